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

This is a gradient strategy of the one trainer (parallel/trainer.py), which runs the micro-batches
and wraps every action in `around`. In a pipeline a rank holds some stages and "the last
micro-batch" is a stage's last backward of the step; buckets never span two stages.

What production DDP (PyTorch) does differently: it learns the bucket order from the first
iteration's actual gradient order, lets the all-reduces run on a separate thread (no polling), and
averages instead of summing (its loss is a per-rank mean).
"""

from __future__ import annotations

from contextlib import contextmanager

from refimpl import backend
from refimpl.memory import track_replicated
from refimpl.optim import StepResult, scale_to_max_norm_, squared_norm
from refimpl.optim.whole_state import load_whole, whole_pieces

MODES = ("bucketed", "naive")


class DataParallel:
    """DDP as a gradient strategy of the one trainer (parallel/trainer.py): whole model state on
    every rank of `comm`, gradients summed over it.

    parts: the pipeline stages this rank holds ({index: stage}; the whole model without a
    pipeline). make_optimizer(params) builds the optimizer on their parameters. Buckets never span
    two stages: a stage's buckets are complete when its last backward of the step is.
    """

    sharded = False

    def __init__(self, parts: dict, make_optimizer, comm, mode: str = "bucketed", bucket_bytes: int = 1 << 20,
                 clip: float = 0.0, budget: int | None = None, rank: int | None = None, norm_total=None,
                 uncounted=(), ledger=None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown data-parallel mode {mode!r}; choose one of {', '.join(MODES)}")
        if bucket_bytes <= 0:
            raise ValueError(f"--bucket-bytes must be positive, got {bucket_bytes}")
        self.comm, self.mode, self.clip, self.norm_total = comm, mode, clip, norm_total
        self.uncounted = set(uncounted)  # parameters whose norm another rank counts (tensor parallelism)
        self.parts = parts
        self.named = [(name, p) for s in sorted(parts) for name, p in parts[s].named_parameters()]
        self.params = [p for _, p in self.named]
        self.buckets = {s: _Buckets(parts[s].parameters(), comm, bucket_bytes) for s in sorted(parts)} \
            if mode == "bucketed" else {}
        self.optimizer = make_optimizer(self.params)
        self.ledger = track_replicated(self.params, self.optimizer, budget, comm.rank if rank is None else rank, ledger)

    @contextmanager
    def around(self, action, last: bool):
        """Bucketed: all-reduce a stage's buckets during its last backward; naive: after it, one by one."""
        bucketed = action.kind in ("B", "W") and self.mode == "bucketed"
        if bucketed:
            self.buckets[action.stage].sync = last  # communicate on the last micro-batch only
        yield
        if action.kind == "F":
            self.ledger.check_activations()
        if bucketed and last:
            self.buckets[action.stage].finish()
        elif action.kind in ("B", "W") and last:
            for p in self.parts[action.stage].parameters():
                if p.grad is None:
                    p.grad = backend.xp().zeros_like(p.data)
                self.comm.allreduce(p.grad)

    def finish(self) -> list:
        return [p.grad for p in self.params]  # whole and summed: the same on every rank

    def squared_norm(self, grads: list) -> float:
        """‖g‖² of this group's gradients (whole and identical on every rank: no communication)."""
        return squared_norm([g for (name, _), g in zip(self.named, grads) if name not in self.uncounted])

    def optimizer_step(self, grads: list, total: float | None = None):
        """Clip (by `total`, the global squared norm, if the caller has it) and step."""
        norm = None
        if self.clip > 0:
            if total is None:
                total = self.squared_norm(grads)
                if self.norm_total is not None:  # the other pipeline stages and tensor-parallel ranks
                    total = self.norm_total(total)
            norm = total ** 0.5
            scale_to_max_norm_(grads, total, self.clip)
        self.optimizer.step()
        return StepResult(True, grads, norm)

    def end_step(self, result) -> None:
        self.optimizer.zero_grad()

    def gather_by_name(self, grads: list) -> dict:
        return {name: backend.to_host(g).copy() for (name, _), g in zip(self.named, grads)}

    def whole_parameters(self) -> dict:
        return {name: backend.to_host(p.data).copy() for name, p in self.named}

    def report(self) -> dict:
        return {"dp_mode": self.mode,
                "buckets": None if not self.buckets else sum(len(b.groups) for b in self.buckets.values())}

    # -- checkpoints: every rank holds the same whole state, the writer writes it ------------------
    @property
    def steps_taken(self) -> int:
        return int(self.optimizer.state[0]["step"]) if self.optimizer.state else 0

    def checkpoint_pieces(self, stages, writes_whole: bool) -> list:
        if not writes_whole:
            return []
        wanted = {id(p) for s in stages for p in self.parts[s].parameters()}
        kept = [(name, p, state) for (name, p), state in zip(self.named, self.optimizer.state) if id(p) in wanted]
        return whole_pieces([(name, p) for name, p, _ in kept], [p.data for _, p, _ in kept], [s for *_, s in kept])

    def load_full_state(self, masters: dict, states: dict, step: int) -> None:
        load_whole(self.named, [p.data for p in self.params], self.optimizer.state, masters, states, step)


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
        self.sync = False  # the trainer turns it on for a stage's last backward (DataParallel.around)
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
        if self.bucket_of[id(param)] in self.requests:  # its all-reduce may already have read the bucket
            raise RuntimeError("DDP: a gradient was accumulated into a bucket whose all-reduce had already started "
                               "(the bucket's count of pending gradients is wrong)")
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
