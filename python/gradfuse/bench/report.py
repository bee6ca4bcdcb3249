"""Records, the printed table, and the files of a run (JSON, markdown, and on CUDA a chart).

One record per (workload, implementation), plus one for the copy baseline. Times are medians
over the timed calls, in µs; ``bytes`` are the workload's algorithmic bytes (what the operation
must read and write at the least, the same for every implementation), so ``gbps`` compares
implementations the way ``speedup`` does and ``copy_frac`` says how close each comes to the
machine's copy bandwidth measured in the same run.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

import torch

import gradfuse

from .engine import BUSY, RunResult
from .measure import Device

SCHEMA = 1


def versions(device: Device) -> dict[str, str]:
    found = {"torch": torch.__version__, "gradfuse": gradfuse.__version__, "python": platform.python_version()}
    try:
        import triton

        found["triton"] = triton.__version__
    except Exception:  # not installed, or broken: the CPU bench does not need it
        pass
    return found | device.versions()


def _stats(times: list[float]) -> dict[str, float]:
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (times[0],) * 3
    return {"median_us": statistics.median(times), "p25_us": q1, "p75_us": q3, "min_us": min(times)}


def build_records(run: RunResult, device: Device, date: datetime) -> list[dict]:
    common = {
        "device": device.name,
        "device_type": device.type,
        "threads": torch.get_num_threads(),
        **({"rust_threads": _rust_threads()} if device.type == "cpu" else {}),
        "quick": device.quick,
        "background_load": run.background_load,
        "versions": versions(device),
        "date": date.isoformat(timespec="seconds"),
    }
    copy = _stats(run.copy_us)
    copy_bytes = 2 * device.copy_bytes  # read the source, write the destination
    copy_gbps = copy_bytes / copy["median_us"] / 1e3
    records = [
        {
            "workload": "copy",
            "family": "baseline",
            "mode": None,
            "shapes": f"{device.copy_bytes // 2**20}MiB",
            "impl": "torch",
            "dtype": "fp32",
            "n_tensors": 1,
            "numel": device.copy_bytes // 4,
            "bytes": copy_bytes,
            **copy,
            "reps": len(run.copy_us),
            "gbps": copy_gbps,
            "copy_frac": 1.0,
            "speedup": None,
            **common,
        }
    ]
    for result in run.results:
        wl = result.workload
        medians = {name: statistics.median(impl.times_us) for name, impl in result.impls.items()}
        for impl in result.impls.values():
            stats = _stats(impl.times_us)
            gbps = result.bytes_moved / stats["median_us"] / 1e3
            whole, part = _split(impl.name)
            record = {
                "workload": wl.name,
                "family": wl.family,
                "mode": wl.mode,
                "shapes": wl.shape_set,
                "impl": impl.name,
                "dtype": wl.dtype_label,
                "n_tensors": result.n_tensors,
                "numel": result.numel,
                "bytes": result.bytes_moved,
                **stats,
                "reps": len(impl.times_us),
                "gbps": gbps,
                "copy_frac": gbps / copy_gbps,
                # A part (``impl:part``) is compared with torch's same part.
                "speedup": medians["torch" + part] / stats["median_us"],
                # ... and is this fraction of its implementation's whole step.
                "share": stats["median_us"] / medians[whole] if part else None,
                "buffer_sets": result.buffer_sets,
                **impl.notes,
                **common,
            }
            if device.type == "cuda":
                record["host_us"] = statistics.median(impl.host_us)
                record["launches"] = impl.launches
            records.append(record)
    return records


def _split(impl: str) -> tuple[str, str]:
    """``"gradfuse:grads"`` -> ``("gradfuse", ":grads")``; ``"gradfuse"`` -> ``("gradfuse", "")``."""
    whole, colon, part = impl.partition(":")
    return whole, colon + part


def _rust_threads() -> int:
    from gradfuse import _rust

    return _rust.num_threads()


def _time(us: float) -> str:
    if us >= 1e5:
        return f"{us / 1e3:.0f} ms"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k" if n >= 1e4 else str(n)


def table_rows(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    cuda = any(r["device_type"] == "cuda" for r in records)
    header = ["workload", "impl", "dtype", "tensors", "elements", "median", "GB/s", "of copy", "speedup"]
    shares = any(r.get("share") is not None for r in records)
    if shares:
        header.append("of step")
    if cuda:
        header += ["host", "launches"]
    rows, last = [], None
    for r in records:
        first = r["workload"] != last
        last = r["workload"]
        row = [
            r["workload"] if first else "",
            r["impl"],
            r["dtype"] if first else "",
            str(r["n_tensors"]) if first else "",
            _count(r["numel"]) if first else "",
            _time(r["median_us"]),
            f"{r['gbps']:.1f}",
            f"{100 * r['copy_frac']:.0f}%",
            "" if r["speedup"] is None else f"{r['speedup']:.2f}x",
        ]
        if shares:
            row.append("" if r.get("share") is None else f"{100 * r['share']:.1f}%")
        if cuda:
            row += [_time(r["host_us"]) if "host_us" in r else "", str(r.get("launches") or "")]
        rows.append(row)
    return header, rows


def title(records: list[dict]) -> str:
    r = records[0]
    v = r["versions"]
    extra = "".join(f", {k} {v[k]}" for k in ("triton", "cuda") if k in v)
    quick = " (--quick)" if r["quick"] else ""
    load = r["background_load"]
    busy = f"; WARNING: other processes used {100 * load:.0f}% of the CPUs" if load and load > BUSY else ""
    where = f"cpu, {r['threads']} threads" if r["device_type"] == "cpu" else r["device_type"]
    return (
        f"gradfuse bench{quick}: {r['device']} ({where}), {r['date']}; "
        f"gradfuse {v['gradfuse']}, torch {v['torch']}{extra}, python {v['python']}{busy}"
    )


def format_table(records: list[dict]) -> str:
    header, rows = table_rows(records)
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    numeric = {"tensors", "elements", "median", "GB/s", "of copy", "speedup", "of step", "host", "launches"}

    def line(cells):
        return "  ".join(
            c.rjust(w) if h in numeric else c.ljust(w) for c, w, h in zip(cells, widths, header, strict=True)
        ).rstrip()

    return "\n".join([title(records), "", line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_markdown(records: list[dict]) -> str:
    header, rows = table_rows(records)
    out = [f"# {title(records)}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    out += [
        "",
        "Medians of interleaved calls. `GB/s` counts the workload's algorithmic bytes (the least the "
        "operation must read and write), `of copy` compares that with the copy baseline measured in "
        "the same run, `speedup` is torch's median over the implementation's (for a part of a step, "
        "`impl:part`, torch's same part over it; `of step` is the part's share of its implementation's "
        "whole step). See benches/README.md.",
    ]
    return "\n".join(out) + "\n"


def file_stem(device: Device, date: datetime, tag: str | None) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", device.name.lower()).strip("-") or device.type
    parts = [device.type, slug, date.strftime("%Y%m%d-%H%M%S")]
    if tag:
        parts.append(re.sub(r"[^A-Za-z0-9_.]+", "-", tag).strip("-"))
    if device.quick:
        parts.append("quick")
    return "_".join(parts)


def write_files(
    out_dir: Path, stem: str, records: list[dict], run: RunResult, command: list[str], *, complete: bool = True
) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and, for a complete run when matplotlib imports, the
    chart ``<stem>.png``; returns the paths written. Each file is replaced whole (written beside
    it, then renamed), so a run stopped while writing leaves the previous version, never half a
    file. ``complete``: False while the run is still going (the JSON says so)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema": SCHEMA,
        "command": command,
        "complete": complete,
        "records": records,
        "failures": [{"workload": name, "error": error} for name, error in run.failures],
    }
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    _replace(paths[0], json.dumps(doc, indent=1) + "\n")
    _replace(paths[1], format_markdown(records))
    chart = write_chart(out_dir / f"{stem}.png", records) if complete else None
    return paths + ([chart] if chart else [])


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_chart(path: Path, records: list[dict]) -> Path | None:
    """The run's chart: speedup against tensor count when the run has the tensor-count sweep
    (CUDA), otherwise every implementation's speedup over torch per workload. None, with a
    message, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no chart (pip install matplotlib)", file=sys.stderr)
        return None
    sweep = [r for r in records if r["shapes"].startswith("sweep") and r["impl"] != "torch"]
    bars = [r for r in records if r["speedup"] is not None and not r["impl"].startswith("torch")]
    if not bars:
        return None
    fig = _sweep_chart(plt, sweep) if sweep else _speedup_chart(plt, bars)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _sweep_chart(plt, sweep: list[dict]):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in dict.fromkeys(r["impl"] for r in sweep):
        points = sorted((r["n_tensors"], r["speedup"]) for r in sweep if r["impl"] == impl)
        ax.plot(*zip(*points, strict=True), marker="o", label=impl)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"tensors (same {_count(sweep[0]['numel'])} fp32 elements in total)")
    ax.set_ylabel("speedup over torch (wall time)")
    ax.set_title(f"clip_grad_norm_, active: {sweep[0]['device']}", fontsize=10)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return fig


def _speedup_chart(plt, bars: list[dict]):
    """Horizontal bars, one per (workload, implementation), top to bottom in run order."""
    labels = [f"{r['workload']}  {r['impl']}" for r in bars]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.28 * len(bars)))
    y = range(len(bars))[::-1]
    colors = ["tab:green" if r["speedup"] >= 1 else "tab:red" for r in bars]
    ax.barh(list(y), [r["speedup"] for r in bars], color=colors)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("speedup over torch (median wall time; log scale)")
    quick = " (--quick)" if bars[0]["quick"] else ""
    ax.set_title(f"gradfuse vs torch{quick}: {bars[0]['device']}, {bars[0]['device_type']}", fontsize=10)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    return fig
