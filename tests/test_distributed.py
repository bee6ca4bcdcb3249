"""Norms across ranks (sharded gradients, DTensor, FSDP2), on 2 real ranks
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
