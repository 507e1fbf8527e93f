"""Starlette with a `BaseHTTPMiddleware` inside `CancelOnDisconnectMiddleware` (or alone)."""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import Response

from .appkit import served
from .starlette_app import build


class PassThroughMiddleware(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        return await call_next(request)


app = served(build(Middleware(PassThroughMiddleware), cancel=True))
control = served(build(Middleware(PassThroughMiddleware), cancel=False))
