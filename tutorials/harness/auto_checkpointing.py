"""Checks for tutorial 13 (automatic checkpointing): articulation points of a small graph, and a
selection rule of the student's own, run inside the engine. Memory is the saved-tensor ledger's
peak and recomputation the engine's forward counter, both measured, never predicted."""

from __future__ import annotations

import numpy as np

from refimpl.autograd import Tensor, ops, saved_tensors
from refimpl.autograd.recording import counting_forwards
from refimpl.checkpointing import AutoCheckpoint, articulation_points, record
from refimpl.checkpointing.auto import memory_rule, speed_rule
from refimpl.checkpointing.graph import Graph, Node, Value
from refimpl.nn import GPT, GPTConfig
from refimpl.nn.layers import Linear
from refimpl.nn.module import Module, ModuleList

from . import Wrong, shown


def graph_of(n: int, edges) -> Graph:
    """A graph of values 0..n-1 (0 the input, n-1 the output), value w > 0 made from the u with (u, w)."""
    g = Graph()
    g.values = [Value(v, v - 1, (1,), 8, True) for v in range(n)]
    g.values[0].producer = -1
    for w in range(1, n):
        args = tuple(("v", u) for u in sorted(u for u, t in edges if t == w))
        g.nodes.append(Node(w - 1, "Op", object, args, {}, (w,), True))
    g.inputs, g.outputs = [0], [n - 1]
    return g


GRAPHS = [
    (4, [(0, 1), (1, 2), (2, 3)]),  # a chain
    (5, [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)]),  # a diamond, then one more
    (6, [(0, 1), (1, 2), (2, 3), (1, 3), (3, 4), (4, 5), (0, 5)]),  # a skip from the input to the output
    (7, [(0, 1), (1, 2), (2, 3), (0, 3), (3, 4), (4, 5), (5, 6), (3, 6)]),  # two residual blocks
    (6, [(0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 5), (1, 2)]),  # two branches crossing once
    (5, [(0, 1), (1, 2), (1, 3), (2, 4), (0, 4)]),  # a dead end (3) that reaches no output
]


def check_articulation_points(find) -> None:
    """Check: articulation points of small graphs."""
    rng = np.random.default_rng(13)
    drawn = []
    for _ in range(40):
        n = int(rng.integers(3, 10))
        edges = {(w - 1, w) for w in range(1, n)} if rng.random() < 0.5 else set()
        edges |= {(int(u), int(w)) for u, w in rng.integers(0, n, (n, 2)) if u < w}
        edges |= {(w - 1, w) for w in range(1, n) if not any(t == w for _, t in edges)}
        drawn.append((n, sorted(edges)))
    for n, edges in GRAPHS + drawn:
        expected = articulation_points(graph_of(n, edges))
        got = find(n, list(edges))
        if sorted(int(v) for v in got) != expected:
            raise Wrong(f"values 0..{n - 1} (input 0, output {n - 1}) with edges {edges}: every input→output path "
                        f"passes through {expected}; you said {shown(sorted(got))}")


class Residual(Module):
    """n tanh layers of width d; every k layers the group's input is added back (k > n: a chain)."""

    def __init__(self, n: int, d: int, k: int, seed: int = 0) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.layers = ModuleList(Linear(d, d, rng, dtype="float64") for _ in range(n))
        self.k = k

    def forward(self, x):
        skip = x
        for i, layer in enumerate(self.layers):
            x = ops.tanh(layer(x))
            if (i + 1) % self.k == 0:
                x = x + skip
                skip = x
        return x


def measure(model, fn, x0) -> tuple:
    """(parameter gradients, peak saved bytes, operation forwards) of the second forward+backward."""
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        base = saved_tensors.live_bytes
        saved_tensors.reset_peak()
        with counting_forwards() as calls:
            y = fn(Tensor(x0, requires_grad=True))
            (y * y).sum().backward()
    return [p.grad.copy() for p in model.parameters()], saved_tensors.peak_bytes - base, sum(calls.values())


NETWORKS = [(24, 2), (30, 100), (36, 3)]  # (layers, skip every k)


def check_selection_rule(rule) -> None:
    """Check: a selection rule of your own."""
    x0 = np.random.default_rng(0).standard_normal((4, 8))
    for n, k in NETWORKS:
        model = Residual(n, 8, k)
        what = f"{n} layers" + (f", a skip every {k}" if k <= n else " in a chain")
        grads, peak, calls = measure(model, model, x0)
        runner = AutoCheckpoint(model, rule)
        try:
            grads_auto, peak_auto, calls_auto = measure(model, runner, x0)
        except ValueError as exc:
            raise Wrong(f"{what}: {exc}") from None
        if not all(np.array_equal(a, b) for a, b in zip(grads, grads_auto)):
            raise Wrong(f"{what}: the gradients differ from the plain run's (they must be the same bits)")
        if peak_auto > 0.4 * peak:
            raise Wrong(f"{what}: your checkpoints {runner.plan.checkpoints} hold a peak of {peak_auto} bytes, "
                        f"{peak_auto / peak:.0%} of the plain run's {peak}; aim for at most 40%")
        if calls_auto > 2 * calls:
            raise Wrong(f"{what}: {calls_auto} operation forwards, more than one extra per operation "
                        f"(the plain run has {calls})")


def _graphs():
    """Recorded graphs to compare rules on: residual networks, a chain, and GPTs' blocks."""
    found = []
    for n, k in NETWORKS + [(5, 1), (9, 4)]:
        found.append((f"{n} layers, skip every {k}", record(Residual(n, 8, k), Tensor(np.zeros((2, 8)),
                                                                                        requires_grad=True))))
    for n_layer, d_model, dropout in [(2, 16, 0.0), (3, 24, 0.1), (5, 8, 0.0)]:
        gpt = GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=n_layer, n_head=2, d_model=d_model, dropout=dropout,
                            dtype="float64"), seed=0)

        def blocks(h, gpt=gpt):
            for block in gpt.blocks:
                h = block(h)
            return h

        found.append((f"a GPT's {n_layer} blocks (d_model {d_model}, dropout {dropout})",
                      record(blocks, gpt.embed(np.zeros((2, 8), dtype=np.int64)))))
    return found


def _compare(rule, reference, what: str) -> None:
    for name, graph in _graphs():
        expected = sorted(reference(graph))
        got = sorted(int(v) for v in rule(graph))
        if got != expected:
            raise Wrong(f"{name}: {what} chooses {[graph.values[v].name for v in expected]}; you chose "
                        f"{[graph.values[v].name for v in got]}")


def check_speed_rule(speed_checkpoints) -> None:
    """Check: the speed rule."""
    _compare(speed_checkpoints, speed_rule, "auto:speed")


def check_memory_rule(memory_checkpoints) -> None:
    """Check: the memory rule, spaced by bytes."""
    _compare(memory_checkpoints, memory_rule, "auto:memory")
