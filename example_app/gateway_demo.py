"""`python -m example_app demo --gateway`: the demo's load through a gateway over N engine servers.

The same engine servers (each with asgi-cancel) serve two passes of the load: through the
gateway with its asgi-cancel binding (middleware + `CancelTransport`), then through the same
gateway without it (`--no-binding`, a plain httpx proxy). The table shows, per backend, what
its engine generated, aborted, and counted as wasted (tokens after *its* client, the gateway,
left), and the tokens it generated that no client read (generated minus what the clients that
stayed read from its responses: the gateway names the backend in `x-example-backend`), and the
same for all backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from .gateway_cli import GatewayProcess
from .launch import ServerProcess
from .load import Load, Run
from .progress import run_pass
from .report import EngineConfig
from .serve import SIM_MODEL_NAME

_COUNTERS = ("tokens_generated", "tokens_wasted", "requests_aborted", "requests")


@dataclass
class GatewayRun:
    run: Run
    backends: list[dict[str, float]]  # per backend: counter deltas over the pass


def run_gateway_demo(load: Load, engine: EngineConfig, backends: int, server: str) -> str:
    """Both passes; returns the table."""
    serve_args = ["--step-time", str(engine.step_time)]
    serve_args += ["--max-batch-size", str(engine.max_batch_size), "--log-level", "warning"]
    passes: list[GatewayRun] = []
    with ExitStack() as stack:
        processes = [
            stack.enter_context(ServerProcess(*serve_args, server=server)) for _ in range(backends)
        ]
        urls = [process.base_url for process in processes]
        for bind in (True, False):
            label = "gateway bound" if bind else "gateway plain"
            before = [process.metrics() for process in processes]
            with GatewayProcess(urls, *(() if bind else ("--no-binding",))) as gateway:
                run = run_pass(gateway, SIM_MODEL_NAME, load, label)
            after = [process.metrics() for process in processes]
            passes.append(
                GatewayRun(run, [_deltas(a, b) for a, b in zip(after, before, strict=True)])
            )
    return format_gateway_table(load, engine, urls, passes)


def _deltas(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {
        name: after[f"example_engine_{name}_total"] - before[f"example_engine_{name}_total"]
        for name in _COUNTERS
    }


def unread_tokens(run: Run) -> float:
    """Tokens generated (all backends) minus those delivered to clients that read to the end."""
    delivered = sum(result.tokens for result in run.results if result.outcome == "done")
    return run.final["example_engine_tokens_generated_total"] - delivered


def delivered_by(run: Run, url: str) -> float:
    """Tokens of `url`'s responses that clients read to the end (the gateway names the
    backend of each response; a client that left before the headers has none, and read none)."""
    return sum(r.tokens for r in run.results if r.outcome == "done" and r.backend == url)


def format_gateway_table(
    load: Load, engine: EngineConfig, urls: Sequence[str], passes: list[GatewayRun]
) -> str:
    rows: list[tuple[str, list[str]]] = []
    for index, url in enumerate(urls):
        port = url.rsplit(":", 1)[-1]
        rows.append((f"backend {index + 1} (:{port})", ["", ""]))
        for name, key in (
            ("  requests", "requests"),
            ("  tokens generated", "tokens_generated"),
            ("  tokens wasted (backend's count)", "tokens_wasted"),
            ("  engine requests aborted", "requests_aborted"),
        ):
            rows.append((name, [f"{p.backends[index][key]:,.0f}" for p in passes]))
        rows.append(
            (
                "  tokens nobody read",
                [
                    f"{p.backends[index]['tokens_generated'] - delivered_by(p.run, url):,.0f}"
                    for p in passes
                ],
            )
        )
    rows.append(
        ("all backends: tokens nobody read", [f"{unread_tokens(p.run):,.0f}" for p in passes])
    )
    left = [
        sum(result.outcome in ("timed out", "closed") for result in p.run.results) for p in passes
    ]
    rows.append(("clients that left early", [str(count) for count in left]))
    header = [
        f"asgi-cancel demo through a gateway: {load.clients} openai clients -> gateway "
        f"(uvicorn) -> {len(urls)} engine servers (each with asgi-cancel)",
        f"simulated engines: batch {engine.max_batch_size}, {engine.step_time * 1000:g} ms/step, "
        f"{load.max_tokens} tokens per request; all on 127.0.0.1",
        "'wasted' is what a backend can see: tokens after its own client, the gateway, left;",
        "'nobody read' also counts the tokens generated for a client the gateway never told about",
        "(per backend it includes the load's two one-token warm-up requests)",
        "",
        f"{'':36}{'with asgi-cancel':>18}{'without':>18}",
        f"{'':36}{'on the gateway':>18}{'on the gateway':>18}",
    ]
    lines = [f"{name:36}" + "".join(f"{cell:>18}" for cell in cells) for name, cells in rows]
    return "\n".join(header + lines)
