"""The package as users get it: the wheel holds the Rust extension and the Triton kernels and
works from a clean virtual environment, away from the source tree; the type stub matches the
compiled module."""

from __future__ import annotations

import ast
import inspect
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from gradfuse import _rust

ROOT = Path(__file__).resolve().parents[1]


def _stub_api() -> dict[str, list[str] | None]:
    """Public names of python/gradfuse/_rust.pyi, with parameter names for functions."""
    tree = ast.parse((ROOT / "python" / "gradfuse" / "_rust.pyi").read_text())
    api: dict[str, list[str] | None] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            api[node.name] = [a.arg for a in node.args.args]
        elif isinstance(node, ast.ClassDef):
            api[node.name] = None
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    api[f"{node.name}.__init__"] = [a.arg for a in item.args.args[1:]]
        elif isinstance(node, ast.AnnAssign):
            api[node.target.id] = None
    return api


def test_stub_matches_compiled_module():
    stub = _stub_api()
    public = {n for n in dir(_rust) if not n.startswith("_")}
    assert public == {n for n in stub if "." not in n}
    for name, params in stub.items():
        if name.endswith(".__init__"):
            cls = getattr(_rust, name.split(".")[0])
            assert list(inspect.signature(cls).parameters) == params, name
        elif params is not None:
            assert list(inspect.signature(getattr(_rust, name)).parameters) == params, name


CHECK = textwrap.dedent(
    """
    import os, sys, torch
    import gradfuse, gradfuse._rust, gradfuse.kernels
    venv = sys.argv[1]
    for mod in (gradfuse, gradfuse._rust, gradfuse.kernels):
        assert mod.__file__.startswith(venv), (mod.__name__, mod.__file__)
    kernel_files = sorted(p for p in os.listdir(os.path.dirname(gradfuse.kernels.__file__)) if p.endswith(".py"))
    print("kernels:", kernel_files)
    assert os.path.basename(gradfuse._rust.__file__).endswith(".abi3.so")
    g = [torch.randn(1000), torch.randn(33, 7).bfloat16()]
    os.environ["GRADFUSE_BACKEND"] = "rust"
    rust = gradfuse.multi_tensor_norm(g)
    os.environ["GRADFUSE_BACKEND"] = "triton"
    triton = gradfuse.multi_tensor_norm(g)
    assert abs(rust.item() - triton.item()) <= 2e-6 * rust.item(), (rust, triton)
    print("ok", rust.item(), triton.item())
    """
)


@pytest.mark.slow
def test_wheel_works_in_a_clean_venv(tmp_path):
    maturin = shutil.which("maturin")
    if maturin is None:
        pytest.fail("maturin is needed to build the wheel: pip install '.[test]'")
    dist = tmp_path / "dist"
    subprocess.run([maturin, "build", "--release", "--out", str(dist)], cwd=ROOT, check=True)
    (wheel,) = dist.glob("gradfuse-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # torch and its dependencies come from this interpreter's site-packages, seen through a
    # folder of links that leaves out every gradfuse entry (an installed or editable copy),
    # so the only gradfuse the venv can import is the wheel's.
    deps = tmp_path / "deps"
    deps.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if "gradfuse" not in entry.name.lower() and not entry.name.endswith(".pth"):
            (deps / entry.name).symlink_to(entry)
    venv_site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (venv_site / "torch_deps.pth").write_text(f"{deps}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        check=True,
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GRADFUSE_BACKEND")}
    env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(
        [python, "-c", CHECK, str(venv)], cwd=outside, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok" in result.stdout
