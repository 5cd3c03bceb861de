"""Hostile manifests and output paths.

Each manifest case saves nothing new: it copies a tiny saved run (steps 1 and 2), damages step 2's
manifest in one way, and runs `python -m refimpl train --resume ...` (or `consolidate`) in this
process through the CLI's main. The rule (refimpl/tools/saved_runs/sharded.py):

  * a manifest is checked before anything of its sizes is allocated: its size, its own SHA-256
    (`manifest_sha256`), every field's type and range, steps consistent with each other and with
    the directory's name, a finite positive loss scale, shapes the shards' bytes can hold;
  * a damaged manifest makes its step corrupt: `--resume SAVE_DIR` falls back to the newest intact
    step with one warning, `--resume SAVE_DIR/step_N` is one line `error: ...` and exit status 2;
  * "sealed" cases recompute the checksum (a forger who knows the format), so that the checks
    behind the checksum are reached;
  * an intact manifest of another model is an error, never a fallback.

Output paths (--trace, --save-dir, consolidate --out) are checked before the run; an output file
that is a symbolic link is refused, a --save-dir that links to a directory is followed
(safe_files.check_output_file / check_output_directory).
"""

import json
import os
import shutil

import numpy as np
import pytest

from refimpl.tools.cli import main
from refimpl.tools.saved_runs import sharded

TINY = ["--model", "gpt", "--n-layer", "1", "--d-model", "8", "--n-head", "2", "--seq-len", "8", "--batch-size", "4",
        "--lr", "1e-2"]
STEP2 = "step_00000002"


def cli(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def one_line_error(code: int, err: str, *fragments: str) -> str:
    assert code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0], err
    assert "done:" not in err and "resumed from" not in err, err  # stopped before training
    return errors[0]


def _save(root, dtype: str):
    assert main(["train", *TINY, "--dtype", dtype, "--steps", "2", "--save-every", "1", "--save-dir", str(root)]) == 0
    return root


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    return {dtype: _save(base / dtype, dtype) for dtype in ("float64", "mixed")}


@pytest.fixture
def ckpt(saved_runs, tmp_path):
    """A fresh copy of the float64 run (steps 1 and 2)."""
    return shutil.copytree(saved_runs["float64"], tmp_path / "ckpt")


@pytest.fixture
def mixed(saved_runs, tmp_path):
    return shutil.copytree(saved_runs["mixed"], tmp_path / "mixed")


def manifest_of(step) -> dict:
    return json.loads((step / "manifest.json").read_text())


def rewrite(step, change, seal: bool = True) -> None:
    """Apply change(manifest) to step's manifest, resealed (a consistent forgery) or not (damage)."""
    manifest = manifest_of(step)
    change(manifest)
    (step / "manifest.json").write_text(json.dumps(sharded.seal(manifest) if seal else manifest))


def resume(capsys, path, dtype="float64", steps=4):
    return cli(capsys, "train", *TINY, "--dtype", dtype, "--steps", steps, "--resume", path)


def setter(*keys_and_value):
    *keys, value = keys_and_value

    def change(manifest):
        target = manifest
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return change


def param_shape(index, shape):
    def change(manifest):
        manifest["parameters"][index][1] = shape
    return change


# ------------------------------------------------------------------------------------------------
# Sealed forgeries: each a one-line error when the step is named
# ------------------------------------------------------------------------------------------------

SEALED = {
    "shape [10**12, 64]": (param_shape(0, [10**12, 64]), "its parameters have 640000000010"),
    "shape of a negative size": (param_shape(0, [-11, 8]), "every parameter must be [name, [non-negative integer"),
    "shape of floats": (param_shape(0, [11.0, 8]), "every parameter must be [name, [non-negative integer"),
    "a parameter listed twice": (lambda m: m["parameters"].append(m["parameters"][0]), "is listed twice"),
    "step -3": (setter("step", -3), "step must be an integer >= 0, got -3"),
    "step a string": (setter("step", "2"), "step must be an integer >= 0, got '2'"),
    "step other than the directory's": (setter("step", 1), "it says step 1, its directory is step 2"),
    "optimizer step 1e30": (setter("optimizer", "step", 1e30), "optimizer.step must be an integer between 0 and"),
    "optimizer step 10**30": (setter("optimizer", "step", 10**30), "optimizer.step must be an integer between 0"),
    "optimizer step -1": (setter("optimizer", "step", -1), "optimizer.step must be an integer between 0 and"),
    "world size 0": (setter("world_size", 0), "world_size must be an integer >= 1, got 0"),
    "world size unlike the shards": (setter("world_size", 3), "shards must be a list of world_size (3) shards"),
    "precision float128": (setter("precision", "float128"), "precision must be float32 or float64 or mixed"),
    "ZeRO stage 7": (setter("zero_stage", 7), "zero_stage must be 0, 1, 2 or 3, got 7"),
    "a loss scale without mixed precision": (setter("loss_scaler", {"scale": 1.0, "good_steps": 0, "skipped": 0}),
                                             "loss_scaler must be null under precision float64"),
    "shard size negative": (lambda m: m["shards"][0].update(bytes=-1), "every shard must be"),
    "shard checksum not hex": (lambda m: m["shards"][0].update(sha256="zz" * 32), "every shard must be"),
    "a dropout state that is not one": (lambda m: m["rng"][0].__setitem__(0, {"bit_generator": "PCG64", "state": 7}),
                                        "a dropout generator state is not a NumPy bit generator's state"),
    "a fingerprint that is not one": (setter("fingerprint", {"fields": 3}), "fingerprint must be an object"),
    "unknown format": (setter("format", "refimpl-sharded-checkpoint/99"), "unknown format"),
}


@pytest.mark.parametrize("case", list(SEALED))
def test_a_sealed_forgery_of_a_named_step_is_one_line(ckpt, capsys, case):
    change, message = SEALED[case]
    rewrite(ckpt / STEP2, change)
    code, err = resume(capsys, ckpt / STEP2)
    one_line_error(code, err, f"checkpoint {ckpt / STEP2}: ", message, "a step directory named explicitly is read")


@pytest.mark.parametrize("case", ["shape [10**12, 64]", "step -3", "optimizer step 1e30", "world size 0"])
def test_a_sealed_forgery_in_a_save_dir_falls_back_with_a_warning(ckpt, capsys, case):
    change, message = SEALED[case]
    rewrite(ckpt / STEP2, change)
    code, err = resume(capsys, ckpt)
    assert code == 0 and "Traceback" not in err, err
    assert f"warning: skipping {ckpt / STEP2} (" in err and message in err, err
    assert f"resuming from the newest intact step, {ckpt / 'step_00000001'}" in err
    assert f"resumed from {ckpt / 'step_00000001'} (step 1" in err


def test_a_huge_shape_allocates_nothing(ckpt, capsys, monkeypatch):
    """The forged shape is refused before np.zeros is ever called with it (no MemoryError)."""
    rewrite(ckpt / STEP2, param_shape(0, [10**12, 64]))
    zeros, sizes = np.zeros, []
    monkeypatch.setattr(sharded.np, "zeros", lambda n, *a, **k: (sizes.append(n), zeros(n, *a, **k))[1])
    with pytest.raises(sharded.CheckpointError, match="more than its shards'"):
        sharded.read_step(str(ckpt / STEP2))
    assert sizes == []
    code, err = cli(capsys, "consolidate", ckpt / STEP2, "--out", ckpt / "model.npz")
    one_line_error(code, err, "its parameters have 640000000010")
    assert not os.path.exists(ckpt / "model.npz")
    # the shard's recorded size inflated too: every shard's size is compared before any is read
    rewrite(ckpt / STEP2, lambda m: m["shards"][0].update(bytes=10**15))
    code, err = cli(capsys, "consolidate", ckpt / STEP2, "--out", ckpt / "model.npz")
    one_line_error(code, err, "shard shard_00000_of_00001.npz is corrupt (", "the manifest says 1000000000000000 bytes")
    assert all(np.prod(n) < 10**6 for n in sizes) and not os.path.exists(ckpt / "model.npz")


def test_another_models_shapes_are_refused_before_reading_and_never_fall_back(ckpt, capsys, monkeypatch):
    """A sealed manifest whose shapes fit its shards but not this model: an error naming both, from
    a save directory too (it is intact, only not this run's), with no shard opened."""
    for step in ("step_00000001", STEP2):
        rewrite(ckpt / step, lambda m: (m["parameters"][0].__setitem__(1, [11, 4]), m.pop("fingerprint")))
    opened = []
    monkeypatch.setattr(sharded.safe_files, "open_confined", lambda *a: opened.append(a))
    code, err = resume(capsys, ckpt)
    one_line_error(code, err, f"checkpoint {ckpt / STEP2} is from another model (wte.weight (11, 4) there, "
                              "wte.weight (11, 8) here")
    assert "warning: skipping" not in err and opened == []


# ------------------------------------------------------------------------------------------------
# The loss scale (a mixed-precision run)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [float("nan"), 0, -1, float("inf"), "65536", True])
def test_a_loss_scale_that_is_not_finite_and_positive_is_refused(mixed, capsys, scale):
    rewrite(mixed / STEP2, setter("loss_scaler", "scale", scale))
    code, err = resume(capsys, mixed / STEP2, dtype="mixed")
    one_line_error(code, err, "loss_scaler.scale must be a finite number > 0, got ")


@pytest.mark.parametrize("change,message", [
    (setter("loss_scaler", None), "loss_scaler must be an object under mixed precision"),
    (setter("loss_scaler", "skipped", 5), "loss_scaler.skipped must be an integer between 0 and the step, 2"),
    (lambda m: (m["loss_scaler"].update(skipped=1), m["optimizer"].update(step=2)),
     "2 optimizer steps and 1 skipped steps are more than step 2"),
])
def test_a_loss_scaler_inconsistent_with_the_steps_is_refused(mixed, capsys, change, message):
    rewrite(mixed / STEP2, change)
    one_line_error(*resume(capsys, mixed / STEP2, dtype="mixed"), message)


def test_a_valid_mixed_precision_manifest_still_resumes(mixed, capsys):
    code, err = resume(capsys, mixed, dtype="mixed", steps=3)
    assert code == 0 and f"resumed from {mixed / STEP2} (step 2" in err, err


# ------------------------------------------------------------------------------------------------
# Damage (the checksum no longer matches, or the file is not a manifest at all)
# ------------------------------------------------------------------------------------------------


def edited(step):
    rewrite(step, setter("loss_scaler", {"scale": float("nan"), "good_steps": 0, "skipped": 0}), seal=False)


def checksum_removed(step):
    rewrite(step, lambda m: m.pop("manifest_sha256"), seal=False)


def not_json(step):
    (step / "manifest.json").write_bytes(b"\x00\xff{not json")


def a_json_list(step):
    (step / "manifest.json").write_text("[1, 2, 3]")


def nested_too_deeply(step):
    (step / "manifest.json").write_text("[" * 100000 + "]" * 100000)


def huge(step):
    with open(step / "manifest.json", "r+b") as f:
        f.truncate(300 << 20)  # sparse: nothing is written, and nothing is read


DAMAGE = {
    edited: "manifest.json is corrupt: its SHA-256 is ",
    checksum_removed: "manifest.json is corrupt: it records no checksum of its own (manifest_sha256)",
    not_json: "cannot read manifest.json:",
    a_json_list: "manifest.json holds a JSON list, not an object",
    nested_too_deeply: "cannot read manifest.json: nested too deeply",
    huge: "manifest.json is 314572800 bytes, more than any manifest refimpl writes (256 MiB)",
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=lambda f: f.__name__)
def test_a_damaged_manifest_falls_back_from_a_save_dir_and_is_an_error_when_named(ckpt, capsys, damage):
    damage(ckpt / STEP2)
    code, err = resume(capsys, ckpt)
    assert code == 0 and "Traceback" not in err, err
    assert f"warning: skipping {ckpt / STEP2} ({DAMAGE[damage]}" in err, err
    assert f"resumed from {ckpt / 'step_00000001'} (step 1" in err
    one_line_error(*resume(capsys, ckpt / STEP2), f"checkpoint {ckpt / STEP2}: {DAMAGE[damage]}")


def test_every_manifest_written_carries_its_checksum_and_a_save_dir_survey_reads_damage(ckpt, capsys):
    manifest = manifest_of(ckpt / STEP2)
    assert manifest["manifest_sha256"] == sharded.manifest_checksum(manifest)
    sharded.check_manifest(manifest, str(ckpt / STEP2))
    nested_too_deeply(ckpt / STEP2)  # --save-dir's survey of the directory: one line, no traceback
    code, err = cli(capsys, "train", *TINY, "--dtype", "float64", "--steps", "2", "--seed", "1", "--save-dir", ckpt)
    one_line_error(code, err, f"--save-dir {ckpt} holds 2 checkpoint(s) of another run")


# ------------------------------------------------------------------------------------------------
# Output paths: checked before the run; symbolic links: an output file's refused, directories followed
# ------------------------------------------------------------------------------------------------

PIPELINED = ["train", *TINY, "--steps", "2", "--schedule", "gpipe"]  # one process, a pipeline: it traces


def test_trace_is_written_atomically(tmp_path, capsys):
    code, err = cli(capsys, *PIPELINED, "--trace", tmp_path / "t.json")
    assert code == 0, err
    assert "traceEvents" in json.loads((tmp_path / "t.json").read_text())
    assert os.listdir(tmp_path) == ["t.json"]  # no temporary file left


@pytest.mark.parametrize("where,message", [
    ("dir", "is a directory; name a file, e.g. "),
    ("missing/t.json", "cannot be written: its directory "),
    ("file/t.json", "is not a directory; create it first"),
    ("link", "is a symbolic link (to "),
    ("/sys/t.json", "cannot be written: Permission denied"),
])
def test_a_bad_trace_path_stops_before_the_first_step(tmp_path, capsys, where, message):
    os.makedirs(tmp_path / "dir")
    (tmp_path / "file").write_text("x")
    (tmp_path / "target.json").write_text("keep")
    os.symlink(tmp_path / "target.json", tmp_path / "link")
    code, err = cli(capsys, *PIPELINED, "--trace", tmp_path / where)
    one_line_error(code, err, "error: --trace ", message)
    assert "step 1/" not in err and (tmp_path / "target.json").read_text() == "keep"


@pytest.mark.parametrize("where,message", [
    ("file", "cannot be written: Not a directory"),
    ("file/deeper", "cannot be written: Not a directory"),
    ("dangling", "is a symbolic link to "),
    ("/sys/ckpt", "cannot be written: Permission denied"),
])
def test_a_bad_save_dir_stops_before_the_first_step(tmp_path, capsys, where, message):
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    code, err = cli(capsys, "train", *TINY, "--steps", "2", "--save-dir", tmp_path / where)
    one_line_error(code, err, "error: --save-dir ", message)
    assert "step 1/" not in err and not os.path.exists(tmp_path / "nowhere")


def test_a_save_dir_that_links_to_a_directory_is_followed(tmp_path, capsys):
    os.makedirs(tmp_path / "scratch")
    os.symlink(tmp_path / "scratch", tmp_path / "ckpt")
    code, err = cli(capsys, "train", *TINY, "--steps", "2", "--save-dir", tmp_path / "ckpt")
    assert code == 0, err
    assert os.listdir(tmp_path / "scratch") == [STEP2] and os.path.islink(tmp_path / "ckpt")


def test_a_bad_resume_with_a_bad_trace_reads_no_checkpoint(ckpt, capsys, monkeypatch):
    """The path check comes first: a --trace problem is found before the checkpoint is read."""
    monkeypatch.setattr(sharded, "read_step", lambda *a: pytest.fail("the checkpoint was read"))
    code, err = cli(capsys, *PIPELINED, "--steps", "4", "--dtype", "float64", "--resume", ckpt, "--trace", ckpt)
    one_line_error(code, err, f"--trace {ckpt} is a directory")


@pytest.mark.parametrize("where,message", [
    ("dir.npz", "is a directory; name a file, e.g. "),
    ("link.npz", "is a symbolic link (to "),
    ("missing/m.npz", "its directory "),
])
def test_a_bad_consolidate_out_is_refused_before_reading(ckpt, tmp_path, capsys, where, message):
    os.makedirs(tmp_path / "dir.npz")
    (tmp_path / "target.npz").write_bytes(b"keep")
    os.symlink(tmp_path / "target.npz", tmp_path / "link.npz")
    code, err = cli(capsys, "consolidate", ckpt, "--out", tmp_path / where)
    one_line_error(code, err, "error: --out ", message)
    assert (tmp_path / "target.npz").read_bytes() == b"keep"


# -- files that are not regular files: refused before they are opened (opening a FIFO would block) --

@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("which,command", [
    ("shard", "resume"), ("shard", "consolidate"), ("manifest.json", "resume"), ("manifest.json", "consolidate"),
])
def test_a_fifo_in_a_named_step_is_refused_before_it_is_opened(ckpt, tmp_path, capsys, which, command):
    step = ckpt / STEP2
    name = which if which == "manifest.json" else next(p.name for p in step.iterdir() if p.name.startswith("shard"))
    (step / name).unlink()
    os.mkfifo(step / name)  # no writer ever opens it: an open() for reading would wait forever
    if command == "resume":
        code, err = cli(capsys, "train", *TINY, "--dtype", "float64", "--steps", "3", "--resume", step)
    else:
        code, err = cli(capsys, "consolidate", step, "--out", tmp_path / "merged.npz")
    one_line_error(code, err, "not a regular file", name)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_shard_in_a_save_dir_falls_back_to_the_intact_step(ckpt, capsys):
    step = ckpt / STEP2
    shard = next(p for p in step.iterdir() if p.name.startswith("shard"))
    shard.unlink()
    os.mkfifo(shard)
    code, err = cli(capsys, "train", *TINY, "--dtype", "float64", "--steps", "3", "--resume", ckpt)
    assert code == 0, err
    assert "not a regular file" in err and "step 1" in err, err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("argv", [
    ["train", "--data", "{fifo}", "--steps", "1"],
    ["train", "--schedule", "{fifo}:make", "--pp", "2", "--steps", "1"],
    ["schedule", "{fifo}:make", "--pp", "2", "--micro-batches", "4"],
    ["verify", "--trainer", "{fifo}:make", "--steps", "1"],
])
def test_a_fifo_given_for_any_input_file_is_refused_before_it_is_opened(tmp_path, capsys, argv):
    fifo = tmp_path / "input.py"
    os.mkfifo(fifo)
    code, err = cli(capsys, *[a.replace("{fifo}", str(fifo)) for a in argv])
    assert code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(fifo) in errors[0], err
