"""`python -m example_app serve`: build the engine and the app, run hypercorn or uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib.util
import logging
import signal
import sys
from types import FrameType
from typing import Any, cast

from starlette.types import ASGIApp

from .app import Shutdown, create_app
from .engine import Engine
from .options import (
    add_middleware_arguments,
    cancel_options,
    check_port,
    port_in_use_message,
    port_number,
)
from .sim_engine import SimulatedEngine

SERVERS = ("hypercorn", "uvicorn")
ENGINES = ("sim", "vllm")
SIM_MODEL_NAME = "sim-llm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000, help="default: 8000")
    parser.add_argument("--server", choices=SERVERS, default="hypercorn")
    parser.add_argument(
        "--no-middleware",
        dest="middleware",
        action="store_false",
        help="run WITHOUT CancelOnDisconnectMiddleware (the demo's baseline)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="sim",
        help="sim: the simulated engine (default); vllm: real vLLM AsyncLLM (needs --model)",
    )
    parser.add_argument("--model", help="vLLM model path or name (--engine vllm)")
    parser.add_argument(
        "--model-name",
        help=f"model name clients send (default: {SIM_MODEL_NAME!r}, or --model for vllm)",
    )
    parser.add_argument(
        "--max-model-len", type=int, help="prompt + completion tokens (sim default: 4096)"
    )
    sim = parser.add_argument_group("simulated engine")
    sim.add_argument(
        "--step-time", type=float, default=0.01, help="seconds per engine step (default: 0.01)"
    )
    sim.add_argument(
        "--max-batch-size", type=int, default=8, help="requests generating at once (default: 8)"
    )
    add_middleware_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))


def build_engine(args: argparse.Namespace) -> tuple[Engine, str]:
    """The engine the arguments ask for, and the model name to serve it as."""
    if args.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise SystemExit(
                "error: --engine vllm needs vLLM, which is not installed: "
                "pip install 'asgi-cancel[vllm]'"
            )
        if not args.model:
            raise SystemExit("--engine vllm needs --model PATH")
        from .vllm_engine import VllmEngine  # imports vllm only when asked for

        engine = VllmEngine(args.model, max_model_len=args.max_model_len)
        return engine, args.model_name or args.model
    simulated = SimulatedEngine(
        step_time=args.step_time,
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len or 4096,
    )
    return simulated, args.model_name or SIM_MODEL_NAME


def main(args: argparse.Namespace) -> int:
    cancel = cancel_options(args, without=None if args.middleware else "--no-middleware")
    check_port(args.host, args.port)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine, model_name = build_engine(args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    shutdown = Shutdown()
    app = create_app(engine, model_name=model_name, cancel=cancel, shutdown=shutdown)
    logging.getLogger("example_app").info(
        "serving %r (%s engine) on http://%s:%d with %s, CancelOnDisconnectMiddleware %s",
        model_name,
        engine.name,
        args.host,
        args.port,
        args.server,
        "ON" if args.middleware else "OFF",
    )
    try:
        if args.server == "uvicorn":
            run_uvicorn(app, args.host, args.port, args.log_level, shutdown)
        else:
            asyncio.run(run_hypercorn(app, args.host, args.port, shutdown))
    except KeyboardInterrupt:  # uvicorn raises the captured SIGINT again once it has stopped
        return 130
    except OSError as error:  # the port was taken between the check and the bind
        if error.errno != errno.EADDRINUSE:
            raise
        sys.stderr.write(port_in_use_message(args.host, args.port) + "\n")
        return 1
    return 0


async def run_hypercorn(app: ASGIApp, host: str, port: int, shutdown: Shutdown) -> None:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.errorlog = logging.getLogger("hypercorn.error")  # through the root handler, once
    config.graceful_timeout = 2.0
    config.startup_timeout = 600.0  # a vLLM engine can take a minute or more to start
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stopping() -> None:
        shutdown.begin()  # streams in flight end with an error event, not a cut
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping)
    await serve(cast(Any, app), config, shutdown_trigger=stop.wait, mode="asgi")


def run_uvicorn(app: ASGIApp, host: str, port: int, log_level: str, shutdown: Shutdown) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            shutdown.begin()  # streams in flight end with an error event, not a cut
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    Server(config).run()
