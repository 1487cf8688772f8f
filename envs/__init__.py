"""Built-in environments; importing this package registers them in `magrpo.env.ENVS` (and the
reasoning-gym env's feedback mode in `magrpo.feedback.FEEDBACK`)."""
from . import length_ratio, tool_arith  # noqa: F401
from .code import env as code_env  # noqa: F401
from .reasoning import env as reasoning_env  # noqa: F401  (imports reasoning-gym only when env=reasoning_gym)
from .reasoning import feedback as reasoning_feedback  # noqa: F401
