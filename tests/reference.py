"""Float64 references, input generators and tolerances shared by the tests.

Tolerances, and why:
- Norms of float64 inputs are accumulated in float64 in a different order than the
  reference: 1e-12 relative.
- Norms of float32/bfloat16/float16 inputs: each |x|^p term is formed in float32 and summed
  16 at a time in float32 before the float64 combine (Rust), or tree-summed in float32
  (Triton); the result is rounded to float32. 2e-6 relative covers both (≈16 ulp).
- Element-wise results (scale, clip, unscale, clamp, accumulate) are compared bit for bit
  with torch computing the same float32 (or float64) arithmetic and rounding once to the
  storage dtype, which is what both backends do (a float64 result bound for float16/bfloat16
  through float32, as torch casts: see double_rounding_case).
"""

from __future__ import annotations

import math
import warnings

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
NORM_TYPES = (2.0, 1.0, 0.0, 3.5, 0.5, -1.0, -2.5, math.inf, -math.inf)
# (dst, src) dtype pairs of accumulate_: low precision into fp32, same-dtype, fp64 either side,
# and fp64 into 16 bits (rounded through fp32, as torch casts; see double_rounding_case).
ACCUMULATE_PAIRS = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float64, torch.float32),
    (torch.float32, torch.float64),
    (torch.float64, torch.float64),
    (torch.float16, torch.float64),
    (torch.bfloat16, torch.float64),
]
# Sizes around the Rust core's boundaries: 16 lanes, 256-element blocks, 32768-element segments.
EDGE_SIZES = (1, 15, 16, 17, 255, 256, 257, 32767, 32768, 32769)


def _torch_measures_sparse() -> bool:
    """Whether this torch's ``clip_grad_norm_`` measures sparse gradients: torch 2.11's
    ``linalg.vector_norm`` has no sparse kernel (NotImplementedError), later versions have one.
    gradfuse hands sparse gradients to torch, so its answer is torch's either way."""
    try:
        with warnings.catch_warnings():  # torch 2.11 warns here that invariant checks are off
            warnings.simplefilter("ignore")
            torch.nn.utils.get_total_norm([torch.sparse_coo_tensor([[0]], [1.0], (2,), check_invariants=True)])
    except NotImplementedError:
        return False
    return True


#: See _torch_measures_sparse; where False, torch's answer to a sparse gradient is its error.
TORCH_MEASURES_SPARSE = _torch_measures_sparse()
SPARSE_NORM_ERROR = "linalg_vector_norm"  # what torch 2.11's NotImplementedError names


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


def double_rounding_case(dtype: torch.dtype, n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, want)``: float64 values whose cast to ``dtype`` (float16 or bfloat16) differs
    between rounding once, directly, and rounding through float32 as torch does (``want``).

    Each value lies just above the midpoint of two neighbouring ``dtype`` numbers ``lo`` (even
    last bit) and ``hi``, by ``(hi - lo) * 2**-30``: too little for float32 to keep. Rounded
    directly it goes up to ``hi``; through float32 it becomes the midpoint exactly, which ties to
    even: ``lo``. Random signs and exponents (from ``seed``), the smallest subnormal's midpoint,
    and the issue's ``1 + 2**-11 + 2**-40`` (float16) / ``1 + 2**-8 + 2**-40`` (bfloat16), first.
    """
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int32, generator=gen).to(torch.int16)
    lo = (bits & ~1).view(dtype)  # even last bit
    lo[0], lo[1] = 1.0, 0.0  # 1.0, and zero, whose neighbour is the smallest subnormal
    finite = torch.isfinite(lo) & torch.isfinite((lo.view(torch.int16) + 1).view(dtype))
    lo = lo[finite]
    hi = (lo.view(torch.int16) + 1).view(dtype)  # the next value away from zero (sign-magnitude)
    lo64, hi64 = lo.double(), hi.double()
    values = (lo64 + hi64) / 2 + (hi64 - lo64) * 2.0**-30
    if dtype == torch.float16:
        assert values[0].item() == 1 + 2**-11 + 2**-40
    # The construction, checked: strictly between the midpoint and hi (a direct rounding gives hi),
    # and torch's cast (through float32) gives lo.
    assert bool(((values - (lo64 + hi64) / 2).abs() > 0).all() and ((hi64 - values).abs() < (hi64 - lo64).abs()).all())
    want = values.to(dtype)
    assert torch.equal(want.view(torch.int16), lo.view(torch.int16)), (
        "torch's float64 cast no longer rounds via float32"
    )
    return values, want
