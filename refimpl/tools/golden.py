"""Golden cases: single-process training written to disk, for an implementation in any framework to be
checked against (the command: `python -m refimpl golden`, refimpl/tools/commands/golden.py; the
format and a worked PyTorch example: docs/golden_cases.md).

A case is a directory of four files, NumPy's .npz (a zip of .npy arrays, readable without refimpl:
numpy.load, or any zip reader and the .npy format's 128-byte-aligned header) and one JSON manifest:

    manifest.json   format, case_id, the configuration (model, optimizer, clipping, batch), the
                    architecture in words, the parameters' names, shapes and dtype, and the
                    SHA-256 and size of every .npz
    initial.npz     {name: array}: the initial weights, by the model's parameter names
    batches.npz     x (S, B, T) and y (S, B, T) int64 for the GPT (y = -100 where not counted),
                    x (S, B, 2) float and y (S, B) int64 for the MLP: the global batch of every step
    expected.npz    loss (S,): the global batch's loss at step s, before its update;
                    grads/SSS/NAME: the gradient of NAME at step s as the optimizer used it (after
                    clipping); params/SSS/NAME: NAME after step s's update  (SSS: the step, 000, 001, ...)

A results file, from any framework, is one .npz with the keys of expected.npz (loss, grads/SSS/NAME,
params/SSS/NAME for every step and parameter, the same shapes) and, optionally, case_id (a string
array: the manifest's case_id, to catch results of another case). check_results compares it with the
case, per tensor, by the relative error of the whole tensor:

    ‖result − expected‖ ≤ atol + rtol · ‖expected‖        (2-norms over the tensor's elements)

with rtol 1e-10, atol 1e-12 for float64 cases and 1e-5, 1e-6 for float32 (as verify's); a NaN or an
inf fails. A norm over the tensor, not element by element: another framework sums in other orders,
and AdamW can amplify one element's rounding far more than the tensor's (verification.py).

Bad input -- a manifest or .npz that cannot be read, a checksum that does not match, a missing
tensor, a shape or a configuration that does not match -- raises CaseError (a ValueError: one line,
exit status 2); differences beyond the tolerance are a FAIL (exit status 1).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile

import numpy as np

from refimpl.local_trainer import LocalTrainer
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task

FORMAT = "refimpl-golden/1"
FILES = ("initial.npz", "batches.npz", "expected.npz")
TOLERANCES = {"float64": (1e-10, 1e-12), "float32": (1e-5, 1e-6)}
# The flags of a case: what is computed depends on these and nothing else (one process, no parallelism).
CONFIG_FIELDS = ("model", "steps", "batch_size", "lr", "optimizer", "weight_decay", "clip", "dtype", "seed",
                 "n_layer", "d_model", "n_head", "seq_len", "data")
MAX_BYTES = 1 << 30  # a case larger than this is refused (fewer --steps, or a smaller model)


class CaseError(ValueError):
    """A golden case or a results file that cannot be compared: one line, exit status 2."""


def key(kind: str, step: int, name: str) -> str:
    """The .npz key of a per-step tensor: grads/000/wte.weight, params/002/lm_head.weight."""
    return f"{kind}/{step:03d}/{name}"


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def case_id(config: dict, parameters: list) -> str:
    """SHA-256 of the configuration and the parameters' names and shapes, as canonical JSON: the same
    case written twice has the same id (the .npz files' bytes hold zip timestamps; their own
    checksums are in the manifest)."""
    text = json.dumps({"config": config, "parameters": parameters}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def optimizer_description(cfg: TrainConfig, optimizer) -> dict:
    """The optimizer's name, hyper-parameters and formula, for an implementation elsewhere."""
    if cfg.optimizer == "adamw":
        return {"name": "adamw", "lr": optimizer.lr, "betas": list(optimizer.betas), "eps": optimizer.eps,
                "weight_decay": optimizer.weight_decay,
                "formula": "m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; theta *= 1 - lr wd; "
                           "theta -= lr/(1-b1^t) * m / (sqrt(v/(1-b2^t)) + eps)  (torch.optim.AdamW)"}
    return {"name": "sgd", "lr": optimizer.lr, "momentum": optimizer.momentum, "weight_decay": optimizer.weight_decay,
            "formula": "g += wd theta; b = g at step 1, else b = momentum b + g; theta -= lr b  (torch.optim.SGD)"}


def model_description(cfg: TrainConfig, model, task) -> dict:
    """The architecture in words (refimpl/nn/models.py, layers.py), for an implementation elsewhere."""
    if cfg.model == "mlp":
        return {"name": "mlp", "sizes": [layer.weight.shape[1] for layer in model.mlp.layers]
                + [model.mlp.layers[-1].weight.shape[0]], "activation": "tanh between layers, none after the last",
                "linear": "y = x W^T + b, W of shape (out, in)",
                "loss": "sum of cross-entropy over the global batch's rows / their number"}
    c = model.config
    return {"name": "gpt", "arch": getattr(c, "arch", "gpt2"), "vocab_size": c.vocab_size, "seq_len": c.seq_len,
            "n_layer": c.n_layer, "n_head": c.n_head, "d_model": c.d_model, "tie_weights": c.tie_weights,
            "dropout": 0.0,
            "forward": "x = wte[idx] + wpe[0:T]; each block: x = x + attn(ln1(x)); x = x + mlp(ln2(x)) "
                       "(pre-LN); logits = ln_f(x) lm_head.weight^T (no bias)",
            "linear": "y = x W^T + b, W of shape (out, in)",
            "layer_norm": "eps 1e-5, biased variance (mean of squares of x - mean), weight and bias",
            "attention": "q, k, v = split(x qkv.weight^T + qkv.bias, 3 equal parts along the last axis, in that "
                         "order); each split into n_head heads of d_model/n_head consecutive columns; "
                         "softmax(q k^T / sqrt(d_model/n_head)) with -inf above the diagonal (causal); heads "
                         "concatenated in order; proj",
            "mlp": "layers.0 (4 d_model), GELU tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), "
                   "layers.1",
            "loss": "sum of cross-entropy over the global batch's targets != -100, divided by their number "
                    "(data parallelism: each rank's sum over its rows divided by the global count; the ranks' "
                    "gradients add up)"}


def estimated_bytes(cfg: TrainConfig, n_params: int) -> int:
    """The case's size: initial weights, then a gradient and a parameter array per step."""
    item = np.dtype(cfg.dtype).itemsize
    return (2 * cfg.steps + 1) * n_params * item


def write_case(cfg: TrainConfig, out_dir: str) -> dict:
    """Train cfg in one process (LocalTrainer) and write the case into out_dir; its manifest."""
    if cfg.dtype not in TOLERANCES:
        raise CaseError(f"a golden case is float64 or float32, not --dtype {cfg.dtype}")
    if cfg.dropout:
        raise CaseError("a golden case has no dropout: its masks are refimpl's random numbers, which another "
                        "framework cannot draw")
    task = build_task(cfg)
    model = build_model(cfg, task)
    n_params = model.num_parameters()
    if estimated_bytes(cfg, n_params) > MAX_BYTES:
        raise CaseError(f"the case would take {estimated_bytes(cfg, n_params) / 2**20:.0f} MiB ({cfg.steps} steps of "
                        f"{n_params:,} parameters): use fewer --steps or a smaller model (at most "
                        f"{MAX_BYTES / 2**20:.0f} MiB)")
    optimizer = build_optimizer(cfg, model.parameters())
    trainer = LocalTrainer(model, optimizer, 1, cfg.clip)
    trainer.record_grads = True
    initial = model.state_dict()
    names = list(initial)
    xs, ys, losses, expected = [], [], [], {}
    for step in range(cfg.steps):
        x, y = task.batch(step, cfg.batch_size)
        xs.append(x)
        ys.append(y)
        losses.append(trainer.step(x, y))
        params = trainer.full_parameters()
        for name in names:
            expected[key("grads", step, name)] = trainer.last_grads[name]
            expected[key("params", step, name)] = params[name]
    expected["loss"] = np.asarray(losses, dtype=np.float64)  # (S,)
    os.makedirs(out_dir, exist_ok=True)
    np.savez(os.path.join(out_dir, "initial.npz"), **initial)
    np.savez(os.path.join(out_dir, "batches.npz"), x=np.stack(xs), y=np.stack(ys))  # (S, B, ...) each
    np.savez(os.path.join(out_dir, "expected.npz"), **expected)
    config = {name: getattr(cfg, name) for name in CONFIG_FIELDS}
    if config["data"] is not None:
        config["data"] = os.path.basename(config["data"])  # the batches are in the case; the name is a label
    parameters = [{"name": name, "shape": list(initial[name].shape), "dtype": str(initial[name].dtype)}
                  for name in names]
    rtol, atol = TOLERANCES[cfg.dtype]
    manifest = {
        "format": FORMAT,
        "case_id": case_id(config, parameters),
        "config": config,
        "model": model_description(cfg, model, task),
        "optimizer": optimizer_description(cfg, optimizer),
        "clip": {"max_norm": cfg.clip, "formula": "off" if cfg.clip <= 0 else
                 "g *= min(1, max_norm / (sqrt(sum of every gradient's squares) + 1e-6)) "
                 "(torch.nn.utils.clip_grad_norm_)"},
        "parameters": parameters,
        "steps": cfg.steps,
        "tolerance": {"rtol": rtol, "atol": atol, "rule": "||result - expected|| <= atol + rtol ||expected|| "
                      "per tensor (2-norm)"},
        "schema": {"initial.npz": "NAME: initial weights",
                   "batches.npz": "x (S, B, ...), y (S, B, ...): global batch of step s (y = -100: not counted)",
                   "expected.npz": "loss (S,): loss of step s before its update; grads/SSS/NAME: gradient of "
                                   "step s as the optimizer used it (after clipping); params/SSS/NAME: after step "
                                   "s's update",
                   "results": "one .npz with expected.npz's keys and shapes, and optionally case_id"},
        "files": {name: {"sha256": sha256(os.path.join(out_dir, name)),
                         "bytes": os.path.getsize(os.path.join(out_dir, name))} for name in FILES},
        "written_by": "python -m refimpl golden " + " ".join(_flags(cfg)),
    }
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return manifest


def _flags(cfg: TrainConfig) -> list[str]:
    """The command-line flags that write this case again (every one, defaults included)."""
    return [f"--{name.replace('_', '-')} {getattr(cfg, name)}" for name in CONFIG_FIELDS
            if getattr(cfg, name) is not None]


def config_of(manifest: dict) -> TrainConfig:
    """The TrainConfig a manifest's configuration describes."""
    config = dict(manifest["config"])
    return TrainConfig(**{name: config[name] for name in CONFIG_FIELDS if name != "data"})


# -- reading and checking ------------------------------------------------------------------------

def _load_npz(path: str, what: str) -> dict:
    """{key: array} of an .npz, or one line saying why it cannot be read (no pickles: plain arrays only)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise CaseError(f"{what} {path} does not exist") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise CaseError(f"{what} {path} is not a readable .npz of plain arrays ({exc}); write it with numpy.savez")\
            from None


def load_case(case_dir: str) -> tuple[dict, dict, dict, dict]:
    """(manifest, initial, batches, expected) of a case, its files' checksums, its configuration and
    its arrays' names and shapes checked (CaseError on the first problem)."""
    path = os.path.join(case_dir, "manifest.json")
    if not os.path.isdir(case_dir):
        raise CaseError(f"golden case {case_dir} is not a directory; write one with python -m refimpl golden --out "
                        f"{case_dir}")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CaseError(f"golden case {case_dir} has no manifest.json; write the case with python -m refimpl golden "
                        f"--out DIR") from None
    except (OSError, ValueError) as exc:
        raise CaseError(f"golden case {case_dir}: manifest.json is not readable JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CaseError(f"golden case {case_dir}: manifest.json's format is {found!r}, not {FORMAT!r}")
    for field in ("case_id", "config", "parameters", "steps", "files"):
        if field not in manifest:
            raise CaseError(f"golden case {case_dir}: manifest.json has no {field!r}")
    for name in FILES:
        entry = manifest["files"].get(name) if isinstance(manifest["files"], dict) else None
        file_path = os.path.join(case_dir, name)
        if not isinstance(entry, dict) or "sha256" not in entry:
            raise CaseError(f"golden case {case_dir}: manifest.json gives no sha256 of {name}")
        if not os.path.isfile(file_path):
            raise CaseError(f"golden case {case_dir}: {name} is missing")
        found = sha256(file_path)
        if found != entry["sha256"]:
            raise CaseError(f"golden case {case_dir}: {name}'s SHA-256 is {found[:16]}..., the manifest says "
                            f"{str(entry['sha256'])[:16]}...: the file changed since the case was written; "
                            f"write the case again")
    config, parameters = manifest["config"], manifest["parameters"]
    if case_id(config, parameters) != manifest["case_id"]:
        raise CaseError(f"golden case {case_dir}: the manifest's configuration or parameter list does not match its "
                        f"case_id (edited by hand?); write the case again")
    _check_config(case_dir, manifest)
    initial = _load_npz(os.path.join(case_dir, "initial.npz"), "golden case file")
    batches = _load_npz(os.path.join(case_dir, "batches.npz"), "golden case file")
    expected = _load_npz(os.path.join(case_dir, "expected.npz"), "golden case file")
    shapes = {p["name"]: tuple(p["shape"]) for p in parameters}
    _check_tensors(f"golden case {case_dir}: initial.npz", initial, {name: shapes[name] for name in shapes})
    _check_tensors(f"golden case {case_dir}: expected.npz", expected, expected_shapes(manifest))
    for name in ("x", "y"):
        if name not in batches or batches[name].shape[:2] != (manifest["steps"], config["batch_size"]):
            raise CaseError(f"golden case {case_dir}: batches.npz's {name} is not ({manifest['steps']}, "
                            f"{config['batch_size']}, ...)")
    return manifest, initial, batches, expected


def _check_config(case_dir: str, manifest: dict) -> None:
    """The configuration builds a model whose parameters are the manifest's (names, shapes, order)."""
    try:
        cfg = config_of(manifest)
        cfg.check()
    except (KeyError, TypeError, ValueError) as exc:
        raise CaseError(f"golden case {case_dir}: manifest.json's config is not a valid configuration ({exc})") \
            from None
    if manifest["config"].get("data") is not None:
        return  # a text file's vocabulary: the batches and the parameters carry it
    model = build_model(cfg, build_task(cfg))
    built = [{"name": name, "shape": list(p.shape), "dtype": str(p.dtype)} for name, p in model.named_parameters()]
    if built != manifest["parameters"]:
        raise CaseError(f"golden case {case_dir}: manifest.json's parameters are not those of its config's model "
                        f"(refimpl builds {len(built)} tensors, the manifest lists {len(manifest['parameters'])}); "
                        f"write the case again with this version of refimpl")


def expected_shapes(manifest: dict) -> dict:
    """{key: shape} of every array a results file must hold."""
    shapes = {"loss": (manifest["steps"],)}
    for step in range(manifest["steps"]):
        for p in manifest["parameters"]:
            for kind in ("grads", "params"):
                shapes[key(kind, step, p["name"])] = tuple(p["shape"])
    return shapes


def _check_tensors(what: str, arrays: dict, shapes: dict) -> None:
    """Every key of `shapes` present, with that shape and a numeric dtype: CaseError on the first problem."""
    missing = [name for name in shapes if name not in arrays]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CaseError(f"{what} lacks {len(missing)} of the {len(shapes)} tensors: {', '.join(missing[:3])}{more}; "
                        f"it needs loss, grads/SSS/NAME and params/SSS/NAME for every step and parameter "
                        f"(docs/golden_cases.md)")
    for name, shape in shapes.items():
        array = arrays[name]
        if tuple(array.shape) != tuple(shape):
            raise CaseError(f"{what}: {name} has shape {tuple(array.shape)}, the case's is {tuple(shape)}")
        if array.dtype.kind not in "fiu":
            raise CaseError(f"{what}: {name} has dtype {array.dtype}, not a number type")


def _relative(result: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> tuple[float, bool]:
    """(‖result − expected‖ / ‖expected‖, passes): both finite and ‖diff‖ <= atol + rtol ‖expected‖."""
    result = np.asarray(result, dtype=np.float64).ravel()
    expected = np.asarray(expected, dtype=np.float64).ravel()
    if not (np.isfinite(result).all() and np.isfinite(expected).all()):
        return math.nan, False
    diff, scale = float(np.linalg.norm(result - expected)), float(np.linalg.norm(expected))
    relative = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    return relative, diff <= atol + rtol * scale


def check_results(case_dir: str, results_path: str, rtol: float | None = None, atol: float | None = None) -> dict:
    """Compare a results file with a case: {"ok", "failures": [...], "checked", "largest", ...}."""
    manifest, _, _, expected = load_case(case_dir)
    results = _load_npz(results_path, "results file")
    if "case_id" in results and str(results["case_id"]) != manifest["case_id"]:
        raise CaseError(f"results file {results_path} was produced from case {str(results['case_id'])[:16]}..., not "
                        f"from {case_dir} ({manifest['case_id'][:16]}...): another configuration")
    _check_tensors(f"results file {results_path}", results, expected_shapes(manifest))
    dtype = manifest["config"]["dtype"]
    default_rtol, default_atol = TOLERANCES.get(dtype, TOLERANCES["float32"])
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    for flag, value in (("--rtol", rtol), ("--atol", atol)):
        if not (math.isfinite(value) and value >= 0):
            raise CaseError(f"{flag} must be a finite number >= 0, got {value}")
    names = [p["name"] for p in manifest["parameters"]]
    failures, largest, checked = [], {"relative_error": -1.0, "what": None}, 0
    for step in range(manifest["steps"]):
        entries = [("loss", "loss", results["loss"][step], expected["loss"][step])]
        for kind, label in (("grads", "gradient"), ("params", "parameter")):
            entries += [(label, name, results[key(kind, step, name)], expected[key(kind, step, name)])
                        for name in names]
        for label, name, value, reference in entries:
            relative, passes = _relative(value, reference, rtol, atol)
            checked += 1
            where = f"step {step} {label} {name}" if label != "loss" else f"step {step} loss"
            if not (relative <= largest["relative_error"]):  # NaN counts as the largest
                largest = {"relative_error": relative, "what": where}
            if not passes:
                failures.append({"step": step, "kind": label, "name": name, "relative_error": relative,
                                 "line": f"{where}: relative error {relative:.3g}"
                                         + (" (not finite)" if math.isnan(relative) else f" > rtol {rtol:g}")})
    return {"ok": not failures, "case": case_dir, "results": results_path, "case_id": manifest["case_id"],
            "steps": manifest["steps"], "tensors_per_step": len(names), "checked": checked, "rtol": rtol,
            "atol": atol, "largest": largest, "failures": failures,
            "first_failure": failures[0]["line"] if failures else None}


def results_from_trainer(case_dir: str, make_trainer, world=None) -> dict:
    """{key: array} of results computed by a refimpl trainer from the case's own files (initial weights
    and batches, not refimpl's seed): make_trainer(cfg, model) -> trainer. The same file layout any
    other framework writes; tests use it with LocalTrainer and the distributed trainers."""
    manifest, initial, batches, _ = load_case(case_dir)
    cfg = config_of(manifest)
    task = build_task(cfg) if manifest["config"].get("data") is None else None
    if task is None:
        raise CaseError("results_from_trainer rebuilds the model from the configuration; a --data case needs the "
                        "text file's vocabulary")
    model = build_model(cfg, task)
    model.load_state_dict(initial)
    trainer = make_trainer(cfg, model)
    trainer.record_grads = True
    results: dict = {"case_id": np.array(manifest["case_id"])}
    losses = []
    for step in range(manifest["steps"]):
        losses.append(trainer.step(batches["x"][step], batches["y"][step]))
        params = trainer.full_parameters()
        if trainer.rank == 0:
            for name in initial:
                results[key("grads", step, name)] = trainer.last_grads[name]
                results[key("params", step, name)] = params[name]
    results["loss"] = np.asarray(losses, dtype=np.float64)
    return results


__all__ = ["CaseError", "FORMAT", "write_case", "load_case", "check_results", "results_from_trainer", "key"]
