"""`python -m refimpl ...` (and the `refimpl` command): the command line (refimpl/tools/cli.py).

Under an MPI launcher, each rank runs as the child of a small keeper process that names the rank
if a signal kills it (refimpl/tools/runtime/keeper.py); the keeper imports only the standard library.
"""

import sys

from refimpl.tools.runtime import keeper


def main() -> int:
    if keeper.wanted():
        return keeper.run_kept(["-m", "refimpl", *sys.argv[1:]])
    from refimpl.tools.cli import main as run_command  # noqa: PLC0415 - only the rank itself loads the command line

    return run_command()


if __name__ == "__main__":
    sys.exit(main())
