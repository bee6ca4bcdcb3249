"""``python -m gradfuse demo``, shortened: it trains, writes its files, and resumes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradfuse.__main__ import main
from gradfuse.demo import GPT, GPTConfig, Windows, stdlib_text


def test_stdlib_text_and_windows():
    text = stdlib_text(200_000)
    assert len(text) == 200_000 and b"def " in bytes(text[:50_000].tolist())
    windows = Windows(text, 128)
    item = windows[3]
    assert len(windows) == (200_000 - 1) // 128
    assert item["input_ids"][1:].tolist() == item["labels"][:-1].tolist()
    assert item["input_ids"][0] == text[3 * 128]


def test_model_returns_a_loss_and_generates():
    model = GPT(GPTConfig(ctx=16, width=32, layers=1, heads=2))
    text = Windows(stdlib_text(200_000), 16)[0]
    out = model(text["input_ids"][None], text["labels"][None])
    assert out.logits.shape == (1, 16, 256) and 5.0 < out.loss.item() < 6.0  # ~ln 256 untrained
    assert len(model.generate(b"def ", 20)) == 20


@pytest.mark.slow
def test_demo_command_trains_and_writes_metrics_checkpoint_and_chart(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["demo", "--steps", "8", "--out", str(out), "--batch-size", "8"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[-1]["step"] == 8
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5 and rows[-1]["eval_loss"] < 5.0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000004.pt", "step-00000008.pt"]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    err = capsys.readouterr().err
    assert "loss" in err and "wrote" in err and "curves.png" in err

    # Longer, from the checkpoint: the rows of the first run stay, the new ones follow.
    assert main(["demo", "--steps", "10", "--out", str(out), "--batch-size", "8", "--resume"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 8, 10] and "eval_loss" in rows[-1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000008.pt", "step-00000010.pt"]


def test_demo_rejects_a_bad_resume_and_bad_steps(tmp_path, capsys):
    assert main(["demo", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
    bad = tmp_path / "bad.pt"
    bad.write_text("nope")
    assert main(["demo", "--steps", "2", "--out", str(tmp_path), "--resume", str(bad)]) == 2
    assert "cannot be read as a checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_help_from_the_command_line():
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    proc = subprocess.run(
        [sys.executable, "-m", "gradfuse", "demo", "--help"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0 and "--precision" in proc.stdout and "--resume" in proc.stdout


@pytest.mark.slow
def test_demo_under_torchrun_trains_data_parallel(tmp_path):
    """Two ranks on this machine (a localhost rendezvous): rank 0 alone writes and reports."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = tmp_path / "ddp"
    demo = ["-m", "gradfuse", "demo", "--steps", "4", "--batch-size", "4", "--out", str(out), "--device", "cpu"]
    proc = subprocess.run([*command, *demo], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.count("2 ranks (cpu)") == 1 and proc.stderr.count("wrote ") == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 4] and rows[-1]["loss"] < rows[0]["loss"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002.pt", "step-00000004.pt"]


def test_a_missing_matplotlib_is_a_clear_message_not_a_crash(tmp_path, monkeypatch, capsys):
    from gradfuse.demo import write_chart

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert write_chart(tmp_path / "c.png", [{"step": 1, "loss": 2.0, "grad_norm": 1.0, "lr": 0.1}]) is None
    assert "matplotlib is not installed, so no chart (pip install matplotlib)" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_what_the_demo_needs_is_installed_by_pip_install():
    """The README's first command is `pip install . && python -m gradfuse demo`: every
    third-party package the demo imports is a dependency, not an extra."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[]", dep, maxsplit=1)[0] for dep in project["dependencies"]}
    assert {"torch", "numpy", "tqdm", "matplotlib"} <= names


def test_the_demo_is_the_readmes_first_command():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    assert first_block.strip() == "pip install . && python -m gradfuse demo"
