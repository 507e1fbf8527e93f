"""The demo's clients: real `openai` clients, some of which leave before their answer is done."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from . import metrics

if TYPE_CHECKING:  # both are imported when the demo runs, not when `serve` parses its arguments
    import httpx
    import openai

Leave = Literal["timeout", "close"]
PROMPT = "Explain why a server should stop working for a client that has gone away."
# The gateway names the backend that served a response: the demo counts per backend what
# clients read.
BACKEND_HEADER = "x-example-backend"
WATCHDOG = 120.0  # seconds: no client may take longer, whatever the server does


@dataclass(frozen=True)
class Load:
    """What the clients do; `plan()` turns it into one deterministic schedule."""

    clients: int
    leave_fraction: float
    max_tokens: int
    ramp: float  # clients arrive evenly spread over this many seconds
    timeouts: tuple[float, float]  # client timeout range (seconds) of those that time out
    close_after: tuple[int, int]  # content chunks read before closing, for those that close
    seed: int = 1


@dataclass(frozen=True)
class ClientPlan:
    index: int
    start: float
    leave: Leave | None  # None: the client stays to the end
    stream: bool
    timeout: float = 0.0
    close_after: int = 0


@dataclass
class ClientResult:
    plan: ClientPlan
    outcome: str  # "done", "timed out", "closed", or "error: ..."
    latency: float
    finished_at: float
    tokens: int
    backend: str | None = None  # the gateway's `x-example-backend` header, when there is one


@dataclass
class Sample:
    at: float
    running: float
    waiting: float
    wasted: float


@dataclass
class Run:
    """One pass of the load against one server."""

    label: str
    results: list[ClientResult] = field(default_factory=list)
    timeline: list[Sample] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)  # counters: since the warm-up
    wall: float = 0.0
    # Seconds from the first client to the engine being idle (the chart's time axis).
    idle_after: float = 0.0


def plan(load: Load) -> list[ClientPlan]:
    rng = random.Random(load.seed)
    leavers = sorted(rng.sample(range(load.clients), round(load.clients * load.leave_fraction)))
    kinds: dict[int, Leave] = {
        index: "close" if position % 3 == 2 else "timeout" for position, index in enumerate(leavers)
    }
    plans = []
    for index in range(load.clients):
        start = index * load.ramp / load.clients
        leave = kinds.get(index)
        if leave == "timeout":
            plans.append(
                ClientPlan(index, start, leave, False, timeout=rng.uniform(*load.timeouts))
            )
        elif leave == "close":
            plans.append(
                ClientPlan(index, start, leave, True, close_after=rng.randint(*load.close_after))
            )
        else:
            plans.append(ClientPlan(index, start, None, stream=index % 2 == 0))
    return plans


def planned_leavers(load: Load) -> int:
    """Clients that try to leave early (a few finish before their timeout)."""
    return sum(client.leave is not None for client in plan(load))


async def run_load(
    base_url: str,
    model: str,
    load: Load,
    label: str,
    on_progress: Callable[[int, int], None],
) -> Run:
    """Send the planned clients, sample `/metrics` meanwhile, wait until the engine is idle."""
    import httpx
    import openai

    plans = plan(load)
    run = Run(label)
    done = 0
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="demo", max_retries=0)
    async with client, httpx.AsyncClient(base_url=base_url, timeout=5.0) as http:
        await _warm_up(client, model)
        baseline = metrics.parse((await http.get("/metrics")).text)
        origin = time.monotonic()
        sampler = asyncio.create_task(_sample(http, run, origin))
        try:

            async def one(client_plan: ClientPlan) -> None:
                nonlocal done
                result = await _client(client, model, load, client_plan, origin)
                run.results.append(result)
                done += 1
                on_progress(done, len(plans))

            clients = asyncio.gather(*(one(client_plan) for client_plan in plans))
            await asyncio.wait_for(clients, WATCHDOG)
            # Without the middleware, abandoned generations are still running: let them finish,
            # so that their waste is counted in full.
            idle = await asyncio.wait_for(_wait_idle(http), WATCHDOG)
            run.idle_after = time.monotonic() - origin
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        # The timeline ends with the idle engine, whenever the sampler last looked.
        wasted = idle["example_engine_tokens_wasted_total"]
        run.timeline.append(Sample(run.idle_after, 0.0, 0.0, wasted))
        run.wall = max(result.finished_at for result in run.results)
        final = metrics.parse((await http.get("/metrics")).text)
        run.final = {
            name: value - baseline.get(name, 0.0) if name.endswith("_total") else value
            for name, value in final.items()
        }
    return run


async def _warm_up(client: openai.AsyncOpenAI, model: str) -> None:
    # The first request of each kind pays for imports and model building in the client: not
    # something to measure, and it would delay the first run's clients only.
    await client.completions.create(model=model, prompt=PROMPT, max_tokens=1, timeout=WATCHDOG)
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=1,
        stream=True,
        stream_options={"include_usage": True},
        timeout=WATCHDOG,
    )
    async with stream:
        async for _chunk in stream:
            pass


async def _wait_idle(http: httpx.AsyncClient) -> dict[str, float]:
    while True:
        sample = metrics.parse((await http.get("/metrics")).text)
        busy = sample["example_engine_requests_running"] + sample["example_engine_requests_waiting"]
        if not busy:
            return sample
        await asyncio.sleep(0.05)


async def _sample(http: httpx.AsyncClient, run: Run, origin: float) -> None:
    while True:
        sample = metrics.parse((await http.get("/metrics")).text)
        run.timeline.append(
            Sample(
                time.monotonic() - origin,
                sample["example_engine_requests_running"],
                sample["example_engine_requests_waiting"],
                sample["example_engine_tokens_wasted_total"],
            )
        )
        await asyncio.sleep(0.05)


async def _client(
    client: openai.AsyncOpenAI, model: str, load: Load, plan: ClientPlan, origin: float
) -> ClientResult:
    import openai

    await asyncio.sleep(max(0.0, origin + plan.start - time.monotonic()))
    started = time.monotonic()
    tokens = 0
    outcome = "done"
    backend: str | None = None
    try:
        if not plan.stream:
            raw = await client.completions.with_raw_response.create(
                model=model,
                prompt=PROMPT,
                max_tokens=load.max_tokens,
                timeout=plan.timeout if plan.leave == "timeout" else WATCHDOG,
            )
            backend = raw.headers.get(BACKEND_HEADER)
            completion = raw.parse()
            tokens = completion.usage.completion_tokens if completion.usage else 0
        else:
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=load.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                timeout=WATCHDOG,
            )
            backend = stream.response.headers.get(BACKEND_HEADER)
            chunks = 0
            async with stream:  # leaving it early closes the stream, and the connection
                async for chunk in stream:
                    if chunk.usage is not None:  # the last event
                        tokens = chunk.usage.completion_tokens
                    elif chunk.choices and chunk.choices[0].delta.content:
                        chunks += 1
                        if plan.leave == "close" and chunks >= plan.close_after:
                            outcome = "closed"
                            break
    except openai.APITimeoutError:
        outcome = "timed out"
    except openai.OpenAIError as error:
        outcome = f"error: {error}"
    finished = time.monotonic()
    return ClientResult(plan, outcome, finished - started, finished - origin, tokens, backend)
