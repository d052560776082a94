"""Outbound HTTP to targets a tenant chose: check the URL, resolve the host once, refuse internal addresses,
connect to the checked address.

The rule (docs/design.md section 10): a target may not be loopback, private, link-local (cloud metadata at
169.254.169.254), multicast, unspecified, reserved or otherwise not globally routable, nor an IPv6 form
that embeds an IPv4 address (IPv4-mapped, 6to4, NAT64), nor an IPv4 address written in a numeric
encoding other than dotted decimal (`2130706433`, `0x7f.1`, `0177.0.0.1`, `127.1`), unless the operator's
allow-list (CIDRs or host names) admits it. Every address a name resolves to must pass; the connection
then goes to a checked address (`PinnedTransport`), so a second DNS answer cannot send it elsewhere.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import SplitResult, urlsplit

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[IPAddress]]

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST_NAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
_DOTTED_QUAD = re.compile(r"^(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?:\.(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}$")
# a path of plain segments: no percent-encoding, no '?', '#', '\\', whitespace or dot segments
_PATH_SEGMENT = re.compile(r"^[A-Za-z0-9_~!$&'()*+,;=:@.-]+$")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
MAX_URL_LENGTH = 2048


class TargetRefused(ValueError):
    """The target is not allowed (or not well-formed); the message says why."""


@dataclass(frozen=True)
class AllowList:
    """Operator-admitted targets: networks (CIDR or single addresses) and exact host names."""

    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        """Entries like '127.0.0.1', '10.0.0.0/8', '::1', 'tools.internal'; raises ValueError for a bad one."""
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        for raw in entries:
            entry = raw.strip().lower()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            name = entry.rstrip(".")
            if not _HOST_NAME.match(name):
                raise ValueError(f"{raw!r} is neither a CIDR, an IP address nor a host name")
            hosts.add(name)
        return cls(tuple(networks), frozenset(hosts))

    def admits_address(self, ip: IPAddress) -> bool:
        candidates = [ip]
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            candidates.append(ip.ipv4_mapped)
        return any(c.version == n.version and c in n for c in candidates for n in self.networks)

    def admits_host(self, host: str) -> bool:
        return host in self.hosts


def system_resolver(host: str, port: int) -> list[IPAddress]:
    """Every address the system resolver gives for `host`, in its order, without duplicates."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[IPAddress] = []
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if ip not in out:
            out.append(ip)
    return out


def forbidden_reason(ip: IPAddress) -> str | None:
    """Why a connection to `ip` is refused by default (None: a public address)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return "an IPv4-mapped IPv6 address"
        if ip.sixtofour is not None or ip in _NAT64:
            return "an IPv6 address that embeds an IPv4 address (6to4 or NAT64)"
        if ip.is_site_local:
            return "a site-local address"
    checks = (
        ("is_unspecified", "an unspecified address"),
        ("is_loopback", "a loopback address"),
        ("is_link_local", "a link-local address"),
        ("is_multicast", "a multicast address"),
        ("is_private", "a private address"),
        ("is_reserved", "a reserved address"),
    )
    for attribute, reason in checks:
        if getattr(ip, attribute):
            return reason
    if not ip.is_global:
        return "not a globally routable address"
    return None


def literal_address(host: str) -> tuple[IPAddress | None, bool]:
    """(address, numeric_encoded) for an IP literal; (None, False) for a host name. `numeric_encoded` is
    True for IPv4 written other than as dotted decimal (what C's inet_aton accepts: 127.1, 0x7f.1, ...)."""
    if ":" in host:
        return ipaddress.IPv6Address(host), False
    if _DOTTED_QUAD.match(host):
        return ipaddress.IPv4Address(host), False
    if re.fullmatch(r"[0-9a-fx.]+", host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host)), True
        except OSError:
            pass
    return None, False


def _normal_host(host: str) -> str:
    host = host.strip().lower().removeprefix("[").removesuffix("]")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)  # no zone ids ("fe80::1%eth0") either
        except ValueError:
            raise TargetRefused(f"{host!r} is not a valid IPv6 address") from None
        return host
    host = host.rstrip(".")
    if not _HOST_NAME.match(host):
        raise TargetRefused(f"{host!r} is not a valid host name (ASCII letters, digits, '-' and '.'; IDNA as punycode)")
    return host


def resolve_target(host: str, port: int, allow: AllowList, resolver: Resolver = system_resolver) -> list[IPAddress]:
    """The addresses to connect to for `host`, each checked; raises TargetRefused naming the reason."""
    host = _normal_host(host)
    ip, encoded = literal_address(host)
    if ip is not None:
        if allow.admits_address(ip) or allow.admits_host(host):
            return [ip]
        if encoded:
            raise TargetRefused(f"{host!r} is a numeric-encoded IP address ({ip}); write addresses as dotted decimal")
        reason = forbidden_reason(ip)
        if reason:
            raise TargetRefused(f"{host} is {reason}; the operator's HTTP allow-list does not admit it")
        return [ip]
    try:
        addresses = resolver(host, port)
    except (OSError, UnicodeError) as exc:
        raise TargetRefused(f"{host!r} does not resolve ({exc.__class__.__name__})") from None
    if not addresses:
        raise TargetRefused(f"{host!r} does not resolve")
    if allow.admits_host(host):
        return addresses
    for address in addresses:
        reason = None if allow.admits_address(address) else forbidden_reason(address)
        if reason:
            raise TargetRefused(f"{host} resolves to {address}, {reason}; the operator's HTTP allow-list does not admit it")
    return addresses


def check_base_url(url: str) -> SplitResult:
    """Syntax rules for a tool server's base URL: http(s), a host, an optional port and a plain path; no
    user info, query, fragment, percent-encoding, backslashes or dot segments, so that appending an
    endpoint can only ever extend the path. Raises TargetRefused."""
    if len(url) > MAX_URL_LENGTH:
        raise TargetRefused(f"longer than {MAX_URL_LENGTH} characters")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise TargetRefused("must not contain whitespace or control characters")
    for char, what in (("?", "a query"), ("#", "a fragment"), ("\\", "a backslash"), ("%", "percent-encoding")):
        if char in url:
            raise TargetRefused(f"must not contain {what} ({char!r})")
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise TargetRefused(f"must be an http(s) URL with a host, got {url!r}")
    if "@" in parts.netloc:
        raise TargetRefused("must not contain user info ('user:password@')")
    try:
        port = parts.port
    except ValueError:
        raise TargetRefused("has an invalid port") from None
    if port == 0:
        raise TargetRefused("has an invalid port")
    _normal_host(parts.hostname or "")
    segments = parts.path.split("/")[1:]
    for i, segment in enumerate(segments):
        if segment == "" and i == len(segments) - 1:
            continue  # one trailing slash
        if segment in ("", ".", "..") or not _PATH_SEGMENT.match(segment):
            raise TargetRefused(f"path segment {segment!r} is not allowed (plain names only, no dot segments)")
    return parts


def endpoint_url(base_url: str, endpoint: str) -> httpx.URL:
    """`base_url` (checked by check_base_url) plus one path segment, quoted."""
    from urllib.parse import quote

    base = httpx.URL(base_url)
    return base.copy_with(path=base.path.rstrip("/") + "/" + quote(endpoint, safe=""))


def request_targets(url: httpx.URL, allow: AllowList, resolver: Resolver = system_resolver
                    ) -> tuple[str, list[IPAddress], bool]:
    """(host, checked addresses, host is a name) for a request URL (httpx's, or any with the same
    `raw_host`, `port` and `scheme`): what a pinned transport connects to, keeping a name for TLS."""
    host = url.raw_host.decode("ascii")  # IDNA-encoded, as it goes on the wire
    port = url.port or (443 if url.scheme == "https" else 80)
    addresses = resolve_target(host, port, allow, resolver)
    return host, addresses, literal_address(_normal_host(host))[0] is None


class PinnedTransport(httpx.HTTPTransport):
    """An HTTP transport that resolves and checks each request's host, then connects to a checked address
    (the next one only when connecting fails). The Host header and TLS SNI/certificate check keep the name.
    Proxies from the environment are never used (they would bypass the check)."""

    def __init__(self, allow: AllowList, resolver: Resolver = system_resolver, **kwargs: object) -> None:
        super().__init__(trust_env=False, **kwargs)  # type: ignore[arg-type]
        self.allow = allow
        self.resolver = resolver

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        host, addresses, named = request_targets(url, self.allow, self.resolver)
        last_error: httpx.ConnectError | None = None
        for ip in addresses:
            request.url = url.copy_with(host=str(ip))
            if named and url.scheme == "https":
                request.extensions = {**request.extensions, "sni_hostname": host}
            try:
                return super().handle_request(request)
            except httpx.ConnectError as exc:
                last_error = exc
            finally:
                request.url = url
        assert last_error is not None
        raise last_error
