"""Every registered ``gradfuse::`` op, and an opcheck case for each on a given device (shared by
test_ops.py on the CPU and test_cuda.py on a GPU, so that both check the same set)."""

from __future__ import annotations

import math

import torch

import gradfuse  # noqa: F401  (registers the ops)


def registered_ops() -> set[str]:
    """The names of every op defined in the ``gradfuse`` namespace, from the dispatcher's own
    registry. Not ``dir(torch.ops.gradfuse)``: that lists only the op packets already looked up
    in this process, so its answer depends on which tests ran before (under xdist, on which
    worker)."""
    prefix = "gradfuse::"
    names = torch._C._dispatch_get_all_op_names()
    return {name[len(prefix) :].split(".")[0] for name in names if name.startswith(prefix)}


def opcheck_cases(device: str = "cpu") -> list[tuple[str, tuple]]:
    """(op name, arguments) pairs covering every registered op: empty, 0-d and mixed-dtype
    lists, two norm orders."""
    d = device
    f = [
        torch.randn(3, 4, device=d),
        torch.randn(0, device=d),
        torch.randn((), device=d),
        torch.randn(5, device=d).bfloat16(),
    ]
    g = [torch.randn(3, 4, device=d), torch.randn(0, device=d), torch.randn((), device=d)]
    inv, found = torch.full((1,), 0.5, device=d), torch.zeros(1, device=d)
    return [
        ("multi_tensor_norm", (f, 2.0, True)),
        ("multi_tensor_norm", ([torch.randn(3, 4, device=d), torch.randn((), device=d)], math.inf, False)),
        ("multi_tensor_scale_", (f, torch.tensor(0.5, device=d))),
        ("clip_grads_with_norm_", (f, 1.0, torch.tensor(3.0, device=d))),
        ("clip_grad_norm_", (g, 0.5, 2.0, False)),
        ("unscale_and_check_", (f, inv, found)),
        ("unscale_check_norm", (g, inv, 2.0)),
        ("unscale_and_clip_", (g, inv, found, 0.5, 2.0)),
        ("unscale_norm_", (f, inv, found, 2.0)),
        (
            "accumulate_",
            (
                [torch.zeros(3, device=d), torch.zeros(0, device=d)],
                [torch.ones(3, device=d).bfloat16(), torch.ones(0, device=d)],
                0.5,
            ),
        ),
        ("clamp_", (f, -0.1, 0.1)),
        ("multi_tensor_stats", (f, 2.0)),
        ("unit_norms", (f, [3, 0, 1, 1], 2.0)),
        ("scale_units_", (f, [3, 0, 1, 1], torch.rand(5, device=d))),
    ]
