//! Gradient-health statistics from the norm's one read: per tensor its norm, its largest
//! magnitude and its count of non-finite (inf or NaN) elements, and the total norm.
//!
//! Segments and the order partials are combined in are those of [`norm::norm`], so the norms
//! are bitwise the ones it gives. Orders 2, 1 and 0 over f32/f16/bf16 (the gradients of nearly
//! every model) take one AVX2 loop that forms the norm's terms exactly as the norm's loop does
//! and, on the registers already loaded, the largest `|x|` and the non-finite count. Other
//! orders and f64 tensors reduce each segment for the norm, then scan it once more for the
//! rest while it is still in cache (a segment is at most 256 KiB): memory is still read once.

use crate::dtype::{Real, Storage};
use crate::error::Result;
use crate::multiversion;
use crate::norm::{self, NormKind};
use crate::parallel;
use crate::tensor::Slice;
use crate::with_slice;

/// Statistics of a list of tensors, one entry per tensor, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct StatsResult {
    /// The total norm over all tensors (as [`norm::NormResult::total`]).
    pub total: f64,
    /// Each tensor's norm.
    pub norms: Vec<f64>,
    /// Each tensor's largest `|x|`: inf when it holds an inf, NaN when it holds a NaN (as
    /// torch's `x.abs().amax()`), 0 for an empty tensor.
    pub amax: Vec<f64>,
    /// Each tensor's count of elements that are inf or NaN.
    pub nonfinite: Vec<u64>,
}

/// One segment's share.
#[derive(Clone, Copy, Debug)]
struct Part {
    raw: f64,
    /// Largest `|x|` among the elements that are not NaN.
    amax: f64,
    nan: bool,
    nonfinite: u64,
}

const LANES: usize = 32;

multiversion! {
    /// Largest `|x|` that is not NaN, whether any `x` is NaN, and how many are inf or NaN.
    fn scan<T: Storage>(xs: &[T]) -> (f64, bool, u64) {
        let zero = <T::Math as Real>::ZERO;
        let mut m = [zero; LANES];
        let mut nan = [false; LANES];
        let mut bad = [0u32; LANES];
        let mut chunks = xs.chunks_exact(LANES);
        for c in &mut chunks {
            for i in 0..LANES {
                let a = <T::Math as Real>::get(c[i]).abs();
                // A NaN compares false: it never becomes the max.
                m[i] = if a > m[i] { a } else { m[i] };
                nan[i] |= a.is_nan();
                bad[i] += u32::from(!a.is_finite());
            }
        }
        let mut largest = m.iter().fold(0f64, |acc, &v| acc.max(v.to_f64()));
        let mut any_nan = nan.iter().any(|&n| n);
        let mut count: u64 = bad.iter().map(|&b| u64::from(b)).sum();
        for &x in chunks.remainder() {
            let a = <T::Math as Real>::get(x).abs();
            any_nan |= a.is_nan();
            count += u64::from(!a.is_finite());
            if a.to_f64() > largest {
                largest = a.to_f64();
            }
        }
        (largest, any_nan, count)
    }
}

/// The AVX2 path: one loop over the whole blocks, the portable loops over the tail.
///
/// # Safety
/// AVX2/FMA/F16C present; `T` not f64.
#[cfg(target_arch = "x86_64")]
unsafe fn simd_segment<T: Storage, const OP: u8>(kind: NormKind, xs: &[T]) -> Part {
    use crate::simd;
    let (blocks, tail) = xs.split_at(xs.len() - xs.len() % simd::BLOCK);
    let (lanes, amax, nan, nonfinite) = simd::stats_blocks::<T, OP>(blocks);
    let raw = norm::finish_simd_lanes(kind, lanes, tail);
    let (tail_max, tail_nan, tail_bad) = scan(tail);
    let amax = (amax as f64).max(tail_max);
    if OP != simd::NON_ZERO && (!raw.is_finite() || amax.is_infinite()) {
        // Orders 2 and 1 do not count in the loop: an inf or NaN (or a square past f32's range)
        // made the sum or the max non-finite; count them now, from cache.
        let (amax, nan, nonfinite) = scan(xs);
        return Part { raw, amax, nan, nonfinite };
    }
    Part { raw, amax, nan: nan || tail_nan, nonfinite: nonfinite + tail_bad }
}

fn segment<T: Storage>(kind: NormKind, xs: &[T]) -> Part {
    #[cfg(target_arch = "x86_64")]
    if std::mem::size_of::<T::Math>() == 4 && crate::dtype::has_avx2() {
        use crate::simd::{ABS, NON_ZERO, SQUARE};
        // SAFETY: the CPU has AVX2/FMA/F16C (checked); T computes in f32, so it is not f64.
        unsafe {
            match kind {
                NormKind::Two => return simd_segment::<T, SQUARE>(kind, xs),
                NormKind::One => return simd_segment::<T, ABS>(kind, xs),
                NormKind::Zero => return simd_segment::<T, NON_ZERO>(kind, xs),
                _ => {}
            }
        }
    }
    let (raw, _) = norm::reduce_segment(kind, xs, None);
    let (amax, nan, nonfinite) = scan(xs);
    Part { raw, amax, nan, nonfinite }
}

/// The `p`-norm of every tensor and of all together (as [`norm::norm`], bitwise), with each
/// tensor's largest magnitude and non-finite count, in one read of the tensors.
pub fn stats(tensors: &[Slice<'_>], p: f64) -> Result<StatsResult> {
    let kind = NormKind::from_order(p)?;
    norm::check_nonempty(kind, tensors.iter().map(Slice::len))?;
    let mut segments = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        t.segments_into(i, &mut segments);
    }
    let tags: Vec<usize> = segments.iter().map(|&(t, _)| t).collect();
    let parts = parallel::map(segments, |(_, s)| s.len(), |(_, s)| with_slice!(Slice, s, |x| segment(kind, x)));
    let n = tensors.len();
    let mut raws = vec![kind.identity(); n];
    let mut amax = vec![0f64; n];
    let mut nan = vec![false; n];
    let mut nonfinite = vec![0u64; n];
    // In segment order, as the norm combines them.
    for (&t, part) in tags.iter().zip(&parts) {
        raws[t] = kind.combine(raws[t], part.raw);
        amax[t] = amax[t].max(part.amax);
        nan[t] |= part.nan;
        nonfinite[t] += part.nonfinite;
    }
    for (m, &has_nan) in amax.iter_mut().zip(&nan) {
        if has_nan {
            *m = f64::NAN;
        }
    }
    Ok(StatsResult { total: kind.total(&raws), norms: raws.iter().map(|&r| kind.finish(r)).collect(), amax, nonfinite })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::tensor::SEGMENT;
    use half::{bf16, f16};

    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let v = ((s >> 11) as f64 / (1u64 << 53) as f64) * 4.0 - 2.0;
                v * 2f64.powi((i % 9) as i32 - 4)
            })
            .collect()
    }

    fn slice_of<T: Storage>(xs: &[T]) -> Slice<'_> {
        let (p, n) = (xs.as_ptr(), xs.len());
        // SAFETY: T's DTYPE names its own type, so each cast is to the slice's own type.
        unsafe {
            match T::DTYPE {
                DType::F32 => Slice::F32(std::slice::from_raw_parts(p.cast(), n)),
                DType::F64 => Slice::F64(std::slice::from_raw_parts(p.cast(), n)),
                DType::F16 => Slice::F16(std::slice::from_raw_parts(p.cast(), n)),
                DType::BF16 => Slice::BF16(std::slice::from_raw_parts(p.cast(), n)),
            }
        }
    }

    /// (amax, nonfinite) in f64 of what the tensor holds.
    fn reference<T: Storage>(xs: &[T]) -> (f64, u64) {
        let vals: Vec<f64> = xs.iter().map(|&x| <f64 as Real>::get(x)).collect();
        let amax =
            if vals.iter().any(|v| v.is_nan()) { f64::NAN } else { vals.iter().fold(0f64, |m, v| m.max(v.abs())) };
        (amax, vals.iter().filter(|v| !v.is_finite()).count() as u64)
    }

    fn check<T: Storage>(specials: &[(usize, f64)]) {
        // Lengths around the AVX2 block (128), the portable lanes (32) and segment edges.
        for n in [0, 1, 31, 127, 128, 129, 1000, SEGMENT - 1, SEGMENT, SEGMENT + 1, 2 * SEGMENT + 5] {
            let mut xs: Vec<T> = values(n, n as u64 + 3).iter().map(|&v| T::put_f64(v)).collect();
            for &(at, v) in specials {
                if at < n {
                    xs[at] = T::put_f64(v);
                }
            }
            let b: Vec<T> = values(77, 5).iter().map(|&v| T::put_f64(v)).collect();
            let ts = [slice_of(&xs), slice_of(&b)];
            for p in [2.0, 1.0, 0.0, 3.0, f64::INFINITY] {
                if n == 0 && p == f64::INFINITY {
                    continue; // no identity: refused, as by the norm (tested below)
                }
                let got = stats(&ts, p).unwrap();
                let want = norm::norm(&ts, p).unwrap();
                let what = format!("{:?} n={n} p={p}", T::DTYPE);
                // The norms are the norm's own, bit for bit (NaN aside).
                let same = |a: f64, b: f64| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
                assert!(same(got.total, want.total), "{what}: {} vs {}", got.total, want.total);
                for (g, w) in got.norms.iter().zip(&want.per_tensor) {
                    assert!(same(*g, *w), "{what}: {g} vs {w}");
                }
                for (i, xs) in [&xs[..], &b[..]].iter().enumerate() {
                    let (amax, bad) = reference(xs);
                    assert!(same(got.amax[i], amax), "{what} tensor {i}: amax {} vs {amax}", got.amax[i]);
                    assert_eq!(got.nonfinite[i], bad, "{what} tensor {i}");
                }
            }
        }
    }

    fn check_all<T: Storage>() {
        check::<T>(&[]);
        check::<T>(&[(0, f64::INFINITY), (130, f64::NEG_INFINITY), (SEGMENT, f64::INFINITY)]);
        check::<T>(&[(5, f64::NAN), (127, f64::INFINITY), (SEGMENT + 1, f64::NAN), (999, -1e3)]);
    }

    #[test]
    fn stats_match_f64_reference_and_the_norm_for_every_dtype() {
        check_all::<f32>();
        check_all::<f64>();
        check_all::<f16>();
        check_all::<bf16>();
    }

    #[test]
    fn empty_tensors_and_orders_without_identity() {
        let e: [f32; 0] = [];
        let a = [3.0f32, -4.0];
        let r = stats(&[Slice::F32(&e), Slice::F32(&a)], 2.0).unwrap();
        assert_eq!(
            (r.total, r.norms.clone(), r.amax.clone(), r.nonfinite.clone()),
            (5.0, vec![0.0, 5.0], vec![0.0, 4.0], vec![0, 0])
        );
        assert!(stats(&[Slice::F32(&a), Slice::F32(&e)], f64::INFINITY).is_err());
        assert!(stats(&[Slice::F32(&a)], f64::NAN).is_err());
    }
}
