"""`python -m example_app serve|gateway|demo`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m example_app",
        description="An OpenAI-compatible server behind CancelOnDisconnectMiddleware.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    from . import demo, gateway_cli, serve

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
