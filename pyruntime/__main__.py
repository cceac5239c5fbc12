import sys

from pyruntime.cli.commands import main

sys.exit(main())
