"""Checks for tutorial 05 (ZeRO 1-2-3): the memory formula, the shards of a flat buffer, and the
sharded optimizer step."""

from __future__ import annotations

import numpy as np

from refimpl import memory
from refimpl.autograd import Parameter
from refimpl.optim import AdamW
from refimpl.parallel.zero.flat import FlatGroup

from . import Wrong, plain, shown


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
            params = [(f"p{i}", Parameter(np.zeros(s))) for i, s in enumerate(sizes)]
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


def check_zero3_bytes(zero3_bytes) -> None:
    """Check: ZeRO-3's bytes per rank when N does not divide the buffers."""
    from refimpl.nn import GPT, GPTConfig
    from refimpl.parallel.zero.flat import module_units, padded_length

    def sizes_of(**config):
        units, _ = module_units(GPT(GPTConfig(**config), seed=0))
        return [sum(p.size for _, p in params) for _, _, params in units]

    models = [("a 2-layer GPT", sizes_of(vocab_size=11, seq_len=16, n_layer=2, n_head=4, d_model=32)),
              ("a 1-layer GPT", sizes_of(vocab_size=7, seq_len=5, n_layer=1, n_head=1, d_model=3)),
              ("modules of 5, 1 and 7 parameters", [5, 1, 7])]
    for what, sizes in models:
        psi = sum(sizes)
        for p, g, k in [(4, 4, 8), (2, 2, 12)]:
            for n in (1, 2, 3, 4, 5, 7, 8, 64):
                # What refimpl allocates: one FlatGroup per module, each rank holding its block of L/N.
                blocks = [FlatGroup(0, [("w", Parameter(np.zeros(size)))], shards=n, rank=n - 1).block
                          for size in sizes]
                expected = (p + g + k) * sum(blocks)
                got = zero3_bytes(list(sizes), n, p, g, k)
                if got is not None and not isinstance(got, (list, tuple, dict, str)) and abs(got - expected) < 1e-9:
                    continue
                padded = n * sum(blocks)
                head = (f"{what} (Ψ = {psi:,} in {len(sizes)} modules), N={n}, P={p}, G={g}, K={k}: every rank "
                        f"holds {expected:,} bytes, (P+G+K)·Ψ′/N with the padded Ψ′ = {padded:,}; "
                        f"you said {plain(got)}")
                reasons = []
                if got == (p + g + k) * psi / n:
                    reasons.append("That is the formula at Ψ: each module's buffer is padded to a multiple of N, "
                                   "and a rank holds the padding of its block too")
                if got == (p + g + k) * padded_length(psi, n) // n:
                    reasons.append("That pads the model as one buffer; ZeRO-3 has one flat buffer per module "
                                   "(its gather unit), each padded on its own")
                if reasons:
                    raise Wrong(head + ". " + ". ".join(reasons))
                if got == (p + g + k) * sum(size // n for size in sizes):
                    raise Wrong(head + ". That rounds each module's share down; the padding rounds it up")
                raise Wrong(head)
