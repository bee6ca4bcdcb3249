"""Where this torch keeps a tensor's pointers, for the Rust core's prefetches (``rust/prefetch.rs``).

The probes of a long list of tensors (``TensorList.probe``, ``grads_of``) call torch's getters
tensor by tensor; after a pass over a model's data every object those getters touch is a cache
miss, one after the other. The Rust core prefetches them a few tensors ahead when it knows five
offsets of torch's private layout: in a tensor's Python object, its ``TensorImpl``; in the
``TensorImpl``, its storage, its autograd metadata and its version counter; in the autograd
metadata, the gradient's ``TensorImpl``. They are found here on sample tensors made for the
purpose, by what torch says of them in public (``_cdata``, ``untyped_storage()._cdata``, a view
sharing the version counter, ``.data`` not sharing it, ``.grad._cdata``), and
handed over only when each is found at exactly one place. The offsets only choose addresses to
prefetch: a wrong one costs speed, never a result (the module docs of ``rust/prefetch.rs`` say
which bytes are read).
"""

from __future__ import annotations

import ctypes

import torch

#: What the Rust core may read (``prefetch::OBJECT_BYTES``, ``prefetch::IMPL_BYTES``).
OBJECT_BYTES = 40
IMPL_BYTES = 64


def _word(addr: int) -> int:
    return ctypes.c_uint64.from_address(addr).value


def _only(candidates: list[int]) -> int | None:
    return candidates[0] if len(candidates) == 1 else None


def find_offsets() -> tuple[int, int, int, int, int] | None:
    """``(cdata, storage, meta, version, grad)`` in bytes, each found at exactly one place on sample
    tensors, or None (no prefetches) when one is not, or when this is not a 64-bit CPython whose
    tensor objects have the basic size the Rust core reads within."""
    if ctypes.sizeof(ctypes.c_void_p) != 8 or torch._C.TensorBase.__basicsize__ < OBJECT_BYTES:
        return None
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    samples = [torch.zeros(3), param, torch.ones(5, dtype=torch.float64), param.grad]
    object_words = range(16, OBJECT_BYTES, 8)  # past the reference count and the type
    cdata = _only([k for k in object_words if all(_word(id(t) + k) == t._cdata for t in samples)])
    if cdata is None:
        return None
    impl_words = range(8, IMPL_BYTES, 8)  # past the vtable pointer

    def at(t: torch.Tensor, k: int) -> int:
        return _word(t._cdata + k)

    storage = _only([k for k in impl_words if all(at(t, k) == t.untyped_storage()._cdata for t in samples)])
    # Autograd metadata: none on a plain tensor, its own (a distinct, aligned pointer) on each
    # tensor that requires grad. Nothing else is null on the one and such on the others: it is
    # read through below, so it must be a pointer.
    plain, tracked = torch.zeros(3), torch.zeros(3, requires_grad=True)
    params = [param, torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    params[1].grad = torch.ones(4, dtype=torch.float64)
    owners = [tracked, *params]
    meta = _only(
        [
            k
            for k in impl_words
            if at(plain, k) == 0
            and all(at(t, k) != 0 and at(t, k) % 8 == 0 for t in owners)
            and len({at(t, k) for t in owners}) == len(owners)
        ]
    )
    # The version counter: shared with a view, not with .data (which shares the storage).
    base = torch.zeros(3)
    view, data = base.view(3), base.data
    version = _only(
        [k for k in impl_words if at(base, k) != 0 and at(base, k) == at(view, k) and at(base, k) != at(data, k)]
    )
    if storage is None or meta is None or version is None:
        return None
    # In a parameter's autograd metadata (its first 64 bytes, as in the TensorImpl): its
    # gradient's TensorImpl.
    metas = [at(p, meta) for p in params]
    grad = _only(
        [k for k in impl_words if all(_word(m + k) == p.grad._cdata for m, p in zip(metas, params, strict=True))]
    )
    if grad is None:
        return None
    return cdata, storage, meta, version, grad
