"""docs/testing.md's recipes, run as written: every block the page says is "Saved as `name`" is
written to a fresh directory and run there by pytest, as a user who copied them would."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .test_pytest_plugin import plugin_args

pytest_plugins = ("pytester",)

PAGE = Path(__file__).parent.parent / "docs" / "testing.md"
SAVED_AS = re.compile(
    r"[Ss]aved as\s+`(?P<name>[\w.]+)`:\n\n```python\n(?P<code>.*?)\n```", re.DOTALL
)
# Each test of the page, on the backends the anyio plugin gives it (trio is installed here);
# test_communicator.py on asyncio only, and conftest.py is the app's fixture for test_fixture*.py.
ON_BOTH = ("test_leaves.py", "test_timeout.py", "test_cancel_by_id.py", "test_deadline.py")
EXPECTED = dict.fromkeys([*ON_BOTH, "test_stream.py", "test_fixture.py"], 2)
EXPECTED |= {"test_communicator.py": 1, "conftest.py": 0}
# Run by pytest-asyncio, in a run of its own (the one above leaves pytest-asyncio out).
UNDER_PYTEST_ASYNCIO = {"test_fixture_asyncio.py": 1}


def recipes() -> dict[str, str]:
    return {match["name"]: match["code"] + "\n" for match in SAVED_AS.finditer(PAGE.read_text())}


def passed(result: pytest.RunResult) -> dict[str, int]:
    names = re.findall(r"^(\S+?\.py)::\S+ PASSED", result.stdout.str(), re.MULTILINE)
    return {name: names.count(name) for name in set(names)}


def test_the_page_has_its_recipes() -> None:
    assert set(recipes()) == set(EXPECTED) | set(UNDER_PYTEST_ASYNCIO)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.parametrize("plugin", ["anyio", "pytest-asyncio"])
def test_the_recipes_pass_as_written(pytester: pytest.Pytester, plugin: str) -> None:
    expected = {name: n for name, n in EXPECTED.items() if n}
    args = ["-p", "no:asyncio", *(f"--ignore={name}" for name in UNDER_PYTEST_ASYNCIO)]
    if plugin == "pytest-asyncio":  # its recipes, in a run of their own
        pytest.importorskip("pytest_asyncio")
        expected = UNDER_PYTEST_ASYNCIO
        args = ["-p", "asyncio", "-o", "asyncio_default_fixture_loop_scope=function"]
        args += UNDER_PYTEST_ASYNCIO
    for name, code in recipes().items():
        (pytester.path / name).write_text(code)
    result = pytester.runpytest_inprocess(
        *plugin_args(), *args, "-v", "-p", "no:cacheprovider", "--timeout=60"
    )
    assert result.ret == 0, result.stdout.str()
    assert passed(result) == expected, result.stdout.str()
