"""A first run without reading the example file (`proxyctl init`, and `doctor` pointing at it), and a SIGHUP
that adds a protected origin to a running serve (the CA reissued with `ca init` first)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from fixtures import config
from fixtures.proxy import clean_env, poll, proxyctl_bin
from idp_fake import FakeIdP
from resource_server import ResourceServer
from test_protected import Deployment, Workspace

API, MORE = "api.test", "more.test"


def run(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"))
    env.pop("PROXYCTL_CONFIG", None)
    return subprocess.run([proxyctl_bin(), *args], capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


def test_init_checks_the_provider_and_writes_a_working_configuration(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    doctor = run(home, "doctor")
    assert doctor.returncode == 1 and "proxyctl init --issuer" in doctor.stdout, doctor.stdout
    with FakeIdP() as fake:
        wrong = run(home, "init", "--issuer", fake.issuer + "/other", "--client-id", "proxyctl-test")
        assert wrong.returncode == 1, wrong
        done = run(home, "init", "--issuer", fake.issuer, "--client-id", "proxyctl-test",
                   "--origin", "https://api.example.test", "--origin", "https://git.example.test:8443", "--dpop")
        assert done.returncode == 0, done.stderr
        conf = home / "xdg" / "proxyctl" / "proxy.conf"
        text = conf.read_text()
        assert f"issuer = {fake.issuer}" in text and "token_binding = dpop" in text
        assert "[origin https://git.example.test:8443]" in text
        assert "PKCE with S256: offered" in done.stderr and "device flow: offered" in done.stderr, done.stderr
        assert "made the local CA for api.example.test, git.example.test" in done.stderr, done.stderr
        assert done.stdout.startswith("proxyctl login"), done.stdout
        assert run(home, "serve", "--check").returncode == 0
        # Never replaced without --force.
        again = run(home, "init", "--issuer", fake.issuer, "--client-id", "other")
        assert again.returncode == 1 and "--force" in again.stderr
        assert conf.read_text() == text
        forced = run(home, "init", "--issuer", fake.issuer, "--client-id", "other", "--force")
        assert forced.returncode == 0 and "client_id = other" in conf.read_text()
    down = run(home, "init", "--issuer", fake.issuer, "--client-id", "x", "--force")
    assert down.returncode == 1 and "cannot use" in down.stderr, down


def test_sighup_applies_a_new_origin(tmp_path):
    rs = ResourceServer(tmp_path / "rs", [API, MORE])
    try:
        with FakeIdP(access_token_format="jwt", expires_in=3600) as fake:
            rs.trust(fake.issuer, fake.url("jwks"))
            provider = config.provider("fake", fake.issuer, redirect_port=0)
            first = config.origin(f"https://{API}:{rs.port}", "fake", ca_file=rs.ca_pem)
            ws = Workspace(tmp_path / "ws", provider + first, f"{API}=127.0.0.1, {MORE}=127.0.0.1")
            ws.ca_init()
            ws.login_fake("fake")
            deployment = Deployment(ws, ws.start_proxy())
            try:
                assert deployment.curl(rs.url("/before", MORE)).returncode != 0, "not protected yet"
                # Add the origin; until the CA names it, the reload keeps the old origins and says why.
                ws.sections = provider + first + config.origin(f"https://{MORE}:{rs.port}", "fake", ca_file=rs.ca_pem)
                ws.write_config(ws.port)
                mark = deployment.proxy.mark()
                deployment.proxy.signal(signal.SIGHUP)
                deployment.proxy.wait_log(r"changes not applied.*run proxyctl ca init to reissue it.*SIGHUP again",
                                          since=mark)
                ws.ca_init()
                deployment.exports = ws.env()
                mark = deployment.proxy.mark()
                deployment.proxy.signal(signal.SIGHUP)
                deployment.proxy.wait_log(r"SIGHUP: configuration reloaded \(protected origins: .*more\.test", since=mark)
                answer = deployment.curl(rs.url("/after", MORE))
                assert answer.status == 200 and answer.json()["sub"], answer
                assert deployment.curl(rs.url("/still", API)).status == 200
            finally:
                assert deployment.stop() is None
    finally:
        rs.close()
