"""The demo's progress line: the engine-idle time it names is the chart's, not the wall time."""

from __future__ import annotations

import time

import pytest

from example_app.progress import Progress

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("tty", [False, True])
def test_progress_prints_the_engine_idle_time_not_server_start_and_stop(
    tty: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    progress = Progress("without", leaving=8)
    progress.tty = tty
    progress(0, 16)
    time.sleep(0.3)  # server start, the load, server stop: none of it is the idle time
    progress(16, 16)
    progress.finish(1.234)
    err = capsys.readouterr().err
    assert "engine idle after 1.2 s" in err, err
    assert "8 try to leave early" in err
    if not tty:
        assert "without: 16/16 clients, engine idle after 1.2 s" in err
