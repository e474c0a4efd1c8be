"""Wildcard origins (issue 30 item 3): `[origin https://*.corp.test:PORT]` protects every host below corp.test on
that port with glewlwyd's token, a more specific `[origin]` wins for its host, corp.test itself and every other
host pass through untouched (the client sees the origin's own certificate), the local CA's intermediate permits
`.corp.test` and OpenSSL refuses a leaf for corp.test signed with its key, and `proxyctl status` lists the hosts
the running serve has seen."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
from pathlib import Path

import pytest

from fixtures import config
from fixtures.deployment import BROWSER, Deployment, Workspace
from fixtures.http import free_port, open_tunnel
from fixtures.pki import CertificateAuthority
from fixtures.proxy import poll
from idp_glewlwyd import Glewlwyd, glewlwyd_available
from resource_server import ResourceServer

HOSTS = ["a.corp.test", "b.deep.corp.test", "api.corp.test", "corp.test", "other.test"]


@pytest.fixture
def idp():
    if not glewlwyd_available():
        pytest.skip("glewlwyd is not installed (scripts/bootstrap test)")
    port = free_port()
    with Glewlwyd(redirect_ports=[port], log_level=os.environ.get("GLEWLWYD_LOG_LEVEL", "WARNING")) as server:
        server.callback_port = port
        yield server


@pytest.fixture
def world(tmp_path, idp):
    rs = ResourceServer(tmp_path / "rs", HOSTS)
    rs.trust(idp.issuer(), idp.discovery()["jwks_uri"])
    sections = (config.provider("glew", idp.issuer(), scopes="openid profile email", redirect_port=idp.callback_port)
                + config.origin(f"https://*.corp.test:{rs.port}", "glew", ca_file=rs.ca_pem,
                                client_authorization="replace")
                + config.origin(f"https://api.corp.test:{rs.port}", "glew", ca_file=rs.ca_pem,
                                client_authorization="keep"))
    ws = Workspace(tmp_path / "ws", sections, ", ".join(f"{h}=127.0.0.1" for h in HOSTS))
    made = ws.ca_init()
    ws.login_glewlwyd("glew", idp)
    deployment = Deployment(ws, ws.start_proxy())
    yield rs, ws, deployment, made
    failure = deployment.stop()
    rs.close()
    assert failure is None, failure


def seen_by_origin(rs: ResourceServer, host: str, path: str):
    found = [s for s in rs.since(0, host) if s.path == path]
    assert len(found) == 1, found
    return found[0]


def test_a_wildcard_origin_protects_every_host_below_it_and_nothing_else(world, tmp_path):
    rs, ws, deployment, made = world
    assert "*.corp.test" in made.stdout + made.stderr, made
    # Every host below the domain, at any depth, gets the token.
    for host in ("a.corp.test", "b.deep.corp.test"):
        answer = deployment.curl(rs.url("/me", host))
        assert answer.status == 200, (host, answer)
        assert json.loads(answer.body)["sub"], answer.body
        assert seen_by_origin(rs, host, "/me").header("Authorization").startswith("Bearer ")
    # The wildcard replaces a client's own Authorization; the more specific section (keep) forwards it.
    own = "Bearer the-clients-own"
    replaced = deployment.curl(rs.url("/replaced", "a.corp.test"), "-H", f"Authorization: {own}")
    assert replaced.status == 200 and seen_by_origin(rs, "a.corp.test", "/replaced").header("Authorization") != own
    kept = deployment.curl(rs.url("/kept", "api.corp.test"), "-H", f"Authorization: {own}")
    assert kept.status == 401 and seen_by_origin(rs, "api.corp.test", "/kept").header("Authorization") == own

    # corp.test itself and other hosts: blind tunnels; the client sees the origin's own certificate.
    proxy_port = deployment.proxy.port
    for host in ("corp.test", "other.test"):
        mark = rs.mark()
        sock, _, response = open_tunnel(proxy_port, f"{host}:{rs.port}")
        assert response.status == 200
        context = ssl.create_default_context(cafile=str(rs.ca_pem))
        with context.wrap_socket(sock, server_hostname=host) as tls:
            issuer = dict(x[0] for x in tls.getpeercert()["issuer"])
            assert issuer["commonName"] == "api test CA", issuer     # the resource server's test CA, not proxyctl's
            tls.sendall(f"GET /public/x HTTP/1.1\r\nHost: {host}:{rs.port}\r\nConnection: close\r\n\r\n".encode())
            assert tls.recv(4096).startswith(b"HTTP/1.1 200")
        [seen] = rs.since(mark, host)
        assert seen.header("Authorization") is None

    # The local CA's intermediate permits .corp.test: OpenSSL verifies a leaf for z.corp.test signed with its key
    # and refuses one for corp.test (and other.test), as a stolen intermediate key would try.
    ca = ws.state / "ca"
    text = subprocess.run(["openssl", "x509", "-in", str(ca / "intermediate.pem"), "-noout", "-ext", "nameConstraints"],
                          capture_output=True, text=True, timeout=30).stdout
    assert "DNS:.corp.test" in text and "DNS:api.corp.test" in text, text
    intermediate = CertificateAuthority.load(ca / "intermediate.pem", ca / "intermediate-key.pem")
    for name, accepted in (("z.corp.test", True), ("x.api.corp.test", True), ("corp.test", False),
                           ("other.test", False), ("corp.test.evil.test", False)):
        identity = intermediate.issue(tmp_path / "forged", [name], stem=name.replace(".", "-"), chain=True)
        done = subprocess.run(["openssl", "verify", "-CAfile", str(ca / "ca.pem"), "-untrusted",
                               str(ca / "intermediate.pem"), "-verify_hostname", name, str(identity.cert_pem)],
                              capture_output=True, text=True, timeout=30)
        assert (done.returncode == 0) == accepted, (name, done.stdout + done.stderr)
        if not accepted:
            assert "subtree violation" in done.stdout + done.stderr, done

    # status lists the hosts the running serve has seen under the wildcard.
    last = []

    def listed():
        status = ws.cli("status")
        last[:] = [status.stdout + status.stderr]
        return status.stdout if f"hosts seen: https://a.corp.test:{rs.port}, https://b.deep.corp.test:{rs.port}" \
            in status.stdout else None
    try:
        out = poll(listed, 15, message="status to list the hosts seen")
    except AssertionError as error:
        raise AssertionError(f"{error}; the last status:\n{last[0] if last else ''}") from None
    assert f"https://*.corp.test:{rs.port}: the provider's access token" in out, out


def test_the_hosts_seen_under_a_wildcard_outlive_the_serve_that_saw_them(world):
    """Hosts served under a wildcard are kept in the state directory (wildcard-hosts.json, 0600 in the 0700 state
    directory, replaced atomically, at most 256 per wildcard): `proxyctl status` lists them after that serve
    stopped, and beside a new serve that has not seen them; a host with a section of its own is not among them."""
    import stat
    rs, ws, deployment, _ = world
    for host in ("a.corp.test", "b.deep.corp.test", "api.corp.test"):
        assert deployment.curl(rs.url("/seen", host)).status in (200, 401)
    assert deployment.stop() is None
    kept = ws.state / "wildcard-hosts.json"
    assert kept.exists(), sorted(p.name for p in ws.state.iterdir())
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600 and stat.S_IMODE(ws.state.stat().st_mode) == 0o700
    hosts = json.loads(kept.read_text())["wildcards"][f"https://*.corp.test:{rs.port}"]
    assert sorted(hosts) == [f"https://a.corp.test:{rs.port}", f"https://b.deep.corp.test:{rs.port}"], hosts
    listed = f"hosts seen: https://a.corp.test:{rs.port}, https://b.deep.corp.test:{rs.port}\n"
    status = ws.cli("status")
    assert listed in status.stdout, status.stdout
    again = ws.start_proxy("again")
    try:
        status = ws.cli("status")
        assert listed in status.stdout, status.stdout
        report = json.loads(ws.cli("status", "--json").stdout)
        [wildcard] = [o for p in report["providers"] for o in p.get("origin_tokens", [])
                      if o["origin"] == f"https://*.corp.test:{rs.port}"]
        assert wildcard["hosts_seen"] == [f"https://a.corp.test:{rs.port}", f"https://b.deep.corp.test:{rs.port}"]
    finally:
        assert again.stop() == 0


def test_each_host_under_a_wildcard_gets_a_token_for_its_own_resource_once_a_sign_in_covers_it(tmp_path):
    """`resource = https://*.corp.test:PORT` in a wildcard section (issue 30 item 3: "its own resource token where
    the provider honours RFC 8707, the same machinery as per-origin tokens"). Its hosts are not known at the first
    login (a "*" is no resource a provider knows), so each host's first request asks for its token by a refresh
    with the host's resource. glewlwyd keeps refreshes to the resources of the sign-in and refuses it, naming the
    login to run; the host is kept as seen (the state directory), and the next `proxyctl login` asks for the
    resources of the hosts seen: from then on each host gets a token for its own audience, obtained once, reused,
    never sent to another host. (A provider that accepts any known resource on a refresh, the fake one, needs no
    second login: the per-origin machinery covers first use.)"""
    if not glewlwyd_available():
        pytest.skip("glewlwyd is not installed (scripts/bootstrap test)")
    rs = ResourceServer(tmp_path / "rs", HOSTS)
    a, b = f"https://a.corp.test:{rs.port}", f"https://b.deep.corp.test:{rs.port}"
    rs.audiences.update({"a.corp.test": a, "b.deep.corp.test": b})
    callback = free_port()
    try:
        with Glewlwyd(redirect_ports=[callback], log_level=os.environ.get("GLEWLWYD_LOG_LEVEL", "WARNING")) as idp:
            idp.set_plugin_parameters("oidc", **{
                "resource-allowed": True, "resource-scope": {"api": [a, b]}, "resource-client-property": "",
                "resource-scope-and-client-property": False, "refresh-token-rolling": False,
                "refresh-token-one-use": "never"})
            rs.trust(idp.issuer(), idp.discovery()["jwks_uri"])
            wildcard = f"https://*.corp.test:{rs.port}"
            sections = (config.provider("glew", idp.issuer(), scopes="openid profile email api",
                                        redirect_port=callback)
                        + config.origin(wildcard, "glew", ca_file=rs.ca_pem, client_authorization="replace",
                                        resource=wildcard))
            ws = Workspace(tmp_path / "ws", sections, ", ".join(f"{h}=127.0.0.1" for h in HOSTS))
            ws.ca_init()

            def login():
                done = ws.cli("login", "glew", BROWSER=BROWSER, PROXYCTL_TEST_BROWSER="glewlwyd",
                              PROXYCTL_TEST_IDP_URL=idp.base_url, PROXYCTL_TEST_IDP_USER=idp.username,
                              PROXYCTL_TEST_IDP_PASSWORD=idp.password,
                              PROXYCTL_TEST_IDP_SCOPE="openid profile email api")
                assert done.returncode == 0, done.stderr

            login()
            deployment = Deployment(ws, ws.start_proxy())
            try:
                # First use: the refresh with the host's resource is refused, and says what to run.
                refused = deployment.curl(rs.url("/me", "a.corp.test"))
                assert refused.status == 500, refused
                assert b"proxyctl login glew" in refused.body, refused.body
                assert deployment.curl(rs.url("/me", "b.deep.corp.test")).status == 500
                kept = ws.state / "wildcard-hosts.json"
                poll(lambda: kept.exists() and len(json.loads(kept.read_text())["wildcards"][wildcard]) == 2, 15,
                     message="the hosts seen kept in the state directory")
                # The next login covers the hosts seen; the same serve then gets each host its own token.
                login()
                mark = rs.mark()
                for host in ("a.corp.test", "b.deep.corp.test", "a.corp.test", "b.deep.corp.test"):
                    answer = deployment.curl(rs.url("/me", host))
                    assert answer.status == 200, (host, answer.status, answer.body[:300])
                for host, resource in (("a.corp.test", a), ("b.deep.corp.test", b)):
                    seen = [s for s in rs.since(mark, host) if s.path == "/me"]
                    assert len(seen) == 2 and all(s.error is None for s in seen), [s.error for s in seen]
                    claims = [json.loads(base64.urlsafe_b64decode(s.token.split(".")[1] + "==")) for s in seen]
                    assert all(c["aud"] == resource or c["aud"] == [resource] for c in claims), claims
                    assert len({c["jti"] for c in claims}) == 1, "obtained once, reused"
                assert not {s.token for s in rs.since(mark, "a.corp.test")} & {
                    s.token for s in rs.since(mark, "b.deep.corp.test")}
                tokens = json.dumps(ws.tokens("glew"))
                assert f"resource={a}" in tokens and f"resource={b}" in tokens
            finally:
                assert deployment.stop() is None
    finally:
        rs.close()
