"""What `python -m example_app serve` prints when it cannot start: one line, no traceback."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from example_app.launch import HOST, PACKAGE_ROOT, free_port

pytestmark = pytest.mark.timeout(120)


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "example_app", "serve", *args],
        cwd=PACKAGE_ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("server", ["hypercorn", "uvicorn"])
def test_busy_port_is_one_line_naming_the_port(busy_port: int, server: str) -> None:
    result = run_serve("--host", HOST, "--port", str(busy_port), "--server", server)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert str(busy_port) in lines[0]
    assert "already in use" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this venv"
)
def test_vllm_engine_without_vllm_names_the_extra() -> None:
    result = run_serve("--engine", "vllm", "--model", "some-model", "--port", str(free_port()))
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "pip install 'asgi-cancel[vllm]'" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
