"""gradfuse.Trainer on FSDP2 (``TrainConfig(parallel="fsdp")``) on 2 real ranks (gloo, this
machine only), against DDP and one process on the combined batch. Scenarios in
``fsdp_scenarios.py``, all in one start of two processes, each reported here as its own test."""

from __future__ import annotations

import fsdp_scenarios
import multiprocess
import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

SCENARIOS = [
    "fsdp_matches_ddp_and_one_process_fp32",
    "fsdp_matches_ddp_and_one_process_bf16",
]


@pytest.fixture(scope="module")
def results():
    return multiprocess.run("fsdp_scenarios", SCENARIOS, world=2, deadline=180)


def test_every_scenario_is_listed():
    assert multiprocess.scenarios_in(fsdp_scenarios) == set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_ranks(results, name):
    multiprocess.assert_passed(results[name])
