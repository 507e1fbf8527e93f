"""Ctrl-C on `serve` with requests in flight: each ends with a shutdown error and one log line."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from example_app.launch import ServerProcess

from .helpers import MODEL, SERVERS, wait_for

pytestmark = pytest.mark.timeout(120)
STREAMS = 3


async def requests_until_shutdown(process: ServerProcess) -> tuple[list[list[str]], httpx.Response]:
    """`STREAMS` streams and one non-streaming request, all generating at the SIGINT."""
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2000, "stream": True}
    started = asyncio.Semaphore(0)

    async def stream(client: httpx.AsyncClient) -> list[str]:
        events = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 2:
                        started.release()
        return events

    async with httpx.AsyncClient(base_url=process.base_url, timeout=30.0) as client:
        streams = [asyncio.create_task(stream(client)) for _ in range(STREAMS)]
        whole = {"model": MODEL, "prompt": "hi", "max_tokens": 2000}
        complete = asyncio.create_task(client.post("/v1/completions", json=whole))
        for _ in range(STREAMS):
            await asyncio.wait_for(started.acquire(), 30)
        await asyncio.to_thread(
            wait_for, process, "all running", lambda s: s["requests_running"] == STREAMS + 1
        )
        os.kill(process.pid, signal.SIGINT)  # what Ctrl-C sends the server
        return await asyncio.wait_for(asyncio.gather(*streams), 30), await complete


@pytest.mark.parametrize("server", SERVERS)
def test_ctrl_c_ends_each_request_with_a_shutdown_error_and_one_log_line(server: str) -> None:
    args = ("--step-time", "0.02", "--max-batch-size", "8", "--log-level", "info")
    with ServerProcess(*args, server=server, ready_timeout=60) as process:
        streams, complete = asyncio.run(requests_until_shutdown(process))
        assert process.process is not None
        process.process.wait(30)
    errors = [json.loads(events[-1])["error"] for events in streams]
    assert all("error" not in json.loads(event) for events in streams for event in events[:-1])
    assert complete.status_code == 503
    errors.append(complete.json()["error"])
    for error in errors:
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("server_error", "server_shutting_down")
    log = process.log_text()
    assert log.count("ended by the server's shutdown") == STREAMS + 1, log
    assert "Traceback" not in log, log
