"""The `pyruntime` command: its subcommands (commands.py) and `pyruntime top`."""

from pyruntime.cli.commands import main as main
