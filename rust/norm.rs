//! Multi-tensor norms (and the read-only fused unscale + inf/NaN check + norm).
//!
//! Each segment of [`SEGMENT`] elements is reduced to one `f64` partial; partials are combined
//! per tensor and then over tensors, always in index order, so the result is bitwise the same
//! for any thread count. Squares and powers are accumulated in `f64` (a square of an `f32` is
//! exact in `f64`), so fp32/bf16/fp16 norms come out correctly rounded in practice; the caller
//! rounds the result to the output dtype.

use crate::dtype::{Real, Storage};
use crate::elementwise::scale_typed;
use crate::error::{Error, Result};
use crate::multiversion;
use crate::parallel;
use crate::simd;
use crate::tensor::{Slice, SliceMut};
use crate::with_slice;

/// How a norm order reduces elements. Built from torch's `norm_type` by [`NormKind::from_order`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormKind {
    /// Number of non-zero elements (NaN counts as non-zero, as in torch).
    Zero,
    /// Sum of |x|.
    One,
    /// sqrt of the sum of x^2.
    Two,
    /// max |x|.
    Inf,
    /// min |x|.
    NegInf,
    /// (sum |x|^p)^(1/p) for any other real p, negative included.
    P(f64),
}

impl NormKind {
    pub fn from_order(p: f64) -> Result<NormKind> {
        Ok(match p {
            _ if p.is_nan() => return Err(Error::BadNormType { p }),
            0.0 => NormKind::Zero,
            1.0 => NormKind::One,
            2.0 => NormKind::Two,
            f64::INFINITY => NormKind::Inf,
            f64::NEG_INFINITY => NormKind::NegInf,
            _ => NormKind::P(p),
        })
    }

    pub fn order(self) -> f64 {
        match self {
            NormKind::Zero => 0.0,
            NormKind::One => 1.0,
            NormKind::Two => 2.0,
            NormKind::Inf => f64::INFINITY,
            NormKind::NegInf => f64::NEG_INFINITY,
            NormKind::P(p) => p,
        }
    }

    /// Orders whose reduction has no identity: torch refuses them on empty tensors.
    pub fn needs_elements(self) -> bool {
        match self {
            NormKind::Inf | NormKind::NegInf => true,
            NormKind::P(p) => p < 0.0,
            _ => false,
        }
    }

    /// The value of a reduction over nothing.
    pub(crate) fn identity(self) -> f64 {
        match self {
            NormKind::NegInf => f64::INFINITY,
            _ => 0.0,
        }
    }

    /// Combines two partial reductions (NaN-propagating for max/min).
    #[inline]
    pub fn combine(self, a: f64, b: f64) -> f64 {
        match self {
            NormKind::Inf => {
                if a.is_nan() || b.is_nan() {
                    f64::NAN
                } else {
                    a.max(b)
                }
            }
            NormKind::NegInf => {
                if a.is_nan() || b.is_nan() {
                    f64::NAN
                } else {
                    a.min(b)
                }
            }
            _ => a + b,
        }
    }

    /// Turns a tensor's raw reduction into its norm.
    #[inline]
    pub fn finish(self, raw: f64) -> f64 {
        match self {
            NormKind::Two => raw.sqrt(),
            NormKind::P(p) => raw.powf(1.0 / p),
            _ => raw,
        }
    }

    /// The total norm from the tensors' raw reductions, in index order. Equal to torch's
    /// `vector_norm(stack(per_tensor_norms), p)`: for p = 0 that counts the tensors with a
    /// non-zero element; for every other order it is the norm of all elements together.
    pub fn total(self, raws: &[f64]) -> f64 {
        if self == NormKind::Zero {
            return raws.iter().filter(|&&r| r != 0.0).count() as f64;
        }
        let raw = raws.iter().fold(self.identity(), |acc, &r| self.combine(acc, r));
        self.finish(raw)
    }
}

/// Lanes of independent accumulators in the element's arithmetic type (`f32`, or 16 `f64` for
/// f64 tensors). Four AVX2 registers of `f32`, as the hand-written loop in `simd.rs` uses (this
/// portable loop must compute exactly what that one does).
const LANES: usize = 32;

/// `f64` lanes the partial sums are folded into, in a fixed order (lane `i` into `i % ACC`).
/// 8 gave bf16 ~55% of the read ceiling, 16 ~68% (before `simd.rs`).
const ACC: usize = 16;

/// Sums the lanes as a balanced tree, in a fixed order.
#[inline(always)]
fn pairwise(acc: &mut [f64; ACC]) -> f64 {
    let mut n = ACC;
    while n > 1 {
        n /= 2;
        for i in 0..n {
            acc[i] += acc[i + n];
        }
    }
    acc[0]
}

/// Rows of `LANES` elements summed in the element's arithmetic type before the partial sums
/// are added into the `f64` lanes: each `f32` partial holds at most 4 terms (error at most a
/// few ulp of itself), while the bulk of the arithmetic runs in `f32`, twice as wide as `f64`.
const ROWS: usize = 4;

/// The `f64` lanes and inf/NaN flag after the whole blocks of `N * ROWS` elements of `xs`
/// (its length must be a multiple of that): `sum g(u)` with `u = x` or (when `UNSCALE`)
/// `u = x * inv`, both formed and passed through `g` in the element's arithmetic type.
#[inline(always)]
fn lane_blocks<T: Storage, const UNSCALE: bool, const N: usize>(
    xs: &[T],
    inv: T::Math,
    g: impl Fn(T::Math) -> T::Math,
) -> ([f64; ACC], bool) {
    let zero = <T::Math as Real>::ZERO;
    let mut acc = [0f64; ACC];
    let mut bad = [false; N];
    for block in xs.chunks_exact(N * ROWS) {
        let mut part = [zero; N];
        for row in block.chunks_exact(N) {
            for i in 0..N {
                let x = <T::Math as Real>::get(row[i]);
                if UNSCALE {
                    bad[i] |= !x.is_finite();
                    part[i] = part[i] + g(x * inv);
                } else {
                    part[i] = part[i] + g(x);
                }
            }
        }
        for row in part.chunks_exact(ACC) {
            for (a, &p) in acc.iter_mut().zip(row) {
                *a += p.to_f64();
            }
        }
    }
    (acc, UNSCALE && bad.iter().any(|&b| b))
}

/// A segment's sum from the lanes of its whole blocks and its last `tail` elements.
#[inline(always)]
fn finish_sum<T: Storage, const UNSCALE: bool>(
    (mut acc, bad): ([f64; ACC], bool),
    tail: &[T],
    inv: T::Math,
    g: impl Fn(T::Math) -> T::Math,
) -> (f64, bool) {
    let mut sum = 0f64;
    let mut tail_bad = false;
    for &x in tail {
        let x = <T::Math as Real>::get(x);
        tail_bad |= !x.is_finite();
        sum += g(if UNSCALE { x * inv } else { x }).to_f64();
    }
    (pairwise(&mut acc) + sum, bad || (UNSCALE && tail_bad))
}

/// `sum g(u)` over the elements, as described at [`lane_blocks`], with `UNSCALE` also whether
/// any `x` was inf/NaN. `N` is the lane count (see [`LANES`]).
#[inline(always)]
fn lane_sum<T: Storage, const UNSCALE: bool, const N: usize>(
    xs: &[T],
    inv: T::Math,
    g: impl Fn(T::Math) -> T::Math + Copy,
) -> (f64, bool) {
    let (blocks, tail) = xs.split_at(xs.len() - xs.len() % (N * ROWS));
    finish_sum::<T, UNSCALE>(lane_blocks::<T, UNSCALE, N>(blocks, inv, g), tail, inv, g)
}

/// `max |u|` (or `min |u|` when `MIN`) with `u` as in [`lane_sum`]; NaN if any `u` is NaN.
#[inline(always)]
fn lane_extreme<T: Storage, const UNSCALE: bool, const MIN: bool, const N: usize>(
    xs: &[T],
    inv: T::Math,
) -> (f64, bool) {
    let start = if MIN { f64::INFINITY } else { 0.0 };
    let mut m = [<T::Math as Real>::from_f64(start); N];
    let mut nan = [false; N];
    let mut bad = [false; N];
    let mut chunks = xs.chunks_exact(N);
    for c in &mut chunks {
        for i in 0..N {
            let x = <T::Math as Real>::get(c[i]);
            bad[i] |= !x.is_finite();
            let a = (if UNSCALE { x * inv } else { x }).abs();
            let better = if MIN { a < m[i] } else { a > m[i] };
            m[i] = if better { a } else { m[i] };
            nan[i] |= a.is_nan();
        }
    }
    let mut r = start;
    let mut any_nan = nan.iter().any(|&n| n);
    let mut any_bad = bad.iter().any(|&b| b);
    for &x in chunks.remainder() {
        let x = <T::Math as Real>::get(x);
        any_bad |= !x.is_finite();
        let a = (if UNSCALE { x * inv } else { x }).abs();
        any_nan |= a.is_nan();
        r = if MIN { r.min(a.to_f64()) } else { r.max(a.to_f64()) };
    }
    let value = if any_nan {
        f64::NAN
    } else {
        m.iter().fold(r, |acc, &v| if MIN { acc.min(v.to_f64()) } else { acc.max(v.to_f64()) })
    };
    (value, UNSCALE && any_bad)
}

/// What a sum-type norm adds up per element (`|u|^p` for its order).
trait Term: Copy + Send + Sync {
    /// The same term in `simd.rs`, if it has one there (used on x86-64 only).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const SIMD: Option<u8>;
    fn term<R: Real>(self, v: R) -> R;
}

#[derive(Clone, Copy)]
struct Square;
#[derive(Clone, Copy)]
struct Abs;
#[derive(Clone, Copy)]
struct NonZero;
/// General orders: the power in f64 (exact enough for any p), each term then rounded once.
#[derive(Clone, Copy)]
struct Pow(f64);

impl Term for Square {
    const SIMD: Option<u8> = Some(simd::SQUARE);
    #[inline(always)]
    fn term<R: Real>(self, v: R) -> R {
        v * v
    }
}
impl Term for Abs {
    const SIMD: Option<u8> = Some(simd::ABS);
    #[inline(always)]
    fn term<R: Real>(self, v: R) -> R {
        v.abs()
    }
}
impl Term for NonZero {
    const SIMD: Option<u8> = Some(simd::NON_ZERO);
    #[inline(always)]
    fn term<R: Real>(self, v: R) -> R {
        if v != R::ZERO {
            R::ONE
        } else {
            R::ZERO
        }
    }
}
impl Term for Pow {
    const SIMD: Option<u8> = None;
    #[inline(always)]
    fn term<R: Real>(self, v: R) -> R {
        R::from_f64(v.to_f64().abs().powf(self.0))
    }
}

/// The lane count for `T`'s arithmetic type (see [`LANES`]).
#[inline(always)]
fn is_f64<T: Storage>() -> bool {
    std::mem::size_of::<T::Math>() == 8
}

// One compiled function per (dtype, order kind): small enough that the hot loop keeps its lanes
// in registers (one function for every kind spilled to the stack, measured in the disassembly).
multiversion! {
    fn portable_sum_segment<T: Storage, G: Term>(xs: &[T], g: G, unscale: Option<f64>) -> (f64, bool) {
        let f = move |v| g.term(v);
        match (unscale, is_f64::<T>()) {
            (None, false) => lane_sum::<T, false, LANES>(xs, <T::Math as Real>::ONE, f),
            (None, true) => lane_sum::<T, false, { LANES / 2 }>(xs, <T::Math as Real>::ONE, f),
            (Some(inv), false) => lane_sum::<T, true, LANES>(xs, <T::Math as Real>::from_f64(inv), f),
            (Some(inv), true) => lane_sum::<T, true, { LANES / 2 }>(xs, <T::Math as Real>::from_f64(inv), f),
        }
    }
}

/// `simd::sum_blocks` for the whole blocks, the portable tail for the rest.
///
/// # Safety
/// As `simd::sum_blocks`: AVX2/FMA/F16C present, `T` not f64.
#[cfg(target_arch = "x86_64")]
unsafe fn simd_sum_segment<T: Storage, G: Term, const OP: u8>(xs: &[T], g: G, unscale: Option<f64>) -> (f64, bool) {
    let (blocks, tail) = xs.split_at(xs.len() - xs.len() % simd::BLOCK);
    let f = move |v| g.term(v);
    match unscale {
        None => finish_sum::<T, false>(simd::sum_blocks::<T, OP, false>(blocks, 1.0), tail, <T::Math as Real>::ONE, f),
        Some(inv) => {
            let inv32 = inv as f32;
            let lanes = simd::sum_blocks::<T, OP, true>(blocks, inv32);
            finish_sum::<T, true>(lanes, tail, <T::Math as Real>::from_f64(inv), f)
        }
    }
}

/// The fused in-place unscale of an f32 segment: `simd::unscale_blocks` for the whole blocks,
/// the portable tail for the rest. Same bits, in the reduction and in memory, as
/// [`reduce_segment`] followed by `scale_typed`.
///
/// # Safety
/// As `simd::sum_blocks`: AVX2/FMA/F16C present.
#[cfg(target_arch = "x86_64")]
unsafe fn simd_unscale_segment<G: Term, const OP: u8>(xs: &mut [f32], g: G, inv: f64) -> (f64, bool) {
    let whole = xs.len() - xs.len() % simd::BLOCK;
    let (blocks, tail) = xs.split_at_mut(whole);
    let lanes = simd::unscale_blocks::<OP>(blocks, inv as f32);
    let r = finish_sum::<f32, true>(lanes, tail, inv as f32, move |v| g.term(v));
    scale_typed(tail, inv);
    r
}

/// A segment's raw reduction (no unscaling) of order 2, 1 or 0 from the `f64` lanes that an
/// AVX2 loop built over its whole `simd::BLOCK`s exactly as `simd::sum_blocks` does, and its
/// `tail` elements: the same bits as [`reduce_segment`] gives. Used by `stats`.
#[cfg(target_arch = "x86_64")]
pub(crate) fn finish_simd_lanes<T: Storage>(kind: NormKind, lanes: [f64; ACC], tail: &[T]) -> f64 {
    let one = <T::Math as Real>::ONE;
    let lanes = (lanes, false);
    match kind {
        NormKind::Two => finish_sum::<T, false>(lanes, tail, one, |v| Square.term(v)).0,
        NormKind::One => finish_sum::<T, false>(lanes, tail, one, |v| Abs.term(v)).0,
        NormKind::Zero => finish_sum::<T, false>(lanes, tail, one, |v| NonZero.term(v)).0,
        _ => unreachable!("only orders 2, 1 and 0 have an AVX2 loop"),
    }
}

/// A segment's raw reduction of `x * inv` (and whether any `x` is inf/NaN), leaving `x * inv`
/// in place (rounded to the storage type; untouched when `inv` is 1).
fn unscale_reduce_segment<T: Storage>(kind: NormKind, xs: &mut [T], inv: f64) -> (f64, bool) {
    #[cfg(target_arch = "x86_64")]
    if T::DTYPE == crate::dtype::DType::F32 && inv != 1.0 && crate::dtype::has_avx2() {
        // SAFETY: T is f32 (its DTYPE says so), so this is the same slice with its own type.
        let xs32 = unsafe { std::slice::from_raw_parts_mut(xs.as_mut_ptr().cast::<f32>(), xs.len()) };
        // SAFETY: the CPU has AVX2/FMA/F16C (checked).
        unsafe {
            match kind {
                NormKind::Two => return simd_unscale_segment::<_, { simd::SQUARE }>(xs32, Square, inv),
                NormKind::One => return simd_unscale_segment::<_, { simd::ABS }>(xs32, Abs, inv),
                NormKind::Zero => return simd_unscale_segment::<_, { simd::NON_ZERO }>(xs32, NonZero, inv),
                _ => {}
            }
        }
    }
    let r = reduce_segment(kind, &*xs, Some(inv));
    if inv != 1.0 {
        scale_typed(xs, inv);
    }
    r
}

/// A segment's `sum g(u)` (and inf/NaN flag): the AVX2 loop where there is one, else the
/// portable loop; both give the same bits.
#[inline(always)]
fn sum_segment<T: Storage, G: Term>(xs: &[T], g: G, unscale: Option<f64>) -> (f64, bool) {
    #[cfg(target_arch = "x86_64")]
    if !is_f64::<T>() && G::SIMD.is_some() && crate::dtype::has_avx2() {
        // SAFETY: the CPU has AVX2/FMA/F16C (checked) and T's arithmetic type is f32, so T is
        // f32, f16 or bf16.
        unsafe {
            return match G::SIMD {
                Some(simd::SQUARE) => simd_sum_segment::<T, G, { simd::SQUARE }>(xs, g, unscale),
                Some(simd::ABS) => simd_sum_segment::<T, G, { simd::ABS }>(xs, g, unscale),
                _ => simd_sum_segment::<T, G, { simd::NON_ZERO }>(xs, g, unscale),
            };
        }
    }
    portable_sum_segment(xs, g, unscale)
}

multiversion! {
    fn extreme_segment<T: Storage>(xs: &[T], min: bool, unscale: Option<f64>) -> (f64, bool) {
        let inv = <T::Math as Real>::from_f64(unscale.unwrap_or(1.0));
        match (unscale.is_some(), min) {
            (false, false) => lane_extreme::<T, false, false, LANES>(xs, inv),
            (false, true) => lane_extreme::<T, false, true, LANES>(xs, inv),
            (true, false) => lane_extreme::<T, true, false, LANES>(xs, inv),
            (true, true) => lane_extreme::<T, true, true, LANES>(xs, inv),
        }
    }
}

/// Raw reduction of one segment. With `unscale = Some(inv)`, reduces `x * inv` (formed in
/// `T::Math`, as unscaling in place would) and reports whether any `x` is inf/NaN.
pub(crate) fn reduce_segment<T: Storage>(kind: NormKind, xs: &[T], unscale: Option<f64>) -> (f64, bool) {
    match kind {
        NormKind::Two => sum_segment(xs, Square, unscale),
        NormKind::One => sum_segment(xs, Abs, unscale),
        NormKind::Zero => sum_segment(xs, NonZero, unscale),
        NormKind::P(p) => sum_segment(xs, Pow(p), unscale),
        NormKind::Inf => extreme_segment(xs, false, unscale),
        NormKind::NegInf => extreme_segment(xs, true, unscale),
    }
}

/// Norms of a list of tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct NormResult {
    /// The total norm (as `f64`; the caller rounds it to the output dtype).
    pub total: f64,
    /// One norm per tensor, in order.
    pub per_tensor: Vec<f64>,
    /// Whether any element was inf or NaN (only computed by [`unscale_check_norm`]).
    pub found_inf: bool,
}

pub(crate) fn check_nonempty(kind: NormKind, mut lens: impl Iterator<Item = usize>) -> Result<()> {
    if kind.needs_elements() {
        if let Some(index) = lens.position(|n| n == 0) {
            return Err(Error::EmptyNorm { index, p: kind.order() });
        }
    }
    Ok(())
}

/// Combines per-segment partials (`tags[k]` is the tensor of segment `k`) in index order.
fn combine(kind: NormKind, n_tensors: usize, tags: &[usize], partials: &[(f64, bool)]) -> NormResult {
    let mut raws = vec![kind.identity(); n_tensors];
    let mut found_inf = false;
    for (&t, &(raw, bad)) in tags.iter().zip(partials) {
        raws[t] = kind.combine(raws[t], raw);
        found_inf |= bad;
    }
    NormResult { total: kind.total(&raws), per_tensor: raws.iter().map(|&r| kind.finish(r)).collect(), found_inf }
}

fn run(kind: NormKind, tensors: &[Slice<'_>], unscale: Option<f64>) -> Result<NormResult> {
    check_nonempty(kind, tensors.iter().map(Slice::len))?;
    let mut segments = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        t.segments_into(i, &mut segments);
    }
    let tags: Vec<usize> = segments.iter().map(|&(t, _)| t).collect();
    let partials =
        parallel::map(segments, |(_, s)| s.len(), |(_, s)| with_slice!(Slice, s, |x| reduce_segment(kind, x, unscale)));
    Ok(combine(kind, tensors.len(), &tags, &partials))
}

/// The p-norm of every tensor and of all of them together (torch's `get_total_norm`).
pub fn norm(tensors: &[Slice<'_>], p: f64) -> Result<NormResult> {
    run(NormKind::from_order(p)?, tensors, None)
}

/// In one read-only pass: the p-norm of `x * inv_scale` over all tensors (each product
/// rounded to the tensor's arithmetic type, as unscaling in place would), and whether any
/// `x` is inf or NaN.
pub fn unscale_check_norm(tensors: &[Slice<'_>], inv_scale: f64, p: f64) -> Result<NormResult> {
    run(NormKind::from_order(p)?, tensors, Some(inv_scale))
}

/// In one read-write pass: `x *= inv_scale` in place (formed in the tensor's arithmetic type)
/// and, exactly as [`unscale_check_norm`] would report them, the norm of the unscaled values
/// and whether any input was inf/NaN. Each segment is reduced and scaled in one loop (f32 on
/// AVX2) or reduced, then scaled while it is still in cache: memory is read and written once.
pub fn unscale_norm_(tensors: Vec<SliceMut<'_>>, inv_scale: f64, p: f64) -> Result<NormResult> {
    let kind = NormKind::from_order(p)?;
    check_nonempty(kind, tensors.iter().map(SliceMut::len))?;
    let n_tensors = tensors.len();
    let mut segments = Vec::new();
    for (i, t) in tensors.into_iter().enumerate() {
        t.segments_into(i, &mut segments);
    }
    let tags: Vec<usize> = segments.iter().map(|(t, _)| *t).collect();
    let partials = parallel::map(
        segments,
        |(_, s)| s.len(),
        |(_, s)| with_slice!(SliceMut, s, |x| unscale_reduce_segment(kind, x, inv_scale)),
    );
    Ok(combine(kind, n_tensors, &tags, &partials))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::SEGMENT;
    use half::{bf16, f16};

    fn reference(xs: &[f64], p: f64) -> f64 {
        if p == f64::INFINITY {
            return xs.iter().fold(0.0, |m: f64, x| m.max(x.abs()));
        }
        if p == f64::NEG_INFINITY {
            return xs.iter().fold(f64::INFINITY, |m: f64, x| m.min(x.abs()));
        }
        if p == 0.0 {
            return xs.iter().filter(|x| **x != 0.0).count() as f64;
        }
        xs.iter().map(|x| x.abs().powf(p)).sum::<f64>().powf(1.0 / p)
    }

    fn data(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 11) as f64 / (1u64 << 53) as f64) * 4.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn every_order_matches_f64_reference_across_segments() {
        let n = SEGMENT * 2 + 17;
        let xs = data(n, 7);
        let x32: Vec<f32> = xs.iter().map(|&v| v as f32).collect();
        let x32d: Vec<f64> = x32.iter().map(|&v| v as f64).collect();
        for p in [2.0, 1.0, 0.0, 3.5, 0.5, -1.5, f64::INFINITY, f64::NEG_INFINITY] {
            let got = norm(&[Slice::F32(&x32)], p).unwrap();
            let want = reference(&x32d, p);
            let one = got.per_tensor[0];
            // Terms are formed in f32 and summed 16 at a time in f32 (see ROWS): each partial is
            // off by at most ~16 ulp of itself, so 2e-6 relative bounds the total. max/min/count
            // are exact.
            let tol = if p.is_infinite() || p == 0.0 { 0.0 } else { 2e-6 * want.abs() };
            assert!((one - want).abs() <= tol, "p={p}: {one} vs {want}");
            // With one tensor the total is its norm, except p = 0 (the count of non-zero tensors).
            assert_eq!(got.total, if p == 0.0 { 1.0 } else { one });
        }
    }

    #[test]
    fn total_combines_tensors_like_torch() {
        let a = [3.0f32, 4.0];
        let b = [0.0f32, 0.0];
        let c = [12.0f32];
        let ts = [Slice::F32(&a), Slice::F32(&b), Slice::F32(&c)];
        assert_eq!(norm(&ts, 2.0).unwrap().total, 13.0);
        assert_eq!(norm(&ts, 2.0).unwrap().per_tensor, vec![5.0, 0.0, 12.0]);
        // p = 0: torch counts the tensors whose own count is non-zero.
        assert_eq!(norm(&ts, 0.0).unwrap().total, 2.0);
        assert_eq!(norm(&ts, 0.0).unwrap().per_tensor, vec![2.0, 0.0, 1.0]);
        assert_eq!(norm(&ts, f64::INFINITY).unwrap().total, 12.0);
        assert_eq!(norm(&ts, f64::NEG_INFINITY).unwrap().total, 0.0);
        // A zero element makes a negative-order norm 0.
        assert_eq!(norm(&ts, -1.0).unwrap().total, 0.0);
    }

    #[test]
    fn nan_propagates_through_every_order_but_zero() {
        let a = [1.0f32, f32::NAN, 2.0];
        for p in [2.0, 1.0, 3.0, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(norm(&[Slice::F32(&a)], p).unwrap().total.is_nan(), "p={p}");
        }
        assert_eq!(norm(&[Slice::F32(&a)], 0.0).unwrap().per_tensor[0], 3.0);
    }

    #[test]
    fn empty_tensors() {
        let e: [f32; 0] = [];
        let a = [2.0f32];
        assert_eq!(norm(&[Slice::F32(&e), Slice::F32(&a)], 2.0).unwrap().total, 2.0);
        assert_eq!(norm(&[], 2.0).unwrap().total, 0.0);
        for p in [f64::INFINITY, f64::NEG_INFINITY, -2.0] {
            assert_eq!(norm(&[Slice::F32(&a), Slice::F32(&e)], p), Err(Error::EmptyNorm { index: 1, p }));
        }
        assert!(matches!(norm(&[Slice::F32(&a)], f64::NAN), Err(Error::BadNormType { .. })));
    }

    #[test]
    fn half_types_accumulate_in_f64() {
        // 10^5 copies of bf16(1.0): an f16/bf16 accumulator would stall at 256 / 2048.
        let ones_b = vec![bf16::ONE; 100_000];
        let ones_h = vec![f16::ONE; 100_000];
        assert_eq!(norm(&[Slice::BF16(&ones_b)], 1.0).unwrap().total, 100_000.0);
        assert_eq!(norm(&[Slice::F16(&ones_h)], 2.0).unwrap().total, 100_000f64.sqrt());
        // f16 squares above 65504 must not overflow.
        let big = vec![f16::from_f32(60000.0); 4];
        assert_eq!(norm(&[Slice::F16(&big)], 2.0).unwrap().total, 120000.0);
    }

    #[test]
    fn deterministic_regardless_of_threads() {
        let xs: Vec<f32> = data(SEGMENT * 5 + 3, 11).iter().map(|&v| v as f32).collect();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let four = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        let a = one.install(|| norm(&[Slice::F32(&xs)], 2.0).unwrap());
        let b = four.install(|| norm(&[Slice::F32(&xs)], 2.0).unwrap());
        assert_eq!(a.total.to_bits(), b.total.to_bits());
    }

    #[test]
    fn unscale_check_norm_reads_only() {
        let xs = [2.0f32, -4.0, 8.0];
        let r = unscale_check_norm(&[Slice::F32(&xs)], 0.5, 2.0).unwrap();
        assert_eq!(r.total, (1.0f64 + 4.0 + 16.0).sqrt());
        assert!(!r.found_inf);
        assert_eq!(xs, [2.0, -4.0, 8.0]);
        let bad = [1.0f32, f32::INFINITY];
        let r = unscale_check_norm(&[Slice::F32(&xs), Slice::F32(&bad)], 0.5, 2.0).unwrap();
        assert!(r.found_inf);
        // The in-place variant reports the same and leaves the unscaled values behind.
        let mut ys = [2.0f32, -4.0, 8.0, f32::NAN];
        let mut h2 = [f16::from_f32(3.0); SEGMENT + 1];
        let r2 = unscale_norm_(vec![SliceMut::F32(&mut ys[..3]), SliceMut::F16(&mut h2)], 0.5, 2.0).unwrap();
        let want = unscale_check_norm(
            &[Slice::F32(&[2.0, -4.0, 8.0]), Slice::F16(&[f16::from_f32(3.0); SEGMENT + 1])],
            0.5,
            2.0,
        );
        assert_eq!(r2, want.unwrap());
        assert_eq!(&ys[..3], &[1.0, -2.0, 4.0]);
        assert!(h2.iter().all(|v| v.to_f32() == 1.5));
        // fp16 values scaled by 2^-16 underflow in f16 storage, but not in the f32 math.
        let h = [f16::from_f32(1.0); 2];
        let r = unscale_check_norm(&[Slice::F16(&h)], 2f64.powi(-30), 1.0).unwrap();
        assert_eq!(r.total, 2.0 * 2f64.powi(-30));
    }

    /// Elements of every kind the loops must agree on: ordinary values of many magnitudes,
    /// signed zeros, and (when `specials`) inf and NaN at scattered positions.
    #[cfg(target_arch = "x86_64")]
    fn mixed<T: Storage>(n: usize, seed: u64, specials: bool) -> Vec<T> {
        data(n, seed)
            .iter()
            .enumerate()
            .map(|(i, &v)| match i % 97 {
                3 => T::put_f64(0.0),
                5 => T::put_f64(-0.0),
                11 if specials => T::put_f64(f64::INFINITY),
                13 if specials && seed % 2 == 0 => T::put_f64(f64::NAN),
                _ => T::put_f64(v * 2f64.powi((i % 23) as i32 - 11)),
            })
            .collect()
    }

    #[cfg(target_arch = "x86_64")]
    fn same_bits<T: Storage, G: Term, const OP: u8>(xs: &[T], g: G) {
        for unscale in [None, Some(0.37), Some(2f64.powi(-14)), Some(65536.0)] {
            let want = portable_sum_segment(xs, g, unscale);
            // SAFETY: the caller checked for AVX2; T is f32, f16 or bf16.
            let got = unsafe { simd_sum_segment::<T, G, OP>(xs, g, unscale) };
            let what = format!("{:?}, op {OP}, n {}, unscale {unscale:?}", T::DTYPE, xs.len());
            assert!(
                got.0.to_bits() == want.0.to_bits() || (got.0.is_nan() && want.0.is_nan()),
                "{what}: {got:?} vs {want:?}"
            );
            assert_eq!(got.1, want.1, "{what}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn simd_matches_portable_for<T: Storage>() {
        for (n, seed) in [(0, 1), (1, 2), (127, 3), (128, 4), (129, 5), (1000, 6), (SEGMENT, 7), (SEGMENT - 1, 8)] {
            for specials in [false, true] {
                let xs = mixed::<T>(n, seed, specials);
                same_bits::<T, Square, { simd::SQUARE }>(&xs, Square);
                same_bits::<T, Abs, { simd::ABS }>(&xs, Abs);
                same_bits::<T, NonZero, { simd::NON_ZERO }>(&xs, NonZero);
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn simd_loop_gives_the_portable_loops_bits() {
        if !crate::dtype::has_avx2() {
            eprintln!("no AVX2/FMA/F16C here: only the portable loop runs");
            return;
        }
        simd_matches_portable_for::<f32>();
        simd_matches_portable_for::<f16>();
        simd_matches_portable_for::<bf16>();
    }

    #[cfg(target_arch = "x86_64")]
    fn fused_unscale_same_bits<G: Term, const OP: u8>(xs: &[f32], g: G) {
        for inv in [0.37, 2f64.powi(-16), 65536.0] {
            let want = portable_sum_segment(xs, g, Some(inv));
            let want_x: Vec<f32> = xs.iter().map(|&x| x * inv as f32).collect();
            let mut got_x = xs.to_vec();
            // SAFETY: the caller checked for AVX2.
            let got = unsafe { simd_unscale_segment::<G, OP>(&mut got_x, g, inv) };
            let what = format!("op {OP}, n {}, inv {inv}", xs.len());
            assert!(
                got.0.to_bits() == want.0.to_bits() || (got.0.is_nan() && want.0.is_nan()),
                "{what}: {got:?} vs {want:?}"
            );
            assert_eq!(got.1, want.1, "{what}");
            let same = got_x.iter().zip(&want_x).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
            assert!(same, "{what}: unscaled values differ");
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn fused_unscale_loop_gives_the_two_loops_bits() {
        if !crate::dtype::has_avx2() {
            return;
        }
        for (n, seed) in [(0, 1), (5, 2), (128, 4), (1000, 6), (SEGMENT, 7)] {
            for specials in [false, true] {
                let xs = mixed::<f32>(n, seed, specials);
                fused_unscale_same_bits::<Square, { simd::SQUARE }>(&xs, Square);
                fused_unscale_same_bits::<Abs, { simd::ABS }>(&xs, Abs);
                fused_unscale_same_bits::<NonZero, { simd::NON_ZERO }>(&xs, NonZero);
            }
        }
    }
}
