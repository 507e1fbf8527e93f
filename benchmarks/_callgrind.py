"""Instructions per request, counted by callgrind: a cost measure that other jobs on a shared
machine cannot disturb (same input, same count), used next to the wall-clock numbers.

`run_callgrind({"group": [variants]}, requests)` runs `_inproc instr` once per group under
`valgrind --tool=callgrind --dump-before=getppid` (the groups in parallel: counts do not depend
on load) and returns instructions per request per variant, plus the functions whose
self cost grew most over the group's baseline (`top_added`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ._util import ROOT


def available() -> bool:
    return shutil.which("valgrind") is not None and shutil.which("callgrind_annotate") is not None


def _part_functions(path: Path, total: int) -> dict[str, int]:
    """Self instruction counts per function, from callgrind_annotate.

    The functions on the stack at the dump (main, the event loop's run...) come out with the
    part's whole total; they are dropped (no function's self cost comes near half of it)."""
    output = subprocess.run(
        ["callgrind_annotate", "--threshold=100", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    functions: dict[str, int] = {}
    for line in output.splitlines():
        match = re.match(r"\s*([\d,]+)\s+\([^)]*\)\s+(.*)$", line)
        if match and ":" in match.group(2):
            count = int(match.group(1).replace(",", ""))
            if count > total // 2:
                continue
            name = match.group(2).split(" [")[0].rsplit("/", 1)[-1].removesuffix("'2")
            functions[name] = functions.get(name, 0) + count
    return functions


def _totals(path: Path) -> int:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("totals:") or line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def run_callgrind(groups: dict[str, tuple[str, list[str]]], requests: int) -> dict[str, Any]:
    """groups: name -> (python, variants); the first variant of each group is its baseline."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="asgi-cancel-callgrind-") as folder:
        jobs = {}
        for group, (python, variants) in groups.items():
            prefix = Path(folder) / group
            command = [
                "valgrind",
                "--tool=callgrind",
                "--dump-before=getppid",
                f"--callgrind-out-file={prefix}.out",
                python,
                *("-m", "benchmarks._inproc", "instr", *variants),
                *("--requests", str(requests)),
            ]
            env = {**os.environ, "PYTHONHASHSEED": "0"}
            jobs[group] = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        for group, job in jobs.items():
            _stdout, stderr = job.communicate(timeout=3600)
            if job.returncode != 0:
                raise RuntimeError(f"callgrind {group} failed:\n{stderr.decode()[-2000:]}")
        for group, (_python, variants) in groups.items():
            prefix = Path(folder) / group
            per_variant: dict[str, Any] = {}
            functions: dict[str, dict[str, int]] = {}
            for index, variant in enumerate(variants):
                part = Path(f"{prefix}.out.{2 * index + 2}")
                total = _totals(part)
                per_variant[variant] = {"instructions_per_request": total / requests}
                functions[variant] = _part_functions(part, total)
            baseline = variants[0]
            for variant in variants[1:]:
                base = functions[baseline]
                grown = {
                    name: (count - base.get(name, 0)) / requests
                    for name, count in functions[variant].items()
                }
                top = sorted(grown.items(), key=lambda item: -item[1])[:10]
                per_variant[variant]["top_added"] = [[name, round(n)] for name, n in top]
                per_variant[variant]["added_per_request"] = (
                    per_variant[variant]["instructions_per_request"]
                    - per_variant[baseline]["instructions_per_request"]
                )
                per_variant[variant]["ratio"] = (
                    per_variant[variant]["instructions_per_request"]
                    / per_variant[baseline]["instructions_per_request"]
                )
            for variant in variants:
                per_variant[variant]["group"] = group
                per_variant[variant]["baseline"] = baseline
            out.update(per_variant)
    return out
