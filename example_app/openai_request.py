"""OpenAI's request bodies as pydantic models (vLLM's names); `max_tokens` checks the rest.

Only what the example serves: one prompt or text messages, one choice, streaming or not. Fields
are strict (`"10"` is no integer); unknown fields are ignored, as vLLM does; what the example
does not implement is refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic import ValidationInfo as Info
from pydantic_core import PydanticCustomError

from .engine import Sampling
from .openai_errors import OpenAIError

MAX_STOP = 4
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}  # OpenAI's, and a cap


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", f"this example server does not support {what}")


def _invalid_type(expected: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_type", f"Input should be {expected}")


def _refused(value: object, info: Info) -> object:
    if value not in (None, False):
        raise _unsupported(f"'{info.field_name}'")
    return value


def _one_prompt(value: object) -> object:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if isinstance(value, list):
        raise _unsupported("a 'prompt' other than one string (batches, token ids)")
    return value


def _stop_strings(value: object) -> object:
    if isinstance(value, str):
        return [value]
    if value is None or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        return value
    raise _invalid_type("a string or an array of strings")


def _content_parts(value: object) -> object:
    if value is None or isinstance(value, str):
        return [{"type": "text", "text": value or ""}]
    if isinstance(value, list):
        return value
    raise _invalid_type("a string or an array of content parts")


def _text_only(value: object) -> object:
    if not (isinstance(value, dict) and value.get("type") == "text"):
        raise _unsupported("content parts other than text")
    return value


One = Annotated[int | None, Field(ge=1, le=1)]  # one choice: n, best_of
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
    n: One = None
    best_of: One = None
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
        message = f"{name} is too large: {value}. This model supports at most {limit} tokens."
        raise OpenAIError(400, message, param=name, code="invalid_value")
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
