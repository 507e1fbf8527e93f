"""benchmarks' own streaming client for the serving benchmark (raw HTTP/1.1 over asyncio).

A raw socket, so that closing it really disconnects (no pool keeps the connection). Used for
the short-request-behind-cancelled-ones measurement (NVIDIA Dynamo's cancellation tests), and
for the cancellation sweep when AIPerf cannot run.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from ._util import median, percentile

PROMPT_WORDS = "the quick brown fox jumps over a lazy dog while seven tired cats watch".split()


def prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(words))


@dataclass
class Result:
    sent: float
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    closed: float | None = None
    status: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


async def stream_completion(
    port: int,
    model: str,
    text: str,
    max_tokens: int,
    *,
    close_after: float | None = None,
    timeout: float = 120.0,
) -> Result:
    """POST a streaming /v1/completions; read it all, or close the socket after `close_after`.

    `close_after=0` closes right after the request is written (before any token can come).
    Tokens are counted as SSE chunks carrying text (one token per chunk on both servers).
    """
    body = json.dumps(
        {
            "model": model,
            "prompt": text,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0.0,
        }
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    result = Result(sent=time.monotonic())
    writer.write(head + body)
    await writer.drain()

    async def read() -> None:
        buffer = b""
        header_done = False
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                return
            buffer += chunk
            if not header_done:
                if b"\r\n\r\n" not in buffer:
                    continue
                header, _, buffer = buffer.partition(b"\r\n\r\n")
                result.status = int(header.split(b" ", 2)[1])
                header_done = True
            while b"\n\n" in buffer:
                event, _, buffer = buffer.partition(b"\n\n")
                for line in event.split(b"\n"):
                    line = line.strip()
                    # chunked framing lines (sizes) are not `data:` lines: skipped
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    try:
                        payload = json.loads(line[6:])
                    except ValueError:
                        continue
                    choices = payload.get("choices") or []
                    if choices and choices[0].get("text"):
                        result.tokens += 1
                        if result.first_token is None:
                            result.first_token = time.monotonic()

    try:
        if close_after is None:
            await asyncio.wait_for(read(), timeout)
            result.ended = time.monotonic()
        else:
            try:
                await asyncio.wait_for(read(), close_after) if close_after > 0 else None
                result.ended = time.monotonic()
            except asyncio.TimeoutError:
                pass
    finally:
        if result.ended is None:
            result.closed = time.monotonic()
        writer.close()
    return result


async def short_behind_cancelled(
    port: int, model: str, *, long_requests: int, long_tokens: int, short_tokens: int, gap: float
) -> dict[str, Any]:
    """N long requests closed before their first token, then one short request: its TTFT."""
    longs = await asyncio.gather(
        *(
            stream_completion(port, model, prompt(i, 24), long_tokens, close_after=0.0)
            for i in range(long_requests)
        )
    )
    await asyncio.sleep(gap)
    short = await stream_completion(port, model, prompt(10_000, 8), short_tokens)
    return {
        "short_ttft_s": short.ttft,
        "short_latency_s": None if short.ended is None else short.ended - short.sent,
        "short_tokens": short.tokens,
        "short_status": short.status,
        "long_tokens_received": sum(result.tokens for result in longs),
    }


async def departures(
    port: int,
    model: str,
    *,
    requests: int,
    concurrency: int,
    input_words: int,
    output_tokens: int,
    cancel_rate: float,
    cancel_delay: float,
    seed: int,
) -> dict[str, Any]:
    """The cancellation sweep with this client: `cancel_rate` of the requests close after
    `cancel_delay` seconds; the figures match AIPerf's (goodput, TTFT of the others)."""
    rng = random.Random(seed)
    plan = [rng.random() < cancel_rate for _ in range(requests)]
    semaphore = asyncio.Semaphore(concurrency)

    async def one(index: int) -> tuple[bool, Result]:
        async with semaphore:
            close = cancel_delay if plan[index] else None
            text = prompt(seed * 100_003 + index, input_words)
            return plan[index], await stream_completion(
                port, model, text, output_tokens, close_after=close
            )

    started = time.monotonic()
    done = await asyncio.gather(*(one(index) for index in range(requests)))
    duration = time.monotonic() - started
    kept = [result for cancelled, result in done if not cancelled]
    ttfts = [result.ttft for result in kept if result.ttft is not None]
    delivered = sum(result.tokens for result in kept)
    return {
        "requests": requests,
        "cancelled": sum(1 for cancelled, _ in done if cancelled),
        "completed": len(kept),
        "duration_s": duration,
        "goodput_tokens_per_s": delivered / duration if duration > 0 else float("nan"),
        "ttft_p50_ms": median(ttfts) * 1000 if ttfts else float("nan"),
        "ttft_p99_ms": percentile(ttfts, 99) * 1000 if ttfts else float("nan"),
        "delivered_tokens": delivered,
    }
