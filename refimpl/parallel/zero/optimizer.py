"""The sharded optimizer step: each rank updates only its shard (ZeRO's P_os, arXiv 1910.02054 §5.1).

For every flat group (flat.py) a rank holds, for its block of L/N elements:

    param block   the parameters it updates: a view into the whole flat buffer (DP, ZeRO-1, ZeRO-2)
                  or its own shard array (ZeRO-3)
    master        float32 copy of the block under mixed precision and bfloat16; the param block itself
                  otherwise
    state         the optimizer's state for the block (AdamW: m and v; SGD: momentum)

and, at step time, the block of the summed gradient (reduce-scatter output, or the persistent
gradient shard). The step, identical on every rank except for which block it touches:

    1. mixed precision: g32 = float32(g16) / S; overflow = any non-finite element on any rank
       (a max all-reduce of one flag); on overflow every rank skips the step (optim/precision.py)
    2. clipping: ‖g‖² = Σ over ranks of the shard's ‖g_r‖² (a sum all-reduce of one number; in a
       pipeline or with tensor parallelism, then summed over the model-parallel ranks, each stage
       counted once, and each parameter held whole by every tensor-parallel rank counted by one:
       the names in `uncounted` are left out here);
       g ← g · min(1, max_norm / (‖g‖ + 1e-6)), as optim.clip_grad_norm_ on whole gradients
    3. optimizer.update(master, g, state) -- the same AdamW/SGD code as single-process training,
       on a flat block instead of a tensor (optim/adamw.py works on any arrays of equal shape)
    4. mixed precision: param block ← float16(master); bfloat16: ← bfloat16(master), rounded to nearest
       even (bfloat16 has no loss scale: step 1 is skipped, its gradients arrive in float32)

Afterwards the trainer all-gathers the parameter blocks (ZeRO-1/2) or leaves them sharded
(ZeRO-3). With one shard (DP) the gradients are whole and identical on every rank, so steps 1 and
2 need no communication.

Each group has its own state dict (its own step counter, all equal); the float32 unscaled
gradients of step 1 are registered as transient "gradient_buckets" while the step runs.
"""

from __future__ import annotations

from refimpl import backend
from refimpl.optim import StepResult, scale_to_max_norm_, squared_norm


class ShardedOptimizer:
    """Master weights and optimizer state of this rank's block of every group, and the step."""

    def __init__(self, optimizer, groups: list, param_blocks: list, ledger, comm, clip: float = 0.0,
                 scaler=None, sharded: bool = True, norm_total=None, any_rank=None, uncounted=(),
                 masters: bool = False) -> None:
        self.optimizer, self.groups, self.param_blocks = optimizer, groups, param_blocks
        self.ledger, self.clip, self.scaler = ledger, clip, scaler
        self.keeps_masters = masters or scaler is not None  # float32 master weights (mixed precision, bfloat16)
        self.comm = comm if sharded else None  # one shard: gradients are whole, nothing to combine
        # Beyond the group: the squared norm of the other pipeline stages (added), the overflow flags
        # of their ranks (max). None: this rank's group holds the whole model.
        self.norm_total, self.any_rank = norm_total, any_rank
        self.uncounted = set(uncounted)  # parameters whose norm another rank counts
        self.masters, self.states = [], []
        for group, block in zip(groups, param_blocks):
            if self.keeps_masters:  # mixed precision, bfloat16: float32 master weights of the shard
                master = ledger.register("master_weights", block.astype("float32"), "float32 master shard")
            else:
                master = block  # the parameters themselves are the master weights
            state = optimizer.init_state(master)
            for value in state.values():
                if hasattr(value, "nbytes"):
                    ledger.register("optimizer_states", value, "optimizer state shard")
            self.masters.append(master)
            self.states.append(state)

    @property
    def steps_taken(self) -> int:
        return int(self.states[0]["step"]) if self.states else 0

    def squared_norm(self, grads: list) -> float:
        """‖g‖² of the groups' gradients over the sharding group (one all-reduce when sharded), the
        parameters another rank counts left out."""
        total = squared_norm(grads if not self.uncounted else counted_pieces(self.groups, grads, self.uncounted))
        return total if self.comm is None else self.comm.allreduce_value(total)

    def step(self, grads: list, total: float | None = None) -> StepResult:
        """One optimizer step given each group's gradient block; collective when sharded. total: the
        global squared norm for clipping, if the caller computed it (float32/float64 only)."""
        temporaries = []
        if self.scaler is not None:  # 1. unscale in float32, vote on overflow
            inverse = 1.0 / self.scaler.scale
            unscaled = []
            for g in grads:
                g32 = self.ledger.register("gradient_buckets", g.astype("float32"), "unscaled float32 gradient")
                g32 *= inverse
                temporaries.append(g32)
                unscaled.append(g32)
            grads = unscaled
            local = 0.0 if all(bool(backend.xp().isfinite(g).all()) for g in grads) else 1.0
            if self.comm is not None:
                local = self.comm.allreduce_value(local, "max")
            overflow = (local if self.any_rank is None else self.any_rank(local)) > 0
            if overflow:
                self.scaler.update(True)
                self._release(temporaries)
                return StepResult(False, grads)
        norm = None
        if self.clip > 0:  # 2. clip by the global norm
            if total is None:
                total = self.squared_norm(grads)
                if self.norm_total is not None:
                    total = self.norm_total(total)
            norm = total ** 0.5
            scale_to_max_norm_(grads, total, self.clip)
        for master, g, state, block in zip(self.masters, grads, self.states, self.param_blocks):
            self.optimizer.update(master, g, state)  # 3. the same update as single-process training
            if master is not block:
                block[...] = master  # 4. float16 parameters from the float32 master weights
        if self.scaler is not None:
            self.scaler.update(False)
        result = StepResult(True, grads, norm)
        self._release(temporaries)
        return result

    def _release(self, arrays) -> None:
        for a in arrays:
            self.ledger.release(a)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_arrays(self, g: int) -> dict:
        """{key: array} of group g's optimizer state (arrays only; the step counter is separate)."""
        return {k: v for k, v in self.states[g].items() if hasattr(v, "nbytes")}

    def load_group(self, g: int, master, state: dict, step: int) -> None:
        """Overwrite group g's master block, state arrays and step counter (values already checked)."""
        self.masters[g][...] = master
        if self.masters[g] is not self.param_blocks[g]:
            self.param_blocks[g][...] = self.masters[g]
        for key, value in self.state_arrays(g).items():
            value[...] = state[key]
        self.states[g]["step"] = step


def counted_pieces(groups, blocks, uncounted: set) -> list:
    """The pieces of each group's block (this rank's shard) that belong to parameters not in `uncounted`."""
    return [block[position:position + stop - start] for group, block in zip(groups, blocks)
            for name, start, stop, position in group.pieces() if name not in uncounted]
