"""The prefetching walks of the probes (``rust/prefetch.rs``, ``gradfuse._layout``).

The offsets of torch's private layout are found on sample tensors; here they are checked on
other tensors than those samples, of every kind a probe meets, against what torch says of them in
public. And a walk must stay within the list it walks when the getters' own calls change it.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch.overrides import TorchFunctionMode

import gradfuse
from gradfuse import _layout, _plan


@pytest.fixture(autouse=True)
def threshold_kept():
    """Each test leaves the prefetch threshold as it found it (a test that lowers it restores it)."""
    _plan.probes()
    core = _plan.rust_core()
    before = core.prefetch()[1]
    yield
    after = core.prefetch()[1]
    core.prefetch(min_bytes=before)
    assert after == before, f"the prefetch threshold was left at {after}, not {before}"


def word(addr: int) -> int:
    return ctypes.c_uint64.from_address(addr).value


def kinds() -> list[torch.Tensor]:
    """Tensors of the kinds the probes walk over: plain, parameters with gradients, views at an
    offset, channels-last, other dtypes, after ``.data =`` and ``set_``, and an inference tensor."""
    param = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16))
    param.grad = torch.randn(4, 3, dtype=torch.bfloat16)
    moved = torch.randn(6)
    moved.data = torch.randn(9, dtype=torch.float64)
    reset = torch.randn(5)
    reset.set_(torch.randn(11).untyped_storage(), 2, (3,), (1,))
    with torch.inference_mode():
        frozen = torch.randn(7)
    conv = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    return [torch.randn(8), param, param.grad, torch.randn(10)[3:], conv, moved, reset, frozen]


def test_this_torchs_offsets_are_found_and_kept_by_the_rust_core():
    offsets = _layout.find_offsets()
    assert offsets is not None, "torch 2.x keeps these pointers at one place each"
    assert _plan.probes()
    assert _plan.rust_core().prefetch()[0] == offsets


def test_the_offsets_describe_tensors_other_than_the_samples():
    cdata, storage, meta, version, grad = _layout.find_offsets()
    for t in kinds():
        impl = t._cdata
        assert word(id(t) + cdata) == impl
        assert word(impl + storage) == t.untyped_storage()._cdata
        # Autograd metadata where torch has some: a parameter, holding its gradient; none on a
        # fresh plain tensor.
        if isinstance(t, torch.nn.Parameter):
            assert word(impl + meta) != 0
            assert word(word(impl + meta) + grad) == t.grad._cdata
    plain = torch.randn(3)
    assert word(plain._cdata + meta) == 0
    # The version counter is shared with views (and follows .data =, which keeps the tensor's
    # own), and an inference tensor has none.
    base = torch.randn(6)
    for view in (base[1:], base.view(2, 3), base.detach()):
        assert word(view._cdata + version) == word(base._cdata + version) != 0
    assert word(base.data._cdata + version) != word(base._cdata + version)
    with torch.inference_mode():
        frozen = torch.randn(2)
    assert word(frozen._cdata + version) == 0


def test_offsets_outside_what_may_be_read_are_refused():
    """The Rust core keeps the first offsets it is given, and only offsets inside the bytes it may
    read (its own tests check each bound); asking again changes nothing."""
    core = _plan.rust_core()
    kept, _ = core.prefetch()
    assert core.prefetch((16, 16, 24, 64, 40))[0] == kept
    assert core.prefetch((8, 16, 24, 40, 40))[0] == kept


class _Shrinking(TorchFunctionMode):
    """A torch function mode that empties ``victim`` the first time a tensor getter runs under it:
    the probes' getters then call back into Python, which changes the list they walk."""

    def __init__(self, victim: list):
        super().__init__()
        self.victim = victim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.victim:
            self.victim.clear()
        return func(*args, **(kwargs or {}))


def test_a_walk_whose_list_shrinks_under_it_stays_inside_it():
    """Under a torch function mode the getters run Python code, which may empty the very list a
    probe walks (prefetching 8 tensors ahead): the walk must read only what is still there."""
    _plan.probes()
    core = _plan.rust_core()
    _, threshold = core.prefetch()
    core.prefetch(min_bytes=0)
    try:
        params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(64)]
        for p in params:
            p.grad = torch.randn(4)
        grads = [p.grad for p in params]
        plan = _plan.make_plan("test", "grads", grads, inplace=True)
        walked, victim = list(grads), list(params)
        with _Shrinking(walked):
            assert plan.tensor_list.probe(walked, True, -1) is None  # the list it was asked about is gone
        with _Shrinking(victim):
            found = core.grads_of(victim)
        assert found is None or found == [] or all(isinstance(g, torch.Tensor) for g in found)
        # The liveness checks of GradBuckets and the DDP handover: a shrunk list is not the same.
        addrs = _plan.as_words(g.data_ptr() for g in grads)
        for with_addrs in (None, addrs):
            victim = list(params)
            with _Shrinking(victim):
                assert core.grads_are(victim, list(grads), with_addrs) is False
        victim = list(grads)
        with _Shrinking(victim):
            assert core.addrs_are(victim, addrs) is False
        # accumulate_'s pair check: either list shrinking under it leaves the answer to Python.
        for side in (0, 1):
            pair = [list(grads), list(grads)]
            with _Shrinking(pair[side]):
                assert core.shape_mismatch(*pair) is None
        # And the same lists walked whole, without the mode.
        assert plan.tensor_list.probe(grads, True, -1) is True
        assert core.grads_of(params) == grads
        assert core.grads_are(params, grads) is True
        assert core.grads_are(params, grads, addrs) is True
        assert core.addrs_are(grads, addrs) is True
        assert core.shape_mismatch(grads, list(grads)) == -1
    finally:
        core.prefetch(min_bytes=threshold)


@pytest.mark.parametrize(
    ("n", "numel", "seed"),
    [(2000, 1100, 0), (17_000, 4, 1)],
    ids=["a large model", "many tiny tensors"],
)
def test_the_clip_of_a_list_past_the_threshold_prefetches_and_agrees_with_torch(n, numel, seed):
    """Past the threshold (8 MiB) the probes prefetch by default: a clip there gives torch's
    answer, call after call, as the gradients are made again. A list counts past it by its data
    (2000 gradients of 1100 floats, 8.4 MiB) or by its tensors too, whose metadata outgrows the
    caches before their data does (``prefetch::METADATA_BYTES``, half a KiB a tensor: 17,000
    gradients of 4 floats, 266 KiB of data)."""
    _plan.probes()
    threshold = _plan.rust_core().prefetch()[1]
    assert threshold < n * numel * 4 if numel > 4 else n * numel * 4 < threshold <= n * 512
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(n)]
    theirs = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(n)]
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(numel, generator=gen)
            b.grad = a.grad.clone()
        total = gradfuse.clip_grad_norm_(ours, 10.0)
        want = torch.nn.utils.clip_grad_norm_(theirs, 10.0)
        torch.testing.assert_close(total, want, rtol=1e-5, atol=0)  # fp32 sums in other orders
        assert all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("n", [1, 3, 8, 9, 33])
def test_lists_of_every_length_around_the_walks_stages(n):
    """Lists shorter than, as long as and past the stages' distances (4 and 8 ahead) and the
    length from which ``grads_of`` prefetches (32)."""
    _plan.probes()
    core = _plan.rust_core()
    _, threshold = core.prefetch()
    core.prefetch(min_bytes=0)
    try:
        params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(n)]
        for i, p in enumerate(params):
            p.grad = None if i % 5 == 2 else torch.randn(3)
        grads = [p.grad for p in params if p.grad is not None]
        assert core.grads_of(params) == grads
        for _ in range(2):
            total = gradfuse.clip_grad_norm_(params, 1e9)
            want = torch.linalg.vector_norm(torch.cat([g.double() for g in grads])) if grads else torch.tensor(0.0)
            assert abs(total.item() - want.item()) <= 1e-5 * max(want.item(), 1.0)
    finally:
        core.prefetch(min_bytes=threshold)


@pytest.mark.parametrize("n", [40, 600])
@pytest.mark.parametrize("hint", [True, False], ids=["moving lists prefetched", "not"])
def test_a_list_made_anew_at_every_call_is_known_as_moving_and_agrees_with_torch(hint, n):
    """A loop that sets its gradients to None and makes them again, at other addresses each step
    (here: rotating through more gradient sets than plans are kept for one list shape): each
    call's plan is moved from the last, and its list is known as moving, so that its probes
    prefetch from ``prefetch::MOVING_MIN_TENSORS`` (512) tensors up (other objects than the last
    walk touched, out of the caches); the same list again clears it. Prefetching decides speed
    alone: the answers are torch's either way, at 40 tensors and at 600."""
    _plan.probes()
    core = _plan.rust_core()
    before = core.prefetch_moving()
    assert before is True  # the default
    core.prefetch_moving(hint)
    _plan.clear_plans()  # the first call makes its plan (none kept from another test)
    try:
        gen = torch.Generator().manual_seed(5)
        ours = [torch.nn.Parameter(torch.zeros(8)) for _ in range(n)]
        theirs = [torch.nn.Parameter(torch.zeros(8)) for _ in range(n)]
        sets = [[torch.randn(8, generator=gen) for _ in range(n)] for _ in range(_plan.PLANS_PER_KEY + 1)]

        def latest():
            return _plan._PLANS[(True, n, 32, 32)][0]

        for k in range(2 * len(sets)):
            for a, b, g in zip(ours, theirs, sets[k % len(sets)], strict=True):
                a.grad, b.grad = g, g.clone()
            total = gradfuse.clip_grad_norm_(ours, 1.0)
            torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(theirs, 1.0), rtol=1e-5, atol=0)
            assert all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7) for a, b in zip(ours, theirs, strict=True))
            # The call's plan (the first kept for the key): the first set's was made, the others moved.
            assert latest().tensor_list.moving is (k > 0)
        # The same list again: its probe finds the plan's own addresses, and the list stops moving.
        gradfuse.clip_grad_norm_(ours, 1.0)
        assert latest().tensor_list.moving is False
        assert core.prefetch_moving() is hint
    finally:
        core.prefetch_moving(before)
