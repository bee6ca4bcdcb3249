"""Clocks and the machine: timing one call, the copy baseline, launch counts, device facts.

Everything device-specific in the benchmark lives here, behind :class:`Device`. On the CPU a
call is timed with ``perf_counter`` (the ops return when their work is done). On CUDA the
device is synchronized before each call, so every call starts on an idle GPU and its CUDA-event
interval is its whole wall time, launch overheads included; the host time is ``perf_counter``
around the same call without synchronizing.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch


class BenchError(RuntimeError):
    """The benchmark cannot run, or an implementation gave a wrong answer or broke the
    measurement's assumptions (the message says which workload, implementation and call)."""


class Device:
    """Where the workloads run, and how a call is timed there."""

    type = "cpu"
    warmup_rounds = 3  # untimed rounds per workload, the correctness round included
    budget_s = 8.0  # timed rounds per workload last about this long (without --reps) ...
    min_reps, max_reps = 10, 200  # ... within these bounds
    copy_bytes = 512 * 2**20  # the copy baseline's source buffer (the issue asks for >= 512 MB)

    def __init__(self, quick: bool = False):
        self.torch_device = torch.device(self.type)
        self.quick = quick
        if quick:
            self.copy_bytes //= 8

    @property
    def name(self) -> str:
        return cpu_model()

    @property
    def cache_bytes(self) -> int:
        """The last-level cache a small workload must not fit in (a working set over twice this
        size is read from memory)."""
        return cpu_llc_bytes()

    def buffer_sets(self, set_bytes: int) -> int:
        """How many copies of a workload's buffers to rotate over so that consecutive calls of
        one implementation find nothing in cache: enough to exceed twice the last-level cache,
        at most 16 (2 with ``--quick``)."""
        wanted = math.ceil(2 * self.cache_bytes / max(set_bytes, 1))
        return max(1, min(wanted, 2 if self.quick else 16))

    def sync(self) -> None:
        pass

    def time(self, call: Callable[[], object]) -> tuple[object, float, float | None]:
        """Run ``call`` once: (its result, wall time in µs, host time in µs or None)."""
        start = time.perf_counter()
        out = call()
        return out, (time.perf_counter() - start) * 1e6, None

    def count_launches(self, call: Callable[[], object]) -> tuple[object, int | None]:
        """Run ``call`` once under the profiler: (its result, device operations it issued)."""
        return call(), None

    def copy_times(self, reps: int) -> list[float]:
        """µs per ``dst.copy_(src)`` of ``copy_bytes``: the bandwidth every record is judged against."""
        src = torch.empty(self.copy_bytes // 4, dtype=torch.float32, device=self.torch_device).fill_(1.0)
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch of dst's pages is not part of any copy's cost
        self.sync()
        return [self.time(lambda: dst.copy_(src))[1] for _ in range(reps)]

    def versions(self) -> dict[str, str]:
        return {}


class CudaDevice(Device):
    type = "cuda"
    warmup_rounds = 5  # the first compiles the Triton kernels
    budget_s = 3.0
    min_reps, max_reps = 20, 2000
    copy_bytes = 2**30  # device-to-device copy of 1 GiB

    def __init__(self, quick: bool = False):
        if not torch.cuda.is_available():
            raise BenchError(
                f"--device cuda needs a CUDA GPU, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); "
                "use --device cpu"
            )
        super().__init__(quick)
        self.torch_device = torch.device("cuda", torch.cuda.current_device())
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._profiler_ready = False

    @property
    def name(self) -> str:
        return torch.cuda.get_device_name(self.torch_device)

    @property
    def cache_bytes(self) -> int:
        props = torch.cuda.get_device_properties(self.torch_device)
        return int(getattr(props, "L2_cache_size", 50 * 2**20))  # 50 MB: an H100's

    def sync(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def time(self, call):
        start, end = self._events
        self.sync()
        start.record()
        t0 = time.perf_counter()
        out = call()
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) * 1e3, host * 1e6

    def count_launches(self, call):
        from torch.profiler import ProfilerActivity, profile

        if not self._profiler_ready:  # CUPTI's first session starts up; keep it out of the count
            with profile(activities=[ProfilerActivity.CUDA]):
                torch.zeros(1, device=self.torch_device).add_(1)
                self.sync()
            self._profiler_ready = True
        self.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = call()
            self.sync()
        # Kernels, memsets and memcpys are the device-side events; runtime API calls are CPU-side.
        return out, sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())

    def versions(self) -> dict[str, str]:
        return {"cuda": str(torch.version.cuda)}


class BackgroundLoad:
    """How much of the machine's CPU time other processes took while this one (and the
    processes it started and waited for) ran (Linux):
    a benchmark sharing its cores with another job measures that job too. ``fraction()`` is
    their share of all cores over the interval since construction, or None where unknown."""

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        busy = (sum(map(int, fields)) - int(fields[3]) - int(fields[4])) / ticks  # all but idle, iowait
        own = os.times()  # this process and its finished children (the data-parallel ranks)
        return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system

    def fraction(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None:
            return None
        wall, busy, own = (b - a for a, b in zip(self._start, end, strict=True))
        return max(0.0, (busy - own) / (wall * (os.cpu_count() or 1)))


def make_device(kind: str | None, quick: bool = False) -> Device:
    """``cpu``, ``cuda``, or None for CUDA when available and the CPU otherwise."""
    if kind is None:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        return CudaDevice(quick)
    if kind == "cpu":
        return Device(quick)
    raise BenchError(f"unknown device {kind!r}: use cpu or cuda")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_llc_bytes(default: int = 32 * 2**20) -> int:
    """Size of the CPU's largest cache, from sysfs (Linux), else ``default``."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (entry / "size").read_text().strip()
            kind = (entry / "type").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction" or not text:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=default)
