"""The demo's passes: one load against one server, with a progress line on stderr."""

from __future__ import annotations

import asyncio
import sys

from .launch import Subprocess
from .load import Load, Run, planned_leavers, run_load


class Progress:
    """A one-line text progress bar on stderr (a line per phase when stderr is not a TTY)."""

    def __init__(self, label: str, leaving: int = 0) -> None:
        self.label = label
        self.leaving = leaving
        self.tty = sys.stderr.isatty()
        self.done = self.total = 0

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        if self.tty:
            filled = round(24 * done / max(total, 1))
            bar = "#" * filled + "." * (24 - filled)
            counts = f"{done}/{total} clients, {self.leaving} try to leave early"
            sys.stderr.write(f"\r{self.label:>17} [{bar}] {counts}")
        elif done == 0:
            sys.stderr.write(
                f"{self.label}: {total} clients, {self.leaving} try to leave early ...\n"
            )
        sys.stderr.flush()

    def finish(self, idle_after: float) -> None:
        """`idle_after`: seconds from the first client to the engine idle, as on the chart.

        Server start and stop are not in it.
        """
        line = f"{self.done}/{self.total} clients, engine idle after {idle_after:.1f} s"
        if self.tty:
            sys.stderr.write(f", engine idle after {idle_after:.1f} s\n")
        else:
            sys.stderr.write(f"{self.label}: {line}\n")
        sys.stderr.flush()


def run_pass(server: Subprocess, model: str, load: Load, label: str) -> Run:
    """The load against `server`, with a progress line; the server's output if it fails."""
    progress = Progress(label, leaving=planned_leavers(load))
    progress(0, load.clients)
    try:
        run = asyncio.run(run_load(server.base_url, model, load, label, progress))
    except BaseException:
        sys.stderr.write(f"\n{label}: server output:\n{server.log_tail()}\n")
        raise
    progress.finish(run.idle_after)
    return run
