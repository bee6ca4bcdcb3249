//! Storage dtypes and the arithmetic types the kernels compute in.
//!
//! Every kernel is written once over a [`Storage`] element type and a [`Real`] arithmetic
//! type (`f32` or `f64`), converting each element on the way in and out; the conversions are
//! branchless and inline, so the loops vectorise for all four dtypes. [`multiversion!`]
//! compiles each kernel twice, for baseline x86-64 and for AVX2, and picks at run time.

use half::{bf16, f16};
use std::ops::{Add, Mul, Sub};

/// Storage dtypes gradfuse understands. The discriminants are the codes the Python layer sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    F32 = 0,
    F64 = 1,
    F16 = 2,
    BF16 = 3,
}

impl DType {
    pub fn from_code(code: u8) -> Option<DType> {
        match code {
            0 => Some(DType::F32),
            1 => Some(DType::F64),
            2 => Some(DType::F16),
            3 => Some(DType::BF16),
            _ => None,
        }
    }

    /// Bytes per element (also the alignment a slice of it needs).
    pub fn size(self) -> usize {
        match self {
            DType::F64 => 8,
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    /// Rounds an `f64` to this dtype and back: the value a tensor of this dtype would hold
    /// after torch's cast, which for f16/bf16 goes through f32 (c10's 16-bit types are built
    /// from `float`), rounding twice.
    pub fn round(self, v: f64) -> f64 {
        match self {
            DType::F64 => v,
            DType::F32 => v as f32 as f64,
            DType::F16 => f16_to_f32(f32_to_f16(v as f32)) as f64,
            DType::BF16 => bf16_to_f32(f32_to_bf16(v as f32)) as f64,
        }
    }
}

/// The arithmetic type of a kernel: `f32` (torch's opmath type for f32/f16/bf16) or `f64`.
pub trait Real:
    Copy + Send + Sync + PartialOrd + Default + 'static + Add<Output = Self> + Mul<Output = Self> + Sub<Output = Self>
{
    const ZERO: Self;
    const ONE: Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn abs(self) -> Self;
    fn is_finite(self) -> bool;
    fn is_nan(self) -> bool;
    /// A storage element's value in this type (exact: widening, or f64 -> f32 rounding).
    fn get<T: Storage>(x: T) -> Self;
    /// This value as a storage element, rounded to nearest even.
    fn put<T: Storage>(self) -> T;
}

macro_rules! impl_real {
    ($t:ty, $get:ident, $put:ident) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn get<T: Storage>(x: T) -> Self {
                x.$get()
            }
            #[inline(always)]
            fn put<T: Storage>(self) -> T {
                T::$put(self)
            }
        }
    };
}
impl_real!(f32, get_f32, put_f32);
impl_real!(f64, get_f64, put_f64);

/// A storage element: one of the four dtypes, with conversions to and from both arithmetic
/// types. `Math` is the type element-wise kernels compute in, as torch does: `f64` for `f64`
/// tensors, `f32` for everything else. Conversions are per element and branchless so that
/// loops over them vectorise (the half crate's slice conversions ran at 8-12 GB/s here, a
/// quarter of memory speed); they are bit-identical to torch's c10::BFloat16 / c10::Half
/// conversions, NaN encodings included.
pub trait Storage: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    type Math: Real;
    fn get_f32(self) -> f32;
    fn get_f64(self) -> f64;
    fn put_f32(v: f32) -> Self;
    fn put_f64(v: f64) -> Self;
}

impl Storage for f32 {
    const DTYPE: DType = DType::F32;
    type Math = f32;
    #[inline(always)]
    fn get_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn get_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn put_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn put_f64(v: f64) -> Self {
        v as f32
    }
}

impl Storage for f64 {
    const DTYPE: DType = DType::F64;
    type Math = f64;
    #[inline(always)]
    fn get_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn get_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn put_f32(v: f32) -> Self {
        v as f64
    }
    #[inline(always)]
    fn put_f64(v: f64) -> Self {
        v
    }
}

macro_rules! half_storage {
    ($t:ty, $dtype:expr, $to:ident, $from:ident) => {
        impl Storage for $t {
            const DTYPE: DType = $dtype;
            type Math = f32;
            #[inline(always)]
            fn get_f32(self) -> f32 {
                $to(self.to_bits())
            }
            #[inline(always)]
            fn get_f64(self) -> f64 {
                $to(self.to_bits()) as f64
            }
            #[inline(always)]
            fn put_f32(v: f32) -> Self {
                <$t>::from_bits($from(v))
            }
            #[inline(always)]
            fn put_f64(v: f64) -> Self {
                // Through f32, as torch casts f64 -> f16/bf16.
                <$t>::from_bits($from(v as f32))
            }
        }
    };
}
half_storage!(f16, DType::F16, f16_to_f32, f32_to_f16);
half_storage!(bf16, DType::BF16, bf16_to_f32, f32_to_bf16);

/// bf16 bits -> f32: the bf16 is the top half of the f32.
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 -> bf16 bits, round to nearest even; NaN becomes 0x7FC0 (as torch's round_to_nearest_even).
#[inline(always)]
pub fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    let rounded = (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16;
    if f.is_nan() {
        0x7FC0
    } else {
        rounded
    }
}

/// f16 bits -> f32, exact (subnormals, inf and NaN payloads included).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7FFF;
    // Shift exponent and mantissa into place, then rebias by 2^112 with a float multiply,
    // which also normalises f16 subnormals exactly.
    let finite = f32::from_bits(em << 13) * f32::from_bits(0x7780_0000);
    let special = f32::from_bits((em << 13) | 0x7F80_0000);
    let m = if em >= 0x7C00 { special } else { finite };
    f32::from_bits(m.to_bits() | sign)
}

/// f32 -> f16 bits, round to nearest even; overflow gives inf, NaN gives sign | 0x7E00 (as c10::Half).
#[inline(always)]
pub fn f32_to_f16(f: f32) -> u16 {
    const F16_MAX_EXP: u32 = (127 + 16) << 23; // first f32 that rounds to inf
    const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23;
    let w = f.to_bits();
    let sign = ((w >> 16) & 0x8000) as u16;
    let x = w & 0x7FFF_FFFF;
    // Normal range: rebias the exponent and round the 13 dropped bits to nearest even.
    let mant_odd = (x >> 13) & 1;
    let normal = (x.wrapping_sub((127 - 15) << 23).wrapping_add(0xFFF + mant_odd) >> 13) as u16;
    // Subnormal range: adding a magic float aligns the 10 mantissa bits at the bottom and the
    // FPU rounds them to nearest even.
    let sub = (f32::from_bits(x) + f32::from_bits(DENORM_MAGIC)).to_bits().wrapping_sub(DENORM_MAGIC) as u16;
    let big = if x > 0x7F80_0000 { 0x7E00 } else { 0x7C00 };
    let mag = if x >= F16_MAX_EXP {
        big
    } else if x < (113 << 23) {
        sub
    } else {
        normal
    };
    sign | mag
}

/// Whether this CPU runs the AVX2 + FMA + F16C versions of the kernels (checked once, cached).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// Defines `pub fn $name` that runs `$body` compiled for AVX2/FMA/F16C when the CPU has them,
/// and for the wheel's baseline x86-64 (SSE2) otherwise. Everything `$body` calls must be
/// `#[inline(always)]` so it is compiled into each version: vectors are then 8 floats wide
/// instead of 4 (bf16 scale: 13 -> 40 GB/s on the CI machine).
#[macro_export]
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident<$($g:ident: $bound:path),+>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name<$($g: $bound),+>($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body<$($g: $bound),+>($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn avx2<$($g: $bound),+>($($arg: $ty),*) $(-> $ret)? {
                    body::<$($g),+>($($arg),*)
                }
                if $crate::dtype::has_avx2() {
                    // SAFETY: the CPU has every feature `avx2` is compiled for (checked here).
                    return unsafe { avx2::<$($g),+>($($arg),*) };
                }
            }
            body::<$($g),+>($($arg),*)
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for code in 0..4u8 {
            let d = DType::from_code(code).unwrap();
            assert_eq!(d as u8, code);
        }
        assert_eq!(DType::from_code(4), None);
        assert_eq!(DType::BF16.size(), 2);
        assert_eq!(DType::F64.size(), 8);
    }

    #[test]
    fn rounding_matches_half() {
        // 1 + 2^-9 is not representable in bf16 (8 mantissa bits): ties-to-even gives 1.0.
        assert_eq!(DType::BF16.round(1.0 + 2f64.powi(-9)), 1.0);
        // Through f32 like torch: 1 + 2^-8 + 2^-30 first rounds to the f32 tie 1 + 2^-8,
        // which then rounds to even (1.0); a direct f64 -> bf16 rounding would give 1 + 2^-7.
        assert_eq!(DType::BF16.round(1.0 + 2f64.powi(-8) + 2f64.powi(-30)), 1.0);
        assert_eq!(DType::F16.round(65520.0), f64::INFINITY);
        assert_eq!(DType::F32.round(0.1), 0.1f32 as f64);
    }

    #[test]
    fn bf16_conversions_match_half_exhaustively() {
        for bits in 0..=u16::MAX {
            // torch widens bf16 by a shift, keeping NaN payloads that `half` would quiet.
            let f = bf16_to_f32(bits);
            let want = bf16::from_bits(bits).to_f32();
            assert!(f.to_bits() == want.to_bits() || (f.is_nan() && want.is_nan()), "{bits:#x}");
            assert_eq!(f.to_bits() >> 16, bits as u32);
        }
        // Every f32 whose top 16 bits cover all patterns, with low halves at the rounding edges.
        for hi in 0..=u16::MAX as u32 {
            for lo in [0u32, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
                let f = f32::from_bits((hi << 16) | lo);
                let want = if f.is_nan() { 0x7FC0 } else { bf16::from_f32(f).to_bits() };
                assert_eq!(f32_to_bf16(f), want, "{:#x}", f.to_bits());
            }
        }
    }

    #[test]
    fn f16_conversions_match_half_exhaustively() {
        for bits in 0..=u16::MAX {
            let f = f16_to_f32(bits);
            let want = f16::from_bits(bits).to_f32();
            assert!(f.to_bits() == want.to_bits() || (f.is_nan() && want.is_nan()), "{bits:#x}");
        }
        // f32 values around every f16 value and halfway point, plus the extremes.
        for bits in 0..=u16::MAX {
            let base = f16::from_bits(bits).to_f32();
            if !base.is_finite() {
                continue;
            }
            let b = base.to_bits();
            for f in [base, f32::from_bits(b + 1), f32::from_bits(b.wrapping_sub(1)), f32::from_bits(b + 0x1000)] {
                if f.is_nan() {
                    continue; // NaN encodings are checked below: torch's, not half's.
                }
                let want = f16::from_f32(f).to_bits();
                assert_eq!(f32_to_f16(f), want, "{:#x}", f.to_bits());
            }
        }
        assert_eq!(f32_to_f16(f32::NAN), 0x7E00);
        assert_eq!(f32_to_f16(-f32::NAN), 0xFE00);
        assert_eq!(f32_to_f16(1e10), 0x7C00);
        assert_eq!(f32_to_f16(-1e-10), 0x8000);
    }
}
