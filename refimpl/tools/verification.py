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

Every rank is checked, not rank 0 alone: after each step every rank fingerprints (SHA-256) the
loss, gradients and parameters it returns, rank 0 broadcasts its fingerprints, and a rank whose
records are not bit for bit rank 0's sends those that differ; rank 0 compares them with the
reference too (a replica that dropped the reduced gradient fails at the first step). In a
pipeline rank 0 returns the whole model, gathered from one copy of each stage, and the other ranks
return nothing; a trainer with local_records() (optional, protocols.HoldsReplica; refimpl's own has
it) also gives every rank's own copy of what it holds, each tensor checked the same way against
rank 0's of the same name, so that a data-parallel replica of a later stage that steps wrongly fails
too, naming its rank.

The verdict is verify's alone. The trainer's report() is called once, at the end, and kept under
"trainer_report"; what verify's logic reads from a trainer is a protocol member
(refimpl/protocols.py): `implements`, the flags that choose how a step is computed that it
honours (verify refuses the others, since ignoring one leaves the numbers unchanged), and, with
--dtype mixed, `optimizer_steps` (a step that does not advance it was skipped) and
`full_optimizer_state()` (MixedPrecisionVerifiable). A trainer of your own that declares a flag
must also act on it: refimpl/tools/flag_check.py traces one step with and without each declared
flag in use, and verify fails, naming the flag, where the trainer runs the same both ways though
refimpl's own trainer does not.

verify runs in float64 unless --dtype says otherwise. A distributed run sums gradients in another
order than one process, so they differ by rounding (about 1e-16 relative in float64, 1e-7 in
float32). AdamW divides each gradient by its running magnitude: where a gradient is about as small
as eps (1e-8), the update's sensitivity to it is about lr/eps, 10⁵ times and more. In float32 that
turns harmless rounding into parameter differences above 1e-5 after one step (with SGD it does
not); in float64 the same amplification stays far below 1e-10. A float32 failure says so (`hint`).

--dtype mixed compares float16 storage / float32 master weights / dynamic loss scaling with
LocalTrainer running the same recipe, at the tolerance of refimpl/tools/compare_mixed.py, and checks that
both runs skip the same steps (--inject-overflow K puts an inf into one gradient at step K on both
sides: both must skip it).

verify_config runs one configuration and returns the figures; build_trainer and
load_trainer_factory give the trainer under test (refimpl's own, or one of yours: --trainer,
docs/verify_your_algorithm.md); check_trainer checks what it declares against the flags. The
command line -- flags, --sweep, the report, the exit status -- is refimpl/tools/commands/verify.py.
"""

from __future__ import annotations

import hashlib
import inspect
import math

import numpy as np

from refimpl.local_trainer import LocalTrainer
from refimpl.protocols import IMPLEMENTATION_FLAGS, MixedPrecisionVerifiable, Verifiable, missing
from refimpl.tools import flag_check
from refimpl.tools.compare import TOLERANCES, Comparison, compare_step
from refimpl.tools.compare_mixed import compare_mixed_step, mixed_tolerance, partial_gradient_magnitudes, state_by_name
from refimpl.tools.console import log
from refimpl.tools.plugin import load_function
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task, make_trainer
from refimpl.tools.runtime import preflight, watchdog
from refimpl.tools.runtime.agreement import check_same_run

FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24  # float32 rounds a real x to x(1 + δ), |δ| ≤ u: no rtol below about 1e-7 holds
KINDS = ("grads", "params", "local_grads", "local_params")  # the tensors of one rank's records of one step
LOCAL = {"local_grads": "grads", "local_params": "params"}  # its own copy (local_records()), checked against rank 0's

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


def flags_used(cfg) -> list[str]:
    """The IMPLEMENTATION_FLAGS (protocols.py) that cfg sets to something other than their default."""
    default = TrainConfig()
    used = []
    for flag in IMPLEMENTATION_FLAGS:
        if flag == "--dtype":
            on = cfg.dtype in ("mixed", "bf16")  # float32 and float64 are the model's dtype: nothing to implement
        elif flag == "--no-overlap":
            on = cfg.overlap is False
        else:
            field = flag[2:].replace("-", "_")
            on = getattr(cfg, field) != getattr(default, field)
        if on:
            used.append(flag)
    return used


def declared_flags(trainer) -> frozenset:
    """trainer.implements, checked: a set of IMPLEMENTATION_FLAGS (one clear line otherwise)."""
    name, declared = type(trainer).__name__, trainer.implements
    if isinstance(declared, (str, bytes)) or not isinstance(declared, (set, frozenset, tuple, list)):
        raise ValueError(f"--trainer: {name}.implements is {type(declared).__name__} {_shown(declared)}; it is a set "
                         "of flags, e.g. frozenset({'--grad-accum'}), or frozenset() for none (refimpl/protocols.py)")
    unknown = [flag for flag in declared if flag not in IMPLEMENTATION_FLAGS]
    if unknown:
        raise ValueError(f"--trainer: {name}.implements names {_shown(unknown)}, which are not flags that choose how "
                         f"a step is computed; choose among {' '.join(IMPLEMENTATION_FLAGS)} (refimpl/protocols.py)")
    return frozenset(declared)


def check_trainer(trainer, cfg) -> frozenset:
    """Before the first step: the trainer implements every flag cfg uses that chooses how a step is
    computed, and has what --dtype mixed reads; its declared flags (one clear line otherwise)."""
    name, declared = type(trainer).__name__, declared_flags(trainer)
    refused = [flag for flag in flags_used(cfg) if flag not in declared]
    if refused:
        shown = ", ".join(f"--dtype {cfg.dtype}" if flag == "--dtype" else flag for flag in refused)
        raise ValueError(f"--trainer: {name} does not implement {shown}; it declares "
                         f"{' '.join(sorted(declared)) or 'none of the flags that choose how a step is computed'} "
                         f"({name}.implements): verify without "
                         f"{'it' if len(refused) == 1 else 'them'}, or implement and declare "
                         f"{'it' if len(refused) == 1 else 'them'} (docs/verify_your_algorithm.md)")
    if cfg.dtype in ("mixed", "bf16"):
        lacking = missing(trainer, MixedPrecisionVerifiable)
        if lacking:
            raise ValueError(f"--dtype {cfg.dtype}: {name} lacks {', '.join(lacking)} (refimpl/protocols.py, "
                             "MixedPrecisionVerifiable: the lockstep comparison hands the reference its optimizer "
                             "state before each step; docs/verify_your_algorithm.md)")
    return declared


def configuration(cfg, world_size: int, declared, not_exercised=()) -> dict:
    """What a verification exercised: the mesh, the flags that define the computation, and those of
    the flags the trainer implements that matter here (--zero and --checkpoint always, --grad-accum,
    or a pipeline's schedule and micro-batches, the others where they differ from their default)."""
    flags = {"--model": cfg.model, "--dtype": cfg.dtype, "--optimizer": cfg.optimizer, "--clip": cfg.clip,
             "--collectives": cfg.collectives}
    if getattr(cfg, "arch", "gpt2") != "gpt2":
        flags.update({"--arch": cfg.arch, "--kv-heads": cfg.kv_heads, "--ffn-size": cfg.ffn_size})
    if cfg.dropout:
        flags["--dropout"] = cfg.dropout
    if cfg.experts:
        flags.update({"--experts": cfg.experts, "--top-k": cfg.top_k})
    pipelined = cfg.pp > 1 or cfg.schedule is not None
    shown = set(flags_used(cfg)) | {"--zero", "--checkpoint"} | \
        ({"--schedule", "--micro-batches"} if pipelined else {"--grad-accum"}) | \
        ({"--cp-impl"} if cfg.cp > 1 else set())
    values = {"--no-overlap": not cfg.overlap, "--schedule": cfg.schedule or ("1f1b" if pipelined else None),
              "--micro-batches": cfg.micro_batches or (2 * cfg.pp if pipelined else None)}
    for flag in IMPLEMENTATION_FLAGS:
        if flag in declared and flag in shown and flag not in ("--dtype", "--pp", "--tp", "--cp"):
            flags[flag] = values.get(flag, getattr(cfg, flag[2:].replace("-", "_"), None))
    return {"world_size": world_size, "dp": world_size // (cfg.pp * cfg.tp * cfg.cp), "pp": cfg.pp, "tp": cfg.tp,
            "cp": cfg.cp,
            "flags": flags, "implements": sorted(declared), "not_exercised": list(not_exercised)}


def described(conf: dict) -> str:
    """The configuration as one line: 'dp 2 x pp 1 x tp 1: --model gpt --dtype float64 ...'."""
    flags = " ".join(flag if value is True else f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
                     for flag, value in conf["flags"].items())
    idle = conf.get("not_exercised")
    cp = f" x cp {conf['cp']}" if conf.get("cp", 1) > 1 else ""
    return f"dp {conf['dp']} x pp {conf['pp']} x tp {conf['tp']}{cp}: {flags}" + \
        (f" (not exercised in this configuration: {' '.join(idle)})" if idle else "")


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


def _check_records(trainer, loss, params, grads, local=None) -> None:
    """What a trainer hands verify must be what the protocol says (protocols.Verifiable, and
    HoldsReplica's local_records() where it has one): a bad return value is one line naming the
    member and what it returned, not a traceback deep inside."""
    name = type(trainer).__name__
    if isinstance(loss, bool) or not isinstance(loss, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name}.step returned {type(loss).__name__} {_shown(loss)}; it returns the global "
                         "batch's loss, a number")
    members = [("full_parameters()", params), ("last_grads", grads)]
    if local is not None:
        if not isinstance(local, dict) or set(local) != {"parameters", "gradients"}:
            raise ValueError(f"{name}.local_records() returned {type(local).__name__} {_shown(local)}; it returns "
                             "{\"parameters\": {name: array}, \"gradients\": {name: array}} (refimpl/protocols.py, "
                             "HoldsReplica)")
        members += [("local_records()['parameters']", local["parameters"]),
                    ("local_records()['gradients']", local["gradients"])]
    for member, records in members:
        if not isinstance(records, dict):
            raise ValueError(f"{name}.{member} is {type(records).__name__} {_shown(records)}; it is a dict "
                             "{parameter name: array}")
        for key, array in records.items():
            if not isinstance(key, str) or not hasattr(array, "shape"):
                raise ValueError(f"{name}.{member}[{key!r}] is {type(array).__name__} {_shown(array)}; each entry "
                                 "is a parameter's name and a NumPy array")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _copied(records: dict) -> dict:
    """A copy of {name: array} (a trainer may reuse its buffers in the next step)."""
    return {name: np.array(array, copy=True) for name, array in records.items()}


def _fingerprints(ours: dict) -> dict:
    """{(kind, name): SHA-256 of the bytes, dtype and shape} of one rank's records of one step."""
    prints = {("loss", ""): repr(float(ours["loss"])), ("skipped", ""): repr(ours["skipped"])}
    for kind in KINDS:
        for name, array in ours.get(kind, {}).items():
            array = np.ascontiguousarray(array)
            prints[(kind, name)] = hashlib.sha256(array.tobytes()).hexdigest() + f"{array.dtype}{array.shape}"
    return prints


def _differences_from_rank0(world, ours: dict) -> dict:
    """{rank: {its records that are not bit for bit rank 0's}} on rank 0, {} elsewhere (collective).

    A rank's own copy (local_grads, local_params: local_records()) is checked against rank 0's
    whole-model records of the same name, rank 0's own copy included. Rank 0 broadcasts
    fingerprints, not arrays: in the usual case (every replica equal) only hashes travel."""
    mine = _fingerprints(ours)
    theirs = {key: value for key, value in mine.items() if key[0] not in LOCAL}  # rank 0's whole-model records
    rank0 = world.bcast_object(theirs if world.rank == 0 else None) if world.size > 1 else theirs
    differing = {kind: {name: array for name, array in ours.get(kind, {}).items()
                        if mine[(kind, name)] != rank0.get((LOCAL.get(kind, kind), name))}
                 for kind in KINDS if world.rank != 0 or kind in LOCAL}
    for kind in ("loss", "skipped"):
        if mine[(kind, "")] != rank0[(kind, "")]:
            differing[kind] = ours[kind]
    if not (any(differing.get(kind) for kind in KINDS) or "loss" in differing or "skipped" in differing):
        differing = None
    gathered = world.allgather_object(differing) if world.size > 1 else [differing]
    return {rank: d for rank, d in enumerate(gathered) if d} if world.rank == 0 else {}


def _with_replicas(step: int, ours: dict, c: Comparison, compare) -> tuple[Comparison, int]:
    """Rank 0's comparison `c` of one step merged with every rank's whose records differ from rank
    0's (ours["replicas"]): what it returns, and apart from that its own copy (local_records()), each
    put in place of rank 0's tensors of the same names; and the rank of the largest difference."""
    worst_rank = 0
    for rank, differing in sorted(ours["replicas"].items()):
        for own in (False, True):
            grads, params = (differing.get("local_grads", {}), differing.get("local_params", {})) if own else \
                (differing.get("grads", {}), differing.get("params", {}))
            if not (grads or params or (not own and ("loss" in differing or "skipped" in differing))):
                continue
            replica = {"loss": differing.get("loss", ours["loss"]),
                       "skipped": differing.get("skipped", ours["skipped"]),
                       "grads": {**ours["grads"], **grads}, "params": {**ours["params"], **params}}
            r = compare(replica)
            what = "the copy it holds (local_records()) is" if own else "its records are"
            r.problems = [] if r.ok else [f"rank {rank}: {p}" for p in r.problems if p not in c.problems] + [
                f"rank {rank}: step {step}: {what} not rank 0's and fail: largest difference in {labelled(r)} "
                f"(tolerance used {r.tolerance_used:.3g})"]
            if r.tolerance_used > c.tolerance_used:
                worst_rank = rank
            c = c.merge(r)
    return c, worst_rank


def labelled(c: Comparison) -> str:
    """The tensor with the largest difference, with what it is: 'gradient lm_head.weight', 'loss'."""
    if c.worst_what is None or c.worst_what == c.worst_name:
        return str(c.worst_name)
    return f"{c.worst_what} {c.worst_name}"


def labelled_worst(result: dict) -> str:
    """verify_config's largest difference, labelled: 'gradient lm_head.weight on rank 1'."""
    what, name, rank = result.get("worst_what"), result.get("worst_name"), result.get("worst_rank")
    text = str(name) if what is None or what == name else f"{what} {name}"
    return text + (f" on rank {rank}" if rank else "")


def float32_hint(cfg, rtol: float) -> str | None:
    """Why a float32 comparison can fail a correct algorithm, or None."""
    if cfg.dtype != "float32":
        return None
    if rtol < 4 * FLOAT32_UNIT_ROUNDOFF:
        return (f"float32 cannot meet rtol {rtol:g}: it rounds at {FLOAT32_UNIT_ROUNDOFF:.1e} relative, and a "
                "distributed run sums in another order; use --dtype float64 (verify's default) or a looser --rtol")
    if cfg.optimizer == "adamw":
        return ("in float32 AdamW amplifies the rounding of gradients near its eps (about lr/eps, 1e5 times), so a "
                "correct algorithm can exceed rtol 1e-5: use --dtype float64 (verify's default), --optimizer sgd, "
                "or a looser --rtol")
    return None


def verify_config(cfg, world, factory=None, rtol=None, atol=None, inject_overflow=None, quiet=False,
                  say=log) -> dict:
    """Run cfg distributed on `world` and, on rank 0, LocalTrainer; compare every step, every rank's records.

    Returns, on every rank, {"ok": bool (the same on every rank), ...}; rank 0's dict also holds the
    figures (max differences, tolerance_used, worst_name and worst_what, problems, per_step, the
    configuration exercised, the trainer's report under "trainer_report"). `say` prints the
    per-step lines (none with quiet=True).
    """
    mixed = cfg.dtype in ("mixed", "bf16")  # float32 master weights, compared in lockstep (compare_mixed.py)
    if not mixed and cfg.dtype not in TOLERANCES:
        raise ValueError(f"verify compares float64, float32 or mixed runs, not --dtype {cfg.dtype}")
    if inject_overflow is not None and cfg.dtype != "mixed":
        raise ValueError("--inject-overflow tests mixed precision's skip rule: use it with --dtype mixed")
    if inject_overflow is not None and not 0 <= inject_overflow < cfg.steps:
        raise ValueError(f"--inject-overflow {inject_overflow} is not a step of this run (0 .. {cfg.steps - 1})")
    for flag, value in (("--rtol", rtol), ("--atol", atol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} must be a finite number >= 0, got {value}; leave it out for the dtype's "
                             f"default tolerance")
    if mixed and cfg.experts:
        raise ValueError(f"verify --dtype {cfg.dtype} bounds only {'float16' if cfg.dtype == 'mixed' else 'bfloat16'} "
                         "rounding of the same computation: with experts, "
                         "a token whose router probabilities tie to float32 rounding can go to another expert on "
                         "either side; verify --experts in float64")
    if mixed and cfg.tp > 1:
        raise ValueError(f"verify --dtype {cfg.dtype} bounds only {'float16' if cfg.dtype == 'mixed' else 'bfloat16'} "
                         "rounding: it assumes each piece of the batch is "
                         "computed with the reference's float32 arithmetic, and tensor parallelism changes it (sliced "
                         "GEMMs, partial sums over ranks: float32 noise in gradients that are exactly zero, such as "
                         "the key bias', which AdamW turns into up to 2·lr); verify --tp in float64")
    if mixed and cfg.cp > 1:
        raise ValueError(f"verify --dtype {cfg.dtype} bounds only 16-bit rounding of the reference's arithmetic, and "
                         "context parallelism changes it (attention as blockwise online-softmax merges over the "
                         "ranks' key/value blocks, gradients summed over token shards); verify --cp in float64")
    dp = world.size // (cfg.pp * cfg.tp * cfg.cp) * cfg.cp  # the gradient's pieces: replicas x token shards
    if cfg.pp > 1 or cfg.schedule is not None:  # the batch's pieces: dp replicas x M pipeline micro-batches
        pieces = (dp, cfg.micro_batches or 2 * cfg.pp)
    else:
        pieces = (dp, cfg.grad_accum)
    tol = mixed_tolerance(*pieces, dtype=cfg.dtype) if mixed else None
    if mixed and (rtol is not None or atol is not None):
        raise ValueError("--rtol and --atol set float32/float64 tolerances; mixed precision's follow from float16 "
                         "rounding (compare_mixed.mixed_tolerance)")
    if not mixed:
        rtol = TOLERANCES[cfg.dtype][0] if rtol is None else rtol
        atol = TOLERANCES[cfg.dtype][1] if atol is None else atol
    say = None if quiet else say
    task = build_task(cfg)
    preflight.check(cfg, task, world, verify=True)  # before any model is built: rank 0 also holds the reference
    distributed_model = build_model(cfg, task)
    check_same_run(world, cfg, task, distributed_model)  # the same flags, data and model on every rank
    comm = world.with_collectives(cfg.collectives)

    # 1. The distributed run: every rank checks its records against rank 0's; rank 0 keeps what differs.
    trainer = build_trainer(cfg, comm, factory, distributed_model)
    declared = check_trainer(trainer, cfg)  # before the first step: what it implements, what mixed reads
    ignored, not_exercised = flag_check.ignored_flags(cfg, task, comm, factory, [
        flag for flag in flags_used(cfg) if flag in declared]) if factory is not None else ([], [])
    trainer.record_grads = True
    holds_replica = callable(getattr(trainer, "local_records", None))  # optional (protocols.HoldsReplica)
    recorded = []
    for step in range(cfg.steps):
        x, y = task.batch(step, cfg.batch_size)
        steps_before = trainer.optimizer_steps if mixed else None
        hook = _InjectInf(_last_held(trainer, distributed_model)) \
            if step == inject_overflow and world.rank == world.size - 1 else None
        loss = trainer.step(x, y)
        if hook is not None:
            hook.remove()
        params = trainer.full_parameters()
        state = trainer.full_optimizer_state() if mixed else None  # for the lockstep reference
        local = trainer.local_records() if holds_replica else None  # this rank's own copy (collective)
        _check_records(trainer, loss, params, trainer.last_grads, local)
        ours = {"loss": float(loss), "grads": _copied(trainer.last_grads), "params": _copied(params),
                "skipped": bool(mixed and trainer.optimizer_steps == steps_before)}
        if local is not None:
            ours.update(local_grads=_copied(local["gradients"]), local_params=_copied(local["parameters"]))
        replicas = _differences_from_rank0(world, ours)
        if world.rank == 0:
            recorded.append({**{k: v for k, v in ours.items() if k not in LOCAL}, "state": state,
                             "replicas": replicas})
    held = world.allgather_object({"parameters": len(ours["params"]), "gradients": len(ours["grads"]),
                                   **({"local_parameters": len(ours["local_params"]),
                                       "local_gradients": len(ours["local_grads"])} if local is not None else {})})
    trainer_report = trainer.report()  # once, at the end: facts for --json, never part of the verdict
    if not isinstance(trainer_report, dict):
        raise ValueError(f"{type(trainer).__name__}.report() returned {type(trainer_report).__name__} "
                         f"{_shown(trainer_report)}; it returns a dict of plain facts ({{}} for none)")

    # 2. The single-process reference, on rank 0, on the same global batches.
    result = {"ok": True}
    if world.rank == 0:
        model = build_model(cfg, task)
        reference = LocalTrainer(model, build_optimizer(cfg, model.parameters()), cfg.grad_accum, cfg.clip)
        reference.record_grads = True
        total, per_step, worst_rank = Comparison(), [], 0
        if ignored:
            total = Comparison(False, tolerance_used=float("inf"), problems=[
                f"{flag_check.value_of(cfg, flag)}: {type(trainer).__name__} declares it but ignores it: a step with "
                "it made the same operations and communicator calls, in the same order and with the same bytes, on "
                f"every rank, as a step without it, where refimpl's own trainer does not (verify without {flag}, or "
                "honour it; refimpl/tools/flag_check.py)" for flag in ignored])
        for step, ours in enumerate(recorded):
            x, y = task.batch(step, cfg.batch_size)
            if mixed and step > 0:  # lockstep: from the distributed run's state after the previous step
                reference.load_mixed_state(recorded[step - 1]["params"], recorded[step - 1]["state"])
            state_before = state_by_name(reference) if mixed else None
            magnitudes = partial_gradient_magnitudes(reference, x, y, tol["k"]) if mixed else None
            scale = (reference.scaler.scale if reference.scaler else 1.0) if mixed else None  # this step's loss scale
            steps_before = reference.optimizer_steps
            hook = _InjectInf(model.parameters()[-1:]) if step == inject_overflow else None
            ref_loss = reference.step(x, y)
            watchdog.progress()  # the other ranks wait meanwhile: this rank is alive
            if hook is not None:
                hook.remove()
            ref = {"loss": ref_loss, "grads": reference.last_grads, "params": reference.full_parameters(),
                   "skipped": reference.optimizer_steps == steps_before}

            def compare(records, step=step, ref=ref, state_before=state_before, magnitudes=magnitudes, scale=scale):
                if mixed:
                    return compare_mixed_step(step, records, ref, state_before, reference.optimizer, tol, magnitudes,
                                              cfg.clip > 0, scale)
                return compare_step(step, records, ref, rtol, atol)

            c, step_worst_rank = _with_replicas(step, ours, compare(ours), compare)
            if c.tolerance_used > total.tolerance_used:
                worst_rank = step_worst_rank
            total = total.merge(c)
            per_step.append({"step": step, "loss": ours["loss"], "reference_loss": ref_loss,
                             "skipped": ours["skipped"], "reference_skipped": ref["skipped"],
                             "max_abs_diff": c.max_abs_diff, "tolerance_used": c.tolerance_used, "ok": c.ok,
                             "worst_name": c.worst_name, "worst_what": c.worst_what,
                             "ranks_differing_from_rank0": sorted(ours["replicas"])})
            if say is not None:
                others = sorted(ours["replicas"])
                say(f"step {step}: loss {ours['loss']:.12g} (reference {ref_loss:.12g})"
                    + (" skipped on both sides (overflow)" if ours["skipped"] and ref["skipped"] else "")
                    + f"; max |diff| {c.max_abs_diff:.1e} (largest in {labelled(c)}"
                    + (f", rank {step_worst_rank}" if step_worst_rank else "") + "), "
                      f"tolerance used {c.tolerance_used:.3g}"
                    + (f"; rank(s) {', '.join(map(str, others))} not bit for bit rank 0's" if others else "")
                    + ("" if c.ok else "  <-- FAIL"))
                for problem in c.problems:
                    say(f"  {problem}")
        conf = configuration(cfg, world.size, declared, not_exercised)
        result = {"ok": total.ok, "max_abs_diff": total.max_abs_diff, "max_rel_diff": total.max_rel_diff,
                  "tolerance_used": total.tolerance_used, "worst_name": total.worst_name,
                  "worst_what": total.worst_what, "worst_rank": worst_rank,
                  "problems": total.problems, "steps": cfg.steps, "world_size": world.size,
                  "rtol": None if mixed else rtol, "atol": None if mixed else atol,
                  "trainer": type(trainer).__name__, "configuration": conf, "checked": described(conf),
                  "records_by_rank": held,  # how many tensors each rank returned (and holds: local_records)
                  "skipped_steps": sum(s["skipped"] for s in per_step),
                  "reference_skipped_steps": sum(s["reference_skipped"] for s in per_step),
                  "per_step": per_step, "trainer_report": trainer_report}
        if mixed:
            result["mixed_tolerance"] = tol
        hint = None if total.ok else float32_hint(cfg, rtol)
        if hint:
            result["hint"] = hint
        if not total.ok and factory is not None and flags_used(cfg):
            result["declared_flags_in_use"] = flags_used(cfg)
    result["ok"] = bool(world.bcast_object(result["ok"]))
    return result
