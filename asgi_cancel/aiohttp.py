"""Carry a request's cancellation to the next hop over aiohttp: a trace config bound to its token.

```python
import aiohttp
from asgi_cancel.aiohttp import cancel_trace_config

session = aiohttp.ClientSession(trace_configs=[cancel_trace_config(forward_to=["backend"])])
```

Inside a request handled by `CancelOnDisconnectMiddleware`, every request this session sends
is bound to that request's token, with the same rules as `asgi_cancel.httpx.CancelTransport`:
when the request should stop (`token.should_stop`: client gone, cancelled by id, deadline
passed; never inside `shield()` or a detached request), a call made in a task the app
spawned is stopped at once: waiting for its response, that task's call is cancelled; streaming,
its response is closed (its reader gets `aiohttp.ClientConnectionError`). A call made in the
request's own task is stopped by the middleware's own cancellation, and its response closed at
the request's end at the latest. Either way the connection closes, and the next hop's own
asgi-cancel sees its client leave. The request id and the remaining deadline go to the hosts
in `forward_to` only, on every hop: a redirect to another host does not carry them. Outside a
request nothing changes. It is aiohttp's own extension point (a `TraceConfig`): nothing is
patched. Needs the `aiohttp` extra (`pip install 'asgi-cancel[aiohttp]'`).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from ._extras import missing_extra

try:
    import aiohttp
    from aiohttp import hdrs
    from yarl import URL
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise missing_extra("aiohttp", exc) from exc

from ._forwarding import Forwarding, ForwardTo
from ._token import CancelToken, find_token, in_request_task

__all__ = ["UpstreamCancelled", "cancel_trace_config"]


class UpstreamCancelled(aiohttp.ClientConnectionError, asyncio.CancelledError):
    """A new upstream call was refused because the request it serves should stop.

    An `aiohttp.ClientConnectionError` for code that handles upstream failures, and an
    `asyncio.CancelledError`, so that in the request's own task the middleware absorbs it as
    the one cancellation it caused.
    """


def cancel_trace_config(
    *,
    forward_to: ForwardTo = (),
    request_id_header: str | None = "x-request-id",
    timeout_header: str | None = "x-request-timeout",
) -> aiohttp.TraceConfig:
    """A `TraceConfig` that binds a session's requests to the current request's token.

    Args:
        forward_to: where the request id and the remaining deadline are sent: host names
            (`["backend", "10.0.0.5:8000"]`; a host without a port matches any port), or a
            predicate `forward_to(scheme, host, port) -> bool`. Default: nowhere.
        request_id_header: the header that carries `token.request_id` (None: not sent).
        timeout_header: the header that carries the remaining deadline, in milliseconds (None:
            not sent). Both are set, replacing what the app may have copied from its client.

    Raises:
        ValueError: `forward_to` holds something other than hosts, or a header option is not
            a header name.
    """
    forwarding = Forwarding(forward_to, request_id_header, timeout_header)
    config = aiohttp.TraceConfig()

    async def on_request_start(
        session: aiohttp.ClientSession, context: SimpleNamespace, params: Any
    ) -> None:
        context.unregister = None
        context.forwarded = ()
        token = find_token()
        if token is None:
            return
        if token.should_stop:
            raise UpstreamCancelled(f"request cancelled: {token.reason}")
        url = params.url
        context.forwarded = forwarding.apply(
            params.headers, (), token, url.scheme, url.host or "", url.port
        )
        task = asyncio.current_task()
        if task is not None and not in_request_task():
            # A task the app spawned: only this binding can stop its call.
            context.unregister = token.on_cancel(lambda: _cancel_call(token, task))

    async def on_request_redirect(
        session: aiohttp.ClientSession, context: SimpleNamespace, params: Any
    ) -> None:
        # aiohttp sends every hop of a call with the headers `on_request_start` saw: the ones
        # set there are taken back here, unless the redirect goes to a host to forward to.
        token = find_token()
        if token is None:
            return
        url = _redirect_url(params)
        context.forwarded = forwarding.apply(
            params.headers, context.forwarded, token, url.scheme, url.host or "", url.port
        )

    async def on_request_end(
        session: aiohttp.ClientSession, context: SimpleNamespace, params: Any
    ) -> None:
        _forget(context)
        token = find_token()
        if token is None:
            return
        response = params.response
        if in_request_task():
            # Read in the request's own task (or a task group's child, cancelled with it):
            # the middleware's cancellation stops the reading; closed at the request's end,
            # so that the upstream connection goes even if the app never released it. Closing
            # it at once would make the reader raise ClientConnectionError instead.
            token.on_finished(response.close)
        else:
            context.unregister = token.on_cancel(lambda: _close(token, response))

    async def on_request_exception(
        session: aiohttp.ClientSession, context: SimpleNamespace, params: Any
    ) -> None:
        _forget(context)

    config.on_request_start.append(on_request_start)
    config.on_request_redirect.append(on_request_redirect)
    config.on_request_end.append(on_request_end)
    config.on_request_exception.append(on_request_exception)
    return config


def _redirect_url(params: aiohttp.TraceRequestRedirectParams) -> URL:
    """Where aiohttp goes after this redirect (an empty URL if it cannot tell: ours are taken
    back; aiohttp then goes nowhere either)."""
    headers = params.response.headers
    location = headers.get(hdrs.LOCATION) or headers.get(hdrs.URI)
    try:
        return URL() if location is None else params.url.join(URL(location))
    except ValueError:
        return URL()


def _cancel_call(token: CancelToken, task: asyncio.Task[Any]) -> None:
    if token.should_stop and not task.done():
        task.cancel(f"request cancelled: {token.reason}")


def _close(token: CancelToken, response: aiohttp.ClientResponse) -> None:
    """Close a response still streaming: the connection goes, the upstream sees us leave."""
    if token.should_stop and not response.closed:
        response.close()


def _forget(context: SimpleNamespace) -> None:
    unregister = getattr(context, "unregister", None)
    if unregister is not None:
        unregister()
        context.unregister = None
