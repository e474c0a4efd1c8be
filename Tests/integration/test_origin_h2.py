"""The proxy's own client to an origin that speaks HTTP/2 (issue 28: one way to an origin). The origin chooses the
protocol by ALPN, not the method: every request goes on a stream of one shared connection, with nothing added but
the credential. A request is sent again only when RFC 9110 §9.2.2 allows it (idempotent, no body, a reused
connection that ended before a byte of answer) or when the origin proved it did not process it (REFUSED_STREAM,
a GOAWAY below its stream: RFC 9113 §8.7). Both client sides: HTTP/1.1 and HTTP/2 inside the tunnel.

The origin is `fixtures.h2_origin.H2Origin` (the `h2` library's server state machine), the provider the fake.
"""

from __future__ import annotations

import functools
import hashlib
import json
import ssl
import uuid
from pathlib import Path

import pytest

from fixtures import config
from fixtures.deployment import Deployment, Workspace
from fixtures.h2_origin import H2Origin
from fixtures.h2client import H2Client
from fixtures.http import Reader, open_tunnel
from idp_fake import FakeIdP

HOST = "h2.test"
SCOPES = "openid profile email"


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("origin-h2")


@pytest.fixture(scope="module")
def fake():
    with FakeIdP(access_token_format="jwt") as idp:
        yield idp


@pytest.fixture(scope="module")
def origin(module_dir):
    server = H2Origin(module_dir / "origin", HOST)
    yield server
    server.close()


@pytest.fixture(scope="module")
def broken(module_dir):
    """An origin that chooses h2 and then sends a PING before its SETTINGS (RFC 9113 §3.4: SETTINGS first)."""
    server = H2Origin(module_dir / "broken", HOST, first_bytes=bytes.fromhex("000008060000000000") + b"12345678")
    yield server
    server.close()


@pytest.fixture(scope="module")
def deployment(module_dir, fake, origin, broken):
    sections = (config.provider("fake", fake.issuer, scopes=SCOPES, redirect_port=0)
                + config.origin(f"https://{origin.authority}", "fake", ca_file=origin.ca_pem)
                + config.origin(f"https://{broken.authority}", "fake", ca_file=broken.ca_pem))
    ws = Workspace(module_dir / "main", sections, f"{HOST}=127.0.0.1")
    ws.ca_init()
    ws.login_fake("fake")
    deployment = Deployment(ws, ws.start_proxy())
    yield deployment
    failure = deployment.stop()
    assert failure is None, failure


def bearer(deployment: Deployment) -> str:
    return "Bearer " + deployment.ws.tokens("fake")["access_token"]


class Http1Client:
    """HTTP/1.1 inside the proxy's tunnel, on raw TLS: the bytes are exactly the test's."""

    def __init__(self, deployment: Deployment, origin: H2Origin):
        sock, _, response = open_tunnel(deployment.proxy.port, origin.authority)
        assert response.status == 200, response.head
        context = ssl.create_default_context(cafile=str(deployment.ws.state / "ca" / "ca.pem"))
        context.set_alpn_protocols(["http/1.1"])
        self.tls = context.wrap_socket(sock, server_hostname=HOST)
        self.reader = Reader(self.tls)
        self.authority = origin.authority

    def request(self, method: str, path: str, body: bytes | None = None, extra: str = ""):
        length = f"Content-Length: {len(body)}\r\n" if body is not None else ""
        self.tls.sendall(f"{method} {path} HTTP/1.1\r\nHost: {self.authority}\r\n{extra}{length}\r\n".encode()
                         + (body or b""))
        return self.reader.read_response(method)

    def close(self):
        self.tls.close()


class Http2Client:
    """HTTP/2 inside the proxy's tunnel (the `h2` library)."""

    def __init__(self, deployment: Deployment, origin: H2Origin):
        self.client = H2Client(deployment.proxy.port, origin.authority, str(deployment.ws.state / "ca" / "ca.pem"),
                               server_hostname=HOST)

    def request(self, method: str, path: str, body: bytes | None = None, extra: str = ""):
        stream = self.client.send_headers(method, path, end_stream=not body)
        if body:
            self.client.send_data(stream, body, end_stream=True)
        return self.client.wait(stream)

    def close(self):
        self.client.sock.close()


CLIENTS = {"http1": Http1Client, "http2": Http2Client}


def status(answer) -> int:
    return answer.status


def proxy_status(answer) -> str:
    return answer.header("proxy-status") or ""


@pytest.mark.parametrize("side", CLIENTS)
def test_every_method_goes_on_one_http2_connection_with_only_the_credential_added(deployment, origin, side):
    """GET, HEAD, POST with a body, PUT, DELETE and OPTIONS * all reach the origin in HTTP/2, on one connection:
    the protocol is the origin's choice, not the method's. The header block is the request's own (pseudo-fields,
    the client's fields, content-length of a body) plus the token; no user-agent of the proxy's."""
    tag = uuid.uuid4().hex[:8]
    mark = origin.mark()
    client = CLIENTS[side](deployment, origin)
    try:
        answers = [client.request("GET", f"/get/{tag}", extra="X-Trace: a b\r\n" if side == "http1" else ""),
                   client.request("HEAD", f"/head/{tag}"),
                   client.request("POST", f"/post/{tag}", body=b"order-1"),
                   client.request("PUT", f"/put/{tag}", body=b"x" * 70_000),
                   client.request("DELETE", f"/delete/{tag}"),
                   client.request("OPTIONS", "*")]
    finally:
        client.close()
    assert [status(a) for a in answers] == [200] * 6, answers
    seen = origin.since(mark)
    assert [(s.method, s.path) for s in seen] == [
        ("GET", f"/get/{tag}"), ("HEAD", f"/head/{tag}"), ("POST", f"/post/{tag}"), ("PUT", f"/put/{tag}"),
        ("DELETE", f"/delete/{tag}"), ("OPTIONS", "*")]
    assert len({s.connection for s in seen}) == 1, "the requests did not share one HTTP/2 connection"
    assert all(s.header("authorization") == bearer(deployment) for s in seen)
    assert all(s.header("user-agent") is None for s in seen), seen[0].headers
    # The body's framing is the client's: a Content-Length from the HTTP/1.1 client, none from the HTTP/2 one
    # (its DATA frames end with END_STREAM).
    names = [name for name, _ in seen[2].headers]
    framing = ["content-length"] if side == "http1" else []
    assert names == [":method", ":scheme", ":authority", ":path", *framing, "authorization"], names
    assert seen[2].header(":authority") == origin.authority and seen[2].body == bytearray(b"order-1")
    assert seen[3].body_size == 70_000
    if side == "http1":
        assert ("x-trace", "a b") in seen[0].headers


@pytest.mark.parametrize("side", CLIENTS)
@pytest.mark.parametrize("method, body", [("POST", b"order"), ("PATCH", b"patch"), ("POST", None)],
                         ids=["post", "patch", "post-no-body"])
def test_a_request_that_may_not_be_resent_reaches_the_http2_origin_once(deployment, origin, side, method, body):
    """The origin reads the request on the shared connection, then drops the connection without a word (no
    GOAWAY): it may have acted on it, so the request is not sent again, and the client gets a 502."""
    tag = uuid.uuid4().hex[:8]
    mark = origin.mark()
    client = CLIENTS[side](deployment, origin)
    try:
        warm = client.request(method, f"/warm/{tag}", body=body)
        dropped = client.request(method, f"/hangup/{tag}", body=body)
    finally:
        client.close()
    assert status(warm) == 200, warm
    assert status(dropped) == 502, dropped
    assert proxy_status(dropped).startswith("proxyctl; error=http_response_incomplete"), dropped
    seen = origin.since(mark)
    assert [s.path for s in seen] == [f"/warm/{tag}", f"/hangup/{tag}"], f"sent {len(seen) - 1} times"
    assert seen[1].connection == seen[0].connection and seen[1].error == "hung up"


@pytest.mark.parametrize("side", CLIENTS)
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_get_or_head_on_a_dropped_http2_connection_is_sent_again_once(deployment, origin, side, method):
    """A bodiless GET or HEAD whose reused connection ended before a byte of answer goes once more, on a new
    connection, and the client gets the answer."""
    tag = uuid.uuid4().hex[:8]
    mark, log_mark = origin.mark(), deployment.proxy.mark()
    client = CLIENTS[side](deployment, origin)
    try:
        warm = client.request(method, f"/warm/{tag}")
        again = client.request(method, f"/hangup/{tag}")
    finally:
        client.close()
    assert status(warm) == 200 and status(again) == 200, (warm, again)
    first, second = origin.since(mark)[1:]
    assert first.path == second.path == f"/hangup/{tag}" and first.error == "hung up"
    assert second.connection != first.connection
    deployment.proxy.wait_log(rf"{method} sent again on a new connection", since=log_mark)


@pytest.mark.parametrize("side", CLIENTS)
@pytest.mark.parametrize("misbehaviour", ["refuse", "goaway"])
def test_a_stream_the_origin_proved_unprocessed_is_sent_again_whatever_the_method(deployment, origin, side,
                                                                                  misbehaviour):
    """REFUSED_STREAM, or a GOAWAY whose last stream id is below the request's, says the origin did nothing with
    it (RFC 9113 §8.7): a POST with a body is sent once more (after a GOAWAY, on a new connection), whole."""
    tag = uuid.uuid4().hex[:8]
    mark = origin.mark()
    client = CLIENTS[side](deployment, origin)
    body = b"payment-" + tag.encode()
    try:
        warm = client.request("POST", f"/warm/{tag}", body=b"warm")
        answer = client.request("POST", f"/{misbehaviour}/{tag}", body=body)
    finally:
        client.close()
    assert status(warm) == 200 and status(answer) == 200, answer
    seen = origin.since(mark)
    first, second = seen[1], seen[2]
    assert first.path == second.path == f"/{misbehaviour}/{tag}" and len(seen) == 3
    assert first.error == ("refused" if misbehaviour == "refuse" else "goaway")
    assert second.error is None and bytes(second.body) == body
    if misbehaviour == "goaway":
        assert second.connection != first.connection


def test_request_trailers_and_response_trailers_cross_in_http2(deployment, origin):
    """A streamed request body with trailer fields (gRPC's shape) reaches the origin with them, and the origin's
    trailers reach an HTTP/2 client."""
    client = H2Client(deployment.proxy.port, origin.authority, str(deployment.ws.state / "ca" / "ca.pem"),
                      server_hostname=HOST)
    with client:
        stream = client.send_headers("POST", "/echo-trailers", end_stream=False, extra=[("te", "trailers")])
        client.send_data(stream, b"part-1,")
        client.send_data(stream, b"part-2")
        client.conn.send_headers(stream, [("x-request-sum", "abc")], end_stream=True)
        client.flush()
        answer = client.wait(stream)
        response = client.request("POST", "/trailers", body=b"q")
    assert answer.status == 200, answer
    info = json.loads(answer.body)
    assert info["body_size"] == 13 and info["trailers"] == {"x-request-sum": "abc"}, info
    assert response.status == 200 and response.trailers.get("grpc-status") == "0", response
    assert response.trailers["x-checksum"] == hashlib.sha256(response.body).hexdigest()


def test_an_http1_clients_request_trailers_reach_the_origin(deployment, origin):
    """RFC 9112 §7.1.2: the trailer fields of an HTTP/1.1 client's chunked request reach the origin with the body
    (they were dropped on the way to a protected origin), read as field lines are; those a trailer must not carry
    (Host, framing) do not travel."""
    client = Http1Client(deployment, origin)
    try:
        client.tls.sendall(
            f"POST /echo-trailers-h1 HTTP/1.1\r\nHost: {origin.authority}\r\nTransfer-Encoding: chunked\r\n"
            "TE: trailers\r\n\r\n7\r\npart-1,\r\n6\r\npart-2\r\n0\r\nx-request-sum: abc\r\n"
            "Host: evil.test\r\nx-second: 2\r\n\r\n".encode())
        answer = client.reader.read_response("POST")
    finally:
        client.close()
    assert answer.status == 200, answer
    info = json.loads(answer.body)
    assert info["body_size"] == 13, info
    assert info["trailers"] == {"x-request-sum": "abc", "x-second": "2"}, info


@pytest.mark.parametrize("side", CLIENTS)
def test_an_origin_that_breaks_http2_is_named_for_it(deployment, broken, side):
    """The proxy's HTTP/2 client ends a connection whose first frame is not SETTINGS (GOAWAY PROTOCOL_ERROR) and
    the client's 502 says so, in nghttp2's words, instead of only that the origin closed the connection."""
    client = CLIENTS[side](deployment, broken)
    try:
        answer = client.request("GET", f"/broken/{uuid.uuid4().hex[:8]}")
    finally:
        client.close()
    assert status(answer) == 502, answer
    assert "broke HTTP/2" in proxy_status(answer) and "SETTINGS" in proxy_status(answer), proxy_status(answer)
    ended = [why for _, why in broken.endings]
    assert ended and all("PROTOCOL_ERROR" in why and "SETTINGS expected" in why for why in ended), ended
