"""A LiteLLM proxy before the demo's engine server, and a client that leaves: for test_litellm.py.

`run_proxy` starts LiteLLM's `litellm --config` from its venv with one model routed to the engine
server, and checks that a client that stays gets its answer on every route; `leave` sends one
request through it, closes the connection at a cell's point and reads, from the engine's own
counters, when the backend was done with the request and how many tokens it generated after the
close; `table` renders the outcomes as docs/integrations.md shows them.
"""

from __future__ import annotations

import json
import secrets
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from example_app.launch import HOST, ServerProcess, Subprocess, answers

from .helpers import (
    MODEL,
    close,
    completion_body,
    delta,
    open_request,
    read_until,
    request,
    stats,
    wait_for,
    wait_idle,
)

STEP = 0.1  # seconds per engine step: "within 100 ms" leaves room for one step at most
MAX_TOKENS = 16  # the leaving request: 1.6 s if nobody stops it
BLOCKER_TOKENS = 8  # holds the backend's only batch slot for 0.8 s
STOPS_WITHIN = 0.1  # seconds from the close to the backend being done with the request

ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


@dataclass(frozen=True)
class Cell:
    route: str  # a key of ROUTES
    stream: bool
    queued: bool  # the client leaves before the first token, while the backend queues it

    @property
    def name(self) -> str:
        mode = "streaming" if self.stream else "non-streaming"
        return f"{self.route}-{mode}-{'queued' if self.queued else 'mid-generation'}"


CELLS = [
    Cell(route, stream, queued)
    for route in ROUTES
    for stream in (False, True)
    for queued in (True, False)
]


def body(route: str, stream: bool, max_tokens: int) -> bytes:
    """One request in the route's own dialect (OpenAI chat and text, Responses, Anthropic)."""
    fields: dict[str, object] = {"model": MODEL, "stream": stream}
    messages = [{"role": "user", "content": "hi"}]
    if route == "completions":
        fields.update(prompt="hi", max_tokens=max_tokens)
    elif route == "responses":
        fields.update(input="hi", max_output_tokens=max_tokens)
    else:  # chat completions and Anthropic's messages
        fields.update(messages=messages, max_tokens=max_tokens)
    return json.dumps(fields).encode()


@dataclass(frozen=True)
class Outcome:
    seconds: float  # from the close until the backend is done with the request
    tokens_after_close: float
    aborted: bool
    engine_requests: float  # the leaving request's engine requests (a retry would show)

    def behaviour(self) -> str:
        return "stops" if self.aborted and self.seconds <= STOPS_WITHIN else "leaks"


Results = dict[str, dict[str, list[Outcome]]]  # proxy label -> cell name -> its runs


@dataclass
class Proxy:
    label: str
    process: Subprocess
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}


def leave(engine: ServerProcess, proxy: Proxy, cell: Cell, results: Results) -> Outcome:
    """Send `cell`'s request through the proxy, close the connection while the backend queues
    it or mid-generation, and follow the backend until it is done with it and idle again."""
    before = wait_idle(engine)
    blocker = None
    if cell.queued:  # straight to the backend
        blocker = open_request(engine.port, "/v1/completions", completion_body(BLOCKER_TOKENS))
        wait_for(engine, "running the blocker", lambda s: s["requests_running"] == 1)
    path, payload = ROUTES[cell.route], body(cell.route, cell.stream, MAX_TOKENS)
    with open_request(proxy.process.port, path, payload, proxy.headers) as sock:
        if cell.queued:
            wait_for(engine, "queueing", lambda s: s["requests_waiting"] == 1)
        else:
            generated = before["tokens_generated_total"] + 2
            wait_for(engine, "generating", lambda s: s["tokens_generated_total"] >= generated)
            if cell.stream:  # the proxy has started its response
                read_until(sock, lambda received: b"\r\n\r\n" in received)
        at_close = stats(engine)["tokens_generated_total"]
        closed_at = close(sock)
    aborted = before["requests_aborted_total"]
    sample = wait_for(
        engine,
        "done with the request",
        lambda s: (
            s["requests_aborted_total"] > aborted
            or s["requests_running"] + s["requests_waiting"] == 0
        ),
    )
    seconds = time.monotonic() - closed_at
    if blocker is not None:
        with blocker:
            head = read_until(blocker, lambda received: b"\r\n" in received)
            assert head.startswith(b"HTTP/1.1 200 "), head
    after = wait_idle(engine)
    tokens_after_close = after["tokens_generated_total"] - at_close
    if cell.queued:  # the blocker's remaining tokens are not the leaving request's
        tokens_after_close = delta(after, before, "tokens_generated") - BLOCKER_TOKENS
    outcome = Outcome(
        seconds,
        tokens_after_close,
        sample["requests_aborted_total"] > aborted,
        delta(after, before, "requests") - cell.queued,
    )
    results.setdefault(proxy.label, {}).setdefault(cell.name, []).append(outcome)
    sys.stdout.write(
        f"\n{proxy.label} {cell.name}: {outcome.behaviour()}, close -> backend done "
        f"{seconds * 1e3:.1f} ms, {tokens_after_close:.0f} tokens after the close\n"
    )
    return outcome


@contextmanager
def run_proxy(
    label: str,
    venv: Path,
    engine: ServerProcess,
    directory: Path,
    *,
    general_settings: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[Proxy]:
    """`litellm --config` from `venv` in `directory`, its one model the engine server; warmed
    up (`warm_up`) before it is yielded, and stopped on exit."""
    model = {
        "model": f"openai/{MODEL}",
        "api_base": f"{engine.base_url}/v1",
        "api_key": "none",
        # The backend has no /v1/responses: LiteLLM bridges it to chat completions.
        "use_chat_completions_api": True,
    }
    config = {
        "model_list": [{"model_name": MODEL, "litellm_params": model}],
        "general_settings": dict(general_settings or {}),
    }
    (directory / "config.yaml").write_text(json.dumps(config, indent=2))  # JSON is YAML
    key = f"sk-{secrets.token_hex(32)}"  # LiteLLM refuses to start without a strong one

    def argv(port: int) -> list[str]:
        cli = str(venv / "bin" / "litellm")
        return [cli, "--config", "config.yaml", "--host", HOST, "--port", str(port)]

    process = Subprocess(
        argv,
        ready=answers("/health/liveliness"),
        cwd=directory,
        env={
            "LITELLM_MASTER_KEY": key,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download at startup
            "LITELLM_TELEMETRY": "False",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        },
        log=directory / "proxy.log",
        ready_timeout=120.0,  # LiteLLM imports for 5-10 s here, more on a loaded machine
    )
    with process:
        proxy = Proxy(label, process, key)
        warm_up(proxy)
        yield proxy


def warm_up(proxy: Proxy) -> None:
    """A client that stays gets its answer on every route and mode, and LiteLLM has imported
    what each route needs (the first /v1/messages takes a second) before anything is timed."""
    for route, path in ROUTES.items():
        for stream in (False, True):
            status, _, answer = request(
                proxy.process.port, "POST", path, body(route, stream, 2), proxy.headers
            )
            assert status == 200, (path, stream, answer, proxy.process.log_tail())


def summary(outcomes: list[Outcome]) -> str:
    seconds = [outcome.seconds for outcome in outcomes]
    low, high = (f(outcome.tokens_after_close for outcome in outcomes) for f in (min, max))
    tokens = f"{high:.0f}" if low == high else f"{low:.0f}-{high:.0f}"
    behaviours = "/".join(sorted({outcome.behaviour() for outcome in outcomes}))
    median, longest = (milliseconds(f(seconds)) for f in (statistics.median, max))
    return f"{behaviours}: {median} / {longest}, {tokens}"


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def table(results: Results, title: str) -> str:
    # The control first, whatever order pytest ran the proxies in.
    labels = sorted(
        (label for label in results if results[label]),
        key=lambda label: (not label.startswith("LiteLLM"), label),
    )
    if not labels:
        return ""
    runs = max(len(outcomes) for label in labels for outcomes in results[label].values())
    lines = [
        "",
        f"{title}, {runs} run(s) per cell: close -> backend done with the request "
        "(median / max), tokens the backend generated after the close",
        "",
        "| route, mode, client leaves | " + " | ".join(labels) + " |",
        "|---" * (len(labels) + 1) + "|",
    ]
    for cell in CELLS:
        entries = [results[label].get(cell.name) for label in labels]
        row = [summary(outcomes) if outcomes else "" for outcomes in entries]
        lines.append(f"| {cell.name} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
