"""Real transformers `generate()` in worker threads, under uvicorn, with a client that leaves.

A tiny random-weight Llama (example_app/tiny_model.py), one generation at a time. For each
threading pattern (tests/threads/_app.py): without the middleware and the adapter, the
generation runs to `max_new_tokens` for a client that left; with them, it stops within a few
tokens of the close, counted from the engine's side (its stopping-criteria calls), and the
request's `TokenUsage` says what it cost. Skipped where torch or transformers is missing (the
main venv); under .ci/vllm.sh (`ASGI_CANCEL_REQUIRE_VLLM=1`) that is a failure.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from . import require

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch and transformers warn on import; not ours to fix
    torch = require("torch")
    transformers = require("transformers")
    import asgi_cancel.transformers
    from asgi_cancel import CancelToken
    from asgi_cancel.transformers import CancelCriteria, generate_in_thread

    from ..vllm._harness import report, tiny_model, wait_for
    from ._app import ROUTES, Engine, Server
    from ._measure import LEAVE_AFTER, depart, stop_by

pytestmark = [pytest.mark.vllm, pytest.mark.servers, pytest.mark.timeout(300)]

MAX_NEW_TOKENS = 300  # about 1-3 s on this model; the control runs it all
# The token being computed at the close, and a few more while the disconnect reaches the loop
# on a loaded machine (the generating thread holds the GIL between tokens: up to 9 seen on 2
# shared cores); a leak makes the hundreds the control shows.
MAX_TOKENS_AFTER_CLOSE = 30
MEASURED: dict[str, Any] = {}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    torch.set_num_threads(1)  # one core for the generation, one for the loop and the client
    with Server(Engine(tiny_model())) as running:
        yield running
    report("threads", MEASURED)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mode", ["bare", "mw"], ids=["control", "adapter"])
def test_a_departed_client_stops_the_generation_only_with_the_adapter(
    server: Server, mode: str, route: str
) -> None:
    # A request sent right after the close queues behind the departed one (one generation at a
    # time): it gets its own tokens either way (how long it waited is measured, not asserted).
    measured = depart(server, mode, route, max_new_tokens=MAX_NEW_TOKENS, next_tokens=10)
    request_id = measured.pop("request_id")
    MEASURED[f"{mode} {route}"] = measured
    assert measured["next_tokens"] == 10
    if mode == "bare":  # without the middleware and the adapter: it runs to max_new_tokens
        assert measured["tokens"] == MAX_NEW_TOKENS, measured
        assert measured["tokens_after_close"] >= MAX_NEW_TOKENS - LEAVE_AFTER - 10, measured
        return
    assert measured["tokens_after_close"] <= MAX_TOKENS_AFTER_CLOSE, measured
    if route.startswith("stream"):
        assert measured["streamer_puts"] <= measured["tokens"] + 1  # the prompt's put
    wait_for(lambda: request_id in server.engine.usage, 10, "the request's usage")
    prompt, completion, after_cancel = server.engine.usage[request_id]
    assert prompt == measured["prompt_tokens"]
    # Read once the request was over. One that awaits its thread ends after it (the middleware
    # never unwinds a request around a worker thread it awaits): every token is counted. A
    # stream can end between two chunks, its reader closed (and its thread joined) after the
    # request: the last token may come after the count.
    if route.startswith("stream"):
        assert measured["tokens"] - 1 <= completion <= measured["tokens"]
    else:
        assert completion == measured["tokens"]
    assert after_cancel <= MAX_TOKENS_AFTER_CLOSE


@pytest.mark.parametrize("how", ["deadline", "cancel"], ids=["deadline", "cancel-by-id"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mode", ["middleware", "mw"], ids=["control", "adapter"])
def test_a_deadline_or_a_cancel_by_id_stops_the_generation_too(
    server: Server, mode: str, route: str, how: str
) -> None:
    # The client stays; its budget runs out, or an operator cancels it by id: the same token
    # fires. The control has the middleware and not the adapter: the request is cancelled
    # (the cancel answered 200), its thread generates on to max_new_tokens.
    measured = stop_by(server, mode, route, how, max_new_tokens=MAX_NEW_TOKENS)
    MEASURED[f"{how} {mode} {route}"] = measured
    if how == "cancel":
        assert measured["cancel_answer"] == "200", measured
    if mode == "middleware":
        assert measured["tokens"] == MAX_NEW_TOKENS, measured
    else:
        assert measured["tokens_after_fire"] <= MAX_TOKENS_AFTER_CLOSE, measured
        assert measured["tokens"] < MAX_NEW_TOKENS // 2, measured


def test_a_generation_that_finished_is_never_marked_stopped(
    server: Server, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The request goes on after its generations ended (or its client leaves during the last
    # chunks): a cancel then stops nothing, counts nothing, and reports nothing.
    monkeypatch.setattr(asgi_cancel.transformers, "STILL_RUNNING_AFTER", 0.05)
    engine = server.engine
    inputs = engine.inputs("a short one")
    prompt = inputs["input_ids"].shape[-1]
    token = CancelToken()
    criteria = CancelCriteria(token)
    streamer = transformers.TextIteratorStreamer(engine.tokenizer, skip_prompt=True)
    twelve = {**inputs, "max_new_tokens": 12, "min_new_tokens": 12}
    with engine.lock:
        output = engine.model.generate(**twelve, stopping_criteria=[criteria])
        generation = generate_in_thread(
            engine.model.generate, token=token, streamer=streamer, **twelve
        )
        text = "".join(generation)
    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        token.fire("client disconnected")
        streamed = generation.result(10)
        time.sleep(0.3)  # six times STILL_RUNNING_AFTER: a report would be in
    assert streamed is not None
    assert output.shape[-1] == streamed.shape[-1] == prompt + 12
    assert text
    assert not criteria.stopped
    assert not generation.stopped
    assert token.usage is not None
    assert token.usage.completion_tokens == 24
    assert token.usage.after_cancel == 0
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("shape", ["batch", "beams"])
def test_criteria_stops_a_real_batch_and_beam_search(server: Server, shape: str) -> None:
    engine = server.engine
    inputs = engine.tokenizer(["one prompt", "another prompt"], return_tensors="pt", padding=True)
    token = CancelToken()
    token.fire("client disconnected")
    criteria = CancelCriteria(token)
    extra = {"num_beams": 2} if shape == "beams" else {}
    with engine.lock:
        output = engine.model.generate(
            **inputs, max_new_tokens=50, min_new_tokens=50, stopping_criteria=[criteria], **extra
        )
    assert output.shape[-1] <= inputs["input_ids"].shape[-1] + 1
    assert criteria.stopped
    assert token.usage is not None
    assert token.usage.prompt_tokens > 0


@pytest.mark.parametrize("how", ["criteria", "generate_in_thread"])
@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beams"])
def test_usage_counts_the_rows_the_model_computes(server: Server, num_beams: int, how: str) -> None:
    # The judge is the model's forward passes. A beam search asks its criteria about twice its
    # beams (transformers 4.50 on: the candidates it picks from), so `rows=` says what it
    # computes; `generate_in_thread` works it out from the call's `num_beams=`.
    engine = server.engine
    inputs = engine.inputs("a prompt of a few tokens")
    prompt = inputs["input_ids"].shape[-1]
    forwarded: list[tuple[int, int]] = []

    def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        forwarded.append(tuple(kwargs["input_ids"].shape))

    token = CancelToken()
    call = {"max_new_tokens": 6, "min_new_tokens": 6, "num_beams": num_beams, "do_sample": False}
    with engine.lock:
        handle = engine.model.register_forward_hook(hook, with_kwargs=True)
        try:
            if how == "criteria":
                criteria = CancelCriteria(token, rows=num_beams if num_beams > 1 else None)
                engine.model.generate(**inputs, **call, stopping_criteria=[criteria])
            else:
                generate_in_thread(engine.model.generate, token=token, **inputs, **call).result(60)
        finally:
            handle.remove()
    assert forwarded[0] == (num_beams, prompt)  # the prefill: every beam
    assert forwarded[1:] == [(num_beams, 1)] * 5  # a token each; the sixth is never forwarded
    assert token.usage is not None
    assert token.usage.prompt_tokens == num_beams * prompt
    assert token.usage.completion_tokens == num_beams * 6
