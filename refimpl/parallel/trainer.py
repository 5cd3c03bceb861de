"""The one distributed trainer: a training step composed of layers, over a dp x tp x pp mesh.

Every distributed configuration -- data parallelism, ZeRO 0-3, mixed precision, tensor and
sequence parallelism, expert parallelism, pipelines of any schedule, and their combinations -- is
this class. One
optimizer step on a global batch of B examples is the same layers on every rank:

    1. the mesh (mesh.py)          N = dp · tp · pp ranks; replica d takes its B/dp examples, cut
                                   into M micro-batches (M = --grad-accum without a pipeline, else
                                   --micro-batches); its tp ranks all run the same micro-batches
    1b. the model's collectives    tensor parallelism (tensor_parallel/): the model is cut over the
                                   tp group before it is cut into stages; its layers communicate
                                   inside every forward and backward, and the loss is computed on
                                   vocabulary shards. Expert parallelism (experts.py): each rank of
                                   an ep group keeps E/ep experts; tokens travel by all-to-all
    2. the micro-batch loop        the pipeline executor (pipeline/executor.py) runs this rank's list
                                   of the schedule: F, B (or I then W) of each of its stages and
                                   micro-batches. A pipeline of one stage holding the whole model
                                   under 1F1B is F0 B0 F1 B1 ...: plain gradient accumulation, so
                                   there is one loop for every configuration
    3. the gradient strategy       over the data-parallel group (the dp ranks that hold the same
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

What every trainer provides (verify, train, checkpoints and the memory ledger rely on it) is
refimpl/protocols.py's `Trainer`.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack, contextmanager

from refimpl import backend
from refimpl.autograd.saved import saved_tensors
from refimpl.nn import functional as F
from refimpl.nn.models import GPT
from refimpl.nn.batch_rows import batch_rows
from refimpl.objective import count_targets, split_batch

from .mesh import Mesh
from refimpl.tools import timeline as tl  # TODO layering: timing moves out of the core
from .pipeline.executor import PipelineExecutor, replay_peak, stage_exchanges
from .pipeline.schedules import build
from .pipeline.simulate import Costs
from .pipeline.stage import split_model
from .pipeline.validate import validate
from .experts import ParameterSubset, apply_expert_parallelism, is_expert_parameter


class Trainer:
    """Training of `model` (built whole and alike on every rank) over `world`; see the module docstring.

    make_optimizer(params) builds the optimizer (with no parameters for ZeRO: it shards the state).
    Pipeline: pp ranks per pipeline, schedule (default 1f1b when pp > 1), micro_batches (default
    2·pp), chunks (interleaved). Tensor parallelism: tp ranks per layer (a GPT), with
    sequence_parallel the activations between them cut along the sequence. Strategy: zero (0-3; 0 with float32/float64 is DDP, dp_mode
    bucketed or naive), bucket_bytes, prefetch and param_threshold (ZeRO-3). precision: float32,
    float64 or mixed. checkpoint: an activation checkpointing plan (refimpl/checkpointing).
    layers: further layers of the step (a new parallel dimension): each is given the mesh
    (`join(mesh)`, collective: it makes its own sub-communicators) and wraps every action of the
    loop (`around(action, last)`, inside the gradient strategy's).
    """

    def __init__(self, model, make_optimizer, world, *, pp: int = 1, schedule: str | None = None,
                 micro_batches: int | None = None, chunks: int | None = None, grad_accum: int = 1,
                 zero: int = 0, dp_mode: str = "bucketed", bucket_bytes: int = 1 << 20, prefetch: int = 0,
                 param_threshold: int = 0, precision: str = "float32", clip: float = 0.0, checkpoint=None,
                 budget: int | None = None, action_costs=None, trace: str | None = None, layers=(),
                 tp: int = 1, sequence_parallel: bool = False, partition_activations: bool = False,
                 ep: int = 1, overlap: bool = True) -> None:
        if not isinstance(pp, int) or pp < 1:
            raise ValueError(f"--pp must be a positive integer (pipeline ranks), got {pp!r}")
        from .tensor_parallel.gpt import check_options  # noqa: PLC0415

        gpt = model.config if isinstance(model, GPT) else None
        check_options(tp, sequence_parallel, partition_activations, checkpoint or "none",
                      "gpt" if gpt else type(model).__name__, gpt.n_head if gpt else 1, gpt.seq_len if gpt else 0)
        if grad_accum <= 0:
            raise ValueError(f"--grad-accum must be positive, got {grad_accum}")
        pipelined = pp > 1 or schedule is not None
        if pipelined and grad_accum != 1:
            raise ValueError(f"--grad-accum {grad_accum} does not apply to a pipeline: its --micro-batches are the "
                             "accumulation; use --grad-accum 1")
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"unknown ZeRO stage {zero!r}; choose 0 (data parallel), 1, 2 or 3")
        # 1. the mesh
        self.mesh = Mesh(world, pp=pp, tp=tp, ep=ep)  # the same clear error on every rank if pp · tp does not divide N
        self.world, self.rank, self.world_size = world, world.rank, world.size
        self.pp, self.dp, self.pipelined, self.clip, self.trace = pp, self.mesh.dp, pipelined, clip, trace
        self.tp, self.tensor_parallel, store = tp, None, None
        if tp > 1:  # 1b. cut the model over the tp group (each rank keeps its slices), then into stages
            from .tensor_parallel import PartitionedActivations, shard_gpt  # noqa: PLC0415

            self.tensor_parallel = shard_gpt(model, self.mesh.tp_comm, sequence_parallel)
            store = PartitionedActivations(self.mesh.tp_comm) if partition_activations else None
        # the whole model's parameter shapes (this rank may hold slices, or some of the experts)
        self.whole_shapes = {name: tuple(param.shape) for name, param in model.named_parameters()} \
            if self.tensor_parallel is None else dict(self.tensor_parallel.shapes)
        self.ep, self.expert_runners = ep, []  # with ep > 1: each MoE layer's ExpertParallel (experts.py)
        # 2. the micro-batch loop: a schedule of M micro-batches (one stage: gradient accumulation)
        name = schedule or "1f1b"
        self.schedule = build(name, pp, (2 * pp if micro_batches is None else micro_batches) if pipelined
                              else grad_accum, chunks)
        if not validate(self.schedule).per_channel_ok:  # the executor's receive policy (executor.py) must complete
            raise ValueError(f"{name}: its lists deadlock with one posted receive per channel; see validate.py")
        self.costs = action_costs if isinstance(action_costs, Costs) or action_costs is None else \
            tl.parse_costs(action_costs)
        self.timing_mode = tl.describe_costs(self.costs)
        p, S, placement = self.mesh.pp_index, self.schedule.num_stages, self.schedule.placement
        why = "" if S == pp else f" ({name} with --pp {pp} cuts the model into {S} stages)"
        # each stage's parameters in the whole model, before expert parallelism keeps E/ep experts per rank
        self.stage_names = {s: [name for name, _ in stage.named_parameters()]
                            for s, stage in split_model(model, S, why=why).items()}
        if ep > 1:  # 1b. expert parallelism: each rank keeps its experts, tokens travel by all-to-all

            self.expert_runners = apply_expert_parallelism(model, self.mesh.ep_comm)
            if not self.expert_runners:
                raise ValueError(f"--ep {ep} splits the experts of a mixture of experts; the model has none: add "
                                 "--experts E, or use --ep 1")
        self.all_stages = split_model(model, S, checkpoint_plan=None if S == 1 else checkpoint, why=why)
        if checkpoint not in (None, "none"):
            from refimpl.checkpointing import apply_to_gpt, parse_plan, selective_recomputation  # noqa: PLC0415

            if S == 1:  # the whole model, as one process
                apply_to_gpt(model, checkpoint, store)
            else:  # the stages run the chain plan; a selective plan also recomputes every attention core
                if isinstance(model, GPT):
                    selective_recomputation(model.blocks, str(parse_plan(checkpoint)).startswith("selective"))
                for stage in self.all_stages.values():
                    stage.checkpoint_store = store
        self.stages = {s: self.all_stages[s] for s in placement.stages_of(p)}
        self.executor = PipelineExecutor(self.schedule, p, self.mesh.pp_comm, self.stages, self.costs,
                                         overlap=overlap and zero != 3)  # ZeRO-3's gather-ahead: one order
        # all-to-alls per forward of every stage: the simulator's chunk model of exposed communication
        self.exchanges = {s: stage_exchanges(stage) for s, stage in self.all_stages.items()}
        # The lowest pipeline rank holding a stage counts it (global norm) and writes it (records, checkpoints).
        self.primary = {s: min(placement.ranks_of(s)) for s in range(S)}
        self.counts_its_stages = all(self.primary[s] == p for s in self.stages)
        # 4. DualPipe: the ranks that hold a second copy of this rank's stages (the mirror in each pipeline)
        holders = sorted({r for s in self.stages for r in placement.ranks_of(s)})
        d, t = self.mesh.dp_index, self.mesh.tp_index
        self.copies = world.split(color=(d * tp + t) * pp + holders[0], key=p) if len(holders) > 1 else None
        # 3 and 5: the gradient strategy over the data-parallel group, with precision and the optimizer
        norm_total, any_rank = (self._model_parallel_norm, self._model_parallel_any) if pp * tp > 1 else (None, None)
        uncounted = set()  # held whole by every tp rank: tp rank 0 counts them in the norm
        if self.tensor_parallel is not None and t > 0:
            uncounted = set(self.tensor_parallel.whole_names(name for name, _ in model.named_parameters()))

        def strategy(parts: dict, comm, ledger=None):
            if zero == 0 and precision != "mixed":
                from .data_parallel import DataParallel  # noqa: PLC0415

                return DataParallel(parts, make_optimizer, comm, dp_mode, bucket_bytes, clip, budget, rank=world.rank,
                                    norm_total=norm_total, uncounted=uncounted, ledger=ledger)
            from .zero import STAGES  # noqa: PLC0415 - mixed precision needs ZeRO's master weights (ZeRO-0: DP)

            options = dict(precision=precision, clip=clip, bucket_bytes=bucket_bytes, budget=budget, rank=world.rank,
                           norm_total=norm_total, any_rank=any_rank, uncounted=uncounted, ledger=ledger)
            if zero == 3:
                options.update(prefetch_bytes=prefetch, param_threshold=param_threshold)
            return STAGES[zero](model, parts, make_optimizer([]), comm, **options)

        if ep == 1:
            self.sharding, self.expert_sharding = strategy(self.stages, self.mesh.dp_comm), None
        else:  # the experts' gradients sum over their replicas (edp_comm), the rest over the whole dp group
            experts = {s: ParameterSubset(stage, is_expert_parameter) for s, stage in self.stages.items()}
            others = {s: ParameterSubset(stage, lambda name: not is_expert_parameter(name))
                      for s, stage in self.stages.items()}
            self.sharding = strategy(others, self.mesh.dp_comm)
            self.expert_sharding = strategy(experts, self.mesh.edp_comm, ledger=self.sharding.ledger)
        self.strategies = [s for s in (self.sharding, self.expert_sharding) if s is not None]
        self.zero, self.precision = zero, precision
        self.layers = list(layers)
        for layer in self.layers:
            layer.join(self.mesh)
        self.ledger = self.sharding.ledger
        self.scaler = getattr(self.sharding, "scaler", None)
        self.record_grads = False
        self.last_grads: dict = {}
        self.steps_done = 0  # the global batch's number (dropout masks are keyed by it)
        self.last_stats = None  # (pp, len(STAT_FIELDS)) figures of the last step, this pipeline's ranks
        self.last_steps = None  # every rank's StepTime list of the last step (only with a trace)
        self.last_comm = None  # every rank's communication events of the last step (overlap.Link; with a trace)

    # ------------------------------------------------------------------------------------------
    def step(self, x, y) -> float:
        """One optimizer step on the global batch (x, y); returns the global batch's loss."""
        total = count_targets(y)  # of the whole global batch
        M = self.schedule.micro_batches
        if self.pipelined:
            if len(x) % (self.dp * M):
                raise ValueError(f"a batch of {len(x)} cannot be split into {self.dp} data-parallel replicas x "
                                 f"{M} micro-batches; choose a --batch-size divisible by {self.dp * M}")
            replicas, micro_batches = "data-parallel replicas (world size / --pp)", "pipeline micro-batches (--micro-batches)"
        else:
            replicas, micro_batches = "data-parallel ranks", "micro-batches per rank (--grad-accum)"
        x_local, y_local = split_batch(x, y, self.dp, replicas)[self.mesh.dp_index]
        micro = split_batch(x_local, y_local, M, micro_batches)
        scale = 1.0 / max(1, total)
        b, first_row = len(micro[0][0]), self.mesh.dp_index * len(x_local)

        def rows(mb):  # rows of the global batch in micro-batch mb: dropout masks independent of the split
            start = first_row + mb * b
            return batch_rows(start, start + b, len(x), self.steps_done, 1.0 if self.scaler is None else self.scaler.scale)

        cross_entropy = F.cross_entropy if self.tensor_parallel is None else self.tensor_parallel.cross_entropy

        def loss_fn(logits, mb):  # objective.micro_batch_loss, from the last stage's logits
            return cross_entropy(logits, backend.asarray(micro[mb][1]), reduction="sum") * scale

        if self.pipelined:
            saved_tensors.reset_peak()
            self.mesh.pp_comm.barrier("the pipeline's start")
        for runner in self.expert_runners:
            runner.traffic.clear()  # the runners record this step's all-to-alls
        record = self.executor.run(lambda mb: micro[mb][0], loss_fn, micro[0][0].shape, t0=time.perf_counter(),
                                   forward_context=rows, around=self._around,
                                   loss_scale=None if self.scaler is None else self.scaler.scale)
        if self.pipelined:
            self._collect_timing(record)
        grads = [strategy.finish() for strategy in self.strategies]  # 3. reduced over the data-parallel group
        if self.copies is not None:  # 4. DualPipe: + the other copy of each stage
            for g in (g for group in grads for g in group):
                self.copies.allreduce(g)
        norm2 = self._squared_norm_with_experts(grads) if self.expert_sharding is not None and self.clip > 0 else None
        results = [strategy.optimizer_step(g, norm2) for strategy, g in zip(self.strategies, grads)]  # 5. the update
        if self.record_grads:
            self.last_grads = self._on_rank0(self._whole([strategy.whole(result.grads)
                                                          for strategy, result in zip(self.strategies, results)]))
        for strategy, result in zip(self.strategies, results):
            strategy.end_step(result)
        self.steps_done += 1
        return self.world.allreduce_value(record.loss if self.mesh.tp_index == 0 else 0.0)  # tp ranks: one loss

    def _squared_norm_with_experts(self, grads: list) -> float:
        """‖g‖² of the whole model with expert parallelism: the experts' part summed over the
        expert-parallel group (each rank holds other experts), then everything over the model-parallel
        ranks (each stage once, replicated tp parameters once)."""
        dense = self.sharding.squared_norm(grads[0])
        experts = self.mesh.ep_comm.allreduce_value(self.expert_sharding.squared_norm(grads[1]))
        total = dense + experts
        return self._model_parallel_norm(total) if self.pp * self.tp > 1 else total

    def _whole(self, pieces: list) -> dict:
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
        return self._on_rank0(self._whole([strategy.whole_parameters() for strategy in self.strategies]))

    def full_optimizer_state(self) -> dict:
        """{"step", "arrays": {key: {name: array}}, "loss_scaler"} on rank 0 (collective; ZeRO strategies).

        verify --dtype mixed hands it to the single-process reference before each step, so that
        each step is compared from the same state (compare_mixed.py, "lockstep")."""
        state = self.sharding.whole_optimizer_state()
        state["arrays"] = {key: self._on_rank0(arrays) for key, arrays in state["arrays"].items()}
        return state

    def model_for_evaluation(self, model, build):
        """The model to evaluate on this rank, or None (collective).

        Without a pipeline every rank holds the whole `model` (ZeRO-3 gathers its parameters
        during the forward, on every rank together). With a pipeline or tensor parallelism, rank 0
        loads the whole trained parameters into a fresh model from build() (its own `model` holds
        only its stages or slices, and under ZeRO-3 only shards); the other ranks evaluate nothing."""
        if not self.pipelined and self.tensor_parallel is None and self.expert_sharding is None:
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
        return self.sharding.checkpoint_pieces(mine, writes_whole=self.mesh.dp_index == 0)

    def load_full_state(self, masters: dict, states: dict, step: int) -> None:
        if self.tensor_parallel is not None or self.expert_sharding is not None:
            raise ValueError("resuming a tensor- or expert-parallel run from a checkpoint is not supported yet; use "
                             "--tp 1 --ep 1")
        self.sharding.load_full_state(masters, states, step)

    def _on_rank0(self, mine: dict) -> dict:
        """{name: array} of the whole model from each rank's {name: array} of its stages (collective
        over the pipeline and the tp group; with expert parallelism `mine` already holds every
        expert, _whole). The tp group first puts its slices together (TensorParallelGPT.whole).
        Without a pipeline that is whole. Stage s comes from pipeline rank primary[s] of replica 0,
        tp rank 0: one message of its arrays flattened in model order (stage_names, whole_shapes)."""
        if self.tensor_parallel is not None:
            mine = self.tensor_parallel.whole(mine)
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
        elif self.mesh.dp_index == 0 and self.mesh.tp_index == 0:
            for s in self.stages:
                if self.primary[s] == self.mesh.pp_index:
                    flat = backend.xp().concatenate([backend.asarray(mine[name]).reshape(-1)
                                                     for name in self.stage_names[s]])
                    self.world.send(flat, 0, tag=s)
        order = [name for s in sorted(self.stage_names) for name in self.stage_names[s]]
        return {name: out[name] for name in order} if self.rank == 0 else {}

    # -- reports ---------------------------------------------------------------------------------
    def _collect_timing(self, record) -> None:
        """Every pipeline rank's figures of this step (one float64 all-gather); steps if tracing."""
        p = self.mesh.pp_index
        stats = tl.rank_stats(record, saved_tensors.peak_bytes,
                              replay_peak(self.schedule, p, record.activation_bytes, "W"),
                              replay_peak(self.schedule, p, record.activation_bytes, "I"),
                              self.model_state_bytes())
        gathered = self.mesh.pp_comm.allgather(stats)  # (pp · fields,)
        self.last_stats = gathered.reshape(self.pp, len(tl.STAT_FIELDS))
        if self.trace:  # a diagnostic, not the hot path
            gathered = self.mesh.pp_comm.allgather_object((record.steps, record.comm))
            self.last_steps = [steps for steps, _ in gathered]
            self.last_comm = [comm for _, comm in gathered]
            if self.rank == 0:
                tl.write_trace(self.trace, tl.chrome_trace(self.schedule, self.last_steps, self.timing_mode,
                                                           self.last_comm, self.costs, self.exchanges,
                                                           self.executor.overlap))

    def model_state_bytes(self) -> dict:
        """{"parameters", "gradients", "optimizer_states"}: bytes of model state this rank holds."""
        current = self.ledger.current()
        return {k: int(current.get(k, 0)) for k in ("parameters", "gradients", "optimizer_states")}

    def timing(self) -> dict | None:
        """Measured vs simulated idle and exposed communication of the last step (timeline.summarize),
        or None before any step."""
        if self.last_stats is None:
            return None
        return tl.summarize(self.schedule, self.last_stats, self.timing_mode, self.costs, self.exchanges,
                            self.executor.overlap)

    def report(self) -> dict:
        """What train --json and verify --json print about the trainer (local: no communication)."""
        info = {"strategy": type(self.sharding).__name__, **self.sharding.report()}
        if self.expert_sharding is not None:
            info["expert_parallel"] = {"ep": self.ep, "expert_data_parallel": self.mesh.edp_comm.size,
                                       "experts_per_rank": self.expert_runners[0].per_rank}
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
            "sharding_group": self.dp,  # the data-parallel ranks over which gradients are reduced and state sharded
            "stage_copies": 2 if self.copies is not None else 1,  # DualPipe: each stage twice per pipeline
        }
        timing = self.timing()
        if timing is not None:
            pipeline.update(timing)
        info["pipeline"] = pipeline
        return info


__all__ = ["Trainer"]
