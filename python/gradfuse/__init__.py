"""gradfuse: fused gradient kernels for PyTorch training.

Gradient accumulation, fp16 unscaling with inf/NaN checks, global-norm measurement and
clipping in one or two passes over memory and one or two kernel launches per device, whatever
the number of parameter tensors, with no host sync and fp32-accurate norms for bf16 models.
CPU tensors run on a Rust core, CUDA tensors on Triton kernels, both behind `gradfuse::`
torch custom ops.
"""

from . import clipping, ops
from .buckets import GradBuckets
from .clip import (
    clip_grad_norm,
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
    patch_torch,
)
from .ddp_hook import DDPHookState, register_ddp_hook
from .ops import (
    TensorStats,
    accumulate_,
    multi_tensor_norm,
    multi_tensor_scale_,
    multi_tensor_stats,
    unscale_and_check_,
    unscale_and_clip_,
    unscale_check_norm,
    unscale_norm_,
)
from .scaler import GradScaler
from .train import TrainConfig, Trainer

__version__ = "0.1.0"

__all__ = [
    "DDPHookState",
    "GradBuckets",
    "GradScaler",
    "TensorStats",
    "TrainConfig",
    "Trainer",
    "__version__",
    "accumulate_",
    "clip_grad_norm",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "clipping",
    "get_total_norm",
    "multi_tensor_norm",
    "multi_tensor_scale_",
    "multi_tensor_stats",
    "ops",
    "patch_torch",
    "register_ddp_hook",
    "unscale_and_check_",
    "unscale_and_clip_",
    "unscale_check_norm",
    "unscale_norm_",
]
