"""Automatic checkpoint selection on any graph: auto:memory, auto:speed, or a list of tensors.

Salimans and Bulatov, "Saving memory using gradient-checkpointing" (openai/gradient-checkpointing,
2018), the package that made √n checkpointing popular, works on a computation graph rather than a
chain of layers. It stores some tensors (the *checkpoints*) and recomputes every other tensor that
backward needs from the nearest stored ones. Its selection rules, as refimpl implements them:

    auto:memory   the articulation points of the graph (graph.py: tensors that every
                  input→loss path passes through), k = ⌈√m⌉ of the m inside the region, spaced
                  by the bytes they hold: checkpoint j is the first articulation point at which
                  the articulation points' cumulative bytes reach j/(k+1) of their total. For a
                  chain of n equal operations this stores about 2√n tensors for one extra
                  forward at most. (Only the articulation points' own sizes count, which are the
                  same on every rank of a data-parallel run even when expert routing changes the
                  sizes of other tensors: every rank chooses the same checkpoints, so the
                  recomputations' collectives, an all-to-all of experts, match.)
    auto:speed    the outputs of the expensive operations (matrix products: MatMul,
                  LinearFunction), so that only cheap elementwise work is recomputed. These are
                  usually not articulation points; see below.
    [t3, t17, …]  the user's tensors, by name (graph.values[i].name) or index; or a callable
                  rule(graph) -> indices (tutorials/13_automatic_checkpointing.py writes one).

How a plan runs (AutoCheckpoint). The first call records the graph (graph.record: one forward
under no_grad, with the random generators put back afterwards, so that the real forward draws the
same dropout masks) and makes the plan. Every call, the user's Python runs as usual and the
engine records every operation as usual; the plan only changes what is *saved*:

    stored      the checkpoints, the region's inputs and outputs, and everything computed after
                the last checkpoint (the last segment stays recorded, as refimpl's sqrt does)
    recomputed  every other tensor a backward reads. A recomputed operation's saved arrays
                become references (autograd/recording.py: deferred saves): "the value of
                tensor t" or "the i-th array this operation saved".

When backward first reads such a reference, the whole *segment* it belongs to is recomputed:
the recorded Function nodes between the stored tensors are run forward again on the stored
arrays (a trace of this step's operations, not the user's Python), and every reference of the
segment gets its array, counted by the saved-tensor ledger until its node's backward is done.
An operation whose output is a checkpoint and that saves only its inputs (a matrix product) is
not run again: only the cheap operations that produce its inputs are. A segment is the set of
recomputed operations linked by recomputed tensors; between articulation points it is the
stretch from one checkpoint to the next.

Because backward runs over the very graph the forward recorded, node by node, gradients are
bitwise those of the plain run. Checkpoints that are not articulation points (auto:speed, a
user's list) are handled as the package handles them: a tensor that is neither stored nor
recomputable from the stored ones inside its segment does not exist — every tensor is either
stored or recomputed from stored tensors, whatever crosses the checkpoints. A region without an
articulation point (two parallel branches) lies inside one segment of auto:memory and is
recomputed whole: its activations are held together during its backward.

Data-dependent graphs, ZeRO-3, dropout.
- The plan is indexed by operation: every step checks each operation and where its arguments come
  from against the recording. Index arrays (expert routing, token gathers) are constants of this
  step's trace, so routing may change freely; a different sequence of operations is refused in
  one line, or (on_change="rebuild") the rest of the step runs plainly and the next call records
  and plans again.
- Recomputation re-runs operations whose Parameters may have been freed (ZeRO-3 frees a module's
  weights after its forward): before a segment is recomputed, the forward pre-hooks of the modules
  whose calls contained its operations fire again (ZeRO-3 gathers them); their forward hooks do
  not fire (the modules' own backward releases them).
- Random numbers are drawn outside the operations (a Dropout module draws its mask and passes it
  to DropoutFunction as a constant), so a dropout mask is a constant of the trace: kept, like in
  the plain run, never drawn again.
- A recomputed tensor's array is dropped once its last recorded user has run (free_early), so the
  memory is really freed; Python code in the region that reads a tensor's .data after the last
  operation that uses it would see None.

What production systems do differently. The package rewrites a static TensorFlow graph (its
recomputation is new graph nodes); PyTorch's non-reentrant torch.utils.checkpoint uses the same
saved-tensor references as here, but re-runs the user's Python for a region the user marks.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

from refimpl.autograd import recording
from refimpl.autograd.function import SavedRef, _compute_array
from refimpl.autograd.grad_mode import is_enabled as is_grad_enabled
from refimpl.autograd.saved import saved_tensors
from refimpl.autograd.tensor import Parameter, Tensor

from .graph import Graph, _tag, _tagged, articulation_points, record
from .state import RngReplay, capture_rng, generators_of

RULES = ("memory", "speed")
EXPENSIVE_OPS = frozenset({"MatMul", "LinearFunction", "TanhMatmul"})  # matrix products


# --- selection rules --------------------------------------------------------------------------
def inner_articulation_points(graph: Graph) -> list[int]:
    """The articulation points strictly inside the region (its inputs and outputs left out)."""
    ends = set(graph.inputs) | set(graph.outputs)
    return [v for v in articulation_points(graph) if v not in ends]


def memory_rule(graph: Graph) -> list[int]:
    """k = ⌈√m⌉ of the m inner articulation points, spaced by the bytes they hold."""
    cuts = inner_articulation_points(graph)
    if not cuts:
        return []
    k = math.isqrt(len(cuts) - 1) + 1  # ⌈√m⌉
    cumulative, total = [], 0
    for v in cuts:
        total += graph.values[v].nbytes
        cumulative.append(total)
    chosen = []
    for j in range(1, k + 1):
        target = j * total / (k + 1)
        pick = next((v for v, held in zip(cuts, cumulative) if held >= target), cuts[-1])
        if pick not in chosen:
            chosen.append(pick)
    return chosen


def speed_rule(graph: Graph) -> list[int]:
    """The outputs of the in-graph matrix products."""
    return [w for node in graph.nodes if node.in_graph and node.op in EXPENSIVE_OPS for w in node.outputs]


def select(graph: Graph, rule) -> list[int]:
    """The checkpoints (value indices, sorted) that `rule` chooses on `graph`."""
    if rule == "memory":
        return sorted(memory_rule(graph))
    if rule == "speed":
        return sorted(speed_rule(graph))
    if isinstance(rule, str):
        raise ValueError(f"auto checkpointing: unknown rule {rule!r}; choose memory, speed, a list of tensors, or a "
                         "function of the graph")
    chosen = rule(graph) if callable(rule) else rule
    return sorted({_value_index(graph, t) for t in chosen})


def _value_index(graph: Graph, name) -> int:
    last = len(graph.values) - 1
    if isinstance(name, str) and name.startswith("t") and name[1:].isdigit():
        index = int(name[1:])
    elif isinstance(name, int) and not isinstance(name, bool):
        index = name
    else:
        raise ValueError(f"auto checkpointing: {name!r} does not name a tensor of the graph; use names like 't12' "
                         f"or indices (the graph has t0..t{last})")
    if not 0 <= index <= last:
        raise ValueError(f"auto checkpointing: t{index} is not a tensor of the recorded graph, which has t0..t{last}")
    if not graph.values[index].in_graph:
        raise ValueError(f"auto checkpointing: t{index} is not in the graph between the inputs and the loss (it is "
                         "computed from parameters or constants only); choose a tensor that depends on the inputs")
    return index


# --- the plan ---------------------------------------------------------------------------------
@dataclass
class Plan:
    """What to store and what to recompute, by operation and tensor index of the recording."""

    graph: Graph
    checkpoints: list  # value indices
    recompute: frozenset  # node indices whose saved arrays become references
    interior: frozenset  # value indices that are recomputed, not stored
    last_use: dict  # value index -> the last node that reads it


def make_plan(graph: Graph, checkpoints: list) -> Plan:
    """Nodes that feed a checkpoint are recomputed; everything after the last one stays recorded."""
    chosen = set(checkpoints)
    consumers = graph.consumers()
    feeding: set = set()
    for node in reversed(graph.nodes):
        if not node.in_graph:
            continue
        if any(w in chosen or any(c in feeding for c in consumers[w]) for w in node.outputs):
            feeding.add(node.index)
    kept = chosen | set(graph.inputs) | set(graph.outputs)
    interior = {w for k in feeding for w in graph.nodes[k].outputs if w not in kept}
    last_use = {v: users[-1] for v, users in enumerate(consumers) if users}
    return Plan(graph, sorted(chosen), frozenset(feeding), frozenset(interior), last_use)


# --- running a plan ---------------------------------------------------------------------------
class Recomputed(SavedRef):
    """A saved array that is not kept: ("value", t) or ("own", node, slot), recomputed on first read."""

    __slots__ = ("segment", "key", "array", "__weakref__")

    def __init__(self, segment, key) -> None:
        self.segment, self.key, self.array = segment, key, None
        segment.live += 1

    def data(self):
        if self.array is None:
            self.segment.recompute()
        return self.array

    def __del__(self) -> None:
        if self.array is not None:
            saved_tensors.remove(self.array)
        self.segment.dropped_one()


class _Entry:
    """One recomputable operation of this step: enough to run its forward again."""

    __slots__ = ("index", "cls", "refs", "options", "needs", "outputs", "rerun", "modules")

    def __init__(self, index, cls, refs, options, needs, outputs, modules) -> None:
        self.index, self.cls, self.refs, self.options = index, cls, refs, options
        self.needs, self.outputs, self.modules, self.rerun = needs, outputs, modules, False


class Segment:
    """Recomputed operations linked by recomputed tensors, and the stored arrays they start from."""

    def __init__(self) -> None:
        self.entries: dict = {}  # node index -> _Entry
        self.pins: dict = {}  # value index -> stored array (counted by the ledger while the segment lives)
        self.refs: list = []  # weak references to this segment's Recomputed entries
        self.live = 0

    def absorb(self, other: Segment) -> None:
        self.entries.update(other.entries)
        for v, array in other.pins.items():
            if v in self.pins:
                saved_tensors.remove(array)
            else:
                self.pins[v] = array
        other.pins = {}
        for ref in other.refs:
            r = ref()
            if r is not None:
                r.segment = self
                self.live += 1
                other.live -= 1
                self.refs.append(ref)
        other.refs = []

    def pin(self, v: int, array) -> None:
        if v not in self.pins:
            saved_tensors.add(array)
            self.pins[v] = array

    def dropped_one(self) -> None:
        self.live -= 1
        if self.live <= 0:
            for array in self.pins.values():
                saved_tensors.remove(array)
            self.pins = {}

    def recompute(self) -> None:
        """Run the segment's operations forward again and hand every reference its array."""
        values, own = {}, {}
        modules = []
        for entry in sorted(self.entries.values(), key=lambda e: e.index):
            if entry.rerun:
                modules += [m for m in entry.modules if not any(m is seen for seen in modules)]
        for module in modules:  # ZeRO-3: gather the parameters these operations read
            for hook in module._forward_pre_hooks:
                hook(module, ())
        for entry in sorted(self.entries.values(), key=lambda e: e.index):
            if not entry.rerun:
                continue
            arrays = [values[r[1]] if r[0] == "v" and r[1] in values else self.pins[r[1]] if r[0] == "v"
                      else _compute_array(r[1].data) if r[0] == "x" else r[1] for r in entry.refs]
            fn = entry.cls()
            fn.needs_input_grad, fn._recording = entry.needs, True
            fn._param_of = {id(a): r[1] for a, r in zip(arrays, entry.refs)
                            if r[0] == "x" and isinstance(r[1], Parameter)}
            with recording.deferring_saves():
                out = fn.forward(*arrays, **entry.options)
            recording.forward_ran(entry.cls.__name__)
            for v, o in zip(entry.outputs, out if isinstance(out, tuple) else (out,)):
                values[v] = o
            own[entry.index] = getattr(fn, "_pending_saves", ())
        for ref in self.refs:
            r = ref()
            if r is None or r.array is not None:
                continue
            kind, *where = r.key
            r.array = values[where[0]] if kind == "value" else own[where[0]][where[1]]
            saved_tensors.add(r.array)


class _Execution:
    """The interceptor of one planned forward (see the module docstring)."""

    def __init__(self, plan: Plan, free_early: bool) -> None:
        self.plan, self.free_early = plan, free_early
        self.token = object()
        self.count = 0
        self.segment_of: dict = {}  # node index -> Segment
        self.open_modules: list = []
        self.interior_tensors: dict = {}  # value index -> Tensor (until its last use)
        self.plain = False  # the graph changed: the rest of the step runs without a plan
        self.change = None

    def enter_module(self, module) -> None:
        self.open_modules.append(module)

    def leave_module(self, module) -> None:
        if self.open_modules and self.open_modules[-1] is module:
            self.open_modules.pop()

    def refs(self, args: tuple) -> tuple:
        out = []
        for a in args:
            v = _tagged(a, self.token) if isinstance(a, Tensor) else None
            out.append(("v", v) if v is not None else ("x", a) if isinstance(a, Tensor) else ("c", a))
        return tuple(out)

    def apply(self, cls, args: tuple, options: dict):
        k = self.count
        self.count += 1
        if self.plain:
            return recording.run(cls, args, options)
        refs = self.refs(args)
        nodes = self.plan.graph.nodes
        signature = (cls.__name__,) + tuple(r[1] if r[0] == "v" else r[0] for r in refs)
        if k >= len(nodes) or nodes[k].signature != signature:
            self.changed(k, cls.__name__)
            return recording.run(cls, args, options)
        node = nodes[k]
        if k not in self.plan.recompute:
            out = recording.run(cls, args, options)
        else:
            with recording.deferring_saves():
                out = recording.run(cls, args, options)
        outs = out if isinstance(out, tuple) else (out,)
        for t, v in zip(outs, node.outputs):
            _tag(t, self.token, v)
            if v in self.plan.interior and self.free_early and v in self.plan.last_use:
                self.interior_tensors[v] = t
        if k in self.plan.recompute:
            self.settle(k, cls, args, refs, options, outs)
        if self.free_early:
            for v in node.value_inputs():
                if self.plan.last_use.get(v) == k and v in self.interior_tensors:
                    self.interior_tensors.pop(v).data = None  # recomputed when backward needs it
        return out

    def settle(self, k, cls, args, refs, options, outs) -> None:
        """Decide, for each array node k saved, whether it is kept or becomes a reference."""
        fn = next((t.grad_fn for t in outs if t.grad_fn is not None), None)
        if fn is None:
            return
        plan, node = self.plan, self.plan.graph.nodes[k]
        segment = Segment()
        for v in node.value_inputs():  # join the segments of the recomputed tensors it reads
            if v in plan.interior:
                other = self.segment_of.get(plan.graph.values[v].producer)
                if other is not None and other is not segment:
                    segment.absorb(other)
                    for j in list(other.entries):
                        self.segment_of[j] = segment
        entry = _Entry(k, cls, refs, dict(options), fn.needs_input_grad, node.outputs,
                       [m for m in self.open_modules if m._forward_pre_hooks])
        segment.entries[k] = entry
        self.segment_of[k] = segment
        by_id = {}
        for r, a in zip(refs, args):
            if isinstance(a, Tensor):
                by_id.setdefault(id(a.data), r)
        for t, v in zip(outs, node.outputs):
            by_id[id(t.data)] = ("v", v)
        entries = []
        for slot, array in enumerate(getattr(fn, "_pending_saves", ())):
            r = by_id.get(id(array)) if array is not None else None
            if array is None or fn._param_of.get(id(array)) is not None:
                entries.append(array)
            elif r is not None and (r[0] != "v" or r[1] not in plan.interior):
                entries.append(array)  # stored tensor, constant (a dropout mask) or outside tensor: kept
            elif r is not None:
                entries.append(self.reference(segment, ("value", r[1])))
            else:
                entries.append(self.reference(segment, ("own", k, slot)))
                entry.rerun = True
        if any(v in plan.interior for v in node.outputs):
            entry.rerun = True
        if entry.rerun:
            for r, a in zip(refs, args):
                if r[0] == "v" and r[1] not in plan.interior:
                    segment.pin(r[1], _compute_array(a.data))
        fn.settle_saved(entries)
        fn.__dict__.pop("_pending_saves", None)

    def reference(self, segment: Segment, key) -> Recomputed:
        r = Recomputed(segment, key)
        segment.refs.append(weakref.ref(r))
        return r

    def changed(self, k: int, op: str) -> None:
        nodes = self.plan.graph.nodes
        was = nodes[k].op if k < len(nodes) else "the end of the graph"
        self.change = f"operation {k} was {was}, now {op}"
        self.plain = True


class AutoCheckpoint:
    """fn(*inputs) under automatic checkpoint selection: `rule` is memory, speed, a list, or a callable.

    on_change: "error" (a graph that differs from the recording is refused in one line) or
    "rebuild" (the step finishes without a plan; the next call records and plans again).
    """

    def __init__(self, fn, rule="memory", *, on_change: str = "error", free_early: bool = True) -> None:
        if on_change not in ("error", "rebuild"):
            raise ValueError(f"on_change must be 'error' or 'rebuild', got {on_change!r}")
        if isinstance(rule, str) and rule not in RULES:
            raise ValueError(f"unknown automatic checkpointing rule auto:{rule}; choose auto:memory or auto:speed "
                             "(a list of tensors or a function of the graph: the Python API)")
        self.fn, self.rule, self.on_change, self.free_early = fn, rule, on_change, free_early
        self.plan: Plan | None = None
        self.recordings = 0

    def record(self, *inputs) -> Plan:
        """Record fn's graph (random generators put back) and make the plan."""
        generators = generators_of(self.fn, *inputs)
        with RngReplay(generators, capture_rng(generators)):
            graph = record(self.fn, *inputs)
        self.recordings += 1
        self.plan = make_plan(graph, select(graph, self.rule))
        return self.plan

    def __call__(self, *inputs):
        if not is_grad_enabled():
            return self.fn(*inputs)
        if self.plan is None:
            self.record(*inputs)
        run = _Execution(self.plan, self.free_early)
        for v, x in zip(self.plan.graph.inputs, [x for x in inputs if isinstance(x, Tensor)]):
            _tag(x, run.token, v)
        with recording.intercepting(run):
            out = self.fn(*inputs)
        for segment in {id(s): s for s in run.segment_of.values()}.values():
            if segment.live == 0:  # nothing of it is read by backward: its stored inputs are not needed
                segment.dropped_one()
        if run.change is None and run.count != len(self.plan.graph.nodes):
            run.change = f"{run.count} operations ran, the recording had {len(self.plan.graph.nodes)}"
        if run.change is not None:
            self.plan = None
            if self.on_change == "error":
                raise ValueError(f"auto checkpointing: the forward graph differs from the one recorded ({run.change}); "
                                 "auto plans need the same operations every step: use on_change='rebuild' to record "
                                 "again, or a chain plan (sqrt, every:K)")
        return out


def auto_checkpoint(fn, *inputs, rule="memory"):
    """fn(*inputs) once under an automatic plan (recorded now); for repeated calls keep an AutoCheckpoint."""
    return AutoCheckpoint(fn, rule)(*inputs)
