"""Non-finite attribution (``gradfuse.train.attribution``): which parameters, and on which ranks,
held inf/NaN on a flagged step. Single-process cases here; 2-rank gloo cases (DDP through the
Trainer, FSDP2 shards) in ``attribution_scenarios.py``, all in one start of two processes."""

from __future__ import annotations

import math

import attribution_scenarios
import multiprocess
import pytest
import torch
import torch.distributed as dist

from gradfuse.train import TrainConfig, Trainer
from gradfuse.train.attribution import nonfinite_counts, nonfinite_report

SCENARIOS = [
    "ddp_inf_on_rank_1_names_the_parameter_and_rank_1",
    "ddp_inf_on_both_ranks_names_both_and_leaves_no_trace",
    "ddp_overflow_in_the_reduction_is_said_so",
    "ddp_recompute_that_does_not_reproduce_names_no_rank",
    "ddp_recompute_starts_each_forward_from_its_own_random_state",
    "fsdp2_shards_report_the_ranks_that_hold_them",
    "ddp_recompute_puts_back_a_buffer_forward_replaces",
    "ddp_recompute_puts_back_python_and_numpy_random",
    "nonfinite_rerun_off_runs_nothing_again",
]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_counts_are_torch_counts_of_inf_and_nan(backend, dtype):
    """Fresh random gradients with inf, -inf and NaN at random places (across chunk edges),
    None and empty ones: each count is torch's count of non-finite elements."""
    gen = torch.Generator().manual_seed(int(dtype.itemsize))
    sizes = [1, 7, 64, 65, 300, 0, 33]  # the Triton fixture shrinks chunks to 64 elements
    grads = []
    for n in sizes:
        g = torch.randn(n, generator=gen).to(dtype)
        if n:
            hits = torch.randint(0, n, (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen)
            values = torch.tensor([math.inf, -math.inf, math.nan])[torch.arange(len(hits)) % 3]
            g[hits] = values.to(dtype)
        grads.append(g)
    grads.insert(2, None)
    want = [0 if g is None else int((~torch.isfinite(g)).sum()) for g in grads]
    assert nonfinite_counts(grads).tolist() == want
    assert any(want)


def test_a_large_finite_gradient_is_not_named():
    """Elements of 1e20 are finite; their squares overflow float32, so the norm is inf. The
    counts are of elements: the old rule (a non-finite per-tensor norm) named this gradient."""
    big = torch.full((8,), 1e20)
    assert nonfinite_counts([big]).tolist() == [0]
    assert nonfinite_report([("w", big), ("b", torch.tensor([math.nan]))]) == {"b": [0]}


def test_report_refuses_what_is_not_named_gradients():
    with pytest.raises(TypeError, match="named_grads must be"):
        nonfinite_report([torch.zeros(2)])
    with pytest.raises(TypeError, match="the gradient of 'w' is a list"):
        nonfinite_report([("w", [1.0])])


def test_one_process_names_the_parameter_and_rank_0_without_a_recompute():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        x, poison = batch
        loss = model(x).square().mean()
        if poison:
            w = model[2].weight
            loss = loss + (w - w.detach()).sqrt().sum()  # value 0, gradient inf
        return loss

    data = [
        (torch.randn(3, 4), False),
        (torch.randn(3, 4), True),
        (torch.randn(3, 4), False),
        (torch.randn(3, 4), False),
    ]
    cfg = TrainConfig(max_steps=2, grad_accum_steps=2, lr=1e-2, log_every=1, progress=False)
    rows = Trainer(net, torch.optim.AdamW(net.parameters()), data, cfg, loss_fn=loss_fn).fit()
    assert rows[0]["nonfinite_grads"] == ["2.weight"] and rows[0]["nonfinite_ranks"] == {"2.weight": [0]}
    assert "nonfinite_note" not in rows[0] and rows[0]["skipped"] == 1
    assert "nonfinite_grads" not in rows[1]
    assert len(calls) == 4  # the gradients at hand tell: nothing is run again


@pytest.fixture(scope="module")
def results():
    return multiprocess.run("attribution_scenarios", SCENARIOS, world=2, deadline=240)


def test_every_scenario_is_listed():
    assert multiprocess.scenarios_in(attribution_scenarios) == set(SCENARIOS)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("name", SCENARIOS)
def test_two_ranks(results, name):
    multiprocess.assert_passed(results[name])
