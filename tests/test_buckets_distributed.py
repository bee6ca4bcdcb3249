"""GradBuckets' sharded norm on 2 real ranks (gloo, this machine only), where a rank holds no
gradients: the scenarios are in ``bucket_dist_scenarios.py``, run in one start of two
processes; a hang is a failure (``multiprocess.run``'s deadline), never a wait."""

from __future__ import annotations

import bucket_dist_scenarios
import multiprocess
import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

SCENARIOS = ["norm_when_one_rank_has_no_gradients"]


@pytest.fixture(scope="module")
def results():
    return multiprocess.run("bucket_dist_scenarios", SCENARIOS, world=2, deadline=120)


def test_every_scenario_is_listed():
    assert multiprocess.scenarios_in(bucket_dist_scenarios) == set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_ranks(results, name):
    multiprocess.assert_passed(results[name])
