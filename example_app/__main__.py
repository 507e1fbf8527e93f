"""`python -m example_app serve|gateway|demo`."""

from __future__ import annotations

import argparse
import sys

# The top-level modules of the `example` extra's packages (and asgi-cancel itself): one of
# them missing means the example's dependencies are not installed in this Python.
EXAMPLE_DEPENDENCIES = frozenset(
    {
        "asgi_cancel",
        "fastapi",
        "httpx",
        "hypercorn",
        "matplotlib",
        "openai",
        "prometheus_client",
        "pydantic",
        "starlette",
        "uvicorn",
    }
)
INSTALL_HINT = "pip install -e '.[example]' in the repository, or run bash example_app/run.sh"


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] not in EXAMPLE_DEPENDENCIES:
            raise
        sys.stderr.write(
            f"python -m example_app: {error.name} is not installed in {sys.executable}: "
            f"{INSTALL_HINT}\n"
        )
        return 2


def run(argv: list[str] | None) -> int:
    from . import demo, gateway_cli, serve  # here: main() turns a missing dependency into a line

    parser = argparse.ArgumentParser(
        prog="python -m example_app",
        description="An OpenAI-compatible server behind CancelOnDisconnectMiddleware.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve.add_arguments(
        commands.add_parser(
            "serve",
            help="run the server",
            description="Run the OpenAI-compatible example server (Ctrl-C to stop).",
        )
    )
    gateway_cli.add_arguments(
        commands.add_parser(
            "gateway",
            help="run an OpenAI-compatible gateway in front of N engine servers",
            description=gateway_cli.__doc__,
        )
    )
    demo.add_arguments(
        commands.add_parser(
            "demo",
            help="compare the server with and without the middleware",
            description=demo.__doc__,
        )
    )
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve.main(args)
    if args.command == "gateway":
        return gateway_cli.main(args)
    return demo.main(args)


if __name__ == "__main__":  # the guard vLLM's engine processes need
    sys.exit(main())
