"""The minimal trainer: ``TrainConfig`` and ``Trainer``, in rooms of their own.

``config`` (the validated dataclass), ``trainer`` (the loop), ``schedule`` (warmup + decay),
``checkpoint`` (atomic files, RNG states), ``data`` (a resumable batch stream), ``metrics``
(JSON lines, progress bar, throughput, memory), ``distributed`` (gradient management per
process layout).
"""

from .checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint
from .config import TrainConfig
from .schedule import lr_factor
from .trainer import NonFiniteLossError, Trainer, model_loss

__all__ = [
    "CheckpointError",
    "NonFiniteLossError",
    "TrainConfig",
    "Trainer",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "lr_factor",
    "model_loss",
]
