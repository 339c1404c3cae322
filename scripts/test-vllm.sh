#!/usr/bin/env bash
# The vLLM backend's tests (tests/test_vllm.py, and the paged-cache tests) in the vLLM
# environment of scripts/setup-vllm.sh. Not part of scripts/test.sh: that environment is a
# separate 6.3 GB install. The first run converts SmolLM2 into ~/.cache/kvqrs (about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
if [ ! -x .venv-vllm/bin/python ]; then
    echo "test-vllm: .venv-vllm is missing; run bash scripts/setup-vllm.sh first" >&2
    exit 1
fi
.venv-vllm/bin/python -m pytest -q tests/test_vllm.py tests/test_paged.py "$@"
