"""``python -m gradfuse bench``: gradfuse side by side with torch on the machine at hand.

Runs the workloads of ``workloads`` (the issue's list on CPU and GPU, plus a 1B model, 10,000
tiny tensors and a tensor-count sweep on GPU) with every implementation in one process,
interleaved, and prints a table of medians and speedups; writes JSON records, a markdown table
and, on CUDA, a chart. How each measurement is kept honest is written in ``cases`` (what a
repeated call does to the gradients) and ``engine`` (order, warm-up, checks).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from .measure import BenchError, make_device
from .workloads import available, select

__all__ = ["BenchError", "add_arguments", "bench"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where to run (default: cuda when available, else cpu)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small shapes (same tensor counts), few reps: a smoke run of a few seconds",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        metavar="NAME",
        help="run only these: family names (clip, amp, accumulate), workload names or globs",
    )
    parser.add_argument(
        "--reps",
        type=int,
        metavar="N",
        help="timed calls per implementation (default: sized per workload to a time budget; 5 with --quick)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="folder for the result files (default: benches/results if it exists here, else .)",
    )
    parser.add_argument("--list", action="store_true", help="list the workloads for the device and exit")


def default_out_dir() -> Path:
    results = Path("benches") / "results"
    return results if results.is_dir() else Path(".")


def bench(args: argparse.Namespace, command: list[str] | None = None) -> int:
    """Run the benchmark described by parsed ``args``; returns the exit status (1 when a
    workload failed, its traceback printed and the others still reported)."""
    from . import engine, host, report

    if args.reps is not None and args.reps < 1:
        raise BenchError(f"--reps must be at least 1, got {args.reps}")
    device = make_device(args.device, quick=args.quick)
    if args.list:
        for workload in available(device.type):
            print(workload.name)
        return 0
    try:
        workloads = select(device.type, args.workloads)
    except ValueError as err:
        raise BenchError(str(err)) from None
    reps = args.reps if args.reps is not None else (5 if args.quick else None)
    date = datetime.now(timezone.utc)
    tag = "-".join(args.workloads) if args.workloads else None
    out_dir = args.out if args.out is not None else default_out_dir()
    stem, command = report.file_stem(device, date, tag), command or sys.argv

    def save(run: engine.RunResult, complete: bool) -> list[Path]:
        host.slopes(run.results)  # the host family's per-tensor slopes, into its records
        records = report.build_records(run, device, date)
        return report.write_files(out_dir, stem, records, run, command, complete=complete)

    # The files are rewritten after every workload ("complete": false until the end), so that a
    # run stopped part way (a time limit, a crash, Ctrl-C) leaves the records of what finished.
    run = engine.run(device, workloads, reps, on_progress=lambda partial: save(partial, complete=False))

    host_summary = host.slopes(run.results)
    print(report.format_table(report.build_records(run, device, date)))
    if host_summary:
        print("\n" + host_summary)
    paths = save(run, complete=True)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    for name, error in run.failures:
        print(f"\n{name} FAILED:\n{error}", file=sys.stderr)
    return 1 if run.failures else 0
