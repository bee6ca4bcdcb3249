"""Sharded checkpoints (FSDP2 + ``torch.distributed.checkpoint``) on 2 real ranks (gloo, this
machine only) and in this process alone: exact round trips, resharding 2 -> 1 and 1 -> 2, a job
killed while saving, and damaged folders refused. Scenarios in
``sharded_checkpoint_scenarios.py``, all in one start of two processes, each reported here as
its own test."""

from __future__ import annotations

import logging
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import multiprocess
import pytest
import sharded_checkpoint_scenarios as scenarios
import torch
import torch.distributed as dist

from gradfuse.train import CheckpointError, checkpoint, list_checkpoints, load_checkpoint, resume, sharded_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

SCENARIOS = [
    "round_trip_on_two_ranks",
    "saved_for_one_rank",
    "one_rank_checkpoint_loads_on_two",
    "fsdp_trainer_resumes_exactly",
    "fsdp_trainer_with_zclip_and_spike_skipping_resumes_exactly",
    "a_signal_on_one_rank_saves_a_sharded_checkpoint_on_every_rank",
    "fsdp_trainer_saved_for_one_rank",
    "fsdp_trainer_resumes_a_one_rank_checkpoint",
    "ranks_resuming_from_a_folder_and_a_file_all_raise",
    "fsdp_trainer_with_idle_parameters_resumes_exactly",
    "fsdp_trainer_with_idle_parameters_saved_for_one_rank",
    "fsdp_trainer_with_idle_parameters_resumes_a_one_rank_checkpoint",
    "a_checkpoint_that_does_not_fit_raises_checkpoint_error_on_every_rank",
    "fsdp_trainer_folder_has_one_owner_on_every_rank",
]


@pytest.fixture(scope="module")
def shared():
    """The folder the ranks share with this process; a 1-rank checkpoint saved here first."""
    root = scenarios.shared_folder("", pytest_pid=os.getpid())
    shutil.rmtree(root, ignore_errors=True)
    scenarios.save_on_one_rank(root / "one-rank")
    scenarios.one_rank_trainer_checkpoint(root / "trainer-one-rank")
    scenarios.one_rank_trainer_checkpoint(root / "trainer-one-rank-idle", make_model=scenarios.idle_model)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def results(shared):
    return multiprocess.run("sharded_checkpoint_scenarios", SCENARIOS, world=2, deadline=180)


def test_every_scenario_is_listed():
    assert multiprocess.scenarios_in(scenarios) == set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_ranks(results, name):
    multiprocess.assert_passed(results[name])


def test_two_rank_checkpoint_loads_in_one_process(results, shared, caplog):
    """Saved by 2 ranks of a sharded model, loaded here alone into an unsharded one: every
    weight and moment equals the saved full tensor bit for bit; the data position is re-split
    with the warning."""
    multiprocess.assert_passed(results["saved_for_one_rank"])
    folder = shared / "two-ranks" / f"step-{scenarios.STEPS:08d}"
    net = scenarios.model(shard=False)
    opt = scenarios.fresh_optimizer(net)
    state = sharded_checkpoint.load(folder, net, opt)
    scenarios.assert_same(scenarios.full_state(net, opt), torch.load(folder.parent / "full.pt", weights_only=True))
    with caplog.at_level(logging.WARNING, logger="gradfuse.train"):
        part = sharded_checkpoint.rank_part(state["ranks"], 0, 1)
    assert part["data"]["position"] == 4 + 6 and part["data"]["epoch"] == 0  # both ranks' batches, on one
    assert "checkpoint of 2 rank(s) on 1" in caplog.text and "data order cannot be the same" in caplog.text


@pytest.mark.parametrize("idle", [False, True], ids=["", "idle-parameters"])
def test_fsdp_trainer_two_ranks_to_one(results, shared, caplog, idle):
    """A 2-rank FSDP2 Trainer's checkpoint resumed by a Trainer with parallel="fsdp" in this
    process alone: weights and moments equal the saved ones bit for bit, each of the two
    ranks' data positions is summed into one, with the warning; training goes on. ``idle``:
    with parameters that have no optimizer state (``scenarios.idle_model``): none after the
    load either."""
    make_model = scenarios.idle_model if idle else scenarios.block_model
    multiprocess.assert_passed(results[f"fsdp_trainer{'_with_idle_parameters' if idle else ''}_saved_for_one_rank"])
    folder = shared / f"trainer-two-ranks{'-idle' if idle else ''}"
    with caplog.at_level(logging.WARNING, logger="gradfuse.train"):
        trainer = scenarios.fsdp_trainer(folder, 0, 1, resume="latest", make_model=make_model)
    assert trainer.resumed_from == folder / "step-00000002"
    scenarios.assert_same(
        scenarios.full_state(trainer.model, trainer.optimizer), torch.load(folder / "full.pt", weights_only=True)
    )
    assert "checkpoint of 2 rank(s) on 1" in caplog.text and "data order cannot be the same" in caplog.text
    assert (trainer.batches.epoch, trainer.batches.position) == (0, 8)  # the 2 ranks' 4 batches each, on one
    if idle:
        names = scenarios.with_state(trainer.optimizer, trainer.model)
        assert len(names) == 8 and all(n.startswith("layers.") for n in names), names
    rows = trainer.fit()
    assert [row["step"] for row in rows] == [3, 4]


def test_one_process_fsdp_trainer_with_idle_parameters_resumes_exactly(tmp_path):
    """parallel="fsdp" in one process (DCP without a process group) with a parameter that never
    gets a gradient and one that gets its first after the step-2 checkpoint: 4 steps straight
    == 2 steps, a crash, a resume, 2 steps, bit for bit (before: every checkpoint failed to
    load, "Missing key in checkpoint state_dict: optimizer.state.extra.weight.step")."""
    straight = scenarios.fsdp_trainer(None, 0, 1, save_every=None, make_model=scenarios.idle_model)
    want_rows = scenarios.results(straight.fit())
    want = scenarios.full_state(straight.model, straight.optimizer)
    first = scenarios.fsdp_trainer(tmp_path, 0, 1, crash_after=2, make_model=scenarios.idle_model)
    with pytest.raises(scenarios.Crash):
        first.fit()
    resumed = scenarios.fsdp_trainer(tmp_path, 0, 1, resume="latest", make_model=scenarios.idle_model)
    assert resumed.step == 2
    assert scenarios.with_state(resumed.optimizer, resumed.model) == scenarios.with_state(first.optimizer, first.model)
    assert scenarios.results(resumed.fit()) == want_rows[2:]
    scenarios.assert_same(scenarios.full_state(resumed.model, resumed.optimizer), want)
    assert {"late.weight", "late.bias"} <= set(scenarios.with_state(resumed.optimizer, resumed.model))


def _partly_trained(optimizer_class=torch.optim.AdamW, **settings):
    """A model trained 2 steps, its middle layer in both, its first layer in the second only
    (one step count fewer), its last layer never: the optimizer has state for some parameters."""
    net = scenarios.model(shard=False)
    opt = optimizer_class(net.parameters(), lr=1e-2, **settings)
    gen = torch.Generator().manual_seed(5)
    for step in range(2):
        x = torch.randn(4, 16, generator=gen)
        if step == 1:
            x = net[0](torch.randn(4, 6, generator=gen)) + x
        net[2](torch.tanh(x)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


@pytest.mark.parametrize(
    "make",
    [
        lambda: _partly_trained(),
        lambda: _partly_trained(fused=True),
        lambda: _partly_trained(torch.optim.SGD, momentum=0.9),
    ],
    ids=["adamw", "fused-adamw", "sgd-momentum"],
)
def test_optimizer_state_of_some_parameters_round_trips(tmp_path, make):
    """Saved with state for some parameters only, loaded into a fresh optimizer and into one
    that has state for other parameters and gradients: exactly the saved state, for exactly the
    saved parameters, in both; the gradients are left as they were; one more step on each
    equals one more step on the saved optimizer, bit for bit."""
    net, opt = make()
    assert 0 < len(opt.state) < len(list(net.parameters()))  # the bug's precondition: some, not all
    path = sharded_checkpoint.save(tmp_path, 2, net, opt)
    want = scenarios.full_state(net, opt)
    fresh_net, fresh_opt = make()
    fresh_opt.state.clear()
    busy_net, busy_opt = make()
    busy_opt.state.clear()
    busy_net[4](torch.randn(2, 7)).sum().backward()  # state for the last layer only, and gradients
    busy_opt.step()
    grads = [p.grad for p in busy_net.parameters()]
    for target, target_opt in ((fresh_net, fresh_opt), (busy_net, busy_opt)):
        sharded_checkpoint.load(path, target, target_opt)
        scenarios.assert_same(scenarios.full_state(target, target_opt), want)
    assert all(a is b for a, b in zip(grads, [p.grad for p in busy_net.parameters()], strict=True))
    busy_opt.zero_grad()
    x = torch.randn(3, 6)
    for model, optimizer in ((net, opt), (fresh_net, fresh_opt), (busy_net, busy_opt)):
        model(x).square().sum().backward()
        optimizer.step()
    for a, b, c in zip(net.parameters(), fresh_net.parameters(), busy_net.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    scenarios.assert_same(scenarios.full_state(fresh_net, fresh_opt), scenarios.full_state(net, opt))


def test_a_checkpoint_with_made_up_optimizer_state_loads_without_it(tmp_path, monkeypatch):
    """A checkpoint written before this fix for an optimizer without state holds torch's
    made-up state (one step at lr 0) and says optimizer_stepped=False: it loads without it."""
    net = scenarios.model(shard=False)
    opt = scenarios.fresh_optimizer(net)

    def as_before(model, optimizer):
        states = sharded_checkpoint._dcp()[1](model, optimizer)
        optimizer.state.clear()
        return states

    monkeypatch.setattr(sharded_checkpoint, "state_to_save", as_before)
    path = sharded_checkpoint.save(tmp_path, 0, net, opt)
    assert any(k.startswith("optimizer.state.") for k in scenarios.metadata_keys(path))
    assert load_checkpoint(path)["optimizer_stepped"] is False
    again = scenarios.model(shard=False)
    opt_again = scenarios.fresh_optimizer(again)
    sharded_checkpoint.load(path, again, opt_again)
    assert not opt_again.state


def test_a_checkpoint_that_does_not_fit_raises_checkpoint_error_in_one_process(tmp_path):
    """DCP's CheckpointException derives from BaseException (``except Exception`` misses it):
    it reaches the user as CheckpointError naming the folder and DCP's reason; the optimizer is
    left as it was."""
    net = scenarios.model(shard=False)
    opt = scenarios.train(net, 1, seed=0)
    path = sharded_checkpoint.save(tmp_path, 1, net, opt)
    target = scenarios.model(shard=False)
    target_opt = scenarios.train(target, 1, seed=3)
    target.add_module("extra", torch.nn.Linear(2, 2))
    target_opt.add_param_group({"params": list(target.extra.parameters())})
    before = scenarios.full_state(target, target_opt)
    try:
        sharded_checkpoint.load(path, target, target_opt)
    except Exception as err:  # the point: an ordinary Exception
        assert isinstance(err, CheckpointError), type(err)
        assert str(path) in str(err) and "Missing key in checkpoint state_dict: model.extra.weight" in str(err)
    else:
        raise AssertionError("no error")
    after = scenarios.full_state(target, target_opt)
    assert {k for k in after if k.startswith("optimizer.")} == {k for k in before if k.startswith("optimizer.")}
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith("optimizer."))


def test_optimizer_state_the_optimizer_has_no_place_for_is_refused(tmp_path):
    """State saved for a parameter the optimizer now lacks, or that is now frozen (torch's
    set_state_dict drops a frozen parameter's state): a CheckpointError naming it, not a
    resume that silently starts that parameter's moments over; the optimizer left as it was."""
    net = scenarios.model(shard=False)
    path = sharded_checkpoint.save(tmp_path, 1, net, scenarios.train(net, 2, seed=0))
    for problem in ("not a parameter of this optimizer", "now frozen"):
        target = scenarios.model(shard=False)
        if problem == "now frozen":
            target[0].weight.requires_grad_(False)
            opt = scenarios.fresh_optimizer(target)
        else:
            opt = torch.optim.AdamW([p for name, p in target.named_parameters() if name != "0.weight"], lr=1e-2)
        with pytest.raises(CheckpointError, match=rf"{path} holds optimizer state .*\(0\.weight: {problem}"):
            sharded_checkpoint.load(path, target, opt)
        assert not opt.state


def test_one_process_fsdp_trainer_keeps_its_best_as_a_folder(tmp_path):
    """parallel="fsdp" in one process: checkpoints are folders (DCP without a process group),
    keep_best writes ``best/`` beside them, and a resume from it continues at its step."""
    eval_data = [(torch.randn(4, 6), torch.randn(4, 3))]
    trainer = scenarios.fsdp_trainer(tmp_path, 0, 1, eval_data=eval_data, keep_best=True, eval_every=1, save_every=1)
    rows = trainer.fit()
    best_step = min(rows, key=lambda row: row["eval_loss"])["step"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]  # keep_last=2
    assert load_checkpoint(tmp_path / "best")["step"] == best_step
    resumed = scenarios.fsdp_trainer(tmp_path, 0, 1, eval_data=eval_data, resume=tmp_path / "best")
    assert resumed.step == best_step and resumed.best_eval_loss == min(row["eval_loss"] for row in rows)


def _copy_of_two_rank_checkpoint(results, shared, tmp_path) -> Path:
    multiprocess.assert_passed(results["saved_for_one_rank"])
    copy = tmp_path / "checkpoints"
    shutil.copytree(shared / "two-ranks", copy)
    return copy / f"step-{scenarios.STEPS:08d}"


@pytest.mark.parametrize(
    ("damaged", "how"),
    [
        ("rank-00001.pt", "missing"),
        ("rank-00001.pt", "flipped"),
        ("trainer.pt", "missing"),
        (".metadata", "missing"),
        (".metadata", "flipped"),
        ("__1_0.distcp", "missing"),
        ("__0_0.distcp", "flipped"),
    ],
)
def test_a_damaged_folder_is_refused_naming_the_file(results, shared, tmp_path, damaged, how):
    folder = _copy_of_two_rank_checkpoint(results, shared, tmp_path)
    target = folder / damaged
    if how == "missing":
        target.unlink()
    else:
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x10  # one bit, in the middle of the file
        target.write_bytes(data)
    net = scenarios.model(shard=False)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(CheckpointError, match=rf"{target}.*(missing|corrupt|checksum)"):
        sharded_checkpoint.load(folder, net, scenarios.fresh_optimizer(net))
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))  # nothing loaded
    # resume="latest" refuses it too, saying why, and finds nothing older to fall back on.
    with pytest.raises(CheckpointError, match=str(target)):
        resume.resolve("latest", folder.parent, announce=False)


def test_files_and_folders_are_listed_and_rotated_together(tmp_path):
    checkpoint.save_checkpoint(tmp_path, 1, {"weights": torch.ones(2)}, keep_last=5)
    net = scenarios.model(shard=False)
    opt = scenarios.train(net, 1, seed=0)
    sharded_checkpoint.save(tmp_path, 2, net, opt, keep_last=5)
    checkpoint.save_checkpoint(tmp_path, 3, {"weights": torch.ones(2)}, keep_last=5)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001.pt", "step-00000002", "step-00000003.pt"]
    (tmp_path / ".saving-step-00000004").mkdir()  # what a killed sharded save leaves
    sharded_checkpoint.save(tmp_path, 4, net, opt, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003.pt", "step-00000004"]
    assert load_checkpoint(tmp_path / "step-00000004")["world_size"] == 1
    (tmp_path / ".saving-step-00000005").mkdir()  # a single-file save cleans it as well
    checkpoint.save_checkpoint(tmp_path, 5, {"weights": torch.ones(2)}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005.pt"]
    sharded_checkpoint.save(tmp_path, 4, net, opt, keep_last=2)  # the same step again replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005.pt"]


@pytest.mark.parametrize("point", ["written", "commit"])
def test_a_job_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, point):
    """Two real rank processes save step 1, then stop inside the save of step 2 (rank 1 after
    writing its part, or rank 0 just before the rename) and are killed (SIGKILL): step 1 is
    whole and is what resume="latest" picks; the next save deletes the leftover."""
    folder = tmp_path / "checkpoints"
    init_file = tmp_path / "rendezvous"
    script = Path(scenarios.__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent), *sys.path])}
    command = [sys.executable, str(script), "RANK", "2", str(init_file), str(folder), point]
    ranks = [
        subprocess.Popen(
            [str(rank) if a == "RANK" else a for a in command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    paused = ranks[1] if point == "written" else ranks[0]
    try:
        lines = []
        while "paused\n" not in lines:
            ready, _, _ = select.select([paused.stdout], [], [], 90)  # a hang is a failure, not a wait
            lines.append(paused.stdout.readline() if ready else "")
            assert lines[-1], paused.stderr.read() if paused.poll() is not None else "no pause within 90 s"
        assert lines == ["saving\n", "paused\n"], lines
    finally:
        for process in ranks:
            process.kill()  # SIGKILL: nothing of the save runs on
            process.wait(timeout=30)
            process.stdout.close()
            process.stderr.close()
    assert [p.name for p in list_checkpoints(folder)] == ["step-00000001"]
    (leftover,) = [p for p in folder.iterdir() if p.name.startswith(".saving-")]
    assert leftover.name == ".saving-step-00000002" and any(leftover.iterdir())
    path, state = resume.resolve("latest", folder, announce=False)
    assert path == folder / "step-00000001" and state["step"] == 1
    net = scenarios.model(shard=False)
    opt = scenarios.fresh_optimizer(net)
    sharded_checkpoint.load(path, net, opt)
    scenarios.assert_same(scenarios.full_state(net, opt), torch.load(tmp_path / "full-step-1.pt", weights_only=True))
    sharded_checkpoint.save(folder, 2, net, opt, keep_last=5)
    assert not leftover.exists() and [p.name for p in list_checkpoints(folder)] == ["step-00000001", "step-00000002"]


def test_the_data_position_re_split_rule():
    state = torch.get_rng_state()
    ahead = {"epoch": 3, "position": 1, "epoch_rng_state": torch.zeros(1, dtype=torch.uint8)}
    behind = [{"epoch": 2, "position": p, "epoch_rng_state": state} for p in (4, 5, 6)]
    # The epoch of the ranks furthest behind; their 15 batches over 2 ranks, rounded down.
    split = sharded_checkpoint.resplit_data([*behind, ahead], 2)
    assert (split["epoch"], split["position"]) == (2, 7) and torch.equal(split["epoch_rng_state"], state)
    assert sharded_checkpoint.resplit_data(behind, 4)["position"] == 3
    fresh = {"epoch": 0, "position": 0, "epoch_rng_state": None}  # saved before any batch
    assert sharded_checkpoint.resplit_data([fresh, fresh], 1) == fresh


def test_a_data_position_past_the_end_is_refused():
    from gradfuse.train.data import BatchStream

    stream = BatchStream([1, 2, 3])
    stream.next()
    saved = {**stream.state_dict(), "position": 5}
    with pytest.raises(ValueError, match="train_data has 3 batches in epoch 0, and the checkpoint's data position"):
        BatchStream([1, 2, 3]).load_state_dict(saved)


def test_an_optimizer_without_state_is_saved_and_loaded_without_one(tmp_path):
    """torch's get_state_dict gives an optimizer that has not stepped a made-up state (one step
    at lr 0: AdamW's step count 1). Neither the save nor the load may leave it there: the run
    would no longer be the one without a checkpoint."""
    net = scenarios.model(shard=False)
    opt = scenarios.fresh_optimizer(net)
    path = sharded_checkpoint.save(tmp_path, 0, net, opt)
    assert not opt.state
    again = scenarios.model(shard=False)
    opt_again = scenarios.fresh_optimizer(again)
    sharded_checkpoint.load(path, again, opt_again)
    assert not opt_again.state
    ref = scenarios.model(shard=False)
    for model, optimizer in [(net, opt), (again, opt_again), (ref, scenarios.fresh_optimizer(ref))]:
        model(torch.ones(2, 6)).square().sum().backward()
        optimizer.step()
    for a, b, c in zip(net.parameters(), again.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)  # as if no checkpoint had been written or read
