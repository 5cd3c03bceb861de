"""`python -m refimpl ...`: the command line (refimpl/tools/cli.py).

Under an MPI launcher, each rank runs as the child of a small keeper process that names the rank
if a signal kills it (refimpl/tools/runtime/keeper.py); the keeper imports only the standard library.
"""

import sys

from refimpl.tools.runtime import keeper

if keeper.wanted():
    sys.exit(keeper.run_kept(["-m", "refimpl", *sys.argv[1:]]))

from refimpl.tools.cli import main  # noqa: E402 - only the rank itself loads the command line

sys.exit(main())
