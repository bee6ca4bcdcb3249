"""The README's data-parallel example runs as written: two ranks under torchrun (on this
machine only), ending with the ranks' weights equal."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ddp_example_under_torchrun():
    readme = (ROOT / "README.md").read_text()
    assert "torchrun --nproc-per-node 2 examples/ddp_hook.py" in readme
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run([*command, "examples/ddp_hook.py"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ranks in sync" in proc.stdout
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], proc.stdout
