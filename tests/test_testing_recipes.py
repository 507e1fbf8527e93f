"""docs/testing.md's recipes, run as written: every block the page says is "Saved as `name`" is
written to a fresh directory and run there by pytest, as a user who copied them would."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ("pytester",)

PAGE = Path(__file__).parent.parent / "docs" / "testing.md"
SAVED_AS = re.compile(
    r"[Ss]aved as\s+`(?P<name>[\w.]+)`:\n\n```python\n(?P<code>.*?)\n```", re.DOTALL
)
# Each test of the page, on the backends the anyio plugin gives it (trio is installed here).
EXPECTED = {
    "test_leaves.py": 2,
    "test_timeout.py": 2,
    "test_cancel_by_id.py": 2,
    "test_deadline.py": 2,
    "test_communicator.py": 1,  # asyncio only
    "test_stream.py": 2,
}


def recipes() -> dict[str, str]:
    return {match["name"]: match["code"] + "\n" for match in SAVED_AS.finditer(PAGE.read_text())}


def test_the_page_has_its_recipes() -> None:
    assert set(recipes()) == set(EXPECTED)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_the_recipes_pass_as_written(pytester: pytest.Pytester) -> None:
    for name, code in recipes().items():
        (pytester.path / name).write_text(code)
    result = pytester.runpytest_inprocess("-v", "-p", "no:cacheprovider", "--timeout=60")
    passed = re.findall(r"^(\S+?\.py)::\S+ PASSED", result.stdout.str(), re.MULTILINE)
    assert result.ret == 0, result.stdout.str()
    assert {name: passed.count(name) for name in EXPECTED} == EXPECTED, result.stdout.str()
