"""A Litestar app: `app = CancelOnDisconnectMiddleware(Litestar(...))`; `control` without it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from litestar import Litestar, Response, get
from litestar.di import NamedDependency, Provide
from litestar.params import QueryParameter
from litestar.response import Stream

from .appkit import (
    NORMAL_BODY,
    NORMAL_HEADER,
    Resource,
    blocking_work,
    chunks,
    resource_dependency,
    served,
    slow_work,
)

RequestId = Annotated[str, QueryParameter(name="id")]
Seconds = Annotated[float, QueryParameter()]


@get("/hello", media_type="text/plain")
async def hello() -> str:
    return "hello"


@get("/normal", media_type="text/plain")
async def normal() -> Response[str]:
    return Response(NORMAL_BODY, media_type="text/plain", headers=dict([NORMAL_HEADER]))


@get("/slow", media_type="text/plain")
async def slow(rid: RequestId, t: Seconds = 30) -> str:
    await slow_work(rid, t)
    return "slow done"


@get("/stream", media_type="text/plain")
async def stream(rid: RequestId, t: Seconds = 30) -> Stream:
    return Stream(chunks(rid, t), media_type="text/plain")


def provide_resource(rid: RequestId) -> Iterator[Resource]:
    yield from resource_dependency(rid)


@get(
    "/sync",
    media_type="text/plain",
    sync_to_thread=True,
    dependencies={"db": Provide(provide_resource)},
)
def sync(rid: RequestId, db: NamedDependency[Resource], t: Seconds = 30) -> str:
    """A sync handler in a worker thread, using a resource that a dependency closes after it."""
    return blocking_work(rid, t, db)


litestar_app = Litestar(route_handlers=[hello, normal, slow, stream, sync])
app = served(litestar_app, wrap=True)
control = served(litestar_app)
