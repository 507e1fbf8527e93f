"""Logging in the `vllm serve` processes the tests start: their log is what the tests read."""

from __future__ import annotations

import logging
import sys


def log_to_stderr(*names: str) -> None:
    """Send the INFO lines of the loggers `names` (asgi-cancel's, a probe's) to stderr, the
    server's log: vLLM configures only its own loggers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    for name in names:
        named = logging.getLogger(name)
        if not named.handlers:
            named.addHandler(handler)
            named.setLevel(logging.INFO)
