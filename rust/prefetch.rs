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
//! touch on tensors `i + AHEAD` (the `TensorImpl`'s first lines) and `i + AHEAD / 2` (what that
//! `TensorImpl`, in cache by then, points to), so that the misses of several tensors overlap.
//! Where those pointers sit is torch's private layout: the Python layer finds the offsets on
//! sample tensors it makes (`gradfuse._layout`, through torch's public `_cdata`, `untyped_storage`,
//! views and `.data`) and hands them over only when each is found exactly once; otherwise nothing
//! is prefetched. The offsets only ever choose addresses to *prefetch*: a word is read only from a
//! live tensor's Python object (within its basic size) or from its `TensorImpl` (within its first
//! 64 bytes, a part of every `TensorImpl`), and what those words point to is prefetched, never
//! read. A wrong offset costs speed, never a result, and never a fault (a prefetch does not fault).

use std::sync::atomic::{AtomicUsize, Ordering};
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
}

/// How many tensors ahead of the getters the first stage runs (the second runs half as far).
pub const AHEAD: usize = 8;

/// The bytes of a Python tensor object that a word may be read from (torch's `TensorBase`
/// basic size is 40 on torch 2.x; the Python layer checks it is at least this).
pub const OBJECT_BYTES: usize = 40;

/// The bytes at the start of every `TensorImpl` that a word may be read from.
pub const IMPL_BYTES: usize = 64;

static OFFSETS: OnceLock<Offsets> = OnceLock::new();

/// The smallest list (in bytes of tensor data) whose probe prefetches: a list smaller than the
/// caches stays in them between calls, with its tensors' metadata, and there a prefetch only
/// costs (~5 ns a tensor). 8 MiB by default; settable for tests (`gradfuse._rust.prefetch`).
static MIN_BYTES: AtomicUsize = AtomicUsize::new(8 << 20);

/// The threshold of [`MIN_BYTES`].
pub fn min_bytes() -> usize {
    MIN_BYTES.load(Ordering::Relaxed)
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
        && [offsets.storage, offsets.meta, offsets.version].iter().all(|&at| word_at(at, IMPL_BYTES));
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

/// What the walk prefetches for a tensor at each stage.
#[derive(Clone, Copy)]
pub enum Want {
    /// A parameter whose `.grad` is read: its autograd metadata.
    Grad,
    /// A tensor whose dtype, size, layout, address and version are read: its storage and
    /// version counter.
    Probe,
}

/// Prefetches for the tensor object `obj`: at stage 1 its `TensorImpl`'s first four lines; at
/// stage 2 (that `TensorImpl` read from cache) the objects `want` needs.
///
/// # Safety
/// `obj` is a live object of one of torch's plain tensor types (`torch.Tensor`,
/// `nn.Parameter`), whose layout is torch's `THPVariable`, and the GIL is held (no Python code
/// can swap its `TensorImpl` meanwhile; `torch.utils.swap_tensors` needs the GIL).
#[inline(always)]
pub unsafe fn stage(o: &Offsets, obj: *const u8, first: bool, want: Want) {
    // SAFETY: `o.cdata + 8 <= OBJECT_BYTES` (checked by `set`) lies inside the live object.
    let imp = unsafe { word(obj as usize + o.cdata) };
    if imp == 0 || imp % 8 != 0 {
        return;
    }
    if first {
        for k in 0..4 {
            line(imp + 64 * k);
        }
        return;
    }
    // SAFETY: `imp` is the live object's `TensorImpl` (it holds a reference while the object
    // lives), at least IMPL_BYTES long; the offsets are inside those bytes (checked by `set`).
    unsafe {
        match want {
            Want::Grad => {
                let meta = word(imp + o.meta);
                if meta != 0 {
                    line(meta);
                    line(meta + 64);
                }
            }
            Want::Probe => {
                let storage = word(imp + o.storage);
                if storage != 0 {
                    line(storage);
                    line(storage + 64);
                }
                let version = word(imp + o.version);
                if version != 0 {
                    line(version);
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
        let good = Offsets { cdata: 16, storage: 16, meta: 24, version: 40 };
        assert!(!set(Offsets { cdata: 40, ..good })); // past the object's basic size
        assert!(!set(Offsets { version: 64, ..good })); // past the TensorImpl's first bytes
        assert!(!set(Offsets { storage: 12, ..good })); // not a word
        assert!(!set(Offsets { cdata: 0, ..good })); // the object's reference count
        assert!(set(good));
        assert!(!set(good)); // once
        assert_eq!(offsets(), Some(&good));
    }

    #[test]
    fn a_prefetch_of_any_address_is_harmless() {
        for addr in [0usize, 1, 8, usize::MAX, usize::MAX - 63, 0xdead_beef] {
            line(addr);
        }
    }
}
