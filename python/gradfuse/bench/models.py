"""The models whose gradients some workloads time: the data-parallel benchmark's transformer
(``ddp``) and the trainer benchmark's small GPT (``trainer``).

Data, like the shape sets of ``workloads``, which read their parameters' shapes from here; the
code that runs them (``data_parallel``, ``training``) builds them from here too.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 512  # of the data-parallel transformer


def make_model(quick: bool) -> nn.Module:
    """A small pre-norm transformer language model (~3.4M parameters; ~0.2M with ``quick``),
    the same weights on every call."""
    d, layers = (32, 2) if quick else (256, 4)
    torch.manual_seed(0)
    blocks = [
        nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True) for _ in range(layers)
    ]
    return nn.Sequential(nn.Embedding(VOCAB, d), *blocks, nn.LayerNorm(d), nn.Linear(d, VOCAB))


def model_config(quick: bool):
    """The trainer workload's ``GPTConfig`` and its micro-batch size."""
    from ..demo import GPTConfig

    if quick:
        return GPTConfig(vocab=64, ctx=16, width=32, layers=2, heads=2), 2
    return GPTConfig(vocab=512, ctx=128, width=192, layers=4, heads=4), 4  # and the micro-batch size
