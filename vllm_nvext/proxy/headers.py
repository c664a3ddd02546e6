"""The proxy's wire-level headers: what crosses the hop, and the bytes it is written in.

Hop-by-hop headers dropped both ways (`request_headers`, `response_headers`), the proxy's
X-Forwarded-For / -Proto as a reverse proxy writes them (`forwarded`, kept from a trusted peer only:
`--forwarded-allow-ips`), and aiohttp's header serializer patched so header bytes that are not UTF-8
reach the upstream as the client sent them (`_text`, `_serialize_headers`).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Sequence
from typing import Any

from aiohttp import http_writer

# Connection-specific headers (RFC 9110 §7.6.1, and the ones HTTP/1.1 proxies have always dropped):
# never forwarded in either direction. `host` is the upstream's, set by the client library.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                        b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade"})  # fmt: skip


def request_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's headers less hop-by-hop ones, those its `Connection` names, `host` and `expect`.

    The proxy's own server has answered `Expect: 100-continue` already; the upstream gets the body.
    """
    drop = _connection_named(headers) | {b"host", b"expect"}
    return [(n, v) for n, v in headers if n not in HOP_BY_HOP and n not in drop]


def response_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The upstream's headers less hop-by-hop ones (the proxy's server frames the body itself)."""
    lowered = [(n.lower(), v) for n, v in headers]
    drop = _connection_named(lowered)
    return [(n, v) for n, v in lowered if n not in HOP_BY_HOP and n not in drop]


def _text(raw: bytes) -> str:
    """Header bytes as a str aiohttp writes back to the same bytes (`_serialize_headers` below)."""
    return raw.decode("utf-8", "surrogateescape")


_aiohttp_serialize_headers = http_writer._serialize_headers


def _serialize_headers(status_line: str, headers: Any) -> bytes:
    """aiohttp's header serializer, which writes a str as UTF-8; a header that came as bytes that are
    not UTF-8 (`_text`'s surrogates, which aiohttp would drop) is written back as those bytes."""
    if all(k.isascii() and v.isascii() for k, v in headers.items()):
        return bytes(_aiohttp_serialize_headers(status_line, headers))
    safe = http_writer._safe_header  # aiohttp's refusal of CR, LF and other controls
    lines = [safe(status_line), *(f"{safe(k)}: {safe(v)}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


http_writer._serialize_headers = _serialize_headers  # what `StreamWriter.write_headers` calls


def _connection_named(headers: Sequence[tuple[bytes, bytes]]) -> set[bytes]:
    return {t.strip().lower() for n, v in headers if n == b"connection" for t in v.split(b",")}


# --- X-Forwarded-* ------------------------------------------------------------------------------------
# What a client says about the hops before the proxy: kept only from a trusted peer (`--forwarded-allow-ips`).
FORWARDED = frozenset({b"forwarded", b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"x-forwarded-port",
                       b"x-forwarded-prefix", b"x-real-ip"})  # fmt: skip
Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def trusted_networks(allowed: Sequence[str]) -> Networks | None:
    """`--forwarded-allow-ips` as networks (uvicorn's syntax: addresses, networks, `*`); None: `*`, every peer."""
    if "*" in allowed:
        return None
    try:
        return tuple(ipaddress.ip_network(a, strict=False) for a in allowed)
    except ValueError:
        raise ValueError(
            f"forwarded-allow-ips: expected IP addresses or networks, or *, got {','.join(allowed)!r}"
        ) from None


def is_trusted(peer: str | None, networks: Networks | None) -> bool:
    """Whether the peer's X-Forwarded-* headers are kept; a peer that is no IP address (a unix socket) is not."""
    if peer is None:
        return False
    if networks is None:
        return True
    if not networks:
        return False  # nobody trusted (the default): no address to parse on each request's path
    return _in_networks(peer, networks)


@functools.lru_cache(maxsize=1024)
def _in_networks(peer: str, networks: Networks) -> bool:
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(address in network for network in networks)


def forwarded(
    headers: list[tuple[bytes, bytes]], peer: str | None, scheme: str, *, trusted: bool
) -> list[tuple[bytes, bytes]]:
    """The headers with the proxy's X-Forwarded-For / -Proto, as a reverse proxy writes them (nginx's
    `$proxy_add_x_forwarded_for`): a trusted peer's chain gets the peer appended; an untrusted peer's
    X-Forwarded-* and Forwarded headers are dropped and the peer alone is written."""
    if not trusted:
        headers = [(n, v) for n, v in headers if n not in FORWARDED]
    chain = b", ".join(v for n, v in headers if n == b"x-forwarded-for")
    out = [(n, v) for n, v in headers if n != b"x-forwarded-for"]
    if peer is not None:
        address = peer.encode("latin-1")
        out.append((b"x-forwarded-for", chain + b", " + address if chain else address))
    elif chain:
        out.append((b"x-forwarded-for", chain))
    if not any(n == b"x-forwarded-proto" for n, _ in out):
        out.append((b"x-forwarded-proto", scheme.encode("latin-1")))
    return out
