"""The configurations `verify --sweep N` draws: valid for this world size, as verify flags.

The space drawn from is the one the property tests draw from (tests/test_verify_drawn.py), so a
user's sweep and CI check the same things: every ZeRO stage (0-3), built-in and ring collectives,
naive and bucketed DDP, gradient accumulation, AdamW and SGD, clipping on and off, the GPT with
dropout and activation checkpointing that really recomputes (at least 4 blocks; every:K, sqrt,
revolve), the MLP, and, where the world size allows, every pipeline schedule on a dp × pp mesh
(`verify --sweep N --schedule NAME`: only pipelines of that schedule, a schedule of your own included)
(with every ZeRO stage and checkpointing inside the stages), and tensor parallelism (tp 2 or 4,
with and without sequence parallelism) on the GPT, with or without a pipeline, under any ZeRO
stage, context parallelism (cp 2 or 4, ring attention or Ulysses; without dropout and experts,
which it refuses) on the GPT with or without tp and a pipeline, and mixtures of experts (E 2, 4, 8;
K 1, 2; dropless or with a capacity factor; expert parallelism over 1, 2 or 4 ranks) without tensor
parallelism; the GPT's block is GPT-2's or
Llama's (grouped-query attention, SwiGLU, with experts SwiGLU experts; docs/llama.md). All in float64 with small models,
2 steps each; mixed precision has pinned cases of its own (tests/test_verify.py). A trainer of your
own (`verify --sweep N --trainer ...`) gets only the flags it declares in `implements`
(protocols.py): the others keep their defaults.

`draw_flags(world_size, choose)` takes the chooser as an argument: `verify --sweep` passes one
backed by a seeded NumPy generator (the seed is printed; `--sweep-seed` replays a sweep), the
property tests one backed by hypothesis (`draw(st.sampled_from(options))`), which shrinks a
failure to a small configuration. Each configuration is a list of command-line flags, so a
failure prints the one command that reproduces it. The sweep itself -- verify each configuration,
report, exit status -- is refimpl/tools/commands/verify.py (run_sweep, verify_flags).
"""

from __future__ import annotations

import functools

import numpy as np

from refimpl.parallel.pipeline import SCHEDULES, ScheduleError, build
from refimpl.tools.plugin import build_executable_schedule

SMALL = ["--d-model", "8", "--n-head", "2", "--seq-len", "8", "--steps", "2", "--dtype", "float64"]


@functools.lru_cache(maxsize=8)
def _builtin_schedule_options(world_size: int) -> tuple:
    """schedule_options of every built-in schedule (they build the same every time: computed once)."""
    return tuple(schedule_options(world_size, list(SCHEDULES)))


def schedule_options(world_size: int, names=None) -> list:
    """(schedule, pp, [valid micro-batch counts], stages) that build for a pp dividing world_size.

    `names`: these schedules only (built-in names or MODULE:FUNCTION; default every built-in one).
    A micro-batch count for which a generator raises ValueError is not drawn; for a schedule of your
    own, a result that the validator (or the executor's receive policy) rejects is an error (a
    generator must refuse what it cannot build, not return something wrong), and so is a schedule
    that builds for no (pp, micro-batches).
    """

    if names is None:
        return list(_builtin_schedule_options(world_size))
    options = []
    for pp in [d for d in range(1, world_size + 1) if world_size % d == 0]:
        for name in names:
            valid, refused = [], None
            for m in range(1, 2 * max(pp, 2) + 3):
                try:
                    built = build(name, pp, m) if name in SCHEDULES else build_executable_schedule(name, pp, m)
                    valid.append((m, built.num_stages))
                except ScheduleError:
                    if name not in SCHEDULES:
                        raise
                except ValueError as exc:
                    refused = exc
            if valid:
                options.append((name, pp, [m for m, _ in valid], valid[0][1]))
    if names and not options:
        raise ValueError(f"--sweep --schedule {' '.join(names)}: builds for no pp dividing {world_size} ranks and "
                         f"micro-batches 1 to {2 * max(world_size, 2) + 2}"
                         + (f"; it says: {refused}" if refused else ""))
    return options


def draw_flags(world_size: int, choose, schedules=None, implements=None) -> list:
    """One configuration for `world_size` ranks, as verify flags; choose(name, options) picks one option.

    `implements`: the flags that choose how a step is computed (protocols.IMPLEMENTATION_FLAGS) that
    the trainer declares (verify --sweep --trainer); a flag it does not declare keeps its default,
    so a trainer of your own is verified only in what it implements. None: all of them (refimpl's
    own trainer). The flags that define the computation (model, optimizer, clipping, dropout, seed,
    collectives) are drawn for every trainer. `schedules` (a list of names, MODULE:FUNCTION
    included: verify --sweep --schedule) draws only pipeline configurations, of those schedules.
    """
    has = (lambda flag: True) if implements is None else (lambda flag: flag in implements)  # noqa: E731
    model = choose("model", ["gpt", "mlp"])
    flags = ["--model", model, *SMALL,
             "--optimizer", choose("optimizer", ["adamw", "sgd"]),
             "--clip", choose("clip", [0.0, 0.05, 1.0]),
             "--collectives", choose("collectives", ["mpi", "ring"])]
    can_pipeline = has("--pp") and has("--schedule") and has("--micro-batches")
    if schedules or (can_pipeline and choose("pipeline", [False, True])):
        options = [o for o in schedule_options(world_size, schedules) if o[0] != "interleaved" or has("--chunks")]
        name, pp, micro_batches, stages = choose("schedule", options)
        m = choose("micro_batches", micro_batches)
        layers_per_stage = choose("layers_per_stage", [1, 2])
        n_layer = stages * layers_per_stage - (1 if model == "mlp" else 0)  # an MLP stage may be a lone output layer
        tp = _draw_tensor_parallel(flags, world_size // pp, choose, has) if model == "gpt" and has("--tp") else 1
        cp = _draw_context_parallel(flags, world_size // (pp * tp), tp, choose, has) if model == "gpt" else 1
        if model == "gpt" and tp == 1 and cp == 1 and has("--ep"):
            _draw_experts(flags, world_size // pp, choose)
        dp = world_size // (pp * tp * cp)
        zero = choose("zero", [0, 1, 2, 3]) if has("--zero") else 0
        flags += ["--schedule", name, "--pp", pp, "--micro-batches", m, "--n-layer", max(n_layer, 1),
                  "--batch-size", dp * m * choose("examples_per_micro_batch", [1, 2])]
        if has("--zero"):
            flags += ["--zero", zero]
        if has("--bucket-bytes"):
            flags += ["--bucket-bytes", choose("bucket_bytes", [64, 1000, 1 << 20])]
        if zero == 3 and has("--param-threshold"):  # no prefetch: it follows one micro-batch's module order
            flags += ["--param-threshold", choose("param_threshold", [0, 17])]
        if name == "interleaved":
            flags += ["--chunks", stages // pp]
        if model == "gpt" and layers_per_stage > 1 and has("--checkpoint"):  # recomputation inside a stage
            stage_plans = ["none", "every:1", "sqrt", "auto:memory", "auto:speed"]
            flags += ["--checkpoint", choose("stage_checkpoint", stage_plans)]
    else:
        tp = _draw_tensor_parallel(flags, world_size, choose, has) if model == "gpt" and has("--tp") else 1
        cp = _draw_context_parallel(flags, world_size // tp, tp, choose, has) if model == "gpt" else 1
        if model == "gpt" and has("--tp") and tp == 1 and cp == 1 and has("--ep"):
            _draw_experts(flags, world_size, choose)
        zero = choose("zero", [0, 1, 2, 3]) if has("--zero") else 0
        accum = choose("grad_accum", [1, 2, 3]) if has("--grad-accum") else 1
        flags += ["--batch-size", world_size * accum * choose("examples_per_micro_batch", [1, 2])]
        if has("--zero"):
            flags += ["--zero", zero]
        if has("--grad-accum"):
            flags += ["--grad-accum", accum]
        if has("--bucket-bytes"):
            flags += ["--bucket-bytes", choose("bucket_bytes", [64, 1000, 1 << 20])]
        if zero == 0 and has("--dp-mode"):
            flags += ["--dp-mode", choose("dp_mode", ["bucketed", "naive"])]
        if zero == 3:
            if has("--prefetch"):
                flags += ["--prefetch", choose("prefetch", ["0", "500", "1MB"])]
            if has("--param-threshold"):
                flags += ["--param-threshold", choose("param_threshold", [0, 17])]
        plans = ["none", "sqrt", "every:2", "revolve:1", "revolve:2", "auto:memory", "auto:speed"]
        checkpoint = choose("checkpoint", plans) if model == "gpt" and has("--checkpoint") else "none"
        n_layer = choose("n_layer_checkpointed", [4, 5]) if checkpoint != "none" else choose("n_layer", [1, 2, 3])
        flags += ["--n-layer", n_layer]
        if has("--checkpoint"):
            flags += ["--checkpoint", checkpoint]
    if model == "gpt":
        dropouts = [0.0] if "--cp" in flags else [0.0, 0.1]  # context parallelism refuses dropout
        flags += ["--dropout", choose("dropout", dropouts), "--seed", choose("seed", [0, 1, 2])]
        if implements is None:  # refimpl's trainer: Llama's block too (with experts: Mixtral's SwiGLU experts)
            _draw_llama(flags, choose)
    return [str(f) for f in flags]


def _draw_llama(flags: list, choose) -> None:
    """For one GPT in two, Llama's block (docs/llama.md): key/value heads among the divisors of the
    heads that tp divides or, without context parallelism, that divide tp (replicated over tp/kv ranks;
    1 is multi-query, all of them multi-head), a SwiGLU width that tp divides;
    2 or 4 heads (head width 4 or 2), so that grouped-query attention proper (1 < kv-heads < heads) occurs."""
    if choose("arch", ["gpt2", "llama"]) == "gpt2":
        return
    n_head = choose("llama_heads", [2, 4]) if int(flags[flags.index("--n-head") + 1]) == 2 else 4
    flags[flags.index("--n-head") + 1] = str(n_head)
    tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    ulysses = int(flags[flags.index("--cp") + 1]) if "ulysses" in flags else 1  # Ulysses: kv heads per tp rank ÷ cp
    replicable = "--cp" not in flags  # fewer key/value heads than tp ranks (replicated): not with context parallelism
    kv_heads = choose("kv_heads", [k for k in range(1, n_head + 1) if n_head % k == 0 and (
        (k % tp == 0 and (k // tp) % ulysses == 0) or (replicable and k < tp and tp % k == 0))])
    flags += ["--arch", "llama", "--kv-heads", kv_heads, "--ffn-size", choose("ffn_size", [12, 20])]


def _draw_context_parallel(flags: list, ranks: int, tp: int, choose, has) -> int:
    """Draw --cp among the divisors 2 and 4 of `ranks` (cp 1 as likely as all others together) and,
    with cp > 1, --cp-impl: Ulysses where tp · cp ≤ 4 (then the heads become tp · cp, so that each
    rank gets whole heads); adds the flags and returns cp. The sequence (8 tokens) divides by 2 · 4."""
    if not has("--cp"):
        return 1
    sizes = [c for c in (2, 4) if ranks % c == 0]
    cp = choose("cp", [1] * max(1, len(sizes)) + sizes)
    if cp > 1:
        impl = choose("cp_impl", ["ring", "ulysses"] if has("--cp-impl") and tp * cp <= 4 else ["ring"])
        if impl == "ulysses":
            heads = flags.index("--n-head") + 1
            flags[heads] = str(max(int(flags[heads]), tp * cp))
        flags += ["--cp", cp, "--cp-impl", impl]
    return cp


def _draw_tensor_parallel(flags: list, ranks: int, choose, has=lambda flag: True) -> int:
    """Draw --tp among the divisors of `ranks` up to 4 (tp 1 as likely as all others together) and,
    with tp > 1, --sequence-parallel (where `has` it); adds the flags (tp 4 needs 4 heads) and returns tp."""
    sizes = [t for t in (2, 4) if ranks % t == 0]
    tp = choose("tp", [1] * max(1, len(sizes)) + sizes)
    if tp > 1:
        flags[flags.index("--n-head") + 1] = str(max(2, tp))  # tp 4 needs 4 heads; seq-len 8 divides by each tp
        flags += ["--tp", tp]
        if has("--sequence-parallel") and choose("sequence_parallel", [False, True]):
            flags.append("--sequence-parallel")
    return tp


def _draw_experts(flags: list, dp: int, choose) -> None:
    """Draw a mixture of experts (E 2, 4 or 8; K 1 or 2; every block or every other one; dropless or
    a capacity factor of 1; expert parallelism over P ranks, P dividing E and the data-parallel
    degree dp) for one GPT in two: --experts 0 is as likely as all the others together."""
    experts = choose("experts", [0, 0, 0, 2, 4, 8])
    if experts:
        flags += ["--experts", experts, "--top-k", choose("top_k", [1, 2]), "--moe-every", choose("moe_every", [1, 2]),
                  "--ep", choose("ep", [p for p in (1, 2, 4) if dp % p == 0 and experts % p == 0])]
        if choose("capacity", [False, True]):
            flags += ["--capacity-factor", "1.0"]


def numpy_chooser(rng: np.random.Generator):
    """choose(name, options) backed by a NumPy generator."""
    return lambda name, options: options[int(rng.integers(len(options)))]

