"""What passes through must pass unchanged: field lines byte for byte (minus hop-by-hop ones), bodies in every
framing, and the origin's own TLS certificate through a tunnel."""

from __future__ import annotations

import hashlib
import ssl
import uuid

from fixtures.content import MiB, expected_sha256
from fixtures.http import Reader, open_tunnel
from fixtures.proxy import clean_env


def token() -> str:
    return uuid.uuid4().hex[:12]


# Field lines that must arrive exactly as sent: case, order, odd spacing, duplicates, empty values.
END_TO_END = (
    b"X-Custom-Case: MiXeD CaSe\r\n"
    b"x-lower-name: value   with   inner   spaces\r\n"
    b"X-Leading-Space:     four leading spaces\r\n"
    b"X-Trailing-Space: trailing space and tab \t\r\n"
    b"X-Tab:\ttab-separated\r\n"
    b"X-No-Space:nospace\r\n"
    b"X-Dup: one\r\n"
    b"Accept: */*\r\n"
    b"X-Dup: two\r\n"
    b"x-dup: three, four\r\n"
    b"X-Empty:\r\n"
    b"Cookie: a=b; c=d\r\n"
    b"User-Agent: integration/1.0 (raw socket)\r\n"
)

# Hop-by-hop field lines: each must be gone at the origin (RFC 9110 §7.6.1), wherever it sits.
HOP_BY_HOP = (
    b"Connection: keep-alive, X-Named-By-Connection\r\n",
    b"X-Named-By-Connection: must be dropped\r\n",
    b"Keep-Alive: timeout=5, max=100\r\n",
    b"Proxy-Connection: keep-alive\r\n",
    b"TE: trailers\r\n",
    b"Upgrade: h2c\r\n",
    b"Proxy-Authorization: Basic dXNlcjpwYXNzd29yZA==\r\n",
)


def interleave(end_to_end: bytes, hop: tuple[bytes, ...]) -> bytes:
    lines = end_to_end.split(b"\r\n")[:-1]
    out = b""
    for index, line in enumerate(lines):
        out += line + b"\r\n"
        if index < len(hop):
            out += hop[index]
    return out


def test_request_fields_arrive_byte_identical_without_hop_by_hop(proxy, echo_origin):
    tag = token()
    path = f"/fields/{tag}?q=1&r=%20x"
    host_line = f"Host: {echo_origin.authority}\r\n".encode()
    sent = (f"GET {echo_origin.url(path)} HTTP/1.1\r\n".encode() + host_line
            + interleave(END_TO_END, HOP_BY_HOP) + b"\r\n")
    with proxy.connect() as sock:
        sock.sendall(sent)
        response = Reader(sock).read_response()
    assert response.status == 200
    received = echo_origin.wait_request(tag)
    expected = f"GET {path} HTTP/1.1\r\n".encode() + host_line + END_TO_END + b"\r\n"
    assert received.head == expected


def test_utf8_and_obs_text_arrive_byte_identical(proxy, echo_origin):
    # curl sends a URL's raw UTF-8 as given; a combining mark right after "/" or "?" (one grapheme with it)
    # must not change how the target is read. Field values may carry any obs-text byte (RFC 9110 §5.5).
    tag = token()
    path = f"/fields/{tag}/caf\u00e9/\u0301x?\u0301q=\u00e9".encode()
    host_line = f"Host: {echo_origin.authority}\r\n".encode()
    fields = b"X-Latin-1: caf\xe9 \xff\x80\r\nX-Utf8: \xc3\xa9\r\n"
    sent = b"GET " + echo_origin.url("").encode() + path + b" HTTP/1.1\r\n" + host_line + fields + b"\r\n"
    with proxy.connect() as sock:
        sock.sendall(sent)
        response = Reader(sock).read_response()
    assert response.status == 200
    received = echo_origin.wait_request(tag)
    assert received.head == b"GET " + path + b" HTTP/1.1\r\n" + host_line + fields + b"\r\n"


def test_request_body_and_fields_with_content_length(proxy, echo_origin):
    tag = token()
    body = bytes(range(256)) * 40 + b"\r\n\r\nnot a head\r\n"
    head = (f"POST {echo_origin.url('/post/' + tag)} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n".encode()
            + b"Content-Type: application/octet-stream\r\n"
            + f"Content-Length: {len(body)}\r\n".encode() + b"X-After-Length:  yes \r\n\r\n")
    with proxy.connect() as sock:
        sock.sendall(head + body)
        response = Reader(sock).read_response()
    assert response.status == 200
    received = echo_origin.wait_request(tag)
    assert received.head == head.replace(echo_origin.url("/post/" + tag).encode(), f"/post/{tag}".encode())
    assert received.body == body


def test_host_field_disagreeing_with_target_is_replaced(proxy, echo_origin):
    """RFC 9112 §3.2.2: the absolute-form target wins over a different Host."""
    tag = token()
    with proxy.connect() as sock:
        sock.sendall(f"GET {echo_origin.url('/host/' + tag)} HTTP/1.1\r\nHost: elsewhere.example\r\n"
                     f"X-Keep: 1\r\n\r\n".encode())
        assert Reader(sock).read_response().status == 200
    received = echo_origin.wait_request(tag)
    assert b"elsewhere.example" not in received.head
    assert received.head.count(b"\r\nHost: ") == 1 and f"Host: {echo_origin.authority}".encode() in received.head
    assert b"X-Keep: 1\r\n" in received.head


RESPONSE_END_TO_END = (
    b"HTTP/1.1 200 Fine Thanks\r\n"
    b"X-Resp-Case: MiXeD\r\n"
    b"x-odd:   spaced   value \t\r\n"
    b"Set-Cookie: a=1; Path=/\r\n"
    b"Content-Type: text/plain\r\n"
    b"Set-Cookie: b=2; Path=/\r\n"
    b"X-Empty:\r\n"
    b"Content-Length: 5\r\n"
)
RESPONSE_HOP_BY_HOP = (
    b"Connection: X-Resp-Hop\r\n",
    b"X-Resp-Hop: must be dropped\r\n",
    b"Keep-Alive: timeout=5\r\n",
)


def test_response_fields_arrive_byte_identical_without_hop_by_hop(proxy, echo_origin):
    tag = token()
    lines = RESPONSE_END_TO_END.split(b"\r\n")[:-1]
    origin_head = lines[0] + b"\r\n" + interleave(b"\r\n".join(lines[1:]) + b"\r\n", RESPONSE_HOP_BY_HOP) + b"\r\n"
    echo_origin.respond(tag, origin_head + b"hello")
    with proxy.connect() as sock:
        sock.sendall(f"GET {echo_origin.url('/resp/' + tag)} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n\r\n"
                     .encode())
        response = Reader(sock).read_response()
    assert response.head == RESPONSE_END_TO_END + b"\r\n"
    assert response.body == b"hello"


def test_chunked_response_with_extensions_and_trailers_passes_unchanged(proxy, echo_origin):
    tag = token()
    chunked = b"5;ext=1\r\nhello\r\n1a\r\n" + b"z" * 26 + b"\r\n0\r\nX-Trailer: done\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Mark: chunked\r\n\r\n"
    echo_origin.respond(tag, head + chunked)
    with proxy.connect() as sock:
        reader = Reader(sock)
        for _ in range(2):  # twice on one connection: the framing must end the response exactly
            sock.sendall(f"GET {echo_origin.url('/chunked/' + tag)} HTTP/1.1\r\nHost: {echo_origin.authority}"
                         f"\r\n\r\n".encode())
            response = reader.read_response()
            assert response.head == head
            assert response.raw_body == chunked
            assert response.body == b"hello" + b"z" * 26


def test_read_until_close_response_is_delivered_then_closed(proxy, echo_origin):
    tag = token()
    body = b"no length, the end is the close\n" * 1000
    echo_origin.respond(tag, b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + body, close=True)
    with proxy.connect() as sock:
        sock.sendall(f"GET {echo_origin.url('/close/' + tag)} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n\r\n"
                     .encode())
        reader = Reader(sock)
        response = reader.read_head()
        assert response.status == 200
        # The client cannot tell the end otherwise: the proxy must say it closes, and close.
        assert "close" in (response.header("connection") or "").lower()
        assert reader.read_to_eof() == body


def test_generated_content_in_each_framing(proxy, http_origin):
    size = 3 * MiB + 12345
    for query in ("", "?chunked=1", "?close=1"):
        with proxy.connect() as sock:
            sock.sendall(f"GET {http_origin.url(f'/gen/{size}{query}')} HTTP/1.1\r\n"
                         f"Host: {http_origin.authority}\r\n\r\n".encode())
            response = Reader(sock).read_response()
        assert response.status == 200, query
        assert hashlib.sha256(response.body).hexdigest() == expected_sha256(size), query


def test_tunnel_shows_the_origins_own_certificate(proxy, https_origin, cert):
    sock, reader, answer = open_tunnel(proxy.port, f"localhost:{https_origin.port}")
    assert answer.status == 200
    with cert.client_context().wrap_socket(sock, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
        assert der == cert.leaf_der
        assert hashlib.sha256(der).hexdigest() == cert.leaf_sha256
        tls.sendall(f"GET /cert HTTP/1.1\r\nHost: localhost:{https_origin.port}\r\nConnection: close\r\n\r\n"
                    .encode())
        assert Reader(tls).read_response().status == 200


def test_tunnel_certificate_seen_by_openssl_cli(proxy, https_origin, cert, tmp_path):
    """A second, independent TLS client: openssl s_client through the proxy (its -proxy option)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        import pytest

        pytest.skip("openssl CLI not installed")
    result = subprocess.run(
        ["openssl", "s_client", "-proxy", proxy.address, "-connect", f"localhost:{https_origin.port}",
         "-servername", "localhost", "-CAfile", str(cert.ca_pem), "-verify_return_error", "-showcerts"],
        input=b"", capture_output=True, timeout=30, env=clean_env())
    assert result.returncode == 0, result.stderr
    pem = result.stdout.split(b"-----BEGIN CERTIFICATE-----", 1)[1].split(b"-----END CERTIFICATE-----", 1)[0]
    assert ssl.PEM_cert_to_DER_cert(
        "-----BEGIN CERTIFICATE-----" + pem.decode() + "-----END CERTIFICATE-----\n") == cert.leaf_der
