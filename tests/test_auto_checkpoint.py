"""Automatic checkpoint selection: articulation points, the rules, bitwise gradients, bytes, errors.

Articulation points are checked against a brute force (remove the vertex, search for a path) on
drawn DAGs; gradients against the plain run bit for bit; memory with the engine's ledger;
recomputation with the engine's forward counter (autograd/recording.py).
"""

import pathlib
import re
import runpy
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.autograd import Tensor, ops, saved_tensors
from refimpl.autograd.recording import counting_forwards
from refimpl.checkpointing import AutoCheckpoint, apply_to_gpt, articulation_points, current_plan, parse_plan, record
from refimpl.checkpointing.auto import inner_articulation_points, make_plan, memory_rule, select, speed_rule
from refimpl.checkpointing.graph import Graph, Node, Value
from refimpl.checkpointing.plans import Auto
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F
from refimpl.nn.layers import Linear
from refimpl.nn.module import Module, ModuleList
from refimpl.tools import cli


class SkipMLP(Module):
    """n tanh layers of width d; every k layers the input of the group is added back (a ResNet)."""

    def __init__(self, n: int, d: int, k: int, seed: int = 0, dtype="float64") -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.layers = ModuleList(Linear(d, d, rng, dtype=dtype) for _ in range(n))
        self.k = k

    def forward(self, x):
        skip = x
        for i, layer in enumerate(self.layers):
            x = ops.tanh(layer(x))
            if (i + 1) % self.k == 0:
                x = x + skip
                skip = x
        return x


class TwoBranches(Module):
    """y = f(x) + g(x), each branch `depth` layers deep: no articulation point between x and y."""

    def __init__(self, depth: int, d: int = 6, seed: int = 0) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.left = ModuleList(Linear(d, d, rng, dtype="float64") for _ in range(depth))
        self.right = ModuleList(Linear(d, d, rng, dtype="float64") for _ in range(depth))

    def forward(self, x):
        a = b = x
        for f, g in zip(self.left, self.right):
            a, b = ops.tanh(f(a)), ops.tanh(g(b))
        return a + b


def _steps(model, fn, x0, steps=2):
    """Run `steps` forward+backward of sum(fn(x)²); the last step's (grads, x.grad, peak, forwards)."""
    for _ in range(steps):
        x = Tensor(x0.copy(), requires_grad=True)
        for p in model.parameters():
            p.grad = None
        base = saved_tensors.live_bytes
        saved_tensors.reset_peak()
        with counting_forwards() as calls:
            y = fn(x)
            (y * y).sum().backward()
        peak = saved_tensors.peak_bytes - base
        assert saved_tensors.live_bytes == base, "saved arrays leaked"
    grads = [None if p.grad is None else p.grad.copy() for p in model.parameters()]
    return grads, x.grad.copy(), peak, sum(calls.values())


def _same(a, b) -> bool:
    return len(a) == len(b) and all((u is None and v is None) or (u is not None and v is not None and u.dtype == v.dtype
                                    and np.array_equal(u, v)) for u, v in zip(a, b))


# -- articulation points -------------------------------------------------------------------------

def _dag(n_values: int, edges: set) -> Graph:
    """A graph whose values 0..n-1 are wired by `edges` (u < w): one node per value w > 0."""
    g = Graph()
    g.values = [Value(v, v - 1, (1,), 8, True) for v in range(n_values)]
    g.values[0].producer = -1
    for w in range(1, n_values):
        args = tuple(("v", u) for u in sorted(u for u, t in edges if t == w))
        g.nodes.append(Node(w - 1, "Op", object, args, {}, (w,), True))
    g.inputs, g.outputs = [0], [n_values - 1]
    return g


def _brute_force_cuts(n: int, edges: set) -> list:
    """v is a cut iff no 0 -> n-1 path avoids it (only vertices on some 0 -> n-1 path qualify)."""
    def path(avoid):
        seen, stack = {0}, [0]
        while stack:
            u = stack.pop()
            for a, b in edges:
                if a == u and b != avoid and b not in seen:
                    seen.add(b)
                    stack.append(b)
        return n - 1 in seen

    def on_some_path(v):
        return path(None) and _reaches(0, v, edges) and _reaches(v, n - 1, edges)

    return [v for v in range(n) if on_some_path(v) and (v in (0, n - 1) or not path(v))]


def _reaches(a: int, b: int, edges: set) -> bool:
    seen, stack = {a}, [a]
    while stack:
        u = stack.pop()
        for s, t in edges:
            if s == u and t not in seen:
                seen.add(t)
                stack.append(t)
    return b in seen


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 12).flatmap(lambda n: st.tuples(
    st.just(n), st.sets(st.tuples(st.integers(0, n - 2), st.integers(1, n - 1)).filter(lambda e: e[0] < e[1])))))
def test_articulation_points_equal_a_brute_force_search_on_drawn_dags(case):
    n, edges = case
    edges = set(edges) | {(w - 1, w) for w in range(1, n) if not any(t == w for _, t in edges)}  # every value made
    assert articulation_points(_dag(n, edges)) == _brute_force_cuts(n, edges)


def test_a_chain_has_every_tensor_as_an_articulation_point_and_a_diamond_has_none_inside():
    assert articulation_points(_dag(5, {(0, 1), (1, 2), (2, 3), (3, 4)})) == [0, 1, 2, 3, 4]
    assert articulation_points(_dag(5, {(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)})) == [0, 3, 4]
    assert articulation_points(_dag(4, {(0, 1), (1, 2), (0, 3), (2, 3)})) == [0, 3]  # a skip around 1, 2


def test_the_skip_mlp_is_cut_only_where_the_skips_join():
    model = SkipMLP(8, 4, k=2)
    graph = record(model, Tensor(np.zeros((3, 4)), requires_grad=True))
    cuts = inner_articulation_points(graph)
    assert [graph.nodes[graph.values[v].producer].op for v in cuts] == ["Add"] * 3  # joins 1..3 (4 is the output)
    assert len(graph.nodes) == 8 * 2 + 4 and graph.outputs == [len(graph.values) - 1]


def test_in_a_pre_ln_gpt_the_only_articulation_points_are_the_residual_sums():
    model = GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=3, n_head=2, d_model=16, dtype="float64"), seed=1)
    x = model.embed(np.zeros((2, 8), dtype=np.int64))
    graph = record(lambda h: _blocks(model, h), x)
    cuts = inner_articulation_points(graph)
    assert [graph.nodes[graph.values[v].producer].op for v in cuts] == ["Add"] * 5  # 2 per block; the last: output
    assert all(graph.values[v].shape == (2, 8, 16) for v in cuts)


def _blocks(model, x):
    for block in model.blocks:
        x = block(x)
    return x


def test_parameters_and_constants_are_not_in_the_graph_a_tied_head_does_not_join_input_and_output():
    model = GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=2, n_head=2, d_model=16, tie_weights=True,
                          dtype="float64"), seed=1)
    x = model.embed(np.zeros((2, 8), dtype=np.int64))
    graph = record(lambda h: model.head(_blocks(model, h)), x)
    assert inner_articulation_points(graph)  # wte feeds the head, but it is a parameter, not a value
    assert all(v.in_graph for v in graph.values)


# -- the rules -----------------------------------------------------------------------------------

def test_memory_keeps_about_sqrt_of_the_articulation_points_spaced_by_bytes():
    model = SkipMLP(32, 4, k=1)  # a skip after every layer: 31 joins inside
    graph = record(model, Tensor(np.zeros((3, 4)), requires_grad=True))
    cuts = inner_articulation_points(graph)
    chosen = memory_rule(graph)
    assert len(cuts) == 31 and len(chosen) == 6  # ⌈√31⌉
    positions = [cuts.index(v) for v in chosen]
    assert positions == sorted(positions) and max(np.diff(positions)) - min(np.diff(positions)) <= 1


def test_speed_keeps_the_matrix_products_among_them_q_k_transposed():
    model = GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=2, n_head=2, d_model=24, dtype="float64"), seed=1)
    graph = record(lambda h: _blocks(model, h), model.embed(np.zeros((3, 8), dtype=np.int64)))
    chosen = speed_rule(graph)
    ops_chosen = [graph.nodes[graph.values[v].producer].op for v in chosen]
    assert set(ops_chosen) == {"MatMul", "LinearFunction"}
    assert sum(graph.values[v].shape == (3, 2, 8, 8) for v in chosen) == 2  # q kᵀ: b·h·T² per block
    assert len(chosen) == 2 * (4 + 2)  # per block: qkv, proj, fc, fc2 and the two attention products


def test_a_region_without_articulation_point_is_kept_whole():
    model = TwoBranches(depth=5)
    graph = record(model, Tensor(np.zeros((3, 6)), requires_grad=True))
    assert inner_articulation_points(graph) == [] and memory_rule(graph) == []
    plan = make_plan(graph, [])
    assert plan.recompute == frozenset() and plan.interior == frozenset()  # stored whole, nothing recomputed
    x0 = np.random.default_rng(0).standard_normal((3, 6))
    plain = _steps(model, model, x0)
    auto = _steps(model, AutoCheckpoint(model, "memory"), x0)
    assert _same(plain[0], auto[0]) and plain[2:] == auto[2:]


# -- running the plans: bitwise gradients, fewer bytes, more forwards ----------------------------

@pytest.mark.parametrize("rule", ["memory", "speed", ["t9", "t20"], lambda g: inner_articulation_points(g)[::2]])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_skip_mlp_gradients_are_bitwise_those_of_the_plain_run(rule, k):
    model = SkipMLP(12, 5, k)
    x0 = np.random.default_rng(1).standard_normal((4, 5))
    plain = _steps(model, model, x0)
    runner = AutoCheckpoint(model, rule)
    auto = _steps(model, runner, x0)
    assert _same(plain[0], auto[0]) and np.array_equal(plain[1], auto[1])
    assert runner.recordings == 1  # recorded on the first step, reused on the second
    assert auto[3] > plain[3]  # something was recomputed


def test_skip_mlp_auto_memory_counts():
    model = SkipMLP(16, 8, 4)
    x0 = np.random.default_rng(1).standard_normal((4, 8))
    grads, _, peak, forwards = _steps(model, model, x0)
    runner = AutoCheckpoint(model, "memory")
    grads_auto, _, peak_auto, forwards_auto = _steps(model, runner, x0)
    # joins t9, t18, t27 inside, 256 bytes each; ⌈√3⌉ = 2, at 1/3 and 2/3 of their bytes: t9, t18
    assert runner.plan.checkpoints == [9, 18]
    assert (peak, peak_auto) == (5376, 3328) and (forwards, forwards_auto) == (38, 54)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("plan", ["auto:memory", "auto:speed"])
def test_gpt_gradients_are_bitwise_with_dropout_and_the_next_step_draws_the_same(plan, dtype):
    def train(plan):
        cfg = GPTConfig(vocab_size=11, seq_len=8, n_layer=4, n_head=2, d_model=16, dropout=0.1, dtype=dtype)
        model = apply_to_gpt(GPT(cfg, seed=3), plan)
        rng = np.random.default_rng(0)
        out = []
        for _ in range(3):
            idx, targets = rng.integers(0, 11, (2, 8)), rng.integers(0, 11, (2, 8))
            for p in model.parameters():
                p.grad = None
            base = saved_tensors.live_bytes
            saved_tensors.reset_peak()
            with counting_forwards() as calls:
                F.cross_entropy(model(idx), targets).backward()
            assert saved_tensors.live_bytes == base
            out.append(([p.grad.copy() for p in model.parameters()], saved_tensors.peak_bytes - base,
                        sum(calls.values())))
        return out, model

    plain, _ = train("none")
    auto, model = train(plan)
    assert current_plan(model) == Auto(plan.split(":")[1])
    for (g0, peak0, calls0), (g1, peak1, calls1) in zip(plain, auto):
        assert _same(g0, g1) and peak1 < peak0 and calls1 > calls0


def test_the_plan_string_and_one_line_errors():
    assert parse_plan("auto:memory") == Auto("memory") and str(parse_plan(" AUTO:Speed ")) == "auto:speed"
    for text, message in [("auto:fast", "unknown rule 'fast'; choose auto:memory"),
                          ("auto:", "unknown rule ''"),
                          ("selective+auto:memory", "an auto plan chooses its own checkpoints")]:
        with pytest.raises(ValueError, match=message):
            parse_plan(text)


def test_a_list_naming_tensors_outside_the_graph_is_refused():
    model = SkipMLP(4, 3, 2)
    graph = record(model, Tensor(np.zeros((2, 3)), requires_grad=True))
    last = len(graph.values) - 1
    with pytest.raises(ValueError, match=f"t999 is not a tensor of the recorded graph, which has t0..t{last}"):
        select(graph, ["t999"])
    with pytest.raises(ValueError, match="'weights' does not name a tensor"):
        select(graph, ["weights"])
    with pytest.raises(ValueError, match="unknown rule 'fastest'"):
        select(graph, "fastest")


def test_a_tensor_computed_from_parameters_only_is_not_in_the_graph():
    rng = np.random.default_rng(0)
    layer = Linear(3, 3, rng, dtype="float64")

    def fn(x):
        w2 = layer.weight * 2.0  # parameters and constants only: not between input and loss
        return ops.matmul(x, w2)

    graph = record(fn, Tensor(np.ones((2, 3)), requires_grad=True))
    assert [v.in_graph for v in graph.values] == [True, False, True]
    with pytest.raises(ValueError, match="t1 is not in the graph between the inputs and the loss"):
        select(graph, ["t1"])


def test_a_graph_that_changes_between_steps_is_one_clear_error_or_rebuilt():
    model = SkipMLP(6, 3, 2)
    depth = {"n": 6}

    def fn(x):
        for layer in model.layers[:depth["n"]]:
            x = ops.tanh(layer(x))
        return x

    x0 = np.ones((2, 3))
    strict = AutoCheckpoint(fn, "memory")
    _steps(model, strict, x0, steps=1)
    depth["n"] = 5
    with pytest.raises(ValueError, match=r"the forward graph differs from the one recorded \(10 operations ran, the "
                                         r"recording had 12\)"):
        _steps(model, strict, x0, steps=1)
    rebuilt = AutoCheckpoint(fn, "memory", on_change="rebuild")
    _steps(model, rebuilt, x0, steps=1)
    depth["n"] = 4
    expected = _steps(model, fn, x0, steps=1)
    assert _same(_steps(model, rebuilt, x0, steps=1)[0], expected[0])  # the changed step runs plainly
    assert _same(_steps(model, rebuilt, x0, steps=1)[0], expected[0]) and rebuilt.recordings == 2


def test_the_cli_refuses_an_unknown_rule_in_one_line(capsys):
    code = cli.main(["train", "--steps", "1", "--checkpoint", "auto:fast"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "unknown rule 'fast'" in err[0], err


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 9), k=st.integers(1, 4), rule=st.sampled_from(["memory", "speed"]), seed=st.integers(0, 9))
def test_drawn_skip_mlps_are_bitwise_and_release_everything(n, k, rule, seed):
    model = SkipMLP(n, 3, k, seed=seed)
    x0 = np.random.default_rng(seed).standard_normal((2, 3))
    plain = _steps(model, model, x0)
    auto = _steps(model, AutoCheckpoint(model, rule), x0)
    assert _same(plain[0], auto[0]) and np.array_equal(plain[1], auto[1])
    if rule == "memory":  # (speed may hold more: see the next test)
        assert auto[2] <= plain[2]


def test_speed_on_a_residual_stream_recomputes_it_whole_and_can_hold_more_than_the_plain_run():
    # x_(i+1) = tanh(W x_i) + x_i: the residual sums are not matrix products, so every sum is
    # recomputed, and the sums chain the whole network into one segment, materialised at once.
    model = SkipMLP(4, 3, 1)
    x0 = np.random.default_rng(0).standard_normal((2, 3))
    runner = AutoCheckpoint(model, "speed")
    plain, auto = _steps(model, model, x0), _steps(model, runner, x0)
    assert _same(plain[0], auto[0]) and (plain[2], auto[2]) == (432, 480)
    assert runner.plan.checkpoints == [1, 4, 7, 10] and runner.plan.interior == frozenset({2, 3, 5, 6, 8, 9})


def test_the_docs_table_is_the_measurement():
    root = pathlib.Path(__file__).resolve().parents[1]
    blocks = re.findall(r"<!-- generated by: python benchmarks/auto_checkpoint_table\.py -->\n(.*?)\n"
                        r"<!-- end generated -->", (root / "docs" / "checkpointing.md").read_text(), re.S)
    table = runpy.run_path(str(root / "benchmarks" / "auto_checkpoint_table.py"))
    assert blocks == [table["markdown"]()], "run: python benchmarks/auto_checkpoint_table.py, and paste its output"


def _spaced_by_all_bytes(graph):
    cuts = inner_articulation_points(graph)
    k = int(np.ceil(np.sqrt(len(cuts))))
    cumulative = np.cumsum([v.nbytes if v.in_graph else 0 for v in graph.values])
    return sorted({next((v for v in cuts if cumulative[v] >= j * cumulative[-1] / (k + 1)), cuts[-1])
                   for j in range(1, k + 1)})


def test_the_tutorial_checks_reject_subtly_wrong_answers_and_pass_the_solutions():
    root = pathlib.Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tutorials"))
    from harness import auto_checkpointing as checks  # noqa: PLC0415
    from harness import run_check  # noqa: PLC0415 - tutorials/ is put on sys.path just above

    solution = runpy.run_path(str(root / "tutorials" / "solutions" / "13_automatic_checkpointing.py"))
    for check, name in [(checks.check_articulation_points, "articulation_points_of"),
                        (checks.check_selection_rule, "my_rule"), (checks.check_speed_rule, "speed_checkpoints"),
                        (checks.check_memory_rule, "memory_checkpoints")]:
        assert run_check(check, solution[name]).ok
    wrong = [
        (checks.check_articulation_points, lambda n, e: solution["articulation_points_of"](n, e)[1:-1]),  # no ends
        (checks.check_memory_rule, _spaced_by_all_bytes),  # the bytes of every tensor, not the cuts' own
        (checks.check_memory_rule, lambda g: solution["memory_checkpoints"](g)[:-1]),  # one too few
        (checks.check_speed_rule, lambda g: [w for n in g.nodes if n.op == "MatMul" for w in n.outputs]),  # no linears
        (checks.check_selection_rule, lambda g: inner_articulation_points(g)),  # all of them: too much memory
        (checks.check_selection_rule, lambda g: ["t1000"]),  # not in the graph
    ]
    for check, answer in wrong:
        assert run_check(check, answer).status == "wrong", check.__name__
