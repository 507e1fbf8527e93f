"""The package as installed: each optional module names its extra when its dependency is missing.

Each case runs in a fresh interpreter where the dependency is hidden by a finder placed first on
`sys.meta_path`, which fails the import as a package that is not installed does, so the test
session's own imports do not matter; with nothing hidden, the modules that need no extra must
import none of them either.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib.metadata import metadata
from pathlib import Path

import pytest

import asgi_cancel

# Every third-party package an optional module or the trio driver may import.
OPTIONAL: tuple[str, ...] = ("aiohttp", "anyio", "httpx", "llama_cpp", "opentelemetry")
OPTIONAL += ("prometheus_client", "redis", "starlette", "torch", "transformers", "trio", "vllm")


# Raises what importing a package that is not installed raises: ModuleNotFoundError naming the
# top-level package (`import redis.asyncio` fails on `redis`).
HIDE = """
import sys

class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide())
"""


def run_hidden(hidden: tuple[str, ...], body: str) -> str:
    """Run `body` in a fresh interpreter with `hidden` not importable; return its stdout."""
    code = f"HIDDEN = {hidden!r}\n{HIDE}\n{body}"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


MISSING = {  # (the module, the dependency hidden, the extra it names)
    "aiohttp": ("asgi_cancel.aiohttp", "aiohttp", "aiohttp"),
    "httpx-without-httpx": ("asgi_cancel.httpx", "httpx", "httpx"),
    "httpx-without-anyio": ("asgi_cancel.httpx", "anyio", "httpx"),
    "prometheus": ("asgi_cancel.prometheus", "prometheus_client", "prometheus"),
    "redis": ("asgi_cancel.redis", "redis", "redis"),
    "otel": ("asgi_cancel.otel", "opentelemetry", "otel"),
    "testing": ("asgi_cancel.testing", "anyio", "testing"),
}


@pytest.mark.parametrize(("module", "hidden", "extra"), MISSING.values(), ids=MISSING)
def test_optional_module_without_its_dependency_names_its_extra(
    module: str, hidden: str, extra: str
) -> None:
    body = (
        f"try:\n    import {module}\n"
        "except ImportError as exc:\n    print(exc)\n"
        f"else:\n    raise SystemExit('{module} imported without {hidden}')\n"
    )
    message = run_hidden((hidden,), body)
    assert message.startswith(f"{module} needs ")
    assert f"({hidden} is missing)" in message
    assert message.endswith(f"pip install 'asgi-cancel[{extra}]'")
    assert extra in (metadata("asgi-cancel").get_all("Provides-Extra") or [])


@pytest.mark.parametrize("hidden", [OPTIONAL, ()], ids=["all-missing", "all-installed"])
def test_modules_that_need_no_extra_import_and_pull_no_optional_dependency(
    hidden: tuple[str, ...],
) -> None:
    # asgi_cancel.vllm takes any engine with generate() and abort(), asgi_cancel.transformers
    # any generate() with stopping criteria: vLLM, transformers and torch are needed at use only.
    body = (
        "import sys, asgi_cancel\n"
        "assert 'asgi_cancel.vllm' not in sys.modules\n"
        "import asgi_cancel.types, asgi_cancel.vllm, asgi_cancel.transformers\n"
        "import asgi_cancel.llama_cpp\n"  # llama_cpp is needed at use only, too
        # pytest loads the plugin wherever the package is installed: httpx and anyio are
        # imported when a test asks for its fixture, not before.
        "import asgi_cancel.pytest_plugin\n"
        f"print(sorted({{name.partition('.')[0] for name in sys.modules}} & set({OPTIONAL!r})))"
    )
    assert run_hidden(hidden, body) == "[]"


def test_only_the_trio_backend_imports_trio() -> None:
    """Trio code lives in its backend (`_trio.py`); other modules reach the running loop
    through `_backend` or anyio."""
    package = Path(asgi_cancel.__file__).parent
    importers = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            if any(name.partition(".")[0] == "trio" for name in names):
                importers.add(path.name)
    assert importers == {"_trio.py"}
