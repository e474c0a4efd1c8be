"""Protected origins through the corporate proxy (`upstream_proxy`, tinyproxy with Basic authentication) on the
proxy's own client: a CONNECT tunnel with the proxy's credentials, then TLS to the origin over it (ALPN as
direct: HTTP/1.1 or HTTP/2 as the origin chooses), the token attached inside; the tunnel kept for the next
request; the proxy's refusals answered as the front door answers them; and the same rule for a request the
origin may have processed (never sent twice).

The origins are named `localhost` (tinyproxy resolves the names it is asked to CONNECT to); the provider, on
127.0.0.1, is reached directly (`no_upstream_proxy`).
"""

from __future__ import annotations

import functools
import shutil
import uuid
from pathlib import Path

import pytest

from fixtures import config
from fixtures.deployment import Deployment, Workspace
from fixtures.h2_origin import H2Origin
from fixtures.http import Reader, free_port, open_tunnel
from fixtures.origins import Tinyproxy
from fixtures.proxy import poll
from idp_fake import FakeIdP
from resource_server import ResourceServer

pytestmark = pytest.mark.skipif(shutil.which("tinyproxy") is None, reason="tinyproxy is not installed")

HOST = "localhost"
SCOPES = "openid profile email"


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("upstream-protected")


@pytest.fixture(scope="module")
def fake():
    with FakeIdP(access_token_format="jwt") as idp:
        yield idp


@pytest.fixture(scope="module")
def rs(module_dir, fake):
    server = ResourceServer(module_dir / "rs", [HOST])
    server.trust(fake.issuer, fake.url("jwks"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def h2(module_dir):
    server = H2Origin(module_dir / "h2", HOST)
    yield server
    server.close()


@pytest.fixture(scope="module")
def tiny(module_dir, rs, h2):
    proxy = Tinyproxy(module_dir / "tinyproxy", [rs.port, h2.port]).start()
    yield proxy
    proxy.stop()


def sections(fake, rs, h2) -> str:
    return (config.provider("fake", fake.issuer, scopes=SCOPES, redirect_port=0)
            + config.origin(f"https://{HOST}:{rs.port}", "fake", ca_file=rs.ca_pem)
            + config.origin(f"https://{HOST}:{h2.port}", "fake", ca_file=h2.ca_pem))


@pytest.fixture(scope="module")
def deployment(module_dir, fake, rs, h2, tiny):
    ws = Workspace(module_dir / "main", sections(fake, rs, h2), "", upstream_proxy=tiny.url(),
                   no_upstream_proxy="127.0.0.1")
    ws.ca_init()
    ws.login_fake("fake")
    deployment = Deployment(ws, ws.start_proxy())
    yield deployment
    failure = deployment.stop()
    assert failure is None, failure


def tunnelled(deployment: Deployment, authority: str):
    sock, _, response = open_tunnel(deployment.proxy.port, authority)
    assert response.status == 200, response.head
    import ssl
    context = ssl.create_default_context(cafile=str(deployment.ws.state / "ca" / "ca.pem"))
    context.set_alpn_protocols(["http/1.1"])
    tls = context.wrap_socket(sock, server_hostname=HOST)
    return tls, Reader(tls)


def exchange(tls, reader, authority: str, method: str, path: str, body: bytes | None = None):
    length = f"Content-Length: {len(body)}\r\n" if body is not None else ""
    tls.sendall(f"{method} {path} HTTP/1.1\r\nHost: {authority}\r\n{length}\r\n".encode() + (body or b""))
    return reader.read_response(method)


def test_requests_to_a_protected_origin_go_through_one_tunnel_with_the_token(deployment, rs, tiny):
    """A GET and a POST with a body: both through the corporate proxy's CONNECT (with its credentials), on one
    kept tunnel, each with the token; nothing reaches the origin but through the proxy."""
    tag = uuid.uuid4().hex[:8]
    log_start = len(tiny.log())
    mark = rs.mark()
    tls, reader = tunnelled(deployment, rs.authority(HOST))
    with tls:
        get = exchange(tls, reader, rs.authority(HOST), "GET", f"/via/{tag}")
        post = exchange(tls, reader, rs.authority(HOST), "POST", f"/order/{tag}", b"one order")
    assert get.status == 200 and post.status == 200, (get, post)
    seen = rs.since(mark)
    assert [s.path for s in seen] == [f"/via/{tag}", f"/order/{tag}"]
    assert seen[0].connection == seen[1].connection, "the second request opened another tunnel"
    assert all(s.token == deployment.ws.tokens("fake")["access_token"] for s in seen)
    assert seen[1].body_size == len(b"one order")
    poll(lambda: f"CONNECT {HOST}:{rs.port}" in tiny.log()[log_start:], 10, message="tinyproxy to log the CONNECT")
    assert tiny.log()[log_start:].count(f"CONNECT {HOST}:{rs.port}") == 1, tiny.log()[log_start:]


def test_an_http2_origin_behind_the_proxy_gets_http2_inside_the_tunnel(deployment, h2, tiny):
    tag = uuid.uuid4().hex[:8]
    mark = h2.mark()
    tls, reader = tunnelled(deployment, h2.authority)
    with tls:
        answer = exchange(tls, reader, h2.authority, "PUT", f"/file/{tag}", b"x" * 1000)
    if answer.status != 200:
        print("h2 origin connections:", h2.endings, "failures:", h2.failures)
        print("tinyproxy:", *tiny.log().splitlines()[-20:], sep="\n  ")
    assert answer.status == 200, (answer, h2.endings)
    seen = h2.since(mark)
    assert [(s.method, s.path, s.body_size) for s in seen] == [("PUT", f"/file/{tag}", 1000)]
    assert seen[0].header("authorization") == "Bearer " + deployment.ws.tokens("fake")["access_token"]


def test_a_post_on_a_tunnel_the_origin_dropped_is_not_sent_again(deployment, rs):
    tag = uuid.uuid4().hex[:8]
    mark = rs.mark()
    tls, reader = tunnelled(deployment, rs.authority(HOST))
    with tls:
        warm = exchange(tls, reader, rs.authority(HOST), "POST", f"/warm/{tag}", b"warm")
        dropped = exchange(tls, reader, rs.authority(HOST), "POST", f"/hangup/{tag}", b"order")
    assert warm.status == 200 and dropped.status == 502, dropped
    assert [s.path for s in rs.since(mark)] == [f"/warm/{tag}", f"/hangup/{tag}"]


# tinyproxy 1.11 answers a wrong password with 401 and a missing one with 407; each is answered as the front door
# answers it for a client's own tunnel (test_upstream.py).
@pytest.mark.parametrize("credentials, needle", [
    (("chain-user", "wrong"), 'error=connection_refused; next-hop="127.0.0.1:{port}"; received-status=401; '
                              'details="upstream proxy: answered 401 to CONNECT"'),
    ((None, None), 'error=proxy_configuration_error; next-hop="127.0.0.1:{port}"; received-status=407; '
                   'details="the upstream proxy requires credentials (407); add user:password to upstream_proxy"'),
])
def test_the_upstream_proxys_refusal_is_named_with_the_fix(module_dir, fake, rs, h2, tiny, credentials, needle):
    user, password = credentials
    ws = Workspace(module_dir / f"refused-{user}", sections(fake, rs, h2), "",
                   upstream_proxy=tiny.url(user=user, password=password), no_upstream_proxy="127.0.0.1")
    ws.ca_init()
    ws.login_fake("fake")
    deployment = Deployment(ws, ws.start_proxy())
    try:
        mark = rs.mark()
        answer = deployment.curl(rs.url("/refused", host=HOST))
        assert answer.status == 502, answer
        assert answer.header("proxy-status") == "proxyctl; " + needle.format(port=tiny.port), answer
        assert rs.since(mark) == []
        assert "wrong" not in deployment.proxy.log()
    finally:
        assert deployment.stop() is None


def test_an_upstream_proxy_nobody_listens_at_is_named(module_dir, fake, rs, h2):
    ws = Workspace(module_dir / "nobody", sections(fake, rs, h2), "",
                   upstream_proxy=f"http://127.0.0.1:{free_port()}", no_upstream_proxy="127.0.0.1")
    ws.ca_init()
    ws.login_fake("fake")
    deployment = Deployment(ws, ws.start_proxy())
    try:
        answer = deployment.curl(rs.url("/nobody", host=HOST))
        assert answer.status == 502, answer
        status = answer.header("proxy-status") or ""
        assert "error=proxy_configuration_error" in status and "the upstream proxy 127.0.0.1:" in status, status
    finally:
        assert deployment.stop() is None
