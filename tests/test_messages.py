"""What a message says (`_messages.py`): whether the last one sent completed the response."""

from __future__ import annotations

import pytest

from asgi_cancel._messages import response_complete
from asgi_cancel.types import Message

START: Message = {"type": "http.response.start", "status": 200, "headers": []}
WITH_TRAILERS: Message = {**START, "trailers": True}


@pytest.mark.parametrize(
    ("start", "last", "complete"),
    [
        (START, {"type": "http.response.body", "body": b"x"}, True),
        (START, {"type": "http.response.body", "more_body": True}, False),
        (WITH_TRAILERS, {"type": "http.response.body"}, False),
        (WITH_TRAILERS, {"type": "http.response.trailers", "more_trailers": True}, False),
        (WITH_TRAILERS, {"type": "http.response.trailers"}, True),
        (START, {"type": "http.response.pathsend", "path": "/a/file"}, True),
        # The zero-copy extension: a file's bytes, `more_body` as a body message's.
        (START, {"type": "http.response.zerocopysend", "file": 3}, True),
        (START, {"type": "http.response.zerocopysend", "file": 3, "more_body": True}, False),
        (START, START, False),
    ],
)
def test_the_last_message_sent_completes_the_response_or_not(
    start: Message, last: Message, complete: bool
) -> None:
    assert response_complete(start, last) is complete
