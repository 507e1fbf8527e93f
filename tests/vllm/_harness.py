"""What the real-vLLM tests share: the environment, the tiny models, a raw HTTP client.

Nothing here imports vLLM but `import_vllm`, which skips (with the reason) where vLLM is not
installed. .ci/vllm.sh builds the tiny random-weight models before the tests run, into
`$ASGI_CANCEL_TINY_MODEL` and, for the realtime route, `$ASGI_CANCEL_TINY_ASR_MODEL`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asgi_cancel import CancelToken

from ..servers.client import dechunk
from ..servers.process import free_port as free_port

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get("ASGI_CANCEL_TINY_MODEL", REPO / ".models" / "tiny-llama"))
ASR_MODEL_DIR = Path(
    os.environ.get("ASGI_CANCEL_TINY_ASR_MODEL", REPO / ".models" / "tiny-qwen3-asr")
)

# vLLM on a CPU machine, offline and quiet (docs/vllm.md explains each one). Set before vLLM is
# imported: its EngineCore and worker processes are spawned with this environment.
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (whole GiB only)
    "VLLM_HOST_IP": "127.0.0.1",  # never advertise another interface
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
for _name, _value in VLLM_ENV.items():
    os.environ.setdefault(_name, _value)

# Loose bounds for a shared 2-core machine; docs/vllm.md quotes what was measured.
LEAVES_ENGINE_WITHIN = 2.0  # s from the disconnect to no unfinished request in the engine
MAX_TOKENS_AFTER_DISCONNECT = 6  # per sequence that was running (about 1 engine step: 1-2)


def _required() -> bool:
    return os.environ.get("ASGI_CANCEL_REQUIRE_VLLM") == "1"


def import_vllm(module: str = "vllm") -> Any:
    """Import `module` of vLLM, or skip the calling test module if vLLM is not installed.

    With `ASGI_CANCEL_REQUIRE_VLLM=1` (set by .ci/vllm.sh) a missing vLLM is an error instead.
    """
    reason = "real vLLM is not installed here (.ci/vllm.sh installs it into .venv-vllm)"
    with warnings.catch_warnings():
        # vLLM, torch and transformers warn on import (deprecations); not ours to fix.
        warnings.simplefilter("ignore")
        if _required():
            importlib.import_module("vllm")
        vllm = pytest.importorskip("vllm", reason=reason)
        if getattr(vllm, "__file__", None) is None:  # a namespace package, not vLLM
            pytest.skip(reason, allow_module_level=True)
        return importlib.import_module(module)


def tiny_model() -> Path:
    """The model directory; skip the test if nothing is there (fail under .ci/vllm.sh)."""
    return _built(MODEL_DIR, "ASGI_CANCEL_TINY_MODEL", "example_app.tiny_model")


def tiny_asr_model() -> Path:
    """The realtime model's directory (tests/vllm/tiny_asr.py); skip or fail as `tiny_model`."""
    return _built(ASR_MODEL_DIR, "ASGI_CANCEL_TINY_ASR_MODEL", "tests.vllm.tiny_asr")


def _built(directory: Path, variable: str, builder: str) -> Path:
    if (directory / "config.json").is_file():  # the builders write it last
        return directory
    reason = (
        f"no tiny model in {directory} ({variable}): .ci/vllm.sh builds it with "
        f"`python -m {builder} {directory}`"
    )
    if _required():
        pytest.fail(reason)
    pytest.skip(reason)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll `predicate` every 2 ms; return the seconds it took, fail after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"watchdog: {what} not within {timeout} s")
        time.sleep(0.002)
    return time.monotonic() - start


class RawClient:
    """One HTTP/1.1 request over a plain socket, so that closing it really disconnects."""

    def __init__(self, port: int, *, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.received = b""
        self.closed_at: float | None = None

    def post(
        self, path: str, payload: dict[str, Any], headers: dict[str, str] | None = None
    ) -> RawClient:
        body = json.dumps(payload).encode()
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
        ).encode()
        self.sock.sendall(head + body)
        return self

    def read_until(self, predicate: Callable[[bytes], bool], timeout: float = 30.0) -> bytes:
        deadline = time.monotonic() + timeout
        while not predicate(self.received):
            if time.monotonic() > deadline:
                raise AssertionError(f"watchdog: response not as expected: {self.received!r}")
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.received += chunk
        return self.received

    def read_all(self, timeout: float = 60.0) -> bytes:
        with contextlib.suppress(ConnectionError):
            self.read_until(lambda _: False, timeout)
        return self.received

    def close(self) -> float:
        """Close the connection (FIN); return the monotonic time it happened."""
        self.closed_at = time.monotonic()
        self.sock.close()
        return self.closed_at

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.closed_at is None:
            self.close()


def body_of(response: bytes) -> bytes:
    """The body of a complete HTTP/1.1 response, chunked or not."""
    head, _, body = response.partition(b"\r\n\r\n")
    return dechunk(body) if b"transfer-encoding: chunked" in head.lower() else body


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def watch(
    token: CancelToken, request_id: str, fired: dict[str, float], usage: dict[str, Any]
) -> None:
    """Record when `token` fires, and the usage it reports once its request is over."""
    token.on_cancel(lambda: fired.__setitem__(request_id, time.monotonic()))

    def record() -> None:
        if (spent := token.usage) is not None:
            usage[request_id] = (spent.prompt_tokens, spent.completion_tokens, spent.after_cancel)

    token.on_finished(record)


def report(section: str, measured: dict[str, Any]) -> None:
    """Write `measured` under `section` of the JSON file at $ASGI_CANCEL_VLLM_REPORT, if set."""
    path = Path(os.environ.get("ASGI_CANCEL_VLLM_REPORT", ""))
    if path.name:
        previous = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps(previous | {section: measured}, indent=2))
