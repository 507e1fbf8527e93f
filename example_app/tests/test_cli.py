"""What `python -m example_app` prints when it cannot start: one clear line, no traceback."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from example_app.launch import HOST, PACKAGE_ROOT, free_port

from .helpers import run_example

pytestmark = pytest.mark.timeout(120)


def one_line(result: subprocess.CompletedProcess[str], status: int = 1) -> str:
    """The last stderr line of a run that failed with `status` and no traceback."""
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    return result.stderr.splitlines()[-1]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("server", ["hypercorn", "uvicorn"])
def test_a_busy_port_is_one_line_naming_it(busy_port: int, server: str) -> None:
    result = run_example("serve", "--host", HOST, "--port", str(busy_port), "--server", server)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert f"port {busy_port} is already in use" in one_line(result)


@pytest.mark.parametrize("command", ["serve", "gateway"])
@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_an_invalid_port_is_an_argparse_error(command: str, port: str) -> None:
    line = one_line(run_example(command, f"--port={port}"), status=2)
    assert line.endswith(f"error: argument --port: '{port}' is not a TCP port (1-65535)")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--no-middleware", "--timeout", "1"], "--timeout needs asgi-cancel"),
        (["serve", "--no-middleware", "--cancel-endpoint"], "(drop --no-middleware)"),
        (["gateway", "--no-binding", "--timeout-header", "x"], "(drop --no-binding)"),
    ],
    ids=["timeout-without-middleware", "cancel-by-id-without-middleware", "deadline-unbound"],
)
def test_an_option_without_asgi_cancel_is_refused(args: list[str], message: str) -> None:
    assert message in one_line(run_example(*args))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_names_the_extra() -> None:
    args = ("serve", "--engine", "vllm", "--model", "some-model", "--port", str(free_port()))
    assert "pip install 'asgi-cancel[vllm]'" in one_line(run_example(*args))


@pytest.mark.parametrize("command", ["serve", "gateway", "demo"])
def test_missing_dependencies_are_one_line_saying_what_to_install(command: str) -> None:
    # -S: no site-packages, as a Python outside the venv; asgi_cancel comes from the checkout.
    result = subprocess.run(
        [sys.executable, "-S", "-m", "example_app", command],
        cwd=PACKAGE_ROOT,
        env={name: value for name, value in os.environ.items() if name != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.stderr.count("\n") == 1, result.stderr
    line = one_line(result, status=2)
    assert "fastapi is not installed" in line
    assert "pip install -e '.[example]'" in line
    assert "bash example_app/run.sh" in line
