#!/bin/sh
# Run the asgi-cancel demo on a fresh machine: create .venv if it is missing, install the package
# with the example's dependencies, then `python -m example_app demo` (arguments are passed on,
# e.g. `example_app/run.sh --quick`; DEMO_ARGS="--quick" does the same). VENV (default: .venv at
# the repository root) and PYTHON (default: python3) override the venv and its interpreter.
set -eu
ROOT=$(CDPATH='' cd -- "$(dirname -- "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        echo "run.sh: needs Python >= 3.10 as '$PYTHON' (set PYTHON=...)" >&2
        exit 1
    fi
    echo "run.sh: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
if ! "$VENV/bin/python" -c 'import asgi_cancel, fastapi, pydantic, starlette, hypercorn, uvicorn, openai, httpx, matplotlib, prometheus_client' 2>/dev/null; then
    echo "run.sh: installing asgi-cancel with the example's dependencies into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[example]"
fi
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH  # example_app is not part of the installed wheel
# shellcheck disable=SC2086  # DEMO_ARGS is a list of arguments
exec "$VENV/bin/python" -m example_app demo ${DEMO_ARGS:-} "$@"
