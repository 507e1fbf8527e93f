"""llama-cpp-python's OpenAI server (`llama_cpp.server`), as uvicorn's factory, for the tests.

`ASGI_CANCEL_LLAMA_MODE=alone` serves `llama_cpp.server.app.create_app()` as it is;
`middleware` wraps it in `CancelOnDisconnectMiddleware` and nothing more; `adapter` serves
`asgi_cancel.llama_cpp.server_app()`, the documented recipe. The model and
its settings come from the environment, as llama-cpp-python's server reads them (`MODEL`,
`N_CTX`, `N_THREADS`, ...). Both get the same two routes of the tests' own: `GET /hello` (the
runner's readiness probe) and `GET /probe` (the engine's side, `llama_probe`).

    uvicorn tests.threads.llama_server_app:create_app --factory
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from . import llama_probe


async def hello() -> PlainTextResponse:
    return PlainTextResponse("hello")


async def probe() -> dict[str, Any]:
    return {"generations": llama_probe.generations(), "cancelled": []}


def create_app() -> Any:
    llama_probe.install()
    mode = os.environ.get("ASGI_CANCEL_LLAMA_MODE", "adapter")
    app: Any
    if mode == "adapter":
        from asgi_cancel.llama_cpp import server_app

        app = server_app()
        assert isinstance(app.app, FastAPI)
        inner = app.app
    elif mode in ("alone", "middleware"):
        from llama_cpp.server.app import create_app as create_server_app

        from asgi_cancel import CancelOnDisconnectMiddleware

        inner = create_server_app()
        app = inner if mode == "alone" else CancelOnDisconnectMiddleware(inner)
    else:
        raise ValueError(
            f"ASGI_CANCEL_LLAMA_MODE must be alone, middleware or adapter, got {mode!r}"
        )
    inner.add_api_route("/hello", hello, methods=["GET"])
    inner.add_api_route("/probe", probe, methods=["GET"])
    return app
