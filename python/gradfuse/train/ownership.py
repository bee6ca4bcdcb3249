"""Whose checkpoints a checkpoint folder holds: one run's, the one training into it.

``keep_last`` and ``resume="latest"`` work on the checkpoints of a folder by step: they are
right only while the folder holds one run's checkpoints, in order. So when a Trainer takes its
``checkpoint_dir`` (``check_folder``, after it holds the folder's lock, on rank 0):

- a fresh run (no ``resume``, or ``resume="latest"`` that found nothing) needs a folder without
  checkpoints; one holding some (another run's) is refused, naming the folder, what is in it
  and how to go on: resume that run, start over (``Trainer(..., start_over=True)`` deletes them
  first), or another folder;
- a run resumed from a checkpoint outside the folder (fine-tuning from a pretrained run's
  checkpoint) is a fresh run here: the same rule;
- a run resumed from a checkpoint in the folder continues the run whose checkpoints they are.
  Resumed from an older one than the newest (an explicit path, ``best.pt``), the newer ones
  belong to a continuation this run replaces: left there, its saves would mix with them and
  ``resume="latest"`` would pick theirs. They are renamed ``superseded-step-...`` (out of
  ``keep_last`` and ``resume="latest"``'s sight, kept for you to delete), with a warning; so is
  a best checkpoint (``keep_best``) of a later step than the one resumed from, which would
  otherwise stand as this run's best or be overwritten by this run's first improvement.
  (``resume="latest"`` resumes the newest valid one: newer ones are damaged, passed over, and
  pruning leaves them alone, ``checkpoint.remove_old``.)

A checkpoint here is a ``step-*`` file or folder, ``best.pt``/``best/`` (``keep_best``), or one
set aside as superseded.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from . import checkpoint

logger = logging.getLogger("gradfuse.train")
SUPERSEDED = "superseded-"  # the prefix of a checkpoint set aside


class CheckpointFolderTaken(checkpoint.CheckpointError):
    """The checkpoint folder holds checkpoints this run must not write among."""


def checkpoints_in(directory: str | os.PathLike) -> list[Path]:
    """The checkpoints of ``directory``: ``step-*`` files and folders by step, then the best."""
    directory = Path(directory)
    return checkpoint.list_checkpoints(directory) + _bests(directory) + sorted(directory.glob(f"{SUPERSEDED}*"))


def _bests(directory: Path) -> list[Path]:
    """The best checkpoint of ``directory`` (``keep_best``: a file, or a sharded folder)."""
    return [p for p in (directory / checkpoint.BEST, directory / checkpoint.BEST_FOLDER) if p.exists()]


def _later(path: Path, step: int) -> bool:
    """Whether the checkpoint at ``path`` holds a later step than ``step`` (unreadable: no)."""
    saved = checkpoint.saved_step(path)
    return saved is not None and saved > step


def check_folder(
    directory: str | os.PathLike,
    *,
    resumed_from: Path | None,
    resumed_step: int | None,
    latest: bool,
    start_over: bool,
) -> None:
    """Refuse ``directory`` for this run by the rules in the module docs (``CheckpointFolderTaken``),
    set aside the newer checkpoints of a run resumed from an older one, or with ``start_over``
    delete the checkpoints in it. ``resumed_from``/``resumed_step``: the checkpoint this run
    continues and its step (None, None: a fresh run); ``latest``: it was picked by
    ``resume="latest"``. The caller holds the folder's lock."""
    directory = Path(directory)
    found = checkpoints_in(directory)
    if start_over:
        if found:
            for path in found:
                checkpoint.remove_path(path)
            checkpoint.remove_stale_saves(directory)
            logger.warning(
                f"start_over=True: deleted the {len(found)} checkpoint(s) in {directory} ({_names(found)}); "
                "this run starts from step 0"
            )
        return
    inside = resumed_from is not None and _resolved(resumed_from.parent) == _resolved(directory)
    if not found or (inside and latest):
        return
    if not inside:
        whose = (
            "a fresh run"
            if resumed_from is None
            else f"this run, resumed from {resumed_from} (outside it), which is a fresh run there"
        )
        if latest:  # resume="latest" found no step checkpoint: the folder holds a best or set-aside one
            go_on = (
                "resume='latest' continues from step checkpoints, and there is none; to continue from one of these "
                f"pass its path, e.g. Trainer(..., resume='{found[0]}')"
            )
        else:
            go_on = "To continue that run pass Trainer(..., resume='latest')"
        raise CheckpointFolderTaken(
            f"TrainConfig.checkpoint_dir {directory} holds the checkpoints of another run ({_names(found)}), and "
            f"{whose} would write its own among them: keep_last would prune by step across both runs and "
            f"resume='latest' could continue the wrong one. {go_on}; to start over, Trainer(..., start_over=True), "
            "which deletes them first; or give this run another checkpoint_dir"
        )
    newer = [p for p in checkpoint.list_checkpoints(directory) if checkpoint.step_of(p) > resumed_step]
    newer += [p for p in _bests(directory) if _resolved(p) != _resolved(resumed_from) and _later(p, resumed_step)]
    for path in newer:
        os.replace(path, _free_name(path))
    if newer:
        checkpoint.fsync_directory(directory)
        logger.warning(
            f"resuming from {resumed_from} (step {resumed_step}): the newer checkpoints in {directory} "
            f"({_names(newer)}) belong to the continuation this run replaces; they are renamed "
            f"{SUPERSEDED}... so that keep_last, keep_best and resume='latest' work on this run's alone. Delete them "
            "when you no longer need them"
        )


def _free_name(path: Path) -> Path:
    """``superseded-step-...``, or ``superseded-2-step-...`` and on where that is taken."""
    target, n = path.with_name(SUPERSEDED + path.name), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{SUPERSEDED}{n}-{path.name}")
    return target


def _names(paths: list[Path]) -> str:
    shown = [p.name for p in paths[:6]]
    more = f" and {len(paths) - 6} more" if len(paths) > 6 else ""
    return ", ".join(shown) + more


def _resolved(path: Path) -> str:
    return os.fspath(Path(path).resolve())
