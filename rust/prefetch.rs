//! Prefetches for the probes' walks over many tensors (`grads_of`, `TensorList::probe`).
//!
//! A probe asks torch's own getters about every tensor of a list; each getter follows pointers
//! from the tensor's Python object to its `TensorImpl` and on to the objects that one points to
//! (its storage, its version counter, a parameter's autograd metadata, where its `.grad` lives).
//! When the call before streamed the tensors' data through the caches (a clip of a model larger
//! than the cache), every one of those objects is a cache miss, and the misses of one tensor come
//! one after the other: ~300 ns a tensor per walk, 2000 × 4096 fp32 gradients on a 2-core EPYC
//! (`grads_of` 667 µs and the probe 650 µs of a 3.0 ms clip; the kernels take 1.5 ms).
//!
//! While the getters run on tensor `i`, the walk here asks the memory system for what they will
//! touch a few tensors ahead, in steps that each follow one pointer more than the step before
//! (see [`PROBE`], [`GRAD`]), so that the misses of several tensors overlap.
//! Where those pointers sit is torch's private layout: the Python layer finds the offsets on
//! sample tensors it makes (`gradfuse._layout`, through torch's public `_cdata`, `untyped_storage`,
//! views, `.data` and `.grad`) and hands them over only when each is found exactly once;
//! otherwise nothing is prefetched. The offsets only ever choose addresses to *prefetch*: a word
//! is read only from a live tensor's Python object (within its basic size), from its `TensorImpl`
//! or from a parameter's autograd metadata (within their first 64 bytes, a part of every one; the
//! metadata lives as long as its `TensorImpl`), and what those words point to is prefetched,
//! never read. A wrong offset costs speed, never a result, and never a fault (a prefetch does not
//! fault).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Where a tensor's pointers sit (see the module docs), in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offsets {
    /// In the Python object: the `TensorImpl` (torch's `_cdata`).
    pub cdata: usize,
    /// In the `TensorImpl`: its storage's `StorageImpl` (`untyped_storage()._cdata`).
    pub storage: usize,
    /// In the `TensorImpl`: its autograd metadata (where a parameter's `.grad` is kept).
    pub meta: usize,
    /// In the `TensorImpl`: its version counter (shared by views, not by `.data`).
    pub version: usize,
    /// In the autograd metadata: the gradient's `TensorImpl` (`.grad._cdata`).
    pub grad: usize,
}

/// One step of the prefetching for one tensor, each needing the one before it done (its
/// objects in cache) to read the pointer it follows.
#[derive(Clone, Copy, Debug)]
pub enum Step {
    /// The `TensorImpl`'s first four lines (its pointers, sizes, dtype and flags).
    Impl,
    /// The storage (where `data_ptr` is read) and the version counter.
    Storage,
    /// A parameter's autograd metadata.
    Meta,
    /// The `TensorImpl` of a parameter's gradient.
    Grad,
}

/// A probe's steps (dtype, size, layout, version, address): how far ahead of the getters each runs.
pub const PROBE: &[(usize, Step)] = &[(8, Step::Impl), (4, Step::Storage)];

/// `grads_of`'s steps (each parameter's `.grad`).
pub const GRAD: &[(usize, Step)] = &[(12, Step::Impl), (8, Step::Meta), (4, Step::Grad)];

/// The shortest list a walk that does not know its bytes prefetches (`grads_of`, the liveness
/// checks): a short list costs little either way.
pub const MIN_TENSORS: usize = 32;

/// The shortest list made anew at every call whose probe prefetches (see [`probed`]).
pub const MOVING_MIN_TENSORS: usize = 512;

/// The bytes of a Python tensor object that a word may be read from (torch's `TensorBase`
/// basic size is 40 on torch 2.x; the Python layer checks it is at least this).
pub const OBJECT_BYTES: usize = 40;

/// The bytes at the start of every `TensorImpl`, and of every autograd metadata, that a word
/// may be read from.
pub const IMPL_BYTES: usize = 64;

static OFFSETS: OnceLock<Offsets> = OnceLock::new();

/// The smallest list (in bytes: its tensors' data and [`METADATA_BYTES`] a tensor) whose probe
/// prefetches: a list smaller than the caches stays in them between calls, with its tensors'
/// metadata, and there a prefetch only costs (~5 ns a tensor). 8 MiB by default; settable for
/// tests (`gradfuse._rust.prefetch`).
static MIN_BYTES: AtomicUsize = AtomicUsize::new(8 << 20);

/// What one tensor of a probed list is counted as besides its data: the objects its walks touch
/// (the gradient's Python object, `TensorImpl`, storage and version counter; its parameter's
/// object, `TensorImpl` and autograd metadata, ~1 KiB in all). So a list of many small tensors,
/// whose metadata alone outgrows the caches, prefetches too. Measured on a 2-core EPYC (1 MiB of
/// L2 a core, 32 MiB of L3), parameters of 16 floats clipped again and again: at 30,000 10.5-11.4
/// ms a call with, 15.5-18.0 without; at 10,000-20,000 even (L3 holds them: 2.42 ms and 2.44 at
/// 10,000); at 2000-8000 a prefetch costs up to 5%. Half a KiB puts the threshold at ~16,000.
pub const METADATA_BYTES: usize = 512;

/// The threshold of [`MIN_BYTES`].
pub fn min_bytes() -> usize {
    MIN_BYTES.load(Ordering::Relaxed)
}

/// Whether the last list probed was past [`MIN_BYTES`]: the walks that do not know the bytes of
/// their tensors (a parameter list's `.grad` read, the liveness checks) prefetch only then, as
/// they mostly come right before or after a probe of the same model's tensors. Only ever a matter
/// of speed (~15 ns a tensor where the metadata is in the cache, ~150 ns saved where it is not).
static LARGE: AtomicBool = AtomicBool::new(false);

/// Records whether a probed list of `n` tensors holding `bytes` of data was past [`MIN_BYTES`],
/// or, `moving`, is made anew at every call (see [`LARGE`]); returns it.
///
/// `moving`: the list's last probe found its tensors at other addresses (a loop that sets its
/// gradients to None and makes them again each step, where the allocator hands them other
/// memory). Those are other objects than the list's last walk touched, and from
/// [`MOVING_MIN_TENSORS`] up a walk finds much of their metadata out of the caches even where
/// their data is small. Measured on a 2-core EPYC (1 MiB of L2 a core), the drop-in clip of
/// parameters of 16 floats whose gradients rotate through 9 sets, with and without: 21.5 / 20.6
/// us at 40 tensors, 54.5 / 50.3 at 148, 101.7 / 94.9 at 300, 194.9 / 206.8 at 600, 335 / 410 at
/// 1000, 699 / 941 at 2000. Gradients just made by a backward may still be in the caches, where
/// a prefetch costs up to ~5%.
pub fn probed(bytes: usize, n: usize, moving: bool) -> bool {
    let large = bytes.saturating_add(n.saturating_mul(METADATA_BYTES)) >= min_bytes()
        || (moving && n >= MOVING_MIN_TENSORS && MOVING.load(Ordering::Relaxed));
    LARGE.store(large, Ordering::Relaxed);
    large
}

/// Whether [`probed`] counts a list made anew at every call as past the threshold (on by
/// default; settable for benches and tests, `gradfuse._rust.prefetch_moving`).
static MOVING: AtomicBool = AtomicBool::new(true);

/// Sets [`MOVING`] when `on` is given; returns it.
pub fn moving(on: Option<bool>) -> bool {
    if let Some(on) = on {
        MOVING.store(on, Ordering::Relaxed);
    }
    MOVING.load(Ordering::Relaxed)
}

/// Whether a walk over `n` tensors whose bytes it does not know prefetches (see [`LARGE`]).
pub fn cold(n: usize) -> bool {
    n >= MIN_TENSORS && LARGE.load(Ordering::Relaxed)
}

/// Sets the threshold of [`MIN_BYTES`].
pub fn set_min_bytes(bytes: usize) {
    MIN_BYTES.store(bytes, Ordering::Relaxed);
}

/// Keeps `offsets` for every later walk; false (nothing kept) when one points outside the bytes
/// a word may be read from, is not 8-byte aligned, or offsets were kept already.
pub fn set(offsets: Offsets) -> bool {
    let word_at = |at: usize, bytes: usize| at % 8 == 0 && at >= 8 && at + 8 <= bytes;
    // A Python object's first 16 bytes are its reference count and type.
    let ok = offsets.cdata >= 16
        && word_at(offsets.cdata, OBJECT_BYTES)
        && [offsets.storage, offsets.meta, offsets.version, offsets.grad].iter().all(|&at| word_at(at, IMPL_BYTES));
    ok && OFFSETS.set(offsets).is_ok()
}

/// The offsets kept by [`set`], if any.
pub fn offsets() -> Option<&'static Offsets> {
    OFFSETS.get()
}

/// Asks for the cache line at `addr`. Never faults, whatever `addr` is.
#[inline(always)]
pub fn line(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch hint has no architectural effect and does not fault on any address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

/// The word at `addr`.
///
/// # Safety
/// `addr` is 8-byte aligned and its 8 bytes lie inside a live allocation. Another thread may
/// write the word meanwhile (torch releases the GIL while it runs ops): the read is volatile and
/// its value only ever chooses an address to prefetch.
#[inline(always)]
unsafe fn word(addr: usize) -> usize {
    // SAFETY: the caller's.
    unsafe { std::ptr::read_volatile(addr as *const usize) }
}

/// Takes `step` for the tensor object `obj`.
///
/// # Safety
/// `obj` is a live object of one of torch's plain tensor types (`torch.Tensor`,
/// `nn.Parameter`), whose layout is torch's `THPVariable`, and the GIL is held (no Python code
/// can swap its `TensorImpl` meanwhile; `torch.utils.swap_tensors` needs the GIL).
#[inline(always)]
pub unsafe fn take(o: &Offsets, obj: *const u8, step: Step) {
    // SAFETY: `o.cdata + 8 <= OBJECT_BYTES` (checked by `set`) lies inside the live object.
    let imp = unsafe { word(obj as usize + o.cdata) };
    if imp == 0 || imp % 8 != 0 {
        return;
    }
    // SAFETY: `imp` is the live object's `TensorImpl` (the object holds a reference while it
    // lives), at least IMPL_BYTES long, and the offsets are inside those bytes (checked by `set`);
    // so is `o.grad` inside the autograd metadata the `TensorImpl` owns (torch never replaces a
    // tensor's autograd metadata once made; it goes with the `TensorImpl`).
    unsafe {
        let pointer = |at: usize| {
            let p = word(imp + at);
            (p != 0 && p % 8 == 0).then_some(p)
        };
        match step {
            Step::Impl => (0..4).for_each(|k| line(imp + 64 * k)),
            Step::Storage => {
                if let Some(storage) = pointer(o.storage) {
                    line(storage);
                    line(storage + 64);
                }
                if let Some(version) = pointer(o.version) {
                    line(version);
                }
            }
            Step::Meta => {
                if let Some(meta) = pointer(o.meta) {
                    line(meta);
                    line(meta + 64);
                }
            }
            Step::Grad => {
                if let Some(meta) = pointer(o.meta) {
                    let grad = word(meta + o.grad);
                    line(grad);
                    line(grad + 64);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_outside_the_readable_bytes_are_refused() {
        let good = Offsets { cdata: 16, storage: 16, meta: 24, version: 40, grad: 40 };
        assert!(!set(Offsets { cdata: 40, ..good })); // past the object's basic size
        assert!(!set(Offsets { version: 64, ..good })); // past the TensorImpl's first bytes
        assert!(!set(Offsets { grad: 64, ..good })); // past the autograd metadata's first bytes
        assert!(!set(Offsets { storage: 12, ..good })); // not a word
        assert!(!set(Offsets { cdata: 0, ..good })); // the object's reference count
        assert!(set(good));
        assert!(!set(good)); // once
        assert_eq!(offsets(), Some(&good));
    }

    #[test]
    fn a_list_is_large_by_its_data_or_by_its_count() {
        assert_eq!(min_bytes(), 8 << 20); // the default (no test here changes it)
        assert!(probed(8 << 20, 1, false)); // GPT-2's 148 gradients hold far more
        assert!(!probed(1 << 20, 2000, false)); // 2000 small tensors: their metadata stays in the caches
        assert!(!cold(2000));
        assert!(probed(0, 16_384, false)); // many tiny tensors: their metadata alone outgrows the caches
        assert!(cold(2000));
        assert!(!cold(MIN_TENSORS - 1));
        assert!(probed(usize::MAX, usize::MAX, false)); // no overflow
        assert!(probed(1 << 20, 2000, true)); // made anew each call: other objects, out of the caches
        assert!(cold(2000));
        assert!(probed(64, MOVING_MIN_TENSORS, true));
        assert!(!probed(64, MOVING_MIN_TENSORS - 1, true)); // too few to gain
        assert!(!cold(2000));
        moving(Some(false));
        assert!(!probed(1 << 20, 2000, true)); // the hint off
        moving(Some(true));
    }

    #[test]
    fn a_prefetch_of_any_address_is_harmless() {
        for addr in [0usize, 1, 8, usize::MAX, usize::MAX - 63, 0xdead_beef] {
            line(addr);
        }
    }
}
