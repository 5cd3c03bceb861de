"""PipelineTrainer: pipeline parallelism (any schedule) composed with data parallelism on a dp x pp mesh.

The world's N ranks form a dp x pp grid (mesh.py: rank = d·pp + p). Each row d is one pipeline:
its pp ranks hold the stages that the schedule places on them (stage.py), and run the schedule's
lists with the executor (executor.py) on the row's communicator. One optimizer step on a global
batch of B examples:

    1. row d takes its slice of B/dp examples and cuts it into M micro-batches of B/(dp·M);
    2. the executor runs the schedule: micro-batch mb enters stage 0, its loss
           loss_mb = Σ_(counted targets of mb) CE / N_batch     (objective.py: N_batch counts the
                                                                 whole global batch)
       is computed on the last stage, and the backward accumulates every stage's parameter
       gradients over the M micro-batches (B, or I then W);
    3. every copy of a stage sums its gradient with the other copies: the dp replicas of the
       stage, and, in DualPipe, also the second copy of the stage in the same pipeline (stage s
       lives on ranks s and pp−1−s). Those 2·dp (DualPipe) or dp (others) ranks hold exactly the
       same stages, so one all-reduce of one flat gradient buffer per rank does it:
           g_s = Σ_(copies c of s) Σ_(micro-batches mb that c ran) ∂loss_mb/∂θ_s = ∂L/∂θ_s;
    4. gradient clipping by the global norm ‖g‖² = Σ_s ‖g_s‖², each stage counted once (on the
       lowest rank that holds it), summed over the pipeline;
    5. every rank steps the optimizer on its own stages' parameters (AdamW and SGD are elementwise,
       so this is the single-process update, stage by stage).

So the step equals single-process training on the whole batch up to the order of floating-point
sums; `verify` checks that to rtol 1e-10 in float64.

With --zero 1 (ZeRO stage 1, Rajbhandari et al., arXiv 1910.02054, section 5.1; zero1.py) step 3
shards the optimizer state over the gradient group's G ranks instead: a reduce-scatter gives each
rank the summed gradient of 1/G of the flat (padded) buffers, the rank updates that block with
optimizer state for it alone, and an all-gather returns the updated parameters —
(P+G)Ψ_rank + KΨ_rank/G bytes of model state per rank for the same 2Ψ_rank(G−1)/G elements of
communication as the all-reduce.

Parameter memory per rank: Ψ·(stages held)/S, i.e. Ψ/pp (1F1B, ZB, interleaved, ZB-V, DualPipeV)
or 2Ψ/pp (DualPipe's two copies). Activation memory per rank: the schedule's in-flight
micro-batches, measured with the engine's saved-tensor ledger (report()["pipeline"]).

The trainer interface is DataParallelTrainer's: step(x, y) -> global loss; record_grads and
last_grads ({name: full gradient} on rank 0); full_parameters() (collective; rank 0 gets every
parameter under its single-process name); report().
"""

from __future__ import annotations

import time

from refimpl import backend
from refimpl.autograd.saved import saved_tensors
from refimpl.nn import functional as F
from refimpl.nn.batch_rows import batch_rows
from refimpl.objective import count_targets, split_batch
from refimpl.optim.clip import clip_coefficient, squared_norm

from ..mesh import Mesh
from . import timeline as tl
from .executor import PipelineExecutor, replay_peak
from .schedules import build
from .simulate import Costs
from .stage import split_model
from .zero1 import StageZero1
from .validate import validate


class PipelineTrainer:
    """Pipeline (and data) parallel training of `model` (a GPT or MLPClassifier built on every rank).

    make_optimizer(params) builds the optimizer for this rank's parameters. schedule is a name
    from schedules.SCHEDULES; pp the pipeline ranks; the data-parallel degree is world.size // pp.
    """

    def __init__(self, model, make_optimizer, world, pp: int, schedule: str = "1f1b", micro_batches: int | None = None,
                 chunks: int | None = None, clip: float = 0.0, checkpoint=None, action_costs: str | None = None,
                 trace: str | None = None, grad_accum: int = 1, zero: int = 0, bucket_bytes: int = 1 << 20) -> None:
        if grad_accum != 1:
            raise ValueError(f"--grad-accum {grad_accum} does not apply to a pipeline: its --micro-batches are the "
                             "accumulation; use --grad-accum 1")
        if zero not in (0, 1):
            raise ValueError(f"--zero {zero} does not compose with pipeline parallelism here; use --zero 1 (optimizer "
                             "states sharded over each stage's data-parallel group) or --zero 0")
        if not isinstance(pp, int) or pp < 1:
            raise ValueError(f"--pp must be a positive integer (pipeline ranks), got {pp!r}")
        self.mesh = Mesh(world, pp=pp)  # raises the same clear error on every rank if pp does not divide N
        micro_batches = 2 * pp if micro_batches is None else micro_batches
        self.schedule = build(schedule, pp, micro_batches, chunks)  # the generator's constraint errors
        if not validate(self.schedule).per_channel_ok:  # the executor's receive policy (executor.py) must complete
            raise ValueError(f"{schedule}: its lists deadlock with one posted receive per channel; see validate.py")
        self.world, self.rank, self.world_size = world, world.rank, world.size
        self.pp, self.dp, self.clip, self.trace = pp, self.mesh.dp, clip, trace
        self.costs = action_costs if isinstance(action_costs, Costs) else tl.parse_costs(action_costs)
        self.timing_mode = tl.describe_costs(self.costs)
        p = self.mesh.pp_index
        placement = self.schedule.placement
        S = self.schedule.num_stages
        why = "" if S == pp else f" ({schedule} with --pp {pp} cuts the model into {S} stages)"
        self.all_stages = split_model(model, S, checkpoint_plan=checkpoint, why=why)  # names and shapes of all
        self.stages = {s: self.all_stages[s] for s in placement.stages_of(p)}
        self.params = [param for s in sorted(self.stages) for param in self.stages[s].parameters()]
        self.executor = PipelineExecutor(self.schedule, p, self.mesh.pp_comm, self.stages, self.costs)
        # The lowest pipeline rank holding a stage counts it (global norm) and reports it (rank 0).
        self.primary = {s: min(placement.ranks_of(s)) for s in range(S)}
        # Gradient group: every rank, in every replica, that holds the same stages as this one.
        color = min(self.primary[s] for s in self.stages)
        self.grad_comm = world.split(color=color, key=world.rank)
        mates = self.grad_comm.allgather_object(sorted(self.stages))
        if any(m != mates[0] for m in mates):
            raise ValueError(f"{schedule}: ranks that share a stage hold different stage sets {mates}")
        self.color, self.zero = color, zero
        named = [(name, param) for s in sorted(self.stages) for name, param in self.stages[s].named_parameters()]
        if zero == 1:  # flat padded buffers, optimizer state for 1/G of them (zero1.py)
            self.zero1 = StageZero1(named, self.grad_comm, make_optimizer([]), bucket_bytes, world.rank)
            self.optimizer = self.zero1.optimizer
        else:
            # One flat gradient buffer; every parameter's .grad is a view into it (backward does +=).
            self.zero1 = None
            xp = backend.xp()
            size = sum(param.size for param in self.params)
            self.flat_grad = xp.zeros(size, dtype=self.params[0].dtype)  # (Ψ_rank,)
            offset = 0
            for param in self.params:
                param.grad = self.flat_grad[offset:offset + param.size].reshape(param.shape)
                offset += param.size
            self.optimizer = make_optimizer(self.params)
        self.record_grads = False
        self.last_grads: dict = {}
        self.steps_done = 0  # the global batch's number (dropout masks are keyed by it)
        self.last_stats = None  # (pp, len(STAT_FIELDS)) figures of the last step, this pipeline's ranks
        self.last_steps = None  # every rank's StepTime list of the last step (only with a trace)

    # ------------------------------------------------------------------------------------------
    def step(self, x, y) -> float:
        """One optimizer step on the global batch (x, y); returns the global batch's loss."""
        total = count_targets(y)  # of the whole global batch
        parts = self.dp * self.schedule.micro_batches
        if len(x) % parts:
            raise ValueError(f"a batch of {len(x)} cannot be split into {self.dp} data-parallel replicas x "
                             f"{self.schedule.micro_batches} micro-batches; choose a --batch-size divisible by {parts}")
        x_local, y_local = split_batch(x, y, self.dp, "data-parallel replicas (world size / --pp)")[self.mesh.dp_index]
        micro = split_batch(x_local, y_local, self.schedule.micro_batches, "pipeline micro-batches (--micro-batches)")
        scale = 1.0 / max(1, total)
        b, first_row = len(micro[0][0]), self.mesh.dp_index * len(x_local)

        def rows(mb):  # rows of the global batch in micro-batch mb: dropout masks independent of the split
            start = first_row + mb * b
            return batch_rows(start, start + b, len(x), self.steps_done)

        def loss_fn(logits, mb):  # objective.micro_batch_loss, from the last stage's logits
            return F.cross_entropy(logits, backend.asarray(micro[mb][1]), reduction="sum") * scale

        saved_tensors.reset_peak()
        pp_comm = self.mesh.pp_comm
        pp_comm.barrier()
        record = self.executor.run(lambda mb: micro[mb][0], loss_fn, micro[0][0].shape, t0=time.perf_counter(),
                                   forward_context=rows)
        self._collect_timing(record)
        self._reduce_and_step()
        self.steps_done += 1
        return self.world.allreduce_value(record.loss)

    def _reduce_and_step(self) -> None:
        """Steps 3-5 of the module docstring: sum the copies' gradients, clip, step, zero."""
        if self.zero1 is not None:
            return self._reduce_and_step_zero1()
        if self.grad_comm.size > 1:  # dp replicas (and DualPipe's second copy) of our stages
            self.grad_comm.allreduce(self.flat_grad)
        if self.clip > 0:
            mine = [param.grad for s, stage in self.stages.items() if self.primary[s] == self.mesh.pp_index
                    for param in stage.parameters()]
            coefficient = clip_coefficient(self.mesh.pp_comm.allreduce_value(squared_norm(mine)), self.clip)
            if coefficient < 1.0:
                self.flat_grad *= coefficient
        if self.record_grads:
            self.last_grads = self._gather_to_rank0("grad")
        self.optimizer.step()
        self.optimizer.zero_grad()

    def _reduce_and_step_zero1(self) -> None:
        """ZeRO-1: reduce-scatter, clip the blocks by the global norm, step the blocks, all-gather."""
        blocks = self.zero1.reduce_scatter()
        if self.clip > 0:
            group = self.zero1.group_squared_norm(blocks)  # the group's stages, each once
            counted = group if self.mesh.pp_index == self.color else 0.0  # DualPipe's mirrored rank: not twice
            coefficient = clip_coefficient(self.mesh.pp_comm.allreduce_value(counted), self.clip)
            if coefficient < 1.0:
                for block in blocks:
                    block *= coefficient
        if self.record_grads:
            self.zero1.write_whole_gradients(blocks)
            self.last_grads = self._gather_to_rank0("grad")
        self.zero1.step(blocks)

    def model_state_bytes(self) -> dict:
        """{"parameters", "gradients", "optimizer_states"}: bytes of model state this rank holds."""
        if self.zero1 is not None:
            return self.zero1.model_state_bytes()
        states = [v for state in self.optimizer.state for v in state.values() if hasattr(v, "nbytes")]
        return {"parameters": sum(p.data.nbytes for p in self.params), "gradients": int(self.flat_grad.nbytes),
                "optimizer_states": sum(int(v.nbytes) for v in states)}

    def _collect_timing(self, record) -> None:
        """Every pipeline rank's figures of this step (one float64 all-gather); steps if tracing."""
        p = self.mesh.pp_index
        stats = tl.rank_stats(record, saved_tensors.peak_bytes,
                              replay_peak(self.schedule, p, record.activation_bytes, "W"),
                              replay_peak(self.schedule, p, record.activation_bytes, "I"),
                              self.model_state_bytes())
        gathered = self.mesh.pp_comm.allgather(stats)  # (pp · fields,)
        self.last_stats = gathered.reshape(self.pp, len(tl.STAT_FIELDS))
        if self.trace:
            self.last_steps = self.mesh.pp_comm.allgather_object(record.steps)  # a diagnostic, not the hot path
            if self.rank == 0:
                tl.write_trace(self.trace, tl.chrome_trace(self.schedule, self.last_steps, self.timing_mode))

    # ------------------------------------------------------------------------------------------
    def _gather_to_rank0(self, what: str) -> dict:
        """{name: array} of every parameter's .data or .grad on world rank 0 (collective).

        Stage s comes from pipeline rank primary[s] of replica 0 (world rank = primary[s]): one
        message of the stage's parameters flattened in model order, into a buffer rank 0 sizes
        from its own copy of the model's shapes.
        """
        xp = backend.xp()
        out: dict = {}
        if self.rank == 0:
            pending = []
            for s, stage in self.all_stages.items():
                named = stage.named_parameters()
                if self.primary[s] == 0:
                    out.update({name: backend.to_host(getattr(param, what)).copy() for name, param in named})
                    continue
                buf = xp.empty(sum(param.size for _, param in named), dtype=named[0][1].dtype)  # (Ψ_s,)
                pending.append((named, buf, self.world.irecv(buf, self.primary[s], tag=s)))
            for named, buf, request in pending:
                request.wait()
                host, offset = backend.to_host(buf), 0
                for name, param in named:
                    out[name] = host[offset:offset + param.size].reshape(param.shape).copy()
                    offset += param.size
        elif self.mesh.dp_index == 0:
            for s, stage in self.stages.items():
                if self.primary[s] == self.mesh.pp_index:
                    flat = xp.concatenate([getattr(param, what).reshape(-1) for param in stage.parameters()])
                    self.world.send(flat, 0, tag=s)
        return {name: out[name] for name, _ in self._all_named()} if self.rank == 0 else {}

    def _all_named(self):
        return [(name, param) for s in sorted(self.all_stages) for name, param in self.all_stages[s].named_parameters()]

    def full_parameters(self) -> dict:
        """{name: array} of the whole model on rank 0 (collective: every rank calls it)."""
        return self._gather_to_rank0("data")

    def gather_model(self, model) -> None:
        """Load the whole trained model into rank 0's `model` (collective), e.g. for evaluation."""
        params = self.full_parameters()
        if self.rank == 0:
            model.load_state_dict(params)

    # ------------------------------------------------------------------------------------------
    def timing(self) -> dict | None:
        """Measured vs simulated idle of the last step (timeline.summarize), or None before any step."""
        if self.last_stats is None:
            return None
        return tl.summarize(self.schedule, self.last_stats, self.timing_mode)

    def report(self) -> dict:
        """What train --json and verify --json print about the pipeline (local: no communication)."""
        S = self.schedule.num_stages
        placement = self.schedule.placement
        sizes = {s: sum(param.size for param in stage.parameters()) for s, stage in self.all_stages.items()}
        info = {
            "schedule": self.schedule.name,
            "pp": self.pp,
            "dp": self.dp,
            "micro_batches": self.schedule.micro_batches,
            "chunks": self.schedule.chunks,
            "stages": S,
            "layers_per_stage": [stage.stop - stage.start for _, stage in sorted(self.all_stages.items())],
            "stages_of_rank": [list(placement.stages_of(r)) for r in range(self.pp)],
            "parameters_of_rank": [sum(sizes[s] for s in placement.stages_of(r)) for r in range(self.pp)],
            "zero": self.zero,
            "gradient_group": self.grad_comm.size,
        }
        timing = self.timing()
        if timing is not None:
            info.update(timing)
        return {"pipeline": info}


__all__ = ["PipelineTrainer"]
