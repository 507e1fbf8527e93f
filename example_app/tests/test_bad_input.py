"""Bad input gets OpenAI-shaped 4xx errors: never a 500, never a hung connection."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from example_app.launch import ServerProcess

from .helpers import MODEL, completion_body, request

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", **fields}).encode()


def chat(content: Any = "hi", role: str = "user", **fields: Any) -> bytes:
    messages = [{"role": role, "content": content}]
    return json.dumps({"model": MODEL, "messages": messages, **fields}).encode()


def case(name: str, path: str, body: bytes, param: str | None = None, code: str = "") -> Any:
    """A 400 naming `param` (and OpenAI's `code`, when given); 404 for an unknown model."""
    status = 404 if code == "model_not_found" else 400
    return pytest.param(path, body, status, param, code, id=name)


RAW_TEMPERATURE = b'{"model": "sim-llm", "prompt": "hi", "temperature": %s}'
CASES = [
    case("malformed-json", COMPLETIONS, b'{"model": "sim-llm", "prompt": '),
    case("empty-body", COMPLETIONS, b""),
    case("not-utf8", COMPLETIONS, b'{"model": "\xff\xfe"}'),
    case("nan-literal", COMPLETIONS, RAW_TEMPERATURE % b"NaN"),
    case("deeply-nested", COMPLETIONS, b"[" * 100_000 + b"]" * 100_000),
    case("5000-digit-integer", COMPLETIONS, b'{"max_tokens": ' + b"9" * 5000 + b"}"),
    case("array-body", COMPLETIONS, b"[1, 2]"),
    case("missing-model", COMPLETIONS, b'{"prompt": "hi"}', "model", "missing_required_parameter"),
    case("unknown-model", COMPLETIONS, completion(model="gpt-9"), "model", "model_not_found"),
    case("unknown-model-stream", CHAT, chat(model="gpt-9", stream=True), "model",
         "model_not_found"),
    case("prompt-null", COMPLETIONS, completion(prompt=None), "prompt", "invalid_type"),
    case("prompt-token-ids", COMPLETIONS, completion(prompt=[1, 2]), "prompt", "unsupported_value"),
    case("max-tokens-zero", COMPLETIONS, completion(max_tokens=0), "max_tokens",
         "integer_below_min_value"),
    case("max-tokens-absurd", COMPLETIONS, completion(max_tokens=10**12), "max_tokens"),
    case("max-tokens-absurd-stream", COMPLETIONS, completion(max_tokens=10**12, stream=True),
         "max_tokens"),
    case("max-tokens-string", COMPLETIONS, completion(max_tokens="10"), "max_tokens"),
    case("max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0),
         "max_completion_tokens"),
    case("context-too-long", COMPLETIONS, completion(prompt="word " * 4000, max_tokens=200),
         "prompt"),
    case("temperature-too-high", COMPLETIONS, completion(temperature=5), "temperature",
         "decimal_above_max_value"),
    case("temperature-infinite", COMPLETIONS, RAW_TEMPERATURE % b"1e400", "temperature"),
    case("stream-string", COMPLETIONS, completion(stream="yes"), "stream"),
    case("stream-options-usage-number", COMPLETIONS,
         completion(stream_options={"include_usage": 1}), "stream_options.include_usage",
         "invalid_type"),
    case("stop-too-many", COMPLETIONS, completion(stop=list("abcde")), "stop",
         "array_above_max_length"),
    case("n-two", COMPLETIONS, completion(n=2), "n", "integer_above_max_value"),
    case("logprobs", COMPLETIONS, completion(logprobs=2), "logprobs", "unsupported_value"),
    case("tools", CHAT, chat(tools=[{"type": "function"}]), "tools", "unsupported_value"),
    case("messages-missing", CHAT, b'{"model": "sim-llm"}', "messages",
         "missing_required_parameter"),
    case("messages-empty-stream", CHAT, chat(messages=[], stream=True), "messages"),
    case("message-bad-role", CHAT, chat(role="robot"), "messages[0].role"),
    case("message-content-number", CHAT, chat(5), "messages[0].content"),
    case("message-image-part", CHAT, chat([{"type": "text", "text": "a"}, {"type": "image_url"}]),
         "messages[0].content[1]", "unsupported_value"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), CASES)
def test_bad_request_is_an_openai_error(
    api_server: ServerProcess, path: str, body: bytes, status: int, param: str | None, code: str
) -> None:
    headers = {"content-type": "application/json"}
    answer, _, raw = request(api_server.port, "POST", path, body, headers)
    assert answer == status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param
    if code:
        assert error["code"] == code


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", COMPLETIONS, completion_body(1, prompt="x" * 2_000_000), 413),
        ("POST", "/v1/nowhere", None, 404),
        ("GET", COMPLETIONS, None, 405),
    ],
    ids=["body-over-1-MiB", "unknown-path", "get-completions"],
)
def test_size_and_routing_errors_are_openai_errors(
    api_server: ServerProcess, method: str, path: str, body: bytes | None, status: int
) -> None:
    answer, _, raw = request(api_server.port, method, path, body)
    assert answer == status
    assert json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_the_openai_client_raises_its_own_error_classes(api_server: ServerProcess) -> None:
    with openai.OpenAI(
        base_url=f"{api_server.base_url}/v1", api_key="test", max_retries=0, timeout=10.0
    ) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
        assert (bad.value.code, bad.value.param) == ("integer_below_min_value", "max_tokens")
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="gpt-9", messages=[])
        assert missing.value.code == "model_not_found"
