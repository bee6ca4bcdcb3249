"""Checks every rank makes together: a rank that raised alone would leave the others waiting in
their next collective, so a failure on any rank is raised on every rank.

``together`` runs a piece of work on each rank (or on some: rank 0 takes the checkpoint
folder's lock, writes a commit) and then gathers whether it failed anywhere; every rank raises,
the failed ones their own error, the others a ``CheckpointError`` naming each failed rank and
its error. ``agree_on_checkpoint`` checks that the ranks resume alike (every rank from the same
checkpoint, or none), before a load whose collectives a rank that refused alone would skip.
Used by the Trainer's checkpoint folder and resume (``trainer``) and by sharded checkpoints
(``sharded_checkpoint``); ``group=None`` is this process alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from .checkpoint import CheckpointError


def together(group, work, failure: str):
    """``work()`` on this rank (falsy: nothing to do here), then every rank of ``group`` (None:
    this process alone) raises if it failed on any, naming the ranks and their errors (``failure``
    says what could not be done); returns what ``work`` returned (None where it did not run)."""
    result, error = None, None
    try:
        if work:
            result = work()
    except Exception as err:
        error = err
    if group is None:
        if error is not None:
            raise error
        return result
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    failed = {rank: why for rank, why in enumerate(errors) if why is not None}
    if failed:
        raise CheckpointError(f"{failure}: " + "; ".join(f"rank {rank}: {why}" for rank, why in failed.items()))
    return result


def agree_on_checkpoint(path: str | os.PathLike | None, group, *, folders_only: str | None = None) -> None:
    """Check, on every rank of ``group`` together (``None``: this process alone), that the ranks
    resume alike: every rank from a checkpoint or none (``path=None``: this rank found none), and
    then one sharded checkpoint folder on every rank, or single files on every rank
    (``folders_only``: folders only, and what needs them, for the message). Otherwise every rank
    raises ``CheckpointError`` naming each rank's checkpoint: a rank that refused alone (or
    skipped the load) would leave the others waiting in the collectives of a load. Each rank
    picks its checkpoint itself (``resume="latest"``)."""
    mine = (os.fspath(Path(path).resolve()), Path(path).is_dir()) if path is not None else (None, False)
    chosen: list = [mine]
    if group is not None:
        chosen = [None] * dist.get_world_size(group)
        dist.all_gather_object(chosen, mine, group=group)
    named = ", ".join(f"rank {rank}: {name or 'no checkpoint'}" for rank, (name, _) in enumerate(chosen))
    without = [name for name, _ in chosen if name is None]
    if without and len(without) < len(chosen):
        raise CheckpointError(
            f"the ranks would not resume alike, some from a checkpoint and some from step 0: {named}. With "
            "resume='latest' each rank looks in its own TrainConfig.checkpoint_dir: it must be the same folder, on a "
            "file system every rank sees"
        )
    if without:
        return
    files = [name for name, is_folder in chosen if not is_folder]
    if folders_only and files:
        raise CheckpointError(
            f"{', '.join(dict.fromkeys(files))} is a single-file checkpoint (whole tensors); {folders_only} needs a "
            f"sharded checkpoint folder (step-XXXXXXXX/) ({named})"
        )
    folders = {name for name, is_folder in chosen if is_folder}
    if len(folders) > 1 or (folders and files):
        raise CheckpointError(
            f"the ranks would load different checkpoints: {named}; every rank must see the same checkpoint folder "
            "(a shared file system)"
        )
