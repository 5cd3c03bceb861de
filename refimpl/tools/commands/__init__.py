"""The command-line commands of `python -m refimpl` (refimpl/tools/cli.py dispatches to them).

    train.py        `python -m refimpl train ...`: the flags of a run, its summary
                    (the loop, the builders, LocalTrainer: refimpl/tools/run.py)
    verify.py       `python -m refimpl verify ...`: one configuration or a --sweep against
                    single-process training (the comparison: refimpl/tools/verification.py; the configurations
                    a sweep draws: refimpl/tools/sweep.py)
    schedule.py     `python -m refimpl schedule ...`: generate, validate, simulate and draw a
                    pipeline schedule (refimpl/parallel/pipeline/)
    memory.py       `python -m refimpl memory ...`: ZeRO memory per rank, the paper's formula
                    beside the measured ledger (refimpl/memory.py)
    consolidate.py  `python -m refimpl consolidate ...`: a sharded checkpoint as one state dict
                    (refimpl/tools/saved_runs/)

Each module provides `add_arguments(parser)` and `run(args) -> int` (and may provide `check(args)`,
the startup checks every rank makes); it parses, prints and writes files, and leaves the computing
to the library modules and algorithm packages, which hold no argparse.
"""
