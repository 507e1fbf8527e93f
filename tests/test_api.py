"""The public surface: exported names (options: test_middleware.py; lazy optional imports:
test_packaging.py)."""

from __future__ import annotations

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
    submodules.add("llama_cpp")
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
