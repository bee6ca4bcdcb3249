"""GradBuckets with a process group, distributed norms and DTensor gradients, on 2 real ranks
(gloo, this machine only). The scenarios are in ``dist_scenarios.py``; they all run in one
start of two processes (a module fixture), each reported here as its own test."""

from __future__ import annotations

import dist_scenarios
import multiprocess
import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

SCENARIOS = [
    "grads_match_ddp",
    "no_sync_accumulates_then_reduces",
    "unused_parameters_like_find_unused",
    "main_grad_bf16_is_the_fp32_average",
    "parameters_broadcast_from_rank_0",
    "layout_mismatch_raises_on_every_rank",
    "sharded_norms_equal_the_full_norm",
    "bucket_norm_with_process_group",
    "dtensor_norms_match_torch",
    "fsdp2_clip_matches_torch",
]


@pytest.fixture(scope="module")
def results():
    return multiprocess.run("dist_scenarios", SCENARIOS, world=2, deadline=300)


def test_every_scenario_is_listed():
    assert multiprocess.scenarios_in(dist_scenarios) == set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_ranks(results, name):
    multiprocess.assert_passed(results[name])
