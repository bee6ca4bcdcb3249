"""``GradScaler.unscale_and_clip_`` over DTensor gradients on 2 real ranks (gloo, this machine
only). The scenarios are in ``scaler_dtensor_scenarios.py``; one start of two processes runs
them all."""

from __future__ import annotations

import multiprocess
import pytest
import scaler_dtensor_scenarios
import torch.distributed as dist

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

SCENARIOS = [
    "scaler_clip_of_dtensor_grads_matches_torch",
    "an_inf_in_one_ranks_shard_skips_the_step_on_every_rank",
    "fp64_gradients_give_an_fp64_norm_on_every_rank",
    "fp64_clip_grad_norm_gives_an_fp64_norm_on_every_rank",
]


@pytest.fixture(scope="module")
def results():
    return multiprocess.run("scaler_dtensor_scenarios", SCENARIOS, world=2, deadline=300)


def test_every_scenario_is_listed():
    assert multiprocess.scenarios_in(scaler_dtensor_scenarios) == set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_ranks(results, name):
    multiprocess.assert_passed(results[name])
