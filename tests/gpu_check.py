"""``make gpu-check``: what a GPU machine runs on one short visit, and what it leaves behind.

A GPU is at hand now and then, for minutes, and only a few small files come back from it. So:

1. ``versions``: Python, torch (and its CUDA), Triton, gradfuse (and where it was imported
   from), the GPU;
2. ``cuda tests``: ``pytest -m "cuda and not serial"`` in parallel (pytest-xdist, ``--workers``);
3. ``serial cuda tests``: ``pytest -m "cuda and serial"``, one at a time (tests that start
   process groups or need most of the GPU's memory);
4. ``bench``: ``python -m gradfuse bench --device cuda``, which rewrites its record files after
   every workload, so a run stopped at its limit keeps what it finished;
5. ``host probe``: ``benches/host_probe.py``, where one call's host time goes on this machine
   (the drop-in clip timed and under cProfile at 1, 148 and 2000 tensors, beside a pure-Python
   calibration loop and torch's own calls), the split the stand-in cannot show.

Each part runs in its own process group under its own time limit (SIGTERM, then SIGKILL 10 s
later, to the whole group: xdist's workers too), so one hang cannot eat the others' time; the
defaults add up to 8.5 minutes. What a part leaves running when it ends is stopped the same way
(it would run on beside the bench). SIGTERM or SIGHUP to the check itself (the machine's own
limit, which does not reach the parts' groups) stops the running part's group and writes the
files, naming that part as stopped. The output folder (``--out``; ``make`` passes ``GPU_OUT``,
which defaults to ``$OUT`` when that is set) gets at most 8 small files: ``summary.txt``,
``cuda-tests.xml`` (the JUnit XML of both test parts), ``cuda-tests.log``, ``bench.log`` and
``host-probe.log`` (trimmed), and the bench's own ``cuda_<device>_<date>.json``/``.md`` (and
``.png`` when it finished). The exit status is 0 when every part passed in time.

``--dry-run`` runs the same plumbing on a machine without a GPU: the CUDA tests collect and
skip, and the bench is a ``--quick`` CPU run of two workloads.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Every CUDA workload on one GPU but the tensor-count sweep (eight more, for the chart: run
#: ``--bench-workloads 'clip_sweep*'`` on a visit of its own), most telling first, so that a run
#: cut at its limit keeps those. zclip is listed only where the package imports (bench).
BENCH_WORKLOADS = [
    # The call path's bars first (issue 23): host time per call (~30 s), many tensors, AGC. The
    # host family's `moved` rows (no bar) are left to a visit that asks for them: the bench part
    # took 176 s of its 180 on the H100 without them.
    "clip_gpt2_*",
    "host_clip_*",
    "host_buckets_*",
    "host_scaler_*",
    "clip_2000x4096_*",
    "clip_tiny10000_*",
    "agc",
    "amp_gpt2_*",
    "accumulate_gpt2_*",
    "step",
    "trainer",
    "health",
    "buckets",
    "stats",
    "clip_llama1b_*",
    "amp_llama1b_*",
    "accumulate_llama1b_*",
]
LOG_HEAD, LOG_TAIL, LOG_MAX_CHARS = 40, 400, 60_000
GRACE_S = 10  # between SIGTERM and SIGKILL when a part runs out of time

VERSIONS = """
import platform, subprocess, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except Exception as err:
    print("triton: not importable:", err)
import gradfuse
print("gradfuse", gradfuse.__version__, "from", gradfuse.__file__)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "x", torch.cuda.device_count())
else:
    print("gpu: none (torch.cuda.is_available() is False)")
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    print("nvidia-smi", smi.stdout.strip() or smi.stderr.strip())
except Exception as err:
    print("nvidia-smi: not run:", err)
"""


@dataclass
class Part:
    name: str
    command: list[str]
    limit_s: float
    log: Path
    status: str = "not run"  # passed / failed (exit N) / TIMED OUT after N s
    seconds: float = 0.0
    started: float = 0.0  # wall clock
    ok_codes: tuple[int, ...] = (0,)

    def run(self) -> bool:
        self.started = time.time()
        start = time.monotonic()
        with open(self.log, "w") as out:
            out.write("$ " + " ".join("<script>" if "\n" in arg else arg for arg in self.command) + "\n")
            out.flush()
            proc = subprocess.Popen(
                self.command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code = proc.wait(timeout=self.limit_s)
            except subprocess.TimeoutExpired:
                code = None
            except Stopped:  # the check itself was told to stop: so is all of this part
                _stop_group(proc)
                self.seconds = time.monotonic() - start
                self.status = f"STOPPED from outside after {self.seconds:.0f} s"
                raise
            # Also after an exit in time: whatever the part started and left running (a hung
            # xdist worker, a test's child) must not run on beside the next parts.
            _stop_group(proc)
        self.seconds = time.monotonic() - start
        if code is None:
            self.status = f"TIMED OUT after {self.limit_s:.0f} s (stopped)"
        else:
            self.status = "passed" if code in self.ok_codes else f"failed (exit {code})"
        return self.status == "passed"


class Stopped(Exception):
    """SIGTERM or SIGHUP reached the check (the machine's own time limit, say)."""


def _stop(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to whatever is left of the part's whole process group, then SIGKILL to what is
    still there after GRACE_S (the part's first process may be gone while its children still
    run: xdist workers)."""
    if not _group_alive(proc):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and _group_alive(proc):
        time.sleep(0.1)
    if _group_alive(proc):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):  # one stuck in the driver: do not wait on it
        proc.wait(timeout=GRACE_S)


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader if it has exited
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def trim(text: str) -> str:
    """The first LOG_HEAD and last LOG_TAIL lines (at most LOG_MAX_CHARS, from the end)."""
    lines = text.splitlines()
    if len(lines) > LOG_HEAD + LOG_TAIL:
        lines = [*lines[:LOG_HEAD], f"[... {len(lines) - LOG_HEAD - LOG_TAIL} lines left out ...]", *lines[-LOG_TAIL:]]
    out = "\n".join(lines) + "\n"
    return out if len(out) <= LOG_MAX_CHARS else "[... cut ...]\n" + out[-LOG_MAX_CHARS:]


def merge_junit(paths: list[Path], into: Path) -> None:
    """One JUnit file holding every test suite of ``paths`` (those that exist and parse)."""
    root = ET.Element("testsuites")
    for path in paths:
        try:
            tree = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        root.extend(tree.iter("testsuite") if tree.tag == "testsuites" else [tree])
    ET.ElementTree(root).write(into, encoding="utf-8", xml_declaration=True)


def junit_summary(path: Path) -> list[str]:
    """Counts, then each failed or erroring test with its message's first line."""
    try:
        suites = list(ET.parse(path).getroot().iter("testsuite"))
    except (OSError, ET.ParseError) as err:
        return [f"no JUnit results ({err})"]
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    lines = [f"{passed} passed, {total['failures']} failed, {total['errors']} errors, {total['skipped']} skipped"]
    for case in (c for s in suites for c in s.iter("testcase")):
        for kind in ("failure", "error"):
            for bad in case.findall(kind):
                message = (bad.get("message") or bad.text or "").strip().splitlines()
                first = message[0][:200] if message else ""
                lines.append(f"  {kind.upper()} {case.get('classname')}::{case.get('name')}: {first}")
    return lines


def bench_summary(out_dir: Path, started_after: float = 0.0) -> list[str]:
    """The newest bench record file written since ``started_after``: one line per implementation."""
    files = sorted(
        (p for p in out_dir.glob("*_*.json") if p.stat().st_mtime >= started_after), key=lambda p: p.stat().st_mtime
    )
    if not files:
        return ["no bench records were written"]
    doc = json.loads(files[-1].read_text())
    records = doc["records"]
    workloads = list(dict.fromkeys(r["workload"] for r in records if r["workload"] != "copy"))
    state = "complete" if doc.get("complete", True) else "INCOMPLETE (stopped part way)"
    lines = [f"{files[-1].name}: {len(workloads)} workloads, {state}, {len(doc['failures'])} failed"]
    copy = next((r for r in records if r["workload"] == "copy"), None)
    if copy:
        lines.append(f"  copy baseline {copy['gbps']:.0f} GB/s")
    for r in records:
        if r["workload"] != "copy" and r["impl"] != "torch":
            lines.append(
                f"  {r['workload']:<34} {r['impl']:<16} {r['median_us'] / 1e3:9.3f} ms  "
                f"{100 * r['copy_frac']:3.0f}% of copy  {r['speedup']:.2f}x torch"
            )
    lines += [f"  FAILED {f['workload']}: {f['error'].strip().splitlines()[-1][:200]}" for f in doc["failures"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = os.environ.get("OUT") or str(ROOT / "benches" / "results" / "gpu-check")
    parser.add_argument("--out", type=Path, default=Path(default_out), help="the output folder (default: $OUT)")
    parser.add_argument("--workers", type=int, default=8, help="xdist workers for the parallel CUDA tests")
    parser.add_argument("--versions-limit", type=float, default=30, help="seconds (default 30)")
    parser.add_argument("--tests-limit", type=float, default=180, help="seconds (default 180)")
    parser.add_argument("--serial-limit", type=float, default=60, help="seconds (default 60)")
    parser.add_argument("--bench-limit", type=float, default=180, help="seconds (default 180)")
    parser.add_argument("--probe-limit", type=float, default=60, help="seconds (default 60)")
    parser.add_argument(
        "--bench-workloads", nargs="+", default=None, help="bench --workloads (default: all but the sweep)"
    )
    parser.add_argument("--dry-run", action="store_true", help="the same plumbing without a GPU (see above)")
    args = parser.parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: torch sees no CUDA GPU (make gpu-check-dry runs the plumbing without one)")
            return 2

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    py = sys.executable
    device = "cpu" if args.dry_run else "cuda"
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE"]
    bench = [py, "-m", "gradfuse", "bench", "--device", device, "--out", str(out)]
    if args.dry_run:
        bench += ["--quick", "--workloads", *(args.bench_workloads or ["clip_gpt2_fp32_active", "trainer"])]
    else:
        bench += ["--workloads", *(args.bench_workloads or BENCH_WORKLOADS)]
    # Without pytest-xdist the "parallel" part runs its tests one after another (the summary says so).
    xdist = importlib.util.find_spec("xdist") is not None
    spread = ["-n", str(args.workers)] if xdist else []
    parts = [
        Part("versions", [py, "-c", VERSIONS], args.versions_limit, work / "versions.log"),
        Part(
            f"cuda tests ({f'{args.workers} workers' if xdist else 'one at a time: no pytest-xdist'})",
            [*pytest, "-m", "cuda and not serial", *spread, f"--junitxml={work / 'parallel.xml'}"],
            args.tests_limit,
            work / "parallel.log",
        ),
        Part(
            "cuda tests (serial)",
            [*pytest, "-m", "cuda and serial", f"--junitxml={work / 'serial.xml'}"],
            args.serial_limit,
            work / "serial.log",
            ok_codes=(0, 5),  # 5: no test selected
        ),
        Part("bench", bench, args.bench_limit, work / "bench.log"),
        Part("host probe", [py, str(ROOT / "benches" / "host_probe.py")], args.probe_limit, work / "host-probe.log"),
    ]
    return run_parts(out, parts, time.strftime("%Y-%m-%d %H:%M:%S %Z"), args.dry_run)


def run_parts(out: Path, parts: list[Part], started: str, dry_run: bool) -> int:
    """Runs the parts in order, writing the output files after each. SIGTERM or SIGHUP (the
    machine's own limit; the parts, in sessions of their own, do not get it) stops the running
    part's whole group, and the files then say which part was stopped."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop)
    try:
        for part in parts:
            print(f"gpu-check: {part.name} (limit {part.limit_s:.0f} s) ...", flush=True)
            part.run()
            print(f"gpu-check: {part.name}: {part.status}, {part.seconds:.0f} s", flush=True)
            # After every part, so that the files are there even if the machine is taken back early.
            summary = write_outputs(out, parts, started, dry_run)
    except Stopped as why:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # the files first
        write_outputs(out, parts, started, dry_run)
        print(f"gpu-check: stopped from outside ({why}); files in {out}", flush=True)
        return 1
    print(summary)
    print(f"gpu-check: files in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0 if all(p.status == "passed" for p in parts) else 1


def write_outputs(out: Path, parts: list[Part], started: str, dry_run: bool) -> str:
    """summary.txt, cuda-tests.xml, cuda-tests.log, bench.log and host-probe.log from what the
    parts left so far (``parts``: versions, both test parts, the bench, then the host probe when
    there is one)."""
    versions, parallel, serial, bench, *probe = parts

    def log(part: Part) -> str:
        return part.log.read_text(errors="replace") if part.log.is_file() else ""

    merge_junit([parallel.log.with_suffix(".xml"), serial.log.with_suffix(".xml")], out / "cuda-tests.xml")
    (out / "cuda-tests.log").write_text(trim(log(parallel) + "\n" + log(serial)))
    (out / "bench.log").write_text(trim(log(bench)))
    if probe:
        (out / "host-probe.log").write_text(trim(log(probe[0])))
    tests = junit_summary(out / "cuda-tests.xml")
    benched = bench_summary(out, started_after=versions.started)
    summary = "\n".join(
        [
            f"gradfuse gpu-check{' (dry run, no GPU)' if dry_run else ''}, started {started}",
            *log(versions).splitlines()[1:],
            "",
            *(f"{p.name}: {p.status}, {p.seconds:.0f} s of {p.limit_s:.0f}" for p in parts),
            "",
            "CUDA tests: " + tests[0],
            *tests[1:],
            "",
            "bench: " + benched[0],
            *benched[1:],
        ]
    )
    (out / "summary.txt").write_text(summary + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(main())
