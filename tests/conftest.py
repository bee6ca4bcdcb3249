"""Shared test setup.

Without a GPU, Triton kernels run under the interpreter (``TRITON_INTERPRET=1``) on CPU
tensors; the variable must be set before ``gradfuse.kernels`` is first imported, which this
file does. Tests marked ``cuda`` are skipped when no GPU is present.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import process_state

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Kernels are fast but inputs are random and sizes vary: no per-example deadline. CI (2 cores,
# Triton interpreter) uses fewer examples than a local run.
settings.register_profile("default", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "default")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _process_state_restored():
    """What a test sets for the whole process (environment variables such as GRADFUSE_BACKEND,
    the default device, SIGINT/SIGTERM handlers, CUDA's sync debug mode) is back as it was after
    the test, even when the test failed or the setter raised half way; a test that left any of
    it changed fails its teardown, naming what (process_state.py)."""
    before = process_state.snapshot()
    yield
    changed = process_state.restore(before)
    if changed:
        pytest.fail("the test left process state changed (now restored): " + "; ".join(changed), pytrace=False)


@pytest.fixture(autouse=True)
def _seed():
    """Fresh but reproducible random inputs per test (the seed is printed on failure by pytest -ra)."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little") if os.environ.get("GRADFUSE_RANDOM_SEED") else 0)


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_TRITON = pytest.param("triton", marks=pytest.mark.skipif(not _INTERPRETED, reason="needs TRITON_INTERPRET=1"))


@pytest.fixture(params=["rust", _TRITON])
def backend(request, monkeypatch):
    """Each test on the Rust core and on the Triton kernels (under the interpreter here, with
    chunks and blocks shrunk so that small inputs cross their edges)."""
    monkeypatch.setenv("GRADFUSE_BACKEND", request.param)
    if request.param == "triton":
        from gradfuse.kernels import _chunk_table as ct

        monkeypatch.setattr(ct, "CHUNK", 64)
        monkeypatch.setattr(ct, "BLOCK", 16)
        monkeypatch.setattr(ct, "FBLOCK", 4)
    return request.param
