"""distance: how far is an algorithm that is not meant to equal single-process training? (the command:
`python -m refimpl distance --trainer FILE.py:FUNCTION [flags]`, refimpl/tools/commands/distance.py.)

verify asks a yes-or-no question at a tolerance of rounding; local SGD, gradient compression or
asynchronous updates change what is computed on purpose, and fail it at once by a factor that means
nothing. This module measures the difference instead, in two ways, on the same global batches as
the reference (local_trainer.LocalTrainer, one process):

Lockstep (one step's error). Before each step t the reference is given the trainer's parameters
θ_t (rank 0's), so both sides start the step from the same point, and for every tensor and for the
whole model (all tensors as one vector) it reports

    gradient error     ‖ĝ_t − g_t‖ / ‖g_t‖        ĝ: the trainer's gradient as its optimizer used it,
    cosine             ĝ_t·g_t / (‖ĝ_t‖ ‖g_t‖)    g: the reference's at θ_t on the same batch
    update error       ‖θ_{t+1} − θ^ref_{t+1}‖ / ‖θ^ref_{t+1} − θ_t‖   the step's error, relative to
                                                 the reference's step (the reference keeps its own
                                                 optimizer state, fed with the exact gradients)
    accumulated error  ‖Σ_{s≤t} (ĝ_s − g_s)‖ / mean_{s≤t} ‖g_s‖   in units of an average gradient:
                                                 what the optimizer missed, summed over the steps
                                                 (‖g_t‖ itself is reported too: gradient_norm)

Free-running (where training goes). The trainer and a second reference train from the same
initial weights without being reset:

    drift              ‖θ_t − θ^ref_t‖ / ‖θ^ref_t − θ_0‖   relative to how far the reference moved
    loss, held-out loss   both curves side by side (held-out: task.eval_batch() every --eval-every steps)

The worst difference is labelled by kind: gradient (lockstep gradient error), parameter (lockstep
update error, or free-running drift) or loss (free-running training or held-out loss, relative to
the reference's), with the tensor and the step. A value NaN or inf (a side that diverged) is the
worst there is, and named in `problems`.

distance_run computes all of it (collective: every rank runs the trainer; rank 0 also runs the two
references and holds the figures); draw draws them (matplotlib, optional: the `viz` extra).
"""

from __future__ import annotations

import math

import numpy as np

from refimpl.local_trainer import LocalTrainer
from refimpl.tools.run import build_model, build_optimizer, build_task, evaluate
from refimpl.tools.runtime import preflight, watchdog
from refimpl.tools.runtime.agreement import check_same_run

# What distance reads and sets of a trainer (a subset of protocols.Verifiable: no report needed).
MEMBERS = ("step", "full_parameters", "record_grads", "last_grads", "world_size", "rank")
WHOLE = "(all tensors)"  # the name under which the whole model's figures are given


def relative_error(value: np.ndarray, reference: np.ndarray) -> float:
    """‖value − reference‖ / ‖reference‖ (0 when both are zero, inf when only the reference is)."""
    diff = float(np.linalg.norm(np.ravel(value - reference)))
    scale = float(np.linalg.norm(np.ravel(reference)))
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def cosine(value: np.ndarray, reference: np.ndarray) -> float:
    """value·reference / (‖value‖ ‖reference‖) (1 when both are zero, 0 when only one is)."""
    a, b = np.ravel(value), np.ravel(reference)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(np.dot(a, b)) / (na * nb)


def flat(arrays: dict, names: list) -> np.ndarray:
    """The arrays of `names`, raveled and concatenated: the whole model as one vector (Ψ,)."""
    return np.concatenate([np.ravel(np.asarray(arrays[name], dtype=np.float64)) for name in names])


def check_trainer(trainer) -> None:
    """A trainer lacking what distance uses: one line naming the members."""
    lacking = [member for member in MEMBERS if not hasattr(trainer, member)]
    if lacking:
        raise ValueError(f"--trainer: {type(trainer).__name__} lacks {', '.join(lacking)} (distance uses "
                         f"{', '.join(MEMBERS)}: refimpl/protocols.py, docs/distance.md)")


def check_records(trainer, shapes: dict, grads, params) -> None:
    """last_grads and full_parameters() hold every parameter, by name, with its shape: one line otherwise."""
    for member, records in (("last_grads", grads), ("full_parameters()", params)):
        if not isinstance(records, dict):
            raise ValueError(f"{type(trainer).__name__}.{member} is {type(records).__name__}; it is a dict "
                             "{parameter name: array} on rank 0")
        for name, shape in shapes.items():
            if name not in records:
                raise ValueError(f"{type(trainer).__name__}.{member} lacks {name!r}; it holds every parameter of the "
                                 f"model by name (model.named_parameters())")
            if np.shape(records[name]) != shape:
                raise ValueError(f"{type(trainer).__name__}.{member}[{name!r}] has shape {np.shape(records[name])}, "
                                 f"the parameter's is {shape}")


def require_matplotlib() -> None:
    """--plot needs matplotlib (the `viz` extra): one line, before any work, if it is missing."""
    try:
        import matplotlib  # noqa: F401, PLC0415 - matplotlib is optional (--plot only)
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib, or pip install -e '.[viz]')") from None


def _eval_steps(steps: int, every: int) -> list[int]:
    """The steps after which held-out loss is measured: every `every`-th, and the last."""
    chosen = [t for t in range(steps) if (t + 1) % every == 0]
    return chosen if chosen and chosen[-1] == steps - 1 else chosen + [steps - 1]


def _held_out_loss(model, params: dict, task) -> float:
    model.load_state_dict(params)
    return evaluate(model, task)[0]


def reference_run(cfg, eval_every: int) -> dict:
    """Free-running single-process training (rank 0): the loss per step, the held-out loss, the
    parameters after every step."""
    task = build_task(cfg)
    model = build_model(cfg, task)
    reference = LocalTrainer(model, build_optimizer(cfg, model.parameters()), cfg.grad_accum, cfg.clip)
    initial = reference.full_parameters()
    losses, params, held_out = [], [], {}
    eval_model = build_model(cfg, task)
    wanted = set(_eval_steps(cfg.steps, eval_every))
    for step in range(cfg.steps):
        x, y = task.batch(step, cfg.batch_size)
        losses.append(reference.step(x, y))
        params.append(reference.full_parameters())
        if step in wanted:
            held_out[step] = _held_out_loss(eval_model, params[-1], task)
        watchdog.progress()  # the other ranks wait meanwhile: this rank is alive
    return {"initial": initial, "loss": losses, "params": params, "held_out": held_out}


class _Tracker:
    """The worst value of each kind, with where it was."""

    def __init__(self) -> None:
        self.worst: dict = {}

    def see(self, kind: str, mode: str, name: str, step: int, value: float) -> None:
        ranked = math.inf if math.isnan(value) else value
        best = self.worst.get(kind)
        if best is None or ranked > best["_rank"]:
            self.worst[kind] = {"kind": kind, "mode": mode, "name": name, "step": step, "value": value,
                                "_rank": ranked}

    def result(self) -> tuple[dict | None, dict]:
        by_kind = {kind: {k: v for k, v in w.items() if k != "_rank"} for kind, w in self.worst.items()}
        overall = max(self.worst.values(), key=lambda w: w["_rank"], default=None)
        return (None if overall is None else by_kind[overall["kind"]]), by_kind


def measure(cfg, world, factory, label: str, reference: dict | None, eval_every: int) -> dict:
    """Train factory's trainer (collective) and, on rank 0, compare it with the lockstep reference
    and the free-running `reference` (reference_run's). Rank 0 returns the figures, the others {}."""
    task = build_task(cfg)
    model = build_model(cfg, task)
    check_same_run(world, cfg, task, model)
    trainer = factory(cfg, model, world)
    check_trainer(trainer)
    trainer.record_grads = True
    root = world.rank == 0
    if root:
        lock_model = build_model(cfg, task)
        lockstep = LocalTrainer(lock_model, build_optimizer(cfg, lock_model.parameters()), cfg.grad_accum, cfg.clip)
        lockstep.record_grads = True
        eval_model = build_model(cfg, task)
        names = [name for name, _ in lock_model.named_parameters()]
        series = {name: {"gradient_error": [], "cosine": [], "update_error": [], "drift": []}
                  for name in [WHOLE, *names]}
        accumulated_error, gradient_norm, loss, held_out, problems = [], [], [], {}, []
        missed = np.zeros(sum(p.size for p in lock_model.parameters()))  # Σ (ĝ_s − g_s) (Ψ,)
        reference_norms = 0.0
        tracker = _Tracker()
        wanted = set(_eval_steps(cfg.steps, eval_every))
    before = trainer.full_parameters()
    for step in range(cfg.steps):
        x, y = task.batch(step, cfg.batch_size)
        step_loss = trainer.step(x, y)
        after = trainer.full_parameters()  # every rank calls it (a sharded trainer communicates here)
        if not root:
            continue
        if step == 0:
            check_records(trainer, {name: p.shape for name, p in lock_model.named_parameters()}, trainer.last_grads,
                          after)
        lock_model.load_state_dict(before)  # lockstep: the reference starts this step where the trainer did
        lockstep.step(x, y)
        watchdog.progress()
        grads, ref_grads, ref_after = trainer.last_grads, lockstep.last_grads, lockstep.full_parameters()
        for name in [WHOLE, *names]:
            pick = (lambda arrays: flat(arrays, names)) if name == WHOLE else (lambda arrays, n=name: arrays[n])
            g, g_ref = pick(grads), pick(ref_grads)
            theta_before, theta, theta_ref = pick(before), pick(after), pick(ref_after)
            theta_0, theta_free = pick(reference["initial"]), pick(reference["params"][step])
            figures = {"gradient_error": relative_error(g, g_ref), "cosine": cosine(g, g_ref),
                       "update_error": relative_error(theta - theta_before, theta_ref - theta_before),
                       # (θ_t − θ_0) − (θ^ref_t − θ_0) = θ_t − θ^ref_t: the drift over the distance travelled
                       "drift": relative_error(theta - theta_0, theta_free - theta_0)}
            for key, value in figures.items():
                series[name][key].append(value)
            if name != WHOLE:
                tracker.see("gradient", "lockstep gradient error", name, step, figures["gradient_error"])
                tracker.see("parameter", "lockstep update error", name, step, figures["update_error"])
                tracker.see("parameter", "free-running drift", name, step, figures["drift"])
        missed += flat(grads, names) - flat(ref_grads, names)
        gradient_norm.append(float(np.linalg.norm(flat(ref_grads, names))))  # ‖g_t‖
        reference_norms += gradient_norm[-1]
        mean_norm = reference_norms / (step + 1)
        accumulated_error.append(float(np.linalg.norm(missed)) / mean_norm if mean_norm > 0 else math.inf)
        loss.append(float(step_loss))
        tracker.see("loss", "free-running training loss", "loss", step,
                    relative_error(np.float64(step_loss), np.float64(reference["loss"][step])))
        if step in wanted:
            held_out[step] = _held_out_loss(eval_model, after, task)
            tracker.see("loss", "free-running held-out loss", "held-out loss", step,
                        relative_error(np.float64(held_out[step]), np.float64(reference["held_out"][step])))
        if not all(math.isfinite(series[WHOLE][key][-1]) for key in ("gradient_error", "update_error")) \
                or not math.isfinite(step_loss):
            problems.append(f"step {step}: not finite: gradient error {series[WHOLE]['gradient_error'][-1]}, "
                            f"update error {series[WHOLE]['update_error'][-1]}, loss {step_loss}")
        before = after
    if not root:
        return {}
    worst, worst_by_kind = tracker.result()
    report = trainer.report() if hasattr(trainer, "report") else {}
    return {"label": label, "trainer": type(trainer).__name__, "report": report,
            "model": {**series[WHOLE], "accumulated_error": accumulated_error, "gradient_norm": gradient_norm},
            "tensors": {name: series[name] for name in names},
            "loss": loss, "held_out": {"steps": sorted(held_out), "loss": [held_out[s] for s in sorted(held_out)]},
            "worst": worst, "worst_by_kind": worst_by_kind, "problems": problems}


def distance_run(cfg, world, factories: list, eval_every: int) -> dict:
    """Measure every (label, factory) against single-process training (collective). Rank 0 returns
    {"steps", "world_size", "reference": {loss, held_out}, "trainers": [measure's dict, ...]}; the others {}."""
    task = build_task(cfg)
    preflight.check(cfg, task, world, verify=True)  # rank 0 also holds the references
    reference = reference_run(cfg, eval_every) if world.rank == 0 else None
    measured = [measure(cfg, world, factory, label, reference, eval_every) for label, factory in factories]
    if world.rank != 0:
        return {}
    steps = sorted(reference["held_out"])
    return {"steps": cfg.steps, "world_size": world.size,
            "reference": {"loss": reference["loss"],
                          "held_out": {"steps": steps, "loss": [reference["held_out"][s] for s in steps]}},
            "trainers": measured}


def summary_line(measured: dict, steps: list[int]) -> str:
    """One line: the whole model's gradient error and drift at some steps, and the worst difference."""
    model = measured["model"]
    shown = [s for s in steps if s < len(model["gradient_error"])]
    at = ", ".join(f"step {s} {model['gradient_error'][s]:.3g}" for s in shown)
    drift = ", ".join(f"step {s} {model['drift'][s]:.3g}" for s in shown)
    accumulated = ", ".join(f"step {s} {model['accumulated_error'][s]:.3g}" for s in shown)
    worst = measured["worst"]
    text = (f"{measured['label']}: gradient error {at}; accumulated {accumulated}; drift {drift}")
    if worst is not None:
        text += (f"; worst: {worst['kind']} ({worst['mode']}) {worst['name']} at step {worst['step']}, "
                 f"{worst['value']:.3g}")
    return text


def short_label(spec: str) -> str:
    """'docs/examples/topk_trainer.py:make_trainer' -> 'topk_trainer:make_trainer' (a legend's entry)."""
    module, _, function = spec.rpartition(":")
    stem = module.replace("\\", "/").rpartition("/")[2].removesuffix(".py").rpartition(".")[2]
    return f"{stem}:{function}" if module else spec


def draw(result: dict, path: str, title: str | None = None) -> None:
    """Six panels (matplotlib, optional): lockstep gradient error, cosine, accumulated error and update
    error; free-running drift; loss and held-out loss beside the reference's."""
    require_matplotlib()
    import matplotlib  # noqa: PLC0415 - matplotlib is optional (--plot only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib is optional
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    panels = [("gradient_error", "lockstep: gradient error ‖ĝ − g‖ / ‖g‖", True),
              ("cosine", "lockstep: cosine(ĝ, g)", False),
              ("accumulated_error", "lockstep: ‖Σ (ĝ − g)‖ / mean ‖g‖", True),
              ("update_error", "lockstep: update error ‖Δθ − Δθ_ref‖ / ‖Δθ_ref‖", True),
              ("drift", "free-running: drift ‖θ − θ_ref‖ / ‖θ_ref − θ₀‖", True)]
    steps = np.arange(1, result["steps"] + 1)
    for ax, (key, label, log) in zip(axes.flat, panels):
        for measured in result["trainers"]:
            values = np.asarray(measured["model"][key], dtype=float)
            ax.plot(steps[:len(values)], values, label=short_label(measured["label"]))
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    ax = axes.flat[5]
    ax.plot(steps, result["reference"]["loss"], color="black", lw=1.5, label="one process")
    held = result["reference"]["held_out"]
    ax.plot(np.asarray(held["steps"]) + 1, held["loss"], "o--", color="black", ms=4, label="one process, held-out")
    for index, measured in enumerate(result["trainers"]):
        color = f"C{index}"
        ax.plot(steps[:len(measured["loss"])], measured["loss"], color=color, lw=1, alpha=0.8)
        ax.plot(np.asarray(measured["held_out"]["steps"]) + 1, measured["held_out"]["loss"], "o--", color=color,
                ms=4)
    ax.set_title("free-running: loss (lines) and held-out loss (dashed, dots)", fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title or f"distance from single-process training, {result['world_size']} process(es)")
    fig.tight_layout()
    metadata = {"Date": None} if str(path).endswith(".svg") else None
    fig.savefig(path, dpi=110, metadata=metadata)
    plt.close(fig)
