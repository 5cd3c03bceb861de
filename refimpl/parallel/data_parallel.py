"""Data parallelism (DDP): every rank holds the whole model and trains on its slice of the batch.

With N ranks, a global batch of B examples is cut into N slices of B/N; each rank runs forward and
backward on its slice (in g micro-batches of B/(N·g) if --grad-accum g), then the ranks sum their
gradients, so every rank holds ∇L of the whole batch (see objective.py: the loss is normalised by
the global batch's target count, so the sum across ranks is the exact gradient; nothing is
averaged). Every rank then takes the same optimizer step on the same replicated weights.

Two versions, side by side:

  naive     after the last micro-batch's backward, one blocking all-reduce per parameter.
  bucketed  gradients live in flat buckets of about `bucket_bytes`, laid out in the order backward
            produces them (the reverse of the model's parameter order). A parameter's gradient is a
            view into its bucket, so backward accumulates straight into it. When the last gradient
            of a bucket is ready (a post-accumulate-grad hook) on the last micro-batch, the bucket's
            non-blocking all-reduce starts, and runs while backward computes earlier layers. MPI
            advances a non-blocking collective only inside MPI calls, so every hook also polls
            (test()) the buckets in flight; the optimizer waits for all of them.

Communication per step per rank, ring counting (comm.py): 2Ψ(N−1)/N elements for Ψ parameters,
for both versions (buckets change the number of calls, not the volume); gradient accumulation
communicates only once, on the last micro-batch.

What production DDP (PyTorch) does differently: it learns the bucket order from the first
iteration's actual gradient order, lets the all-reduces run on a separate thread (no polling), and
averages instead of summing (its loss is a per-rank mean).
"""

from __future__ import annotations

from refimpl import backend
from refimpl.objective import count_targets, micro_batch_loss, split_batch
from refimpl.optim import clip_grad_norm_

MODES = ("bucketed", "naive")


class DataParallelTrainer:
    """A trainer (same interface as train.LocalTrainer) that runs data-parallel over `comm`."""

    def __init__(self, model, optimizer, comm, grad_accum: int = 1, clip: float = 0.0,
                 mode: str = "bucketed", bucket_bytes: int = 1 << 20) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown data-parallel mode {mode!r}; choose one of {', '.join(MODES)}")
        if bucket_bytes <= 0:
            raise ValueError(f"--bucket-bytes must be positive, got {bucket_bytes}")
        self.model, self.optimizer, self.comm = model, optimizer, comm
        self.grad_accum, self.clip, self.mode = grad_accum, clip, mode
        self.world_size, self.rank = comm.size, comm.rank
        self.record_grads = False
        self.last_grads: dict = {}
        self.steps_done = 0  # the global batch's number, for split-independent dropout masks
        self.buckets = _Buckets(model.parameters(), comm, bucket_bytes) if mode == "bucketed" else None

    def step(self, x, y) -> float:
        """One optimizer step on the global batch (x, y); returns the global batch's loss."""
        total = count_targets(y)  # of the whole global batch: every rank builds the same batch
        x_local, y_local = split_batch(x, y, self.world_size, "data-parallel ranks")[self.rank]
        micro = split_batch(x_local, y_local, self.grad_accum, "micro-batches per rank (--grad-accum)")
        loss_value = 0.0
        first_row = self.rank * len(x_local)  # this rank's rows of the global batch
        for i, (xm, ym) in enumerate(micro):
            if self.buckets is not None:
                self.buckets.sync = i == len(micro) - 1  # communicate on the last micro-batch only
            loss = micro_batch_loss(self.model, xm, ym, total, rows=(first_row + i * len(xm), len(x), self.steps_done))
            loss.backward()
            loss_value += float(loss.item())
        if self.buckets is not None:
            self.buckets.finish()
        else:
            for p in self.model.parameters():
                if p.grad is None:
                    p.grad = backend.xp().zeros_like(p.data)
                self.comm.allreduce(p.grad)
        if self.clip > 0:
            clip_grad_norm_(self.model.parameters(), self.clip)  # gradients are whole and identical
        if self.record_grads:
            self.last_grads = {name: backend.to_host(p.grad).copy() for name, p in self.model.named_parameters()}
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps_done += 1
        return self.comm.allreduce_value(loss_value)

    def full_parameters(self) -> dict:
        return self.model.state_dict()  # replicated: every rank holds the whole model

    def report(self) -> dict:
        return {"dp_mode": self.mode, "buckets": None if self.buckets is None else len(self.buckets.groups)}


def assign_buckets(param_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices in buckets of at most bucket_bytes, in the order backward produces the
    gradients (last parameter first); a parameter larger than bucket_bytes gets a bucket of its own.
    ZeRO's flat groups use the same rule (zero/flat.py)."""
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(param_bytes))):
        if not buckets or size + param_bytes[i] > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += param_bytes[i]
    return buckets


class _Buckets:
    """Flat gradient buckets whose all-reduce starts as soon as their last gradient is accumulated."""

    def __init__(self, params, comm, bucket_bytes: int) -> None:
        xp = backend.xp()
        self.comm = comm
        self.sync = True
        params = list(params)
        self.groups = [[params[i] for i in bucket]  # parameters of each bucket, in backward order
                       for bucket in assign_buckets([p.data.nbytes for p in params], bucket_bytes)]
        self.flats = []
        self.bucket_of: dict[int, int] = {}
        for b, group in enumerate(self.groups):
            flat = xp.zeros(sum(p.size for p in group), dtype=group[0].dtype)  # (n_b,)
            offset = 0
            for p in group:
                view = flat[offset:offset + p.size].reshape(p.shape)
                if p.grad is not None:
                    view[...] = p.grad
                p.grad = view  # backward accumulates straight into the bucket
                offset += p.size
                self.bucket_of[id(p)] = b
                p.register_post_accumulate_grad_hook(self._ready)
            self.flats.append(flat)
        self.pending = [len(g) for g in self.groups]
        self.requests: dict[int, object] = {}

    def _ready(self, param) -> None:
        if not self.sync:
            return
        b = self.bucket_of[id(param)]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.requests[b] = self.comm.iallreduce(self.flats[b])
        for request in self.requests.values():  # MPI progresses only inside MPI calls: poll
            request.test()

    def finish(self) -> None:
        """Start buckets whose gradients never arrived (unused parameters), then wait for all."""
        for b in range(len(self.groups)):
            if b not in self.requests:
                self.requests[b] = self.comm.iallreduce(self.flats[b])
        for b in range(len(self.groups)):
            self.requests[b].wait()
        self.requests = {}
        self.pending = [len(g) for g in self.groups]
