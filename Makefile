# One set of targets for people, hooks and CI (.ci/run calls `make ci`).
PYTHON ?= python
# Recipes run in bash with pipefail, so that `cmd | tee log` fails when cmd does.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
# Where `make gpu-check` writes its logs (the benchmark's records go to benches/results/ as usual).
GPU_OUT ?= benches/results/gpu-check

.PHONY: install dev test lint rust-test bench wheel ci gpu-compile gpu-check

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

gpu-check:          ## the one command a GPU machine runs: the CUDA tests, then the GPU benchmark (README, "GPU")
	@$(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: torch sees no CUDA GPU')"
	mkdir -p $(GPU_OUT)
	nvidia-smi > $(GPU_OUT)/nvidia-smi.txt 2>&1 || true
	$(PYTHON) -c "import platform, torch, triton, gradfuse; print('python', platform.python_version()); \
		print('torch', torch.__version__, 'cuda', torch.version.cuda); print('triton', triton.__version__); \
		print('gradfuse', gradfuse.__version__, gradfuse.__file__); print(torch.cuda.get_device_name())" \
		| tee $(GPU_OUT)/versions.txt
	tests=0; bench=0; \
	$(PYTHON) -m pytest -m cuda -p no:cacheprovider -ra --junitxml=$(GPU_OUT)/cuda-tests.xml 2>&1 \
		| tee $(GPU_OUT)/cuda-tests.log || tests=$$?; \
	$(PYTHON) -m gradfuse bench --device cuda --out benches/results 2>&1 | tee $(GPU_OUT)/bench.log || bench=$$?; \
	echo "gpu-check: CUDA tests exit $$tests, benchmark exit $$bench; logs in $(GPU_OUT)/, records in benches/results/"; \
	test $$tests -eq 0 && test $$bench -eq 0

ci: install lint rust-test test
