"""Checkpoint files: written atomically, found by step, checked when read; and RNG states.

A checkpoint is one file, ``step-00001000.pt`` in the checkpoint folder, holding a dict made
by the trainer (model, optimizer, scheduler, scaler, counters, data position, RNG states)
plus a format tag. It is written to a temporary file in the same folder, flushed and fsynced,
then renamed over the final name (atomic on POSIX and Windows), and the folder is fsynced: a
process killed at any moment leaves either the complete new file or none, and the previous
checkpoints untouched. A write that fails (a full disk, a file size limit: torch's zip writer
hides those behind ``unexpected pos``) is an ``OSError`` naming the file and the cause, and its
temporary file is deleted. Only the ``keep_last`` newest up to the one just written are kept
(never that one). Every save holds the folder's lock (``lock.py``: the Trainer's, or one taken
for the save), so a second writer is refused instead of removing the first one's temporary
file; whose checkpoints a folder holds is ``ownership.py``'s.

Files are read with ``torch.load(weights_only=True)`` (no code runs from a checkpoint), so
everything in one is a tensor, a number, a string or a container of those.

Checksums: ``torch.save`` writes a zip archive whose every record (the pickle and each
tensor's storage) carries the CRC-32 of its bytes, computed as it is written (forced on here,
whatever ``torch.utils.serialization.config`` says). ``load_checkpoint`` checks every record
against its CRC before unpickling: bytes overwritten anywhere are a ``CheckpointError``, not
an optimizer state full of inf and NaN. ``newest_valid_checkpoint`` walks back to the newest
file that passes.

Sharded checkpoints (``sharded_checkpoint.py``, FSDP2) are folders, ``step-00001000/``,
committed by one rename of their temporary folder: the files of
``torch.distributed.checkpoint`` (``.metadata`` and one ``.distcp`` file per rank), the
Trainer's shared state in ``trainer.pt`` and each rank's own part (RNG, data position) in
``rank-00000.pt``, ``rank-00001.pt``, ... The last two are written as the files above are; they
also hold the CRC-32 of the metadata and of each rank's ``.distcp`` files, so a folder is
checked whole (``verify_folder``) before anything is loaded from it. Files and folders are
listed, rotated by ``keep_last`` and picked by ``resume="latest"`` together.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import random
import re
import shutil
import zipfile
import zlib
from pathlib import Path

import torch

from .lock import FolderLock, holding

FORMAT = "gradfuse.Trainer checkpoint"
VERSION = 1
_NAME = re.compile(r"^step-(\d+)(\.pt)?$")  # a file (one process writes it) or a sharded folder
_TEMP_PREFIX = ".saving-"
BEST = "best.pt"  # the checkpoint with the lowest eval loss (keep_best), apart from the step-*.pt
BEST_FOLDER = "best"  # the same, sharded
# The files of a sharded checkpoint folder besides torch.distributed.checkpoint's own.
METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards
TRAINER_FILE = "trainer.pt"  # the state every rank shares (step, schedule, scaler, counters, config)


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used: truncated, corrupt, or not written by the Trainer."""


def checkpoint_path(directory: str | os.PathLike, step: int, sharded: bool = False) -> Path:
    return Path(directory) / (f"step-{step:08d}" if sharded else f"step-{step:08d}.pt")


def rank_file(folder: str | os.PathLike, rank: int) -> Path:
    """The file of ``rank``'s own state in a sharded checkpoint folder."""
    return Path(folder) / f"rank-{rank:05d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The checkpoint files and sharded folders in ``directory``, oldest step first (temporary
    ones are not)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p.name, p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, _, p in sorted(found)]


def step_of(path: str | os.PathLike) -> int | None:
    """The step a checkpoint's name says (``step-00001000.pt`` or ``step-00001000/``: 1000); None
    for another name."""
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def saved_step(path: str | os.PathLike) -> int | None:
    """The step a checkpoint file or sharded folder holds, read without loading its tensors
    (a file through ``mmap``, a folder from its shared state); None if it cannot be read."""
    path = Path(path)
    try:
        if path.is_dir():
            return load_checkpoint(path / TRAINER_FILE)["step"]
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"]
    except (CheckpointError, OSError, RuntimeError, KeyError, TypeError, ValueError, pickle.UnpicklingError):
        return None


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def check_directory(directory: str | os.PathLike, what: str = "TrainConfig.checkpoint_dir") -> Path:
    """Make ``directory`` (and its parents) and check that a file can be written there, so that
    a folder that cannot hold checkpoints is an error before training, not at the first save."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f"{_TEMP_PREFIX}probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise OSError(err.errno, f"{what} {os.fspath(directory)!r} cannot hold files: {err.strerror or err}") from err
    return directory


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    state: dict,
    keep_last: int,
    name: str | None = None,
    lock: FolderLock | None = None,
) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically; delete all but the ``keep_last``
    newest checkpoints up to it (and the temporary file of a save that was killed). Returns the
    path. ``name`` (e.g. ``best.pt``) writes that file instead, outside the ``keep_last``
    rotation. ``lock``: the folder's lock, held by the caller (a Trainer); without one, the
    folder is locked for the save (``CheckpointFolderInUse`` if another writer holds it). An
    ``OSError`` (a full disk, a file size limit) names the file it could not write."""
    directory = Path(directory)
    with holding(directory, lock, "gradfuse.train.checkpoint.save_checkpoint"):
        remove_stale_saves(directory)
        final = checkpoint_path(directory, step) if name is None else directory / name
        write_file(final, state)
        if name is None:
            remove_old(directory, keep_last, newest=final)
    return final


class _Recording:
    """A file's ``write`` for ``torch.save``, keeping the ``OSError`` it raised: torch's zip
    writer turns one into ``[enforce fail at inline_container.cc] unexpected pos``."""

    def __init__(self, file):
        self.file = file
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.file.flush()


def write_file(final: Path, state: dict) -> None:
    """Write ``state`` (with the format tag) to ``final`` atomically: a temporary file beside it,
    CRC-32 on, flushed and fsynced, renamed over ``final``, the folder fsynced. An ``OSError``
    (a full disk, a file size limit) names the file it could not write; the temporary file is
    deleted and ``final``, if it existed, is untouched."""
    temp = final.parent / f"{_TEMP_PREFIX}{final.name}"
    try:
        with open(temp, "wb") as f, _crc32_on():
            recording = _Recording(f)
            try:
                torch.save({"format": FORMAT, "version": VERSION, **state}, recording)
            except RuntimeError as err:  # torch's writer hides the OSError it met
                if recording.error is not None:
                    raise recording.error from err
                if "inline_container" not in str(err) and "PytorchStreamWriter" not in str(err):
                    raise
                raise OSError(errno.EIO, f"torch's writer failed ({str(err).splitlines()[0]})") from err
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
    except OSError as err:
        temp.unlink(missing_ok=True)
        raise OSError(
            err.errno, f"could not write the checkpoint {final}: {err.strerror or err}{_why(err, final)}",
            os.fspath(final),
        ) from err  # fmt: skip
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_directory(final.parent)  # make the rename itself durable


def _why(err: OSError, final: Path) -> str:
    """What an ``OSError`` of a checkpoint write most likely means, and the space left."""
    hints = {
        errno.EFBIG: "the file is larger than the process's file size limit (ulimit -f) or the file system allows",
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is used up",
    }
    hint = hints.get(err.errno, "")
    try:
        usage = shutil.disk_usage(final.parent)
        free = f"{usage.free / 2**20:.1f} MiB free there"
    except OSError:
        free = ""
    said = "; ".join(part for part in (hint, free) if part)
    return f" ({said}); nothing was written in its place, and the previous checkpoints are untouched" if said else ""


def remove_stale_saves(directory: Path) -> None:
    """Delete what saves that were killed left in ``directory``: temporary files and folders."""
    for stale in directory.glob(f"{_TEMP_PREFIX}*"):
        remove_path(stale)


def remove_old(directory: Path, keep_last: int, newest: Path | None = None) -> None:
    """Delete all but the ``keep_last`` newest checkpoints (files and folders alike) up to
    ``newest``, the one just written, which is never deleted; checkpoints of a later step are
    left alone (newer ones that a resume passed over as damaged). Whose checkpoints the folder
    holds is checked when a Trainer takes it (``ownership``)."""
    found = list_checkpoints(directory)
    if newest is not None:
        newest = Path(newest)
        if newest not in found:
            return
        found = found[: found.index(newest) + 1]
    for old in found[:-keep_last]:
        remove_path(old)


def remove_path(path: Path) -> None:
    """Delete a checkpoint file or folder (a symlink itself, not what it points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def temporary_folder(directory: str | os.PathLike, final_name: str) -> Path:
    """Where a sharded checkpoint is written before its rename to ``directory / final_name``."""
    return Path(directory) / f"{_TEMP_PREFIX}{final_name}"


def file_crc32(path: Path) -> int:
    """The CRC-32 of a whole file, read in 16 MiB pieces."""
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(1 << 24):
            crc = zlib.crc32(piece, crc)
    return crc


@contextlib.contextmanager
def _crc32_on():
    """torch computes each record's CRC-32 while writing unless told not to; the check on load
    relies on it, so it is on for the save whatever the process's setting."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: always computed
        yield
        return
    before = config.save.compute_crc32
    config.save.compute_crc32 = True
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def verify_checksums(path: str | os.PathLike) -> None:
    """Check every record of the zip archive at ``path`` against its CRC-32 (``CheckpointError``
    naming the first record that differs, or why the archive cannot be read)."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads each record, compares its CRC-32
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise CheckpointError(
            f"{path} cannot be read as a checkpoint, it may be truncated or corrupt ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}).{_others(path)}"
        ) from err
    if bad is not None:
        raise CheckpointError(
            f"{path} is corrupt: the checksum (CRC-32) of its record {bad!r} does not match its bytes.{_others(path)}"
        )


def fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder; its rename is durable without it
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Read a checkpoint written by ``save_checkpoint``; ``CheckpointError`` with the reason
    when the file is truncated, corrupt or something else (FileNotFoundError when missing).
    For a sharded folder: its shared state, with every rank's own part under ``"ranks"``,
    after the whole folder is checked (``verify_folder``); the model and optimizer are read
    from it by ``sharded_checkpoint.load_model_and_optimizer``."""
    path = Path(path)
    if path.is_dir():
        return verify_folder(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    verify_checksums(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"{path} cannot be read as a checkpoint, it may be truncated or corrupt ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}).{_others(path)}"
        ) from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} was not written by gradfuse.Trainer (no {FORMAT!r} tag).{_others(path)}")
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {state.get('version')!r}; this gradfuse reads {VERSION}"
        )
    return state


def verify_folder(folder: str | os.PathLike) -> dict:
    """Check a sharded checkpoint folder whole: ``trainer.pt`` and every rank's file present
    and CRC-valid, and the metadata and each ``.distcp`` file matching the CRC-32 recorded when
    it was written. Returns the shared state with the ranks' parts as a list under ``"ranks"``;
    ``CheckpointError`` naming the file that is missing or corrupt."""
    folder = Path(folder)
    shared = _part(folder / TRAINER_FILE, "the Trainer's shared state")
    if not isinstance(shared.get("world_size"), int) or "metadata_crc32" not in shared:
        raise CheckpointError(f"{folder / TRAINER_FILE} is not the shared state of a sharded checkpoint")
    _check_crc(folder / METADATA, shared.get("metadata_crc32"), "torch.distributed.checkpoint's metadata")
    ranks = []
    for rank in range(shared["world_size"]):
        own = _part(rank_file(folder, rank), f"rank {rank}'s state")
        if own.get("rank") != rank or not isinstance(own.get("files"), dict):
            raise CheckpointError(f"{rank_file(folder, rank)} is not rank {rank}'s state of a sharded checkpoint")
        for name, crc in own["files"].items():
            _check_crc(folder / name, crc, f"rank {rank}'s shard of the model and optimizer")
        ranks.append(own)
    return {**shared, "ranks": ranks}


def _part(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(
            f"{path} ({what}) is missing: {path.parent} is not a complete sharded checkpoint.{_others(path.parent)}"
        )
    return load_checkpoint(path)


def _check_crc(path: Path, want: int | None, what: str) -> None:
    if not path.is_file():
        raise CheckpointError(
            f"{path} ({what}) is missing: {path.parent} is not a complete sharded checkpoint.{_others(path.parent)}"
        )
    if file_crc32(path) != want:
        raise CheckpointError(
            f"{path} ({what}) is corrupt: its CRC-32 differs from the one recorded when it was written."
            f"{_others(path.parent)}"
        )


def newest_valid_checkpoint(directory: str | os.PathLike) -> tuple[Path | None, dict | None, list[tuple[Path, str]]]:
    """The newest checkpoint (file or sharded folder) in ``directory`` that loads: (its path,
    its state, [(newer one, why it was refused), ...]); (None, None, refused) when none does."""
    refused = []
    for path in reversed(list_checkpoints(directory)):
        try:
            return path, load_checkpoint(path), refused
        except CheckpointError as err:
            refused.append((path, str(err)))
    return None, None, refused


def _others(path: Path) -> str:
    others = [p.name for p in list_checkpoints(path.parent) if p != path]
    return f" Other checkpoints in {path.parent}: {', '.join(others)}." if others else ""


# --- random number generators -------------------------------------------------------------


def rng_state() -> dict:
    """The states of torch's CPU and CUDA generators, Python's ``random`` and numpy's, as
    tensors and plain values (so that ``weights_only`` loading reads them)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    numpy = np.random.get_state(legacy=False)
    state["numpy"] = {
        "bit_generator": numpy["bit_generator"],
        "key": torch.from_numpy(numpy["state"]["key"].astype("int64")),
        "pos": int(numpy["state"]["pos"]),
        "has_gauss": int(numpy["has_gauss"]),
        "gauss": float(numpy["gauss"]),
    }
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        numpy = state["numpy"]
        key = numpy["key"].numpy().astype("uint32")
        np.random.set_state((numpy["bit_generator"], key, numpy["pos"], numpy["has_gauss"], numpy["gauss"]))
