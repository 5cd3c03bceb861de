"""Checks for tutorial 04 (data parallelism): the batch split, the loss each rank differentiates,
and the gradient buckets."""

from __future__ import annotations

import numpy as np

from refimpl.autograd import Tensor
from refimpl.data import IGNORE, SortTask
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F
from refimpl.objective import count_targets, split_batch
from refimpl.parallel.data_parallel import assign_buckets as library_assign_buckets

from . import Wrong, expect_close, in_student_process, plain, plain_array, shown


def check_rank_micro_batches(rank_micro_batches) -> None:
    """Check: a rank's micro-batches."""
    x = np.arange(24).reshape(12, 2)  # row i is [2i, 2i + 1]: easy to recognise
    y = np.arange(12)
    for world_size, grad_accum in [(1, 1), (2, 3), (3, 2), (4, 1), (2, 2)]:
        for rank in range(world_size):
            local = split_batch(x, y, world_size, "ranks")[rank]
            expected = split_batch(*local, grad_accum, "micro-batches")
            got = list(rank_micro_batches(x, y, world_size, rank, grad_accum))
            if len(got) != len(expected):
                raise Wrong(f"{world_size} ranks, grad_accum {grad_accum}: rank {rank} runs {grad_accum} "
                            f"micro-batches, you returned {len(got)}")
            for i, ((gx, gy), (ex, ey)) in enumerate(zip(got, expected)):
                if not (np.array_equal(gx, ex) and np.array_equal(gy, ey)):
                    raise Wrong(f"{world_size} ranks, grad_accum {grad_accum}: rank {rank}'s micro-batch {i} "
                                f"should hold rows {list(ey)} of the global batch; yours holds {list(np.ravel(gy))}")


def evaluate_local_loss(local_loss, config: dict, weights: dict, shards: list, total: int) -> dict:
    """Runs where the student's code lives (harness.in_student_process): a GPT of `config` holding
    `weights`, each rank's `local_loss(model, x_r, y_r, total)` and its backward, the gradients
    accumulating over the ranks as the all-reduce sums them. Returns plain data: {"losses": each
    rank's loss value, "grads": {name: the summed gradient}}, or {"returned": what a rank returned
    instead of a scalar Tensor}."""
    model = GPT(GPTConfig(**config), seed=0)
    for name, p in model.named_parameters():
        p.data[...] = weights[name]
    losses = []
    for xs, ys in shards:
        loss = local_loss(model, xs, ys, total)
        if not isinstance(loss, Tensor) or loss.size != 1:
            return {"returned": shown(loss)[:200]}
        loss.backward()  # gradients accumulate: the sum over ranks, as the all-reduce computes
        losses.append(float(loss.item()))
    return {"losses": losses, "grads": {name: None if p.grad is None else np.array(p.grad, dtype=np.float64)
                                        for name, p in model.named_parameters()}}


def check_local_loss(local_loss) -> None:
    """Check: the loss each rank differentiates."""
    task = SortTask(length=3, seed=1)
    x, y = task.batch(0, 6)
    y[:2, 4:] = IGNORE  # ranks get different numbers of counted targets
    y[5, 5] = IGNORE
    config = {"vocab_size": task.vocab_size, "seq_len": task.seq_len, "n_layer": 1, "n_head": 2, "d_model": 8,
              "dtype": "float64"}
    model = GPT(GPTConfig(**config), seed=3)
    whole_loss = F.cross_entropy(model(x), y)
    whole_loss.backward()  # the whole batch in one process: the reference
    reference = {name: p.grad.copy() for name, p in model.named_parameters()}
    weights = {name: p.data.copy() for name, p in model.named_parameters()}
    total = count_targets(y)
    for world_size in (2, 3):
        shards = [(xs.copy(), ys.copy()) for xs, ys in split_batch(x, y, world_size, "ranks")]
        got = in_student_process(evaluate_local_loss, local_loss, config, {n: w.copy() for n, w in weights.items()},
                                 shards, total)
        if not isinstance(got, dict) or not ("returned" in got or {"losses", "grads"} <= got.keys()):
            raise Wrong(f"the evaluation of local_loss returned {type(got).__name__}, not its losses and gradients")
        if "returned" in got:
            raise Wrong(f"return the scalar loss Tensor that this rank calls backward() on; got {got['returned']}")
        grads = got["grads"] if isinstance(got["grads"], dict) else {}
        for name in reference:
            if grads.get(name) is None:
                raise Wrong(f"with {world_size} ranks, {name} got no gradient: is the loss computed from the model's "
                            f"output?")
            try:
                expect_close(plain_array(grads[name], name), reference[name],
                             f"the sum over {world_size} ranks of the gradient of {name}")
            except Wrong as exc:
                raise Wrong(f"{exc}. The ranks hold different numbers of counted targets, so each must divide by "
                            f"the global batch's count ({total}), not by its own") from None
        losses = got["losses"]
        if not (isinstance(losses, list) and len(losses) == world_size
                and all(isinstance(v, float) for v in losses)):
            raise Wrong(f"with {world_size} ranks: expected {world_size} loss values, got {shown(losses)[:200]}")
        expect_close(sum(losses), whole_loss.item(), "the sum of the ranks' losses")


def check_assign_buckets(assign_buckets) -> None:
    """Check: gradient buckets."""
    model = GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=2, n_head=2, d_model=16))
    sizes = [p.data.nbytes for p in model.parameters()]
    # Sizes that some buckets fill exactly (the last two parameters; the whole model): a bucket may
    # hold exactly bucket_bytes, and only a parameter that would take it *past* starts a new one.
    exact = [sizes[-1] + sizes[-2], sum(sizes)]
    for bucket_bytes in (1, 1000, 4096, 10_000, 1 << 20, *exact):
        expected = library_assign_buckets(sizes, bucket_bytes)  # the rule DDP's buckets (and ZeRO's groups) use
        got = [list(g) for g in assign_buckets(list(sizes), bucket_bytes)]
        if got != expected:
            first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            raise Wrong(f"with bucket_bytes={bucket_bytes} and the parameter sizes of a 2-layer GPT there are "
                        f"{len(expected)} buckets and bucket {first} is "
                        f"{expected[first] if first < len(expected) else 'absent'}; you made {len(got)} buckets, "
                        f"and bucket {first} is {plain(got[first]) if first < len(got) else 'absent'}"
                        + (" (a bucket may hold exactly bucket_bytes)" if bucket_bytes in exact else ""))


def _ring_bytes(lengths, world_size, rank, itemsize) -> int:
    from refimpl.parallel import ring  # noqa: PLC0415

    return sum(ring.bytes_sent("allreduce", n, world_size, rank, itemsize) for n in lengths)


def check_bucketed_bytes(bucketed_bytes) -> None:
    """Check: the bytes a rank's bucketed all-reduces send in one step."""
    for n_layer, d_model, itemsize in [(2, 16, 8), (1, 16, 4), (2, 12, 8)]:
        model = GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=n_layer, n_head=2, d_model=d_model))
        numels = [p.data.size for p in model.parameters()]
        nbytes = [n * itemsize for n in numels]
        for bucket_bytes in (1, 1000, 4096, 10_000, 1 << 20):
            buckets = library_assign_buckets(nbytes, bucket_bytes)
            lengths = [sum(numels[i] for i in b) for b in buckets]
            for world_size in (1, 2, 3, 4):
                for rank in range(world_size):
                    expected = _ring_bytes(lengths, world_size, rank, itemsize)
                    got = bucketed_bytes(list(numels), itemsize, world_size, rank, bucket_bytes)
                    if got == expected:
                        continue
                    where = (f"a {n_layer}-layer GPT of width {d_model} ({sum(numels)} parameters, {itemsize}-byte "
                             f"gradients), bucket_bytes={bucket_bytes}, {world_size} ranks: rank {rank}")
                    message = f"{where} sends {expected} bytes in its {len(buckets)} all-reduces; you said {plain(got)}"
                    forward = library_assign_buckets(nbytes[::-1], bucket_bytes)  # buckets cut in the model's order
                    forward_lengths = [sum(numels[len(numels) - 1 - i] for i in b) for b in forward]
                    if got == _ring_bytes([sum(numels)], world_size, rank, itemsize):
                        message += (". That is one all-reduce of all the gradients; each bucket is its own "
                                    "all-reduce, cut into its own N blocks")
                    elif world_size > 1 and got in (2 * (world_size - 1) * sum(numels) * itemsize // world_size,
                                                    2 * (world_size - 1) * sum(lengths) * itemsize / world_size):
                        message += (". That is 2(N − 1)/N · Ψ, the average over ranks; a bucket whose length N does "
                                    "not divide has unequal blocks, and rank r skips blocks r and r + 1 of each")
                    elif got == _ring_bytes(forward_lengths, world_size, rank, itemsize):
                        message += (". Those are the buckets cut in the model's order; backward fills them from the "
                                    "last parameter to the first (exercise 3)")
                    raise Wrong(message)
