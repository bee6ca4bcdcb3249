"""Batches for training: an endless stream over a re-iterable that knows where it is.

The stream walks ``train_data`` epoch after epoch. Its position is (epoch, batches taken in
that epoch, the torch RNG state when the epoch's iterator was made). A shuffled
``DataLoader`` draws its permutation (and its workers' seeds) from torch's global generator
when ``iter()`` is called, so making the iterator again from the same RNG state gives the same
order; skipping the batches already taken then puts a resumed run on the very next batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

_END = object()


class BatchStream:
    def __init__(self, data: Iterable):
        self.data = data
        self.epoch = 0
        self.position = 0  # batches taken from the current epoch
        self._epoch_rng_state: torch.Tensor | None = None
        self._iterator: Iterator | None = None

    def next(self):
        if self._iterator is None:
            self._start_epoch()
        try:
            batch = next(self._iterator)
        except StopIteration:
            if self.position == 0:
                raise ValueError("train_data yielded no batches") from None
            self.epoch += 1
            self._start_epoch()
            return self.next()
        self.position += 1
        return batch

    def _start_epoch(self) -> None:
        self.position = 0
        self._epoch_rng_state = torch.get_rng_state()
        sampler = getattr(self.data, "sampler", None)
        if hasattr(sampler, "set_epoch"):  # DistributedSampler reshuffles per epoch this way
            sampler.set_epoch(self.epoch)
        self._iterator = iter(self.data)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "epoch_rng_state": self._epoch_rng_state}

    def load_state_dict(self, state: dict) -> None:
        """Go back to a saved position: rebuild that epoch's iterator from its RNG state and
        skip the batches already taken. Changes torch's RNG state (restore it afterwards)."""
        self.epoch = state["epoch"]
        if state["epoch_rng_state"] is None:  # saved before the first batch
            self._iterator = None
            self.position = 0
            return
        torch.set_rng_state(state["epoch_rng_state"])
        self._start_epoch()
        for taken in range(state["position"]):
            if next(self._iterator, _END) is _END:  # the data is shorter than when the position was saved
                raise ValueError(
                    f"train_data has {taken} batches in epoch {self.epoch}, and the checkpoint's data position is "
                    f"batch {state['position']} of it: pass the train_data the run was saved with (after a change "
                    "of world size, each rank's share of it)"
                )
        self.position = state["position"]


def to_device(batch, device: torch.device):
    """``batch`` with every tensor in it (through dicts, lists and tuples) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_size(batch) -> int:
    """Samples in a batch: the first dimension of its ``input_ids``, or of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        values = [batch["input_ids"]] if "input_ids" in batch else list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return 1
    for value in values:
        if isinstance(value, (torch.Tensor, Mapping, list, tuple)):
            return batch_size(value)
    return 1


def token_count(batch) -> int | None:
    """Tokens in a batch with ``input_ids`` (None without)."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel()
    return None
