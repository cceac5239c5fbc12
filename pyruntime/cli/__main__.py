"""`python -m pyruntime.cli`: the `pyruntime` command."""
import sys

from pyruntime.cli.commands import main

sys.exit(main())
