"""Sharded checkpoints: each rank writes its shard; any world size and stage can read them back.

Layout of one checkpoint (train --save-dir DIR writes DIR/step_00000040/ after step 40):

    step_00000040/
        shard_00000_of_00004.npz    rank 0's pieces
        shard_00001_of_00004.npz    ...
        manifest.json               written last, by rank 0: step, world size, stage, precision,
                                    optimizer, loss scale, the model's parameter names and shapes,
                                    every shard's file name, size and SHA-256, dropout RNG states,
                                    the run's fingerprint (fingerprint.py), and its own SHA-256
                                    ("manifest_sha256": of its canonical JSON without that field)

A *piece* is a contiguous range [start, stop) of one flattened parameter with its master weights
(float32 under mixed precision) and optimizer state (AdamW m and v, SGD momentum) for that range.
A rank's pieces are its shard of every flat group (flat.py) with the padding left out, so a
checkpoint does not depend on N, bucket sizes or the stage that wrote it: reading it back
assembles every parameter whole, and the reader cuts its own shards out of them. That is how a run
saved at N = 4 resumes at N = 2 or N = 3, or at another stage (the same idea as DeepSpeed's
"universal checkpoint"). DP and single-process trainers save one piece per parameter from rank 0.

Crash safety (safe_files.py). A step is assembled in a hidden directory DIR/.step_00000040.*.saving
(created exclusively): every rank creates its shard there exclusively, rank 0 adds the manifest
once every shard is on disk, and renames the directory to step_00000040 -- so a step directory is
complete or absent, never half-written. Saving a step that exists (a run continued from an earlier
step) renames the old directory aside first and deletes it after the new one is in place; a crash
in between loses that step, and --resume falls back to the one before.

A checkpoint directory belongs to one run. --save-dir refuses a directory holding complete steps of
another run (another fingerprint, or none), naming the flags that differ, unless
--overwrite-checkpoints asks to start over: then those steps (and incomplete leftovers) are removed
before step 1. --resume continues only the run that wrote the checkpoint: it may change the flags
in fingerprint.MAY_CHANGE (--steps, --save-every, world size, --zero, ...), no other.

Reading is all-or-nothing, and a manifest is checked before anything is allocated (check_manifest):
its size, its own checksum, then every field's type and range -- step and optimizer step integers
>= 0 with the optimizer step (plus the skipped steps of mixed precision) not above the step, the
step equal to the directory's name, a loss scale that is a finite positive number (and present
exactly under mixed precision), a known format, precision, stage and world size, one shard and one
set of dropout states per rank, parameter shapes of non-negative integers whose elements the
shards' recorded bytes can hold -- and, when resuming, the run's fingerprint, the model's names
and shapes and the optimizer (read_step's `vet`). A problem in the manifest makes that step
corrupt: a save directory falls back past it, a named step is an error. Then every shard's name
(a plain file name inside the checkpoint directory, symbolic links resolved -- checked before any
file is opened), existence, size and checksum are checked before anything is assigned, and every
rank learns about the problems any rank found (failure.agree), so all of them stop with the same
one-line error instead of some waiting forever in a collective. A fingerprint, model or optimizer
that is not this run's is an error, never a reason to fall back (Refused). --resume DIR (a save
directory) takes the newest intact step, warning about each newer one it skips (no manifest, a
corrupt manifest or shard); --resume DIR/step_N takes that step or stops. At the same world size
and stage, a resumed run is bitwise identical to an uninterrupted one: master weights, optimizer
state and step, loss scale, dropout generators and the data position (batches are a function of
the step) are all restored exactly.

`python -m refimpl consolidate CKPT --out model.npz` writes the whole model as one ordinary state
dict ({name: array}, loadable with model.load_state_dict(dict(numpy.load(...))); --optimizer adds
the optimizer state as "optimizer/<key>/<name>"). Under mpiexec, rank 0 does the work. The command
line (`train --save-dir/--resume`, `consolidate`) is refimpl/tools/commands/; this module prints only the
progress lines of a run (`checkpoint: PATH`, `resumed from ...`) and its warnings.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import tempfile

import numpy as np

from refimpl.optim.precision import PRECISIONS
from refimpl.parallel.comm import LocalComm
from refimpl.protocols import Checkpointable, missing
from refimpl.tools.console import log
from refimpl.tools.runtime import watchdog
from refimpl.tools.runtime.failure import AgreedError, agree
from refimpl.tools.saved_runs import fingerprint, safe_files

FORMAT = "refimpl-sharded-checkpoint/3"  # /2 adds the run's fingerprint, /3 the manifest's own checksum
READABLE = (FORMAT, "refimpl-sharded-checkpoint/2", "refimpl-sharded-checkpoint/1")
MANIFEST = "manifest.json"
CHECKSUM = "manifest_sha256"  # SHA-256 of the manifest's canonical JSON without this field
MANIFEST_LIMIT = 256 << 20  # bytes: far above any manifest written (parameters and dropout states per rank)
STEP = re.compile(r"step_(\d{8})$")  # a published step directory
LEFTOVER = re.compile(r"\.step_(\d{8})\.[0-9a-f]+\.(saving|replaced|removing)$")  # an interrupted save


def step_directory(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def shard_name(rank: int, world_size: int) -> str:
    return f"shard_{rank:05d}_of_{world_size:05d}.npz"


def _comm(world):
    if world is not None:
        return world

    return LocalComm()


def on_rank0(comm, action):
    """Run action() on rank 0 only (collective); every rank returns its result, or raises AgreedError alike.
    An OSError or ValueError there becomes a one-line message (the others wait in one broadcast)."""
    outcome = None
    if comm.rank == 0:
        try:
            outcome = (True, action())
        except (OSError, ValueError) as exc:
            outcome = (False, str(exc) if isinstance(exc, ValueError) else _os_error(exc))
    ok, value = comm.bcast_object(outcome)
    if not ok:
        raise AgreedError(value)
    return value


def _os_error(exc: OSError) -> str:
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}"


# ------------------------------------------------------------------------------------------------
# What a trainer holds, as pieces
# ------------------------------------------------------------------------------------------------


def _pieces(trainer, model) -> tuple[list, int]:
    """([(name, start, stop, {"master": array, state key: array})], optimizer step) of this rank."""
    lacking = missing(trainer, Checkpointable)
    if lacking:
        raise ValueError(f"sharded checkpoints need a trainer with {', '.join(lacking)} "
                         f"(refimpl/protocols.py); {type(trainer).__name__} lacks them")
    return trainer.checkpoint_pieces(), trainer.optimizer_steps


def _dropout_states(model) -> list:
    """Sequential dropout generators (used outside a trainer's batch_rows context)."""
    return [m.generator.bit_generator.state for m in model.modules()
            if isinstance(getattr(m, "generator", None), np.random.Generator)]


# ------------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------------


def save(trainer, model, cfg, step: int, world=None) -> str:
    """Write checkpoint `step` (collective): every rank its shard, rank 0 the manifest, into a
    staging directory that rank 0 then renames to step_NNNNNNNN (replacing an older copy)."""
    comm = _comm(world)
    final = step_directory(cfg.save_dir, step)
    pieces, optimizer_step = _pieces(trainer, model)
    arrays = {"__index__": np.array(json.dumps([[n, a, b] for n, a, b, _ in pieces]))}
    for k, (_, _, _, values) in enumerate(pieces):
        for key, value in values.items():
            arrays[f"{key}/{k}"] = value
    name = shard_name(comm.rank, comm.size)
    staging = on_rank0(comm, lambda: safe_files.make_staging_directory(cfg.save_dir, os.path.basename(final)))
    try:
        digest, size, problem = None, None, None
        try:
            digest, size = safe_files.create_new(os.path.join(staging, name), lambda f: np.savez(f, **arrays))
            watchdog.progress()  # a file written: this rank is alive (the others may wait for it)
        except OSError as exc:
            problem = f"cannot write checkpoint shard {name} into {staging}: {_os_error(exc)}"
            if isinstance(exc, FileNotFoundError) and comm.rank != 0:  # rank 0 created the directory
                problem += " (--save-dir must be on a file system that every rank shares)"
        agree(comm, problem)  # every shard is on disk, or every rank stops
        shards = comm.allgather_object({"file": name, "sha256": digest, "bytes": size, "rng": _dropout_states(model)})

        def finish():  # rank 0: the manifest last, then the step appears whole
            text = json.dumps(seal(_manifest(trainer, model, cfg, step, optimizer_step, shards)), indent=1).encode()
            safe_files.create_new(os.path.join(staging, MANIFEST), lambda f: f.write(text))
            safe_files.publish(staging, final)

        on_rank0(comm, finish)  # nobody goes on (or exits) before the step is in place
    except AgreedError:
        if comm.rank == 0 and os.path.isdir(staging):
            safe_files.remove(staging)  # an unfinished step leaves nothing behind
        raise
    return final


def _manifest(trainer, model, cfg, step: int, optimizer_step: int, shards: list) -> dict:
    """What manifest.json records (see the module docstring); shards: every rank's file, by rank."""
    scaler = trainer.scaler
    return {
        "format": FORMAT, "step": step, "world_size": len(shards), "trainer": type(trainer).__name__,
        "zero_stage": cfg.zero, "precision": cfg.dtype,
        "optimizer": {"name": cfg.optimizer, "step": optimizer_step},
        "loss_scaler": None if scaler is None else scaler.state_dict(),
        "parameters": [[n, list(p.shape)] for n, p in model.named_parameters()],
        "model": {k: getattr(cfg, k) for k in ("model", "n_layer", "d_model", "n_head", "seq_len", "data")},
        "fingerprint": fingerprint.of(cfg),
        "shards": [{k: s[k] for k in ("file", "sha256", "bytes")} for s in shards],
        "rng": [s["rng"] for s in shards],
    }


def manifest_checksum(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON (sorted keys, no spaces, ASCII) without CHECKSUM."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(manifest: dict) -> dict:
    """The manifest with its own checksum recorded (a copy)."""
    return {**{k: v for k, v in manifest.items() if k != CHECKSUM}, CHECKSUM: manifest_checksum(manifest)}


def maybe_save(trainer, model, cfg, steps_done: int, world=None) -> str | None:
    """Save after every --save-every steps, and after the last step."""
    if (cfg.save_every and steps_done % cfg.save_every == 0) or steps_done == cfg.steps:
        path = save(trainer, model, cfg, steps_done, world)
        if trainer.rank == 0:
            log(f"checkpoint: {path}")
        return path
    return None


def check_writable(root: str, world=None) -> None:
    """Before training: every rank can create --save-dir and write into it (collective), so that a
    bad directory stops the run at step 0 with one clear error, not after its first save."""
    comm = _comm(world)
    problem = None
    try:
        safe_files.check_output_directory(root, "--save-dir")
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryFile(dir=root, prefix=".write_test_"):  # a unique name: jobs may share root
            pass
    except ValueError as exc:
        problem = str(exc)
    except OSError as exc:
        problem = f"--save-dir {root!r} cannot be written: {exc.strerror or exc}; choose a writable directory"
    agree(comm, problem)  # every rank stops, or none does


def prepare_save_dir(cfg, world=None) -> None:
    """Before step 1 (collective): --save-dir can be written and holds no complete step of another
    run -- or, with --overwrite-checkpoints, those steps and any incomplete leftovers are removed
    (by rank 0). Steps of this same run stay, and are replaced when this run saves them again."""
    check_writable(cfg.save_dir, world)
    comm = _comm(world)
    ours = fingerprint.of(cfg)
    others, ours_found, leftovers, problem = [], [], [], None
    try:
        others, ours_found, leftovers = _survey(cfg.save_dir, ours)
    except OSError as exc:
        problem = f"--save-dir {cfg.save_dir!r} cannot be listed: {_os_error(exc)}"
    if others and not cfg.overwrite_checkpoints:
        name, why = others[0]
        problem = (f"--save-dir {cfg.save_dir} holds {len(others)} checkpoint(s) of another run ({name} {why}); "
                   "choose another --save-dir, or pass --overwrite-checkpoints to delete them and start over")
    agree(comm, problem)
    doomed = [name for name, _ in others] + leftovers if cfg.overwrite_checkpoints else []
    if doomed:
        on_rank0(comm, lambda: [safe_files.remove(os.path.join(cfg.save_dir, name)) for name in doomed])
    if comm.rank == 0:
        if doomed:
            log(f"--overwrite-checkpoints: deleted {', '.join(doomed)} from {cfg.save_dir}")
        if ours_found and not cfg.resume:
            log(f"note: {cfg.save_dir} already holds {', '.join(ours_found)} of this run (the same flags); "
                "this run replaces each of them when it saves that step")


def _survey(root: str, ours: dict) -> tuple[list, list, list]:
    """([(step, how it differs)] of other runs, [steps] of this run, [incomplete leftovers]) in root."""
    others, same, leftovers = [], [], []
    for name in sorted(os.listdir(root), reverse=True):
        path = os.path.join(root, name)
        if LEFTOVER.match(name):
            leftovers.append(name)
        elif STEP.match(name):
            if not os.path.isfile(os.path.join(path, MANIFEST)):
                leftovers.append(name)  # incomplete (older refimpls saved in place): never loaded
                continue
            try:
                theirs = _load_manifest(path).get("fingerprint")
            except (OSError, ValueError, AttributeError, RecursionError) as exc:
                others.append((name, f"has a {MANIFEST} that cannot be read: {exc}"))
                continue
            if not fingerprint.well_formed(theirs):
                others.append((name, "records no run fingerprint (written by an older refimpl)"))
                continue
            differs = fingerprint.differences(theirs, ours)
            if differs:
                others.append((name, "differs in " + "; ".join(differs)))
            else:
                same.append(name)
    return others, same, leftovers


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used: `path` and `reason` (str: "checkpoint PATH: REASON")."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"checkpoint {path}: {reason}")
        self.path, self.reason = path, reason


class Checkpoint:
    """A checkpoint read whole: manifest, and every parameter's master and state, flattened."""

    def __init__(self, path: str, manifest: dict, masters: dict, states: dict) -> None:
        self.path, self.manifest, self.masters, self.states = path, manifest, masters, states
        self.step = int(manifest["step"])


class Refused(ValueError):
    """A checkpoint that is intact but not this run's (read_step's `vet` refused it): an error,
    never a reason to fall back to an older step."""


def open_newest(path: str, vet=None) -> tuple[Checkpoint, list[str]]:
    """(checkpoint, ["PATH (why it was skipped)", ...]). A step directory (it has a manifest, or is
    named step_NNNNNNNN) is read as it is: a problem is an error. A save directory gives its newest
    intact step; newer ones that are incomplete or corrupt are skipped, each with the reason.
    vet(checkpoint without arrays): read_step's; what it raises is raised as Refused."""
    if os.path.isfile(os.path.join(path, MANIFEST)) or STEP.match(os.path.basename(os.path.normpath(path))):
        try:
            return read_step(path, vet), []
        except CheckpointError as exc:
            raise ValueError(f"{exc}; a step directory named explicitly is read as it is: name its save "
                             f"directory ({os.path.dirname(os.path.normpath(path)) or '.'}) to take the newest "
                             "intact step instead") from None
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint {path} " + ("is not a directory" if os.path.exists(path) else "does not exist"))
    names = sorted(os.listdir(path), reverse=True)
    steps = [n for n in names if STEP.match(n)]
    skipped = []
    for name in steps:
        try:
            checkpoint = read_step(os.path.join(path, name), vet)
        except CheckpointError as exc:
            skipped.append(f"{exc.path} ({exc.reason})")
            continue
        newer = [n for n in names if LEFTOVER.match(n) and n.endswith(".saving")
                 and int(LEFTOVER.match(n).group(1)) > checkpoint.step]
        skipped += [f"{os.path.join(path, n)} (a save that was interrupted)" for n in newer]
        return checkpoint, skipped
    detail = f" ({'; '.join(skipped)})" if skipped else f" (no step_* directory holds a {MANIFEST})"
    raise ValueError(f"no intact checkpoint in {path}{detail}")


def locate(path: str) -> str:
    """The checkpoint directory that open_newest(path) reads."""
    return open_newest(path)[0].path


def read(path: str) -> Checkpoint:
    """The checkpoint at `path`: a step directory, or a save directory's newest intact step."""
    return open_newest(path)[0]


def read_step(path: str, vet=None) -> Checkpoint:
    """Read and check one step directory (manifest, shard names, checksums, coverage);
    CheckpointError naming the directory and the problem if anything is wrong. vet(checkpoint),
    if given, sees the checked manifest (a Checkpoint without arrays) before any shard is opened;
    a ValueError from it is raised as Refused."""
    if not os.path.isdir(path):
        raise CheckpointError(path, "no such directory")
    manifest_path = os.path.join(path, MANIFEST)
    if os.path.lexists(manifest_path) and not os.path.isfile(manifest_path):
        raise CheckpointError(path, f"{MANIFEST} is not a regular file (a directory, FIFO or device); "
                                    "the checkpoint is damaged or forged")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(path, f"incomplete, no {MANIFEST} (a save that was interrupted)")
    try:
        return _read(path, vet)
    except Refused:
        raise
    except ValueError as exc:
        raise CheckpointError(path, str(exc)) from None
    except (KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:  # not a manifest we wrote
        raise CheckpointError(path, f"{MANIFEST} is malformed ({type(exc).__name__}: {exc})") from None


def _load_manifest(path: str) -> dict:
    """The parsed manifest of step directory `path` (a JSON object of at most MANIFEST_LIMIT bytes), or ValueError."""
    try:
        with safe_files.open_regular(os.path.join(path, MANIFEST), MANIFEST) as f:
            size = os.fstat(f.fileno()).st_size
            text = f.read() if size <= MANIFEST_LIMIT else None  # the size first: nothing huge is read
    except OSError as exc:
        raise ValueError(f"cannot read {MANIFEST}: {exc}") from None
    if text is None:
        raise ValueError(f"{MANIFEST} is {size} bytes, more than any manifest refimpl writes "
                         f"({MANIFEST_LIMIT >> 20} MiB); it is damaged or forged")
    try:
        manifest = json.loads(text)
    except RecursionError:
        raise ValueError(f"cannot read {MANIFEST}: nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"cannot read {MANIFEST}: {exc}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{MANIFEST} holds a JSON {type(manifest).__name__}, not an object")
    return manifest


def _read(path: str, vet=None) -> Checkpoint:
    manifest = _load_manifest(path)
    check_manifest(manifest, path)  # everything below relies on it: nothing is allocated before
    if vet is not None:
        try:
            vet(Checkpoint(path, manifest, {}, {}))
        except ValueError as exc:
            raise Refused(str(exc)) from None
    shapes = {name: tuple(shape) for name, shape in manifest["parameters"]}
    for shard in manifest["shards"]:  # every name is confined before any file is opened
        safe_files.check_name(path, shard["file"], "shard")
    for shard in manifest["shards"]:  # every size as recorded before any is read: the bound on shapes holds
        try:
            info = os.stat(safe_files.check_name(path, shard["file"], "shard"))
        except OSError:
            continue  # missing or unreadable: open_confined below says which
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the open below: refused before it
            raise ValueError(f"shard {shard['file']} is not a regular file (a directory, FIFO or device); "
                             "the checkpoint is damaged or forged")
        size = info.st_size
        if size != shard["bytes"]:
            raise ValueError(f"shard {shard['file']} is corrupt ({size} bytes, the manifest says "
                             f"{shard['bytes']} bytes)")
    masters: dict = {}
    states: dict = {}
    covered = {name: 0 for name in shapes}
    for shard in manifest["shards"]:
        with safe_files.open_confined(path, shard["file"], "shard") as f:
            digest, size = safe_files.sha256_of(f)
            if size != shard["bytes"] or digest != shard["sha256"]:
                raise ValueError(f"shard {shard['file']} is corrupt ({size} bytes, sha256 {digest[:12]}..., "
                                 f"the manifest says {shard['bytes']} bytes, {shard['sha256'][:12]}...)")
            f.seek(0)
            _read_shard(shard["file"], f, shapes, masters, states, covered)
        watchdog.progress()  # a file read: this rank is alive (consolidate's other ranks wait for it)
    short = [n for n, c in covered.items() if c != _elements(shapes[n]) or (c and n not in masters)]
    if short:
        raise ValueError(f"the shards do not cover parameter {short[0]} exactly once")
    return Checkpoint(path, manifest, masters, states)


def _elements(shape) -> int:
    """Elements of a shape, as a Python int (no overflow, whatever the manifest says)."""
    return math.prod(int(d) for d in shape)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


def check_manifest(manifest: dict, path: str | None = None) -> None:
    """ValueError naming the first problem unless `manifest` is one refimpl could have written:
    its own checksum (format /3; older formats have none), every field's type and range, steps
    that agree with each other and with the directory's name, a finite positive loss scale, and
    parameters whose elements the shards' recorded bytes can hold. Allocates nothing of the
    manifest's sizes: this is what makes a forged shape an error rather than a MemoryError."""
    def bad(field: str, what: str, value) -> ValueError:
        shown = repr(value)
        return ValueError(f"{MANIFEST} is corrupt: {field} must be {what}, got "
                          f"{shown if len(shown) <= 80 else shown[:77] + '...'}")

    fmt = manifest.get("format")
    if fmt not in READABLE:
        raise ValueError(f"unknown format {fmt!r}, expected {FORMAT}")
    if fmt == FORMAT or CHECKSUM in manifest:
        recorded = manifest.get(CHECKSUM)
        if not isinstance(recorded, str):
            raise ValueError(f"{MANIFEST} is corrupt: it records no checksum of its own ({CHECKSUM}), which "
                             f"{FORMAT} requires")
        actual = manifest_checksum(manifest)
        if actual != recorded:
            raise ValueError(f"{MANIFEST} is corrupt: its SHA-256 is {actual[:12]}..., it records "
                             f"{recorded[:12]}... (edited or damaged after it was written)")
    step = manifest.get("step")
    if not (_is_int(step) and step >= 0):
        raise bad("step", "an integer >= 0", step)
    named = STEP.match(os.path.basename(os.path.normpath(path))) if path else None
    if named and int(named.group(1)) != step:
        raise ValueError(f"{MANIFEST} is corrupt: it says step {step}, its directory is step {int(named.group(1))}")
    world = manifest.get("world_size")
    if not (_is_int(world) and world >= 1):
        raise bad("world_size", "an integer >= 1", world)
    if not isinstance(manifest.get("trainer", ""), str):
        raise bad("trainer", "a string", manifest.get("trainer"))
    if manifest.get("zero_stage") not in (0, 1, 2, 3) or isinstance(manifest.get("zero_stage"), bool):
        raise bad("zero_stage", "0, 1, 2 or 3", manifest.get("zero_stage"))
    precision = manifest.get("precision")
    if precision not in PRECISIONS:
        raise bad("precision", " or ".join(PRECISIONS), precision)
    optimizer = manifest.get("optimizer")
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("name"), str)):
        raise bad("optimizer", 'an object {"name": ..., "step": ...}', optimizer)
    if not (_is_int(optimizer.get("step")) and 0 <= optimizer["step"] <= step):
        raise bad("optimizer.step", f"an integer between 0 and the step, {step}", optimizer.get("step"))
    scaler = manifest.get("loss_scaler")
    if scaler is not None or precision == "mixed":
        if precision != "mixed":
            raise bad("loss_scaler", f"null under precision {precision} (only mixed precision scales the loss)",
                      scaler)
        if not isinstance(scaler, dict):
            raise bad("loss_scaler", "an object under mixed precision", scaler)
        scale = scaler.get("scale")
        if not (_is_number(scale) and math.isfinite(scale) and scale > 0):
            raise bad("loss_scaler.scale", "a finite number > 0", scale)
        for key in ("good_steps", "skipped"):
            if not (_is_int(scaler.get(key)) and 0 <= scaler[key] <= step):
                raise bad(f"loss_scaler.{key}", f"an integer between 0 and the step, {step}", scaler.get(key))
        if optimizer["step"] + scaler["skipped"] > step:
            raise ValueError(f"{MANIFEST} is corrupt: {optimizer['step']} optimizer steps and {scaler['skipped']} "
                             f"skipped steps are more than step {step}")
    parameters = manifest.get("parameters")
    if not isinstance(parameters, list):
        raise bad("parameters", "a list of [name, shape]", parameters)
    names = set()
    for entry in parameters:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and len(entry[1]) <= 32
                and all(_is_int(d) and d >= 0 for d in entry[1])):
            raise bad("every parameter", "[name, [non-negative integer sizes]]", entry)
        if entry[0] in names:
            raise ValueError(f"{MANIFEST} is corrupt: parameter {entry[0]} is listed twice")
        names.add(entry[0])
    if not isinstance(manifest.get("model", {}), dict):
        raise bad("model", "an object", manifest.get("model"))
    if "fingerprint" in manifest and not fingerprint.well_formed(manifest["fingerprint"]):
        raise bad("fingerprint", 'an object {"fields": {...}, "sha256": "..."}', manifest["fingerprint"])
    shards = manifest.get("shards")
    if not (isinstance(shards, list) and len(shards) == world):
        raise bad("shards", f"a list of world_size ({world}) shards", shards)
    for shard in shards:
        if not (isinstance(shard, dict) and isinstance(shard.get("file"), str) and _is_int(shard.get("bytes"))
                and shard["bytes"] >= 0 and isinstance(shard.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", shard["sha256"])):
            raise bad("every shard", '{"file": name, "sha256": 64 hex digits, "bytes": integer >= 0}', shard)
    if len({shard["file"] for shard in shards}) != len(shards):
        raise ValueError(f"{MANIFEST} is corrupt: it names one shard file twice")
    elements, held = sum(_elements(shape) for _, shape in parameters), sum(shard["bytes"] for shard in shards)
    if 2 * elements > held:  # master weights alone take >= 2 bytes an element
        raise ValueError(f"{MANIFEST} is corrupt: its parameters have {elements} elements, more than its shards' "
                         f"{held} bytes can hold")
    rng = manifest.get("rng")
    if rng is not None:
        if not (isinstance(rng, list) and len(rng) == world and all(isinstance(r, list) for r in rng)):
            raise bad("rng", f"a list of world_size ({world}) lists of generator states", rng)
        for states in rng:
            for state in states:
                _check_generator_state(state)


def _check_generator_state(state) -> None:
    """ValueError unless `state` is a NumPy bit generator's state (tried on a fresh generator)."""
    name = state.get("bit_generator") if isinstance(state, dict) else None
    try:
        if name not in _BIT_GENERATORS:
            raise ValueError(name)
        getattr(np.random, name)(0).state = state
    except Exception:  # noqa: BLE001 - whatever NumPy raises for a bad state, the manifest is corrupt
        shown = repr(state)
        raise ValueError(f"{MANIFEST} is corrupt: a dropout generator state is not a NumPy bit generator's "
                         f"state ({shown if len(shown) <= 80 else shown[:77] + '...'})") from None


def _read_shard(name: str, f, shapes: dict, masters: dict, states: dict, covered: dict) -> None:
    """Assemble one shard's pieces into the whole flattened arrays (masters, states[kind])."""
    with np.load(f) as data:
        index = json.loads(str(data["__index__"]))
        for k, (param, start, stop) in enumerate(index):
            size = int(np.prod(shapes.get(param, (-1,)), dtype=np.int64))
            if param not in shapes or not 0 <= start <= stop <= size:
                raise ValueError(f"shard {name} holds {param}[{start}:{stop}], which the manifest's parameters "
                                 "do not have")
            for key in (f for f in data.files if f.endswith(f"/{k}")):
                kind = key.rsplit("/", 1)[0]
                target = masters if kind == "master" else states.setdefault(kind, {})
                if param not in target:
                    target[param] = np.zeros(size, dtype=data[key].dtype)
                target[param][start:stop] = data[key]
            covered[param] += stop - start


def check_model(checkpoint: Checkpoint, model, cfg) -> None:
    """ValueError unless the checkpoint holds this model's parameters and this optimizer's state."""
    theirs = [(n, tuple(s)) for n, s in checkpoint.manifest["parameters"]]
    ours = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if theirs != ours:
        differ = next(((a, b) for a, b in zip(theirs, ours) if a != b), None)
        detail = (f"{differ[0][0]} {differ[0][1]} there, {differ[1][0]} {differ[1][1]} here" if differ
                  else f"{len(theirs)} parameters there, {len(ours)} here")
        raise ValueError(f"checkpoint {checkpoint.path} is from another model ({detail}; it was saved with "
                         f"{checkpoint.manifest['model']})")
    if checkpoint.manifest["optimizer"]["name"] != cfg.optimizer:
        raise ValueError(f"checkpoint {checkpoint.path} holds {checkpoint.manifest['optimizer']['name']} state, "
                         f"this run uses --optimizer {cfg.optimizer}")


def check_run(checkpoint: Checkpoint, cfg) -> str | None:
    """ValueError unless the checkpoint was written by the run `cfg` continues (the same fingerprint);
    returns a warning for a checkpoint that records no fingerprint (an older format)."""
    theirs = checkpoint.manifest.get("fingerprint")
    if not isinstance(theirs, dict):
        return (f"warning: checkpoint {checkpoint.path} records no run fingerprint (written by an older refimpl): "
                "only its model's shapes and optimizer are checked")
    differs = fingerprint.differences(theirs, fingerprint.of(cfg))
    if differs:
        raise ValueError(f"checkpoint {checkpoint.path} is of another run (differs in {'; '.join(differs)}); "
                         "--resume continues a run with the same flags, changing only --steps, --save-every, the "
                         "world size, --zero or other flags that do not change what is computed (docs/zero.md)")
    return None


def resume(trainer, model, cfg, world=None) -> int:
    """Load --resume into the trainer (collective); returns the step to continue from."""
    comm = _comm(world)
    checkpoint, problem, notes, run_notes = None, None, [], []

    def vet(candidate):  # on the checked manifest, before any shard is read
        run_notes[:] = filter(None, [check_run(candidate, cfg)])
        check_model(candidate, model, cfg)
        if candidate.step >= cfg.steps:
            raise ValueError(f"checkpoint {candidate.path} is at step {candidate.step}; --steps {cfg.steps} "
                             "leaves nothing to train (--steps is the total, counted from step 0)")

    try:
        checkpoint, skipped = open_newest(cfg.resume, vet)
        notes = [f"warning: skipping {why}; resuming from the newest intact step, {checkpoint.path}"
                 for why in skipped] + run_notes
    except ValueError as exc:
        problem = str(exc)
    if comm.rank == 0:
        for note in notes:
            log(note)
    agree(comm, problem)  # every rank stops, or none does
    chosen = comm.allgather_object(checkpoint.path)
    if len(set(chosen)) > 1:  # every rank sees the same list and raises alike
        raise AgreedError(f"--resume {cfg.resume}: the ranks found different newest intact checkpoints "
                          f"({', '.join(f'rank {r}: {p}' for r, p in enumerate(chosen))}); name one step directory")
    _load(trainer, model, checkpoint, comm.rank)
    if comm.rank == 0:
        log(f"resumed from {checkpoint.path} (step {checkpoint.step}, saved by {checkpoint.manifest['world_size']} "
            f"rank(s) at ZeRO stage {checkpoint.manifest['zero_stage']}, {checkpoint.manifest['precision']})")
    return checkpoint.step


def _load(trainer, model, checkpoint: Checkpoint, rank: int) -> None:
    step = int(checkpoint.manifest["optimizer"]["step"])
    trainer.load_full_state(checkpoint.masters, checkpoint.states, step)
    trainer.steps_done = checkpoint.step  # the batch number that keys dropout masks (nn/batch_rows.py)
    scaler, saved = trainer.scaler, checkpoint.manifest.get("loss_scaler")
    if scaler is not None and saved is not None:
        scaler.load_state_dict(saved)
    states = checkpoint.manifest.get("rng") or [[]]
    mine = states[rank] if rank < len(states) else states[0]
    generators = [m.generator for m in model.modules()
                  if isinstance(getattr(m, "generator", None), np.random.Generator)]
    if len(mine) == len(generators):
        for generator, state in zip(generators, mine):
            generator.bit_generator.state = state


# ------------------------------------------------------------------------------------------------
# Consolidation (python -m refimpl consolidate CKPT --out FILE: refimpl/tools/commands/consolidate.py)
# ------------------------------------------------------------------------------------------------


def consolidate(path: str, out: str, optimizer: bool = False) -> dict:
    """Write the whole model (and optionally optimizer state) as one .npz; nothing is written on error.
    A save directory gives its newest intact step, with a warning for each newer one skipped."""
    if not out.endswith(".npz"):
        raise ValueError(f"--out must name a .npz file, got {out}")
    safe_files.check_output_file(out, "--out", "model.npz")  # before reading: a bad --out is not found last
    checkpoint, skipped = open_newest(path)
    for why in skipped:
        log(f"warning: skipping {why}; consolidating the newest intact step, {checkpoint.path}")
    shapes = {name: tuple(shape) for name, shape in checkpoint.manifest["parameters"]}
    arrays = {name: checkpoint.masters[name].reshape(shapes[name]) for name in shapes}
    if optimizer:
        for key, values in checkpoint.states.items():
            arrays.update({f"optimizer/{key}/{name}": v.reshape(shapes[name]) for name, v in values.items()})
        arrays["optimizer/step"] = np.array(checkpoint.manifest["optimizer"]["step"])
    digest, size = safe_files.write_atomically(out, lambda f: np.savez(f, **arrays))
    return {"checkpoint": checkpoint.path, "out": out, "step": checkpoint.step, "parameters": len(shapes),
            "elements": int(sum(int(np.prod(s, dtype=np.int64)) for s in shapes.values())), "bytes": size,
            "sha256": digest, "saved_world_size": checkpoint.manifest["world_size"],
            "saved_zero_stage": checkpoint.manifest["zero_stage"], "precision": checkpoint.manifest["precision"],
            "skipped": skipped}

