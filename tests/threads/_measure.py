"""One departure, measured from the engine's side: a client that leaves mid-generation, and
the request that queued behind it. Shared by the tests and benchmarks/threads.py."""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..vllm._harness import RawClient, wait_for
from ._app import Server

PROMPT = "Tell me a long story about a llama that runs on a CPU."
LEAVE_AFTER = 20  # tokens the engine made for the request before its client leaves


def new_id(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


def depart(
    server: Server,
    mode: str,
    route: str,
    *,
    max_new_tokens: int,
    next_tokens: int = 10,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """POST `/{mode}/{route}`, close the socket once the engine made `LEAVE_AFTER` tokens,
    wait for the generation to end; send the next request (`next_tokens`) right after the
    close and measure its time to first token (its first token in the engine)."""
    engine = server.engine
    request_id = new_id(f"{mode}-{route}")
    payload = {"id": request_id, "prompt": PROMPT, "max_new_tokens": max_new_tokens}
    client = RawClient(server.port).post(f"/{mode}/{route}", payload)
    steps = engine.steps[request_id]
    wait_for(lambda: len(steps) >= LEAVE_AFTER, timeout, "the first tokens")
    closed_at = client.close()
    next_id = new_id("next")
    sent_at = time.monotonic()
    follower = RawClient(server.port).post(
        f"/{mode}/{route}", {"id": next_id, "prompt": PROMPT, "max_new_tokens": next_tokens}
    )
    wait_for(lambda: request_id in engine.ended, timeout, "the generation's end")
    measured: dict[str, Any] = {
        "request_id": request_id,
        "tokens": len(steps),
        "tokens_after_close": engine.tokens_after(request_id, closed_at),
        "close_to_stop_ms": round((engine.ended[request_id] - closed_at) * 1000, 1),
        "streamer_puts": engine.puts.get(request_id, 0),
        "prompt_tokens": engine.prompt_tokens[request_id],
    }
    if request_id in engine.fired:
        measured["close_to_fire_ms"] = round((engine.fired[request_id] - closed_at) * 1000, 2)
    with follower:
        wait_for(lambda: next_id in engine.ended, timeout, "the next request's end")
        first = engine.steps[next_id][0]
        measured["next_ttft_ms"] = round((first - sent_at) * 1000, 1)
        measured["next_tokens"] = len(engine.steps[next_id])
        follower.read_all(timeout)
    return measured


DEADLINE_MS = 100  # the caller's budget in stop_by("deadline"): a few dozen tokens in


def stop_by(
    server: Server, mode: str, route: str, how: str, *, max_new_tokens: int, timeout: float = 120.0
) -> dict[str, Any]:
    """POST `/{mode}/{route}` from a client that stays, and stop it the other two ways:
    `deadline` (its `x-request-timeout`) or `cancel` (`POST /v1/requests/{id}/cancel` once the
    engine made `LEAVE_AFTER` tokens); wait for the generation's end, and count from the
    engine's side what it made after the request's token fired."""
    engine = server.engine
    request_id = new_id(f"{how}-{mode}-{route}")
    payload = {"id": request_id, "prompt": PROMPT, "max_new_tokens": max_new_tokens}
    header = {"x-request-timeout": f"{DEADLINE_MS}ms"} if how == "deadline" else {}
    measured: dict[str, Any] = {}
    with RawClient(server.port).post(
        f"/{mode}/{route}", payload, {"x-request-id": request_id, **header}
    ) as client:
        if how == "cancel":
            wait_for(lambda: len(engine.steps[request_id]) >= LEAVE_AFTER, timeout, "tokens")
            with RawClient(server.port).post(f"/v1/requests/{request_id}/cancel", {}) as cancel:
                measured["cancel_answer"] = cancel.read_all(timeout).split(b" ", 2)[1].decode()
        wait_for(lambda: request_id in engine.ended, timeout, "the generation's end")
        measured["status"] = client.read_all(timeout).split(b" ", 2)[1].decode()
    steps = engine.steps[request_id]
    fired = engine.fired[request_id]
    measured |= {
        "tokens": len(steps),
        "tokens_after_fire": engine.tokens_after(request_id, fired),
        "fire_to_stop_ms": round((engine.ended[request_id] - fired) * 1000, 1),
    }
    return measured
