"""A minimal reverse-mode autograd engine (see docs/autograd.md).

    Tensor, Parameter     arrays that remember how they were computed
    Function              one differentiable operation (forward + backward + saved tensors)
    backward, grad        the engine: full backward B, or the split I + W (defer_weight_grads)
    no_grad, enable_grad  turn recording off and on
    saved_tensors         live and peak bytes of tensors saved for backward
    gradcheck             compare backward against central finite differences
"""

from . import ops
from .engine import WeightGradWork, backward, grad
from .function import Function
from .grad_mode import enable_grad, no_grad
from .grad_mode import is_enabled as is_grad_enabled
from .gradcheck import GradcheckError, gradcheck
from .saved import saved_tensors
from .tensor import Parameter, Tensor

__all__ = ["Tensor", "Parameter", "Function", "backward", "grad", "WeightGradWork", "no_grad", "enable_grad",
           "is_grad_enabled", "saved_tensors", "ops", "gradcheck", "GradcheckError"]
