"""OpenAI's request bodies as pydantic models: bad input is a 4xx `OpenAIError`, never a 500.

Only what the example serves: text completions and chat completions, one choice, streaming or
not. Fields are strict (`"10"` is not an integer, `1.0` not a token count); unknown fields are
ignored (as vLLM does); features the example does not implement are refused with a 400 rather
than silently ignored. What depends on the engine (the context length) is `max_tokens`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal

from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic import ValidationInfo as Info
from pydantic_core import PydanticCustomError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from .engine import Sampling
from .openai_errors import OpenAIError, unsupported

MAX_BODY = 1024 * 1024
MAX_STOP = 4
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}  # OpenAI's, and a cap


def _only_one(value: int, info: Info) -> int:
    if value != 1:
        message = unsupported(f"'{info.field_name}' other than 1")
        raise PydanticCustomError("unsupported_value", message)
    return value


def _refused(value: object, info: Info) -> object:
    if value not in (None, False):
        raise PydanticCustomError("unsupported_value", unsupported(f"'{info.field_name}'"))
    return value


def _one_prompt(value: object) -> object:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if isinstance(value, list):
        what = "a 'prompt' other than one string (batches, token ids)"
        raise PydanticCustomError("unsupported_value", unsupported(what))
    return value


def _stop_strings(value: object) -> object:
    if isinstance(value, str):
        return [value]
    if value is None or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        return value
    expected = {"expected": "a string or an array of strings"}
    raise PydanticCustomError("invalid_type", "expected {expected}", expected)


def _content_parts(value: object) -> object:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if isinstance(value, list):
        return value
    expected = {"expected": "a string or an array of content parts"}
    raise PydanticCustomError("invalid_type", "expected {expected}", expected)


def _text_only(value: object) -> object:
    if not (isinstance(value, dict) and value.get("type") == "text"):
        raise PydanticCustomError("unsupported_value", unsupported("content parts other than text"))
    return value


One = Annotated[int, Field(ge=1, le=128), AfterValidator(_only_one)]
Refused = Annotated[Any, AfterValidator(_refused)]
Strict = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = Strict
    include_usage: bool | None = None


class TextPart(BaseModel):
    model_config = Strict
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = Strict
    role: Literal["assistant", "developer", "system", "tool", "user"]
    content: Annotated[
        list[Annotated[TextPart, BeforeValidator(_text_only)]], BeforeValidator(_content_parts)
    ] = []


class GenerationRequest(BaseModel):
    """What `/v1/completions` and `/v1/chat/completions` share, in OpenAI's order of checks."""

    model_config = Strict
    model: str
    n: One | None = None
    best_of: One | None = None
    echo: Refused = None
    logprobs: Refused = None
    suffix: Refused = None
    tools: Refused = None
    functions: Refused = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    stop: Annotated[
        list[str] | None, BeforeValidator(_stop_strings), Field(max_length=MAX_STOP)
    ] = None
    seed: Annotated[int | None, Field(ge=-(2**63), le=2**63 - 1)] = None
    ignore_eos: bool | None = None  # vLLM's extension: generate max_tokens tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int) -> Sampling:
        """The engine's options, once `max_tokens` is checked against the model's length."""
        return Sampling(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=tuple(stop for stop in self.stop or () if stop),
            seed=self.seed,
            ignore_eos=bool(self.ignore_eos),
        )


class CompletionRequest(GenerationRequest):
    """A `/v1/completions` body: one prompt string (or a list of one)."""

    prompt: Annotated[str, BeforeValidator(_one_prompt)]

    def render(self) -> str:
        return self.prompt


class ChatCompletionRequest(GenerationRequest):
    """A `/v1/chat/completions` body: text messages; `max_completion_tokens` is the newer name."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None

    def render(self) -> str:
        """A plain-text chat prompt, the same for every engine (no model-specific template)."""
        lines = (f"{m.role}: {''.join(part.text for part in m.content)}\n" for m in self.messages)
        return "".join(lines) + "assistant:"


def max_tokens(
    request: CompletionRequest | ChatCompletionRequest,
    prompt: str,
    max_model_len: int,
    count_prompt_tokens: Callable[[str], int | None],
) -> int:
    """The request's token budget, checked against the model's length (the engine's to know)."""
    chat = isinstance(request, ChatCompletionRequest)
    name, value = "max_tokens", request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        name, value = "max_completion_tokens", request.max_completion_tokens
    limit = max_model_len - 1
    if value is None:
        return min(DEFAULT_MAX_TOKENS["chat" if chat else "completion"], limit)
    if value > limit:
        raise OpenAIError(
            400,
            f"{name} is too large: {value}. This model supports at most {limit} completion "
            f"tokens, whereas you provided {value}.",
            param=name,
            code="invalid_value",
        )
    prompt_tokens = count_prompt_tokens(prompt)
    if prompt_tokens is not None and prompt_tokens + value > max_model_len:
        where = "messages" if chat else "prompt"
        raise OpenAIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + value} tokens ({prompt_tokens} in the {where}, {value} "
            f"in the completion). Please reduce the length of the {where} or completion.",
            param=where,
            code="context_length_exceeded",
        )
    return value


class JSONBodyRoute(APIRoute):
    """A route whose body is read (at most `MAX_BODY`) and decoded as OpenAI's API does.

    Before FastAPI's own parsing: whatever the content type, strict JSON (no `NaN`, no
    5000-digit integers, no stack overflow on deep nesting), and a 413 or a 400 in OpenAI's
    words instead of FastAPI's generic "There was an error parsing the body".
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle_json_body(request: Request) -> Response:
            body = await _read_body(request)
            return await handler(_ParsedRequest(request.scope, request.receive, body))

        return handle_json_body


class _ParsedRequest(Request):
    def __init__(self, scope: Scope, receive: Receive, body: bytes) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        # FastAPI decodes the body as JSON only for a JSON content type; OpenAI ignores it.
        headers.append((b"content-type", b"application/json"))
        super().__init__({**scope, "headers": headers}, receive)
        self._decoded = parse_json_body(body)
        self._raw = body

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._decoded


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise _too_large()
    return bytes(body)


def _too_large() -> OpenAIError:
    return OpenAIError(413, f"Request body too large: the limit is {MAX_BODY} bytes.")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> Any:
    """Decode a request body as strict JSON (any value: the model says it must be an object)."""
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # also bad UTF-8, NaN/Infinity, 5000-digit integers
        raise OpenAIError(
            400,
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, "
            "but what was sent was not valid JSON.)",
        ) from None
