"""Issue 21.1 on 2 real ranks (gloo, this machine only): the DDP hook's measurement is used
only where it is handed over (``measured=``) or inside the Trainer's step; everywhere else the
drop-ins and the scaler read the gradients, and give torch's answer after any edit made
between backward and the clip. Scenarios in ``ddp_handover_scenarios.py``, all in one start of
two processes, each reported here as its own test."""

from __future__ import annotations

import ddp_handover_scenarios
import multiprocess
import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

SCENARIOS = [
    "drop_ins_read_the_gradients_after_every_unseen_edit",
    "scaler_reads_the_gradients_after_every_unseen_edit",
    "randomized_edits_against_torch",
    "handover_is_right_when_fresh_and_raises_when_visibly_stale",
    "trainer_step_reads_no_gradient_after_backward",
    "an_empty_parameter_is_no_stale_handover",
    "a_parameter_ddp_ignores_is_outside_the_handover",
]


@pytest.fixture(scope="module")
def results():
    return multiprocess.run("ddp_handover_scenarios", SCENARIOS, world=2, deadline=300)


def test_every_scenario_is_listed():
    assert multiprocess.scenarios_in(ddp_handover_scenarios) == set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_ranks(results, name):
    multiprocess.assert_passed(results[name])
