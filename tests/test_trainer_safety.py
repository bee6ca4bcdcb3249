"""gradfuse.Trainer is never silently wrong: each numbered case of issue 14 gets the right result
or a clear error at the earliest moment, naming the field, file or argument.

Real components throughout: a DataLoader with worker processes, checkpoint files on disk
corrupted byte by byte, a real SIGINT/SIGTERM sent to a child process running ``fit()``.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from test_trainer import TinyLM, Tokens, adamw, config, loader

import gradfuse
from gradfuse.train import CheckpointError, Trainer, TrainingInterrupted, list_checkpoints, load_checkpoint, lr_factor

LOG = "gradfuse.train"


def _trainer(model=None, data=None, **overrides):
    model = model or TinyLM()
    return Trainer(model, adamw(model), data if data is not None else loader(), config(**overrides))


# --- 1. evaluation data that yields no batches ----------------------------------------------------


class OneWalk:
    """Re-iterable in form, empty from its second walk on (as a wrapped one-shot generator is)."""

    def __init__(self, batches):
        self.batches, self.walks = batches, 0

    def __iter__(self):
        self.walks += 1
        return iter(self.batches if self.walks == 1 else [])


def test_eval_data_that_yields_nothing_is_an_error_not_a_loss_of_zero():
    batches = list(loader(16, 8, shuffle=False))
    model = TinyLM()
    trainer = Trainer(model, adamw(model), loader(), config(max_steps=4, eval_every=2), eval_data=OneWalk(batches))
    with pytest.raises(ValueError, match=r"eval_data yielded no batches at step 4"):
        trainer.fit()
    assert trainer.step == 4  # the first evaluation (step 2) had its batches


@pytest.mark.parametrize("eval_data", ["generator", "empty list"])
def test_one_shot_or_empty_eval_data_is_refused_when_the_trainer_is_made(eval_data):
    model = TinyLM()
    data = (b for b in list(loader(16, 8))) if eval_data == "generator" else []
    kind, match = (
        (TypeError, r"eval_data is a one-shot generator") if data != [] else (ValueError, "eval_data is empty")
    )
    with pytest.raises(kind, match=match):
        Trainer(model, adamw(model), loader(), config(), eval_data=data)


def test_eval_batches_caps_an_evaluation_and_the_loss_is_their_mean():
    batches = list(loader(40, 8, shuffle=False))
    model = TinyLM()
    trainer = Trainer(model, adamw(model), loader(), config(max_steps=1, eval_batches=2), eval_data=batches)
    got = trainer.evaluate()
    assert model.training  # evaluate() put it back
    model.eval()
    with torch.no_grad():
        expected = sum(model(**b).loss.double() for b in batches[:2]) / 2
    assert got == pytest.approx(expected.item(), rel=1e-6)  # fp32 losses summed in fp64


# --- 2. resuming with changed settings --------------------------------------------------------------


def _checkpointed(folder, **overrides):
    settings = dict(max_steps=4, lr=3e-3, lr_schedule="cosine", checkpoint_dir=folder, **overrides)
    model = TinyLM()
    Trainer(model, adamw(model), loader(), config(**settings)).fit()
    return list_checkpoints(folder)[-1]


def test_resume_uses_the_lr_and_schedule_given_now_and_says_what_changed(tmp_path, caplog):
    _checkpointed(tmp_path)
    model = TinyLM(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    cfg = config(max_steps=8, lr=1e-5, lr_schedule="linear", checkpoint_dir=tmp_path)
    with caplog.at_level(logging.WARNING, LOG):
        trainer = Trainer(model, optimizer, loader(), cfg, resume="latest")
    factor = lr_factor(4, max_steps=8, warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-5 * factor)  # the very next step's
    assert optimizer.param_groups[0]["weight_decay"] == 0.05  # the optimizer given now, not the saved one
    rows = trainer.fit()
    expected = [
        1e-5 * lr_factor(s, max_steps=8, warmup_steps=0, schedule="linear", min_lr_ratio=0.0) for s in range(4, 8)
    ]
    assert [r["lr"] for r in rows] == pytest.approx(expected)
    (message,) = [r.getMessage() for r in caplog.records if "differ from the checkpoint" in r.getMessage()]
    for change in (
        "lr 0.003 -> 1e-05",
        "lr_schedule 'cosine' -> 'linear'",
        "max_steps 4 -> 8",
        "weight_decay 0.1 -> 0.05",
    ):
        assert change in message


def test_resume_with_the_same_settings_logs_nothing(tmp_path, caplog):
    _checkpointed(tmp_path)
    model = TinyLM()
    cfg = config(max_steps=4, lr=3e-3, lr_schedule="cosine", checkpoint_dir=tmp_path)
    with caplog.at_level(logging.WARNING, LOG):
        trainer = Trainer(model, adamw(model), loader(), cfg, resume="latest")
    assert trainer.step == 4 and caplog.records == []


def test_resume_keeps_the_configs_loss_scaler_rule(tmp_path):
    _checkpointed(tmp_path, precision="fp16", growth_interval=100)
    model = TinyLM()
    cfg = config(
        max_steps=6, lr=3e-3, lr_schedule="cosine", checkpoint_dir=tmp_path, precision="fp16", growth_interval=1
    )
    trainer = Trainer(model, adamw(model), loader(), cfg, resume="latest")
    scale = trainer.scaler.get_scale()
    assert trainer.scaler.get_growth_interval() == 1 and scale == 2.0**16  # the scale itself continues
    trainer.train_step()
    assert trainer.scaler.get_scale() == 2 * scale


# --- 3. a checkpoint with bytes overwritten in the middle ------------------------------------------


def _corrupt_middle(path):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = b"\xff" * 64  # NaN bit patterns in whatever tensor lies there
    path.write_bytes(bytes(data))


def test_a_checkpoint_corrupted_in_the_middle_is_refused_and_latest_falls_back(tmp_path, caplog):
    _checkpointed(tmp_path, save_every=2)
    newest = list_checkpoints(tmp_path)[-1]
    _corrupt_middle(newest)
    torch.load(newest, weights_only=True)  # torch alone reads it: the checksum is what catches it
    with pytest.raises(CheckpointError, match=r"step-00000004.pt is corrupt: the checksum \(CRC-32\)"):
        load_checkpoint(newest)
    model = TinyLM()
    with pytest.raises(CheckpointError, match=r"step-00000004\.pt is corrupt"):
        Trainer(model, adamw(model), loader(), config(checkpoint_dir=tmp_path), resume=newest)
    with caplog.at_level(logging.WARNING, LOG):
        trainer = Trainer(model, adamw(model), loader(), config(checkpoint_dir=tmp_path, max_steps=4), resume="latest")
    assert trainer.step == 2
    (message,) = [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
    assert "step-00000004.pt" in message and "newest valid one, step-00000002.pt" in message
    for state in trainer.optimizer.state.values():
        assert all(torch.isfinite(v).all() for v in state.values())


def test_latest_with_every_checkpoint_corrupt_is_an_error(tmp_path):
    _checkpointed(tmp_path, save_every=2)
    for path in list_checkpoints(tmp_path):
        _corrupt_middle(path)
    model = TinyLM()
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be used: .*step-00000004.*step-00000002"):
        Trainer(model, adamw(model), loader(), config(checkpoint_dir=tmp_path), resume="latest")


# --- 4, 5. one-shot training data; (x, y) batches without loss_fn ----------------------------------


def test_a_one_shot_generator_as_train_data_is_refused_when_the_trainer_is_made():
    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"train_data is a one-shot generator: it is used up by its first pass"):
        Trainer(model, adamw(model), (b for b in loader()), config())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_tuple_batches_without_loss_fn_say_to_pass_one_before_calling_the_model():
    calls = []
    model = torch.nn.Linear(3, 1)
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    data = [(torch.randn(4, 3), torch.randn(4, 1))]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config(max_steps=1))
    with pytest.raises(TypeError, match=r"the batch is a tuple of 2.*pass\s+Trainer\(\.\.\., loss_fn="):
        trainer.fit()
    assert calls == []


# --- 6. a skipped first step does not warn about the schedule -------------------------------------


def test_a_skipped_first_step_raises_no_scheduler_warning():
    model = TinyLM()

    def loss_fn(model, batch):
        loss = model(**batch).loss
        return loss * math.nan if trainer.step == 0 else loss

    trainer = Trainer(model, adamw(model), loader(), config(max_steps=2), loss_fn=loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = trainer.fit()
    assert rows[0]["nan_losses"] == 1 and math.isfinite(rows[1]["loss"])


# --- 7. unscale_and_clip_ refuses fp16 gradients as unscale_ does --------------------------------------


@pytest.mark.parametrize("call", ["unscale_", "unscale_and_clip_"])
def test_an_enabled_scaler_refuses_fp16_gradients_either_way(call):
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.float16))
    p.grad = torch.randn(8, dtype=torch.float16) * 1000
    before = p.grad.clone()
    optimizer = torch.optim.SGD([p], lr=0.1)
    scaler = gradfuse.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # as a loss would be, before backward
    args = (optimizer,) if call == "unscale_" else (optimizer, 1.0)
    with pytest.raises(ValueError, match=r"Attempting to unscale FP16 gradients\."):
        getattr(scaler, call)(*args)
    assert torch.equal(p.grad, before)
    norm = gradfuse.GradScaler("cpu", enabled=False).unscale_and_clip_(optimizer, math.inf)  # nothing to unscale
    assert norm.item() == pytest.approx(before.float().norm().item(), rel=1e-3)


# --- 8. a checkpoint folder that cannot be used; a full disk ------------------------------------------


def test_a_checkpoint_dir_that_cannot_be_made_is_an_error_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match=r"TrainConfig.checkpoint_dir '.*file/ckpt' cannot hold files"):
        _trainer(checkpoint_dir=tmp_path / "file" / "ckpt")


def test_a_full_disk_names_the_checkpoint_file(tmp_path, monkeypatch):
    trainer = _trainer(checkpoint_dir=tmp_path, max_steps=1)

    def no_space(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(OSError, match=r"could not write the checkpoint .*step-00000001.pt: No space left") as err:
        trainer.fit()
    assert err.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []  # the temporary file is gone


# --- 9. gradfuse demo --out FILE -----------------------------------------------------------------------


def test_demo_out_naming_a_file_is_an_error_before_building_anything(tmp_path, capsys, monkeypatch):
    from gradfuse import demo
    from gradfuse.__main__ import main

    monkeypatch.setattr(demo, "stdlib_text", lambda *a: pytest.fail("read the text before checking --out"))
    (tmp_path / "file").write_text("keep me")
    assert main(["demo", "--out", str(tmp_path / "file")]) == 2
    assert f"--out {tmp_path / 'file'} is a file" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "keep me"


# --- 10. SIGINT / SIGTERM while fit() runs -----------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, sys.argv[2])
    import torch
    from test_trainer import TinyLM, Tokens, adamw, config
    from gradfuse.train import Trainer, TrainingInterrupted

    class Announce:
        def on_step_end(self, row):
            print(json.dumps({"step": row["step"]}), flush=True)
            time.sleep(0.05)  # slow enough for the signal to land mid-run

    model = TinyLM()
    cfg = config(max_steps=10_000, checkpoint_dir=sys.argv[1], save_every=5_000, progress=False, log_every=1000)
    data = torch.utils.data.DataLoader(Tokens(64), batch_size=8, shuffle=True, num_workers=2)
    trainer = Trainer(model, adamw(model), data, cfg, callbacks=[Announce()])
    try:
        trainer.fit()
    except TrainingInterrupted as stop:
        print(json.dumps({"stopped": str(stop), "step": stop.step, "checkpoint": str(stop.checkpoint),
                          "signal": stop.signal}), flush=True)
        sys.exit(3)
    """
)


def _wait_for_line(proc, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)  # a hang is a failure, not a wait
    return proc.stdout.readline() if ready else ""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_finishes_the_step_saves_and_says_how_to_resume(tmp_path, sig):
    tests = os.path.dirname(__file__)
    command = [sys.executable, "-c", CHILD, str(tmp_path), tests]
    # A session of its own: SIGINT goes to the whole process group, DataLoader workers included,
    # as Ctrl-C at a terminal does. SIGTERM goes to the training process: torch's workers exit on
    # a SIGTERM of their own (see the README).
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with subprocess.Popen(command, **popen) as proc:
        try:
            line = _wait_for_line(proc, 90)
            assert line.startswith('{"step"'), proc.stderr.read() if proc.poll() is not None else "no step in 90 s"
            os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
            lines = []
            while (line := _wait_for_line(proc, 60)) and '"stopped"' not in line:
                lines.append(line)
            assert proc.wait(timeout=60) == 3, proc.stderr.read()
        finally:
            proc.kill()
    stop = json.loads(line)
    last_step = json.loads(lines[-1])["step"] if lines else 1
    assert stop["step"] == last_step and stop["signal"] == sig.name
    assert stop["checkpoint"] == str(tmp_path / f"step-{last_step:08d}.pt")
    assert "resume='latest'" in stop["stopped"] and f"after step {last_step} of 10000" in stop["stopped"]
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step-{last_step:08d}.pt"]
    assert load_checkpoint(tmp_path / f"step-{last_step:08d}.pt")["step"] == last_step


def test_without_checkpoint_dir_a_signal_still_stops_after_the_step_and_says_nothing_is_saved():
    class SignalAt2:
        def on_step_end(self, row):
            if row["step"] == 2:
                os.kill(os.getpid(), signal.SIGINT)

    model = TinyLM()
    trainer = Trainer(model, adamw(model), loader(), config(max_steps=10), callbacks=[SignalAt2()])
    # The handlers fit() must put back: whatever was there (SIG_IGN for SIGINT when the tests run
    # as a background job from a script, Python's default_int_handler in a terminal).
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(TrainingInterrupted, match=r"SIGINT after step 3 of 10: no checkpoint written") as stop:
        trainer.fit()  # the signal lands after step 2's sync: step 3 is the one it finishes
    assert stop.value.step == trainer.step == 3 and stop.value.checkpoint is None
    assert {sig: signal.getsignal(sig) for sig in before} == before  # handlers restored


@pytest.mark.slow
def test_the_demo_stopped_by_ctrl_c_saves_and_exits_130_without_a_traceback(tmp_path):
    command = [sys.executable, "-m", "gradfuse", "demo", "--out", str(tmp_path), "--steps", "2000"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            metrics = tmp_path / "metrics.jsonl"
            for _ in range(1200):  # up to 120 s for the first step on a loaded machine
                if metrics.is_file() and metrics.stat().st_size:
                    break
                assert proc.poll() is None, proc.stderr.read()
                select.select([], [], [], 0.1)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "stopped by SIGINT after step" in err and "--resume" in err
    (saved,) = list_checkpoints(tmp_path / "checkpoints")
    assert load_checkpoint(saved)["step"] > 0


# --- 11. progress without a terminal ---------------------------------------------------------------------


def test_progress_without_a_terminal_is_a_plain_line_every_log_every_steps(capfd):
    model = TinyLM()
    Trainer(model, adamw(model), loader(), config(max_steps=40, log_every=10, progress=True)).fit()
    err = capfd.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [line.split(" loss ")[0] for line in lines] == [f"train: step {s}/40" for s in (10, 20, 30, 40)]
    assert len(err) < 400


# --- 12. nothing to do, said --------------------------------------------------------------------------------


def test_fit_again_and_resume_with_nothing_to_resume_say_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, LOG):
        trainer = _trainer(max_steps=2, checkpoint_dir=tmp_path / "ckpt", data=loader())
        assert [r.getMessage() for r in caplog.records] == []
        model = TinyLM()
        fresh = Trainer(model, adamw(model), loader(), config(checkpoint_dir=tmp_path / "none"), resume="latest")
        assert fresh.step == 0
        assert "resume='latest': no checkpoint in" in caplog.records[-1].getMessage()
        assert "starting from step 0" in caplog.records[-1].getMessage()
        assert len(trainer.fit()) == 2
        assert trainer.fit() == []
    assert "nothing to train: already at step 2 of TrainConfig.max_steps=2" in caplog.records[-1].getMessage()


def test_train_data_from_a_dataloader_with_workers_resumes(tmp_path):
    """A real DataLoader with worker processes, through a checkpoint and a resume."""

    def run(max_steps, resume=None):
        model = TinyLM()
        data = torch.utils.data.DataLoader(Tokens(40), batch_size=8, shuffle=True, num_workers=2)
        cfg = config(max_steps=max_steps, checkpoint_dir=tmp_path / str(max_steps if resume is None else "r"))
        return Trainer(model, adamw(model), data, cfg, resume=resume).fit(), model

    _, straight = run(4)
    run(2)
    rows, resumed = run(4, resume=tmp_path / "2" / "step-00000002.pt")
    assert [r["step"] for r in rows] == [3, 4]
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))


@pytest.mark.slow
def test_the_checksum_benchmark_runs_quick():
    script = os.path.join(os.path.dirname(__file__), "..", "benches", "checkpoint.py")
    done = subprocess.run(
        [sys.executable, script, "--quick", "--reps", "1"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.splitlines()[-1])
    assert set(record["median_s"]) == {"save", "save_no_crc", "verify", "load"} and record["size_bytes"] > 0
