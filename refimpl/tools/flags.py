"""The flags that several commands share, and what they turn into.

    add_run_arguments, config_from_args, config_from_flags   a training run's flags (train, verify,
                                                              memory) and its TrainConfig (run.py)
    schedule_name                                             a schedule's name: built-in or your own
    add_model_arguments, describe_run                         a model on a cluster (predict, plan)
    positive_int, non_negative_int, int_in, finite_float,     argparse `type`s of numeric flags: one set of
    probability                                               rules (integer, finite, in range) for every command
    add_max_work_argument, check_work                         a command's bound on its work, checked before it
    check_writable                                            an output file, checked before the work

Commands import this module, never each other.
"""

from __future__ import annotations

import argparse
import math
import os

from refimpl import backend
from refimpl.memory import parse_bytes
from refimpl.optim import OPTIMIZERS
from refimpl.parallel.pipeline.schedules import SCHEDULES
from refimpl.tools.cluster import hardware
from refimpl.tools.cluster.model import ARCHITECTURES, ATTENTION_KERNELS, DTYPES, Run
from refimpl.tools.plugin import SCHEDULE_EXAMPLE, is_spec
from refimpl.tools.run import DEFAULTS, TrainConfig


def schedule_name(text: str) -> str:
    """argparse `type` of a schedule's name (here, train and verify): a built-in name, or MODULE:FUNCTION
    of your own (loaded and checked later, when it is built)."""
    if text in SCHEDULES or is_spec(text):
        return text
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose from {', '.join(SCHEDULES)}, or MODULE:FUNCTION / FILE.py:FUNCTION "
        f"for a schedule of your own, e.g. {SCHEDULE_EXAMPLE})")


# --------------------------------------------------------------------------------------------
# Numeric flags: one set of rules (the same as train's checks) for every command
# --------------------------------------------------------------------------------------------


def _integer(text: str) -> int:
    try:
        return int(str(text).strip(), 10)
    except ValueError:
        shown = str(text) if len(str(text)) <= 40 else str(text)[:37] + "..."
        raise argparse.ArgumentTypeError(f"{shown!r} is not a whole number") from None


def int_in(lo: int | None = None, hi: int | None = None, what: str = "an integer"):
    """argparse `type`: a whole number in [lo, hi] (either bound may be None)."""
    def parse(text: str) -> int:
        value = _integer(text)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            if hi is None and lo == 1:
                rule = "(>= 1)"
            elif hi is None:
                rule = f">= {lo}"
            elif lo is None:
                rule = f"<= {hi}"
            else:
                rule = f"between {lo} and {hi}"
            shown = str(value) if len(str(value)) <= 40 else f"a number of {len(str(value))} digits"
            raise argparse.ArgumentTypeError(f"must be {what} {rule}; got {shown}")
        return value
    parse.__name__ = "integer"
    return parse


positive_int = int_in(1, what="a positive integer")
positive_int.__name__ = "positive_int"
non_negative_int = int_in(0, what="an integer")
non_negative_int.__name__ = "non_negative_int"


def finite_float(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False):
    """argparse `type`: a finite number in the interval from lo to hi (open ends where asked)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number; got {text}")
        below = lo is not None and (value <= lo if lo_open else value < lo)
        above = hi is not None and (value >= hi if hi_open else value > hi)
        if below or above:
            left = "any" if lo is None else (f"({lo:g}" if lo_open else f"[{lo:g}")
            right = "" if hi is None else (f"{hi:g})" if hi_open else f"{hi:g}]")
            rule = f"> {lo:g}" if hi is None and lo_open else f">= {lo:g}" if hi is None else f"in {left}, {right}"
            raise argparse.ArgumentTypeError(f"must be {rule}; got {text}")
        return value
    parse.__name__ = "number"
    return parse


probability = finite_float(0.0, 1.0, hi_open=True)  # train's --dropout rule: [0, 1)
probability.__name__ = "probability"


# --------------------------------------------------------------------------------------------
# Bounded work: a command estimates its work units before doing it and refuses past a cap
# --------------------------------------------------------------------------------------------


def add_max_work_argument(p: argparse.ArgumentParser, default: int, unit: str) -> None:
    p.add_argument("--max-work", type=positive_int, default=default, metavar="N",
                   help=f"refuse, before starting, a run estimated at more than N {unit} (default {default:,})")


def check_work(estimate: int, cap: int, unit: str, what: str) -> None:
    """Raise ValueError (one line) when `estimate` work units exceed `cap`: by how much, and how to override."""
    if estimate > cap:
        times = estimate / cap
        shown = f"{estimate:,}" if estimate < 10**30 else f"about 10^{len(str(estimate)) - 1}"
        raise ValueError(f"{what} is about {shown} {unit}, {times:.3g}x the cap of {cap:,}: make it smaller, or pass "
                         f"--max-work {estimate if estimate < 10**30 else shown} to run it anyway")



def check_writable(path: str, flag: str) -> None:
    """Refuse, before any work, an output file that cannot be written: a directory, or a missing or
    read-only folder."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: no such directory {folder}")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(DEFAULTS), default="gpt",
                   help="gpt: sorting task (or --data text); mlp: 2-D spirals (default gpt)")
    p.add_argument("--steps", type=int, help="optimizer steps (gpt 400, mlp 600)")
    p.add_argument("--batch-size", type=int, help="global batch size, split over ranks and micro-batches")
    p.add_argument("--lr", type=float, help="learning rate (gpt 3e-3, mlp 1e-2)")
    p.add_argument("--dtype", default="float32", help="float32, float64, mixed (float16 storage, float32 master "
                   "weights, loss scaling; on ZeRO's sharded optimizer, --zero 0 included) or bf16 (bfloat16 "
                   "storage from ml_dtypes, float32 master weights, no loss scaling) (default float32)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    p.add_argument("--n-layer", type=int, help="transformer blocks, or MLP hidden layers (default 2)")
    p.add_argument("--d-model", type=int, help="model width (default 64)")
    p.add_argument("--n-head", type=int, help="attention heads (default 4)")
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                   help="the GPT's block: gpt2 (LayerNorm, learned positions, GeLU MLP) or llama (RMSNorm, rotary "
                        "positions, SwiGLU MLP, grouped-query attention; docs/llama.md) (default gpt2)")
    p.add_argument("--kv-heads", type=int, metavar="N",
                   help="--arch llama: key/value heads, a divisor of --n-head (1: multi-query; default --n-head)")
    p.add_argument("--ffn-size", type=int, metavar="F",
                   help="--arch llama: the SwiGLU MLP's width (default 4 x d-model)")
    p.add_argument("--seq-len", type=int,
                   help="context length (sorting: 2 x sequence length, default 16; --data: default 64)")
    p.add_argument("--data", metavar="FILE", help="train a character-level GPT on this UTF-8 text file")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    p.add_argument("--weight-decay", type=float, default=None, help="weight decay, >= 0 (default 0: none)")
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (0: off)")
    p.add_argument("--dropout", type=float, default=0.0, help="GPT dropout probability, in [0, 1) (default 0)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (per rank)")
    p.add_argument("--collectives", choices=("mpi", "ring"), default="mpi",
                   help="MPI's built-in collectives, or the textbook ring algorithms of ring.py")
    p.add_argument("--dp-mode", choices=("bucketed", "naive"), default="bucketed",
                   help="data parallelism: overlapped bucket all-reduces, or one all-reduce per gradient")
    p.add_argument("--bucket-bytes", type=int, default=1 << 20, help="gradient bucket size in bytes (default 1 MiB)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks; data parallel = world size / pp")
    p.add_argument("--schedule", type=schedule_name, metavar="NAME",
                   help="pipeline schedule: gpipe, 1f1b, interleaved, zb1p, zbh2, zbv, dualpipe, dualpipev, or one of "
                        "your own as MODULE:FUNCTION or FILE.py:FUNCTION (docs/capstone.md) "
                        "(default 1f1b when --pp > 1)")
    p.add_argument("--micro-batches", type=int, help="pipeline micro-batches per step and replica (default 2 x pp)")
    p.add_argument("--chunks", type=int, help="model chunks per rank (interleaved only; default 2)")
    p.add_argument("--action-costs", metavar="F=0.02,I=0.02,W=0.02",
                   help="pipeline sleep-cost mode: pad every step to these seconds (B=I+W, FB=F+B unless given); "
                        "link-delay mode: P=s delivers each pipeline message s after its send, A=s completes each "
                        "all-to-all s after its start")
    p.add_argument("--trace", metavar="FILE", help="write the last step's measured pipeline timeline (Chrome trace)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per layer (a GPT; Megatron-LM); "
                   "data parallel = world size / (pp x tp)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: layer norms and dropouts on sequence shards (all-gather / reduce-scatter)")
    p.add_argument("--partition-activations", action="store_true",
                   help="with --tp and --checkpoint: keep 1/tp of each checkpointed block input per rank (ZeRO-R Pa)")
    p.add_argument("--cp", type=int, default=1, metavar="C",
                   help="context-parallel ranks per sequence (a GPT): each holds T/C of its tokens, attention over "
                        "all of them (docs/context_parallel.md); data parallel = world size / (pp x tp x cp)")
    p.add_argument("--cp-impl", choices=["ring", "ulysses"], default="ring",
                   help="with --cp: ring attention (key/value blocks around the ring, load-balanced causal chunks) "
                        "or Ulysses (all-to-all from sequence to head shards; heads per tp rank divisible by C)")
    p.add_argument("--experts", type=int, default=0, metavar="E",
                   help="mixture of experts: E expert MLPs per MoE block (default 0: the dense MLP)")
    p.add_argument("--top-k", type=int, default=2, metavar="K", help="experts chosen per token (default 2)")
    p.add_argument("--moe-every", type=int, default=1, metavar="N",
                   help="every N-th block gets the experts (default 1)")
    p.add_argument("--capacity-factor", type=float, default=None, metavar="C",
                   help="at most ceil(C x K x T / E) tokens per expert and sequence, later ones dropped "
                        "(default: dropless)")
    p.add_argument("--ep", type=int, default=1, metavar="P",
                   help="expert-parallel ranks: each holds experts/P of them, tokens travel by all-to-all; P divides "
                        "the data-parallel degree (default 1)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", default=None,
                   help="run DualPipe's F&B steps as F then B (default: interleaved at the experts' all-to-alls)")
    p.add_argument("--aux-coef", type=float, default=0.01, metavar="A",
                   help="weight of the load-balancing loss (Switch Transformer's alpha, default 0.01)")
    p.add_argument("--zero", type=int, default=0, metavar="STAGE",
                   help="ZeRO stage: 0 data parallel, 1 shard optimizer states, 2 + gradients, 3 + parameters")
    p.add_argument("--prefetch", type=parse_bytes, default=0, metavar="BYTES",
                   help="ZeRO-3: bytes of the next modules' parameters to gather ahead (default 0: on demand)")
    p.add_argument("--param-threshold", type=int, default=0, metavar="N",
                   help="ZeRO-3: parameters with fewer than N elements stay whole on every rank (default 0)")
    p.add_argument("--mem-budget", type=parse_bytes, default=None, metavar="SIZE",
                   help="per-rank memory budget, e.g. 200MB: exceeding it is an out-of-memory error")
    p.add_argument("--save-dir", metavar="DIR", help="write sharded checkpoints under DIR/step_NNNNNNNN/")
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="checkpoint every K steps (default: at the end)")
    p.add_argument("--resume", metavar="PATH", help="continue the run saved in PATH: a step directory, or a "
                   "--save-dir (its newest intact step); only --steps, --save-every, world size, --zero and other "
                   "flags that do not change what is computed may differ (docs/zero.md)")
    p.add_argument("--overwrite-checkpoints", action="store_true", help="start over in a --save-dir that holds "
                   "another run's checkpoints: delete them before the first step")
    backend.add_argument(p)
    p.add_argument("--checkpoint", default="none", metavar="PLAN",
                   help="activation checkpointing of the GPT's blocks: none, sqrt, every:K, revolve:C, budget:BYTES; "
                        "selective (attention cores only), selective+PLAN; auto:memory or auto:speed (checkpoints "
                        "chosen on the graph of the blocks' operations)")
    p.add_argument("--json", action="store_true", help="print one JSON summary line on stdout")


def config_from_args(args) -> TrainConfig:
    """The TrainConfig of parsed train (or verify) flags: a flag not given takes the model's default."""
    defaults = dict(DEFAULTS[args.model])
    if args.data is not None:
        defaults["seq_len"] = 64
    values = {}
    for field in TrainConfig.__dataclass_fields__:
        given = getattr(args, field, None)
        default = defaults.get(field, TrainConfig.__dataclass_fields__[field].default)
        values[field] = given if given is not None else default
    return TrainConfig(**values)


def config_from_flags(flags) -> TrainConfig:
    """The checked TrainConfig of a list of train flags (["--experts", "4", ...]), as the command parses them."""
    parser = argparse.ArgumentParser(add_help=False)
    add_run_arguments(parser)
    cfg = config_from_args(parser.parse_args([str(flag) for flag in flags]))
    cfg.check()
    return cfg


def add_model_arguments(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """The model's flags (predict and plan share them)."""
    d = (lambda v: v) if defaults else (lambda v: None)
    p.add_argument("--n-layer", type=positive_int, default=d(24), help="transformer blocks (default 24)")
    p.add_argument("--d-model", type=positive_int, default=d(2048), help="model width h (default 2048)")
    p.add_argument("--n-head", type=positive_int, default=d(16), help="attention heads (default 16)")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="sequence length in tokens (default 2048)")
    p.add_argument("--vocab-size", type=positive_int, default=51200,
                   help="vocabulary (default 51200, GPT-2's padded)")
    p.add_argument("--batch-size", type=positive_int, default=512,
                   help="global batch in sequences per step (default 512)")
    p.add_argument("--arch", choices=ARCHITECTURES, default="gpt2",
                   help="the block: gpt2 (LayerNorm, learned positions, GeLU MLP of 4 x d-model) or llama (RMSNorm, "
                        "rotary positions, SwiGLU MLP of --ffn-size, grouped-query attention with --kv-heads) "
                        "(default gpt2)")
    p.add_argument("--kv-heads", type=positive_int, metavar="K",
                   help="--arch llama: key/value heads, a divisor of --n-head (1: multi-query; default --n-head)")
    p.add_argument("--ffn-size", type=positive_int, metavar="F",
                   help="--arch llama: the SwiGLU MLP's hidden width (default 4 x d-model)")
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default="dense",
                   help="dense: the T x T scores pass through memory, as refimpl computes them (default); flash: a "
                        "fused causal kernel (FlashAttention) that keeps no scores and recomputes them in backward")
    p.add_argument("--dtype", choices=DTYPES, default="mixed",
                   help="mixed: 16-bit training (P = G = 2, K = 12 bytes per parameter) (default); bf16: bfloat16 "
                        "storage, gradients reduced in float32 (P = 2, G = 4, K = 12), at the 16-bit rate; float32; "
                        "float64")
    p.add_argument("--dropout", type=probability, default=0.0,
                   help="dropout probability, in [0, 1) (> 0 keeps the masks; default 0)")
    p.add_argument("--tie-weights", action="store_true", help="the head shares the token embedding")
    p.add_argument("--experts", type=non_negative_int, default=0, metavar="E",
                   help="mixture of experts: E expert MLPs per MoE block")
    p.add_argument("--top-k", type=positive_int, default=2, metavar="K", help="experts per token (default 2)")
    p.add_argument("--moe-every", type=positive_int, default=1, metavar="N",
                   help="every N-th block has experts (default 1)")
    p.add_argument("--cluster", default="a100-80gb",
                   help=f"a preset ({', '.join(hardware.PRESETS)}), a JSON file, or 'local' "
                        f"({hardware.LOCAL_FILE}, written by `python -m refimpl calibrate`) (default a100-80gb)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def describe_run(r: Run) -> str:
    cp = f" × cp {r.cp} ({r.cp_impl})" if getattr(r, "cp", 1) > 1 else ""
    arch = ""
    if getattr(r, "arch", "gpt2") == "llama":
        arch = f" llama (K={r.key_value_heads} key/value heads, F={r.ffn})"
    text = (f"L={r.n_layer} h={r.d_model} a={r.n_head}{arch} s={r.seq_len} V={r.vocab_size}; dp {r.dp} × tp {r.tp} × "
            f"pp {r.pp}{cp} = {r.gpus} GPUs; ZeRO-{r.zero}, {r.dtype}, checkpoint {r.checkpoint}")
    if r.pp > 1:
        text += f", {r.schedule}" + (f" (chunks {r.chunks})" if r.chunks else "")
    if r.sequence_parallel:
        text += ", sequence parallel"
    if getattr(r, "attention", "dense") == "flash":
        text += ", flash attention"
    if r.experts:
        text += f", {r.experts} experts (top-{r.top_k}, ep {r.ep})"
    return text + f"; batch {r.batch_size} = {r.micro_batches} micro-batches of {r.micro_batch_size} per replica"


__all__ = ["positive_int", "non_negative_int", "int_in", "finite_float", "probability", "add_max_work_argument",
           "check_work", "check_writable", "add_run_arguments", "config_from_args", "config_from_flags",
           "schedule_name", "add_model_arguments", "describe_run"]
