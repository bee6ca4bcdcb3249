"""The benchmark loop: implementations side by side in one process, interleaved, medians.

For each workload every implementation gets its own buffers (rotated over several sets when the
workload is small, so that no call finds the previous one's data in cache), built from the same
pristine gradients. Then:

1. one untimed round on identical inputs, compared against torch (a fast wrong answer is an
   error, not a result);
2. more untimed warm-up rounds (on CUDA the first compiles the Triton kernels), then, on CUDA,
   one call per implementation under the profiler to count its device launches;
3. timed rounds, each calling every implementation once, in alternating order (A B, B A, ...)
   so that drifts in machine speed hit all alike; every call is checked afterwards (module
   ``cases``). The garbage collector is off while timing.

The copy baseline is measured before the first workload and after the last, pooled.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cases import FAMILY_CLASSES, Family, clear_cache
from .health import HEALTH_FAMILIES
from .host import HOST_FAMILIES
from .measure import BackgroundLoad, BenchError, Device
from .results import ImplResult, WorkloadResult
from .training import TRAINING_FAMILIES
from .workloads import Workload

#: Other processes' CPU share above which a run is flagged as disturbed.
BUSY = 0.05


def make_family(workload: Workload, device: torch.device, quick: bool) -> Family:
    return (FAMILY_CLASSES | TRAINING_FAMILIES | HEALTH_FAMILIES | HOST_FAMILIES)[workload.family](
        workload, device, quick
    )


class Runner:
    """One implementation on one workload: its buffer sets, and where each is in its schedule."""

    def __init__(self, family: Family, name: str, fn, n_sets: int):
        self.family, self.name, self.fn = family, name, fn
        self.sets = [family.new_set_for(name) for _ in range(n_sets)]
        self.calls = [0] * n_sets  # calls on each set since its last restore
        self.turn = 0
        self.result = ImplResult(name)

    def prepare(self):
        """Untimed: pick the next set, restore it if due, and bind the call to time."""
        s = self.turn % len(self.sets)
        if self.family.restore_every and self.calls[s] == self.family.restore_every:
            self.family.restore(self.sets[s])
            self.calls[s] = 0
        return self.family.bind(self.fn, self.sets[s], self.calls[s])

    def finish(self, out) -> None:
        """Untimed: check what the call did, advance the schedule."""
        s = self.turn % len(self.sets)
        try:
            self.family.verify(out, self.sets[s], self.calls[s])
        except BenchError as err:
            raise BenchError(
                f"{self.family.workload.name}: {self.name}, call {self.calls[s]} on buffer set {s}: {err}"
            ) from None
        self.calls[s] += 1
        self.turn += 1


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_workload(workload: Workload, device: Device, reps: int | None) -> WorkloadResult:
    if workload.family == "ddp":  # two processes, each timing its own steps
        from .data_parallel import run_ddp

        return run_ddp(workload, device, reps)
    if workload.family == "fsdp":  # the same, the model sharded by FSDP2
        from .fsdp import run_fsdp

        return run_fsdp(workload, device, reps)
    family = make_family(workload, device.torch_device, device.quick)
    n_sets = device.buffer_sets(family.set_bytes) if family.rotate_sets else 1
    runners = {name: Runner(family, name, fn, n_sets) for name, fn in family.impls().items()}

    # 1. Correctness: every implementation's first call, on identical inputs (set 0, call 0).
    outs = {}
    for name, runner in list(runners.items()):
        try:
            outs[name] = runner.prepare()()
            device.sync()
            runner.finish(outs[name])
        except Exception as err:
            if name in ("torch", "gradfuse"):
                raise
            _log(f"  {name} dropped from {workload.name}: {type(err).__name__}: {err}")
            del runners[name], outs[name]
    for name in [n for n in outs if n != "torch"]:
        try:
            family.compare({"torch": outs["torch"], name: outs[name]}, {n: runners[n].sets[0] for n in ("torch", name)})
        except BenchError as err:
            if name == "gradfuse":
                raise BenchError(f"{workload.name}: wrong result: {err}") from None
            _log(f"  {name} dropped from {workload.name}: wrong result: {err}")
            del runners[name], outs[name]
    del outs

    # 2. Warm-up, timing how long a round takes to size the timed part; launch counts.
    names = list(runners)
    round_s = []
    for _ in range(device.warmup_rounds - 1):
        start = time.perf_counter()
        _round(runners, names, device)
        round_s.append(time.perf_counter() - start)
    for runner in runners.values():
        out, runner.result.launches = device.count_launches(runner.prepare())
        runner.finish(out)
    if reps is None:
        per_round = statistics.median(round_s) if round_s else 1.0
        reps = max(device.min_reps, min(device.max_reps, int(device.budget_s / per_round)))

    # 3. Timed rounds, alternating the order.
    gc.collect()
    gc.disable()
    try:
        for i in range(reps):
            for name in names if i % 2 == 0 else reversed(names):
                runner = runners[name]
                call = runner.prepare()
                out, us, host = device.time(call)
                runner.finish(out)
                runner.result.times_us.append(us)
                if host is not None:
                    runner.result.host_us.append(host)
    finally:
        gc.enable()
    return WorkloadResult(
        workload,
        family.n_tensors,
        family.numel,
        family.bytes_moved,
        n_sets,
        {name: r.result for name, r in runners.items()},
    )


def _round(runners: dict[str, Runner], names: list[str], device: Device) -> None:
    for name in names:
        runner = runners[name]
        out = runner.prepare()()
        device.sync()
        runner.finish(out)


@dataclass
class RunResult:
    results: list[WorkloadResult]
    copy_us: list[float]
    failures: list[tuple[str, str]]
    background_load: float | None  # other processes' share of the CPUs during the run


def run(
    device: Device, workloads: list[Workload], reps: int | None, on_progress: Callable[[RunResult], None] | None = None
) -> RunResult:
    """Run the copy baseline and every workload; a workload that fails is reported in
    ``failures`` (name, traceback) and the others still run. ``on_progress`` gets what is done
    so far after each workload (the bench writes its files then, so that a run stopped at a
    time limit keeps the workloads it finished)."""
    background = BackgroundLoad()
    copy_reps = reps or (3 if device.quick else 10)
    _log(f"copy baseline: {device.copy_bytes / 2**20:.0f} MiB, {copy_reps} copies")
    copy_us = device.copy_times(copy_reps)
    results, failures = [], []
    for i, workload in enumerate(workloads, 1):
        start = time.perf_counter()
        _log(f"[{i}/{len(workloads)}] {workload.name}")
        try:
            result = run_workload(workload, device, reps)
        except Exception as err:
            _log(f"  FAILED: {type(err).__name__}: {err}")
            failures.append((workload.name, traceback.format_exc()))
        else:
            results.append(result)
            summary = ", ".join(f"{n} {statistics.median(r.times_us) / 1e3:.3f} ms" for n, r in result.impls.items())
            reps_done = len(next(iter(result.impls.values())).times_us)
            _log(
                f"  {summary} ({reps_done} reps, {result.buffer_sets} buffer sets, {time.perf_counter() - start:.1f} s)"
            )
        finally:
            if i == len(workloads) or workloads[i].shape_set != workload.shape_set:
                clear_cache()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if on_progress is not None:
            on_progress(RunResult(list(results), list(copy_us), list(failures), None))
    _log("copy baseline again")
    copy_us += device.copy_times(copy_reps)
    load = background.fraction()
    if load is not None and load > BUSY:
        _log(
            f"WARNING: other processes used {100 * load:.0f}% of the CPUs during this run; "
            "its timings are not trustworthy (torch's OpenMP loops suffer most): rerun on a quiet machine"
        )
    return RunResult(results, copy_us, failures, load)
