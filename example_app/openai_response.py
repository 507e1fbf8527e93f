"""OpenAI response bodies for completions and chat completions, whole and as SSE chunks."""

from __future__ import annotations

import json
from typing import Any

from .openai_request import GenerationRequest

DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event, as OpenAI streams them (`data: {...}` and a blank line)."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Responder:
    """Builds the bodies of one request's response, whichever endpoint it came from."""

    def __init__(self, request: GenerationRequest, response_id: str, created: int) -> None:
        self.request = request
        self.chat = request.kind == "chat"
        self.response_id = response_id
        self.created = created

    def _envelope(self, object_type: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_type,
            "created": self.created,
            "model": self.request.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def whole(
        self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        """The non-streaming response."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
            body = self._envelope("chat.completion", [choice])
        else:
            choice["text"] = text
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def chunks(self, delta: str, finish_reason: str | None, *, first: bool) -> bytes:
        """The SSE events for one engine output: new text, and the finish reason if done."""
        if not self.chat:
            return sse(self._text_chunk(delta, finish_reason))
        events = b""
        if first:
            events += sse(self._chat_chunk({"role": "assistant", "content": ""}, None))
        if delta:
            events += sse(self._chat_chunk({"content": delta}, None))
        if finish_reason is not None:
            events += sse(self._chat_chunk({}, finish_reason))
        return events

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The last event when the client asked for `stream_options.include_usage`."""
        body = self._envelope(self._chunk_object, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return sse(body)

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _text_chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def _chat_chunk(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk", [choice])
