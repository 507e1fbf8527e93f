"""`OpenAIRequestIds`: the ids vLLM's OpenAI server shows its clients, as aliases of the
requests they name (exported by `asgi_cancel.vllm`)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from ._registry import CancelRegistry
from ._token import find_token
from .types import ASGIApp, Message, Receive, Scope, Send

# What vLLM 0.32's OpenAI handlers store on `raw_request.state` once they have named the
# request (`RequestResponseMetadata`): its `request_id` is the `id` of the response body.
_METADATA = "request_metadata"
# The header vLLM's `--enable-request-id-headers` sets on every response, whatever the
# middleware's registry reads.
_VLLM_HEADER = b"x-request-id"


class OpenAIRequestIds:
    """Make the ids vLLM's OpenAI server shows its clients cancel their requests by id.

    vLLM names a request after the client's `X-Request-Id`, the body's `request_id` or a
    random uuid: `chatcmpl-{id}` (chat), `cmpl-{id}` (completions), the `request_id` itself
    (`resp_{uuid}` by default, Responses API); that name is the `id` of the response body and
    of every streamed chunk. With `--enable-request-id-headers` vLLM also answers with an
    `X-Request-Id` of its own (the client's, else a fresh uuid). None of them is the
    middleware's id: a cancel by one of them would find no request. Wrapped around vLLM's
    app, inside `CancelOnDisconnectMiddleware`, this makes each of them an alias of the
    request (`CancelRegistry.alias()`): the body's id the moment vLLM names the request,
    before it reaches the engine (streaming or not), the header's when the response starts.

    ```python
    class CancelById(CancelOnDisconnectMiddleware):  # vllm serve --middleware module.CancelById
        def __init__(self, app: ASGIApp) -> None:
            registry = CancelRegistry()
            super().__init__(OpenAIRequestIds(app, registry), registry=registry)
    ```

    It reads what vLLM 0.32's handlers store on `request.state` (`request_metadata`, a
    Starlette `request.state` kept in `scope["state"]`) and vLLM's response header: nothing is
    imported from vLLM. Outside a request with an id, it passes everything through untouched.

    Args:
        app: vLLM's ASGI app (what `--middleware` hands to its class).
        registry: the `CancelRegistry` given to the middleware around it.
    """

    def __init__(self, app: ASGIApp, registry: CancelRegistry) -> None:
        if not isinstance(registry, CancelRegistry):
            raise ValueError(f"registry must be a CancelRegistry, got {registry!r}")
        self.app = app
        self.registry = registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = find_token()
        if scope["type"] != "http" or token is None or token.request_id is None:
            await self.app(scope, receive, send)
            return
        registry = self.registry
        scope["state"] = _AliasingState(registry, scope.get("state") or {})

        def send_aliasing(message: Message) -> Awaitable[None]:
            if message["type"] == "http.response.start":
                headers = message.get("headers", ())
                if not isinstance(headers, (list, tuple)):  # any iterable: read it once
                    headers = list(headers)
                    message = {**message, "headers": headers}
                for name, value in headers:
                    if name.lower() == _VLLM_HEADER:
                        registry.alias(bytes(value).decode("latin-1"))
            return send(message)

        await self.app(scope, receive, send_aliasing)


class _AliasingState(dict[str, Any]):
    """A request's `scope["state"]` that aliases the request when vLLM names it there."""

    __slots__ = ("registry",)

    def __init__(self, registry: CancelRegistry, state: dict[str, Any]) -> None:
        super().__init__(state)
        self.registry = registry

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key == _METADATA:
            name = getattr(value, "request_id", None)
            if isinstance(name, str):
                self.registry.alias(name)
