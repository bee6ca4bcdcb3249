# One set of targets for people, hooks and CI (.ci/run calls `make ci`).
PYTHON ?= python
# Recipes run in bash with pipefail, so that `cmd | tee log` fails when cmd does.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
# Where `make gpu-check` writes its few files: $OUT when set (a GPU machine's output folder).
GPU_OUT ?= $(if $(OUT),$(OUT),benches/results/gpu-check)
# More flags for tests/gpu_check.py, e.g. GPU_CHECK_FLAGS='--workers 16 --bench-limit 240'.
GPU_CHECK_FLAGS ?=

.PHONY: install dev test lint rust-test bench wheel ci gpu-compile gpu-check gpu-check-dry

install:            ## install as the README tells a new user, with the test tools
	$(PYTHON) -m pip install '.[test]'

dev:                ## editable install for development (rebuild after Rust changes)
	$(PYTHON) -m pip install --no-build-isolation -e '.[test]'

test:               ## the README's test command
	$(PYTHON) -m pytest

rust-test:          ## the pure Rust kernels, without Python
	cargo test --release

lint:
	ruff check .
	ruff format --check .
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings

bench:              ## CPU benchmark against torch; results under benches/results/
	$(PYTHON) -m gradfuse bench --device cpu

wheel:              ## the abi3 wheel (for a GPU machine: carry dist/ and pip install --no-deps)
	maturin build --release --out dist

gpu-compile:        ## every Triton kernel specialization compiled for sm_90 and sm_80 (no GPU needed): table and checks
	$(PYTHON) tests/kernel_compile.py

gpu-check:          ## the one command a GPU machine runs (README, "GPU"): CUDA tests, the CUDA bench, the host probe, in 8.5 min
	$(PYTHON) tests/gpu_check.py --out $(GPU_OUT) $(GPU_CHECK_FLAGS)

gpu-check-dry:      ## gpu-check's plumbing without a GPU: the CUDA tests collect and skip, a quick CPU bench
	$(PYTHON) tests/gpu_check.py --dry-run --workers 2 --out $(GPU_OUT)-dry $(GPU_CHECK_FLAGS)

ci: install lint rust-test test
