"""Scenarios for gradfuse's DDP communication hook, run on every rank of a 2-rank gloo process
group by ``tests/test_ddp_hook.py`` (through ``tests/multiprocess.py``). Each takes
``(rank, world)`` and raises on failure.

The reference is torch's own ``DistributedDataParallel`` with its default reduction, on a copy of
the same model fed the same data: gradients must match it bit for bit (for two ranks the hook's
``(a + b) / 2`` is exactly DDP's ``a / 2 + b / 2``). Norms are compared with torch's
``get_total_norm`` of those same gradients to fp32 tolerance (``NORM_RTOL``): both accumulate
in fp32 but in a different order (per bucket then combined, against per tensor then combined).
"""

from __future__ import annotations

import copy
import datetime
import math
import random
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from dist_scenarios import Net  # head registered first but used last; extra when asked; never never
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradfuse
from gradfuse.ddp_hook import state_for
from reference import SPARSE_NORM_ERROR, TORCH_MEASURES_SPARSE

#: fp32 sums of a few thousand terms in two different orders: a few ulps of the total apart.
NORM_RTOL = 2e-6
#: A small bucket cap (in MB), so that the test models span several buckets.
SMALL_CAP = 0.002


def batch(rank: int, step: int, n: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)  # different data per rank
    return torch.randn(n, 16, generator=gen)


def pair(make=lambda: Net(), norm_type=2.0, **ddp_kwargs):
    """(ours: DDP + the hook, its state, theirs: the same DDP without it) over copies of the
    same model."""
    torch.manual_seed(0)
    model = make()
    theirs = DDP(
        copy.deepcopy(model),
        bucket_cap_mb=ddp_kwargs.pop("bucket_cap_mb", SMALL_CAP),
        gradient_as_bucket_view=True,
        **ddp_kwargs,
    )
    ours = DDP(model, bucket_cap_mb=theirs.bucket_bytes_cap / 2**20, gradient_as_bucket_view=True, **ddp_kwargs)
    state = gradfuse.register_ddp_hook(ours, norm_type=norm_type)
    return ours, state, theirs


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def assert_same_grads(ours: nn.Module, theirs: nn.Module, what: str) -> None:
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, f"{what}: {name} has a gradient where DDP has none"
            continue
        assert p.grad is not None, f"{what}: {name} has no gradient where DDP has one"
        same = torch.equal(p.grad, q.grad) or (
            torch.equal(p.grad.isnan(), q.grad.isnan()) and torch.equal(p.grad.nan_to_num(), q.grad.nan_to_num())
        )  # bit for bit, NaN where DDP has NaN (an overflow step)
        assert same, f"{what}: {name} differs by {(p.grad - q.grad).abs().max()}"


def assert_norm(state, theirs: nn.Module, what: str) -> None:
    """The hook's norm is torch's norm of DDP's gradients, and the drop-ins take it."""
    want = torch.nn.utils.get_total_norm(grads(theirs), state.norm_type).item()
    got = state.total_norm().item()
    assert math.isclose(got, want, rel_tol=NORM_RTOL, abs_tol=1e-30), f"{what}: norm {got} vs torch's {want}"


def assert_views(state, model: nn.Module) -> None:
    storages = {b.untyped_storage().data_ptr() for b in state.buffers}
    assert storages, "the state has no bucket buffers"
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert p.grad.untyped_storage().data_ptr() in storages, f"{name}.grad is not a bucket view"


def step_both(ours, theirs, x, **kwargs) -> None:
    ours(x, **kwargs).square().sum().backward()
    theirs(x, **kwargs).square().sum().backward()


def zero(*models) -> None:
    for m in models:
        m.zero_grad(set_to_none=True)


# --- parity ---------------------------------------------------------------------------------


def grads_and_norm_match_ddp(rank, world):
    """Several iterations (DDP rebuilds its buckets after the first), several buckets: DDP's
    gradients bit for bit, torch's norm, every gradient a view into the state's buffers. The
    drop-ins read the gradients (torch's answer) unless the state is handed over
    (``measured=state``), which gives the hook's norm itself: nothing is read again."""
    ours, state, theirs = pair()
    for step in range(4):
        zero(ours, theirs)
        step_both(ours, theirs, batch(rank, step))
        assert_same_grads(ours, theirs, f"step {step}")
        assert_norm(state, theirs, f"step {step}")
        assert_views(state, ours)
        assert step == 0 or len(state.buffers) > 1, "expected several buckets after the rebuild"
        assert state.found_inf().item() == 0.0
        assert state_for(grads(ours), 2.0) is state
        got = gradfuse.get_total_norm(grads(ours))
        assert math.isclose(got.item(), state.total_norm().item(), rel_tol=NORM_RTOL), (got, state.total_norm())
    # Issue 21.1: a write through .data after backward (behind the version counters, which
    # nothing can see) shows, because the drop-in reads the gradients; the state still gives
    # what the backward measured.
    poisoned = next(ours.parameters()).grad
    saved = poisoned.clone()
    poisoned.data.fill_(1e6)
    assert state_for(grads(ours), 2.0) is state  # invisible to the version counters
    assert gradfuse.get_total_norm(grads(ours)).item() > 1e6 > state.total_norm().item()
    poisoned.data.copy_(saved)
    # The drop-in clip with the state handed over: the hook's norm, one scale pass over the
    # buckets; torch's clip on DDP's.
    total = gradfuse.clip_grad_norm_(ours.parameters(), 0.05, measured=state)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
    assert torch.equal(total, state.total_norm()) and math.isclose(total.item(), want.item(), rel_tol=NORM_RTOL)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=4 * NORM_RTOL, atol=0)
    # Clipping modified the gradients: the state no longer describes them, and a handover says so.
    assert state_for(grads(ours), 2.0) is None
    with _raises(RuntimeError, "changed since"):
        gradfuse.clip_grad_norm_(ours.parameters(), 0.05, measured=state)
    again = gradfuse.get_total_norm(grads(ours))
    assert math.isclose(again.item(), 0.05, rel_tol=1e-5), again


def every_norm_order(rank, world):
    """Every order the hook takes (for orders <= 0 it reads the per-parameter views) gives
    torch's norm of DDP's gradients; so does the drop-in (which reads them)."""
    for p in (1.0, 3.0, math.inf, 0.0, -1.0, -math.inf, 0.5):
        ours, state, theirs = pair(norm_type=p)
        for step in range(2):
            zero(ours, theirs)
            step_both(ours, theirs, batch(rank, step))
            assert_same_grads(ours, theirs, f"order {p}")
            assert_norm(state, theirs, f"order {p}, step {step}")
            got = gradfuse.get_total_norm(grads(ours), p)
            assert math.isclose(got.item(), state.total_norm().item(), rel_tol=NORM_RTOL), (p, got, state)
        # The scale pass alone (over DDP's buckets) with the hook's norm, as torch's with its own.
        gradfuse.clip_grads_with_norm_(ours.parameters(), 1e-3, got)
        torch.nn.utils.clip_grads_with_norm_(theirs.parameters(), 1e-3, torch.nn.utils.get_total_norm(grads(theirs), p))
        for a, b in zip(grads(ours), grads(theirs), strict=True):
            torch.testing.assert_close(a, b, rtol=4 * NORM_RTOL, atol=0)
        assert state_for(grads(ours), p) is None, "the state still claims the clipped gradients"


def no_sync_accumulates_then_measures(rank, world):
    """Backward inside ``no_sync`` communicates nothing and measures nothing (the state keeps
    the last synchronised norm, but no longer covers the accumulated gradients); the next
    synchronised backward reduces and measures what was accumulated."""
    ours, state, theirs = pair()
    for step in range(3):
        zero(ours, theirs)
        step_both(ours, theirs, batch(rank, 10 * step))
        assert_norm(state, theirs, "before no_sync")
        before = state.total_norm()
        with ours.no_sync(), theirs.no_sync():
            step_both(ours, theirs, batch(rank, 10 * step + 1))
        assert state.total_norm() is before, "no_sync backward changed the state"
        assert state_for(grads(ours), 2.0) is None, "the state claims gradients accumulated after it"
        assert_same_grads(ours, theirs, "inside no_sync")
        step_both(ours, theirs, batch(rank, 10 * step + 2))
        assert_same_grads(ours, theirs, "after no_sync")
        assert_norm(state, theirs, "after no_sync")
        assert state_for(grads(ours), 2.0) is state


def unused_parameters(rank, world):
    """``find_unused_parameters``: ``extra`` used on rank 0 only (both get the average, as under
    DDP), ``never`` on no rank (no gradient anywhere). Orders 2 and -1: the negative order is
    refused by the state when some parameter has no gradient (its zero slot would decide the
    norm), and the drop-in then reads the gradients and gives torch's answer."""
    for p in (2.0, 0.0, -1.0, -math.inf):
        ours, state, theirs = pair(lambda: Net(unused=True), norm_type=p, find_unused_parameters=True)
        for step in range(3):
            zero(ours, theirs)
            step_both(ours, theirs, batch(rank, step), use_extra=rank == 0)
            assert_same_grads(ours, theirs, f"order {p} step {step}")
            assert ours.module.never.weight.grad is None
            want = torch.nn.utils.get_total_norm(grads(theirs), p)
            got = gradfuse.get_total_norm(grads(ours), p)
            assert math.isclose(got.item(), want.item(), rel_tol=NORM_RTOL), (p, got, want)
            if p >= 0:  # a zero slot adds nothing to a positive order, and counts 0 for order 0
                assert state_for(grads(ours), p) is state
                assert math.isclose(state.total_norm().item(), want.item(), rel_tol=NORM_RTOL), (p, state, want)
            else:
                assert state_for(grads(ours), p) is None
                with _raises(RuntimeError, "negative"):
                    state.total_norm()


def stale_gradient_of_a_parameter_unused_everywhere(rank, world):
    """A parameter unused on every rank that still holds a gradient on rank 1 only: DDP sums
    that stale gradient into its bucket slot, which rank 0 (no gradient there) must not count.
    The state refuses, and the drop-in reads the gradients: torch's answer."""
    ours, _state, theirs = pair(lambda: Net(unused=True), find_unused_parameters=True)
    step_both(ours, theirs, batch(rank, 0), use_extra=True)
    if rank == 0:
        for m in (ours, theirs):
            m.module.extra.weight.grad = None
    else:
        for m in (ours, theirs):
            m.module.extra.weight.grad.fill_(3.0)  # a stale gradient on rank 1 only
    for m in (ours, theirs):
        for name, p in m.module.named_parameters():
            if not name.startswith("extra.weight"):
                p.grad = None
    step_both(ours, theirs, batch(rank, 1))
    assert_same_grads(ours, theirs, "stale")
    if rank == 0:
        assert state_for(grads(ours), 2.0) is None
    want = torch.nn.utils.get_total_norm(grads(theirs))
    got = gradfuse.get_total_norm(grads(ours))
    assert math.isclose(got.item(), want.item(), rel_tol=NORM_RTOL), (got, want)


def static_graph(rank, world):
    """``static_graph=True`` (DDP reduces the first iteration at the end of backward, then as
    usual): gradients and norms as DDP's from the first iteration on."""
    ours, state, theirs = pair(static_graph=True)
    for step in range(4):
        zero(ours, theirs)
        step_both(ours, theirs, batch(rank, step))
        assert_same_grads(ours, theirs, f"step {step}")
        assert_norm(state, theirs, f"step {step}")
        assert state_for(grads(ours), 2.0) is state


def join_uneven_inputs(rank, world):
    """``join()``: rank 1 runs out of data two steps early and shadows the others' collectives
    (calling the hook with zero buckets, outside any backward); rank 0's gradients are DDP's
    and its norm the norm of them. The joined rank's state is never taken for a backward."""
    ours, state, theirs = pair()
    steps = 5 if rank == 0 else 3
    for model in (ours, theirs):
        with model.join():
            for step in range(steps):
                model.zero_grad(set_to_none=True)
                model(batch(rank, step)).square().sum().backward()
                if model is ours:
                    torch.save([g.clone() for g in grads(ours)], f"/tmp/gradfuse-join-{rank}-{step}.pt")
                    if rank == 0:
                        norms = getattr(state, "_test_norms", [])
                        norms.append(state.total_norm().item())
                        state._test_norms = norms
    # Rank 0 ran the same steps in both: compare its last step, and every step's norm.
    if rank == 0:
        assert_same_grads(ours, theirs, "last step under join")
        assert_norm(state, theirs, "last step under join")
        assert len(state._test_norms) == 5


def exception_in_backward(rank, world):
    """Case 2 of the issue: an exception inside backward, caught, training goes on. DDP raises
    on every following forward ("Expected to have finished reduction ..."), with or without the
    hook; the hook's state never offers the failed backward's norm."""
    outcomes = {}
    for which in ("theirs", "ours"):
        ours, state, theirs = pair(lambda: BoomNet())
        model = ours if which == "ours" else theirs
        seen = []
        for step in range(3):
            model.zero_grad()
            Boom.armed = step == 1
            try:
                model(batch(rank, step)).square().sum().backward()
                seen.append("ok")
            except RuntimeError as err:
                seen.append(str(err).split(".")[0])
            finally:
                Boom.armed = False
            if which == "ours" and step >= 1:
                with _raises(RuntimeError, "did not"):
                    state.total_norm()
                assert state_for(grads(ours), 2.0) is None
        outcomes[which] = seen
    assert outcomes["ours"] == outcomes["theirs"], outcomes
    assert outcomes["ours"][1] == "boom" and outcomes["ours"][0] == "ok", outcomes


class Boom(torch.autograd.Function):
    """Identity that raises in backward while ``armed``."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.armed:
            raise RuntimeError("boom")
        return g


class BoomNet(Net):
    def forward(self, x, use_extra=False):
        return self.head(Boom.apply(self.body(x)))


class SharedInCheckpoint(nn.Module):
    """Case 1 of the issue: ``w`` is used inside a reentrant checkpoint segment and outside it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.w(t)), x, use_reentrant=True)
        return self.out(self.w(h))


def reentrant_checkpoint_with_a_shared_weight(rank, world):
    """DDP raises ("mark a variable ready only once"); so does DDP with the hook, the same
    error, and the state offers nothing."""
    errors = {}
    for which in ("theirs", "ours"):
        ours, _state, theirs = pair(lambda: SharedInCheckpoint())
        model = ours if which == "ours" else theirs
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        try:
            model(x).square().sum().backward()
            errors[which] = None
        except RuntimeError as err:
            errors[which] = str(err).split("\n")[0][:80]
        if which == "ours":
            assert state_for(grads(ours), 2.0) is None
    assert errors["ours"] == errors["theirs"] and errors["ours"] is not None, errors


def cast_after_construction(rank, world):
    """Case 3: the model cast after DDP was built, while ``.grad`` exists. DDP raises or gives
    its own gradients; DDP with the hook does exactly the same, and the drop-in's norm is
    torch's norm of whatever the gradients are (never a stale bucket's)."""
    for cast in ("double", "channels_last"):
        outcomes = {}
        for which in ("theirs", "ours"):
            ours, _state, theirs = pair(lambda: ConvNet())
            model = ours if which == "ours" else theirs
            x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(rank))
            model(x).square().sum().backward()
            if cast == "double":
                model.double()
                x = x.double()
            else:
                model.to(memory_format=torch.channels_last)
                x = x.to(memory_format=torch.channels_last)
            try:
                model(x).square().sum().backward()
                outcomes[which] = [g.clone() for g in grads(model)]
            except RuntimeError as err:
                outcomes[which] = str(err)[:60]
            if which == "ours" and not isinstance(outcomes[which], str):
                want = torch.nn.utils.get_total_norm(grads(ours))
                got = gradfuse.get_total_norm(grads(ours))
                assert math.isclose(got.item(), want.item(), rel_tol=NORM_RTOL), (cast, got, want)
        a, b = outcomes["ours"], outcomes["theirs"]
        if isinstance(a, str) or isinstance(b, str):
            assert a == b, (cast, a, b)
        else:
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), cast


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


def layouts_that_differ_across_ranks_raise(rank, world):
    """Cases 5 and 6: shapes [8, 4] on one rank and [4, 8] on the other, or a layer frozen on
    one rank only: DDP's construction raises on every rank (no hang beyond the group's
    timeout), before the hook."""
    for case in ("transposed", "frozen"):
        if case == "transposed":
            model = nn.Linear(4, 8) if rank == 0 else nn.Linear(8, 4, bias=False)
            if rank == 1:
                model.bias = nn.Parameter(torch.zeros(8))
        else:
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            if rank == 1:
                model[0].requires_grad_(False)
        try:
            # A group of its own: after the error the ranks have not run the same collectives on it.
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
            ddp = DDP(model, gradient_as_bucket_view=True, process_group=group)
            gradfuse.register_ddp_hook(ddp)
        except (RuntimeError, ValueError):
            # DDP's check: for the transposed shapes rank 1 raises at once, and rank 0 when its
            # collective times out (the group's timeout).
            continue
        raise AssertionError(f"{case}: DDP accepted ranks whose parameters differ")


def buffers_are_broadcast(rank, world):
    """Case 7: BatchNorm running statistics are rank 0's on every rank after each forward (DDP's
    ``broadcast_buffers``), with the hook as without."""
    ours, _state, theirs = pair(lambda: ConvNet())
    for step in range(2):
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        ours(x).square().sum().backward()
        theirs(x).square().sum().backward()
    ours.eval()  # the forward broadcasts rank 0's statistics and updates none
    theirs.eval()
    ours(x)
    theirs(x)
    mine = ours.module.bn.running_mean.clone()
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    assert torch.equal(everyone[0], everyone[1])
    assert torch.equal(mine, theirs.module.bn.running_mean)
    assert_same_grads(ours, theirs, "conv net")


def _scaler_pair(ours, theirs, fused: bool, init_scale: float = 2.0**8, growth_interval: int = 2000):
    def optimizer(model):
        if fused:
            return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)

    return (
        (optimizer(ours), gradfuse.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)),
        (optimizer(theirs), torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)),
    )


def _same_weights_from_here(ours, opt_o, theirs, opt_t) -> None:
    """Put theirs on ours' weights and optimizer state, so that the next step's gradients can be
    compared bit for bit (the two clips round their norms differently, so weights drift by ulps)."""
    with torch.no_grad():
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            q.copy_(p)
    opt_t.load_state_dict(copy.deepcopy(opt_o.state_dict()))  # load_state_dict would share the tensors


def _assert_close_weights(ours, theirs, what: str) -> None:
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        # One step apart from the same weights; the clip coefficients differ by the norms' ulps.
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{what}: {n}: {m}")


def scaler_folds_the_clip_into_the_optimizer(rank, world):
    """``GradScaler.unscale_and_clip_`` on gradients the hook measured, handed over
    (``measured=state``), reads none of them: the norm it returns is the hook's times
    ``inv_scale``, bit for bit, and ``found_inf`` is the
    hook's (an inf on rank 1 only: both ranks skip the step and back off, as torch's scaler
    does). With fused AdamW the clip is folded into the optimizer's read; with a plain SGD one
    write pass runs over DDP's buckets. Weights as torch's ``unscale_`` + ``clip_grad_norm_`` +
    step on plain DDP."""
    for fused in (True, False):
        ours, state, theirs = pair()
        (opt_o, sc_o), (opt_t, sc_t) = _scaler_pair(ours, theirs, fused)
        for step in range(5):
            overflow = step == 3
            x = batch(rank, step)
            for model, opt, sc in ((ours, opt_o, sc_o), (theirs, opt_t, sc_t)):
                opt.zero_grad()
                loss = model(x).square().sum()
                if overflow and rank == 1:
                    loss = loss * math.inf
                sc.scale(loss).backward()
            if not overflow:
                assert_same_grads(ours, theirs, f"fused={fused} step {step}")
            assert state_for(grads(ours), 2.0) is state
            inv = torch.tensor(1.0 / sc_o.get_scale(), dtype=torch.float32)
            total = sc_o.unscale_and_clip_(opt_o, 0.5, measured=state)
            torch.testing.assert_close(total, state.total_norm() * inv, rtol=0, atol=0, equal_nan=True)
            assert sc_o.found_inf(opt_o).item() == float(overflow)
            sc_t.unscale_(opt_t)
            want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
            if not overflow:
                assert math.isclose(total.item(), want.item(), rel_tol=NORM_RTOL), (total, want)
            for sc, opt in ((sc_o, opt_o), (sc_t, opt_t)):
                sc.step(opt)
                sc.update()
            assert sc_o.get_scale() == sc_t.get_scale(), (sc_o.get_scale(), sc_t.get_scale())
            _assert_close_weights(ours, theirs, f"fused={fused} step {step}")
            _same_weights_from_here(ours, opt_o, theirs, opt_t)


def scaler_without_clipping_reads_the_flag(rank, world):
    """Loss scaling without clipping: ``scaler.step`` on fused AdamW checks the gradients for
    inf/NaN (a read-only pass: nothing was handed over), and ``unscale_`` runs over DDP's few
    buckets; weights, gradients and the loss scale bit for bit torch's scaler on plain DDP,
    an overflow on rank 1 only skipping the step on both ranks. (Before issue 21.1 this took
    the hook's flag, and missed what was written after backward: the last lines.)"""
    for fused in (True, False):
        ours, state, theirs = pair()
        (opt_o, sc_o), (opt_t, sc_t) = _scaler_pair(ours, theirs, fused)
        for step in range(4):
            x = batch(rank, step)
            for model, opt, sc in ((ours, opt_o, sc_o), (theirs, opt_t, sc_t)):
                opt.zero_grad()
                loss = model(x).square().sum()
                if step == 2 and rank == 1:
                    loss = loss * math.inf
                sc.scale(loss).backward()
                if model is ours:
                    assert state_for(grads(ours), 2.0) is state
                if not fused:
                    sc.unscale_(opt)
                sc.step(opt)
                sc.update()
            assert_same_grads(ours, theirs, f"fused={fused} step {step}")
            assert sc_o.get_scale() == sc_t.get_scale(), (step, sc_o.get_scale(), sc_t.get_scale())
            for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
                assert torch.equal(p, q), f"fused={fused} step {step}: weights differ"
    # The flag is read from the gradients: a NaN written behind the version counters (through
    # .data, which nothing can detect) after backward is seen, as torch's scaler sees it.
    opt_o.zero_grad()
    sc_o.scale(ours(batch(rank, 9)).square().sum()).backward()
    next(ours.parameters()).grad.data.view(-1)[0] = math.nan
    assert state.found_inf().item() == 0.0 and state_for(grads(ours), 2.0) is state
    found = sc_o._check_inf_per_device(opt_o)
    assert sum(f.item() for f in found.values()) == 1.0


class TiedNet(nn.Module):
    """Tied input and output embeddings; ``extra`` used when asked; a ``Boom`` point that raises
    in forward when asked."""

    def __init__(self, vocab: int = 20, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.extra = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens, use_extra=False, fail=False):
        h = self.body(self.emb(tokens))
        if fail:
            raise ValueError("failed in forward")
        if use_extra:
            h = h + self.extra(h)
        return self.out(h)


def randomized_against_ddp(rank, world):
    """A few hundred steps drawing from: gradient accumulation under ``no_sync``, parameters
    unused on some ranks or all, an exception in forward (caught; in the synchronised
    micro-step too, leaving the step with unsynchronised gradients), every ``zero_grad``
    variant, a frozen layer, fp16-style loss scaling with overflows on one rank, tied weights;
    fused AdamW with the scaler's folded clip. Every step: gradients bit for bit DDP's, the
    norm torch's, the same overflow decision and loss scale, weights one step from the same
    start equal to torch's to the clip's rounding. The hook's state is handed over where it
    covers the gradients (as the Trainer hands it over), and the gradients read otherwise."""
    rng = random.Random(2024)  # the same draws on every rank
    ours, state, theirs = pair(lambda: TiedNet(), find_unused_parameters=True)
    (opt_o, sc_o), (opt_t, sc_t) = _scaler_pair(ours, theirs, fused=True, init_scale=2.0**6, growth_interval=4)
    fast = 0
    steps = 200
    for step in range(steps):
        micro = rng.choice([1, 1, 2, 3])
        extra_on = rng.choice(["none", "rank0", "all"])
        frozen = rng.random() < 0.15
        # Every step starts from zeroed gradients: the folded clip leaves them scaled where
        # torch's unscale_ rewrites them, so gradients kept across steps would differ by design.
        zero_mode = rng.choice(["module", "zeros", "optimizer", "optimizer-zeros"])
        fail_at = rng.randrange(micro) if rng.random() < 0.08 else None
        overflow_rank = rng.choice([0, 1]) if rng.random() < 0.1 else None
        max_norm = rng.choice([0.05, 1.0, 1e3])
        for model, opt, sc in ((ours, opt_o, sc_o), (theirs, opt_t, sc_t)):
            if zero_mode == "module":
                model.zero_grad()
            elif zero_mode == "zeros":
                model.zero_grad(set_to_none=False)
            elif zero_mode == "optimizer":
                opt.zero_grad()
            else:
                opt.zero_grad(set_to_none=False)
            model.module.body[0].requires_grad_(not frozen)
            for i in range(micro):
                gen = torch.Generator().manual_seed(1000 * step + 10 * i + rank)
                tokens = torch.randint(0, 20, (4, 5), generator=gen)
                use_extra = extra_on == "all" or (extra_on == "rank0" and rank == 0)
                sync = i == micro - 1
                with nullcontext() if sync else model.no_sync():
                    try:
                        logits = model(tokens, use_extra=use_extra, fail=fail_at == i)
                    except ValueError:
                        continue
                    loss = logits.square().mean()
                    if overflow_rank == rank and sync:
                        loss = loss * math.inf
                    sc.scale(loss).backward()
        assert_same_grads(ours, theirs, f"step {step}")
        if not grads(theirs):  # every forward failed after zero_grad: torch's scaler can't step
            continue
        covered = state_for(grads(ours), 2.0) is state
        fast += covered
        total = sc_o.unscale_and_clip_(opt_o, max_norm, measured=state if covered else None)
        sc_t.unscale_(opt_t)
        want = torch.nn.utils.clip_grad_norm_([p for p in theirs.parameters() if p.grad is not None], max_norm)
        found = sc_o.found_inf(opt_o).item()
        assert found == float(not math.isfinite(want.item())), (step, found, want)
        if found == 0.0:
            assert math.isclose(total.item(), want.item(), rel_tol=NORM_RTOL), (step, total, want)
        for sc, opt in ((sc_o, opt_o), (sc_t, opt_t)):
            sc.step(opt)
            sc.update()
        assert sc_o.get_scale() == sc_t.get_scale(), step
        _assert_close_weights(ours, theirs, f"step {step}")
        _same_weights_from_here(ours, opt_o, theirs, opt_t)
    assert fast > steps // 3, f"the hook's norm was used on only {fast} of {steps} steps"


def low_precision_buckets(rank, world):
    """fp16 and bf16 models: DDP's gradients bit for bit (fp16 buckets are divided before the
    sum, as DDP's default hook does, since a sum can overflow fp16 where the average does not;
    bf16 buckets are summed then halved, which for two ranks rounds the same), and the hook's
    norm, accumulated in fp32, is the float64 norm of those gradients to fp32 precision
    (torch's own norm of fp16 gradients is rounded to fp16, so it is not the reference)."""
    for dtype in (torch.float16, torch.bfloat16):
        ours, state, theirs = pair(lambda d=dtype: Net().to(d))
        for step in range(3):
            zero(ours, theirs)
            x = batch(rank, step).to(dtype)
            if dtype == torch.float16:
                x = x * 300  # gradients whose sum over both ranks leaves fp16's range
            ours(x).float().square().sum().backward()
            theirs(x).float().square().sum().backward()
            assert_same_grads(ours, theirs, f"{dtype} step {step}")
            want = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads(theirs)]))
            found = not all(torch.isfinite(g).all() for g in grads(theirs))
            assert state.found_inf().item() == float(found)
            if not found:
                got = state.total_norm()
                assert got.dtype == torch.float32
                assert math.isclose(got.item(), want.item(), rel_tol=NORM_RTOL), (dtype, got, want)


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8, sparse=True)
        self.out = nn.Linear(8, 4)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


def sparse_gradients(rank, world):
    """A sparse embedding gradient (its own bucket, reduced as DDP's default hook does): DDP's
    gradients; the state offers no norm (a sparse bucket is not measured), so the drop-in clip
    reads the gradients and gives torch's answer."""
    ours, state, theirs = pair(lambda: SparseNet())
    for step in range(2):
        zero(ours, theirs)
        tokens = torch.randint(0, 30, (4, 3), generator=torch.Generator().manual_seed(10 * step + rank))
        for m in (ours, theirs):
            m(tokens).square().sum().backward()
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(p.grad.to_dense(), q.grad.to_dense())
        with _raises(RuntimeError, "sparse"):
            state.total_norm()
        if not TORCH_MEASURES_SPARSE:  # torch's answer is its error (torch 2.11), nothing modified
            with _raises(NotImplementedError, SPARSE_NORM_ERROR):
                torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
            with _raises(NotImplementedError, SPARSE_NORM_ERROR):
                gradfuse.clip_grad_norm_(ours.parameters(), 0.1)
            for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
                assert torch.equal(p.grad.to_dense(), q.grad.to_dense())
            continue
        got = gradfuse.clip_grad_norm_(ours.parameters(), 0.1)
        want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
        assert math.isclose(got.item(), want.item(), rel_tol=NORM_RTOL), (got, want)


def bad_registration_raises(rank, world):
    model = Net()
    with _raises(TypeError, "ddp_model must be"):
        gradfuse.register_ddp_hook(model)
    plain = DDP(copy.deepcopy(model))
    with _raises(ValueError, "gradient_as_bucket_view=True"):
        gradfuse.register_ddp_hook(plain)
    ddp = DDP(model, gradient_as_bucket_view=True)
    with _raises(ValueError, "norm_type"):
        gradfuse.register_ddp_hook(ddp, norm_type=float("nan"))
    state = gradfuse.register_ddp_hook(ddp)
    with _raises(RuntimeError, "already has a communication hook"):
        gradfuse.register_ddp_hook(ddp)
    with _raises(RuntimeError, "no synchronised backward"):
        state.total_norm()


class _raises:
    def __init__(self, kind, text):
        self.kind, self.text = kind, text

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        assert kind is not None, f"expected {self.kind.__name__} ({self.text})"
        assert issubclass(kind, self.kind) and self.text in str(err), f"got {kind.__name__}: {err}"
        return True
