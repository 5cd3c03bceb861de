"""Saved runs: a training run written to disk by every rank and read back at any world size.

    sharded.py      sharded checkpoints: each rank writes its shard of the parameters and optimizer
                    state, rank 0 a manifest; `train --resume` reads them back at any world size,
                    ZeRO stage or pipeline mesh, and `consolidate` merges them into one state dict
    fingerprint.py  which run a checkpoint belongs to: the flags that define what it computes
    safe_files.py   files that a crash, a second writer or a planted link cannot damage

Every trainer saves through this package: LocalTrainer, and the one distributed Trainer whatever
its gradient strategy (DDP, ZeRO 0-3) and pipeline (parallel/trainer.py), through the trainer
protocol's `checkpoint_pieces()` and `load_full_state()` (refimpl/protocols.py). Nothing
here is specific to ZeRO, so it does not live in parallel/zero/.

Why "saved runs" and not "checkpoints": refimpl/checkpointing/ is *activation* checkpointing,
which drops activations in forward and recomputes them in backward; it writes nothing to disk,
and its schedules already speak of snapshots (revolve's Snapshot(i)). The files, flags and messages
keep the usual word -- a sharded checkpoint, `--overwrite-checkpoints`, `checkpoint: DIR/step_N`
-- while the package's name says what it holds: the saved state of a run, to resume or to keep.

The command line (`train --save-dir/--resume`, `consolidate`) is in refimpl/tools/commands/; this
package holds no argparse.
"""
