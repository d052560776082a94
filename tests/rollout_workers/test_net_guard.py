"""HTTP targets chosen by tenants (net_guard and the http environment): the SSRF table, URL-path injection,
DNS pinning, redirects and error bodies. Servers are real ones on 127.0.0.1 (allow-listed, as an operator
running a local tool server would); resolvers are fakes only where a DNS answer must be controlled."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_workers.environments import (
    EnvironmentRegistration,
    http_env,
    make_env_factory,
    validate_registration,
)
from rollout_workers.environments.base import ToolError
from rollout_workers.environments.http_env import post_json
from rollout_workers.environments.policy import EnvironmentPolicy
from rollout_workers.net_guard import (
    AllowList,
    PinnedTransport,
    TargetRefused,
    check_base_url,
    endpoint_url,
    resolve_target,
    system_resolver,
)

TOOLS = [{"name": "echo", "description": "echo", "parameters": {"type": "object"}}]
LOOPBACK_NAME = "loopback.test"  # a name whose (fake) DNS answer is 127.0.0.1


def fake_dns(answers: dict[str, list[str]]) -> Any:
    calls: list[str] = []

    def resolve(host: str, port: int) -> list[Any]:
        calls.append(host)
        if host in answers:
            return [ipaddress.ip_address(a) for a in answers[host]]
        return system_resolver(host, port)

    resolve.calls = calls  # type: ignore[attr-defined]
    return resolve


# (host as written in a URL, the reason the default rule gives, an allow-list entry that admits it)
SSRF_TARGETS = [
    ("127.0.0.1", "loopback", "127.0.0.1"),
    ("localhost", "loopback", "localhost"),
    ("10.0.0.1", "private", "10.0.0.0/8"),
    ("172.16.0.1", "private", "172.16.0.0/12"),
    ("192.168.1.1", "private", "192.168.0.0/16"),
    ("169.254.169.254", "link-local", "169.254.169.254"),
    ("[::1]", "loopback", "::1"),
    ("[::ffff:127.0.0.1]", "IPv4-mapped", "127.0.0.1"),
    ("[::ffff:169.254.169.254]", "IPv4-mapped", "::ffff:169.254.169.254/128"),
    ("0.0.0.0", "unspecified", "0.0.0.0/32"),
    ("[::]", "unspecified", "::/128"),
    ("2130706433", "numeric-encoded", "127.0.0.1"),
    ("0x7f000001", "numeric-encoded", "127.0.0.0/8"),
    ("0x7f.1", "numeric-encoded", "127.0.0.1"),
    ("0177.0.0.1", "numeric-encoded", "127.0.0.1"),
    ("127.1", "numeric-encoded", "127.0.0.0/8"),
    ("224.0.0.1", "multicast", "224.0.0.0/4"),
    ("240.0.0.1", "private", "240.0.0.0/4"),  # reserved (Python lists 240/4 among the private ranges)
    ("100.64.0.1", "not a globally routable", "100.64.0.0/10"),  # carrier-grade NAT
    ("[fe80::1]", "link-local", "fe80::/10"),
    ("[fd00::1]", "private", "fd00::/8"),
    ("[2002:7f00:1::]", "6to4", "2002::/16"),  # 6to4 around 127.0.0.1
    ("[64:ff9b::a9fe:a9fe]", "NAT64", "64:ff9b::/96"),  # NAT64 around 169.254.169.254
    (LOOPBACK_NAME, "resolves to 127.0.0.1", "127.0.0.1"),
    (LOOPBACK_NAME, "resolves to 127.0.0.1", LOOPBACK_NAME),
]


@pytest.mark.parametrize(("host", "reason", "admit"), SSRF_TARGETS)
def test_internal_targets_are_refused_unless_the_allow_list_admits_them(host: str, reason: str, admit: str) -> None:
    resolver = fake_dns({LOOPBACK_NAME: ["127.0.0.1"]})
    with pytest.raises(TargetRefused) as err:
        resolve_target(host, 80, AllowList.parse([]), resolver)
    assert reason in str(err.value), str(err.value)
    # unrelated allow entries admit nothing else
    with pytest.raises(TargetRefused):
        resolve_target(host, 80, AllowList.parse(["192.0.2.0/24", "tools.example"]), resolver)
    addresses = resolve_target(host, 80, AllowList.parse([admit]), resolver)
    assert addresses and all(isinstance(a, ipaddress.IPv4Address | ipaddress.IPv6Address) for a in addresses)


@pytest.mark.parametrize("host", ["93.184.216.34", "[2606:4700:4700::1111]", "8.8.8.8"])
def test_public_addresses_pass_by_default(host: str) -> None:
    assert resolve_target(host, 443, AllowList()) == [ipaddress.ip_address(host.strip("[]"))]


def test_a_name_must_resolve_only_to_allowed_addresses() -> None:
    resolver = fake_dns({"mixed.test": ["93.184.216.34", "10.1.2.3"], "public.test": ["93.184.216.34"]})
    with pytest.raises(TargetRefused, match="resolves to 10.1.2.3, a private address"):
        resolve_target("mixed.test", 80, AllowList(), resolver)
    assert resolve_target("public.test", 80, AllowList(), resolver) == [ipaddress.ip_address("93.184.216.34")]
    with pytest.raises(TargetRefused, match="does not resolve"):
        resolve_target("no-such-host.invalid", 80, AllowList())


@pytest.mark.parametrize("bad", ["not a cidr!", "10.0.0.0/33", "http://x"])
def test_a_bad_allow_list_entry_is_an_error(bad: str) -> None:
    with pytest.raises(ValueError, match="neither a CIDR"):
        AllowList.parse([bad])


def test_registration_checks_the_target_and_names_base_url() -> None:
    reg = {"kind": "http", "name": "meta", "base_url": "http://169.254.169.254/latest", "tools": TOOLS}
    with pytest.raises(ValueError, match=r"^base_url: 169\.254\.169\.254 is a link-local address"):
        validate_registration(reg)
    with pytest.raises(ValueError, match=r"^base_url: .*numeric-encoded"):
        validate_registration({**reg, "base_url": "http://2130706433:8265/"})
    assert validate_registration(reg, EnvironmentPolicy(http_allow=("169.254.0.0/16",))).base_url == reg["base_url"]
    assert validate_registration({**reg, "base_url": "https://93.184.216.34/api/"}).name == "meta"


# ---------------------------------------------------------------- URL paths


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://tools.example/api?", "query"),
        ("http://tools.example/api?x=1", "query"),
        ("http://tools.example/api#", "fragment"),
        ("http://tools.example/a/../admin", "dot segments"),
        ("http://tools.example/./api", "dot segments"),
        ("http://tools.example//api", "not allowed"),
        ("http://tools.example/%2e%2e/admin", "percent-encoding"),
        ("http://tools.example/api%3Fx", "percent-encoding"),
        ("http://tools.example/api%23", "percent-encoding"),
        ("http://user:pw@tools.example/", "user info"),
        ("http://tools.example\\@evil.example/", "backslash"),
        ("http://tools.example /api", "whitespace"),
        ("http://tools.example:99999/", "port"),
        ("ftp://tools.example/", "http(s)"),
        ("http:///api", "http(s)"),
        ("http://t\u00f6ols.example/", "host name"),
    ],
)
def test_base_urls_that_could_change_the_path_are_refused(url: str, words: str) -> None:
    with pytest.raises(TargetRefused, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_base_url(url)
    with pytest.raises(ValueError) as err:  # the same rule when the registration is parsed: a 422 on base_url
        EnvironmentRegistration(kind="http", name="x", base_url=url, tools=TOOLS)
    assert "base_url" in str(err.value)


def test_endpoint_urls_only_extend_the_base_path() -> None:
    assert str(endpoint_url("http://tools.example:8080/api/v1/", "call")) == "http://tools.example:8080/api/v1/call"
    assert str(endpoint_url("https://tools.example", "reset")) == "https://tools.example/reset"
    sneaky = endpoint_url("http://tools.example/api", "a/../b?c#d")
    assert sneaky.raw_path == b"/api/a%2F..%2Fb%3Fc%23d"
    assert sneaky.query == b"" and sneaky.fragment == "" and sneaky.host == "tools.example"


# ---------------------------------------------------------------- a real tool server on 127.0.0.1


class Recorder:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []


@pytest.fixture
def server() -> Iterator[tuple[int, Recorder]]:
    rec = Recorder()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802 - http.server naming
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            rec.requests.append({"path": self.path, "host": self.headers["Host"]})
            if self.path == "/redirect/call":
                self._send(302, b"", {"Location": "/landed/call"})
            elif self.path == "/secret/call":
                self._send(400, b"SECRET-TOKEN-4711 internal stack trace")
            elif self.path == "/crash/call":
                self._send(500, b"SECRET-TOKEN-4711 internal stack trace")
            elif self.path == "/big/call":
                self._send(200, json.dumps({"result": "x" * 5000}).encode())
            elif self.path == "/notjson/call":
                self._send(200, b"SECRET-TOKEN-4711 <html>")
            else:
                self._send(200, json.dumps({"result": "ok", "path": self.path}).encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], rec
    finally:
        httpd.shutdown()
        httpd.server_close()


LOCAL = EnvironmentPolicy(http_allow=("127.0.0.1",))


def local_registration(port: int, path: str = "", **fields: Any) -> EnvironmentRegistration:
    reg = EnvironmentRegistration(kind="http", name="local", base_url=f"http://127.0.0.1:{port}{path}",
                                  tools=TOOLS, retries=1, backoff_s=0.0, **fields)
    return validate_registration(reg, LOCAL)


def test_a_local_tool_server_needs_the_allow_list(server: tuple[int, Recorder]) -> None:
    port, rec = server
    reg = {"kind": "http", "name": "local", "base_url": f"http://127.0.0.1:{port}", "tools": TOOLS}
    with pytest.raises(ValueError, match="^base_url: 127.0.0.1 is a loopback address"):
        validate_registration(reg)
    ok = validate_registration(reg, LOCAL)
    assert post_json(ok, "call", {}, LOCAL.allow_list)["result"] == "ok"
    # checked again at connect time: the same registration under a policy without the entry reaches nothing
    env = make_env_factory(ok)()
    with pytest.raises(RuntimeError, match="target refused: 127.0.0.1 is a loopback address"):
        asyncio.run(env.call("echo", {}))
    assert len(rec.requests) == 1


def test_redirects_are_not_followed(server: tuple[int, Recorder]) -> None:
    port, rec = server
    reg = local_registration(port, "/redirect")
    with pytest.raises(RuntimeError, match="HTTP 302 .redirects are not followed"):
        post_json(reg, "call", {}, LOCAL.allow_list)
    assert [r["path"] for r in rec.requests] == ["/redirect/call"]  # never /landed/call


@pytest.mark.parametrize("path", ["/secret", "/crash", "/notjson"])
def test_error_bodies_from_the_target_are_not_echoed(server: tuple[int, Recorder], path: str) -> None:
    port, _ = server
    env = make_env_factory(local_registration(port, path), policy=LOCAL)()
    with pytest.raises(Exception) as err:
        asyncio.run(env.call("echo", {}))
    assert not isinstance(err.value, ToolError)  # an environment failure, not text shown to the model
    message = str(err.value)
    assert "SECRET" not in message and "stack trace" not in message, message
    expected = {"/secret": "HTTP 400", "/crash": "HTTP 500", "/notjson": "not JSON"}[path]
    assert expected in message, message


def test_answers_are_capped_in_size(server: tuple[int, Recorder], monkeypatch: pytest.MonkeyPatch) -> None:
    port, _ = server
    reg = local_registration(port, "/big")
    assert len(post_json(reg, "call", {}, LOCAL.allow_list)["result"]) == 5000
    monkeypatch.setattr(http_env, "MAX_RESPONSE_BYTES", 1000)
    with pytest.raises(RuntimeError, match="answer larger than 1000 bytes"):
        post_json(reg, "call", {}, LOCAL.allow_list)


# ---------------------------------------------------------------- DNS pinning


def test_the_transport_connects_to_the_checked_address_and_keeps_the_host_name(
    server: tuple[int, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, rec = server
    # a proxy in the environment would bypass the check: it must be ignored
    monkeypatch.setenv("HTTP_PROXY", "http://192.0.2.1:3128")
    monkeypatch.setenv("ALL_PROXY", "http://192.0.2.1:3128")
    resolver = fake_dns({"tools.test": ["127.0.0.1"]})
    transport = PinnedTransport(AllowList.parse(["127.0.0.1"]), resolver=resolver)
    with httpx.Client(transport=transport, trust_env=False) as client:
        r = client.post(f"http://tools.test:{port}/pinned", json={})
    assert r.status_code == 200 and r.json()["path"] == "/pinned"
    # the system cannot resolve tools.test: the connection went to the address this resolution checked,
    # and the request still names the host
    assert resolver.calls == ["tools.test"]
    assert rec.requests[-1] == {"path": "/pinned", "host": f"tools.test:{port}"}


def test_a_rebinding_answer_is_refused_on_the_next_connection(server: tuple[int, Recorder]) -> None:
    port, rec = server
    answers = iter([["93.184.216.34"], ["127.0.0.1"]])
    calls: list[str] = []

    def rebinding(host: str, _port: int) -> list[Any]:
        calls.append(host)
        return [ipaddress.ip_address(a) for a in next(answers)]

    # registration-time check: the first answer is public
    assert resolve_target("rebind.test", port, AllowList(), rebinding) == [ipaddress.ip_address("93.184.216.34")]
    # connect time: the name now points at loopback; the transport checks that answer and refuses
    transport = PinnedTransport(AllowList(), resolver=rebinding)
    with httpx.Client(transport=transport, trust_env=False) as client, pytest.raises(
        TargetRefused, match="resolves to 127.0.0.1, a loopback address"
    ):
        client.post(f"http://rebind.test:{port}/call", json={})
    assert calls == ["rebind.test", "rebind.test"] and rec.requests == []


def test_the_next_checked_address_is_tried_when_one_does_not_connect(server: tuple[int, Recorder]) -> None:
    port, rec = server
    resolver = fake_dns({"two.test": ["127.0.0.2", "127.0.0.1"]})  # nothing listens on 127.0.0.2:port
    transport = PinnedTransport(AllowList.parse(["127.0.0.0/8"]), resolver=resolver)
    with httpx.Client(transport=transport, trust_env=False) as client:
        assert client.post(f"http://two.test:{port}/second", json={}).status_code == 200
    assert rec.requests[-1]["path"] == "/second"


def self_signed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A certificate for `name` (its own CA) and its key, as PEM files."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_tls_to_a_pinned_address_still_verifies_the_host_name(tmp_path: Path) -> None:
    cert_file, key_file = self_signed(tmp_path, "tools.test")
    hosts: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server naming
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            hosts.append(self.headers["Host"])
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert_file, key_file)
    httpd.socket = server_ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    try:
        trust = ssl.create_default_context(cafile=str(cert_file))
        resolver = fake_dns({"tools.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
        transport = PinnedTransport(AllowList.parse(["127.0.0.1"]), resolver=resolver, verify=trust)
        with httpx.Client(transport=transport, trust_env=False) as client:
            assert client.post(f"https://tools.test:{port}/call", json={}).status_code == 200
            # the same address under another name: the certificate does not match, so no request is made
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED|match"):
                client.post(f"https://other.test:{port}/call", json={})
        assert hosts == [f"tools.test:{port}"]
    finally:
        httpd.shutdown()
        httpd.server_close()
