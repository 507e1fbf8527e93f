"""The endpoints answer like OpenAI's: the `openai` client parses them, streaming and not."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from example_app import metrics
from example_app.launch import ServerProcess

from .helpers import MODEL, completion_body, request

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client(api_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{api_server.base_url}/v1", api_key="test", max_retries=0, timeout=10.0
    ) as client:
        yield client


def test_completion(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Say something", max_tokens=5)
    assert (completion.object, completion.model) == ("text_completion", MODEL)
    assert completion.id.startswith("cmpl-")
    (choice,) = completion.choices
    assert (choice.index, choice.finish_reason) == (0, "length")
    assert len(choice.text.split()) == 5  # the simulated engine: one word per token
    assert completion.usage is not None
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (2, 5, 7)


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
    assert {chunk.object for chunk in chunks} == {"text_completion"}
    assert len({chunk.id for chunk in chunks}) == 1
    assert len("".join(chunk.choices[0].text for chunk in text_chunks).split()) == 6
    reasons = [chunk.choices[0].finish_reason for chunk in text_chunks]
    assert reasons == [None] * (len(reasons) - 1) + ["length"]
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
    assert (choice.message.role, choice.finish_reason) == ("assistant", "length")
    assert len((choice.message.content or "").split()) == 4


def test_chat_stream_wire_format(api_server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, headers, raw = request(
        api_server.port, "POST", "/v1/chat/completions", json.dumps(body).encode()
    )
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.decode().split("\n") if line]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert chunks[-2]["choices"][0] == last
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 2


def test_stop_strings_and_the_models(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="x", max_tokens=500, stop=[" the", " a"], seed=7
    )
    assert completion.choices[0].finish_reason == "stop"
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_any_content_type_is_read_as_json(api_server: ServerProcess) -> None:
    # curl -d without -H sends a form content type; OpenAI reads the JSON all the same.
    headers = {"content-type": "application/x-www-form-urlencoded"}
    status, _, body = request(
        api_server.port, "POST", "/v1/completions", completion_body(2), headers
    )
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 2


def test_health_metrics_and_schema(api_server: ServerProcess) -> None:
    health = json.loads(request(api_server.port, "GET", "/health")[2])
    assert health == {"status": "ok", "engine": "sim", "middleware": True}
    _, headers, body = request(api_server.port, "GET", "/metrics")
    assert headers["content-type"] == metrics.CONTENT_TYPE
    parsed = metrics.parse(body.decode())
    assert parsed['example_info{engine="sim",middleware="on"}'] == 1
    assert parsed["example_engine_max_batch_size"] == 8
    schemas = json.loads(request(api_server.port, "GET", "/openapi.json")[2])["components"]
    models = "CompletionRequest ChatCompletionRequest CompletionResponse ChatCompletionResponse"
    assert {*models.split(), "ModelList", "ErrorResponse"} <= set(schemas["schemas"])
