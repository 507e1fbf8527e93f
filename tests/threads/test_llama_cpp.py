"""llama-cpp-python generating in a worker thread, under real uvicorn, with a client that leaves.

Each case sends a completion from a raw socket, closes the connection mid-generation and reads
from the engine's side (`llama_probe`: llama.cpp's forward passes, timed) how many tokens were
generated after the close. The control runs the same app without `asgi_cancel.llama_cpp` (the
middleware alone cancels the app task; the thread goes on) and shows the generation running to
`max_tokens`; with it, the generation stops within a few tokens. Then llama-cpp-python's own
OpenAI server (`llama_cpp.server`), alone and through `asgi_cancel.llama_cpp.server_app()`.

Needs llama-cpp-python (and gguf, to write the model): `.ci/llama_cpp.sh` makes that venv and
runs this file there, where a missing llama_cpp is a failure (ASGI_CANCEL_REQUIRE_LLAMA_CPP=1);
elsewhere the module is skipped. Each case's figures are printed at the end, and written as
JSON to ASGI_CANCEL_LLAMA_RESULTS when it is set (docs/threads.md quotes them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ..servers.client import (
    FIN,
    close,
    connect,
    get,
    read_head,
    read_response,
    recv_some,
    send_request,
)
from ..servers.runner import UVICORN_ARGS, Server, ServerSpec, command

if importlib.util.find_spec("llama_cpp") is None:
    if os.environ.get("ASGI_CANCEL_REQUIRE_LLAMA_CPP") == "1":
        raise ImportError("llama_cpp is not installed, and ASGI_CANCEL_REQUIRE_LLAMA_CPP=1")
    pytest.skip(
        "llama-cpp-python is not installed (.ci/llama_cpp.sh runs these)", allow_module_level=True
    )

pytestmark = pytest.mark.servers

MAX_TOKENS = 600  # ~1 s of the tiny model on one thread: the control runs to the end
LEAVE_AFTER = 20  # tokens generated (engine side) before the client leaves
# Tokens generated after the close, with asgi-cancel: the disconnect is read, the token fired,
# the criterion asked at the next token. A leak runs to MAX_TOKENS.
AFTER_CLOSE_BOUND = 40
SETTLE = 0.5  # seconds without a forward pass: the generation stopped
UVICORN = ServerSpec("uvicorn", command(*UVICORN_ARGS, "--http", "h11"))
UVICORN_FACTORY = ServerSpec("uvicorn", command(*UVICORN_ARGS, "--http", "h11", "--factory"))
RESULTS: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("ASGI_CANCEL_LLAMA_MODEL")
    if given:
        return Path(given)
    from .tiny_gguf import write

    return write(tmp_path_factory.mktemp("model") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def servers(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    pool = ServerPool(model, tmp_path_factory)
    try:
        yield pool
    finally:
        pool.stop()
    if RESULTS:
        print_results()


class ServerPool:
    """One server per (app, mode), started on first use, all stopped at the module's end."""

    def __init__(self, model: Path, tmp: pytest.TempPathFactory) -> None:
        self.model = model
        self.tmp = tmp
        self.running: dict[tuple[str, str], Server] = {}

    def get(self, app: str, mode: str) -> Server:
        key = (app, mode)
        if key not in self.running:
            if app == "app":
                server = Server(UVICORN, "tests.threads.llama_app:asgi", self.tmp.mktemp(mode))
            else:
                target = "tests.threads.llama_server_app:create_app"
                server = Server(UVICORN_FACTORY, target, self.tmp.mktemp(f"server-{mode}"))
            server.env.update(
                ASGI_CANCEL_LLAMA_MODE=mode,
                ASGI_CANCEL_LLAMA_MODEL=str(self.model),
                # llama_cpp.server's settings, from the environment as it documents.
                MODEL=str(self.model),
                N_CTX="4096",
                N_THREADS="1",
                VERBOSE="false",
            )
            server.start()
            self.running[key] = server
        return self.running[key]

    def stop(self) -> None:
        for server in self.running.values():
            server.stop()


def probe(server: Server) -> dict[str, Any]:
    response = get(server.port, "/probe")
    assert response.status == 200, response
    result: dict[str, Any] = json.loads(response.body)
    return result


def wait_for(server: Server, what: str, predicate: Any, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state = probe(server)
        if predicate(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {server.log()[-3000:]}")
        time.sleep(0.02)


def post(port: int, path: str, body: dict[str, Any], *extra: tuple[str, str]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = connect(port, timeout=30.0)
    headers = (("Content-Type", "application/json"), ("Content-Length", str(len(data))), *extra)
    send_request(sock, "POST", path, headers=headers, body=data)
    return sock


def started(server: Server, before: int, tokens: int = 1) -> dict[str, Any]:
    """The probe once the generation after the first `before` has made `tokens` tokens."""

    def ready(state: dict[str, Any]) -> bool:
        generations = state["generations"]
        return len(generations) > before and len(generations[before]["evals"]) >= tokens

    return wait_for(server, "the generation to start", ready)


def completion_body(kind: str, max_tokens: int, stream: bool, thread: str) -> dict[str, Any]:
    """The request for our app or for llama_cpp.server (which ignores `thread` and `chat`)."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream, "temperature": 0.0}
    body |= {"thread": thread, "prompt": "hello there"}
    if kind == "chat":
        body |= {"chat": True, "messages": [{"role": "user", "content": "hello there"}]}
    return body


def path_of(app: str, kind: str, thread: str) -> str:
    if app == "server":
        return "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return "/v1/completions/sync" if thread == "sync" else "/v1/completions"


@contextmanager
def departed(server: Server, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Send the request, close the connection once LEAVE_AFTER tokens were generated (a stream:
    once its first chunks arrived too), and yield what happened then: `closed_at`, `index` (the
    generation's, in the probe)."""
    before = len(probe(server)["generations"])
    sock = post(server.port, path, body)
    try:
        state = started(server, before, LEAVE_AFTER)
        if body["stream"]:
            status, _, rest = read_head(sock)
            assert status == 200
            while rest.count(b"data: ") < 2:
                rest += recv_some(sock)
        closed_at = close(sock, FIN)
    except BaseException:
        sock.close()
        raise
    assert len(state["generations"]) == before + 1, "another generation ran meanwhile"
    yield {"closed_at": closed_at, "index": before}


def settled(server: Server, index: int, timeout: float = 60.0) -> dict[str, Any]:
    """The generation `index` once it made no forward pass for SETTLE seconds."""
    deadline = time.monotonic() + timeout
    while True:
        generation = probe(server)["generations"][index]
        last = generation["evals"][-1]
        if time.monotonic() - last > SETTLE:
            return dict(generation)
        if time.monotonic() > deadline:
            raise AssertionError(f"generation {index} still running after {timeout} s")
        time.sleep(0.05)


def measure(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with departed(server, path, body) as left:
        pass
    generation = settled(server, left["index"])
    evals = generation["evals"]
    after = [t for t in evals if t > left["closed_at"]]
    return {
        # The prompt's forward pass, then one per generated token.
        "generated": len(evals),
        "after_close": len(after),
        "stop_ms": round(max(0.0, evals[-1] - left["closed_at"]) * 1000, 1),
        "index": left["index"],
        "closed_at": left["closed_at"],
    }


def result(app: str, mode: str, kind: str, stream: bool, thread: str, **figures: Any) -> None:
    """One row of the measurements (printed at the end, and docs/threads.md's table)."""
    RESULTS.append(
        {"app": app, "mode": mode, "kind": kind, "stream": stream, "thread": thread, **figures}
    )


def assert_stopped(figures: dict[str, Any]) -> None:
    """The generation stopped within a few tokens of the close, far from MAX_TOKENS."""
    assert figures["after_close"] <= AFTER_CLOSE_BOUND, figures
    assert figures["generated"] < MAX_TOKENS // 2, figures


# (app, kind, stream, thread): our app, each way of reaching a worker thread; llama_cpp.server.
CASES = [("app", "completion", False, t) for t in ("to_thread", "thread", "executor", "sync")]
CASES += [("app", "completion", True, "to_thread"), ("app", "completion", True, "thread")]
CASES += [("app", "chat", False, "to_thread"), ("app", "chat", True, "thread")]
CASES += [
    ("server", kind, stream, "") for kind in ("completion", "chat") for stream in (False, True)
]
CASE_IDS = [
    "-".join(filter(None, (app, kind, "stream" if stream else "whole", thread)))
    for app, kind, stream, thread in CASES
]
MODES = ["alone", "middleware", "adapter"]
MODE_IDS = ["alone", "control", "adapter"]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize(("app", "kind", "stream", "thread"), CASES, ids=CASE_IDS)
def test_a_generation_stops_when_the_client_leaves(
    servers: ServerPool, app: str, mode: str, kind: str, stream: bool, thread: str
) -> None:
    server = servers.get(app, mode)
    reports = len(probe(server)["cancelled"])
    body = completion_body(kind, MAX_TOKENS, stream, thread)
    figures = measure(server, path_of(app, kind, thread), body)
    result(app, mode, kind, stream, thread, **figures)
    if mode != "adapter" and (app == "app" or not stream):
        # Alone, nothing is cancelled; with the middleware alone, the app task is, and the
        # thread is not (llama_cpp.server awaits the generation in run_in_threadpool, which the
        # app task's cancellation does not interrupt): either way it runs to max_tokens.
        assert figures["generated"] == MAX_TOKENS
        return
    # llama_cpp.server's streams stop alone too: it asks request.is_disconnected() after each
    # chunk.
    assert_stopped(figures)
    if app == "server":
        return  # no cancel report: llama_cpp.server's own app
    # What the cancelled generation cost, as the cancel report got it (TokenUsage).
    state = wait_for(server, "the cancel report", lambda s: len(s["cancelled"]) > reports)
    usage = state["cancelled"][reports]
    generation = state["generations"][figures["index"]]
    assert usage["prompt_tokens"] == generation["prompt_tokens"]
    # One count per forward pass: the prompt's, then one per token (the last token sampled is
    # counted too: it cost its forward pass's logits).
    assert usage["completion_tokens"] == figures["generated"]
    assert usage["after_cancel"] <= AFTER_CLOSE_BOUND


QUEUED = [("app", "alone"), ("app", "middleware"), ("app", "adapter")]
QUEUED += [("server", "alone"), ("server", "adapter")]


@pytest.mark.parametrize(("app", "mode"), QUEUED, ids=[f"{a}-{m}" for a, m in QUEUED])
def test_the_next_request_queued_behind_a_departed_one_starts_at_once(
    servers: ServerPool, app: str, mode: str
) -> None:
    server = servers.get(app, mode)
    body = completion_body("completion", MAX_TOKENS, False, "to_thread")
    nxt_body = completion_body("completion", 4, True, "thread")
    with departed(server, path_of(app, "completion", "to_thread"), body) as left:
        sock = post(server.port, path_of(app, "completion", "thread"), nxt_body)
        sent_at = time.monotonic()
        try:
            status, _, rest = read_head(sock)
            while b"data: " not in rest:
                rest += recv_some(sock)
            first_at = time.monotonic()
        finally:
            sock.close()
    assert status == 200
    state = probe(server)
    first = state["generations"][left["index"]]
    nxt = state["generations"][left["index"] + 1]
    after = [t for t in first["evals"] if t > left["closed_at"]]
    ttft_ms = round((first_at - sent_at) * 1000, 1)
    figures = {"generated": len(first["evals"]), "after_close": len(after), "next_ttft_ms": ttft_ms}
    result(app, mode, "queued", True, "", **figures)
    if mode == "adapter":
        assert_stopped(figures)
    else:
        assert len(first["evals"]) == MAX_TOKENS
        assert nxt["started"] >= first["evals"][-1]  # it waited for the whole departed one


@pytest.mark.parametrize("how", ["deadline", "cancel-by-id"])
@pytest.mark.parametrize("mode", ["middleware", "adapter"], ids=["control", "adapter"])
def test_a_deadline_or_a_cancel_by_id_stops_the_generation_too(
    servers: ServerPool, mode: str, how: str
) -> None:
    # The client stays; its budget runs out 150 ms in, or an operator cancels its request by
    # id: the same token fires. The control is cancelled too, and its thread runs on.
    server = servers.get("app", mode)
    before = len(probe(server)["generations"])
    request_id = f"llama-{mode}-{time.monotonic_ns()}"
    header = ("x-request-timeout", "150ms") if how == "deadline" else ("X-Request-Id", request_id)
    body = completion_body("completion", MAX_TOKENS, False, "to_thread")
    with post(server.port, "/v1/completions", body, header) as sock:
        started(server, before, 1 if how == "deadline" else LEAVE_AFTER)
        cancelled_at = time.monotonic()
        if how == "cancel-by-id":
            answer = fetch_json(server, f"/v1/requests/{request_id}/cancel", {})
            assert answer == {"id": request_id, "cancelled": True}
            assert read_response(sock).status == 499  # still connected: told, not cut
        generation = settled(server, before)
    evals = generation["evals"]
    after = [t for t in evals if t > cancelled_at]
    if how == "cancel-by-id":
        stop_ms = round(max(0.0, evals[-1] - cancelled_at) * 1000, 1)
        figures = {"generated": len(evals), "after_close": len(after), "stop_ms": stop_ms}
        result("app", mode, how, False, "to_thread", **figures)
    if mode == "middleware":
        assert len(evals) == MAX_TOKENS
    else:
        assert how == "deadline" or len(after) <= AFTER_CLOSE_BOUND
        assert len(evals) < MAX_TOKENS // 2


def test_a_thread_that_ignores_the_token_is_reported_and_not_waited_for(
    servers: ServerPool,
) -> None:
    server = servers.get("app", "adapter")
    reports = len(probe(server)["cancelled"])
    body = completion_body("completion", MAX_TOKENS, False, "ignore")
    with departed(server, "/v1/completions", body) as left:
        pass
    generation = settled(server, left["index"])
    assert len(generation["evals"]) == MAX_TOKENS  # it ignored the token: ran to the end
    log = server.log()
    assert "a llama.cpp generation has not asked its stopping criteria" in log, log[-3000:]
    assert "after its request was cancelled, nor before" in log
    # The request was over while its thread still generated: not waited for.
    report = probe(server)["cancelled"][reports]
    assert report["finished_at"] is not None
    assert report["finished_at"] < generation["evals"][-1]


def test_a_finished_generation_is_never_marked_cancelled(servers: ServerPool) -> None:
    # A whole completion the client waits for: its own finish_reason, no cancel report.
    server = servers.get("app", "adapter")
    reports = len(probe(server)["cancelled"])
    for path in ("/v1/completions", "/v1/completions/sync"):
        response = fetch_json(server, path, completion_body("completion", 12, False, "thread"))
        assert response["choices"][0]["finish_reason"] == "length"
        assert response["usage"]["completion_tokens"] == 12
    assert len(probe(server)["cancelled"]) == reports


@pytest.mark.parametrize("draft", [False, True], ids=["", "draft-model"])
def test_a_cancel_between_the_last_token_and_the_end_leaves_finish_reason(
    model: Path, draft: bool
) -> None:
    # llama-cpp-python asks its criteria once more after the loop: a cancel that lands then
    # (the last token generated, the response not yet sent) does not turn "length" into "stop".
    # With a draft model (speculative decoding) that call's ids hold the drafted tokens too.
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from asgi_cancel import CancelToken
    from asgi_cancel.llama_cpp import stopping_criteria

    drafts = LlamaPromptLookupDecoding(num_pred_tokens=5, max_ngram_size=2) if draft else None
    llm = llama_cpp.Llama(
        model_path=str(model), n_ctx=1024, n_threads=1, verbose=False, seed=1, draft_model=drafts
    )
    token = CancelToken()
    asked: list[int] = []

    def cancel_at_the_last_token(input_ids: Any, logits: Any) -> bool:
        asked.append(len(input_ids))
        if len(asked) == 21:  # the closing call; the cancel criterion is asked after it
            token.fire("client disconnected")
        return False

    criteria = stopping_criteria(cancel_at_the_last_token, token=token)
    result = llm.create_completion(
        "the of and the of and the of and",  # a repeating prompt: the lookup drafts from it
        max_tokens=20,
        temperature=0.0,
        stopping_criteria=criteria,
    )
    assert len(asked) == 21  # twenty tokens, then the closing call
    assert (asked[-1] > asked[-2] + 1) is draft  # the drafted tokens were evaluated
    assert token.cancelled
    assert result["choices"][0]["finish_reason"] == "length"
    assert not criteria[-1].stopped
    assert token.usage is not None
    assert (token.usage.completion_tokens, token.usage.after_cancel) == (20, 0)


def test_outside_a_request_the_criteria_never_stop_a_generation(model: Path) -> None:
    import llama_cpp

    from asgi_cancel.llama_cpp import logits_processor, stopping_criteria

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=512, n_threads=1, verbose=False)
    with pytest.warns(RuntimeWarning, match="outside a request") as warned:
        criteria = stopping_criteria()
    with pytest.warns(RuntimeWarning, match="outside a request") as warned_too:
        processors = logits_processor(llm)
    assert [w.filename for w in [*warned, *warned_too]] == [__file__, __file__]  # these lines
    result = llm.create_completion(
        "hello", max_tokens=8, temperature=0.0, stopping_criteria=criteria
    )
    assert result["choices"][0]["finish_reason"] == "length"
    assert criteria[-1].generated == 8
    chat = llm.create_chat_completion(
        messages=[{"role": "user", "content": "hello"}], max_tokens=8, logits_processor=processors
    )
    assert chat["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_grammar_that_forbids_the_end_still_stops_and_the_process_lives(
    model: Path, kind: str
) -> None:
    # llama-cpp-python applies a grammar after the logits processors: the cancel must leave
    # the grammar a token of its own (none aborted the process inside llama.cpp), then end.
    # In a subprocess (`llama_grammar`), so such an abort fails this test, not the session.
    def generate(cancel_at: int) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "tests.threads.llama_grammar", str(model), kind, str(cancel_at)],
            cwd=Path(__file__).parents[2],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
        return result

    control = generate(cancel_at=0)
    assert control["chunks"] > 40  # the grammar kept it open: no end-of-sequence allowed
    cancelled = generate(cancel_at=5)
    assert cancelled["finish"] == "stop"
    assert cancelled["chunks"] <= 5 + 2  # the token in progress, then end-of-sequence


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_llama_cpp_server_with_a_grammar_stops_and_lives(servers: ServerPool, kind: str) -> None:
    # The grammar forbids end-of-sequence until its `}` (not written by the tiny model within
    # LEAVE_AFTER tokens): the cancel lands mid-structure. An abort took the server down.
    server = servers.get("server", "adapter")
    body = completion_body(kind, MAX_TOKENS, False, "") | {"grammar": 'root ::= "{" [a-z ]* "}"'}
    figures = measure(server, path_of("server", kind, ""), body)
    assert figures["after_close"] <= AFTER_CLOSE_BOUND, figures
    response = fetch_json(server, path_of("server", kind, ""), {**body, "max_tokens": 4})
    assert response["usage"]["completion_tokens"] <= 4  # the same server, still serving


def fetch_json(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with post(server.port, path, body) as sock:
        response = read_response(sock)
    assert response.status == 200, response
    result: dict[str, Any] = json.loads(response.body)
    return result


THREADS = {"to_thread": "`asyncio.to_thread`", "thread": "`threading.Thread`", "": ""}
THREADS |= {"executor": "`run_in_executor`", "sync": "FastAPI `def` endpoint"}


def path_label(row: dict[str, Any]) -> str:
    """What docs/threads.md calls a row (benchmarks/threads.py renders the JSON there)."""
    where = "your app" if row["app"] == "app" else "`llama_cpp.server`"
    where += f", {THREADS[row['thread']]}" if row["thread"] else ""
    if row["kind"] == "queued":
        return f"{where}: the next request's time to first chunk (ms)"
    if row["kind"] == "cancel-by-id":
        return f"{where}: a cancel by id, whole"
    call = "create_chat_completion" if row["kind"] == "chat" else "create_completion"
    return f"{where}: `{call}`, {'streaming' if row['stream'] else 'whole'}"


def print_results() -> None:
    lines = [
        "",
        "llama.cpp: tokens generated after the client closed, close -> stop (ms)",
        f"{'app':8} {'mode':10} {'kind':10} {'stream':6} {'thread':9} {'generated':>9} "
        f"{'after':>6} {'stop ms':>8} {'next ttft ms':>12}",
    ]
    # In the order of docs/threads.md's table: llama_cpp.server's departures last.
    rows = sorted(RESULTS, key=lambda row: row["app"] == "server" and row["kind"] != "queued")
    for row in rows:
        lines.append(
            f"{row['app']:8} {row['mode']:10} {row['kind']:10} {row['stream']!s:6} "
            f"{row['thread']:9} {row['generated']:>9} {row.get('after_close', ''):>6} "
            f"{row.get('stop_ms', ''):>8} {row.get('next_ttft_ms', ''):>12}"
        )
    print("\n".join(lines))  # noqa: T201 - the measurements, with -s or -rA
    out = os.environ.get("ASGI_CANCEL_LLAMA_RESULTS")
    if out:
        labelled = [{"path": path_label(row), **row} for row in rows]
        Path(out).write_text(json.dumps(labelled, indent=1))
