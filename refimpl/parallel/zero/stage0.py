"""Data parallelism inside the ZeRO framework: the paper's baseline (arXiv 1910.02054, §3).

Every rank holds everything -- parameters, gradients, master weights, optimizer states -- whole:

    model-state bytes per rank   (P + G + K) Ψ                  (16Ψ for mixed-precision Adam)
    communication per step       all-reduce of the gradients: 2Ψ(N−1)/N elements

Parameters and gradients live in flat buckets of about --bucket-bytes (flat.py, one shard: no
padding); each parameter's data and grad are views into them. Backward accumulates into the
gradient buckets; on the last micro-batch a bucket's all-reduce starts as soon as its last
gradient is in (overlapping the rest of backward), and every rank then takes the same optimizer
step on the same whole arrays.

refimpl runs float32/float64 `--zero 0` with parallel/data_parallel.py (DDP's strategy); this
class is what `--zero 0 --dtype mixed` runs, since mixed precision needs the master weights and
loss scaling that ZeRO's sharded optimizer provides. Stage 1 (stage1.py) shards the optimizer state.

Legend: L a bucket's length (one shard: no padding).
"""

from __future__ import annotations

from .flat import bucket_groups
from .sharding import ZeroSharding


class ZeroStage0(ZeroSharding):
    """Whole parameters, whole gradients (all-reduced), whole optimizer state on every rank."""

    stage = 0

    def _make_groups(self, named: list, first_index: int) -> list:
        return bucket_groups(named, self.bucket_bytes, 1, 0, first_index)  # DP: whole buffers, nothing to shard

    def _hold_parameters(self) -> list:
        self.param_flats, blocks = self._whole_parameter_buffers(self.groups)  # (L,) each; one block: all of it
        return blocks

    def _hold_gradients(self) -> None:
        self.grad_flats = self._whole_gradient_buffers()  # (L,) each

    def _needs_reduction(self, group) -> bool:
        return True  # whole gradients: every bucket is reduced after the last backward

    def _start_reduction(self, group):
        return self.comm.iallreduce(self.grad_flats[group.index])

    def _reduction_done(self, group) -> None:
        pass

    def _gradient_blocks(self) -> list:
        return self.grad_flats

    def _clear_gradients(self) -> None:
        for flat in self.grad_flats:
            flat[...] = 0

    def _publish(self) -> None:
        pass  # every rank took the same step on the same whole arrays

    def _whole_parameters(self, group):
        return self.param_flats[group.index]
