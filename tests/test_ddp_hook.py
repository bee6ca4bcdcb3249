"""gradfuse's DDP communication hook on 2 real ranks (gloo, this machine only). The scenarios
are in ``ddp_hook_scenarios.py``; they all run in one start of two processes (a module
fixture), each reported here as its own test."""

from __future__ import annotations

import ddp_hook_scenarios
import multiprocess
import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

SCENARIOS = [
    "grads_and_norm_match_ddp",
    "every_norm_order",
    "no_sync_accumulates_then_measures",
    "unused_parameters",
    "stale_gradient_of_a_parameter_unused_everywhere",
    "static_graph",
    "join_uneven_inputs",
    "exception_in_backward",
    "reentrant_checkpoint_with_a_shared_weight",
    "cast_after_construction",
    "layouts_that_differ_across_ranks_raise",
    "buffers_are_broadcast",
    "low_precision_buckets",
    "sparse_gradients",
    "scaler_folds_the_clip_into_the_optimizer",
    "scaler_without_clipping_reads_the_flag",
    "randomized_against_ddp",
    "bad_registration_raises",
]


@pytest.fixture(scope="module")
def results():
    return multiprocess.run("ddp_hook_scenarios", SCENARIOS, world=2, deadline=240)


def test_every_scenario_is_listed():
    assert multiprocess.scenarios_in(ddp_hook_scenarios) == set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_ranks(results, name):
    multiprocess.assert_passed(results[name])
