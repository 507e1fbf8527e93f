"""The servers the serving benchmark drives: vLLM's OpenAI server and example_app's simulated one.

Each is started twice, without and with `CancelOnDisconnectMiddleware`, both on 127.0.0.1. The
two stay up side by side (an idle engine costs no CPU) so that runs can alternate between them
without paying a vLLM start-up (30-75 s on 2 cores) per run; the starts themselves happen one
after the other, never two at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from example_app.launch import StartupError, Subprocess, answers

from ._util import ROOT

VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_DIR = Path(os.environ.get("ASGI_CANCEL_TINY_MODEL", ROOT / ".models" / "tiny-llama"))
MODEL_NAME = "tiny-llama"
MIDDLEWARE = "asgi_cancel.CancelOnDisconnectMiddleware"
VARIANTS = ("without", "with")
TARGETS = ("sim", "vllm")
# vLLM on a CPU machine, offline and quiet (docs/vllm.md explains each one).
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
VLLM_MAX_NUM_SEQS = 16
SIM_STEP_TIME = 0.01
SIM_MAX_BATCH = 16
MAX_MODEL_LEN = 512
SETTLE_S = 1.5


def have_vllm() -> bool:
    if not VLLM_PYTHON.exists():
        return False
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.util as u; assert u.find_spec('vllm')"],
        capture_output=True,
    )
    return probe.returncode == 0


def ensure_model(*pythons: Path) -> Path:
    """Build the tiny local model (no downloads) unless it is there; return its folder.

    Built with the first interpreter that has `tokenizers` (vLLM's venv, AIPerf's, or this
    one): the dev venv has neither it nor transformers."""
    if not (MODEL_DIR / "config.json").exists():
        candidates = [VLLM_PYTHON, *pythons, Path(sys.executable)]
        python = next(
            (
                candidate
                for candidate in candidates
                if candidate.exists()
                and subprocess.run(
                    [str(candidate), "-c", "import tokenizers, transformers"],
                    capture_output=True,
                    timeout=120,
                ).returncode
                == 0
            ),
            Path(sys.executable),
        )
        subprocess.run(
            [str(python), "-m", "example_app.tiny_model", str(MODEL_DIR)],
            cwd=ROOT,
            check=True,
            timeout=300,
        )
    return MODEL_DIR


@dataclass
class Target:
    """One server process: `target` (sim or vllm) `variant` (without or with the middleware)."""

    target: str
    variant: str
    log: Path
    port: int = 0
    process: Subprocess | None = None
    startup_s: float = 0.0
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return MODEL_NAME

    def command(self) -> list[str]:
        if self.target == "vllm":
            command = [
                str(VLLM_PYTHON),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(MODEL_DIR),
                "--served-model-name",
                MODEL_NAME,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dtype",
                "float32",
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--enforce-eager",
                "--max-num-seqs",
                str(VLLM_MAX_NUM_SEQS),
                "--seed",
                "0",
                "--disable-uvicorn-access-log",
            ]
            if self.variant == "with":
                command += ["--middleware", MIDDLEWARE]
            return command
        command = [
            sys.executable,
            "-m",
            "example_app",
            "serve",
            "--server",
            "uvicorn",
            "--port",
            str(self.port),
            "--model-name",
            MODEL_NAME,
            "--max-model-len",
            str(MAX_MODEL_LEN * 8),
            "--step-time",
            str(SIM_STEP_TIME),
            "--max-batch-size",
            str(SIM_MAX_BATCH),
            "--log-level",
            "warning",
        ]
        if self.variant == "without":
            command.append("--no-middleware")
        return command

    def start(self, timeout: float = 300.0) -> Target:
        environment = VLLM_ENV if self.target == "vllm" else {}
        self.process = Subprocess(
            self._argv,
            ready=answers("/health"),
            cwd=ROOT,
            env=environment,
            log=self.log,
            ready_timeout=timeout,
            poll=0.5,
            stop_timeout=60.0,
        )
        try:
            self.process.start()
        except StartupError as exc:
            raise RuntimeError(f"{self.name} did not start: {exc}") from None
        self.startup_s = self.process.startup_seconds
        return self

    def _argv(self, port: int) -> list[str]:
        self.port = port
        return self.command()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def name(self) -> str:
        return f"{self.target}/{self.variant}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def metrics(self) -> dict[str, float]:
        """Prometheus samples of the server, summed over labels (`name` -> value)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_and_labels, _, value = line.rpartition(" ")
            name = name_and_labels.split("{", 1)[0]
            try:
                samples[name] = samples.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return samples

    def generated_tokens(self) -> float:
        samples = self.metrics()
        if self.target == "vllm":
            return samples.get("vllm:generation_tokens_total", 0.0)
        return samples.get("example_engine_tokens_generated_total", 0.0)

    def wasted_tokens(self) -> float | None:
        """Tokens generated after the client left (the simulated engine counts them itself)."""
        if self.target == "vllm":
            return None
        return self.metrics().get("example_engine_tokens_wasted_total", 0.0)

    def busy(self) -> float:
        samples = self.metrics()
        if self.target == "vllm":
            return samples.get("vllm:num_requests_running", 0.0) + samples.get(
                "vllm:num_requests_waiting", 0.0
            )
        return samples.get("example_engine_requests_running", 0.0) + samples.get(
            "example_engine_requests_waiting", 0.0
        )

    def wait_idle(self, timeout: float = 120.0) -> float:
        """Wait until the engine runs and queues nothing; return the seconds it took."""
        started = time.monotonic()
        while self.busy() > 0:
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"{self.name}: engine still busy after {timeout} s")
            time.sleep(0.02)
        return time.monotonic() - started

    def settle(self) -> None:
        """Idle, and past vLLM's busy-poll window: after its last step a vLLM worker spins on
        its shared-memory queue for 1 s (`busy_loop_s`), which would take CPU from the server
        measured next (both variants stay up side by side)."""
        self.wait_idle()
        time.sleep(SETTLE_S)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


DEFAULT_LAYOUT = tuple((variant, variant) for variant in VARIANTS)


class Pair:
    """The target without and with the middleware, started one after the other, stopped both.

    `layout`: (label, variant) per server, in start order; the default is without, then with.
    `benchmarks.serving_profile --layout` also starts with first (ba) or two servers without
    (aa, an A/A control: what two identical servers differ by on this machine).
    """

    def __init__(
        self,
        target: str,
        logs: Path,
        layout: tuple[tuple[str, str], ...] = DEFAULT_LAYOUT,
    ) -> None:
        self.servers = {
            label: Target(target, variant, logs / f"{target}-{label}.log")
            for label, variant in layout
        }

    def __enter__(self) -> Pair:
        try:
            for server in self.servers.values():
                server.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
