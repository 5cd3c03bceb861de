"""Optimizers written on plain arrays, so that ZeRO can step a shard with the same code."""

from .adamw import AdamW
from .base import ArrayOptimizer, StepResult
from .clip import clip_coefficient, clip_grad_norm_, scale_to_max_norm_, squared_norm
from .sgd import SGD

OPTIMIZERS = {"adamw": AdamW, "sgd": SGD}

__all__ = ["ArrayOptimizer", "StepResult", "AdamW", "SGD", "OPTIMIZERS", "clip_grad_norm_", "clip_coefficient",
           "scale_to_max_norm_", "squared_norm"]
