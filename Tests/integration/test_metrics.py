"""The admin listener (`admin_listen`): /healthz, /readyz and /metrics. A scripted run of known requests, then
/metrics parsed with prometheus_client's parser (code this project did not write) and each counter compared
with what the test did; no label may carry a path, a query, a host the client asked for, a token or a user.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fixtures import config
from fixtures.http import Reader, connect, free_port, open_tunnel
from fixtures.origins import Origin
from fixtures.proxy import SANITIZER, poll
from idp_fake import FakeIdP
from resource_server import ResourceServer
from test_protected import Deployment, Workspace

API, NOLOGIN = "api.test", "nologin.test"


def admin_url(proxy) -> str:
    # The line after the listening one that Proxy.start waits for, in a write of its own: waited for too.
    return proxy.wait_log(r"health and metrics on (http://\S+) ")[0].group(1)


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=10) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    status, content_type, text = get(base + "/metrics")
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4"), (status, content_type)
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples, text


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def deployment(tmp_path):
    rs = ResourceServer(tmp_path / "rs", [API, NOLOGIN])
    with FakeIdP(access_token_format="jwt", expires_in=3600) as fake:
        rs.trust(fake.issuer, fake.url("jwks"))
        sections = (config.provider("fake", fake.issuer, redirect_port=0)
                    + config.provider("nobody", fake.issuer, redirect_port=0)
                    + config.origin(f"https://{API}:{rs.port}", "fake", ca_file=rs.ca_pem)
                    + config.origin(f"https://{NOLOGIN}:{rs.port}", "nobody", ca_file=rs.ca_pem))
        ws = Workspace(tmp_path / "ws", sections, f"{API}=127.0.0.1, {NOLOGIN}=127.0.0.1",
                       admin_listen="127.0.0.1:0")
        ws.ca_init()
        ws.login_fake("fake")
        deployment = Deployment(ws, ws.start_proxy())
        deployment.rs = rs
        try:
            yield deployment
        finally:
            deployment.stop()
            rs.close()


def test_metrics_count_what_the_test_did(deployment, tmp_path):
    rs, proxy = deployment.rs, deployment.proxy
    base = admin_url(proxy)
    assert get(base + "/healthz")[:1] == (200,)
    status, _, reasons = get(base + "/readyz")
    assert status == 503 and f"https://{NOLOGIN}:{rs.port}: not signed in to nobody" in reasons, reasons
    assert "fake" not in reasons.replace("nobody", ""), "the signed-in provider is ready"
    assert get(base + "/nothing")[0] == 404
    # Abuse: what is not a request gets the one parser's answer, and only GET and HEAD are served.
    host, port = base[len("http://"):].rsplit(":", 1)
    for raw, expected in ((b"POST /metrics HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n", 405),
                          (b"GET /metrics HTTP/1.1\r\nHost : x\r\n\r\n", 400),
                          (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n", 414)):
        sock = connect(int(port), host)
        sock.sendall(raw)
        assert Reader(sock).read_head().status == expected, raw[:40]
        sock.close()
    # Never on the proxy's own port.
    assert base != proxy.url

    origin = Origin()
    try:
        # 2 forwarded plain-HTTP requests (passthrough, 200).
        for path in ("/one?secret=1", "/two"):
            answer = deployment.curl(origin.url(path))
            assert answer.status == 200, answer
        # 1 blind tunnel that carries one exchange of known size.
        sock, reader, response = open_tunnel(proxy.port, origin.authority)
        assert response.status == 200
        request = f"GET /tunnelled HTTP/1.1\r\nHost: {origin.authority}\r\nConnection: close\r\n\r\n".encode()
        sock.sendall(request)
        received = reader.read_to_eof()
        sock.close()
        # 1 CONNECT nobody answers (502 connection_refused), 1 request that is no proxy request (400).
        closed = free_port()
        refused = deployment.curl(f"https://127.0.0.1:{closed}/", "--proxytunnel")
        assert refused.status in (0, 502), refused
        raw = connect(proxy.port)
        raw.sendall(b"GET /not-a-proxy-request HTTP/1.1\r\nHost: x\r\n\r\n")
        assert Reader(raw).read_response().status == 400
        raw.close()
    finally:
        origin.close()
    # Intercepted: 2 requests with the token, then one the origin rejects once (refresh and replay), and one
    # for the origin whose provider nobody signed in to (401 from the proxy).
    for path in ("/a", "/b"):
        assert deployment.curl(rs.url(path, API)).status == 200
    rs.reject_next(1)
    assert deployment.curl(rs.url("/replayed", API)).status == 200
    assert deployment.curl(rs.url("/x", NOLOGIN)).status == 401

    def settled():
        samples, text = scrape(base)
        done = (value(samples, "proxyctl_connections_open") == 0
                and value(samples, "proxyctl_tunnels_total", kind="blind") >= 1)
        return (samples, text) if done else None
    samples, text = poll(settled, 15, message="every connection to close")

    assert value(samples, "proxyctl_requests_total", kind="passthrough", status_class="2xx") == 2
    assert value(samples, "proxyctl_requests_total", kind="connect", status_class="2xx") == 1 + 4  # blind + intercepted
    assert value(samples, "proxyctl_requests_total", kind="connect", status_class="5xx") == 1
    assert value(samples, "proxyctl_requests_total", kind="proxy", status_class="4xx") == 1
    assert value(samples, "proxyctl_requests_total", kind="intercepted", status_class="2xx") == 3
    assert value(samples, "proxyctl_requests_total", kind="intercepted", status_class="4xx") == 1
    assert value(samples, "proxyctl_tunnels_total", kind="blind") == 1
    assert value(samples, "proxyctl_tunnels_total", kind="intercepted") == 4
    assert value(samples, "proxyctl_upstream_errors_total", error="connection_refused") == 1
    # The blind tunnel moved exactly the bytes of its exchange.
    assert value(samples, "proxyctl_bytes_total", kind="connect", direction="up") == len(request)
    assert value(samples, "proxyctl_bytes_total", kind="connect", direction="down") == len(received)
    assert value(samples, "proxyctl_tokens_attached_total", provider="fake") == 3  # one per exchange, the replayed one included
    assert value(samples, "proxyctl_replays_total", provider="fake") == 1
    assert value(samples, "proxyctl_token_refreshes_total", provider="fake", outcome="ok") == 1
    assert value(samples, "proxyctl_token_refreshes_total", provider="fake", outcome="failed") == 0
    assert value(samples, "proxyctl_sign_in_needed_total", provider="nobody") == 1
    assert value(samples, "proxyctl_nonce_retries_total", provider="fake") == 0
    assert value(samples, "proxyctl_step_ups_total", provider="fake") == 0
    expiry = deployment.ws.tokens("fake")["expires_at"]
    assert value(samples, "proxyctl_token_expiry_timestamp_seconds", provider="fake") == expiry
    assert value(samples, "proxyctl_request_duration_seconds_count", kind="passthrough") == 2
    assert value(samples, "proxyctl_request_duration_seconds_count", kind="intercepted") == 4
    assert value(samples, "proxyctl_request_duration_seconds_bucket", kind="intercepted", le="+Inf") == 4
    assert value(samples, "proxyctl_connections_accepted_total") >= 9
    # No label carries a path, a query, a host the client asked for, a token or a user.
    token = deployment.ws.tokens("fake")["access_token"]
    for needle in ("/one", "secret", "/replayed", API, NOLOGIN, "127.0.0.1", token):
        assert needle not in text, needle


# MARK: - The admin listener under abuse (issue 32 item 2)


def admin_address(proxy) -> tuple[str, int]:
    host, port = urllib.parse.urlsplit(admin_url(proxy)).netloc.rsplit(":", 1)
    return host, int(port)


def probe(address: tuple[str, int], host_field: str, path: str = "/healthz") -> tuple[int, str, float]:
    """One request on a new connection, as a liveness probe makes it: the status, the body and the seconds from
    the connect to the whole answer."""
    started = time.monotonic()
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host_field}\r\nConnection: close\r\n\r\n".encode())
        response = Reader(sock, timeout=5).read_response()
    return response.status, response.body.decode(), time.monotonic() - started


# A process (not a thread of the test: the probes' timings must not wait for the GIL) that opens `hold`
# connections sending half a request head and reports how many the listener still holds; on a line "churn" it
# keeps opening more as fast as it can, each kept until it holds `hold` again (saying "churning" after the first
# 50), until its standard input closes; then it reports how many it opened in all.
FLOOD = r"""
import collections, select, socket, sys, threading
host, port, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: "
sockets, opened, running = collections.deque(), 0, True
def open_one():
    global opened
    sock = socket.socket()
    try:
        sock.connect((host, port))
        sock.sendall(head)
    except OSError:
        pass  # the listener made room at this one's expense already
    sockets.append(sock)
    opened += 1
    while len(sockets) > hold:
        sockets.popleft().close()
def held_open():
    count = 0
    for sock in sockets:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            count += 1
            continue
        try:
            count += 1 if sock.recv(1, socket.MSG_PEEK) else 0
        except OSError:
            pass
    return count
for _ in range(hold):
    open_one()
print("held", held_open(), flush=True)
if sys.stdin.readline().strip() == "churn":
    def stop():
        global running
        sys.stdin.read()
        running = False
    threading.Thread(target=stop, daemon=True).start()
    for _ in range(50):
        open_one()
    print("churning", flush=True)
    while running:
        open_one()
print("opened", opened, flush=True)
"""


class HalfOpenFlood:
    """The FLOOD process against `address`, holding `hold` half-sent heads."""

    def __init__(self, address: tuple[str, int], hold: int):
        self.process = subprocess.Popen([sys.executable, "-c", FLOOD, address[0], str(address[1]), str(hold)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline().split()
        assert line[:1] == ["held"], line
        self.held = int(line[1])

    def churn(self) -> None:
        """Starts the churn, and returns once it runs (a loaded machine may start the process's loop after a
        whole round of probes: the probes would then not have waited behind anything)."""
        self.process.stdin.write("churn\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline().split()
        assert line[:1] == ["churning"], line

    def stop(self) -> int:
        """Ends the flood; how many connections it opened in all."""
        self.process.stdin.close()
        out = self.process.stdout.read()
        self.process.wait(30)
        return int(out.split()[-1])


def probes(address: tuple[str, int], count: int) -> tuple[list[float], str]:
    """`count` probes of /healthz, each answered 200; their times, sorted, and a summary."""
    timings = []
    for _ in range(count):
        status, body, seconds = probe(address, f"127.0.0.1:{address[1]}")
        assert (status, body) == (200, "ok\n")
        timings.append(seconds)
    timings.sort()
    return timings, f"median {timings[len(timings) // 2] * 1000:.1f} ms, max {timings[-1] * 1000:.1f} ms"


# The bound for a liveness probe. Under AddressSanitizer (scripts/test's second pass) every allocation
# and free of the flood's connections is instrumented and the first probes pay for warming it up: on this shared
# two-core machine the ASan build's slowest probe beside the 1,000 took 40-70 ms in five runs (the release
# build's 0.4-26 ms), so the bound there is 300 ms, which still fails the 8-10 s of connection resets the flood
# caused before.
HEALTHZ_BOUND = 0.1 if SANITIZER is None else 0.3
# While the flood churns: one dropped SYN's retransmission (1 s) and then the bound.
CHURN_MAX = 1.0 + 1.0


def test_a_thousand_half_sent_heads_do_not_blind_healthz(proxy_factory):
    """1,000 connections that send half a request head: `/healthz` once answered with connection resets for 8-10 s
    (the listener held 64 and reset the rest). Now the oldest unfinished head makes room, a connection is handed
    over with its first bytes (TCP_DEFER_ACCEPT) and a probe's head is read at its accept: every probe answers
    200 within 100 ms while the 1,000 are held. Then the flood keeps opening new ones as fast as it can: the
    probes wait behind the flood's connections in the kernel's accept queue, so there every one answers 200,
    half within the bound and all within two seconds (a SYN the full queue dropped is sent again after one)."""
    proxy = proxy_factory(admin_listen="127.0.0.1:0")
    address = admin_address(proxy)
    flood = HalfOpenFlood(address, hold=1000)
    try:
        assert flood.held >= 16, f"the flood holds {flood.held} of the listener's slots"
        held, summary = probes(address, 30)
        print(f"/healthz beside 1,000 half-sent heads: {summary}")
        assert held[-1] < HEALTHZ_BOUND, summary
        flood.churn()
        churned, churn_summary = probes(address, 30)
    finally:
        opened = flood.stop()
    print(f"/healthz while the flood opened {opened - 1000} more: {churn_summary}")
    assert opened > 1030, "the flood ran during the probes"
    # The slowest may have had its SYN dropped by the full accept queue the flood keeps filling: the kernel's
    # first retransmission comes after 1 s (a fresh clone's AddressSanitizer pass, two clones at once: 1,029.6 ms),
    # so the bound for the slowest allows that one retransmission; the 8-10 s of resets before still fail it.
    assert churned[len(churned) // 2] < HEALTHZ_BOUND and churned[-1] < CHURN_MAX, churn_summary
    assert proxy.process.poll() is None


def test_a_head_trickled_in_meets_the_admin_head_deadline(proxy_factory):
    proxy = proxy_factory(admin_listen="127.0.0.1:0", header_timeout="1s")
    address = admin_address(proxy)
    with socket.create_connection(address, timeout=10) as sock:
        started = time.monotonic()
        sock.settimeout(0.2)
        answer = b""
        for byte in b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 100:
            try:
                sock.sendall(bytes([byte]))
                answer += sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if answer:
                break
        elapsed = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert 0.8 < elapsed < 4, f"closed after {elapsed:.1f}s"


@pytest.mark.parametrize("path", ["/metrics", "/readyz", "/healthz"])
def test_a_dns_rebinding_host_is_refused(proxy_factory, path):
    """A web page on evil.example whose name the attacker re-points at 127.0.0.1 reaches the listener with
    `Host: evil.example:PORT`: 421, nothing of the metrics or readiness; its own names are answered."""
    proxy = proxy_factory(admin_listen="127.0.0.1:0", admin_hosts="proxyctl")
    address = admin_address(proxy)
    status, body, _ = probe(address, f"evil.example:{address[1]}", path)
    assert status == 421 and "own address only" in body and "admin_hosts in [proxy]" in body, (status, body)
    assert "proxyctl_" not in body and "ready" not in body
    # Its own names, and a name a scraper was given (a Compose service name) through admin_hosts.
    for host in (f"127.0.0.1:{address[1]}", f"localhost:{address[1]}", "localhost", f"proxyctl:{address[1]}"):
        assert probe(address, host, path)[0] in (200, 503), host
