"""The pydantic request and response models: OpenAI's codes, the wire format, the schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from example_app.launch import ServerProcess
from example_app.openai_errors import param_name

from .conftest import MODEL

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def http(api_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_server.base_url, timeout=10.0) as client:
        yield client


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("body",), None),
        (("body", "model"), "model"),
        (("body", "messages", 0), "messages[0]"),
        (("body", "messages", 0, "content", 1, "text"), "messages[0].content[1].text"),
    ],
    ids=["body", "field", "item", "nested"],
)
def test_param_names_a_pydantic_loc_as_openai_does(
    loc: tuple[int | str, ...], param: str | None
) -> None:
    assert param_name(loc) == param


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"model": None}, "model", "invalid_type"),
        ({"prompt": None}, "prompt", "invalid_type"),
        ({"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
        ({"temperature": 5}, "temperature", "decimal_above_max_value"),
        ({"n": 2}, "n", "integer_above_max_value"),
        ({"stop": list("abcde")}, "stop", "array_above_max_length"),
        ({"prompt": [1, 2]}, "prompt", "unsupported_value"),
        ({"logprobs": 2}, "logprobs", "unsupported_value"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_type"),
    ],
    ids=lambda value: json.dumps(value) if isinstance(value, dict) else None,
)
def test_validation_errors_carry_openai_codes(
    http: httpx.Client, fields: dict[str, Any], param: str, code: str
) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)


def test_missing_fields_are_missing_required_parameter(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"model": MODEL})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "missing_required_parameter"


def test_any_content_type_is_read_as_json(http: httpx.Client) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    # curl -d without -H sends a form content type; OpenAI reads the JSON all the same.
    headers = {"content-type": "application/x-www-form-urlencoded"}
    response = http.post("/v1/completions", content=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_chat_stream_wire_format(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 2


def test_openapi_schema_names_the_models(http: httpx.Client) -> None:
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    for name in (
        "CompletionRequest",
        "ChatCompletionRequest",
        "CompletionResponse",
        "ChatCompletionResponse",
        "ModelList",
        "ErrorResponse",
    ):
        assert name in schemas
