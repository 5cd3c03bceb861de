"""The training loop and its builders; the single-process reference trainer.

One optimizer step on a global batch of B examples split into g micro-batches (--grad-accum g):

    loss = Σ_micro Σ_(counted targets) −log p(target)  /  (number of counted targets in the batch)

Each micro-batch's backward accumulates (+=) into the parameters' gradients, so the step's
gradient is that of the whole batch's mean loss whatever g is. Then gradients are clipped by global
norm (--clip), the optimizer steps, and gradients are zeroed.

Here: TrainConfig (every flag of a run), build_task / build_model / build_optimizer,
LocalTrainer (one process, the reference that verify compares against), make_trainer (LocalTrainer
or the distributed parallel/trainer.py), evaluate, and train(cfg), the loop itself. The command
line, `python -m refimpl train ...`, is refimpl/tools/commands/train.py; verify and memory build their
runs from this module too.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import asdict, dataclass

from refimpl import backend
from refimpl.autograd import no_grad, saved_tensors
from refimpl.checkpointing import apply_to_gpt, count_forward_calls, parse_plan
from refimpl.data import SortTask, SpiralsTask, TextTask, accuracy
from refimpl.local_trainer import LocalTrainer
from refimpl.memory import memory_by_rank
from refimpl.nn import GPT, GPTConfig, MLPClassifier
from refimpl.nn import functional as F
from refimpl.nn.experts import add_load, describe_load, take_load
from refimpl.nn.layers import check_llama_shape
from refimpl.nn.models import ARCHITECTURES
from refimpl.objective import to_input
from refimpl.optim import OPTIMIZERS
from refimpl.parallel.comm import get_world as world_of
from refimpl.parallel.context_parallel.gpt import check_options as check_context_parallel
from refimpl.parallel.tensor_parallel.gpt import check_options
from refimpl.parallel.trainer import Trainer
from refimpl.tools import timeline
from refimpl.tools.console import Progress
from refimpl.tools.plugin import build_executable_schedule, is_spec
from refimpl.tools.runtime import preflight, watchdog
from refimpl.tools.runtime.agreement import check_same_run
from refimpl.tools.runtime.failure import agree
from refimpl.tools.saved_runs import safe_files, sharded

# Per-model defaults (the demo settings); a flag given on the command line overrides them.
DEFAULTS = {
    "gpt": dict(steps=400, batch_size=32, lr=3e-3, n_layer=2, d_model=64, n_head=4, seq_len=16, weight_decay=0.0),
    "mlp": dict(steps=600, batch_size=128, lr=1e-2, n_layer=2, d_model=64, n_head=1, seq_len=0, weight_decay=0.0),
}


@dataclass
class TrainConfig:
    model: str = "gpt"
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3
    dtype: str = "float32"
    seed: int = 0
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    seq_len: int = 16
    data: str | None = None
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    clip: float = 1.0
    dropout: float = 0.0
    grad_accum: int = 1
    collectives: str = "mpi"
    dp_mode: str = "bucketed"
    bucket_bytes: int = 1 << 20
    # ZeRO, mixed precision, memory ledger (refimpl/parallel/zero; docs/zero.md);
    # sharded checkpoints (refimpl/tools/saved_runs)
    zero: int = 0
    prefetch: int = 0
    param_threshold: int = 0
    mem_budget: int | None = None
    save_dir: str | None = None
    save_every: int = 0
    resume: str | None = None
    overwrite_checkpoints: bool = False  # start over in a --save-dir that holds another run's steps
    checkpoint: str = "none"  # activation checkpointing of the GPT's blocks (refimpl/checkpointing)
    # pipeline parallelism (refimpl/parallel/pipeline; docs/pipeline_parallel.md)
    pp: int = 1
    schedule: str | None = None
    micro_batches: int | None = None
    chunks: int | None = None
    action_costs: str | None = None
    trace: str | None = None
    # tensor and sequence parallelism (refimpl/parallel/tensor_parallel; docs/tensor_parallel.md)
    tp: int = 1
    sequence_parallel: bool = False
    partition_activations: bool = False
    # mixture of experts (refimpl/nn/experts.py; docs/experts.md)
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float | None = None
    aux_coef: float = 0.01
    ep: int = 1  # expert-parallel ranks (refimpl/parallel/experts.py), inside the data-parallel group
    overlap: bool = True  # DualPipe's F&B steps interleave F and B at their all-to-alls (pipeline/overlap.py)
    # context parallelism (refimpl/parallel/context_parallel; docs/context_parallel.md)
    cp: int = 1
    cp_impl: str = "ring"
    # the block (refimpl/nn/models.py; docs/llama.md): gpt2, or llama with kv_heads and ffn_size
    arch: str = "gpt2"
    kv_heads: int | None = None
    ffn_size: int | None = None

    def check(self) -> None:
        if self.model not in DEFAULTS:
            raise ValueError(f"unknown model {self.model!r}; choose gpt or mlp")
        for name in ("steps", "batch_size", "n_layer", "d_model", "grad_accum"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        self.check_hyperparameters()
        if self.model == "gpt" and self.n_head <= 0:
            raise ValueError(f"--n-head must be positive, got {self.n_head}")
        if self.model == "gpt" and self.seq_len < 2:
            raise ValueError(f"--seq-len must be at least 2 for the GPT, got {self.seq_len}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by --grad-accum {self.grad_accum}; "
                             f"choose a batch size that is a multiple of it")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.data is not None and self.model != "gpt":
            raise ValueError("--data trains a character-level GPT; use it with --model gpt")
        if self.pp < 1 or (self.micro_batches is not None and self.micro_batches < 1):
            raise ValueError(f"--pp and --micro-batches must be positive, got {self.pp} and {self.micro_batches}")
        self.check_tensor_parallel()
        check_context_parallel(self.cp, self.cp_impl, self.seq_len, self.n_head, self.kv_heads or self.n_head,
                               self.tp, self.model, self.dropout, self.experts)
        self.check_experts()
        self.check_arch()
        self.check_own_schedule()
        if self.checkpoint != "none":

            parse_plan(self.checkpoint)  # a clear error for a bad plan
            if self.model != "gpt":
                raise ValueError("--checkpoint applies to the GPT's transformer blocks; use it with --model gpt")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"unknown ZeRO stage {self.zero!r}; choose --zero 0 (data parallel), 1, 2 or 3")
        for name in ("prefetch", "param_threshold", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.mem_budget is not None and self.mem_budget <= 0:
            raise ValueError(f"--mem-budget must be positive, got {self.mem_budget}")
        if self.dtype == "bf16":  # bfloat16 storage, float32 master weights, no loss scale (optim/precision.py)
            backend.check_dtype("bfloat16")  # ml_dtypes installed, numpy backend: or one line saying how
            self.check_bf16()
        elif self.dtype != "mixed":  # mixed: float16 storage, float32 master weights (optim/precision.py)
            backend.check_dtype(self.dtype)
        if self.dtype in ("float16", "bfloat16"):
            raise ValueError(f"--dtype {self.dtype} is not a training dtype; use float32, float64, mixed or bf16 "
                             f"(16-bit storage with float32 master weights)")

    def check_own_schedule(self) -> None:
        """--schedule MODULE:FUNCTION: load it, build it for this run, validate it and check that the
        executor can run it, now, on every rank, before anything trains (the one-line errors:
        refimpl/tools/plugin.py)."""
        if is_spec(self.schedule):
            build_executable_schedule(self.schedule, self.pp, self.micro_batches or 2 * self.pp, self.chunks)

    def check_bf16(self) -> None:
        """--dtype bf16 runs in one process (LocalTrainer) and on the distributed Trainer (ZeRO 0-3,
        whose sharded optimizer keeps the float32 master weights) with every parallelism."""
        if self.model != "gpt":
            raise ValueError("--dtype bf16 is for the GPT; the MLP trains in float32 or float64")

    def check_arch(self) -> None:
        """--arch, --kv-heads and --ffn-size: the Llama block's shape (with --experts its experts are
        SwiGLU MLPs of --ffn-size, Mixtral's; what does not run with experts is check_experts')."""
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown --arch {self.arch!r}; choose one of {', '.join(ARCHITECTURES)}")
        if self.arch != "llama":
            if self.kv_heads is not None or self.ffn_size is not None:
                raise ValueError("--kv-heads and --ffn-size shape the Llama block; add --arch llama")
            return
        if self.model != "gpt":
            raise ValueError("--arch llama is a GPT's block; use it with --model gpt")
        check_llama_shape(self.d_model, self.n_head, self.n_head if self.kv_heads is None else self.kv_heads,
                          self.ffn_size)

    def check_experts(self) -> None:
        """--experts, --top-k, --moe-every, --capacity-factor, --aux-coef and --ep: one line each."""
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"--ep must be a positive integer (expert-parallel ranks), got {self.ep}")
        if self.ep > 1 and self.experts == 0:
            raise ValueError(f"--ep {self.ep} splits the experts of a mixture of experts; add --experts E (a multiple "
                             f"of {self.ep}), or use --ep 1")
        if self.experts == 0:
            return
        if self.experts % self.ep:
            raise ValueError(f"--ep {self.ep} does not divide --experts {self.experts}: each expert-parallel rank "
                             f"holds experts / ep of them; use an --ep that divides {self.experts}")
        if self.ep > 1 and self.dtype == "mixed":
            raise ValueError("--ep with --dtype mixed is not supported yet: the experts' and the other parameters' "
                             "strategies would keep two loss scales and vote on overflow apart; use --ep 1 or float32")
        if self.ep > 1 and (self.save_dir or self.resume):
            raise ValueError("sharded checkpoints (--save-dir, --resume) of expert-parallel runs are not written yet; "
                             "use --ep 1 to save or resume")
        if self.experts < 0:
            raise ValueError(f"--experts must be >= 0 (0: the dense MLP), got {self.experts}")
        if self.model != "gpt":
            raise ValueError("--experts replaces the GPT blocks' MLP by a mixture of experts; use it with --model gpt")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"--top-k {self.top_k} must be between 1 and --experts {self.experts} (each token chooses "
                             "k of the experts)")
        if self.moe_every < 1:
            raise ValueError(f"--moe-every must be >= 1 (every n-th block gets the experts), got {self.moe_every}")
        if self.capacity_factor is not None and not (math.isfinite(self.capacity_factor) and self.capacity_factor > 0):
            raise ValueError(f"--capacity-factor must be a positive number (tokens per expert = factor x K x T / E), "
                             f"got {self.capacity_factor}; leave it out for dropless routing")
        if not (math.isfinite(self.aux_coef) and self.aux_coef >= 0):
            raise ValueError(f"--aux-coef must be a finite number >= 0, got {self.aux_coef}; the paper's is 0.01")
        if self.tp > 1:
            raise ValueError("--experts with --tp is not supported yet: the experts are not split over the "
                             "tensor-parallel group; use --tp 1")

    def check_tensor_parallel(self) -> None:
        """--tp, --sequence-parallel and --partition-activations against the model (the world size is
        the mesh's check)."""

        llama = self.arch == "llama"  # its key/value heads and SwiGLU width are split too
        check_options(self.tp, self.sequence_parallel, self.partition_activations, self.checkpoint, self.model,
                      self.n_head, self.seq_len, (self.kv_heads or self.n_head) if llama else None,
                      (self.ffn_size or 4 * self.d_model) if llama else None)
        kv_heads = self.kv_heads or self.n_head
        if llama and self.tp > kv_heads and self.cp > 1:
            raise ValueError(f"--cp {self.cp} with --tp {self.tp} larger than --kv-heads {kv_heads} (key/value heads "
                             f"replicated over tensor-parallel ranks) is not supported; use --cp 1, or --kv-heads "
                             f"{self.tp}")
        if self.tp > 1 and (self.save_dir or self.resume):
            raise ValueError("sharded checkpoints (--save-dir, --resume) of tensor-parallel runs are not written yet; "
                             "use --tp 1 to save or resume")

    def check_hyperparameters(self) -> None:
        """Refuse NaN, infinities and values outside a hyperparameter's range, in one line that says
        how to fix it. argparse's float() accepts "nan" and "inf", and NaN compares False with
        everything, so a check like `lr <= 0` lets it through: every check here is written as what
        a valid value satisfies."""
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be positive and finite, got {self.lr}; try 3e-3 (the GPT's default) or 1e-2")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}; use 0 (no decay) "
                             f"or e.g. 0.1")
        if not (math.isfinite(self.clip) and self.clip >= 0):
            raise ValueError(f"--clip must be a finite number >= 0 (the largest global gradient norm), got "
                             f"{self.clip}; use e.g. 1.0, or 0 to turn clipping off")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1) (the probability of zeroing an activation), got "
                             f"{self.dropout}; use e.g. 0.1, or 0 for none")
        if self.dropout > 0 and self.model != "gpt":
            raise ValueError("--dropout applies to the GPT's blocks; the MLP has no dropout: use it with --model gpt")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0 (NumPy's generators take non-negative seeds), got {self.seed}; "
                             f"use e.g. --seed {-self.seed}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"--bucket-bytes must be positive, got {self.bucket_bytes} (default 1048576: 1 MiB)")
        if self.chunks is not None and self.chunks < 1:
            raise ValueError(f"--chunks must be positive (model chunks per rank, interleaved), got {self.chunks}")


def build_task(cfg: TrainConfig):
    if cfg.model == "mlp":
        return SpiralsTask(seed=cfg.seed)
    if cfg.data is not None:
        return TextTask(cfg.data, cfg.seq_len, seed=cfg.seed)
    if cfg.seq_len % 2:
        raise ValueError(f"the sorting task needs an even --seq-len (2 x sequence length), got {cfg.seq_len}")
    return SortTask(length=cfg.seq_len // 2, seed=cfg.seed)


def build_model(cfg: TrainConfig, task):
    if cfg.model == "mlp":
        sizes = [task.n_features] + [cfg.d_model] * cfg.n_layer + [task.n_classes]
        return MLPClassifier(sizes, seed=cfg.seed, activation="tanh", dtype=model_dtype(cfg))
    config = GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
                       d_model=cfg.d_model, dropout=cfg.dropout, dtype=model_dtype(cfg), n_experts=cfg.experts,
                       top_k=cfg.top_k, moe_every=cfg.moe_every, capacity_factor=cfg.capacity_factor,
                       aux_coef=cfg.aux_coef, arch=cfg.arch, kv_heads=cfg.kv_heads, ffn_size=cfg.ffn_size)
    return GPT(config, seed=cfg.seed)


def model_dtype(cfg: TrainConfig) -> str:
    """The parameters' dtype: float16 storage under --dtype mixed (float32 master weights live in ZeRO),
    bfloat16 under --dtype bf16 (float32 master weights in LocalTrainer or ZeRO's sharded optimizer)."""
    return {"mixed": "float16", "bf16": "bfloat16"}.get(cfg.dtype, cfg.dtype)


def build_optimizer(cfg: TrainConfig, params):
    if cfg.optimizer == "adamw":
        return OPTIMIZERS["adamw"](params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return OPTIMIZERS["sgd"](params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)


@no_grad()
def evaluate(model, task) -> tuple[float, float]:
    """(loss, accuracy) on the task's held-out batch, in eval mode."""
    was_training = model.training
    model.eval()
    x, y = task.eval_batch()
    logits = model(to_input(model, x))
    loss = float(F.cross_entropy(logits, backend.asarray(y)).item())
    model.train(was_training)
    return loss, accuracy(backend.to_host(logits.data), y)


def make_trainer(cfg: TrainConfig, model, world=None, distributed: bool | None = None):
    """The trainer for this run: LocalTrainer in one process, else the one distributed Trainer.

    distributed=None chooses by the world's size; verify forces True so that even a world of one
    process runs the distributed code path. Pipelines, ZeRO and mixed precision always take it
    (in one process over a one-rank world).
    """
    layered = cfg.pp > 1 or cfg.schedule is not None or cfg.zero or cfg.dtype == "mixed" or cfg.tp > 1 or cfg.ep > 1 \
        or cfg.cp > 1
    if not layered and (world is None or (distributed is None and world.size == 1) or distributed is False):
        if cfg.checkpoint != "none":

            apply_to_gpt(model, cfg.checkpoint)
        return LocalTrainer(model, build_optimizer(cfg, model.parameters()), cfg.grad_accum, cfg.clip, cfg.mem_budget)
    schedule = cfg.schedule  # a built-in's name, or a schedule of your own built and checked here
    if is_spec(schedule):
        schedule = build_executable_schedule(schedule, cfg.pp, cfg.micro_batches or 2 * cfg.pp, cfg.chunks)
    costs = timeline.parse_costs(cfg.action_costs)  # --action-costs: refused before any rank communicates
    trainer = Trainer(model, lambda params: build_optimizer(cfg, params), world or get_world(cfg),
                      pp=cfg.pp, schedule=schedule, micro_batches=cfg.micro_batches, chunks=cfg.chunks,
                      grad_accum=cfg.grad_accum, zero=cfg.zero, dp_mode=cfg.dp_mode, bucket_bytes=cfg.bucket_bytes,
                      prefetch=cfg.prefetch, param_threshold=cfg.param_threshold, precision=cfg.dtype, clip=cfg.clip,
                      checkpoint=cfg.checkpoint, budget=cfg.mem_budget, tp=cfg.tp,
                      sequence_parallel=cfg.sequence_parallel, partition_activations=cfg.partition_activations,
                      ep=cfg.ep, overlap=cfg.overlap, cp=cfg.cp, cp_impl=cfg.cp_impl)
    timeline.install(trainer, costs, cfg.trace)  # the pipeline's timing, pacing and trace (tools/timeline.py)
    return trainer


def get_world(cfg: TrainConfig):
    """The world communicator (a one-process LocalComm unless launched by mpiexec; no MPI import then)."""
    return world_of(cfg.collectives)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite: training diverged (exit status 1, not a traceback).

    `train` decides it on the step's global loss, which every trainer has already reduced over all
    ranks for reporting (parallel/trainer.py, with allreduce_value: a pipeline's last stages
    contribute it and the other ranks 0). So every rank holds the same
    number and raises at the same step, at no extra communication: like failure.AgreedError,
    nobody is left waiting in a collective, and the train command prints the message once and
    exits 1 on every rank, without MPI_Abort. (Whether a sum is finite does not depend on the
    order in which ranks add: NaN and inf propagate, and the terms, cross-entropies, are >= 0.)

    Mixed precision's skip rule is not divergence: a float16 overflow in the scaled gradients
    skips the step and backs the loss scale off (optim/precision.py) while the float32 loss stays
    finite; a loss that is not finite means the parameters are no longer usable.
    """

    def __init__(self, step: int, loss: float, cfg: TrainConfig) -> None:
        self.step, self.loss = step, loss
        clip = f"a smaller --clip (this run: {cfg.clip:g})" if cfg.clip > 0 else "--clip 1.0 (this run: off)"
        super().__init__(f"step {step}: the loss is {loss}; training diverged: try a smaller --lr "
                         f"(this run: {cfg.lr:g}), or {clip}")


def check_output_paths(cfg: TrainConfig, world=None) -> None:
    """--trace (written by rank 0) and --save-dir (written by every rank) can be written, checked
    before the run (collective when a world is given and either is set): one line on every rank
    now, not a traceback after the run. The rules, symbolic links included: safe_files.py."""
    if not (cfg.trace or cfg.save_dir):
        return
    problem = None
    try:
        if cfg.trace and (world is None or world.rank == 0):
            safe_files.check_output_file(cfg.trace, "--trace", "trace.json")
        if cfg.save_dir:
            safe_files.check_output_directory(cfg.save_dir, "--save-dir")
    except ValueError as exc:
        problem = str(exc)
    if world is None:
        if problem:
            raise ValueError(problem)
        return
    agree(world, problem)  # every rank stops, or none does


def train(cfg: TrainConfig, progress: bool = True, world=None) -> dict:
    """Train as configured; return the summary printed by --json."""
    cfg.check()
    check_output_paths(cfg, world)  # before anything is built, read or trained
    task = build_task(cfg)
    preflight.check(cfg, task, world)  # refuse up front a run its hosts' memory cannot hold (runtime/preflight.py)
    model = build_model(cfg, task)
    if world is not None:
        check_same_run(world, cfg, task, model)  # the same flags, data and model on every rank
    n_params = model.num_parameters()  # the whole model's (tensor parallelism then keeps slices)
    trainer = make_trainer(cfg, model, world)
    start_step = 0
    if cfg.resume or cfg.save_dir:  # sharded checkpoints (refimpl/tools/saved_runs/sharded.py)

        start_step = sharded.resume(trainer, model, cfg, world) if cfg.resume else 0
        if cfg.save_dir:  # before the first step, not at the first save: writable, and not another run's
            sharded.prepare_save_dir(cfg, world)
    progress = progress and trainer.rank == 0
    bar = Progress(cfg.steps, label=f"train {cfg.model}", enabled=progress)
    saved_tensors.reset_peak()
    peak_activation_bytes = 0
    examples = tokens = 0
    losses = []
    count_blocks = cfg.model == "gpt" and cfg.pp == 1 and cfg.schedule is None
    expert_load: dict = {}  # MoE layer -> stats of this rank's micro-batches, summed over the steps (nn/experts.py)
    with count_forward_calls(model.blocks if count_blocks else []) as block_calls:
        start = time.perf_counter()
        for step in range(start_step, cfg.steps):
            x, y = task.batch(step, cfg.batch_size)
            saved_tensors.reset_peak()
            loss = trainer.step(x, y)
            watchdog.progress()
            peak_activation_bytes = max(peak_activation_bytes, saved_tensors.peak_bytes)
            losses.append(loss)
            if cfg.experts:
                expert_load = add_load(expert_load, take_load(model))
            examples += len(x)
            tokens += x.size if cfg.model == "gpt" else 0
            bar.update(step + 1, loss=loss)
            if not math.isfinite(loss):  # the same number on every rank: they stop together
                raise TrainingDiverged(step + 1, loss, cfg)
            if cfg.save_dir:
                sharded.maybe_save(trainer, model, cfg, step + 1, world)
        elapsed = time.perf_counter() - start
    # a pipeline's model lives in parts on several ranks: rank 0 evaluates it whole, the others nothing
    evaluated = trainer.model_for_evaluation(model, lambda: build_model(cfg, task))
    eval_loss, acc = evaluate(evaluated, task) if evaluated is not None else (None, None)
    summary = {
        "ok": True,  # False, with "error" and "diverged_at_step", when the loss became NaN or infinite (run)
        "model": cfg.model,
        "final_loss": losses[-1],
        "eval_loss": eval_loss,
        "accuracy": acc,
        "steps": cfg.steps,
        "start_step": start_step,  # > 0 when resumed from a checkpoint: steps start_step+1 .. steps ran here
        "seconds": elapsed,
        "samples_per_s": examples / elapsed,
        "tokens_per_s": tokens / elapsed if cfg.model == "gpt" else None,
        "peak_activation_bytes": peak_activation_bytes,
        # block forwards per block per micro-batch of the steps run here (a resumed run: since the
        # checkpoint): 1 without checkpointing, more with recomputation
        "forward_calls_per_layer": (block_calls.total / (cfg.n_layer * (cfg.steps - start_step) * cfg.grad_accum)
                                    if count_blocks else None),
        "n_params": n_params,
        "world_size": trainer.world_size,
        "config": asdict(cfg),
    }
    summary.update(trainer.report())
    if cfg.experts:  # per MoE layer: tokens per expert over the run, drops, the balance loss
        per_rank = [expert_load] if world is None else world.allgather_object(expert_load)
        summary["experts"] = describe_load(functools.reduce(add_load, per_rank, {}), cfg.steps - start_step)
    summary["backend"] = backend.name()
    if world is not None:
        summary["bytes_sent"] = world.counters_by_rank()  # per rank, by kind of call
        summary.update(world.transfer_report())  # CUDA-aware MPI or host staging (parallel/staging.py)
    summary.update(memory_by_rank(trainer, world))  # model_state_bytes and peaks, per rank and category
    summary["_model"] = model
    return summary

