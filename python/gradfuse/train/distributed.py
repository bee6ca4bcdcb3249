"""Who holds the gradients, and how many processes share the work.

The trainer touches gradient management in two places besides clipping (which goes through
the scaler): it zeroes the gradients before a step, and it lets backward skip communication
on every micro-step but the last (``no_sync``). ``LocalGradients`` is that for one process.
``World`` says which process this is and averages a scalar over the processes (the loss,
for logging and for the non-finite check, which must agree on every rank).
"""

from __future__ import annotations

import contextlib

import torch


class World:
    """One process: rank 0 of 1."""

    rank = 0
    world_size = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def close(self) -> None:
        pass


class LocalGradients:
    """Gradients as autograd leaves them in ``param.grad``; nothing to communicate."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()
