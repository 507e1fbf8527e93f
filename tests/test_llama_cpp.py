"""asgi_cancel.llama_cpp without llama.cpp: the criterion, the stream and the watch, driven the
way llama-cpp-python 0.3.36 calls them (tests/threads/test_llama_cpp.py runs the real engine).

`complete()` is llama-cpp-python's loop as far as stopping criteria see it: after each token,
the criteria get the ids evaluated so far (the prompt, then one more per token); after the
loop, one closing call with the same ids (more with a draft model) decides `finish_reason`.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import anyio
import pytest

import asgi_cancel.llama_cpp
from asgi_cancel import CancelOnDisconnectMiddleware, CancelToken, detach, shield
from asgi_cancel.llama_cpp import CancelCriterion, stream
from asgi_cancel.types import Receive, Scope, Send

from .helpers import leave

PROMPT = 5


def complete(
    criterion: Callable[[list[int], object], bool],
    max_tokens: int,
    *,
    each_token: Callable[[int], None] = lambda n: None,
    drafted: int = 0,
) -> tuple[str, int]:
    """(finish_reason, tokens handed out) of one non-streaming completion; with a draft model
    (speculative decoding), `drafted` tokens it drafted are evaluated past the last one, and
    the closing call's ids hold them too."""
    ids = list(range(PROMPT))
    tokens = 0
    while True:
        if criterion(list(ids), None):
            break
        tokens += 1
        each_token(tokens)
        if tokens >= max_tokens:
            break
        ids.append(tokens)  # the next eval
    finish = "stop" if criterion([*ids, *range(drafted)], None) else "length"
    return finish, tokens


@pytest.mark.parametrize("drafted", [0, 3], ids=["", "draft-model"])
@pytest.mark.parametrize(
    ("max_tokens", "finish", "generated", "after_cancel"),
    # At token 10 of 100: the eleventh was sampled, never handed out. At token 8 of 8: between
    # the last token and llama's closing call, and finish_reason stays.
    [(100, ("stop", 10), 11, 1), (8, ("length", 8), 8, 0)],
    ids=["stops-at-the-next-token", "a-finished-generation-is-never-marked-cancelled"],
)
def test_stops_at_the_token_after_the_cancel_and_counts_what_it_cost(
    max_tokens: int, finish: tuple[str, int], generated: int, after_cancel: int, drafted: int
) -> None:
    token = CancelToken()
    criterion = CancelCriterion(token)

    def cancel_at_ten_or_the_end(n: int) -> None:
        if n == min(10, max_tokens):
            token.fire("client disconnected")

    assert (
        complete(criterion, max_tokens, each_token=cancel_at_ten_or_the_end, drafted=drafted)
        == finish
    )
    assert criterion.stopped is (finish[0] == "stop")
    assert criterion.generated == generated
    usage = token.usage
    assert usage is not None
    counts = (usage.prompt_tokens, usage.completion_tokens, usage.after_cancel)
    assert counts == (PROMPT, generated, after_cancel)


def test_outside_a_request_it_says_so_and_never_stops() -> None:
    with pytest.warns(RuntimeWarning, match=r"outside a request.*pass token=") as warned:
        criterion = CancelCriterion()
    assert warned[0].filename == __file__  # this line, not the adapter's
    assert criterion.token is None
    assert complete(criterion, 20) == ("length", 20)
    assert criterion.generated == 20
    assert criterion.prompt_tokens == PROMPT


def test_a_wrong_type_is_a_type_error_and_a_bad_value_a_value_error() -> None:
    with pytest.raises(TypeError, match=r"token must be a CancelToken or None, got 'token' \(str"):
        CancelCriterion("token")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token must be a CancelToken"):
        stream([], token=object())  # type: ignore[arg-type]
    processor = asgi_cancel.llama_cpp.CancelLogitsProcessor
    with pytest.raises(TypeError):
        processor("2", CancelToken())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eos_token must be a token id >= 0, got -1"):
        processor(-1, CancelToken())


def chunks(log: list[str]) -> Iterator[int]:
    try:
        for n in range(1000):
            log.append(f"chunk {n}")
            yield n
    finally:
        log.append("closed")


def test_stream_ends_at_once_and_closes_the_generation() -> None:
    token = CancelToken()
    criterion = CancelCriterion(token)
    log: list[str] = []
    seen = []
    for n in stream(chunks(log), token=token, criteria=[criterion]):
        seen.append(n)
        if n == 3:
            token.fire("client disconnected")
    assert seen == [0, 1, 2, 3]
    assert log[-2:] == ["chunk 3", "closed"]  # no chunk was made after the cancel


def test_stream_passes_everything_through_when_not_cancelled() -> None:
    assert list(stream(iter(range(5)), token=CancelToken())) == [0, 1, 2, 3, 4]
    with pytest.warns(RuntimeWarning, match=r"stream\(\) was made outside a request"):
        passed = list(stream(range(3)))  # outside a request: nothing can cancel it
    assert passed == [0, 1, 2]


@pytest.fixture
def quick_watch(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(asgi_cancel.llama_cpp, "STILL_RUNNING_AFTER", 0.05)
    return 0.05


def warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_thread_that_ignores_the_token_is_reported_not_waited_for(
    caplog: pytest.LogCaptureFixture, quick_watch: float
) -> None:
    token = CancelToken()
    CancelCriterion(token)  # made, never passed to the generation
    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        started = time.monotonic()
        token.fire("client disconnected")
        assert time.monotonic() - started < quick_watch  # fire() does not wait
        deadline = time.monotonic() + 5.0
        while not warned(caplog) and time.monotonic() < deadline:
            time.sleep(0.01)
    (message,) = warned(caplog)
    unasked = "a llama.cpp generation has not asked its stopping criteria or logits processor"
    assert message.startswith(unasked)
    assert "after its request was cancelled, nor before" in message


class Scores(list[float]):
    """What a logits processor is given (llama-cpp-python: a numpy array)."""

    def max(self) -> float:
        return max(self)


def process(processor: Callable[[list[int], Scores], Scores], tokens: int) -> None:
    """llama-cpp-python's loop as a logits processor sees it: one call before each token is
    sampled, and nothing when the generation ends (end of sequence, max_tokens, a stop)."""
    ids = list(range(PROMPT))
    for n in range(tokens):
        processor(list(ids), Scores([0.5, 1.0, -1.0, 3.0]))
        ids.append(n)


def test_generations_that_ended_or_stopped_are_not_reported(
    caplog: pytest.LogCaptureFixture, quick_watch: float
) -> None:
    # Ended before the cancel: a criterion whose generation ended on its own, one whose stream
    # its caller closed (without `stream()`), and a logits processor whose generation ended on
    # its own. Then a stream closed at its first step by the cancel (llama.cpp never asked), and
    # one that stops at the cancel (its own token).
    token, stopping_token = CancelToken(), CancelToken()
    whole, closed = CancelCriterion(token), CancelCriterion(token)
    assert complete(whole, 5) == ("length", 5)
    for n in range(5):  # five chunks read, then the stream closed: no closing call
        assert not closed(list(range(PROMPT + n)), None)
    processor = asgi_cancel.llama_cpp.CancelLogitsProcessor(2, token)
    process(processor, 5)
    unasked = CancelCriterion(token)
    chunked = stream(chunks([]), token=token, criteria=[unasked])
    stopping = CancelCriterion(stopping_token)
    thread = threading.Thread(target=complete, args=(stopping, 10_000))
    thread.start()
    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        token.fire("client disconnected")
        stopping_token.fire("client disconnected")
        assert list(chunked) == []
        thread.join(5.0)
        time.sleep(quick_watch * 4)
    assert warned(caplog) == []
    assert [ended.stopped for ended in (whole, closed, processor)] == [False, False, False]
    assert unasked.generated == 0
    assert stopping.stopped
    assert token.usage is not None
    assert (token.usage.completion_tokens, token.usage.after_cancel) == (15, 0)


# -- under the middleware: the token found in a worker thread, shield() and detach() ---------


def slowly(started: threading.Event) -> Callable[[int], None]:
    """A token every 2 ms, `started` set at the first."""

    def each_token(n: int) -> None:
        started.set()
        time.sleep(0.002)

    return each_token


def generation_app(
    wrap: str, results: dict[str, Any], started: threading.Event
) -> Callable[[Scope, Receive, Send], Any]:
    """An ASGI app generating twice in a worker thread (anyio's, which copies the context): a
    chat completion (a logits processor) that ends on its own, then a generation (a
    criterion), wrapped in `wrap`, during which the client leaves."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        def first() -> None:
            results["first"] = asgi_cancel.llama_cpp.CancelLogitsProcessor(2)
            process(results["first"], 5)

        def generate() -> tuple[str, int]:
            criterion = CancelCriterion()  # in the thread: found through the copied context
            results["criterion"] = criterion
            return complete(criterion, 300, each_token=slowly(started))

        await anyio.to_thread.run_sync(first)
        try:
            with shield() if wrap == "shield" else detach() if wrap == "detach" else nullcontext():
                results["finish"] = await anyio.to_thread.run_sync(generate)
        finally:
            results["done"] = True
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    return app


@pytest.mark.parametrize(
    ("wrap", "runs_to_the_end"),
    [("none", False), ("shield", True), ("detach", True)],
    ids=["plain", "shield", "detach"],
)
@pytest.mark.anyio
async def test_under_the_middleware_the_disconnect_stops_the_thread_unless_shielded(
    caplog: pytest.LogCaptureFixture, quick_watch: float, wrap: str, runs_to_the_end: bool
) -> None:
    """The second generation stops (unless shielded); the first, ended on its own, is not
    taken for a generation that ignores the token."""
    results: dict[str, Any] = {}
    started = threading.Event()
    app = CancelOnDisconnectMiddleware(generation_app(wrap, results, started))
    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        conn = await leave(app, when=started.is_set)
        await anyio.sleep(quick_watch * 4)
    assert warned(caplog) == []
    assert not results["first"].stopped
    assert conn.app_exception is None
    assert results["done"]  # conn.run returned once the app did
    criterion: CancelCriterion = results["criterion"]
    usage = criterion.token.usage if criterion.token is not None else None
    assert usage is not None
    if runs_to_the_end:
        assert results["finish"] == ("length", 300)
        assert not criterion.stopped
    else:
        assert criterion.stopped
        assert criterion.generated < 300
        assert usage.after_cancel <= 5  # a token or two while the disconnect is read


def test_stopping_criteria_without_llama_cpp_names_the_extra() -> None:
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama_cpp is installed here")
    with pytest.raises(ImportError, match=r"pip install 'asgi-cancel\[llama-cpp\]'"):
        asgi_cancel.llama_cpp.stopping_criteria()
    with pytest.raises(ImportError, match=r"'llama-cpp-python\[server\]'"):
        asgi_cancel.llama_cpp.server_app()


def test_the_logits_processor_puts_end_of_sequence_first_once_cancelled() -> None:
    # Above the others, which keep their logits: a grammar applied after the processors
    # (llama-cpp-python's order) that forbids end-of-sequence still has its own tokens.
    token = CancelToken()
    processor = asgi_cancel.llama_cpp.CancelLogitsProcessor(2, token)
    ids = list(range(PROMPT))
    assert processor(ids, Scores([0.5, 1.0, -1.0, 3.0])) == [0.5, 1.0, -1.0, 3.0]
    token.fire("client disconnected")
    assert processor([*ids, 1], Scores([0.5, 1.0, -1.0, 3.0])) == [0.5, 1.0, 3.0 + 1e4, 3.0]
    assert processor.stopped
    assert token.usage is not None
    assert (token.usage.prompt_tokens, token.usage.completion_tokens) == (PROMPT, 2)
    assert token.usage.after_cancel == 1
