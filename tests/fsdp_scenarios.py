"""Scenarios for ``gradfuse.Trainer`` with ``parallel="fsdp"`` (FSDP2's ``fully_shard``) on every
rank of a 2-rank gloo process group, run by ``tests/test_trainer_fsdp.py`` through
``tests/multiprocess.py``. Each takes ``(rank, world)`` and raises on failure.

Why the comparisons are not bitwise: FSDP2 reduce-scatters the gradients where DDP all-reduces
them (another summation order, and a pre-division by the world size), the total norm adds the
ranks' shards in another order, and one process sums the combined batch's rows in one matmul
where two ranks sum half each; fp32 rounding differs at the level of 1e-7 relative per step.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
import train_dist_scenarios
from torch import nn
from torch.distributed.tensor import DTensor
from train_dist_scenarios import my_share

from gradfuse.train import TrainConfig, Trainer, lr_factor

STEPS, ACCUM, PER_RANK = 3, 2, 4


class Block(nn.Module):
    """The unit FSDP2 shards on its own (``fsdp_units=["Block"]``)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


def model() -> nn.Module:
    torch.manual_seed(0)
    # 3 outputs: the last layer's rows shard unevenly over 2 ranks (FSDP2 pads the second).
    return nn.Sequential(nn.Linear(6, 16), Block(16), Block(16), nn.Linear(16, 3))


def combined_batches(n: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return train_dist_scenarios.combined_batches(n, size, outputs=3)


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def settings(**overrides) -> TrainConfig:
    base = dict(
        max_steps=STEPS, grad_accum_steps=ACCUM, max_grad_norm=0.05, lr=1e-2, lr_schedule="cosine", warmup_steps=1,
        log_every=1, progress=False, parallel="fsdp", fsdp_units=["Block"],
    )  # fmt: skip
    return TrainConfig(**{**base, **overrides})


def full(params) -> list[torch.Tensor]:
    """The whole tensors, gathered from every rank's shard (a collective: every rank calls it)."""
    return [p.full_tensor().detach().clone() if isinstance(p, DTensor) else p.detach().clone() for p in params]


def train(
    parallel: str, precision: str, rank: int, world: int, optimizer=None, loss_fn=mse, make_model=model, **overrides
):
    """(trainer, rows, the whole weights after) of a Trainer run on this rank's share."""
    net = make_model()
    opt = (optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True)))(net.parameters())
    if parallel == "ddp":  # the FSDP2 settings are refused under DDP
        overrides = {**overrides, "fsdp_units": []}
        overrides.pop("reshard_after_forward", None)
    cfg = settings(parallel=parallel, precision=precision, **overrides)
    batches = my_share(combined_batches(STEPS * ACCUM, PER_RANK * world), rank, world)
    trainer = Trainer(net, opt, batches, cfg, loss_fn=loss_fn)
    rows = trainer.fit()
    return trainer, rows, full(net.parameters())


def one_process(world: int, loss_fn=mse, make_model=model, norm_type: float = 2.0, modules: list | None = None):
    """The reference: one process on the combined batches, torch's own clip and fused AdamW.
    With ``modules`` (a list): per step, each depth-1 module's gradient norm and largest
    magnitude before the clip, in float64, are appended to it as ``{"grad_norm/<m>": ...}``."""
    combined = combined_batches(STEPS * ACCUM, PER_RANK * world)
    ref = make_model()
    observe = None if modules is None else lambda net: modules.append(per_module_reference(net, norm_type))
    losses, norms = train_dist_scenarios.reference_run(
        ref, combined, ACCUM, STEPS, loss_fn=loss_fn, fused=True, norm_type=norm_type, before_clip=observe
    )
    return losses, norms, [p.detach() for p in ref.parameters()]


def per_module_reference(net: nn.Module, norm_type: float) -> dict[str, float]:
    """Each depth-1 module's gradient norm and largest magnitude, in float64."""
    members: dict[str, list[torch.Tensor]] = {}
    for name, p in net.named_parameters():
        members.setdefault(name.split(".")[0], []).append(p.grad.double().reshape(-1))
    out = {}
    for m, grads in members.items():
        flat = torch.cat(grads)
        out[f"grad_norm/{m}"] = torch.linalg.vector_norm(flat, norm_type).item()
        out[f"grad_amax/{m}"] = flat.abs().max().item()
    return out


def assert_matches_fp32(rows, weights, ddp_rows, ddp_weights, losses, norms, ref_weights) -> None:
    """An fp32 FSDP2 run's losses, norms and weights against DDP's and one process's, within fp32
    rounding (reduce-scatter and all-reduce add in different orders)."""
    for other_losses, other_norms, other_weights in (
        ([r["loss"] for r in ddp_rows], [r["grad_norm"] for r in ddp_rows], ddp_weights),
        (losses, norms, ref_weights),
    ):
        torch.testing.assert_close([r["loss"] for r in rows], other_losses, rtol=1e-5, atol=0)
        torch.testing.assert_close([r["grad_norm"] for r in rows], other_norms, rtol=1e-5, atol=0)
        for a, b in zip(weights, other_weights, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def fsdp_matches_ddp_and_one_process_fp32(rank, world):
    trainer, rows, weights = train("fsdp", "fp32", rank, world)
    assert trainer.grads.sharded
    assert all(isinstance(p, DTensor) for p in trainer.model.parameters())
    # The user's optimizer was carried over to the sharded parameters: it steps the model's own.
    assert [id(p) for p in trainer.optimizer.param_groups[0]["params"]] == [id(p) for p in trainer.model.parameters()]
    _, ddp_rows, ddp_weights = train("ddp", "fp32", rank, world)
    losses, norms, ref_weights = one_process(world)
    assert all(r["clip_coef"] < 1 for r in rows)  # the clip was active: the folded clip was exercised
    assert_matches_fp32(rows, weights, ddp_rows, ddp_weights, losses, norms, ref_weights)


def fsdp_matches_ddp_and_one_process_bf16(rank, world):
    """bf16: FSDP2 gathers bf16 parameters (its MixedPrecisionPolicy) where DDP's autocast casts
    the fp32 ones per op; both round the same fp32 weights to the same bf16 values and compute
    the same per-rank bf16 gradients, reduced in fp32: FSDP2 vs DDP stays within fp32
    tolerance. One process sums the combined batch's rows in a single bf16 matmul where each
    rank sums its half and the halves are added in fp32: a bf16 rounding apart (2**-8), hence
    the looser tolerance against it."""
    _, rows, weights = train("fsdp", "bf16", rank, world)
    _, ddp_rows, ddp_weights = train("ddp", "bf16", rank, world)
    torch.testing.assert_close([r["loss"] for r in rows], [r["loss"] for r in ddp_rows], rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ddp_rows], rtol=1e-5, atol=0)
    for a, b in zip(weights, ddp_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    def autocast_mse(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mse(model, batch)

    losses, norms, ref_weights = one_process(world, autocast_mse)
    torch.testing.assert_close([r["loss"] for r in rows], losses, rtol=2e-2, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in rows], norms, rtol=2e-2, atol=0)
    for a, b in zip(weights, ref_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def fsdp_matches_ddp_fp16_with_loss_scaling(rank, world):
    """fp16: FSDP2 gathers fp16 parameters, the loss is scaled by GradScaler, the gradients are
    reduced in fp32 and unscaled inside the fused AdamW's read; the same numbers as DDP's."""
    _, rows, weights = train("fsdp", "fp16", rank, world)
    _, ddp_rows, ddp_weights = train("ddp", "fp16", rank, world)
    assert [r["loss_scale"] for r in rows] == [r["loss_scale"] for r in ddp_rows] == [2.0**16] * STEPS
    torch.testing.assert_close([r["loss"] for r in rows], [r["loss"] for r in ddp_rows], rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ddp_rows], rtol=1e-5, atol=0)
    for a, b in zip(weights, ddp_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def hand_written_fsdp(rank: int, world: int, norm_type: float, make_optimizer):
    """torchtitan's way: fully_shard the units and the root, the optimizer built after, torch's
    clip_grad_norm_ on the DTensor gradients; (norms, the whole weights after)."""
    from torch.distributed.fsdp import fully_shard

    net = model()
    for block in (net[1], net[2]):
        fully_shard(block)
    fully_shard(net)
    opt = make_optimizer(net.parameters())
    batches = my_share(combined_batches(STEPS * ACCUM, PER_RANK * world), rank, world)
    norms = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = 1e-2 * lr_factor(step, max_steps=STEPS, warmup_steps=1, schedule="cosine", min_lr_ratio=0.0)
        opt.zero_grad()
        for micro in range(ACCUM):
            net.set_requires_gradient_sync(micro == ACCUM - 1)
            (mse(net, batches[step * ACCUM + micro]) / ACCUM).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05, norm_type).full_tensor().item())
        opt.step()
    return norms, full(net.parameters())


def clip_norm_equals_torch_on_the_same_fsdp_model(rank, world):
    """The norm the Trainer reports (gradfuse's fused pass over the local shards, one
    all-reduce) equals torch's clip_grad_norm_ on the DTensor gradients of the same FSDP2
    model, for orders 2, 1 and inf, and the clip (folded into fused AdamW; in place for SGD)
    moves the weights as torch's does."""
    fused = lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True)  # noqa: E731
    sgd = lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9)  # noqa: E731 (not fused: clipped in place)
    for norm_type, make_optimizer in ((2.0, fused), (1.0, fused), (float("inf"), fused), (2.0, sgd)):
        _, rows, weights = train("fsdp", "fp32", rank, world, optimizer=make_optimizer, norm_type=norm_type)
        norms, torch_weights = hand_written_fsdp(rank, world, norm_type, make_optimizer)
        assert all(r["clip_coef"] < 1 for r in rows), norm_type
        torch.testing.assert_close([r["grad_norm"] for r in rows], norms, rtol=1e-5, atol=0, msg=str(norm_type))
        for a, b in zip(weights, torch_weights, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=str(norm_type))


def communication_only_on_the_last_micro_step(rank, world):
    """FSDP2 reduce-scatters once per unit per step whatever grad_accum_steps (the micro-steps run
    under set_requires_gradient_sync(False)); the step's all-reduces are the loss's mean and
    the one that gives the norm and the inf/NaN flag together."""
    # FSDP2's reduce-scatter: dist.reduce_scatter_single on the torch versions that have it (its
    # old name reduce_scatter_tensor is an alias there), dist.reduce_scatter_tensor before (2.11).
    scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    real_scatter, real_reduce, calls = getattr(dist, scatter), dist.all_reduce, []

    def counting(real):
        def call(*args, **kwargs):
            calls.append(real.__name__)
            return real(*args, **kwargs)

        return call

    counts = []
    for accum in (1, 4):
        net = model()
        batches = my_share(combined_batches(2 * accum, 2 * world), rank, world)
        cfg = settings(max_steps=2, grad_accum_steps=accum)
        trainer = Trainer(net, torch.optim.AdamW(net.parameters(), fused=True), batches, cfg, loss_fn=mse)
        calls.clear()
        setattr(dist, scatter, counting(real_scatter))
        dist.all_reduce = counting(real_reduce)
        try:
            trainer.fit()
        finally:
            setattr(dist, scatter, real_scatter)
            dist.all_reduce = real_reduce
        counts.append(sorted(calls))
    # Per step: one reduce-scatter per unit (2 Blocks and the root), two all-reduces.
    expected = sorted(["all_reduce"] * 2 * 2 + [scatter] * 3 * 2)
    assert counts[0] == counts[1] == expected, counts


def an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(rank, world):
    """An inf in rank 1's shard only (after the reduce-scatter, so rank 0's shards are finite):
    the inf/NaN flag rides the norm's all-reduce, and both ranks skip the step (fp16: and back
    the loss scale off), the weights unchanged on both."""
    for precision in ("fp16", "fp32"):
        net = model()
        batches = my_share(combined_batches(STEPS * ACCUM, PER_RANK * world), rank, world)
        cfg = settings(precision=precision)
        trainer = Trainer(net, torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True), batches, cfg, loss_fn=mse)
        measure = trainer.scaler.unscale_and_clip_

        def poisoned(optimizer, *args, trainer=trainer, net=net, measure=measure, **kwargs):
            if rank == 1 and trainer.step == 1:
                shard = next(p.grad for p in net.parameters() if p.grad.to_local().numel())
                shard.to_local().view(-1)[0] = float("inf")
            return measure(optimizer, *args, **kwargs)

        trainer.scaler.unscale_and_clip_ = poisoned
        rows = [trainer.train_step()]
        before = full(net.parameters())
        rows.append(trainer.train_step())
        after = full(net.parameters())
        assert [r["skipped"] for r in rows] == [0, 1], (precision, rows)
        assert rows[1]["nonfinite_grads"] == ["0.weight"], rows[1]  # on both ranks
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), precision
        scale = trainer.scaler.get_scale()
        assert scale == (2.0**15 if precision == "fp16" else 1.0), (precision, scale)


def bad_settings_raise_before_anything_is_sharded(rank, world):
    """An unknown unit, an optimizer that has stepped or that holds another model's parameter,
    CPU offload without a GPU, a model sharded already: each a ValueError naming the problem,
    the model left unsharded."""
    from torch.distributed.fsdp import fully_shard

    batches = my_share(combined_batches(2, 2 * world), rank, world)
    net = model()
    stepped = torch.optim.AdamW(net.parameters())
    net(batches[0][0]).sum().backward()
    stepped.step()
    stranger = nn.Linear(2, 2)
    sharded = fully_shard(model())
    fresh = torch.optim.AdamW(net.parameters())
    cases = [
        (net, settings(fsdp_units=["Blok"]), fresh, r"fsdp_units names \['Blok'\].*Block"),
        (net, settings(), stepped, "optimizer already has state"),
        (net, settings(), torch.optim.AdamW([*net.parameters(), stranger.weight]), r"param_groups\[0\].*\(2, 2\)"),
        (net, settings(cpu_offload=True), fresh, "TrainConfig.cpu_offload.*cpu"),
        (sharded, settings(), torch.optim.AdamW(sharded.parameters()), "parameters are DTensors already"),
    ]
    for target, cfg, opt, message in cases:
        try:
            Trainer(target, opt, batches, cfg, loss_fn=mse)
        except ValueError as err:
            assert re.search(message, str(err)), (message, str(err))
        else:
            raise AssertionError(f"no error for {message}")
        assert not any(isinstance(p, DTensor) for p in net.parameters()), message


def summed_squares(model, batch):
    """``loss_normalization="tokens"``: the summed loss and the rows it counts (3 of 4 here)."""
    x, y = batch
    rows = (model(x).float() - y).pow(2).sum(-1)[:3]
    return rows.sum(), torch.tensor(3)


def other_trainer_features_match_ddp(rank, world):
    """The rest of the Trainer under FSDP2 gives DDP's losses, norms, clip coefficients and
    weights: ZClip and AutoClip (the total norm through the DTensor path, the policy's
    coefficient folded into fused AdamW), order 0 (a count of non-zero gradients, which no loss
    scale changes), token-exact accumulation (the divisor folded into the unscale factor),
    spike skipping, activation checkpointing of the units, and reshard_after_forward=False."""
    cases = [
        dict(max_grad_norm=None, clip="zclip", clip_options={"warmup_steps": 1, "max_grad_norm": None}),
        dict(max_grad_norm=None, clip="autoclip"),
        dict(norm_type=0.0, max_grad_norm=2.0),
        dict(norm_type=0.0, max_grad_norm=2.0, precision="fp16"),
        dict(loss_normalization="tokens", loss_fn=summed_squares),
        dict(skip_spikes=(8, 6.0, 2)),
        dict(activation_checkpointing=["Block"]),
        dict(reshard_after_forward=False),
    ]
    for case in cases:
        precision = case.pop("precision", "fp32")
        _, rows, weights = train("fsdp", precision, rank, world, **case)
        _, ddp_rows, ddp_weights = train("ddp", precision, rank, world, **case)
        for key in ("loss", "grad_norm", "clip_coef"):
            mine, theirs = [r[key] for r in rows], [r[key] for r in ddp_rows]
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=0, msg=f"{key} {case}")
        if case.get("norm_type") == 0:
            assert all(r["clip_coef"] < 1 for r in rows), rows  # 8 non-zero tensors, clipped to 2
        for a, b in zip(weights, ddp_weights, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=str(case))


def the_optimizer_is_carried_over_group_by_group(rank, world):
    """Two param groups with their own settings: after the Trainer is made, each group holds
    the sharded parameters of the same names (the same list objects, changed in place), with
    its settings as they were."""
    net = model()
    names = [name for name, _ in net.named_parameters()]
    decay = [p for p in net.parameters() if p.dim() == 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "lr": 5e-3}], lr=1e-2)
    lists = [group["params"] for group in opt.param_groups]
    expected = [[n for n in names if n.endswith("weight")], [n for n in names if n.endswith("bias")]]
    batches = my_share(combined_batches(2, 2 * world), rank, world)
    trainer = Trainer(net, opt, batches, settings(lr=None, max_grad_norm=None), loss_fn=mse)
    by_id = {id(p): name for name, p in trainer.model.named_parameters()}
    assert all(isinstance(p, DTensor) for p in trainer.model.parameters())
    for group, before, want in zip(opt.param_groups, lists, expected, strict=True):
        assert group["params"] is before
        assert [by_id.get(id(p)) for p in group["params"]] == want, (group["params"], want)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.01]
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 5e-3]


class Gain(nn.Module):
    """One parameter of one element: FSDP2 leaves rank 1 an empty shard of it."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        return x * self.scale


def model_with_gain() -> nn.Module:
    net = model()
    net.append(Gain())
    return net


def per_module_norms_match_ddp_and_one_process(rank, world):
    """log_grad_norms under FSDP2: each rank reduces its local shards per module from the
    clip's own read (multi_tensor_stats), and one (order inf) or two (finite orders) small
    all-reduces combine the ranks; the grad_norm/<m> and grad_amax/<m> of every step equal the
    DDP Trainer's and one process's (float64, on the combined batch), within fp32 tolerance (the
    summation orders differ, see the module docstring); in fp16 the DDP Trainer's. Module "4"
    (Gain) is an empty shard on rank 1: that rank still joins the collectives and adds nothing."""
    real_reduce, calls = dist.all_reduce, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real_reduce(*args, **kwargs)

    for norm_type in (2.0, float("inf")):
        counts = []
        for depth in (None, 1):
            calls.clear()
            dist.all_reduce = counting
            try:
                _, rows, _ = train("fsdp", "fp32", rank, world, make_model=model_with_gain, norm_type=norm_type,
                                   log_grad_norms=depth)  # fmt: skip
            finally:
                dist.all_reduce = real_reduce
            counts.append(len(calls))
        # Every step logs (log_every=1): one more all-reduce per step for order inf, two for 2.
        extra = 1 if norm_type == float("inf") else 2
        assert counts[1] - counts[0] == extra * STEPS, (norm_type, counts)
        _, ddp_rows, _ = train("ddp", "fp32", rank, world, make_model=model_with_gain, norm_type=norm_type,
                               log_grad_norms=1)  # fmt: skip
        reference: list[dict] = []
        one_process(world, make_model=model_with_gain, norm_type=norm_type, modules=reference)
        keys = [f"grad_{kind}/{m}" for kind in ("norm", "amax") for m in "01234"]
        for row, ddp_row, ref in zip(rows, ddp_rows, reference, strict=True):
            assert sorted(k for k in row if k.startswith("grad_") and "/" in k) == sorted(keys), row
            for key in keys:
                msg = f"{key} step {row['step']} order {norm_type}"
                torch.testing.assert_close(row[key], ddp_row[key], rtol=1e-5, atol=0, msg=msg)
                torch.testing.assert_close(row[key], ref[key], rtol=1e-5, atol=0, msg=msg)
    # fp16: the statistics of the loss-scaled shards, unscaled by the probe, as DDP's (the model
    # without Gain, which autocast multiplies in fp32 where FSDP2 casts it to fp16).
    _, rows, _ = train("fsdp", "fp16", rank, world, log_grad_norms=1)
    _, ddp_rows, _ = train("ddp", "fp16", rank, world, log_grad_norms=1)
    assert rows[0]["loss_scale"] == 2.0**16 and rows[-1]["skipped"] == 0, rows
    for row, ddp_row in zip(rows, ddp_rows, strict=True):
        for key in [f"grad_{kind}/{m}" for kind in ("norm", "amax") for m in "0123"]:
            torch.testing.assert_close(row[key], ddp_row[key], rtol=1e-5, atol=0, msg=f"fp16 {key}")


def agc_matches_ddp(rank, world):
    """clip="agc" under FSDP2: the rows of each matrix are whole on their rank (FSDP2 shards
    dim 0), and each bias (and the one-element Gain, an empty shard on rank 1) is one unit
    whose weight and gradient norms come from the ranks' partials in one all-reduce per step.
    Losses, total norms and weights equal the DDP Trainer's within fp32 tolerance, for orders 2
    and inf, in fp32 and in fp16 (the unscale folded into AGC's write); the clip was active
    (the weights differ from an unclipped run's), and no step overflowed."""
    # fp16 without Gain: autocast multiplies by its fp32 scale where FSDP2 casts it to fp16.
    cases = [(2.0, "fp32", model_with_gain), (float("inf"), "fp32", model_with_gain), (2.0, "fp16", model)]
    for norm_type, precision, make_model in cases:
        options = {"clip_factor": 0.02, "norm_type": norm_type}
        common = dict(make_model=make_model, max_grad_norm=None)
        _, rows, weights = train("fsdp", precision, rank, world, clip="agc", clip_options=options, **common)
        _, ddp_rows, ddp_weights = train("ddp", precision, rank, world, clip="agc", clip_options=options, **common)
        _, _, free_weights = train("fsdp", precision, rank, world, **common)
        msg = f"order {norm_type} {precision}"
        for key in ("loss", "grad_norm"):
            mine, theirs = [r[key] for r in rows], [r[key] for r in ddp_rows]
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=0, msg=f"{key} {msg}")
        assert rows[-1]["skipped"] == 0, (msg, rows)
        for a, b in zip(weights, ddp_weights, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=msg)
        assert any((a - b).abs().max() > 1e-4 for a, b in zip(weights, free_weights, strict=True)), msg


def agc_refuses_shards_that_split_its_units(rank, world):
    """A matrix sharded along dim 1 (tensor parallel's Shard(1)) has its rows, AGC's units,
    split across the ranks: a ValueError naming the parameter on every rank, before any pass
    (the gradients unchanged)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gradfuse.agc import adaptive_clip_grad_

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(9)
    rows = nn.Parameter(distribute_tensor(torch.randn(4, 6, generator=gen), mesh, [Shard(0)]))
    cols = nn.Parameter(distribute_tensor(torch.randn(4, 6, generator=gen), mesh, [Shard(1)]))
    for p in (rows, cols):
        p.grad = distribute_tensor(torch.randn(4, 6, generator=gen), mesh, p.placements)
    before = [p.grad.to_local().clone() for p in (rows, cols)]
    try:
        adaptive_clip_grad_([rows, cols], clip_factor=1e-3)
    except ValueError as err:
        assert re.search(r"AGC: parameter 1 \(4, 6\) is sharded along .*Shard\(dim=1\)", str(err)), str(err)
    else:
        raise AssertionError("no error for a Shard(1) matrix")
    assert all(torch.equal(p.grad.to_local(), b) for p, b in zip((rows, cols), before, strict=True))


class Embed(nn.Module):
    """An embedding of float inputs (``x @ weight``), its weight tied to ``TiedModel.head``'s."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, width) * 0.3)

    def forward(self, x):
        return x @ self.weight


class TiedModel(nn.Module):
    """An embedding and an output head sharing one weight (as a language model's), Blocks
    between them, and a last projection to the 3 targets."""

    def __init__(self):
        super().__init__()
        self.embed = Embed(6, 16)
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.head = nn.Linear(16, 6, bias=False)
        self.head.weight = self.embed.weight
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.head(self.blocks(self.embed(x))))


def tied_model() -> nn.Module:
    torch.manual_seed(0)
    return TiedModel()


GROUPED = ["Block", ("embed", "head")]  # the tied embedding and head: one FSDP2 unit


def tied_weights_in_one_unit_match_ddp_and_one_process(rank, world):
    """fsdp_units with a group (``fully_shard([embed, head])``): the tied weight stays one
    parameter (one DTensor, registered under both names, stepped once by the optimizer), and
    the losses, norms and weights equal the DDP Trainer's and one process's, as the untied
    model's do."""
    trainer, rows, weights = train("fsdp", "fp32", rank, world, make_model=tied_model, fsdp_units=GROUPED)
    net = trainer.model
    assert isinstance(net.embed.weight, DTensor) and net.head.weight is net.embed.weight
    assert type(net.embed).__name__ == "FSDPEmbed" and type(net.head).__name__ == "FSDPLinear"
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(list(net.parameters())) == 7
    _, ddp_rows, ddp_weights = train("ddp", "fp32", rank, world, make_model=tied_model)
    losses, norms, ref_weights = one_process(world, make_model=tied_model)
    assert all(r["clip_coef"] < 1 for r in rows)
    assert_matches_fp32(rows, weights, ddp_rows, ddp_weights, losses, norms, ref_weights)


def split_tied_weights_are_refused_before_anything_is_sharded(rank, world):
    """Tied weights in two units (the embedding's and the head's), or in a unit and the root
    (the head left to it): a ValueError at Trainer(...) naming both parameters and their units
    and suggesting the group, with the model as it was (the same parameter objects, tie
    included, the same module classes, nothing sharded) and the optimizer too; a Trainer with
    the grouped units is then built on the same model and trains it as a fresh one would."""
    net = tied_model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    params = list(net.named_parameters(remove_duplicate=False))
    classes = [(name, type(m)) for name, m in net.named_modules()]
    values = [p.detach().clone() for _, p in params]
    held = [list(g["params"]) for g in opt.param_groups]
    batches = my_share(combined_batches(STEPS * ACCUM, PER_RANK * world), rank, world)
    cases = [
        (["Block", "Embed"], r"head\.weight \(in the root"),
        (["Block", "Embed", "head"], r"head\.weight \(in unit 'head' \(Linear\)\)"),
    ]
    for units, where in cases:
        try:
            # With activation checkpointing too: the refusal must not leave forwards wrapped either.
            Trainer(net, opt, batches, settings(fsdp_units=units, activation_checkpointing=["Block"]), loss_fn=mse)
        except ValueError as err:
            message = str(err)
            assert "embed.weight (in unit 'embed' (Embed)) is the same parameter as" in message, message
            assert re.search(where, message) and "('embed', 'head')" in message, message
        else:
            raise AssertionError(f"no error for {units}")
        assert [(n, id(p)) for n, p in net.named_parameters(remove_duplicate=False)] == [(n, id(p)) for n, p in params]
        assert [(name, type(m)) for name, m in net.named_modules()] == classes and net.head.weight is net.embed.weight
        assert all(torch.equal(p, v) for (_, p), v in zip(params, values, strict=True))
        assert not any(isinstance(p, DTensor) for p in net.parameters()) and not opt.state
        assert [list(g["params"]) for g in opt.param_groups] == held
        assert not any("forward" in vars(m) for m in net.modules()), "a refused Trainer left a forward wrapped"
    trainer = Trainer(net, opt, batches, settings(fsdp_units=GROUPED), loss_fn=mse)
    rows = trainer.fit()
    _, fresh_rows, fresh_weights = train("fsdp", "fp32", rank, world, make_model=tied_model, fsdp_units=GROUPED)
    assert [r["loss"] for r in rows] == [r["loss"] for r in fresh_rows]
    assert all(torch.equal(a, b) for a, b in zip(full(net.parameters()), fresh_weights, strict=True))


@dataclasses.dataclass
class Output:
    """A model output of one's own making: a dataclass, which torch's pytree takes for a leaf."""

    prediction: torch.Tensor


class Wrapped(nn.Module):
    """``model()`` returning its prediction as is, or inside an ``Output`` (``dataclass``)."""

    def __init__(self, dataclass: bool):
        super().__init__()
        self.net, self.dataclass = model(), dataclass

    def forward(self, x):
        y = self.net(x)
        return Output(y) if self.dataclass else y


def mse_of_output(model, batch):
    x, y = batch
    out = model(x)
    return F.mse_loss((out.prediction if isinstance(out, Output) else out).float(), y)


def a_dataclass_output_trains_as_a_tensor_does_or_is_refused(rank, world):
    """torch 2.11's FSDP2 misses the tensors inside a dataclass output (train/fsdp.py): there the
    first forward raises a TypeError naming the class, with or without the reshard after forward
    (without the check: an error in backward, or silently unreduced gradients); on a torch whose
    FSDP2 looks inside dataclasses, the weights are those of the same model returning a tensor,
    bit for bit."""
    from gradfuse.train.fsdp import _finds_tensors_in_dataclasses

    for reshard in (True, False):
        run = lambda dc, reshard=reshard: train(  # noqa: E731
            "fsdp", "fp32", rank, world, loss_fn=mse_of_output, make_model=lambda: Wrapped(dc),
            reshard_after_forward=reshard,
        )  # fmt: skip
        _, _, want = run(False)
        if _finds_tensors_in_dataclasses():
            _, _, got = run(True)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), reshard
            continue
        try:
            run(True)
        except TypeError as err:
            assert re.search(r"Wrapped\.forward returns a Output, a dataclass .*register_dataclass", str(err)), err
        else:
            raise AssertionError(f"no error (reshard_after_forward={reshard})")
