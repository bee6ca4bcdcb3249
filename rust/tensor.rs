//! Typed views of tensor memory and the fixed segmentation every kernel shares.
//!
//! The Python layer hands over `(address, numel, dtype)` triples. [`RawTensor::validate`]
//! checks what can be checked here (dtype, alignment, null); the rest of the contract is the
//! caller's, stated on [`RawTensor::slice`] and [`RawTensor::slice_mut`].

use crate::dtype::DType;
use crate::error::{Error, Result};
use half::{bf16, f16};

/// Elements per segment. Norm partials are formed per segment and combined in segment order,
/// so results do not depend on the number of threads. Changing this constant changes the
/// last bits of fp32 norms; keep it fixed. 32768 f32 = 128 KiB: two segments per core fit L2.
pub const SEGMENT: usize = 1 << 15;

/// Below this many elements in a call, kernels run on the calling thread: waking the pool
/// costs more than the work (measured: ~20 us per parallel region on 2 cores).
pub const PARALLEL_MIN: usize = 1 << 16;

/// A read-only typed view of one tensor (or one segment of it).
#[derive(Clone, Copy, Debug)]
pub enum Slice<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

/// A writable typed view of one tensor (or one segment of it).
#[derive(Debug)]
pub enum SliceMut<'a> {
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
    F16(&'a mut [f16]),
    BF16(&'a mut [bf16]),
}

/// Runs `$body` with `$s` bound to the concrete slice inside a [`Slice`] or [`SliceMut`].
#[macro_export]
macro_rules! with_slice {
    ($kind:ident, $v:expr, |$s:ident| $body:expr) => {
        match $v {
            $crate::tensor::$kind::F32($s) => $body,
            $crate::tensor::$kind::F64($s) => $body,
            $crate::tensor::$kind::F16($s) => $body,
            $crate::tensor::$kind::BF16($s) => $body,
        }
    };
}

impl<'a> Slice<'a> {
    pub fn len(&self) -> usize {
        with_slice!(Slice, self, |s| s.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            Slice::F32(_) => DType::F32,
            Slice::F64(_) => DType::F64,
            Slice::F16(_) => DType::F16,
            Slice::BF16(_) => DType::BF16,
        }
    }
    /// Appends this view's segments of `SEGMENT` elements to `out`, tagged with `tag`.
    pub fn segments_into(self, tag: usize, out: &mut Vec<(usize, Slice<'a>)>) {
        match self {
            Slice::F32(s) => out.extend(s.chunks(SEGMENT).map(|c| (tag, Slice::F32(c)))),
            Slice::F64(s) => out.extend(s.chunks(SEGMENT).map(|c| (tag, Slice::F64(c)))),
            Slice::F16(s) => out.extend(s.chunks(SEGMENT).map(|c| (tag, Slice::F16(c)))),
            Slice::BF16(s) => out.extend(s.chunks(SEGMENT).map(|c| (tag, Slice::BF16(c)))),
        }
    }
}

impl<'a> SliceMut<'a> {
    pub fn len(&self) -> usize {
        with_slice!(SliceMut, self, |s| s.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Appends this view's disjoint segments of `SEGMENT` elements to `out`, tagged with `tag`.
    pub fn segments_into(self, tag: usize, out: &mut Vec<(usize, SliceMut<'a>)>) {
        match self {
            SliceMut::F32(s) => out.extend(s.chunks_mut(SEGMENT).map(|c| (tag, SliceMut::F32(c)))),
            SliceMut::F64(s) => out.extend(s.chunks_mut(SEGMENT).map(|c| (tag, SliceMut::F64(c)))),
            SliceMut::F16(s) => out.extend(s.chunks_mut(SEGMENT).map(|c| (tag, SliceMut::F16(c)))),
            SliceMut::BF16(s) => out.extend(s.chunks_mut(SEGMENT).map(|c| (tag, SliceMut::BF16(c)))),
        }
    }
}

/// A tensor's memory as the Python layer describes it: the address of its first element,
/// its number of elements, and its dtype. Dense tensors only: the elements occupy exactly
/// `numel * dtype.size()` bytes from `addr` (contiguous, or non-overlapping and dense).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawTensor {
    pub addr: usize,
    pub numel: usize,
    pub dtype: DType,
}

impl RawTensor {
    /// Builds and checks one descriptor; `index` is the tensor's position, for errors.
    pub fn new(index: usize, addr: usize, numel: usize, code: u8) -> Result<RawTensor> {
        let dtype = DType::from_code(code).ok_or(Error::UnknownDType { index, code })?;
        let t = RawTensor { addr, numel, dtype };
        t.validate(index)?;
        Ok(t)
    }

    pub fn validate(&self, index: usize) -> Result<()> {
        if self.numel == 0 {
            return Ok(());
        }
        if self.addr == 0 {
            return Err(Error::NullData { index });
        }
        let align = self.dtype.size();
        if self.addr % align != 0 {
            return Err(Error::Misaligned { index, addr: self.addr, align });
        }
        Ok(())
    }

    /// Byte range `[start, end)` this tensor occupies (empty for zero elements).
    pub fn byte_range(&self) -> (usize, usize) {
        (self.addr, self.addr + self.numel * self.dtype.size())
    }

    /// A shared view of the tensor's elements.
    ///
    /// # Safety
    /// The caller guarantees, for the whole lifetime `'a`: `validate` passed; the
    /// `numel * size` bytes at `addr` belong to one live allocation holding initialised
    /// elements of `dtype` (the Python layer keeps the tensor object alive for the call);
    /// and nothing writes them except through views obtained from this crate that do not
    /// overlap them (the Python layer rejects overlapping in-place targets).
    pub unsafe fn slice<'a>(&self) -> Slice<'a> {
        if self.numel == 0 {
            return match self.dtype {
                DType::F32 => Slice::F32(&[]),
                DType::F64 => Slice::F64(&[]),
                DType::F16 => Slice::F16(&[]),
                DType::BF16 => Slice::BF16(&[]),
            };
        }
        let (p, n) = (self.addr, self.numel);
        // SAFETY: non-null and aligned (validate), and in bounds and live (caller's contract).
        unsafe {
            match self.dtype {
                DType::F32 => Slice::F32(std::slice::from_raw_parts(p as *const f32, n)),
                DType::F64 => Slice::F64(std::slice::from_raw_parts(p as *const f64, n)),
                DType::F16 => Slice::F16(std::slice::from_raw_parts(p as *const f16, n)),
                DType::BF16 => Slice::BF16(std::slice::from_raw_parts(p as *const bf16, n)),
            }
        }
    }

    /// An exclusive view of the tensor's elements.
    ///
    /// # Safety
    /// As for [`RawTensor::slice`], and in addition no other view of any of these bytes,
    /// shared or exclusive, exists during `'a` (the Python layer has checked that the
    /// in-place targets of one call are pairwise disjoint and that no input overlaps them).
    pub unsafe fn slice_mut<'a>(&self) -> SliceMut<'a> {
        if self.numel == 0 {
            return match self.dtype {
                DType::F32 => SliceMut::F32(&mut []),
                DType::F64 => SliceMut::F64(&mut []),
                DType::F16 => SliceMut::F16(&mut []),
                DType::BF16 => SliceMut::BF16(&mut []),
            };
        }
        let (p, n) = (self.addr, self.numel);
        // SAFETY: non-null and aligned (validate), in bounds, live and unaliased (caller's contract).
        unsafe {
            match self.dtype {
                DType::F32 => SliceMut::F32(std::slice::from_raw_parts_mut(p as *mut f32, n)),
                DType::F64 => SliceMut::F64(std::slice::from_raw_parts_mut(p as *mut f64, n)),
                DType::F16 => SliceMut::F16(std::slice::from_raw_parts_mut(p as *mut f16, n)),
                DType::BF16 => SliceMut::BF16(std::slice::from_raw_parts_mut(p as *mut bf16, n)),
            }
        }
    }
}

/// Finds two byte ranges that overlap where at least one of them is written.
///
/// `ranges[i] = (start, end, written)`. Empty ranges never overlap. Returns the indices of
/// one conflicting pair (smaller first) or `None`. O(n log n).
pub fn find_conflict(ranges: &[(usize, usize, bool)]) -> Option<(usize, usize)> {
    let mut order: Vec<usize> = (0..ranges.len()).filter(|&i| ranges[i].0 < ranges[i].1).collect();
    order.sort_unstable_by_key(|&i| (ranges[i].0, i));
    // Furthest end seen so far among all ranges, and among written ranges, with their owners.
    let mut any: Option<(usize, usize)> = None;
    let mut written: Option<(usize, usize)> = None;
    for &k in &order {
        let (start, end, w) = ranges[k];
        let hit = if w { any } else { written };
        if let Some((e, j)) = hit {
            if start < e {
                return Some((j.min(k), j.max(k)));
            }
        }
        if any.is_none_or(|(e, _)| end > e) {
            any = Some((end, k));
        }
        if w && written.is_none_or(|(e, _)| end > e) {
            written = Some((end, k));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_rejects_null_and_misaligned() {
        assert_eq!(RawTensor::new(2, 0, 4, 0), Err(Error::NullData { index: 2 }));
        assert_eq!(RawTensor::new(1, 0, 0, 0).map(|t| t.numel), Ok(0));
        assert_eq!(RawTensor::new(5, 0x1002, 4, 0), Err(Error::Misaligned { index: 5, addr: 0x1002, align: 4 }));
        assert!(RawTensor::new(0, 0x1002, 4, 3).is_ok());
        assert_eq!(RawTensor::new(3, 0x1000, 1, 9), Err(Error::UnknownDType { index: 3, code: 9 }));
    }

    #[test]
    fn segments_cover_each_tensor_in_order() {
        let a = vec![1.0f32; SEGMENT * 2 + 3];
        let mut out = Vec::new();
        Slice::F32(&a).segments_into(7, &mut out);
        let lens: Vec<usize> = out.iter().map(|(_, s)| s.len()).collect();
        assert_eq!(lens, vec![SEGMENT, SEGMENT, 3]);
        assert!(out.iter().all(|(t, _)| *t == 7));
    }

    #[test]
    fn conflicts_need_a_written_side() {
        // Two read-only ranges may overlap.
        assert_eq!(find_conflict(&[(0, 10, false), (5, 15, false)]), None);
        // Adjacent written ranges do not overlap (half-open).
        assert_eq!(find_conflict(&[(0, 10, true), (10, 20, true)]), None);
        assert_eq!(find_conflict(&[(10, 20, true), (0, 11, false)]), Some((0, 1)));
        assert_eq!(find_conflict(&[(0, 100, false), (200, 300, true), (50, 60, true)]), Some((0, 2)));
        // A long read range followed by a short one must still be seen by a later write.
        assert_eq!(find_conflict(&[(0, 100, false), (10, 20, false), (90, 95, true)]), Some((0, 2)));
        // Empty ranges are ignored.
        assert_eq!(find_conflict(&[(5, 5, true), (0, 10, true)]), None);
    }

    #[test]
    fn conflicts_match_brute_force() {
        // Deterministic pseudo-random ranges against the O(n^2) definition.
        let mut seed = 0x2545F4914F6CDD1Du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..500 {
            let n = (next() % 8) as usize + 1;
            let ranges: Vec<(usize, usize, bool)> = (0..n)
                .map(|_| {
                    let s = (next() % 64) as usize;
                    (s, s + (next() % 12) as usize, next() % 2 == 0)
                })
                .collect();
            let brute = (0..n).any(|i| {
                (i + 1..n).any(|j| {
                    let (a, b) = (ranges[i], ranges[j]);
                    a.0 < a.1 && b.0 < b.1 && a.0 < b.1 && b.0 < a.1 && (a.2 || b.2)
                })
            });
            let found = find_conflict(&ranges);
            assert_eq!(found.is_some(), brute, "{ranges:?}");
            if let Some((i, j)) = found {
                let (a, b) = (ranges[i], ranges[j]);
                assert!(a.0 < b.1 && b.0 < a.1 && (a.2 || b.2), "{ranges:?} -> {i},{j}");
            }
        }
    }
}
