"""Built-in environments; importing this package registers them in `magrpo.env.ENVS`."""
from . import length_ratio, tool_arith  # noqa: F401
from .code import env as code_env  # noqa: F401
