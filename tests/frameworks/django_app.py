"""A Django 5 project in one module: settings in code, no database.

`app` is Django's ASGI application wrapped with the middleware (`asgi.py`:
`application = CancelOnDisconnectMiddleware(get_asgi_application())`); `control` is the same
application without it. (Django refuses `lifespan` scopes; uvicorn then goes on without.)
"""

from __future__ import annotations

import django  # type: ignore[import-untyped]
from django.conf import settings  # type: ignore[import-untyped]

settings.configure(
    DEBUG=False,
    SECRET_KEY="asgi-cancel-framework-matrix",
    ROOT_URLCONF=__name__,
    ALLOWED_HOSTS=["*"],
    INSTALLED_APPS=[],
    MIDDLEWARE=[],
    DATABASES={},
    USE_TZ=True,
    # Errors (a 500, a traceback) must show up in the server's log, which the tests read.
    LOGGING={
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"console": {"class": "logging.StreamHandler"}},
        "loggers": {"django": {"handlers": ["console"], "level": "ERROR"}},
    },
)
django.setup()

from django.core.asgi import get_asgi_application  # type: ignore[import-untyped]  # noqa: E402
from django.http import (  # type: ignore[import-untyped]  # noqa: E402
    HttpRequest,
    HttpResponse,
    StreamingHttpResponse,
)
from django.urls import path  # type: ignore[import-untyped]  # noqa: E402

from .appkit import NORMAL_BODY, NORMAL_HEADER, blocking_work, chunks, served, slow_work  # noqa: E402


def text(body: str, headers: dict[str, str] | None = None) -> HttpResponse:
    response = HttpResponse(body, content_type="text/plain", headers=headers)
    response["Content-Length"] = str(len(response.content))
    return response


async def hello(request: HttpRequest) -> HttpResponse:
    return text("hello")


async def normal(request: HttpRequest) -> HttpResponse:
    return text(NORMAL_BODY, dict([NORMAL_HEADER]))


async def slow(request: HttpRequest) -> HttpResponse:
    """An async view: Django runs it in its own task, which it cancels on a disconnect."""
    query = request.GET
    await slow_work(query["id"], float(query.get("t", "30")), float(query.get("cleanup", "0")))
    return text("slow done")


async def stream(request: HttpRequest) -> StreamingHttpResponse:
    query = request.GET
    body = chunks(query["id"], float(query.get("t", "30")))
    return StreamingHttpResponse(body, content_type="text/plain")


def sync(request: HttpRequest) -> HttpResponse:
    """A sync view: Django runs it in a thread (asgiref `sync_to_async`)."""
    query = request.GET
    return text(blocking_work(query["id"], float(query.get("t", "30"))))


urlpatterns = [path(view.__name__, view) for view in (hello, normal, slow, stream, sync)]


django_application = get_asgi_application()
app = served(django_application, wrap=True)
control = served(django_application)
