"""gradfuse.Trainer on FSDP2 (``TrainConfig(parallel="fsdp")``) on 2 real ranks (gloo, this
machine only), against DDP and one process on the combined batch. Scenarios in
``fsdp_scenarios.py``, all in one start of two processes, each reported here as its own test."""

from __future__ import annotations

import dataclasses

import fsdp_scenarios
import multiprocess
import pytest
import torch
import torch.distributed as dist

from gradfuse.train import TrainConfig, Trainer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

SCENARIOS = [
    "fsdp_matches_ddp_and_one_process_fp32",
    "fsdp_matches_ddp_and_one_process_bf16",
    "fsdp_matches_ddp_fp16_with_loss_scaling",
    "clip_norm_equals_torch_on_the_same_fsdp_model",
    "communication_only_on_the_last_micro_step",
    "an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank",
    "bad_settings_raise_before_anything_is_sharded",
    "other_trainer_features_match_ddp",
    "the_optimizer_is_carried_over_group_by_group",
    "per_module_norms_match_ddp_and_one_process",
    "agc_matches_ddp",
    "agc_refuses_shards_that_split_its_units",
    "tied_weights_in_one_unit_match_ddp_and_one_process",
    "split_tied_weights_are_refused_before_anything_is_sharded",
    "a_dataclass_output_trains_as_a_tensor_does_or_is_refused",
]


@pytest.fixture(scope="module")
def results():
    return multiprocess.run("fsdp_scenarios", SCENARIOS, world=2, deadline=180)


def test_every_scenario_is_listed():
    assert multiprocess.scenarios_in(fsdp_scenarios) == set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_ranks(results, name):
    multiprocess.assert_passed(results[name])


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (dict(parallel="zero"), ValueError, "TrainConfig.parallel must be one of 'ddp', 'fsdp', got 'zero'"),
        (dict(parallel="fsdp", fsdp_units="Block"), TypeError, "TrainConfig.fsdp_units must be a list of module class"),
        (dict(parallel="fsdp", fsdp_units=[1]), TypeError, "TrainConfig.fsdp_units must be a list of module class"),
        (dict(parallel="fsdp", fsdp_units=[("embed", 1)]), TypeError, r"or a list/tuple of names .*entry 0 is \("),
        (dict(parallel="fsdp", fsdp_units=["Block", {"embed"}]), TypeError, r"entry 1 is \{'embed'\}"),
        (
            dict(parallel="fsdp", fsdp_units=["Block", ()]),
            ValueError,
            r"entry 1 \(\(\)\) must name at least one module",
        ),
        (dict(parallel="fsdp", fsdp_units=[["embed", ""]]), ValueError, "no name may be empty"),
        (dict(parallel="fsdp", fsdp_units=[""]), ValueError, "TrainConfig.fsdp_units entry 0 is an empty name"),
        (dict(parallel="fsdp", reshard_after_forward=1), TypeError, "TrainConfig.reshard_after_forward must be True"),
        (dict(parallel="fsdp", cpu_offload="yes"), TypeError, "TrainConfig.cpu_offload must be True or False"),
        (dict(fsdp_units=["Block"]), ValueError, "TrainConfig.fsdp_units applies to parallel='fsdp' only"),
        (dict(reshard_after_forward=False), ValueError, "TrainConfig.reshard_after_forward applies to parallel="),
        (dict(cpu_offload=True), ValueError, "TrainConfig.cpu_offload applies to parallel='fsdp' only"),
        (dict(log_grad_norms=1, norm_type=0.0), ValueError, "TrainConfig.log_grad_norms is not available with norm"),
    ],
)
def test_bad_parallel_settings_name_the_field(overrides, error, message):
    with pytest.raises(error, match=message):
        TrainConfig(**overrides)
    with pytest.raises(error, match=message):  # replace() checks again
        dataclasses.replace(TrainConfig(), **overrides)


def test_one_process_with_parallel_fsdp_trains_the_plain_model():
    """No process group: nothing to shard over; the run is the DDP setting's, bit for bit."""
    batches = fsdp_scenarios.my_share(fsdp_scenarios.combined_batches(6, 4), 0, 1)
    weights = []
    for parallel in ("fsdp", "ddp"):
        net = fsdp_scenarios.model()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
        units = ["Block"] if parallel == "fsdp" else []
        cfg = fsdp_scenarios.settings(parallel=parallel, fsdp_units=units)
        trainer = Trainer(net, opt, batches, cfg, loss_fn=fsdp_scenarios.mse)
        trainer.fit()
        assert trainer.grads.sharded is False
        weights.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_one_process_per_module_norms_match_the_float64_reference(norm_type):
    """The one-process side of the 2-rank scenario per_module_norms_match_ddp_and_one_process:
    the Trainer with parallel="fsdp" and no process group logs the same per-module norms and
    largest magnitudes as a hand-run float64 reference on the same batches (fp32 tolerance:
    the Trainer's gradients and sums are fp32)."""
    world = 2  # the combined batches of the 2-rank scenario, all in this process
    batches = fsdp_scenarios.combined_batches(fsdp_scenarios.STEPS * fsdp_scenarios.ACCUM, 4 * world)
    net = fsdp_scenarios.model_with_gain()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    cfg = fsdp_scenarios.settings(norm_type=norm_type, log_grad_norms=1)
    rows = Trainer(net, opt, batches, cfg, loss_fn=fsdp_scenarios.mse).fit()
    reference: list[dict] = []
    fsdp_scenarios.one_process(world, make_model=fsdp_scenarios.model_with_gain, norm_type=norm_type, modules=reference)
    assert len(rows) == len(reference) == fsdp_scenarios.STEPS
    for row, ref in zip(rows, reference, strict=True):
        assert set(ref) <= set(row)
        for key, value in ref.items():
            torch.testing.assert_close(row[key], value, rtol=1e-5, atol=0, msg=key)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), -1.0])
def test_a_ranks_shards_the_kernels_cannot_run_are_measured_by_torch(monkeypatch, norm_type):
    """The DTensor clip measures each rank's shards before the all-reduce every rank must join:
    shards the fused kernels refuse (on one rank only, say) are measured with torch's ops
    instead, to the same norm of the unscaled shards and the same inf/NaN flag."""
    from gradfuse import scaler

    gen = torch.Generator().manual_seed(3)
    shards = [torch.randn(n, generator=gen) for n in (5, 0, 17, 1)]
    inv_scale = torch.tensor(0.25)
    fused = scaler._local_norm_and_flag(shards, inv_scale, norm_type, torch.device("cpu"))
    monkeypatch.setattr(scaler, "_fused_groups", lambda tensors, one_device: None)
    by_torch = scaler._local_norm_and_flag(shards, inv_scale, norm_type, torch.device("cpu"))
    expected = torch.linalg.vector_norm(torch.cat([s.double() for s in shards]) * 0.25, norm_type).float()
    torch.testing.assert_close(fused[0], expected, rtol=1e-6, atol=0)  # fp32 sums of 23 elements
    torch.testing.assert_close(by_torch[0], expected, rtol=1e-6, atol=0)
    assert fused[1].item() == by_torch[1].item() == 0.0
    shards[2][4] = float("nan")
    assert scaler._local_norm_and_flag(shards, inv_scale, norm_type, torch.device("cpu"))[1].item() == 1.0


def test_units_come_innermost_first_without_the_root():
    """FSDP2 shards a module's descendants before the module: nested units come inner first,
    and the root, sharded last in any case, is not among them even when its class is named."""
    from torch import nn

    from gradfuse.train.fsdp import fsdp_units

    class Block(nn.Sequential):
        pass

    inner, other = Block(nn.Linear(2, 2)), Block(nn.Linear(2, 2))
    outer = Block(inner, nn.Linear(2, 2))
    root = Block(outer, other)
    units = fsdp_units(root, ["Block"])
    assert len(units) == 3 and {id(u) for u in units} == {id(inner), id(outer), id(other)}
    assert units.index(inner) < units.index(outer)
    with pytest.raises(ValueError, match=r"fsdp_units names \['Blok'\].*Block, Linear"):
        fsdp_units(root, ["Block", "Blok"])


def test_a_group_is_one_unit_sharded_before_the_units_around_its_modules():
    """A list/tuple entry is one unit (a list of modules), named by qualified names or classes;
    it comes before every unit holding one of its modules, even one whose other module comes
    later in the model (FSDP2 shards inner units first); name entries stay modules, a module
    named twice by name entries is one unit, and the config keeps groups as lists."""
    from torch import nn

    from gradfuse.train.fsdp import check_ties, fsdp_units

    class Block(nn.Sequential):
        pass

    net = nn.Sequential()
    net.add_module("outer", Block(nn.Linear(2, 2)))
    net.add_module("mid", nn.Linear(2, 2))
    net.add_module("last", Block(nn.Linear(2, 2)))
    net.add_module("head", nn.Linear(2, 2))
    net.head.weight = net.outer[0].weight  # tied: the group below keeps them together
    units = fsdp_units(net, ["Block", ("head", "outer.0"), "last"])
    group = [u for u in units if isinstance(u, list)]
    assert group == [[net.head, net.outer[0]]]
    assert units.index(group[0]) < units.index(net.outer) and len(units) == 3  # "last": a Block already
    check_ties(net, units)
    with pytest.raises(ValueError, match=r"outer\.0\.weight \(in unit 'outer' \(Block\)\) is the same .*'head'"):
        check_ties(net, fsdp_units(net, ["Block", "head"]))
    by_class = fsdp_units(net, [("Linear",)])  # every Linear of the model: one unit
    assert [set(map(id, u)) for u in by_class] == [{id(m) for m in net.modules() if isinstance(m, nn.Linear)}]
    config = TrainConfig(parallel="fsdp", fsdp_units=["Block", ("head", "outer.0")])
    assert config.to_dict()["fsdp_units"] == ["Block", ["head", "outer.0"]]  # compared on resume: as saved


def test_a_shared_module_in_two_units_is_refused():
    """The same module at two places, one inside a unit and one left to the root: its
    parameters would be in two units (torch refuses at the first forward)."""
    from torch import nn

    from gradfuse.train.fsdp import check_ties, fsdp_units

    class Block(nn.Sequential):
        pass

    shared = nn.Linear(2, 2)
    net = nn.Sequential(Block(shared), shared)
    with pytest.raises(
        ValueError, match=r"0\.0\.weight \(in unit '0' \(Block\)\) is the same parameter as 1\.weight \(in the root"
    ):
        check_ties(net, fsdp_units(net, ["Block"]))
    check_ties(net, fsdp_units(net, ["Block", "1"]))  # the shared module a unit of its own: fine


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["Block", ("b", "head")], r"entries 0 \('Block'\) and 1 \(\('b', 'head'\)\) both take the module 'b'"),
        ([("b", "head"), "head"], r"both take the module 'head'"),
        ([("a", "a.0")], r"group \('a', 'a\.0'\) holds 'a\.0', which is inside 'a' of the same group"),
        ([("a", "b.0"), ("b", "a.0")], r"each hold a module inside another's"),
        (["Linear"], r"'Linear' is both a module class and the qualified name of another module"),
        ([("head", "nothing")], r"names \['nothing'\], but the model has no module of that class or qualified name"),
    ],
)
def test_fsdp_units_that_cannot_be_sharded_are_refused(entries, message):
    from torch import nn

    from gradfuse.train.fsdp import fsdp_units

    class Block(nn.Sequential):
        pass

    net = nn.Sequential()
    for name in ("a", "b"):
        net.add_module(name, Block(nn.Linear(2, 2)))
    net.add_module("head", nn.Linear(2, 2))
    if entries == ["Linear"]:
        net.add_module("Linear", nn.Tanh())
    with pytest.raises(ValueError, match=message):
        fsdp_units(net, entries)
