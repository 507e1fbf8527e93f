"""One `vllm serve` for both variants of tests/vllm/test_realtime.py: a `--middleware` class.

```console
$ vllm serve MODEL --middleware tests.vllm.realtime_variants.AloneOrWithMiddleware
```

A connection whose handshake carries `x-test-variant: asgi-cancel` goes through
`CancelOnDisconnectMiddleware(app)`, built as vLLM builds `--middleware
asgi_cancel.CancelOnDisconnectMiddleware` (`cls(app)`, default options) and at the same place
in vLLM's stack; any other goes straight to vLLM's app, as without the middleware. One engine
start serves both (vLLM's start-up is most of the test's time), and the two variants' sessions
meet the same engine. asgi-cancel's log lines go to the server's log, which the test reads.
"""

from __future__ import annotations

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.types import ASGIApp, Receive, Scope, Send

from .server_log import log_to_stderr

HEADER = b"x-test-variant"
WITH_MIDDLEWARE = b"asgi-cancel"


class AloneOrWithMiddleware:
    """vLLM's app, behind `CancelOnDisconnectMiddleware` for connections that ask for it."""

    def __init__(self, app: ASGIApp) -> None:
        log_to_stderr("asgi_cancel")
        self.app = app
        self.with_middleware = CancelOnDisconnectMiddleware(app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if dict(scope.get("headers", ())).get(HEADER) == WITH_MIDDLEWARE:
            await self.with_middleware(scope, receive, send)
        else:
            await self.app(scope, receive, send)
