"""The one distributed trainer: a training step composed of layers, over a dp x cp x tp x pp mesh.

Every distributed configuration -- data parallelism, ZeRO 0-3, mixed precision, tensor and
sequence parallelism, context parallelism, expert parallelism, pipelines of any schedule, and their
combinations -- is
this class. One optimizer step on a global batch of B examples is the same layers on every rank:

    1. the mesh (mesh.py)          N = dp · cp · tp · pp ranks; replica d takes its B/dp examples, cut
                                   into M micro-batches (M = --grad-accum without a pipeline, else
                                   --micro-batches); its tp ranks all run the same micro-batches, its
                                   cp ranks each the T/cp tokens of every sequence that they hold
    1b. the model's collectives    tensor parallelism (tensor_parallel/): the model is cut over the
                                   tp group before it is cut into stages; its layers communicate
                                   inside every forward and backward, and the loss is computed on
                                   vocabulary shards. Context parallelism (context_parallel/gpt.py):
                                   every layer runs on the rank's tokens, attention over the cp
                                   group's keys and values. Expert parallelism (experts.py): each
                                   rank of an ep group keeps E/ep experts; tokens travel by all-to-all
    2. the micro-batch loop        the pipeline executor (pipeline/executor.py) runs this rank's list
                                   of the schedule: F, B (or I then W) of each of its stages and
                                   micro-batches. A pipeline of one stage holding the whole model
                                   under 1F1B is F0 B0 F1 B1 ...: plain gradient accumulation, so
                                   there is one loop for every configuration
    3. the gradient strategy       over the data-parallel group (the dp · cp ranks that hold the same
                                   stages): DDP (data_parallel.py) or a ZeRO stage (zero/), which
                                   keeps model state whole or sharded and reduces gradients during
                                   the loop (it wraps every action: `around`). With expert
                                   parallelism a second strategy holds the experts and reduces over
                                   their replicas (edp_comm), sharing the first one's memory ledger
    4. the stage copies            DualPipe runs every stage twice per pipeline (ranks s and
                                   pp-1-s): the two copies' reduced gradients are summed
    5. precision and optimizer     the strategy's optimizer step on its blocks: mixed precision's
                                   unscale and overflow vote, clipping by the global norm (summed
                                   over the model-parallel ranks: each stage counted once, each
                                   parameter held whole by every tp rank counted by tp rank 0),
                                   the update

    loss_mb = Σ_(counted targets of mb) CE / N_batch   (objective.py: N_batch counts the whole
                                                        global batch, so gradients simply add up)

So the step equals single-process training on the whole batch up to the order of floating-point
sums; `verify` checks that to rtol 1e-10 in float64 (and bit for bit where the arithmetic is the
same). A new dimension (tensor or expert parallelism) is a new layer -- an axis of the mesh and
the collectives inside the model -- never a new trainer.

Why DualPipe's copies are a layer of their own: the strategy's reductions run during the loop,
in the order of this rank's schedule, and the two copies of a stage run in different orders on
their two ranks; MPI needs every rank of a communicator to issue its collectives in the same
order, so the strategy reduces over the dp replicas (which run the same list) and the copies are
summed after the loop, in stage order.

`Trainer.__init__` builds the layers in that order, one named step each: the mesh, the tensor-
parallel cut, the schedule, the stages (with their experts and activation checkpointing), the
executor, DualPipe's copies, the gradient strategies, the further layers. Timing, pacing and
tracing the pipeline are not the trainer's: a tool installs an observer on its executor
(pipeline/executor.py, `Observer`; refimpl/tools/timeline.py), whose figures report() includes.

What every trainer provides (verify, train, checkpoints and the memory ledger rely on it) is in
refimpl/protocols.py: `Verifiable`, with `HoldsReplica`, `MixedPrecisionVerifiable` and
`Checkpointable`, all of which this trainer implements.
"""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager

from refimpl import backend
from refimpl.checkpointing import apply_to_gpt, parse_plan, selective_recomputation
from refimpl.nn import functional as F
from refimpl.nn.batch_rows import batch_rows
from refimpl.nn.models import GPT
from refimpl.objective import count_targets, split_batch
from refimpl.protocols import IMPLEMENTATION_FLAGS

from .context_parallel.gpt import apply_context_parallelism
from .data_parallel import DataParallel
from .experts import ParameterSubset, apply_expert_parallelism, is_expert_parameter
from .mesh import Mesh
from .pipeline.actions import Schedule
from .pipeline.executor import PipelineExecutor
from .pipeline.schedules import build
from .pipeline.stage import split_model
from .pipeline.validate import validate
from .tensor_parallel import PartitionedActivations, check_options, shard_gpt
from .zero import STAGES


def _check_options(model, pp, tp, sequence_parallel, partition_activations, checkpoint, grad_accum, schedule,
                   zero) -> None:
    """The options that cannot work together, refused before anything communicates (on every rank alike)."""
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"--pp must be a positive integer (pipeline ranks), got {pp!r}")
    gpt = model.config if isinstance(model, GPT) else None
    check_options(tp, sequence_parallel, partition_activations, checkpoint or "none",
                  "gpt" if gpt else type(model).__name__, gpt.n_head if gpt else 1, gpt.seq_len if gpt else 0,
                  *((gpt.n_kv_heads, gpt.ffn_width) if gpt and gpt.arch == "llama" else ()))
    if grad_accum <= 0:
        raise ValueError(f"--grad-accum must be positive, got {grad_accum}")
    if (pp > 1 or schedule is not None) and grad_accum != 1:
        raise ValueError(f"--grad-accum {grad_accum} does not apply to a pipeline: its --micro-batches are the "
                         "accumulation; use --grad-accum 1")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {zero!r}; choose 0 (data parallel), 1, 2 or 3")


class Trainer:
    """Training of `model` (built whole and alike on every rank) over `world`; see the module docstring.

    make_optimizer(params) builds the optimizer (with no parameters for ZeRO: it shards the state).
    Pipeline: pp ranks per pipeline, schedule (a built-in's name, default 1f1b when pp > 1, or a
    Schedule already built: the tools build a schedule of your own, MODULE:FUNCTION), micro_batches
    (default 2·pp), chunks (interleaved); overlap: DualPipe's F&B steps interleaved at their
    all-to-alls. Tensor parallelism: tp ranks per layer (a GPT), with sequence_parallel the
    activations between them cut along the sequence. Expert parallelism: ep ranks share a MoE
    layer's experts. Strategy: zero (0-3; 0 with float32/float64 is DDP, dp_mode bucketed or naive),
    bucket_bytes, prefetch and param_threshold (ZeRO-3). precision: float32, float64 or mixed.
    checkpoint: an activation checkpointing plan (refimpl/checkpointing). layers: further layers of
    the step (a new parallel dimension): each is given the mesh (`join(mesh)`, collective: it makes
    its own sub-communicators) and wraps every action of the loop (`around(action, last)`, inside
    the gradient strategy's). A tool that times or paces the pipeline installs its observer as
    `trainer.executor.observer` (pipeline/executor.py, Observer; refimpl/tools/timeline.py).
    """

    implements = frozenset(IMPLEMENTATION_FLAGS)  # every flag that chooses how a step is computed (protocols.py)

    def __init__(self, model, make_optimizer, world, *, pp: int = 1, schedule: str | Schedule | None = None,
                 micro_batches: int | None = None, chunks: int | None = None, grad_accum: int = 1,
                 zero: int = 0, dp_mode: str = "bucketed", bucket_bytes: int = 1 << 20, prefetch: int = 0,
                 param_threshold: int = 0, precision: str = "float32", clip: float = 0.0, checkpoint=None,
                 budget: int | None = None, layers=(), tp: int = 1, sequence_parallel: bool = False,
                 partition_activations: bool = False, ep: int = 1, overlap: bool = True, cp: int = 1,
                 cp_impl: str = "ring") -> None:
        _check_options(model, pp, tp, sequence_parallel, partition_activations, checkpoint, grad_accum, schedule,
                       zero)
        self.world, self.rank, self.world_size = world, world.rank, world.size
        self.pp, self.tp, self.ep, self.zero, self.precision, self.clip = pp, tp, ep, zero, precision, clip
        self.pipelined = pp > 1 or schedule is not None
        # The build order: each step needs what the ones above it built.
        self.mesh = Mesh(world, pp=pp, tp=tp, ep=ep, cp=cp)  # 1. the same clear error on every rank if pp·tp·cp ∤ N
        self.dp = self.mesh.dp
        store = self._cut_over_tensor_parallel(model, sequence_parallel, partition_activations)  # 1b.
        self.context_parallel = apply_context_parallelism(model, self.mesh.cp_comm, cp_impl, tp) \
            if cp > 1 else None  # 1b. every layer on this rank's tokens
        self.schedule = self._build_schedule(schedule, micro_batches, chunks, grad_accum)  # 2.
        self._cut_into_stages(model, checkpoint, store)  # 2. with 1b's experts and activation checkpointing
        self.executor = self._build_executor(overlap=overlap and zero != 3)  # 2. (ZeRO-3's gather-ahead: one order)
        self.copies = self._stage_copies()  # 4. DualPipe
        self.sharding, self.expert_sharding = self._gradient_strategies(  # 3. and 5.
            model, make_optimizer, zero, precision, dp_mode, bucket_bytes, budget, prefetch, param_threshold)
        self.layers = self._join_layers(layers)  # further layers of the step
        self.strategies = [s for s in (self.sharding, self.expert_sharding) if s is not None]
        self.ledger = self.sharding.ledger
        self.scaler = getattr(self.sharding, "scaler", None)
        self.record_grads = False
        self.last_grads: dict = {}
        self.held_grads: dict = {}  # the gradients of this rank's stages, whole (local_records)
        self.steps_done = 0  # the global batch's number (dropout masks are keyed by it)

    def _cut_over_tensor_parallel(self, model, sequence_parallel: bool, partition_activations: bool):
        """1b. With tp > 1 each rank keeps its slices of the model (tensor_parallel/), before the model
        is cut into stages; returns the store of partitioned activations (or None)."""
        self.tensor_parallel, store = None, None
        if self.tp > 1:
            self.tensor_parallel = shard_gpt(model, self.mesh.tp_comm, sequence_parallel)
            store = PartitionedActivations(self.mesh.tp_comm) if partition_activations else None
        # the whole model's parameter shapes (this rank may hold slices, or some of the experts)
        self.whole_shapes = {name: tuple(param.shape) for name, param in model.named_parameters()} \
            if self.tensor_parallel is None else dict(self.tensor_parallel.shapes)
        return store

    def _build_schedule(self, schedule, micro_batches: int | None, chunks: int | None, grad_accum: int) -> Schedule:
        """2. The micro-batch loop: a built-in schedule by name (default 1f1b) for M micro-batches, or
        one built already; without a pipeline, 1F1B over one stage with M = grad_accum (gradient
        accumulation)."""
        if not isinstance(schedule, Schedule):
            M = (2 * self.pp if micro_batches is None else micro_batches) if self.pipelined else grad_accum
            schedule = build(schedule or "1f1b", self.pp, M, chunks)
        if not validate(schedule).per_channel_ok:  # the executor's receive policy (executor.py) must complete
            raise ValueError(f"{schedule.name}: its lists deadlock with one posted receive per channel; "
                             "see validate.py")
        return schedule

    def _cut_into_stages(self, model, checkpoint, store) -> None:
        """2. The model cut into the schedule's S stages (all_stages), those this rank runs (stages),
        and who counts each: with ep > 1 each MoE layer first keeps its E/ep experts (1b,
        experts.py); activation checkpointing runs inside the stages, or over the whole model."""
        S, placement, p = self.schedule.num_stages, self.schedule.placement, self.mesh.pp_index
        why = "" if S == self.pp else f" ({self.schedule.name} with --pp {self.pp} cuts the model into {S} stages)"
        # each stage's parameters in the whole model, before expert parallelism keeps E/ep experts per rank
        self.stage_names = {s: [name for name, _ in stage.named_parameters()]
                            for s, stage in split_model(model, S, why=why).items()}
        self.expert_runners = []  # with ep > 1: each MoE layer's ExpertParallel (experts.py)
        if self.ep > 1:
            self.expert_runners = apply_expert_parallelism(model, self.mesh.ep_comm)
            if not self.expert_runners:
                raise ValueError(f"--ep {self.ep} splits the experts of a mixture of experts; the model has none: add "
                                 "--experts E, or use --ep 1")
        self.all_stages = split_model(model, S, checkpoint_plan=None if S == 1 else checkpoint, why=why)
        if checkpoint not in (None, "none"):
            if S == 1:  # the whole model, as one process
                apply_to_gpt(model, checkpoint, store)
            else:  # the stages run the chain plan; a selective plan also recomputes every attention core
                if isinstance(model, GPT):
                    selective_recomputation(model.blocks, str(parse_plan(checkpoint)).startswith("selective"))
                for stage in self.all_stages.values():
                    stage.checkpoint_store = store
        self.stages = {s: self.all_stages[s] for s in placement.stages_of(p)}
        # The lowest pipeline rank holding a stage counts it (global norm) and writes it (records, checkpoints).
        self.primary = {s: min(placement.ranks_of(s)) for s in range(S)}
        self.counts_its_stages = all(self.primary[s] == p for s in self.stages)

    def _build_executor(self, overlap: bool) -> PipelineExecutor:
        """2. The executor of this rank's list; the experts' all-to-alls run through it (the switch
        points of its overlapped F&B steps)."""
        executor = PipelineExecutor(self.schedule, self.mesh.pp_index, self.mesh.pp_comm, self.stages, overlap=overlap)
        for runner in self.expert_runners:
            runner.all_to_all = executor.all_to_all
        return executor

    def _stage_copies(self):
        """4. DualPipe: the communicator of the ranks that hold a copy of this rank's stages (the mirror
        in each pipeline), over which the copies' gradients are summed; None with one copy."""
        holders = sorted({r for s in self.stages for r in self.schedule.placement.ranks_of(s)})
        if len(holders) == 1:
            return None
        d, c, t, p = self.mesh.dp_index, self.mesh.cp_index, self.mesh.tp_index, self.mesh.pp_index
        return self.world.split(color=((d * self.mesh.cp + c) * self.tp + t) * self.pp + holders[0], key=p)

    def _gradient_strategies(self, model, make_optimizer, zero: int, precision: str, dp_mode: str, bucket_bytes: int,
                             budget: int | None, prefetch: int, param_threshold: int) -> tuple:
        """3. and 5. The gradient strategy over the data-parallel group, with precision and the
        optimizer: DDP, or a ZeRO stage (mixed precision needs ZeRO's master weights: ZeRO-0 then).
        With ep > 1 a second one holds the experts and reduces over their replicas (edp_comm),
        sharing the first one's memory ledger. Returns (strategy, expert strategy or None)."""
        norm_total, any_rank = (self._model_parallel_norm, self._model_parallel_any) if self.pp * self.tp > 1 \
            else (None, None)
        uncounted = set()  # held whole by every tp rank: tp rank 0 counts them; replicated slices: their first rank
        if self.tensor_parallel is not None:
            uncounted = set(self.tensor_parallel.uncounted_names(name for name, _ in model.named_parameters()))

        def strategy(parts: dict, comm, ledger=None):
            if zero == 0 and precision not in ("mixed", "bf16"):  # both need ZeRO's float32 master weights
                return DataParallel(parts, make_optimizer, comm, dp_mode, bucket_bytes, self.clip, budget,
                                    rank=self.rank, norm_total=norm_total, uncounted=uncounted, ledger=ledger)
            options = dict(precision=precision, clip=self.clip, bucket_bytes=bucket_bytes, budget=budget,
                           rank=self.rank, norm_total=norm_total, any_rank=any_rank, uncounted=uncounted, ledger=ledger)
            if zero == 3:
                options.update(prefetch_bytes=prefetch, param_threshold=param_threshold)
            return STAGES[zero](model, parts, make_optimizer([]), comm, **options)

        if self.ep == 1:
            return strategy(self.stages, self.mesh.dp_comm), None
        # the experts' gradients sum over their replicas (edp_comm), the rest over the whole dp group
        experts = {s: ParameterSubset(stage, is_expert_parameter) for s, stage in self.stages.items()}
        others = {s: ParameterSubset(stage, lambda name: not is_expert_parameter(name))
                  for s, stage in self.stages.items()}
        dense = strategy(others, self.mesh.dp_comm)
        return dense, strategy(experts, self.mesh.edp_comm, ledger=dense.ledger)

    def _join_layers(self, layers) -> list:
        """Further layers of the step: each makes its sub-communicators of the mesh (collective)."""
        layers = list(layers)
        for layer in layers:
            layer.join(self.mesh)
        return layers

    # ------------------------------------------------------------------------------------------
    def step(self, x, y) -> float:
        """One optimizer step on the global batch (x, y); returns the global batch's loss."""
        total = count_targets(y)  # of the whole global batch
        M = self.schedule.micro_batches
        if self.pipelined:
            if len(x) % (self.dp * M):
                raise ValueError(f"a batch of {len(x)} cannot be split into {self.dp} data-parallel replicas x "
                                 f"{M} micro-batches; choose a --batch-size divisible by {self.dp * M}")
            replicas = "data-parallel replicas (world size / --pp)"
            micro_batches = "pipeline micro-batches (--micro-batches)"
        else:
            replicas, micro_batches = "data-parallel ranks", "micro-batches per rank (--grad-accum)"
        x_local, y_local = split_batch(x, y, self.dp, replicas)[self.mesh.dp_index]
        if self.context_parallel is not None:  # (B/dp, T) -> (B/dp, T/cp): this rank's tokens of each sequence
            x_local, y_local = self.context_parallel.shard(x_local), self.context_parallel.shard(y_local)
        micro = split_batch(x_local, y_local, M, micro_batches)
        scale = 1.0 / max(1, total)
        b, first_row = len(micro[0][0]), self.mesh.dp_index * len(x_local)

        def rows(mb):  # rows of the global batch in micro-batch mb: dropout masks independent of the split
            start = first_row + mb * b
            loss_scale = 1.0 if self.scaler is None else self.scaler.scale
            return batch_rows(start, start + b, len(x), self.steps_done, loss_scale)

        cross_entropy = F.cross_entropy if self.tensor_parallel is None else self.tensor_parallel.cross_entropy

        def loss_fn(logits, mb):  # objective.micro_batch_loss, from the last stage's logits
            return cross_entropy(logits, backend.asarray(micro[mb][1]), reduction="sum") * scale

        for runner in self.expert_runners:
            runner.traffic.clear()  # the runners record this step's all-to-alls
        record = self.executor.run(lambda mb: micro[mb][0], loss_fn, micro[0][0].shape, forward_context=rows,
                                   around=self._around, loss_scale=None if self.scaler is None else self.scaler.scale)
        grads = [strategy.finish() for strategy in self.strategies]  # 3. reduced over the data-parallel group
        if self.copies is not None:  # 4. DualPipe: + the other copy of each stage
            for g in (g for group in grads for g in group):
                self.copies.allreduce(g)
        norm2 = self._squared_norm_with_experts(grads) if self.expert_sharding is not None and self.clip > 0 else None
        results = [strategy.optimizer_step(g, norm2) for strategy, g in zip(self.strategies, grads)]  # 5. the update
        if self.record_grads:
            self.held_grads = self._whole_slices(self._merge_by_name([strategy.gather_by_name(result.grads)
                                                                      for strategy, result in zip(self.strategies,
                                                                                                  results)]))
            self.last_grads = self._on_rank0(self.held_grads)
        for strategy, result in zip(self.strategies, results):
            strategy.end_step(result)
        self.steps_done += 1
        # tp ranks: one loss; cp ranks: each the share of its tokens, which add up
        return self.world.allreduce_value(record.loss if self.mesh.tp_index == 0 else 0.0)

    def _squared_norm_with_experts(self, grads: list) -> float:
        """‖g‖² of the whole model with expert parallelism: the experts' part summed over the
        expert-parallel group (each rank holds other experts), then everything over the model-parallel
        ranks (each stage once, replicated tp parameters once)."""
        dense = self.sharding.squared_norm(grads[0])
        experts = self.mesh.ep_comm.allreduce_value(self.expert_sharding.squared_norm(grads[1]))
        total = dense + experts
        return self._model_parallel_norm(total) if self.pp * self.tp > 1 else total

    def _merge_by_name(self, pieces: list) -> dict:
        """{name: array} of this rank's stages from every strategy's {name: array}; with expert
        parallelism all the experts, gathered over the expert-parallel group (a diagnostic path)."""
        mine = {name: array for piece in pieces for name, array in piece.items()}
        if self.expert_sharding is not None:
            experts = {name: array for name, array in mine.items() if is_expert_parameter(name)}
            for other in self.mesh.ep_comm.allgather_object(experts):
                mine.update(other)
        return mine

    def _model_parallel_norm(self, local: float) -> float:
        """Σ over the model-parallel ranks (pipeline x tp) of ‖g‖² (local: this rank's slices of its
        stages, without the parameters another rank counts), each stage counted once."""
        return self.mesh.mp_comm.allreduce_value(local if self.counts_its_stages else 0.0)

    def _model_parallel_any(self, flag: float) -> float:
        """An overflow on any stage or slice (flag 1.0) skips the step on every rank."""
        return self.mesh.mp_comm.allreduce_value(flag, "max")

    @contextmanager
    def _around(self, action, last: bool):
        """Every action inside the gradient strategy's wrapper, then the further layers' (outermost first)."""
        with ExitStack() as stack:
            for strategy in self.strategies:
                stack.enter_context(strategy.around(action, last))
            for layer in self.layers:
                stack.enter_context(layer.around(action, last))
            yield

    # -- what the trainer holds ------------------------------------------------------------------
    def full_parameters(self) -> dict:
        """{name: NumPy array} of the whole model (collective). Without a pipeline every rank gets
        it; with one, rank 0 (the others get {}). Mixed precision: the float32 master weights."""
        return self._on_rank0(self._held_parameters())

    def local_records(self) -> dict:
        """{"parameters", "gradients"}: {name: whole array} of this rank's own stages (collective): its
        copy, not the one rank 0 gathers from data-parallel replica 0, so that verify checks every
        replica. Slices are joined over the tp group, ZeRO shards gathered over the dp group, experts
        over the ep group; the gradients are the last step's with record_grads."""
        return {"parameters": self._held_parameters(), "gradients": self.held_grads}

    def _held_parameters(self) -> dict:
        """{name: whole array} of this rank's stages (collective over its tp, dp and ep groups)."""
        return self._whole_slices(self._merge_by_name([strategy.whole_parameters() for strategy in self.strategies]))

    def full_optimizer_state(self) -> dict:
        """{"step", "arrays": {key: {name: array}}, "loss_scaler"} on rank 0 (collective; ZeRO strategies).

        verify --dtype mixed hands it to the single-process reference before each step, so that
        each step is compared from the same state (compare_mixed.py, "lockstep")."""
        state = self.sharding.whole_optimizer_state()
        state["arrays"] = {key: self._on_rank0(self._whole_slices(arrays)) for key, arrays in state["arrays"].items()}
        return state

    def model_for_evaluation(self, model, build):
        """The model to evaluate on this rank, or None (collective).

        Without a pipeline every rank holds the whole `model` (ZeRO-3 gathers its parameters
        during the forward, on every rank together). With a pipeline or tensor parallelism, rank 0
        loads the whole trained parameters into a fresh model from build() (its own `model` holds
        only its stages or slices, and under ZeRO-3 only shards); the other ranks evaluate nothing."""
        if not self.pipelined and self.tensor_parallel is None and self.expert_sharding is None \
                and self.context_parallel is None:
            return model
        params = self.full_parameters()
        if self.rank != 0:
            return None
        fresh = build()
        fresh.load_state_dict(params)
        return fresh

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (a mixed-precision step skipped on overflow is not one)."""
        return self.sharding.steps_taken

    def checkpoint_pieces(self) -> list:
        """This rank's share of a sharded checkpoint: the blocks of the stages it is primary for,
        whole groups only from data-parallel replica 0 (refimpl/tools/saved_runs/sharded.py)."""
        if self.tensor_parallel is not None or self.expert_sharding is not None:
            raise ValueError("sharded checkpoints (--save) of tensor- or expert-parallel runs are not written yet: "
                             "their pieces are slices of parameters or some of the experts; train with --tp 1 "
                             "--ep 1 to save, or without --save")
        mine = [s for s in self.stages if self.primary[s] == self.mesh.pp_index]
        return self.sharding.checkpoint_pieces(mine, writes_whole=self.mesh.leads_replica)

    def load_full_state(self, masters: dict, states: dict, step: int) -> None:
        if self.tensor_parallel is not None or self.expert_sharding is not None:
            raise ValueError("resuming a tensor- or expert-parallel run from a checkpoint is not supported yet; use "
                             "--tp 1 --ep 1")
        self.sharding.load_full_state(masters, states, step)

    def _whole_slices(self, mine: dict) -> dict:
        """{name: whole array} from this rank's {name: slice} (collective over the tp group:
        TensorParallelGPT.gather_by_name); `mine` itself without tensor parallelism."""
        return mine if self.tensor_parallel is None else self.tensor_parallel.gather_by_name(mine)

    def _on_rank0(self, mine: dict) -> dict:
        """{name: array} of the whole model from each rank's {name: whole array} of its stages
        (collective over the pipeline; with expert parallelism `mine` already holds every expert,
        _merge_by_name, and with tensor parallelism whole arrays, _whole_slices). Without a pipeline
        that is whole. Stage s comes from pipeline rank primary[s] of replica 0, tp rank 0: one
        message of its arrays flattened in model order (stage_names, whole_shapes)."""
        if not self.pipelined or self.pp == 1:
            return mine
        out: dict = {}
        if self.rank == 0:
            pending = []
            for s, names in self.stage_names.items():
                if self.primary[s] == 0:
                    out.update({name: mine[name] for name in names})
                    continue
                sizes = [math.prod(self.whole_shapes[name]) for name in names]
                buf = backend.xp().empty(sum(sizes), dtype=next(iter(mine.values())).dtype)
                pending.append((names, sizes, buf, self.world.irecv(buf, self.mesh.rank_of(0, self.primary[s]), tag=s)))
            for names, sizes, buf, request in pending:
                request.wait()
                host, offset = backend.to_host(buf), 0
                for name, size in zip(names, sizes):
                    out[name] = host[offset:offset + size].reshape(self.whole_shapes[name]).copy()
                    offset += size
        elif self.mesh.leads_replica and self.mesh.tp_index == 0:
            for s in self.stages:
                if self.primary[s] == self.mesh.pp_index:
                    flat = backend.xp().concatenate([backend.asarray(mine[name]).reshape(-1)
                                                     for name in self.stage_names[s]])
                    self.world.send(flat, 0, tag=s)
        order = [name for s in sorted(self.stage_names) for name in self.stage_names[s]]
        return {name: out[name] for name in order} if self.rank == 0 else {}

    # -- reports ---------------------------------------------------------------------------------
    def model_state_bytes(self) -> dict:
        """{"parameters", "gradients", "optimizer_states"}: bytes of model state this rank holds."""
        current = self.ledger.current()
        return {k: int(current.get(k, 0)) for k in ("parameters", "gradients", "optimizer_states")}

    def report(self) -> dict:
        """What train --json and verify --json print about the trainer (local: no communication)."""
        info = {"strategy": type(self.sharding).__name__, **self.sharding.report()}
        if self.expert_sharding is not None:
            info["expert_parallel"] = {"ep": self.ep, "expert_data_parallel": self.mesh.edp_comm.size,
                                       "experts_per_rank": self.expert_runners[0].per_rank}
        if self.context_parallel is not None:
            info["context_parallel"] = {"cp": self.mesh.cp, "impl": self.context_parallel.impl,
                                        "layout": self.context_parallel.layout}
        if self.tensor_parallel is not None:
            tp = self.tensor_parallel
            info["tensor_parallel"] = {"tp": self.tp, "sequence_parallel": tp.sequence_parallel,
                                       "padded_vocab": tp.padded_vocab, "split_parameters": len(tp.splits)}
        if not self.pipelined:
            return info
        S = self.schedule.num_stages
        placement = self.schedule.placement
        sizes = {s: sum(param.size for param in stage.parameters()) for s, stage in self.all_stages.items()}
        pipeline = {
            "schedule": self.schedule.name,
            "pp": self.pp,
            "dp": self.dp,
            "micro_batches": self.schedule.micro_batches,
            "chunks": self.schedule.chunks,
            "stages": S,
            "layers_per_stage": None if S == 1 else [stage.stop - stage.start
                                                     for _, stage in sorted(self.all_stages.items())],
            "stages_of_rank": [list(placement.stages_of(r)) for r in range(self.pp)],
            "parameters_of_rank": [sum(sizes[s] for s in placement.stages_of(r)) for r in range(self.pp)],
            "zero": self.zero,
            "sharding_group": self.mesh.dp_comm.size,  # the dp · cp ranks over which gradients are reduced and
            # state sharded
            "stage_copies": 2 if self.copies is not None else 1,  # DualPipe: each stage twice per pipeline
        }
        pipeline.update(self.executor.observer.report())  # a tool's figures (timing: tools/timeline.py)
        info["pipeline"] = pipeline
        return info


__all__ = ["Trainer"]
