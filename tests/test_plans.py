"""Kept plans are never stale (``gradfuse._plan``).

A plan is validated once and kept; later calls confirm it against their tensors. Here sequences of
calls are interleaved with every way the tensors can change under a kept plan (a replaced
``.grad``, ``set_``, ``.data =``, ``resize_``, a dtype change, grads turning None, a changed
order, a new list of the same length, memory or object ids reused, aliases introduced, layouts
changed), and after each call the result is checked against torch and a float64 reference, on
the Rust core and on the Triton kernels (interpreter). Plus: what a plan keeps (no tensors, a
bounded cache), and that repeated calls reuse it (moved when the gradients are made again).
"""

from __future__ import annotations

import copy
import gc
import math
import os
import random
import weakref
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch

import gradfuse
from gradfuse import _plan
from reference import close, ref_norms, same_bits

TORCH_CLIP = torch.nn.utils.clip_grad_norm_
TORCH_CLIP_WITH_NORM = torch.nn.utils.clip_grads_with_norm_
SHAPES = [(4, 6), (16,), (3, 5), (7,), (2, 8), (4, 3, 2, 2)]


def rand_like(t: torch.Tensor, generator) -> torch.Tensor:
    return (torch.randn(t.shape, dtype=torch.float64, generator=generator) * 3).to(t.dtype)


class World:
    """Parameters and gradients that the steps change, and the calls that check them."""

    def __init__(self, seed: int, copies: int = 1):
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        shapes = SHAPES * copies
        self.params = [
            self._param(s, torch.bfloat16 if i % len(SHAPES) == 3 else torch.float32) for i, s in enumerate(shapes)
        ]

    def _param(self, shape, dtype) -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = rand_like(p, self.gen)
        return p

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def pick(self, with_grad: bool = True) -> torch.nn.Parameter | None:
        choices = [p for p in self.params if (p.grad is not None) == with_grad]
        return self.rng.choice(choices) if choices else None

    # --- the changes ------------------------------------------------------------------------

    def replace(self):
        if (p := self.pick()) is not None:
            p.grad = rand_like(p, self.gen)

    def set_(self):
        if (p := self.pick()) is not None:
            g = p.grad
            # Memory for g's own strides (a strided view reaches past numel elements).
            extent = sum((n - 1) * st for n, st in zip(g.shape, g.stride(), strict=True)) + 1 if g.numel() else 1
            fresh = rand_like(torch.empty(extent, dtype=g.dtype), self.gen)
            g.set_(fresh.untyped_storage(), 0, g.shape, g.stride())

    def set_inside(self):
        """``set_`` to a contiguous window in the middle of a larger buffer."""
        if (p := self.pick()) is not None:
            g = p.grad
            big = rand_like(torch.empty(g.numel() + 13, dtype=g.dtype), self.gen)
            # Strides stated: without them set_ keeps the tensor's own (a strided view's would
            # reach past the buffer's end).
            g.set_(big.untyped_storage(), 5, g.shape, torch.empty(g.shape, device="meta").stride())

    def data(self):
        if (p := self.pick()) is not None:
            p.grad.data = rand_like(p.grad, self.gen)

    def data_dtype(self):
        """``.data =`` to another dtype (the parameter keeps its own)."""
        if (p := self.pick()) is not None:
            other = torch.float64 if p.grad.dtype != torch.float64 else torch.float32
            p.grad.data = p.grad.data.to(other)

    def view_dtype(self):
        """The same bytes read as another dtype: same address, same size in bytes."""
        p = self.pick()
        if p is not None and p.grad.dtype == torch.float32 and p.grad.is_contiguous():
            p.grad.data = p.grad.data.view(torch.bfloat16)
            p.grad.copy_(rand_like(p.grad, self.gen))  # the low halves of float32 are no sane bfloat16

    def resize(self):
        if (p := self.pick()) is not None and p.grad.numel() > 2:
            p.grad.resize_(p.grad.numel() // 2)

    def none(self):
        if (p := self.pick()) is not None:
            p.grad = None

    def revive(self):
        if (p := self.pick(with_grad=False)) is not None:
            p.grad = rand_like(p, self.gen)

    def order(self):
        self.rng.shuffle(self.params)

    def new_list(self):
        """Fresh parameters of the same kinds: a new list of the same length."""
        self.params = [self._param(p.shape, p.dtype) for p in self.params]

    def free_and_reuse(self):
        """Every gradient freed, then made again at once: the allocator hands back the same memory
        (and Python the same object ids) as often as not, with other values."""
        shapes = [(p, p.grad.shape, p.grad.dtype) for p in self.params if p.grad is not None]
        for p, _, _ in shapes:
            p.grad = None
        gc.collect()
        for p, shape, dtype in shapes:
            if shape == p.shape and dtype == p.dtype:
                p.grad = rand_like(p, self.gen)

    def alias(self):
        """One gradient shared by two parameters (the same tensor), or overlapping views."""
        same = [(a, b) for a in self.params for b in self.params if a is not b and a.shape == b.shape]
        same = [(a, b) for a, b in same if a.grad is not None and a.grad.shape == b.shape and a.grad.dtype == b.dtype]
        if same and self.rng.random() < 0.5:
            a, b = self.rng.choice(same)
            b.grad = a.grad
            return
        p = self.pick()
        if p is not None and p.grad.dtype == p.dtype and p.grad.shape == p.shape and p.dim() == 1:
            q = next((q for q in self.params if q is not p and q.shape == p.shape and q.dtype == p.dtype), None)
            if q is not None:
                base = rand_like(torch.empty(p.numel() + 3, dtype=p.dtype), self.gen)
                p.grad, q.grad = base[: p.numel()], base[3:]

    def non_contiguous(self):
        if (p := self.pick()) is not None and p.grad.shape == p.shape and p.dim() >= 1:
            wide = rand_like(torch.empty(*p.shape[:-1], 2 * p.shape[-1], dtype=p.dtype), self.gen)
            p.grad = wide[..., ::2]

    def transpose(self):
        p = self.pick()
        if p is not None and p.grad.dim() == 2:
            p.grad.t_()

    def permute(self):
        """A gradient re-pointed over its own memory with its dimensions in another order (``set_``
        with permuted strides: the same address and size, dense in no named memory format), or
        given fresh memory in such an order."""
        p = self.pick()
        if p is None or p.grad.dim() < 2:
            return
        g = p.grad
        order = list(range(g.dim()))
        while order == list(range(g.dim())):
            self.rng.shuffle(order)
        base = torch.empty([g.shape[d] for d in order], device="meta").stride()
        strides = [0] * g.dim()
        for pos, d in enumerate(order):
            strides[d] = base[pos]
        if self.rng.random() < 0.5 and g.is_contiguous():
            g.set_(g.untyped_storage(), g.storage_offset(), g.shape, strides)
        else:
            fresh = rand_like(torch.empty(g.numel(), dtype=g.dtype), self.gen)
            g.set_(fresh.untyped_storage(), 0, g.shape, strides)

    def values(self):
        if (p := self.pick()) is not None:
            p.grad.mul_(3.0)

    def relayout(self):
        """A 4-d gradient switched between channels-last and torch's contiguous format: in new
        memory, or over its own (``set_`` with the other format's strides: the same address and
        size, its elements now in another order)."""
        p = self.pick()
        if p is None or p.grad.dim() != 4:
            return
        g = p.grad
        channels_last = g.is_contiguous(memory_format=torch.channels_last) and not g.is_contiguous()
        layout = torch.contiguous_format if channels_last else torch.channels_last
        if self.rng.random() < 0.5:
            new = g.contiguous(memory_format=layout)
            if g.dtype == p.dtype:
                p.grad = new
            else:  # after a .data = of another dtype: torch refuses such a gradient assigned
                g.data = new
        else:
            strides = torch.empty(g.shape, device="meta").contiguous(memory_format=layout).stride()
            g.set_(g.untyped_storage(), g.storage_offset(), g.shape, strides)

    # --- the calls ---------------------------------------------------------------------------

    def check_clip(self, max_norm: float):
        """The drop-in clip: the total as the float64 reference, the gradients as torch scales
        them by that total (aliases included), the kept plans whatever they are."""
        # torch's clip reads ``.grad`` of what it is given; one deepcopy keeps the aliasing.
        reference = [SimpleNamespace(grad=g) for g in copy.deepcopy([p.grad for p in self.params])]
        before = [g.clone() for g in self.grads()]
        total = gradfuse.clip_grad_norm_(self.params, max_norm)
        if aliased(self.grads()):  # handed to torch: torch's answer, bit for bit
            assert same_bits(total, TORCH_CLIP(reference, max_norm))
        else:
            want, _ = ref_norms(before, 2.0)
            assert close(total.item(), want, 4e-6), (total.item(), want)
            TORCH_CLIP_WITH_NORM(reference, max_norm, total)
        for p, q in zip(self.params, reference, strict=True):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert same_bits(p.grad, q.grad), (p.grad, q.grad)

    def check_total(self, norm_type: float):
        grads = self.grads()
        total = gradfuse.get_total_norm(grads, norm_type)
        want = torch.nn.utils.get_total_norm([g.double() for g in grads], norm_type)
        assert close(total.item(), want.item(), 4e-6), (total.item(), want.item())

    def check_unscale_and_clip(self, max_norm: float):
        """The fused op: refuses aliases (as documented), else unscales and clips."""
        grads = self.grads()
        inv, found = torch.full((), 0.25), torch.zeros(())
        before = [g.clone() for g in grads]
        if aliased(grads):
            with pytest.raises(_plan.OverlapError, match="overlap in memory"):
                gradfuse.unscale_and_clip_(grads, inv, found, max_norm)
            assert all(same_bits(g, b) for g, b in zip(grads, before, strict=True)) and found.item() == 0
            return
        total = gradfuse.unscale_and_clip_(grads, inv, found, max_norm)
        want, _ = ref_norms([b.double() * 0.25 for b in before], 2.0)
        assert close(total.item(), want, 4e-6), (total.item(), want)
        assert found.item() == float(not all(torch.isfinite(b).all() for b in before))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        factor = 0.25 * coef.item()
        for g, b in zip(grads, before, strict=True):
            m = torch.float64 if b.dtype == torch.float64 else torch.float32
            assert same_bits(g, (b.to(m) * torch.tensor(factor, dtype=torch.float64).to(m)).to(b.dtype))


def aliased(grads: list[torch.Tensor]) -> bool:
    """Whether two gradients' memory spans meet (the steps make aliases only of whole spans)."""
    spans = []
    for g in grads:
        if g.numel():
            extent = sum((n - 1) * st for n, st in zip(g.shape, g.stride(), strict=True)) + 1
            spans.append((g.data_ptr(), g.data_ptr() + extent * g.element_size()))
    spans.sort()
    return any(a[1] > b[0] for a, b in pairwise(spans))


CHANGES = [
    "replace",
    "set_",
    "set_inside",
    "data",
    "data_dtype",
    "view_dtype",
    "resize",
    "none",
    "revive",
    "order",
    "new_list",
    "free_and_reuse",
    "alias",
    "non_contiguous",
    "transpose",
    "values",
    "relayout",
    "permute",
]


def run_call(world: World, which: int):
    if which == 0:
        world.check_clip(max_norm=world.rng.choice([0.5, 1e6]))
    elif which == 1:
        world.check_total(world.rng.choice([2.0, 1.0, math.inf]))
    else:
        world.check_unscale_and_clip(max_norm=world.rng.choice([0.5, 1e6]))


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_under_a_kept_plan_gives_torchs_answer(backend, change):
    """Each call twice first (the plan is made, then kept), then the change, then every call."""
    world = World(seed=CHANGES.index(change))
    for which in (0, 1, 2, 0, 1, 2):
        run_call(world, which)
    for _ in range(3):  # some changes need a gradient of a certain kind: try a few times
        getattr(world, change)()
        for which in (0, 1, 2):
            run_call(world, which)


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_of_changes_and_calls(backend, seed):
    world = World(seed=100 + seed)
    for _ in range(18):
        if world.rng.random() < 0.6:
            getattr(world, world.rng.choice(CHANGES))()
        run_call(world, world.rng.randrange(3))


@pytest.fixture
def prefetching():
    """Every probe prefetches ahead of its getters (``rust/prefetch.rs``; the threshold in bytes
    lowered to nothing), with the offsets found on this torch."""
    _plan.probes()
    core = _plan.rust_core()
    offsets, threshold = core.prefetch()
    assert offsets is not None, "no tensor layout offsets found on this torch (gradfuse._layout)"
    core.prefetch(min_bytes=0)
    yield
    core.prefetch(min_bytes=threshold)


@pytest.mark.parametrize("seed", range(8))
def test_random_sequences_under_walks_that_prefetch(prefetching, seed):
    """The same sequences over 42 gradients, long enough for both stages of the prefetching walk
    (8 and 4 tensors ahead) to run in ``grads_of`` and in every probe, while the changes replace,
    re-point, free and reuse what those stages read and prefetch."""
    world = World(seed=200 + seed, copies=7)
    for _ in range(30):
        if world.rng.random() < 0.6:
            getattr(world, world.rng.choice(CHANGES))()
        run_call(world, world.rng.randrange(3))


# --- what a plan keeps, and that it is kept ------------------------------------------------


def test_a_kept_plan_holds_no_tensor():
    grads = [torch.randn(10), torch.randn(3, 4)]
    refs = [weakref.ref(g) for g in grads]
    for _ in range(2):
        gradfuse.clip_grad_norm_(grads, 1.0)
        gradfuse.get_total_norm(grads)
    assert _plan._PLANS  # kept
    del grads
    gc.collect()
    assert all(r() is None for r in refs)


def test_lists_of_one_shape_taken_in_turn_each_keep_their_plan(monkeypatch):
    """Up to PLANS_PER_KEY lists of one shape at their own addresses, called in turn (the bench's
    buffer sets of two implementations; models of one architecture), each find their own plan
    after the first round: none is moved (on CUDA a move uploads addresses and allocates the
    table's scratch), none is built again. One list more and they move."""
    moves = []
    monkeypatch.setattr(_plan.Plan, "moved", lambda self, *a, real=_plan.Plan.moved: moves.append(1) or real(self, *a))
    gen = torch.Generator().manual_seed(0)

    def rounds(n_lists):
        lists = [[torch.randn(5, generator=gen), torch.randn(3, 2, generator=gen)] for _ in range(n_lists)]
        for _ in range(2):
            for grads in lists:
                want = ref_norms(grads, 2.0)[0]
                assert close(gradfuse.get_total_norm(grads).item(), want, 2e-6)
        moves.clear()
        for grads in lists:
            gradfuse.get_total_norm(grads)
        return len(moves)

    _plan.clear_plans()
    assert rounds(_plan.PLANS_PER_KEY) == 0
    _plan.clear_plans()
    assert rounds(_plan.PLANS_PER_KEY + 1) == _plan.PLANS_PER_KEY + 1


def test_a_kept_plan_holds_no_tensor_of_a_source_planned_for_one_call(backend):
    """accumulate_ over a kept ``dst`` plan with a ``src`` that is planned for the call alone (a
    transposed source is copied, and the plan of the copy holds the list it works on): nothing the
    kept plan derives keeps the caller's tensors, or the copies, alive."""
    dst = [torch.zeros(50), torch.zeros(3, 4)]
    a, b = torch.randn(50), torch.randn(4, 3)
    refs = [weakref.ref(a), weakref.ref(b)]
    for _ in range(2):
        gradfuse.accumulate_(dst, [a, b.t()])
    assert same_bits(dst[0], 2 * a) and same_bits(dst[1], 2 * b.t())
    del a, b
    gc.collect()
    assert all(r() is None for r in refs)


def test_the_same_bytes_as_another_dtype_at_the_same_address_are_planned_anew(backend):
    """Memory a kept plan described, now a tensor of another dtype and length (the same bytes):
    the new tensor's norm, not the old reading of its bytes."""
    storage = torch.randn(8, dtype=torch.float64)
    as_f32 = [storage.view(torch.float32)]
    for _ in range(2):
        gradfuse.multi_tensor_norm(as_f32)
    as_f64 = [storage]  # same address, same size in bytes
    want, _ = ref_norms(as_f64, 2.0)
    assert close(gradfuse.multi_tensor_norm(as_f64).item(), want, 1e-12)


def test_an_empty_tensor_on_another_device_is_not_taken_for_the_kept_one():
    """An empty tensor's address says nothing about its device: it is read at every call."""
    tensors = [torch.zeros(0), torch.randn(5)]
    for _ in range(2):
        gradfuse.multi_tensor_norm(tensors)
    with pytest.raises(_plan.MixedDevicesError, match=r"tensors\[0\] is on meta"):
        gradfuse.multi_tensor_norm([torch.zeros(0, device="meta"), tensors[1]])


def test_the_probe_reads_the_device_of_a_tensor_that_moved_and_only_then():
    """A kept plan's tensors at other addresses must be on the plan's device (the probe reads it,
    in its one pass); at the plan's own addresses the address says the device and nothing is
    read. With one device here, the probe is asked about a device the tensors are not on."""
    if not _plan.probes():
        pytest.skip("the Rust core cannot call this torch's getters")
    grads = [torch.randn(6), torch.randn(4)]
    plan = _plan.make_plan("test", "grads", grads, inplace=True)
    elsewhere = [g.clone() for g in grads]
    assert plan.tensor_list.probe(elsewhere, True, -1) == _plan.as_words(g.data_ptr() for g in elsewhere)
    assert plan.tensor_list.probe(elsewhere, True, 0) is None  # not on cuda:0: no move
    assert plan.tensor_list.probe(grads, True, 0) is True  # the plan's own addresses: not read
    half = [grads[0], elsewhere[1]]
    assert plan.tensor_list.probe(half, True, 0) is None
    assert plan.tensor_list.probe(half, True, -1) == _plan.as_words(g.data_ptr() for g in half)


def test_an_inference_tensor_in_place_of_a_kept_one_gets_torchs_error():
    """Outside inference mode torch refuses to write an inference tensor in place: so does a
    call that finds one where a kept plan had a normal tensor (same size, dtype, address or not)."""
    grads = [torch.randn(6), torch.randn(4)]
    for _ in range(2):
        gradfuse.clip_grad_norm_(grads, 1e-3)
    with torch.inference_mode():
        frozen = [grads[0].clone(), grads[1]]
    before = [g.clone() for g in frozen]
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        torch.ops.gradfuse.clip_grad_norm_(frozen, 1e-3, 2.0, False)
    assert all(same_bits(g, b) for g, b in zip(frozen, before, strict=True))


def _negated(t: torch.Tensor) -> torch.Tensor:
    """``t`` made a lazily negated view of its own memory, in place (``.data =``): the same
    object, address, dtype, size and layout, each value now the negation of what its memory holds."""
    t.data = torch._neg_view(t.data)
    assert t.is_neg()
    return t


@pytest.mark.parametrize("fresh", [False, True], ids=["kept plans", "new plans"])
def test_negated_views_give_the_values_they_hold(backend, fresh):
    """A tensor with torch's negative bit (``torch._neg_view``, ``z.conj().imag``) holds the
    negation of its values in memory. An addition into or from one, and a clamp into a range that
    is not symmetric, give the results of its values, whether its plan is new or was kept for it
    before the bit was set (same address: the confirmation asks); a clip and a norm, whose results
    a negation does not change, give torch's answer too. Checked against float64 references of
    the values, a dtype pair (fp32 += bf16) among the additions."""
    gen = torch.Generator().manual_seed(11)
    dst = [torch.randn(s, generator=gen) for s in SHAPES]
    src = [torch.randn(s, generator=gen).to(torch.bfloat16 if i == 1 else torch.float32) for i, s in enumerate(SHAPES)]
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    if fresh:
        _plan.clear_plans()  # none kept for other tensors that were at these addresses
    else:  # plans made and kept for the lists as they are
        for _ in range(2):
            gradfuse.accumulate_(dst, src, alpha=0.0)
            gradfuse.ops.clamp_op([g.clone() for g in grads], -1e9, 1e9)
            gradfuse.ops.clamp_op(grads, -1e9, 1e9)
            gradfuse.multi_tensor_norm(grads)
    for i in (0, 3):
        _negated(dst[i])
        _negated(src[i + 1])
        _negated(grads[i])

    want = [d.double() + 0.5 * s.double() for d, s in zip(dst, src, strict=True)]
    gradfuse.accumulate_(dst, src, alpha=0.5)
    for i, (d, w) in enumerate(zip(dst, want, strict=True)):
        # fp32 sums of fp32 and bf16 values: one rounding of the sum (w is exact in float64).
        torch.testing.assert_close(d.double(), w, rtol=2**-23, atol=0, msg=f"dst[{i}]")
    assert dst[0].is_neg() and dst[3].is_neg()  # written through torch: still negated views

    total, _ = ref_norms(grads, 2.0)
    assert close(gradfuse.multi_tensor_norm(grads).item(), total, 4e-6)
    clamped = [g.double().clamp(-0.25, 1.0) for g in grads]
    gradfuse.ops.clamp_op(grads, -0.25, 1.0)
    assert all(torch.equal(g.double(), c) for g, c in zip(grads, clamped, strict=True))
    # Their memory holds the negation: a clip by 0.5 scales it, and so the values.
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    before = [g.double() for g in grads]
    total, _ = ref_norms(before, 2.0)
    got = gradfuse.clip_grad_norm_(params, 0.5)
    assert close(got.item(), total, 4e-6)
    coef = 0.5 / (got.item() + 1e-6)
    for g, b in zip(grads, before, strict=True):
        torch.testing.assert_close(g.double(), b * coef, rtol=2**-22, atol=0)


def test_the_shape_check_of_a_pair_names_the_first_pair_that_differs():
    """``accumulate_``'s pairs: shapes compared in one pass (the Rust core's), the first pair of
    other shapes named as Python would find it, nothing modified; a subclass among them is
    compared in Python (the pass cannot answer for it)."""

    class Sub(torch.Tensor):
        pass

    dst = [torch.zeros(4, 3), torch.zeros(6), torch.zeros(2, 8), torch.zeros(3)]
    for src, index in (
        ([torch.ones(4, 3), torch.ones(6), torch.ones(8, 2), torch.ones(3, 1)], 2),
        ([torch.ones(4, 3), torch.ones(6), torch.ones(2, 8), torch.ones(3, 1)], 3),
        ([torch.ones(4, 3), torch.ones(2, 3), torch.ones(2, 8), torch.ones(3)], 1),
        ([torch.ones(4, 3), torch.ones(6).as_subclass(Sub), torch.ones(2, 8), torch.ones(1, 3)], 3),
    ):
        with pytest.raises(ValueError, match=rf"dst\[{index}\] has shape .* but src\[{index}\] has shape"):
            gradfuse.accumulate_(dst, src)
        assert all(not d.any() for d in dst)
    if _plan.probes():
        core = _plan.rust_core()
        assert core.shape_mismatch(dst, [d.clone() for d in dst]) == -1
        assert core.shape_mismatch(dst, [torch.ones(4, 3), torch.ones(6), torch.ones(16), torch.ones(3)]) == 2
        assert core.shape_mismatch(dst, dst[:3]) is None  # other lengths: the caller's to name
        assert core.shape_mismatch([torch.zeros(2).as_subclass(Sub)], [torch.zeros(2)]) is None


def _count_builds(monkeypatch) -> list:
    """The ops of the plans made from here on (none kept before)."""
    _plan.clear_plans()
    built = []
    real = _plan._build

    def counting(op, name, tensors, *args):
        built.append(op)
        return real(op, name, tensors, *args)

    monkeypatch.setattr(_plan, "_build", counting)
    return built


def test_a_training_loop_plans_once(backend, monkeypatch):
    """The Trainer's step: gradients set to None, made again by backward (often at other
    addresses), unscaled, clipped and stepped by the scaler: the plans made by the first step are
    moved by the later ones, never made anew."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = gradfuse.GradScaler("cpu", init_scale=2.0**8)
    built = _count_builds(monkeypatch)
    x = torch.randn(32, 8)
    totals = []
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(x).square().mean()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        total = scaler.unscale_and_clip_(opt, max_norm=0.1)
        want, _ = ref_norms([g.double() / 2.0**8 for g in grads], 2.0)
        assert close(total.item(), want, 4e-6)
        scaler.step(opt)
        scaler.update()
        totals.append(total.item())
        if step == 0:
            first = len(built)
    assert first >= 1 and len(built) == first, built


def test_the_drop_in_clip_plans_once_over_gradients_made_again(backend, monkeypatch):
    model = torch.nn.Linear(5, 3)
    built = _count_builds(monkeypatch)
    for step in range(4):
        model.zero_grad(set_to_none=True)
        model(torch.randn(7, 5)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        total = gradfuse.clip_grad_norm_(model.parameters(), 0.5)
        want, _ = ref_norms(grads, 2.0)
        assert close(total.item(), want, 4e-6)
        if step == 0:
            first = len(built)
    assert len(built) == first == 1, built


def test_a_plan_moved_at_every_step_keeps_no_chain_of_tables(backend):
    """Gradients made again at every step move the plan every call: each moved plan takes what
    its predecessor derived (the chunk table, to move) and nothing older."""
    grads = [torch.randn(7), torch.randn(3, 3)]
    plans = []
    for _ in range(6):
        grads = [g.clone() for g in grads]  # new memory, as backward makes after zero_grad(set_to_none)
        gradfuse.multi_tensor_norm(grads)
        plans.append(_plan.make_plan("t", "tensors", grads, inplace=False))
    for plan in plans[1:]:
        inherited = plan.memo.get("moved_from", {})
        assert "moved_from" not in inherited


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_lists_of_one_kind_keep_scratch_buffers_of_their_own(backend):
    """Two lists of the same shapes at other addresses: the second's plan, and its chunk table,
    are the first's moved. The norm kernels' scratch (partials, counters) must still be each
    list's own: kernels over the two may run at once on two streams (DDP runs each bucket's
    measuring pass on a stream of its own, and buckets of equal size are common; a graph replay
    beside eager calls), and shared counters would let one kernel finalize with the other's
    programs counted, before its own partials are written. Emulated here: the first list's
    kernel in flight (one of its programs counted) while the second's norm runs."""
    a = [torch.randn(200), torch.randn(3, 50)]
    b = [torch.randn(200) * 3, torch.randn(3, 50)]
    gradfuse.multi_tensor_norm(a)
    counters = _plan.make_plan("t", "tensors", a, inplace=False).memo["table"].scratch()[2]
    counters[0] = 1
    try:
        got = gradfuse.multi_tensor_norm(b)
    finally:
        counters[0] = 0
    want, _ = ref_norms(b, 2.0)
    assert close(got.item(), want, 2e-6)


class _LoggedParameter(torch.nn.Parameter):
    """A Parameter subclass whose ``grad`` reads are its own (a user's, or a tensor library's)."""

    reads = 0

    @property
    def grad(self):
        type(self).reads += 1
        return torch.Tensor.grad.__get__(self)

    @grad.setter
    def grad(self, value):
        torch.Tensor.grad.__set__(self, value)


def test_gradients_are_read_in_one_pass_as_python_reads_them():
    """``_plan.grads_of`` (one Rust pass through torch's getter) gives the very gradient objects a
    Python loop gives, Nones skipped, in order; it answers None (the caller reads them in Python)
    for anything it cannot read as Python would: a Parameter subclass with a ``grad`` of its own,
    a gradient that is a tensor subclass, a getter that raises. The drop-in then still gives
    torch's answer, through the subclass's own ``grad``."""
    if not _plan.probes():
        pytest.skip("the probes are not set on this Python/torch: the C-level maps are used")
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 2, 4)] + [torch.zeros(6, requires_grad=True)]
    for i, p in enumerate(params):
        if i != 2:
            p.grad = torch.randn(p.shape, generator=gen)
    got = _plan.grads_of(params)
    want = [p.grad for p in params if p.grad is not None]
    assert len(got) == len(want) == 4 and all(a is b for a, b in zip(got, want, strict=True))
    assert _plan.grads_of([]) == []

    logged = _LoggedParameter(torch.zeros(4))
    logged.grad = torch.randn(4, generator=gen)
    assert _plan.grads_of([*params, logged]) is None

    class Sub(torch.Tensor):
        pass

    odd = torch.nn.Parameter(torch.zeros(4))
    odd.grad = torch.randn(4, generator=gen).as_subclass(Sub)
    assert _plan.grads_of([*params, odd]) is None

    # The drop-in over the subclass parameter: its own getter is used, and torch's answer given.
    ours = [copy.deepcopy(p) for p in params] + [logged]
    theirs = [copy.deepcopy(p) for p in params] + [copy.deepcopy(logged)]
    for a, b in zip(ours, theirs, strict=True):
        if a.grad is not None:
            b.grad = a.grad.clone()
    before = _LoggedParameter.reads
    total = gradfuse.clip_grad_norm_(ours, 0.5)
    assert _LoggedParameter.reads > before
    want_total = TORCH_CLIP(theirs, 0.5)
    assert close(total.item(), want_total.item(), 2e-6)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=2e-6, atol=1e-7)


def test_a_non_leaf_grad_read_warns_once_as_torch_does():
    """torch warns when ``.grad`` of a non-leaf tensor is read; the one-pass read calls the same
    getter, so the warning is the same, once per read; made an error, it reaches the caller."""
    if not _plan.probes():
        pytest.skip("the probes are not set on this Python/torch")
    leaf = torch.zeros(3, requires_grad=True)
    non_leaf = leaf * 2
    with pytest.warns(UserWarning, match="not a leaf") as record:
        assert _plan.grads_of([non_leaf]) == []
    assert len([w for w in record if "leaf" in str(w.message)]) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="not a leaf"):
            gradfuse.clip_grad_norm_([non_leaf], 1.0)


def test_the_hot_paths_grad_mode_switch_restores_the_mode_it_found():
    """``ops.no_grad`` (the drop-ins' cheaper ``torch.no_grad``): grad mode off inside, the mode
    it found back after, also after an exception and when nested."""
    from gradfuse import ops

    for start in (True, False):
        torch.set_grad_enabled(start)
        try:
            with ops.no_grad():
                assert not torch.is_grad_enabled()
                with ops.no_grad():
                    assert not torch.is_grad_enabled()
                assert not torch.is_grad_enabled()
            assert torch.is_grad_enabled() is start
            with pytest.raises(KeyError):
                with ops.no_grad():
                    raise KeyError("x")
            assert torch.is_grad_enabled() is start
        finally:
            torch.set_grad_enabled(True)


# --- channels-last tensors: kept plans of dense, non-contiguous memory --------------------------


def _conv_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(5)
    )
    net(torch.randn(2, 3, 8, 8))
    return net.to(memory_format=torch.channels_last)


def test_channels_last_gradients_are_planned_once(backend, monkeypatch):
    """A channels-last conv net's gradients (contiguous in channels-last, not in torch's default
    format): the first call's plan is kept and confirmed (moved when backward makes them again),
    not made anew at every call as a plan of non-contiguous tensors was; each call gives torch's
    answer."""
    ours, theirs = _conv_net(0), _conv_net(0)
    built = _count_builds(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(4, 3, 8, 8, generator=gen).contiguous(memory_format=torch.channels_last)
        for net in (ours, theirs):
            net.zero_grad(set_to_none=True)
            net(x).square().sum().backward()
        assert any(p.grad.dim() == 4 and not p.grad.is_contiguous() for p in ours.parameters())
        total = gradfuse.clip_grad_norm_(ours.parameters(), 0.5)
        want = TORCH_CLIP(theirs.parameters(), 0.5)
        assert close(total.item(), want.item(), 4e-6)
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=4e-6, atol=1e-7)
        if step == 0:
            first = len(built)
    assert len(built) == first == 1, built


def test_permuted_gradients_are_planned_once(backend, monkeypatch):
    """Gradients dense in an order no memory format names (transposed, permuted: what torch gives
    a parameter made that way) keep their plan, as contiguous ones do: confirmed at every call
    (their sizes and strides compared), each call torch's answer; a permutation changed in place
    (same address, same size) is planned anew."""
    gen = torch.Generator().manual_seed(11)
    shapes = [((6, 4), (1, 0)), ((2, 3, 5), (2, 0, 1)), ((7,), (0,))]
    params = []
    for shape, order in shapes:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn([shape[d] for d in order], generator=gen).permute(*_inverse(order))
        params.append(p)
    assert [p.grad.shape for p in params] == [torch.Size(s) for s, _ in shapes]
    assert not params[0].grad.is_contiguous() and not params[1].grad.is_contiguous()
    built = _count_builds(monkeypatch)

    def check(max_norm):
        theirs = [SimpleNamespace(grad=p.grad.clone()) for p in params]
        total = gradfuse.clip_grad_norm_(params, max_norm)
        want = TORCH_CLIP(theirs, max_norm)
        assert close(total.item(), want.item(), 4e-6)
        for a, b in zip(params, theirs, strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=4e-6, atol=1e-7)

    for max_norm in (1e9, 0.5, 1e9, 0.25):
        check(max_norm)
    assert len(built) == 1, built
    plan = _plan.make_plan("t", "grads", [p.grad for p in params], inplace=True)
    assert plan.permuted == (0, 1) and plan.cached
    g = params[1].grad  # another order over the same memory: same address, same size
    g.set_(g.untyped_storage(), g.storage_offset(), g.shape, (1, 10, 2))
    check(0.1)
    assert len(built) == 2, built
    check(0.1)
    assert len(built) == 2, built


def _inverse(order):
    inverse = [0] * len(order)
    for pos, d in enumerate(order):
        inverse[d] = pos
    return inverse


def test_a_permuted_plan_serves_no_op_on_rows(backend):
    """A kept plan of a transposed tensor walks its memory as it lies: right for a scale (each
    element alone), wrong for AGC's unit ops, whose units are rows along dim 0 (not blocks of a
    transpose's memory). After a scale keeps such a plan (in place, as ``scale_units_`` is), each
    row is still scaled by its own factor."""
    gen = torch.Generator().manual_seed(13)
    t = torch.randn(5, 6, generator=gen).t()  # (6, 5): each row strided by 6 in memory
    gradfuse.multi_tensor_scale_([t], 0.5)  # a kept plan of [t], permuted
    assert _plan.make_plan("t", "tensors", [t], inplace=True).permuted == (0,)
    factors = torch.arange(1.0, 7.0)
    want = t.double() * factors.double()[:, None]
    torch.ops.gradfuse.scale_units_([t], [6], factors)
    torch.testing.assert_close(t.double(), want, rtol=2e-7, atol=0)


def test_a_permuted_plan_serves_no_op_that_pairs_elements(backend):
    """As for channels-last below: ``accumulate_`` pairs ``dst[i]`` with ``src[i]`` by index, so a
    transposed destination's kept plan (its memory as it lies) must not serve it."""
    gen = torch.Generator().manual_seed(17)
    dst = torch.randn(4, 7, generator=gen).t()
    src = torch.randn(7, 4, generator=gen)
    want = dst.double() * 0.25 + src.double()
    gradfuse.multi_tensor_scale_([dst], 0.25)  # a kept plan of [dst], permuted
    assert _plan.make_plan("t", "tensors", [dst], inplace=True).permuted == (0,)
    gradfuse.accumulate_([dst], [src])
    torch.testing.assert_close(dst.double(), want, rtol=2e-6, atol=1e-6)


def test_a_channels_last_plan_serves_no_op_that_pairs_elements(backend):
    """A kept plan of a channels-last tensor walks its memory as it lies, which is right for a
    clip (each element alone) but not for ``accumulate_``, which pairs ``dst[i]`` with ``src[i]``
    by index: a contiguous source with a channels-last destination must not reuse it."""
    gen = torch.Generator().manual_seed(3)
    dst = torch.randn(2, 3, 4, 5, generator=gen).contiguous(memory_format=torch.channels_last)
    src = torch.randn(2, 3, 4, 5, generator=gen)
    want = dst.double() * 0.25 + src.double()
    gradfuse.multi_tensor_scale_([dst], 0.25)  # a kept plan of [dst], in channels-last
    assert _plan.make_plan("t", "tensors", [dst], inplace=True).formats == b"\x01"
    gradfuse.accumulate_([dst], [src])
    torch.testing.assert_close(dst.double(), want, rtol=2e-6, atol=1e-6)


def test_a_kept_channels_last_plan_is_not_taken_for_other_memory_at_the_same_address(backend):
    """Under a kept channels-last plan, the gradient becomes, at the same address and with as many
    elements, a view that skips memory (``set_`` onto a larger storage), or a transposed view that
    is dense in no known format: each call still gives torch's answer."""
    gen = torch.Generator().manual_seed(5)
    shape = (2, 3, 4, 4)
    store = torch.randn(4 * 96, generator=gen)
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = torch.empty(shape).contiguous(memory_format=torch.channels_last)
    p.grad.set_(store.untyped_storage(), 0, shape, p.grad.stride())
    other = torch.nn.Parameter(torch.zeros(7))
    other.grad = torch.randn(7, generator=gen)
    params = [p, other]

    def check(max_norm):
        theirs = [copy.deepcopy(q) for q in params]
        for a, b in zip(params, theirs, strict=True):
            b.grad = a.grad.clone()
        total = gradfuse.clip_grad_norm_(params, max_norm)
        want = TORCH_CLIP(theirs, max_norm)
        assert close(total.item(), want.item(), 4e-6)
        for a, b in zip(params, theirs, strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=4e-6, atol=1e-7)

    check(1e9)
    check(1e9)  # the kept plan, confirmed
    # Every other element of the same channels-last walk, from the same address: as many
    # elements, and memory between them that is not the gradient's.
    p.grad.set_(store.untyped_storage(), 0, shape, (96, 2, 24, 6))
    before = store.clone()
    check(0.5)
    assert same_bits(store[1:192:2], before[1:192:2])  # the memory between: untouched
    assert not same_bits(store[0:192:2], before[0:192:2])  # the gradient: clipped
    # A permutation that is dense in no known memory format.
    p.grad.set_(store.untyped_storage(), 0, shape, (1, 2, 6, 24))
    before = store.clone()
    check(0.25)
    assert same_bits(store[96:], before[96:])
