"""What a hop binding forwards to the next hop, and to which hosts: one rule for every binding.

The request id and the remaining budget go only to the hosts a binding was told to forward
them to: never to a third-party API by default. They are set, not added: the gateway's own id
and remaining budget win over whatever the app copied from its client's headers (a client must
not lengthen the next hop's deadline). Every hop of a call is checked, redirects included: the
HTTP clients copy a request's headers onto the request that follows its redirect, so the ones
an earlier hop was given are taken back when the next host is not one to forward to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from urllib.parse import urlsplit

from ._token import CancelToken
from ._validate import header_name

__all__ = ["ForwardTo", "Forwarding"]

# A predicate on the upstream request's (scheme, host, port), or the hosts to forward to.
ForwardTo = Iterable[str] | Callable[[str, str, int | None], bool]
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


class Forwarding:
    """A binding's forwarding options, checked once at construction."""

    __slots__ = ("hosts", "predicate", "request_id_header", "timeout_header")

    def __init__(
        self,
        forward_to: ForwardTo,
        request_id_header: str | None,
        timeout_header: str | None,
    ) -> None:
        self.predicate: Callable[[str, str, int | None], bool] | None = None
        self.hosts: frozenset[tuple[str, int | None]] = frozenset()
        if callable(forward_to):
            self.predicate = forward_to
        elif isinstance(forward_to, str):
            raise ValueError(f"forward_to must be a list of hosts, got the string {forward_to!r}")
        else:
            self.hosts = frozenset(_host_and_port(host) for host in forward_to)
        self.request_id_header = (
            None
            if request_id_header is None
            else header_name("request_id_header", request_id_header).decode("ascii")
        )
        self.timeout_header = (
            None
            if timeout_header is None
            else header_name("timeout_header", timeout_header).decode("ascii")
        )

    def forwards_to(self, scheme: str, host: str, port: int | None) -> bool:
        """Whether the id and budget go to this upstream."""
        if self.predicate is not None:
            return bool(self.predicate(scheme, host, port))
        host = host.lower()
        if (host, None) in self.hosts:
            return True
        return (host, port if port is not None else _DEFAULT_PORTS.get(scheme)) in self.hosts

    def headers(
        self, token: CancelToken, scheme: str, host: str, port: int | None
    ) -> list[tuple[str, str]]:
        """The headers to set on a request to this upstream (none for another host)."""
        if not self.forwards_to(scheme, host, port):
            return []
        headers = []
        if self.request_id_header is not None and token.request_id is not None:
            headers.append((self.request_id_header, token.request_id))
        remaining = token.remaining()
        if self.timeout_header is not None and remaining is not None:
            headers.append((self.timeout_header, f"{int(remaining * 1000)}ms"))
        return headers

    def apply(
        self,
        headers: MutableMapping[str, str],
        earlier: Iterable[tuple[str, str]],
        token: CancelToken,
        scheme: str,
        host: str,
        port: int | None,
    ) -> tuple[tuple[str, str], ...]:
        """Set the headers on one hop of a call, after taking back those `earlier` hops set
        (copied onto a redirect): a value the app set itself, not ours, is left. Returns what
        this hop was given, for the next."""
        for name, value in earlier:
            if headers.get(name) == value:
                del headers[name]
        forwarded = tuple(self.headers(token, scheme, host, port))
        for name, value in forwarded:
            headers[name] = value
        return forwarded


def _host_and_port(entry: object) -> tuple[str, int | None]:
    """`"backend"`, `"backend:8000"`, `"10.0.0.5"`, `"[::1]:8000"`: (host, port or None)."""
    if not isinstance(entry, str) or not entry or "/" in entry or "@" in entry:
        raise ValueError(
            f"forward_to must hold host names ('backend' or 'backend:8000'), got {entry!r}"
        )
    try:
        parts = urlsplit(f"//{entry}")
        port = parts.port
    except ValueError:
        raise ValueError(f"forward_to: {entry!r} is not a host or host:port") from None
    if not parts.hostname:
        raise ValueError(f"forward_to: {entry!r} is not a host or host:port")
    return parts.hostname.lower(), port
