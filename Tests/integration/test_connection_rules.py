"""The connection machine's rules, end to end with the real binary (each was a defect of the callback code it
replaced): no automatic resend of a non-idempotent request, one rule for upgrades to protected origins on
both ways in, settings captured per connection (a SIGHUP does not change an exchange in flight), WebSocket
upgrades on passthrough becoming tunnels, and the intercepted target reaching the origin byte for byte."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest

from fixtures import config
from fixtures.http import Reader, open_tunnel, reset_close


def token() -> str:
    return uuid.uuid4().hex[:12]


def request(method: str, origin, path: str, extra: str = "") -> bytes:
    return f"{method} {origin.url(path)} HTTP/1.1\r\nHost: {origin.authority}\r\n{extra}\r\n".encode()


# MARK: - RFC 9110 §9.2.2: a proxy must not resend a non-idempotent request on its own


@pytest.mark.parametrize("method, sent_times", [("GET", 2), ("DELETE", 2), ("POST", 1), ("PATCH", 1)])
def test_a_request_on_a_kept_alive_connection_the_origin_closed_is_resent_only_when_idempotent(
        proxy, echo_origin, method, sent_times):
    """The origin answers a first request and keeps the connection; it reads the second and closes without a
    byte of response (a keep-alive race). An idempotent method without a body is sent once more on a new
    connection (which closes the same way here: no third try); a POST, even with Content-Length: 0, never is."""
    tag = token()
    echo_origin.respond(f"/stale/{tag}", b"", close=True)
    with proxy.connect() as sock:
        reader = Reader(sock)
        sock.sendall(request("GET", echo_origin, f"/first/{tag}"))
        assert reader.read_response().status == 200
        sock.sendall(request(method, echo_origin, f"/stale/{tag}", "Content-Length: 0\r\n"))
        answer = reader.read_response(method)
    assert answer.status == 502
    assert answer.header("proxy-status").startswith("proxyctl; error=http_response_incomplete")
    seen = echo_origin.requests_with(f"/stale/{tag}")
    assert len(seen) == sent_times, f"{method} reached the origin {len(seen)} times"
    if sent_times == 2:
        assert seen[0].connection != seen[1].connection, "the resend goes on a new connection"
        proxy.wait_log(rf"{method} \S+/stale/{tag} note=\"the kept-alive connection to \S+ closed unanswered; "
                       rf"sent again on a new one\"")
    else:
        proxy.wait_log(rf"{method} \S+/stale/{tag} status=502 error=http_response_incomplete .*"
                       rf"a {method} is not sent twice")


# MARK: - Settings per connection


def test_sighup_does_not_change_the_timeouts_of_an_exchange_in_flight(proxy_factory):
    """idle_timeout 1s; the origin answers after 2s; a SIGHUP raising idle_timeout to 5s arrives while the
    request waits. The exchange keeps the settings it was accepted with (504 after 1s: before, it re-read the
    new value and waited); a connection accepted after the reload gets the new ones (the same slow answer
    arrives)."""
    proxy = proxy_factory(idle_timeout="1s")
    tag = token()
    slow = SlowOrigin(delay=2.0)
    try:
        with proxy.connect() as sock:
            sock.sendall(f"GET {slow.url(f'/slow/{tag}')} HTTP/1.1\r\nHost: {slow.authority}\r\n\r\n".encode())
            slow.wait_requests(1)
            mark = proxy.mark()
            proxy.config_path.write_text(proxy.config_path.read_text().replace("idle_timeout = 1s",
                                                                               "idle_timeout = 5s"))
            proxy.signal(1)  # SIGHUP
            proxy.wait_log("SIGHUP: configuration reloaded", since=mark)
            answer = Reader(sock).read_response()
            assert answer.status == 504, "the exchange in flight took the reloaded settings"
            assert answer.header("proxy-status").startswith("proxyctl; error=http_response_timeout")
            assert "within 1s" in answer.header("proxy-status")
        with proxy.connect() as sock:
            sock.sendall(f"GET {slow.url(f'/slow2/{tag}')} HTTP/1.1\r\nHost: {slow.authority}\r\n\r\n".encode())
            assert Reader(sock).read_response().status == 200, "a new connection gets the reloaded settings"
    finally:
        slow.close()


class SlowOrigin:
    """Answers every request with 200 after `delay` seconds."""

    def __init__(self, delay: float):
        self.delay = delay
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.count = 0
        self.condition = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def authority(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"http://{self.authority}{path}"

    def wait_requests(self, count: int) -> None:
        with self.condition:
            assert self.condition.wait_for(lambda: self.count >= count, 10), "the slow origin got no request"

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                Reader(sock).read_until(b"\r\n\r\n")
            except (EOFError, OSError):
                return
            with self.condition:
                self.count += 1
                self.condition.notify_all()
            time.sleep(self.delay)
            try:
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nslow")
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


# MARK: - Upgrades


def test_a_websocket_upgrade_on_passthrough_becomes_a_tunnel(proxy, echo_origin):
    """A plain-HTTP upgrade to an origin that is not protected: the 101 reaches the client, then bytes flow
    both ways untouched, and the log names the upgraded request, not a CONNECT."""
    tag = token()
    echo_origin.respond(
        f"/ws/{tag}",
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\nserver-frame")
    mark = proxy.mark()
    with proxy.connect() as sock:
        sock.sendall(request("GET", echo_origin, f"/ws/{tag}", "Connection: Upgrade\r\nUpgrade: websocket\r\n"))
        reader = Reader(sock)
        head = reader.read_head()
        assert head.status == 101 and head.header("upgrade") == "websocket"
        assert reader.read_exact(len(b"server-frame")) == b"server-frame"
    received = echo_origin.wait_request(f"/ws/{tag}")
    assert b"Connection: upgrade\r\n" in received.head and b"Upgrade: websocket\r\n" in received.head
    proxy.wait_log(rf"GET http://127\.0\.0\.1:{echo_origin.port}/ws/{tag} status=101 up=\d+ down=\d+", since=mark)
    assert not [line for line in proxy.request_lines(mark) if "CONNECT" in line]


def protected_http_config(port: int, origin_port: int) -> str:
    """A proxy with one protected http:// origin on loopback, never signed in."""
    return (config.proxy(listen=f"127.0.0.1:{port}", log_level="info", connect_timeout="5s", shutdown_grace="3s")
            + config.provider("corp", "https://login.example.test", client_id="proxyctl")
            + config.origin(f"http://127.0.0.1:{origin_port}", "corp"))


def test_an_upgrade_to_a_protected_http_origin_follows_the_token_rules(proxy_factory, echo_origin):
    """Before, the Upgrade field was stripped and the request went out as an ordinary one with the token. An
    upgrade is now a protected exchange like any other (test_websocket.py has the whole of it): without a
    sign-in it is the same 401 naming the login, and the origin is never contacted."""
    proxy = proxy_factory(raw_config=protected_http_config(0, echo_origin.port))
    tag = token()
    with proxy.connect() as sock:
        sock.sendall(request("GET", echo_origin, f"/ws/{tag}", "Connection: Upgrade\r\nUpgrade: websocket\r\n"))
        answer = Reader(sock).read_response()
    assert answer.status == 401
    assert "run proxyctl login corp" in answer.header("proxy-status")
    assert not echo_origin.requests_with(f"/ws/{tag}")


def test_a_protected_http_origin_without_sign_in_is_401_naming_the_login(proxy_factory, echo_origin):
    proxy = proxy_factory(raw_config=protected_http_config(0, echo_origin.port))
    tag = token()
    with proxy.connect() as sock:
        sock.sendall(request("GET", echo_origin, f"/data/{tag}"))
        answer = Reader(sock).read_response()
    assert answer.status == 401
    assert "run proxyctl login corp" in answer.header("proxy-status")
    assert not echo_origin.requests_with(f"/data/{tag}")


# MARK: - Resets and trailers


class ResettingOrigin:
    """Accepts a connection, reads what comes, sends `payload`, then resets the connection (SO_LINGER 0)."""

    def __init__(self, payload: bytes):
        self.payload = payload
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def authority(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            sock.settimeout(5)
            try:
                sock.recv(65536)
                sock.sendall(self.payload)
                time.sleep(0.2)
            except OSError:
                pass
            reset_close(sock)

    def close(self) -> None:
        self.listener.close()


def read_until_end(sock: socket.socket) -> tuple[bytes, str]:
    """Everything the socket delivers, and how it ended: "eof" (a clean close) or "reset"."""
    data = b""
    sock.settimeout(10)
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data, "reset"
        if not chunk:
            return data, "eof"
        data += chunk


def test_an_origin_reset_reaches_the_client_of_a_tunnel_as_a_reset(proxy):
    origin = ResettingOrigin(b"some bytes")
    try:
        sock, _, answer = open_tunnel(proxy.port, origin.authority)
        assert answer.status == 200
        with sock:
            sock.sendall(b"hello")
            data, end = read_until_end(sock)
        assert data == b"some bytes"
        assert end == "reset", "a reset upstream reached the client as a clean close"
    finally:
        origin.close()


def test_a_read_until_close_body_cut_by_a_reset_is_not_taken_for_complete(proxy, curl):
    """A response framed by the close, then a reset: curl must fail (it once exited 0 with a cut body)."""
    origin = ResettingOrigin(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npartial body")
    try:
        result = curl("-x", proxy.url, f"http://{origin.authority}/cut")
        assert result.returncode != 0, "curl took a body cut by a reset for a complete one"
        assert b"reset" in result.stderr.lower() or result.returncode in (18, 56), result.stderr
    finally:
        origin.close()


def test_framing_and_routing_fields_in_a_trailer_do_not_travel(proxy, echo_origin):
    tag = token()
    body = (b"5\r\nhello\r\n0\r\nX-Checksum: abc\r\nContent-Length: 999\r\nHost: evil.test\r\n"
            b"Proxy-Authorization: Basic c2VjcmV0\r\nX-After: 1\r\n\r\n")
    with proxy.connect() as sock:
        sock.sendall(request("POST", echo_origin, f"/trailer/{tag}", "Transfer-Encoding: chunked\r\n") + body)
        assert Reader(sock).read_response().status == 200
    received = echo_origin.wait_request(f"/trailer/{tag}")
    assert received.body == b"5\r\nhello\r\n0\r\nX-Checksum: abc\r\nX-After: 1\r\n\r\n"
