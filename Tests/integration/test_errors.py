"""Every bad-input rule and every failure to reach the next hop, on the wire with a raw socket.

Each answer of the proxy's own carries `Proxy-Status: proxyctl; error=<type>` (RFC 9209) and a one-line text
body; after a framing error the connection must be closed, because the rest of the bytes cannot be trusted.
"""

from __future__ import annotations

import socket
import time

import pytest

from fixtures.http import Reader, Response


LIMITS = dict(max_request_line="1KiB", max_header_bytes="4KiB", max_headers=20)


@pytest.fixture
def strict_proxy(proxy_factory):
    return proxy_factory(**LIMITS)


def exchange(proxy, raw: bytes) -> tuple[Response, Reader]:
    sock = proxy.connect()
    sock.sendall(raw)
    reader = Reader(sock)
    return reader.read_response(), reader


def assert_proxy_answer(response: Response, status: int, error: str) -> None:
    assert response.status == status, response.head
    proxy_status = response.header("proxy-status")
    assert proxy_status is not None, response.head
    assert proxy_status.startswith(f"proxyctl; error={error}"), proxy_status
    assert response.header("content-type").startswith("text/plain")
    assert response.body.endswith(b"\n") and response.body.count(b"\n") == 1, response.body
    assert len(response.body) > 10


H = "Host: 127.0.0.1:9\r\n"
BAD_REQUESTS = {
    # Request lines.
    "request line without target and version": (b"GET\r\n\r\n", 400),
    "request line with an extra word": (f"GET http://127.0.0.1:9/ HTTP/1.1 extra\r\n{H}\r\n".encode(), 400),
    "request line with two spaces": (f"GET  http://127.0.0.1:9/ HTTP/1.1\r\n{H}\r\n".encode(), 400),
    "method that is not a token": (f"G(T http://127.0.0.1:9/ HTTP/1.1\r\n{H}\r\n".encode(), 400),
    "target bytes that are not UTF-8": (f"GET http://127.0.0.1:9/caf\xe9 HTTP/1.1\r\n{H}\r\n".encode("latin-1"), 400),
    "garbage instead of a version": (f"GET http://127.0.0.1:9/ HTTX/1.1\r\n{H}\r\n".encode(), 400),
    "request line too long": (b"GET http://127.0.0.1:9/" + b"a" * 1500 + b" HTTP/1.1\r\n" + H.encode() + b"\r\n",
                              414),
    # Heads too large.
    "head larger than max_header_bytes": (
        f"GET http://127.0.0.1:9/ HTTP/1.1\r\n{H}".encode() + b"".join(
            b"X-Big-%d: %s\r\n" % (i, b"v" * 600) for i in range(10)) + b"\r\n", 431),
    "more fields than max_headers": (
        f"GET http://127.0.0.1:9/ HTTP/1.1\r\n{H}".encode() + b"".join(
            b"X-F%d: v\r\n" % i for i in range(40)) + b"\r\n", 431),
    # Framing (RFC 9112 §6.3 and the smuggling guards).
    "Content-Length and Transfer-Encoding": (
        f"POST http://127.0.0.1:9/ HTTP/1.1\r\n{H}Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        "0\r\n\r\n".encode(), 400),
    "two different Content-Length fields": (
        f"POST http://127.0.0.1:9/ HTTP/1.1\r\n{H}Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello".encode(),
        400),
    "a Content-Length list that disagrees": (
        f"POST http://127.0.0.1:9/ HTTP/1.1\r\n{H}Content-Length: 5, 6\r\n\r\nhello".encode(), 400),
    "Content-Length that is not a number": (
        f"POST http://127.0.0.1:9/ HTTP/1.1\r\n{H}Content-Length: +5\r\n\r\nhello".encode(), 400),
    "Transfer-Encoding not ending in chunked": (
        f"POST http://127.0.0.1:9/ HTTP/1.1\r\n{H}Transfer-Encoding: chunked, gzip\r\n\r\n".encode(), 400),
    "obs-fold": (f"GET http://127.0.0.1:9/ HTTP/1.1\r\n{H}X-Folded: first\r\n second\r\n\r\n".encode(), 400),
    "obs-fold with a tab": (f"GET http://127.0.0.1:9/ HTTP/1.1\r\n{H}X-Folded: first\r\n\tsecond\r\n\r\n".encode(),
                            400),
    "whitespace before the colon": (f"GET http://127.0.0.1:9/ HTTP/1.1\r\nHost : 127.0.0.1:9\r\n\r\n".encode(), 400),
    "tab before the colon": (f"GET http://127.0.0.1:9/ HTTP/1.1\r\n{H}X-Name\t: v\r\n\r\n".encode(), 400),
    "two Host fields": (f"GET http://127.0.0.1:9/ HTTP/1.1\r\n{H}{H}\r\n".encode(), 400),
    "HTTP/1.1 without Host": (b"GET http://127.0.0.1:9/ HTTP/1.1\r\nAccept: */*\r\n\r\n", 400),
    # Line endings.
    "bare LF line endings": (b"GET http://127.0.0.1:9/ HTTP/1.1\nHost: 127.0.0.1:9\n\n", 400),
    "bare LF in one field line": (f"GET http://127.0.0.1:9/ HTTP/1.1\r\n{H}X-A: b\nX-C: d\r\n\r\n".encode(), 400),
    "bare CR in a field value": (f"GET http://127.0.0.1:9/ HTTP/1.1\r\n{H}X-A: b\rc\r\n\r\n".encode(), 400),
    # CONNECT authorities.
    "CONNECT authority with a CR": (b"CONNECT exa\rmple.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 400),
    "CONNECT authority with a LF": (b"CONNECT exa\nmple.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 400),
    "CONNECT authority with encoded CRLF": (
        b"CONNECT example.com%0d%0aX-Injected:%201:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 400),
    "CONNECT authority with userinfo": (
        b"CONNECT user:secret@example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 400),
    "CONNECT without a port": (b"CONNECT example.com HTTP/1.1\r\nHost: example.com\r\n\r\n", 400),
    "CONNECT with a path": (b"CONNECT example.com:443/path HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 400),
    "CONNECT with a body": (b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\nContent-Length: 2\r\n\r\n"
                            b"hi", 400),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_the_connection_closed(name, strict_proxy):
    raw, status = BAD_REQUESTS[name]
    mark = strict_proxy.mark()
    response, reader = exchange(strict_proxy, raw)
    assert_proxy_answer(response, status, "http_request_error")
    assert response.header("connection") == "close"
    assert reader.closed_by_peer(), "the connection must be closed after a framing or syntax error"
    reader.sock.close()
    # Nothing was forwarded, and the refusal is logged.
    strict_proxy.wait_log(rf"status={status}", since=mark)
    assert "127.0.0.1:9 refused" not in strict_proxy.log_since(mark)


def test_keepalive_continues_after_an_answer_that_is_not_a_framing_error(proxy, echo_origin):
    """Origin-form is a mistake in the target, not in the framing: the connection may stay usable."""
    with proxy.connect() as sock:
        reader = Reader(sock)
        sock.sendall(b"GET /index.html HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = reader.read_response()
        assert first.status == 400
        if first.header("connection") == "close":
            pytest.skip("the proxy closes after this answer (allowed)")
        sock.sendall(f"GET {echo_origin.url('/after-400')} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n\r\n"
                     .encode())
        assert reader.read_response().status == 200


@pytest.mark.parametrize("form", ["absolute", "connect"])
def test_unknown_host_is_502_dns_error(form, proxy):
    target = "no-such-host.invalid:80"
    raw = (f"GET http://{target}/x HTTP/1.1\r\nHost: {target}\r\n\r\n" if form == "absolute"
           else f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").encode()
    response, _ = exchange(proxy, raw)
    assert_proxy_answer(response, 502, "dns_error")
    assert 'next-hop="no-such-host.invalid:80"' in response.header("proxy-status")


@pytest.mark.parametrize("form", ["absolute", "connect"])
def test_refused_connection_is_502_connection_refused(form, proxy, refusing_port):
    target = f"127.0.0.1:{refusing_port}"
    raw = (f"GET http://{target}/x HTTP/1.1\r\nHost: {target}\r\n\r\n" if form == "absolute"
           else f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").encode()
    response, _ = exchange(proxy, raw)
    assert_proxy_answer(response, 502, "connection_refused")
    assert f'next-hop="{target}"' in response.header("proxy-status")


@pytest.fixture
def hanging_port():
    """A port where connect() hangs: a listener with backlog 0 whose accept queue is already full, so the
    kernel drops further SYNs and the connecting side keeps retrying."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    probe = socket.socket()
    probe.settimeout(0.5)
    try:
        probe.connect(("127.0.0.1", port))
        hangs = False
    except (socket.timeout, TimeoutError):
        hangs = True
    except OSError:
        hangs = False
    probe.close()
    if not hangs:
        for sock in [listener, *fillers]:
            sock.close()
        pytest.skip("connects to a full backlog complete or fail at once on this kernel: no way to make one hang")
    yield port
    for sock in [listener, *fillers]:
        sock.close()


@pytest.mark.parametrize("form", ["absolute", "connect"])
def test_connect_timeout_is_504_connection_timeout(form, proxy_factory, hanging_port):
    proxy = proxy_factory(connect_timeout="1s")
    target = f"127.0.0.1:{hanging_port}"
    raw = (f"GET http://{target}/x HTTP/1.1\r\nHost: {target}\r\n\r\n" if form == "absolute"
           else f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").encode()
    started = time.monotonic()
    response, _ = exchange(proxy, raw)
    elapsed = time.monotonic() - started
    assert_proxy_answer(response, 504, "connection_timeout")
    assert 0.9 <= elapsed < 8, f"connect_timeout = 1s, answered after {elapsed:.2f}s"


def test_origin_form_is_400_with_a_hint(proxy):
    response, _ = exchange(proxy, b"GET /index.html HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert_proxy_answer(response, 400, "http_request_error")
    assert b"HTTPS_PROXY" in response.body
    assert proxy.address.encode() in response.body


def test_https_url_in_a_plain_request_is_400_with_a_hint(proxy):
    response, _ = exchange(proxy, b"GET https://127.0.0.1:9/ HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n")
    assert_proxy_answer(response, 400, "http_request_error")
    assert b"CONNECT" in response.body


@pytest.mark.parametrize("form", ["absolute", "connect"])
def test_request_to_the_proxy_itself_is_refused_as_a_loop(form, proxy):
    target = proxy.address
    raw = (f"GET http://{target}/x HTTP/1.1\r\nHost: {target}\r\n\r\n" if form == "absolute"
           else f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").encode()
    response, _ = exchange(proxy, raw)
    assert_proxy_answer(response, 508, "proxy_loop_detected")
