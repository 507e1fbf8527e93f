"""Validating OpenAI requests: bad input is a 4xx `OpenAIError`, never a 500.

Only what the example serves: text completions and chat completions, one choice, streaming or
not. Unknown fields are ignored (as vLLM does); features the example does not implement are
refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

from .engine import Sampling
from .openai_errors import OpenAIError, json_type, type_error, unsupported

Kind = Literal["completion", "chat"]
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
DEFAULT_MAX_TOKENS: dict[Kind, int] = {"completion": 16, "chat": 256}  # OpenAI's, and a cap
MAX_STOP = 4


@dataclass(frozen=True)
class GenerationRequest:
    """A validated `/v1/completions` or `/v1/chat/completions` request."""

    kind: Kind
    model: str
    prompt: str
    sampling: Sampling
    stream: bool
    include_usage: bool


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # also bad UTF-8, NaN/Infinity, 5000-digit integers
        raise OpenAIError(
            400,
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, "
            "but what was sent was not valid JSON.)",
        ) from None
    if not isinstance(body, dict):
        raise OpenAIError(
            400,
            f"Invalid request body: expected a JSON object, but got {json_type(body)} instead.",
            code="invalid_type",
        )
    return body


def parse_request(
    kind: Kind,
    body: dict[str, Any],
    *,
    models: Collection[str],
    max_model_len: int,
    count_prompt_tokens: Callable[[str], int | None],
) -> GenerationRequest:
    """Validate a decoded body. Raises `OpenAIError` (400, or 404 for an unknown model)."""
    model = body.get("model")
    if model is None:
        raise OpenAIError(
            400,
            "You must provide a model parameter.",
            param="model",
            code="missing_required_parameter",
        )
    if not isinstance(model, str):
        raise type_error("model", "a string", model)
    if model not in models:
        # OpenAI and vLLM answer 404 here, and the openai client raises NotFoundError.
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    prompt = _prompt(body) if kind == "completion" else render_chat(_messages(body))
    for name in ("n", "best_of"):
        if _integer(body, name, default=1, minimum=1, maximum=128) != 1:
            raise unsupported(name, f"'{name}' other than 1")
    for name in ("echo", "logprobs", "suffix", "tools", "functions"):
        if body.get(name) not in (None, False):
            raise unsupported(name, f"'{name}'")
    stream = _boolean(body, "stream", default=False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise type_error("stream_options", "an object", options)
        include_usage = _boolean(options, "include_usage", default=False, where="stream_options.")
    sampling = Sampling(
        max_tokens=_max_tokens(kind, body, prompt, max_model_len, count_prompt_tokens),
        temperature=_number(body, "temperature", default=1.0, minimum=0.0, maximum=2.0),
        top_p=_number(body, "top_p", default=1.0, minimum=0.0, maximum=1.0),
        stop=_stop(body),
        seed=_integer(body, "seed", default=None, minimum=-(2**63), maximum=2**63 - 1),
        ignore_eos=_boolean(body, "ignore_eos", default=False),
    )
    return GenerationRequest(kind, model, prompt, sampling, stream, include_usage)


def render_chat(messages: list[tuple[str, str]]) -> str:
    """A plain-text chat prompt, the same for every engine (no model-specific template)."""
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if prompt is None:
        raise OpenAIError(
            400,
            "Missing required parameter: 'prompt'.",
            param="prompt",
            code="missing_required_parameter",
        )
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list):
        raise unsupported("prompt", "a 'prompt' other than one string (batches, token ids)")
    if not isinstance(prompt, str):
        raise type_error("prompt", "a string", prompt)
    return prompt


def _messages(body: dict[str, Any]) -> list[tuple[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise OpenAIError(
            400,
            "Missing required parameter: 'messages'.",
            param="messages",
            code="missing_required_parameter",
        )
    if not isinstance(messages, list):
        raise type_error("messages", "an array", messages)
    if not messages:
        raise OpenAIError(
            400,
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got "
            "an empty array instead.",
            param="messages",
            code="empty_array",
        )
    rendered = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise type_error(where, "an object", message)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise OpenAIError(
                400,
                f"Invalid value for '{where}.role': expected one of {', '.join(sorted(ROLES))}.",
                param=f"{where}.role",
                code="invalid_value",
            )
        rendered.append((role, _content(message.get("content"), f"{where}.content")))
    return rendered


def _content(content: object, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise type_error(where, "a string or an array of content parts", content)
    texts = []
    for index, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise unsupported(f"{where}[{index}]", "content parts other than text")
        text = part.get("text")
        if not isinstance(text, str):
            raise type_error(f"{where}[{index}].text", "a string", text)
        texts.append(text)
    return "".join(texts)


def _max_tokens(
    kind: Kind,
    body: dict[str, Any],
    prompt: str,
    max_model_len: int,
    count_prompt_tokens: Callable[[str], int | None],
) -> int:
    name = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"  # the newer name; the openai client sends either
    limit = max_model_len - 1
    value = _integer(body, name, default=None, minimum=1, maximum=None)
    if value is None:
        return min(DEFAULT_MAX_TOKENS[kind], limit)
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
        where = "messages" if kind == "chat" else "prompt"
        raise OpenAIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + value} tokens ({prompt_tokens} in the {where}, {value} "
            f"in the completion). Please reduce the length of the {where} or completion.",
            param=where,
            code="context_length_exceeded",
        )
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if not isinstance(stop, list) or not all(isinstance(item, str) for item in stop):
        raise type_error("stop", "a string or an array of strings", stop)
    if len(stop) > MAX_STOP:
        raise OpenAIError(
            400,
            f"Invalid 'stop': array too long. Expected an array with maximum length {MAX_STOP}, "
            f"but got an array with length {len(stop)} instead.",
            param="stop",
            code="array_above_max_length",
        )
    return tuple(item for item in stop if item)


def _integer(
    body: dict[str, Any], name: str, *, default: int | None, minimum: int, maximum: int | None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(name, "an integer", value)
    _check_range(name, "integer", value, minimum, maximum)
    return value


def _number(
    body: dict[str, Any], name: str, *, default: float, minimum: float, maximum: float
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(name, "a number", value)
    _check_range(name, "decimal", value, minimum, maximum)
    return float(value)


def _boolean(body: dict[str, Any], name: str, *, default: bool, where: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise type_error(where + name, "a boolean", value)
    return value


def _check_range(name: str, kind: str, value: float, minimum: float, maximum: float | None) -> None:
    if (isinstance(value, float) and not math.isfinite(value)) or value < minimum:
        raise OpenAIError(
            400,
            f"Invalid '{name}': {kind} below minimum value. Expected a value >= "
            f"{_show(minimum)}, but got {_show(value)} instead.",
            param=name,
            code=f"{kind}_below_min_value",
        )
    if maximum is not None and value > maximum:
        raise OpenAIError(
            400,
            f"Invalid '{name}': {kind} above maximum value. Expected a value <= "
            f"{_show(maximum)}, but got {_show(value)} instead.",
            param=name,
            code=f"{kind}_above_max_value",
        )


def _show(value: float) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
