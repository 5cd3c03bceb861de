"""Which run a checkpoint belongs to: the run's configuration fingerprint.

A *run* is defined by what it computes: the model and its shape, the data, the seed, the
optimizer and its hyperparameters, the batch size, the precision, dropout. Every manifest of a
sharded checkpoint (sharded.py) records those flags as a fingerprint -- the values themselves,
so that an error can name the flags that differ, and a SHA-256 of them:

    {"fields": {"model": "gpt", "seed": 0, "lr": 0.003, ..., "data": "sha256:9f86d0...", ...},
     "sha256": "<SHA-256 of the fields as canonical JSON>",
     "data_path": "input.txt"}

The data are identified by their contents: --data FILE by the file's SHA-256 (its path is
recorded for messages only, so the same file copied to a node's scratch disk is the same run),
the synthetic tasks by their flags (--model, --seq-len, --seed).

Every TrainConfig field belongs to the fingerprint except those in MAY_CHANGE: they say how long
the run trains and how the same computation is laid out on the machine (ranks, ZeRO stage,
buckets, memory, activation recomputation), which only changes the order of floating-point sums.
A continued run may change them (`--resume ckpt --steps 600` at another world size and stage);
it may not change anything in the fingerprint, precision (--dtype) included: float64, float32 and
mixed precision compute different numbers, so a run that switches precision is another run.

Production systems keep the same kind of record less strictly: DeepSpeed stores the whole
ds_config in its checkpoints and Megatron-LM stores its argument namespace (and checks a few
shape-defining arguments on load); neither refuses a changed learning rate.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

from refimpl.tools.saved_runs import safe_files

# TrainConfig fields a resumed run may change: its length, where it saves, and how the same
# arithmetic is laid out. A new TrainConfig field is part of the fingerprint unless it is named here
# (tests/test_saved_runs_guards.py lists the fingerprint's fields, so adding one is a decision).
MAY_CHANGE = frozenset({
    "steps", "save_dir", "save_every", "resume", "overwrite_checkpoints", "timeout",  # length, saving, watchdog
    "zero", "grad_accum", "collectives", "dp_mode", "bucket_bytes",  # how the global batch's gradient is summed
    "prefetch", "param_threshold", "mem_budget", "checkpoint",  # memory: gathering, budgets, recomputation
    "pp", "schedule", "micro_batches", "chunks", "action_costs", "trace",  # the pipeline's layout
    "tp", "sequence_parallel", "partition_activations", "ep", "overlap",  # tp, ep, F&B overlap: the same model
    "cp", "cp_impl",  # context parallelism: the same sequences, their tokens over ranks
})


def flag(field: str) -> str:
    """The command-line flag of a TrainConfig field: grad_accum -> --grad-accum."""
    return "--" + field.replace("_", "-")


# Fields that choose the block (docs/llama.md): recorded only when they differ from GPT-2's defaults,
# so a GPT-2 run's fingerprint is the same whether or not its TrainConfig has these fields.
RECORDED_WHEN_SET = {"arch": "gpt2", "kv_heads": None, "ffn_size": None}


def of(cfg) -> dict:
    """The fingerprint of the run that `cfg` (a TrainConfig) configures."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in MAY_CHANGE and not (k in RECORDED_WHEN_SET and v == RECORDED_WHEN_SET[k])}
    if fields.get("data") is not None:
        fields["data"] = "sha256:" + file_sha256(cfg.data)
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return {"fields": fields, "sha256": hashlib.sha256(text.encode()).hexdigest(), "data_path": cfg.data}


def file_sha256(path: str) -> str:
    """SHA-256 of a file's contents (cached while its inode, size and change times stay the same: a
    run saves many times)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"cannot read --data {path!r} to fingerprint the run: {exc.strerror or exc}") from None
    return _file_sha256(os.path.realpath(path), (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, version: tuple) -> str:
    h = hashlib.sha256()
    try:
        with safe_files.open_regular(path, f"--data {path!r}") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as exc:
        raise ValueError(f"cannot read --data {path!r} to fingerprint the run: {exc.strerror or exc}") from None
    return h.hexdigest()


def well_formed(fingerprint) -> bool:
    """Whether a manifest's fingerprint has the shape `of` returns ({"fields": {...}, "sha256": str})."""
    return (isinstance(fingerprint, dict) and isinstance(fingerprint.get("fields"), dict)
            and isinstance(fingerprint.get("sha256"), str)
            and isinstance(fingerprint.get("data_path"), (str, type(None))))


def differences(theirs: dict, ours: dict) -> list[str]:
    """The flags in which two fingerprints differ, as ["--seed: 0 there, 1 here", ...] (there: the
    checkpoint's run, here: this one); empty when they are the same run."""
    if theirs.get("sha256") == ours["sha256"]:  # the quick test; the fields decide
        return []
    a, b = theirs.get("fields", {}), ours["fields"]
    return [f"{flag(name)}: {_show(name, a, theirs)} there, {_show(name, b, ours)} here"
            for name in sorted(set(a) | set(b)) if a.get(name, _ABSENT) != b.get(name, _ABSENT)]


_ABSENT = object()


def _show(name: str, fields: dict, fingerprint: dict) -> str:
    if name not in fields:
        return "(not recorded)"
    value = fields[name]
    if name == "data" and isinstance(value, str) and value.startswith("sha256:"):
        return f"{fingerprint.get('data_path')} (sha256 {value[7:19]}...)"
    return "none" if value is None else str(value)
