"""A resume checks the checkpoint against the model, the optimizer, the schedule and the scaler
before anything is changed: a mismatch raises ``CheckpointMismatch`` naming what differs, and
the model and optimizer are exactly as they were (a96b1fb overwrote the model first, then
raised torch's error, or raised nothing and failed at the first step). Checkpoints written
before the check existed (without the optimizer's class and parameter names) still resume,
exactly. Single files and sharded folders (DCP, one process) alike."""

from __future__ import annotations

import copy

import pytest
import sharded_checkpoint_scenarios as scenarios
import torch
from test_trainer import TinyLM, config, loader

from gradfuse.train import CheckpointError, Trainer, load_checkpoint
from gradfuse.train.checkpoint import write_file
from gradfuse.train.compatibility import CheckpointMismatch

STEPS = 3


def momentum_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def adamw(model, params=None):
    return torch.optim.AdamW(model.parameters() if params is None else params, lr=1e-2, weight_decay=0.1)


def saved_run(folder, make_optimizer=momentum_sgd, model=None, **overrides):
    """Trains ``STEPS`` steps and saves at the end: the folder's step-00000003.pt."""
    model = model or TinyLM()
    cfg = config(max_steps=STEPS, checkpoint_dir=folder, **overrides)
    Trainer(model, make_optimizer(model), loader(), cfg).fit()
    return folder / f"step-{STEPS:08d}.pt"


def as_written_by_a96b1fb(path):
    """The checkpoint without what was added to it since a96b1fb (the optimizer's class and its
    groups' parameter names, three config fields): what the Trainer of a96b1fb wrote for the
    same run (checked once against files written by a96b1fb itself)."""
    state = load_checkpoint(path)
    for key in ("format", "version", "optimizer_class", "optimizer_params"):
        state.pop(key, None)
    for field in ("nonfinite_rerun", "find_unused_parameters", "static_graph"):  # TrainConfig fields since
        state["config"].pop(field)
    write_file(path, state)


def everything(model, optimizer) -> dict:
    return {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict())}


def assert_same(a: dict, b: dict) -> None:
    """Nested state dicts equal, tensors bit for bit."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (a.keys(), getattr(b, "keys", lambda: b)())
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b or (a != a and b != b), (a, b)


def refused(path, model, optimizer, match: str, **kwargs) -> CheckpointMismatch:
    """Resuming ``path`` into ``model``/``optimizer`` (already stepped, so that their state is not
    empty) raises a mismatch matching ``match``; both are untouched."""
    model(**next(iter(loader()))).loss.backward()
    optimizer.step()
    before = everything(model, optimizer)
    cfg = config(max_steps=STEPS + 2, checkpoint_dir=path.parent)
    with pytest.raises(CheckpointMismatch, match=match) as err:
        Trainer(model, optimizer, loader(), cfg, resume=path, **kwargs)
    assert_same(before, everything(model, optimizer))
    assert isinstance(err.value, CheckpointError) and str(path) in str(err.value)
    return err.value


@pytest.mark.parametrize("written_by", ["now", "a96b1fb"])
def test_another_optimizer_class_is_named_and_nothing_changes(tmp_path, written_by):
    """The issue's case: an SGD(momentum) checkpoint resumed with AdamW. a96b1fb loaded the
    weights, then failed in AdamW's first step with KeyError: 'step'."""
    path = saved_run(tmp_path)
    if written_by == "a96b1fb":
        as_written_by_a96b1fb(path)
        match = "param group 0 was saved with settings dampening, momentum, nesterov, which AdamW does not have"
    else:
        match = "the optimizer: saved with SGD, this run uses AdamW"
    model = TinyLM(seed=1)
    refused(path, model, adamw(model), match)


@pytest.mark.parametrize("written_by", ["now", "a96b1fb"])
def test_checkpoints_without_the_new_record_still_resume_exactly(tmp_path, written_by):
    """N straight steps == N/2 + resume + N/2, bit for bit, from a checkpoint with or without the
    optimizer's record."""
    straight = TinyLM()
    Trainer(straight, adamw(straight), loader(), config(max_steps=2 * STEPS)).fit()
    path = saved_run(tmp_path / "ckpt", adamw)
    if written_by == "a96b1fb":
        as_written_by_a96b1fb(path)
        assert "optimizer_class" not in load_checkpoint(path)
    resumed_model = TinyLM(seed=5)
    cfg = config(max_steps=2 * STEPS, checkpoint_dir=tmp_path / "ckpt")
    Trainer(resumed_model, adamw(resumed_model), loader(), cfg, resume="latest").fit()
    for a, b in zip(straight.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_another_model_shape_dtype_or_keys_are_named(tmp_path):
    path = saved_run(tmp_path, adamw)
    wider = TinyLM(d=24)
    refused(path, wider, adamw(wider), r"model shapes differ: embed.weight saved \(17, 16\), now \(17, 24\)")
    half = TinyLM().double()
    refused(path, half, adamw(half), "model dtypes differ: embed.weight saved as torch.float32, now torch.float64")
    extra = TinyLM()
    extra.register_buffer("scale", torch.ones(3))
    refused(path, extra, adamw(extra), "the model has scale, which the checkpoint lacks")


def test_an_optimizer_over_other_parameters_is_named(tmp_path):
    path = saved_run(tmp_path, adamw)
    model = TinyLM()
    subset = adamw(model, [p for n, p in model.named_parameters() if not n.startswith("head")])
    refused(path, model, subset, r"param group 0 was saved over 15 parameter\(s\), this one holds 13")
    model = TinyLM()
    params = list(model.parameters())
    swapped = adamw(model, [params[1], params[0], *params[2:]])  # the same count, in another order
    refused(path, model, swapped, r"saved over other parameters: embed.weight \(now blocks.0.norm.weight\)")
    model = TinyLM()
    two_groups = adamw(model, [{"params": params[:4]}, {"params": params[4:]}])
    refused(path, model, two_groups, r"saved with 1 param group\(s\), this one has 2")


def test_a_swapped_order_in_an_old_checkpoint_is_caught_by_the_state_shapes(tmp_path):
    """Without recorded names (a96b1fb), parameters in another order show in the moments'
    shapes (AdamW's state tensors have their parameter's shape)."""
    path = saved_run(tmp_path, adamw)
    as_written_by_a96b1fb(path)
    model = TinyLM()
    params = list(model.parameters())
    swapped = adamw(model, [params[1], params[0], *params[2:]])
    refused(path, model, swapped, r"optimizer state shapes differ: exp_avg of blocks.0.norm.weight saved \(17, 16\)")


def test_a_torch_scheduler_of_another_kind_is_named(tmp_path):
    model = TinyLM()
    opt = adamw(model)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    Trainer(model, opt, loader(), config(max_steps=STEPS, checkpoint_dir=tmp_path), scheduler=cosine).fit()
    path = tmp_path / f"step-{STEPS:08d}.pt"
    model = TinyLM()
    opt = adamw(model)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    refused(path, model, opt, "this run's StepLR resumes from its own state dict.*T_max", scheduler=step_lr)
    # The config's schedule or a step -> lr function take the position alone: a change of kind resumes.
    model = TinyLM()
    cfg = config(max_steps=STEPS + 2, checkpoint_dir=tmp_path)
    resumed = Trainer(model, adamw(model), loader(), cfg, resume=path, scheduler=lambda step: 1e-3)
    assert resumed.step == STEPS and resumed.optimizer.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("scheduler", ["OneCycleLR", "SWALR"])
def test_an_old_checkpoint_of_a_torch_scheduler_resumes_with_a_step_function(tmp_path, scheduler):
    """A checkpoint without the optimizer's record (a96b1fb) of a run with a torch scheduler that
    writes settings of its own into the param groups (OneCycleLR: max_lr, min_lr, max_momentum,
    base_momentum; SWALR: swa_lr) resumes with a step -> lr function, as the refusal of another
    scheduler kind advises: those keys are the schedule's, not another optimizer class's (before:
    refused as "saved with settings ..., which AdamW does not have")."""
    model = TinyLM()
    opt = adamw(model)
    made = {
        "OneCycleLR": lambda: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10),
        "SWALR": lambda: torch.optim.swa_utils.SWALR(opt, swa_lr=1e-3, anneal_epochs=2),
    }[scheduler]()
    Trainer(model, opt, loader(), config(max_steps=STEPS, checkpoint_dir=tmp_path), scheduler=made).fit()
    path = tmp_path / f"step-{STEPS:08d}.pt"
    as_written_by_a96b1fb(path)
    model = TinyLM(seed=1)
    cfg = config(max_steps=STEPS + 2, checkpoint_dir=tmp_path)
    resumed = Trainer(model, adamw(model), loader(), cfg, resume=path, scheduler=lambda step: 1e-3)
    assert resumed.step == STEPS and resumed.optimizer.param_groups[0]["lr"] == 1e-3
    saved = load_checkpoint(path)["model"]
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    resumed.close()
    # Another optimizer class still shows in the settings it carries.
    model = TinyLM(seed=1)
    refused(path, model, momentum_sgd(model), "saved with settings .*amsgrad.*which SGD does not have")


def test_a_step_function_that_fails_at_the_resumed_step_is_named_and_nothing_changes(tmp_path):
    """A step -> lr function that has no learning rate for the step a run resumes at (a table
    shorter than the run now, a NaN past its end) is refused before anything is loaded, naming
    the step (before: its error came from the schedule's load, after the model's weights and the
    optimizer's state had been overwritten from the checkpoint)."""
    path = saved_run(tmp_path, adamw)
    table = [1e-3] * STEPS  # steps 0 .. STEPS - 1: none for the resumed step
    cases = [
        (lambda step: table[step], rf"step -> lr function raised IndexError for step {STEPS}"),
        (lambda step: 1e-3 if step < STEPS else float("nan"), rf"returned nan for step {STEPS}"),
    ]
    for function, match in cases:
        model = TinyLM(seed=1)
        refused(path, model, adamw(model), match, scheduler=function)


def test_a_sharded_folder_is_checked_through_its_metadata(tmp_path):
    """A folder of torch.distributed.checkpoint (parallel="fsdp" in one process): checked
    against DCP's metadata before DCP loads anything into the model (a96b1fb: DCP's own error
    from inside the load, or none for another optimizer class)."""
    scenarios.fsdp_trainer(tmp_path, 0, 1, max_steps=2).fit()
    folder = tmp_path / "step-00000002"
    cfg = scenarios.fsdp_trainer(None, 0, 1, save_every=None).config  # the same settings, no checkpoint_dir
    no_bias = scenarios.block_model()
    no_bias[0] = torch.nn.Linear(6, 16, bias=False)
    cases = [
        (no_bias, torch.optim.AdamW, r"the checkpoint has 0.bias, which the model lacks"),
        (scenarios.block_model(), torch.optim.SGD, "the optimizer: saved with AdamW, this run uses SGD"),
    ]
    for model, optimizer_class, match in cases:
        optimizer = optimizer_class(model.parameters(), lr=1e-2)
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(CheckpointMismatch, match=match):
            Trainer(model, optimizer, scenarios.shuffled_data(0, 1), cfg, resume=folder)
        assert_same(before, model.state_dict())
        assert not optimizer.state
