"""Ctrl-C on `serve` with streams in flight: each ends with an error event and one log line."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from example_app.launch import ServerProcess

from .conftest import MODEL, SERVERS

pytestmark = pytest.mark.timeout(120)
STREAMS = 3


async def stream_until_shutdown(process: ServerProcess) -> list[list[str]]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2000,
        "stream": True,
    }
    started = asyncio.Event()
    running = 0

    async def one(client: httpx.AsyncClient) -> list[str]:
        nonlocal running
        events = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 2:
                        running += 1
                        if running == STREAMS:
                            started.set()
        return events

    timeout = httpx.Timeout(30.0)
    async with httpx.AsyncClient(base_url=process.base_url, timeout=timeout) as client:
        tasks = [asyncio.create_task(one(client)) for _ in range(STREAMS)]
        await asyncio.wait_for(started.wait(), 30)
        os.kill(process.pid, signal.SIGINT)  # what Ctrl-C sends the server
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)


@pytest.mark.parametrize("server", SERVERS)
def test_ctrl_c_ends_streams_with_an_error_event_and_one_log_line_each(server: str) -> None:
    args = ("--step-time", "0.02", "--max-batch-size", "8", "--log-level", "info")
    with ServerProcess(*args, server=server, ready_timeout=60) as process:
        streams = asyncio.run(stream_until_shutdown(process))
        assert process.process is not None
        process.process.wait(30)
    log = process.log_text()
    for events in streams:
        assert events[-1] != "[DONE]"
        last = json.loads(events[-1])
        assert last["error"]["type"] == "server_error"
        assert last["error"]["code"] == "server_shutting_down"
        assert set(last["error"]) == {"message", "type", "param", "code"}
        assert all("error" not in json.loads(event) for event in events[:-1])
    assert log.count("ended by the server's shutdown") == STREAMS, log
    assert "Traceback" not in log, log
