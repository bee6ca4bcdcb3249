"""Process-wide state that tests set, set with the warnings of each torch version handled, and a
snapshot that conftest.py's autouse fixture takes before every test and puts back after it.

A test that sets such state and then fails (or whose setter raises half way, as torch 2.11's
``set_sync_debug_mode`` does under ``filterwarnings = error``: it warns after the mode is set)
must not leave it to the next test in the same worker: on the first GPU run a sync debug mode
left at "error" failed a dozen unrelated tests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import warnings

import torch

#: Environment variables tests set (through monkeypatch, or by hand inside hypothesis examples).
ENV_VARS = ("GRADFUSE_BACKEND", "TRITON_INTERPRET")
SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)


def set_sync_debug_mode(mode: int | str) -> None:
    """``torch.cuda.set_sync_debug_mode(mode)``. torch 2.11 warns on every call that the mode
    "is a prototype feature and does not yet detect all synchronizing operations" (a UserWarning
    from C++, raised after the mode is set): known, and not about gradfuse. Only that warning is
    ignored, only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Synchronization debug mode is a prototype feature", category=UserWarning
        )
        torch.cuda.set_sync_debug_mode(mode)


@contextlib.contextmanager
def sync_debug_mode(mode: int | str = "error"):
    """Synchronizing CUDA operations raise (``"error"``) inside the block; the previous mode is
    back after it, even when setting the mode raised."""
    before = torch.cuda.get_sync_debug_mode()
    try:
        set_sync_debug_mode(mode)
        yield
    finally:
        set_sync_debug_mode(before)


def _default_device() -> torch.device | None:
    # get_default_device() says "cpu" both when nothing is set and when "cpu" was set; either
    # way, None puts back torch's own default.
    device = torch.get_default_device()
    return None if device.type == "cpu" else device


def snapshot() -> dict:
    state = {
        "env": {name: os.environ.get(name) for name in ENV_VARS},
        "default device": _default_device(),
        "signal handlers": {sig: signal.getsignal(sig) for sig in SIGNALS},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["sync debug mode"] = torch.cuda.get_sync_debug_mode()
    return state


def restore(before: dict) -> list[str]:
    """Put back what differs from ``before``; returns what did (empty when nothing)."""
    changed = []
    for name, value in before["env"].items():
        if os.environ.get(name) != value:
            changed.append(f"${name}={os.environ.get(name)!r} (was {value!r})")
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if _default_device() != before["default device"]:
        changed.append(f"default device {_default_device()} (was {before['default device']})")
        torch.set_default_device(before["default device"])
    for sig, handler in before["signal handlers"].items():
        if signal.getsignal(sig) is not handler:
            changed.append(f"{signal.Signals(sig).name} handler {signal.getsignal(sig)!r} (was {handler!r})")
            signal.signal(sig, handler)
    mode = before.get("sync debug mode", 0)
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.get_sync_debug_mode() != mode:
        changed.append(f"CUDA sync debug mode {torch.cuda.get_sync_debug_mode()} (was {mode})")
        set_sync_debug_mode(mode)
    return changed
