"""The table generator: measurements in, markdown between the markers out (no proxy needed)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from .harness import Outcome
from .table import END, START, main, summarize


def line(
    proxy: str, config: str, scenario: str, outcome: str, ms: float | None, seen: bool | None = None
) -> str:
    """One measurement, as `measure` logs it."""
    result = Outcome(proxy, "1.0", "uvicorn-httptools", config, scenario, outcome, ms, seen)
    return json.dumps(asdict(result))


def test_cells_are_median_and_max_or_the_outcome() -> None:
    lines = [
        line("nginx", "defaults", "first-byte", "cancelled", 1.0),
        line("nginx", "defaults", "first-byte", "cancelled", 3.0),
        line("nginx", "defaults", "first-byte", "cancelled", 2.0),
        line("nginx", "defaults", "upload", "not started", None),
        line("haproxy", "tuned", "first-byte", "never", None),
        line("haproxy", "tuned", "sse", "cancelled", 5.0, seen=True),
        line("haproxy", "tuned", "sse", "never", None, seen=False),
    ]
    table = summarize(lines).splitlines()
    assert (
        table[2]
        == "| nginx 1.0 | defaults | uvicorn-httptools | 2.0 / 3.0 ms |  |  | **not started** |"
    )
    assert table[3].startswith(
        "| haproxy 1.0 | `option abortonclose` | uvicorn-httptools | **never** |"
    )
    assert "cancelled 1/2, never 1/2 (held back 1/2)" in table[3]
    assert "over 3 runs" in table[5]


def write_page(tmp_path: Path, page_text: str) -> str:
    """Caddy's one measurement written into a page holding `page_text`; the page's new text."""
    log = tmp_path / "log.jsonl"
    log.write_text(line("caddy", "defaults", "sse", "cancelled", 0.5) + "\n")
    page = tmp_path / "page.md"
    page.write_text(page_text)
    main([str(log), "--write", str(page)])
    return page.read_text()


def test_write_replaces_the_text_between_the_markers(tmp_path: Path) -> None:
    text = write_page(tmp_path, f"before\n{START}\nold table\n{END}\nafter\n")
    assert "old table" not in text
    assert text.startswith(f"before\n{START}\n| proxy |")
    assert text.endswith(f"{END}\nafter\n")
    assert "| caddy 1.0 | defaults | uvicorn-httptools |  | 0.5 / 0.5 ms |" in text


def test_write_refuses_a_page_without_markers(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="markers"):
        write_page(tmp_path, "no markers\n")
