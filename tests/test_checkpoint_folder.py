"""Checkpoint folders have one owner: a fresh run refuses a folder holding another run's
checkpoints unless told to resume or start over; pruning never deletes the checkpoint just
written; a second writer (another Trainer, in this process or another, or a direct save) is
refused at once by the folder's lock, and never clobbers a file. Single-file checkpoints and
sharded folders (DCP, one process here) alike. The 2-rank cases (rank 0 holds the lock; ranks
that find different checkpoints) are in ``train_dist_scenarios.py``."""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest
import sharded_checkpoint_scenarios as scenarios
import torch
from test_trainer import TinyLM, adamw, config, loader

from gradfuse.train import CheckpointError, Trainer, list_checkpoints, load_checkpoint, sharded_checkpoint
from gradfuse.train.checkpoint import save_checkpoint
from gradfuse.train.lock import LOCK_FILE, CheckpointFolderInUse
from gradfuse.train.ownership import CheckpointFolderTaken


class Saved:
    """``on_save``: the paths given, and whether each existed when it was given."""

    def __init__(self):
        self.paths = []
        self.existed = []

    def on_save(self, path):
        self.paths.append(path)
        self.existed.append(path.exists())


def trainer(folder, seed=0, callbacks=(), **overrides):
    """A TinyLM run saving every step into ``folder``, keep_last=2; ``overrides`` go to the
    config, or ``resume``/``start_over`` to the Trainer."""
    model = TinyLM(seed=seed)
    extra = {k: overrides.pop(k) for k in ("resume", "start_over") if k in overrides}
    cfg = config(**{"max_steps": 4, "checkpoint_dir": folder, "save_every": 1, "keep_last": 2, **overrides})
    return Trainer(model, adamw(model), loader(), cfg, callbacks=callbacks, **extra)


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


# --- ownership ----------------------------------------------------------------------------------


def test_a_fresh_run_refuses_a_folder_holding_another_runs_checkpoints(tmp_path):
    """The issue's case: run A leaves step-3 and step-4 (keep_last=2); a fresh run B in the
    same folder is refused at construction, naming the folder, what is in it and the ways on;
    nothing in the folder changed. a96b1fb let B train: its step-1 was deleted by its own
    pruning in the same save, and a resume after a crash loaded A's step 4."""
    trainer(tmp_path).fit()
    before = snapshot(tmp_path)
    assert sorted(before) == ["step-00000003.pt", "step-00000004.pt"]
    with pytest.raises(CheckpointFolderTaken) as refused:
        trainer(tmp_path, seed=1)
    message = str(refused.value)
    assert str(tmp_path) in message and "step-00000003.pt, step-00000004.pt" in message, message
    assert "resume='latest'" in message and "start_over=True" in message and "another checkpoint_dir" in message
    assert isinstance(refused.value, CheckpointError)
    assert snapshot(tmp_path) == before  # and the lock was let go: A can be resumed at once
    assert trainer(tmp_path, resume="latest", max_steps=5).step == 4


def test_resume_latest_in_a_folder_of_a_best_checkpoint_alone_names_a_way_that_works(tmp_path):
    """A folder holding a best checkpoint and no step checkpoint (keep_best without save_every,
    a run killed before its end): resume="latest" finds nothing to continue, and the refusal
    names the best checkpoint's path to resume from, not resume='latest' again (before: it
    advised resume='latest', the call that was refused)."""
    model = TinyLM()
    cfg = config(max_steps=2, checkpoint_dir=tmp_path, eval_every=1, keep_best=True)
    Trainer(model, adamw(model), loader(), cfg, eval_data=list(loader(16, shuffle=False))).save(best=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]
    with pytest.raises(CheckpointFolderTaken) as refused:
        trainer(tmp_path, resume="latest")
    message = str(refused.value)
    assert f"resume='{tmp_path / 'best.pt'}'" in message and "start_over=True" in message, message
    assert "pass Trainer(..., resume='latest')" not in message, message
    assert trainer(tmp_path, resume=tmp_path / "best.pt").step == 0


def test_start_over_deletes_the_other_runs_checkpoints_and_keeps_its_own(tmp_path, caplog):
    trainer(tmp_path).fit()
    saved = Saved()
    with caplog.at_level(logging.WARNING, logger="gradfuse.train"):
        b = trainer(tmp_path, seed=1, callbacks=[saved], start_over=True, max_steps=1)
    assert "deleted the 2 checkpoint(s)" in caplog.text and "step-00000004.pt" in caplog.text
    b.fit()
    assert saved.paths == [tmp_path / "step-00000001.pt"] and saved.paths[0].is_file()  # not pruned by itself
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001.pt"]
    resumed = trainer(tmp_path, seed=2, resume="latest")
    assert resumed.step == 1
    assert all(torch.equal(a, c) for a, c in zip(weights(b.model), weights(resumed.model), strict=True))


def test_start_over_and_resume_exclude_each_other(tmp_path):
    with pytest.raises(ValueError, match=r"start_over deletes the checkpoints .* resume continues"):
        trainer(tmp_path, resume="latest", start_over=True)
    with pytest.raises(ValueError, match=r"start_over=True\) deletes the checkpoints in TrainConfig.checkpoint_dir"):
        model = TinyLM()
        Trainer(model, adamw(model), loader(), config(), start_over=True)
    with pytest.raises(TypeError, match=r"start_over=\.\.\.\) must be True or False"):
        trainer(tmp_path, start_over="yes")


def test_resuming_from_elsewhere_into_a_folder_of_another_run_is_refused(tmp_path):
    """Fine-tuning from a checkpoint in another folder is a fresh run in checkpoint_dir."""
    trainer(tmp_path / "pretrain").fit()
    trainer(tmp_path / "finetune").fit()
    with pytest.raises(CheckpointFolderTaken, match="outside it"):
        trainer(tmp_path / "finetune", resume=tmp_path / "pretrain" / "step-00000004.pt", max_steps=6)
    fresh = trainer(tmp_path / "empty", resume=tmp_path / "pretrain" / "step-00000004.pt", max_steps=6)
    assert fresh.step == 4


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    """The newest checkpoint is damaged, so resume="latest" continues from the one before; with
    keep_last=1 the next save must keep what it wrote (a96b1fb kept the damaged newer one and
    deleted the new one: on_save was given a path that no longer existed)."""
    trainer(tmp_path, keep_last=3).fit()  # step-2, step-3, step-4
    (tmp_path / "step-00000004.pt").write_bytes(b"damaged")
    saved = Saved()
    resumed = trainer(tmp_path, resume="latest", keep_last=1, max_steps=4, callbacks=[saved])
    assert resumed.step == 3
    resumed.fit()
    assert saved.paths == [tmp_path / "step-00000004.pt"] and saved.existed == [True]
    assert load_checkpoint(saved.paths[0])["step"] == 4
    (tmp_path / "step-00000009.pt").write_bytes(b"damaged")  # newer than anything this run writes
    resumed = trainer(tmp_path, resume="latest", keep_last=1, max_steps=6, callbacks=[saved])
    resumed.fit()
    assert [p.name for p in saved.paths] == ["step-00000004.pt", "step-00000005.pt", "step-00000006.pt"]
    assert all(saved.existed), saved.existed
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000006.pt", "step-00000009.pt"]


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, caplog):
    """resume= an older checkpoint of the folder: its newer ones belong to the continuation this
    run replaces; they are renamed out of the rotation (kept, with a warning), so that
    resume="latest" later continues this run (a96b1fb: it picked the abandoned step 4)."""
    trainer(tmp_path, keep_last=4).fit()
    with caplog.at_level(logging.WARNING, logger="gradfuse.train"):
        branch = trainer(tmp_path, resume=tmp_path / "step-00000002.pt", max_steps=3, keep_last=4, lr=1e-3)
    assert "step-00000003.pt, step-00000004.pt" in caplog.text and "superseded-" in caplog.text
    branch.fit()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "step-00000001.pt", "step-00000002.pt", "step-00000003.pt",
        "superseded-step-00000003.pt", "superseded-step-00000004.pt",
    ]  # fmt: skip
    again = trainer(tmp_path, resume="latest", max_steps=3, keep_last=4, lr=1e-3)
    assert again.resumed_from == tmp_path / "step-00000003.pt"
    assert all(torch.equal(a, b) for a, b in zip(weights(branch.model), weights(again.model), strict=True))


def test_resuming_an_older_checkpoint_sets_the_newer_best_aside_too(tmp_path, caplog):
    """keep_best: the best checkpoint written after the one resumed from (best.pt of step 4, the
    run resumed from step 2) belongs to the continuation this run replaces, as its step files
    do: it is set aside with them, whole, instead of staying this run's best (resumed from it
    later, another run's weights) or being overwritten by this run's first improvement (the
    other continuation's best model lost)."""

    def run(**overrides):
        model = TinyLM()
        extra = {k: overrides.pop(k) for k in ("resume",) if k in overrides}
        settings = {"max_steps": 4, "checkpoint_dir": tmp_path, "save_every": 1, "keep_last": 4, "eval_every": 1}
        cfg = config(**{**settings, "keep_best": True, **overrides})
        evaluated = list(loader(16, shuffle=False))
        return Trainer(model, adamw(model), loader(), cfg, eval_data=evaluated, **extra)

    run().fit()
    best = tmp_path / "best.pt"
    other_best, other_step = best.read_bytes(), load_checkpoint(best)["step"]
    assert other_step > 2, other_step  # the eval loss fell in steps 3-4: best.pt is newer than step 2
    with caplog.at_level(logging.WARNING, logger="gradfuse.train"):
        branch = run(resume=tmp_path / "step-00000002.pt", max_steps=3, lr=1e-3)
    assert "best.pt" in caplog.text and "superseded-" in caplog.text, caplog.text
    assert not best.exists() and (tmp_path / "superseded-best.pt").read_bytes() == other_best
    branch.fit()
    assert (tmp_path / "superseded-best.pt").read_bytes() == other_best
    assert not best.exists() or load_checkpoint(best)["step"] <= 3  # only this run's own best


# --- one writer at a time -----------------------------------------------------------------------


def test_a_second_trainer_in_this_process_is_refused_at_once(tmp_path):
    """Two Trainers on one folder at once: the second is refused when it is made, naming the
    folder and the holder; the first trains and saves untouched; once its fit() returned the
    folder is free (a96b1fb: one removed or renamed the other's temporary file)."""
    first = trainer(tmp_path)
    with pytest.raises(CheckpointFolderInUse) as refused:
        trainer(tmp_path, resume="latest")
    message = str(refused.value)
    assert str(tmp_path) in message and "in this process" in message and f"pid {os.getpid()}" in message, message
    with pytest.raises(CheckpointFolderInUse, match="in use by"):
        save_checkpoint(tmp_path, 9, {"weights": torch.ones(2)}, keep_last=2)  # a direct save too
    first.fit()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003.pt", "step-00000004.pt"]
    assert not (tmp_path / LOCK_FILE).exists()  # released, and its file deleted
    second = trainer(tmp_path, resume="latest", max_steps=5)
    assert second.step == 4 and second.lock.held
    second.close()
    assert not second.lock.held
    after = trainer(tmp_path, resume="latest", max_steps=5)  # close() freed it
    after.fit()
    second.save()  # after its close(): the save takes the lock for itself, and lets it go
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_sharded_writer_is_refused_while_a_trainer_holds_the_folder(tmp_path):
    """The same through torch.distributed.checkpoint folders (parallel="fsdp" in one process):
    a second FSDP Trainer and a direct sharded save are refused; a fresh run is refused a
    folder of another run's step folders."""
    first = scenarios.fsdp_trainer(tmp_path, 0, 1)
    with pytest.raises(CheckpointFolderInUse, match="in use by"):
        scenarios.fsdp_trainer(tmp_path, 0, 1)
    net = scenarios.model(shard=False)
    with pytest.raises(CheckpointFolderInUse, match="in use by"):
        sharded_checkpoint.save(tmp_path, 7, net, scenarios.fresh_optimizer(net), keep_last=2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".saving-")]
    first.fit()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000004"]
    with pytest.raises(CheckpointFolderTaken, match="step-00000002, step-00000004"):
        scenarios.fsdp_trainer(tmp_path, 0, 1)
    assert scenarios.fsdp_trainer(tmp_path, 0, 1, resume="latest").step == 4


def test_fit_that_fails_before_its_first_step_lets_go_of_the_folder(tmp_path):
    """fit() raising while it sets up (here: the metrics file cannot be made, its folder is a
    file) lets go of the checkpoint folder as a fit() that fails in a step does: a Trainer
    made next (with the path fixed) takes the folder. (Before: the failed Trainer kept the lock
    while it lived, and the next one was refused as a second writer in this process.)"""
    (tmp_path / "not-a-folder").write_text("")
    failing = trainer(tmp_path / "run", metrics_path=tmp_path / "not-a-folder" / "metrics.jsonl")
    with pytest.raises(OSError):
        failing.fit()
    assert not failing.lock.held and not (tmp_path / "run" / LOCK_FILE).exists()
    fixed = trainer(tmp_path / "run", metrics_path=tmp_path / "metrics.jsonl", max_steps=1)
    fixed.fit()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-00000001.pt"]


HOLDER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from test_trainer import TinyLM, adamw, config, loader
    from gradfuse.train import Trainer

    model = TinyLM()
    trainer = Trainer(model, adamw(model), loader(), config(checkpoint_dir=sys.argv[1]))
    print("holding", flush=True)
    time.sleep(120)
    """
)


@pytest.mark.slow
def test_a_trainer_in_another_process_is_refused_until_that_process_dies(tmp_path):
    """Another process holds the folder (a Trainer made, not finished): a Trainer here is
    refused naming that process; once it is killed (SIGKILL: nothing of it runs on), the
    kernel has dropped its lock and the folder is free, its stale lock file notwithstanding."""
    command = [sys.executable, "-c", HOLDER, str(tmp_path), os.path.dirname(__file__)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 90)  # a hang is a failure, not a wait
            line = proc.stdout.readline() if ready else ""
            assert line == "holding\n", proc.stderr.read() if proc.poll() is not None else "no sign in 90 s"
            with pytest.raises(CheckpointFolderInUse, match=f"pid {proc.pid} on"):
                trainer(tmp_path)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    assert (tmp_path / LOCK_FILE).exists()  # left by the killed process
    trainer(tmp_path, max_steps=1).fit()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001.pt"]


FORKS = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from test_trainer import TinyLM, adamw, config, loader
    from gradfuse.train import Trainer

    model = TinyLM()
    trainer = Trainer(model, adamw(model), loader(), config(checkpoint_dir=sys.argv[1]))
    child = os.fork()
    if child == 0:  # a forked child that ends as Python programs do (atexit runs), or lets go of the Trainer
        print(trainer.lock.held, flush=True)
        trainer.close()
        sys.exit(0)
    os.waitpid(child, 0)
    print(trainer.lock.held, flush=True)
    sys.stdin.readline()  # holds the folder until told
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_ending_leaves_the_parents_lock_alone(tmp_path):
    """A process holding the folder forks (a launcher, a data worker, the user's own code); the
    child inherits the Trainer and its lock's descriptor. The child is not the holder (it cannot
    write under the parent's lock), and when it lets go of the Trainer or ends, the parent still
    holds the folder: another process is refused. (Before: the child's exit deleted the parent's
    lock file, and a second writer took the folder while the first still trained.)"""
    command = [sys.executable, "-c", FORKS, str(tmp_path), os.path.dirname(__file__)]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with subprocess.Popen(command, **pipes) as proc:
        try:
            lines = []
            for _ in range(2):
                ready, _, _ = select.select([proc.stdout], [], [], 90)  # a hang is a failure, not a wait
                lines.append(proc.stdout.readline() if ready else "")
            assert lines == ["False\n", "True\n"], (lines, proc.stderr.read() if proc.poll() is not None else "")
            assert (tmp_path / LOCK_FILE).exists()
            with pytest.raises(CheckpointFolderInUse, match=f"pid {proc.pid} on"):
                trainer(tmp_path)
        finally:
            proc.stdin.close()
            proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read()
    trainer(tmp_path, max_steps=1).fit()  # the parent has ended: the folder is free


# --- a write that fails inside torch's writer ---------------------------------------------------

FILE_SIZE_LIMIT = textwrap.dedent(
    """
    import json, resource, signal, sys
    import torch
    from gradfuse.train import checkpoint

    folder = sys.argv[1]
    checkpoint.save_checkpoint(folder, 1, {"weights": torch.arange(10.0)}, keep_last=5)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        checkpoint.save_checkpoint(folder, 2, {"weights": torch.zeros(1_000_000)}, keep_last=5)  # 4 MB
    except Exception as err:
        print(json.dumps({"type": type(err).__name__, "message": str(err), "errno": getattr(err, "errno", None)}))
    """
)


def test_a_write_past_the_file_size_limit_names_the_file_and_loses_nothing(tmp_path):
    """torch's zip writer turns the EFBIG of a write past the process's file size limit into
    ``RuntimeError: [enforce fail at inline_container.cc:671] . unexpected pos``, naming no
    file (a96b1fb). The checkpoint writer names the file and the cause, leaves no temporary
    file, and the previous checkpoint still loads."""
    out = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMIT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    error = json.loads(out.stdout)
    assert error["type"] == "OSError" and error["errno"] == errno.EFBIG, error
    message = error["message"]
    assert f"could not write the checkpoint {tmp_path / 'step-00000002.pt'}" in message, message
    assert "File too large" in message and "ulimit -f" in message and "MiB free" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001.pt"]  # nothing half-written
    assert torch.equal(load_checkpoint(tmp_path / "step-00000001.pt")["weights"], torch.arange(10.0))
