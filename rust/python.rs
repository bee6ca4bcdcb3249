//! pyo3 glue: `gradfuse._rust`. Converts Python arguments, checks what the safety contract
//! needs, releases the GIL and calls the plain-Rust core. No kernel logic lives here.
//!
//! Tensors arrive as a [`TensorList`]: addresses, element counts and dtype codes taken by the
//! Python layer (`gradfuse._plan`) from live, dense (contiguous or non-overlapping-and-dense)
//! CPU tensors that the caller keeps alive for the duration of the call. That is the part of
//! the contract this file cannot check; alignment, null addresses and disjointness of
//! written memory it checks itself before any view is made.

use crate::bucket;
use crate::dtype::DType;
use crate::elementwise;
use crate::error::Error;
use crate::norm::{self as norms, NormResult};
use crate::parallel;
use crate::prefetch::{self, Step};
use crate::stats as health;
use crate::tensor::{find_conflict, find_strided_conflict, RawTensor, Slice, SliceMut, Strided};
use crate::unitwise;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::ffi::{c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};

// The Python layer's exception types (defined in `gradfuse._plan`, so that `import gradfuse`
// need not load this module): the drop-in clipping functions catch them and hand the call to torch.
pyo3::import_exception!(gradfuse._plan, OverlapError);
pyo3::import_exception!(gradfuse._plan, UnsupportedTensorError);

/// The memory of a list of tensors: what the kernels need, nothing else.
#[pyclass(frozen, module = "gradfuse._rust")]
struct TensorList {
    /// The argument's name in the public API (`grads`, `dst`, ...), for error messages.
    name: String,
    tensors: Vec<RawTensor>,
    /// Whether kernels may write these tensors; then they were checked pairwise disjoint
    /// when the list was made, before any kernel of the call runs.
    writable: bool,
    /// The memory format each tensor is contiguous in (see [`set_probes`]: 0 torch's contiguous
    /// format, 1 channels-last, 2 channels-last 3d, [`PERMUTED`] dense in another order; either
    /// way its elements fill exactly its `numel` slots from its address), checked by
    /// [`TensorList::probe`] (a permuted tensor's sizes and strides by the Python layer); None:
    /// all are 0.
    formats: Option<Vec<u8>>,
    /// The bytes of the tensors' data: a probe of a list past `prefetch::min_bytes` (these and
    /// `prefetch::METADATA_BYTES` a tensor) prefetches.
    bytes: usize,
    /// Whether the tensors this list describes are likely other objects at each call: set when it
    /// was made by [`TensorList::moved`] or its last probe found other addresses, cleared when
    /// its last probe found its own. A probe then prefetches (see `prefetch::probed`). Speed only.
    moving: AtomicBool,
}

#[pymethods]
impl TensorList {
    /// `codes` holds one dtype code per tensor, as bytes: read in place, where a list would
    /// cost a conversion per element (~40 us at 2000 tensors, measured).
    #[new]
    #[pyo3(signature = (name, addrs, numels, codes, writable=false, formats=None))]
    fn new(
        name: String,
        addrs: Vec<usize>,
        numels: Vec<usize>,
        codes: &[u8],
        writable: bool,
        formats: Option<Vec<u8>>,
    ) -> PyResult<Self> {
        if let Some(f) = &formats {
            if f.len() != addrs.len() || f.iter().any(|&k| k > PERMUTED) {
                return Err(PyValueError::new_err(format!(
                    "{name}: {} memory formats (each 0..={PERMUTED}) for {} tensors",
                    f.len(),
                    addrs.len()
                )));
            }
        }
        if addrs.len() != numels.len() || addrs.len() != codes.len() {
            return Err(PyValueError::new_err(format!(
                "{name}: {} addresses, {} sizes and {} dtype codes",
                addrs.len(),
                numels.len(),
                codes.len()
            )));
        }
        let tensors = addrs
            .iter()
            .zip(&numels)
            .zip(codes)
            .enumerate()
            .map(|(i, ((&a, &n), &c))| RawTensor::new(i, a, n, c))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| to_py(e, &name, ""))?;
        let bytes = tensors.iter().map(|t| t.numel * t.dtype.size()).sum();
        let list = TensorList { name, tensors, writable, formats, bytes, moving: AtomicBool::new(false) };
        if writable {
            list.check_disjoint(None).map_err(|e| list.err(e))?;
        }
        Ok(list)
    }

    fn __len__(&self) -> usize {
        self.tensors.len()
    }

    /// Whether this list's tensors are taken to be made anew at every call (see `moving`).
    #[getter]
    fn moving(&self) -> bool {
        self.moving.load(Ordering::Relaxed)
    }

    /// Raises OverlapError when a tensor of `reads` overlaps one of these (a writable list) other
    /// than the one at its own index that it is identical to (`dst[i] += src[i]` reads each
    /// element before writing it); the check `accumulate_` makes, for callers that keep lists.
    fn check_reads(&self, reads: &TensorList) -> PyResult<()> {
        if !self.writable {
            return Err(PyValueError::new_err(format!("{} was not made writable", self.name)));
        }
        let same: Vec<bool> = self.tensors.iter().zip(&reads.tensors).map(|(a, b)| a == b).collect();
        self.check_disjoint(Some((reads, &same))).map_err(|e| to_py(e, &self.name, &reads.name))
    }

    /// Whether `tensors` (a list) are still what this list describes, in one pass through torch's
    /// own attribute getters (see [`set_probes`]): each a plain tensor (`torch.Tensor` or
    /// `nn.Parameter`) with this list's dtype and size in bytes, contiguous in its memory format
    /// (see `formats`; a [`PERMUTED`] one's sizes and strides are the caller's to confirm), and
    /// with `writing` not an inference tensor, with `signed` not negated (torch's negative bit: its
    /// memory holds the negation of its values); one at another address than this list's on
    /// `device` (`Tensor.get_device()`'s index, -1 for the CPU), read then: an address names its
    /// device, so one at this list's own address needs no reading. Returns None when one is not
    /// (or a probe raised: the caller plans the list anew, which names the problem), True when
    /// they are at this list's addresses too, else their addresses (see [`words`]). Raises when
    /// the probes are not set.
    #[pyo3(signature = (tensors, writing, device, signed=false))]
    fn probe(
        &self,
        py: Python<'_>,
        tensors: &Bound<'_, PyList>,
        writing: bool,
        device: i64,
        signed: bool,
    ) -> PyResult<Py<PyAny>> {
        let probes = PROBES.get(py).ok_or_else(|| PyRuntimeError::new_err("gradfuse._rust: probes not set"))?;
        if tensors.len() != self.tensors.len() {
            return Ok(py.None());
        }
        let mut addrs = Vec::with_capacity(self.tensors.len());
        let moving = self.moving.load(Ordering::Relaxed);
        let ahead = prefetch::offsets().filter(|_| prefetch::probed(self.bytes, self.tensors.len(), moving));
        for (i, (t, want)) in tensors.iter().zip(&self.tensors).enumerate() {
            if let Some(o) = ahead {
                // SAFETY: the GIL is held and `tensors` is a live list.
                unsafe { probes.ahead(o, tensors, i, prefetch::PROBE) };
            }
            let format = self.formats.as_ref().map_or(0, |f| f[i]);
            // SAFETY: `t` is a live object (the list holds it) and the GIL is held; `probe_one`
            // calls torch's getters only on exact `torch.Tensor`/`nn.Parameter` instances.
            match unsafe { probes.probe_one(t.as_ptr(), want, writing, signed, format) } {
                // SAFETY: as above; `probe_one` found `t` a plain tensor.
                Some(addr) if addr == want.addr || unsafe { probes.device_of(t.as_ptr()) } == Some(device) => {
                    addrs.push(addr)
                }
                _ => return Ok(py.None()),
            }
        }
        if addrs.len() != self.tensors.len() {
            // The list shrank while the getters ran (Python code under a torch function mode).
            return Ok(py.None());
        }
        let same = addrs.iter().zip(&self.tensors).all(|(&a, t)| a == t.addr);
        self.moving.store(!same, Ordering::Relaxed);
        if same {
            return Ok(true.into_pyobject(py)?.to_owned().into_any().unbind());
        }
        Ok(PyBytes::new(py, &to_words(addrs)).into_any().unbind())
    }

    /// The same list (sizes, dtypes, writability) at the addresses `addrs` (see [`words`]),
    /// checked as a new list is (alignment, and disjointness when writable); None when the new
    /// addresses fail a check or change whether some tensor is 16-byte aligned (the GPU kernels
    /// group tensors by it).
    fn moved(&self, addrs: &[u8]) -> PyResult<Option<TensorList>> {
        let addrs: Vec<usize> = words(addrs)?.collect();
        if addrs.len() != self.tensors.len() {
            return Ok(None);
        }
        let mut tensors = Vec::with_capacity(addrs.len());
        for (i, (&addr, t)) in addrs.iter().zip(&self.tensors).enumerate() {
            let moved = RawTensor { addr, ..*t };
            if (addr % 16 == 0) != (t.addr % 16 == 0) || moved.validate(i).is_err() {
                return Ok(None);
            }
            tensors.push(moved);
        }
        let list = TensorList {
            name: self.name.clone(),
            tensors,
            writable: self.writable,
            formats: self.formats.clone(),
            bytes: self.bytes,
            moving: AtomicBool::new(true),
        };
        if list.writable && list.check_disjoint(None).is_err() {
            return Ok(None);
        }
        Ok(Some(list))
    }

    fn __repr__(&self) -> String {
        let numel: usize = self.tensors.iter().map(|t| t.numel).sum();
        format!("TensorList({}, {} tensors, {} elements)", self.name, self.tensors.len(), numel)
    }
}

impl TensorList {
    fn slices(&self) -> Vec<Slice<'_>> {
        // SAFETY: each RawTensor passed `validate` in `new`; liveness and initialisation are
        // the Python layer's part of the contract (module docs); writers of this memory during
        // the call are only views from `slices_mut` of lists checked disjoint from it.
        self.tensors.iter().map(|t| unsafe { t.slice() }).collect()
    }

    /// Checks that no two of these tensors overlap, nor any of them one of `reads` (except a
    /// read flagged as identical to the target at its index).
    fn check_disjoint(&self, reads: Option<(&TensorList, &[bool])>) -> Result<(), Error> {
        let mut ranges: Vec<(usize, usize, bool)> = self
            .tensors
            .iter()
            .map(|t| {
                let (s, e) = t.byte_range();
                (s, e, true)
            })
            .collect();
        if let Some((src, skip)) = reads {
            ranges.extend(src.tensors.iter().zip(skip).map(|(t, &same)| {
                // A source identical to its own target (dst[i] += src[i] with src[i] is dst[i]) is fine.
                let (s, e) = if same { (0, 0) } else { t.byte_range() };
                (s, e, false)
            }));
        }
        if let Some((i, j)) = find_conflict(&ranges) {
            let n = self.tensors.len();
            let label = |k: usize| match reads {
                Some((src, _)) if k >= n => (src.name.clone(), k - n),
                _ => (self.name.clone(), k),
            };
            return Err(Error::Overlap { first: label(i), second: label(j) });
        }
        Ok(())
    }

    /// Exclusive views of a writable list; `reads` are the other tensors of the call.
    fn slices_mut(&self, reads: Option<(&TensorList, &[bool])>) -> PyResult<Vec<SliceMut<'_>>> {
        if !self.writable {
            return Err(PyValueError::new_err(format!("{} was not made writable", self.name)));
        }
        if let Some((src, _)) = reads {
            self.check_disjoint(reads).map_err(|e| to_py(e, &self.name, &src.name))?;
        }
        // SAFETY: validated in `new`, live (module docs), pairwise disjoint (checked in `new`;
        // the list is frozen) and disjoint from the call's other tensors (checked just above:
        // the only other views of a call are the read views of `reads`).
        Ok(self.tensors.iter().map(|t| unsafe { t.slice_mut() }).collect())
    }

    fn err(&self, e: Error) -> PyErr {
        to_py(e, &self.name, "")
    }
}

fn to_py(e: Error, list: &str, other: &str) -> PyErr {
    let msg = e.message(list, other);
    match e {
        Error::UnknownDType { .. } => PyTypeError::new_err(msg),
        Error::EmptyNorm { .. } => PyRuntimeError::new_err(msg),
        Error::Overlap { .. } => OverlapError::new_err(msg),
        // Memory the kernels cannot address (torch.frombuffer at an odd offset, say).
        Error::Misaligned { .. } => UnsupportedTensorError::new_err(msg),
        _ => PyValueError::new_err(msg),
    }
}

fn out_dtype(code: u8) -> PyResult<DType> {
    match DType::from_code(code) {
        Some(d @ (DType::F32 | DType::F64)) => Ok(d),
        _ => Err(PyTypeError::new_err(format!("norm outputs are float32 or float64, got dtype code {code}"))),
    }
}

// --- probes: torch's attribute getters, called directly ------------------------------------

/// The layout CPython gives its method and getset descriptors (`PyDescr_COMMON` then the
/// definition), stable since Python 3.3. Read only after [`set_probes`] checked, through the
/// public `d_name` field that sits before it, that the layout is the one described here.
#[repr(C)]
struct DescrCommon {
    ob_base: ffi::PyObject,
    d_type: *mut ffi::PyTypeObject,
    d_name: *mut ffi::PyObject,
    d_qualname: *mut ffi::PyObject,
}

#[repr(C)]
struct GetSetDescr {
    common: DescrCommon,
    d_getset: *mut ffi::PyGetSetDef,
}

#[repr(C)]
struct MethodDescr {
    common: DescrCommon,
    d_method: *mut ffi::PyMethodDef,
}

/// A getter of torch's tensor type, and its closure.
struct Getter {
    get: ffi::getter,
    closure: *mut c_void,
}

/// A method of torch's tensor type that takes no arguments, as its C function.
enum Method {
    NoArgs(ffi::PyCFunction),
    Keywords(ffi::PyCFunctionWithKeywords),
}

/// What a probe calls and compares with (see [`set_probes`]).
struct Probes {
    dtype: Getter,
    nbytes: Getter,
    version: Getter,
    grad: Getter,
    shape: Getter,
    data_ptr: Method,
    is_contiguous: Method,
    get_device: Method,
    is_neg: Method,
    /// `is_contiguous`'s keyword arguments for memory formats 1..=LAYOUTS (`memory_format=...`).
    layouts: Vec<Py<PyDict>>,
    /// torch's dtype objects of codes 0..=3, and the plain tensor types.
    dtypes: Vec<Py<PyAny>>,
    plain: Vec<Py<PyAny>>,
    empty: Py<PyTuple>,
}

// SAFETY: the raw pointers are C functions and closures of torch's extension module, which is
// never unloaded, and every use holds the GIL (the lock is a PyOnceLock, read with the GIL).
unsafe impl Send for Probes {}
unsafe impl Sync for Probes {}

static PROBES: PyOnceLock<Probes> = PyOnceLock::new();

/// The memory formats other than torch's contiguous one that a kept list may hold (channels-last,
/// channels-last 3d).
const LAYOUTS: usize = 2;

/// The format code of a tensor whose elements fill its `numel` slots in an order no memory
/// format names (a transpose, a permutation): its contiguity is not asked here; the Python layer
/// compares its sizes and strides with the kept ones.
const PERMUTED: u8 = LAYOUTS as u8 + 1;

/// The getter behind `descr`, a getset descriptor named `name`; None if it is not one.
fn getter_of(descr: &Bound<'_, PyAny>, name: &str) -> Option<Getter> {
    let ptr = descr.as_ptr();
    let want = CString::new(name).ok()?;
    // SAFETY: the descriptor's type is checked to be CPython's getset descriptor type before its
    // fields are read; its name field (common to all descriptors) must be the expected string
    // before the definition pointer after it is followed.
    unsafe {
        if ffi::Py_TYPE(ptr) != &raw mut ffi::PyGetSetDescr_Type {
            return None;
        }
        let d = ptr as *const GetSetDescr;
        let d_name = (*d).common.d_name;
        if d_name.is_null()
            || ffi::PyUnicode_Check(d_name) == 0
            || ffi::PyUnicode_CompareWithASCIIString(d_name, want.as_ptr()) != 0
        {
            return None;
        }
        let def = (*d).d_getset;
        if def.is_null() || (*def).name.is_null() || CStr::from_ptr((*def).name) != want.as_c_str() {
            return None;
        }
        Some(Getter { get: (*def).get?, closure: (*def).closure })
    }
}

/// The C function behind `descr`, a method descriptor named `name` that can be called with no
/// arguments; None if it is not one.
fn method_of(descr: &Bound<'_, PyAny>, name: &str) -> Option<Method> {
    let ptr = descr.as_ptr();
    let want = CString::new(name).ok()?;
    // SAFETY: as in `getter_of`, for method descriptors; the flags decide the C signature.
    unsafe {
        if ffi::Py_TYPE(ptr) != &raw mut ffi::PyMethodDescr_Type {
            return None;
        }
        let d = ptr as *const MethodDescr;
        let d_name = (*d).common.d_name;
        if d_name.is_null()
            || ffi::PyUnicode_Check(d_name) == 0
            || ffi::PyUnicode_CompareWithASCIIString(d_name, want.as_ptr()) != 0
        {
            return None;
        }
        let def = (*d).d_method;
        if def.is_null() || (*def).ml_name.is_null() || CStr::from_ptr((*def).ml_name) != want.as_c_str() {
            return None;
        }
        let flags = (*def).ml_flags & !ffi::METH_COEXIST;
        if flags == ffi::METH_NOARGS {
            Some(Method::NoArgs((*def).ml_meth.PyCFunction))
        } else if flags == ffi::METH_VARARGS | ffi::METH_KEYWORDS {
            Some(Method::Keywords((*def).ml_meth.PyCFunctionWithKeywords))
        } else {
            None
        }
    }
}

/// Sets the probes of [`TensorList::probe`], [`grads_are`], [`addrs_are`] and
/// [`shape_mismatch`]: `getters` are torch's getset descriptors `dtype`, `nbytes`, `_version`,
/// `grad` and `shape`, `methods` its method descriptors `data_ptr`, `is_contiguous`, `get_device`
/// and `is_neg` (as `torch.Tensor` resolves them), `dtypes` the dtype objects of codes 0..=3,
/// `plain` the tensor types probed and `layouts` the keyword arguments of `is_contiguous` for
/// memory formats 1..=LAYOUTS (`{"memory_format": torch.channels_last}`, ...). Returns False,
/// setting nothing, when any descriptor is not what a probe can call directly (a Python that
/// lays descriptors out otherwise, a torch that defines them otherwise): the Python layer then
/// probes with `map`.
#[pyfunction]
fn set_probes(
    py: Python<'_>,
    getters: Vec<Bound<'_, PyAny>>,
    methods: Vec<Bound<'_, PyAny>>,
    dtypes: Vec<Py<PyAny>>,
    plain: Vec<Py<PyAny>>,
    layouts: Vec<Py<PyDict>>,
) -> PyResult<bool> {
    if getters.len() != 5 || methods.len() != 4 || dtypes.len() != 4 || layouts.len() != LAYOUTS {
        return Err(PyValueError::new_err(format!("set_probes: 5 getters, 4 methods, 4 dtypes, {LAYOUTS} layouts")));
    }
    let (Some(dtype), Some(nbytes), Some(version), Some(grad), Some(shape)) = (
        getter_of(&getters[0], "dtype"),
        getter_of(&getters[1], "nbytes"),
        getter_of(&getters[2], "_version"),
        getter_of(&getters[3], "grad"),
        getter_of(&getters[4], "shape"),
    ) else {
        return Ok(false);
    };
    let (Some(data_ptr), Some(is_contiguous @ Method::Keywords(_)), Some(get_device), Some(is_neg)) = (
        method_of(&methods[0], "data_ptr"),
        method_of(&methods[1], "is_contiguous"),
        method_of(&methods[2], "get_device"),
        method_of(&methods[3], "is_neg"),
    ) else {
        return Ok(false); // is_contiguous takes memory_format: a torch whose does not is not probed
    };
    let empty = PyTuple::empty(py).unbind();
    let probes = Probes {
        dtype,
        nbytes,
        version,
        grad,
        shape,
        data_ptr,
        is_contiguous,
        get_device,
        is_neg,
        layouts,
        dtypes,
        plain,
        empty,
    };
    let _ = PROBES.set(py, probes);
    Ok(true)
}

/// The gradients of `params` that are not None, in order, read through torch's `grad` getter in
/// one pass; None when the probes are not set, some parameter or gradient is not a plain tensor,
/// or a getter raises (the caller then reads them in Python, which raises as torch does), and
/// when some gradient's dtype is `without` (a torch dtype: the caller's Python path refuses it).
#[pyfunction]
#[pyo3(signature = (params, without=None))]
fn grads_of<'py>(
    py: Python<'py>,
    params: &Bound<'py, PyList>,
    without: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, PyList>>> {
    let Some(probes) = PROBES.get(py) else { return Ok(None) };
    let without = without.map(|d| d.as_ptr());
    let grads = PyList::empty(py);
    let ahead = prefetch::offsets().filter(|_| prefetch::cold(params.len()));
    for (i, p) in params.iter().enumerate() {
        if let Some(o) = ahead {
            // SAFETY: the GIL is held and `params` is a live list.
            unsafe { probes.ahead(o, params, i, prefetch::GRAD) };
        }
        // SAFETY: `p` is live (the list holds it), the GIL is held, and the getter is called on
        // plain tensors only; the new reference is owned by the Bound made from it.
        let grad = unsafe {
            if !probes.is_plain(p.as_ptr()) {
                return Ok(None);
            }
            let Some(grad) = probes.get(&probes.grad, p.as_ptr()) else { return Ok(None) };
            Bound::from_owned_ptr(py, grad)
        };
        if grad.is_none() {
            continue;
        }
        if !probes.is_plain(grad.as_ptr()) {
            return Ok(None);
        }
        if let Some(refused) = without {
            // SAFETY: `grad` is a live plain tensor (checked above) and the GIL is held; the new
            // reference is released.
            let found = unsafe {
                let Some(dtype) = probes.get(&probes.dtype, grad.as_ptr()) else { return Ok(None) };
                ffi::Py_DECREF(dtype);
                dtype == refused
            };
            if found {
                return Ok(None);
            }
        }
        grads.append(grad)?;
    }
    Ok(Some(grads))
}

/// Whether probes of lists made anew at every call prefetch (see `prefetch::probed`): set when
/// `on` is given; returns the setting. For benches and tests: on by default.
#[pyfunction]
#[pyo3(signature = (on=None))]
fn prefetch_moving(on: Option<bool>) -> bool {
    prefetch::moving(on)
}

/// `(cdata, storage, meta, version, grad)`: [`prefetch::Offsets`] as Python sees them.
type OffsetTuple = (usize, usize, usize, usize, usize);

/// The prefetches of the probes' walks (see [`prefetch`]): `offsets` (cdata, storage, meta,
/// version, grad), found by the Python layer on sample tensors, are kept when given (once; refused
/// when outside the bytes a word may be read from), `min_bytes` sets the smallest list whose
/// probe prefetches. Returns the offsets kept (None: no prefetches) and the threshold.
#[pyfunction]
#[pyo3(name = "prefetch", signature = (offsets=None, min_bytes=None))]
fn prefetch_setup(offsets: Option<OffsetTuple>, min_bytes: Option<usize>) -> (Option<OffsetTuple>, usize) {
    if let Some((cdata, storage, meta, version, grad)) = offsets {
        prefetch::set(prefetch::Offsets { cdata, storage, meta, version, grad });
    }
    if let Some(bytes) = min_bytes {
        prefetch::set_min_bytes(bytes);
    }
    let kept = prefetch::offsets().map(|o| (o.cdata, o.storage, o.meta, o.version, o.grad));
    (kept, prefetch::min_bytes())
}

/// The process environment's `GRADFUSE_BACKEND` (None when unset or not UTF-8): what
/// `os.environ.get` gives, which Python keeps in step with the process environment (`putenv` on
/// every change), for ~0.1 us where `os.environ.get` of an unset name costs ~0.5 us (a KeyError
/// raised and caught).
#[pyfunction]
fn backend_env() -> Option<String> {
    std::env::var("GRADFUSE_BACKEND").ok()
}

/// The addresses `addrs` holds: native-endian 64-bit words, one per tensor (`array("Q", ...)`'s
/// bytes, made once by the caller so that a call converts no Python integers); an error when its
/// length is not a whole number of words.
fn words(addrs: &[u8]) -> PyResult<impl Iterator<Item = usize> + '_> {
    if addrs.len() % 8 != 0 {
        return Err(PyValueError::new_err(format!(
            "addresses: {} bytes is not a whole number of 8-byte words",
            addrs.len()
        )));
    }
    Ok(addrs.chunks_exact(8).map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")) as usize))
}

/// `addrs` as the native-endian 64-bit words [`words`] reads.
fn to_words(addrs: impl IntoIterator<Item = usize>) -> Vec<u8> {
    addrs.into_iter().flat_map(|a| (a as u64).to_ne_bytes()).collect()
}

/// Whether `params[i].grad is grads[i]` for every `i` (the lists of equal length), read through
/// torch's `grad` getter in one pass, and, with `addrs` (see [`words`]), whether each
/// `grads[i].data_ptr() == addrs[i]` too, in the same pass; None when the probes are not set. A
/// parameter or gradient that is not a plain tensor, or a getter that raises, makes it False.
#[pyfunction]
#[pyo3(signature = (params, grads, addrs=None))]
fn grads_are(
    py: Python<'_>,
    params: &Bound<'_, PyList>,
    grads: &Bound<'_, PyList>,
    addrs: Option<&[u8]>,
) -> PyResult<Option<bool>> {
    let Some(probes) = PROBES.get(py) else { return Ok(None) };
    let n = params.len();
    let wanted: Option<Vec<usize>> = addrs.map(words).transpose()?.map(Iterator::collect);
    if n != grads.len() || wanted.as_ref().is_some_and(|w| w.len() != n) {
        return Ok(Some(false));
    }
    let ahead = prefetch::offsets().filter(|_| prefetch::cold(n));
    for (i, (p, g)) in params.iter().zip(grads.iter()).enumerate() {
        if let Some(o) = ahead {
            // SAFETY: the GIL is held and `params` is a live list.
            unsafe { probes.ahead(o, params, i, prefetch::GRAD) };
        }
        // SAFETY: `p` and `g` are live (the lists hold them), the GIL is held, and the getters
        // are called on plain tensors only; the new reference is released.
        let same = unsafe {
            let ptr = p.as_ptr();
            if !probes.is_plain(ptr) {
                return Ok(Some(false));
            }
            let Some(grad) = probes.get(&probes.grad, ptr) else { return Ok(Some(false)) };
            let same = grad == g.as_ptr();
            ffi::Py_DECREF(grad);
            // A list that grew under a getter has no wanted address past its first length.
            let at = |w: &Vec<usize>| w.get(i).copied();
            same && wanted.as_ref().is_none_or(|w| at(w).is_some() && probes.addr_of(g.as_ptr()) == at(w))
        };
        if !same {
            return Ok(Some(false));
        }
    }
    // A getter may have run Python code (a torch function mode) that shrank a list.
    Ok(Some(params.len() == grads.len() && params.len() == n))
}

/// The index of the first pair `a[i]`, `b[i]` whose shapes differ (torch's `shape` getter, the
/// sizes compared as Python compares them), -1 when none does; None when the probes are not set,
/// the lists differ in length (also after a getter ran Python code, under a torch function mode),
/// a tensor is not plain or a getter raises: the caller then compares them itself, which names
/// the problem as torch would.
#[pyfunction]
fn shape_mismatch(py: Python<'_>, a: &Bound<'_, PyList>, b: &Bound<'_, PyList>) -> PyResult<Option<isize>> {
    let Some(probes) = PROBES.get(py) else { return Ok(None) };
    let n = a.len();
    if b.len() != n {
        return Ok(None);
    }
    for i in 0..n {
        // Bounds-checked at every step: a getter may have run Python code that shrank a list.
        let (Ok(x), Ok(y)) = (a.get_item(i), b.get_item(i)) else { return Ok(None) };
        // SAFETY: `x` and `y` are live (owned references), the GIL is held, the getter is called on
        // plain tensors only, and both new references are released.
        let same = unsafe {
            if !probes.is_plain(x.as_ptr()) || !probes.is_plain(y.as_ptr()) {
                return Ok(None);
            }
            let Some(sx) = probes.get(&probes.shape, x.as_ptr()) else { return Ok(None) };
            let Some(sy) = probes.get(&probes.shape, y.as_ptr()) else {
                ffi::Py_DECREF(sx);
                return Ok(None);
            };
            let same = ffi::PyObject_RichCompareBool(sx, sy, ffi::Py_EQ);
            ffi::Py_DECREF(sx);
            ffi::Py_DECREF(sy);
            if same < 0 {
                ffi::PyErr_Clear();
                return Ok(None);
            }
            same == 1
        };
        if !same {
            return Ok(Some(i as isize));
        }
    }
    Ok(Some(-1))
}

/// Whether `tensors[i].data_ptr() == addrs[i]` for every `i` (`addrs`: see [`words`]), through
/// torch's `data_ptr` in one pass; None when the probes are not set. A tensor that is not plain,
/// or whose `data_ptr` raises, makes it False.
#[pyfunction]
fn addrs_are(py: Python<'_>, tensors: &Bound<'_, PyList>, addrs: &[u8]) -> PyResult<Option<bool>> {
    let Some(probes) = PROBES.get(py) else { return Ok(None) };
    let wanted: Vec<usize> = words(addrs)?.collect();
    if tensors.len() != wanted.len() {
        return Ok(Some(false));
    }
    let ahead = prefetch::offsets().filter(|_| prefetch::cold(wanted.len()));
    for (i, (t, &want)) in tensors.iter().zip(&wanted).enumerate() {
        if let Some(o) = ahead {
            // SAFETY: the GIL is held and `tensors` is a live list.
            unsafe { probes.ahead(o, tensors, i, prefetch::PROBE) };
        }
        // SAFETY: `t` is live (the list holds it) and the GIL is held.
        if unsafe { probes.addr_of(t.as_ptr()) } != Some(want) {
            return Ok(Some(false));
        }
    }
    // As in `grads_are`.
    Ok(Some(tensors.len() == wanted.len()))
}

impl Probes {
    /// The prefetches of a walk over `list` at item `i` (see [`prefetch`]): each of `steps` for
    /// the item as far ahead as the step says, when that item is a plain tensor.
    ///
    /// # Safety
    /// The GIL is held and `list` is a live list.
    unsafe fn ahead(&self, o: &prefetch::Offsets, list: &Bound<'_, PyList>, i: usize, steps: &[(usize, Step)]) {
        let ptr = list.as_ptr();
        for &(distance, step) in steps {
            let j = i + distance;
            // SAFETY: the GIL is held; `j` is checked against the list's current length (a
            // getter may run Python code, under a torch function mode, that shrinks it), and the
            // borrowed item is used before anything else runs.
            unsafe {
                if (j as ffi::Py_ssize_t) >= ffi::PyList_Size(ptr) {
                    continue;
                }
                let obj = ffi::PyList_GetItem(ptr, j as ffi::Py_ssize_t);
                if obj.is_null() {
                    ffi::PyErr_Clear();
                    continue;
                }
                if self.is_plain(obj) {
                    prefetch::take(o, obj as *const u8, step);
                }
            }
        }
    }

    /// Whether `t`'s type is exactly one of the plain tensor types (`torch.Tensor`, `nn.Parameter`).
    fn is_plain(&self, t: *mut ffi::PyObject) -> bool {
        // SAFETY: `t` is a live object (every caller holds it) and the GIL is held.
        let ty = unsafe { ffi::Py_TYPE(t) } as *mut ffi::PyObject;
        self.plain.iter().any(|p| p.as_ptr() == ty)
    }

    /// Calls a getter: a new reference, or None with the error cleared.
    unsafe fn get(&self, g: &Getter, t: *mut ffi::PyObject) -> Option<*mut ffi::PyObject> {
        // SAFETY: the caller's: `t` is a live torch tensor of a plain type, the GIL is held.
        let r = unsafe { (g.get)(t, g.closure) };
        Self::checked(r)
    }

    /// Calls a method with no arguments: a new reference, or None with the error cleared.
    unsafe fn call(&self, m: &Method, t: *mut ffi::PyObject) -> Option<*mut ffi::PyObject> {
        // SAFETY: as in `get`; the flags checked in `method_of` chose the signature.
        let r = unsafe {
            match m {
                Method::NoArgs(f) => f(t, std::ptr::null_mut()),
                Method::Keywords(f) => f(t, self.empty.as_ptr(), std::ptr::null_mut()),
            }
        };
        Self::checked(r)
    }

    /// Calls a method that takes keyword arguments with `kwargs` only: a new reference, or None
    /// with the error cleared (None also for a method without keyword arguments).
    unsafe fn call_kw(&self, m: &Method, t: *mut ffi::PyObject, kwargs: &Py<PyDict>) -> Option<*mut ffi::PyObject> {
        let Method::Keywords(f) = m else { return None };
        // SAFETY: as in `get`; the flags checked in `method_of` chose the signature.
        Self::checked(unsafe { f(t, self.empty.as_ptr(), kwargs.as_ptr()) })
    }

    fn checked(r: *mut ffi::PyObject) -> Option<*mut ffi::PyObject> {
        if r.is_null() {
            // SAFETY: the GIL is held (every caller is a pymethod).
            unsafe { ffi::PyErr_Clear() };
            None
        } else {
            Some(r)
        }
    }

    /// One tensor: its data address when it is what `want` describes (see
    /// [`TensorList::probe`]; contiguous in memory format `format`), else None.
    ///
    /// # Safety
    /// `t` is a live object and the GIL is held.
    unsafe fn probe_one(
        &self,
        t: *mut ffi::PyObject,
        want: &RawTensor,
        writing: bool,
        signed: bool,
        format: u8,
    ) -> Option<usize> {
        // SAFETY: the getters and methods are called on exact torch.Tensor/nn.Parameter objects
        // only, as Python's attribute lookup would call them; every new reference is released.
        unsafe {
            if !self.is_plain(t) {
                return None;
            }
            let dtype = self.get(&self.dtype, t)?;
            let same = dtype == self.dtypes[want.dtype as usize].as_ptr();
            ffi::Py_DECREF(dtype);
            let nbytes = self.get(&self.nbytes, t)?;
            let size = ffi::PyLong_AsSize_t(nbytes);
            ffi::Py_DECREF(nbytes);
            if !same || size != want.numel * want.dtype.size() {
                ffi::PyErr_Clear();
                return None;
            }
            if format != PERMUTED {
                let contiguous = match format {
                    0 => self.call(&self.is_contiguous, t)?,
                    k => self.call_kw(&self.is_contiguous, t, self.layouts.get(k as usize - 1)?)?,
                };
                let is_true = contiguous == ffi::Py_True();
                ffi::Py_DECREF(contiguous);
                if !is_true {
                    return None;
                }
            }
            if writing {
                // Inference tensors have no version counter: reading it raises.
                ffi::Py_DECREF(self.get(&self.version, t)?);
            }
            if signed {
                let negated = self.call(&self.is_neg, t)?;
                let is_true = negated == ffi::Py_True();
                ffi::Py_DECREF(negated);
                if is_true {
                    return None;
                }
            }
            self.addr_of(t)
        }
    }

    /// `t.get_device()` (-1 for the CPU) when the call answers; else None.
    ///
    /// # Safety
    /// `t` is a live plain tensor and the GIL is held.
    unsafe fn device_of(&self, t: *mut ffi::PyObject) -> Option<i64> {
        // SAFETY: the caller's; the new reference is released.
        unsafe {
            let index = self.call(&self.get_device, t)?;
            let value = ffi::PyLong_AsLongLong(index);
            ffi::Py_DECREF(index);
            if value == -1 && !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear();
                return None;
            }
            Some(value)
        }
    }

    /// `t.data_ptr()` when `t` is a plain tensor and the call answers; else None.
    ///
    /// # Safety
    /// `t` is a live object and the GIL is held.
    unsafe fn addr_of(&self, t: *mut ffi::PyObject) -> Option<usize> {
        if !self.is_plain(t) {
            return None;
        }
        // SAFETY: the caller's; `data_ptr` is called on a plain tensor, its reference released.
        unsafe {
            let addr = self.call(&self.data_ptr, t)?;
            let value = ffi::PyLong_AsSize_t(addr);
            ffi::Py_DECREF(addr);
            if value == usize::MAX && !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear();
                return None;
            }
            Some(value)
        }
    }
}

/// Writes `values` as `dtype` to `addr`.
///
/// # Safety
/// `addr` is the data of a live, contiguous tensor of `dtype` with at least `values.len()`
/// elements that nothing else reads or writes during the call (the Python layer allocates it
/// just before the call).
unsafe fn write_out(addr: usize, dtype: DType, values: &[f64]) -> PyResult<()> {
    if values.is_empty() {
        return Ok(());
    }
    if addr == 0 || addr % dtype.size() != 0 {
        return Err(PyValueError::new_err(format!("bad output address {addr:#x}")));
    }
    // SAFETY: non-null and aligned (checked); size, liveness and exclusivity per the contract.
    unsafe {
        match dtype {
            DType::F64 => std::slice::from_raw_parts_mut(addr as *mut f64, values.len()).copy_from_slice(values),
            _ => {
                let out = std::slice::from_raw_parts_mut(addr as *mut f32, values.len());
                out.iter_mut().zip(values).for_each(|(o, v)| *o = *v as f32);
            }
        }
    }
    Ok(())
}

fn write_norms(r: &NormResult, total_addr: usize, per_tensor_addr: usize, dtype: DType) -> PyResult<f64> {
    let total = dtype.round(r.total);
    // SAFETY: both addresses come from tensors `gradfuse._cpu` allocates for this call
    // (0-d for the total, one element per tensor for the per-tensor norms).
    unsafe {
        write_out(total_addr, dtype, &[total])?;
        if per_tensor_addr != 0 {
            write_out(per_tensor_addr, dtype, &r.per_tensor)?;
        }
    }
    Ok(total)
}

/// Norm of every tensor and of all together. Writes the total (0-d) and, when
/// `per_tensor_addr` is non-zero, the per-tensor norms, as `out_code`; returns the total
/// as rounded to that dtype.
#[pyfunction]
fn norm(
    py: Python<'_>,
    tensors: &Bound<'_, TensorList>,
    norm_type: f64,
    total_addr: usize,
    per_tensor_addr: usize,
    out_code: u8,
) -> PyResult<f64> {
    let tl = tensors.get();
    let dtype = out_dtype(out_code)?;
    let r = py.detach(|| norms::norm(&tl.slices(), norm_type)).map_err(|e| tl.err(e))?;
    write_norms(&r, total_addr, per_tensor_addr, dtype)
}

/// One pass: the norm of `x * inv_scale` and whether any `x` is inf/NaN, read-only, or with
/// `in_place` also writing `x *= inv_scale` (read and written once). Writes the total as
/// `out_code`; returns `(total, found_inf)`.
#[pyfunction]
#[pyo3(signature = (tensors, inv_scale, norm_type, total_addr, out_code, in_place=false))]
fn unscale_check_norm(
    py: Python<'_>,
    tensors: &Bound<'_, TensorList>,
    inv_scale: f64,
    norm_type: f64,
    total_addr: usize,
    out_code: u8,
    in_place: bool,
) -> PyResult<(f64, bool)> {
    let tl = tensors.get();
    let dtype = out_dtype(out_code)?;
    let r = if in_place {
        let views = tl.slices_mut(None)?;
        py.detach(|| norms::unscale_norm_(views, inv_scale, norm_type))
    } else {
        py.detach(|| norms::unscale_check_norm(&tl.slices(), inv_scale, norm_type))
    };
    let r = r.map_err(|e| tl.err(e))?;
    Ok((write_norms(&r, total_addr, 0, dtype)?, r.found_inf))
}

/// Gradient-health statistics in one read: writes the total norm (0-d) and the per-tensor
/// norms and largest magnitudes as `out_code`, and the per-tensor non-finite counts as int64.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn stats(
    py: Python<'_>,
    tensors: &Bound<'_, TensorList>,
    norm_type: f64,
    total_addr: usize,
    norms_addr: usize,
    amax_addr: usize,
    nonfinite_addr: usize,
    out_code: u8,
) -> PyResult<()> {
    let tl = tensors.get();
    let dtype = out_dtype(out_code)?;
    let r = py.detach(|| health::stats(&tl.slices(), norm_type)).map_err(|e| tl.err(e))?;
    if !r.nonfinite.is_empty() && (nonfinite_addr == 0 || nonfinite_addr % 8 != 0) {
        return Err(PyValueError::new_err(format!("bad output address {nonfinite_addr:#x}")));
    }
    // SAFETY: every address comes from a tensor `gradfuse._cpu` allocates for this call: 0-d
    // for the total, one element per tensor for the others (the counts int64, checked aligned
    // and non-null above), which nothing else touches during the call.
    unsafe {
        write_out(total_addr, dtype, &[r.total])?;
        write_out(norms_addr, dtype, &r.norms)?;
        write_out(amax_addr, dtype, &r.amax)?;
        if !r.nonfinite.is_empty() {
            let out = std::slice::from_raw_parts_mut(nonfinite_addr as *mut i64, r.nonfinite.len());
            out.iter_mut().zip(&r.nonfinite).for_each(|(o, &c)| *o = c as i64);
        }
    }
    Ok(())
}

/// The `norm_type`-norm of every unit (`units[i]` equal parts of tensor `i`), written as
/// `out_code` to `out_addr` (one element per unit, tensor by tensor).
#[pyfunction]
fn unit_norms(
    py: Python<'_>,
    tensors: &Bound<'_, TensorList>,
    units: Vec<usize>,
    norm_type: f64,
    out_addr: usize,
    out_code: u8,
) -> PyResult<()> {
    let tl = tensors.get();
    let dtype = out_dtype(out_code)?;
    let norms = py.detach(|| unitwise::unit_norms(&tl.slices(), &units, norm_type)).map_err(|e| tl.err(e))?;
    // SAFETY: `out_addr` is the data of a tensor `gradfuse._cpu` allocates for this call, with
    // one element of `out_code` per unit.
    unsafe { write_out(out_addr, dtype, &norms) }
}

/// `x *= factor` per unit (numbered as by `unit_norms`); the factors are read from a float32 or
/// float64 tensor (`factors_code`) at `factors_addr` with one element per unit.
#[pyfunction]
fn scale_units_(
    py: Python<'_>,
    tensors: &Bound<'_, TensorList>,
    units: Vec<usize>,
    factors_addr: usize,
    factors_code: u8,
) -> PyResult<()> {
    let tl = tensors.get();
    let dtype = out_dtype(factors_code)?;
    let n: usize = units.iter().sum();
    if n > 0 && (factors_addr == 0 || factors_addr % dtype.size() != 0) {
        return Err(PyValueError::new_err(format!("bad factors address {factors_addr:#x}")));
    }
    // SAFETY: non-null and aligned (checked); the Python layer passes a live contiguous tensor
    // of `dtype` with one element per unit, which no kernel of this call writes.
    let factors: Vec<f64> = unsafe {
        match (n, dtype) {
            (0, _) => Vec::new(),
            (_, DType::F64) => std::slice::from_raw_parts(factors_addr as *const f64, n).to_vec(),
            _ => std::slice::from_raw_parts(factors_addr as *const f32, n).iter().map(|&f| f as f64).collect(),
        }
    };
    let views = tl.slices_mut(None)?;
    py.detach(|| unitwise::scale_units(views, &units, &factors)).map_err(|e| tl.err(e))
}

/// `x *= scale` in place (nothing is touched when `scale == 1`).
#[pyfunction]
fn scale_(py: Python<'_>, tensors: &Bound<'_, TensorList>, scale: f64) -> PyResult<()> {
    let tl = tensors.get();
    let views = tl.slices_mut(None)?;
    if scale == 1.0 {
        return Ok(()); // x * 1 is x: nothing to write, and no thread to hand the GIL to
    }
    py.detach(|| elementwise::scale(views, scale));
    Ok(())
}

/// torch's clip coefficient `clamp(max_norm / (total + 1e-6), max=1)` in the arithmetic of
/// the dtype `code` (the dtype of the total-norm tensor).
#[pyfunction]
fn clip_coef(total_norm: f64, max_norm: f64, code: u8) -> PyResult<f64> {
    let dtype = DType::from_code(code).ok_or_else(|| PyTypeError::new_err(format!("unknown dtype code {code}")))?;
    Ok(elementwise::clip_coef(total_norm, max_norm, dtype))
}

/// `x *= inv_scale` in place; returns whether any `x` was inf/NaN before scaling.
#[pyfunction]
fn unscale_and_check_(py: Python<'_>, tensors: &Bound<'_, TensorList>, inv_scale: f64) -> PyResult<bool> {
    let tl = tensors.get();
    let views = tl.slices_mut(None)?;
    Ok(py.detach(|| elementwise::unscale_and_check(views, inv_scale)))
}

/// `x = min(max(x, lo), hi)` in place.
#[pyfunction]
fn clamp_(py: Python<'_>, tensors: &Bound<'_, TensorList>, lo: f64, hi: f64) -> PyResult<()> {
    let tl = tensors.get();
    let views = tl.slices_mut(None)?;
    py.detach(|| elementwise::clamp(views, lo, hi));
    Ok(())
}

/// `dst[i] += alpha * src[i]`. `src[i]` may be `dst[i]` itself, but no other source may
/// overlap any target.
#[pyfunction]
fn accumulate_(py: Python<'_>, dst: &Bound<'_, TensorList>, src: &Bound<'_, TensorList>, alpha: f64) -> PyResult<()> {
    let (d, s) = (dst.get(), src.get());
    let named = |e: Error| to_py(e, &d.name, &s.name);
    if d.tensors.len() != s.tensors.len() {
        return Err(named(Error::LengthMismatch {
            what: "accumulate_",
            left: d.tensors.len(),
            right: s.tensors.len(),
        }));
    }
    let same: Vec<bool> = d.tensors.iter().zip(&s.tensors).map(|(a, b)| a == b).collect();
    let views = d.slices_mut(Some((s, &same)))?;
    let sources = s.slices();
    py.detach(|| elementwise::accumulate(views, &sources, alpha)).map_err(named)
}

/// The bucket layout of parameters with these element counts and dtype codes, placed in
/// `order` (see `bucket::plan`). Returns `(slots, buckets)`: `slots[i] = (bucket, offset)` of
/// parameter `i` (offset in elements) and `buckets[b] = (dtype code, numel, parameters)`.
#[pyfunction]
fn plan_buckets(
    numels: Vec<usize>,
    codes: Vec<u8>,
    order: Vec<usize>,
    cap_bytes: usize,
    first_cap_bytes: usize,
    align_bytes: usize,
    world_size: usize,
) -> PyResult<BucketLayout> {
    let dtypes = codes
        .iter()
        .enumerate()
        .map(|(index, &code)| DType::from_code(code).ok_or(Error::UnknownDType { index, code }))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| to_py(e, "params", ""))?;
    let opts = bucket::Options { cap_bytes, first_cap_bytes, align_bytes, world_size };
    let plan = bucket::plan(&numels, &dtypes, &order, &opts).map_err(|e| to_py(e, "params", ""))?;
    let slots = plan.slots.iter().map(|s| (s.bucket, s.offset)).collect();
    let buckets = plan.buckets.into_iter().map(|b| (b.dtype as u8, b.numel, b.params)).collect();
    Ok((slots, buckets))
}

type BucketLayout = (Vec<(usize, usize)>, Vec<(u8, usize, Vec<usize>)>);

/// Indices `(i, j)` of two strided views that share a byte while at least one is written, or
/// `(i, i)` for a written view whose own elements share memory; `None` if there are none. Each
/// view is torch's `data_ptr()`, `element_size()`, `shape` and `stride()`. Exact for any
/// layout: spans first, then arithmetic, then (only for views still in doubt) their bytes.
#[pyfunction]
fn find_strided_overlap(
    py: Python<'_>,
    addrs: Vec<usize>,
    itemsizes: Vec<usize>,
    shapes: Vec<Vec<usize>>,
    strides: Vec<Vec<usize>>,
    written: Vec<bool>,
) -> PyResult<Option<(usize, usize)>> {
    let n = addrs.len();
    if [itemsizes.len(), shapes.len(), strides.len(), written.len()].iter().any(|&m| m != n) {
        return Err(PyValueError::new_err("find_strided_overlap: the argument lists differ in length"));
    }
    if shapes.iter().zip(&strides).any(|(a, b)| a.len() != b.len()) {
        return Err(PyValueError::new_err("find_strided_overlap: a shape and its strides differ in length"));
    }
    let views: Vec<Strided> =
        (0..n).map(|i| Strided::from_torch(addrs[i], itemsizes[i], &shapes[i], &strides[i])).collect();
    Ok(py.detach(|| find_strided_conflict(&views, &written)))
}

/// Number of threads the CPU kernels run on.
#[pyfunction]
fn num_threads() -> usize {
    parallel::num_threads()
}

/// Run the CPU kernels on the OpenMP runtime (torch's) whose entry points are at these
/// addresses: `GOMP_parallel`, `omp_get_thread_num`, `omp_get_num_threads`,
/// `omp_get_max_threads`. Returns whether they are in use.
///
/// The addresses come from `ctypes` lookups of a runtime loaded in this process for good,
/// which is all `parallel::use_openmp` asks.
#[pyfunction]
fn use_openmp(parallel: usize, thread_num: usize, num_threads: usize, max_threads: usize) -> bool {
    // SAFETY: see above; the Python layer passes only addresses of those four symbols.
    unsafe { parallel::use_openmp(parallel, thread_num, num_threads, max_threads) }
}

/// Whether the CPU kernels run on an OpenMP team (see `use_openmp`), else on rayon's pool.
#[pyfunction]
fn on_openmp() -> bool {
    parallel::on_openmp()
}

#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TensorList>()?;
    m.add_function(wrap_pyfunction!(set_probes, m)?)?;
    m.add_function(wrap_pyfunction!(grads_of, m)?)?;
    m.add_function(wrap_pyfunction!(prefetch_setup, m)?)?;
    m.add_function(wrap_pyfunction!(prefetch_moving, m)?)?;
    m.add_function(wrap_pyfunction!(backend_env, m)?)?;
    m.add_function(wrap_pyfunction!(grads_are, m)?)?;
    m.add_function(wrap_pyfunction!(addrs_are, m)?)?;
    m.add_function(wrap_pyfunction!(shape_mismatch, m)?)?;
    m.add_function(wrap_pyfunction!(norm, m)?)?;
    m.add_function(wrap_pyfunction!(unscale_check_norm, m)?)?;
    m.add_function(wrap_pyfunction!(stats, m)?)?;
    m.add_function(wrap_pyfunction!(unit_norms, m)?)?;
    m.add_function(wrap_pyfunction!(scale_units_, m)?)?;
    m.add_function(wrap_pyfunction!(scale_, m)?)?;
    m.add_function(wrap_pyfunction!(clip_coef, m)?)?;
    m.add_function(wrap_pyfunction!(unscale_and_check_, m)?)?;
    m.add_function(wrap_pyfunction!(clamp_, m)?)?;
    m.add_function(wrap_pyfunction!(accumulate_, m)?)?;
    m.add_function(wrap_pyfunction!(plan_buckets, m)?)?;
    m.add_function(wrap_pyfunction!(find_strided_overlap, m)?)?;
    m.add_function(wrap_pyfunction!(num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(use_openmp, m)?)?;
    m.add_function(wrap_pyfunction!(on_openmp, m)?)?;
    Ok(())
}
