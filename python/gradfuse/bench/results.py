"""The records of a run: each implementation's times on a workload, and the workload's facts.

Below both runners (``engine`` in one process, ``data_parallel`` over two ranks), which fill
them in, and ``report``, which reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .workloads import Workload


@dataclass
class ImplResult:
    name: str
    times_us: list[float] = field(default_factory=list)
    host_us: list[float] = field(default_factory=list)
    launches: int | None = None
    notes: dict = field(default_factory=dict)  # workload-specific fields for the record


@dataclass
class WorkloadResult:
    workload: Workload
    n_tensors: int
    numel: int
    bytes_moved: int
    buffer_sets: int
    impls: dict[str, ImplResult]
