#!/usr/bin/env bash
# The speed harness in one command: install the comparison peers into .venv (best effort, each
# on its own: a peer that fails to install is reported and skipped, never fatal), then run
# benches/bench_speed.py (kernels vs memcpy / NumPy / torch / peers, the TurboQuant peers,
# one-token append overhead, model.generate tokens/s). Needs scripts/setup.sh first.
#
#   bash scripts/bench.sh            # full run (about 10-15 minutes on 2 idle cores)
#   bash scripts/bench.sh --quick    # smoke run on tiny sizes
#   bash scripts/bench.sh --sections kernels peers --threads 1   # any bench_speed.py options
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
    echo "bench: .venv is missing; run bash scripts/setup.sh first" >&2
    exit 1
fi
export HF_HUB_OFFLINE=1

# The versions the harness was written and tested against (their APIs differ between releases).
PEERS="fht-cpu==1.0.1 hadamard-transform==0.2.0 turboquant-torch==0.4.0 turbo-quant-lite==0.1.1 pyturboquant-cpu==0.1.0 tqai==0.6.1"
# turboquant 0.2.0 ships a top-level package named `turboquant`, as turboquant-torch does: it goes
# into a folder of its own, which the harness puts on PYTHONPATH for that peer alone.
TURBOQUANT="turboquant==0.2.0"
FFHT="ffht-unofficial==0.3"

install() {  # install NAME [pip options...]: report, never fail
    local spec=$1; shift
    if "$PY" -m pip install --quiet --disable-pip-version-check "$@" "$spec" >/tmp/kvqrs-bench-pip.log 2>&1; then
        echo "bench: installed $spec"
    else
        echo "bench: could not install $spec (skipped in the tables): $(tail -n 1 /tmp/kvqrs-bench-pip.log)" >&2
    fi
}

for p in $PEERS; do install "$p"; done
if [ ! -d .venv/peers/turboquant/turboquant ]; then
    install "$TURBOQUANT" --no-deps --target .venv/peers/turboquant
fi
# ffht-unofficial builds a C extension with numpy's headers and pybind11, without build isolation.
if ! "$PY" -c "import ffht" 2>/dev/null; then
    install "pybind11" && install "wheel"
    install "$FFHT" --no-build-isolation
fi

exec "$PY" benches/bench_speed.py "$@"
