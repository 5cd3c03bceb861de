"""A checkpoint directory belongs to one run: the run's fingerprint in every
manifest; --save-dir refuses another run's directory (or starts over when asked); --resume refuses
any change but length and layout; a save directory falls back past broken newest steps, a named
step does not; shard names are confined to their directory; temporary files are created
exclusively; consolidate under mpiexec. One process unless a test says `mpi`."""

import json
import os
import re
import shutil

import numpy as np
import pytest
from mpi_util import run_local, run_mpi, run_mpi_json
from test_zero import run_mpi_error

from refimpl.tools.run import TrainConfig, train
from refimpl.tools.runtime.failure import AgreedError
from refimpl.tools.saved_runs import fingerprint, safe_files, sharded

BASE = dict(model="gpt", n_layer=1, d_model=8, n_head=2, seq_len=8, dtype="float64", batch_size=4, steps=6,
            lr=1e-2, dropout=0.1)
# the command line of BASE
TRAIN = ["-m", "refimpl", "train", "--model", "gpt", "--n-layer", "1", "--d-model", "8", "--n-head", "2",
         "--seq-len", "8", "--dtype", "float64", "--batch-size", "4", "--steps", "6", "--lr", "1e-2",
         "--dropout", "0.1"]


def run(**changes) -> dict:
    """Train BASE with `changes`, in this process."""
    return train(TrainConfig(**{**BASE, **changes}), progress=False)


def tree(root) -> dict:
    """{relative path: bytes} of every file under root (the exact state of a save directory)."""
    out = {}
    for where, _, files in os.walk(root):
        for name in files:
            path = os.path.join(where, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def state(path) -> dict:
    """Master weights and optimizer state of a checkpoint, by name."""
    checkpoint = sharded.read(str(path))
    return {"step": checkpoint.step, **{f"master/{k}": v for k, v in checkpoint.masters.items()},
            **{f"{kind}/{k}": v for kind, values in checkpoint.states.items() for k, v in values.items()}}


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key]), key


@pytest.fixture
def saved(tmp_path):
    """BASE saved after steps 2, 4 and 6 under tmp_path/ckpt."""
    run(save_dir=str(tmp_path / "ckpt"), save_every=2)
    return tmp_path / "ckpt"


# ------------------------------------------------------------------------------------------------
# The fingerprint
# ------------------------------------------------------------------------------------------------


def test_the_fingerprint_holds_what_defines_a_run_and_nothing_else():
    fields = fingerprint.of(TrainConfig(**BASE))["fields"]
    # A new TrainConfig field lands here unless it is listed in fingerprint.MAY_CHANGE: decide which.
    assert sorted(fields) == ["aux_coef", "batch_size", "capacity_factor", "clip", "d_model", "data", "dropout",
                              "dtype", "experts", "lr", "model", "moe_every", "n_head", "n_layer", "optimizer", "seed",
                              "seq_len", "top_k", "weight_decay"]
    assert not {"steps", "save_every", "save_dir", "resume", "zero", "timeout", "grad_accum"} & set(fields)
    a, b = fingerprint.of(TrainConfig(**BASE)), fingerprint.of(TrainConfig(**{**BASE, "steps": 99, "zero": 3}))
    assert a == b and len(a["sha256"]) == 64
    other = fingerprint.of(TrainConfig(**{**BASE, "seed": 1, "lr": 0.02}))
    assert fingerprint.differences(a, other) == ["--lr: 0.01 there, 0.02 here", "--seed: 0 there, 1 here"]


def test_every_manifest_records_the_fingerprint(saved):
    manifest = sharded.read(str(saved)).manifest
    assert manifest["format"] == "refimpl-sharded-checkpoint/3"
    assert manifest["manifest_sha256"] == sharded.manifest_checksum(manifest)  # its own checksum
    assert manifest["fingerprint"] == json.loads(json.dumps(fingerprint.of(TrainConfig(**BASE))))


# ------------------------------------------------------------------------------------------------
# --save-dir belongs to one run
# ------------------------------------------------------------------------------------------------


def test_another_run_into_the_same_save_dir_is_refused_naming_the_flags(saved):
    before = tree(saved)
    done = run_local(TRAIN + ["--seed", "1", "--lr", "0.02", "--save-dir", saved])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == [f"error: --save-dir {saved} holds 3 checkpoint(s) of another run (step_00000006 differs in "
                      "--lr: 0.01 there, 0.02 here; --seed: 0 there, 1 here); choose another --save-dir, or pass "
                      "--overwrite-checkpoints to delete them and start over"], done.stderr
    assert "step 1/" not in done.stderr  # refused before the first step
    assert tree(saved) == before


def test_a_fresh_run_into_an_empty_or_missing_dir_and_the_same_run_again_are_allowed(tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    run(save_dir=str(tmp_path / "empty"))
    run(save_dir=str(tmp_path / "missing" / "deeper"))
    run(save_dir=str(tmp_path / "empty"), steps=4, save_every=2, grad_accum=2)  # the same run, laid out otherwise
    assert "already holds step_00000006 of this run" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "empty")) == ["step_00000002", "step_00000004", "step_00000006"]


def test_overwrite_checkpoints_starts_over(saved, capsys):
    (saved / "notes.txt").write_text("mine")  # not a checkpoint: left alone
    os.makedirs(saved / "step_00000009")  # an incomplete step and an interrupted save: removed
    os.makedirs(saved / ".step_00000008.0123456789ab.saving")
    run(seed=1, lr=0.02, steps=4, save_dir=str(saved), save_every=2, overwrite_checkpoints=True)
    assert "--overwrite-checkpoints: deleted" in capsys.readouterr().err
    assert sorted(os.listdir(saved)) == ["notes.txt", "step_00000002", "step_00000004"]
    other = fingerprint.of(TrainConfig(**{**BASE, "seed": 1, "lr": 0.02}))
    for step in ("step_00000002", "step_00000004"):
        assert sharded.read(str(saved / step)).manifest["fingerprint"]["sha256"] == other["sha256"]
    # the directory now belongs to the new run: it resumes there, the first run is refused
    summary = run(seed=1, lr=0.02, steps=6, resume=str(saved), save_dir=str(saved))
    assert summary["start_step"] == 4
    with pytest.raises(AgreedError, match="holds 3 checkpoint"):
        run(save_dir=str(saved))


# ------------------------------------------------------------------------------------------------
# --resume continues the same run
# ------------------------------------------------------------------------------------------------


def test_resume_may_change_length_saving_and_layout(saved, tmp_path):
    run(steps=8, resume=str(saved), save_dir=str(saved), save_every=1, zero=2, grad_accum=2, checkpoint="sqrt")
    assert sharded.read(str(saved)).step == 8
    assert sorted(os.listdir(saved))[-2:] == ["step_00000007", "step_00000008"]


@pytest.mark.parametrize("change,flags", [
    (dict(seed=1), "--seed: 0 there, 1 here"),
    (dict(lr=0.02, weight_decay=0.1), "--lr: 0.01 there, 0.02 here; --weight-decay: 0.0 there, 0.1 here"),
    (dict(n_layer=2), "--n-layer: 1 there, 2 here"),
    (dict(optimizer="sgd"), "--optimizer: adamw there, sgd here"),
    (dict(dtype="float32"), "--dtype: float64 there, float32 here"),  # precision may not change
    (dict(dropout=0.0, batch_size=8), "--batch-size: 4 there, 8 here; --dropout: 0.1 there, 0.0 here"),
])
def test_resume_refuses_another_run_naming_the_flags(saved, change, flags):
    before = tree(saved)
    with pytest.raises(AgreedError) as error:
        run(**change, steps=8, resume=str(saved), save_dir=str(saved))
    assert f"checkpoint {saved / 'step_00000006'} is of another run (differs in {flags}); --resume" in str(error.value)
    assert tree(saved) == before


def test_resume_refuses_other_data_and_follows_the_data_not_its_path(tmp_path):
    text = "the quick brown fox jumps over the lazy dog. " * 20
    (tmp_path / "a.txt").write_text(text)
    data = dict(data=str(tmp_path / "a.txt"), steps=2)
    run(**data, save_dir=str(tmp_path / "ckpt"))
    shutil.copy(tmp_path / "a.txt", tmp_path / "copy.txt")  # the same contents elsewhere: the same run
    assert run(data=str(tmp_path / "copy.txt"), steps=3, resume=str(tmp_path / "ckpt"))["start_step"] == 2
    (tmp_path / "a.txt").write_text(text.replace("fox", "cat"))  # the same path, other contents: another run
    with pytest.raises(AgreedError, match=r"differs in --data: .*a\.txt \(sha256 [0-9a-f]{12}\.\.\.\) there, "
                                          r".*a\.txt \(sha256 [0-9a-f]{12}\.\.\.\) here\)"):
        run(**{**data, "steps": 3}, resume=str(tmp_path / "ckpt"))
    with pytest.raises(AgreedError, match=r"differs in --data: .*a\.txt \(sha256 .*\) there, none here"):
        run(steps=3, resume=str(tmp_path / "ckpt"))  # the sorting task instead of the text


def test_resume_refusal_is_one_line_from_the_command(saved):
    done = run_local(TRAIN + ["--seed", "3", "--steps", "8", "--resume", saved])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if line.strip()] == [
        f"error: checkpoint {saved / 'step_00000006'} is of another run (differs in --seed: 0 there, 3 here); "
        "--resume continues a run with the same flags, changing only --steps, --save-every, the world size, --zero "
        "or other flags that do not change what is computed (docs/zero.md)"]


# ------------------------------------------------------------------------------------------------
# Falling back past a broken newest step, and not past a named one
# ------------------------------------------------------------------------------------------------


def truncate_a_shard(step):
    shard = step / "shard_00000_of_00001.npz"
    shard.write_bytes(shard.read_bytes()[:-100])


def delete_the_manifest(step):
    os.remove(step / "manifest.json")


def old_manifest_new_shards(step):
    """What an overwrite of step 6 that died half-way did before saves were staged: the old
    manifest beside the new run's shards (here: step 4's shard under step 6's manifest)."""
    shutil.copy(step.parent / "step_00000004" / "shard_00000_of_00001.npz", step / "shard_00000_of_00001.npz")


@pytest.mark.parametrize("damage,reason", [
    (truncate_a_shard, "shard shard_00000_of_00001.npz is corrupt"),
    (delete_the_manifest, "incomplete, no manifest.json (a save that was interrupted)"),
    (old_manifest_new_shards, "shard shard_00000_of_00001.npz is corrupt"),
])
def test_resume_from_a_save_dir_falls_back_to_the_newest_intact_step(saved, tmp_path, capsys, damage, reason):
    reference = tmp_path / "reference"
    run(steps=8, resume=str(saved / "step_00000004"), save_dir=str(reference))
    damage(saved / "step_00000006")
    summary = run(steps=8, resume=str(saved), save_dir=str(saved), save_every=2)
    err = capsys.readouterr().err
    assert summary["start_step"] == 4
    assert (f"warning: skipping {saved / 'step_00000006'} ({reason}" in err
            and f"resuming from the newest intact step, {saved / 'step_00000004'}" in err), err
    assert_bitwise(state(saved), state(reference))  # step 8, continued from step 4
    assert sharded.read(str(saved / "step_00000006")).step == 6  # rewritten whole by the resumed run


def test_an_explicitly_named_step_does_not_fall_back(saved):
    truncate_a_shard(saved / "step_00000006")
    with pytest.raises(AgreedError, match=re.escape(f"checkpoint {saved / 'step_00000006'}: shard "
                                                    "shard_00000_of_00001.npz is corrupt (") +
                       ".*; a step directory named explicitly is read as it is"):
        run(steps=8, resume=str(saved / "step_00000006"))
    delete_the_manifest(saved / "step_00000004")
    with pytest.raises(AgreedError, match="step_00000004: incomplete, no manifest.json"):
        run(steps=8, resume=str(saved / "step_00000004"))
    for step in ("step_00000002", "step_00000004", "step_00000006"):
        shutil.rmtree(saved / step)
    with pytest.raises(AgreedError, match=re.escape(f"no intact checkpoint in {saved} (no step_* directory")):
        run(steps=8, resume=str(saved))


class Crash(Exception):
    pass


def test_an_overwrite_interrupted_between_its_renames_loses_only_that_step(saved, monkeypatch):
    """Saving step 6 again (a run resumed from step 4) dies after the old step 6 was moved aside:
    step 4 is intact, and resuming the save directory continues from it."""
    rename, calls = os.rename, []

    def dies_second_time(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the old step 6 is aside, the new one not yet in place
            raise Crash()
        rename(src, dst)

    monkeypatch.setattr(safe_files.os, "rename", dies_second_time)
    with pytest.raises(Crash):
        run(steps=6, resume=str(saved / "step_00000004"), save_dir=str(saved))
    monkeypatch.undo()
    assert calls[0][0] == str(saved / "step_00000006") and calls[1][1] == str(saved / "step_00000006")
    assert sharded.read(str(saved)).step == 4  # the newest intact step
    assert run(steps=6, resume=str(saved), save_dir=str(saved))["start_step"] == 4


def test_a_save_that_fails_leaves_the_existing_step_untouched(saved, monkeypatch):
    before = tree(saved / "step_00000006")

    def full_disk(path, write):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(safe_files, "create_new", full_disk)
    with pytest.raises(AgreedError, match="cannot write checkpoint shard shard_00000_of_00001.npz .*No space left"):
        run(steps=6, resume=str(saved / "step_00000004"), save_dir=str(saved))
    assert tree(saved / "step_00000006") == before
    assert sorted(os.listdir(saved)) == ["step_00000002", "step_00000004", "step_00000006"]  # no staging left


# ------------------------------------------------------------------------------------------------
# Shard names are confined to the checkpoint directory
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def opened(monkeypatch):
    """Every path opened through os.open, open or numpy.load from here on."""
    paths = []
    for module, name in ((os, "open"), (np, "load")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda p, *a, _real=real, **k: (paths.append(str(p)), _real(p, *a, **k))[1])
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: (paths.append(str(p)), real_open(p, *a, **k))[1])
    return paths


def forge(step, index: int, name: str) -> None:
    """Make the manifest of `step` name `name` as its index-th shard, its checksum resealed (a forger
    who knows the format: the confinement must hold even then)."""
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["shards"][index]["file"] = name
    (step / "manifest.json").write_text(json.dumps(sharded.seal(manifest)))


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_a_manifest_cannot_name_a_file_outside_its_directory(saved, tmp_path, opened, kind):
    secret = tmp_path / "secret.npz"
    secret.write_bytes((saved / "step_00000006" / "shard_00000_of_00001.npz").read_bytes())  # a valid shard even
    step = saved / "step_00000006"
    name = {"dotdot": "../../secret.npz", "absolute": str(secret), "symlink": "shard_00000_of_00001.npz"}[kind]
    if kind == "symlink":
        os.remove(step / name)
        os.symlink(secret, step / name)
    else:
        forge(step, 0, name)
    with pytest.raises(ValueError) as error:
        sharded.read(str(step))
    if kind == "symlink":
        assert f"shard {name} is a symbolic link to {secret}, outside the checkpoint directory" in str(error.value)
    else:
        assert (f"the manifest names shard {name!r}, which is not a file name inside the checkpoint directory"
                in str(error.value))
    assert not [p for p in opened if os.path.realpath(p) == str(secret) or "secret" in p], opened


def test_a_symlink_inside_the_directory_is_allowed(saved):
    step = saved / "step_00000006"
    os.rename(step / "shard_00000_of_00001.npz", step / "real.npz")
    os.symlink("real.npz", step / "shard_00000_of_00001.npz")
    assert sharded.read(str(step)).step == 6


# ------------------------------------------------------------------------------------------------
# Temporary files are created exclusively
# ------------------------------------------------------------------------------------------------


def test_create_new_never_writes_through_a_planted_link(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(FileExistsError):
        safe_files.create_new(str(tmp_path / "link"), lambda f: f.write(b"evil"))
    assert target.read_bytes() == b"precious"


def test_a_link_planted_at_a_temporary_name_is_not_followed(saved, tmp_path, monkeypatch):
    """Links planted at the names earlier versions used (NAME.tmp), and at the name the writer
    picks (its random part made predictable here): their targets stay as they were."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "model.npz"
    os.symlink(victim, str(out) + ".tmp")
    os.symlink(victim, saved / "step_00000006" / "manifest.json.tmp")
    sharded.consolidate(str(saved), str(out))  # a random temporary name: succeeds
    run(steps=6, resume=str(saved / "step_00000004"), save_dir=str(saved))
    assert victim.read_bytes() == b"precious"
    predictable = tmp_path / ".model.npz.000000000000.tmp"
    os.symlink(victim, predictable)
    monkeypatch.setattr(safe_files.secrets, "token_hex", lambda n: "0" * 12)
    with pytest.raises(FileExistsError):
        sharded.consolidate(str(saved), str(out))
    assert victim.read_bytes() == b"precious" and os.path.islink(predictable)
    with np.load(out) as data:  # the earlier output is intact
        assert "wte.weight" in data.files


def test_a_link_planted_in_the_staging_directory_stops_the_save(saved, tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    make = safe_files.make_staging_directory

    def planted(root, name):
        path = make(root, name)
        os.symlink(victim, os.path.join(path, "shard_00000_of_00001.npz"))
        return path

    monkeypatch.setattr(safe_files, "make_staging_directory", planted)
    with pytest.raises(AgreedError, match="cannot write checkpoint shard shard_00000_of_00001.npz"):
        run(steps=6, resume=str(saved / "step_00000004"), save_dir=str(saved))
    assert victim.read_bytes() == b"precious"


# ------------------------------------------------------------------------------------------------
# Under mpiexec
# ------------------------------------------------------------------------------------------------

MPI_TRAIN = [a if a != "4" else "12" for a in TRAIN]  # --batch-size 12: 6 rows on each of 2 ranks


@pytest.mark.mpi
def test_mpi_another_run_is_refused_once_and_resume_falls_back(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_mpi_json(2, MPI_TRAIN + ["--zero", "2", "--save-dir", ckpt, "--save-every", "2", "--json"], timeout=300)
    before = tree(ckpt)
    refused = run_mpi_error(2, MPI_TRAIN + ["--zero", "1", "--seed", "5", "--save-dir", ckpt], timeout=300)
    message = (f"error: --save-dir {ckpt} holds 3 checkpoint(s) of another run (step_00000006 differs in --seed: "
               "0 there, 5 here)")
    assert refused.returncode == 2 and refused.stderr.count(message) == 1, refused.stderr  # agreed: said once
    assert "Traceback" not in refused.stderr and tree(ckpt) == before
    resumed = run_mpi_error(2, MPI_TRAIN + ["--zero", "1", "--lr", "0.5", "--steps", "8", "--resume", ckpt],
                            timeout=300)
    assert resumed.returncode == 2 and resumed.stderr.count("differs in --lr: 0.01 there, 0.5 here") == 1
    # the newest step corrupt: every rank falls back to step 4, rank 0 warns once; the result equals
    # a run resumed from step 4 by name, bit for bit (same N and stage)
    run_mpi_json(2, MPI_TRAIN + ["--zero", "2", "--steps", "8", "--resume", ckpt / "step_00000004", "--save-dir",
                                 tmp_path / "reference", "--json"], timeout=300)
    shard = ckpt / "step_00000006" / "shard_00001_of_00002.npz"
    shard.write_bytes(shard.read_bytes()[:-10])
    done = run_mpi(2, MPI_TRAIN + ["--zero", "2", "--steps", "8", "--resume", ckpt, "--save-dir", ckpt, "--json"],
                   timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(f"warning: skipping {ckpt / 'step_00000006'} (shard shard_00001_of_00002.npz is "
                             "corrupt") == 1, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["start_step"] == 4
    assert_bitwise(state(ckpt), state(tmp_path / "reference"))


@pytest.mark.mpi
def test_mpi_consolidate_on_two_ranks_writes_what_one_process_writes(saved, tmp_path):
    one = run_local(["-m", "refimpl", "consolidate", saved, "--out", tmp_path / "one.npz", "--optimizer", "--json"])
    assert one.returncode == 0, one.stderr
    two = run_mpi(2, ["-m", "refimpl", "consolidate", saved, "--out", tmp_path / "two.npz", "--optimizer", "--json"],
                  timeout=300)
    assert two.returncode == 0, two.stderr
    assert two.stderr.count("consolidated ") == 1 and len(two.stdout.strip().splitlines()) == 1  # rank 0 only
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert {k: v for k, v in a.items() if k not in ("out", "sha256")} == {
        k: v for k, v in b.items() if k not in ("out", "sha256")}
    with np.load(tmp_path / "one.npz") as x, np.load(tmp_path / "two.npz") as y:
        assert sorted(x.files) == sorted(y.files)
        assert all(np.array_equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x.files)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "one.npz", "two.npz"]  # no temporary file left
    bad = run_mpi_error(2, ["-m", "refimpl", "consolidate", tmp_path / "nothing", "--out", tmp_path / "x.npz"],
                        timeout=300)
    assert bad.returncode == 2 and bad.stderr.count(f"error: checkpoint {tmp_path / 'nothing'} does not exist") == 1
