"""A server stopped with SIGTERM or SIGINT while requests are in flight, with the middleware and
without it (the control): the outside cancellation reaches the app, threads end as they would
without us, the server exits on its own, and its log holds nothing the control's does not.

The medians of 3 runs each are `python -m tests.reliability.shutdown --runs 3`
(docs/reliability.md); here each case runs once and its time is printed (shown with -rA).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ..servers.runner import ServerSpec
from .shutdown import (
    EXIT_TIMEOUT,
    LOG_MARKERS,
    SERVERS,
    ShutdownResult,
    shutdown_run,
)

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What the app must see: a CancelledError in every request still waiting at the graceful
# timeout (the long thread's request included: it is abandoned to its thread, as without us).
CANCELLED = ("stream", "slow", "long-thread", "hold", "queued")

_results: dict[tuple[str, str, bool], ShutdownResult] = {}


def run(spec: ServerSpec, sig: signal.Signals, middleware: bool, tmp: Path) -> ShutdownResult:
    """One run per case for the whole module (both tests read it)."""
    key = (spec.name, sig.name, middleware)
    if key not in _results:
        workdir = tmp / f"{spec.name}-{sig.name}-{'with' if middleware else 'without'}"
        workdir.mkdir()
        _results[key] = shutdown_run(spec, middleware, sig, workdir, "s")
    return _results[key]


@pytest.fixture
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ShutdownResult, ShutdownResult]:
    spec, sig = request.param
    tmp = tmp_path_factory.getbasetemp()
    return run(spec, sig, False, tmp), run(spec, sig, True, tmp)


CASES = [(spec, sig) for spec in SERVERS for sig in SIGNALS]
IDS = [f"{spec.name}-{sig.name}" for spec, sig in CASES]


@pytest.mark.parametrize("pair", CASES, ids=IDS, indirect=True)
def test_shutdown_with_requests_in_flight(pair: tuple[ShutdownResult, ShutdownResult]) -> None:
    control, ours = pair
    print(  # noqa: T201  (shown with -rA)
        f"{ours.server} {ours.signal}: signal -> exit {control.seconds:.2f} s without, "
        f"{ours.seconds:.2f} s with the middleware"
    )
    for result in (control, ours):
        assert result.returncode != -999, f"{result.server} hung:\n{result.log[-3000:]}"
        assert result.seconds < EXIT_TIMEOUT
    for name in CANCELLED:
        assert "cancelled" in ours.kinds(name), (name, ours.events[name])
        assert "done" not in ours.kinds(name), (name, ours.events[name])
    # The thread that ends within the graceful timeout completes, in both.
    assert ours.kinds("thread") == control.kinds("thread")
    assert ours.outcome("thread") == "returned"
    # The one that outlasts it: its request is cancelled at once (not held until the thread
    # returns); the thread runs to its end (hypercorn, uvicorn on SIGINT: the interpreter waits
    # for it) or dies with the process (uvicorn re-raises SIGTERM); exactly as without us.
    assert [k for k in ours.kinds("long-thread") if k != "exit"] == [
        k for k in control.kinds("long-thread") if k != "exit"
    ]
    # The request pipelined behind the slow one is never started, in both.
    assert ours.events["pipelined"] == control.events["pipelined"] == []
    # Both servers log tracebacks of their own at shutdown (uvicorn: the cancelled requests'
    # "Exception in ASGI application"; hypercorn: its connection task group's CancelledError):
    # the middleware must add none.
    for marker in LOG_MARKERS:
        assert ours.markers[marker] <= control.markers[marker], (
            f"{marker!r}: {ours.markers[marker]} with the middleware, "
            f"{control.markers[marker]} without:\n{ours.log[-4000:]}"
        )
    assert control.markers["Task was destroyed but it is pending"] == 0
    assert control.markers["Task exception was never retrieved"] == 0


# The middleware re-raises an outside cancellation in the same event-loop iteration as a
# bare app (its watcher is cancelled, not waited for): uvicorn runs only a few iterations
# after cancelling the requests at its graceful timeout before the process dies, and what
# wraps the middleware must see every request end in them.
END_CASES = CASES


@pytest.mark.parametrize("pair", END_CASES, ids=IDS, indirect=True)
def test_request_end_reaches_the_server(pair: tuple[ShutdownResult, ShutdownResult]) -> None:
    """What wraps the middleware sees every request end as it does without it: the outside
    cancellation re-raised (CancelledError), the completed thread's request returned."""
    control, ours = pair
    for name in (*CANCELLED, "thread"):
        assert ours.outcome(name) == control.outcome(name), (name, ours.events[name])
    assert ours.outcome("stream") == "CancelledError"
