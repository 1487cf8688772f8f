"""Built-in external-feedback modes; importing this package registers them in `magrpo.feedback.FEEDBACK`:
plain, level_feedback, level_passed, passed, expert_edits."""
from . import expert_edits, levels, plain  # noqa: F401
