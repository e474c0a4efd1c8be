"""One log line per request and per tunnel, with the client, method, target, status, bytes each way and
duration; never a query string's content, never credentials."""

from __future__ import annotations

import base64
import re
import socket
import uuid

import pytest

from fixtures.http import Reader, open_tunnel


TIMESTAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
DURATION = r"(\d+ms|\d+\.\d\ds)"


def token() -> str:
    return uuid.uuid4().hex[:12]


def test_request_line_has_every_field_and_exact_byte_counts(proxy, echo_origin):
    tag = token()
    secret = "s3cr3t-query-value"
    with proxy.connect() as sock:
        client_port = sock.getsockname()[1]
        sock.sendall(f"POST {echo_origin.url(f'/log/{tag}?token={secret}&x=1')} HTTP/1.1\r\n"
                     f"Host: {echo_origin.authority}\r\nContent-Length: 11\r\n\r\nhello world".encode())
        response = Reader(sock).read_response()
    assert response.status == 200
    received = echo_origin.wait_request(tag)
    line = proxy.wait_log(
        rf"(?m)^{TIMESTAMP} info conn=(\d+) client=127\.0\.0\.1:{client_port} POST "
        rf"http://127\.0\.0\.1:{echo_origin.port}/log/{tag}\?\.\.\. status=200 up=(\d+) down=(\d+) "
        rf"duration={DURATION}$")[0]
    assert int(line.group(2)) == len(received.head) + len(received.body), "up= counts what was sent upstream"
    assert int(line.group(3)) == response.total_bytes, "down= counts what the client received"
    assert secret not in proxy.log()
    assert "token=" not in proxy.log()


def test_tunnel_line_has_every_field_and_exact_byte_counts(proxy, echo_origin):
    tag = token()
    sock, reader, answer = open_tunnel(proxy.port, echo_origin.authority)
    assert answer.status == 200
    client_port = sock.getsockname()[1]
    sent = f"GET /tunnel-log/{tag}?key=hidden HTTP/1.1\r\nHost: {echo_origin.authority}\r\n\r\n".encode()
    sock.sendall(sent)
    response = reader.read_response()
    assert response.status == 200
    sock.shutdown(socket.SHUT_WR)
    assert reader.read_to_eof() == b""
    sock.close()
    line = proxy.wait_log(
        rf"(?m)^{TIMESTAMP} info conn=(\d+) client=127\.0\.0\.1:{client_port} CONNECT "
        rf"127\.0\.0\.1:{echo_origin.port} status=200 up=(\d+) down=(\d+) duration={DURATION}$")[0]
    assert int(line.group(2)) == len(sent)
    assert int(line.group(3)) == response.total_bytes


def test_exactly_one_line_per_request_and_per_tunnel(proxy, echo_origin):
    tag = token()
    mark = proxy.mark()
    with proxy.connect() as sock:
        reader = Reader(sock)
        for index in range(4):
            sock.sendall(f"GET {echo_origin.url(f'/one/{tag}/{index}')} HTTP/1.1\r\nHost: {echo_origin.authority}"
                         f"\r\n\r\n".encode())
            assert reader.read_response().status == 200
    for _ in range(3):
        sock, reader, answer = open_tunnel(proxy.port, echo_origin.authority)
        assert answer.status == 200
        sock.close()
    proxy.wait_log(rf"CONNECT 127\.0\.0\.1:{echo_origin.port} status=200", since=mark, count=3)
    lines = proxy.request_lines(mark)
    assert len([line for line in lines if f"/one/{tag}/" in line]) == 4
    assert len([line for line in lines if "CONNECT" in line]) == 3
    assert len(lines) == 7, lines


def test_queries_are_cut_in_every_kind_of_line(proxy, refusing_port):
    secret = "code=TOPSECRETCODE"
    raws = [
        # Refused upstream: the error line.
        f"GET http://127.0.0.1:{refusing_port}/cb?{secret} HTTP/1.1\r\nHost: 127.0.0.1:{refusing_port}\r\n\r\n",
        # Origin-form: answered by the proxy itself.
        f"GET /callback?{secret} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        # An unknown host.
        f"GET http://no-such-host.invalid/cb?{secret} HTTP/1.1\r\nHost: no-such-host.invalid\r\n\r\n",
        # A malformed request after the query.
        f"GET http://127.0.0.1:{refusing_port}/cb?{secret} HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Field: x\r\n\r\n",
    ]
    for raw in raws:
        with proxy.connect() as sock:
            sock.sendall(raw.encode())
            assert Reader(sock).read_response().status >= 400
    proxy.wait_log(r"status=\d+", count=len(raws))
    log = proxy.log()
    assert "TOPSECRETCODE" not in log
    assert "?..." in log


def test_proxy_authorization_values_are_never_logged(proxy_factory, echo_origin):
    proxy = proxy_factory(log_level="debug")
    credentials = base64.b64encode(b"someone:Pr0xy-Passw0rd").decode()
    raws = [
        # A loopback proxy without proxy_auth_file drops the field.
        f"GET {echo_origin.url('/pa')} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n"
        f"Proxy-Authorization: Basic {credentials}\r\n\r\n",
        # Twice is an error.
        f"GET {echo_origin.url('/pa2')} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n"
        f"Proxy-Authorization: Basic {credentials}\r\nProxy-Authorization: Basic {credentials}\r\n\r\n",
        # Malformed, right after the credentials.
        f"GET {echo_origin.url('/pa3')} HTTP/1.1\r\nProxy-Authorization: Basic {credentials}\r\nBroken\r\n\r\n",
        f"CONNECT {echo_origin.authority} HTTP/1.1\r\nProxy-Authorization: Basic {credentials}\r\n\r\n",
    ]
    for raw in raws:
        with proxy.connect() as sock:
            sock.sendall(raw.encode())
            Reader(sock).read_head()
    proxy.wait_log(r"status=\d+", count=3)
    log = proxy.log()
    assert credentials not in log
    assert "Pr0xy-Passw0rd" not in log
    assert not re.search(r"(?i)proxy-authorization:\s*\S", log)
