#!/usr/bin/env bash
# Run every check: formatting and lints (cargo fmt, clippy on both crates, ruff), the type stub
# of the native module (mypy's stubtest), the Rust unit and property tests (dispatched SIMD path,
# then once more with KVQRS_FORCE_SCALAR=1), then the Python suite (hypothesis oracle
# comparisons, invariants, error handling). Needs scripts/setup.sh first.
# Each step prints its wall time; the first failure stops the run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
export HF_HUB_OFFLINE=1  # nothing may download weights or data at run time
export PYO3_PYTHON="$PWD/.venv/bin/python"  # clippy on rust/py builds pyo3 against the venv's Python

step() {
    local name="$1"; shift
    local start=$SECONDS
    echo "== $name"
    "$@"
    echo "== $name: ok ($((SECONDS - start)) s)"
}

PY_SOURCES=(python tests benches)
step "cargo fmt --check" cargo fmt --all --check
step "cargo clippy (kvqrs-core, kvqrs-py)" cargo clippy --workspace --all-targets -- -D warnings
step "ruff check" .venv/bin/ruff check "${PY_SOURCES[@]}"
step "ruff format --check" .venv/bin/ruff format --check "${PY_SOURCES[@]}"
step "stubtest kvqrs._native" .venv/bin/python -m mypy.stubtest kvqrs._native
step "cargo test (dispatched SIMD)" cargo test -p kvqrs-core
step "cargo test (KVQRS_FORCE_SCALAR=1)" env KVQRS_FORCE_SCALAR=1 cargo test -p kvqrs-core
step "pytest" .venv/bin/python -m pytest -q
