"""The ``host`` bench family (``python -m gradfuse bench --workloads host``): host time per call
of the drop-in clip, ``GradBuckets`` and ``GradScaler`` at each tensor count, with the per-tensor
slope, and (no GPU here) the Triton path's host work through a stand-in launcher."""

from __future__ import annotations

import pytest
from bench_runs import run_bench

from gradfuse.bench.workloads import HOST_APIS, HOST_COUNTS, select


def test_the_host_family_is_run_on_request_only():
    assert not [w for w in select("cpu", None) if w.family == "host"]
    names = {w.name for w in select("cpu", ["host"])}
    assert names == {f"host_{api}_{n}" for api in HOST_APIS for n in HOST_COUNTS}


@pytest.fixture(scope="module")
def host_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-host")
    # Compiled Triton (not the interpreter the test session uses): the stand-in launcher's path.
    workloads = ["--workloads", "host_*_1", "host_*_148", "host_*_2000"]
    return run_bench(out, "--reps", "5", *workloads, unset=("GRADFUSE_BACKEND", "TRITON_INTERPRET"), timeout=600)


@pytest.mark.slow
def test_host_workloads_time_gradfuse_torch_and_the_stand_in(host_run):
    proc, doc = host_run
    by_workload = {}
    for record in doc["records"]:
        by_workload.setdefault(record["workload"], {})[record["impl"]] = record
    for api in HOST_APIS:
        for n in (1, 148, 2000):
            impls = by_workload[f"host_{api}_{n}"]
            assert set(impls) == {"torch", "gradfuse", "gradfuse_triton_standin"}, impls
            assert all(r["n_tensors"] == n and r["median_us"] > 0 for r in impls.values())
            # The slope over 148 and 2000 tensors, in every record of the API.
            assert all(isinstance(r["slope_ns"], float) for r in impls.values()), impls
    out = proc.stdout
    assert "host time per call" in out and "ns/tensor" in out
    assert "gradfuse_triton_standin: the CUDA path's host work" in out  # labelled
