"""Scenarios for sharded checkpoints (``gradfuse.train.sharded_checkpoint``) on every rank of a
2-rank gloo process group, run by ``tests/test_sharded_checkpoint.py`` through
``tests/multiprocess.py``. Each takes ``(rank, world)`` and raises on failure.

The model is sharded by FSDP2 (``fully_shard`` on each linear layer, then the root), so its
parameters and AdamW moments are DTensors with a shard on each rank. The reference for
"loaded exactly" is the full (unsharded) tensors gathered at the save, compared bit for bit.
Folders both ranks and the pytest process share are named by ``shared_folder``.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from gradfuse.train import TrainConfig, Trainer, TrainingInterrupted, checkpoint, sharded_checkpoint

STEPS = 3


def shared_folder(name: str, pytest_pid: int | None = None) -> Path:
    """A folder the two ranks and their parent (the pytest process) name the same way."""
    return Path(tempfile.gettempdir(), f"gradfuse-sharded-{pytest_pid or os.getppid()}", name)


def model(shard: bool) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 7), nn.Tanh(), nn.Linear(7, 3))
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(net)
    return net


def train(net: nn.Module, steps: int, seed: int) -> torch.optim.Optimizer:
    """A few AdamW steps on data that differs per ``seed`` (so the moments are not zero)."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        net(torch.randn(4, 6, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_state(net: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every weight and optimizer moment, unsharded, keyed by parameter name."""
    names = {p: n for n, p in net.named_parameters()}
    state = {f"model.{n}": full(t).clone() for n, t in net.state_dict().items()}
    for p, moments in opt.state.items():
        for key, value in moments.items():
            state[f"optimizer.{names[p]}.{key}"] = full(value).clone()
    return state


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def metadata_keys(folder: Path) -> set[str]:
    """The keys DCP's metadata in ``folder`` lists (``optimizer.state.<parameter>.<key>``, ...)."""
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)


def fresh_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=1e-2)


class Captured(logging.Handler):
    """The gradfuse.train warnings logged while it is installed."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("gradfuse.train").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("gradfuse.train").removeHandler(self)


# --- the module on its own -------------------------------------------------------------------


def round_trip_on_two_ranks(rank, world):
    """Saved on 2 ranks, loaded on 2 ranks into a fresh sharded model: every shard, every moment
    and each rank's own part come back exactly; keep_last keeps the newest; the folder holds
    DCP's files and one file per rank."""
    folder = shared_folder("round-trip")
    net = model(shard=True)
    opt = train(net, STEPS, seed=rank)
    own = {"rng": checkpoint.rng_state(), "data": {"epoch": 1, "position": 3 + rank, "epoch_rng_state": None}}
    for step in (1, 2, 3):
        path = sharded_checkpoint.save(
            folder, step, net, opt, shared={"note": "shared"}, own=own, keep_last=2, group=dist.group.WORLD
        )
    assert path == folder / "step-00000003"
    assert [p.name for p in checkpoint.list_checkpoints(folder)] == ["step-00000002", "step-00000003"]
    names = sorted(p.name for p in path.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "rank-00000.pt", "rank-00001.pt", "trainer.pt"]
    assert not [p for p in folder.iterdir() if p.name.startswith(".saving-")]
    want = full_state(net, opt)

    again = model(shard=True)
    opt_again = fresh_optimizer(again)
    state = sharded_checkpoint.load(path, again, opt_again, group=dist.group.WORLD)
    assert_same(full_state(again, opt_again), want)
    for mine, theirs in zip(again.parameters(), net.parameters(), strict=True):  # this rank's own shard
        assert torch.equal(mine.to_local(), theirs.to_local())
    assert state["step"] == 3 and state["note"] == "shared" and state["world_size"] == 2
    recorded = [name for part in state["ranks"] for name in part["files"]]  # each shard's CRC-32, once
    assert sorted(recorded) == ["__0_0.distcp", "__1_0.distcp"], recorded
    part = sharded_checkpoint.rank_part(state["ranks"], rank, world)
    assert part["data"] == own["data"] and torch.equal(part["rng"]["torch"], own["rng"]["torch"])
    # Training on from the loaded state equals training on from the saved one.
    train(net, 1, seed=10 + rank), train(again, 1, seed=10 + rank)
    for mine, theirs in zip(again.parameters(), net.parameters(), strict=True):
        assert torch.equal(mine.to_local(), theirs.to_local())


def saved_for_one_rank(rank, world):
    """Saves a 2-rank checkpoint and its full tensors for the pytest process to load alone."""
    folder = shared_folder("two-ranks")
    net = model(shard=True)
    opt = train(net, STEPS, seed=rank)
    own = {"data": {"epoch": 0, "position": 4 + 2 * rank, "epoch_rng_state": torch.get_rng_state()}}
    sharded_checkpoint.save(folder, STEPS, net, opt, own=own, keep_last=3, group=dist.group.WORLD)
    want = full_state(net, opt)
    if rank == 0:
        torch.save(want, folder / "full.pt")


def one_rank_checkpoint_loads_on_two(rank, world):
    """The checkpoint the pytest process saved alone (``save_on_one_rank``) loaded on 2 ranks
    into a sharded model: the full tensors equal the saved ones exactly; the data position is
    re-split, with the warning, and both ranks continue the one saved RNG state."""
    folder = shared_folder("one-rank")
    want = torch.load(folder / "full.pt", weights_only=True)
    net = model(shard=True)
    opt = fresh_optimizer(net)
    state = sharded_checkpoint.load(folder / f"step-{STEPS:08d}", net, opt, group=dist.group.WORLD)
    assert_same(full_state(net, opt), want)
    with Captured() as log:
        part = sharded_checkpoint.rank_part(state["ranks"], rank, world, announce=rank == 0)
    assert part["data"]["position"] == 5 // 2 and part["data"]["epoch"] == 2  # 5 batches taken, split over 2
    assert torch.equal(part["rng"]["torch"], state["ranks"][0]["rng"]["torch"])
    if rank == 0:
        (message,) = log.messages
        assert "checkpoint of 1 rank(s) on 2" in message and "data order cannot be the same" in message, message
    else:
        assert not log.messages


def save_on_one_rank(folder: Path) -> None:
    """In one process, no process group (the pytest process): a checkpoint of an unsharded
    model for ``one_rank_checkpoint_loads_on_two``."""
    net = model(shard=False)
    opt = train(net, STEPS, seed=7)
    torch.manual_seed(99)
    own = {"rng": checkpoint.rng_state(), "data": {"epoch": 2, "position": 5, "epoch_rng_state": torch.get_rng_state()}}
    sharded_checkpoint.save(folder, STEPS, net, opt, own=own)
    torch.save(full_state(net, opt), folder / "full.pt")


# --- the Trainer on FSDP2 ---------------------------------------------------------------------

TRAIN_STEPS, ACCUM = 4, 2
VOLATILE = {"samples_per_s", "tokens_per_s", "peak_mem_mb"}  # timings, not results


class Crash(Exception):
    pass


class Block(nn.Module):
    """The unit FSDP2 shards on its own (``fsdp_units=["Block"]``); its dropout draws from the
    RNG, so a resume that did not restore each rank's RNG states would differ."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.dropout(torch.tanh(self.linear(x)))


def block_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), Block(16), Block(16), nn.Linear(16, 3))  # 3 rows: sharded unevenly


LATE_FROM = 2  # idle_model's late branch is taken from the step after this one (the step-2 save's next)


class IdleParameters(nn.Module):
    """``block_model``'s layers and two more trainable parameters: ``extra``, a head forward
    never uses, and ``late``, a branch taken once the Trainer is past step ``LATE_FROM``
    (``use_late``, set by ``fsdp_trainer``'s loss): at the step-2 checkpoint neither has
    optimizer state, from step 3 on ``late`` has (the subset changes between save and resume)."""

    def __init__(self):
        super().__init__()
        self.layers = block_model()
        self.late = nn.Linear(6, 3)
        self.extra = nn.Linear(16, 3)
        self.use_late = False

    def forward(self, x):
        y = self.layers(x)
        return y + self.late(x) if self.use_late else y


def idle_model() -> nn.Module:
    net = IdleParameters()
    torch.manual_seed(1)  # the same initial weights on every rank (block_model seeds its own)
    for layer in (net.late, net.extra):
        layer.reset_parameters()
    return net


def with_state(optimizer: torch.optim.Optimizer, net: nn.Module) -> list[str]:
    """The names of the parameters ``optimizer`` holds state for."""
    return sorted(name for name, p in net.named_parameters() if optimizer.state.get(p))


def shuffled_data(rank: int, ranks: int) -> torch.utils.data.DataLoader:
    """This rank's share of 20 samples in a shuffled loader of batches of 2: on 2 ranks 5 batches
    an epoch, so epochs end inside steps 3 and 5 (the checkpoint of step 2 sits inside the
    first); one process takes all 20."""
    gen = torch.Generator().manual_seed(40)
    x, y = torch.randn(20, 6, generator=gen), torch.randn(20, 3, generator=gen)
    data = torch.utils.data.TensorDataset(x[rank::ranks], y[rank::ranks])
    return torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)


def fsdp_trainer(
    folder: Path | None,
    rank: int,
    world: int,
    crash_after=None,
    resume=None,
    eval_data=None,
    make_model=block_model,
    **overrides,
) -> Trainer:
    net = make_model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    settings = dict(
        max_steps=TRAIN_STEPS, grad_accum_steps=ACCUM, max_grad_norm=0.05, lr=1e-2, lr_schedule="cosine",
        warmup_steps=1, log_every=1, progress=False, parallel="fsdp", fsdp_units=["Block"], checkpoint_dir=folder,
        save_every=2, keep_last=2,
    )  # fmt: skip

    def loss_fn(model, batch):
        if trainer.step == crash_after:
            raise Crash
        if isinstance(model, IdleParameters):
            model.use_late = trainer.step >= LATE_FROM
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    cfg = TrainConfig(**{**settings, **overrides})
    data = shuffled_data(rank, world)
    trainer = Trainer(net, opt, data, cfg, loss_fn=loss_fn, resume=resume, eval_data=eval_data)
    return trainer


def results(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in VOLATILE} for row in rows]


class Saved:
    """An ``on_save`` callback: the paths it was given."""

    def __init__(self):
        self.paths: list[Path] = []

    def on_save(self, path):
        self.paths.append(path)


def fsdp_trainer_resumes_exactly(rank, world):
    """4 steps straight == 2 steps, a crash in step 3, a resume from the step-2 folder in a fresh
    model and optimizer, 2 steps: the same losses and the same weights, bit for bit."""
    _resumes_exactly(rank, world, "trainer-resume")


def fsdp_trainer_with_zclip_and_spike_skipping_resumes_exactly(rank, world):
    """The same with the state of a clipping policy and of spike skipping (device tensors) in
    the checkpoint: ZClip's statistics and the spike windows continue as they were."""
    health = dict(max_grad_norm=None, clip="zclip", clip_options={"warmup_steps": 1}, skip_spikes=(3, 4.0, 2))
    _resumes_exactly(rank, world, "trainer-resume-health", **health)


def fsdp_trainer_with_idle_parameters_resumes_exactly(rank, world):
    """The same with a parameter that never gets a gradient and one that gets its first after
    the checkpoint: the checkpoint holds optimizer state for the others only, the resume loads
    exactly that (pytorch/pytorch#192202: DCP asked for every parameter's, and the load failed
    with "Missing key in checkpoint state_dict: optimizer.state.extra.weight.step"), and the
    resumed run is the straight one bit for bit, late's first optimizer step included."""
    _resumes_exactly(rank, world, "trainer-resume-idle", make_model=idle_model)


def _resumes_exactly(rank: int, world: int, name: str, make_model=block_model, **overrides) -> None:
    overrides["make_model"] = make_model
    straight = fsdp_trainer(None, rank, world, save_every=None, **overrides)
    want_rows = results(straight.fit())
    want = full_state(straight.model, straight.optimizer)

    folder = shared_folder(name)
    first = fsdp_trainer(folder, rank, world, crash_after=2, **overrides)
    saved = Saved()
    first.callbacks = type(first.callbacks)([saved])
    try:
        first.fit()
        raise AssertionError("the crash did not happen")
    except Crash:
        pass
    assert saved.paths == ([folder / "step-00000002"] if rank == 0 else [])  # on_save: the folder, on rank 0
    assert [p.name for p in checkpoint.list_checkpoints(folder)] == ["step-00000002"]
    files = sorted(p.name for p in (folder / "step-00000002").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "rank-00000.pt", "rank-00001.pt", "trainer.pt"]

    single_file = checkpoint.save_checkpoint(shared_folder(f"single-file-{rank}"), 2, {"config": {}}, keep_last=1)
    try:
        fsdp_trainer(folder, rank, world, resume=single_file, **overrides)
        raise AssertionError("a single-file checkpoint was loaded into a sharded model")
    except checkpoint.CheckpointError as err:
        assert "single-file checkpoint" in str(err) and str(single_file) in str(err), err
    copy = shared_folder(f"copy-of-{name}")
    if rank == 0:
        shutil.copytree(folder / "step-00000002", copy)
    dist.barrier()
    try:  # rank 1 pointed at another folder than rank 0's (the same bytes, but nothing says so)
        fsdp_trainer(folder, rank, world, resume=folder / "step-00000002" if rank == 0 else copy, **overrides)
        raise AssertionError("the ranks loaded different checkpoints")
    except checkpoint.CheckpointError as err:
        assert "the ranks would load different checkpoints" in str(err), err

    resumed = fsdp_trainer(folder, rank, world, resume="latest", **overrides)
    assert resumed.step == 2 and resumed.resumed_from == folder / "step-00000002"
    if make_model is idle_model:  # the subset that has state at the save, then at the end
        with_layers = [n for n in with_state(resumed.optimizer, resumed.model) if n.startswith("layers.")]
        assert with_state(resumed.optimizer, resumed.model) == with_layers == with_state(first.optimizer, first.model)
        assert len(with_layers) == 8, with_layers
        assert with_state(straight.optimizer, straight.model) == sorted([*with_layers, "late.bias", "late.weight"])
    got_rows = results(resumed.fit())
    assert got_rows == want_rows[2:], (got_rows, want_rows[2:])
    assert_same(full_state(resumed.model, resumed.optimizer), want)
    assert [p.name for p in checkpoint.list_checkpoints(folder)] == ["step-00000002", "step-00000004"]


def a_signal_on_one_rank_saves_a_sharded_checkpoint_on_every_rank(rank, world):
    """SIGINT reaches rank 1 only, after step 1: both ranks finish step 2, both write their
    shards of it into one folder, and both raise TrainingInterrupted naming it; a resume
    continues from it."""
    folder = shared_folder("signal")

    class SignalOnRank1:
        def on_step_end(self, row):
            if rank == 1 and row["step"] == 1:
                os.kill(os.getpid(), signal.SIGINT)

    trainer = fsdp_trainer(folder, rank, world, save_every=None)
    trainer.callbacks = type(trainer.callbacks)([SignalOnRank1()])
    try:
        trainer.fit()
        raise AssertionError("fit() ran to the end")
    except TrainingInterrupted as stop:
        assert stop.step == trainer.step == 2 and stop.checkpoint == folder / "step-00000002", stop
        assert str(folder / "step-00000002") in str(stop)
    assert [p.name for p in checkpoint.list_checkpoints(folder)] == ["step-00000002"]
    assert checkpoint.load_checkpoint(folder / "step-00000002")["world_size"] == 2
    resumed = fsdp_trainer(folder, rank, world, resume="latest")
    assert resumed.step == 2 and [row["step"] for row in resumed.fit()] == [3, 4]


def ranks_resuming_from_a_folder_and_a_file_all_raise(rank, world):
    """Rank 0 resumes from a sharded folder, rank 1 from a single file: every rank raises
    ``CheckpointError`` naming both (rank 1 refusing alone left rank 0 waiting in the load)."""
    folder = shared_folder("folder-and-file")
    fsdp_trainer(folder, rank, world, max_steps=2).fit()  # saves step-00000002/ at its end
    single_file = checkpoint.checkpoint_path(shared_folder("folder-and-file-single"), 2)
    if rank == 1:
        checkpoint.save_checkpoint(single_file.parent, 2, {"config": {}}, keep_last=1)
    try:
        fsdp_trainer(None, rank, world, resume=folder / "step-00000002" if rank == 0 else single_file, save_every=None)
        raise AssertionError("the ranks resumed from different checkpoints")
    except checkpoint.CheckpointError as err:
        assert "single-file checkpoint" in str(err) and str(single_file) in str(err), err
        assert f"rank 0: {(folder / 'step-00000002').resolve()}" in str(err), err


def fsdp_trainer_folder_has_one_owner_on_every_rank(rank, world):
    """Rank 0 holds the folder's lock while an FSDP2 Trainer runs: a second Trainer on it is
    refused on every rank at once (no rank left waiting in a save's collectives); after the
    first finished, a fresh run is refused the folder of its step folders on every rank, and a
    resume takes it."""
    from gradfuse.train.lock import CheckpointFolderInUse
    from gradfuse.train.ownership import CheckpointFolderTaken

    folder = shared_folder("one-owner")
    first = fsdp_trainer(folder, rank, world)
    assert (first.lock is not None and first.lock.held) == (rank == 0)
    for refused, kind in [("in use by a gradfuse.Trainer", CheckpointFolderInUse), ("another run", None)]:
        if kind is None:
            first.fit()
            kind = CheckpointFolderTaken
        try:
            fsdp_trainer(folder, rank, world)
            raise AssertionError(f"a second Trainer was given {folder}")
        except (checkpoint.CheckpointError, kind) as err:
            assert refused in str(err) and isinstance(err, kind) == (rank == 0), err
    assert [p.name for p in checkpoint.list_checkpoints(folder)] == ["step-00000002", "step-00000004"]
    assert fsdp_trainer(folder, rank, world, resume="latest").step == 4


def fsdp_trainer_saved_for_one_rank(rank, world):
    """Saves a 2-rank Trainer checkpoint (step 2) and its full tensors, for the pytest process to
    resume alone (``test_fsdp_trainer_two_ranks_to_one``)."""
    _saved_for_one_rank(shared_folder("trainer-two-ranks"), rank, world, block_model)


def fsdp_trainer_with_idle_parameters_saved_for_one_rank(rank, world):
    """The same with ``idle_model``: optimizer state for some parameters only."""
    _saved_for_one_rank(shared_folder("trainer-two-ranks-idle"), rank, world, idle_model)


def _saved_for_one_rank(folder: Path, rank: int, world: int, make_model) -> None:
    trainer = fsdp_trainer(folder, rank, world, max_steps=2, make_model=make_model)
    trainer.fit()
    want = full_state(trainer.model, trainer.optimizer)
    if rank == 0:
        torch.save(want, folder / "full.pt")


def fsdp_trainer_resumes_a_one_rank_checkpoint(rank, world):
    """The checkpoint of a Trainer with parallel="fsdp" in one process (the pytest process,
    ``one_rank_trainer_checkpoint``) resumed on 2 ranks: the weights and moments equal the saved
    ones exactly, the warning says the data order changes, and training goes on."""
    _resumes_a_one_rank_checkpoint(shared_folder("trainer-one-rank"), rank, world, block_model)


def fsdp_trainer_with_idle_parameters_resumes_a_one_rank_checkpoint(rank, world):
    """The same with ``idle_model``: the state of the parameters that had one, and no other."""
    _resumes_a_one_rank_checkpoint(shared_folder("trainer-one-rank-idle"), rank, world, idle_model)


def _resumes_a_one_rank_checkpoint(folder: Path, rank: int, world: int, make_model) -> None:
    want = torch.load(folder / "full.pt", weights_only=True)
    with Captured() as log:
        trainer = fsdp_trainer(folder, rank, world, resume=folder / "step-00000002", make_model=make_model)
    assert_same(full_state(trainer.model, trainer.optimizer), want)
    warned = [m for m in log.messages if "data order cannot be the same" in m]
    assert len(warned) == (1 if rank == 0 else 0), log.messages
    assert (trainer.batches.epoch, trainer.batches.position) == (0, 2)  # the 4 batches one process took, over 2
    rows = trainer.fit()
    assert [row["step"] for row in rows] == [3, 4] and all(math.isfinite(row["loss"]) for row in rows)


def one_rank_trainer_checkpoint(folder: Path, make_model=block_model) -> None:
    """In one process (the pytest process): a Trainer with parallel="fsdp" saves step 2."""
    trainer = fsdp_trainer(folder, 0, 1, max_steps=2, make_model=make_model)
    trainer.fit()
    assert (folder / "step-00000002" / checkpoint.METADATA).is_file()
    torch.save(full_state(trainer.model, trainer.optimizer), folder / "full.pt")


def a_checkpoint_that_does_not_fit_raises_checkpoint_error_on_every_rank(rank, world):
    """Loading into a model with a parameter the checkpoint lacks (DCP's CheckpointException,
    a BaseException, on every rank), on both ranks or on rank 1 only, or into an optimizer
    with a parameter frozen on rank 1 only (refused before DCP runs): every rank raises
    ``CheckpointError`` (an Exception) naming the folder and the problem, none left waiting."""
    folder = shared_folder("misfit")
    net = model(shard=True)
    opt = train(net, STEPS, seed=rank)
    path = sharded_checkpoint.save(folder, STEPS, net, opt, group=dist.group.WORLD)

    def misfit() -> nn.Module:
        target = model(shard=False)
        target.add_module("extra", nn.Linear(2, 2))
        return target

    def frozen() -> nn.Module:
        target = model(shard=False)
        target[0].bias.requires_grad_(False)
        return target

    cases = [(misfit, {0, 1}, "Missing key in checkpoint state_dict: model.extra.weight"), (misfit, {1}, "rank 1")]
    cases.append((frozen, {1}, r"0\.bias: now frozen"))
    for make, odd_ranks, message in cases:
        target = make() if rank in odd_ranks else model(shard=False)
        try:
            sharded_checkpoint.load(path, target, fresh_optimizer(target), group=dist.group.WORLD)
        except checkpoint.CheckpointError as err:
            assert str(path) in str(err) and re.search(message, str(err)), (odd_ranks, err)
        else:
            raise AssertionError(f"loaded into a model that does not fit on ranks {odd_ranks}")


# --- a job killed while saving (run as a process of its own by the test) ----------------------


def save_then_get_killed(rank: int, world: int, init_file: str, folder: str, point: str) -> None:
    """Saves step 1 whole, then starts step 2 and stops at ``point`` until killed: ``"written"``,
    rank 1 after writing its own file (rank 0 waits for it); ``"commit"``, rank 0 with every
    file written, just before the rename (rank 1 waits for it). Prints ``paused`` when there."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    folder = Path(folder)
    net = model(shard=True)
    opt = train(net, STEPS, seed=rank)
    sharded_checkpoint.save(folder, 1, net, opt, keep_last=5, group=dist.group.WORLD)
    want = full_state(net, opt)
    if rank == 0:
        torch.save(want, folder.parent / "full-step-1.pt")
    train(net, 1, seed=50 + rank)

    def pause():
        print("paused", flush=True)
        time.sleep(600)

    if point == "written" and rank == 1:
        write_file = checkpoint.write_file

        def write_then_pause(final, state):
            write_file(final, state)
            pause()

        checkpoint.write_file = write_then_pause
    if point == "commit" and rank == 0:
        fsync_directory = checkpoint.fsync_directory

        def pause_before_rename(directory):
            fsync_directory(directory)
            if directory.name.startswith(".saving-step-"):
                pause()

        checkpoint.fsync_directory = pause_before_rename
    print("saving", flush=True)
    sharded_checkpoint.save(folder, 2, net, opt, keep_last=5, group=dist.group.WORLD)
    print("not killed", flush=True)


if __name__ == "__main__":
    save_then_get_killed(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
