"""Checkpoints and resume: exact continuation, atomic files, and bad files refused clearly.

The resume tests crash a run (an exception from the loss function, after the checkpoint and
one more step, so the metrics file runs past the checkpoint) and continue it in a fresh
model from ``resume="latest"``; the result must equal an uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import textwrap

import pytest
import torch
from test_trainer import TinyLM, adamw, config, loader

from gradfuse.train import CheckpointError, Trainer, latest_checkpoint, list_checkpoints, load_checkpoint
from gradfuse.train.checkpoint import save_checkpoint

STEPS = 8
VOLATILE = {"samples_per_s", "tokens_per_s", "peak_mem_mb"}  # timings, not results


class Crash(Exception):
    pass


def _run(folder, precision="fp32", crash_after=None, resume=None, model_seed=0, **overrides):
    model = TinyLM(seed=model_seed)
    settings = dict(
        max_steps=STEPS, grad_accum_steps=2, precision=precision, max_grad_norm=0.5, lr=1e-2, lr_schedule="cosine",
        warmup_steps=2, checkpoint_dir=folder, save_every=4, metrics_path=folder / "metrics.jsonl", log_every=1,
    )  # fmt: skip
    cfg = config(**{**settings, **overrides})

    def loss_fn(model, batch):
        if trainer.step == crash_after:
            raise Crash
        return model(**batch).loss

    # 40 samples in batches of 8, 2 per step: epochs end inside steps 3 and 5, and the
    # checkpoint of step 4 sits in the middle of the second epoch of a shuffled loader.
    trainer = Trainer(model, adamw(model), loader(40, 8), cfg, loss_fn=loss_fn, resume=resume)
    if precision == "fp16":  # an overflow at step 2: the loss scale saved at step 4 is not the initial one
        model.head.bias.register_hook(lambda g: g * math.inf if trainer.step == 1 else g)
    trainer.fit()
    return trainer


def _results(trainer, folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return (
        [p.detach() for p in trainer.model.parameters()],
        trainer.optimizer.state_dict()["state"],
        [{k: v for k, v in row.items() if k not in VOLATILE} for row in rows],
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_is_exact(tmp_path, precision):
    straight = _results(_run(tmp_path / "a", precision), tmp_path / "a")
    with pytest.raises(Crash):
        _run(tmp_path / "b", precision, crash_after=5)
    assert [p.name for p in list_checkpoints(tmp_path / "b")] == ["step-00000004.pt"]
    resumed_trainer = _run(tmp_path / "b", precision, resume="latest", model_seed=1)
    resumed = _results(resumed_trainer, tmp_path / "b")

    weights, opt_state, rows = straight
    for a, b in zip(weights, resumed[0], strict=True):
        assert torch.equal(a, b)
    for key, state in opt_state.items():
        for name, value in state.items():
            assert torch.equal(value, resumed[1][key][name]), (key, name)
    assert rows == resumed[2] and [r["step"] for r in rows] == list(range(1, STEPS + 1))
    if precision == "fp16":
        assert rows[1]["skipped"] == 1 and rows[-1]["loss_scale"] == 2.0**15
        assert resumed_trainer.scaler.get_scale() == rows[-1]["loss_scale"]


def test_keep_last_and_no_temporary_files_left(tmp_path):
    _run(tmp_path, save_every=1, keep_last=3)
    assert [p.name for p in sorted(tmp_path.iterdir())] == [
        "metrics.jsonl", "step-00000006.pt", "step-00000007.pt", "step-00000008.pt",
    ]  # fmt: skip


def test_a_truncated_checkpoint_is_a_clear_error_and_the_previous_one_still_loads(tmp_path):
    _run(tmp_path, save_every=4)
    newest = latest_checkpoint(tmp_path)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"step-00000008.pt cannot be read as a checkpoint, it may be truncated"):
        load_checkpoint(newest)
    with pytest.raises(CheckpointError, match=r"Other checkpoints in .*: step-00000004.pt"):
        _run(tmp_path, resume=newest)
    trainer = _run(tmp_path, resume=tmp_path / "step-00000004.pt", max_steps=5, save_every=None)
    assert trainer.step == 5


@pytest.mark.parametrize("content", ["text", "other dict"])
def test_a_foreign_file_is_refused(tmp_path, content):
    path = tmp_path / "step-00000001.pt"
    if content == "text":
        path.write_text("not a checkpoint\n")
        match = "cannot be read as a checkpoint"
    else:
        torch.save({"model": {}}, path)
        match = "was not written by gradfuse.Trainer"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)


def test_resume_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint file at"):
        _run(tmp_path, resume=tmp_path / "missing.pt")
    model = TinyLM()
    with pytest.raises(ValueError, match=r"resume='latest' needs TrainConfig\.checkpoint_dir"):
        Trainer(model, adamw(model), loader(), config(), resume="latest")
    trainer = _run(tmp_path / "empty", resume="latest", max_steps=2)  # nothing to resume: a fresh start
    assert trainer.step == 2


# A child process saves a good checkpoint, then starts a second save and stops at the given
# point (half of the file written, or all of it written and not yet renamed) until killed.
CHILD = textwrap.dedent(
    """
    import io, os, sys, time
    import torch
    from gradfuse.train import checkpoint

    folder, stall = sys.argv[1], sys.argv[2]
    checkpoint.save_checkpoint(folder, 1, {"weights": torch.arange(10.0)}, keep_last=5)

    def announce_and_wait():
        print("saving", flush=True)
        time.sleep(120)

    if stall == "write":
        real_save = torch.save

        def half_then_wait(obj, f):
            buffer = io.BytesIO()
            real_save(obj, buffer)
            f.write(buffer.getvalue()[: buffer.tell() // 2])
            f.flush()
            announce_and_wait()

        torch.save = half_then_wait
    else:
        os.fsync = lambda fd: announce_and_wait()
    checkpoint.save_checkpoint(folder, 2, {"weights": torch.zeros(100_000)}, keep_last=5)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("stall", ["write", "fsync"])
def test_a_process_killed_while_saving_leaves_the_last_good_checkpoint(tmp_path, stall):
    command = [sys.executable, "-c", CHILD, str(tmp_path), stall]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 60)  # a hang is a failure, not a wait
            line = proc.stdout.readline() if ready else ""
            assert line == "saving\n", proc.stderr.read() if proc.poll() is not None else "no sign of the save in 60 s"
        finally:
            proc.kill()
            proc.wait(timeout=30)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001.pt"]
    assert torch.equal(load_checkpoint(latest_checkpoint(tmp_path))["weights"], torch.arange(10.0))
    (leftover,) = [p for p in tmp_path.iterdir() if p.name.startswith(".saving-")]  # the killed save's
    save_checkpoint(tmp_path, 3, {"weights": torch.ones(2)}, keep_last=5)
    assert not leftover.exists() and [p.name for p in list_checkpoints(tmp_path)][-1] == "step-00000003.pt"
    assert os.listdir(tmp_path) and proc.returncode != 0
