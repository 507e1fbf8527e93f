"""`python -m example_app gateway`: the gateway (`gateway.py`) in front of N engine servers.

Without `--backend`, it starts `--backends` example servers (simulated engine) itself on free
ports of 127.0.0.1 and stops them when it stops; with `--backend URL` (repeated) it uses
running ones. `GatewayProcess` runs the command as a subprocess for the demo and the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Mapping, Sequence
from contextlib import ExitStack

from .app import Shutdown
from .launch import HOST, ServerProcess, Subprocess, answers, example_app_env
from .options import (
    add_middleware_arguments,
    cancel_options,
    check_port,
    port_number,
)
from .serve import SERVERS, run_hypercorn, run_uvicorn

DEFAULT_BACKENDS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=HOST, help=f"default: {HOST}")
    parser.add_argument("--port", type=port_number, default=8000, help="default: 8000")
    parser.add_argument("--server", choices=SERVERS, default="uvicorn", help="default: uvicorn")
    parser.add_argument(
        "--no-binding",
        dest="bind",
        action="store_false",
        help="a plain httpx proxy: no CancelOnDisconnectMiddleware, no CancelTransport",
    )
    parser.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="an example server to forward to (repeat for several); default: start --backends",
    )
    parser.add_argument(
        "--backends",
        type=int,
        default=DEFAULT_BACKENDS,
        help=f"engine servers to start when no --backend is given (default: {DEFAULT_BACKENDS})",
    )
    engine = parser.add_argument_group("started backends (simulated engine)")
    engine.add_argument("--step-time", type=float, default=0.01, help="default: 0.01")
    engine.add_argument("--max-batch-size", type=int, default=8, help="default: 8")
    engine.add_argument("--backend-server", choices=SERVERS, default="hypercorn")
    add_middleware_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))


def main(args: argparse.Namespace) -> int:
    if not args.backend and args.backends < 1:
        raise SystemExit("error: --backends must be >= 1")
    binding = cancel_options(args, without=None if args.bind else "--no-binding")
    check_port(args.host, args.port)
    for server in {args.server, args.backend_server}:  # missing: fail before any start
        importlib.import_module(server)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from .gateway import create_gateway  # httpx: only the gateway needs it

    # uvicorn re-raises a captured SIGTERM once it has stopped: exit through Python, so the
    # started backends are stopped too.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with ExitStack() as backends:
        urls = list(args.backend or [])
        if not urls:
            for _ in range(args.backends):
                backend = ServerProcess(*_backend_args(args), server=args.backend_server)
                process = backends.enter_context(backend)
                urls.append(process.base_url)
        app = create_gateway(urls, binding=binding)
        logging.getLogger("example_app").info(
            "gateway on http://%s:%d (%s) over %s, asgi-cancel binding %s",
            args.host,
            args.port,
            args.server,
            ", ".join(urls),
            "ON" if args.bind else "OFF",
        )
        try:
            if args.server == "uvicorn":
                run_uvicorn(app, args.host, args.port, args.log_level, Shutdown())
            else:
                asyncio.run(run_hypercorn(app, args.host, args.port, Shutdown()))
        except KeyboardInterrupt:
            return 130
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _backend_args(args: argparse.Namespace) -> list[str]:
    """`serve` arguments for a started backend (which inherits the cancel secret's variable)."""
    serve_args = ["--step-time", str(args.step_time), "--max-batch-size", str(args.max_batch_size)]
    serve_args.extend(["--log-level", "warning"])
    if args.cancel_endpoint:
        serve_args.append("--cancel-endpoint")
    if args.timeout_header is not None:  # the header the gateway forwards its budget in
        serve_args += ["--timeout-header", args.timeout_header]
    return serve_args


class GatewayProcess(Subprocess):
    """`python -m example_app gateway --backend URL...` on 127.0.0.1, ready once `/health` answers.

    Args:
        backends: the example servers' base URLs.
        *gateway_args: extra `gateway` arguments (e.g. `"--no-binding"`).
        env: environment variables to add for the gateway.
    """

    def __init__(
        self,
        backends: Sequence[str],
        *gateway_args: str,
        ready_timeout: float = 120.0,  # as ServerProcess: loaded machines
        env: Mapping[str, str] | None = None,
    ) -> None:
        def argv(port: int) -> list[str]:
            command = [sys.executable, "-m", "example_app", "gateway", "--host", HOST]
            command += ["--port", str(port), "--log-level", "warning"]
            for url in backends:
                command += ["--backend", url]
            return [*command, *gateway_args]

        super().__init__(
            argv,
            ready=answers("/health", timeout=1.0),
            env=example_app_env(env),
            ready_timeout=ready_timeout,
        )

    def __enter__(self) -> GatewayProcess:
        super().__enter__()
        return self
