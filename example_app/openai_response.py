"""OpenAI's response bodies as pydantic models: completions and chat, whole and as SSE chunks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer

from .openai_request import ChatCompletionRequest, CompletionRequest

DONE = b"data: [DONE]\n\n"


def sse(data: BaseModel) -> bytes:
    """One server-sent event, as OpenAI streams them (`data: {...}` and a blank line)."""
    return b"data: " + data.model_dump_json().encode() + b"\n\n"


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        total = prompt_tokens + completion_tokens
        return cls(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=total
        )


class _Envelope(BaseModel):
    object: str
    id: str
    created: int
    model: str
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(_Envelope):
    """A `/v1/completions` response, and each of its stream's chunks (the same object)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    """What a chat chunk adds; only the fields it has (`{}` with the finish reason)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "asgi-cancel-example"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Responder:
    """Builds the bodies of one request's response, whichever endpoint it came from."""

    def __init__(
        self, request: CompletionRequest | ChatCompletionRequest, response_id: str, created: int
    ) -> None:
        self.chat = isinstance(request, ChatCompletionRequest)
        self.envelope: dict[str, Any] = {
            "id": response_id,
            "created": created,
            "model": request.model,
        }
        self.response_id = response_id

    def whole(
        self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int
    ) -> BaseModel:
        """The non-streaming response."""
        usage = UsageInfo.of(prompt_tokens, completion_tokens)
        if self.chat:
            chat_choice = ChatCompletionChoice(
                message=ChatMessage(content=text), finish_reason=finish_reason
            )
            return ChatCompletionResponse(**self.envelope, choices=[chat_choice], usage=usage)
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return CompletionResponse(**self.envelope, choices=[choice], usage=usage)

    def chunks(self, delta: str, finish_reason: str | None, *, first: bool) -> bytes:
        """The SSE events for one engine output: new text, and the finish reason if done."""
        if not self.chat:
            choice = CompletionChoice(text=delta, finish_reason=finish_reason)
            return sse(CompletionResponse(**self.envelope, choices=[choice]))
        events = b""
        if first:
            events += self._chat_chunk(DeltaMessage(role="assistant", content=""), None)
        if delta:
            events += self._chat_chunk(DeltaMessage(content=delta), None)
        if finish_reason is not None:
            events += self._chat_chunk(DeltaMessage(), finish_reason)
        return events

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The last event when the client asked for `stream_options.include_usage`."""
        usage = UsageInfo.of(prompt_tokens, completion_tokens)
        chunk_type = ChatCompletionStreamResponse if self.chat else CompletionResponse
        return sse(chunk_type(**self.envelope, choices=[], usage=usage))

    def _chat_chunk(self, delta: DeltaMessage, finish_reason: str | None) -> bytes:
        choice = ChatCompletionStreamChoice(delta=delta, finish_reason=finish_reason)
        return sse(ChatCompletionStreamResponse(**self.envelope, choices=[choice]))
