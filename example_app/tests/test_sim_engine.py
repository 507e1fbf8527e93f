"""The simulated engine: batching, queueing, aborts and the wasted-token count, in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager
from typing import TypeVar

import pytest

from example_app.engine import RequestOutput, Sampling
from example_app.sim_engine import SimParams, SimulatedEngine

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

T = TypeVar("T")
WATCHDOG = 5.0


async def watchdog(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, WATCHDOG)


@asynccontextmanager
async def running(**options: float) -> AsyncIterator[SimulatedEngine]:
    engine = SimulatedEngine(
        step_time=options.get("step_time", 0.002),
        max_batch_size=int(options.get("max_batch_size", 2)),
    )
    await engine.start()
    try:
        yield engine
    finally:
        await watchdog(engine.stop())


async def last(outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    final = None
    async with aclosing(outputs):
        async for output in outputs:
            final = output
    assert final is not None
    return final


async def collect(engine: SimulatedEngine, request_id: str, max_tokens: int) -> RequestOutput:
    return await last(engine.generate("a prompt", SimParams(max_tokens=max_tokens), request_id))


async def wait_until_admitted(engine: SimulatedEngine, running: int) -> None:
    for _ in range(int(WATCHDOG * 1000)):
        if engine.stats().running >= running:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"fewer than {running} requests running")


async def test_a_request_gets_one_token_per_step_until_max_tokens() -> None:
    async with running() as engine:
        final = await watchdog(collect(engine, "a", 5))
        assert final.finished
        assert final.outputs[0].finish_reason == "length"
        assert len(final.outputs[0].token_ids) == 5
        assert final.outputs[0].text.count(" ") == 5  # one word per token
        stats = engine.stats()
        assert (stats.requests, stats.finished, stats.tokens_generated) == (1, 1, 5)
        assert (stats.running, stats.waiting, stats.aborted, stats.tokens_wasted) == (0, 0, 0, 0)


async def test_requests_beyond_the_batch_size_wait_in_the_queue() -> None:
    async with running(step_time=0.01, max_batch_size=2) as engine:
        tasks = [asyncio.create_task(collect(engine, f"r{i}", 50)) for i in range(5)]
        await watchdog(wait_until_admitted(engine, 2))
        stats = engine.stats()
        assert (stats.running, stats.waiting) == (2, 3)
        await engine.abort([f"r{i}" for i in range(5)])
        finals = await watchdog(asyncio.gather(*tasks))
        assert {final.outputs[0].finish_reason for final in finals} == {"abort"}
        assert engine.stats().aborted == 5


async def test_abort_frees_the_slot_for_the_next_waiting_request() -> None:
    async with running(step_time=0.01, max_batch_size=1) as engine:
        first = asyncio.create_task(collect(engine, "first", 1000))
        await watchdog(wait_until_admitted(engine, 1))
        second = asyncio.create_task(collect(engine, "second", 3))
        await asyncio.sleep(0.03)
        assert (engine.stats().running, engine.stats().waiting) == (1, 1)
        await engine.abort("first")
        assert (engine.stats().running, engine.stats().waiting) == (0, 1)  # at once
        assert (await watchdog(first)).outputs[0].finish_reason == "abort"
        assert (await watchdog(second)).outputs[0].finish_reason == "length"


async def test_abort_of_unknown_or_finished_requests_is_ignored() -> None:
    async with running() as engine:
        await watchdog(collect(engine, "done", 2))
        await engine.abort(["done", "never-seen"])
        assert engine.stats().aborted == 0


async def test_cancelling_the_consumer_aborts_the_request_like_vllm() -> None:
    async with running(step_time=0.01) as engine:
        task = asyncio.create_task(collect(engine, "a", 1000))
        await watchdog(wait_until_admitted(engine, 1))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watchdog(task)
        stats = engine.stats()
        assert (stats.running, stats.aborted) == (0, 1)


async def test_closing_the_generator_early_aborts_the_request() -> None:
    async with running(step_time=0.01) as engine:
        outputs = engine.generate("a prompt", SimParams(max_tokens=1000), "a")
        await watchdog(anext(outputs))
        await outputs.aclose()
        stats = engine.stats()
        assert (stats.running, stats.aborted) == (0, 1)


async def test_tokens_after_the_client_left_count_as_wasted() -> None:
    async with running(step_time=0.02) as engine:  # time to mark it gone before the next step
        outputs = engine.generate("a prompt", SimParams(max_tokens=20), "a")
        first = await watchdog(anext(outputs))
        engine.client_gone("a")
        engine.client_gone("a")  # counted once
        await watchdog(last(outputs))
        before = len(first.outputs[0].token_ids)
        stats = engine.stats()
        assert stats.clients_gone == 1
        assert stats.tokens_wasted == 20 - before == stats.tokens_generated - before


async def test_stop_string_ends_the_request_early() -> None:
    async with running() as engine:
        params = engine.sampling_params(Sampling(max_tokens=200, stop=(" the",), seed=3))
        final = await watchdog(last(engine.generate("p", params, "a")))
        assert final.outputs[0].finish_reason == "stop"
        assert " the" not in final.outputs[0].text


async def test_duplicate_request_id_is_refused() -> None:
    async with running(step_time=0.01) as engine:
        task = asyncio.create_task(collect(engine, "same", 1000))
        await watchdog(wait_until_admitted(engine, 1))
        with pytest.raises(ValueError, match="already in use"):
            await watchdog(collect(engine, "same", 1))
        await engine.abort("same")
        await watchdog(task)


def test_invalid_configuration_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="step_time"):
        SimulatedEngine(step_time=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        SimulatedEngine(max_batch_size=0)
