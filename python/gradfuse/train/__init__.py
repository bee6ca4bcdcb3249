"""The minimal trainer: ``TrainConfig`` and ``Trainer``, in rooms of their own.

``config`` (the validated dataclass), ``trainer`` (the loop), ``schedule`` (warmup + decay),
``checkpoint`` (atomic checksummed files, RNG states), ``sharded_checkpoint`` (FSDP2's
checkpoints through DCP, one folder every rank writes into), ``data`` (a resumable batch stream),
``metrics`` (JSON lines, TensorBoard, progress, throughput, memory), ``resume`` (which
checkpoint, and the settings given now over the saved ones), ``callbacks`` (the user's hooks),
``interrupt`` (SIGINT/SIGTERM: finish the step, save, stop), ``distributed`` (gradient
management per process layout), ``fsdp`` (the model sharded by FSDP2).
"""

from .checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint
from .config import TrainConfig
from .interrupt import TrainingInterrupted
from .schedule import lr_factor
from .trainer import NonFiniteLossError, Trainer, model_loss

__all__ = [
    "CheckpointError",
    "NonFiniteLossError",
    "TrainConfig",
    "Trainer",
    "TrainingInterrupted",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "lr_factor",
    "model_loss",
]
