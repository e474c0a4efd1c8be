"""Connection reuse: keep-alive, pipelining, chunked request bodies."""

from __future__ import annotations

import json
import re
import time
import uuid

import requests

from fixtures.content import MiB, expected_sha256, write_generated
from fixtures.http import Reader, open_tunnel


def token() -> str:
    return uuid.uuid4().hex[:12]


def conn_ids(lines: list[str]) -> list[str]:
    return [re.search(r" conn=(\d+) ", line).group(1) for line in lines]


def test_keepalive_with_requests_session(proxy, http_origin):
    tag = token()
    mark = proxy.mark()
    with requests.Session() as session:
        session.trust_env = False
        session.proxies = {"http": proxy.url}
        for index in range(5):
            with session.get(http_origin.url(f"/ka/{tag}/{index}"), timeout=20) as answer:
                assert answer.status_code == 200
                assert answer.text == f"origin GET /ka/{tag}/{index}\n"
    proxy.wait_log(rf"GET http://127\.0\.0\.1:{http_origin.port}/ka/{tag}/\d status=200", since=mark, count=5)
    lines = [line for line in proxy.request_lines(mark) if f"/ka/{tag}/" in line]
    assert len(lines) == 5, lines
    assert len(set(conn_ids(lines))) == 1, f"five requests on one client connection should share one conn id: {lines}"


def test_keepalive_raw_socket_reuses_client_and_upstream_connection(proxy, echo_origin):
    tag = token()
    mark = proxy.mark()
    with proxy.connect() as sock:
        reader = Reader(sock)
        for index in range(3):
            sock.sendall(f"GET {echo_origin.url(f'/ka/{tag}/{index}')} HTTP/1.1\r\nHost: {echo_origin.authority}"
                         f"\r\n\r\n".encode())
            response = reader.read_response()
            assert response.status == 200
            assert response.body.startswith(f"echo GET /ka/{tag}/{index} ".encode())
    proxy.wait_log(rf"GET http://127\.0\.0\.1:{echo_origin.port}/ka/{tag}/\d status=200", since=mark, count=3)
    lines = [line for line in proxy.request_lines(mark) if f"/ka/{tag}/" in line]
    assert len(set(conn_ids(lines))) == 1, lines
    origin_connections = {request.connection for request in echo_origin.requests_with(f"/ka/{tag}/")}
    assert len(origin_connections) == 1, "the upstream connection should be kept alive and reused"


def test_keepalive_tunnel_carries_many_requests(proxy, https_origin, cert):
    # A raw TLS client rather than requests: urllib3 may keep a tunnelled connection open after
    # Session.close(), and this test needs to know when the tunnel ends.
    mark = proxy.mark()
    sock, _, answer = open_tunnel(proxy.port, f"localhost:{https_origin.port}")
    assert answer.status == 200
    with cert.client_context().wrap_socket(sock, server_hostname="localhost") as tls:
        reader = Reader(tls)
        for index in range(5):
            tls.sendall(f"GET /tunnel-ka/{index} HTTP/1.1\r\nHost: localhost:{https_origin.port}\r\n\r\n".encode())
            response = reader.read_response()
            assert response.status == 200
            assert response.body == f"origin GET /tunnel-ka/{index}\n".encode()
    # All five went through one CONNECT; the tunnel is logged once, when it closes.
    proxy.wait_log(rf"CONNECT localhost:{https_origin.port} status=200", since=mark)
    assert len([line for line in proxy.request_lines(mark) if "CONNECT" in line]) == 1


def test_pipelining_three_requests_in_one_write(proxy, echo_origin):
    tag = token()
    body = b"pipelined body"
    requests_bytes = (
        f"GET {echo_origin.url(f'/pipe/{tag}/1')} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n\r\n".encode()
        + f"POST {echo_origin.url(f'/pipe/{tag}/2')} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n"
          f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        + f"GET {echo_origin.url(f'/pipe/{tag}/3')} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n\r\n".encode()
    )
    with proxy.connect() as sock:
        sock.sendall(requests_bytes)
        reader = Reader(sock)
        answers = [reader.read_response() for _ in range(3)]
    assert [a.status for a in answers] == [200, 200, 200]
    assert answers[0].body.startswith(f"echo GET /pipe/{tag}/1 ".encode())
    assert answers[1].body.startswith(f"echo POST /pipe/{tag}/2 ".encode())
    assert answers[2].body.startswith(f"echo GET /pipe/{tag}/3 ".encode())
    assert echo_origin.wait_request(f"/pipe/{tag}/2").body == body


def test_chunked_upload_with_curl(proxy, http_origin, https_origin, cert, curl, tmp_path):
    size = 8 * MiB + 333
    data = write_generated(tmp_path / "chunked.bin", size)
    for origin in (http_origin, https_origin):
        result = curl("--fail", "-x", proxy.url, "--cacert", str(cert.ca_pem), "-H", "Transfer-Encoding: chunked",
                      "--data-binary", f"@{data}", origin.url("/upload", host="localhost"))
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout)
        assert answer["size"] == size, origin.scheme
        assert answer["sha256"] == expected_sha256(size), origin.scheme


def test_chunked_upload_raw_with_extensions_and_trailers(proxy, echo_origin):
    tag = token()
    chunked = (b"4;name=value\r\nWiki\r\n"
               b"6;quoted=\"a b\";flag\r\npedia \r\n"
               b"E\r\nin \r\n\r\nchunks.\r\n"
               b"0;last=yes\r\nX-Checksum: abc123\r\nX-Another-Trailer:  spaced \r\n\r\n")
    head = (f"POST {echo_origin.url('/chunk/' + tag)} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n"
            f"Transfer-Encoding: chunked\r\nContent-Type: text/plain\r\n\r\n").encode()
    with proxy.connect() as sock:
        # In pieces, with the chunk boundaries split across writes.
        sock.sendall(head + chunked[:7])
        sock.sendall(chunked[7:30])
        sock.sendall(chunked[30:])
        response = Reader(sock).read_response()
    assert response.status == 200
    received = echo_origin.wait_request(tag)
    assert received.body == chunked
    assert b"Transfer-Encoding: chunked\r\n" in received.head


def test_bad_chunk_size_is_400_when_no_response_started(proxy, echo_origin):
    tag = token()
    with proxy.connect() as sock:
        sock.sendall(f"POST {echo_origin.url('/badchunk/' + tag)} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n"
                     f"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n".encode())
        reader = Reader(sock)
        response = reader.read_response()
        assert response.status == 400
        assert response.header("proxy-status").startswith("proxyctl; error=http_request_error")
        assert response.body.endswith(b"\n") and response.body.count(b"\n") == 1
        assert reader.closed_by_peer(), "the connection must close after a framing error"


# MARK: - A kept-alive upstream connection when the client connection changes course
#
# Regression (hardening issue, item 1): a keep-alive GET left its upstream connection open; a CONNECT on the
# same client connection then overwrote it while its bufferevent still pointed at the connection, the tunnel
# freed the connection, and the orphan's keep-alive timer (or the origin closing it) ran on freed memory. The
# release binary crashed only sometimes; the ASan build (scripts/test runs this file against it) always.


def _keepalive_get(sock, reader, origin, path):
    sock.sendall(f"GET {origin.url(path)} HTTP/1.1\r\nHost: {origin.authority}\r\n\r\n".encode())
    response = reader.read_response()
    assert response.status == 200
    return response


def _proxy_still_serves(proxy, origin):
    """The proxy outlived the orphaned connection's timer: it is running and answers a new request."""
    assert proxy.process.poll() is None, f"proxyctl died: {proxy.log()[-3000:]}"
    with proxy.connect() as sock:
        _keepalive_get(sock, Reader(sock), origin, f"/alive/{token()}")
    assert proxy.process.poll() is None


def _wait_past_keepalive(proxy, mark):
    # keepalive_timeout is 1s in these tests: the kept-alive upstream connection (or what was left of it)
    # reaches its idle timer. Waiting on a log line would be better, but an orphan logs nothing: the
    # liveness check after a wait a little longer than the timer is the observable.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert proxy.process.poll() is None, f"proxyctl died: {proxy.log_since(mark)[-3000:]}"
        time.sleep(0.1)


def test_keepalive_get_then_connect_on_one_connection(proxy_factory, http_origin, https_origin, cert):
    proxy = proxy_factory(keepalive_timeout="1s")
    mark = proxy.mark()
    with proxy.connect() as sock:
        reader = Reader(sock)
        _keepalive_get(sock, reader, http_origin, f"/before-connect/{token()}")
        sock.sendall(f"CONNECT localhost:{https_origin.port} HTTP/1.1\r\nHost: localhost:{https_origin.port}"
                     f"\r\n\r\n".encode())
        assert reader.read_head().status == 200
        with cert.client_context().wrap_socket(sock, server_hostname="localhost") as tls:
            tls.sendall(f"GET /through HTTP/1.1\r\nHost: localhost:{https_origin.port}\r\n\r\n".encode())
            response = Reader(tls).read_response()
            assert response.status == 200 and response.body == b"origin GET /through\n"
            _wait_past_keepalive(proxy, mark)
    _proxy_still_serves(proxy, http_origin)


def test_keepalive_get_then_connect_that_fails(proxy_factory, http_origin, refusing_port):
    proxy = proxy_factory(keepalive_timeout="1s")
    mark = proxy.mark()
    port = refusing_port  # nothing listens there: the CONNECT is refused
    with proxy.connect() as sock:
        reader = Reader(sock)
        _keepalive_get(sock, reader, http_origin, f"/before-refused/{token()}")
        sock.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        assert reader.read_head().status == 502
    _wait_past_keepalive(proxy, mark)
    _proxy_still_serves(proxy, http_origin)


def test_keepalive_get_then_get_to_another_host(proxy_factory, http_origin, echo_origin):
    proxy = proxy_factory(keepalive_timeout="1s")
    mark = proxy.mark()
    with proxy.connect() as sock:
        reader = Reader(sock)
        _keepalive_get(sock, reader, http_origin, f"/host-a/{token()}")
        response = _keepalive_get(sock, reader, echo_origin, f"/host-b/{token()}")
        assert response.body.startswith(b"echo GET /host-b/")
        # A third request on the same connection: back to the first host, on a fresh upstream connection.
        _keepalive_get(sock, reader, http_origin, f"/host-a-again/{token()}")
    _wait_past_keepalive(proxy, mark)
    _proxy_still_serves(proxy, http_origin)


def test_pipelined_get_and_connect_in_one_write(proxy_factory, http_origin, https_origin, cert):
    proxy = proxy_factory(keepalive_timeout="1s")
    mark = proxy.mark()
    with proxy.connect() as sock:
        sock.sendall(f"GET {http_origin.url('/pipelined-before-connect')} HTTP/1.1\r\nHost: {http_origin.authority}"
                     f"\r\n\r\nCONNECT localhost:{https_origin.port} HTTP/1.1\r\nHost: localhost:{https_origin.port}"
                     f"\r\n\r\n".encode())
        reader = Reader(sock)
        assert reader.read_response().status == 200
        assert reader.read_head().status == 200
        assert not reader.buffer
        with cert.client_context().wrap_socket(sock, server_hostname="localhost") as tls:
            tls.sendall(f"GET /pipelined-through HTTP/1.1\r\nHost: localhost:{https_origin.port}\r\n\r\n".encode())
            assert Reader(tls).read_response().status == 200
            _wait_past_keepalive(proxy, mark)
    _proxy_still_serves(proxy, http_origin)
