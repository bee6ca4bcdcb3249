"""What training reports: metrics rows as JSON lines, a progress bar, throughput and memory.

``Metrics`` owns the outputs of one ``fit``: the rows it returns, the JSON-lines file (one
row per line, flushed as written; non-finite numbers are written as ``null``), TensorBoard
event files (``torch.utils.tensorboard``, when a folder is given) and the progress: a tqdm bar
on a terminal, and where stderr is not one (a log file, a batch job) a plain line every
``every`` steps instead of a bar's carriage-return redraws. ``Throughput`` counts samples and
tokens between logged steps. Only the process that ``Metrics`` is told is the main one writes
anything.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch

logger = logging.getLogger("gradfuse.train")


class Throughput:
    """Samples and tokens per second since the last ``rates()`` call."""

    def __init__(self):
        self._start = time.perf_counter()
        self.samples = 0
        self.tokens = 0

    def add(self, samples: int, tokens: int | None) -> None:
        self.samples += samples
        self.tokens += tokens or 0

    def rates(self) -> dict[str, float]:
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        rates = {"samples_per_s": self.samples / elapsed}
        if self.tokens:
            rates["tokens_per_s"] = self.tokens / elapsed
        self._start, self.samples, self.tokens = now, 0, 0
        return rates


def peak_memory_mb(device: torch.device) -> float | None:
    """Peak memory so far: allocated by torch on a CUDA device, the process's peak resident
    set on the CPU (None where the OS does not say)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Metrics:
    """The rows of a run, the JSON-lines file and the progress bar. Use as a context manager."""

    def __init__(
        self,
        path: str | os.PathLike | None,
        progress: bool,
        total_steps: int,
        start_step: int,
        main_process: bool = True,
        tensorboard_dir: str | os.PathLike | None = None,
        every: int = 10,
    ):
        self.rows: list[dict] = []
        self.main_process = main_process
        self.path = Path(path) if path is not None and main_process else None
        self.tensorboard_dir = tensorboard_dir if main_process else None
        self._bar_wanted = progress and main_process
        self.total_steps, self.start_step = total_steps, start_step
        self.every = every
        self._step = start_step
        self._file = None
        self._bar = None
        self._plain = False  # progress as a line every `every` steps (stderr is not a terminal)
        self._started = time.perf_counter()
        self._tensorboard = None

    def __enter__(self) -> Metrics:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = self._rows_before(self.start_step) if self.start_step else []
            self._file = open(self.path, "w")
            self._file.writelines(kept)
            self._file.flush()
        if self.tensorboard_dir is not None:
            self._tensorboard = tensorboard_writer(self.tensorboard_dir, self.start_step)
        if self._bar_wanted and not _is_terminal(sys.stderr):
            self._plain = True
        elif self._bar_wanted:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                warnings.warn(
                    "progress=True needs tqdm (pip install tqdm); training without a progress bar", stacklevel=3
                )
            else:
                self._bar = tqdm(total=self.total_steps, initial=self.start_step, desc="train", dynamic_ncols=True)
        return self

    def _rows_before(self, step: int) -> list[str]:
        """Lines of an existing file up to ``step``: a resumed run rewrites what came after the
        checkpoint it resumed from."""
        if not self.path.is_file():
            return []
        with open(self.path) as f:
            return [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]

    def __exit__(self, *exc_info) -> None:
        if self._file is not None:
            self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def progress(self, loss: float, lr: float) -> None:
        """Advance the progress by one step."""
        self._step += 1
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
            self._bar.update(1)
        elif self._plain and (self._step % self.every == 0 or self._step == self.total_steps):
            rate = (self._step - self.start_step) / max(time.perf_counter() - self._started, 1e-9)
            print(
                f"train: step {self._step}/{self.total_steps} loss {loss:.4f} lr {lr:.2e} ({rate:.2f} steps/s)",
                file=sys.stderr,
                flush=True,
            )

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self._file is not None:
            self._file.write(json.dumps({k: _json_value(v) for k, v in row.items()}) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    tag = "eval/loss" if key == "eval_loss" else f"train/{key}"
                    self._tensorboard.add_scalar(tag, value, row["step"])
            self._tensorboard.flush()

    def message(self, text: str) -> None:
        """A line for the person watching, printed above the progress bar."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        elif self.main_process:
            logger.warning(text)


def _is_terminal(stream) -> bool:
    """Whether a progress bar can redraw itself there: a terminal, or a Jupyter kernel (where
    tqdm.auto draws a widget)."""
    if "ipykernel" in sys.modules:
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def check_tensorboard() -> None:
    """``TrainConfig.tensorboard_dir`` needs the ``tensorboard`` package; say so before training."""
    try:
        import tensorboard  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "TrainConfig.tensorboard_dir is set, but the tensorboard package is not installed: "
            "pip install 'gradfuse[tensorboard]' (or pip install tensorboard), or set tensorboard_dir=None"
        ) from err


def tensorboard_writer(folder: str | os.PathLike, start_step: int):
    """A ``SummaryWriter`` into ``folder``; a resumed run (``start_step`` > 0) drops the events
    written after its checkpoint, as the JSON-lines file does."""
    check_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(os.fspath(folder), purge_step=start_step + 1 if start_step else None)
