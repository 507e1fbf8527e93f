"""The public surface: exported names (options: test_middleware.py; documented: test_docs.py;
lazy optional imports: test_packaging.py)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import types

import asgi_cancel
import asgi_cancel.types


def public_submodules() -> set[str]:
    return {
        m.name for m in pkgutil.iter_modules(asgi_cancel.__path__) if not m.name.startswith("_")
    }


def test_all_is_a_sorted_tuple_of_names_the_package_defines() -> None:
    names = asgi_cancel.__all__
    assert isinstance(names, tuple)
    assert list(names) == sorted(set(names)), "sorted, each name once"
    for name in names:
        obj = getattr(asgi_cancel, name)  # each one importable: `from asgi_cancel import name`
        assert obj.__module__.startswith("asgi_cancel._"), (name, obj.__module__)
        assert obj.__name__ == name, f"{name} is exported under another name ({obj.__name__})"
    assert isinstance(asgi_cancel.__version__, str)


def test_nothing_but_all_and_the_public_submodules_is_public() -> None:
    for name in public_submodules():  # attributes once imported: make them all present
        importlib.import_module(f"asgi_cancel.{name}")
    # (pytest rewrites the package when it loads the plugin: `@py_builtins` is no name)
    public = {name for name in dir(asgi_cancel) if name.isidentifier() and name[0] != "_"}
    modules = {name for name in public if isinstance(getattr(asgi_cancel, name), types.ModuleType)}
    assert modules == public_submodules(), "a private module leaks, or one is misnamed"
    assert public - modules == set(asgi_cancel.__all__)


def test_types_all_names_every_alias_and_class_it_defines() -> None:
    tree = ast.parse(inspect.getsource(asgi_cancel.types))
    assigned = {
        target.id
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name) and not target.id.startswith("_")
    }
    assigned |= {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert sorted(asgi_cancel.types.__all__) == sorted(assigned)
    for name in asgi_cancel.types.__all__:
        getattr(asgi_cancel.types, name)
