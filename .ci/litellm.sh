#!/usr/bin/env bash
# The LiteLLM step of CI: LiteLLM's proxy in its own venv, then example_app/tests/test_litellm.py
# (a real `litellm --config` before the demo's engine server, without and with asgi-cancel).
# Called by .ci/run; runnable alone from anywhere.
#
#   .ci/litellm.sh [extra pytest args]
#
# Environment (all optional):
#   LITELLM_VENV         the venv to use or create (default: <repo>/.venv-litellm); reused when it
#                        already has litellm 1.108.7, so only the first run pays the install
#   LITELLM_CI_PYTHON    the Python for a new venv (default: a Python 3.11)
#
# litellm 1.108.7 is what `pip install 'litellm[proxy]'` resolves to from PyPI today: the newer
# releases' proxy extra pins packages pip cannot find there (litellm-proxy, and newer
# litellm-proxy-extras and litellm-enterprise). The test's control records what this version
# does on its own: pinned, so that a LiteLLM release changes it only through this line.
#
# The test runs in the dev venv (.venv, as tests/run.sh makes it): it starts the demo's engine
# server from there and the proxy from LiteLLM's venv, which gets asgi-cancel from this checkout
# (the recipe in docs/integrations.md imports it).
#
# Budget on a 2-core machine: install ~40 s without pip's cache (~25 s with it), tests ~1.5 min.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${LITELLM_VENV:-$ROOT/.venv-litellm}"
PY="$VENV/bin/python"
LITELLM_VERSION="1.108.7"
DEV_PYTHON="$ROOT/.venv/bin/python"

step_start=0
step() { step_start=$(date +%s.%N); echo "=== litellm.sh: $*"; }
took() {
    local seconds
    seconds=$(awk -v a="$step_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    echo "=== litellm.sh: $1 took ${seconds}s"
    TIMINGS+=("$1: ${seconds}s")
}
TIMINGS=()
total_start=$(date +%s.%N)

find_python() {
    local candidate
    for candidate in "${LITELLM_CI_PYTHON:-}" /root/.pyenv/versions/3.11.7/bin/python python3.11; do
        [ -n "$candidate" ] || continue
        if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "litellm.sh: no Python 3.11 found (set LITELLM_CI_PYTHON)" >&2
    return 1
}

has_litellm() {
    [ -x "$PY" ] && "$PY" -c "
import importlib.metadata as metadata, sys
sys.exit(metadata.version('litellm') != '$LITELLM_VERSION')" 2>/dev/null
}

if [ ! -x "$DEV_PYTHON" ]; then
    echo "litellm.sh: $DEV_PYTHON missing: run tests/run.sh first (it makes .venv)" >&2
    exit 1
fi

step "install LiteLLM into $VENV"
if has_litellm; then
    echo "litellm.sh: reusing $VENV (litellm $LITELLM_VERSION present)"
else
    [ -x "$PY" ] || "$(find_python)" -m venv "$VENV"
    timeout 600 "$PY" -m pip install -q -U pip
    timeout 900 "$PY" -m pip install -q "litellm[proxy]==$LITELLM_VERSION"
fi
timeout 300 "$PY" -m pip install -q --no-deps -e "$ROOT"
took "install"

step "tests"
set +e
ASGI_CANCEL_REQUIRE_LITELLM=1 ASGI_CANCEL_LITELLM_VENV="$VENV" timeout 900 "$DEV_PYTHON" -m pytest \
    example_app/tests/test_litellm.py -p no:cacheprovider -q -s -ra "$@"
status=$?
set -e
took "tests"
if [ "$status" -eq 5 ]; then
    echo "litellm.sh: pytest collected no tests; expected test_litellm.py to run" >&2
    status=1
fi

total=$(awk -v a="$total_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
echo "=== litellm.sh: timings: ${TIMINGS[*]}; total: ${total}s; pytest exit status: $status"
exit "$status"
