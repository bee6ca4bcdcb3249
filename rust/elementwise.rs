//! In-place element-wise kernels over lists of tensors: scale (and clip), unscale with an
//! inf/NaN check, accumulate, clamp. Each runs over the fixed segments of every tensor in one
//! parallel loop, computing in the tensor's arithmetic type (`f64` for `f64`, else `f32`).

use crate::dtype::{DType, Real, Storage};
use crate::error::{Error, Result};
use crate::multiversion;
use crate::parallel;
use crate::tensor::{Slice, SliceMut};
use crate::with_slice;

fn segments_of(tensors: Vec<SliceMut<'_>>) -> Vec<SliceMut<'_>> {
    let mut tagged = Vec::new();
    for t in tensors {
        t.segments_into(0, &mut tagged);
    }
    tagged.into_iter().map(|(_, s)| s).collect()
}

/// Splits every tensor into segments and runs `f` on each, in parallel when the call is big.
fn for_each_segment<'a>(tensors: Vec<SliceMut<'a>>, f: impl Fn(SliceMut<'a>) + Sync + Send) {
    parallel::map(segments_of(tensors), SliceMut::len, f);
}

/// Like [`for_each_segment`], with `any` over a per-segment boolean (every segment runs).
fn any_segment<'a>(tensors: Vec<SliceMut<'a>>, f: impl Fn(SliceMut<'a>) -> bool + Sync + Send) -> bool {
    parallel::map(segments_of(tensors), SliceMut::len, f).into_iter().any(|b| b)
}

multiversion! {
    pub(crate) fn scale_typed<T: Storage>(xs: &mut [T], s: f64) {
        let s = <T::Math as Real>::from_f64(s);
        for x in xs.iter_mut() {
            *x = (<T::Math as Real>::get(*x) * s).put();
        }
    }
}

/// `x *= scale` for every element, computed in the tensor's arithmetic type with `scale`
/// rounded to it. A scale of exactly 1 returns at once without touching memory: `x * 1 == x`
/// bit for bit, so skipping is exact (this is clipping's common, inactive case).
pub fn scale(tensors: Vec<SliceMut<'_>>, scale: f64) {
    if scale == 1.0 {
        return;
    }
    for_each_segment(tensors, |seg| with_slice!(SliceMut, seg, |x| scale_typed(x, scale)));
}

/// Clip coefficient `min(max_norm / (total_norm + 1e-6), 1)` computed exactly as torch does
/// for a `total_norm` tensor of dtype `dtype`: torch evaluates `max_norm / (t + 1e-6)` as
/// `(t + 1e-6).reciprocal() * max_norm` then `clamp(max=1)`, each op in float (double for
/// float64) with the Python scalars kept in that precision, each result rounded to `dtype`.
/// NaN stays NaN.
pub fn clip_coef(total_norm: f64, max_norm: f64, dtype: DType) -> f64 {
    let coef = if dtype == DType::F64 {
        (1.0 / (total_norm + 1e-6)) * max_norm
    } else {
        let r = |v: f32| dtype.round(v as f64) as f32;
        let denom = r(total_norm as f32 + 1e-6f32);
        r(r(1.0 / denom) * max_norm as f32) as f64
    };
    if coef > 1.0 {
        1.0
    } else {
        coef
    }
}

multiversion! {
    fn has_non_finite<T: Storage>(xs: &[T]) -> bool {
        xs.iter().fold(false, |bad, &x| bad | !<T::Math as Real>::get(x).is_finite())
    }
}

multiversion! {
    fn unscale_typed<T: Storage>(xs: &mut [T], inv: f64) -> bool {
        let inv = <T::Math as Real>::from_f64(inv);
        let mut bad = false;
        for x in xs.iter_mut() {
            let v = <T::Math as Real>::get(*x);
            bad |= !v.is_finite();
            *x = (v * inv).put();
        }
        bad
    }
}

/// Applies `x *= inv_scale` and reports whether any `x` was inf or NaN before scaling,
/// as `torch._amp_foreach_non_finite_check_and_unscale_` does. With `inv_scale == 1` it only
/// reads (the values would not change).
pub fn unscale_and_check(tensors: Vec<SliceMut<'_>>, inv_scale: f64) -> bool {
    if inv_scale == 1.0 {
        return any_segment(tensors, |seg| with_slice!(SliceMut, seg, |x| has_non_finite(&*x)));
    }
    any_segment(tensors, |seg| with_slice!(SliceMut, seg, |x| unscale_typed(x, inv_scale)))
}

multiversion! {
    fn clamp_typed<T: Storage>(xs: &mut [T], lo: f64, hi: f64) {
        let (lo, hi) = (<T::Math as Real>::from_f64(lo), <T::Math as Real>::from_f64(hi));
        for x in xs.iter_mut() {
            let v = <T::Math as Real>::get(*x);
            let y = if v < lo { lo } else { v };
            *x = (if y > hi { hi } else { y }).put();
        }
    }
}

/// `lo <= x <= hi` by `x = min(max(x, lo), hi)` with NaN kept, as torch's
/// `clamp_min_` followed by `clamp_max_` (so `lo > hi` gives `hi` everywhere).
pub fn clamp(tensors: Vec<SliceMut<'_>>, lo: f64, hi: f64) {
    for_each_segment(tensors, |seg| with_slice!(SliceMut, seg, |x| clamp_typed(x, lo, hi)));
}

/// `dst[i] += alpha * src[i]` element-wise. The arithmetic is `f64` if either side is `f64`,
/// else `f32` (so bf16/fp16 gradients accumulate into fp32 main gradients without double
/// rounding).
pub fn accumulate(dst: Vec<SliceMut<'_>>, src: &[Slice<'_>], alpha: f64) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::LengthMismatch { what: "accumulate", left: dst.len(), right: src.len() });
    }
    for (index, (d, s)) in dst.iter().zip(src).enumerate() {
        if d.len() != s.len() {
            return Err(Error::NumelMismatch { index, dst: d.len(), src: s.len() });
        }
    }
    let mut pairs = Vec::new();
    for (d, s) in dst.into_iter().zip(src) {
        let mut ds = Vec::new();
        d.segments_into(0, &mut ds);
        let mut ss = Vec::new();
        s.segments_into(0, &mut ss);
        pairs.extend(ds.into_iter().zip(ss).map(|((_, d), (_, s))| (d, s)));
    }
    let work = |(d, s): (SliceMut<'_>, Slice<'_>)| {
        with_slice!(SliceMut, d, |d| with_slice!(Slice, s, |s| accumulate_typed(d, s, alpha)))
    };
    parallel::map(pairs, |(_, s)| s.len(), work);
    Ok(())
}

#[inline(always)]
fn add_scaled<D: Storage, S: Storage, R: Real>(dst: &mut [D], src: &[S], alpha: f64) {
    let a = R::from_f64(alpha);
    if alpha == 1.0 {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = (R::get(*d) + R::get(s)).put();
        }
    } else {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = (R::get(*d) + a * R::get(s)).put();
        }
    }
}

multiversion! {
    fn accumulate_typed<D: Storage, S: Storage>(dst: &mut [D], src: &[S], alpha: f64) {
        if D::DTYPE == DType::F64 || S::DTYPE == DType::F64 {
            add_scaled::<D, S, f64>(dst, src, alpha)
        } else {
            add_scaled::<D, S, f32>(dst, src, alpha)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::SEGMENT;
    use half::{bf16, f16};

    #[test]
    fn scale_by_one_is_a_no_op_and_others_scale() {
        let mut a = vec![1.5f32, f32::NAN, -0.0, f32::INFINITY];
        let before: Vec<u32> = a.iter().map(|v| v.to_bits()).collect();
        scale(vec![SliceMut::F32(&mut a)], 1.0);
        assert_eq!(a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), before);
        let mut b = vec![bf16::from_f32(3.0); SEGMENT + 5];
        let mut c = vec![2.0f64; 3];
        scale(vec![SliceMut::BF16(&mut b), SliceMut::F64(&mut c)], 0.5);
        assert!(b.iter().all(|v| v.to_f32() == 1.5));
        assert_eq!(c, vec![1.0; 3]);
    }

    #[test]
    fn clip_coef_matches_torch_arithmetic() {
        // total well above max_norm: 1 / (total + 1e-6) * max_norm, in f32.
        let total = 7.25f32;
        let want = (1.0f32 / (total + 1e-6f32)) * 0.75f32;
        assert_eq!(clip_coef(total as f64, 0.75, DType::F32), want as f64);
        assert_eq!(clip_coef(0.1, 1.0, DType::F32), 1.0);
        assert!(clip_coef(f64::NAN, 1.0, DType::F32).is_nan());
        assert_eq!(clip_coef(f64::INFINITY, 1.0, DType::F32), 0.0);
        // In f64 the 1e-6 is not rounded to f32.
        assert_eq!(clip_coef(3.0, 1.5, DType::F64), (1.0 / (3.0 + 1e-6)) * 1.5);
        // A bf16 total: every intermediate is rounded to bf16, but not the scalars.
        let r = |v: f32| bf16::from_f32(v).to_f32();
        let want = r(r(1.0 / r(2.5f32 + 1e-6)) * 0.3f32);
        assert_eq!(clip_coef(2.5, 0.3, DType::BF16), want as f64);
    }

    #[test]
    fn unscale_reports_non_finite_and_scales_everything() {
        let mut a = vec![4.0f32; SEGMENT * 3];
        let mut h = vec![f16::from_f32(2.0), f16::INFINITY];
        let found = unscale_and_check(vec![SliceMut::F32(&mut a), SliceMut::F16(&mut h)], 0.25);
        assert!(found);
        assert!(a.iter().all(|&v| v == 1.0));
        assert_eq!(h[0].to_f32(), 0.5);
        assert!(h[1].is_infinite());
        let mut ok = vec![1.0f32; 3];
        assert!(!unscale_and_check(vec![SliceMut::F32(&mut ok)], 1.0));
        let mut nan = vec![bf16::NAN];
        assert!(unscale_and_check(vec![SliceMut::BF16(&mut nan)], 1.0));
    }

    #[test]
    fn clamp_keeps_nan_and_orders_like_torch() {
        let mut a = vec![-3.0f32, 0.5, 3.0, f32::NAN];
        clamp(vec![SliceMut::F32(&mut a)], -1.0, 1.0);
        assert_eq!(&a[..3], &[-1.0, 0.5, 1.0]);
        assert!(a[3].is_nan());
        let mut b = vec![-3.0f32, 3.0];
        clamp(vec![SliceMut::F32(&mut b)], 1.0, -1.0);
        assert_eq!(b, vec![-1.0, -1.0]);
    }

    #[test]
    fn accumulate_mixed_dtypes() {
        let mut main = vec![1.0f32; SEGMENT + 9];
        let g: Vec<bf16> = (0..SEGMENT + 9).map(|i| bf16::from_f32((i % 7) as f32)).collect();
        accumulate(vec![SliceMut::F32(&mut main)], &[Slice::BF16(&g)], 0.5).unwrap();
        for (i, v) in main.iter().enumerate() {
            assert_eq!(*v, 1.0 + 0.5 * (i % 7) as f32);
        }
        let mut d = vec![1.0f64; 2];
        let s = vec![0.1f32; 2];
        accumulate(vec![SliceMut::F64(&mut d)], &[Slice::F32(&s)], 1.0).unwrap();
        assert_eq!(d[0], 1.0 + 0.1f32 as f64);
    }

    #[test]
    fn accumulate_rejects_mismatches_before_writing() {
        let mut d = vec![0.0f32; 3];
        let s = vec![1.0f32; 2];
        let r = accumulate(vec![SliceMut::F32(&mut d)], &[Slice::F32(&s)], 1.0);
        assert_eq!(r, Err(Error::NumelMismatch { index: 0, dst: 3, src: 2 }));
        assert_eq!(d, vec![0.0; 3]);
        let r = accumulate(vec![], &[Slice::F32(&s)], 1.0);
        assert!(matches!(r, Err(Error::LengthMismatch { .. })));
    }
}
