"""Compatibility: the ASGI aliases moved to the public `asgi_cancel.types`."""

from __future__ import annotations

from .types import AnyASGIApp as AnyASGIApp
from .types import ASGIApp as ASGIApp
from .types import Message as Message
from .types import OnCancelled as OnCancelled
from .types import Receive as Receive
from .types import Scope as Scope
from .types import Send as Send
