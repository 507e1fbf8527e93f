"""The endpoints answer like OpenAI's: the `openai` client parses them, streaming and not."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from example_app import metrics
from example_app.launch import ServerProcess

from .conftest import MODEL

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client(api_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{api_server.base_url}/v1", api_key="test", max_retries=0, timeout=10.0
    ) as client:
        yield client


def test_completion(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Say something", max_tokens=5)
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert completion.model == MODEL
    (choice,) = completion.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert len(choice.text.split()) == 5  # the simulated engine: one word per token
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens == 2
    assert completion.usage.total_tokens == 7


def test_completion_stream(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=["Say something"],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert all(chunk.object == "text_completion" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    assert len("".join(chunk.choices[0].text for chunk in text_chunks).split()) == 6
    assert [chunk.choices[0].finish_reason for chunk in text_chunks][-1] == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in text_chunks[:-1])
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 6


def test_chat_completion(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        ],
        max_completion_tokens=4,
    )
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    (choice,) = completion.choices
    assert choice.message.role == "assistant"
    assert choice.message.content is not None
    assert len(choice.message.content.split()) == 4
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 4


def test_chat_completion_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=5,
        stream=True,
    )
    with stream:
        chunks = list(stream)
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert len(text.split()) == 5
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is None  # not asked for


def test_stop_string_finishes_with_stop(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="x", max_tokens=500, stop=[" the", " a"], seed=7
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.completion_tokens < 500


def test_models(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_health_and_metrics(api_server: ServerProcess) -> None:
    health = httpx.get(f"{api_server.base_url}/health", timeout=5.0)
    assert health.json() == {"status": "ok", "engine": "sim", "middleware": True}
    response = httpx.get(f"{api_server.base_url}/metrics", timeout=5.0)
    assert response.headers["content-type"] == metrics.CONTENT_TYPE
    lines = response.text.splitlines()
    samples = [line for line in lines if not line.startswith("#")]
    for sample in samples:  # every sample is `name value`, announced by HELP and TYPE lines
        name = sample.split("{")[0].split(" ")[0]
        # A histogram's and a counter's extra series are announced under the family's name.
        family = re.sub(r"_(bucket|sum|count|created)$", "", name)
        assert any(line.startswith((f"# HELP {name} ", f"# HELP {family} ")) for line in lines)
        assert any(line.startswith((f"# TYPE {name} ", f"# TYPE {family} ")) for line in lines)
        float(sample.rpartition(" ")[2])
    parsed = metrics.parse(response.text)
    assert parsed['example_info{engine="sim",middleware="on"}'] == 1
    assert parsed["example_engine_max_batch_size"] == 8
