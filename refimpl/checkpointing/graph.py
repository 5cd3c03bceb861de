"""The forward graph of a function of tensors, recorded once, and its articulation points.

Salimans and Bulatov's gradient-checkpointing package (2018) chooses checkpoints on the graph,
not on a chain of layers. Its memory rule looks for *articulation points*: tensors whose removal
disconnects the graph's inputs from its output. Only there is a cut safe when the graph has skip
connections: every path from input to loss passes through such a tensor, so the segment behind it
can be recomputed from it alone.

The graph. `record(fn, *inputs)` runs fn once in recording mode (refimpl/autograd/recording.py):
under no_grad, so nothing is saved, but with every result that would require a gradient marked
so, so modules behave as in training. Each operation becomes a Node; each tensor a Value:

    values    region inputs first, then every output of every operation, in execution order
              (so a value's index is a topological position: producers come first)
    in graph  the values reachable from the data inputs; parameters and constants are not
              values at all (a tied embedding would otherwise join the input and the head)

Articulation points (`articulation_points`). Add a source S before the inputs and a sink T after
the outputs; a value v is an articulation point when every S→T path passes through v. In a DAG
whose vertices are numbered topologically this has a linear test: keep only the relevant vertices
(reachable from S and reaching T) and the edges between them; v is a cut exactly when no edge
jumps over it, i.e. there is no edge (u, w) with u < v < w. (If one did, S→u→w→T would avoid v,
since every vertex on S→u is numbered below u and every vertex on w→T above w; if none does, a
path must step from below v to above v, and the only way is through v.) One sweep keeps the
farthest end of the edges seen so far:

    reach(p) = max{w : (u, w) relevant edge, u < p}     v is a cut  ⇔  reach(v) ≤ v

Single articulation points are sufficient cuts, not the only ones: a pair of tensors can separate
input from loss when neither does alone (two parallel branches). refimpl uses single points only;
a region without one stays inside one segment (docs/checkpointing.md, "Automatic selection").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refimpl.autograd import recording
from refimpl.autograd.grad_mode import no_grad
from refimpl.autograd.tensor import Tensor


@dataclass
class Value:
    index: int
    producer: int  # the node that produced it; -1 for a region input
    shape: tuple
    nbytes: int
    in_graph: bool

    @property
    def name(self) -> str:
        return f"t{self.index}"


@dataclass
class Node:
    index: int
    op: str  # the Function's class name
    cls: type
    args: tuple  # one entry per positional argument: ("v", value) | ("x", Tensor) | ("c", constant)
    options: dict
    outputs: tuple  # value indices
    in_graph: bool

    @property
    def signature(self) -> tuple:
        """What must be the same on every step: the operation and where each argument comes from."""
        return (self.op,) + tuple(a[1] if a[0] == "v" else a[0] for a in self.args)

    def value_inputs(self) -> list:
        return [a[1] for a in self.args if a[0] == "v"]


@dataclass
class Graph:
    values: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)  # value indices of the region's tensor inputs
    outputs: list = field(default_factory=list)  # value indices of the region's tensor outputs

    def consumers(self) -> list:
        """consumers[v] = the nodes that read value v, in order."""
        found = [[] for _ in self.values]
        for node in self.nodes:
            for v in node.value_inputs():
                if not found[v] or found[v][-1] != node.index:
                    found[v].append(node.index)
        return found

    def describe(self, v: int) -> str:
        value = self.values[v]
        made_by = "input" if value.producer < 0 else self.nodes[value.producer].op
        return f"{value.name} ({made_by}, {tuple(value.shape)}, {value.nbytes} B)"


def _tag(tensor: Tensor, token, index: int) -> None:
    tensor._recorded_as = (token, index)


def _tagged(tensor, token) -> int | None:
    tag = getattr(tensor, "_recorded_as", None)
    return tag[1] if tag is not None and tag[0] is token else None


class Recorder:
    """The interceptor of a recording pass: runs each operation under no_grad, notes it down."""

    def __init__(self) -> None:
        self.graph = Graph()
        self.token = object()  # tags of this recording only

    def add_input(self, tensor: Tensor) -> int:
        v = len(self.graph.values)
        self.graph.values.append(Value(v, -1, tuple(tensor.shape), int(tensor.data.nbytes), True))
        self.graph.inputs.append(v)
        _tag(tensor, self.token, v)
        return v

    def refs(self, args: tuple) -> tuple:
        refs = []
        for a in args:
            v = _tagged(a, self.token) if isinstance(a, Tensor) else None
            refs.append(("v", v) if v is not None else ("x", a) if isinstance(a, Tensor) else ("c", a))
        return tuple(refs)

    def apply(self, cls, args: tuple, options: dict):
        refs = self.refs(args)
        in_graph = any(r[0] == "v" and self.graph.values[r[1]].in_graph for r in refs)
        wants_grad = any(isinstance(a, Tensor) and a.requires_grad for a in args)
        with no_grad():
            out = recording.run(cls, args, options)
        outs = out if isinstance(out, tuple) else (out,)
        marked = tuple(Tensor(o.data, requires_grad=wants_grad and o.data.dtype.kind == "f") for o in outs)
        index = len(self.graph.nodes)
        out_values = []
        for t in marked:
            v = len(self.graph.values)
            self.graph.values.append(Value(v, index, tuple(t.shape), int(t.data.nbytes), in_graph))
            _tag(t, self.token, v)
            out_values.append(v)
        self.graph.nodes.append(Node(index, cls.__name__, cls, refs, dict(options), tuple(out_values), in_graph))
        return marked if isinstance(out, tuple) else marked[0]


def record(fn, *inputs) -> Graph:
    """The graph of fn(*inputs), from one recording pass (nothing is saved for backward)."""
    recorder = Recorder()
    for x in inputs:
        if isinstance(x, Tensor):
            recorder.add_input(x)
    with recording.intercepting(recorder):
        out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs:
        v = _tagged(o, recorder.token) if isinstance(o, Tensor) else None
        if v is not None:
            recorder.graph.outputs.append(v)
    for x in inputs:
        if isinstance(x, Tensor):
            del x._recorded_as
    return recorder.graph


def relevant_edges(graph: Graph) -> tuple[set, list]:
    """(relevant values, edges (u, w)) of the in-graph value DAG, relevant = on some input→output path."""
    reaches_out = set(graph.outputs)
    for node in reversed(graph.nodes):
        if node.in_graph and any(w in reaches_out for w in node.outputs):
            reaches_out.update(v for v in node.value_inputs() if graph.values[v].in_graph)
    relevant = {v.index for v in graph.values if v.in_graph and v.index in reaches_out}
    edges = []
    for node in graph.nodes:
        if not node.in_graph:
            continue
        ins = [v for v in set(node.value_inputs()) if v in relevant]
        outs = [w for w in node.outputs if w in relevant]
        edges += [(u, w) for u in ins for w in outs]
    return relevant, edges


def articulation_points(graph: Graph) -> list[int]:
    """The values (indices, in topological order) that every input→output path passes through,
    the inputs and outputs themselves included when they qualify (see the module docstring)."""
    relevant, edges = relevant_edges(graph)
    sink = len(graph.values)  # T, after every value
    starts = {}  # u -> the farthest w of an edge (u, w)
    for u, w in edges:
        starts[u] = max(starts.get(u, -1), w)
    for v in graph.outputs:
        starts[v] = sink  # v -> T
    reach = max((v for v in graph.inputs if v in relevant), default=-1)  # edges S -> inputs
    cuts = []
    for v in sorted(relevant):
        if reach <= v:
            cuts.append(v)
        reach = max(reach, starts.get(v, -1))
    return cuts
