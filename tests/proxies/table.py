"""The table of docs/proxies.md, from the JSON lines the proxy suite writes with
ASGI_CANCEL_PROXY_LOG set (the runs that made it: docs/proxies.md, "Made with"):

    .venv/bin/python -m tests.proxies.table /tmp/proxies.jsonl --write docs/proxies.md

Without `--write` the table goes to stdout; with it, the text between the two markers in that
file is replaced.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from .harness import CANCELLED, DEFAULTS, SCENARIOS
from .proxies import PROXIES

START = "<!-- proxies-table:start -->"
END = "<!-- proxies-table:end -->"
HEADINGS = {
    "first-byte": "before the first byte",
    "sse": "mid-stream (SSE)",
    "body": "slow non-streaming answer",
    "upload": "mid-upload",
}


def cell(items: list[dict[str, Any]]) -> str:
    """`0.6 / 2.2 ms` (median / max) when every run was cancelled; else each outcome's count.
    Runs whose client saw none of the answer before it left are counted as held back."""
    if not items:
        return ""
    outcomes = [item["outcome"] for item in items]
    held = sum(item["seen"] is False for item in items)
    note = f" (held back {held}/{len(items)})" if held else ""
    if set(outcomes) == {CANCELLED}:
        values = [item["ms"] for item in items]
        return f"{statistics.median(values):.1f} / {max(values):.1f} ms{note}"
    if len(set(outcomes)) == 1:
        return f"**{outcomes[0]}**{note}"
    counts = {outcome: outcomes.count(outcome) for outcome in sorted(set(outcomes))}
    return ", ".join(f"{outcome} {count}/{len(items)}" for outcome, count in counts.items()) + note


def summarize(lines: list[str]) -> str:
    groups: dict[tuple[str, str, str], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    versions: dict[str, str] = {}
    for line in lines:
        item = json.loads(line)
        groups[item["proxy"], item["config"], item["server"]][item["scenario"]].append(item)
        versions[item["proxy"]] = item["version"]
    order = {proxy.name: index for index, proxy in enumerate(PROXIES)}
    labels = {proxy.name: proxy.tuned for proxy in PROXIES}
    runs = max((len(items) for row in groups.values() for items in row.values()), default=0)
    out = [
        "| proxy | config | server | " + " | ".join(HEADINGS[s] for s in SCENARIOS) + " |",
        "|---|---|---|" + "---|" * len(SCENARIOS),
    ]
    for proxy, config, server in sorted(
        groups, key=lambda key: (order[key[0]], key[1] != DEFAULTS, key[2])
    ):
        row = groups[proxy, config, server]
        shown = "defaults" if config == DEFAULTS else labels[proxy]
        cells = " | ".join(cell(row.get(scenario, [])) for scenario in SCENARIOS)
        out.append(f"| {proxy} {versions[proxy]} | {shown} | {server} | {cells} |")
    out.append("")
    out.append(
        f"Close (FIN) -> the app's `CancelledError`, median / max over {runs} runs; "
        "**never**: no cancellation within 3 s of the close; **not started**: the proxy never "
        "handed the request to the app; **held back**: in that many runs no event or piece of the "
        "answer had reached the client when it left (0.5 s after the app sent the third)."
    )
    return "\n".join(out) + "\n"


def write(path: Path, table: str) -> None:
    text = path.read_text()
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not (start and end):
        raise ValueError(f"{path} has no {START} ... {END} markers")
    path.write_text(f"{head}{START}\n{table}{END}{tail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.proxies.table")
    parser.add_argument("log", type=Path, help="the JSON lines of ASGI_CANCEL_PROXY_LOG")
    parser.add_argument("--write", type=Path, help="replace the table between the markers here")
    args = parser.parse_args(argv)
    table = summarize(args.log.read_text().splitlines())
    if args.write:
        write(args.write, table)
    else:
        sys.stdout.write(table)


if __name__ == "__main__":
    main()
