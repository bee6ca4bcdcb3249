"""Chunk tables: how one launch covers every element of every tensor in a list.

A list of tensors (their addresses, sizes and dtype codes: no tensor objects) becomes, in int64
device buffers uploaded with one copy each:

- per tensor ``i``: its data address (one per side: ``accumulate_`` has a ``dst`` and a ``src``
  side), its ``numel``, and the index and count of its chunks (``first_chunk``, ``chunk_count``);
- per chunk ``c``: the tensor it belongs to (``chunk_tensor``) and its position inside that
  tensor (``chunk_index``; it covers elements ``[chunk_index * CHUNK, (chunk_index + 1) * CHUNK)``).

Every tensor has at least one chunk (an empty tensor one empty chunk), so every tensor gets a
per-tensor result. Chunks are ordered by *group*: tensors that share dtype codes and address
alignment form a group, one launch per group with its dtypes as compile-time constants; within a
group chunks follow the tensors' order. Program ``pid`` of a group's launch handles chunk
``group.base + pid``.

The addresses are kept apart from the rest: the same tensors at other addresses (gradients set to
None and made again) are :meth:`ChunkTable.moved`, which uploads the addresses alone and shares
everything else. Keeping tables between calls, and keeping them alive for CUDA graphs, is the
caller's (the package's plans); nothing here holds a tensor of the caller's.

:func:`run` launches a chunk kernel over every group of a table, with the meta-parameters every
chunk kernel takes, through launches prepared once per table (``_launch.Prepared``: the table's
buffers bound once, each call binding its own few arguments; :func:`launches` gives them, for a
caller that keeps them); :func:`run_once` makes a table's one-off launch (a finishing kernel) the
same way.
"""

from __future__ import annotations

import os
import struct

import torch

from ._launch import INTERPRET, SLOT, Prepared, Ptr, launcher

#: Elements per program (per chunk). 2**15 is the Rust core's segment too: 128 KiB of fp32 per
#: program, ~3800 programs for GPT-2 124M (enough to fill an H100's 132 SMs many times over)
#: while 2000 tensors of 4096 elements still get one program each. Untuned default: to be
#: measured on a GPU (benches/). Must be a multiple of VEC. Read when a table is built and at
#: every launch, so tests can shrink it (``monkeypatch.setattr(_chunk_table, "CHUNK", 64)``);
#: a table remembers the size it was built with (``chunk``).
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

__all__ = ["ALIGN_BYTES", "BLOCK", "CHUNK", "FBLOCK", "INTERPRET", "NUM_WARPS", "SLOT", "VEC", "ChunkTable", "Group"]


class Group:
    """Chunks ``[base, base + count)`` of a table: tensors with the same dtype codes (one per
    side) and the same address alignment, run by one launch on CUDA device ``device`` (-1: CPU
    tensors under the interpreter)."""

    __slots__ = ("aligned", "base", "codes", "count", "device")

    def __init__(self, codes: tuple[int, ...], aligned: bool, base: int, count: int, device: int):
        self.codes = codes
        self.aligned = aligned
        self.base = base
        self.count = count
        self.device = device

    def __repr__(self) -> str:
        return f"Group(codes={self.codes}, aligned={self.aligned}, base={self.base}, count={self.count})"


class ChunkTable:
    """An uploaded chunk table (see the module docstring) and the scratch buffers the norm
    kernels use with it.

    Device views: ``addrs[side]`` (int64 per tensor), ``numel``, ``first_chunk``,
    ``chunk_count`` (per tensor), ``chunk_tensor``, ``chunk_index`` (per chunk). Every view
    starts 16-byte aligned, so kernels see one pointer alignment whatever the table. ``args``
    holds the same views as launch arguments (:class:`_launch.Ptr`), ``addr_args`` the addresses.
    """

    __slots__ = (
        "_host",
        "_prepared",
        "_scratch",
        "_scratch_args",
        "addr_args",
        "addrs",
        "aligned",
        "args",
        "chunk",
        "chunk_count",
        "chunk_index",
        "chunk_tensor",
        "device",
        "first_chunk",
        "groups",
        "n_chunks",
        "n_tensors",
        "numel",
    )

    def __init__(self, device: torch.device, addrs: list, numels, codes: list[bytes]):
        """``addrs``: per side, the tensors' addresses (a list or an int64 tensor); ``numels``:
        their element counts (shared by the sides); ``codes``: per side, their dtype codes."""
        if CHUNK <= 0 or CHUNK % VEC:
            raise ValueError(f"gradfuse.kernels: CHUNK must be a positive multiple of {VEC}, got {CHUNK}")
        self.chunk = CHUNK
        addrs = [torch.as_tensor(side, dtype=torch.int64) for side in addrs]
        numel = torch.as_tensor(numels, dtype=torch.int64)
        n = len(numel)
        counts = torch.clamp_min((numel + (CHUNK - 1)) // CHUNK, 1)
        kinds = _kinds(addrs, [_codes(c) for c in codes])
        # Groups in order of first appearance, chunks grouped (stable), all with tensor ops.
        distinct, inverse = torch.unique(kinds, return_inverse=True)
        first_seen = torch.full((len(distinct),), n, dtype=torch.int64)
        first_seen.scatter_reduce_(0, inverse, torch.arange(n, dtype=torch.int64), "amin")
        rank = torch.empty_like(first_seen)
        rank[torch.argsort(first_seen)] = torch.arange(len(distinct), dtype=torch.int64)
        group_of = rank[inverse]
        order = torch.sort(group_of, stable=True).indices
        counts_o = counts[order]
        ends_o = torch.cumsum(counts_o, 0)
        first_o = ends_o - counts_o
        first = torch.empty(n, dtype=torch.int64)
        first[order] = first_o
        n_chunks = int(ends_o[-1])
        chunk_tensor = torch.repeat_interleave(order, counts_o)
        chunk_index = torch.arange(n_chunks, dtype=torch.int64) - torch.repeat_interleave(first_o, counts_o)
        group_counts = torch.zeros(len(distinct), dtype=torch.int64).index_add_(0, group_of, counts)

        index = -1 if device.type != "cuda" else device.index
        self.groups = []
        base = 0
        for kind, count in zip(distinct[torch.argsort(first_seen)].tolist(), group_counts.tolist(), strict=True):
            sides = [(kind >> (8 * s)) & 0xFF for s in range(len(addrs))]
            codes_of = tuple(k >> 1 for k in sides)
            self.groups.append(Group(codes_of, all(k & 1 for k in sides), base, count, index))
            base += count

        #: Per side, whether each tensor's address is 16-byte aligned (what :meth:`moved` checks).
        self.aligned = [side % ALIGN_BYTES == 0 for side in addrs]
        self.device = device
        self.n_tensors = n
        self.n_chunks = n_chunks
        self._scratch = None
        self._scratch_args = None
        self._prepared = {}
        self._host = []
        self.addrs = [self._upload(side) for side in addrs]
        self.numel, self.first_chunk, self.chunk_count, self.chunk_tensor, self.chunk_index = (
            self._upload(s) for s in (numel, first, counts, chunk_tensor, chunk_index)
        )
        self.addr_args = [Ptr(a) for a in self.addrs]
        self.args = [
            Ptr(t) for t in (self.numel, self.chunk_tensor, self.chunk_index, self.first_chunk, self.chunk_count)
        ]

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (int64) on the table's device, in a buffer of its own (16-byte aligned: every
        allocation is)."""
        if self.device.type != "cuda":
            return host
        # Pinned, so the copy is asynchronous (no host sync) and capturable; kept alive with the
        # table because a captured graph re-reads it at every replay.
        host = host.pin_memory()
        self._host.append(host)
        return host.to(self.device, non_blocking=True)

    def moved(self, addrs: list, aligned: bool = False) -> ChunkTable | None:
        """This table for the same tensors at ``addrs`` (per side, a list or an int64 tensor):
        new address buffers, the rest shared; None when a tensor's 16-byte alignment changed (the
        groups would). ``aligned``: the caller found each address as aligned as the one this table
        was built with (a plan's own tensors, whose move the Rust core checks so), and nothing is
        checked again here (three tensor ops a side: ~3 us, ~15 on a slower host). Not during a
        CUDA graph capture (the upload could not happen outside it): the caller's to refuse.

        The scratch buffers are not shared: this table describes other tensors, whose kernels may
        run while this one's do, on another stream (each DDP bucket's measuring pass runs on a
        stream of its own, and buckets of equal size are common), and counters shared between the
        two would let a kernel finalize before its partials are written."""
        addrs = [torch.as_tensor(side, dtype=torch.int64) for side in addrs]
        # The dtypes are the table's: the groups stay when every alignment does.
        if len(addrs) != len(self.aligned):
            return None
        if not aligned and not all(
            torch.equal(side % ALIGN_BYTES == 0, was) for side, was in zip(addrs, self.aligned, strict=True)
        ):
            return None
        other = ChunkTable.__new__(ChunkTable)
        for slot in ChunkTable.__slots__:
            if slot not in ("addrs", "addr_args", "_host", "_prepared", "_scratch", "_scratch_args"):
                setattr(other, slot, getattr(self, slot))
        # Its own prepared launches: this table's are bound to this table's addresses and scratch.
        other._host, other._prepared, other._scratch, other._scratch_args = [], {}, None, None
        other.addrs = [other._upload(side) for side in addrs]
        other.addr_args = [Ptr(a) for a in other.addrs]
        if self._prepared:
            other._move_prepared(self)
        return other

    def _move_prepared(self, old: ChunkTable) -> None:
        """``old``'s prepared launches, on this table's addresses and scratch buffers (a gradient
        list made again at other addresses every step keeps its launches bound: ~1 us a launch
        where preparing anew binds every argument twice)."""
        replace = {id(a): b for a, b in zip(old.addr_args, self.addr_args, strict=True)}
        allowed = {id(p) for p in (*self.args, *self.addr_args)}
        if old._scratch_args is not None:
            scratch = self.scratch_args()
            replace.update(zip(map(id, old._scratch_args), scratch, strict=True))
            allowed.update(map(id, scratch))
        for key, runs in old._prepared.items():
            moved = [prepared.moved(replace, allowed) for prepared in runs]
            if all(moved):
                self._prepared[key] = moved

    def scratch_args(self) -> tuple[Ptr, Ptr, Ptr]:
        """:meth:`scratch` as launch arguments."""
        scratch = self.scratch()
        if self._scratch_args is None or self._scratch_args[0].tensor is not scratch[0]:
            self._scratch_args = tuple(Ptr(t) for t in scratch)
        return self._scratch_args

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


def _codes(codes) -> torch.Tensor:
    """Dtype codes (bytes, a list or a tensor) as an int64 tensor."""
    if isinstance(codes, bytes | bytearray):
        return (
            torch.frombuffer(bytearray(codes), dtype=torch.uint8).to(torch.int64)
            if codes
            else torch.zeros(0, dtype=torch.int64)
        )
    return torch.as_tensor(codes, dtype=torch.int64)


def _kinds(addrs: list[torch.Tensor], codes: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor, its group's key: per side (a byte each) its dtype code and whether its address
    is 16-byte aligned (``code << 1 | aligned``)."""
    kinds = torch.zeros_like(addrs[0])
    for s, (side, code) in enumerate(zip(addrs, codes, strict=True)):
        kinds |= ((code << 1) | (side % ALIGN_BYTES == 0).to(torch.int64)) << (8 * s)
    return kinds


_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")


def f64_bits(value: float) -> int:
    """``value`` as the signed int64 with its float64 bits: how an exact float64 scalar reaches a
    kernel (Triton passes Python floats as float32). Kernels decode it with ``_jit.as_f64``."""
    return _I64.unpack(_F64.pack(value))[0]


def _meta(group: Group, fp_fusion: bool, meta: dict) -> dict:
    """The meta-parameters of a chunk kernel's launch over ``group``: ``meta`` and those every
    chunk kernel takes (``ALIGNED``, ``CHUNK``, ``BLOCK``, ``VEC``, the warp count, and FP fusion,
    stated rather than defaulted: Triton >= 3.9 warns when it is unset and changes the default in
    3.10)."""
    return {
        "ALIGNED": group.aligned,
        "CHUNK": CHUNK,
        "BLOCK": BLOCK,
        "VEC": VEC,
        "num_warps": NUM_WARPS,
        "enable_fp_fusion": fp_fusion,
        **meta,
    }


#: Prepared launch sets kept per table, at most (a handful of kernels and configurations in use).
_PREPARED_PER_TABLE = 32


def launches(table: ChunkTable, kernel, config: tuple, make) -> list[Prepared]:
    """The launches of ``kernel`` over every group of ``table``, in order, prepared
    (:class:`_launch.Prepared`) once per table, ``config`` (what the arguments and meta-parameters
    depend on besides the table and the group: hashable, exact) and :func:`tuning`, by
    ``make(group) -> (args, fp_fusion, meta)``, where ``args`` holds ``SLOT`` where each call's
    values go and otherwise the table's buffers (``Ptr``) and numbers. Valid as long as the table
    and the tuning are (a caller that keeps them checks both)."""

    def prepare():
        runs = []
        for g in table.groups:
            args, fp_fusion, meta = make(g)
            runs.append(Prepared(launcher(kernel), g.count, args, _meta(g, fp_fusion, meta), g.device))
        return runs

    return _prepared(table, kernel, config, prepare)


def run(table: ChunkTable, kernel, config: tuple, make, *values) -> None:
    """Launches ``kernel`` over every group of ``table`` (:func:`launches`), with ``values`` in
    the slots."""
    for prepared in launches(table, kernel, config, make):
        prepared(*values)


def run_once(table: ChunkTable, kernel, grid: int, config: tuple, make, *values) -> None:
    """One launch of ``kernel`` on ``grid`` programs for ``table`` (not per group: a finishing
    kernel, say), prepared as :func:`run` prepares, by ``make() -> (args, meta)`` (every
    meta-parameter: none is added)."""

    def prepare():
        args, meta = make()
        return [Prepared(launcher(kernel), grid, args, meta, table.groups[0].device)]

    _prepared(table, kernel, (grid, config), prepare)[0](*values)


def tuning() -> tuple:
    """What every chunk kernel's launches depend on besides their table and arguments (tests
    change it): ``(CHUNK, BLOCK, FBLOCK, VEC, NUM_WARPS)``."""
    return (CHUNK, BLOCK, FBLOCK, VEC, NUM_WARPS)


def _prepared(table: ChunkTable, kernel, config: tuple, prepare) -> list[Prepared]:
    """The table's prepared launches of ``kernel`` for ``config`` and the current tuning, made by
    ``prepare()`` the first time."""
    key = (id(kernel), config, *tuning())  # the kernels live as long as the module
    runs = table._prepared.get(key)
    if runs is None:
        if len(table._prepared) >= _PREPARED_PER_TABLE:
            table._prepared.clear()  # configurations that keep changing (a norm type per call): bounded
        runs = table._prepared[key] = prepare()
    return runs
