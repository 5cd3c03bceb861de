"""ZeRO stage 3: partition the parameters too (P_os+g+p; Rajbhandari et al. 2020, arXiv 1910.02054, §5.3).

Each rank keeps only its shard of everything:

    model-state bytes per rank   (P + G + K) Ψ / N               mixed-precision Adam: 16Ψ/N
    elements sent per step       per micro-batch an all-gather in forward, an all-gather in backward
                                 and a reduce-scatter: 3g Ψ(N−1)/N

Parameters are grouped by module: every module that owns parameters (Linear, LayerNorm, Embedding)
is a *unit*, one flat group (flat.py) whose parameters are gathered together. One step, in the
order it runs (the methods below, top to bottom):

    forward pre-hook    all-gather the unit's whole parameters (or wait for a prefetch), then start
                        prefetching the units that come next
    forward hook        free them (each parameter's data becomes a placeholder)
    backward pre-hook   all-gather them again: the engine reads a saved parameter's data at backward
                        time (autograd/function.py), so the backward sees whole weights
    a unit's gradients  as in stage 2 (stage2.py, with one bucket per unit): its first gradient opens
                        the bucket; its last one frees the gathered parameters (the unit's backward is
                        over), then reduce-scatters the bucket into this rank's gradient shard
    after an action     free whatever is still gathered (a prefetch not used; between I and W)
    the step            each rank updates its parameter shard in place (optimizer.py): nothing to
                        all-gather, the next forward gathers what it needs

so at any moment a rank holds whole parameters of the unit being computed plus those prefetched:
the ledger's "gathered_parameters" stays at or below the largest unit plus --prefetch bytes.

Prefetch. The first micro-batch records the order in which units run, in forward and in backward
(DeepSpeed traces it the same way). From then on, after gathering a unit, the next units of the
trace are all-gathered without blocking while their bytes fit in --prefetch (0: gather on demand).
Every rank follows the same trace, so the collectives match.

Small parameters. A parameter with fewer than --param-threshold elements is kept whole on every rank
(DeepSpeed's stage3_param_persistence_threshold, 100,000 there; 0 here: all partitioned); it travels
like ZeRO-2's parameters, costing PΨ_p in full and (g + 1)Ψ_p(N−1)/N per step; the ledger counts it
under "parameters".

The placeholder of a freed parameter is a read-only broadcast of NaN with the parameter's shape (no
memory), so shapes still answer and a read that should not happen shows up as NaN.

What DeepSpeed does differently: zero.Init builds the model already partitioned (refimpl builds it
whole, then shards it); it keeps the last modules of forward gathered for backward, coalesces
gathers into buckets, and overlaps communication on a separate CUDA stream.

Legend: Ψ parameters (Ψ_p of them kept whole), N ranks, g micro-batches per step (gradient
accumulation); P, G, K bytes per parameter of parameters, gradients and optimizer state; L a unit's
padded length, L/N one rank's shard of it.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

from refimpl import backend

from .buffers import GradientShards, all_gather_blocks, whole_parameter_buffers
from .flat import FlatGroup, bucket_groups, module_units
from .strategy import ZeroStrategy


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


class ZeroStage3(ZeroStrategy):
    """Shards of parameters, gradients and optimizer state; whole parameters only while needed."""

    stage = 3

    def __init__(self, model, parts: dict, optimizer, comm, prefetch_bytes: int = 0, param_threshold: int = 0,
                 bucket_bytes: int = 1 << 20, **common) -> None:
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
        super().__init__(parts, comm, **common)  # the ledger, the loss scaler, the parameters by name
        self.model, self.prefetch_bytes, self.param_threshold = model, prefetch_bytes, param_threshold
        self.units: list[_Unit] = []
        self._lay_out(partial(self._units_then_small_parameters, bucket_bytes))
        self.unit_of = {unit.group.index: unit for unit in self.units}
        self.optimizer = self._sharded_optimizer(optimizer, self._hold_parameters())  # updates the shards in place
        self.gradients = GradientShards(self.groups, self.ledger, comm)  # shards (L/N,); buckets (L,) while reduced
        for p in (p for group in self.groups for p in group.params):
            p.register_hook(partial(self._gradient_arriving, p))
            p.register_post_accumulate_grad_hook(self._gradient_in)
        self._order: dict[str, list] = {}  # "forward"/"backward" -> units in the order they ran
        self._tracing: dict[str, list] | None = None
        self._in_use: set[int] = set()  # indices of units between use and release
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda module, args, u=unit: self._use(u, "forward"))
            unit.module.register_forward_hook(lambda module, args, output, u=unit: self._release(u))
            unit.module.register_full_backward_pre_hook(lambda module, grad, u=unit: self._use(u, "backward"))
        if whole_model:  # a pipeline stage is no module: the checks below need the model's own forward
            model.register_forward_hook(lambda module, args, output: self._check_first_forward(output))

    def _units_then_small_parameters(self, bucket_bytes: int, named: list, first_index: int) -> list:
        """One pipeline stage's groups: its units (the modules that own its parameters), then flat buckets
        of its parameters smaller than --param-threshold, kept whole as in stage 2."""
        units, small = module_units(self.model, self.param_threshold, only={id(p) for _, p in named})
        groups = []
        for name, module, params in units:
            group = FlatGroup(first_index + len(groups), params, self.world_size, self.rank)
            self.units.append(_Unit(name, module, group))
            groups.append(group)
        if small:
            groups += bucket_groups(small, bucket_bytes, self.world_size, self.rank, first_index + len(groups))
        return groups

    def _hold_parameters(self) -> list:
        """A unit keeps its shard (L/N,) and frees the whole; a group of small parameters stays whole,
        as in stage 2. Returns the block (L/N,) of every group that the optimizer updates."""
        for unit in self.units:
            group = unit.group
            whole = group.flatten([p.data for p in group.params])  # (L,) once, to cut the shard
            unit.shard = self.ledger.register("parameters", whole[group.start:group.stop].copy(), "parameter shard")
            for p in group.params:
                p.data = placeholder(p)
        small = [group for group in self.groups if group.index not in self.unit_of]
        flats, small_blocks = whole_parameter_buffers(small, self.ledger, "whole small parameters")  # (L,), (L/N,)
        self.small_flats = {group.index: flat for group, flat in zip(small, flats)}
        blocks = {unit.group.index: unit.shard for unit in self.units}  # updated in place by the optimizer
        blocks.update((group.index, block) for group, block in zip(small, small_blocks))
        return [blocks[group.index] for group in self.groups]

    # -- one step, in the order it runs ---------------------------------------------------------------
    @contextmanager
    def around(self, action, last: bool):
        """Around one action of the micro-batch loop: F, B, I or W of a pipeline stage (every backward
        reduces its gradients, the last one as the others)."""
        if not self._order and self._tracing is None and action.kind == "F" and action.mb == 0:
            self._tracing = {}  # the first micro-batch's order of units (for prefetch)
        yield
        if action.kind == "F":
            self.ledger.check_activations()  # a budget check when saved activations peak
        if action.kind in ("B", "W"):  # the stage's parameter gradients accumulated in this action
            self._after_backward(self.groups_of_stage[action.stage])
        for unit in self.units:  # anything prefetched but not used, or not released (between I and W)
            self._release(unit)
        if self._tracing is not None and action.kind in ("B", "W") and action.mb == 0:
            self._order, self._tracing = self._tracing, None

    def _use(self, unit: _Unit, phase: str) -> None:
        """Forward or backward pre-hook: the unit is about to run; make its parameters whole."""
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

    def _gather(self, unit: _Unit, blocking: bool) -> None:
        """All-gather every rank's shard of the unit into a whole buffer (L,): now, or started (a prefetch)."""
        group = unit.group
        unit.whole = self.ledger.register("gathered_parameters", group.empty(), f"module {unit.name or 'root'}")  # (L,)
        if blocking:
            self.comm.allgather(unit.shard, unit.whole)
            self._attach(unit)
        else:
            unit.request = self.comm.iallgather(unit.shard, unit.whole)

    def _attach(self, unit: _Unit) -> None:
        """Point the unit's parameters' data at the gathered buffer."""
        for p, view in zip(unit.group.params, unit.group.views(unit.whole)):
            p.data = view

    def _prefetch(self, unit: _Unit, phase: str) -> None:
        """Start gathering the units that follow `unit` in the first micro-batch's order, within --prefetch."""
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

    def _poll(self) -> None:
        """MPI advances non-blocking collectives only inside MPI calls: test the ones in flight."""
        self.gradients.poll()
        for unit in self.units:
            if unit.request is not None:
                unit.request.test()

    def _release(self, unit: _Unit) -> None:
        """Forward hook, and whenever the unit's whole parameters are done with: free them."""
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

    def _gradient_arriving(self, param, grad) -> None:
        """Leaf hook, before backward adds grad into param.grad: the group's first gradient opens its bucket."""
        self.gradients.open_bucket(param)

    def _gradient_in(self, param) -> None:
        """Post-accumulate hook: param's gradient was added into its group's bucket."""
        group = self.gradients.count(param)
        if group is not None:  # the group's last gradient
            self._reduce_scatter(group)
        self._poll()

    def _reduce_scatter(self, group) -> None:
        """The unit's backward is over: free its gathered parameters (the "free after use" of backward);
        then, as in stage 2, reduce-scatter its bucket and add the one before it into the shard."""
        unit = self.unit_of.get(group.index)
        if unit is not None:  # (a group of small parameters has nothing gathered)
            self._release(unit)
        self.gradients.reduce_scatter(group)

    def _after_backward(self, mine: list) -> None:
        """After a backward of the pipeline stage whose groups are `mine`: reduce the buckets still open;
        wait for every reduce-scatter and add it into the shard."""
        for group in self.gradients.still_open(mine):
            self._reduce_scatter(group)
        self.gradients.end_backward(mine)

    def finish(self) -> list:
        """After the micro-batch loop: this rank's gradient shard (L/N,) of every group, summed."""
        self.gradients.wait()
        return self.gradients.shards

    def optimizer_step(self, blocks: list, total: float | None = None):
        """Each rank steps its shard, which for a unit is the parameters it keeps (optimizer.py)."""
        return self.optimizer.step(blocks, total)

    def end_step(self, result) -> None:
        """Zero the gradient shards. The parameter shards were updated in place: only the small whole
        parameters are all-gathered (if the step was taken)."""
        self.gradients.zero()
        if result.applied:
            all_gather_blocks(self.comm, list(self.small_flats.values()))

    # -- the first forward's checks -------------------------------------------------------------------
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

    # -- records (strategy.py) --------------------------------------------------------------------------
    def whole_parameters(self) -> dict:
        """{name: NumPy array} (collective); the float32 master weights under mixed precision."""
        if self.optimizer.keeps_masters:
            return self.gather_by_name(self.optimizer.masters)
        return self._arrays_by_name([self._whole_copy(group) for group in self.groups])

    def _whole_copy(self, group):
        """group's whole parameters (L,): a unit's gathered into a copy for inspection, not kept."""
        unit = self.unit_of.get(group.index)
        if unit is None:
            return self.small_flats[group.index]
        whole = group.empty()
        self.comm.allgather(unit.shard, whole)
        return whole

    def load_full_state(self, masters: dict, states: dict, step: int) -> None:
        """Set master weights, parameters and optimizer state from whole flattened arrays by name."""
        self._load_blocks(masters, states, step)  # this rank's blocks: a unit's shard is its parameters
        all_gather_blocks(self.comm, list(self.small_flats.values()))

    def report(self) -> dict:
        return {**super().report(), "units": len(self.units), "prefetch_bytes": self.prefetch_bytes,
                "param_threshold": self.param_threshold,
                "largest_unit_bytes": max((u.group.nbytes for u in self.units), default=0)}
