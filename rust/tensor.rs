//! Typed views of tensor memory and the fixed segmentation every kernel shares.
//!
//! The Python layer hands over `(address, numel, dtype)` triples. [`RawTensor::validate`]
//! checks what can be checked here (dtype, alignment, null); the rest of the contract is the
//! caller's, stated on [`RawTensor::slice`] and [`RawTensor::slice_mut`].

use crate::dtype::DType;
use crate::error::{Error, Result};
use half::{bf16, f16};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

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

/// The memory of one strided view, as torch describes it: the address of its first element,
/// its element size, and per dimension `(size, stride in bytes)`. Unlike [`RawTensor`] it need
/// not be dense; it is only ever compared, never read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Strided {
    pub addr: usize,
    pub itemsize: usize,
    pub dims: Vec<(usize, usize)>,
}

impl Strided {
    /// From torch's `data_ptr()`, `element_size()`, `shape` and `stride()` (strides in elements).
    pub fn from_torch(addr: usize, itemsize: usize, shape: &[usize], strides: &[usize]) -> Strided {
        let dims = shape.iter().zip(strides).map(|(&n, &s)| (n, s * itemsize)).collect();
        Strided { addr, itemsize, dims }
    }

    /// Bytes `[start, end)` from the first element to the end of the last one; `None` when empty.
    pub fn span(&self) -> Option<(usize, usize)> {
        if self.dims.iter().any(|&(n, _)| n == 0) {
            return None;
        }
        let last: usize = self.dims.iter().map(|&(n, s)| (n - 1) * s).sum();
        Some((self.addr, self.addr + last + self.itemsize))
    }

    /// The view as runs of contiguous bytes: dimensions of size 1 dropped, the others sorted
    /// outermost (largest stride) first, and each merged into the next outer one where together
    /// they tile memory. The innermost dimension becomes the run when its elements are adjacent.
    fn layout(&self) -> Layout {
        let mut dims: Vec<(usize, usize)> = self.dims.iter().copied().filter(|&(n, _)| n > 1).collect();
        dims.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(b.0.cmp(&a.0)));
        let mut merged: Vec<(usize, usize)> = Vec::with_capacity(dims.len());
        for &(n, s) in dims.iter().rev() {
            match merged.last_mut() {
                Some(inner) if s == inner.0 * inner.1 => inner.0 *= n,
                _ => merged.push((n, s)),
            }
        }
        let mut run = self.itemsize;
        if let Some(&(n, s)) = merged.first() {
            if s == self.itemsize {
                run = n * self.itemsize;
                merged.remove(0);
            }
        }
        merged.reverse();
        Layout::new(run, merged)
    }
}

/// Runs of `run` bytes starting at `base + sum(i_d * stride_d)`, `dims` outermost first.
#[derive(Clone, Debug)]
struct Layout {
    run: usize,
    dims: Vec<(usize, usize)>,
    /// The gcd of the strides: every run starts at `base` plus a multiple of it (0: one run).
    period: usize,
}

impl Layout {
    fn new(run: usize, dims: Vec<(usize, usize)>) -> Layout {
        let period = dims.iter().fold(0, |g, &(_, s)| gcd(g, s));
        Layout { run, dims, period }
    }

    /// Whether the runs in index order are disjoint and ascending: every stride clears the whole
    /// extent of the dimensions inside it. Views cut from a tensor by slicing, stepping and
    /// permuting always are; only `as_strided` layouts whose dimensions interleave are not.
    fn monotone(&self) -> bool {
        let mut extent = self.run;
        for &(n, s) in self.dims.iter().rev() {
            if s < extent {
                return false;
            }
            extent += (n - 1) * s;
        }
        true
    }

    /// The runs at `base` in ascending address order (where the layout overlaps itself, the
    /// overlapping runs come one after the other).
    fn runs(&self, base: usize) -> RunStream {
        if self.monotone() {
            return Box::new(Odometer::new(base, self));
        }
        // Interleaved dimensions: the outermost one splits the view into sub-views, each
        // enumerated in order (recursively), merged by start address.
        let (n, s) = self.dims[0];
        let inner = Layout::new(self.run, self.dims[1..].to_vec());
        let streams = (0..n).map(|i| inner.runs(base + i * s)).collect();
        Box::new(Merge::new(streams).map(|(start, end, _)| (start, end)))
    }
}

/// Runs of contiguous bytes, `[start, end)`.
type RunStream = Box<dyn Iterator<Item = (usize, usize)>>;

/// A layout's runs in index order (ascending for a monotone layout).
struct Odometer {
    base: usize,
    run: usize,
    dims: Vec<(usize, usize)>,
    index: Vec<usize>,
    offset: usize,
    done: bool,
}

impl Odometer {
    fn new(base: usize, layout: &Layout) -> Odometer {
        let dims = layout.dims.clone();
        Odometer { base, run: layout.run, index: vec![0; dims.len()], dims, offset: 0, done: false }
    }
}

impl Iterator for Odometer {
    type Item = (usize, usize);
    fn next(&mut self) -> Option<(usize, usize)> {
        if self.done {
            return None;
        }
        let start = self.base + self.offset;
        self.done = true;
        for d in (0..self.dims.len()).rev() {
            let (n, s) = self.dims[d];
            self.index[d] += 1;
            self.offset += s;
            if self.index[d] < n {
                self.done = false;
                break;
            }
            self.offset -= n * s;
            self.index[d] = 0;
        }
        Some((start, start + self.run))
    }
}

/// Several ascending run streams merged into one, each run tagged with its stream's index.
struct Merge {
    streams: Vec<RunStream>,
    heap: BinaryHeap<Reverse<(usize, usize, usize)>>,
}

impl Merge {
    fn new(mut streams: Vec<RunStream>) -> Merge {
        let heap =
            streams.iter_mut().enumerate().filter_map(|(k, s)| s.next().map(|(a, b)| Reverse((a, b, k)))).collect();
        Merge { streams, heap }
    }
}

impl Iterator for Merge {
    type Item = (usize, usize, usize);
    fn next(&mut self) -> Option<(usize, usize, usize)> {
        let Reverse((start, end, k)) = self.heap.pop()?;
        if let Some((a, b)) = self.streams[k].next() {
            self.heap.push(Reverse((a, b, k)));
        }
        Some((start, end, k))
    }
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Whether two layouts provably share no byte by arithmetic alone: every run of `a` starts at
/// `a_base` plus a multiple of its period, and likewise for `b`; modulo the gcd `g` of the two
/// periods, `a` covers `[a_base, a_base + a.run)` and `b` `[b_base, b_base + b.run)`. Disjoint
/// residues mean disjoint bytes (e.g. `buf[0::2]` and `buf[1::2]`, or the column slices
/// `W[:, 0:4]` and `W[:, 4:8]`).
fn residues_disjoint(a: &Layout, a_base: usize, b: &Layout, b_base: usize) -> bool {
    let g = gcd(a.period, b.period);
    if g == 0 || a.run + b.run > g {
        return false;
    }
    let d = if b_base >= a_base { (b_base - a_base) % g } else { (g - (a_base - b_base) % g) % g };
    d >= a.run && g - d >= b.run
}

/// The furthest run ends seen so far from two different owners (the furthest of all, and the
/// furthest among the other owners), so that a new run can be checked against every earlier
/// run of another owner at once.
#[derive(Default)]
struct TopEnds([Option<(usize, usize)>; 2]);

impl TopEnds {
    fn push(&mut self, end: usize, owner: usize) {
        match self.0 {
            [None, _] => self.0[0] = Some((end, owner)),
            [Some((e0, o0)), second] => {
                if o0 == owner {
                    if end > e0 {
                        self.0[0] = Some((end, owner));
                    }
                } else if end > e0 {
                    self.0 = [Some((end, owner)), Some((e0, o0))];
                } else if second.is_none_or(|(e1, _)| end > e1) {
                    self.0[1] = Some((end, owner));
                }
            }
        }
    }

    /// An owner other than `owner` with a run ending after `start`.
    fn other_past(&self, start: usize, owner: usize) -> Option<usize> {
        let other = match self.0[0] {
            Some((_, o)) if o == owner => self.0[1],
            first => first,
        };
        other.filter(|&(e, _)| e > start).map(|(_, o)| o)
    }
}

/// Finds two views that share a byte where at least one is written, or a written view whose
/// own elements share memory (returned as `(i, i)`). Exact for any strided layouts, elements of
/// any sizes: a range test first (views whose byte spans do not interleave are disjoint), then
/// an arithmetic test per pair inside each group of interleaving spans, then, only for the
/// views still in doubt, a merge of their runs of contiguous bytes in address order.
pub fn find_strided_conflict(views: &[Strided], written: &[bool]) -> Option<(usize, usize)> {
    let mut spans: Vec<(usize, usize, usize)> =
        views.iter().enumerate().filter_map(|(i, v)| v.span().map(|(s, e)| (s, e, i))).collect();
    spans.sort_unstable();
    let mut layouts: Vec<Option<Layout>> = vec![None; views.len()];
    let mut first = 0;
    while first < spans.len() {
        let mut end = spans[first].1;
        let mut last = first + 1;
        while last < spans.len() && spans[last].0 < end {
            end = end.max(spans[last].1);
            last += 1;
        }
        let group: Vec<usize> = spans[first..last].iter().map(|&(_, _, i)| i).collect();
        first = last;
        if !group.iter().any(|&i| written[i]) {
            continue;
        }
        for &i in &group {
            layouts[i] = Some(views[i].layout());
        }
        let layout = |i: usize| layouts[i].as_ref().expect("laid out above");
        // Views in doubt: written ones that may overlap themselves, and both sides of every
        // pair (one written) whose spans meet and whose residues do not separate them.
        let mut doubt = vec![false; group.len()];
        for (a, &i) in group.iter().enumerate() {
            doubt[a] |= written[i] && !layout(i).monotone();
            let (si, ei) = views[i].span().expect("non-empty");
            for (b, &j) in group.iter().enumerate().skip(a + 1) {
                let (sj, ej) = views[j].span().expect("non-empty");
                if !(written[i] || written[j]) || sj >= ei || si >= ej {
                    continue;
                }
                if !residues_disjoint(layout(i), views[i].addr, layout(j), views[j].addr) {
                    doubt[a] = true;
                    doubt[b] = true;
                }
            }
        }
        let suspects: Vec<usize> = group.iter().zip(&doubt).filter(|(_, &d)| d).map(|(&i, _)| i).collect();
        if let Some(hit) = merge_conflict(&suspects, views, &layouts, written) {
            return Some(hit);
        }
    }
    None
}

/// The exact test: every run of the `suspects`, in address order, against the runs before it.
fn merge_conflict(
    suspects: &[usize],
    views: &[Strided],
    layouts: &[Option<Layout>],
    written: &[bool],
) -> Option<(usize, usize)> {
    if suspects.is_empty() {
        return None;
    }
    let streams = suspects.iter().map(|&i| layouts[i].as_ref().expect("laid out").runs(views[i].addr)).collect();
    let mut any = TopEnds::default();
    let mut writes = TopEnds::default();
    let mut own_end = vec![0usize; suspects.len()];
    for (start, end, k) in Merge::new(streams) {
        let i = suspects[k];
        if written[i] && start < own_end[k] {
            return Some((i, i));
        }
        let seen = if written[i] { &any } else { &writes };
        if let Some(o) = seen.other_past(start, k) {
            let j = suspects[o];
            return Some((i.min(j), i.max(j)));
        }
        own_end[k] = own_end[k].max(end);
        any.push(end, k);
        if written[i] {
            writes.push(end, k);
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

    /// Bytes of each element of a view (brute force, index order).
    fn element_bytes(v: &Strided) -> Vec<(usize, usize)> {
        let mut out = vec![(v.addr, v.addr + v.itemsize)];
        for &(n, s) in &v.dims {
            out = (0..n).flat_map(|i| out.iter().map(move |&(a, b)| (a + i * s, b + i * s))).collect();
        }
        out
    }

    fn share_a_byte(a: &[(usize, usize)], b: &[(usize, usize)]) -> bool {
        a.iter().any(|&(s, e)| b.iter().any(|&(t, f)| s < f && t < e))
    }

    fn self_overlaps(a: &[(usize, usize)]) -> bool {
        (0..a.len()).any(|i| (i + 1..a.len()).any(|j| a[i].0 < a[j].1 && a[j].0 < a[i].1))
    }

    fn strided(addr: usize, itemsize: usize, dims: &[(usize, usize)]) -> Strided {
        Strided { addr, itemsize, dims: dims.iter().map(|&(n, s)| (n, s * itemsize)).collect() }
    }

    #[test]
    fn strided_views_that_share_no_element_do_not_conflict() {
        // buf[0::2] and buf[1::2] (f32): interleaved spans, disjoint elements.
        let even = strided(0x1000, 4, &[(8, 2)]);
        let odd = strided(0x1004, 4, &[(8, 2)]);
        assert_eq!(find_strided_conflict(&[even.clone(), odd.clone()], &[true, true]), None);
        // W[:, 0:4], W[:, 4:8] and W[:, 8:16] of a 5 x 16 f32 matrix; then an overlapping slice.
        let cols = |c0: usize, c1: usize| strided(0x1000 + c0 * 4, 4, &[(5, 16), (c1 - c0, 1)]);
        let slices = [cols(0, 4), cols(4, 8), cols(8, 16)];
        assert_eq!(find_strided_conflict(&slices, &[true; 3]), None);
        let more = [cols(0, 4), cols(4, 8), cols(7, 9)];
        assert_eq!(find_strided_conflict(&more, &[true; 3]), Some((1, 2)));
        // A column of W and the transposed rows below it: only the ones that meet conflict.
        let column = strided(0x1000, 4, &[(5, 16)]);
        let row = strided(0x1000 + 16 * 4 + 4, 4, &[(15, 1)]);
        assert_eq!(find_strided_conflict(&[column.clone(), row], &[true, true]), None);
        let row0 = strided(0x1000 + 16 * 4, 4, &[(15, 1)]);
        assert_eq!(find_strided_conflict(&[column, row0], &[true, false]), Some((0, 1)));
        // Reads may overlap each other; the same tensor twice may not be written.
        assert_eq!(find_strided_conflict(&[even.clone(), even.clone()], &[false, false]), None);
        assert_eq!(find_strided_conflict(&[even.clone(), even.clone()], &[true, false]), Some((0, 1)));
        // An expanded view (stride 0) overlaps itself; empty views never conflict.
        let expanded = strided(0x1000, 4, &[(3, 0), (4, 1)]);
        assert_eq!(find_strided_conflict(std::slice::from_ref(&expanded), &[true]), Some((0, 0)));
        assert_eq!(find_strided_conflict(&[expanded], &[false]), None);
        assert_eq!(find_strided_conflict(&[strided(0x1000, 4, &[(0, 1)]), odd], &[true, true]), None);
        // Mixed element sizes: an f32 and the bf16 view of its upper half share bytes.
        let f32_view = strided(0x1000, 4, &[(4, 2)]);
        let bf16_upper = strided(0x1002, 2, &[(1, 1)]);
        assert_eq!(find_strided_conflict(&[f32_view.clone(), bf16_upper], &[true, true]), Some((0, 1)));
        let bf16_gap = strided(0x1004, 2, &[(2, 1)]);
        assert_eq!(find_strided_conflict(&[f32_view, bf16_gap], &[true, true]), None);
    }

    #[test]
    fn top_ends_keep_the_furthest_run_of_another_owner() {
        let mut top = TopEnds::default();
        for (end, owner) in [(10, 0), (5, 1), (8, 2), (12, 0), (7, 1)] {
            top.push(end, owner);
        }
        // Owner 0 holds the furthest end (12); among the others owner 2 reaches furthest (8).
        assert_eq!(top.other_past(6, 0), Some(2));
        assert_eq!(top.other_past(8, 0), None);
        assert_eq!(top.other_past(11, 1), Some(0));
        assert_eq!(top.other_past(12, 2), None);
    }

    #[test]
    fn strided_conflicts_match_brute_force() {
        let mut seed = 0x9E3779B97F4A7C15u64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % m) as usize
        };
        for _ in 0..6000 {
            let n = next(6) + 1;
            let views: Vec<Strided> = (0..n)
                .map(|_| {
                    let itemsize = [2, 4, 8][next(3)];
                    let ndim = next(3) + 1;
                    // Element-aligned offsets into a small buffer; arbitrary strides, as_strided
                    // interleavings and zero strides included.
                    let dims: Vec<(usize, usize)> = (0..ndim).map(|_| (next(4), next(7))).collect();
                    strided(0x1000 + next(24) * 2, itemsize, &dims)
                })
                .collect();
            let written: Vec<bool> = (0..n).map(|_| next(3) != 0).collect();
            let bytes: Vec<Vec<(usize, usize)>> = views.iter().map(element_bytes).collect();
            let brute = (0..n).any(|i| {
                (written[i] && self_overlaps(&bytes[i]))
                    || (i + 1..n).any(|j| (written[i] || written[j]) && share_a_byte(&bytes[i], &bytes[j]))
            });
            let found = find_strided_conflict(&views, &written);
            assert_eq!(found.is_some(), brute, "{views:?} written {written:?}");
            match found {
                Some((i, j)) if i == j => assert!(written[i] && self_overlaps(&bytes[i])),
                Some((i, j)) => {
                    assert!(i < j && (written[i] || written[j]) && share_a_byte(&bytes[i], &bytes[j]))
                }
                None => {}
            }
        }
    }
}
