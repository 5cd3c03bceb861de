"""Tutorial 15 (the Llama block): each check passes the reference solution and rejects the usual wrong
answers with a message that names the mistake; the checks draw new inputs every run; the solutions
equal refimpl's measurements far beyond the public cases (the hidden drawn cases compare students with
the solutions); and the grader scores an edited copy exercise by exercise, failing answers that call
refimpl's own function.

tests/test_tutorials.py runs the tutorial with the solutions and every check on its stub;
tests/test_grade.py grades every solution file; tests/test_grading_hidden.py draws 15.3 and 15.4's
hidden cases."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tutorials"))  # the exercise harness, as the tutorials import it
from harness import llama as checks  # noqa: E402
from harness import run_check  # noqa: E402
from tutorial_util import solution  # noqa: E402

from refimpl.autograd import Tensor, saved_tensors  # noqa: E402
from refimpl.nn import functional as F  # noqa: E402
from refimpl.nn.layers import GroupedQueryAttention  # noqa: E402

TUTORIAL = "15_llama_block"
CHECKS = {"rotary": checks.check_rotary, "relative_score": checks.check_relative_score,
          "kv_bytes": checks.check_kv_bytes, "block_parameters": checks.check_block_parameters}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_solution_passes_its_check(name):
    result = run_check(CHECKS[name], solution(TUTORIAL, name))
    assert result.ok, result


def test_refimpls_rotary_passes_the_check_it_is_compared_with():
    result = run_check(checks.check_rotary, lambda x, positions, base: F.rotary(Tensor(x), positions, base).data)
    assert result.ok, result


# -- wrong rotations --------------------------------------------------------------------------------------

def _rope(**mistake):
    return lambda x, positions, base: checks._rope_numpy(x, positions, base, **mistake)


def _from_zero(x, positions, base):
    return checks._rope_numpy(x, np.arange(x.shape[-2]), base)


def _in_place(x, positions, base):
    x[...] = checks._rope_numpy(x, positions, base)
    return x


def _nan_at_large_positions(x, positions, base):
    y = checks._rope_numpy(x, positions, base)
    y[..., np.asarray(positions) > 1000, :] = np.nan
    return y


WRONG_ROTATIONS = [
    (_rope(pairing="halves"), "rotate_half"),
    (_rope(exponent=1.0), "base^(−i/D)"),
    (_rope(sign=-1.0), "the other way"),
    (_from_zero, "use positions[t]"),
    (_in_place, "changed x in place"),
    (_nan_at_large_positions, "NaN or ±inf"),
    (lambda x, positions, base: x[..., :-1], "expected x's shape"),
    (lambda x, positions, base: "rotated", "return a NumPy array"),
]


@pytest.mark.parametrize("wrong, says", WRONG_ROTATIONS, ids=[w[1][:30] for w in WRONG_ROTATIONS])
def test_the_rotary_check_rejects_wrong_rotations_with_the_reason(wrong, says):
    result = run_check(checks.check_rotary, wrong)
    assert result.status in ("wrong", "error") and says in result.message, result


def test_the_rotary_check_draws_new_inputs_every_run():
    seen = []

    def recording(x, positions, base):
        seen.append((x.shape, float(x.ravel()[0]), base))
        return solution(TUTORIAL, "rotary")(x, positions, base)

    for _ in range(2):
        assert run_check(checks.check_rotary, recording).ok
    first, second = seen[: len(seen) // 2], seen[len(seen) // 2:]
    assert first[0] == second[0]  # the fixed readable case
    assert first[1:] != second[1:]  # and new draws after it


# -- the relative property ------------------------------------------------------------------------------------

def _rotated(v, p, base, **mistake):
    return checks._rope_numpy(np.asarray(v, dtype=np.float64)[None, :], [p], base, **mistake)[0]


WRONG_SCORES = [
    (lambda q, k, delta, base: float(q @ k), "no rotation"),
    (lambda q, k, delta, base: float(q @ _rotated(k, -delta, base)), "the sign of the offset"),
    (lambda q, k, delta, base: float(_rotated(q, delta, base) @ k), "the sign of the offset"),
    (lambda q, k, delta, base: float(q @ _rotated(k, delta, base, pairing="halves")), "rotate_half"),
    (lambda q, k, delta, base: float(q @ _rotated(k, delta, base)) * (1 + 1e-6), "by refimpl's rotary"),
    (lambda q, k, delta, base: np.nan, "finite"),
    (lambda q, k, delta, base: [1.0, 2.0], "one number"),
]


@pytest.mark.parametrize("wrong, says", WRONG_SCORES, ids=[f"{i}-{w[1][:24]}" for i, w in enumerate(WRONG_SCORES)])
def test_the_relative_check_rejects_wrong_scores_with_the_reason(wrong, says):
    result = run_check(checks.check_relative_score, wrong)
    assert result.status == "wrong" and says in result.message, result


def test_the_relative_check_draws_new_positions_and_shifts_and_calls_refimpls_rotary(monkeypatch):
    """The expected scores come from refimpl's rotary at (m, n) and at (m + s, n + s), new every run."""
    calls = []
    original = F.rotary

    def recording(x, positions, base=10000.0):
        calls.append(int(np.asarray(positions)[0]))
        return original(x, positions, base)

    monkeypatch.setattr(F, "rotary", recording)
    for _ in range(2):
        assert run_check(checks.check_relative_score, solution(TUTORIAL, "relative_score")).ok
    half = len(calls) // 2
    assert half >= 6 * 5 * 2 * 2 and calls[:half] != calls[half:]


def test_an_absolute_position_answer_cannot_pass():
    """A function of delta alone passes only because scores are invariant under a common shift: a 'score'
    that also depends on where the pair sits (here, a learned absolute term) fails."""
    right = solution(TUTORIAL, "relative_score")
    result = run_check(checks.check_relative_score, lambda q, k, delta, base: right(q, k, delta, base) + 1e-3 * delta)
    assert result.status == "wrong" and "you said" in result.message


# -- the key/value bytes -------------------------------------------------------------------------------------------

def _kv(b, T, H, Hkv, D, item):
    return 2 * b * T * Hkv * D * item


WRONG_KV = [
    (lambda b, T, H, Hkv, D, item: (_kv(b, T, H, H, D, item), H / Hkv), "that is multi-head attention's"),
    (lambda b, T, H, Hkv, D, item: (_kv(b, T, H, Hkv, D, item) // 2, H / Hkv), "two tensors"),
    (lambda b, T, H, Hkv, D, item: (_kv(b, T, H, Hkv, D, item) // item, H / Hkv), "bytes, not elements"),
    (lambda b, T, H, Hkv, D, item: (_kv(b, T, H, Hkv, D, item) * (H // Hkv), H / Hkv), "never copies one"),
    (lambda b, T, H, Hkv, D, item: (_kv(b, T, H, Hkv, D, item), Hkv / H), "upside down"),
    (lambda b, T, H, Hkv, D, item: (_kv(b, T, H, Hkv, D, item), float("inf")), "finite"),
    (lambda b, T, H, Hkv, D, item: _kv(b, T, H, Hkv, D, item), "return the pair"),
]


@pytest.mark.parametrize("wrong, says", WRONG_KV, ids=[w[1][:30] for w in WRONG_KV])
def test_the_kv_check_rejects_wrong_answers_with_the_reason(wrong, says):
    result = run_check(checks.check_kv_bytes, wrong)
    assert result.status == "wrong" and says in result.message, result


@pytest.mark.parametrize("b, T, H, Hkv, D, dtype", [(2, 5, 4, 2, 4, "float64"), (3, 7, 6, 1, 2, "float32"),
                                                      (1, 16, 8, 8, 8, "float64")])
def test_kv_bytes_are_what_the_ledger_saves_beyond_multi_query(b, T, H, Hkv, D, dtype):
    """Exercise 3's bytes are the saved-tensor ledger's too: one layer's forward saves exactly the keys and
    values more than at one key/value head (q, the probabilities and the heads' output do not change)."""
    def ledger(kv_heads):
        layer = GroupedQueryAttention(H * D, H, kv_heads, T, np.random.default_rng(0), dtype=dtype)
        x = Tensor(np.random.default_rng(1).normal(size=(b, T, H * D)).astype(dtype), requires_grad=True)
        saved_tensors.reset_peak()
        before = saved_tensors.live_bytes
        y = layer(x)
        peak = saved_tensors.peak_bytes - before
        y.sum().backward()
        return peak

    kv_bytes = solution(TUTORIAL, "kv_bytes")
    item = np.dtype(dtype).itemsize
    assert ledger(Hkv) - ledger(1) == kv_bytes(b, T, H, Hkv, D, item)[0] - kv_bytes(b, T, H, 1, D, item)[0]
    assert checks.kv_bytes_of_layer(b, T, H, Hkv, D, dtype) == (kv_bytes(b, T, H, Hkv, D, item)[0], item)


# -- a block's parameters ----------------------------------------------------------------------------------------

def _params(d, H, Hkv, F_):
    return solution(TUTORIAL, "block_parameters")(d, H, Hkv, F_)


WRONG_PARAMETERS = [
    (lambda d, H, Hkv, F_: _params(d, H, H, F_), "map d_model to kv_heads·d_head"),
    (lambda d, H, Hkv, F_: _params(d, H, Hkv, F_) - d * F_, "three matrices"),
    (lambda d, H, Hkv, F_: _params(d, H, Hkv, F_) + 2 * d, "a gain and no bias"),
    (lambda d, H, Hkv, F_: _params(d, H, Hkv, F_) - 2 * d, "two RMSNorms"),
    (lambda d, H, Hkv, F_: _params(d, H, Hkv, F_) + 3 * d + 2 * (Hkv * d // H) + 2 * F_, "no biases"),
    (lambda d, H, Hkv, F_: 12 * d * d + 13 * d, "the block has"),
]


@pytest.mark.parametrize("wrong, says", WRONG_PARAMETERS, ids=[w[1][:30] for w in WRONG_PARAMETERS])
def test_the_parameter_check_rejects_wrong_counts_with_the_reason(wrong, says):
    result = run_check(checks.check_block_parameters, wrong)
    assert result.status == "wrong" and says in result.message, result


def test_llama_2_7b_has_the_parameters_its_name_rounds():
    """The public count of Llama 2 7B, 6,738,415,616: 32 blocks, two untied embeddings of 32,000 × 4,096 and
    the final RMSNorm, with the solution's block and with refimpl's memory model."""
    per_block = _params(4096, 32, 32, 11008)
    assert per_block == checks.formula_block_parameters(4096, 32, 32, 11008) == 202_383_360
    assert 32 * per_block + 2 * 32_000 * 4096 + 4096 == 6_738_415_616
    assert 32 * _params(4096, 32, 8, 14336) + 2 * 128_256 * 4096 + 4096 == 8_030_261_248  # Llama 3 8B


def test_the_solutions_equal_refimpl_far_beyond_the_public_cases():
    """The hidden cases (tutorials/grading/hidden.py) compare a student with the solutions: the solutions
    equal what refimpl builds and measures over many shapes."""
    kv_bytes, params = solution(TUTORIAL, "kv_bytes"), solution(TUTORIAL, "block_parameters")
    for b, T, H, Hkv, D in [(1, 1, 1, 1, 2), (2, 9, 12, 4, 6), (3, 4, 16, 2, 2), (1, 3, 10, 5, 8)]:
        for dtype in ("float32", "float64"):
            item = np.dtype(dtype).itemsize
            measured = checks.kv_bytes_of_layer(b, T, H, Hkv, D, dtype)[0]
            multi_head = checks.kv_bytes_of_layer(b, T, H, H, D, dtype)[0]
            assert kv_bytes(b, T, H, Hkv, D, item) == (measured, multi_head / measured)
    for d, H, Hkv, F_ in [(8, 4, 1, 1), (24, 6, 3, 40), (32, 8, 8, 7), (12, 2, 1, 96)]:
        assert params(d, H, Hkv, F_) == checks.built_block_parameters(d, H, Hkv, F_) == \
            checks.formula_block_parameters(d, H, Hkv, F_)


# -- the grader, on an edited copy of the tutorial ---------------------------------------------------------------

def _grade_module():
    path = REPO / "tutorials" / "grade.py"
    spec = importlib.util.spec_from_file_location("tutorials_grade", path)
    module = sys.modules["tutorials_grade"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def _filled(source: str, function: str, body: str) -> str:
    start = source.index(f"@ex.stub\ndef {function}(")
    end = source.index("\n\n\n", start)
    return source[:start] + "@ex.stub\n" + body.strip() + source[end:]


def test_the_grader_scores_an_edited_copy_exercise_by_exercise(tmp_path):
    source = (REPO / "tutorials" / f"{TUTORIAL}.py").read_text()
    source = _filled(source, "rotary", '''
def rotary(x, positions, base):
    from refimpl.autograd import Tensor
    from refimpl.nn import functional as F
    return F.rotary(Tensor(x), positions, base).data
''')
    source = _filled(source, "relative_score", '''
def relative_score(q, k, delta, base):
    import numpy as np
    D = len(k)
    angles = delta * base ** (-np.arange(0, D, 2) / D)
    cos, sin = np.cos(angles), np.sin(angles)
    k_even = k[0::2] * cos - k[1::2] * sin
    k_odd = k[0::2] * sin + k[1::2] * cos
    return float(q[0::2] @ k_even + q[1::2] @ k_odd)
''')
    source = _filled(source, "kv_bytes", '''
def kv_bytes(b, T, n_head, kv_heads, d_head, itemsize):
    return b * T * kv_heads * d_head * itemsize, n_head / kv_heads
''')
    path = tmp_path / f"{TUTORIAL}.py"
    path.write_text('raise SystemExit("the tutorial itself must not run")\n' + source)
    grade = _grade_module()
    report = grade.summary(grade.grade_files([path], timeout=30))
    results = {r["exercise"]: r for r in report["results"] if r["tutorial"] == TUTORIAL}
    assert [results[n]["result"] for n in range(1, 5)] == ["fail", "pass", "fail", "not done"], results
    assert results[1]["reason"] == "forbidden", results
    assert results[3]["reason"] == "wrong" and "two tensors" in results[3]["message"], results
    assert (results[1]["max_points"], results[2]["max_points"], results[3]["max_points"]) == (2, 2, 1)
