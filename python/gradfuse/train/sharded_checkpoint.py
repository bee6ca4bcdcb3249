"""Sharded checkpoints: a model sharded by FSDP2 saved and loaded through
``torch.distributed.checkpoint`` (DCP), every rank writing its own shard, committed atomically.

A checkpoint is a folder, ``step-00001000/`` in the checkpoint folder (layout and checks in
``checkpoint.py``): DCP's files (``.metadata`` and the shards of the model and optimizer
state dicts from ``torch.distributed.checkpoint.state_dict.get_state_dict``), the Trainer's
shared state in ``trainer.pt`` (written by rank 0) and each rank's own part (its RNG states and
data position) in ``rank-00000.pt``, ``rank-00001.pt``, ...

Atomic as the single-file checkpoints are. Rank 0 deletes what a killed save left and makes
``.saving-step-00001000/``; every rank writes into it; once all have finished (one collective
that also carries any rank's error to every rank), rank 0 commits with ONE rename to
``step-00001000/``, fsyncs the checkpoint folder, deletes all but the ``keep_last`` newest up to
it, and a last collective lets every rank go on. Rank 0 holds the folder's lock (``lock.py``)
throughout: the Trainer's, or one it takes for the save. A job killed at any moment leaves either the complete
new folder or none (a temporary one, deleted at the next save), and the previous ones whole.

Loading goes through DCP too (``dcp.load`` into the model's and optimizer's own state dicts,
then ``set_state_dict``), so the world size may differ from the one that saved: DCP reads each
rank's slices from whatever shards hold them (2 ranks -> 1, 1 -> 2, a plain model into an FSDP2
one and back). Then each rank takes its own part back (``rank_part``); on another world size
it cannot, and the rule is: rank ``r`` gets the RNG states of saved rank ``r % saved world size``
(the Trainer seeds every rank alike, so these are the states a fresh rank would have had too),
and the data position is re-split: every rank starts its data at the epoch of the ranks
furthest behind, after ``floor(batches the saved ranks took in that epoch / new world size)``
batches, with a warning that the data order cannot be the same as an uninterrupted run's
(samples near the split may be seen twice, never skipped, when each rank's data is its share of
one dataset, e.g. through ``DistributedSampler``).

Without a process group (``group=None``: one process, with or without ``fully_shard``) the same
folders are written and read through DCP's single-process mode.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint
from .lock import FolderLock, holding
from .ranks import agree_on_checkpoint, together

logger = logging.getLogger("gradfuse.train")
# DCP says so whenever it runs without a process group; here that is asked for (group=None).
_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def save(
    directory: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    shared: dict | None = None,
    own: dict | None = None,
    keep_last: int | None = None,
    group=None,
    name: str | None = None,
    lock: FolderLock | None = None,
) -> Path:
    """Write the sharded checkpoint of ``step``: ``model`` and ``optimizer`` through DCP,
    ``shared`` (the same on every rank: rank 0's is kept) and this rank's ``own`` part; every
    rank of ``group`` calls it (``None``: this process alone). Then all but the ``keep_last``
    newest checkpoints up to it are deleted (``None``: none). ``name`` writes that folder
    instead (e.g. ``best``), outside the rotation. ``lock``: rank 0's hold on ``directory`` (a
    Trainer's); without one, rank 0 locks the folder for the save, and every rank raises
    ``CheckpointFolderInUse`` if another writer holds it. Returns the folder's path on every
    rank."""
    with contextlib.ExitStack() as held:
        hold = functools.partial(held.enter_context, holding(directory, lock, "gradfuse.train.sharded_checkpoint.save"))
        return _save(directory, step, model, optimizer, shared, own, keep_last, group, name, hold)


def _save(directory, step, model, optimizer, shared, own, keep_last, group, name, hold) -> Path:
    directory = Path(directory)
    rank, world = _rank_and_world(group)
    final = directory / name if name is not None else checkpoint.checkpoint_path(directory, step, sharded=True)
    temp = checkpoint.temporary_folder(directory, final.name)

    def prepare():
        hold()  # rank 0 holds the folder until the save is over (lock.py)
        directory.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_stale_saves(directory)
        temp.mkdir()

    together(group, rank == 0 and prepare, f"could not start the checkpoint {final}")
    dcp, _, _ = _dcp()
    stepped = bool(optimizer.state)
    model_state, optimizer_state = state_to_save(model, optimizer)
    with _single_process_quiet(group), _dcp_errors(f"could not write the checkpoint {final}"):
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=temp,
            process_group=group,
            no_dist=group is None,
        )

    def write_parts():
        # The CRC-32 of every shard file is recorded, each rank reading an even share of them. The
        # shard files are those the written metadata names: what dcp.save returns lacks them on
        # torch 2.11 (its FileSystemWriter.finish fills a copy of the metadata), so it is read back.
        shards = sorted({info.relative_path for info in read_metadata(temp).storage_data.values()})
        files = {file: checkpoint.file_crc32(temp / file) for file in shards[rank::world]}
        own_part = {"rank": rank, "world_size": world, "files": files, **(own or {})}
        checkpoint.write_file(checkpoint.rank_file(temp, rank), own_part)
        if rank == 0:
            metadata_crc32 = checkpoint.file_crc32(temp / checkpoint.METADATA)
            shared_part = {
                "step": step, **(shared or {}), "world_size": world, "metadata_crc32": metadata_crc32,
                "optimizer_stepped": stepped,
            }  # fmt: skip
            checkpoint.write_file(temp / checkpoint.TRAINER_FILE, shared_part)

    try:
        together(group, write_parts, f"could not write the checkpoint {final}")
    except BaseException:
        if rank == 0:
            checkpoint.remove_stale_saves(directory)
        raise

    def commit():
        checkpoint.fsync_directory(temp)  # the entries of every rank's files
        replaced = None
        # The same step saved again: the old folder is moved aside, then deleted once the new one
        # is in place (a kill between the two renames leaves the older checkpoints, not this step).
        if final.exists():
            replaced = checkpoint.temporary_folder(directory, final.name + "-replaced")
            os.replace(final, replaced)
        os.replace(temp, final)
        checkpoint.fsync_directory(directory)  # make the rename itself durable
        if replaced is not None:
            checkpoint.remove_stale_saves(directory)
        if name is None and keep_last is not None:
            checkpoint.remove_old(directory, keep_last, newest=final)

    together(group, rank == 0 and commit, f"could not commit the checkpoint {final}")
    return final


def load_model_and_optimizer(folder: str | os.PathLike, model: torch.nn.Module, optimizer, *, group=None) -> None:
    """Read ``model``'s and ``optimizer``'s state from the sharded checkpoint ``folder``, on any
    world size: DCP fills the state dicts the model and optimizer have now (their shards on
    this rank), then ``set_state_dict`` puts them in place. The optimizer ends with state for
    exactly the parameters that had state when it was saved (``optimizer_template``). Every
    rank of ``group`` calls it (``None``: this process alone); a failure on any rank raises
    ``CheckpointError`` naming the folder on every rank. The folder should have been checked
    first (``checkpoint.load_checkpoint``)."""
    agree_on_checkpoint(folder, group, folders_only="loading through torch.distributed.checkpoint")
    folder = Path(folder)
    dcp, _, set_state_dict = _dcp()
    failure = f"could not load the checkpoint {folder}"
    put_aside = _SetAside(optimizer)
    try:
        loaded: dict = {}

        def prepare():
            loaded["model"], loaded["optimizer"], loaded["saved"] = optimizer_template(folder, model, optimizer)

        together(group, _naming(failure, prepare), failure)
        model_state, optimizer_state, saved = loaded["model"], loaded["optimizer"], loaded["saved"]
        # DCP fills the states the checkpoint holds; the template's others are torch's made-up ones.
        state = {"model": model_state, "optimizer": _only(optimizer_state, saved)}
        with _single_process_quiet(group), _dcp_errors(failure):
            dcp.load(state, checkpoint_id=folder, process_group=group, no_dist=group is None)

        def put_in_place():
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
            if not checkpoint.load_checkpoint(folder / checkpoint.TRAINER_FILE).get("optimizer_stepped", True):
                saved.clear()  # saved by an older gradfuse with the made-up state of an optimizer without one
            forget_made_up_state(optimizer, optimizer_state, saved)

        together(group, _naming(failure, put_in_place), failure)
    except BaseException:
        put_aside.restore_state()
        raise
    finally:
        put_aside.restore_grads()


def load(folder: str | os.PathLike, model: torch.nn.Module, optimizer, *, group=None) -> dict:
    """Check ``folder`` whole, load ``model`` and ``optimizer`` from it, and return the saved
    state: the shared part, with every saved rank's own part as a list under ``"ranks"``
    (``rank_part`` picks this rank's)."""
    state = checkpoint.load_checkpoint(folder)
    load_model_and_optimizer(folder, model, optimizer, group=group)
    return state


def rank_part(ranks: list[dict], rank: int, world: int, *, announce: bool = True, where: str = "") -> dict:
    """This rank's own part of a checkpoint saved by ``len(ranks)`` ranks: its own on the same
    world size; otherwise the RNG states of saved rank ``rank % len(ranks)`` and the data
    position re-split by the rule in the module docs, with a warning (``announce``: this
    process logs) that the data order cannot be the same."""
    saved_world = len(ranks)
    if saved_world == world:
        return ranks[rank]
    part = dict(ranks[rank % saved_world])
    data = [r["data"] for r in ranks if r.get("data") is not None]
    if data:
        part["data"] = resplit_data(data, world)
        if announce:
            logger.warning(
                f"resuming{where} a checkpoint of {saved_world} rank(s) on {world}: the model and optimizer are "
                f"resharded exactly, but the data order cannot be the same as without the change: every rank "
                f"starts at batch {part['data']['position']} of epoch {part['data']['epoch']} of its train_data "
                f"(the batches the {saved_world} rank(s) took in that epoch, split over {world}); rank r continues "
                f"the random number generators of saved rank r % {saved_world}"
            )
    return part


def resplit_data(positions: list[dict], world: int) -> dict:
    """One data position (``BatchStream.state_dict()``) for every rank of ``world`` from the
    saved ranks' ``positions``: the epoch of the ranks furthest behind, and the batches they
    took in it divided by ``world``, rounded down (batches seen again rather than skipped)."""
    epoch = min(p["epoch"] for p in positions)
    behind = [p for p in positions if p["epoch"] == epoch]
    started = [p for p in behind if p["epoch_rng_state"] is not None]
    if not started:  # saved before the first batch of that epoch
        return {"epoch": epoch, "position": 0, "epoch_rng_state": None}
    taken = sum(p["position"] for p in behind)
    return {"epoch": epoch, "position": taken // world, "epoch_rng_state": started[0]["epoch_rng_state"]}


# --- optimizer state: saved and loaded for exactly the parameters that have one ---------------
#
# An optimizer such as AdamW makes a parameter's state at its first gradient: a parameter that
# has not had one yet (a head unused in forward, a branch not taken so far) has none. torch's
# ``get_state_dict`` gives the state the optimizer has, except that an optimizer with no state
# at all is first stepped once at lr 0 to make one (AdamW: step 1, zero moments) for every
# trainable parameter; a fresh optimizer being loaded gets that made-up state too, and DCP's
# load then asks the checkpoint for every parameter's (pytorch/pytorch#192202). Here the
# checkpoint holds the real state only, the load asks DCP for the parameters the checkpoint has
# state for (its metadata says which), and the made-up state is forgotten after both: the
# optimizer has state for the same parameters after a load as before the save, and training on
# is the run without a checkpoint, whatever subset that is.


def state_to_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``model``'s and ``optimizer``'s state dicts (``get_state_dict``, parameters named by
    their FQNs), the optimizer's holding the state of the parameters that have one; any state
    torch made up on the way is taken off the optimizer again."""
    _, get_state_dict, _ = _dcp()
    had_state = {p for p, state in optimizer.state.items() if state}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    names = _fqns(optimizer, optimizer_state)
    real = {names[p] for p in had_state}
    forget_made_up_state(optimizer, optimizer_state, real)
    return model_state, _only(optimizer_state, real)


def optimizer_template(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict, dict, set]:
    """(model state dict, optimizer state dict, FQNs of the parameters the checkpoint in
    ``folder`` holds optimizer state for): the state dicts DCP loads into, the optimizer's with
    an entry for every trainable parameter (torch makes them up: ``optimizer`` must have no
    state and no gradients, see ``_SetAside``). Raises ``CheckpointError`` where the checkpoint
    holds state this optimizer has no place for: it would be dropped without a word."""
    _, get_state_dict, _ = _dcp()
    keys = read_metadata(folder).state_dict_metadata
    model_state, optimizer_state = get_state_dict(model, optimizer)
    trainable = set(optimizer_state["state"])
    known = {fqn for group in optimizer_state["param_groups"] for fqn in group["params"]}
    saved, unknown = set(), set()
    for key in keys:
        if not key.startswith(_STATE_PREFIX):
            continue
        name = key[len(_STATE_PREFIX) :]  # "<parameter FQN>.<state key>[.<nested key>...]"
        fqn = next((name[:i] for i, c in enumerate(name) if c == "." and name[:i] in known), None)
        (saved if fqn is not None else unknown).add(fqn or name.rsplit(".", 1)[0])
    problems = {"not a parameter of this optimizer": unknown, "now frozen (requires_grad=False)": saved - trainable}
    problems = {why: names for why, names in problems.items() if names}
    if problems:
        listed = "; ".join(f"{', '.join(sorted(names))}: {why}" for why, names in problems.items())
        raise checkpoint.CheckpointError(
            f"the checkpoint {folder} holds optimizer state that this optimizer has no place for ({listed}); loading "
            "would drop it: resume with the model and optimizer that saved it"
        )
    return model_state, optimizer_state, saved


def forget_made_up_state(optimizer: torch.optim.Optimizer, optimizer_state: dict, keep: set) -> None:
    """Take the state of every parameter whose FQN is not in ``keep`` off ``optimizer``
    (``optimizer_state``: the ``get_state_dict`` that names its parameters)."""
    for p, fqn in _fqns(optimizer, optimizer_state).items():
        if fqn not in keep:
            optimizer.state.pop(p, None)


_STATE_PREFIX = "optimizer.state."  # the keys of the optimizer's per-parameter state in DCP's metadata


def _fqns(optimizer: torch.optim.Optimizer, optimizer_state: dict) -> dict:
    """parameter -> its FQN in ``optimizer_state`` (``get_state_dict`` lists each group's
    parameters by FQN, in the optimizer's order)."""
    return {
        p: fqn
        for group, named in zip(optimizer.param_groups, optimizer_state["param_groups"], strict=True)
        for p, fqn in zip(group["params"], named["params"], strict=True)
    }


def _only(optimizer_state: dict, fqns: set) -> dict:
    """``optimizer_state`` with the per-parameter state of ``fqns`` only (the same inner dicts)."""
    return {**optimizer_state, "state": {k: v for k, v in optimizer_state["state"].items() if k in fqns}}


class _SetAside:
    """The optimizer's state and the parameters' gradients set aside while a load runs: torch
    makes up a state for every trainable parameter (the template DCP loads into) only for an
    optimizer with no state and parameters with no gradients. ``restore_state`` puts the
    state back (a failed load), ``restore_grads`` the gradients (always)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer, self.state = optimizer, optimizer.state
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.grads = [p.grad for p in self.params]
        optimizer.state = collections.defaultdict(dict)
        for p in self.params:
            p.grad = None

    def restore_state(self) -> None:
        self.optimizer.state = self.state

    def restore_grads(self) -> None:
        for p, grad in zip(self.params, self.grads, strict=True):
            p.grad = grad


def _naming(failure: str, work):
    """``work`` raising ``CheckpointError("<failure>: ...")`` for any error of its own."""

    def run():
        try:
            work()
        except checkpoint.CheckpointError:
            raise
        except Exception as err:
            raise checkpoint.CheckpointError(f"{failure}: {type(err).__name__}: {err}") from err

    return run


@contextlib.contextmanager
def _dcp_errors(failure: str):
    """DCP's ``CheckpointException`` (a ``BaseException``: ``except Exception`` misses it; DCP
    raises it on every rank) as ``CheckpointError("<failure>: ...")``, each failed rank's error
    named."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        by_error: dict[str, list[int]] = {}
        for rank, (error, _) in sorted(err.failures.items()):
            by_error.setdefault(f"{type(error).__name__}: {error}", []).append(rank)
        why = "; ".join(f"rank {', '.join(map(str, ranks))}: {e}" for e, ranks in by_error.items())
        raise checkpoint.CheckpointError(f"{failure}: {why or err}") from err


def _dcp():
    """``torch.distributed.checkpoint`` and its state-dict functions, imported when first used:
    importing them costs about a second, too much for every ``import gradfuse``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


def read_metadata(folder: Path):
    """DCP's metadata of the checkpoint in ``folder``, as its ``.metadata`` file holds it."""
    dcp, _, _ = _dcp()
    return dcp.FileSystemReader(folder).read_metadata()


def _rank_and_world(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@contextlib.contextmanager
def _single_process_quiet(group):
    """DCP warns that it runs in one process whenever it does; with ``group=None`` that is what
    was asked for."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", _SINGLE_PROCESS, UserWarning)
        yield
