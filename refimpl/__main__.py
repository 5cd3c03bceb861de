"""`python -m refimpl ...`: the command line (refimpl/tools/cli.py)."""

import sys

from refimpl.tools.cli import main

sys.exit(main())
