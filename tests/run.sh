#!/usr/bin/env bash
# The test command from the README. From a fresh clone it creates .venv (Python 3.11 by default;
# PYTHON=... to choose), installs the package with its test extras, runs the whole suite on real
# servers, then the real-vLLM suite in its own venv (.ci/vllm.sh; ASGI_CANCEL_SKIP_VLLM=1 skips
# it). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-}
if [ -z "$python" ]; then
  for candidate in python3.11 /root/.pyenv/versions/3.11.7/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python=$candidate; break; fi
  done
fi
venv=${VENV:-.venv}

if [ ! -x "$venv/bin/python" ]; then
  echo "== creating $venv with $python"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
echo "== installing asgi-cancel[dev] into $venv"
"$venv/bin/python" -m pip install -q -e '.[dev]'

echo "== pytest (ASGI level, real servers, example app; branch coverage >= 90%)"
status=0
coverage=(--cov=asgi_cancel --cov-report=term)
[ "$#" -gt 0 ] || coverage+=(--cov-fail-under=90)  # the floor applies to the whole suite
"$venv/bin/python" -m pytest "${coverage[@]}" "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
elif [ "$status" -ne 0 ]; then
  exit "$status"
fi

if [ "${ASGI_CANCEL_SKIP_VLLM:-0}" != "1" ]; then
  echo "== real vLLM suite (.ci/vllm.sh)"
  bash .ci/vllm.sh
fi
