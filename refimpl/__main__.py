import sys

from refimpl.tools.cli import main

sys.exit(main())
