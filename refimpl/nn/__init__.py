"""Neural-network building blocks on the autograd engine."""

from refimpl.autograd.tensor import Parameter

from . import functional
from .layers import (
    MLP,
    Block,
    CausalSelfAttention,
    Dropout,
    Embedding,
    GroupedQueryAttention,
    LayerNorm,
    Linear,
    LlamaBlock,
    RMSNorm,
    SwiGLU,
)
from .models import GPT, GPTConfig, MLPClassifier
from .module import Module, ModuleList

__all__ = ["Parameter", "functional", "Module", "ModuleList", "Linear", "LayerNorm", "Embedding", "Dropout",
           "MLP", "CausalSelfAttention", "Block", "RMSNorm", "SwiGLU", "GroupedQueryAttention", "LlamaBlock", "GPT",
           "GPTConfig", "MLPClassifier"]
