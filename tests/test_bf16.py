"""bfloat16 training (--dtype bf16): bfloat16 parameters, float32 gradients, master weights and
arithmetic, no loss scale; verified against one process in lockstep at bfloat16's bounds."""

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from mpi_util import PROGRAMS, last_json, run_mpi

from refimpl import backend
from refimpl.local_trainer import LocalTrainer
from refimpl.memory import bytes_per_parameter, model_state_bytes
from refimpl.optim.precision import storage_dtype
from refimpl.parallel.comm import get_world
from refimpl.tools.compare_mixed import mixed_tolerance
from refimpl.tools.flags import config_from_flags
from refimpl.tools.run import build_model, build_optimizer, build_task, make_trainer

SMALL = ["--dtype", "bf16", "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8"]
BF16 = np.dtype(ml_dtypes.bfloat16)


def trainer_for(*flags, world=None, distributed=None):
    cfg = config_from_flags([*SMALL, *flags])
    task = build_task(cfg)
    model = build_model(cfg, task)
    return cfg, task, model, make_trainer(cfg, model, world, distributed)


def test_the_tolerance_uses_bfloat16s_unit_roundoff():
    tol = mixed_tolerance(world_size=2, grad_accum=3, dtype="bf16")
    assert tol["u"] == 2.0 ** -8 and tol["grad_rtol"] == 4 * 6 * 2.0 ** -8 and tol["loss_rtol"] == 4 * 6 * 2.0 ** -8
    assert mixed_tolerance(2, 3)["grad_rtol"] == 4 * 6 * 2.0 ** -11  # float16's, unchanged
    with pytest.raises(ValueError, match="dtype must be one of"):
        mixed_tolerance(2, 3, dtype="float8")


def test_what_is_stored_in_bfloat16_and_what_in_float32():
    assert storage_dtype("bf16") == "bfloat16" and bytes_per_parameter("bf16") == (2, 4, 12)
    cfg, task, model, trainer = trainer_for("--steps", "1")
    assert isinstance(trainer, LocalTrainer)
    assert all(p.dtype == BF16 for p in model.parameters())
    trainer.step(*task.batch(0, cfg.batch_size))
    assert all(p.grad.dtype == np.float32 for p in model.parameters())  # accumulated in float32
    assert all(m.dtype == np.float32 for m in trainer.masters)
    assert all(np.array_equal(p.data, m.astype(BF16)) for p, m in zip(model.parameters(), trainer.masters))
    logits = model(task.batch(0, 2)[0])
    assert logits.dtype == np.float32  # activations: float32 arithmetic on bfloat16 weights


def test_a_bfloat16_gradient_is_each_micro_batchs_rounded_gradient_summed_in_float32():
    """Two micro-batches: the float32 gradient is bf16(g₁) + bf16(g₂), as the ZeRO buffers sum them."""
    cfg, task, model, trainer = trainer_for("--steps", "1", "--grad-accum", "2", "--batch-size", "4", "--clip", "0")
    x, y = task.batch(0, 4)
    from refimpl.objective import count_targets, micro_batch_loss  # noqa: PLC0415 - only here

    pieces = []
    for i in range(2):
        for p in model.parameters():
            p.grad = None
        micro_batch_loss(model, x[2 * i:2 * i + 2], y[2 * i:2 * i + 2], count_targets(y), rows=(2 * i, 4, 0)).backward()
        pieces.append([p.grad.copy() for p in model.parameters()])
    assert all(g.dtype == BF16 for g in pieces[0])  # the engine rounds each gradient to the parameter's dtype
    for p in model.parameters():
        p.grad = np.zeros(p.shape, np.float32)
    trainer.record_grads = True
    trainer.step(x, y)
    for g, a, b in zip(trainer.last_grads.values(), *pieces):
        assert np.array_equal(g, a.astype(np.float32) + b.astype(np.float32))


def test_training_in_bfloat16_follows_float32_closely():
    losses = {}
    for dtype in ("bf16", "float32"):
        cfg = config_from_flags([*SMALL[2:], "--dtype", dtype, "--steps", "80", "--lr", "1e-2"])
        task = build_task(cfg)
        trainer = make_trainer(cfg, build_model(cfg, task), None)
        losses[dtype] = [trainer.step(*task.batch(s, cfg.batch_size)) for s in range(cfg.steps)]
    bf16, f32 = np.array(losses["bf16"]), np.array(losses["float32"])
    assert np.all(np.isfinite(bf16)) and bf16[-5:].mean() < 0.4 * bf16[:5].mean()  # it learns
    np.testing.assert_allclose(bf16[:5], f32[:5], rtol=1e-2)  # the same start, to bfloat16's rounding
    assert abs(bf16[-5:].mean() - f32[-5:].mean()) < 0.25 * f32[-5:].mean()


def test_master_weights_keep_small_updates_that_bfloat16_weights_would_lose():
    """With lr 1e-5, AdamW moves each weight by about 1e-5 a step, under half a bfloat16 spacing of
    any |w| > 2^-8 · 2 · 1e-5 ≈ 0.005: weights kept in bfloat16 only never move; the float32 master
    weights accumulate the updates and the bfloat16 copies follow."""

    class BfloatOnly(LocalTrainer):  # the planted bug: no master weights, the update rounded into bfloat16
        def _master_weight_step(self, grads):
            super()._master_weight_step(grads)
            for p, master in zip(self.params, self.masters):
                master[...] = p.data.astype(np.float32)

    moved = {}
    for kind in (LocalTrainer, BfloatOnly):
        cfg = config_from_flags([*SMALL, "--steps", "200", "--lr", "1e-5"])
        task = build_task(cfg)
        model = build_model(cfg, task)
        trainer = kind(model, build_optimizer(cfg, model.parameters()), cfg.grad_accum, cfg.clip)
        w = model.blocks[0].mlp.layers[0].weight
        start = w.data.astype(np.float32).copy()
        for s in range(cfg.steps):
            trainer.step(*task.batch(s, cfg.batch_size))
        large = np.abs(start) > 0.01
        moved[kind.__name__] = float(np.mean(w.data.astype(np.float32)[large] != start[large]))
    assert moved["BfloatOnly"] == 0.0  # bfloat16-only weights stopped moving
    assert moved["LocalTrainer"] > 0.5, moved  # the master weights carried the updates


def test_bfloat16_parameters_travel_as_bits_and_are_never_reduced():
    comm = get_world()
    a = np.array([1.5, -2.25, 3.0], dtype=BF16)
    out = comm.allgather(a)
    assert out.dtype == BF16 and np.array_equal(out, a)  # one rank: its own block, bit for bit
    with pytest.raises(ValueError, match="bfloat16, which MPI cannot reduce"):
        comm.allreduce(a.copy())


def test_bfloat16_on_cupy_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(backend, "name", lambda: "cupy")
    with pytest.raises(ValueError, match=r"^--dtype bf16 runs on the numpy backend only"):
        backend.check_dtype("bfloat16")


def test_without_ml_dtypes_bfloat16_says_how_to_install_it():
    code = ("import sys; sys.modules['ml_dtypes'] = None\n"
            "from refimpl.tools.cli import main\n"
            "sys.exit(main(['train', '--dtype', 'bf16', '--steps', '1']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: --dtype bf16 stores arrays in bfloat16 from ml_dtypes")
    assert done.stderr.rstrip().endswith("pip install ml_dtypes")


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--pp", "2"], ["--experts", "2", "--ep", "2"],
                                   ["--tp", "2", "--pp", "2", "--sequence-parallel"]])
def test_model_parallel_layers_accept_bfloat16(flags):
    """What they compute under bf16: tests/test_bf16_parallel.py."""
    assert config_from_flags([*SMALL, *flags]).dtype == "bf16"


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_ledger_counts_two_byte_parameters_and_float32_state(zero):
    """One rank of the ZeRO strategies (and LocalTrainer, below): the ledger's model states are
    memory.py's formula with (P, G, K) = (2, 4, 12), category by category."""
    cfg, task, model, trainer = trainer_for("--steps", "1", "--zero", str(zero), world=get_world(), distributed=True)
    trainer.step(*task.batch(0, cfg.batch_size))
    psi = sum(p.size for p in model.parameters())
    held = trainer.ledger.model_state()
    assert held == {"parameters": 2 * psi, "gradients": 4 * psi, "master_weights": 4 * psi,
                    "optimizer_states": 8 * psi}
    assert sum(held.values()) == model_state_bytes(zero, psi, 1, *bytes_per_parameter("bf16")) == 18 * psi
    if zero == 0:
        _, _, _, local = trainer_for("--steps", "1")
        assert isinstance(local, LocalTrainer) and local.ledger.model_state() == held


# -- against one process, on two ranks --------------------------------------------------------------
VERIFY = ["--dtype", "bf16", "--steps", "3", "--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "8",
          "--batch-size", "8"]


@pytest.mark.mpi
def test_verify_bf16_equals_one_process_on_every_zero_stage(tmp_path):
    cases = [VERIFY + ["--zero", str(z)] for z in range(4)]
    cases += [VERIFY + ["--zero", "2", "--grad-accum", "2", "--optimizer", "sgd", "--clip", "0", "--collectives",
                        "ring"],
              VERIFY + ["--zero", "1", "--arch", "llama", "--kv-heads", "1", "--ffn-size", "24"],
              VERIFY + ["--zero", "3", "--arch", "llama", "--grad-accum", "2"]]
    path = tmp_path / "bf16.json"
    path.write_text(json.dumps(cases))
    done = run_mpi(2, [PROGRAMS / "verify_many.py", path], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for r in last_json(done):
        assert r["ok"], (r["flags"], r["problems"], r["tolerance_used"])
        assert r["strategy"].startswith("ZeroStage") and r["skipped_steps"] == 0


PLANTED = (
    "import sys\n"
    "from refimpl.parallel.zero import optimizer\n"
    "original = optimizer.ShardedOptimizer.step\n"
    "def step(self, grads, total=None):\n"
    "    result = original(self, grads, total)\n"
    "    for master, block in zip(self.masters, self.param_blocks):\n"
    "        master[...] = block.astype('float32')  # the bug: the weights live in bfloat16 only\n"
    "    return result\n"
    "optimizer.ShardedOptimizer.step = step\n"
    "from refimpl.tools.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer,times", [("sgd", 1000), ("adamw", 10)])
def test_weights_kept_only_in_bfloat16_fail_far_beyond_the_tolerance(tmp_path, optimizer, times):
    script = tmp_path / "no_master_weights.py"
    script.write_text(PLANTED)
    done = run_mpi(2, [script, "verify", *VERIFY, "--zero", "1", "--optimizer", optimizer, "--json"], timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    result = last_json(done)
    assert result["tolerance_used"] >= times and "master weight" in result["worst_what"], result["tolerance_used"]


@pytest.mark.parametrize("zero", [0, 2])
def test_a_bfloat16_run_resumes_bit_for_bit(tmp_path, zero):
    """Saved float32 master weights and optimizer state (not the bfloat16 parameters) continue the run
    exactly: one process (LocalTrainer) and ZeRO-2 on a one-rank world."""
    from refimpl.tools.run import TrainConfig, train  # noqa: PLC0415 - only here
    from refimpl.tools.saved_runs import sharded  # noqa: PLC0415 - only here

    base = dict(model="gpt", arch="llama", kv_heads=1, n_layer=1, d_model=8, n_head=2, seq_len=8, dtype="bf16",
                zero=zero, batch_size=4, steps=4, lr=1e-2)
    train(TrainConfig(**base, save_dir=str(tmp_path / "a"), save_every=2), progress=False)
    train(TrainConfig(**base, save_dir=str(tmp_path / "b"), resume=str(tmp_path / "a" / "step_00000002")),
          progress=False)
    a, b = (sharded.read(str(tmp_path / d)) for d in ("a", "b"))
    assert a.step == b.step == 4 and a.masters["wte.weight"].dtype == np.float32
    for name in a.masters:
        assert np.array_equal(a.masters[name], b.masters[name]), name
    for key in a.states:
        for name in a.states[key]:
            assert np.array_equal(a.states[key][name], b.states[key][name]), (key, name)
