#!/usr/bin/env bash
# Run the whole test suite: Rust unit and property tests, then the Python suite (hypothesis
# oracle comparisons, invariants, error handling, stubs). Needs scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
export HF_HUB_OFFLINE=1  # nothing may download weights or data at run time

cargo test -p kvqrs-core
.venv/bin/python -m pytest -q
