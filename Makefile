# One set of targets for people, hooks and CI (.ci/run calls `make ci`).
PYTHON ?= python

.PHONY: install dev test lint rust-test bench wheel ci

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

ci: install lint rust-test test
