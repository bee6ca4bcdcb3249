"""The benchmark and the CLI: a quick CPU run's records, and the checks that keep a bench from
reporting a fast wrong answer. Nothing here asserts speed; the bench only reports it."""

import dataclasses
import json
import math
from datetime import datetime

import pytest
import torch
from bench_runs import run_bench

import gradfuse
from gradfuse.__main__ import main
from gradfuse.bench import engine
from gradfuse.bench.measure import BenchError, Device
from gradfuse.bench.workloads import HOST_APIS, HOST_COUNTS, Workload

# The CPU list: every one must be measured, with torch and gradfuse side by side.
CPU_WORKLOADS = {
    "clip_2000x4096_fp32_active": (2000, 3),
    "clip_2000x4096_fp32_inactive": (2000, 1),
    "clip_gpt2_fp32_active": (148, 3),
    "clip_gpt2_fp32_inactive": (148, 1),
    "clip_gpt2_bf16_active": (148, 3),
    "clip_gpt2_bf16_inactive": (148, 1),
    "amp_gpt2_fp32_active": (148, 3),
    "amp_gpt2_fp32_inactive": (148, 2),  # unscaling always writes: one read/write pass
    "accumulate_gpt2_bf16": (148, None),
    "buckets_2000x4096_fp32_active": (2000, 3),
    "buckets_2000x4096_fp32_inactive": (2000, 1),
    "ddp_transformer_fp32": (29, 1),  # the quick model's parameters; bytes: the gradients reduced
    "fsdp_transformer_fp32": (29, 1),  # the same model, sharded by FSDP2; bytes: its gradients
    "step_gpt2_fp32_active": (148, 8),  # the norm's read, then AdamW's 4 reads and 3 writes
    "trainer_gpt2small_fp32": (28, 1),  # the quick model's parameters; bytes: its gradients
    "stats_gpt2_fp32": (148, 1),  # one read
    "zclip_gpt2_fp32": (148, 1),  # the norm's read (no clipping after the warm-up)
    "agc_gpt2_fp32": (148, 3),  # read weights and gradients, write gradients
    "health_gpt2small_fp32": (28, 1),  # the trainer workload's model; bytes: its gradients
}
ITEMSIZE = {"fp32": 4, "bf16": 2}
REQUIRED = {
    "workload": str,
    "family": str,
    "impl": str,
    "dtype": str,
    "median_us": float,
    "p25_us": float,
    "p75_us": float,
    "reps": int,
    "device": str,
    "device_type": str,
    "n_tensors": int,
    "numel": int,
    "bytes": int,
    "gbps": float,
    "copy_frac": float,
    "versions": dict,
    "date": str,
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc, doc = run_bench(out)
    return proc, out, doc


@pytest.mark.slow
def test_quick_run_writes_one_json_and_one_markdown_file(quick_run):
    proc, out, doc = quick_run
    names = sorted(p.suffix for p in out.iterdir())
    assert names == [".json", ".md", ".png"]  # the chart of speedups (matplotlib is a dependency)
    (json_path,) = out.glob("*.json")
    assert json_path.name.startswith("cpu_") and "_quick" in json_path.name
    assert doc["schema"] == 1 and doc["failures"] == [] and doc["complete"] is True
    md = next(out.glob("*.md")).read_text()
    table = proc.stdout
    for name in CPU_WORKLOADS:
        assert name in md and name in table
    assert "speedup" in table and "gradfuse" in table


@pytest.mark.slow
def test_records_have_the_schema(quick_run):
    _, _, doc = quick_run
    for record in doc["records"]:
        for key, kind in REQUIRED.items():
            assert isinstance(record[key], kind), (key, record)
        assert record["device_type"] == "cpu" and record["quick"] is True
        assert record["background_load"] is None or record["background_load"] >= 0
        assert "host_us" not in record and "launches" not in record  # CUDA only
        assert {"torch", "gradfuse", "python"} <= set(record["versions"])
        assert record["versions"]["gradfuse"] == gradfuse.__version__
        assert record["versions"]["torch"] == torch.__version__
        datetime.fromisoformat(record["date"])
        assert 0 < record["p25_us"] <= record["median_us"] <= record["p75_us"]
        assert math.isfinite(record["median_us"])
        assert record["reps"] == (5 if record["workload"] != "copy" else 2 * 5)  # copies: before and after
        assert record["gbps"] == pytest.approx(record["bytes"] / record["median_us"] / 1e3, rel=1e-9)


@pytest.mark.slow
def test_every_workload_has_torch_and_gradfuse_and_consistent_speedups(quick_run):
    _, _, doc = quick_run
    by_workload = {}
    for record in doc["records"]:
        by_workload.setdefault(record["workload"], {})[record["impl"]] = record
    assert set(by_workload) == {"copy", *CPU_WORKLOADS}
    assert set(by_workload["accumulate_gpt2_bf16"]) == {"torch", "gradfuse", "torch_foreach"}
    assert set(by_workload["buckets_2000x4096_fp32_active"]) == {"torch", "gradfuse", "gradfuse_dropin"}
    ddp = by_workload["ddp_transformer_fp32"]
    assert set(ddp) == {f"{impl}{part}" for impl in ("torch", "gradfuse") for part in ("", ":after_backward", ":clip")}
    # Bytes read and written after backward: torch's norm read and clip read/write on top of
    # fused AdamW's 7 passes, which are all gradfuse has left (the hook measured in backward).
    for impl, passes in (("torch", 10), ("gradfuse", 7)):
        assert ddp[impl]["after_backward_bytes"] == passes * ddp[impl]["numel"] * 4
    fsdp = by_workload["fsdp_transformer_fp32"]
    parts = {f"{impl}{part}" for impl in ("torch", "gradfuse") for part in ("", ":after_backward", ":clip")}
    assert set(fsdp) == {*parts, "trainer"}
    for record in fsdp.values():  # per rank: FSDP2 holds half of what DDP holds on 2 ranks (a shard of each)
        assert 0.4 < record["state_mb"] / record["ddp_state_mb"] < 0.6, record
    assert set(by_workload["trainer_gpt2small_fp32"]) == {
        "torch", "gradfuse", "gradfuse_tokens", "torch:grads", "gradfuse:grads",
    }  # fmt: skip
    assert set(by_workload["stats_gpt2_fp32"]) == {"torch", "gradfuse", "gradfuse_norm"}
    for name, (n_tensors, passes) in CPU_WORKLOADS.items():
        impls = by_workload[name]
        assert {"torch", "gradfuse"} <= set(impls), name
        for impl, record in impls.items():
            whole, colon, part = impl.partition(":")  # a part of a step: against torch's same part
            torch_median = impls["torch" + colon + part]["median_us"]
            assert record["n_tensors"] == n_tensors
            assert record["speedup"] == pytest.approx(torch_median / record["median_us"], rel=1e-9), (name, impl)
            if part:  # the part's fraction of its implementation's whole step
                assert record["share"] == pytest.approx(record["median_us"] / impls[whole]["median_us"], rel=1e-9)
            else:
                assert record["share"] is None
            # The same algorithmic bytes for every implementation of a workload.
            assert record["bytes"] == impls["torch"]["bytes"]
            dtype = record["dtype"]
            if passes is None:
                assert dtype == "fp32+=bf16" and record["bytes"] == record["numel"] * (4 + 2 + 4)
            else:
                assert record["bytes"] == passes * record["numel"] * ITEMSIZE[dtype], name
        assert impls["torch"]["speedup"] == 1.0


@pytest.mark.slow
def test_copy_baseline_is_present_and_every_bandwidth_is_a_fraction_of_it(quick_run):
    _, _, doc = quick_run
    (copy,) = [r for r in doc["records"] if r["workload"] == "copy"]
    assert copy["impl"] == "torch" and copy["copy_frac"] == 1.0 and copy["speedup"] is None
    assert copy["bytes"] == 2 * copy["numel"] * 4 >= 2 * 64 * 2**20  # read + write, quick: 64 MiB
    assert copy["gbps"] > 0
    for record in doc["records"]:
        assert record["copy_frac"] == pytest.approx(record["gbps"] / copy["gbps"], rel=1e-9)


# --- in process: the checks that catch a wrong or drifting implementation -----------------


def _run(workload: str, reps: int = 2):
    family, shape_set, dtype, *mode = workload.split("_")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return engine.run_workload(Workload(family, shape_set, dtypes[dtype], *mode), Device(quick=True), reps)


def test_in_process_run_measures_every_call():
    result = _run("clip_2000x4096_fp32_active", reps=3)
    assert set(result.impls) == {"torch", "gradfuse"}
    assert all(len(r.times_us) == 3 and min(r.times_us) > 0 for r in result.impls.values())


def test_a_clip_that_does_not_rescale_is_reported_as_wrong(monkeypatch):
    monkeypatch.setattr(
        gradfuse, "clip_grad_norm_", lambda params, max_norm: gradfuse.get_total_norm([p.grad for p in params])
    )
    with pytest.raises(BenchError, match="gradfuse gradients after one call"):
        _run("clip_2000x4096_fp32_active")


def test_an_inaccurate_norm_is_reported_as_wrong(monkeypatch):
    clip = gradfuse.clip_grad_norm_
    monkeypatch.setattr(gradfuse, "clip_grad_norm_", lambda params, max_norm: clip(params, max_norm) * (1 + 1e-3))
    with pytest.raises(BenchError, match="fp64 norm"):
        _run("clip_gpt2_bf16_inactive")


def test_a_clip_that_stops_rescaling_after_the_first_call_is_caught(monkeypatch):
    """The first call is right (it passes the comparison with torch); later calls only measure.
    The schedule check sees the next norm on the same buffers 1/0.9 too large."""
    clip, calls = gradfuse.clip_grad_norm_, []

    def lazy_clip(params, max_norm):
        calls.append(1)
        return clip(params, max_norm) if len(calls) == 1 else gradfuse.get_total_norm([p.grad for p in params])

    monkeypatch.setattr(gradfuse, "clip_grad_norm_", lazy_clip)
    with pytest.raises(BenchError, match="did not rescale"):
        _run("clip_gpt2_fp32_active")


def test_amp_that_sets_found_inf_on_finite_gradients_is_caught(monkeypatch):
    unscale_and_clip = gradfuse.unscale_and_clip_

    def flagging(tensors, inv_scale, found_inf, max_norm):
        total = unscale_and_clip(tensors, inv_scale, found_inf, max_norm)
        found_inf.fill_(1.0)
        return total

    monkeypatch.setattr(gradfuse, "unscale_and_clip_", flagging)
    with pytest.raises(BenchError, match="found_inf"):
        _run("amp_gpt2_fp32_active")


def test_a_bucket_clip_that_does_not_rescale_is_caught(monkeypatch):
    from gradfuse.bench import cases

    monkeypatch.setattr(cases, "_bucket_clip", lambda params, max_norm: params.buckets.get_total_norm())
    with pytest.raises(BenchError, match="gradfuse gradients after one call"):
        _run("buckets_2000x4096_fp32_active")


def test_a_step_that_does_not_clip_is_caught(monkeypatch):
    from gradfuse.bench import training

    real = training._gradfuse_step

    def unclipped(s, max_norm):
        return real(s, math.inf)

    monkeypatch.setattr(training, "_gradfuse_step", unclipped)
    with pytest.raises(BenchError, match=r"gradfuse (weights|exp_avg) after one step"):
        _run("step_gpt2_fp32_active")


def test_a_trainer_step_that_does_not_clip_is_caught(monkeypatch):
    from gradfuse.bench import training

    make = training.TrainerFamily.new_set_for

    def unclipped(self, impl):
        state = make(self, impl)
        if impl == "gradfuse":
            state.config = dataclasses.replace(state.config, max_grad_norm=None)
        return state

    monkeypatch.setattr(training.TrainerFamily, "new_set_for", unclipped)
    with pytest.raises(BenchError, match=r"Trainer (weights|exp_avg) after one step"):
        _run("trainer_gpt2small_fp32")


def test_wrong_accumulation_is_caught(monkeypatch):
    monkeypatch.setattr(gradfuse, "accumulate_", lambda dst, src: gradfuse.ops.accumulate_(dst, src, alpha=0.5))
    with pytest.raises(BenchError, match="gradfuse sums"):
        _run("accumulate_gpt2_bf16")


# --- the command line ---------------------------------------------------------------------


def test_a_run_stopped_part_way_keeps_the_records_of_the_workloads_it_finished(tmp_path, monkeypatch):
    """The files are written after each workload: a run stopped by a time limit (here an
    interrupt at the second workload) leaves the first one's records, marked incomplete."""
    real = engine.run_workload

    def stopped_at_the_second(workload, device, reps):
        if workload.name == "clip_gpt2_fp32_inactive":
            raise KeyboardInterrupt  # where a time limit's signal lands
        return real(workload, device, reps)

    monkeypatch.setattr(engine, "run_workload", stopped_at_the_second)
    workloads = ["clip_gpt2_fp32_active", "clip_gpt2_fp32_inactive"]
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "--device", "cpu", "--quick", "--workloads", *workloads, "--out", str(tmp_path)])
    (json_path,) = tmp_path.glob("*.json")
    doc = json.loads(json_path.read_text())
    assert doc["complete"] is False and doc["failures"] == []
    assert {(r["workload"], r["impl"]) for r in doc["records"]} == {
        ("copy", "torch"),
        ("clip_gpt2_fp32_active", "torch"),
        ("clip_gpt2_fp32_active", "gradfuse"),
    }
    assert "clip_gpt2_fp32_active" in json_path.with_suffix(".md").read_text()
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md"]  # no chart, no temporary file


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"gradfuse {gradfuse.__version__}"


def test_unknown_command_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_no_command_is_an_error(capsys):
    assert main([]) == 2
    assert "a command is required" in capsys.readouterr().err


def test_unknown_workload_is_a_clear_error(capsys, tmp_path):
    assert main(["bench", "--device", "cpu", "--workloads", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'nope' matches no workload" in err and "clip_gpt2_fp32_active" in err
    assert not any(tmp_path.iterdir())


def test_cuda_only_workloads_are_not_offered_on_cpu(capsys):
    assert main(["bench", "--device", "cpu", "--list"]) == 0
    names = capsys.readouterr().out.split()
    # The host family (run on request, bench/host.py) is listed too.
    host = {f"host_{api}_{n}" for api in HOST_APIS for n in HOST_COUNTS}
    assert set(names) == set(CPU_WORKLOADS) | host


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is missing")
def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    assert main(["bench", "--device", "cuda", "--quick"]) == 2
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err
