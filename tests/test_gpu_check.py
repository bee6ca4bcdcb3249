"""``make gpu-check``'s plumbing (tests/gpu_check.py) without a GPU: a part that hangs is stopped
at its limit with every process it started, logs are trimmed, the JUnit results of both test parts
are merged and summarised, and a dry run leaves its few files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

import gpu_check


def _alive(pid: int) -> bool:
    """Running (a killed orphan may stay a zombie until its new parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_part_past_its_limit_is_stopped_with_its_children(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "GRACE_S", 2)
    pid_file = tmp_path / "child.pid"
    # A parent that starts a child which ignores SIGTERM, then both hang (as xdist workers might).
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(600)"
    )
    part = gpu_check.Part("hang", [sys.executable, "-c", code], 3, tmp_path / "hang.log")
    start = time.monotonic()
    assert part.run() is False
    assert time.monotonic() - start < 3 + 2 * 2 + 5
    assert part.status.startswith("TIMED OUT after 3 s")
    child = int(pid_file.read_text())
    for _ in range(50):  # reaped by init once killed
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)


def test_exit_codes_and_trimmed_logs(tmp_path):
    ok = gpu_check.Part("ok", [sys.executable, "-c", "print('x\\n' * 5000)"], 60, tmp_path / "ok.log")
    assert ok.run() and ok.status == "passed"
    bad = gpu_check.Part("bad", [sys.executable, "-c", "raise SystemExit(3)"], 60, tmp_path / "bad.log")
    assert not bad.run() and bad.status == "failed (exit 3)"
    none = [sys.executable, "-c", "raise SystemExit(5)"]  # pytest: no test selected
    five = gpu_check.Part("none", none, 60, tmp_path / "n.log", ok_codes=(0, 5))
    assert five.run()
    trimmed = gpu_check.trim(ok.log.read_text())
    assert len(trimmed.splitlines()) == gpu_check.LOG_HEAD + 1 + gpu_check.LOG_TAIL
    assert "lines left out" in trimmed and len(trimmed) <= gpu_check.LOG_MAX_CHARS + 20


def test_junit_files_are_merged_and_failures_named(tmp_path):
    a, b = tmp_path / "a.xml", tmp_path / "b.xml"
    a.write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_cuda" name="test_x"><failure message="assert 3 == 2">tb</failure></testcase>'
        '<testcase classname="tests.test_cuda" name="test_y"/>'
        '<testcase classname="tests.test_cuda" name="test_z"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    b.write_text('<testsuite name="p" tests="1" failures="0" errors="0" skipped="0"><testcase name="t"/></testsuite>')
    merged = tmp_path / "m.xml"
    gpu_check.merge_junit([a, b, tmp_path / "missing.xml"], merged)
    assert len(list(ET.parse(merged).getroot().iter("testsuite"))) == 2
    lines = gpu_check.junit_summary(merged)
    assert lines[0] == "2 passed, 1 failed, 0 errors, 1 skipped"
    assert lines[1] == "  FAILURE tests.test_cuda::test_x: assert 3 == 2"


@pytest.mark.slow
def test_dry_run_leaves_a_summary_and_at_most_eight_files(tmp_path):
    out = tmp_path / "out"
    script = gpu_check.ROOT / "tests" / "gpu_check.py"
    cmd = [sys.executable, str(script), "--dry-run", "--workers", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert len(names) <= 8
    assert {"summary.txt", "cuda-tests.xml", "cuda-tests.log", "bench.log", "host-probe.log"} <= set(names)
    summary = (out / "summary.txt").read_text()
    assert "bench: passed" in summary and "cuda tests (serial): passed" in summary and "host probe: passed" in summary
    assert "n=2000: clip" in (out / "host-probe.log").read_text()
    assert "0 failed, 0 errors" in summary and "2 workloads, complete, 0 failed" in summary
    (records,) = out.glob("cpu_*.json")
    assert json.loads(records.read_text())["complete"] is True


def _orphan_maker(pid_file, then: str) -> list[str]:
    """A part whose first process starts a child that ignores SIGTERM and sleeps, then ``then``."""
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); {then}"
    )
    return [sys.executable, "-c", code]


def _gone(pid: int) -> bool:
    for _ in range(50):  # reaped by init once killed
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_a_part_that_exits_leaves_none_of_its_processes_behind(tmp_path, monkeypatch):
    """A part whose first process exits in time while something it started still runs (a hung
    xdist worker, a test's child process): that leftover would run on beside the next parts
    (the bench, whose timings and GPU memory it would share). Before the fix it was left
    running; now the part's whole process group is stopped when the part ends."""
    monkeypatch.setattr(gpu_check, "GRACE_S", 2)
    pid_file = tmp_path / "child.pid"
    part = gpu_check.Part("leaves", _orphan_maker(pid_file, "sys.exit(0)"), 30, tmp_path / "leaves.log")
    start = time.monotonic()
    assert part.run() and part.status == "passed"
    assert time.monotonic() - start < 2 * 2 + 10
    assert _gone(int(pid_file.read_text()))


STOPPED_FROM_OUTSIDE = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import gpu_check
gpu_check.GRACE_S = 2
work, out = Path({work!r}), Path({out!r})
ok = [sys.executable, "-c", "print('fine')"]
parts = [
    gpu_check.Part("versions", ok, 30, work / "versions.log"),
    gpu_check.Part("cuda tests", {hang!r}, 300, work / "parallel.log"),
    gpu_check.Part("cuda tests (serial)", ok, 30, work / "serial.log"),
    gpu_check.Part("bench", ok, 30, work / "bench.log"),
]
sys.exit(gpu_check.run_parts(out, parts, "now", dry_run=True))
"""


def test_a_check_stopped_from_outside_stops_its_part_and_leaves_a_summary(tmp_path):
    """The machine's own time limit stops ``make gpu-check`` with SIGTERM while a part runs. The
    parts run in sessions of their own (so that a part's limit can stop all of it), which that
    signal does not reach. Before the fix the check died at once: the running part (and what it
    started) ran on, and the summary still said that part was "not run". Now the check stops the
    running part's whole group, writes the summary naming it, and exits."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    pid_file = tmp_path / "child.pid"
    script = STOPPED_FROM_OUTSIDE.format(
        tests=str(gpu_check.ROOT / "tests"),
        work=str(work),
        out=str(out),
        hang=_orphan_maker(pid_file, "time.sleep(600)"),
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(300):
            if (pid_file.exists() and pid_file.read_text()) or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the check ended before its part started"
        child = int(pid_file.read_text())
        proc.terminate()
        assert proc.wait(timeout=30) != 0
    finally:
        proc.kill()
    assert _gone(child)
    summary = (out / "summary.txt").read_text()
    assert "cuda tests: STOPPED from outside after" in summary, summary
    assert "versions: passed" in summary and "bench: not run" in summary


def test_every_bench_pattern_names_cuda_workloads_and_the_host_family_is_among_them():
    """A pattern that matches nothing would stop the bench part on the GPU machine at once (a
    usage error), losing the visit's measurements: each must select CUDA workloads here."""
    from gradfuse.bench.workloads import select

    names = [w.name for w in select("cuda", gpu_check.BENCH_WORKLOADS)]
    assert names and len(names) == len(set(names))
    assert {f"host_{api}_{n}" for api in ("clip", "buckets", "scaler") for n in (1, 148, 2000, 10000)} <= set(names)
    assert not any(name.startswith("clip_sweep") for name in names)  # a visit of its own
    assert not any(name.startswith("host_moved") for name in names)  # no bar: on request, within the limit
