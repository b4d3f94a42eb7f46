"""CLI subcommands; shared helpers for them live in `layerscope.commands.common`."""
