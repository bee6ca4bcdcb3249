"""The minimal trainer: ``TrainConfig`` and ``Trainer``, in rooms of their own.

``config`` (the validated dataclass), ``trainer`` (the loop), ``schedule`` (warmup + decay),
``checkpoint`` (atomic checksummed files, RNG states), ``sharded_checkpoint`` (FSDP2's
checkpoints through DCP, one folder every rank writes into), ``data`` (a resumable batch stream),
``metrics`` (JSON lines, TensorBoard, progress, throughput, memory), ``resume`` (which
checkpoint, and the settings given now over the saved ones), ``callbacks`` (the user's hooks),
``interrupt`` (SIGINT/SIGTERM: finish the step, save, stop), ``distributed`` (gradient
management per process layout), ``fsdp`` (the model sharded by FSDP2), ``lock`` (one writer per
checkpoint folder), ``ownership`` (one run's checkpoints per folder), ``compatibility`` (does a
checkpoint fit this run, checked before a resume loads anything), ``ranks`` (checks every rank
makes together: a failure on one is raised on all).
"""

from .checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint
from .compatibility import CheckpointMismatch
from .config import TrainConfig
from .interrupt import TrainingInterrupted
from .lock import CheckpointFolderInUse
from .ownership import CheckpointFolderTaken
from .schedule import lr_factor
from .trainer import NonFiniteLossError, Trainer, model_loss

__all__ = [
    "CheckpointError",
    "CheckpointFolderInUse",
    "CheckpointFolderTaken",
    "CheckpointMismatch",
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
