"""`transformers serve` (transformers' own OpenAI server) with a client that leaves, alone and
with the recipe of docs/threads.md (tests/threads/_serve.py, `serve_recipe`).

The server runs in this process on the tiny random-weight Llama; a raw socket closes once the
engine made `LEAVE_AFTER` tokens, counted from the engine's side (a stopping criterion probed
into every `generate()`). Alone, the non-streaming route runs to `max_tokens` for a client that
left; with the recipe it stops within a few tokens. Streaming stops in both: transformers'
SSE generator cancels its streamer when it is closed. The same with `--continuous-batching`,
counted from the batch manager's tokens (tests/threads/_serve.py, `BatchedGenerations`).
Skipped where transformers or accelerate is missing (the main venv); under .ci/vllm.sh
(`ASGI_CANCEL_REQUIRE_VLLM=1`) that is a failure.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

from . import require

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch and transformers warn on import; not ours to fix
    torch = require("torch")
    transformers = require("transformers")
    require("accelerate")  # `transformers serve` loads no model on the CPU without it
    require("transformers.cli.serve")

    from ..vllm._harness import tiny_model
    from ._measure import LEAVE_AFTER
    from ._serve import BatchedGenerations, Generations, serve_departure, served

pytestmark = [pytest.mark.vllm, pytest.mark.servers, pytest.mark.timeout(120)]

MAX_NEW_TOKENS = 300  # about 1 s on this model; the control runs it all
# The token being computed at the close, and one more when the disconnect reaches the loop a
# step later on a loaded machine; a leak makes the hundreds the control shows.
MAX_TOKENS_AFTER_CLOSE = 30


@pytest.fixture(scope="module")
def generations() -> Iterator[tuple[Generations, BatchedGenerations]]:
    torch.set_num_threads(1)  # one core for the generation, one for the loop and the client
    probed = Generations(transformers.LlamaForCausalLM), BatchedGenerations()
    yield probed
    for probe in probed:
        probe.restore()


@pytest.fixture(scope="module", params=["alone", "recipe", "alone-batched", "recipe-batched"])
def server(
    request: pytest.FixtureRequest, generations: tuple[Generations, BatchedGenerations]
) -> Iterator[tuple[str, int, Generations | BatchedGenerations]]:
    mode, _, batched = request.param.partition("-")
    with served(tiny_model(), recipe=mode == "recipe", batched=bool(batched)) as port:
        yield mode, port, generations[1 if batched else 0]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_a_departed_client_stops_the_generation_only_with_the_recipe(
    server: tuple[str, int, Generations | BatchedGenerations], stream: bool
) -> None:
    mode, port, generations = server
    measured = serve_departure(port, generations, tiny_model(), stream, MAX_NEW_TOKENS, timeout=30)
    if mode == "alone" and not stream:
        # The control: nothing stops the inference thread's generate(), nor the batch's request.
        assert measured["tokens"] == MAX_NEW_TOKENS, measured
        assert measured["tokens_after_close"] >= MAX_NEW_TOKENS - LEAVE_AFTER - 10, measured
    else:
        assert measured["tokens_after_close"] <= MAX_TOKENS_AFTER_CLOSE, measured
