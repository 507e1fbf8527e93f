"""LiteLLM's proxy before the demo's engine server: does the backend stop when the client leaves?

Every hop is its own process on 127.0.0.1. The backend is `python -m example_app serve` on the
simulated engine with one batch slot and 100 ms steps, behind its middleware: it aborts its
engine request when its own client, the proxy, disconnects. The proxy is LiteLLM's
`litellm --config` from LiteLLM's venv (`.ci/litellm.sh` makes it; `ASGI_CANCEL_LITELLM_VENV`
points elsewhere), with one model routed to the backend as an OpenAI-compatible server. A
raw-socket client sends one request to /v1/chat/completions, /v1/completions, /v1/responses or
/v1/messages, streaming or not, and closes its connection while the request waits in the
backend's queue (before its first token: the one slot is held by a request sent straight to the
backend) or mid-generation. What is asserted is the backend engine's own counters, as in
test_gateway_chain.py: when it is done with the request (aborted, or finished) and how many
tokens it generated for it after the close.

Four proxies: LiteLLM as installed (the control, what it does on its own today), LiteLLM with
its own `general_settings.cancel_on_disconnect: true`, and LiteLLM with asgi-cancel added by
the recipe in docs/integrations.md (its code block, run as is) on each of LiteLLM's upstream
transports (aiohttp, its default, and httpx). `pytest -s` prints the table the docs quote;
`ASGI_CANCEL_LITELLM_RUNS=5` runs each cell five times. Without LiteLLM's venv the module is
skipped, unless `ASGI_CANCEL_REQUIRE_LITELLM=1` (CI) makes that a failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from example_app.launch import PACKAGE_ROOT, ServerProcess

from .litellm_proxy import (
    CELLS,
    STEP,
    STOPS_WITHIN,
    Cell,
    Proxy,
    Results,
    leave,
    run_proxy,
    table,
)

pytestmark = [pytest.mark.servers, pytest.mark.timeout(300)]

VENV = Path(os.environ.get("ASGI_CANCEL_LITELLM_VENV") or PACKAGE_ROOT / ".venv-litellm")
RECIPE_DOC = PACKAGE_ROOT / "docs" / "integrations.md"
RUNS = int(os.environ.get("ASGI_CANCEL_LITELLM_RUNS", "1"))
TRANSPORTS = {"aiohttp": {}, "httpx": {"DISABLE_AIOHTTP_TRANSPORT": "True"}}

# What LiteLLM (the version .ci/litellm.sh pins) does on its own when the client leaves.
# "stops": the backend is done with the request within STOPS_WITHIN of the close. "leaks": it
# keeps it for nobody: to the end, or (a streaming request still queued) until its first token
# reaches the proxy, which then closes it: LiteLLM starts watching for the disconnect only once
# the upstream has answered. Which of the two varies from run to run on /v1/responses and
# /v1/messages.
LITELLM_ALONE = {
    "chat-non-streaming-queued": "leaks",
    "chat-non-streaming-mid-generation": "leaks",
    "chat-streaming-queued": "leaks",  # until its first token
    "chat-streaming-mid-generation": "stops",
    "completions-non-streaming-queued": "leaks",
    "completions-non-streaming-mid-generation": "leaks",
    "completions-streaming-queued": "stops",
    "completions-streaming-mid-generation": "stops",
    "responses-non-streaming-queued": "leaks",
    "responses-non-streaming-mid-generation": "leaks",
    "responses-streaming-queued": "leaks",
    "responses-streaming-mid-generation": "stops",
    "messages-non-streaming-queued": "leaks",
    "messages-non-streaming-mid-generation": "leaks",
    "messages-streaming-queued": "leaks",
    "messages-streaming-mid-generation": "stops",
}


def recipe() -> str:
    """The hook module exactly as docs/integrations.md shows it."""
    blocks = re.findall(r"```python\n(.*?)```", RECIPE_DOC.read_text(), flags=re.DOTALL)
    modules = [block for block in blocks if block.startswith('"""litellm_cancel.py')]
    assert len(modules) == 1, f"{RECIPE_DOC}: one litellm_cancel.py block, found {len(modules)}"
    return str(modules[0])


# One backend and one proxy of each kind for the module -----------------------------------------


@pytest.fixture(scope="module")
def results() -> Iterator[Results]:
    """LiteLLM's venv (skip without it); the outcomes, printed as a table at the end."""
    if not (VENV / "bin" / "litellm").exists():
        reason = f"LiteLLM's venv is missing ({VENV}): bash .ci/litellm.sh makes it"
        if os.environ.get("ASGI_CANCEL_REQUIRE_LITELLM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    version = subprocess.run(
        [
            VENV / "bin" / "python",
            "-c",
            "import importlib.metadata as m; print(m.version('litellm'))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    outcomes: Results = {}
    yield outcomes
    sys.stdout.write(table(outcomes, f"LiteLLM {version}"))


@pytest.fixture(scope="module")
def engine(results: Results) -> Iterator[ServerProcess]:
    args = ["--step-time", str(STEP), "--max-batch-size", "1", "--log-level", "warning"]
    with ServerProcess(*args, server="uvicorn") as process:
        yield process


@pytest.fixture(scope="module")
def litellm_alone(
    engine: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    directory = tmp_path_factory.mktemp("alone")
    with run_proxy("LiteLLM alone", VENV, engine, directory) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def litellm_cancel_on_disconnect(
    engine: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    directory = tmp_path_factory.mktemp("cancel-on-disconnect")
    settings = {"cancel_on_disconnect": True}
    with run_proxy(
        "LiteLLM cancel_on_disconnect", VENV, engine, directory, general_settings=settings
    ) as proxy:
        yield proxy


@pytest.fixture(scope="module", params=TRANSPORTS)
def litellm_with_asgi_cancel(
    engine: ServerProcess, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Proxy]:
    transport: str = request.param
    directory = tmp_path_factory.mktemp(f"asgi-cancel-{transport}")
    # As the docs say: litellm_cancel.py beside the config, named as a worker startup hook.
    (directory / "litellm_cancel.py").write_text(recipe())
    env = {
        "LITELLM_WORKER_STARTUP_HOOKS": "litellm_cancel:install",
        "PYTHONPATH": str(directory),
        **TRANSPORTS[transport],
    }
    with run_proxy(f"asgi-cancel ({transport})", VENV, engine, directory, env=env) as proxy:
        yield proxy


# Tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.name)
def test_with_asgi_cancel_the_backend_stops_at_once(
    engine: ServerProcess, litellm_with_asgi_cancel: Proxy, results: Results, cell: Cell
) -> None:
    for _ in range(RUNS):
        outcome = leave(engine, litellm_with_asgi_cancel, cell, results)
        assert outcome.aborted, outcome
        assert outcome.seconds <= STOPS_WITHIN, outcome
        assert outcome.tokens_after_close <= (0 if cell.queued else 1), outcome  # one step
        assert outcome.engine_requests == 1, outcome  # no retry
    assert "Traceback" not in litellm_with_asgi_cancel.process.log_text()


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: f"{cell.name}-{LITELLM_ALONE[cell.name]}")
def test_litellm_alone_today(
    engine: ServerProcess, litellm_alone: Proxy, results: Results, cell: Cell
) -> None:
    # The control: the id says what LiteLLM does on its own, "leaks" or "stops" (LITELLM_ALONE).
    expected = LITELLM_ALONE[cell.name]
    for _ in range(RUNS):
        outcome = leave(engine, litellm_alone, cell, results)
        assert outcome.behaviour() == expected, outcome


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: f"{cell.name}-stops")
def test_litellm_cancel_on_disconnect_today(
    engine: ServerProcess, litellm_cancel_on_disconnect: Proxy, results: Results, cell: Cell
) -> None:
    # LiteLLM's own opt-in, a second control: today it stops every cell here.
    for _ in range(RUNS):
        outcome = leave(engine, litellm_cancel_on_disconnect, cell, results)
        assert outcome.behaviour() == "stops", outcome
        assert outcome.tokens_after_close <= (0 if cell.queued else 1), outcome
