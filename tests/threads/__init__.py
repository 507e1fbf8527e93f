"""Generation in worker threads: the transformers and llama.cpp suites (own venvs in CI)."""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest


def require(module: str) -> Any:
    """`module`, imported; skipped when missing, except under .ci/vllm.sh
    (`ASGI_CANCEL_REQUIRE_VLLM=1`), where a missing module is a failure."""
    if os.environ.get("ASGI_CANCEL_REQUIRE_VLLM") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(
        module, reason=f"{module} is not installed (.ci/vllm.sh's venv has it)"
    )
