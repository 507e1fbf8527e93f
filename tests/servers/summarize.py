"""Turn the latencies of several runs into the markdown table in docs/servers.md.

rm -f /tmp/latency.jsonl
for i in 1 2 3 4 5; do
    ASGI_CANCEL_LATENCY_LOG=/tmp/latency.jsonl .venv/bin/pytest tests/servers -m servers -q
done
.venv/bin/python tests/servers/summarize.py /tmp/latency.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

CLOSE_ORDER = ["fin", "rst", "half", "rst-stream", "conn-fin"]


def summarize(path: Path) -> str:
    cells: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in path.read_text().splitlines():
        item = json.loads(line)
        cells[item["server"], item["scenario"]][item["close"]].append(item["cancel_ms"])
    closes = [c for c in CLOSE_ORDER if any(c in row for row in cells.values())]
    lines = [
        "| server | scenario | " + " | ".join(closes) + " |",
        "|---|---|" + "---|" * len(closes),
    ]
    for (server, scenario), row in sorted(cells.items()):
        values = [
            f"{statistics.median(row[c]):.1f} / {max(row[c]):.1f}" if row.get(c) else ""
            for c in closes
        ]
        lines.append(f"| {server} | {scenario} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(summarize(Path(sys.argv[1])))
