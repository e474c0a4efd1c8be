"""HTTP/2 between clients and the proxy for protected origins (issue 12): a client that offers h2 in the TLS
handshake the proxy terminates gets h2, and every stream is one request with exactly the token handling of an
HTTP/1.1 request (attached, refreshed once and replayed once on a 401, the refusal passed on).

Real clients only: curl (libcurl + nghttp2), httpx (the `h2` library), grpcio (gRPC's C core, both ends),
and raw `h2` connections for what a well-behaved client never sends. The origins are the HTTP/1.1 resource
server (tokens checked against the provider's JWKS) and a grpcio server that checks the bearer token itself.
The provider is the fault-injecting fake: exact refresh counts.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import subprocess
import threading
import time
import urllib.parse
import uuid
from pathlib import Path

import grpc
import httpx
import pytest

from fixtures import config
from fixtures.content import MiB, expected_sha256, write_generated
from fixtures.deployment import Deployment, Workspace
from fixtures.h2client import H2Client
from fixtures.http import run_curl
from grpc_server import SERVICE, GrpcOrigin
from idp_fake import FakeIdP
from resource_server import ResourceServer

API, GRPC = "api.test", "grpc.test"
SCOPES = "openid profile email"

provider_section = functools.partial(config.provider, scopes=SCOPES)
origin_section = functools.partial(config.origin, client_authorization="keep")


# MARK: - Module fixtures: the fake provider, the origins, one signed-in proxy


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("http2")


@pytest.fixture(scope="module")
def fake():
    with FakeIdP(access_token_format="jwt") as idp:
        yield idp


@pytest.fixture(scope="module")
def rs(module_dir, fake):
    server = ResourceServer(module_dir / "rs", [API])
    server.trust(fake.issuer, fake.url("jwks"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def grpc_origin(module_dir, fake):
    server = GrpcOrigin(module_dir / "grpc", GRPC)
    server.trust(fake.issuer, fake.url("jwks"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def deployment(module_dir, fake, rs, grpc_origin):
    sections = (provider_section("fake", fake.issuer, redirect_port=0)
                + origin_section(f"https://{API}:{rs.port}", "fake", ca_file=rs.ca_pem)
                + origin_section(f"https://{grpc_origin.authority}", "fake", ca_file=grpc_origin.ca_pem))
    ws = Workspace(module_dir / "main", sections, f"{API}=127.0.0.1, {GRPC}=127.0.0.1")
    ws.ca_init()
    ws.login_fake("fake")
    deployment = Deployment(ws, ws.start_proxy())
    yield deployment
    failure = deployment.stop()
    assert failure is None, failure


def h2_curl(deployment: Deployment, url: str, *args: str):
    """curl --http2 with the environment `proxyctl env` set up; the HTTP version goes to stdout."""
    return run_curl(url, "--http2", "--suppress-connect-headers", *args, env=deployment.client_env(),
                    scratch=deployment.ws.root / "curl")


def h2_lines(deployment: Deployment, mark: int, target: str, at_least: int) -> list[str]:
    """The HTTP/2 log lines since `mark` of the test's own requests, those naming `target` (a path no other test
    asks for): the shared proxy writes a line after its client has the answer, so the line of the test before
    can land after the mark."""
    return deployment.lines(mark, needle=" h2=", target=target, at_least=at_least)


# MARK: - curl and httpx


def test_curl_gets_http2_and_the_origin_gets_the_token(deployment, rs):
    path = f"/hello/{uuid.uuid4().hex[:10]}"
    mark, seen_mark = deployment.proxy.mark(), rs.mark()
    answer = h2_curl(deployment, rs.url(f"{path}?x=1"), "-w", "%{http_version}")
    assert answer.returncode == 0 and answer.status == 200, str(answer)
    assert answer.stderr == ""
    info = answer.json()
    assert info["authorization"] and info["sub"], info
    assert info["path"] == f"{path}?x=1" and info["host"] == rs.authority()
    seen = rs.since(seen_mark)
    assert len(seen) == 1 and seen[0].header("authorization").startswith("Bearer ")
    [line] = h2_lines(deployment, mark, f"https://{rs.authority()}{path}", 1)
    # The query is left out of the log (it may carry secrets).
    assert f"GET https://{rs.authority()}{path}?... status=200" in line and line.endswith(" h2=1"), line


def test_http2_version_is_what_the_client_sees(deployment, rs):
    env = deployment.client_env()
    done = subprocess.run(["curl", "-sS", "--http2", "-o", "/dev/null", "-w", "%{http_version}",
                           rs.url("/version")], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and done.stdout == "2", done


def test_many_streams_on_one_connection_each_get_their_answer(deployment, rs):
    """httpx with http2=True: 40 requests at once on one connection, each with its own path and body, each
    answered for itself (the origin saw each body whole)."""
    many = f"/many/{uuid.uuid4().hex[:10]}"
    mark = deployment.proxy.mark()
    bodies = {f"{many}/{i}": os.urandom(1000 + 7919 * i) for i in range(40)}

    async def run():
        async with httpx.AsyncClient(http2=True, proxy=deployment.exports["HTTPS_PROXY"],
                                     verify=deployment.exports["SSL_CERT_FILE"], timeout=60) as client:
            # One request first, so that the others find the connection open and share it.
            await client.get(rs.url(f"{many}/warm-up"))
            answers = await asyncio.gather(*(client.post(rs.url(path), content=body)
                                             for path, body in bodies.items()))
            return dict(zip(bodies, answers))

    responses = asyncio.run(run())
    for path, response in responses.items():
        assert response.http_version == "HTTP/2", response.http_version
        assert response.status_code == 200, (path, response.text)
        info = response.json()
        assert info["path"] == path
        assert info["body_size"] == len(bodies[path])
        assert info["body_sha256"] == hashlib.sha256(bodies[path]).hexdigest()
    lines = h2_lines(deployment, mark, f"https://{rs.authority()}{many}/", len(bodies) + 1)
    assert len({line.split(" conn=")[1].split()[0] for line in lines}) == 1, "one connection carries every stream"
    assert sorted(int(line.rsplit(" h2=", 1)[1]) for line in lines) == list(range(1, 2 * len(bodies) + 2, 2))


@pytest.mark.parametrize("size", [0, 100_000, 5 * MiB])
def test_uploads_reach_the_origin_whole(deployment, rs, tmp_path, size):
    source = tmp_path / "upload.bin"
    write_generated(source, size)
    answer = h2_curl(deployment, rs.url(f"/upload/{size}"), "--data-binary", f"@{source}",
                     "-H", "Content-Type: application/octet-stream")
    assert answer.status == 200, str(answer)
    info = answer.json()
    assert info["body_size"] == size and info["body_sha256"] == expected_sha256(size), info


def test_a_download_flows_under_flow_control(deployment, rs, tmp_path):
    """64 MiB through one stream: far beyond every window, so the body only arrives whole if the window
    updates, pauses and resumes all work."""
    size = 64 * MiB
    target = tmp_path / "download.bin"
    done = subprocess.run(["curl", "-sS", "--http2", "-o", str(target), "-w", "%{http_code} %{http_version}",
                           rs.url(f"/download/{size}")], capture_output=True, text=True,
                          env=deployment.client_env(), timeout=120)
    assert done.stdout == "200 2", done
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    assert digest == expected_sha256(size)


def test_a_401_is_refreshed_and_replayed_on_the_same_stream(deployment, rs, fake, tmp_path):
    """The origin refuses the first token once: the proxy refreshes (one grant), replays the POST with its
    body, and the client's stream gets the 200."""
    before = fake.count("token", grant_type="refresh_token")
    body = os.urandom(300_000)
    source = tmp_path / "body.bin"
    source.write_bytes(body)
    seen_mark = rs.mark()
    rs.reject_next(1)
    answer = h2_curl(deployment, rs.url("/replayed"), "--data-binary", f"@{source}")
    assert answer.status == 200, str(answer)
    assert fake.count("token", grant_type="refresh_token") == before + 1
    seen = rs.since(seen_mark)
    assert [s.status for s in seen] == [401, 200]
    assert seen[1].body_sha256 == hashlib.sha256(body).hexdigest()
    assert seen[0].token != seen[1].token


def test_the_proxys_own_answers_come_as_http2_responses(deployment, rs):
    """A request the proxy refuses (here: a Host naming another authority than the tunnel) gets the proxy's
    answer on its stream, with Proxy-Status, and the connection goes on serving."""
    tunnel = urllib.parse.urlsplit(deployment.exports["HTTPS_PROXY"])
    seen_mark = rs.mark()
    with H2Client(tunnel.port, rs.authority(), deployment.exports["SSL_CERT_FILE"]) as client:
        first = client.request("GET", "/x", authority="other.test:443")
        assert first.status == 421, first
        assert first.header("proxy-status").startswith("proxyctl; error=http_request_denied"), first
        assert "does not match the tunnel" in first.header("proxy-status")
        assert b"no token was sent" in first.body
        assert int(first.header("content-length")) == len(first.body)
        assert rs.since(seen_mark) == [], "a misdirected request never reaches the origin"
        second = client.request("GET", "/after")
        assert second.status == 200, second
        assert json.loads(second.body)["path"] == "/after"


# MARK: - gRPC: grpcio at both ends, the proxy in between


@pytest.fixture
def channel(deployment, grpc_origin):
    """A grpcio channel to the gRPC origin through the proxy (grpc.http_proxy: CONNECT, then TLS trusting the
    local CA), as a gRPC program behind HTTPS_PROXY makes it."""
    root = (deployment.ws.state / "ca" / "ca.pem").read_bytes()
    options = [("grpc.http_proxy", deployment.exports["HTTPS_PROXY"]), ("grpc.enable_retries", 0)]
    with grpc.secure_channel(grpc_origin.authority, grpc.ssl_channel_credentials(root), options) as made:
        yield made


def method(channel, kind: str, name: str):
    return getattr(channel, kind)(f"/{SERVICE}/{name}")


def test_grpc_unary_call_carries_the_token(deployment, grpc_origin, channel):
    mark, calls = deployment.proxy.mark(), grpc_origin.mark()
    payload = os.urandom(50_000)
    answer, call = method(channel, "unary_unary", "Unary").with_call(payload, timeout=30)
    assert call.code() == grpc.StatusCode.OK
    info = json.loads(answer)
    assert info["size"] == len(payload) and info["sha256"] == hashlib.sha256(payload).hexdigest()
    assert info["sub"], info
    seen = grpc_origin.since(calls)
    assert len(seen) == 1 and seen[0]["status"] == "OK", seen
    # Other tests call Unary too: this call's line is the one that carried its payload (and gRPC's 5-byte frame).
    [line] = h2_lines(deployment, mark, f" up={len(payload) + 5} ", 1)
    assert f"POST https://{grpc_origin.authority}/{SERVICE}/Unary status=200" in line, line


def test_grpc_server_streaming_delivers_every_message_and_the_status(grpc_origin, channel):
    """2,000 messages of 16 KiB (32 MiB) in one response stream, then the grpc-status trailer."""
    count = 2000
    stream = method(channel, "unary_stream", "Download")(count.to_bytes(8, "big"), timeout=60)
    received = 0
    for index, message in enumerate(stream):
        assert message == bytes([index % 251]) * 16384
        received += 1
    assert received == count
    assert stream.code() == grpc.StatusCode.OK


def test_grpc_client_streaming_uploads_every_message(grpc_origin, channel):
    messages = [os.urandom(16384) for _ in range(300)]
    answer = method(channel, "stream_unary", "Upload")(iter(messages), timeout=60)
    info = json.loads(answer)
    digest = hashlib.sha256(b"".join(messages)).hexdigest()
    assert info == {"count": 300, "size": 300 * 16384, "sha256": digest}


def test_grpc_bidirectional_stream_is_interactive(grpc_origin, channel):
    """Each message is answered before the next is sent: the request body streams to the origin while the
    response streams back (nothing waits for the request to end)."""
    outgoing: list[bytes] = []
    ready = threading.Event()

    def requests():
        for index in range(50):
            message = f"message {index} ".encode() * (index + 1)
            outgoing.append(message)
            ready.clear()
            yield message
            assert ready.wait(20), f"no answer to message {index} while the stream was open"

    replies = method(channel, "stream_stream", "Chat")(requests(), timeout=60)
    count = 0
    for reply in replies:
        assert reply == outgoing[count][::-1]
        count += 1
        ready.set()
    assert count == 50 and replies.code() == grpc.StatusCode.OK


def test_grpc_unauthenticated_is_refreshed_and_replayed_once(deployment, fake, grpc_origin, channel):
    """The origin refuses a token with grpc-status 16 (a trailers-only 200): for the proxy that is a 401, so
    it refreshes once and replays once; the program sees only the success."""
    before = fake.count("token", grant_type="refresh_token")
    calls = grpc_origin.mark()
    grpc_origin.reject_next(1)
    answer = method(channel, "unary_unary", "Unary")(b"heal me", timeout=30)
    assert json.loads(answer)["size"] == 7
    seen = grpc_origin.since(calls)
    assert [c["status"] for c in seen] == ["UNAUTHENTICATED", "OK"]
    assert seen[0]["token"] != seen[1]["token"]
    assert fake.count("token", grant_type="refresh_token") == before + 1


def test_grpc_unauthenticated_twice_reaches_the_program_with_proxy_status(deployment, fake, grpc_origin,
                                                                         channel):
    """Refused again after the refresh: one refresh, one replay, then the program gets UNAUTHENTICATED, the
    origin's www-authenticate and the proxy's proxy-status saying what was tried."""
    before = fake.count("token", grant_type="refresh_token")
    calls = grpc_origin.mark()
    grpc_origin.reject_next(2)
    with pytest.raises(grpc.RpcError) as refused:
        method(channel, "unary_unary", "Unary")(b"no luck", timeout=30)
    error = refused.value
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    metadata = dict(error.initial_metadata()) | dict(error.trailing_metadata())
    assert "rejected by the test" in metadata["www-authenticate"]
    assert metadata["proxy-status"].startswith("proxyctl"), metadata
    assert len(grpc_origin.since(calls)) == 2
    assert fake.count("token", grant_type="refresh_token") == before + 1


def test_grpc_bidirectional_call_refused_while_open_gets_the_refusal_at_once(deployment, fake, grpc_origin,
                                                                              channel):
    """A bidirectional call refused UNAUTHENTICATED while the client keeps its request stream open (it waits
    for an answer before sending more): the program gets the refusal at once with proxy-status saying to
    call again, the token is refreshed meanwhile, and the next call goes through with the new token."""
    before = fake.count("token", grant_type="refresh_token")
    generation = deployment.ws.tokens("fake")["generation"]
    calls = grpc_origin.mark()
    grpc_origin.reject_next(1)
    answered = threading.Event()

    def requests():
        yield b"hello"
        answered.wait(30)

    started = time.monotonic()
    replies = method(channel, "stream_stream", "Chat")(requests(), timeout=30)
    with pytest.raises(grpc.RpcError) as refused:
        list(replies)
    answered.set()
    assert time.monotonic() - started < 10, "the refusal waited for the request stream's end"
    error = refused.value
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    metadata = dict(error.initial_metadata()) | dict(error.trailing_metadata())
    assert "call again" in metadata["proxy-status"] and "received-status=200" in metadata["proxy-status"], metadata
    # The refresh runs in the background: the next call is made once its answer is stored.
    deadline = time.monotonic() + 10
    while deployment.ws.tokens("fake")["generation"] == generation and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.count("token", grant_type="refresh_token") == before + 1
    again = method(channel, "stream_stream", "Chat")(iter([b"abc", b"de"]), timeout=30)
    assert list(again) == [b"cba", b"ed"] and again.code() == grpc.StatusCode.OK
    seen = grpc_origin.since(calls)
    assert [c["status"] for c in seen] == ["UNAUTHENTICATED", "OK"], seen
    assert seen[0]["token"] != seen[1]["token"]


# MARK: - Ending connections: shutdown and reload


@pytest.fixture
def own_proxy(module_dir, deployment, tmp_path):
    """A second proxy on the module's state directory (its tokens and CA), for tests that stop or reload it.
    Its shutdown_grace is long (the suite's 3 s can run out while a loaded machine drains a 32 MiB stream, and
    the proxy then rightly cuts it): these tests check that streams in flight finish, not how fast."""
    ws = Workspace(tmp_path / "own", deployment.ws.sections, deployment.ws.resolve, state=deployment.ws.state,
                   shutdown_grace="60s")
    own = Deployment(ws, ws.start_proxy())
    yield own
    own.stop()


def test_shutdown_lets_the_stream_in_flight_finish(own_proxy, grpc_origin):
    """SIGTERM while a gRPC call streams its response (32 MiB, held back by flow control) on one HTTP/2
    connection and another connection sits idle: the call's every message and its OK status arrive, the idle
    connection is closed with GOAWAY, and the proxy exits 0 once the call is done."""
    tunnel = urllib.parse.urlsplit(own_proxy.exports["HTTPS_PROXY"])
    idle = H2Client(tunnel.port, grpc_origin.authority, own_proxy.exports["SSL_CERT_FILE"])
    root = (own_proxy.ws.state / "ca" / "ca.pem").read_bytes()
    options = [("grpc.http_proxy", own_proxy.exports["HTTPS_PROXY"]), ("grpc.enable_retries", 0)]
    with grpc.secure_channel(grpc_origin.authority, grpc.ssl_channel_credentials(root), options) as channel:
        count = 2000
        stream = method(channel, "unary_stream", "Download")(count.to_bytes(8, "big"), timeout=60)
        first = next(stream)
        mark = own_proxy.proxy.mark()
        own_proxy.proxy.signal(15)
        own_proxy.proxy.wait_log("shutting down: waiting", since=mark)
        try:
            rest = list(stream)
        except grpc.RpcError as error:
            pytest.fail(f"the stream was cut: {error}; the proxy said:\n{own_proxy.proxy.log_since(mark)[-3000:]}")
        assert [first, *rest] == [bytes([i % 251]) * 16384 for i in range(count)]
        assert stream.code() == grpc.StatusCode.OK
    while idle.goaway is None and idle.pump():
        pass
    assert idle.goaway is not None and idle.goaway.error_code == 0
    idle.sock.close()
    assert own_proxy.proxy.wait(20) == 0


def test_shutdown_delivers_what_flow_control_still_holds_back(own_proxy, rs):
    """An exchange ends in the proxy once libcurl has the whole response, though the client's flow-control
    window may still hold part of it in the proxy. The client here reads nothing after its request, so its
    64 KiB window holds back most of a 200,000-byte download; SIGTERM comes; then it reads again: every byte
    and the stream's end arrive, then GOAWAY, and the proxy exits 0. (It once closed the connection as soon
    as its output buffer was empty, and stopped reading the WINDOW_UPDATEs that would have let the rest go.)"""
    size = 200_000
    tunnel = urllib.parse.urlsplit(own_proxy.exports["HTTPS_PROXY"])
    with H2Client(tunnel.port, rs.authority(), own_proxy.exports["SSL_CERT_FILE"],
                  streams_outlive_goaway=True) as client:
        mark = own_proxy.proxy.mark()
        stream = client.send_headers("GET", f"/download/{size}")
        own_proxy.proxy.wait_log(rf"GET https://\S+/download/{size} status=200", since=mark)
        own_proxy.proxy.signal(15)
        own_proxy.proxy.wait_log("shutting down: waiting", since=mark)
        time.sleep(0.3)
        answer = client.wait(stream)
        assert answer.status == 200 and answer.reset is None, answer
        assert answer.ended and len(answer.body) == size, f"{len(answer.body)} of {size} bytes"
        assert hashlib.sha256(answer.body).hexdigest() == expected_sha256(size)
        while client.goaway is None and client.pump():
            pass
        assert client.goaway is not None and client.goaway.error_code == 0
    assert own_proxy.proxy.wait(20) == 0


def test_reload_asks_http2_clients_to_reconnect(own_proxy, rs):
    """SIGHUP: an open HTTP/2 connection gets GOAWAY (its settings were captured when it was accepted), the
    request in flight still completes, and the next connection works."""
    tunnel = urllib.parse.urlsplit(own_proxy.exports["HTTPS_PROXY"])
    with H2Client(tunnel.port, rs.authority(), own_proxy.exports["SSL_CERT_FILE"]) as client:
        assert client.request("GET", "/before").status == 200
        mark = own_proxy.proxy.mark()
        own_proxy.proxy.signal(1)
        own_proxy.proxy.wait_log("SIGHUP: configuration reloaded", since=mark)
        while client.goaway is None and client.pump():
            pass
        assert client.goaway is not None and client.goaway.error_code == 0
    answer = h2_curl(own_proxy, rs.url("/after-reload"))
    assert answer.status == 200, str(answer)
