"""`--engine vllm`: real vLLM `AsyncLLM` behind the same `Engine` seam as the simulator.

`generate` and `abort` go straight to `AsyncLLM` (so `abort_on_cancel` aborts real vLLM
requests); this wrapper only converts outputs and keeps the counters `/metrics` shows. vLLM's
scheduler does not expose per-request state cheaply, so here "waiting" means submitted but no
token yet (queue and prefill) and "running" means decoding.

vLLM is imported when the engine starts, never at import time. On a CPU-only machine, build a
tiny random-weight model with `python -m example_app.tiny_model OUTDIR` (see README.md).
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing
from typing import Any

from .engine import (
    CompletionOutput,
    Counters,
    EngineRequestError,
    EngineStats,
    RequestOutput,
    Sampling,
)


class _Tracked:
    __slots__ = ("client_gone", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.client_gone = False


class VllmEngine:
    """vLLM's `AsyncLLM` with the example's `Engine` interface.

    Args:
        model: a model path (or a Hugging Face name, if downloads are allowed).
        max_model_len: cap the context length (smaller means less KV cache on CPU).
        **engine_args: more `vllm.AsyncEngineArgs` fields.
    """

    name = "vllm"

    def __init__(self, model: str, *, max_model_len: int | None = None, **engine_args: Any):
        self.model = model
        self._engine_args = dict(engine_args, model=model)
        if max_model_len is not None:
            self._engine_args["max_model_len"] = max_model_len
        self._llm: Any = None
        self._vllm: Any = None
        self._client_errors: tuple[type[Exception], ...] = (ValueError,)
        self._live: dict[str, _Tracked] = {}
        self.counters = Counters()

    @property
    def max_model_len(self) -> int:
        if self._llm is None:
            return int(self._engine_args.get("max_model_len", 2048))
        return int(self._llm.model_config.max_model_len)

    async def start(self) -> None:
        self._vllm = importlib.import_module("vllm")
        self._client_errors = (
            importlib.import_module("vllm.exceptions").VLLMClientError,
            ValueError,
        )
        async_llm = importlib.import_module("vllm.v1.engine.async_llm")
        args = self._vllm.AsyncEngineArgs(**self._engine_args)
        self._llm = async_llm.AsyncLLM.from_engine_args(args)

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def sampling_params(self, sampling: Sampling) -> object:
        try:
            return self._vllm.SamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p or 1e-6,  # OpenAI allows 0, vLLM wants (0, 1]
                stop=list(sampling.stop) or None,
                seed=sampling.seed,
                ignore_eos=sampling.ignore_eos,
            )
        except ValueError as error:
            raise EngineRequestError(str(error)) from None

    def count_prompt_tokens(self, prompt: str) -> int | None:
        return None  # vLLM validates the prompt length itself

    async def generate(
        self, prompt: str, params: object, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        tracked = self._live[request_id] = _Tracked()
        self.counters.requests += 1
        finished = False
        try:
            async with aclosing(self._llm.generate(prompt, params, request_id)) as outputs:
                async for output in outputs:
                    converted = self._convert(output)
                    completion = converted.outputs[0]
                    new = len(completion.token_ids) - tracked.tokens
                    tracked.tokens += new
                    self.counters.tokens_generated += new
                    if tracked.client_gone:
                        self.counters.tokens_wasted += new
                    finished = converted.finished and completion.finish_reason != "abort"
                    yield converted
        except self._client_errors as error:
            raise EngineRequestError(str(error)) from None
        finally:
            del self._live[request_id]
            if finished:
                self.counters.finished += 1
            else:
                self.counters.aborted += 1

    @staticmethod
    def _convert(output: Any) -> RequestOutput:
        return RequestOutput(
            request_id=output.request_id,
            prompt_token_ids=tuple(output.prompt_token_ids or ()),
            outputs=tuple(
                CompletionOutput(
                    index=completion.index,
                    text=completion.text,
                    token_ids=tuple(completion.token_ids),
                    finish_reason=completion.finish_reason,
                )
                for completion in output.outputs
            ),
            finished=output.finished,
        )

    async def abort(self, request_id: str | Iterable[str]) -> None:
        await self._llm.abort(request_id)

    def client_gone(self, request_id: str) -> None:
        tracked = self._live.get(request_id)
        if tracked is not None and not tracked.client_gone:
            tracked.client_gone = True
            self.counters.clients_gone += 1

    def _max_batch_size(self) -> int:
        if self._llm is None:
            return 0
        return int(self._llm.vllm_config.scheduler_config.max_num_seqs)

    def stats(self) -> EngineStats:
        running = sum(1 for tracked in self._live.values() if tracked.tokens)
        return self.counters.stats(
            running=running,
            waiting=len(self._live) - running,
            max_batch_size=self._max_batch_size(),
        )
