"""Django Channels consumers, the project of django_app.py for HTTP: `app` is the
`ProtocolTypeRouter` wrapped with the middleware (`asgi.py`: `application =
CancelOnDisconnectMiddleware(ProtocolTypeRouter({...}))`); `control` is the same without it.

- `/ws/busy`: an `AsyncWebsocketConsumer` that, given a prompt, streams `tick <i>` from its
  `receive()` handler: Channels dispatches one message at a time, so it reads nothing else,
  the disconnect included, until the stream ends.
- `/ws/chat`: echoes; its `disconnect(code)` handler records `disconnected`.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from channels.generic.websocket import AsyncWebsocketConsumer  # type: ignore[import-untyped]
from channels.routing import ProtocolTypeRouter, URLRouter  # type: ignore[import-untyped]
from django.urls import path  # type: ignore[import-untyped]

from ..servers.events import record, token_state
from .appkit import served, ticking
from .django_app import django_application


class Consumer(AsyncWebsocketConsumer):  # type: ignore[misc]
    def query(self, name: str, default: str = "") -> str:
        values = parse_qs(self.scope["query_string"].decode()).get(name)
        return values[0] if values else default

    async def connect(self) -> None:
        await self.accept()


class BusyConsumer(Consumer):
    async def receive(self, text_data: str | None = None, bytes_data: Any = None) -> None:
        rid, seconds = self.query("id"), float(self.query("t", "30"))
        await ticking(rid, seconds, lambda text: self.send(text_data=text))


class ChatConsumer(Consumer):
    async def connect(self) -> None:
        await self.accept()
        record(self.query("id"), "start", **token_state())

    async def receive(self, text_data: str | None = None, bytes_data: Any = None) -> None:
        await self.send(text_data=text_data)

    async def disconnect(self, code: int) -> None:
        record(self.query("id"), "disconnected", code=code, **token_state())
        record(self.query("id"), "finally")


router = ProtocolTypeRouter(
    {
        "http": django_application,
        "websocket": URLRouter(
            [path("ws/busy", BusyConsumer.as_asgi()), path("ws/chat", ChatConsumer.as_asgi())]
        ),
    }
)
app = served(router, wrap=True)
control = served(router)
