"""WebSocket to protected origins (issue 12): the `websockets` client through HTTPS_PROXY against a wss origin
(the `websockets` server, checking the bearer token on the upgrade against the provider's JWKS), and an
absolute-form upgrade to a protected ws:// loopback origin on the proxy's front door. The token rides on the
upgrade request; a 401 to the upgrade is refreshed once and replayed once; a step-up challenge is passed on;
after 101 the connection is a tunnel with backpressure, the close handshake and the idle timeout.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import socket
import ssl
import time
import urllib.parse
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from fixtures import config
from fixtures.deployment import Deployment, Workspace
from fixtures.http import Reader
from fixtures.proxy import poll
from idp_fake import FakeIdP
from ws_server import WebSocketOrigin

WSS_HOST = "ws.test"
SCOPES = "openid profile email"

provider_section = functools.partial(config.provider, scopes=SCOPES)
origin_section = functools.partial(config.origin, client_authorization="replace")


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("websocket")


@pytest.fixture(scope="module")
def fake():
    with FakeIdP(access_token_format="jwt") as idp:
        yield idp


@pytest.fixture(scope="module")
def wss(module_dir, fake):
    server = WebSocketOrigin(module_dir / "wss", WSS_HOST)
    server.trust(fake.issuer, fake.url("jwks"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def plain_ws(module_dir, fake):
    server = WebSocketOrigin(module_dir / "ws", "127.0.0.1", tls=False)
    server.trust(fake.issuer, fake.url("jwks"))
    yield server
    server.close()


def sections(fake, wss, plain_ws) -> str:
    return (provider_section("fake", fake.issuer, redirect_port=0)
            + origin_section(wss.origin_url, "fake", ca_file=wss.ca_pem)
            + origin_section(plain_ws.origin_url, "fake"))


@pytest.fixture(scope="module")
def deployment(module_dir, fake, wss, plain_ws):
    ws = Workspace(module_dir / "main", sections(fake, wss, plain_ws), f"{WSS_HOST}=127.0.0.1")
    ws.ca_init()
    ws.login_fake("fake")
    deployment = Deployment(ws, ws.start_proxy())
    yield deployment
    failure = deployment.stop()
    assert failure is None, failure


def client(deployment: Deployment, url: str, **options):
    """The websockets client through the proxy, trusting what `proxyctl env` says. TLS 1.2 to the proxy: the sync
    client reads its socket in a background thread while the main thread writes the upgrade request, and with
    TLS 1.3 that thread can take the session tickets the server sends after the handshake at the same moment:
    Python's SSL object is not safe for that (python-engineio#461, python-socketio#1568), and about one
    connection in a hundred lost its request or failed with "[SSL] internal error" on the client side, the
    proxy having received only the handshake (its socket state showed it). TLS 1.3 is covered by every other
    client."""
    context = ssl.create_default_context(cafile=deployment.exports["SSL_CERT_FILE"])
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    options.setdefault("ping_interval", None)
    options.setdefault("open_timeout", 30)
    return connect(url, proxy=deployment.exports["HTTPS_PROXY"], ssl=context, **options)


def upgrade_lines(deployment: Deployment, mark: int, target: str, at_least: int) -> list[str]:
    """The upgrade lines since `mark` naming `target`, the test's own path: the line of another test's exchange
    can land after the mark."""
    return deployment.lines(mark, needle="note=\"switched protocols\"", target=target, at_least=at_least)


def tunnel_line(deployment: Deployment, mark: int, label: str) -> str:
    """The line the tunnel writes when it ends (the upgrade's own line has intercepted= in it)."""
    def found():
        lines = [line for line in deployment.proxy.log_since(mark).splitlines()
                 if f" {label} status=101 up=" in line and " intercepted=" not in line]
        return lines[0] if lines else None
    return poll(found, 10, message=f"the tunnel line of {label}")


# MARK: - wss through HTTPS_PROXY


def test_messages_echo_and_the_origin_got_the_token(deployment, wss):
    mark, seen = deployment.proxy.mark(), wss.mark()
    with client(deployment, wss.url("/chat?room=1"), max_size=None) as ws:
        ws.send("hello")
        assert ws.recv(timeout=10) == "hello"
        blob = os.urandom(256 * 1024)
        ws.send(blob)
        assert ws.recv(timeout=30) == blob
    upgrades = wss.since(seen)
    assert len(upgrades) == 1 and upgrades[0]["status"] == 101 and upgrades[0]["sub"], upgrades
    assert upgrades[0]["host"] == wss.authority
    line = upgrade_lines(deployment, mark, f"https://{wss.authority}/chat?", 1)[0]
    assert f"GET https://{wss.authority}/chat?... status=101" in line and "intercepted=fake" in line, line
    # The tunnel's own line when it ends: bytes both ways, no error.
    tunnel = tunnel_line(deployment, mark, f"GET https://{wss.authority}/chat?...")
    up = int(tunnel.split(" up=")[1].split()[0])
    down = int(tunnel.split(" down=")[1].split()[0])
    assert up > 256 * 1024 and down > 256 * 1024, tunnel
    assert "closed=" not in tunnel, tunnel


def test_large_messages_and_bursts_pass_with_backpressure(deployment, wss):
    """A 8 MiB message (far beyond every buffer: the relay pauses a side while the other's output is full)
    and 2,000 small ones sent before any is read, all echoed in order."""
    with client(deployment, wss.url("/big"), max_size=None) as ws:
        big = os.urandom(8 * 1024 * 1024)
        ws.send(big)
        assert hashlib.sha256(ws.recv(timeout=60)).digest() == hashlib.sha256(big).digest()
        for index in range(2000):
            ws.send(f"m{index}")
        assert [ws.recv(timeout=30) for _ in range(2000)] == [f"m{index}" for index in range(2000)]


def test_a_401_to_the_upgrade_is_refreshed_and_replayed_once(deployment, fake, wss):
    before = fake.count("token", grant_type="refresh_token")
    seen = wss.mark()
    wss.reject_next(1)
    with client(deployment, wss.url("/healed")) as ws:
        ws.send("still me")
        assert ws.recv(timeout=10) == "still me"
    upgrades = wss.since(seen)
    assert [u["status"] for u in upgrades] == [401, 101]
    assert upgrades[0]["token"] != upgrades[1]["token"]
    assert fake.count("token", grant_type="refresh_token") == before + 1


def test_a_401_after_the_refresh_reaches_the_client_with_proxy_status(deployment, fake, wss):
    before = fake.count("token", grant_type="refresh_token")
    wss.reject_next(2)
    with pytest.raises(InvalidStatus) as refused:
        with client(deployment, wss.url("/refused")):
            pass
    response = refused.value.response
    assert response.status_code == 401
    assert "rejected by the test" in response.headers["WWW-Authenticate"]
    assert response.headers["Proxy-Status"].startswith("proxyctl; received-status=401"), response.headers
    assert response.body == b"a valid bearer token is required\n"
    assert fake.count("token", grant_type="refresh_token") == before + 1


def test_a_401_naming_another_authorization_server_is_passed_on_without_a_refresh(deployment, fake, wss):
    """An upgrade's 401 naming the origin's resource metadata, which names another authorization server (issue 30):
    checked as a plain request's 401 is, so the client gets the 401 with Proxy-Status naming the mismatch and the
    `proxyctl init --origin` to run, nothing is refreshed and the upgrade is not sent again."""
    before = fake.count("token", grant_type="refresh_token")
    mark, seen = deployment.proxy.mark(), wss.mark()
    wss.metadata_servers = ["https://login.other.test"]
    wss.reject_next(1)
    try:
        with pytest.raises(InvalidStatus) as refused:
            with client(deployment, wss.url("/elsewhere")):
                pass
    finally:
        wss.metadata_servers = None
        wss.reject_next(0)
    response = refused.value.response
    assert response.status_code == 401
    assert "resource_metadata=" in response.headers["WWW-Authenticate"]
    assert response.headers["Proxy-Status"] == (
        'proxyctl; error=proxy_configuration_error; received-status=401; details="the origin\'s resource metadata '
        'names the authorization server https://login.other.test, not the issuer of [provider fake]; set it up '
        f'with: proxyctl init --origin {wss.origin_url}"'), response.headers
    assert [u["status"] for u in wss.since(seen)] == [401]
    assert wss.metadata_fetches >= 1
    assert fake.count("token", grant_type="refresh_token") == before
    log = poll(lambda: "wrong authorization server" in deployment.proxy.log_since(mark)
               and deployment.proxy.log_since(mark), 10, message="the log line")
    assert f"proxyctl init --origin {wss.origin_url}" in log, log


def test_a_step_up_challenge_is_passed_on_untouched(deployment, fake, wss):
    before = fake.count("token", grant_type="refresh_token")
    seen = wss.mark()
    wss.step_up_next(1)
    with pytest.raises(InvalidStatus) as refused:
        with client(deployment, wss.url("/stronger")):
            pass
    response = refused.value.response
    assert response.status_code == 401
    assert 'error="insufficient_user_authentication"' in response.headers["WWW-Authenticate"]
    assert "proxyctl step-up" in response.headers["Proxy-Status"], response.headers
    assert len(wss.since(seen)) == 1, "a step-up is not retried"
    assert fake.count("token", grant_type="refresh_token") == before, "nor refreshed"


def test_the_close_handshake_passes_both_ways(deployment, wss):
    """The server closes (code 1000, "bye"): the client sees that close, and the tunnel ends without an
    error on either side."""
    mark = deployment.proxy.mark()
    with client(deployment, wss.url("/bye")) as ws:
        ws.send("bye")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
        assert closed.value.rcvd.reason == "bye"
    tunnel = tunnel_line(deployment, mark, f"GET https://{wss.authority}/bye")
    assert "closed=" not in tunnel, tunnel


# MARK: - The idle timeout, as configured


# Long enough that the quiet second below cannot reach it on a loaded machine (the test's own thread can stall for
# a second under ASan), short enough to wait for.
IDLE_TIMEOUT = 4


@pytest.fixture
def short_idle(module_dir, deployment, fake, wss, plain_ws, tmp_path):
    """A second proxy on the module's state (tokens, CA) with idle_timeout IDLE_TIMEOUT."""
    ws = Workspace(tmp_path / "idle", sections(fake, wss, plain_ws), f"{WSS_HOST}=127.0.0.1",
                   state=deployment.ws.state, idle_timeout=f"{IDLE_TIMEOUT}s")
    own = Deployment(ws, ws.start_proxy())
    yield own
    own.stop()


def test_an_idle_connection_lives_until_idle_timeout_then_closes(short_idle, wss):
    """Quiet for 1 s (under idle_timeout) and then talking works; quiet for idle_timeout ends the tunnel, not
    sooner, with a log line saying so. (With the default idle_timeout of 10 minutes, the same holds for a
    connection that sleeps 9 minutes.)"""
    mark = short_idle.proxy.mark()
    with client(short_idle, wss.url("/sleepy")) as ws:
        time.sleep(1.0)
        sent = time.monotonic()  # the proxy's last activity on the tunnel comes after this
        ws.send("awake")
        assert ws.recv(timeout=10) == "awake"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=15)
        quiet = time.monotonic() - sent
    # The proxy's clock counts whole milliseconds: a few of them of slack.
    assert quiet >= IDLE_TIMEOUT - 0.01, f"closed after {quiet:.3f}s quiet, idle_timeout is {IDLE_TIMEOUT}s"
    line = short_idle.lines(mark, needle="closed=\"idle timeout\"", at_least=1)[0]
    assert f"GET https://{wss.authority}/sleepy status=101" in line


# MARK: - A protected ws:// origin on the front door


def frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """One masked client frame (RFC 6455 §5.2)."""
    mask = os.urandom(4)
    header = bytes([0x80 | opcode])
    if len(payload) < 126:
        header += bytes([0x80 | len(payload)])
    elif len(payload) < 65536:
        header += bytes([0x80 | 126]) + len(payload).to_bytes(2, "big")
    else:
        header += bytes([0x80 | 127]) + len(payload).to_bytes(8, "big")
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def read_frame(reader: Reader) -> tuple[int, bytes]:
    first, second = reader.read_exact(2)
    length = second & 0x7F
    if length == 126:
        length = int.from_bytes(reader.read_exact(2), "big")
    elif length == 127:
        length = int.from_bytes(reader.read_exact(8), "big")
    return first & 0x0F, reader.read_exact(length)


def test_an_absolute_form_upgrade_to_a_protected_ws_origin(deployment, plain_ws):
    """A client that sends its upgrade to the proxy itself (GET http://... with Upgrade: websocket) gets it
    with the token attached, the origin's 101 (with the right Sec-WebSocket-Accept), then a tunnel."""
    seen = plain_ws.mark()
    key = base64.b64encode(os.urandom(16)).decode()
    proxy = urllib.parse.urlsplit(deployment.exports["HTTPS_PROXY"])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=20) as sock:
        sock.sendall((f"GET {plain_ws.origin_url}/plain HTTP/1.1\r\nHost: {plain_ws.authority}\r\n"
                      f"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: {key}\r\n"
                      "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        reader = Reader(sock)
        head = reader.read_head()
        assert head.status == 101, head.head
        accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
        assert head.header("sec-websocket-accept") == accept.decode()
        sock.sendall(frame(b"over the front door"))
        assert read_frame(reader) == (0x1, b"over the front door")
    upgrades = plain_ws.since(seen)
    assert len(upgrades) == 1 and upgrades[0]["status"] == 101 and upgrades[0]["sub"], upgrades


# MARK: - DPoP on the upgrade


@pytest.fixture
def dpop_deployment(tmp_path):
    """Its own fake provider with token_binding = dpop and a wss origin that takes only DPoP-bound tokens with
    a proof for the upgrade."""
    with FakeIdP(access_token_format="jwt") as idp:
        origin = WebSocketOrigin(tmp_path / "dpop-wss", "dpop-ws.test", dpop=True)
        origin.trust(idp.issuer, idp.url("jwks"))
        sections = (provider_section("fake", idp.issuer, redirect_port=0, token_binding="dpop")
                    + origin_section(origin.origin_url, "fake", ca_file=origin.ca_pem))
        ws = Workspace(tmp_path / "dpop", sections, "dpop-ws.test=127.0.0.1")
        ws.ca_init()
        ws.login_fake("fake")
        deployment = Deployment(ws, ws.start_proxy())
        deployment.origin = origin
        try:
            yield deployment
        finally:
            failure = deployment.stop()
            origin.close()
        assert failure is None, failure


def test_a_dpop_proof_for_get_rides_on_the_upgrade_and_a_nonce_challenge_is_met_once(dpop_deployment):
    origin = dpop_deployment.origin
    seen = origin.mark()
    with client(dpop_deployment, origin.url("/bound?x=1")) as ws:
        ws.send("bound")
        assert ws.recv(timeout=10) == "bound"
    first = origin.since(seen)
    assert len(first) == 1 and first[0]["scheme"] == "dpop" and first[0]["proof_htm"] == "GET", first
    # The origin starts demanding its nonce: the upgrade is answered 401 use_dpop_nonce once, then sent again
    # with a new proof carrying it.
    origin.dpop.require_nonce = True
    mark, seen = dpop_deployment.proxy.mark(), origin.mark()
    with client(dpop_deployment, origin.url("/nonce")) as ws:
        ws.send("with nonce")
        assert ws.recv(timeout=10) == "with nonce"
    upgrades = origin.since(seen)
    assert [u["status"] for u in upgrades] == [401, 101]
    assert upgrades[1]["proof_nonce"] == origin.dpop.current_nonce(origin.authority)
    line = upgrade_lines(dpop_deployment, mark, f"https://{origin.authority}/nonce ", 1)[0]
    assert "attempts=2" in line and "nonce_retry=1" in line, line


# MARK: - WebSocket over HTTP/2 (RFC 8441)


def test_a_websocket_over_http2_extended_connect(deployment, wss):
    """An HTTP/2 client opens the WebSocket with extended CONNECT (:protocol websocket): the proxy sends the
    origin an HTTP/1.1 upgrade with the token, answers 200 when it switched, and the stream carries the frames
    both ways."""
    from fixtures.h2client import H2Client

    seen, mark = wss.mark(), deployment.proxy.mark()
    proxy = urllib.parse.urlsplit(deployment.exports["HTTPS_PROXY"])
    with H2Client(proxy.port, wss.authority, deployment.exports["SSL_CERT_FILE"]) as h2:
        while h2.conn.remote_settings.enable_connect_protocol != 1:
            assert h2.pump(), "no SETTINGS_ENABLE_CONNECT_PROTOCOL from the proxy (RFC 8441 §3)"
        stream = h2.send_headers("CONNECT", "/over-h2?x=1", end_stream=False, protocol="websocket",
                                 extra=[("sec-websocket-version", "13")])
        answer = h2.wait_for(stream, lambda a: a.headers)
        assert answer.status == 200, answer
        assert "sec-websocket-accept" not in answer.headers and "upgrade" not in answer.headers
        for text in (b"first over h2", b"x" * 70_000):
            before = len(answer.body)
            h2.send_data(stream, frame(text))
            size = len(text) + (2 if len(text) < 126 else 4 if len(text) < 65536 else 10)
            answer = h2.wait_for(stream, lambda a: len(a.body) >= before + size)
            reader_bytes = answer.body[before:]
            opcode, payload = parse_frame(reader_bytes)
            assert (opcode, payload) == (0x1, text)
        # The client ends its side: the origin sees the end, and the stream ends cleanly.
        h2.send_data(stream, frame(b"\x03\xe8", opcode=0x8), end_stream=True)
        answer = h2.wait(stream)
        assert answer.reset is None
    upgrades = wss.since(seen)
    assert len(upgrades) == 1 and upgrades[0]["status"] == 101 and upgrades[0]["sub"], upgrades
    assert upgrades[0]["path"] == "/over-h2?x=1"
    line = upgrade_lines(deployment, mark, f"https://{wss.authority}/over-h2?", 1)[0]
    assert f"GET https://{wss.authority}/over-h2?... status=101" in line, line


def test_an_extended_connect_is_refreshed_and_replayed_like_an_upgrade(deployment, fake, wss):
    from fixtures.h2client import H2Client

    before = fake.count("token", grant_type="refresh_token")
    seen = wss.mark()
    wss.reject_next(1)
    proxy = urllib.parse.urlsplit(deployment.exports["HTTPS_PROXY"])
    with H2Client(proxy.port, wss.authority, deployment.exports["SSL_CERT_FILE"]) as h2:
        stream = h2.send_headers("CONNECT", "/h2-healed", end_stream=False, protocol="websocket",
                                 extra=[("sec-websocket-version", "13")])
        answer = h2.wait_for(stream, lambda a: a.headers)
        assert answer.status == 200, answer
    assert [u["status"] for u in wss.since(seen)] == [401, 101]
    assert fake.count("token", grant_type="refresh_token") == before + 1


def test_an_extended_connect_refused_twice_gets_the_401_on_its_stream(deployment, wss):
    from fixtures.h2client import H2Client

    wss.reject_next(2)
    proxy = urllib.parse.urlsplit(deployment.exports["HTTPS_PROXY"])
    with H2Client(proxy.port, wss.authority, deployment.exports["SSL_CERT_FILE"]) as h2:
        stream = h2.send_headers("CONNECT", "/h2-refused", end_stream=False, protocol="websocket",
                                 extra=[("sec-websocket-version", "13")])
        answer = h2.wait(stream)
        assert answer.status == 401, answer
        assert answer.header("proxy-status").startswith("proxyctl; received-status=401"), answer
        assert answer.body == b"a valid bearer token is required\n"
        # The connection goes on: another stream works.
        wss.reject_next(0)
        again = h2.send_headers("CONNECT", "/h2-after", end_stream=False, protocol="websocket",
                                extra=[("sec-websocket-version", "13")])
        assert h2.wait_for(again, lambda a: a.headers).status == 200


def parse_frame(data: bytes) -> tuple[int, bytes]:
    """One unmasked server frame from the start of `data`."""
    opcode, length, offset = data[0] & 0x0F, data[1] & 0x7F, 2
    if length == 126:
        length, offset = int.from_bytes(data[2:4], "big"), 4
    elif length == 127:
        length, offset = int.from_bytes(data[2:10], "big"), 10
    return opcode, data[offset:offset + length]
