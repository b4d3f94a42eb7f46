"""A draft for the serving engines: their folders (engine_export.py), COMMANDS.md (commands_md.py) and check-draft (check.py)."""
