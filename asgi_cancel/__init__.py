"""asgi-cancel: stop an ASGI app's work the moment its HTTP client disconnects."""

from ._endpoint import cancel_endpoint as cancel_endpoint
from ._endpoint import require_header as require_header
from ._middleware import CancelOnDisconnectMiddleware as CancelOnDisconnectMiddleware
from ._registry import CancelRegistry as CancelRegistry
from ._token import CancelToken as CancelToken
from ._token import TokenUsage as TokenUsage
from ._token import current_token as current_token
from ._token import detach as detach
from ._token import shield as shield
from ._turn import turn as turn

__version__ = "0.1.0"

__all__ = (
    "CancelOnDisconnectMiddleware",
    "CancelRegistry",
    "CancelToken",
    "TokenUsage",
    "cancel_endpoint",
    "current_token",
    "detach",
    "require_header",
    "shield",
    "turn",
)
