"""Float64 references, input generators and tolerances shared by the tests.

Tolerances, and why:
- Norms of float64 inputs are accumulated in float64 in a different order than the
  reference: 1e-12 relative.
- Norms of float32/bfloat16/float16 inputs: each |x|^p term is formed in float32 and summed
  16 at a time in float32 before the float64 combine (Rust), or tree-summed in float32
  (Triton); the result is rounded to float32. 2e-6 relative covers both (≈16 ulp).
- Element-wise results (scale, clip, unscale, clamp, accumulate) are compared bit for bit
  with torch computing the same float32 (or float64) arithmetic and rounding once to the
  storage dtype, which is what both backends do.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
NORM_TYPES = (2.0, 1.0, 0.0, 3.5, 0.5, -1.0, -2.5, math.inf, -math.inf)
# (dst, src) dtype pairs of accumulate_: low precision into fp32, same-dtype, and fp64 either side.
ACCUMULATE_PAIRS = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float64, torch.float32),
    (torch.float32, torch.float64),
    (torch.float64, torch.float64),
]
# Sizes around the Rust core's boundaries: 16 lanes, 256-element blocks, 32768-element segments.
EDGE_SIZES = (1, 15, 16, 17, 255, 256, 257, 32767, 32768, 32769)


def rtol_for(dtypes) -> float:
    return 1e-12 if all(d == torch.float64 for d in dtypes) else 2e-6


def rtol(tensors) -> float:
    return rtol_for(t.dtype for t in tensors)


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype element-wise arithmetic happens in (torch's opmath type)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def scaled(t: torch.Tensor, factor) -> torch.Tensor:
    """``t * factor`` as gradfuse computes it: in the arithmetic type, rounded once to ``t``'s
    dtype (on the CPU). ``factor`` is a number or a one-element tensor."""
    t = t.detach().cpu()
    m = math_dtype(t.dtype)
    if isinstance(factor, torch.Tensor):
        f = factor.detach().cpu().to(m)
    else:
        f = torch.tensor(factor, dtype=torch.float64).to(m)
    return (t.to(m) * f).to(t.dtype)


def clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def params_of(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters whose ``.grad`` are the given tensors (the tensors themselves, not copies)."""
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty_like(g))
        p.grad = g
        out.append(p)
    return out


def ref_norms(tensors: list[torch.Tensor], p: float) -> tuple[float, list[float]]:
    """torch's get_total_norm semantics, computed in float64: per-tensor vector norms, then the
    norm of the stacked per-tensor norms (so p = 0 counts tensors with a non-zero element)."""
    per = [torch.linalg.vector_norm(t.detach().double().reshape(-1), p).item() for t in tensors]
    total = torch.linalg.vector_norm(torch.tensor(per, dtype=torch.float64), p).item()
    return total, per


def close(got: float, want: float, rtol: float) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    if math.isinf(want):
        return got == want
    return abs(got - want) <= rtol * abs(want) + 1e-300


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including NaN positions and signed zeros (NaN payloads may differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a[~nan_a].view(width), b[~nan_b].view(width))


def randn(shape, dtype: torch.dtype, scale: float = 1.0, generator=None) -> torch.Tensor:
    return (torch.randn(shape, dtype=torch.float64, generator=generator) * scale).to(dtype)


def poison(t: torch.Tensor, positions: list[int], values: list[float]) -> None:
    flat = t.view(-1)
    for i, v in zip(positions, values, strict=True):
        flat[i] = v
