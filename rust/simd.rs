//! AVX2 inner loop of the common sum-type norms (2, 1 and 0) over f32, f16 and bf16 storage.
//!
//! The portable loop in `norm.rs` computes the same thing, lane for lane, but LLVM vectorised
//! its f32 -> f64 fold two lanes at a time and spilled the row sums: the f32 2-norm read at
//! ~70% of a plain f32 sum on one core, this loop at ~95% (interleaved, 500 MB, CI machine).
//! Both run the same arithmetic in the same order, so the results are bitwise equal, which
//! `norm::tests` checks: 32 f32 lanes, each summing `ROWS` = 4 terms, folded lane `i` into
//! f64 accumulator `i % 16` after every block of 128 elements.

/// What each element adds: `u * u`, `|u|`, or 1 when `u != 0` (NaN included).
pub const SQUARE: u8 = 0;
pub const ABS: u8 = 1;
pub const NON_ZERO: u8 = 2;

/// Elements per block: 4 rows of 32 lanes.
pub const BLOCK: usize = 128;

#[cfg(target_arch = "x86_64")]
pub use avx2::{stats_blocks, sum_blocks, unscale_blocks};

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{ABS, BLOCK, SQUARE};
    use crate::dtype::{DType, Storage};
    use std::arch::x86_64::*;

    /// Eight elements of `T` (f32, f16 or bf16) widened to f32, exactly.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8<T: Storage>(p: *const T) -> __m256 {
        match T::DTYPE {
            DType::F32 => _mm256_loadu_ps(p.cast()),
            DType::BF16 => {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
            }
            DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            DType::F64 => unreachable!("f64 norms take the portable loop"),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn term<const OP: u8>(u: __m256, abs_mask: __m256, one: __m256) -> __m256 {
        match OP {
            SQUARE => _mm256_mul_ps(u, u),
            ABS => _mm256_and_ps(u, abs_mask),
            _ => _mm256_and_ps(_mm256_cmp_ps::<_CMP_NEQ_UQ>(u, _mm256_setzero_ps()), one),
        }
    }

    /// A block's four row sums (32 f32 lanes) into the f64 accumulators: lanes 8k..8k+8 fold
    /// into accumulators (8k..8k+8) % 16, the order the portable loop uses.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn fold(part: &[__m256; 4], acc: &mut [__m256d; 4]) {
        for (k, lane) in part.iter().enumerate() {
            let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(*lane));
            let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(*lane));
            acc[(2 * k) % 4] = _mm256_add_pd(acc[(2 * k) % 4], lo);
            acc[(2 * k + 1) % 4] = _mm256_add_pd(acc[(2 * k + 1) % 4], hi);
        }
    }

    /// The 16 f64 accumulators as an array.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn unpack(acc: &[__m256d; 4]) -> [f64; 16] {
        let mut out = [0f64; 16];
        for (k, a) in acc.iter().enumerate() {
            _mm256_storeu_pd(out.as_mut_ptr().add(4 * k), *a);
        }
        out
    }

    /// The 16 f64 accumulators and the inf/NaN flag after every whole block of `xs` (whose length
    /// must be a multiple of [`BLOCK`]); with `UNSCALE`, terms are of `u = x * inv` formed in f32.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C (`dtype::has_avx2`), and `T` must not be f64.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn sum_blocks<T: Storage, const OP: u8, const UNSCALE: bool>(xs: &[T], inv: f32) -> ([f64; 16], bool) {
        // Never written: STORE is false.
        blocks::<T, OP, UNSCALE, false>(xs.as_ptr().cast_mut(), xs.len(), inv)
    }

    /// As [`sum_blocks`] with `UNSCALE`, for f32 tensors, also leaving `u = x * inv` in place: the
    /// in-place unscale and its norm in one loop (two loops, the second re-reading the segment
    /// from cache, ran ~30% slower than a plain scale pass; measured).
    ///
    /// # Safety
    /// As [`sum_blocks`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn unscale_blocks<const OP: u8>(xs: &mut [f32], inv: f32) -> ([f64; 16], bool) {
        blocks::<f32, OP, true, true>(xs.as_mut_ptr(), xs.len(), inv)
    }

    /// What [`stats_blocks`] returns: the 16 f64 accumulators of [`sum_blocks`], and over the
    /// same elements the largest `|x|` that is not NaN, and (order 0 only, see below) whether
    /// any `x` is NaN and how many are inf or NaN.
    pub type BlockStats = ([f64; 16], f32, bool, u64);

    /// As [`sum_blocks`] without unscaling (same accumulators, same bits), and in the same read
    /// the largest `|x|`: one `max` more per 8 elements on registers already loaded (an `and`
    /// too for squares), where a second loop over the segment would re-read it. For orders 2
    /// and 1 nothing else is needed: an inf or NaN makes the sum (or the max) non-finite, and
    /// the caller then counts them in a second look at the segment, which finite gradients never
    /// take. Order 0's terms stay finite, so its loop also counts inf/NaN elements and flags NaN.
    ///
    /// # Safety
    /// As [`sum_blocks`]; also `xs.len() / 8` must fit in an i32 lane (segments are far smaller).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn stats_blocks<T: Storage, const OP: u8>(xs: &[T]) -> BlockStats {
        debug_assert_eq!(xs.len() % BLOCK, 0);
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let one = _mm256_set1_ps(1.0);
        let inf = _mm256_set1_ps(f32::INFINITY);
        let mut acc = [_mm256_setzero_pd(); 4];
        let mut amax = _mm256_setzero_ps();
        let mut nan = _mm256_setzero_ps();
        let mut count = _mm256_setzero_si256();
        let p0 = xs.as_ptr();
        for b in 0..xs.len() / BLOCK {
            let p = p0.add(b * BLOCK);
            let mut part = [_mm256_setzero_ps(); 4];
            for row in 0..4 {
                for (k, lane) in part.iter_mut().enumerate() {
                    let x = load8(p.add(row * 32 + k * 8));
                    let a = _mm256_and_ps(x, abs_mask);
                    // maxps returns its second operand when either is NaN: NaN never enters.
                    amax = _mm256_max_ps(a, amax);
                    if OP == super::NON_ZERO {
                        nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
                        // |x| < inf fails for inf and NaN; the all-ones mask is -1 as an integer.
                        let bad = _mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf);
                        count = _mm256_sub_epi32(count, _mm256_castps_si256(bad));
                    }
                    let t = term::<OP>(x, abs_mask, one);
                    *lane = if row == 0 { t } else { _mm256_add_ps(*lane, t) };
                }
            }
            fold(&part, &mut acc);
        }
        let out = unpack(&acc);
        let mut maxes = [0f32; 8];
        _mm256_storeu_ps(maxes.as_mut_ptr(), amax);
        let mut counts = [0i32; 8];
        _mm256_storeu_si256(counts.as_mut_ptr().cast(), count);
        let largest = maxes.iter().fold(0f32, |m, &v| m.max(v));
        let total = counts.iter().map(|&c| c as u64).sum();
        (out, largest, _mm256_movemask_ps(nan) != 0, total)
    }

    /// The loop behind [`sum_blocks`] and [`unscale_blocks`]; `STORE` writes `u` back (f32 only).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn blocks<T: Storage, const OP: u8, const UNSCALE: bool, const STORE: bool>(
        xs: *mut T,
        len: usize,
        inv: f32,
    ) -> ([f64; 16], bool) {
        debug_assert_eq!(len % BLOCK, 0);
        debug_assert!(!STORE || (UNSCALE && T::DTYPE == DType::F32));
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let one = _mm256_set1_ps(1.0);
        let inf = _mm256_set1_ps(f32::INFINITY);
        let inv = _mm256_set1_ps(inv);
        let mut acc = [_mm256_setzero_pd(); 4];
        let mut bad = _mm256_setzero_ps();
        for b in 0..len / BLOCK {
            let p = xs.add(b * BLOCK);
            let mut part = [_mm256_setzero_ps(); 4];
            for row in 0..4 {
                for (k, lane) in part.iter_mut().enumerate() {
                    let at = p.add(row * 32 + k * 8);
                    let x = load8(at);
                    let u = if UNSCALE {
                        // !is_finite(x): |x| < inf fails for inf and NaN alike.
                        bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_NLT_UQ>(_mm256_and_ps(x, abs_mask), inf));
                        _mm256_mul_ps(x, inv)
                    } else {
                        x
                    };
                    if STORE {
                        _mm256_storeu_ps(at.cast(), u);
                    }
                    let t = term::<OP>(u, abs_mask, one);
                    // Row 0 starts the sum: 0 + t == t bitwise for these terms (never -0).
                    *lane = if row == 0 { t } else { _mm256_add_ps(*lane, t) };
                }
            }
            fold(&part, &mut acc);
        }
        let out = unpack(&acc);
        (out, _mm256_movemask_ps(bad) != 0)
    }
}
