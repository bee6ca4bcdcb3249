"""Issue 21.1: the DDP hook's measurement is used only where it is handed over (or inside the
Trainer's step), never because the gradients *look* untouched. Run on every rank of a 2-rank
gloo process group by ``tests/test_ddp_handover.py`` (through ``tests/multiprocess.py``).

The reference is torch on a plain DDP (no hook) built from the same model and fed the same
data, its gradients edited exactly as ours between backward and the clip: every edit a user
makes after backward (masking through ``.data``, a NumPy view, a collective on ``p.grad``, a
NaN clean-up), and the drop-ins and the scaler compared with torch's result on them.
Tolerances: norms to ``NORM_RTOL`` (fp32 sums in another order, see ``ddp_hook_scenarios``);
clipped gradients and weights to the few ulps by which the two norms round the coefficient.
"""

from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist
from ddp_hook_scenarios import (
    NORM_RTOL,
    Net,
    SparseNet,
    _assert_close_weights,
    _raises,
    _same_weights_from_here,
    _scaler_pair,
    assert_same_grads,
    batch,
    grads,
    pair,
    zero,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import gradfuse
from gradfuse.ddp_hook import state_for
from reference import SPARSE_NORM_ERROR, TORCH_MEASURES_SPARSE

MAX_NORM = 0.05  # below the test model's gradient norm: the clip is active
POISON_AT = (3, 5)  # the element of body[0].weight's gradient that rank 1 makes NaN


def _noise(like: torch.Tensor, seed: int, scale: float = 1.0) -> torch.Tensor:
    """The same values on every rank (the ranks stay in step), a fresh draw per seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(like.shape, generator=gen).to(like.dtype) * scale


def _numpy_halve(g: torch.Tensor, seed: int) -> None:
    g.numpy()[...] *= 0.5


def _all_reduce(g: torch.Tensor, seed: int) -> None:
    dist.all_reduce(g)  # a sum of the averaged gradients: twice them, on every rank


#: Edits a user makes between backward and the clip that move no version counter.
UNSEEN = {
    "data.mul_": lambda g, seed: g.data.mul_(0.5),
    "data.clamp_": lambda g, seed: g.data.clamp_(-1e-3, 1e-3),
    "data.add_(noise)": lambda g, seed: g.data.add_(_noise(g, seed)),
    "data.copy_": lambda g, seed: g.data.copy_(_noise(g, seed, 3.0)),
    "numpy": _numpy_halve,
    "all_reduce": _all_reduce,
    "nan_to_num_": lambda g, seed: g.data.nan_to_num_(0.0),
}
#: Edits that do move a version counter, or replace the gradient (a visibly stale handover).
SEEN = {
    "mul_": lambda g, seed: g.mul_(0.5),
    "add_(noise)": lambda g, seed: g.add_(_noise(g, seed)),
    "zero_": lambda g, seed: g.zero_(),
}


class Poisoned:
    """Rank 1 writes a NaN into one element of ``body[0].weight``'s gradient during backward
    (before DDP's reduction: every rank then has the NaN) while ``armed``."""

    def __init__(self, models, rank: int):
        self.armed = False
        if rank == 1:
            for m in models:
                m.module.body[0].weight.register_hook(self._poison)

    def _poison(self, g):
        if not self.armed:
            return g
        g = g.clone()
        g[POISON_AT] = math.nan
        return g


def _edit(model, name: str, seed: int) -> None:
    fn = {**UNSEEN, **SEEN}[name]
    for i, p in enumerate(model.parameters()):
        if p.grad is not None:
            fn(p.grad, seed + i)


def _backward(ours, theirs, rank, step, scalers=None, poison=None):
    for i, m in enumerate((ours, theirs)):
        loss = m(batch(rank, step)).square().sum()
        if scalers is not None:
            loss = scalers[i].scale(loss)
        if poison is not None:
            poison.armed = True
        try:
            loss.backward()
        finally:
            if poison is not None:
                poison.armed = False


def _assert_norm(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert math.isclose(got.item(), want.item(), rel_tol=NORM_RTOL), f"{what}: {got.item()} vs torch's {want.item()}"


def _assert_clipped_grads(ours, theirs, what: str) -> None:
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=4 * NORM_RTOL, atol=1e-12, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


# --- the drop-ins ---------------------------------------------------------------------------------


def drop_ins_read_the_gradients_after_every_unseen_edit(rank, world):
    """``clip_grad_norm_`` and ``get_total_norm`` after each edit that moves no version counter
    (the gradients still look as backward left them): torch's norm and torch's clipped
    gradients. Before the fix both took the hook's pre-edit norm (0.212 where torch gives 0.106
    for a halving; no clip at all after added noise; NaN after a NaN clean-up)."""
    ours, state, theirs = pair()
    poison = Poisoned((ours, theirs), rank)
    for k, name in enumerate(UNSEEN):
        for call in ("get_total_norm", "clip_grad_norm_"):
            zero(ours, theirs)
            _backward(ours, theirs, rank, 10 * k, poison=poison if name == "nan_to_num_" else None)
            assert_same_grads(ours, theirs, name)
            assert state_for(grads(ours), 2.0) is state, "the edit below must be one the state cannot see"
            _edit(ours, name, 100 * k)
            _edit(theirs, name, 100 * k)
            assert state_for(grads(ours), 2.0) is state, name  # still invisible: only reading tells
            if call == "get_total_norm":
                got = gradfuse.get_total_norm(grads(ours))
                want = torch.nn.utils.get_total_norm(grads(theirs))
            else:
                got = gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM)
                want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM)
                _assert_clipped_grads(ours, theirs, f"{name}, {call}")
            assert math.isfinite(want.item()), name
            _assert_norm(got, want, f"{name}, {call}")
            if name != "nan_to_num_":  # the measurement itself is what it was
                assert not math.isclose(got.item(), state.total_norm().item(), rel_tol=1e-3), (name, got, state)


# --- the scaler ---------------------------------------------------------------------------------

#: How the scaler is used after backward, and the same with torch's scaler on plain DDP.
SCALER_USES = ("unscale_", "unscale_and_clip_", "step")


def _scaler_round(use, ours, theirs, opt_o, sc_o, opt_t, sc_t, what) -> None:
    """One use of the scalers after backward: gradfuse's on ``ours``, torch's on ``theirs``;
    then step and update both, and compare everything torch's scaler decides."""
    if use == "unscale_":
        sc_o.unscale_(opt_o)
        sc_t.unscale_(opt_t)
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), f"{what}: {name}"
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, equal_nan=True, msg=f"{what}: {name}")
    elif use == "unscale_and_clip_":
        got = sc_o.unscale_and_clip_(opt_o, MAX_NORM)
        sc_t.unscale_(opt_t)
        want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM)
        if math.isfinite(want.item()):
            _assert_norm(got, want, what)
        else:
            assert not math.isfinite(got.item()), (what, got, want)
    sc_o.step(opt_o)
    sc_t.step(opt_t)
    found_t = sum(v.item() for v in sc_t._per_optimizer_states[id(opt_t)]["found_inf_per_device"].values())
    assert sc_o.found_inf(opt_o).item() == float(found_t > 0), f"{what}: found_inf {sc_o.found_inf(opt_o)} vs {found_t}"
    sc_o.update()
    sc_t.update()
    assert sc_o.get_scale() == sc_t.get_scale(), f"{what}: scale {sc_o.get_scale()} vs {sc_t.get_scale()}"
    _assert_close_weights(ours, theirs, what)


def scaler_reads_the_gradients_after_every_unseen_edit(rank, world):
    """``unscale_``, ``unscale_and_clip_`` and ``step`` (its inf check, with fused AdamW) after
    each edit that moves no version counter, against torch's scaler on plain DDP: the same
    norm, the same skip decision, the same loss scale and weights. Before the fix the scaler
    clipped with the pre-edit norm and, after a NaN on rank 1 cleaned with ``nan_to_num_`` on
    every rank, skipped the step and halved the scale where torch steps."""
    for fused in (True, False):
        ours, state, theirs = pair()
        poison = Poisoned((ours, theirs), rank)
        start = {k: v.clone() for k, v in ours.state_dict().items()}
        for k, name in enumerate(UNSEEN):
            for use in SCALER_USES:
                if use == "step" and not fused:
                    continue  # a plain optimizer: step unscales first, which is unscale_'s case
                what = f"fused={fused} {name} {use}"
                for model in (ours, theirs):  # every round from the same weights, fresh optimizers
                    model.load_state_dict(start)
                (opt_o, sc_o), (opt_t, sc_t) = _scaler_pair(ours, theirs, fused, init_scale=2.0**4)
                nan = name == "nan_to_num_"
                _backward(ours, theirs, rank, 10 * k + 1, scalers=(sc_o, sc_t), poison=poison if nan else None)
                assert state_for(grads(ours), 2.0) is state
                assert state.found_inf().item() == float(nan), what
                _edit(ours, name, 100 * k)
                _edit(theirs, name, 100 * k)
                _scaler_round(use, ours, theirs, opt_o, sc_o, opt_t, sc_t, what)


def randomized_edits_against_torch(rank, world):
    """Seeded rounds, the same draws on every rank: a random set of edits (none, some that move
    a version counter, some that do not, on random parameters; a gradient replaced or set to
    None), then a random consumer (the drop-in clip or norm, the scaler's ``unscale_``,
    ``unscale_and_clip_`` or ``step``), against torch on the same edits, every round. Where the
    hook's state is handed over, it is right when nothing touched the gradients, and raises
    when a version counter moved or a gradient was replaced."""
    rng = random.Random(21)
    ours, state, theirs = pair()
    poison = Poisoned((ours, theirs), rank)
    (opt_o, sc_o), (opt_t, sc_t) = _scaler_pair(ours, theirs, fused=True, init_scale=2.0**4, growth_interval=3)
    n_params = len(list(ours.parameters()))
    handed = raised = 0
    for step in range(80):
        opt_o.zero_grad()
        opt_t.zero_grad()
        nan = rng.random() < 0.15
        consumer = rng.choice(["clip_grad_norm_", "get_total_norm", *SCALER_USES])
        scaled = consumer in SCALER_USES
        _backward(
            ours, theirs, rank, 1000 + step, scalers=(sc_o, sc_t) if scaled else None, poison=poison if nan else None
        )
        edits = []
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            kind = rng.choice([*UNSEEN, *SEEN, "replace", "none"])
            edits.append((kind, rng.sample(range(n_params), rng.randint(1, n_params)), rng.randrange(10**6)))
        if nan:  # a NaN on rank 1 that some rounds clean up on every rank, and some keep
            if rng.random() < 0.6:
                edits.append(("nan_to_num_", list(range(n_params)), 0))
        for kind, chosen, seed in edits:
            for model in (ours, theirs):
                params = list(model.parameters())
                for i in chosen:
                    p = params[i]
                    if p.grad is None:
                        continue
                    if kind == "replace":
                        p.grad = p.grad.clone() * 2
                    elif kind == "none":
                        p.grad = None
                    else:
                        {**UNSEEN, **SEEN}[kind](p.grad, seed + i)
        what = f"step {step}: {consumer} after {[e[0] for e in edits]}"
        assert_same_grads(ours, theirs, what)
        untouched = not edits
        visibly = any(kind in SEEN or kind in ("replace", "none") for kind, _, _ in edits)
        if consumer in ("clip_grad_norm_", "get_total_norm") or consumer == "unscale_and_clip_":
            if untouched and rng.random() < 0.5:
                handed += 1
                if consumer == "unscale_and_clip_":
                    inv = 1.0 / sc_o.get_scale()
                    got = sc_o.unscale_and_clip_(opt_o, MAX_NORM, measured=state)
                    hooks = state.total_norm() * torch.tensor(inv, dtype=torch.float32)
                    torch.testing.assert_close(got, hooks, rtol=0, atol=0, equal_nan=True, msg=what)
                    sc_t.unscale_(opt_t)
                    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM)
                    if math.isfinite(want.item()):
                        _assert_norm(got, want, what)
                    _finish(ours, theirs, opt_o, sc_o, opt_t, sc_t, what)
                    continue
                got = gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM, measured=state)
                torch.testing.assert_close(got, state.total_norm(), rtol=0, atol=0, equal_nan=True, msg=what)
                want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM)
                if math.isfinite(want.item()):
                    _assert_norm(got, want, what)
                    _assert_clipped_grads(ours, theirs, what)
                continue
            if visibly:
                raised += 1
                before = [None if p.grad is None else p.grad.clone() for p in ours.parameters()]
                with _raises(RuntimeError, "changed since"):
                    if consumer == "unscale_and_clip_":
                        sc_o.unscale_and_clip_(opt_o, MAX_NORM, measured=state)
                    else:
                        gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM, measured=state)
                for p, b in zip(ours.parameters(), before, strict=True):  # nothing was modified
                    assert (p.grad is None and b is None) or torch.equal(p.grad, b), what
        if consumer == "get_total_norm":
            want = torch.nn.utils.get_total_norm(grads(theirs))
            got = gradfuse.get_total_norm(grads(ours))
            assert math.isnan(got.item()) == math.isnan(want.item()), what
            if math.isfinite(want.item()):
                _assert_norm(got, want, what)
        elif consumer == "clip_grad_norm_":
            want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM)
            got = gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM)
            if math.isfinite(want.item()):
                _assert_norm(got, want, what)
                _assert_clipped_grads(ours, theirs, what)
            else:
                assert not math.isfinite(got.item()), what
        else:
            if not grads(theirs):
                continue  # every gradient set to None: torch's scaler has nothing to step on
            _scaler_round(consumer, ours, theirs, opt_o, sc_o, opt_t, sc_t, what)
        _same_weights_from_here(ours, opt_o, theirs, opt_t)
    assert handed >= 5 and raised >= 5, (handed, raised)


def _finish(ours, theirs, opt_o, sc_o, opt_t, sc_t, what) -> None:
    for sc, opt in ((sc_o, opt_o), (sc_t, opt_t)):
        sc.step(opt)
        sc.update()
    assert sc_o.get_scale() == sc_t.get_scale(), what
    _assert_close_weights(ours, theirs, what)
    _same_weights_from_here(ours, opt_o, theirs, opt_t)


# --- the explicit handover ----------------------------------------------------------------------


def handover_is_right_when_fresh_and_raises_when_visibly_stale(rank, world):
    """``measured=state``: fresh, the hook's norm itself (bit for bit; torch's to fp32) and the
    clip over DDP's buckets; visibly stale (a version counter moved, a gradient replaced or
    set to None, gradients accumulated by a ``no_sync`` backward, an optimizer over some of the
    parameters), ``RuntimeError`` naming why, with nothing modified; a wrong order or object,
    a clear error; a backward that left no measurement, the gradients read."""
    ours, state, theirs = pair()
    for fused in (True, False):
        (opt_o, sc_o), (opt_t, sc_t) = _scaler_pair(ours, theirs, fused)
        zero(ours, theirs)
        _backward(ours, theirs, rank, 1)
        got = gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM, measured=state)
        want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM)
        assert torch.equal(got, state.total_norm())
        _assert_norm(got, want, "fresh drop-in")
        _assert_clipped_grads(ours, theirs, "fresh drop-in")
        # The scaler: fresh right after backward.
        zero(ours, theirs)
        _backward(ours, theirs, rank, 2, scalers=(sc_o, sc_t))
        got = sc_o.unscale_and_clip_(opt_o, MAX_NORM, measured=state)
        sc_t.unscale_(opt_t)
        want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM)
        _assert_norm(got, want, f"fused={fused} fresh scaler")
        _finish(ours, theirs, opt_o, sc_o, opt_t, sc_t, f"fused={fused} fresh scaler")

    stale = {
        "mul_": (lambda m: m.module.head.weight.grad.mul_(0.5), "version counters moved"),
        "replaced": (lambda m: setattr(m.module.head.weight, "grad", m.module.head.weight.grad.clone()), "not one"),
        # Another object over the same memory: what the backward left is an object, not an address.
        "viewed again": (
            lambda m: setattr(
                m.module.head.weight, "grad", m.module.head.weight.grad.view(-1).view_as(m.module.head.weight)
            ),
            "not one",
        ),
        "set to None": (lambda m: setattr(m.module.head.bias, "grad", None), "gradients were given"),
        "re-pointed": (
            lambda m: setattr(m.module.head.weight.grad, "data", m.module.head.weight.grad.clone()),
            "views",
        ),
        # Accumulated out of place: DDP holds the bucket view, so autograd makes a new .grad.
        "no_sync backward": (lambda m: _no_sync_backward(m, rank), "not one the backward left"),
    }
    for name, (edit, message) in stale.items():
        ours, state, _ = pair()  # each case from a fresh DDP
        opt_o = torch.optim.AdamW(ours.parameters(), fused=True)
        sc_o = gradfuse.GradScaler("cpu", enabled=False)  # no loss scaling here: clipping only
        ours(batch(rank, 3)).square().sum().backward()
        edit(ours)
        before = [None if p.grad is None else p.grad.clone() for p in ours.parameters()]
        with _raises(RuntimeError, message):
            gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM, measured=state)
        with _raises(RuntimeError, message):
            sc_o.unscale_and_clip_(opt_o, MAX_NORM, measured=state)
        for p, b in zip(ours.parameters(), before, strict=True):
            assert (p.grad is None and b is None) or torch.equal(p.grad, b), f"{name}: modified"
        # Nothing was recorded either: the scaler takes the same gradients without the handover.
        want = torch.nn.utils.get_total_norm(grads(ours))
        _assert_norm(sc_o.unscale_and_clip_(opt_o, MAX_NORM), want, name)

    # Wrong uses: an optimizer over some of the parameters, another order, another object.
    zero(ours)
    ours(batch(rank, 4)).square().sum().backward()
    some = torch.optim.SGD(ours.module.body.parameters(), lr=0.1)
    with _raises(RuntimeError, "gradients were given"):
        gradfuse.GradScaler("cpu", enabled=False).unscale_and_clip_(some, MAX_NORM, measured=state)
    with _raises(ValueError, "measures the 2.0-norm"):
        gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM, 1.0, measured=state)
    with _raises(TypeError, "measured= takes the state"):
        gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM, measured=state.total_norm())
    with _raises(ValueError, "no process_group"):
        gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM, measured=state, process_group=dist.group.WORLD)

    # No measurement (a sparse bucket): the gradients are read, torch's answer.
    sparse_ours, sparse_state, sparse_theirs = pair(lambda: SparseNet())
    tokens = torch.randint(0, 30, (4, 3), generator=torch.Generator().manual_seed(rank))
    for m in (sparse_ours, sparse_theirs):
        m(tokens).square().sum().backward()
    with _raises(RuntimeError, "sparse"):
        sparse_state.total_norm()
    if not TORCH_MEASURES_SPARSE:  # torch's answer is its error (torch 2.11), nothing modified
        with _raises(NotImplementedError, SPARSE_NORM_ERROR):
            torch.nn.utils.clip_grad_norm_(sparse_theirs.parameters(), 0.1)
        with _raises(NotImplementedError, SPARSE_NORM_ERROR):
            gradfuse.clip_grad_norm_(sparse_ours.parameters(), 0.1, measured=sparse_state)
        for p, q in zip(sparse_ours.parameters(), sparse_theirs.parameters(), strict=True):
            assert torch.equal(p.grad.to_dense(), q.grad.to_dense())
        return
    got = gradfuse.clip_grad_norm_(sparse_ours.parameters(), 0.1, measured=sparse_state)
    want = torch.nn.utils.clip_grad_norm_(sparse_theirs.parameters(), 0.1)
    _assert_norm(got, want, "sparse")


def _no_sync_backward(model, rank):
    with model.no_sync():
        model(batch(rank, 5)).square().sum().backward()


# --- the Trainer ------------------------------------------------------------------------------


class GradientReads(TorchDispatchMode):
    """Counts the ops that touch the memory of given tensors (here: the gradients)."""

    def __init__(self, tensors):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = []
        for a in [*args, *(kwargs or {}).values()]:
            flat.extend(a if isinstance(a, (list, tuple)) else [a])
        if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages for t in flat):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def trainer_step_reads_no_gradient_after_backward(rank, world):
    """The Trainer under DDP (fp32 and fp16 loss scaling, fused AdamW, clipping active): the
    clip after backward touches no gradient (it is handed the hook's measurement: inside the
    Trainer's step no user code runs between backward and the clip), and the step's norm is
    the hook's. The counter itself counts: the same call without the handover reads once."""
    from train_dist_scenarios import combined_batches, mse, my_share, settings

    from gradfuse.train import Trainer

    for precision in ("fp32", "fp16"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
        data = my_share(combined_batches(8, 4 * world), rank, world)
        trainer = Trainer(net, opt, data, settings(max_steps=2, precision=precision), loss_fn=mse)
        counts = []
        real = trainer._unscale_and_clip

        def counted(*args, real=real, counts=counts, net=net):
            with GradientReads([p.grad for p in net.parameters()]) as reads:
                out = real(*args)
            counts.append(list(reads.ops))
            return out

        trainer._unscale_and_clip = counted
        rows = trainer.fit()
        assert counts == [[], []], f"{precision}: the clip after backward touched the gradients: {counts}"
        if precision == "fp32":  # the step's norm is the hook's (fp16: times the step's 1 / scale)
            assert rows[-1]["grad_norm"] == trainer.grads.hook.total_norm().item()
        # Without the handover, the same call reads the gradients: the counter can fail.
        trainer.grads.zero_grad()
        trainer.net(data[0][0]).square().sum().backward()
        scaler = gradfuse.GradScaler("cpu", enabled=False)
        with GradientReads([p.grad for p in net.parameters()]) as reads:
            scaler.unscale_and_clip_(opt, MAX_NORM)
        assert len(reads.ops) == 1, reads.ops
        scaler.update()


# --- an empty parameter ---------------------------------------------------------------------------


class EmptyNet(Net):
    """``Net`` with two empty parameters (zero-width placeholders, as a rank-0 adapter has),
    both used in forward."""

    def __init__(self):
        super().__init__()
        self.first = nn.Parameter(torch.zeros(0))
        self.last = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x, use_extra=False):
        return super().forward(x, use_extra) + self.first.sum() + self.last.sum()


def an_empty_parameter_is_no_stale_handover(rank, world):
    """An empty gradient changes no norm of positive order (nor the count of order 0) and holds
    no inf/NaN, so the handover of a fresh measurement is taken as for any model: before the fix
    it raised "3 gradients were given, and the backward left 2" (the empty gradient views no
    bucket memory), and the Trainer under DDP failed at every step. For ``inf`` torch refuses an
    empty gradient ("cannot compute the inf norm on an empty tensor"): the hook then leaves no
    measurement, and the handover gives torch's answer, that error."""
    for norm_type in (2.0, 1.0, 0.0):
        ours, state, theirs = pair(EmptyNet, norm_type=norm_type)
        for fused in (True, False):
            (opt_o, sc_o), (opt_t, sc_t) = _scaler_pair(ours, theirs, fused)
            zero(ours, theirs)
            _backward(ours, theirs, rank, 1)
            got = gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM, norm_type, measured=state)
            want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM, norm_type)
            assert torch.equal(got, state.total_norm())
            _assert_norm(got, want, f"order {norm_type}: drop-in")
            _assert_clipped_grads(ours, theirs, f"order {norm_type}: drop-in")
            zero(ours, theirs)
            _backward(ours, theirs, rank, 2, scalers=(sc_o, sc_t))
            got = sc_o.unscale_and_clip_(opt_o, MAX_NORM, norm_type, measured=state)
            sc_t.unscale_(opt_t)
            want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM, norm_type)
            _assert_norm(got, want, f"order {norm_type}, fused={fused}: scaler")
            _finish(ours, theirs, opt_o, sc_o, opt_t, sc_t, f"order {norm_type}, fused={fused}: scaler")

    ours, state, theirs = pair(EmptyNet, norm_type=math.inf)
    _backward(ours, theirs, rank, 3)
    with _raises(RuntimeError, "empty"):
        state.total_norm()
    with _raises(RuntimeError, "empty tensor"):
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM, math.inf)
    with _raises(RuntimeError, "empty tensor"):
        gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM, math.inf, measured=state)
    assert_same_grads(ours, theirs, "inf: nothing modified")

    # The Trainer under DDP: every step hands the measurement over, and reads nothing after backward.
    from train_dist_scenarios import combined_batches, mse, my_share, settings

    from gradfuse.train import Trainer

    class EmptyHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
            self.empty = nn.Parameter(torch.zeros(0))

        def forward(self, x):
            return self.net(x) + self.empty.sum()

    torch.manual_seed(0)
    net = EmptyHead()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    data = my_share(combined_batches(8, 4 * world), rank, world)
    trainer = Trainer(net, opt, data, settings(max_steps=2), loss_fn=mse)
    counts = []
    real = trainer._unscale_and_clip

    def counted(*args):
        with GradientReads([p.grad for p in net.parameters() if p.numel()]) as reads:
            out = real(*args)
        counts.append(list(reads.ops))
        return out

    trainer._unscale_and_clip = counted
    rows = trainer.fit()
    assert counts == [[], []], f"the clip after backward touched the gradients: {counts}"
    assert rows[-1]["grad_norm"] == trainer.grads.hook.total_norm().item()


def a_parameter_ddp_ignores_is_outside_the_handover(rank, world):
    """A parameter DDP was told to ignore keeps its own, unreduced gradient, outside every bucket:
    the hook's norm is not of it. A handover over every parameter raises (the backward left one
    gradient fewer in the buckets) with nothing modified; without it, the gradients are read
    (torch's answer, this rank's gradients)."""

    def ignoring():
        model = Net()
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["head.bias"])
        return model

    for cap in (None, 25):  # small buckets (the scenarios' default), and all in one bucket
        ours, state, theirs = pair(ignoring, **({} if cap is None else {"bucket_cap_mb": cap}))
        _backward(ours, theirs, rank, 1)  # DDP's first backward; it then rebuilds its buckets
        zero(ours, theirs)
        _backward(ours, theirs, rank, 2)
        assert (state._n_buckets == 1) == (cap is not None), state._n_buckets
        assert ours.module.head.bias.grad is not None  # computed, not reduced
        before = [p.grad.clone() for p in ours.parameters()]
        with _raises(RuntimeError, "gradients were given"):
            gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM, measured=state)
        for p, b in zip(ours.parameters(), before, strict=True):
            assert torch.equal(p.grad, b), f"cap {cap}: modified"
        got = gradfuse.clip_grad_norm_(ours.parameters(), MAX_NORM)
        want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM)
        _assert_norm(got, want, f"cap {cap}: read")
        _assert_clipped_grads(ours, theirs, f"cap {cap}: read")
