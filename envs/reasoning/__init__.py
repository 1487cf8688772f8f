"""env=reasoning_gym: the procedural tasks of the reasoning-gym library (issue 48)."""
