"""`asgi_cancel.transformers` against a fake `generate()`: fast checks of its contract.

The fake calls its stopping criteria after every token and feeds a streamer, as transformers'
`generate()` does, with fake tensors (no torch here). The real-model, real-server proof is in
tests/threads/test_transformers.py.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable, Generator
from typing import Any, cast

import pytest

import asgi_cancel.transformers
from asgi_cancel import CancelOnDisconnectMiddleware, CancelToken, detach, shield
from asgi_cancel.testing import ClientConnection
from asgi_cancel.transformers import CancelCriteria, Generation, generate_in_thread
from asgi_cancel.types import Receive, Scope, Send

from .helpers import WATCHDOG, leave, read_body, respond


class FakeBools(list[bool]):
    def bool(self) -> FakeBools:
        return self


class FakeIds:
    """What a stopping criterion reads of `input_ids`: the shape and `new_full`."""

    def __init__(self, rows: int, length: int) -> None:
        self.shape = (rows, length)

    def new_full(self, size: tuple[int], fill_value: int) -> FakeBools:
        return FakeBools([bool(fill_value)] * size[0])


class FakeStreamer:
    """`TextIteratorStreamer`'s queue protocol."""

    def __init__(self) -> None:
        self.text_queue: queue.Queue[Any] = queue.Queue()
        self.stop_signal: object = None

    def put(self, value: Any) -> None:
        self.text_queue.put(f"t{value} ")

    def end(self) -> None:
        self.text_queue.put(self.stop_signal)


class FakeModel:
    """`generate()`: one token per `step` seconds, stopping criteria after each, as
    transformers does; records when each token was made (the engine's side)."""

    def __init__(self, *, step: float = 0.002, prompt: int = 5, first_token_delay: float = 0.0):
        self.step = step
        self.prompt = prompt
        self.first_token_delay = first_token_delay
        self.made: list[float] = []
        self.ended = threading.Event()

    def generate(
        self,
        *,
        max_new_tokens: int,
        stopping_criteria: list[Callable[..., Any]] = (),  # type: ignore[assignment]
        streamer: FakeStreamer | None = None,
        rows: int = 1,
        ignore_criteria: bool = False,
        fail_at: int | None = None,
    ) -> int:
        try:
            time.sleep(self.first_token_delay)
            for made in range(1, max_new_tokens + 1):
                time.sleep(self.step)
                if made == fail_at:
                    raise RuntimeError("the model broke")
                self.made.append(time.monotonic())
                if streamer is not None:
                    streamer.put(made)
                ids = FakeIds(rows, self.prompt + made)
                done = [criterion(ids, None) for criterion in stopping_criteria]
                every_row = done and all(any(row) for row in zip(*done, strict=True))
                if every_row and not ignore_criteria:
                    break
            if streamer is not None:
                streamer.end()
            return len(self.made)
        finally:
            self.ended.set()

    def made_after(self, moment: float) -> int:
        return sum(1 for at in self.made if at > moment)


def fired_token() -> tuple[CancelToken, Callable[[], float]]:
    token = CancelToken()

    def fire() -> float:
        at = time.monotonic()
        token.fire("client disconnected")
        return at

    return token, fire


def fire_mid_generation(model: FakeModel, fire: Callable[[], float], criteria: Any) -> float:
    """`fire()` once a 5000-token generation in a thread has made 20; when it fired."""
    kwargs = {"max_new_tokens": 5000, "stopping_criteria": [criteria]}
    thread = threading.Thread(target=model.generate, kwargs=kwargs)
    thread.start()
    deadline = time.monotonic() + WATCHDOG
    while len(model.made) < 20 and time.monotonic() < deadline:
        time.sleep(0.001)
    fired_at = fire()
    thread.join(WATCHDOG)
    assert not thread.is_alive()
    return fired_at


def streamed(model: FakeModel, token: CancelToken | None = None, **kwargs: Any) -> Generation[int]:
    """`model.generate(**kwargs)` by `generate_in_thread`, with a streamer, bound to `token`
    (a fresh one by default)."""
    token = token if token is not None else CancelToken()
    return generate_in_thread(model.generate, token=token, streamer=FakeStreamer(), **kwargs)


def warned(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_criteria_stops_within_one_token_of_the_cancellation(
    caplog: pytest.LogCaptureFixture, quick_watch: float
) -> None:
    model = FakeModel()
    token, fire = fired_token()
    criteria = CancelCriteria(token)
    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        fired_at = fire_mid_generation(model, fire, criteria)
        time.sleep(quick_watch * 4)
    assert warned(caplog) == []  # it was asked: never reported as a criteria nobody calls
    assert model.made_after(fired_at) <= 1
    assert criteria.stopped
    assert criteria.stopped_at is not None
    usage = token.usage
    assert usage is not None
    assert usage.prompt_tokens == 5
    assert usage.completion_tokens == len(model.made)
    assert usage.after_cancel <= 1


@pytest.mark.parametrize("criteria", [True, False], ids=["criteria", "control"])
def test_a_fired_token_stops_every_row_at_once_only_through_the_criteria(criteria: bool) -> None:
    model = FakeModel(step=0.0005)
    token, fire = fired_token()
    fire()
    given: list[Callable[..., Any]] = [CancelCriteria(token)] if criteria else []
    model.generate(max_new_tokens=300, stopping_criteria=given, rows=3)
    if not criteria:  # the control: a cancelled token alone stops nothing
        assert len(model.made) == 300
        assert token.usage is None
        return
    assert len(model.made) == 1
    assert token.usage is not None
    assert (token.usage.prompt_tokens, token.usage.completion_tokens) == (15, 3)


def test_rows_given_are_counted_instead_of_the_rows_asked_about() -> None:
    # A beam search of 3 asks about 6 candidates per token: 3 rows are computed.
    token = CancelToken()
    FakeModel(step=0).generate(
        max_new_tokens=4, stopping_criteria=[CancelCriteria(token, rows=3)], rows=6
    )
    assert token.usage is not None
    assert (token.usage.prompt_tokens, token.usage.completion_tokens) == (15, 12)
    bad: tuple[Any, ...] = (0, True, 2.0)
    for rows in bad:
        with pytest.raises(ValueError, match="rows must be None or an int > 0"):
            CancelCriteria(token, rows=rows)


@pytest.mark.parametrize(
    ("given", "rows"),
    [
        ({}, None),  # the rows asked about
        ({"num_beams": 3}, 6),  # a beam search: batch (2) times beams
        ({"num_beams": 1}, None),  # greedy: what it asks about is what it computes
        ({"num_beams": 3, "rows": 4}, 4),  # said outright: that wins
    ],
    ids=["plain", "beams", "one-beam", "rows"],
)
def test_generate_in_thread_counts_a_beam_searchs_rows(given: dict[str, Any], rows: int) -> None:
    seen: list[dict[str, Any]] = []

    def generate(**kwargs: Any) -> None:
        seen.append(kwargs)

    generation = generate_in_thread(generate, token=CancelToken(), input_ids=FakeIds(2, 5), **given)
    generation.result(WATCHDOG)
    assert generation.criteria.rows == rows
    assert "rows" not in seen[0]  # ours, not generate()'s
    assert seen[0].get("num_beams") == given.get("num_beams")
    with pytest.raises(ValueError, match="rows must be None or an int > 0"):
        generate_in_thread(generate, token=CancelToken(), rows=0)


def test_finished_generation_is_never_marked_stopped(
    caplog: pytest.LogCaptureFixture, quick_watch: float
) -> None:
    model = FakeModel(step=0)
    token, fire = fired_token()
    criteria = CancelCriteria(token)
    model.generate(max_new_tokens=10, stopping_criteria=[criteria])
    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        fire()
        time.sleep(quick_watch * 4)
    assert warned(caplog) == []  # nor reported
    assert not criteria.stopped
    assert token.usage is not None
    assert (token.usage.completion_tokens, token.usage.after_cancel) == (10, 0)


def test_criteria_outside_a_request_warns_at_the_callers_line_and_never_stops() -> None:
    with pytest.warns(RuntimeWarning, match="outside a request") as warned:
        criteria = CancelCriteria()
    model = FakeModel(step=0)
    assert model.generate(max_new_tokens=50, stopping_criteria=[criteria]) == 50
    assert not criteria.stopped
    with pytest.warns(RuntimeWarning, match="outside a request") as warned_too:
        generation = generate_in_thread(model.generate, max_new_tokens=5)
    assert generation.result(WATCHDOG) == 55
    # This file's lines, not generate_in_thread's: the warning shows where the fix goes.
    assert [w.filename for w in [*warned, *warned_too]] == [__file__, __file__]


def test_criteria_made_in_a_plain_thread_has_no_token() -> None:
    # threading.Thread does not carry the request's context: why the token is taken before.
    made: list[CancelCriteria] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        inside = CancelCriteria()
        warned: list[warnings.WarningMessage] = []

        def in_thread() -> None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                made.append(CancelCriteria())
            warned.extend(caught)

        thread = threading.Thread(target=in_thread)
        thread.start()
        thread.join(WATCHDOG)
        assert [w.category for w in warned] == [RuntimeWarning]
        made.append(inside)
        await respond(send)

    asyncio.run(ClientConnection().run(CancelOnDisconnectMiddleware(app)))
    in_thread, inside = made
    assert in_thread.token is None
    assert inside.token is not None


def test_a_token_of_the_wrong_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"token must be a CancelToken or None, got 'token' \(str"):
        CancelCriteria("token")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token must be a CancelToken"):
        generate_in_thread(FakeModel().generate, token=object())  # type: ignore[arg-type]


UNASKED = "a transformers generate() has not asked its CancelCriteria"


@pytest.fixture
def quick_watch(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(asgi_cancel.transformers, "STILL_RUNNING_AFTER", 0.05)
    return 0.05


def test_criteria_never_called_is_reported_while_its_generation_runs_on(
    caplog: pytest.LogCaptureFixture, quick_watch: float
) -> None:
    # run_in_executor, the criteria made in the endpoint but never passed to generate(): the
    # generation runs to its end, and the log says why, STILL_RUNNING_AFTER after the cancel.
    model = FakeModel(step=0.002)
    wall_minus_monotonic = time.time() - time.monotonic()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        CancelCriteria()  # made, and forgotten
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: model.generate(max_new_tokens=600)
        )
        await respond(send)

    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        asyncio.run(leave(CancelOnDisconnectMiddleware(app), when=lambda: len(model.made) >= 5))
        assert model.ended.wait(WATCHDOG)
    assert len(model.made) == 600
    records = warned(caplog)
    assert len(records) == 1, caplog.text
    assert records[0].getMessage().startswith(UNASKED)
    assert "after its request was cancelled, nor before" in records[0].getMessage()
    # Reported while the thread still generated, not once it was done.
    assert records[0].created - wall_minus_monotonic < model.made[-1] - 0.2


@pytest.mark.parametrize("keep", ["shield", "detach", "shield-stream"])
def test_shielded_or_detached_generation_runs_to_the_end(
    caplog: pytest.LogCaptureFixture, quick_watch: float, keep: str
) -> None:
    """And a criteria made there but never called is not reported: shielded work runs on."""
    model = FakeModel(step=0.001)
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        with shield() if keep.startswith("shield") else detach():
            CancelCriteria()  # never called, on purpose
            if keep == "shield-stream":
                generation = generate_in_thread(
                    model.generate, streamer=FakeStreamer(), max_new_tokens=150
                )
                seen.extend(await asyncio.to_thread(list, generation))
            else:
                seen.append(criteria := CancelCriteria())
                await asyncio.to_thread(
                    model.generate, max_new_tokens=150, stopping_criteria=[criteria]
                )
        await respond(send)

    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        asyncio.run(leave(CancelOnDisconnectMiddleware(app), when=lambda: len(model.made) >= 10))
        time.sleep(quick_watch * 2)  # the 140 tokens after the disconnect took 3 x quick_watch
    assert warned(caplog) == []
    assert len(model.made) == 150
    if keep == "shield-stream":
        assert len(seen) == 150  # every text read
    else:
        assert not seen[0].stopped


def test_stream_ends_at_the_disconnect_and_the_thread_within_one_token() -> None:
    model = FakeModel()
    token, fire = fired_token()
    generation = streamed(model, token, max_new_tokens=5000)
    texts = []
    fired_at = 0.0
    for text in generation:
        texts.append(text)
        if len(texts) == 20:
            fired_at = fire()
    assert not generation.thread.is_alive()
    assert generation.stopped
    assert not generation.left_running
    assert model.made_after(fired_at) <= 1
    assert len(texts) <= 22
    assert token.usage is not None
    assert token.usage.after_cancel <= 1


@pytest.mark.parametrize("how", ["cancel", "stop"])
def test_the_reader_ends_before_any_token_at_a_cancel_or_a_stop(how: str) -> None:
    # A long prefill: no token comes, and the reader still ends at the disconnect or stop().
    model = FakeModel(first_token_delay=0.5)
    token, fire = fired_token()
    generation = streamed(model, token, max_new_tokens=5000, join_timeout=0)
    threading.Timer(0.05, fire if how == "cancel" else generation.stop).start()
    started = time.monotonic()
    assert list(generation) == []
    assert time.monotonic() - started < 0.45
    assert model.ended.wait(WATCHDOG)
    assert len(model.made) == 1  # the first token, then the criteria stopped it
    assert generation.stopped


def test_stream_without_cancellation_reads_everything() -> None:
    model = FakeModel(step=0)
    generation = streamed(model, max_new_tokens=40)
    assert len(list(generation)) == 40
    assert generation.result(WATCHDOG) == 40
    assert not generation.stopped


@pytest.mark.parametrize("poll", [False, True], ids=["read", "polled-then-read"])
def test_thread_that_ignores_the_token_is_logged_not_waited_on(
    caplog: pytest.LogCaptureFixture, poll: bool
) -> None:
    model = FakeModel()
    token, fire = fired_token()
    generation = streamed(model, token, max_new_tokens=400, ignore_criteria=True, join_timeout=0.1)
    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        if poll:
            # `result(timeout)` returns None while it runs: a poll, not a thread left running.
            assert generation.result(0.02) is None
            assert not generation.left_running
            assert caplog.records == []
            fire()  # the request stops; this thread ignores it
        else:
            threading.Timer(0.05, fire).start()
        started = time.monotonic()
        list(generation)
        waited = time.monotonic() - started
    assert waited < 0.6  # the 400 tokens take ~0.8 s or more
    assert generation.left_running
    assert [record.getMessage() for record in caplog.records] == [
        "a generate() thread still runs 0.1s after its request stopped "
        "(it does not check CancelCriteria?); left running"
    ]
    assert model.ended.wait(WATCHDOG)  # left to finish by itself


def test_generation_error_ends_the_stream_with_it() -> None:
    model = FakeModel(step=0)
    generation = streamed(model, max_new_tokens=50, fail_at=5)
    with pytest.raises(RuntimeError, match="the model broke"):
        list(generation)
    whole = generate_in_thread(model.generate, token=CancelToken(), max_new_tokens=9, fail_at=2)
    with pytest.raises(RuntimeError, match="the model broke"):
        whole.result(WATCHDOG)


def test_reader_that_leaves_early_stops_the_generation() -> None:
    """A `for` loop left with `break`: the reader is closed when the loop drops it, not by a
    `close()` of the caller's."""
    model = FakeModel()
    generation = streamed(model, max_new_tokens=5000)
    for count, _ in enumerate(generation, 1):
        if count == 5:
            break
    assert model.ended.wait(WATCHDOG)
    assert len(model.made) < 50
    assert generation.stopped


@pytest.mark.parametrize("where", ["worker-thread", "event-loop"])
def test_closing_the_reader_in_an_event_loop_never_waits_for_the_thread(where: str) -> None:
    # Starlette's iterator wrapper, collected in the loop's thread after a disconnect, closes
    # the reader there: a join would stall the loop until the next token. A worker thread that
    # closes it still waits for the generation, as documented.
    model = FakeModel(step=0.5)
    generation = streamed(model, max_new_tokens=5000)
    reader = cast(Generator[str, None, None], iter(generation))
    assert next(reader) == "t1 "
    waited: list[float] = []

    def close() -> None:
        started = time.monotonic()
        reader.close()
        waited.append(time.monotonic() - started)

    async def in_the_loop() -> None:
        close()

    if where == "event-loop":
        asyncio.run(asyncio.wait_for(in_the_loop(), WATCHDOG))
        assert waited[0] < 0.25  # the next token is ~0.5 s away
        assert generation.thread.is_alive()
    else:
        close()
        assert not generation.thread.is_alive()
    assert model.ended.wait(WATCHDOG)
    assert len(model.made) == 2  # stopped at the token after the close
    assert generation.stopped
    assert not generation.left_running


def test_without_a_streamer_the_criteria_given_are_kept_and_there_is_nothing_to_read() -> None:
    model = FakeModel(step=0)
    calls: list[int] = []

    def counting(input_ids: FakeIds, scores: object) -> FakeBools:
        calls.append(input_ids.shape[1])
        return input_ids.new_full((1,), 0)

    given = [counting]
    generation = generate_in_thread(
        model.generate, token=CancelToken(), max_new_tokens=7, stopping_criteria=given
    )
    with pytest.raises(ValueError, match="streamer="):  # join_timeout: test_validate.py
        list(generation)
    assert generation.result(WATCHDOG) == 7
    assert given == [counting]
    assert len(calls) == 7


def test_error_of_a_stopped_generation_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = FakeModel(first_token_delay=0.1)
    token, fire = fired_token()
    fire()
    generation = streamed(model, token, max_new_tokens=9, fail_at=1)
    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        assert list(generation) == []
    assert "a stopped generate() raised" in caplog.text
