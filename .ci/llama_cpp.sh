#!/usr/bin/env bash
# The llama.cpp step of CI: llama-cpp-python built from its sdist (it vendors llama.cpp) into its
# own venv, a tiny GGUF model written locally (tests/threads/tiny_gguf.py, random weights, no
# download), then tests/threads/test_llama_cpp.py: real uvicorn, a raw-socket client that leaves,
# generation in a worker thread, and llama_cpp.server, each without and with asgi-cancel.
# Called by .ci/run; runnable alone from anywhere.
#
#   .ci/llama_cpp.sh [extra pytest args]     the tests; their measurements are printed at the
#                                            end and written to .models/llama_cpp_results.json
#   .ci/llama_cpp.sh --build-only            build (or find) the cached wheel, nothing else
#
# Environment (all optional):
#   LLAMA_CPP_VENV       the venv to use or create (default: <repo>/.venv-llama)
#   LLAMA_CPP_CI_PYTHON  the Python for a new venv (default: a Python 3.11)
#   ASGI_CANCEL_WHEEL_CACHE
#                        where built wheels are kept, outside the clone, so a fresh clone on the
#                        same machine reuses them (default: ${XDG_CACHE_HOME:-~/.cache}/asgi-cancel/wheels)
#
# The build takes /tmp/asgi-cancel-heavy.lock itself: don't run this script under that lock
# before the wheel is cached.
#
# PyPI has only the sdist of llama-cpp-python: the first run compiles llama.cpp (CPU only, no
# -march=native so the wheel runs on any x86-64 with AVX2, no OpenMP, no multimodal library).
# Budget on a 2-core machine: that build 8 min the first time (501 s of CPU, 0.7 GB of memory,
# a 19.5 MB wheel) and nothing after (the cached wheel), venv and install ~30 s, model <1 s,
# tests ~1 min.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${LLAMA_CPP_VENV:-$ROOT/.venv-llama}"
PY="$VENV/bin/python"
LLAMA_CPP_VERSION="0.3.36"
# The flags are part of the cache key: a change of either builds a new wheel.
CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF"
WHEEL_CACHE="${ASGI_CANCEL_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/asgi-cancel/wheels}"
KEY=$(printf '%s|%s|%s' "$LLAMA_CPP_VERSION" "$CMAKE_FLAGS" "$(uname -m)" | sha256sum | cut -c1-12)
WHEEL_DIR="$WHEEL_CACHE/llama-cpp-python-$LLAMA_CPP_VERSION-$KEY"
MODEL="$ROOT/.models/tiny-llama.gguf"

step_start=0
step() { step_start=$(date +%s.%N); echo "=== llama_cpp.sh: $*"; }
took() {
    local seconds
    seconds=$(awk -v a="$step_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    echo "=== llama_cpp.sh: $1 took ${seconds}s"
    TIMINGS+=("$1: ${seconds}s")
}
TIMINGS=()
total_start=$(date +%s.%N)

find_python() {
    local candidate
    for candidate in "${LLAMA_CPP_CI_PYTHON:-}" /root/.pyenv/versions/3.11.7/bin/python python3.11; do
        [ -n "$candidate" ] || continue
        if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "llama_cpp.sh: no Python 3.11 found (set LLAMA_CPP_CI_PYTHON)" >&2
    return 1
}

cached_wheel() { ls "$WHEEL_DIR"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl 2>/dev/null | head -1; }

build_wheel() {
    mkdir -p "$WHEEL_CACHE"
    # One build per key at a time (two clones building at once wait for the first one's wheel);
    # the heavy lock keeps the compile off the other heavy jobs of a shared 2-core machine.
    exec 8>"$WHEEL_DIR.lock"
    flock -w 3600 8 || { echo "llama_cpp.sh: $WHEEL_DIR.lock held for an hour" >&2; return 1; }
    if [ -n "$(cached_wheel)" ]; then
        echo "llama_cpp.sh: reusing $(cached_wheel)"
        return 0
    fi
    local python tmp
    python=$(find_python)
    tmp=$(mktemp -d "$WHEEL_CACHE/.build.XXXXXX")
    echo "llama_cpp.sh: building llama-cpp-python $LLAMA_CPP_VERSION ($CMAKE_FLAGS) into $WHEEL_DIR"
    # GNU time, where it is installed, for the build's CPU time and peak memory.
    local measure=()
    [ ! -x /usr/bin/time ] || measure=(/usr/bin/time -v -o "$tmp/time.txt")
    if ! CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=2 flock /tmp/asgi-cancel-heavy.lock \
        "${measure[@]}" timeout 3600 "$python" -m pip wheel -q --no-deps \
        --no-binary llama-cpp-python -w "$tmp" "llama-cpp-python==$LLAMA_CPP_VERSION" \
        >"$tmp/build.log" 2>&1; then
        tail -40 "$tmp/build.log" >&2
        echo "llama_cpp.sh: building llama-cpp-python failed (log: $tmp/build.log)" >&2
        return 1
    fi
    grep -E "Elapsed|Maximum resident|User time|System time" "$tmp/time.txt" 2>/dev/null || true
    mkdir -p "$WHEEL_DIR.tmp"
    mv "$tmp"/*.whl "$WHEEL_DIR.tmp/"
    [ ! -f "$tmp/time.txt" ] || mv "$tmp/time.txt" "$WHEEL_DIR.tmp/"
    rm -rf "$WHEEL_DIR" "$tmp"
    mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
    echo "llama_cpp.sh: built $(cached_wheel)"
}

step "llama-cpp-python $LLAMA_CPP_VERSION wheel (cache: $WHEEL_DIR)"
if ! build_wheel; then
    if [ "${CI:-}" = "true" ]; then exit 1; fi
    echo "llama_cpp.sh: no wheel: the llama.cpp tests cannot run" >&2
    exit 1
fi
took "wheel"
[ "${1:-}" != "--build-only" ] || exit 0

step "venv $VENV"
[ -x "$PY" ] || "$(find_python)" -m venv "$VENV"
timeout 600 "$PY" -m pip install -q -U pip
timeout 900 "$PY" -m pip install -q "$(cached_wheel)[server]" "gguf==0.19.0" \
    "pytest>=8.2" "pytest-timeout>=2.3" -e "$ROOT"
took "install"

step "tiny GGUF model $MODEL"
mkdir -p "$(dirname "$MODEL")"
"$PY" -m tests.threads.tiny_gguf "$MODEL"
took "model"

step "tests"
set +e
ASGI_CANCEL_REQUIRE_LLAMA_CPP=1 ASGI_CANCEL_LLAMA_MODEL="$MODEL" \
    ASGI_CANCEL_LLAMA_RESULTS="$ROOT/.models/llama_cpp_results.json" timeout 900 "$PY" -m pytest \
    tests/threads/test_llama_cpp.py -p no:cacheprovider -q -rA "$@"
status=$?
set -e
took "tests"
if [ "$status" -eq 5 ]; then
    echo "llama_cpp.sh: pytest collected no tests; expected test_llama_cpp.py to run" >&2
    status=1
fi

total=$(awk -v a="$total_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
echo "=== llama_cpp.sh: timings: ${TIMINGS[*]}; total: ${total}s; exit status: $status"
exit "$status"
