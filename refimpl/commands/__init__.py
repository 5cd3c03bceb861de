"""The command-line commands of `python -m refimpl` (refimpl/cli.py dispatches to them).

    schedule.py    `python -m refimpl schedule ...`: generate, validate, simulate and draw a
                   pipeline schedule (refimpl/parallel/pipeline/)
    memory.py      `python -m refimpl memory ...`: ZeRO memory per rank, the paper's formula
                   beside the measured ledger (refimpl/memory.py)

Each module provides `add_arguments(parser)` and `run(args) -> int`; it parses, prints and
writes files, and leaves the computing to the algorithm packages, which hold no argparse and
print nothing. (`train`, `verify` and `consolidate` still live in refimpl/train.py,
refimpl/verify.py and refimpl/parallel/zero/checkpoint.py.)
"""
