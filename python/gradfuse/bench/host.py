"""The ``host`` family: host time of one call, what a call costs before any kernel's work.

``python -m gradfuse bench --workloads host`` times the calls a training step makes, each on the
same list again, on 1, 148 (GPT-2's parameter count), 2000 and 10,000 gradients of 16 fp32
elements with an inactive clip (the coefficient is 1: the kernels' work is a read of a few bytes),
so that what is left is the host's: argument handling, the plan's confirmation, the dispatch, the
launches:

- ``clip``: the drop-in ``gradfuse.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_``;
- ``buckets``: ``GradBuckets.clip_grad_norm_`` against torch's clip of the same gradients;
- ``scaler``: ``GradScaler.unscale_and_clip_`` against torch's ``unscale_`` + ``clip_grad_norm_``
  (the loss scale 1, so that repeated unscaling changes nothing);
- ``moved``: the drop-in clip where each call's gradients are other tensors, at addresses no kept
  plan describes (the parameters' ``.grad`` set, untimed, from one more gradient set than a plan
  key keeps, in turn): a training loop that sets gradients to None and whose allocator hands the
  new ones other memory. The plan is confirmed, then moved (the new addresses checked, the chunk
  table's addresses uploaded again).

On the CPU the torch thread count is 1 while a host workload runs (the Rust core's kernels then
run on the calling thread, as the tiny tensors would anyway). On a machine without a GPU each
gradfuse call is also timed through the Triton backend with a **stand-in launcher**
(implementation ``gradfuse_triton_standin``): the plans, chunk tables, launch keys and
argument packing of the CUDA path run for real on the CPU tensors, and each launch stops at the
compiled kernel's launcher, which a stand-in replaces (no device, no driver call; the first launch
of each specialization is bound by Triton's JIT on a stand-in driver for sm_90, whose compile is
skipped). It shows the host part of a CUDA call without a GPU; a real launch adds the driver's own
few microseconds per kernel (2.8-3.6 us measured elsewhere).

After the table, ``slopes`` prints each implementation's host time per call at each count and
the per-tensor slope (least squares over the counts from 148 up), also stored in the records'
``slope_ns`` field.
"""

from __future__ import annotations

import math
import os
import weakref
from types import SimpleNamespace

import torch

import gradfuse
from gradfuse._plan import PLANS_PER_KEY

from .cases import GRADFUSE_NORM_RTOL, INACTIVE_HEADROOM, Family, Pristine, parameters_for
from .measure import BenchError

STANDIN = "_triton_standin"


def _torch_scaler_step(state, max_norm):
    state.scaler.unscale_(state.opt)
    return torch.nn.utils.clip_grad_norm_(state.params, max_norm)


def _gradfuse_scaler_step(state, max_norm):
    return state.scaler.unscale_and_clip_(state.opt, max_norm)


class HostFamily(Family):
    """One API on ``n`` tiny gradients, the same list at every call, an inactive clip."""

    rotate_sets = False

    def __init__(self, workload, device, quick):
        super().__init__(workload, device, quick)
        self.api = workload.mode
        self.pristine = Pristine(self.shapes, torch.float32, device)
        self.max_norm = self.pristine.norm * INACTIVE_HEADROOM
        if device.type == "cpu":
            previous = torch.get_num_threads()
            torch.set_num_threads(1)
            weakref.finalize(self, torch.set_num_threads, previous)  # when the workload is done
        self.standin = device.type == "cpu" and not torch.cuda.is_available() and _install_standin()

    def impls(self):
        if self.api in ("clip", "moved"):
            impls = {
                "torch": lambda s, m: torch.nn.utils.clip_grad_norm_(s.params, m),
                "gradfuse": lambda s, m: gradfuse.clip_grad_norm_(s.params, m),
            }
        elif self.api == "buckets":
            impls = {
                "torch": lambda s, m: torch.nn.utils.clip_grad_norm_(s.params, m),
                "gradfuse": lambda s, m: s.buckets.clip_grad_norm_(m),
            }
        else:
            impls = {"torch": _torch_scaler_step, "gradfuse": _gradfuse_scaler_step}
        if self.standin:
            impls["gradfuse" + STANDIN] = impls["gradfuse"]
        return impls

    def new_set(self):
        return self.new_set_for("gradfuse")

    def new_set_for(self, impl: str):
        params = parameters_for(self.pristine.clone())
        state = SimpleNamespace(params=params, impl=impl)
        if self.api == "moved":
            state.grad_sets = [[p.grad for p in params]] + [self.pristine.clone() for _ in range(PLANS_PER_KEY)]
        if self.api == "buckets" and impl != "torch":
            state.buckets = gradfuse.GradBuckets(params)
        if self.api == "scaler":
            opt = torch.optim.SGD(params, lr=0.0)
            kind = torch.amp.GradScaler if impl == "torch" else gradfuse.GradScaler
            # A loss scale of 1 that never grows: repeated unscaling leaves the gradients as they are.
            state.scaler = kind(self.device.type, init_scale=1.0, growth_interval=2**30)
            state.scaler.scale(torch.ones((), device=self.device))
            state.opt = opt
        return state

    @property
    def set_bytes(self):
        return self.numel * 4

    @property
    def bytes_moved(self):
        return self.set_bytes  # the norm's read; an inactive clip writes nothing

    def bind(self, fn, state, k):
        if state.impl.endswith(STANDIN):  # this call through the Triton backend (put back in verify)
            self._backend = os.environ.get("GRADFUSE_BACKEND")
            os.environ["GRADFUSE_BACKEND"] = "triton"
        if self.api == "moved":
            for p, g in zip(state.params, state.grad_sets[k % len(state.grad_sets)], strict=True):
                p.grad = g
        max_norm = self.max_norm
        return lambda: fn(state, max_norm)

    def verify(self, out, state, k):
        if state.impl.endswith(STANDIN):
            if self._backend is None:
                del os.environ["GRADFUSE_BACKEND"]
            else:
                os.environ["GRADFUSE_BACKEND"] = self._backend
        if self.api == "scaler":
            state.scaler.update()  # ready for the next call (untimed)
        if state.impl.endswith(STANDIN):
            return  # nothing was computed: the launches stopped at the stand-in
        total = float(out)
        if not math.isclose(total, self.pristine.norm, rel_tol=1e-3) or not total < self.max_norm:
            raise BenchError(f"returned norm {total:.6g}, the gradients' is {self.pristine.norm:.6g} (inactive clip)")

    def restore(self, state):
        raise AssertionError("an inactive clip changes nothing: never restored")

    def compare(self, outs, buffers):
        exact = self.pristine.norm
        for name, out in outs.items():
            if name.endswith(STANDIN):
                continue  # nothing was computed
            rtol = 5e-3 if name == "torch" else GRADFUSE_NORM_RTOL
            if not math.isclose(float(out), exact, rel_tol=rtol):
                raise BenchError(f"{name} returned norm {float(out):.9g}, the fp64 norm is {exact:.9g}")
            grads = [p.grad for p in buffers[name].params]
            if not all(torch.equal(g, p) for g, p in zip(grads, self.pristine.tensors, strict=True)):
                raise BenchError(f"{name} changed the gradients of an inactive clip")


HOST_FAMILIES = {"host": HostFamily}


# --- the stand-in launcher --------------------------------------------------------------------


class _StandInDriver:
    """Triton's active driver for the stand-in: names sm_90 as the target; no device behind it."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


class _StandInKernel:
    """What a compiled kernel looks like to the launcher: the source Triton would have compiled
    (its signature, constants and alignment attributes, as the JIT bound them), and a launcher
    that launches nothing."""

    function = None
    packed_metadata = (4, 1, 0)
    launches = 0

    def __init__(self, compile_info: dict):
        self.src = SimpleNamespace(
            signature=compile_info["signature"],
            constants=compile_info["constants"],
            attrs=compile_info["configs"][0],
        )

    def run(self, *args):
        _StandInKernel.launches += 1


_STANDIN: list = []


def _install_standin() -> bool:
    """Puts the stand-in in place for this process (once): Triton's driver, the JIT's compile
    (bound, then skipped: a stand-in kernel instead), and the current stream. False when Triton
    runs under its interpreter here, where there is no launch path to time."""
    from ..kernels import _launch

    if _launch.INTERPRET:
        return False
    if _STANDIN:
        return True
    from triton import knobs
    from triton.runtime import driver

    driver.set_active(_StandInDriver())
    captured: list = []

    def hook(*, compile, **_):
        captured.append(compile)
        return True  # bound, not compiled

    knobs.runtime.jit_cache_hook = hook
    real_jit = _launch.Launcher._jit

    def standin_jit(self, grid, args, meta):
        captured.clear()
        real_jit(self, grid, args, meta)
        return _StandInKernel(captured[-1]) if captured else None

    _launch.Launcher._jit = standin_jit
    _launch._stream = lambda device: 0
    _STANDIN.append(True)
    return True


# --- slopes -------------------------------------------------------------------------------------


def slopes(results) -> str:
    """Per host API and implementation: median host µs per call at each count, and the
    least-squares slope (ns per tensor) over the counts from 148 up; the slope is also put in each
    host result's ``notes["slope_ns"]``. Empty when no host workload ran."""
    table: dict[tuple[str, str], dict[int, float]] = {}
    for result in results:
        if result.workload.family != "host":
            continue
        for name, impl in result.impls.items():
            times = impl.host_us or impl.times_us
            table.setdefault((result.workload.mode, name), {})[result.n_tensors] = _median(times)
    if not table:
        return ""
    slope_of = {key: _slope(points) for key, points in table.items()}
    for result in results:
        if result.workload.family == "host":
            for name, impl in result.impls.items():
                if slope_of.get((result.workload.mode, name)) is not None:
                    impl.notes["slope_ns"] = round(slope_of[(result.workload.mode, name)], 1)
    counts = sorted({n for points in table.values() for n in points})
    header = ["api", "implementation", *(f"{n} tensors" for n in counts), "ns/tensor"]
    rows = []
    for (api, name), points in sorted(table.items()):
        slope = slope_of[(api, name)]
        cells = [f"{points[n]:.1f} us" if n in points else "" for n in counts]
        rows.append([api, name, *cells, "" if slope is None else f"{slope:.0f}"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["host time per call (median), same list again, 16-element fp32 gradients, inactive clip:"]
    lines += [
        "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in [header, *rows]
    ]
    if any(name.endswith(STANDIN) for _, name in table):
        lines.append(
            f"gradfuse{STANDIN}: the CUDA path's host work on CPU tensors, each launch stopped at the compiled "
            "kernel's launcher (a stand-in: no GPU here); a real launch adds the driver's call"
        )
    return "\n".join(lines)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _slope(points: dict[int, float]) -> float | None:
    """ns per tensor: the least-squares slope of µs against count, over counts >= 148."""
    xs = [n for n in points if n >= 148]
    if len(xs) < 2:
        return None
    mx = sum(xs) / len(xs)
    my = sum(points[n] for n in xs) / len(xs)
    var = sum((x - mx) ** 2 for x in xs)
    return 1e3 * sum((x - mx) * (points[x] - my) for x in xs) / var
