"""Chaining through an upstream proxy (tinyproxy with Basic authentication), and no_upstream_proxy."""

from __future__ import annotations

import hashlib
import uuid

from fixtures.content import MiB, expected_sha256
from fixtures.http import Reader, Response, open_tunnel
from fixtures.origins import Tinyproxy
from fixtures.proxy import poll


def token() -> str:
    return uuid.uuid4().hex[:12]


class TinyLog:
    """The part of tinyproxy's log written after creation."""

    def __init__(self, tinyproxy: Tinyproxy):
        self.tinyproxy = tinyproxy
        self.start = len(tinyproxy.log())

    def text(self) -> str:
        return self.tinyproxy.log()[self.start:]

    def wait(self, needle: str, timeout: float = 10) -> None:
        poll(lambda: needle in self.text(), timeout, message=f"tinyproxy to log {needle!r}")


def test_tunnel_goes_through_the_upstream_proxy(proxy_factory, tinyproxy, https_origin, cert, curl):
    proxy = proxy_factory(upstream_proxy=tinyproxy.url())
    log = TinyLog(tinyproxy)
    size = 4 * MiB + 7
    result = curl("--fail", "-x", proxy.url, "--cacert", str(cert.ca_pem), "-o", "-",
                  https_origin.url(f"/gen/{size}", host="localhost"))
    assert result.returncode == 0, result.stderr
    assert hashlib.sha256(result.stdout).hexdigest() == expected_sha256(size)
    log.wait(f"CONNECT localhost:{https_origin.port} HTTP/1.1")


def test_tunnel_through_upstream_sees_the_origin_certificate(proxy_factory, tinyproxy, https_origin, cert):
    proxy = proxy_factory(upstream_proxy=tinyproxy.url())
    log = TinyLog(tinyproxy)
    sock, _, answer = open_tunnel(proxy.port, f"localhost:{https_origin.port}")
    assert answer.status == 200
    with cert.client_context().wrap_socket(sock, server_hostname="localhost") as tls:
        assert tls.getpeercert(binary_form=True) == cert.leaf_der
        tls.sendall(f"GET /via HTTP/1.1\r\nHost: localhost:{https_origin.port}\r\n\r\n".encode())
        assert Reader(tls).read_response().body == b"origin GET /via\n"
    log.wait(f"CONNECT localhost:{https_origin.port}")


def test_plain_request_goes_through_the_upstream_proxy(proxy_factory, tinyproxy, echo_origin):
    proxy = proxy_factory(upstream_proxy=tinyproxy.url())
    log = TinyLog(tinyproxy)
    tag = token()
    with proxy.connect() as sock:
        sock.sendall(f"GET {echo_origin.url('/chain/' + tag)} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n"
                     f"X-Client: kept\r\n\r\n".encode())
        response = Reader(sock).read_response()
    assert response.status == 200
    received = echo_origin.wait_request(tag)
    assert b"Via: " in received.head and b"tinyproxy" in received.head, "tinyproxy adds Via to what it forwards"
    assert b"X-Client: kept" in received.head
    log.wait(f"GET http://127.0.0.1:{echo_origin.port}/chain/{tag}")
    # proxyctl's credentials for tinyproxy are for tinyproxy only.
    assert Tinyproxy.PASSWORD not in proxy.log()


def test_no_upstream_proxy_hosts_go_direct(proxy_factory, tinyproxy, echo_origin, https_origin, cert, curl):
    proxy = proxy_factory(upstream_proxy=tinyproxy.url(), no_upstream_proxy="localhost, .example.invalid")
    log = TinyLog(tinyproxy)
    direct, chained = token(), token()
    with proxy.connect() as sock:
        reader = Reader(sock)
        sock.sendall(f"GET {echo_origin.url('/direct/' + direct, host='localhost')} HTTP/1.1\r\n"
                     f"Host: localhost:{echo_origin.port}\r\n\r\n".encode())
        assert reader.read_response().status == 200
        sock.sendall(f"GET {echo_origin.url('/chained/' + chained)} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n"
                     f"\r\n".encode())
        assert reader.read_response().status == 200
    assert b"Via: " not in echo_origin.wait_request(direct).head, "localhost is in no_upstream_proxy"
    assert b"Via: " in echo_origin.wait_request(chained).head, "127.0.0.1 is not in no_upstream_proxy"
    # Tunnels: localhost direct, 127.0.0.1 through tinyproxy.
    for host in ("localhost", "127.0.0.1"):
        result = curl("--fail", "-x", proxy.url, "--cacert", str(cert.ca_pem),
                      https_origin.url(f"/tunnel-{host}", host=host))
        assert result.returncode == 0, result.stderr
    log.wait(f"CONNECT 127.0.0.1:{https_origin.port}")
    log.wait(f"/chained/{chained}")
    text = log.text()
    assert f"/direct/{direct}" not in text
    assert f"CONNECT localhost:{https_origin.port}" not in text


def assert_upstream_refusal(response: Response, tinyproxy: Tinyproxy, upstream_status: int) -> None:
    assert response.status == 502, response.head
    proxy_status = response.header("proxy-status")
    assert proxy_status and proxy_status.startswith("proxyctl; error="), response.head
    assert f'next-hop="127.0.0.1:{tinyproxy.port}"' in proxy_status, proxy_status
    assert str(upstream_status) in proxy_status, f"Proxy-Status should name the upstream's {upstream_status}"
    assert response.header("proxy-authenticate") is None, "the client cannot fix proxyctl's upstream credentials"
    assert response.body.endswith(b"\n") and response.body.count(b"\n") == 1


def test_tunnel_with_wrong_upstream_credentials_is_502(proxy_factory, tinyproxy, https_origin):
    proxy = proxy_factory(upstream_proxy=tinyproxy.url(password="wrong-password"))
    sock, reader, answer = open_tunnel(proxy.port, f"localhost:{https_origin.port}")
    reader.read_body(answer)
    sock.close()
    # tinyproxy 1.11 answers a wrong password with 401 (and a missing one with 407).
    assert_upstream_refusal(answer, tinyproxy, 401)
    assert "wrong-password" not in proxy.log()


def test_tunnel_without_upstream_credentials_is_502_naming_407(proxy_factory, tinyproxy, https_origin):
    proxy = proxy_factory(upstream_proxy=tinyproxy.url(user=None))
    sock, reader, answer = open_tunnel(proxy.port, f"localhost:{https_origin.port}")
    reader.read_body(answer)
    sock.close()
    assert_upstream_refusal(answer, tinyproxy, 407)


def test_plain_request_without_upstream_credentials_is_502_naming_407(proxy_factory, tinyproxy, echo_origin):
    """A 407 from the upstream proxy is about proxyctl's credentials: passed on, the client would think
    proxyctl wants a password from it. It must become a 502 that names the upstream's 407."""
    proxy = proxy_factory(upstream_proxy=tinyproxy.url(user=None))
    tag = token()
    with proxy.connect() as sock:
        sock.sendall(f"GET {echo_origin.url('/noauth/' + tag)} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n\r\n"
                     .encode())
        response = Reader(sock).read_response()
    assert echo_origin.requests_with(tag) == []
    assert_upstream_refusal(response, tinyproxy, 407)
