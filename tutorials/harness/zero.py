"""Checks for tutorial 05 (ZeRO 1-2-3): the memory formula, the shards of a flat buffer, and the
sharded optimizer step."""

from __future__ import annotations

import numpy as np

from refimpl import memory
from refimpl.autograd import Parameter
from refimpl.optim import AdamW
from refimpl.parallel.zero.flat import FlatGroup

from . import Wrong, shown, plain


def check_model_state_bytes(model_state_bytes) -> None:
    """Check: model-state bytes per rank."""
    for p, g, k in [(2, 2, 12), (4, 4, 8)]:
        for stage in range(4):
            for psi, n in [(7_500_000_000, 64), (1024, 4), (96, 1), (120, 8)]:
                expected = memory.model_state_bytes(stage, psi, n, p, g, k)
                got = model_state_bytes(stage, psi, n, p, g, k)
                if got is None or abs(got - expected) > 1e-6 * max(1, expected):
                    name = memory.STAGE_NAMES[stage]
                    raise Wrong(f"{name} with Ψ={psi:,}, N={n}, P={p}, G={g}, K={k} holds {expected:,} bytes per rank "
                                f"({memory.STAGE_FORMULAS[stage]}); you said {plain(got)}")


def check_shard_bounds(shard_bounds) -> None:
    """Check: a rank's shard of a padded flat buffer."""
    for sizes in [(6,), (3, 4), (5, 1, 7), (1,)]:
        for n in (1, 2, 3, 4, 8):
            params = [("p%d" % i, Parameter(np.zeros(s))) for i, s in enumerate(sizes)]
            for rank in range(n):
                group = FlatGroup(0, params, shards=n, rank=rank)
                expected = (group.length, group.start, group.stop)
                got = tuple(shard_bounds(sum(sizes), n, rank))
                if got != expected:
                    raise Wrong(f"{sum(sizes)} elements over {n} ranks: the buffer is padded to {group.length} and "
                                f"rank {rank} owns [{group.start}, {group.stop}); you said (length, start, stop) = "
                                f"{plain(got)}")


def check_sharded_update(sharded_update) -> None:
    """Check: the sharded optimizer step."""
    rng = np.random.default_rng(6)
    for n, length in [(1, 6), (2, 10), (3, 12), (4, 8)]:
        whole = rng.standard_normal(length)
        reference = AdamW(lr=0.1, weight_decay=0.01)
        ref_state = reference.init_state(whole)
        ours = whole.copy()
        optimizer = AdamW(lr=0.1, weight_decay=0.01)
        block = length // n
        states = [optimizer.init_state(ours[r * block:(r + 1) * block]) for r in range(n)]
        for step in range(3):
            grad = rng.standard_normal(length)
            reference.update(whole, grad, ref_state)
            sharded_update(optimizer, ours, grad, n, states)
            if not np.array_equal(ours, whole):
                at = int(np.argmax(ours != whole))
                raise Wrong(f"{n} ranks, {length} elements, step {step + 1}: element {at} (rank {at // block}'s shard) "
                            f"is {shown(ours[at])} but one AdamW over the whole buffer gives {shown(whole[at])}; "
                            "each rank must update exactly its own block with its own state")
        for r, state in enumerate(states):
            if state["m"].shape != (block,):
                raise Wrong(f"rank {r}'s optimizer state must stay the size of its shard, {block}")
