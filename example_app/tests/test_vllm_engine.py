"""`serve --engine vllm`: the same endpoints over real vLLM, and a client timeout aborts it.

Runs where vLLM is installed (.ci/vllm.sh runs it in `.venv-vllm`); skipped elsewhere. The
engine takes about a minute to start on 2 cores, so one server serves the whole module.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from example_app.launch import PACKAGE_ROOT, ServerProcess

from .helpers import delta, wait_idle

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


def test_client_timeout_aborts_the_vllm_request(
    vllm_server: ServerProcess, client: openai.OpenAI
) -> None:
    max_tokens = 2000  # about 3 s on this CPU
    returned: list[str] = []
    for _ in range(3):
        # Once in a fresh clone's CI (of many runs) the call returned the whole completion
        # after ~3 s instead of timing out: not understood, not seen since. Tried again, so
        # that a timeout that never fires still fails, with what came back each time.
        before = wait_idle(vllm_server)
        started = time.monotonic()
        try:
            # ignore_eos: the random-weight model may sample its end-of-text token early.
            completion = client.completions.create(
                model=NAME,
                prompt="Hello",
                max_tokens=max_tokens,
                timeout=0.5,
                extra_body={"ignore_eos": True},
            )
        except openai.APITimeoutError:
            break
        returned.append(f"{completion.usage} after {time.monotonic() - started:.2f} s")
    else:
        pytest.fail("the client's 0.5 s timeout never fired: " + "; ".join(returned))
    after = wait_idle(vllm_server)
    assert delta(after, before, "requests_aborted") == 1
    assert delta(after, before, "clients_gone") == 1
    assert delta(after, before, "tokens_generated") < max_tokens
    assert delta(after, before, "tokens_wasted") <= 6  # about one engine step
