"""`serve --engine vllm`: the same endpoints over real vLLM, and a client that leaves aborts it.

Runs where vLLM is installed (.ci/vllm.sh runs it in `.venv-vllm`); skipped elsewhere. The
engine takes about a minute to start on 2 cores, so one server serves the whole module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from example_app.launch import PACKAGE_ROOT, ServerProcess

from .helpers import close, delta, open_request, wait_for, wait_idle

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="real vLLM is not installed here (it is in .venv-vllm)",
    ),
]

MODEL_DIR = Path(os.environ.get("ASGI_CANCEL_TINY_MODEL", PACKAGE_ROOT / ".models" / "tiny-llama"))
# Offline, quiet, 1 GiB of KV cache (.ci/vllm.sh sets them too; docs/vllm.md explains each).
OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS")
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    **dict.fromkeys(OFFLINE, "1"),
}
NAME = "tiny"


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[ServerProcess]:
    # In a subprocess: building imports torch and transformers, which warn on import.
    build = [sys.executable, "-m", "example_app.tiny_model", str(MODEL_DIR)]
    subprocess.run(build, cwd=PACKAGE_ROOT, check=True, timeout=300, capture_output=True)
    args = ["--engine", "vllm", "--model", str(MODEL_DIR), "--model-name", NAME]
    args += ["--max-model-len", "2048", "--log-level", "warning"]
    # uvicorn: it comes with vLLM, hypercorn does not.
    with ServerProcess(*args, server="uvicorn", ready_timeout=400.0, env=VLLM_ENV) as process:
        yield process


@pytest.fixture
def client(vllm_server: ServerProcess) -> Iterator[openai.OpenAI]:
    url = f"{vllm_server.base_url}/v1"
    with openai.OpenAI(base_url=url, api_key="test", max_retries=0, timeout=60.0) as client:
        yield client


def test_endpoints_parse_as_openai(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=NAME, prompt="Hello", max_tokens=8)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    with stream:
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_a_client_that_leaves_aborts_the_vllm_request(vllm_server: ServerProcess) -> None:
    """The client leaves (as a timed-out client does: it closes the connection) once the
    engine runs its request, seconds before the answer: the engine request is aborted.

    Not the openai client's own `timeout=`: in a fresh clone's CI its 0.5 s timer sometimes
    never fired (three calls in a row returned the whole completion after ~3.4 s), which
    tested the client, not the server."""
    max_tokens = 2000  # about 3 s on this CPU
    before = wait_idle(vllm_server)
    body = json.dumps(
        # ignore_eos: the random-weight model may sample its end-of-text token early.
        {"model": NAME, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
    ).encode()
    sock = open_request(vllm_server.port, "/v1/completions", body)
    try:
        wait_for(vllm_server, "running", lambda s: s["requests_running"] >= 1)
    finally:
        close(sock)
    after = wait_idle(vllm_server)
    assert delta(after, before, "requests_aborted") == 1
    assert delta(after, before, "clients_gone") == 1
    assert delta(after, before, "tokens_generated") < max_tokens
    assert delta(after, before, "tokens_wasted") <= 6  # about one engine step
