import sys

from pyruntime.cli import main

sys.exit(main())
