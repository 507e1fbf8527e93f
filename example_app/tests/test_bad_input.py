"""Bad input gets OpenAI-shaped 4xx errors: never a 500, never a hung connection."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from example_app.launch import ServerProcess

from .conftest import MODEL

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", **fields}).encode()


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": MESSAGES, **fields}).encode()


def case(name: str, path: str, body: bytes, status: int = 400, param: str | None = None) -> Any:
    return pytest.param(path, body, status, param, id=name)


def user(content: object) -> list[dict[str, object]]:
    return [{"role": "user", "content": content}]


RAW_TEMPERATURE = b'{"model": "sim-llm", "prompt": "hi", "temperature": %s}'
CASES = [
    case("malformed-json", COMPLETIONS, b'{"model": "sim-llm", "prompt": '),
    case("empty-body", COMPLETIONS, b""),
    case("not-utf8", COMPLETIONS, b'{"model": "\xff\xfe"}'),
    case("nan-literal", COMPLETIONS, RAW_TEMPERATURE % b"NaN"),
    case("deeply-nested", COMPLETIONS, b"[" * 100_000 + b"]" * 100_000),
    case("5000-digit-integer", COMPLETIONS, b'{"max_tokens": ' + b"9" * 5000 + b"}"),
    case("array-body", COMPLETIONS, b"[1, 2]"),
    case("missing-model", COMPLETIONS, b'{"prompt": "hi"}', param="model"),
    case("model-not-string", COMPLETIONS, completion(model=7), param="model"),
    case("unknown-model", COMPLETIONS, completion(model="gpt-9"), 404, "model"),
    case("unknown-model-chat", CHAT, chat(model="gpt-9"), 404, "model"),
    case("unknown-model-stream", CHAT, chat(model="gpt-9", stream=True), 404, "model"),
    case("missing-prompt", COMPLETIONS, b'{"model": "sim-llm"}', param="prompt"),
    case("prompt-not-string", COMPLETIONS, completion(prompt={"text": "hi"}), param="prompt"),
    case("prompt-token-ids", COMPLETIONS, completion(prompt=[1, 2, 3]), param="prompt"),
    case("max-tokens-zero", COMPLETIONS, completion(max_tokens=0), param="max_tokens"),
    case("max-tokens-negative", COMPLETIONS, completion(max_tokens=-5), param="max_tokens"),
    case("max-tokens-absurd", COMPLETIONS, completion(max_tokens=10**12), param="max_tokens"),
    case(
        "max-tokens-absurd-stream",
        COMPLETIONS,
        completion(max_tokens=10**12, stream=True),
        param="max_tokens",
    ),
    case("max-tokens-string", COMPLETIONS, completion(max_tokens="10"), param="max_tokens"),
    case("max-tokens-float", COMPLETIONS, completion(max_tokens=10.5), param="max_tokens"),
    case("max-tokens-bool", COMPLETIONS, completion(max_tokens=True), param="max_tokens"),
    case(
        "max-completion-tokens-zero",
        CHAT,
        chat(max_completion_tokens=0),
        param="max_completion_tokens",
    ),
    case(
        "context-too-long",
        COMPLETIONS,
        completion(prompt="word " * 4000, max_tokens=200),
        param="prompt",
    ),
    case("temperature-string", COMPLETIONS, completion(temperature="hot"), param="temperature"),
    case("temperature-too-high", COMPLETIONS, completion(temperature=5), param="temperature"),
    case("temperature-infinite", COMPLETIONS, RAW_TEMPERATURE % b"1e400", param="temperature"),
    case("top-p-negative", COMPLETIONS, completion(top_p=-0.1), param="top_p"),
    case("stream-string", COMPLETIONS, completion(stream="yes"), param="stream"),
    case(
        "stream-options-not-object",
        COMPLETIONS,
        completion(stream=True, stream_options=[]),
        param="stream_options",
    ),
    case("stop-too-many", COMPLETIONS, completion(stop=list("abcde")), param="stop"),
    case("stop-not-strings", COMPLETIONS, completion(stop=[1]), param="stop"),
    case("n-two", COMPLETIONS, completion(n=2), param="n"),
    case("seed-string", COMPLETIONS, completion(seed="x"), param="seed"),
    case("ignore-eos-string", COMPLETIONS, completion(ignore_eos="yes"), param="ignore_eos"),
    case("messages-missing", CHAT, b'{"model": "sim-llm"}', param="messages"),
    case("messages-not-array", CHAT, chat(messages="hi"), param="messages"),
    case("messages-empty", CHAT, chat(messages=[]), param="messages"),
    case("messages-empty-stream", CHAT, chat(messages=[], stream=True), param="messages"),
    case("message-not-object", CHAT, chat(messages=["hi"]), param="messages[0]"),
    case(
        "message-bad-role",
        CHAT,
        chat(messages=[{"role": "robot", "content": "hi"}]),
        param="messages[0].role",
    ),
    case(
        "message-content-number",
        CHAT,
        chat(messages=user(5)),
        param="messages[0].content",
    ),
    case(
        "message-image-part",
        CHAT,
        chat(messages=user([{"type": "image_url", "image_url": {}}])),
        param="messages[0].content[0]",
    ),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]
    assert body["error"]["param"] == param


@pytest.fixture(scope="module")
def http(api_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_server.base_url, timeout=10.0) as client:
        yield client


@pytest.mark.parametrize(("path", "body", "status", "param"), CASES)
def test_bad_request_is_an_openai_error(
    http: httpx.Client, path: str, body: bytes, status: int, param: str | None
) -> None:
    headers = {"content-type": "application/json"}
    assert_openai_error(http.post(path, content=body, headers=headers), status, param)


def test_body_too_large_is_413(http: httpx.Client) -> None:
    response = http.post(COMPLETIONS, content=completion(prompt="x" * 2_000_000))
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("POST", "/v1/nowhere", 404), ("GET", COMPLETIONS, 405), ("DELETE", "/v1/models", 405)],
    ids=["unknown-path", "get-completions", "delete-models"],
)
def test_routing_errors_are_openai_errors(
    http: httpx.Client, method: str, path: str, status: int
) -> None:
    assert_openai_error(http.request(method, path), status, None)


def test_the_openai_client_raises_its_own_error_classes(api_server: ServerProcess) -> None:
    with openai.OpenAI(
        base_url=f"{api_server.base_url}/v1", api_key="test", max_retries=0, timeout=10.0
    ) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
        assert bad.value.code == "integer_below_min_value"
        assert bad.value.param == "max_tokens"
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="gpt-9", messages=[])
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=10**9,
                stream=True,
            )
