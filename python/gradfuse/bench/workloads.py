"""The benchmark workloads: which gradients, in which dtype, through which op family.

One list serves both devices. A workload names a shape set (a list of gradient shapes, as a
model's ``parameters()`` would give them), a dtype, an op family (``clip``, ``amp``,
``accumulate``) and, for the norm families, a mode: *active* (the norm exceeds ``max_norm``,
every gradient is rescaled) or *inactive* (the norm is below it, the clip coefficient is 1).
``--quick`` swaps each shape set for a smaller one of the same structure: the same number of
tensors with smaller dimensions, so per-tensor overheads stay visible while the run takes
seconds.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import math
from dataclasses import dataclass

import torch

from .models import make_model, model_config

Shape = tuple[int, ...]

FAMILIES = (
    "clip", "buckets", "amp", "accumulate", "ddp", "fsdp", "step", "trainer", "stats", "zclip", "agc", "health",
    "host",
)  # fmt: skip
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}

#: Tensor counts of the GPU sweep (the chart of speedup against tensor count); the total
#: element count is fixed, so only the split changes from point to point.
SWEEP_COUNTS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
SWEEP_TOTAL = 2**26  # 256 MiB of fp32 gradients: well past the 50 MB L2 of an H100
SWEEP_TOTAL_QUICK = 2**20
#: The host-time family (bench/host.py): tensor counts (1, GPT-2's 148, 2000, 10,000) of tiny
#: gradients, and the APIs timed.
HOST_COUNTS = (1, 148, 2000, 10_000)
HOST_ELEMENTS = 16
HOST_APIS = ("clip", "buckets", "scaler", "moved")


def gpt2_shapes(vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12) -> list[Shape]:
    """GPT-2 124M in ``model.parameters()`` order: 148 tensors, 124,439,808 elements (the LM
    head is tied to ``wte``). Conv1D weights are stored (in, out), as in Hugging Face's model."""
    layer = [
        (d,), (d,),  # ln_1 weight, bias
        (d, 3 * d), (3 * d,),  # attn.c_attn
        (d, d), (d,),  # attn.c_proj
        (d,), (d,),  # ln_2 weight, bias
        (d, 4 * d), (4 * d,),  # mlp.c_fc
        (4 * d, d), (d,),  # mlp.c_proj
    ]  # fmt: skip
    return [(vocab, d), (ctx, d), *layer * layers, (d,), (d,)]


def llama_shapes(
    vocab: int = 32000, hidden: int = 2048, layers: int = 22, inter: int = 5632, kv: int = 256
) -> list[Shape]:
    """A ~1.1B-parameter Llama (TinyLlama's dimensions: grouped-query attention with 4 KV heads
    of 64), untied embeddings, RMSNorm weights: 201 tensors, 1,100,048,384 elements."""
    layer = [
        (hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),  # q, k, v, o
        (inter, hidden), (inter, hidden), (hidden, inter),  # gate, up, down
        (hidden,), (hidden,),  # input_layernorm, post_attention_layernorm
    ]  # fmt: skip
    return [(vocab, hidden), *layer * layers, (hidden,), (vocab, hidden)]


def tiny_shapes(n: int = 10_000) -> list[Shape]:
    """``n`` small tensors of 64 to 256 elements (a fixed, irregular pattern): launch- and
    host-overhead bound, like the biases and norms of a model with many small layers."""
    return [(64 + (i * 37) % 193,) for i in range(n)]


def transformer_shapes(quick: bool) -> list[Shape]:
    """The parameters of the data-parallel benchmark's model (``models.make_model``)."""
    return [tuple(p.shape) for p in make_model(quick).parameters()]


def gpt2small_shapes(quick: bool) -> list[Shape]:
    """The parameters of the trainer benchmark's small GPT-2-shaped model."""
    from ..demo import GPT

    return [tuple(p.shape) for p in GPT(model_config(quick)[0]).parameters()]


def host_shapes(n: int):
    """``host<n>``: ``n`` gradients of HOST_ELEMENTS elements (the same with ``--quick``)."""
    shapes = lambda: [(HOST_ELEMENTS,)] * n  # noqa: E731
    return shapes, shapes


def uniform_shapes(n: int, numel: int) -> list[Shape]:
    return [(numel,)] * n


def _sweep(n: int):
    return (
        lambda: uniform_shapes(n, SWEEP_TOTAL // n),
        lambda: uniform_shapes(n, max(1, SWEEP_TOTAL_QUICK // n)),
    )


#: shape set name -> (full shapes, quick shapes), built on demand.
SHAPE_SETS = {
    "2000x4096": (lambda: uniform_shapes(2000, 4096), lambda: uniform_shapes(2000, 256)),
    "gpt2": (gpt2_shapes, lambda: gpt2_shapes(vocab=1024, ctx=128, d=64)),
    "llama1b": (llama_shapes, lambda: llama_shapes(vocab=1024, hidden=128, inter=352, kv=32)),
    "tiny10000": (tiny_shapes, tiny_shapes),
    "transformer": (lambda: transformer_shapes(False), lambda: transformer_shapes(True)),
    "gpt2small": (lambda: gpt2small_shapes(False), lambda: gpt2small_shapes(True)),
    **{f"sweep{n}": _sweep(n) for n in SWEEP_COUNTS},
    **{f"host{n}": host_shapes(n) for n in HOST_COUNTS},
}


@dataclass(frozen=True)
class Workload:
    family: str  # one of FAMILIES
    shape_set: str  # a key of SHAPE_SETS
    dtype: torch.dtype  # of the gradients (for accumulate: of the source, added into fp32)
    mode: str | None = None  # active | inactive (clip, buckets, amp, step), None (the others)
    cuda_only: bool = False

    @property
    def name(self) -> str:
        if self.family == "host":  # host_<api>_<tensors>
            return f"host_{self.mode}_{self.shape_set.removeprefix('host')}"
        parts = [self.family, self.shape_set, DTYPE_NAMES[self.dtype]]
        return "_".join([*parts, self.mode] if self.mode else parts)

    @property
    def dtype_label(self) -> str:
        if self.family == "accumulate":
            return f"fp32+={DTYPE_NAMES[self.dtype]}"
        return DTYPE_NAMES[self.dtype]

    def shapes(self, quick: bool) -> list[Shape]:
        full, small = SHAPE_SETS[self.shape_set]
        return small() if quick else full()


def _both(family: str, shape_set: str, dtype: torch.dtype, cuda_only: bool = False) -> list[Workload]:
    return [Workload(family, shape_set, dtype, mode, cuda_only) for mode in ("active", "inactive")]


F32, BF16 = torch.float32, torch.bfloat16

WORKLOADS: list[Workload] = [
    # The list, on both devices.
    *_both("clip", "2000x4096", F32),
    *_both("clip", "gpt2", F32),
    *_both("clip", "gpt2", BF16),
    *_both("amp", "gpt2", F32),
    Workload("accumulate", "gpt2", BF16),
    # Gradients in GradBuckets, and data-parallel backward on 2 ranks against DDP.
    *_both("buckets", "2000x4096", F32),
    Workload("ddp", "transformer", F32),
    Workload("fsdp", "transformer", F32),  # the same model sharded by FSDP2 on 2 ranks
    # Training steps: clip + fused AdamW under loss scaling, and a whole Trainer step.
    Workload("step", "gpt2", F32, "active"),
    Workload("trainer", "gpt2small", F32),
    # Gradient health: per-tensor statistics against the plain fused norm (and torch's passes).
    Workload("stats", "gpt2", F32),
    Workload("zclip", "gpt2", F32),  # listed only where the zclip package imports (see available)
    Workload("agc", "gpt2", F32),
    Workload("health", "gpt2small", F32),  # the Trainer with log_grad_norms + skip_spikes + zclip
    # GPU only: a 1B model, 10,000 tiny tensors, and the tensor-count sweep for the chart.
    *_both("clip", "llama1b", F32, cuda_only=True),
    *_both("clip", "llama1b", BF16, cuda_only=True),
    *_both("amp", "llama1b", F32, cuda_only=True),
    Workload("accumulate", "llama1b", BF16, cuda_only=True),
    *_both("clip", "tiny10000", F32, cuda_only=True),
    *(Workload("clip", f"sweep{n}", F32, "active", cuda_only=True) for n in SWEEP_COUNTS),
    # Host time of a call on the same list again, per API and tensor count (bench/host.py).
    *(Workload("host", f"host{n}", F32, api) for api in HOST_APIS for n in HOST_COUNTS),
]


def available(device_type: str) -> list[Workload]:
    """The workloads run on a device of this type (``cpu`` or ``cuda``), in order. The 2-rank
    data-parallel and FSDP2 workloads need two GPUs on CUDA (NCCL)."""
    two_ranks = device_type == "cpu" or torch.cuda.device_count() >= 2
    has_zclip = importlib.util.find_spec("zclip") is not None  # the reference ZClip is compared with
    return [
        w
        for w in WORKLOADS
        if (device_type == "cuda" or not w.cuda_only)
        and (w.family not in ("ddp", "fsdp") or two_ranks)
        and (w.family != "zclip" or has_zclip)
    ]


def select(device_type: str, patterns: list[str] | None) -> list[Workload]:
    """The workloads matching any pattern: a family name, a workload name, or a glob over
    workload names (``clip_gpt2_*``). No patterns: all of them but the ``host`` family (host time
    per call, run on request: ``--workloads host``). Raises ``ValueError`` naming a pattern that
    matches nothing on this device."""
    candidates = available(device_type)
    if not patterns:
        return [w for w in candidates if w.family != "host"]
    chosen: set[str] = set()
    for pattern in patterns:
        hits = [w.name for w in candidates if pattern in (w.family, "all") or fnmatch.fnmatchcase(w.name, pattern)]
        if not hits:
            names = ", ".join(w.name for w in candidates)
            raise ValueError(
                f"--workloads {pattern!r} matches no workload on {device_type}; "
                f"use a family ({', '.join(FAMILIES)}), a name or a glob. Available: {names}"
            )
        chosen.update(hits)
    return [w for w in candidates if w.name in chosen]


def numel(shapes: list[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)
