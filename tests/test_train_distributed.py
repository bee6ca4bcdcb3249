"""gradfuse.Trainer data-parallel on 2 real ranks (gloo, this machine only), against one
process on the combined batch. Scenarios in ``train_dist_scenarios.py``, all in one start
of two processes, each reported here as its own test."""

from __future__ import annotations

import multiprocess
import pytest
import torch.distributed as dist
import train_dist_scenarios

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

SCENARIOS = [
    "two_ranks_match_one_process_on_the_combined_batch",
    "communication_only_on_the_last_micro_step",
    "rank_0_writes_and_every_rank_resumes",
    "token_exact_accumulation_over_ranks_and_micro_batches",
    "a_signal_on_one_rank_stops_every_rank_after_the_same_step",
    "health_features_agree_across_ranks",
    "ranks_that_find_different_latest_checkpoints_all_raise",
    "rank_0_holds_the_folder_and_a_second_trainer_is_refused_on_every_rank",
    "unused_parameters_train_with_the_ddp_option_and_its_error_names_the_field",
    "a_parameter_used_on_one_rank_only_gives_one_process_result",
]


@pytest.fixture(scope="module")
def results():
    return multiprocess.run("train_dist_scenarios", SCENARIOS, world=2, deadline=240)


def test_every_scenario_is_listed():
    assert multiprocess.scenarios_in(train_dist_scenarios) == set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_ranks(results, name):
    multiprocess.assert_passed(results[name])
