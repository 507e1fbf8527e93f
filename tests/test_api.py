"""The public surface: exported names, lazy optional imports (options: test_middleware.py)."""

from __future__ import annotations

import subprocess
import sys

import asgi_cancel
import asgi_cancel.types


def test_all_lists_exactly_the_public_names_and_the_types_aliases() -> None:
    assert asgi_cancel.__all__ == (
        "CancelOnDisconnectMiddleware",
        "CancelRegistry",
        "CancelToken",
        "TokenUsage",
        "cancel_endpoint",
        "current_token",
        "detach",
        "require_header",
        "shield",
    )
    public = {name for name in dir(asgi_cancel) if not name.startswith("_")}
    # submodules appear as attributes once imported elsewhere in the test session
    submodules = {"aiohttp", "httpx", "otel", "prometheus", "redis", "testing", "types", "vllm"}
    assert public - submodules == set(asgi_cancel.__all__)
    assert isinstance(asgi_cancel.__version__, str)
    assert asgi_cancel.types.__all__ == [
        "ASGIApp",
        "AnyASGIApp",
        "Message",
        "OnCancelled",
        "Receive",
        "Scope",
        "Send",
    ]


def test_import_does_not_pull_optional_dependencies() -> None:
    code = (
        "import sys, asgi_cancel\n"
        "bad = [m for m in ('vllm', 'trio', 'anyio', 'starlette', 'prometheus_client',"
        " 'asgi_cancel.vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "import asgi_cancel.vllm\n"
        "assert 'vllm' not in sys.modules, 'the adapter imported vllm'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
