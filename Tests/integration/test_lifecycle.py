"""Signals and configuration checks: SIGHUP reloads, SIGTERM drains within shutdown_grace, serve --check."""

from __future__ import annotations

import hashlib
import re
import signal
import socket
import threading
import time

import pytest

from fixtures import config
from fixtures.content import MiB, expected_sha256
from fixtures.http import Reader, Response, free_port, open_tunnel
from fixtures.proxy import Proxy, poll, run_proxyctl


def get(proxy, origin, path: str) -> Response:
    with proxy.connect() as sock:
        sock.sendall(f"GET {origin.url(path)} HTTP/1.1\r\nHost: {origin.authority}\r\nConnection: close\r\n\r\n"
                     .encode())
        return Reader(sock).read_response()


def test_sighup_applies_a_changed_valid_configuration(proxy, http_origin):
    long_path = "/" + "p" * 600
    assert get(proxy, http_origin, long_path).status == 200
    proxy.wait_log(rf"GET http://127\.0\.0\.1:{http_origin.port}/p+ status=200")

    # Quieter, and a smaller request line limit that shows on the wire. ("configuration reloaded" is an
    # info line, so at warn the 414 is the sign that the reload happened.)
    proxy.config_path.write_text(config.proxy(log_level="warn", connect_timeout="5s", shutdown_grace="3s",
                                               max_request_line="512"))
    proxy.signal(signal.SIGHUP)
    poll(lambda: get(proxy, http_origin, long_path).status == 414, 10, interval=0.1,
         message="the new max_request_line to apply")
    mark = proxy.mark()
    assert get(proxy, http_origin, "/quiet").status == 200
    assert "/quiet" not in proxy.log_since(mark), "log_level = warn must not log requests"

    # And back.
    proxy.config_path.write_text(config.proxy(log_level="info", connect_timeout="5s", shutdown_grace="3s"))
    proxy.signal(signal.SIGHUP)
    proxy.wait_log(r"SIGHUP: configuration reloaded", since=mark)
    assert get(proxy, http_origin, long_path).status == 200
    assert get(proxy, http_origin, "/loud").status == 200
    proxy.wait_log(rf"GET http://127\.0\.0\.1:{http_origin.port}/loud status=200", since=mark)


def test_sighup_with_a_broken_configuration_keeps_serving_the_old_one(proxy, http_origin):
    proxy.config_path.write_text("[proxy]\nlog_level = info\nconnect_timeout = soon\n")
    mark = proxy.mark()
    proxy.signal(signal.SIGHUP)
    proxy.wait_log(r"SIGHUP: the new configuration has errors", since=mark)
    proxy.wait_log(rf"{proxy.config_path}:3: \[proxy\] connect_timeout", since=mark)
    assert proxy.process.poll() is None
    assert get(proxy, http_origin, "/still-serving").status == 200
    proxy.wait_log(rf"GET http://127\.0\.0\.1:{http_origin.port}/still-serving status=200", since=mark)


def test_sighup_with_a_missing_configuration_file_keeps_serving(proxy, http_origin):
    proxy.config_path.unlink()
    mark = proxy.mark()
    proxy.signal(signal.SIGHUP)
    proxy.wait_log(r"SIGHUP: the new configuration has errors", since=mark)
    proxy.wait_log(rf"{proxy.config_path}: the configuration file does not exist", since=mark)
    assert get(proxy, http_origin, "/no-file").status == 200


class Download(threading.Thread):
    """Reads one response in the background, through the proxy (plain or tunnel), and remembers the result.
    The connection stays open after the response, as a keep-alive client's would, until the client is done
    with it (`end`)."""

    def __init__(self, proxy, mode, http_origin, https_origin, cert, path: str):
        super().__init__(daemon=True)
        self.mode = mode
        self.closed_by_proxy: bool | None = None
        if mode == "tunnel":
            raw, _, answer = open_tunnel(proxy.port, f"localhost:{https_origin.port}")
            assert answer.status == 200
            self.sock = cert.client_context().wrap_socket(raw, server_hostname="localhost")
            self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost:{https_origin.port}\r\n\r\n".encode())
        else:
            self.sock = proxy.connect()
            self.sock.sendall(f"GET {http_origin.url(path)} HTTP/1.1\r\nHost: {http_origin.authority}\r\n\r\n"
                              .encode())
        self.reader = Reader(self.sock, timeout=60)
        self.head = self.reader.read_head()
        self.body = bytearray()
        self.finished_at: float | None = None
        self.error: BaseException | None = None

    def run(self):
        length = int(self.head.header("content-length"))
        try:
            while len(self.body) < length:
                data = self.reader.read_some(length - len(self.body))
                if not data:
                    break
                self.body += data
        except OSError as error:
            self.error = error
        self.finished_at = time.monotonic()
        if self.error is None and len(self.body) == length:
            self.end()

    def end(self):
        """What a client with its whole answer and nothing more to ask does, at once (the proxy's exit waits
        for it, so it must not wait for the test's main thread): a drained keep-alive connection, which the
        proxy ends by itself while shutting down, is closed on seeing the proxy's end (the proxy lingers up to
        2 s for the client's); a tunnel, in use until the client closes it, is closed."""
        if self.mode == "plain":
            self.closed_by_proxy = self.reader.closed_by_peer(10)
        self.sock.close()


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        # The probe's SYN was queued on the listener in the instant it closed: the kernel resets what it had
        # not accepted. Not served, but not the closed listener's answer yet either: ask again.
        return False


@pytest.mark.parametrize("mode", ["plain", "tunnel"])
def test_sigterm_lets_a_slow_download_finish_then_exits_0(mode, proxy_factory, http_origin, https_origin, cert):
    grace = 8
    proxy = proxy_factory(shutdown_grace=f"{grace}s")
    size = 2 * MiB
    download = Download(proxy, mode, http_origin, https_origin, cert, f"/slow/{size}?seconds=2")
    assert download.head.status == 200
    download.start()
    signalled = time.monotonic()
    proxy.signal(signal.SIGTERM)
    # New connections are refused at once...
    poll(lambda: refuses_connections(proxy.port), 5, message="the listener to close")
    proxy.wait_log(rf"shutting down: waiting up to {grace}s for 1 connection")
    # ...while the transfer runs to its end.
    download.join(30)
    assert download.error is None
    assert hashlib.sha256(download.body).hexdigest() == expected_sha256(size)
    if mode == "plain":
        # A tunnel is in use until the client closes it; a drained keep-alive HTTP connection is not: the proxy
        # ended it without waiting for the client.
        assert download.closed_by_proxy, "the proxy kept the drained keep-alive connection open"
    code = proxy.wait(grace + 5)
    exited = time.monotonic()
    assert code == 0, proxy.log()
    assert exited - signalled < grace, "the proxy waited for the whole grace period"
    assert exited - download.finished_at < 5, (
        f"the proxy exited {exited - download.finished_at:.1f}s after the last transfer finished; "
        "a connection with nothing in flight should not hold the shutdown")
    proxy.wait_log(rf"(GET|CONNECT) \S+ status=200 up=\d+ down=\d+")
    download.sock.close()


@pytest.mark.parametrize("mode", ["plain", "tunnel"])
def test_sigterm_cuts_transfers_that_outlast_shutdown_grace(mode, proxy_factory, http_origin, https_origin, cert):
    proxy = proxy_factory(shutdown_grace="1s")
    size = 4 * MiB
    download = Download(proxy, mode, http_origin, https_origin, cert, f"/slow/{size}?seconds=40")
    download.start()
    signalled = time.monotonic()
    proxy.signal(signal.SIGTERM)
    code = proxy.wait(15)
    elapsed = time.monotonic() - signalled
    assert code == 0
    assert 0.9 <= elapsed < 6, f"shutdown_grace = 1s, exited after {elapsed:.1f}s"
    download.join(15)
    assert len(download.body) < size
    assert "grace period over" in proxy.log()
    download.sock.close()


def test_sigint_stops_like_sigterm(proxy):
    proxy.signal(signal.SIGINT)
    assert proxy.wait(10) == 0
    assert "shutting down" in proxy.log()


def test_idle_keepalive_connections_do_not_delay_shutdown(proxy, http_origin):
    with proxy.connect() as sock:
        sock.sendall(f"GET {http_origin.url('/idle')} HTTP/1.1\r\nHost: {http_origin.authority}\r\n\r\n".encode())
        reader = Reader(sock)
        assert reader.read_response().status == 200
        started = time.monotonic()
        proxy.signal(signal.SIGTERM)
        assert proxy.wait(10) == 0
        assert time.monotonic() - started < 2
        assert reader.closed_by_peer(5)


def test_check_accepts_a_good_configuration(tmp_path):
    conf = tmp_path / "good.conf"
    conf.write_text(config.proxy(listen="127.0.0.1:0", connect_timeout="3s", idle_timeout="2m",
                                  keepalive_timeout="30s", header_timeout="10s", shutdown_grace="500ms",
                                  max_request_line="16KiB", max_header_bytes="128KiB", max_headers=200,
                                  max_connections=100, log_level="debug",
                                  upstream_proxy="http://user:pa55@127.0.0.1:3128",
                                  no_upstream_proxy="localhost, 10.0.0.0/8, .internal.example"))
    result = run_proxyctl(tmp_path, "serve", "--config", str(conf), "--check")
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout
    assert "pa55" not in result.stdout + result.stderr


def test_check_names_file_line_and_key_of_every_error(tmp_path):
    conf = tmp_path / "bad.conf"
    conf.write_text("[proxy]\nlisten = 127.0.0.1:0\nconnect_timeout = banana\n# comment\nmax_headers = lots\n"
                    "colour = blue\n")
    result = run_proxyctl(tmp_path, "serve", "--config", str(conf), "--check")
    assert result.returncode == 1
    assert f"{conf}:3: [proxy] connect_timeout:" in result.stderr
    assert f"{conf}:5: [proxy] max_headers:" in result.stderr
    assert f"{conf}:6: [proxy] colour:" in result.stderr


def test_check_refuses_a_missing_file(tmp_path):
    result = run_proxyctl(tmp_path, "serve", "--config", str(tmp_path / "absent.conf"), "--check")
    assert result.returncode == 1
    assert "absent.conf" in result.stderr and "does not exist" in result.stderr


def test_without_config_flag_only_the_private_xdg_directory_is_looked_at(tmp_path, http_origin):
    """The fixtures give proxyctl its own HOME and XDG_CONFIG_HOME: without --config it looks there, and
    nowhere near the user's real configuration."""
    proxy = Proxy(tmp_path / "bare", config=None).start()
    try:
        xdg = proxy.env["XDG_CONFIG_HOME"]
        assert xdg.startswith(str(tmp_path))
        proxy.wait_log(rf"no configuration file at {xdg}/proxyctl/proxy.conf")
        assert get(proxy, http_origin, "/bare").status == 200
    finally:
        assert proxy.stop() == 0


def test_a_second_serve_on_a_taken_port_names_who_listens_and_a_free_port(tmp_path):
    """`serve` of a second configuration on the port of a running one: the message names that serve (its pid
    and file, from its record in the shared state directory) and a free port for the second file's `listen`;
    another program on the port is named as such."""
    port = free_port()
    state = tmp_path / "state"
    first = Proxy(tmp_path / "first", config.proxy(listen=f"127.0.0.1:{port}", state_dir=state, shutdown_grace="3s"),
                  listen=None).start()
    try:
        second = tmp_path / "second.conf"
        second.write_text(config.proxy(listen=f"127.0.0.1:{port}", state_dir=state))
        taken = run_proxyctl(tmp_path, "serve", "--config", str(second))
        assert taken.returncode == 1, taken
        found = re.search(
            "^" + re.escape(f"proxyctl: proxyctl serve (pid {first.pid}, config {first.config_path}) already listens on "
                      f"127.0.0.1:{port}; stop it (kill {first.pid}), or set listen = 127.0.0.1:") + r"(\d+)"
            + re.escape(f" in [proxy] of {second} (or give --listen 127.0.0.1:") + r"(\d+)\)$", taken.stderr, re.M)
        assert found and found.group(1) == found.group(2), taken.stderr
        # The port it names is free: the second configuration serves there.
        second.write_text(config.proxy(listen=f"127.0.0.1:{found.group(1)}", state_dir=state, shutdown_grace="3s"))
        moved = Proxy(tmp_path / "moved", None, listen=None, args=("--config", str(second))).start()
        assert moved.port == int(found.group(1))
        assert moved.stop() == 0

        # With --listen, the fix is another --listen; another program is not called proxyctl.
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            other.listen()
            busy = other.getsockname()[1]
            flag = run_proxyctl(tmp_path, "serve", "--config", str(second), "--listen", f"127.0.0.1:{busy}")
            assert flag.returncode == 1, flag
            assert re.search(
                "^" + re.escape(f"proxyctl: another program already listens on 127.0.0.1:{busy} (ss -ltnp 'sport = :{busy}' "
                          "shows which); stop it, or give another port: --listen 127.0.0.1:") + r"\d+$",
                flag.stderr, re.M), flag.stderr
    finally:
        assert first.stop() == 0
