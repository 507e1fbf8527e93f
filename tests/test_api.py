"""The public surface: exported names, configuration errors, lazy optional imports."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

import asgi_cancel
from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.types import Receive, Scope, Send


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    pass  # pragma: no cover


def test_all_lists_exactly_the_public_names() -> None:
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


def test_types_module_exports_the_aliases() -> None:
    import asgi_cancel.types

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
        "bad = [m for m in ('vllm', 'trio', 'anyio', 'starlette', 'prometheus_client')"
        " if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_non_callable_app_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="app must be an ASGI callable"):
        CancelOnDisconnectMiddleware("app")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("read_ahead", -1),
        ("read_ahead", 1.5),
        ("read_ahead", "64k"),
        ("read_ahead", True),
        ("grace", -0.1),
        ("grace", float("nan")),
        ("grace", float("inf")),
        ("grace", "1s"),
        ("on_cancelled", 42),
        ("watch_delay", -0.001),
        ("watch_delay", float("inf")),
        ("watch_delay", "5ms"),
    ],
)
def test_bad_option_is_a_value_error_naming_it(option: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{option} must be"):
        CancelOnDisconnectMiddleware(app, **{option: value})


def test_unknown_option_is_rejected() -> None:
    with pytest.raises(TypeError, match="unexpected keyword"):
        CancelOnDisconnectMiddleware(app, readahead=10)  # type: ignore[call-arg]


def test_valid_options_are_kept() -> None:
    middleware = CancelOnDisconnectMiddleware(
        app, read_ahead=0, grace=0, on_cancelled=print, watch_delay=0
    )
    assert (middleware.read_ahead, middleware.grace, middleware.watch_delay) == (0, 0.0, 0.0)
    assert middleware.app is app
