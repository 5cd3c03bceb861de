"""verify: is the distributed algorithm right? (the command: `python -m refimpl verify [train flags]`,
refimpl/tools/commands/verify.py; this module is what it runs.)

Runs the distributed configuration (under mpiexec, or a world of one process) for K optimizer
steps, and, on rank 0, the single-process reference — local_trainer.LocalTrainer, plain training code that
imports nothing from refimpl.parallel — on the same global batches from the same initial weights.
After every step it compares the loss, every parameter's gradient (as used by the optimizer) and
every parameter with refimpl/tools/compare.py: it passes when every value is finite and

    |distributed − reference| <= atol + rtol · |reference|

with rtol 1e-10, atol 1e-12 in float64 and rtol 1e-5, atol 1e-6 in float32 (docs/design.md's
tolerances; --rtol and --atol override them). A NaN or inf anywhere fails, naming the step, the
tensor and the side.

verify runs in float64 unless --dtype says otherwise. A distributed run sums gradients in another
order than one process, so they differ by rounding (about 1e-16 relative in float64, 1e-7 in
float32). AdamW divides each gradient by its running magnitude: where a gradient is about as small
as eps (1e-8), the update's sensitivity to it is about lr/eps, 10⁵ times and more. In float32 that
turns harmless rounding into parameter differences above 1e-5 after one step (with SGD it does
not); in float64 the same amplification stays far below 1e-10.

--dtype mixed compares float16 storage / float32 master weights / dynamic loss scaling with
LocalTrainer running the same recipe, at the tolerance of refimpl/tools/compare_mixed.py, and checks that
both runs skip the same steps (--inject-overflow K puts an inf into one gradient at step K on both
sides: both must skip it).

verify_config runs one configuration and returns the figures; build_trainer and
load_trainer_factory give the trainer under test (refimpl's own, or one of yours: --trainer,
docs/verify_your_algorithm.md). The command line -- flags, --sweep, the report, the exit status --
is refimpl/tools/commands/verify.py.
"""

from __future__ import annotations

import inspect
import math

import numpy as np

from refimpl.local_trainer import LocalTrainer
from refimpl.protocols import Verifiable, missing
from refimpl.tools.compare import TOLERANCES, Comparison, compare_step
from refimpl.tools.compare_mixed import compare_mixed_step, mixed_tolerance, partial_gradient_magnitudes, state_by_name
from refimpl.tools.console import log
from refimpl.tools.plugin import load_function
from refimpl.tools.run import build_model, build_optimizer, build_task, make_trainer
from refimpl.tools.runtime import preflight, watchdog
from refimpl.tools.runtime.agreement import check_same_run

# -- the trainer under test ----------------------------------------------------------------------

def load_trainer_factory(spec: str):
    """FUNCTION from 'package.module:FUNCTION' or 'path/to/file.py:FUNCTION' (a clear error otherwise;
    the loader is refimpl/tools/plugin.py's, shared with --schedule)."""
    factory = load_function(spec, "--trainer", "docs/examples/flat_allreduce_trainer.py:make_trainer")
    function = spec.rpartition(":")[2]
    try:
        inspect.signature(factory).bind("cfg", "model", "world")
    except TypeError:
        raise ValueError(f"--trainer {spec!r}: {function} must take (cfg, model, world) and return a trainer") from None
    except ValueError:  # a builtin without a signature: let the call itself decide
        pass
    return factory


def build_trainer(cfg, world, factory=None, model=None):
    """The distributed trainer for cfg on world (refimpl's own, or factory(cfg, model, world)) of
    `model` (default: built from cfg)."""
    model = build_model(cfg, build_task(cfg)) if model is None else model
    if factory is None:
        return make_trainer(cfg, model, world, distributed=True)
    try:
        trainer = factory(cfg, model, world)
    except SystemExit as exc:  # sys.exit() in a plug-in is its failure, never a finished run
        raise ValueError(f"--trainer: {getattr(factory, '__name__', 'the factory')}(cfg, model, world) called "
                         f"sys.exit({exc.code!r}); it returns a trainer") from None
    lacking = missing(trainer, Verifiable)
    if lacking:
        raise ValueError(f"--trainer: {type(trainer).__name__} lacks {', '.join(lacking)} of the trainer protocol "
                         f"(refimpl/protocols.py, Verifiable; docs/verify_your_algorithm.md)")
    return trainer


# -- one configuration ---------------------------------------------------------------------------

def _last_held(trainer, model) -> list:
    """[the last parameter this rank holds]: the model's last, or in a pipeline its last stage's."""
    stages = getattr(trainer, "stages", None)  # refimpl's Trainer: {index: stage} of this rank
    return stages[max(stages)].parameters()[-1:] if stages else model.parameters()[-1:]


class _InjectInf:
    """Put an inf into the gradients of `params` on their way in (the overflow test): the reference
    into its last parameter's, the distributed run into the last parameter the last rank holds, so
    that both sides see an overflow in the same step."""

    def __init__(self, params) -> None:
        self.handles = [p.register_hook(self.with_inf) for p in params]

    @staticmethod
    def with_inf(grad):
        grad = grad.copy()
        grad.reshape(-1)[0] = np.inf
        return grad

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _check_records(trainer, loss, params) -> None:
    """What a trainer hands verify must be what the protocol says (protocols.Verifiable): a bad
    return value is one line naming the member and what it returned, not a traceback deep inside."""
    name = type(trainer).__name__
    if isinstance(loss, bool) or not isinstance(loss, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name}.step returned {type(loss).__name__} {_shown(loss)}; it returns the global "
                         "batch's loss, a number")
    for member, records in (("full_parameters()", params), ("last_grads", trainer.last_grads)):
        if not isinstance(records, dict):
            raise ValueError(f"{name}.{member} is {type(records).__name__} {_shown(records)}; it is a dict "
                             "{parameter name: array} on rank 0")
        for key, array in records.items():
            if not isinstance(key, str) or not hasattr(array, "shape"):
                raise ValueError(f"{name}.{member}[{key!r}] is {type(array).__name__} {_shown(array)}; each entry "
                                 "is a parameter's name and a NumPy array")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _skipped(trainer) -> int:
    return int(trainer.report().get("skipped_steps", 0) or 0)


def verify_config(cfg, world, factory=None, rtol=None, atol=None, inject_overflow=None, quiet=False) -> dict:
    """Run cfg distributed on `world` and, on rank 0, LocalTrainer; compare every step.

    Returns, on every rank, {"ok": bool (the same on every rank), ...}; rank 0's dict also holds the
    figures (max differences, tolerance_used, problems, per_step).
    """
    mixed = cfg.dtype == "mixed"
    if not mixed and cfg.dtype not in TOLERANCES:
        raise ValueError(f"verify compares float64, float32 or mixed runs, not --dtype {cfg.dtype}")
    if inject_overflow is not None and not mixed:
        raise ValueError("--inject-overflow tests mixed precision's skip rule: use it with --dtype mixed")
    if inject_overflow is not None and not 0 <= inject_overflow < cfg.steps:
        raise ValueError(f"--inject-overflow {inject_overflow} is not a step of this run (0 .. {cfg.steps - 1})")
    for flag, value in (("--rtol", rtol), ("--atol", atol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} must be a finite number >= 0, got {value}; leave it out for the dtype's "
                             f"default tolerance")
    if mixed and cfg.experts:
        raise ValueError("verify --dtype mixed bounds only float16 rounding of the same computation: with experts, "
                         "a token whose router probabilities tie to float32 rounding can go to another expert on "
                         "either side; verify --experts in float64")
    if mixed and cfg.tp > 1:
        raise ValueError("verify --dtype mixed bounds only float16 rounding: it assumes each piece of the batch is "
                         "computed with the reference's float32 arithmetic, and tensor parallelism changes it (sliced "
                         "GEMMs, partial sums over ranks: float32 noise in gradients that are exactly zero, such as "
                         "the key bias', which AdamW turns into up to 2·lr); verify --tp in float64")
    dp = world.size // (cfg.pp * cfg.tp)
    if cfg.pp > 1 or cfg.schedule is not None:  # the batch's pieces: dp replicas x M pipeline micro-batches
        pieces = (dp, cfg.micro_batches or 2 * cfg.pp)
    else:
        pieces = (dp, cfg.grad_accum)
    tol = mixed_tolerance(*pieces) if mixed else None
    if mixed and (rtol is not None or atol is not None):
        raise ValueError("--rtol and --atol set float32/float64 tolerances; mixed precision's follow from float16 "
                         "rounding (compare_mixed.mixed_tolerance)")
    if not mixed:
        rtol = TOLERANCES[cfg.dtype][0] if rtol is None else rtol
        atol = TOLERANCES[cfg.dtype][1] if atol is None else atol
    task = build_task(cfg)
    preflight.check(cfg, task, world, verify=True)  # before any model is built: rank 0 also holds the reference
    distributed_model = build_model(cfg, task)
    check_same_run(world, cfg, task, distributed_model)  # the same flags, data and model on every rank
    comm = world.with_collectives(cfg.collectives)

    # 1. The distributed run, recording what rank 0 needs for the comparison.
    trainer = build_trainer(cfg, comm, factory, distributed_model)
    trainer.record_grads = True
    recorded = []
    for step in range(cfg.steps):
        x, y = task.batch(step, cfg.batch_size)
        skipped_before = _skipped(trainer)
        hook = _InjectInf(_last_held(trainer, distributed_model)) \
            if step == inject_overflow and world.rank == world.size - 1 else None
        loss = trainer.step(x, y)
        if hook is not None:
            hook.remove()
        params = trainer.full_parameters()
        state = trainer.full_optimizer_state() if mixed else None  # for the lockstep reference
        if world.rank == 0:
            _check_records(trainer, loss, params)
            recorded.append({"loss": loss, "grads": trainer.last_grads, "params": params, "state": state,
                             "skipped": _skipped(trainer) > skipped_before})

    # 2. The single-process reference, on rank 0, on the same global batches.
    result = {"ok": True}
    if world.rank == 0:
        model = build_model(cfg, task)
        reference = LocalTrainer(model, build_optimizer(cfg, model.parameters()), cfg.grad_accum, cfg.clip)
        reference.record_grads = True
        total, per_step = Comparison(), []
        for step, ours in enumerate(recorded):
            x, y = task.batch(step, cfg.batch_size)
            if mixed and step > 0:  # lockstep: from the distributed run's state after the previous step
                reference.load_mixed_state(recorded[step - 1]["params"], recorded[step - 1]["state"])
            state_before = state_by_name(reference) if mixed else None
            magnitudes = partial_gradient_magnitudes(reference, x, y, tol["k"]) if mixed else None
            scale = reference.scaler.scale if mixed else None  # this step's loss scale
            skipped_before = _skipped(reference)
            hook = _InjectInf(model.parameters()[-1:]) if step == inject_overflow else None
            ref_loss = reference.step(x, y)
            watchdog.progress()  # the other ranks wait meanwhile: this rank is alive
            if hook is not None:
                hook.remove()
            ref = {"loss": ref_loss, "grads": reference.last_grads, "params": reference.full_parameters(),
                   "skipped": _skipped(reference) > skipped_before}
            if mixed:
                c = compare_mixed_step(step, ours, ref, state_before, reference.optimizer, tol, magnitudes,
                                       cfg.clip > 0, scale)
            else:
                c = compare_step(step, ours, ref, rtol, atol)
            total = total.merge(c)
            per_step.append({"step": step, "loss": ours["loss"], "reference_loss": ref_loss,
                             "skipped": ours["skipped"], "reference_skipped": ref["skipped"],
                             "max_abs_diff": c.max_abs_diff, "tolerance_used": c.tolerance_used, "ok": c.ok})
            if not quiet:
                log(f"step {step}: loss {ours['loss']:.12g} (reference {ref_loss:.12g})"
                    + (" skipped on both sides (overflow)" if ours["skipped"] and ref["skipped"] else "")
                    + f"; max |diff| {c.max_abs_diff:.1e} (largest in {c.worst_name}), "
                      f"tolerance used {c.tolerance_used:.3g}" + ("" if c.ok else "  <-- FAIL"))
                for problem in c.problems:
                    log(f"  {problem}")
        result = {"ok": total.ok, "max_abs_diff": total.max_abs_diff, "max_rel_diff": total.max_rel_diff,
                  "tolerance_used": total.tolerance_used, "worst_name": total.worst_name,
                  "problems": total.problems, "steps": cfg.steps, "world_size": world.size,
                  "rtol": None if mixed else rtol, "atol": None if mixed else atol,
                  "trainer": type(trainer).__name__, **trainer.report(),
                  "reference_skipped_steps": _skipped(reference), "per_step": per_step}
        if mixed:
            result["mixed_tolerance"] = tol
    result["ok"] = bool(world.bcast_object(result["ok"]))
    return result

