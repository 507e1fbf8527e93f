"""One event-loop parametrisation: every anyio test runs on asyncio and on trio. A test that
is asyncio code by nature says so, and why: `@pytest.mark.asyncio_only(reason="...")`; one that
parametrises `anyio_backend` itself is left as it says."""

from __future__ import annotations

import pytest

BACKENDS = ("asyncio", "trio")
# Written for asyncio and not this suite's to change: on asyncio until they say so themselves
# (test_listeners.py's disconnect-first case fails on trio: a gap of the trio driver).
ASYNCIO_MODULES = {"test_httpx.py", "test_listeners.py"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "asyncio_only(reason): asyncio code by nature: the test runs on asyncio alone"
    )


@pytest.fixture
def anyio_backend() -> str:
    """Stands in for anyio's own (parametrised) fixture: the loops are chosen below."""
    raise AssertionError("parametrised by pytest_generate_tests")  # pragma: no cover


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "anyio_backend" not in metafunc.fixturenames:
        return
    if any("anyio_backend" in m.args[0] for m in metafunc.definition.iter_markers("parametrize")):
        return
    marker = metafunc.definition.get_closest_marker("asyncio_only")
    if marker is not None and not marker.kwargs.get("reason"):
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: asyncio_only needs a reason=")
    asyncio_only = marker is not None or metafunc.definition.path.name in ASYNCIO_MODULES
    metafunc.parametrize("anyio_backend", BACKENDS[:1] if asyncio_only else BACKENDS)
