"""The ``@triton.jit`` helpers every chunk kernel uses: decoding a chunk of a chunk table (see
``_chunk_table``), typed pointers, rounding to the storage dtype, and the in-place rewrite of a
chunk."""

from __future__ import annotations

import triton
import triton.language as tl

from ._launch import INTERPRET

#: The interpreter converts float32 to bfloat16 by truncation (Triton 3.6-3.9); compiled kernels
#: round to nearest even. Under the interpreter :func:`to_storage` rounds by hand, so that the
#: kernels' results there are the ones a GPU gives.
_EMULATE_BF16 = tl.constexpr(INTERPRET)


@triton.jit
def as_f64(bits):
    """A float64 scalar from the int64 made by :func:`f64_bits`."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.constexpr_function
def math_type(code):
    """The arithmetic type for a storage dtype code: float64 for float64, else float32 (torch's
    opmath type)."""
    return tl.float64 if code == 1 else tl.float32


#: Whether the kernels run under the interpreter, for :func:`loop_bound` (compiled: False).
_INTERPRETED = tl.constexpr(INTERPRET)


@triton.jit
def loop_bound(x):
    """``x`` (a scalar tensor: a loaded bound, a kernel argument) as a bound of ``range``.

    Compiled: ``x`` itself (the static branch is dropped; the compiled code is the same as with
    ``x`` in the ``range``, checked with ``tests/kernel_compile.py``). Under the interpreter,
    ``range`` takes its bounds through ``tensor.__index__``, which Triton 3.6 implements as
    ``int()`` of the scalar's one-element array; NumPy deprecated that in 1.25 and refuses it in
    2.4 ("only 0-dimensional arrays can be converted"); Triton 3.9 squeezes the array first.
    So there the bound is taken out as a Python int (returned, not assigned: the interpreter
    turns every assigned value back into a tensor)."""
    if _INTERPRETED:
        return x.handle.data.item()
    return x


@triton.jit
def tensor_ptr(addr_ptr, t, CODE: tl.constexpr, ALIGNED: tl.constexpr):
    """Typed pointer to the data of tensor ``t`` of a table side."""
    addr = tl.load(addr_ptr + t)
    if CODE == 0:
        ptr = addr.to(tl.pointer_type(tl.float32))
    elif CODE == 1:
        ptr = addr.to(tl.pointer_type(tl.float64))
    elif CODE == 2:
        ptr = addr.to(tl.pointer_type(tl.float16))
    else:
        ptr = addr.to(tl.pointer_type(tl.bfloat16))
    if ALIGNED:
        # True for every tensor of an aligned group (checked on the host); lets the compiler
        # emit 16-byte accesses for the body (see VEC).
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def chunk_bounds(chunk, numel_ptr, chunk_tensor_ptr, chunk_index_ptr, CHUNK: tl.constexpr, VEC: tl.constexpr):
    """Where chunk ``chunk`` lies: ``(t, start, body_end, tail, numel)``.

    The chunk's body is ``[start, body_end)``; both ends are multiples of VEC by construction
    (``start`` a multiple of CHUNK, ``body_end`` the smaller of ``start + CHUNK`` and
    ``tail = numel // VEC * VEC``), so masks built from them are constant over VEC lanes. The
    tensor's tail ``[tail, numel)`` (under VEC elements) lies inside one chunk, the one that
    handles it (see :func:`tail_mask`).
    """
    t = tl.load(chunk_tensor_ptr + chunk)
    start = tl.load(chunk_index_ptr + chunk) * CHUNK
    numel = tl.load(numel_ptr + t)
    tail = (numel // VEC) * VEC
    body_end = tl.minimum(start + CHUNK, tail)
    return t, start, body_end, tail, numel


@triton.jit
def tail_mask(offs, start, numel, CHUNK: tl.constexpr):
    """Mask of the tail offsets ``offs = tail + arange(VEC)`` this chunk handles: those below
    ``numel``, if the tail is inside this chunk. (Element-wise comparisons only: combining a
    scalar condition with a vector mask by ``&`` breaks under the interpreter, which broadcasts
    the scalar boolean to int64.)"""
    return (offs < numel) & (offs >= start) & (offs < start + CHUNK)


@triton.jit
def to_storage(v, DT: tl.constexpr):
    """``v`` (float32 or float64 arithmetic) rounded to the storage dtype ``DT``, to nearest even.

    Every store of a kernel's arithmetic into a tensor goes through here. A float64 value bound
    for 16 bits is rounded to float32 first, then to 16 bits, as torch and the Rust core cast
    float64 -> float16/bfloat16: rounding once, directly, differs where the float32 rounding
    lands on a 16-bit halfway point (``1 + 2**-11 + 2**-40`` gives float16 1.0 through float32,
    1.0009765625 directly). Compiled, a direct ``.to(float16)`` of a float64 is PTX
    ``cvt.rn.f16.f64`` (and ``cvt.rn.bf16.f64`` on sm_90); ``tests/test_compile.py`` checks
    that no kernel contains either.
    """
    if DT == tl.float16 or DT == tl.bfloat16:
        f = v.to(tl.float32)  # a no-op for float32 arithmetic
        if _EMULATE_BF16 and DT == tl.bfloat16:
            # torch's round_to_nearest_even: add 0x7FFF plus the lowest kept bit, drop 16 bits;
            # NaN keeps its sign and top payload bits, made quiet.
            bits = f.to(tl.uint32, bitcast=True)
            r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            r = tl.where(f != f, (bits >> 16) | 0x40, r)
            out = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            out = f.to(DT)
    else:
        out = v.to(DT)
    return out


#: ``op`` of :func:`rewrite_chunk`.
MUL = tl.constexpr(0)  # x * a
CLAMP = tl.constexpr(1)  # min(max(x, a), b), NaN kept (NaN < a and NaN > b are false)


@triton.jit
def _apply(v, a, b, OP: tl.constexpr):
    if OP == 0:
        r = v * a
    else:
        y = tl.where(v < a, a, v)
        r = tl.where(y > b, b, y)
    return r


@triton.jit
def rewrite_chunk(x_ptr, start, body_end, tail, numel, a, b, OP: tl.constexpr, MT: tl.constexpr, CHUNK, BLOCK, VEC):
    """Rewrites this chunk of a tensor in place (body then tail, see :func:`chunk_bounds`):
    ``x = op(x, a, b)`` computed in ``MT`` and rounded once to the storage dtype."""
    for k in range(loop_bound(start), loop_bound(body_end), BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < body_end
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(x_ptr + offs, to_storage(_apply(x.to(MT), a, b, OP), x.dtype), mask=mask)
    offs = tail + tl.arange(0, VEC)
    mask = tail_mask(offs, start, numel, CHUNK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(x_ptr + offs, to_storage(_apply(x.to(MT), a, b, OP), x.dtype), mask=mask)


@triton.jit
def is_finite(x):
    """Element-wise: not inf and not NaN (NaN compares false)."""
    return tl.abs(x) < float("inf")
