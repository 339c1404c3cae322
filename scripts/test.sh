#!/usr/bin/env bash
# Run every check: formatting and lints (cargo fmt, clippy on both crates, ruff), the type stub
# of the native module (mypy's stubtest), the Rust unit and property tests (dispatched SIMD path,
# then once more with KVQRS_FORCE_SCALAR=1), then the Python suite (hypothesis oracle
# comparisons, invariants, error handling), then, when asked (KVQRS_VLLM=1 here or given to
# scripts/setup.sh), the vLLM backend's tests in .venv-vllm (scripts/test-vllm.sh), where a
# missing or broken .venv-vllm fails the run. Needs scripts/setup.sh first.
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

# Whether the last step, the vLLM tests, runs: decided (and a bad value refused) up front.
case "${KVQRS_VLLM:-}" in
    1) skip_vllm="" ;;
    0) skip_vllm="KVQRS_VLLM=0" ;;
    "") if [ -e .venv/kvqrs-vllm ]; then skip_vllm=""; else skip_vllm="not requested: KVQRS_VLLM=1 bash scripts/setup.sh installs .venv-vllm"; fi ;;
    *) echo "test: KVQRS_VLLM must be 0 or 1, not '$KVQRS_VLLM'" >&2; exit 1 ;;
esac
[ -z "$skip_vllm" ] || echo "test: the vLLM tests will not run ($skip_vllm)"

PY_SOURCES=(python tests benches scripts)
step "cargo fmt --check" cargo fmt --all --check
step "cargo clippy (kvqrs-core, kvqrs-py)" cargo clippy --workspace --all-targets -- -D warnings
step "ruff check" .venv/bin/ruff check "${PY_SOURCES[@]}"
step "ruff format --check" .venv/bin/ruff format --check "${PY_SOURCES[@]}"
step "stubtest kvqrs._native" .venv/bin/python -m mypy.stubtest kvqrs._native
step "cargo test (dispatched SIMD)" cargo test -p kvqrs-core
step "cargo test (KVQRS_FORCE_SCALAR=1)" env KVQRS_FORCE_SCALAR=1 cargo test -p kvqrs-core
# tests/vllm/test_vllm.py needs vLLM, which .venv does not have: it runs in the last step.
# pytest-xdist: one worker per core, at most 4 (each loads the model once): 2.6x faster on 2 cores.
workers=$(.venv/bin/python -c 'import os; print(min(4, os.cpu_count() or 1))')
step "pytest ($workers workers)" .venv/bin/python -m pytest -q -n "$workers" --ignore=tests/vllm/test_vllm.py
if [ -n "$skip_vllm" ]; then
    echo "== vLLM tests: not run ($skip_vllm)"
else
    step "vLLM tests (.venv-vllm)" bash scripts/test-vllm.sh
fi
