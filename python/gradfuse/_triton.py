"""Triton backend of the ``gradfuse::`` ops: CUDA tensors (and, with ``GRADFUSE_BACKEND=triton``
under ``TRITON_INTERPRET=1``, CPU tensors).

Same functions, arguments, results and side effects as the CPU backend (``gradfuse._cpu``): each
takes validated plans (``gradfuse._plan``) and runs the kernels (``gradfuse.kernels``) from the
plan's chunk table, which the plan keeps (``memo``): built at the first call on a list, moved
(its addresses uploaded alone) when the same kind of tensors come at other addresses. The plan
keeps each operation's launches on that table too (``_launch_sets``), so that a call binds its
own few arguments and launches. One launch
per dtype group covers every tensor, whatever their number. Nothing here waits for the device or
reads a device value on the host, except ``clip_grad_norm_(error_if_nonfinite=True)``, whose error
needs the total on the host; every call can be captured in a CUDA graph after one warm-up call,
as usual, so that the table is built and uploaded outside the capture. A plan used while a graph
is captured is kept for the life of the process (the graph replays with its table's addresses).

A chunk table's scratch buffers (norm partials and counters) serve one call at a time: calls on
one stream are ordered, but two norms of the very same tensors running concurrently on two
streams would share them.

Launches per call, for tensors of one dtype: ``norm`` 1 (the last program finalizes), ``stats`` 2,
``unit_norms`` 1, ``scale_units_`` 1, ``scale_``/``clip_grads_with_norm_``/``unscale_and_check_``/
``accumulate_``/``clamp_`` 1, ``clip_grad_norm_`` 2, ``unscale_check_norm`` 1, ``unscale_and_clip_`` 2.
Mixed dtypes (or mixed 16-byte address alignment) add one launch per extra group to each pass.
"""

from __future__ import annotations

import torch

from ._plan import DTYPE_CODES, Plan, nonfinite_total_error
from .kernels import ChunkTable, _accumulate, _clamp, _norm, _scale, _stats, _unitwise, _unscale
from .kernels import _chunk_table as ct

#: Plans whose tables a captured CUDA graph uses: never freed.
_PINNED: dict[int, Plan] = {}
_NOTHING: dict = {}


def _capturing(plan: Plan) -> bool:
    return plan.on_cuda and torch._C._cuda_isCurrentStreamCapturing()


def _capture_error() -> RuntimeError:
    return RuntimeError(
        "gradfuse: these tensors were first seen while a CUDA graph was being captured; run the call once "
        "before capturing (the usual warm-up), so that its chunk table is built and uploaded outside the capture"
    )


def _kept(plan: Plan, key, make, move):
    """The table ``plan.memo[key]``: made by ``make()`` the first time, or ``move(table)`` from
    the table of the plan this one moved from (None: made anew); pins the plan while a CUDA graph
    is captured, where nothing may be made or uploaded."""
    table = plan.memo.get(key)
    if table is not None and table.chunk != ct.CHUNK:
        table = None  # built with another chunk size (tests change it)
    if table is None:
        if _capturing(plan):
            raise _capture_error()
        old = plan.memo.get("moved_from", _NOTHING).get(key)
        if old is not None and old.chunk == ct.CHUNK:
            table = move(old)
        if table is None:
            table = make()
        plan.memo[key] = table
    elif plan.on_cuda and id(plan) not in _PINNED and _capturing(plan):
        _PINNED[id(plan)] = plan
    return table


def _table(plan: Plan) -> ChunkTable:
    """The chunk table of ``plan``'s tensors. One moved from the table of the plan this one moved
    from skips the table's alignment check: each plan's move was checked by the Rust core
    (``TensorList.moved``: every tensor as 16-byte aligned as before), so the table's origin and
    this plan agree on every tensor's alignment."""
    return _kept(
        plan,
        "table",
        lambda: ChunkTable(plan.device, [plan.addr_tensor()], plan.numels, [plan.codes]),
        lambda old: old.moved([plan.addr_tensor()], aligned=True),
    )


def _pair_table(dst: Plan, src: Plan) -> ChunkTable:
    """The two-sided table of ``dst[i] += src[i]``, kept with ``dst`` for the last ``src`` plan
    it was used with; made for the call alone when ``src`` is (its plan holds the tensors it
    works on, which a kept ``dst`` plan must not keep alive)."""
    if not src.cached:
        if _capturing(dst):
            raise _capture_error()
        return ChunkTable(dst.device, [dst.addrs, src.addrs], dst.numels, [dst.codes, src.codes])
    pair = dst.memo.get("pair")
    if pair is not None and pair[0] is not src:
        del dst.memo["pair"], dst.memo["pair table"]
    table = _kept(
        dst,
        "pair table",
        lambda: ChunkTable(dst.device, [dst.addrs, src.addrs], dst.numels, [dst.codes, src.codes]),
        lambda old: None,
    )
    dst.memo["pair"] = (src,)
    return table


def _unit_table(plan: Plan, units: list[int]) -> ChunkTable:
    """The table of the units of ``plan`` (``units[i]`` equal parts of tensor ``i``), each a
    tensor of its own. One moved is checked for alignment: a unit's can change where its
    tensor's does not (rows of 8 bytes, their tensor 4 then 8 bytes past a 16-byte boundary)."""

    def rows():
        itemsizes = [b // n if n else 1 for b, n in zip(plan.nbytes, plan.numels, strict=True)]
        return _unitwise.unit_rows(plan.addrs, plan.numels, plan.codes, itemsizes, units)

    def make():
        addrs, numels, codes = rows()
        return ChunkTable(plan.device, [addrs], numels, [codes])

    return _kept(plan, ("units", tuple(units)), make, lambda old: old.moved([rows()[0]]))


def _launch_on(plan: Plan):
    """The CUDA device of the plan made current for the call (launches go to the current device)."""
    if plan.on_cuda and torch._C._cuda_getDevice() != plan.device.index:
        return torch.cuda.device(plan.device)
    return _NO_SWITCH


class _NoSwitch:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


_NO_SWITCH = _NoSwitch()

#: A 0-d tensor per (dtype, device), whose ``empty_like`` makes each call's new 0-d results:
#: ~0.5 us less than ``torch.empty((), dtype=..., device=...)``, which parses both arguments.
_SCALARS: dict = {}


def _new_scalar(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new uninitialized 0-d tensor of ``dtype`` on ``device``, for a kernel to write."""
    like = _SCALARS.get((dtype, device))
    if like is None:
        like = torch.empty((), dtype=dtype, device=device)
        if device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing():
            return like  # not kept: made from a graph's private pool, it would hold the pool's memory
        _SCALARS[(dtype, device)] = like
    return torch.empty_like(like)


#: Launch sets a plan keeps (a handful of operations and norm orders in use; a norm order per
#: call would otherwise add one at every call).
_LAUNCH_SETS_PER_PLAN = 16


def _launch_sets(plan: Plan, table: ChunkTable, key, make):
    """``make()``: launch lists of the kernel modules for ``table`` (``_norm.norm_launches``, ...),
    kept with the plan under ``key`` while its table and the kernels' tuning stay the same. A call
    then launches them as they are, without the kernel functions' per-call work: what those
    check, this module's own calls get right (its plans' tables, outputs it makes)."""
    kept = plan.memo.get("launches")
    tuning = ct.tuning()
    if kept is None or kept[0] is not table or kept[1] != tuning:
        kept = plan.memo["launches"] = (table, tuning, {})
    sets = kept[2]
    found = sets.get(key)
    if found is None:
        if len(sets) >= _LAUNCH_SETS_PER_PLAN:
            sets.clear()
        found = sets[key] = make()
    return found


def _empty_norm(plan: Plan):
    out = plan.out_dtype
    total = torch.zeros((), dtype=out, device=plan.device)
    return total, torch.zeros(0, dtype=out, device=plan.device)


def norm(plan: Plan, norm_type: float, per_tensor: bool):
    """``(total, per)``: the ``norm_type``-norm of all tensors (0-d) and of each (shape ``(n,)``,
    or ``(0,)`` unless ``per_tensor``), in ``plan.out_dtype``."""
    if len(plan) == 0:
        return _empty_norm(plan)
    out = plan.out_dtype
    table = _table(plan)
    launches = _launch_sets(
        plan, table, ("norm", norm_type, per_tensor), lambda: _norm.norm_launches(table, norm_type, per_tensor)
    )
    total = _new_scalar(out, plan.device)
    per = torch.empty(len(plan) if per_tensor else 0, dtype=out, device=plan.device)
    values = (total, per) if per_tensor else (total,)
    with _launch_on(plan):
        for launch in launches:
            launch(*values)
    return total, per


def stats(plan: Plan, norm_type: float):
    """``(total, norms, amax, nonfinite)``: the total norm (0-d), and per tensor its norm, its
    largest magnitude (``plan.out_dtype``) and its count of inf/NaN elements (int64), in one
    read of the tensors (two launches, see ``kernels._stats``)."""
    out, n, device = plan.out_dtype, len(plan), plan.device
    norms, amax = torch.empty(n, dtype=out, device=device), torch.empty(n, dtype=out, device=device)
    nonfinite = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        return torch.zeros((), dtype=out, device=device), norms, amax, nonfinite
    total = _new_scalar(out, device)
    with _launch_on(plan):
        _stats.multi_tensor_stats(_table(plan), norm_type, total, norms, amax, nonfinite)
    return total, norms, amax, nonfinite


def unit_norms(plan: Plan, units: list[int], norm_type: float) -> torch.Tensor:
    """The norm of every unit (``units[i]`` equal parts of tensor ``i``): one norm launch over
    the units as tensors of their own."""
    out = torch.empty(sum(units), dtype=plan.out_dtype, device=plan.device)
    if out.numel():
        total = _new_scalar(plan.out_dtype, plan.device)
        with _launch_on(plan):
            _norm.multi_tensor_norm(_unit_table(plan, units), norm_type, total, out)
    return out


def scale_units_(plan: Plan, units: list[int], factors: torch.Tensor) -> None:
    """``x *= factors[k]`` for every element of unit ``k``; units with factor 1 are not touched."""
    if sum(units):
        table = _unit_table(plan, units)
        plan.before_write()
        with _launch_on(plan):
            _unitwise.scale_units_(table, factors)


def scale_(plan: Plan, scale: torch.Tensor) -> None:
    """``x *= scale`` in place; ``scale`` is a one-element device tensor, read by the kernel (a
    scale of exactly 1 touches nothing)."""
    if len(plan):
        table = _table(plan)
        code = _code(scale)
        launches = _launch_sets(plan, table, ("scale", code), lambda: _scale.scale_launches(table, _scale.SCALE, code))
        plan.before_write()
        with _launch_on(plan):
            for launch in launches:
                launch(scale, 0)


def _code(t: torch.Tensor) -> int:
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        raise TypeError(f"gradfuse: a scale or total norm of dtype {t.dtype} is not supported")
    return code


def clip_grads_with_norm_(plan: Plan, max_norm: float, total_norm: torch.Tensor) -> None:
    """``x *= clamp(max_norm / (total_norm + 1e-6), max=1)`` with the coefficient computed on the
    device in ``total_norm``'s dtype (torch's arithmetic); a coefficient of 1 touches nothing."""
    if len(plan):
        table = _table(plan)
        code = _code(total_norm)
        launches = _launch_sets(plan, table, ("clip by", code), lambda: _scale.scale_launches(table, _scale.CLIP, code))
        plan.before_write()
        max_norm_bits = ct.f64_bits(max_norm)
        with _launch_on(plan):
            for launch in launches:
                launch(total_norm, max_norm_bits)


def clip_grad_norm_(plan: Plan, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """Total norm, then clipping by it: two launches (norm with fused finalize, then scale)."""
    if len(plan) == 0:
        return _empty_norm(plan)[0]
    table = _table(plan)
    out = plan.out_dtype
    norm, scale = _launch_sets(
        plan,
        table,
        ("clip", norm_type),
        lambda: (_norm.norm_launches(table, norm_type), _scale.scale_launches(table, _scale.CLIP, DTYPE_CODES[out])),
    )
    total = _new_scalar(out, plan.device)
    with _launch_on(plan):
        for launch in norm:
            launch(total)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            # The one host sync of this backend, asked for by the caller; nothing was modified yet.
            raise nonfinite_total_error(norm_type)
        plan.before_write()
        max_norm_bits = ct.f64_bits(max_norm)
        for launch in scale:
            launch(total, max_norm_bits)
    return total


def unscale_and_check_(plan: Plan, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """As ``torch._amp_foreach_non_finite_check_and_unscale_``: ``x *= inv_scale``, and
    ``found_inf = 1.0`` if any ``x`` was inf or NaN (never reset to 0)."""
    if len(plan):
        table = _table(plan)
        plan.before_write(found_inf)
        with _launch_on(plan):
            _unscale.unscale_and_check_(table, inv_scale, found_inf)


def inverse_scale(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inv_scale, found_inf)`` for an unscale by ``scale`` (a one-element float32 tensor): the
    reciprocal as torch's ``unscale_`` takes it (in float64, rounded to float32) and a zeroed flag,
    new 0-d float32 tensors on ``scale``'s device, in one launch."""
    inv_scale = _new_scalar(torch.float32, scale.device)
    found_inf = _new_scalar(torch.float32, scale.device)
    if scale.is_cuda and torch._C._cuda_getDevice() != scale.device.index:
        with torch.cuda.device(scale.device):
            _unscale.inverse_scale(scale, inv_scale, found_inf)
    else:
        _unscale.inverse_scale(scale, inv_scale, found_inf)
    return inv_scale, found_inf


def unscale_check_norm(plan: Plan, inv_scale: torch.Tensor, norm_type: float):
    """One read-only pass: ``(norm of x * inv_scale, found_inf)``, ``found_inf`` a new 0-d
    float32 tensor (1.0 if any ``x`` was inf or NaN)."""
    found = _new_scalar(torch.float32, inv_scale.device)
    if len(plan) == 0:
        return _empty_norm(plan)[0], found.zero_()
    table = _table(plan)
    found_write = _norm.FOUND_WRITE
    launches = _launch_sets(
        plan, table, ("unscaled norm", norm_type), lambda: _norm.norm_launches(table, norm_type, False, found_write)
    )
    total = _new_scalar(plan.out_dtype, plan.device)
    with _launch_on(plan):
        for launch in launches:
            launch(total, inv_scale, found)
    return total, found


def _measure_then_scale(
    plan: Plan, inv_scale: torch.Tensor, found_inf: torch.Tensor, norm_type: float, mode: int, max_norm: float = 0.0
):
    """The read-only unscale+check+norm pass, then the write pass in ``mode``: UNSCALE_CLIP (by
    ``inv_scale * clip_coef(total)``) or SCALE (by ``inv_scale``); returns the norm of the
    unscaled tensors."""
    if len(plan) == 0:
        return _empty_norm(plan)[0]
    table = _table(plan)
    out = plan.out_dtype
    # The scale's factor: the total (its clip coefficient), or inv_scale itself.
    code = DTYPE_CODES[out] if mode == _scale.UNSCALE_CLIP else DTYPE_CODES[inv_scale.dtype]
    norm, scale = _launch_sets(
        plan,
        table,
        ("measure, scale", norm_type, mode, code),
        lambda: (
            _norm.norm_launches(table, norm_type, False, _norm.FOUND_SET),
            _scale.scale_launches(table, mode, code),
        ),
    )
    total = _new_scalar(out, plan.device)
    plan.before_write(found_inf)
    with _launch_on(plan):
        for launch in norm:
            launch(total, inv_scale, found_inf)
        if mode == _scale.UNSCALE_CLIP:
            max_norm_bits = ct.f64_bits(max_norm)
            for launch in scale:
                launch(total, inv_scale, max_norm_bits)
        else:
            for launch in scale:
                launch(inv_scale, 0)
    return total


def unscale_and_clip_(plan: Plan, inv_scale: torch.Tensor, found_inf: torch.Tensor, max_norm: float, norm_type: float):
    """Read-only unscale+check+norm pass, then one write pass by ``inv_scale * clip_coef(norm)``
    (skipped when that product is exactly 1); returns the norm of the unscaled tensors."""
    return _measure_then_scale(plan, inv_scale, found_inf, norm_type, _scale.UNSCALE_CLIP, max_norm)


def unscale_norm_(plan: Plan, inv_scale: torch.Tensor, found_inf: torch.Tensor, norm_type: float):
    """``x *= inv_scale`` in place; returns the norm of the scaled values and sets ``found_inf``
    to 1.0 if any ``x`` was inf or NaN. Two launches (a read-only norm pass, then the write):
    the DDP hook takes this path only for gloo on CUDA; with NCCL the all-reduce averages and
    the hook's pass is read-only."""
    return _measure_then_scale(plan, inv_scale, found_inf, norm_type, _scale.SCALE)


def accumulate_(dst: Plan, src: Plan, alpha: float) -> None:
    """``dst[i] += alpha * src[i]``, in float64 if either side is float64, else float32."""
    if len(dst):
        table = _pair_table(dst, src)
        dst.before_write()
        with _launch_on(dst):
            _accumulate.accumulate_(table, alpha)


def clamp_(plan: Plan, lo: float, hi: float) -> None:
    """``x = min(max(x, lo), hi)`` in place, NaN kept."""
    if len(plan):
        table = _table(plan)
        plan.before_write()
        with _launch_on(plan):
            _clamp.clamp_(table, lo, hi)
