"""ZeRO stage 3: partition the parameters too (P_os+g+p; Rajbhandari et al., arXiv 1910.02054, §5.3).

Each rank keeps only its shard of everything:

    model-state bytes per rank   (P + G + K) Ψ / N              mixed Adam: 16Ψ/N
    communication per step       all-gather in forward + all-gather in backward + reduce-scatter
                                 = 3Ψ(N−1)/N elements per micro-batch (3gΨ(N−1)/N per step)

Parameters are grouped by module: every module that owns parameters (Linear, LayerNorm,
Embedding) is a *unit*, one flat group (flat.py) whose parameters are gathered together.

    forward pre-hook    all-gather the unit's whole parameters (or wait for a prefetch), then
                        start prefetching the units that come next
    forward hook        free them (each parameter's data becomes a placeholder)
    backward pre-hook   all-gather them again: the engine reads a saved parameter's data at
                        backward time (autograd/function.py), so the backward sees whole weights
    last gradient in    free them; reduce-scatter the unit's gradient bucket into this rank's
                        gradient shard (as stage2.py, with one bucket per unit)

so at any moment a rank holds whole parameters of the unit being computed plus those prefetched:
the ledger's "gathered_parameters" stays at or below the largest unit plus --prefetch bytes.

Prefetch. The first micro-batch records the order in which units run, in forward and in
backward (DeepSpeed traces it the same way). From then on, after gathering a unit, the trainer
starts non-blocking all-gathers for the following units of the trace while their bytes fit in
--prefetch (0: gather on demand). Every rank follows the same trace, so the collectives match.

Small parameters. A parameter with fewer than --param-threshold elements is kept whole on every
rank (DeepSpeed's stage3_param_persistence_threshold, 100,000 there; 0 here: all partitioned);
it travels like ZeRO-2's parameters, costing PΨ_p in full and (g + 1)Ψ_p(N−1)/N per step; the
ledger counts it under "parameters".

The placeholder of a freed parameter is a read-only broadcast of NaN with the parameter's shape
(no memory), so shapes still answer and a read that should not happen shows up as NaN.

What DeepSpeed does differently: zero.Init builds the model already partitioned (refimpl builds it
whole, then shards it); it keeps the last modules of forward gathered for backward, coalesces
gathers into buckets, and overlaps communication on a separate CUDA stream.

Legend: L a module's padded length, N ranks, L/N one rank's shard of it.
"""

from __future__ import annotations

from refimpl import backend

from .flat import FlatGroup, bucket_groups, module_units
from .sharding import ZeroSharding


class _Unit:
    """One module's sharded parameters: its flat group, its shard, its gathered buffer if any."""

    def __init__(self, name: str, module, group: FlatGroup) -> None:
        self.name, self.module, self.group = name, module, group
        self.shard = None  # (L/N,) this rank's parameters, persistent
        self.whole = None  # (L,) gathered parameters, or None when freed
        self.request = None  # the all-gather in flight (a prefetch), or None


def placeholder(param):
    """A freed parameter's data: NaN broadcast to its shape, holding no memory."""
    xp = backend.xp()
    return xp.broadcast_to(xp.asarray(float("nan"), dtype=param.dtype), param.shape)


class ZeroStage3(ZeroSharding):
    """Shards of parameters, gradients and optimizer state; whole parameters only while needed."""

    stage = 3
    sharded = True
    reduce_every_micro_batch = True

    def __init__(self, model, parts: dict, optimizer, comm, prefetch_bytes: int = 0, param_threshold: int = 0,
                 **options) -> None:
        if prefetch_bytes < 0:
            raise ValueError(f"--prefetch must be >= 0 bytes, got {prefetch_bytes}")
        whole_model = len(parts) == 1 and getattr(next(iter(parts.values())), "model", None) is model
        if prefetch_bytes and not whole_model:
            raise ValueError("--prefetch follows the order of one micro-batch's modules; in a pipeline a rank runs "
                             "its stages' micro-batches interleaved: use --prefetch 0 with --pp")
        if getattr(getattr(model, "config", None), "tie_weights", False):
            raise ValueError("ZeRO-3 gathers a module's parameters around its own calls; a tied embedding is also "
                             "used by the head, outside them (DeepSpeed registers it as an external parameter); "
                             "use tie_weights=False or ZeRO-2")
        self.prefetch_bytes, self.param_threshold = prefetch_bytes, param_threshold
        self.units: list[_Unit] = []
        self._order: dict[str, list] = {}  # "forward"/"backward" -> units in the order they ran
        self._tracing: dict[str, list] | None = None
        self._in_use: set[int] = set()  # indices of units between use and release
        super().__init__(model, parts, optimizer, comm, **options)
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda module, args, u=unit: self._use(u, "forward"))
            unit.module.register_forward_hook(lambda module, args, output, u=unit: self._release(u))
            unit.module.register_full_backward_pre_hook(lambda module, grad, u=unit: self._use(u, "backward"))
        if whole_model:  # a pipeline stage is no module: the checks below need the model's own forward
            model.register_forward_hook(lambda module, args, output: self._check_first_forward(output))

    # -- layout -----------------------------------------------------------------------------------
    def _make_groups(self, named: list, first_index: int) -> list:
        """One pipeline stage's units (the modules that own its parameters), then its persistent groups."""
        units, persistent = module_units(self.model, self.param_threshold, only={id(p) for _, p in named})
        groups = []
        for name, module, params in units:
            group = FlatGroup(first_index + len(groups), params, self.world_size, self.rank)
            self.units.append(_Unit(name, module, group))
            groups.append(group)
        self.unit_of = {unit.group.index: unit for unit in self.units}
        if persistent:  # kept whole: flat buckets, as stage 2
            groups += bucket_groups(persistent, self.bucket_bytes, self.world_size, self.rank, first_index + len(groups))
        return groups

    def _hold_parameters(self) -> list:
        """A unit keeps its shard (L/N,) and frees the whole; a persistent group stays whole, as in stage 2."""
        for unit in self.units:
            group = unit.group
            whole = group.flatten([p.data for p in group.params])  # (L,) once, to cut the shard
            unit.shard = self.ledger.register("parameters", whole[group.start:group.stop].copy(), "parameter shard")
            for p in group.params:
                p.data = placeholder(p)
        persistent = [group for group in self.groups if group.index not in self.unit_of]
        flats, blocks = self._whole_parameter_buffers(persistent, "whole small parameters")  # (L,), (L/N,)
        self.param_flats = [None] * len(self.groups)  # whole buffers of the persistent groups only
        by_group = {unit.group.index: unit.shard for unit in self.units}  # updated in place by the optimizer
        for group, flat, block in zip(persistent, flats, blocks):
            self.param_flats[group.index], by_group[group.index] = flat, block
        return [by_group[group.index] for group in self.groups]

    def _hold_gradients(self) -> None:
        self._hold_gradient_shards()  # (L/N,) each, persistent; buckets (L,) only while reduced

    def _before_accumulate(self, param, grad):
        self._open_bucket(self._group_of[id(param)])  # the group's first gradient: allocate its bucket
        return None

    def _needs_reduction(self, group) -> bool:
        return self.grad_buckets[group.index] is not None  # no gradient arrived: nothing to add

    # -- gather and release -------------------------------------------------------------------------
    def _gather(self, unit: _Unit, blocking: bool) -> None:
        group = unit.group
        unit.whole = self.ledger.register("gathered_parameters", group.empty(), f"module {unit.name or 'root'}")  # (L,)
        if blocking:
            self.comm.allgather(unit.shard, unit.whole)
            self._attach(unit)
        else:
            unit.request = self.comm.iallgather(unit.shard, unit.whole)

    def _attach(self, unit: _Unit) -> None:
        for p, view in zip(unit.group.params, unit.group.views(unit.whole)):
            p.data = view

    def _use(self, unit: _Unit, phase: str) -> None:
        """A unit is about to run (forward or backward): make its parameters whole."""
        if self._tracing is not None:
            trace = self._tracing.setdefault(phase, [])
            if unit not in trace:
                trace.append(unit)
        if unit.whole is None:
            self._gather(unit, blocking=True)
        elif unit.request is not None:  # prefetched: wait for it
            unit.request.wait()
            unit.request = None
            self._attach(unit)
        self._in_use.add(unit.group.index)
        self._prefetch(unit, phase)
        self._poll()

    def _prefetch(self, unit: _Unit, phase: str) -> None:
        order = self._order.get(phase)
        if not order or self.prefetch_bytes <= 0 or unit not in order:
            return
        ahead = sum(u.group.nbytes for u in self.units if u.whole is not None and u.group.index not in self._in_use)
        for following in order[order.index(unit) + 1:]:
            if following.whole is not None:
                continue  # already gathered or on its way (counted in `ahead`)
            if ahead + following.group.nbytes > self.prefetch_bytes:
                break
            self._gather(following, blocking=False)
            ahead += following.group.nbytes

    def _release(self, unit: _Unit) -> None:
        """Free the unit's whole parameters (after its forward, or once its gradients are in)."""
        if unit.whole is None:
            return
        if unit.request is not None:
            unit.request.wait()
            unit.request = None
        for p in unit.group.params:
            p.data = placeholder(p)
        self.ledger.release(unit.whole)
        unit.whole = None
        self._in_use.discard(unit.group.index)

    def _poll(self) -> None:
        super()._poll()
        for unit in self.units:
            if unit.request is not None:
                unit.request.test()

    def _check_first_forward(self, output) -> None:
        """After the first forward: a parameter used outside its module's call read a NaN placeholder."""
        if self._tracing is None or "forward" not in self._tracing:
            return
        missing = [u.name for u in self.units if u not in self._tracing["forward"]]
        if missing:
            raise ValueError(f"ZeRO-3: the parameters of {', '.join(missing)} were never gathered: the model uses "
                             "them outside a call of their module, which ZeRO-3 cannot see")
        data = getattr(output, "data", None)
        if data is not None and not bool(backend.xp().isfinite(data).all()):
            raise ValueError("ZeRO-3: the first forward produced NaN or inf: a parameter was read while freed "
                             "(used outside a call of its module?)")

    # -- action boundaries and gradients -------------------------------------------------------------
    def _begin_action(self, action) -> None:
        if not self._order and self._tracing is None and action.kind == "F" and action.mb == 0:
            self._tracing = {}  # the first micro-batch's order of units (for prefetch)

    def _end_action(self, action) -> None:
        for unit in self.units:  # anything prefetched but not used, or not released (between I and W)
            self._release(unit)
        if self._tracing is not None and action.kind in ("B", "W") and action.mb == 0:
            self._order, self._tracing = self._tracing, None

    def _start_reduction(self, group):
        """Two things happen when a unit's last gradient is in: its backward is over, so its
        gathered parameters are freed (the "free after use" of backward); then, as in stage 2,
        its gradient bucket is reduce-scattered."""
        unit = self.unit_of.get(group.index)
        if unit is not None:
            self._release(unit)
        return self._reduce_scatter_bucket(group)

    def _reduction_done(self, group) -> None:
        self._add_bucket_into_shard(group)

    def _gradient_blocks(self) -> list:
        return self.grad_shards

    def _clear_gradients(self) -> None:
        for shard in self.grad_shards:
            shard[...] = 0

    # -- publishing and records ---------------------------------------------------------------------------
    def _publish(self) -> None:
        self._all_gather_parameters([flat for flat in self.param_flats if flat is not None])  # persistent groups

    def _whole_parameters(self, group):
        unit = self.unit_of.get(group.index)
        if unit is None:
            return self.param_flats[group.index]
        whole = group.empty()  # (L,) a copy for inspection (verify, checkpoints), not kept
        self.comm.allgather(unit.shard, whole)
        return whole

    def report(self) -> dict:
        return {**super().report(), "units": len(self.units), "prefetch_bytes": self.prefetch_bytes,
                "param_threshold": self.param_threshold,
                "largest_unit_bytes": max((u.group.nbytes for u in self.units), default=0)}
