"""A server stopped with SIGTERM or SIGINT while requests are in flight, with the middleware and
without it (the control): the outside cancellation reaches the app, threads end as they would
without us, the server exits on its own, and its log holds nothing the control's does not.
Each case runs once, its time printed (-rA); `python -m tests.reliability.shutdown --runs 3`
gives the medians in docs/reliability.md.
"""

from __future__ import annotations

import pytest

from .shutdown import CASES, LOG_MARKERS, ShutdownResult, shutdown_run

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]

# What the app must see: a CancelledError in every request still waiting at the graceful
# timeout (the long thread's request included: it is abandoned to its thread, as without us).
CANCELLED = ("stream", "slow", "long-thread", "hold", "queued")


@pytest.fixture(scope="module", params=CASES, ids=[f"{spec}-{sig.name}" for spec, sig in CASES])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ShutdownResult, ShutdownResult]:
    """One run without the middleware and one with it, per case, for both tests."""
    spec, sig = request.param
    control, ours = (
        shutdown_run(spec, middleware, sig, tmp_path_factory.mktemp(f"{spec}-{sig.name}"), "s")
        for middleware in (False, True)
    )
    return control, ours


def test_shutdown_with_requests_in_flight(pair: tuple[ShutdownResult, ShutdownResult]) -> None:
    control, ours = pair
    print(  # noqa: T201  (shown with -rA)
        f"{ours.server} {ours.signal}: signal -> exit {control.seconds:.2f} s without, "
        f"{ours.seconds:.2f} s with the middleware"
    )
    for result in (control, ours):  # each exited on its own (within EXIT_TIMEOUT: not hung)
        assert result.returncode != -999, f"{result.server} hung:\n{result.log[-3000:]}"
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


def test_request_end_reaches_the_server(pair: tuple[ShutdownResult, ShutdownResult]) -> None:
    """What wraps the middleware sees every request end as it does without it: the outside
    cancellation re-raised (CancelledError), the completed thread's request returned.

    The middleware re-raises an outside cancellation in the same event-loop iteration as a
    bare app (its watcher is cancelled, not waited for): uvicorn runs only a few iterations
    after cancelling the requests at its graceful timeout before the process dies, and what
    wraps the middleware must see every request end in them."""
    control, ours = pair
    for name in (*CANCELLED, "thread"):
        assert ours.outcome(name) == control.outcome(name), (name, ours.events[name])
    assert ours.outcome("stream") == "CancelledError"
