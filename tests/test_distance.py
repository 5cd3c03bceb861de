"""distance (refimpl/tools/distance.py, `python -m refimpl distance`): how far an algorithm that is not
meant to be equivalent is from single-process training, and the shapes docs/distance.md promises.

- The measures: relative error and cosine, their conventions at zero, drawn vectors.
- Lockstep really starts both sides from the same parameters: top-k without error feedback then
  hands the optimizer exactly top_k(g) of the reference's g, so error² + cosine² = 1 at every step.
- Error feedback: the accumulated gradient error is what the memory holds (Σ(ĝ − g) = −e, exactly),
  it stays under the contraction's bound q/(1 − q)·max‖g‖, and it stays flat; without the memory it
  grows, well past error feedback's.
- An equivalent algorithm is at distance zero (rounding); local SGD averaging after every step with
  SGD has data parallelism's parameters (update error and drift at rounding) although each rank's
  gradient is its own share's (2 MPI ranks, through the command, with --json and --plot).
- Bad input is one line, exit status 2.
"""

from __future__ import annotations

import math
import runpy

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from mpi_util import REPO, run_mpi_json
from threadpoolctl import threadpool_limits

from refimpl.local_trainer import LocalTrainer
from refimpl.parallel.comm import LocalComm
from refimpl.tools.cli import main
from refimpl.tools.distance import cosine, distance_run, relative_error
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task

EXAMPLES = REPO / "docs" / "examples"
# The configuration of docs/distance.md's figures: a 1-block GPT on the sorting task, SGD, no clipping.
FLAGS = ["--n-layer", "1", "--d-model", "32", "--seq-len", "8", "--optimizer", "sgd", "--lr", "0.1", "--clip", "0"]
CONFIG = dict(model="gpt", batch_size=32, lr=0.1, optimizer="sgd", clip=0.0, dtype="float64", n_layer=1, d_model=32,
              n_head=4, seq_len=8)


# -- the measures ----------------------------------------------------------------------------------

finite = st.floats(-1e3, 1e3, allow_nan=False)


@given(reference=arrays(np.float64, st.integers(1, 20), elements=finite),
       factor=st.floats(-4.0, 4.0).filter(lambda f: f == 0 or abs(f) > 1e-6))
def test_a_scaled_copy_has_relative_error_of_the_scale_and_cosine_of_its_sign(reference, factor):
    if np.linalg.norm(reference) < 1e-100:
        reference = reference + 1.0
    assert relative_error(factor * reference, reference) == pytest.approx(abs(factor - 1), rel=1e-9, abs=1e-12)
    expected_cosine = 0.0 if factor == 0 else math.copysign(1.0, factor)
    assert cosine(factor * reference, reference) == pytest.approx(expected_cosine, abs=1e-9)


def test_the_conventions_at_zero():
    zero, one = np.zeros(3), np.ones(3)
    assert relative_error(zero, zero) == 0.0 and relative_error(one, zero) == math.inf
    assert cosine(zero, zero) == 1.0 and cosine(one, zero) == 0.0 and cosine(zero, one) == 0.0
    assert math.isnan(relative_error(np.array([np.nan]), one[:1]))


# -- top-k with and without error feedback, in one process ------------------------------------------

@pytest.fixture(scope="module")
def topk():
    """100 steps of top-10% sparsification, without and with error feedback (one process)."""
    example = runpy.run_path(str(EXAMPLES / "topk_trainer.py"))
    cfg = TrainConfig(steps=100, **CONFIG)
    with threadpool_limits(limits=1):  # small matrices: BLAS threads only contend with the other tests' processes
        result = distance_run(cfg, LocalComm(), [("without", example["make_trainer"]),
                                                  ("with", example["make_error_feedback_trainer"])], eval_every=10)
    without, with_feedback = result["trainers"]
    return result, without, with_feedback


def test_lockstep_starts_both_sides_from_the_same_parameters(topk):
    _, without, _ = topk
    error, cos = (np.array(without["model"][k]) for k in ("gradient_error", "cosine"))
    # ĝ = top_k(g) of the same g: ĝ ⟂ g − ĝ, so ‖g − ĝ‖² + ‖ĝ‖² = ‖g‖², and cos(ĝ, g) = ‖ĝ‖/‖g‖
    np.testing.assert_allclose(error ** 2 + cos ** 2, 1.0, rtol=0, atol=1e-12)
    k, size = without["report"]["k"], without["report"]["k"] / without["report"]["ratio"]
    assert (error <= math.sqrt(1 - k / size) + 1e-12).all()  # top-k keeps at least k/Ψ of ‖g‖²
    assert (error > 0.05).all()


def test_error_feedback_accumulated_error_stays_under_its_bound_and_flat(topk):
    _, _, with_feedback = topk
    accumulated = np.array(with_feedback["model"]["accumulated_error"])  # ‖Σ(ĝ − g)‖ / mean ‖g‖
    norms = np.array(with_feedback["model"]["gradient_norm"])  # ‖g_t‖
    assert np.isfinite(accumulated).all()
    steps = np.arange(1, len(norms) + 1)
    missed = accumulated * np.cumsum(norms) / steps  # ‖Σ_{s≤t}(ĝ_s − g_s)‖ = ‖e_{t+1}‖ (one process)
    # ‖a − top_k(a)‖ <= q ‖a‖ with q = √(1 − k/Ψ): the memory stays below q/(1 − q)·max_{s≤t} ‖g_s‖
    q = math.sqrt(1 - with_feedback["report"]["k"] / (with_feedback["report"]["k"] / with_feedback["report"]["ratio"]))
    assert (missed <= q / (1 - q) * np.maximum.accumulate(norms) * (1 + 1e-9)).all()
    assert missed[-1] == pytest.approx(with_feedback["report"]["memory_norm"], rel=1e-9)
    # flat: the second half never far above the first
    assert accumulated[50:].max() <= 1.5 * accumulated[10:50].max()


def test_error_feedback_identity_holds_exactly():
    """Σ_s (ĝ_s − g_s) = −e: checked with the trainer itself against a lockstep LocalTrainer."""
    example = runpy.run_path(str(EXAMPLES / "topk_trainer.py"))
    cfg = TrainConfig(steps=20, **CONFIG)
    task = build_task(cfg)
    model, ref_model = build_model(cfg, task), build_model(cfg, task)
    trainer = example["make_error_feedback_trainer"](cfg, model, LocalComm())
    trainer.record_grads = True
    reference = LocalTrainer(ref_model, build_optimizer(cfg, ref_model.parameters()), 1, 0.0)
    reference.record_grads = True
    names = [name for name, _ in model.named_parameters()]
    missed = np.zeros(trainer.memory.size)
    for step in range(cfg.steps):
        ref_model.load_state_dict(model.state_dict())
        x, y = task.batch(step, cfg.batch_size)
        trainer.step(x, y)
        reference.step(x, y)
        missed += np.concatenate([(trainer.last_grads[n] - reference.last_grads[n]).ravel() for n in names])
        np.testing.assert_allclose(missed, -trainer.memory, rtol=0, atol=1e-12)


def test_without_error_feedback_the_accumulated_error_grows(topk):
    _, without, with_feedback = topk
    accumulated = np.array(without["model"]["accumulated_error"])
    assert accumulated[99] >= 5 * accumulated[0]
    assert accumulated[99] >= 2 * accumulated[9]
    assert accumulated[99] >= 2 * np.max(with_feedback["model"]["accumulated_error"])
    assert without["report"]["memory_norm"] == 0.0


def test_the_report_labels_the_worst_difference(topk):
    result, without, with_feedback = topk
    for measured in (without, with_feedback):
        assert measured["worst"]["kind"] in ("gradient", "parameter", "loss")
        assert set(measured["worst_by_kind"]) == {"gradient", "parameter", "loss"}
        by_kind = measured["worst_by_kind"]
        assert measured["worst"]["value"] == max(w["value"] for w in by_kind.values())
        assert by_kind["gradient"]["mode"] == "lockstep gradient error"
        assert by_kind["parameter"]["mode"] in ("lockstep update error", "free-running drift")
        assert measured["held_out"]["steps"] == list(range(9, 100, 10))
        assert len(measured["loss"]) == 100 and measured["problems"] == []
    assert len(result["reference"]["loss"]) == 100


def test_an_equivalent_algorithm_is_at_distance_zero():
    example = runpy.run_path(str(EXAMPLES / "flat_allreduce_trainer.py"))
    cfg = TrainConfig(steps=5, **CONFIG)
    measured = distance_run(cfg, LocalComm(), [("flat", example["make_trainer"])], eval_every=5)["trainers"][0]
    for key in ("gradient_error", "update_error", "drift", "accumulated_error"):
        assert max(measured["model"][key]) <= 1e-12, key
    assert min(measured["model"]["cosine"]) >= 1 - 1e-12
    assert measured["worst"]["value"] <= 1e-10


# -- local SGD on two ranks, through the command --------------------------------------------------

@pytest.mark.mpi
def test_local_sgd_on_two_ranks(tmp_path):
    spec = str(EXAMPLES / "local_sgd_trainer.py")
    plot = tmp_path / "distance.png"
    result = run_mpi_json(2, ["-m", "refimpl", "distance", "--trainer", f"{spec}:make_every_step_trainer",
                              "--trainer", f"{spec}:make_trainer", *FLAGS, "--steps", "12", "--json",
                              "--eval-every", "4"]
                          + (["--plot", str(plot)] if _has_matplotlib() else []), timeout=180)
    assert result["world_size"] == 2 and result["steps"] == 12
    every_step, every_fourth = result["trainers"]
    # H = 1 with SGD: the average of the replicas' steps is the step of the average gradient
    assert max(every_step["model"]["update_error"]) <= 1e-10
    assert max(every_step["model"]["drift"]) <= 1e-9
    assert min(every_step["model"]["gradient_error"]) >= 0.05  # rank 0's gradient is its own share's
    # H = 4: the replicas drift apart between averages
    assert every_fourth["model"]["drift"][-1] >= 1e-3
    assert every_fourth["report"] == {"trainer": "LocalSGDTrainer", "sync_every": 4, "averages": 3}
    assert every_fourth["held_out"]["steps"] == [3, 7, 11]
    if _has_matplotlib():
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401, PLC0415 - optional
    except ImportError:
        return False
    return True


# -- bad input ---------------------------------------------------------------------------------------

LACKING = """
class Lacking:
    world_size, rank = 1, 0

    def step(self, x, y):
        return 0.0


def make(cfg, model, world):
    return Lacking()
"""


PARTIAL = """
from refimpl.local_trainer import LocalTrainer
from refimpl.tools.run import build_optimizer


class Partial(LocalTrainer):
    @property
    def last_grads(self):
        return {name: g for name, g in self._grads.items() if name != "wpe.weight"}

    @last_grads.setter
    def last_grads(self, grads):
        self._grads = grads


def make(cfg, model, world):
    return Partial(model, build_optimizer(cfg, model.parameters()), 1, cfg.clip)
"""


@pytest.mark.parametrize("argv, pattern", [
    (["--trainer", "{examples}/nowhere.py:make_trainer"], "nowhere.py"),
    (["--trainer", "{tmp}/partial.py:make"], "Partial.last_grads lacks 'wpe.weight'"),
    (["--trainer", "{examples}/topk_trainer.py:top_k"], "must take (cfg, model, world)"),
    (["--trainer", "{tmp}/lacking.py:make"], "Lacking lacks full_parameters, record_grads, last_grads"),
    (["--trainer", "{examples}/topk_trainer.py:make_trainer", "--eval-every", "0"], "--eval-every must be a positive"),
    (["--trainer", "{examples}/topk_trainer.py:make_trainer", "--plot", "{tmp}/x.txt"], "ending in .png, .svg, .pdf"),
    (["--trainer", "{examples}/topk_trainer.py:make_trainer", "--plot", "{tmp}/no/x.png"], "no such directory"),
    (["--trainer", "{examples}/topk_trainer.py:make_trainer", "--lr", "nan"], "--lr must be positive and finite"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, pattern):
    (tmp_path / "lacking.py").write_text(LACKING)
    (tmp_path / "partial.py").write_text(PARTIAL)
    argv = [a.format(examples=EXAMPLES, tmp=tmp_path) for a in argv]
    try:
        code = main(["distance", *FLAGS, "--steps", "2", *argv])  # the later of two flags wins
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, captured
    assert len(lines) == 1 and lines[0].startswith("error: ") and pattern in lines[0], lines
