"""Chunk tables: how one launch covers every element of every tensor in a list.

A list of tensors becomes, in one int64 device buffer uploaded with one copy:

- per tensor ``i``: its data address (one per side: ``accumulate_`` has a ``dst`` and a ``src``
  side), its ``numel``, and the index and count of its chunks (``first_chunk``, ``chunk_count``);
- per chunk ``c``: the tensor it belongs to (``chunk_tensor``) and its position inside that
  tensor (``chunk_index``; it covers elements ``[chunk_index * CHUNK, (chunk_index + 1) * CHUNK)``).

Every tensor has at least one chunk (an empty tensor one empty chunk), so every tensor gets a
per-tensor result. Chunks are ordered by *group*: tensors that share dtype codes and address
alignment form a group, one launch per group with its dtypes as compile-time constants; within a
group chunks follow the tensors' order. Program ``pid`` of a group's launch handles chunk
``group.base + pid``.

Tables are cached, keyed on everything they encode (addresses, sizes, dtype codes, device and
chunk size), so a training loop that clips the same gradients every step builds its table once
(a cache hit costs building and hashing the key). A table used while a CUDA graph is being
captured is kept for the life of the process, since the graph replays with its addresses baked
in; building one during a capture is refused (warm up first, as for any captured workload).

The ``@triton.jit`` helpers at the bottom decode a chunk inside a kernel; every kernel in this
package uses them.
"""

from __future__ import annotations

import itertools
import os
import struct

import torch
import triton
import triton.language as tl

#: Elements per program (per chunk). 2**15 is the Rust core's segment too: 128 KiB of fp32 per
#: program, ~3800 programs for GPT-2 124M (enough to fill an H100's 132 SMs many times over)
#: while 2000 tensors of 4096 elements still get one program each. Untuned default: to be
#: measured on a GPU (benches/). Must be a multiple of VEC. Read at every call, so tests can
#: shrink it (``monkeypatch.setattr(_chunk_table, "CHUNK", 64)``); it is part of the cache key.
CHUNK = int(os.environ.get("GRADFUSE_TRITON_CHUNK", 1 << 15))
#: Elements per loop step inside a program (a power of two). 2048 with 4 warps is 16 elements,
#: four 16-byte loads of fp32, in flight per thread per step. Untuned default.
BLOCK = int(os.environ.get("GRADFUSE_TRITON_BLOCK", 2048))
#: Partials reduced per loop step by the finalizing program (a power of two). Untuned default;
#: a few thousand partials take a handful of steps.
FBLOCK = int(os.environ.get("GRADFUSE_TRITON_FBLOCK", 1024))
#: Warps per program for the chunk kernels. Triton's default, untuned.
NUM_WARPS = 4
#: The body of a tensor is its first ``numel // VEC * VEC`` elements, processed in masked blocks
#: whose bounds the compiler can prove are multiples of VEC elements (so loads and stores of an
#: aligned tensor become 16-byte vector accesses); the last ``numel % VEC`` elements are the tail,
#: handled by one extra masked block. 16 elements is 16 bytes even for fp16/bf16.
VEC = 16
#: Byte alignment of a tensor's address that lets a group promise aligned accesses.
ALIGN_BYTES = 16
#: Tables kept in the cache (least recently used evicted). A training loop needs a handful
#: (gradients, main gradients, a few bucket views); 64 bounds the memory of stale ones.
CACHE_SIZE = 64

#: Whether kernels run under the Triton interpreter (CPU tensors, numpy arithmetic).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
#: The interpreter converts float32 to bfloat16 by truncation (Triton 3.6-3.9); compiled kernels
#: round to nearest even. Under the interpreter :func:`to_storage` rounds by hand, so that the
#: kernels' results there are the ones a GPU gives.
_EMULATE_BF16 = tl.constexpr(INTERPRET)


class Group:
    """Chunks ``[base, base + count)`` of a table: tensors with the same dtype codes (one per
    side) and the same address alignment, run by one launch."""

    __slots__ = ("aligned", "base", "codes", "count")

    def __init__(self, codes: tuple[int, ...], aligned: bool, base: int, count: int):
        self.codes = codes
        self.aligned = aligned
        self.base = base
        self.count = count

    def __repr__(self) -> str:
        return f"Group(codes={self.codes}, aligned={self.aligned}, base={self.base}, count={self.count})"


class ChunkTable:
    """A cached, uploaded chunk table (see the module docstring) and the scratch buffers the
    norm kernels use with it.

    Device views: ``addrs[side]`` (int64 per tensor), ``numel``, ``first_chunk``,
    ``chunk_count`` (per tensor), ``chunk_tensor``, ``chunk_index`` (per chunk). Every view
    starts 16-byte aligned, so kernels see one pointer alignment whatever the table.
    """

    __slots__ = (
        "_host",
        "_scratch",
        "addrs",
        "chunk_count",
        "chunk_index",
        "chunk_tensor",
        "conflict",
        "device",
        "first_chunk",
        "groups",
        "last_used",
        "n_chunks",
        "n_tensors",
        "numel",
    )

    def __init__(self, device: torch.device, addrs: list[list[int]], numels: list[int], codes: list[list[int]]):
        n = len(numels)
        if CHUNK <= 0 or CHUNK % VEC:
            raise ValueError(f"gradfuse.kernels: CHUNK must be a positive multiple of {VEC}, got {CHUNK}")
        numel = torch.tensor(numels, dtype=torch.int64)
        counts = torch.clamp_min((numel + (CHUNK - 1)) // CHUNK, 1)
        keys = list(zip(*codes, *(map(_aligned, side) for side in addrs), strict=True))
        sides = len(addrs)
        distinct = list(dict.fromkeys(keys))
        if len(distinct) == 1:
            order = torch.arange(n, dtype=torch.int64)
        else:
            rank = {k: r for r, k in enumerate(distinct)}
            group_of = torch.tensor([rank[k] for k in keys], dtype=torch.int64)
            order = torch.sort(group_of, stable=True).indices
        counts_o = counts[order]
        ends_o = torch.cumsum(counts_o, 0)
        first_o = ends_o - counts_o
        first = torch.empty(n, dtype=torch.int64)
        first[order] = first_o
        n_chunks = int(ends_o[-1])
        chunk_tensor = torch.repeat_interleave(order, counts_o)
        chunk_index = torch.arange(n_chunks, dtype=torch.int64) - torch.repeat_interleave(first_o, counts_o)

        self.groups = []
        base = 0
        group_counts = torch.zeros(len(distinct), dtype=torch.int64)
        if len(distinct) == 1:
            group_counts[0] = n_chunks
        else:
            group_counts.index_add_(0, group_of, counts)
        for key, count in zip(distinct, group_counts.tolist(), strict=True):
            self.groups.append(Group(tuple(key[:sides]), all(key[sides:]), base, count))
            base += count

        sections = [torch.tensor(side, dtype=torch.int64) for side in addrs]
        sections += [numel, first, counts, chunk_tensor, chunk_index]
        host, views = _pack(sections)
        if device.type == "cuda":
            # Pinned, so the copy is asynchronous (no host sync) and capturable; kept alive in
            # the table because a captured graph re-reads it at every replay.
            host = host.pin_memory()
            buf = host.to(device, non_blocking=True)
        else:
            buf = host
        self._host = host
        parts = [buf[a:b] for a, b in views]
        self.addrs = parts[:sides]
        self.numel, self.first_chunk, self.chunk_count, self.chunk_tensor, self.chunk_index = parts[sides:]
        self.device = device
        self.n_tensors = n
        self.n_chunks = n_chunks
        self._scratch = None
        self.conflict = None

    def check_disjoint(self, plans) -> None:
        """Raises the CPU backend's OverlapError if in-place targets overlap each other or the
        call's inputs (found once, when the table was built: it depends only on the key)."""
        if self.conflict is not None:
            from .._plan import OverlapError

            (a, i), (b, j) = self.conflict
            raise OverlapError(
                f"{plans[a].name}[{i}] and {plans[b].name}[{j}] overlap in memory; in-place targets must not "
                "overlap each other or their inputs"
            )

    def scratch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(partials, raws, counters)`` for the norm kernels, allocated on first use.

        ``partials``: float64 per chunk; ``raws``: float64 per tensor; ``counters``: int32,
        ``[0]`` programs finished, ``[1]`` the found-inf flag, ``[2 + i]`` chunks of tensor ``i``
        finished. The kernels leave the counters at zero when they return (the last program to
        use one resets it), so they are zeroed here once, not per call.
        """
        if self._scratch is None:
            self._scratch = (
                torch.empty(self.n_chunks, dtype=torch.float64, device=self.device),
                torch.empty(self.n_tensors, dtype=torch.float64, device=self.device),
                torch.zeros(self.n_tensors + 2, dtype=torch.int32, device=self.device),
            )
        return self._scratch


def _aligned(addr: int) -> bool:
    return addr % ALIGN_BYTES == 0


def _pack(sections: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Concatenates int64 sections, each padded to an even length so that every one starts at a
    16-byte offset; returns the buffer and each section's ``(start, end)``."""
    parts, views, at = [], [], 0
    pad = torch.zeros(1, dtype=torch.int64)
    for s in sections:
        parts.append(s)
        views.append((at, at + len(s)))
        at += len(s)
        if len(s) % 2:
            parts.append(pad)
            at += 1
    return torch.cat(parts), views


_CACHE: dict = {}
_CLOCK = itertools.count()
#: Tables used while a CUDA graph was being captured: never evicted (the graph holds their addresses).
_PINNED: dict = {}


class _Key:
    """What a table encodes: device, chunk size, and per side the addresses, sizes and dtype
    codes. Only the addresses are hashed (they tell tables apart), once; a lookup then costs one
    comparison of the lists. A cache hit, key included: ~15 us at 2000 tensors (measured on the
    2-core CI machine; 30 us for accumulate_'s two lists)."""

    __slots__ = ("_hash", "addrs", "codes", "device", "numels")

    def __init__(self, plans):
        self.device = (plans[0].device, CHUNK)
        addrs = tuple(plans[0].addrs)
        for p in plans[1:]:
            addrs += tuple(p.addrs)
        self.addrs = addrs
        self.numels = plans[0].numels
        self.codes = [p.codes for p in plans]
        self._hash = hash(self.addrs)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return (
            self.addrs == other.addrs
            and self.numels == other.numels
            and self.codes == other.codes
            and self.device == other.device
        )


def chunk_table(plans) -> ChunkTable:
    """The (cached) chunk table of one plan, or of several plans walked together (``accumulate_``'s
    ``dst`` and ``src``, which have equal ``numels``). Raises ValueError, before any kernel runs,
    when in-place targets (the first plan, if ``inplace``) overlap each other or the inputs."""
    key = _Key(plans)
    table = _PINNED.get(key) if _PINNED else None
    if table is None:
        device = plans[0].device
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        table = _CACHE.get(key)
        if table is None:
            if capturing:
                raise RuntimeError(
                    "gradfuse: these tensors were first seen while a CUDA graph was being captured; run the "
                    "call once before capturing (the usual warm-up), so that its chunk table is built and "
                    "uploaded outside the capture"
                )
            table = ChunkTable(device, [p.addrs for p in plans], plans[0].numels, [p.codes for p in plans])
            table.conflict = _find_conflict(plans)
            while _CACHE and len(_CACHE) >= CACHE_SIZE:
                # Evict the least recently used (a scan, but only when a new table is built).
                del _CACHE[min(_CACHE, key=lambda k: _CACHE[k].last_used)]
            _CACHE[key] = table
        if capturing:
            # The graph replays with this table's addresses baked in: never evict it.
            _PINNED[key] = _CACHE.pop(key)
    table.last_used = next(_CLOCK)
    table.check_disjoint(plans)
    return table


def _find_conflict(plans):
    """``((plan, index), (plan, index))`` of two overlapping tensors of which at least one is
    written, or None; as the Rust core's check (a source identical to its own target is fine)."""
    if not getattr(plans[0], "inplace", False):
        return None
    from .._plan import ELEMENT_SIZE
    from .._rust import find_overlap

    dst = plans[0]
    starts, ends, written = [], [], []
    for k, p in enumerate(plans):
        for i, (a, n, c) in enumerate(zip(p.addrs, p.numels, p.codes, strict=True)):
            same = k > 0 and a == dst.addrs[i] and c == dst.codes[i]
            starts.append(0 if same else a)
            ends.append(0 if same else a + n * ELEMENT_SIZE[c])
            written.append(k == 0)
    hit = find_overlap(starts, ends, written)
    if hit is None:
        return None
    n = len(dst.addrs)
    return tuple(divmod(h, n) for h in hit)


def clear_cache() -> None:
    """Drops every cached table that no captured CUDA graph uses."""
    _CACHE.clear()


def f64_bits(value: float) -> int:
    """``value`` as the signed int64 with its float64 bits: how an exact float64 scalar reaches a
    kernel (Triton passes Python floats as float32). Kernels decode it with :func:`as_f64`."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def launch(kernel, group: Group, *args, fp_fusion: bool = False, **meta):
    """``kernel[(group.count,)](*args, **meta)`` plus the meta-parameters every chunk kernel
    takes (``ALIGNED``, ``CHUNK``, ``BLOCK``, ``VEC``, the warp count, and FP fusion, stated
    rather than defaulted: Triton >= 3.9 warns when it is unset and changes the default in
    3.10). Returns what Triton returns (the compiled kernel, whose ``asm`` the GPU tests
    inspect). Under the interpreter, numpy's floating-point warnings are off (inf * 0 and
    friends are meant here: the GPU is silent about them, and the test suite turns warnings
    into errors)."""
    meta = {
        "ALIGNED": group.aligned,
        "CHUNK": CHUNK,
        "BLOCK": BLOCK,
        "VEC": VEC,
        "num_warps": NUM_WARPS,
        "enable_fp_fusion": fp_fusion,
        **meta,
    }
    if INTERPRET:
        import numpy as np

        with np.errstate(all="ignore"):
            return kernel[(group.count,)](*args, **meta)
    return kernel[(group.count,)](*args, **meta)


# --- in-kernel helpers ----------------------------------------------------------------------


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
