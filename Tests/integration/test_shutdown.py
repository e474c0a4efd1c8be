"""Shutdown with requests to protected origins in flight, in every order of signals a person, systemd or a
container runtime sends (issue 28: a second SIGTERM aborted the process, `unowned` reference to a freed
object, when transfers were in flight). Each case: a server-sent event stream from an HTTP/1.1 origin and a
held response from an HTTP/2 origin and an upload whose body has not ended, all through the proxy, then two signals back to back or 0.3 s apart.
The proxy must exit 0 within the grace period, and under AddressSanitizer without a report (conftest fails the
test on any crash report).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from fixtures import config
from fixtures.deployment import Deployment, Workspace
from fixtures.h2_origin import H2Origin
from idp_fake import FakeIdP
from resource_server import ResourceServer

API, H2 = "api.test", "h2.test"


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shutdown")


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
def h2(module_dir):
    server = H2Origin(module_dir / "h2", H2)
    yield server
    server.close()


FIRST = {"TERM": signal.SIGTERM, "INT": signal.SIGINT, "HUP": signal.SIGHUP}
SECOND = {"TERM": signal.SIGTERM, "INT": signal.SIGINT}


@pytest.mark.parametrize("delay", [0.0, 0.3], ids=["back-to-back", "apart"])
@pytest.mark.parametrize("second", SECOND)
@pytest.mark.parametrize("first", FIRST)
def test_two_signals_with_transfers_in_flight_end_cleanly(tmp_path, fake, rs, h2, first, second, delay):
    sections = (config.provider("fake", fake.issuer, scopes="openid", redirect_port=0)
                + config.origin(f"https://{API}:{rs.port}", "fake", ca_file=rs.ca_pem)
                + config.origin(f"https://{h2.authority}", "fake", ca_file=h2.ca_pem))
    ws = Workspace(tmp_path / "ws", sections, f"{API}=127.0.0.1, {H2}=127.0.0.1", shutdown_grace="2s")
    ws.ca_init()
    ws.login_fake("fake")
    deployment = Deployment(ws, ws.start_proxy())
    rs_mark, h2_mark = rs.mark(), h2.mark()
    clients = [
        subprocess.Popen(["curl", "-sS", "-N", "--http1.1", "-o", "/dev/null", rs.url("/events")],
                         env=deployment.client_env(), stderr=subprocess.DEVNULL),
        subprocess.Popen(["curl", "-sS", "-N", "--http2", "-o", "/dev/null", h2.url("/hold")],
                         env=deployment.client_env(), stderr=subprocess.DEVNULL),
        # An upload whose body never ends (curl reads it from a pipe the test holds open).
        subprocess.Popen(["curl", "-sS", "--http1.1", "-T", "-", "-o", "/dev/null", rs.url("/upload")],
                         env=deployment.client_env(), stdin=subprocess.PIPE, stderr=subprocess.DEVNULL),
    ]
    clients[2].stdin.write(b"x" * 100_000)
    clients[2].stdin.flush()
    try:
        deadline = time.monotonic() + 20
        while (len(rs.since(rs_mark)) < 1 or len(h2.since(h2_mark)) < 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rs.since(rs_mark) and h2.since(h2_mark), "the requests did not reach the origins"
        deployment.proxy.signal(FIRST[first])
        if delay:
            time.sleep(delay)
        deployment.proxy.signal(SECOND[second])
        code = deployment.proxy.wait(15)
        assert code == 0, deployment.proxy.log()[-3000:]
    finally:
        for client in clients:
            client.kill()
            client.wait()
            if client.stdin:
                client.stdin.close()
        rs.events.put(None)
