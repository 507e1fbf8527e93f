"""The error an optional module raises when the extra it needs is not installed."""

from __future__ import annotations


def missing_extra(extra: str, error: ImportError) -> ImportError:
    """The ImportError naming the missing package and the extra that installs it."""
    return ImportError(
        f"asgi_cancel.{extra} needs packages that are not installed ({error.name} is "
        f"missing): pip install 'asgi-cancel[{extra}]'"
    )
