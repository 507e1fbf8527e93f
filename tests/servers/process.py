"""A free port on 127.0.0.1. Standard library only: the real-vLLM tests import it from vLLM's
own venv."""

from __future__ import annotations

import socket

from .client import HOST


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port
