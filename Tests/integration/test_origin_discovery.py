"""Protected origins from their URL alone (issue 30): `proxyctl init --origin URL` without `--issuer` or
`--client-id` reads the origin's protected resource metadata (RFC 9728: the `resource_metadata` of its 401, else
the well-known URL), the authorization server it names (RFC 8414 / OpenID Connect Discovery), registers a native
public client there (RFC 7591; glewlwyd's `register-client-allowed`), and `proxyctl login` then `serve` reach the
API with that client's token, its audience the origin's resource (RFC 8707). And the refusals, each closed by
construction: metadata for another resource (§3.3), several servers without `--issuer`, a registration the
provider refuses, an authorization server nobody saw named (no terminal, no `--yes`), http, a redirect to another
origin, 64 KiB, an issuer that is not the one named, and an `authorization_endpoint` with shell metacharacters or
a `file:` URL (the CVE-2025-6514 shape) never run."""

from __future__ import annotations

import json
import os
import pty
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures import config
from fixtures.deployment import BROWSER, Deployment, Workspace
from fixtures.http import free_port
from fixtures.proxy import Proxy, clean_env, poll, proxyctl_bin
from idp_fake import FakeIdP
from idp_glewlwyd import Glewlwyd, glewlwyd_available
from resource_server import ResourceServer

API = "api.test"
needs_glewlwyd = pytest.mark.skipif(not glewlwyd_available(), reason="glewlwyd is not installed")


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"), **extra)
    env.pop("PROXYCTL_CONFIG", None)
    env.pop("XDG_STATE_HOME", None)
    if "BROWSER" not in extra:
        env.pop("BROWSER", None)
    return env


def run(home: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([proxyctl_bin(), *args], capture_output=True, text=True, timeout=60,
                          env=env_for(home, **extra), stdin=subprocess.DEVNULL)


def conf_of(home: Path) -> Path:
    return home / "xdg" / "proxyctl" / "proxy.conf"


def state_of(home: Path) -> Path:
    return home / ".local" / "state" / "proxyctl"


@pytest.fixture
def home(tmp_path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def rs(tmp_path):
    server = ResourceServer(tmp_path / "rs", [API, "other.test"])
    yield server
    server.close()


def init_origin(home: Path, rs: ResourceServer, *extra: str) -> subprocess.CompletedProcess:
    """`proxyctl init --origin https://api.test:PORT` as the user would type it, plus what the test set-up needs:
    the name resolved to 127.0.0.1 and the test CA of the resource server."""
    return run(home, "init", "--origin", rs.url("", API), "--resolve", f"{API}=127.0.0.1,other.test=127.0.0.1",
               "--ca-file", str(rs.ca_pem), *extra)


# MARK: - From the origin alone, against glewlwyd


@pytest.fixture
def glewlwyd_registering():
    if not glewlwyd_available():
        pytest.skip("glewlwyd is not installed (scripts/bootstrap test)")
    with Glewlwyd(log_level=os.environ.get("GLEWLWYD_LOG_LEVEL", "WARNING")) as idp:
        yield idp


@needs_glewlwyd
def test_init_from_the_origin_alone_then_login_and_serve_reach_the_api(home, rs, glewlwyd_registering, tmp_path,
                                                                     default_redirect_port):
    """The issue's Done-when: `proxyctl init --origin URL` and `proxyctl login`, nothing else, and a request through
    `serve` (plain curl) reaches the API with the token of the client init registered, whose audience is the
    origin's resource. glewlwyd registers the client (RFC 7591, `register-client-allowed`), honours RFC 8707 for
    the `api` scope, and matches the registered redirect URI exactly."""
    idp = glewlwyd_registering
    resource = rs.url("", API)
    idp.set_plugin_parameters("oidc", **{
        "register-client-allowed": True, "register-client-auth-scope": [],
        "resource-allowed": True, "resource-scope": {"api": [resource]}, "resource-client-property": "",
        "resource-scope-and-client-property": False})
    rs.trust(idp.issuer(), idp.discovery()["jwks_uri"])
    rs.audiences[API] = resource
    rs.publish_metadata({"resource": "{origin}", "authorization_servers": [idp.issuer()],
                         "scopes_supported": ["api"], "resource_name": "The test API"})

    init = init_origin(home, rs, "--yes")
    assert init.returncode == 0, init.stderr
    err = init.stderr
    # Named before anything was sent to it, and what would be registered.
    named = err.index(f"The origin names the authorization server {idp.issuer()}.")
    assert err.index("Reading the metadata of") > named
    assert f"resource_metadata in its answer to a request without a token" in err, err
    text = conf_of(home).read_text()
    client_id = re.search(r"^client_id = (\S+)$", text, re.M).group(1)
    assert client_id != idp.client_id
    assert f"registered client {client_id} at {idp.issuer()}" in err
    # Where each value came from, in the file.
    assert f"# issuer: from authorization_servers of the protected resource metadata at\n" in text, text
    assert f"issuer = {idp.issuer()}\n" in text
    assert "# client_id: registered at " in text and "(RFC 7591)" in text
    assert "scopes = openid api\n" in text
    assert f"[origin {resource}]\nprovider = default\n" in text
    assert f"resource = {resource}\n" in text and "RFC 8707" in text
    # The origin's certificate needed --ca-file, the provider (http on loopback) did not.
    origin_section = text[text.index("[origin "):]
    assert f"ca_file = {rs.ca_pem}" in origin_section and text.count("ca_file =") == 1, text
    # The registration is kept, 0600 in a 0700 directory, and its access token was never printed.
    directory = state_of(home) / "registrations"
    [kept] = list(directory.iterdir())
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and stat.S_IMODE(kept.stat().st_mode) == 0o600
    registration = json.loads(kept.read_text())
    assert registration["client_id"] == client_id and registration["issuer"] == idp.issuer()
    assert registration["registration_access_token"] not in init.stdout + init.stderr
    port = re.search(r"redirect_port = (\d+)", text).group(1)
    assert registration["redirect_uris"] == [f"http://127.0.0.1:{port}/callback"]
    # glewlwyd has the client as a public one with exactly that redirect URI.
    client = idp.admin("GET", "/client/" + client_id).json()
    assert client["confidential"] is False and client["redirect_uri"] == registration["redirect_uris"]

    # The commands init printed.
    login_line, use_line = init.stdout.splitlines()
    assert login_line.startswith("proxyctl login") and use_line == f"proxyctl exec -- curl {resource}"
    login = run(home, "login", BROWSER=BROWSER, PROXYCTL_TEST_BROWSER="glewlwyd",
                PROXYCTL_TEST_IDP_URL=idp.base_url, PROXYCTL_TEST_IDP_USER=idp.username,
                PROXYCTL_TEST_IDP_PASSWORD=idp.password)
    assert login.returncode == 0, login.stderr

    proxy = Proxy(tmp_path / "serve", None, listen="127.0.0.1:0", args=("--config", str(conf_of(home))))
    proxy.env = env_for(home)
    proxy.start()
    try:
        done = subprocess.run(["curl", "-sS", "--proxy", proxy.url, "--cacert",
                               str(state_of(home) / "ca" / "ca.pem"), resource + "/me"],
                              capture_output=True, text=True, timeout=60, env=clean_env())
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["sub"] and answer["client_id"] == client_id, answer
        assert answer["aud"] == resource or resource in answer["aud"], answer
        [seen] = [s for s in rs.since(0) if s.path == "/me" and s.status == 200]
        assert seen.header("Authorization").startswith("Bearer ")
    finally:
        assert proxy.stop() == 0


@needs_glewlwyd
def test_a_registration_the_provider_refuses_is_named_with_the_flag_that_helps(home, rs, glewlwyd_registering):
    """glewlwyd with registration that needs an access token of a scope (`register-client-auth-scope`): init names
    the issuer, the refusal (HTTP 401) and --client-id, and writes nothing."""
    idp = glewlwyd_registering
    idp.set_plugin_parameters("oidc", **{"register-client-allowed": True, "register-client-auth-scope": ["g_admin"]})
    rs.publish_metadata({"resource": "{origin}", "authorization_servers": [idp.issuer()]})
    init = init_origin(home, rs, "--yes")
    assert init.returncode == 1, init.stderr
    assert f"{idp.issuer()} refused the client registration (HTTP 401" in init.stderr, init.stderr
    assert "give --client-id ID" in init.stderr and not conf_of(home).exists()
    assert not (state_of(home) / "registrations").exists() or not list((state_of(home) / "registrations").iterdir())


# MARK: - The refusals, against the fake provider


def test_metadata_for_another_resource_is_refused(home, rs):
    """RFC 9728 §3.3: metadata whose resource is not the URL given (another host, another path) names both and is
    not used: the authorization server it names hears nothing."""
    with FakeIdP(registration=True) as fake:
        for other in ("https://other.test:{port}".format(port=rs.port), rs.url("/api", API)):
            rs.publish_metadata({"resource": other, "authorization_servers": [fake.issuer]})
            init = init_origin(home, rs, "--yes")
            assert init.returncode == 1, init.stderr
            assert f"is for the resource {other}, not {rs.url('', API)}" in init.stderr, init.stderr
            assert "RFC 9728 §3.3" in init.stderr
        assert fake.counts() == {} and not conf_of(home).exists()


def test_several_authorization_servers_need_issuer(home, rs):
    with FakeIdP(registration=True) as fake, FakeIdP(registration=True) as second:
        rs.publish_metadata({"resource": "{origin}", "authorization_servers": [second.issuer, fake.issuer]})
        init = init_origin(home, rs, "--yes")
        assert init.returncode == 1
        assert (f"the origin names several authorization servers ({second.issuer}, {fake.issuer}); choose one with "
                "--issuer URL") in init.stderr, init.stderr
        wrong = init_origin(home, rs, "--issuer", "http://127.0.0.1:1/elsewhere")
        assert wrong.returncode == 1 and "is not one of the authorization servers the origin names" in wrong.stderr
        assert fake.counts() == {} and second.counts() == {}
        # The one chosen; the origin wants DPoP-bound tokens, and its scopes come with offline_access.
        rs.publish_metadata({"resource": "{origin}", "authorization_servers": [second.issuer, fake.issuer],
                             "scopes_supported": ["api", "admin"], "dpop_bound_access_tokens_required": True})
        chosen = init_origin(home, rs, "--issuer", fake.issuer)
        assert chosen.returncode == 0, chosen.stderr
        text = conf_of(home).read_text()
        assert f"issuer = {fake.issuer}\n" in text
        assert "token_binding = dpop\ndpop_required = true\n" in text and "dpop_bound_access_tokens_required" in text
        assert "scopes = openid api admin offline_access\n" in text, text
        assert second.counts() == {} and fake.count("register") == 1
        registered = fake.registered[0]
        assert registered["token_endpoint_auth_method"] == "none" and registered["dpop_bound_access_tokens"] is True
        assert registered["grant_types"] == ["authorization_code", "refresh_token",
                                             "urn:ietf:params:oauth:grant-type:device_code"]


def test_no_authorization_server_is_contacted_before_the_user_saw_it_named(home, rs, tmp_path):
    """Without a terminal and without --yes init names the server and stops; on a terminal it asks, and "n" leaves
    the server uncontacted and nothing written; "y" goes on."""
    with FakeIdP(registration=True) as fake:
        rs.publish_metadata({"resource": "{origin}", "authorization_servers": [fake.issuer]})
        quiet = init_origin(home, rs)
        assert quiet.returncode == 1
        assert f"The origin names the authorization server {fake.issuer}." in quiet.stderr
        assert f"Nothing was sent to {fake.issuer}; run again with --yes, or with --issuer {fake.issuer}" in quiet.stderr
        assert fake.counts() == {} and not conf_of(home).exists()

        def on_terminal(answer: bytes) -> tuple[int, str]:
            master, slave = pty.openpty()
            process = subprocess.Popen(
                [proxyctl_bin(), "init", "--origin", rs.url("", API), "--resolve", f"{API}=127.0.0.1",
                 "--ca-file", str(rs.ca_pem)], stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=env_for(home))
            os.close(slave)
            os.write(master, answer)
            out, err = process.communicate(timeout=60)
            os.close(master)
            return process.returncode, err.decode()

        code, err = on_terminal(b"n\n")
        assert code == 1 and "Go ahead and write" in err and "Nothing was sent to" in err, err
        assert fake.counts() == {} and not conf_of(home).exists()
        code, err = on_terminal(b"y\n")
        assert code == 0, err
        assert fake.count("register") == 1 and conf_of(home).exists()
        assert "client_id = dyn-" in conf_of(home).read_text()


def test_a_client_id_metadata_document_is_the_client_where_the_provider_accepts_them(home, rs):
    url = "https://client.example.test/proxyctl.json"
    with FakeIdP(discovery_overrides={"client_id_metadata_document_supported": True}) as fake:
        rs.publish_metadata({"resource": "{origin}", "authorization_servers": [fake.issuer]})
        init = init_origin(home, rs, "--yes", "--client-metadata-url", url)
        assert init.returncode == 0, init.stderr
        assert f"client_id = {url}\n" in conf_of(home).read_text()
        assert fake.count("register") == 0
    with FakeIdP() as fake:
        rs.publish_metadata({"resource": "{origin}", "authorization_servers": [fake.issuer]})
        refused = init_origin(home, rs, "--yes", "--client-metadata-url", url, "--force")
        assert refused.returncode == 1
        assert "accepts no Client ID Metadata Document" in refused.stderr and "--client-id ID" in refused.stderr


@pytest.mark.parametrize("shape", ["http_server", "cross_origin_redirect", "large", "issuer_mismatch",
                                   "http_origin"])
def test_metadata_is_fetched_only_as_the_rules_say(home, rs, shape):
    """https only (http on loopback), no redirect to another origin (the other server hears nothing), at most
    64 KiB, and an authorization server's metadata that names another issuer is not used."""
    with FakeIdP(registration=True) as fake, FakeIdP(registration=True) as elsewhere:
        doc = {"resource": "{origin}", "authorization_servers": [fake.issuer]}
        rs.publish_metadata(doc)
        expect = ""
        args = ("--yes",)
        if shape == "http_server":
            rs.publish_metadata(dict(doc, authorization_servers=["http://login.example.test/realms/dev"]))
            expect = "http:// is accepted only for loopback hosts"
        elif shape == "cross_origin_redirect":
            target = elsewhere.url("discovery")
            rs.metadata_answer = lambda path, host: (302, [("Location", target)], b"")
            expect = f"redirects to \"{target}\"; metadata is never fetched from another origin"
        elif shape == "large":
            big = dict(doc, padding="x" * (100 * 1024))
            rs.metadata_answer = lambda path, host: (200, [], json.dumps(big).replace(
                "{origin}", f"https://{host}").encode())
            expect = "the answer is larger than 65536 bytes"
        elif shape == "issuer_mismatch":
            fake.discovery_overrides["issuer"] = elsewhere.issuer
            expect = f"names {elsewhere.issuer}, not {fake.issuer} (RFC 8414 §3.3"
        elif shape == "http_origin":
            done = run(home, "init", "--origin", f"http://{API}:{rs.port}", "--yes")
            assert done.returncode == 64 and "http:// is accepted only for loopback hosts" in done.stderr
            return
        init = init_origin(home, rs, *args)
        assert init.returncode == 1, init.stderr
        assert expect in init.stderr, init.stderr
        assert elsewhere.counts() == {} and fake.count("register") == 0 and not conf_of(home).exists()


# MARK: - The browser: execve, one argument, https or loopback http only (CVE-2025-6514)


RECORDER = """#!/bin/sh
# Records its arguments, one per line, then the count.
for a in "$@"; do printf '%s\\n' "$a" >> "{log}"; done
echo "argc=$#" >> "{log}"
"""


def test_the_authorization_endpoint_reaches_the_browser_as_one_argument_and_a_file_url_never(home, rs, tmp_path,
                                                                                          default_redirect_port):
    """An authorization_endpoint with shell metacharacters is one argument of the browser's execve (the command
    substitution in it never runs); a `file:` endpoint, or one with a space, is refused before anything starts.
    Its login listens on init's default redirect port until it is stopped: under the port's lock, or another
    test's login finds the port taken and registers a new client (a fresh clone failed
    test_init_from_the_origin_alone_then_login_and_serve_reach_the_api so: its token was the new client's)."""
    marker = tmp_path / "pwned"
    log = tmp_path / "browser.log"
    recorder = tmp_path / "recorder"
    recorder.write_text(RECORDER.replace("{log}", str(log)))
    recorder.chmod(0o755)
    with FakeIdP(registration=True) as fake:
        evil = fake.url("authorize") + f"?next=$(touch$IFS{marker});id&x='"
        fake.discovery_overrides["authorization_endpoint"] = evil
        rs.publish_metadata({"resource": "{origin}", "authorization_servers": [fake.issuer]})
        init = init_origin(home, rs, "--yes")
        assert init.returncode == 0, init.stderr
        login = subprocess.Popen([proxyctl_bin(), "login"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, env=env_for(home, BROWSER=str(recorder)))
        try:
            poll(lambda: log.exists() and "argc=" in log.read_text(), 20, message="the browser to be started")
        finally:
            login.terminate()
            login.communicate(timeout=20)
        lines = log.read_text().splitlines()
        assert lines[-1] == "argc=1", lines
        assert lines[0].startswith(evil + "&"), lines
        assert not marker.exists()

        for bad, why in (("file:///etc/passwd", "authorization_endpoint is not usable"),
                         (fake.url("authorize") + "?a=b c", "authorization_endpoint is not usable")):
            log.unlink(missing_ok=True)
            fake.discovery_overrides["authorization_endpoint"] = bad
            again = init_origin(home, rs, "--yes", "--force")
            assert again.returncode == 1 and why in again.stderr, again.stderr
            # A proxy.conf written before the provider changed its endpoint: login refuses it too.
            login = run(home, "login", BROWSER=str(recorder))
            assert login.returncode != 0 and why in login.stderr, login.stderr
            assert not log.exists()


# MARK: - In serve: another authorization server named by the 401; insufficient_scope


def serve_workspace(root: Path, rs: ResourceServer, issuer: str, **provider_keys) -> Deployment:
    sections = (config.provider("p", issuer, **provider_keys)
                + config.origin(rs.url("", API), "p", ca_file=rs.ca_pem))
    ws = Workspace(root, sections, f"{API}=127.0.0.1")
    ws.ca_init()
    return ws


@pytest.mark.parametrize("names_provider", [False, True])
def test_a_401_naming_another_authorization_server_is_passed_on_and_nothing_switches(tmp_path, rs, names_provider):
    """The origin's 401 names metadata (on the origin) whose authorization_servers are not the configured
    provider's: the client gets that 401 with Proxy-Status naming the mismatch, the log names the `proxyctl init
    --origin` to run, and no refresh is spent on it (a token of another server never becomes one the origin
    accepts). Metadata that names the provider: the usual refresh and one replay."""
    with FakeIdP() as fake, FakeIdP() as other:
        # The resource server trusts nobody: every token is refused, with resource_metadata in the 401.
        rs.publish_metadata({"resource": "{origin}",
                             "authorization_servers": [fake.issuer if names_provider else other.issuer]})
        ws = serve_workspace(tmp_path / "ws", rs, fake.issuer)
        ws.login_fake("p")
        deployment = Deployment(ws, ws.start_proxy())
        try:
            mark = deployment.proxy.mark()
            fake.reset_counts()
            answer = deployment.curl(rs.url("/me", API))
            assert answer.status == 401, answer
            assert "resource_metadata=" in answer.header("WWW-Authenticate")
            status = answer.header("Proxy-Status")
            metadata_fetches = [s for s in rs.since(0) if s.path.startswith("/.well-known/")]
            assert len(metadata_fetches) == 1, metadata_fetches
            if names_provider:
                assert fake.count("token", grant_type="refresh_token") == 1
                assert "refused a freshly refreshed token" in status, status
            else:
                assert status == (f'proxyctl; error=proxy_configuration_error; received-status=401; details="the '
                                  f"origin's resource metadata names the authorization server {other.issuer}, not the "
                                  f'issuer of [provider p]; set it up with: proxyctl init --origin {rs.url("", API)}"')
                assert fake.count("token") == 0 and other.counts() == {}
                log = poll(lambda: "wrong authorization server" in deployment.proxy.log_since(mark)
                           and deployment.proxy.log_since(mark), 10, message="the log line")
                assert f"run: proxyctl init --origin {rs.url('', API)} --config NEW.conf" in log, log
                # The verdict is kept: a second request does not fetch the metadata again.
                assert deployment.curl(rs.url("/me", API)).status == 401
                assert len([s for s in rs.since(0) if s.path.startswith("/.well-known/")]) == 1
        finally:
            assert deployment.stop() is None


def test_the_code_exchange_asks_for_the_origin_as_resource_and_its_first_request_needs_no_refresh(tmp_path, rs):
    """RFC 8707 on the token request too (issue 30): with the one origin init --origin writes (its resource in its
    [origin]), login's code exchange carries `resource` = the origin, as the authorization request does, and the
    token it brings is the origin's own from the start: the first request through serve reaches the API with
    `aud` = the resource and no refresh token is spent on it."""
    with FakeIdP(access_token_format="jwt") as fake:
        resource = rs.url("", API)
        rs.trust(fake.issuer, fake.url("jwks"))
        rs.audiences[API] = resource
        sections = (config.provider("p", fake.issuer, scopes="openid profile")
                    + config.origin(resource, "p", ca_file=rs.ca_pem, resource=resource))
        ws = Workspace(tmp_path / "ws", sections, f"{API}=127.0.0.1")
        ws.ca_init()
        ws.login_fake("p")
        authorization = fake.requests("authorize")[-1]
        assert authorization.query.get("resource") == resource, authorization.query
        [exchange] = [r for r in fake.requests("token") if r.form.get("grant_type") == "authorization_code"]
        assert exchange.form.get("resource") == resource, exchange.form
        deployment = Deployment(ws, ws.start_proxy())
        try:
            answer = deployment.curl(rs.url("/me", API))
            assert answer.status == 200, answer
            assert resource in json.loads(answer.body)["aud"], answer.body
            assert fake.count("token", grant_type="refresh_token") == 0
            status = ws.cli("status")
            assert f"its own token (resource {resource}), valid until" in status.stdout, status.stdout
            assert "the provider ignored the resource indicator" not in status.stdout
        finally:
            assert deployment.stop() is None


@needs_glewlwyd
def test_insufficient_scope_is_surfaced_like_a_step_up_and_step_up_asks_for_the_scope(tmp_path, rs,
                                                                                      glewlwyd_registering):
    """An origin answering 403 `insufficient_scope` with `scope="api"` (RFC 6750 §3.1): the client gets it with
    Proxy-Status naming `proxyctl step-up ORIGIN`, nothing is refreshed, `status` lists it; `proxyctl step-up` signs
    in asking for the provider's scopes and `api`, and the same request through the same serve gets 200."""
    idp = glewlwyd_registering
    idp.add_redirect_ports([port := free_port()])
    rs.trust(idp.issuer(), idp.discovery()["jwks_uri"])
    rs.require_scope["/admin"] = "api"
    ws = serve_workspace(tmp_path / "ws", rs, idp.issuer(), client_id=idp.client_id, scopes="openid profile email",
                         redirect_port=port)
    ws.login_glewlwyd("p", idp)
    deployment = Deployment(ws, ws.start_proxy())
    try:
        answer = deployment.curl(rs.url("/admin", API))
        assert answer.status == 403, answer
        assert answer.header("Proxy-Status") == (
            f'proxyctl; received-status=403; details="the origin needs the scope api: run proxyctl step-up '
            f'{rs.url("", API)}"')
        status = ws.cli("status")
        assert f"{rs.url('', API)} (the scope api)" in status.stdout, status.stdout
        stepped = ws.cli("step-up", BROWSER=BROWSER, PROXYCTL_TEST_BROWSER="glewlwyd",
                         PROXYCTL_TEST_IDP_URL=idp.base_url, PROXYCTL_TEST_IDP_USER=idp.username,
                         PROXYCTL_TEST_IDP_PASSWORD=idp.password)
        assert stepped.returncode == 0, stepped.stderr
        assert f"{rs.url('', API)} needs the scope api; signing in to p asking for it too." in stepped.stderr
        again = deployment.curl(rs.url("/admin", API))
        assert again.status == 200, again
        assert "api" in json.loads(again.body)["scope"].split()
    finally:
        assert deployment.stop() is None


@needs_glewlwyd
def test_login_registers_again_on_a_free_port_when_the_registered_one_is_taken(home, rs, glewlwyd_registering,
                                                                               tmp_path):
    """The issue's "a loopback redirect URI on a port proxyctl keeps for this provider and registers again when it
    cannot bind it", at login: init registered a client at glewlwyd for one port; with that port held by a socket,
    `proxyctl login` registers a new client (RFC 7591, init's rules) on a free port, says so on stderr, keeps the
    new registration (0600, replaced atomically) and writes its client id and port into proxy.conf (the rest of
    the file as it was), signs in with it, and serve reaches the API with the new client's token."""
    import socket
    idp = glewlwyd_registering
    resource = rs.url("", API)
    idp.set_plugin_parameters("oidc", **{
        "register-client-allowed": True, "register-client-auth-scope": [],
        "resource-allowed": True, "resource-scope": {"api": [resource]}, "resource-client-property": "",
        "resource-scope-and-client-property": False})
    rs.trust(idp.issuer(), idp.discovery()["jwks_uri"])
    rs.audiences[API] = resource
    rs.publish_metadata({"resource": "{origin}", "authorization_servers": [idp.issuer()], "scopes_supported": ["api"]})
    port = free_port()
    init = init_origin(home, rs, "--yes", "--redirect-port", str(port))
    assert init.returncode == 0, init.stderr
    before = conf_of(home).read_text()
    old_client = re.search(r"^client_id = (\S+)$", before, re.M).group(1)
    [kept] = list((state_of(home) / "registrations").iterdir())
    old_token = json.loads(kept.read_text())["registration_access_token"]

    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        login = run(home, "login", BROWSER=BROWSER, PROXYCTL_TEST_BROWSER="glewlwyd",
                    PROXYCTL_TEST_IDP_URL=idp.base_url, PROXYCTL_TEST_IDP_USER=idp.username,
                    PROXYCTL_TEST_IDP_PASSWORD=idp.password)
    finally:
        holder.close()
    assert login.returncode == 0, login.stderr
    after = conf_of(home).read_text()
    new_client = re.search(r"^client_id = (\S+)$", after, re.M).group(1)
    new_port = int(re.search(r"^redirect_port = (\d+)$", after, re.M).group(1))
    assert new_client != old_client and new_port != port
    uri = f"http://127.0.0.1:{new_port}/callback"
    err = login.stderr
    assert (f"Port {port} is taken, and client {old_client}, which proxyctl registered at {idp.issuer()}, allows "
            f"only http://127.0.0.1:{port}/callback: registering a client again on a free port (RFC 7591).") in err, err
    assert (f"Registered client {new_client} at {idp.issuer()} with the redirect URI {uri} (kept in {kept}); "
            f"{conf_of(home)} now says client_id = {new_client} and redirect_port = {new_port}.") in err, err
    assert f"Signed in to default as" in err
    # Only those two values changed in proxy.conf; the comments saying where values came from stay.
    assert after == before.replace(f"client_id = {old_client}\n", f"client_id = {new_client}\n").replace(
        f"redirect_port = {port}\n", f"redirect_port = {new_port}\n")
    assert stat.S_IMODE(conf_of(home).stat().st_mode) == 0o600
    # The registration kept is the new one, 0600, its access token never printed.
    assert [p.name for p in (state_of(home) / "registrations").iterdir()] == [kept.name]
    registration = json.loads(kept.read_text())
    assert registration["client_id"] == new_client and registration["redirect_uris"] == [uri]
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert registration["registration_access_token"] != old_token
    assert registration["registration_access_token"] not in login.stdout + login.stderr
    client = idp.admin("GET", "/client/" + new_client).json()
    assert client["confidential"] is False and client["redirect_uri"] == [uri]
    assert json.loads((state_of(home) / "tokens" / "default.json").read_text())["client_id"] == new_client

    proxy = Proxy(tmp_path / "serve", None, listen="127.0.0.1:0", args=("--config", str(conf_of(home))))
    proxy.env = env_for(home)
    proxy.start()
    try:
        done = subprocess.run(["curl", "-sS", "--proxy", proxy.url, "--cacert",
                               str(state_of(home) / "ca" / "ca.pem"), resource + "/me"],
                              capture_output=True, text=True, timeout=60, env=clean_env())
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["client_id"] == new_client, answer
    finally:
        assert proxy.stop() == 0


def test_a_registration_is_reused_while_its_port_is_free_and_made_again_when_it_is_not(home, rs):
    """A second init for the same issuer (--force) reuses the kept registration and its redirect port; when that
    port is taken, it registers again on a free one and keeps the new registration."""
    import socket
    with FakeIdP(registration=True) as fake:
        rs.publish_metadata({"resource": "{origin}", "authorization_servers": [fake.issuer]})
        # A port of this test's own (17755, init's first choice, may be another test's login right now).
        port = free_port()
        first = init_origin(home, rs, "--yes", "--redirect-port", str(port))
        assert first.returncode == 0, first.stderr
        text = conf_of(home).read_text()
        client_id = re.search(r"^client_id = (\S+)$", text, re.M).group(1)
        assert f"redirect_port = {port}\n" in text
        again = init_origin(home, rs, "--yes", "--force")
        assert again.returncode == 0, again.stderr
        assert fake.count("register") == 1 and f"client_id = {client_id}\n" in conf_of(home).read_text()
        assert f"use client {client_id}, registered there before" in again.stderr, again.stderr
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as proxyctl's listeners: TIME_WAIT aside
        holder.bind(("127.0.0.1", port))
        holder.listen()
        try:
            moved = init_origin(home, rs, "--yes", "--force")
        finally:
            holder.close()
        assert moved.returncode == 0, moved.stderr
        text = conf_of(home).read_text()
        assert fake.count("register") == 2 and f"client_id = {client_id}\n" not in text
        new_port = int(re.search(r"^redirect_port = (\d+)$", text, re.M).group(1))
        assert new_port != port and fake.registered[-1]["redirect_uris"] == [f"http://127.0.0.1:{new_port}/callback"]
        [kept] = list((state_of(home) / "registrations").iterdir())
        assert json.loads(kept.read_text())["redirect_uris"] == [f"http://127.0.0.1:{new_port}/callback"]
        # login on a taken port registers again itself (the glewlwyd test below shows the whole way).
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", new_port))
        holder.listen()
        try:
            login = run(home, "login", BROWSER=BROWSER, PROXYCTL_TEST_BROWSER="fake")
        finally:
            holder.close()
        assert login.returncode == 0, login.stderr
        assert fake.count("register") == 3, login.stderr
        assert f"Port {new_port} is taken, and client " in login.stderr, login.stderr
        assert re.search(r"^redirect_port = (\d+)$", conf_of(home).read_text(), re.M).group(1) != str(new_port)
