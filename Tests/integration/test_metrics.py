"""The admin listener (`admin_listen`): /healthz, /readyz and /metrics. A scripted run of known requests, then
/metrics parsed with prometheus_client's parser (code this project did not write) and each counter compared
with what the test did; no label may carry a path, a query, a host the client asked for, a token or a user.
"""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fixtures import config
from fixtures.http import Reader, connect, free_port, open_tunnel
from fixtures.origins import Origin
from fixtures.proxy import poll
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
    for raw, expected in ((b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
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
