"""Activation checkpointing: keep fewer activations, recompute them during backward.

Chen, Xu, Zhang and Guestrin, "Training Deep Nets with Sublinear Memory Cost" (arXiv 1604.06174);
Griewank and Walther, "Algorithm 799: revolve" (ACM TOMS 26(1), 2000). See docs/checkpointing.md.

For a chain of n equal layers, each recorded layer saving R bytes and each layer input A bytes:

    plan          extra layer forwards            peak saved bytes
    none          0                               n·R
    every:K       n − K                           (⌈n/K⌉ − 1)·A + K·R
    sqrt          n − ⌈√n⌉  (every:⌈√n⌉)          ≈ 2√n·A when R = A
    revolve:C     t(n, C) = r·n − β(C+1, r−1)     at most C·A + R
    budget:B      fewest extra forwards with peak <= B

    checkpoint(fn, *args)                     one function, recomputed in backward (checkpoint.py)
    checkpoint_sequential(layers, x, plan)    a chain under a plan (sequential.py)
    parse_plan, actions_for, resolve_budget   plans (plans.py); revolve's formulas (revolve.py)
    simulate_chain                            a schedule's cost from its actions (actions.py)
    apply_to_gpt, gpt_forward, current_plan   the GPT's blocks under a plan (gpt_blocks.py)
    selective_recomputation                   attention cores recomputed (gpt_blocks.py; plan "selective")
    count_forward_calls, measure_chain        exact measurements (measure.py)
    AutoCheckpoint, record, articulation_points   automatic selection on any graph (auto.py, graph.py;
                                              plans auto:memory, auto:speed)
"""

from . import actions, revolve
from .actions import simulate_chain
from .auto import AutoCheckpoint, auto_checkpoint
from .checkpoint import checkpoint
from .gpt_blocks import AutoBlocks, apply_to_gpt, current_plan, gpt_forward, selective_recomputation
from .graph import articulation_points, record
from .measure import count_forward_calls, measure_chain
from .plans import PLAN_FORMS, LayerCost, actions_for, chain_plan, parse_plan, predicted_cost, resolve_budget
from .sequential import checkpoint_sequential, measure_layer_cost, resolve_plan

__all__ = ["checkpoint", "checkpoint_sequential", "parse_plan", "PLAN_FORMS", "actions_for", "resolve_budget",
           "resolve_plan", "predicted_cost", "LayerCost", "measure_layer_cost", "simulate_chain", "actions", "revolve",
           "apply_to_gpt", "current_plan", "gpt_forward", "count_forward_calls", "measure_chain",
           "selective_recomputation", "chain_plan", "AutoCheckpoint", "auto_checkpoint", "AutoBlocks", "record",
           "articulation_points"]
