"""The docs agree with the code: the API page documents every public name and nothing that is
gone, the options table gives every option with its default, and docs/websockets.md's example
runs as written. Needs the clone (docs/ is not in the sdist)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from typing import Any

import asgi_cancel
from asgi_cancel import CancelOnDisconnectMiddleware

DOCS = Path(__file__).resolve().parent.parent / "docs"


def documented() -> set[str]:
    """The objects docs/api.md renders (`::: asgi_cancel.x.Name`)."""
    return set(re.findall(r"^::: (\S+)$", (DOCS / "api.md").read_text(), re.MULTILINE))


def public_names() -> set[str]:
    """Every public name: the package's `__all__`, and what each public submodule defines."""
    names = {f"asgi_cancel.{name}" for name in asgi_cancel.__all__}
    for info in pkgutil.iter_modules(asgi_cancel.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"asgi_cancel.{info.name}")
        exported = getattr(module, "__all__", None) or [
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and (inspect.isclass(value) or inspect.isfunction(value))
            and value.__module__ == module.__name__
        ]
        names.update(f"{module.__name__}.{name}" for name in exported)
    return names


def test_the_api_page_documents_every_public_name() -> None:
    pages = documented()
    missing = {
        name
        for name in public_names()
        if name not in pages and name.rpartition(".")[0] not in pages
    }
    assert missing == set()


def test_every_name_the_api_page_renders_exists() -> None:
    for path in documented():
        module_name, _, name = path.rpartition(".")
        try:
            importlib.import_module(path)
        except ModuleNotFoundError:
            assert hasattr(importlib.import_module(module_name), name), path


def test_the_options_table_gives_every_option_its_default() -> None:
    text = (DOCS / "how-it-works.md").read_text()
    section = text.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    table = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, re.MULTILINE))
    parameters = list(inspect.signature(CancelOnDisconnectMiddleware).parameters.values())
    assert [p.name for p in parameters[:1]] == ["app"]
    options = parameters[1:]
    # Keyword-only, each with a default: no positional option, no **kwargs swallowing a typo.
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in options)
    assert table == {p.name: repr(p.default) for p in options}


def test_the_module_map_names_every_module_and_no_other() -> None:
    text = (DOCS / "contributing.md").read_text()
    block = text.split("\n## Module map\n", 1)[1].split("```\n", 2)[1]
    mapped = re.findall(r"^  (\w+\.py) ", block, re.MULTILINE)
    package = Path(asgi_cancel.__file__).parent
    assert sorted(mapped) == sorted(path.name for path in package.glob("*.py"))
    assert len(mapped) == len(set(mapped))


def test_the_realtime_example_of_the_docs_cancels_one_response_and_keeps_the_socket() -> None:
    """docs/websockets.md's `turn()` example, run as written under Starlette's TestClient."""
    from starlette.testclient import TestClient

    text = (DOCS / "websockets.md").read_text()
    source = text.split("```python\n", 1)[1].split("```\n", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(source, "docs/websockets.md", "exec"), namespace)
    with TestClient(namespace["app"]) as client, client.websocket_connect("/v1/realtime") as ws:
        ws.send_json({"type": "response.create"})
        assert ws.receive_json()["type"] == "response.text.delta"
        ws.send_json({"type": "response.cancel"})
        deltas = 0  # in flight when the cancel came, then the cancellation: 1000 without it
        while ws.receive_json()["type"] == "response.text.delta":
            deltas += 1
        assert deltas < 100
        ws.send_json({"type": "response.create"})  # the socket is still open
        assert ws.receive_json()["type"] == "response.text.delta"
