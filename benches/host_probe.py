"""Where a call's host time goes: the drop-in clip on 1, 148 and 2000 tiny fp32 gradients (an
inactive clip, the same list again), timed plain and under cProfile, beside a pure-Python
calibration loop and torch's own per-tensor getters, so that runs on two machines can be put on
one scale; then the same clip when each call's gradients are other tensors (``moved``: the bench's
``host_moved`` rows, a loop that sets gradients to None), timed with the device busy and idle
before each call, under cProfile, beside the allocations and uploads a moved plan makes.

    python benches/host_probe.py            # CUDA when there is a GPU
    python benches/host_probe.py --standin  # the CPU tensors through the Triton path, launches
                                            # stopped at a stand-in (gradfuse.bench.host)

Prints one report (torch's clip timed beside, for scale); no files. Not a benchmark: a map for
the next change.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch

import gradfuse


def per_call_us(fn, calls: int = 300, repeats: int = 7) -> float:
    for _ in range(20):
        fn()
    sync()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return statistics.median(runs)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile(label: str, fn, calls: int = 300, top: int = 22, before=None) -> None:
    prof = cProfile.Profile()
    for k in range(calls):
        if before is not None:
            before(k)
        prof.enable()
        fn()
        prof.disable()
    sync()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda item: -item[1][2])[:top]
    print(f"---- cProfile {label}: us per clip call, own (tottime) and with callees (cumtime)")
    for (path, line, name), (_, ncalls, own, cum, _) in rows:
        where = f"{os.path.basename(path)}:{line}({name})" if line else name
        print(f"{own / calls * 1e6:9.2f} {cum / calls * 1e6:9.2f} {ncalls / calls:6.1f}x  {where}")


def calibration() -> None:
    def loop():
        total = 0
        for i in range(10_000):
            total += i & 7
        return total

    print(f"python loop of 10k additions: {per_call_us(loop, calls=50):.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--standin", action="store_true")
    args = parser.parse_args()
    if args.standin:
        from gradfuse.bench.host import _install_standin

        assert _install_standin(), "the stand-in needs Triton's NVIDIA backend"
        os.environ["GRADFUSE_BACKEND"] = "triton"
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}, standin {args.standin}, torch {torch.__version__}, gradfuse {gradfuse.__version__}")
    calibration()
    for n in (1, 148, 2000):
        params = [torch.nn.Parameter(torch.randn(16, device=device)) for _ in range(n)]
        for p in params:
            p.grad = torch.randn(16, device=device) * 1e-3

        def clip(params=params, max_norm=1e6):
            return gradfuse.clip_grad_norm_(params, max_norm)

        def grads(params=params):
            return [p.grad for p in params]

        def torch_clip(params=params, max_norm=1e6):
            return torch.nn.utils.clip_grad_norm_(params, max_norm)

        us = per_call_us(clip)
        print(
            f"n={n}: clip {us:.1f} us/call; [p.grad] {per_call_us(grads):.2f} us;"
            f" torch clip {per_call_us(torch_clip, calls=30, repeats=3):.1f} us"
        )
        if n in (1, 2000):
            profile(f"clip n={n}", clip)
    moved(device)
    empty = per_call_us(lambda: torch.empty((), device=device))
    full = per_call_us(lambda: torch.full((), 2.0, device=device))
    print(f"torch.empty(()) {empty:.2f} us; torch.full((), 2.0) {full:.2f} us")


def moved(device: torch.device, sets: int = 9) -> None:
    """The clip where each call finds other gradient tensors (``sets`` in turn: more than the
    plans kept per list shape), the setting of ``.grad`` untimed; "busy": the calls back to back,
    "idle": the device synchronized before each (as the bench's host column); "unhinted": busy,
    without the prefetch of lists known to move (``gradfuse._rust.prefetch_moving``), in turns
    with "busy"."""
    from gradfuse import _plan

    core = _plan.rust_core()
    for n in (1, 148, 2000):
        params = [torch.nn.Parameter(torch.randn(16, device=device)) for _ in range(n)]
        grad_sets = [[torch.randn(16, device=device) * 1e-3 for _ in range(n)] for _ in range(sets)]

        def use(k, params=params, grad_sets=grad_sets):
            for p, g in zip(params, grad_sets[k % len(grad_sets)], strict=True):
                p.grad = g

        def clip(params=params, max_norm=1e6):
            return gradfuse.clip_grad_norm_(params, max_norm)

        times = {"busy": [], "idle": [], "unhinted": []}
        for turn in range(4):
            for label in times:
                core.prefetch_moving(label != "unhinted")
                for k in range(100 + 100 * (turn == 0)):
                    use(k)
                    if label == "idle":
                        sync()
                    start = time.perf_counter()
                    clip()
                    if turn or k >= 100:
                        times[label].append((time.perf_counter() - start) * 1e6)
        core.prefetch_moving(True)
        sync()
        rows = [f"{label} {statistics.median(ts):.1f}" for label, ts in times.items()]
        print(f"moved n={n}: us/call {', '.join(rows)}")
        if n in (1, 148):

            def idle_use(k, use=use):
                use(k)
                sync()

            profile(f"moved clip n={n} (idle)", clip, calls=200, before=idle_use)
    if device.type != "cuda":
        return
    pinned = per_call_us(lambda: torch.empty(16, dtype=torch.int64).pin_memory())
    host = torch.empty(16, dtype=torch.int64).pin_memory()
    upload = per_call_us(lambda: host.to(device, non_blocking=True))
    zeros = per_call_us(lambda: torch.zeros(16, dtype=torch.int32, device=device))
    print(f"pin_memory() of 16 int64 {pinned:.2f} us; its upload {upload:.2f} us; torch.zeros(16) {zeros:.2f} us")


if __name__ == "__main__":
    main()
