"""Sharded checkpoints: save at N = 4, resume at N = 4 (bitwise), 2 and 3 (other stages), consolidate,
and bad checkpoints (corrupt, missing, interrupted, another model) that stop with one line and
overwrite nothing."""

import json
import os
import shutil

import numpy as np
import pytest
from mpi_util import run_local, run_local_json, run_mpi_json
from test_zero import run_mpi_error

from refimpl.tools.run import TrainConfig, build_model, build_task, train
from refimpl.tools.saved_runs import sharded

pytestmark = pytest.mark.mpi

# float64, dropout on (masks keyed by batch and row, so they survive a change of N), 6 steps in all
TRAIN = ["-m", "refimpl", "train", "--model", "gpt", "--n-layer", "1", "--d-model", "8", "--n-head", "2",
         "--seq-len", "8", "--dtype", "float64", "--batch-size", "12", "--steps", "6", "--dropout", "0.1",
         "--lr", "1e-2", "--weight-decay", "0.01", "--json"]


def assert_same(a: dict, b: dict, rtol: float | None = None) -> None:
    assert set(a) == set(b)
    for name in a:
        if rtol is None:
            assert np.array_equal(a[name], b[name]), name
        else:
            np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=1e-12, err_msg=name)


def load(path: str) -> dict:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """ZeRO-3 at N = 4 for 6 steps, checkpoints after steps 3 and 6, and the consolidated step 6."""
    root = tmp_path_factory.mktemp("zero_ckpt")
    summary = run_mpi_json(4, TRAIN + ["--zero", "3", "--save-dir", root / "run", "--save-every", "3"], timeout=180)
    assert summary["zero_stage"] == 3 and summary["optimizer_steps"] == 6
    final = str(root / "final.npz")
    sharded.consolidate(str(root / "run" / "step_00000006"), final, optimizer=True)
    return root


def test_save_writes_one_shard_per_rank_and_a_manifest_last(saved):
    step3 = saved / "run" / "step_00000003"
    names = sorted(os.listdir(step3))
    assert names == ["manifest.json"] + [f"shard_{r:05d}_of_00004.npz" for r in range(4)]
    manifest = sharded.read(str(step3)).manifest
    assert manifest["world_size"] == 4 and manifest["zero_stage"] == 3 and manifest["step"] == 3
    assert manifest["optimizer"] == {"name": "adamw", "step": 3}
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])


def test_resume_at_the_same_world_size_and_stage_is_bitwise_identical(saved):
    run_mpi_json(4, TRAIN + ["--zero", "3", "--resume", saved / "run" / "step_00000003", "--save-dir",
                             saved / "again"], timeout=180)
    out = str(saved / "again.npz")
    sharded.consolidate(str(saved / "again"), out, optimizer=True)  # the newest: step 6
    assert_same(load(out), load(str(saved / "final.npz")))  # parameters and optimizer state, bit for bit


@pytest.mark.parametrize("n,stage,accum", [(2, 0, 1), (3, 1, 1), (3, 2, 1), (2, 1, 3)])
def test_resume_at_another_world_size_and_stage(saved, n, stage, accum):
    tag = f"n{n}z{stage}a{accum}"  # --grad-accum, too, splits the same global batch otherwise
    summary = run_mpi_json(n, TRAIN + ["--zero", str(stage), "--grad-accum", str(accum), "--resume",
                                       saved / "run" / "step_00000003", "--save-dir", saved / tag], timeout=180)
    assert summary["world_size"] == n and summary["start_step"] == 3 and summary["steps"] == 6
    assert summary["forward_calls_per_layer"] == 1.0  # per step run here (3 of the 6), not per step in all
    out = str(saved / f"{tag}.npz")
    sharded.consolidate(str(saved / tag), out, optimizer=True)
    assert sharded.read(str(saved / tag)).manifest["world_size"] == n
    assert_same(load(out), load(str(saved / "final.npz")), rtol=1e-10)  # sums in another order only


def test_consolidated_state_dict_loads_into_the_model(saved, tmp_path):
    result = run_local_json(["-m", "refimpl", "consolidate", saved / "run", "--out", tmp_path / "m.npz", "--json"])
    assert result["step"] == 6 and result["saved_world_size"] == 4 and result["saved_zero_stage"] == 3
    cfg = TrainConfig(model="gpt", n_layer=1, d_model=8, n_head=2, seq_len=8, dtype="float64")
    model = build_model(cfg, build_task(cfg))
    state = load(str(tmp_path / "m.npz"))
    model.load_state_dict(state)  # strict: exactly the model's names and shapes
    assert result["elements"] == model.num_parameters() and result["parameters"] == len(state)
    full = load(str(saved / "final.npz"))
    assert_same(state, {k: v for k, v in full.items() if not k.startswith("optimizer/")})


def test_corrupt_or_missing_shard_is_a_clear_error_and_overwrites_nothing(saved, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(saved / "run" / "step_00000003", corrupt)
    shard = corrupt / "shard_00002_of_00004.npz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = tmp_path / "precious.npz"
    out.write_bytes(b"do not overwrite me")
    with pytest.raises(ValueError, match="shard shard_00002_of_00004.npz is corrupt"):
        sharded.consolidate(str(corrupt), str(out))
    missing = tmp_path / "missing"
    shutil.copytree(saved / "run" / "step_00000003", missing)
    os.remove(missing / "shard_00001_of_00004.npz")
    done = run_local(["-m", "refimpl", "consolidate", missing, "--out", out])
    assert done.returncode == 2 and "shard shard_00001_of_00004.npz is missing" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert out.read_bytes() == b"do not overwrite me" and not os.path.exists(str(out) + ".tmp")
    # resuming from the corrupt checkpoint: every rank stops before training or saving anything
    resumed = run_mpi_error(2, TRAIN + ["--zero", "2", "--resume", corrupt, "--save-dir", tmp_path / "never"],
                            timeout=120)
    assert resumed.returncode == 2 and "is corrupt" in resumed.stderr and "Traceback" not in resumed.stderr
    assert not (tmp_path / "never").exists()


def test_a_save_dir_that_cannot_be_written_stops_the_run_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    done = run_mpi_error(2, TRAIN + ["--zero", "1", "--save-dir", blocker / "run"], timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    message = f"error: --save-dir '{blocker / 'run'}' cannot be written: Not a directory"
    assert done.stderr.count(message) == 1, done.stderr  # every rank agreed; rank 0 says it once
    assert "step 1/" not in done.stderr and "done:" not in done.stderr  # not one step was trained


def test_checkpoint_from_another_model_is_a_clear_error(saved, tmp_path):
    other = [a if a != "8" else "16" for a in TRAIN]  # --d-model 16 (and --seq-len 16: a different task too)
    done = run_mpi_error(2, other + ["--zero", "1", "--resume", saved / "run" / "step_00000003"], timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert lines and all("is of another run" in line for line in lines), done.stderr
    assert "(differs in --d-model: 8 there, 16 here; --seq-len: 8 there, 16 here)" in done.stderr
    # a manifest without a fingerprint (an older refimpl) still has its model's shapes checked
    old = tmp_path / "old"
    shutil.copytree(saved / "run" / "step_00000003", old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["fingerprint"], manifest["manifest_sha256"]
    manifest["format"] = "refimpl-sharded-checkpoint/1"
    (old / "manifest.json").write_text(json.dumps(manifest))
    cfg = TrainConfig(model="gpt", n_layer=1, d_model=16, n_head=2, seq_len=16, dtype="float64")
    with pytest.raises(ValueError,
                       match=r"is from another model \(wte.weight \(11, 8\) there, wte.weight \(11, 16\) here;"):
        sharded.check_model(sharded.read(str(old)), build_model(cfg, build_task(cfg)), cfg)
    assert "records no run fingerprint" in sharded.check_run(sharded.read(str(old)), cfg)


def test_interrupted_save_is_never_loaded_and_nothing_left_to_train_is_an_error(saved, tmp_path):
    root = tmp_path / "runs"
    shutil.copytree(saved / "run" / "step_00000003", root / "step_00000003")
    os.makedirs(root / "step_00000009")  # a save that died before its manifest
    (root / "step_00000009" / "shard_00000_of_00004.npz").write_bytes(b"partial")
    assert sharded.locate(str(root)) == str(root / "step_00000003")
    with pytest.raises(ValueError, match="step_00000009: incomplete, no manifest.json"):
        sharded.locate(str(root / "step_00000009"))
    with pytest.raises(ValueError, match="leaves nothing to train"):
        train(TrainConfig(model="gpt", n_layer=1, d_model=8, n_head=2, seq_len=8, dtype="float64", batch_size=12,
                          dropout=0.1, lr=1e-2, weight_decay=0.01, steps=3, resume=str(root)), progress=False)


def test_mixed_precision_resume_is_bitwise_in_one_process(tmp_path):
    base = dict(model="gpt", n_layer=1, d_model=8, n_head=2, seq_len=8, dtype="mixed", zero=2, batch_size=4,
                steps=4, lr=1e-2)
    train(TrainConfig(**base, save_dir=str(tmp_path / "a"), save_every=2), progress=False)
    train(TrainConfig(**base, save_dir=str(tmp_path / "b"), resume=str(tmp_path / "a" / "step_00000002")),
          progress=False)
    a, b = (sharded.read(str(tmp_path / d)) for d in ("a", "b"))
    assert a.step == b.step == 4 and a.manifest["loss_scaler"] == b.manifest["loss_scaler"]
    assert a.masters["wte.weight"].dtype == np.float32  # master weights, not the float16 parameters
    assert_same(a.masters, b.masters)
    for key in a.states:
        assert_same(a.states[key], b.states[key])
