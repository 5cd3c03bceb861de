"""Sharded checkpoints: each rank writes its shard; any world size and stage can read them back.

Layout of one checkpoint (train --save-dir DIR writes DIR/step_00000040/ after step 40):

    step_00000040/
        shard_00000_of_00004.npz    rank 0's pieces          written to *.tmp, then renamed
        shard_00001_of_00004.npz    ...
        manifest.json               written last, by rank 0: step, world size, stage, precision,
                                    optimizer, loss scale, the model's parameter names and shapes,
                                    every shard's file name, size and SHA-256, dropout RNG states

A *piece* is a contiguous range [start, stop) of one flattened parameter with its master weights
(float32 under mixed precision) and optimizer state (AdamW m and v, SGD momentum) for that range.
A rank's pieces are its shard of every flat group (flat.py) with the padding left out, so a
checkpoint does not depend on N, bucket sizes or the stage that wrote it: reading it back
assembles every parameter whole, and the reader cuts its own shards out of them. That is how a run
saved at N = 4 resumes at N = 2 or N = 3, or at another stage (the same idea as DeepSpeed's
"universal checkpoint"). DP and single-process trainers save one piece per parameter from rank 0.

Crash safety. Every file is written under a temporary name and renamed (os.replace is atomic on
POSIX), and the manifest -- which lists the shards and their checksums -- is renamed into place
only after every rank has finished its shard. A directory without a manifest is an interrupted
save and is never loaded; --resume DIR picks the newest complete step_* directory.

Reading is all-or-nothing: the manifest, every shard's existence, size and checksum, and the
model's parameter names and shapes are checked before anything is assigned, and every rank
learns about the first problem any rank found (one all-gather), so all of them stop with the same
one-line error instead of some waiting forever in a collective. At the same world size and stage,
a resumed run is bitwise identical to an uninterrupted one: master weights, optimizer state and
step, loss scale, dropout generators and the data position (batches are a function of the step)
are all restored exactly.

`python -m refimpl consolidate CKPT --out model.npz` writes the whole model as one ordinary state
dict ({name: array}, loadable with model.load_state_dict(dict(numpy.load(...))); --optimizer adds
the optimizer state as "optimizer/<key>/<name>").
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np

from refimpl import backend
from refimpl.console import emit_json, log
from refimpl.parallel.failure import agree

FORMAT = "refimpl-sharded-checkpoint/1"
MANIFEST = "manifest.json"


def step_directory(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def shard_name(rank: int, world_size: int) -> str:
    return f"shard_{rank:05d}_of_{world_size:05d}.npz"


def _comm(world):
    if world is not None:
        return world
    from refimpl.parallel.comm import LocalComm  # noqa: PLC0415

    return LocalComm()


# ------------------------------------------------------------------------------------------------
# What a trainer holds, as pieces
# ------------------------------------------------------------------------------------------------


def _pieces(trainer, model) -> tuple[list, int]:
    """([(name, start, stop, {"master": array, state key: array})], optimizer step) of this rank."""
    if hasattr(trainer, "checkpoint_pieces"):  # the ZeRO trainers
        return trainer.checkpoint_pieces(), trainer.optimizer.steps_taken
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is None or not hasattr(optimizer, "state") or type(trainer).__name__ not in (
            "LocalTrainer", "DataParallelTrainer"):
        raise ValueError(f"sharded checkpoints support the ZeRO, data-parallel and single-process trainers, "
                         f"not {type(trainer).__name__}")
    pieces, step = [], 0
    if trainer.rank == 0:  # every rank holds the same whole state: rank 0 writes it
        for (name, p), state in zip(model.named_parameters(), optimizer.state):
            arrays = {"master": backend.to_host(p.data).reshape(-1)}
            arrays.update({k: backend.to_host(v).reshape(-1) for k, v in state.items() if hasattr(v, "nbytes")})
            pieces.append((name, 0, p.size, arrays))
    if optimizer.state:
        step = int(optimizer.state[0]["step"])
    return pieces, step


def _dropout_states(model) -> list:
    """Sequential dropout generators (used outside a trainer's batch_rows context)."""
    return [m.generator.bit_generator.state for m in model.modules()
            if isinstance(getattr(m, "generator", None), np.random.Generator)]


# ------------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------------


def _write_atomically(path: str, write) -> tuple[str, int]:
    """write(file object) into path.tmp, then rename it to path; returns (sha256, bytes)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    digest, size = _sha256(tmp)
    os.replace(tmp, path)
    return digest, size


def _sha256(path: str) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def save(trainer, model, cfg, step: int, world=None) -> str:
    """Write this rank's shard and (rank 0) the manifest of checkpoint `step`; collective."""
    comm = _comm(world)
    directory = step_directory(cfg.save_dir, step)
    os.makedirs(directory, exist_ok=True)
    pieces, optimizer_step = _pieces(trainer, model)
    arrays = {"__index__": np.array(json.dumps([[n, a, b] for n, a, b, _ in pieces]))}
    for k, (_, _, _, values) in enumerate(pieces):
        for key, value in values.items():
            arrays[f"{key}/{k}"] = value
    name = shard_name(comm.rank, comm.size)
    digest, size = _write_atomically(os.path.join(directory, name), lambda f: np.savez(f, **arrays))
    shards = comm.allgather_object({"file": name, "sha256": digest, "bytes": size, "rng": _dropout_states(model)})
    if comm.rank == 0:
        scaler = getattr(trainer, "scaler", None)
        manifest = {
            "format": FORMAT, "step": step, "world_size": comm.size, "trainer": type(trainer).__name__,
            "zero_stage": getattr(trainer, "stage", 0), "precision": cfg.dtype,
            "optimizer": {"name": cfg.optimizer, "step": optimizer_step},
            "loss_scaler": None if scaler is None else scaler.state_dict(),
            "parameters": [[n, list(p.shape)] for n, p in model.named_parameters()],
            "model": {k: getattr(cfg, k) for k in ("model", "n_layer", "d_model", "n_head", "seq_len", "data")},
            "shards": [{k: s[k] for k in ("file", "sha256", "bytes")} for s in shards],
            "rng": [s["rng"] for s in shards],
        }
        text = json.dumps(manifest, indent=1).encode()
        _write_atomically(os.path.join(directory, MANIFEST), lambda f: f.write(text))
    comm.bcast_object(True)  # nobody goes on (or exits) before the manifest is in place
    return directory


def maybe_save(trainer, model, cfg, steps_done: int, world=None) -> str | None:
    """Save after every --save-every steps, and after the last step."""
    if (cfg.save_every and steps_done % cfg.save_every == 0) or steps_done == cfg.steps:
        path = save(trainer, model, cfg, steps_done, world)
        if trainer.rank == 0:
            log(f"checkpoint: {path}")
        return path
    return None


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------


class Checkpoint:
    """A checkpoint read whole: manifest, and every parameter's master and state, flattened."""

    def __init__(self, path: str, manifest: dict, masters: dict, states: dict) -> None:
        self.path, self.manifest, self.masters, self.states = path, manifest, masters, states
        self.step = int(manifest["step"])


def locate(path: str) -> str:
    """The checkpoint directory: path itself if it has a manifest, else its newest complete step_*."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint {path} does not exist")
    complete = sorted(d for d in os.listdir(path)
                      if d.startswith("step_") and os.path.isfile(os.path.join(path, d, MANIFEST)))
    if not complete:
        raise ValueError(f"no checkpoint in {path}: no {MANIFEST} there or in a step_* directory "
                         "(a save that was interrupted has no manifest)")
    return os.path.join(path, complete[-1])


def read(path: str) -> Checkpoint:
    """Read and check a whole checkpoint (manifest, shards, checksums, coverage); ValueError if bad."""
    path = locate(path)
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"checkpoint {path}: cannot read {MANIFEST}: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path}: unknown format {manifest.get('format')!r}, expected {FORMAT}")
    shapes = {name: tuple(shape) for name, shape in manifest["parameters"]}
    masters: dict = {}
    states: dict = {}
    covered = {name: 0 for name in shapes}
    for shard in manifest["shards"]:
        file = os.path.join(path, shard["file"])
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint {path}: shard {shard['file']} is missing")
        digest, size = _sha256(file)
        if size != shard["bytes"] or digest != shard["sha256"]:
            raise ValueError(f"checkpoint {path}: shard {shard['file']} is corrupt ({size} bytes, sha256 "
                             f"{digest[:12]}..., the manifest says {shard['bytes']} bytes, {shard['sha256'][:12]}...)")
        with np.load(file) as data:
            index = json.loads(str(data["__index__"]))
            for k, (name, start, stop) in enumerate(index):
                for key in (f for f in data.files if f.endswith(f"/{k}")):
                    kind = key.rsplit("/", 1)[0]
                    target = masters if kind == "master" else states.setdefault(kind, {})
                    if name not in target:
                        target[name] = np.zeros(int(np.prod(shapes[name], dtype=np.int64)), dtype=data[key].dtype)
                    target[name][start:stop] = data[key]
                covered[name] += stop - start
    short = [n for n, c in covered.items() if c != int(np.prod(shapes[n], dtype=np.int64))]
    if short:
        raise ValueError(f"checkpoint {path}: the shards do not cover parameter {short[0]} exactly once")
    return Checkpoint(path, manifest, masters, states)


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


def check_writable(root: str, world=None) -> None:
    """Before training: every rank can create --save-dir and write into it (collective), so that a
    bad directory stops the run at step 0 with one clear error, not after its first save."""
    comm = _comm(world)
    problem = None
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryFile(dir=root, prefix=".write_test_"):  # a unique name: jobs may share root
            pass
    except OSError as exc:
        problem = f"--save-dir {root!r} cannot be written: {exc.strerror or exc}; choose a writable directory"
    agree(comm, problem)  # every rank stops, or none does


def resume(trainer, model, cfg, world=None) -> int:
    """Load --resume into the trainer (collective); returns the step to continue from."""
    comm = _comm(world)
    checkpoint, problem = None, None
    try:
        checkpoint = read(cfg.resume)
        check_model(checkpoint, model, cfg)
        if checkpoint.step >= cfg.steps:
            raise ValueError(f"checkpoint {checkpoint.path} is at step {checkpoint.step}; --steps {cfg.steps} "
                             "leaves nothing to train (--steps is the total, counted from step 0)")
    except ValueError as exc:
        problem = str(exc)
    agree(comm, problem)  # every rank stops, or none does
    _load(trainer, model, checkpoint, comm.rank)
    if comm.rank == 0:
        log(f"resumed from {checkpoint.path} (step {checkpoint.step}, saved by {checkpoint.manifest['world_size']} "
            f"rank(s) at ZeRO stage {checkpoint.manifest['zero_stage']}, {checkpoint.manifest['precision']})")
    return checkpoint.step


def _load(trainer, model, checkpoint: Checkpoint, rank: int) -> None:
    step = int(checkpoint.manifest["optimizer"]["step"])
    if hasattr(trainer, "load_full_state"):
        trainer.load_full_state(checkpoint.masters, checkpoint.states, step)
    else:
        for (name, p), state in zip(model.named_parameters(), trainer.optimizer.state):
            p.data[...] = backend.asarray(checkpoint.masters[name].reshape(p.shape), dtype=p.dtype)
            for key, value in state.items():
                if hasattr(value, "nbytes"):
                    value[...] = backend.asarray(checkpoint.states[key][name].reshape(value.shape), dtype=value.dtype)
            state["step"] = step
    if hasattr(trainer, "steps_done"):
        trainer.steps_done = checkpoint.step  # the batch number that keys dropout masks (nn/batch_rows.py)
    scaler, saved = getattr(trainer, "scaler", None), checkpoint.manifest.get("loss_scaler")
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
# Consolidation: python -m refimpl consolidate CKPT --out FILE
# ------------------------------------------------------------------------------------------------


def consolidate(path: str, out: str, optimizer: bool = False) -> dict:
    """Write the whole model (and optionally optimizer state) as one .npz; nothing is written on error."""
    checkpoint = read(path)
    shapes = {name: tuple(shape) for name, shape in checkpoint.manifest["parameters"]}
    arrays = {name: checkpoint.masters[name].reshape(shapes[name]) for name in shapes}
    if optimizer:
        for key, values in checkpoint.states.items():
            arrays.update({f"optimizer/{key}/{name}": v.reshape(shapes[name]) for name, v in values.items()})
        arrays["optimizer/step"] = np.array(checkpoint.manifest["optimizer"]["step"])
    if not out.endswith(".npz"):
        raise ValueError(f"--out must name a .npz file, got {out}")
    digest, size = _write_atomically(out, lambda f: np.savez(f, **arrays))
    return {"checkpoint": checkpoint.path, "out": out, "step": checkpoint.step, "parameters": len(shapes),
            "elements": int(sum(int(np.prod(s, dtype=np.int64)) for s in shapes.values())), "bytes": size,
            "sha256": digest, "saved_world_size": checkpoint.manifest["world_size"],
            "saved_zero_stage": checkpoint.manifest["zero_stage"], "precision": checkpoint.manifest["precision"]}


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory (step_*), or a --save-dir (its newest checkpoint)")
    p.add_argument("--out", required=True, help="the .npz file to write (replaced only if everything checks out)")
    p.add_argument("--optimizer", action="store_true", help="also write optimizer state as optimizer/<key>/<name>")
    p.add_argument("--json", action="store_true", help="print one JSON summary line on stdout")


def run(args) -> int:
    result = consolidate(args.checkpoint, args.out, args.optimizer)
    log(f"consolidated {result['checkpoint']} (step {result['step']}, saved by {result['saved_world_size']} rank(s) "
        f"at ZeRO stage {result['saved_zero_stage']}) into {result['out']}: {result['parameters']} parameters, "
        f"{result['elements']} elements, {result['bytes']} bytes")
    if args.json:
        emit_json(result)
    return 0
