"""A bench run as a user starts it (``python -m gradfuse bench --device cpu --quick ...``), in a
process of its own, for the tests that read its records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_bench(out: Path, *args: str, unset: tuple[str, ...] = ("GRADFUSE_BACKEND",), timeout: float = 300):
    """``(process, records)``: the bench run in ``out`` with ``args`` after ``--quick``, the
    environment variables ``unset`` removed (the test session's backend choice, say); the run must
    succeed and leave one JSON record there."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    command = [sys.executable, "-m", "gradfuse", "bench", "--device", "cpu", "--quick", *args, "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=out, env=env)
    assert proc.returncode == 0, f"bench failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    (json_path,) = out.glob("*.json")
    return proc, json.loads(json_path.read_text())
