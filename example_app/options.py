"""The command-line options `serve` and `gateway` share: the port, the middleware's options."""

from __future__ import annotations

import argparse
import errno
import os
import socket

from .cancelling import CancelOptions

# The cancel endpoint's secret comes from the environment: an argument would show in `ps`.
SECRET_ENV = "ASGI_CANCEL_SECRET"
# So does the broker's URL, which may hold a Redis ACL user's password.
REDIS_ENV = "ASGI_CANCEL_REDIS_URL"
TIMEOUT_HEADER = "x-request-timeout"


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 1-65535."""
    port = int(text) if text.isdigit() else 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return port


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def add_middleware_arguments(parser: argparse.ArgumentParser) -> None:
    """The middleware's options that `serve` and `gateway` share: cancel by id, deadlines."""
    parser.add_argument(
        "--cancel-endpoint",
        action="store_true",
        help="serve cancel-by-id: DELETE /v1/requests/{X-Request-Id} (off by default); "
        f"with ${SECRET_ENV} set, it requires the header X-Cancel-Secret: <that value>; "
        f"with ${REDIS_ENV} set (redis://host:6379/0), a cancel reaches the request in any "
        "process on that Redis (--workers, several servers)",
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        metavar="SECONDS",
        help="a deadline for every request: past it, the request is cancelled and answered "
        "504 (a started stream is ended); default: none",
    )
    parser.add_argument(
        "--timeout-header",
        metavar="NAME",
        help=f"the request header with the caller's budget, e.g. `{TIMEOUT_HEADER}: 1.5s` "
        f"(default: {TIMEOUT_HEADER}; '' reads none)",
    )


def cancel_options(args: argparse.Namespace, *, without: str | None) -> CancelOptions | None:
    """The middleware's options from `add_middleware_arguments`' flags and `$ASGI_CANCEL_SECRET`.

    Args:
        without: the flag that left the middleware out (`--no-middleware`), or None.
    """
    if without is not None:
        asked = {
            "--cancel-endpoint": args.cancel_endpoint,
            "--timeout": args.timeout is not None,
            "--timeout-header": args.timeout_header is not None,
        }
        for flag in asked:
            if asked[flag]:
                raise SystemExit(f"error: {flag} needs asgi-cancel (drop {without})")
        return None
    header = TIMEOUT_HEADER if args.timeout_header is None else args.timeout_header
    secret = os.environ.get(SECRET_ENV) or None
    redis_url = os.environ.get(REDIS_ENV) or None
    if redis_url is not None and not args.cancel_endpoint:
        raise SystemExit(f"error: ${REDIS_ENV} carries cancels by id: add --cancel-endpoint")
    return CancelOptions(args.cancel_endpoint, secret, args.timeout, header or None, redis_url)


def port_in_use_message(host: str, port: int) -> str:
    return f"error: cannot listen on {host}:{port}: port {port} is already in use"


def check_port(host: str, port: int) -> None:
    """Exit with one line if the port cannot be bound (before the engine starts, not after)."""
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
                sock.bind(address)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise SystemExit(port_in_use_message(host, port)) from None
        raise SystemExit(
            f"error: cannot listen on {host}:{port}: {error.strerror or error}"
        ) from None
