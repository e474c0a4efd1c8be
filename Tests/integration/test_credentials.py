"""Credentials beyond one person's login (issue 15), end to end with the real binary:

- per-origin audience: two origins with different `resource` values each receive only their own token, and
  the resource server checks `aud` (glewlwyd, which implements RFC 8707 on the authorization and refresh
  requests; the fake for a provider that ignores `resource`, which `proxyctl status` must say);
- `grant = client_credentials` with `private_key_jwt` (glewlwyd verifies the assertion against the public key
  `proxyctl key init` printed), no login, a 401 answered by a new grant and one replay;
- `grant = token_exchange` from a file-based subject token (the fake: glewlwyd 2.7.5 has no RFC 8693) with
  `client_secret_basic` from a 0600 file, under `proxyctl exec` as a CI job would run it;
- `proxyctl login --prompt` reaches the authorization request; `proxyctl logout --end-session` opens the
  end_session_endpoint from the discovery document (the fake and glewlwyd).
"""

from __future__ import annotations

import functools
import json
import os
import stat
import subprocess
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from fixtures import config
from fixtures.http import free_port, run_curl
from fixtures.jose import unverified_claims
from fixtures.proxy import clean_env, poll, proxyctl_bin
from fixtures.secret_service import HeadlessSecretService
from idp_fake import FakeIdP
from idp_glewlwyd import Glewlwyd, glewlwyd_available
from resource_server import ResourceServer
from signin import Workspace as SignInWorkspace, wait_expired
from fixtures.deployment import BROWSER, Deployment, Workspace

A, B, PLAIN_API, CI = "a.test", "b.test", "default.test", "ci.test"
A_RES, B_RES, CI_RES = "https://a.test/", "https://b.test/", "https://ci.test/"
SCOPES = "openid profile email api"
RESOLVE = ", ".join(f"{h}=127.0.0.1" for h in (A, B, PLAIN_API, CI))

origin_section = functools.partial(config.origin, client_authorization="replace")
needs_glewlwyd = pytest.mark.skipif(not glewlwyd_available(), reason="glewlwyd is not installed")


# MARK: - Fixtures


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("credentials")


@pytest.fixture(scope="module")
def idp():
    """glewlwyd with RFC 8707 on (the `api` scope may be narrowed to a.test, b.test and ci.test) and the client
    credentials grant with client keys as PEM (`pubkey`)."""
    if not glewlwyd_available():
        pytest.skip("glewlwyd is not installed (scripts/bootstrap test)")
    callback = free_port()
    with Glewlwyd(redirect_ports=[callback], log_level=os.environ.get("GLEWLWYD_LOG_LEVEL", "WARNING")) as server:
        server.callback_port = callback
        server.set_plugin_parameters("oidc", **{
            "resource-allowed": True, "resource-scope": {"api": [A_RES, B_RES, CI_RES]},
            "resource-client-property": "", "resource-scope-and-client-property": False,
            "auth-type-client-enabled": True, "allow-non-oidc": True, "client-pubkey-parameter": "pubkey",
            # glewlwyd narrows a ROTATED refresh token to the one resource of the refresh that rotated it, after
            # which the other origins' resources are refused (invalid_target): per-origin audiences need a
            # refresh token that keeps every resource of the sign-in (docs/sign-in.md says so).
            "refresh-token-rolling": False, "refresh-token-one-use": "never"})
        mod = server.admin("GET", "/mod/client/database").json()
        mod["parameters"]["data-format"]["pubkey"] = {"multiple": False, "read": True, "write": True}
        server.admin("PUT", "/mod/client/database", {k: mod[k] for k in (
            "module", "name", "display_name", "order", "parameters", "readonly") if k in mod})
        server.admin("PUT", "/mod/client/database/reset")
        yield server


@pytest.fixture(scope="module")
def rs(module_dir, idp):
    server = ResourceServer(module_dir / "rs", [A, B, PLAIN_API, CI], audiences={A: A_RES, B: B_RES, CI: CI_RES})
    server.trust(idp.issuer(), idp.discovery()["jwks_uri"])
    yield server
    server.close()


def login(ws: Workspace, provider: str, idp: Glewlwyd, *extra: str):
    done = ws.cli("login", provider, *extra, BROWSER=BROWSER, PROXYCTL_TEST_BROWSER="glewlwyd",
                  PROXYCTL_TEST_IDP_URL=idp.base_url, PROXYCTL_TEST_IDP_USER=idp.username,
                  PROXYCTL_TEST_IDP_PASSWORD=idp.password, PROXYCTL_TEST_IDP_SCOPE=SCOPES)
    assert done.returncode == 0, f"proxyctl login {provider}: {done.stderr[-2000:]}"
    return done


def bearer(seen) -> dict:
    assert seen.error is None, seen.error
    return unverified_claims(seen.token)


# MARK: - Per-origin audience (glewlwyd)


@needs_glewlwyd
def test_two_origins_with_their_own_resource_each_get_only_their_own_token(module_dir, idp, rs):
    sections = (config.provider("glew", idp.issuer(), scopes=SCOPES, redirect_port=idp.callback_port)
                + origin_section(f"https://{A}:{rs.port}", "glew", resource=A_RES, ca_file=rs.ca_pem)
                + origin_section(f"https://{B}:{rs.port}", "glew", resource=B_RES, scopes="api", ca_file=rs.ca_pem)
                + origin_section(f"https://{PLAIN_API}:{rs.port}", "glew", ca_file=rs.ca_pem))
    ws = Workspace(module_dir / "audience", sections, RESOLVE)
    ws.ca_init()
    login(ws, "glew", idp)
    deployment = Deployment(ws, ws.start_proxy())
    try:
        mark = rs.mark()
        for host in (A, B, PLAIN_API, A, B):
            answer = deployment.curl(rs.url("/me", host))
            assert answer.status == 200, (host, answer.status, answer.body[:300])
        a = [bearer(s) for s in rs.since(mark, A)]
        b = [bearer(s) for s in rs.since(mark, B)]
        default = [bearer(s) for s in rs.since(mark, PLAIN_API)]
        # Each origin got a token for itself only, obtained once and reused.
        assert {c["aud"] for c in a} == {A_RES} and {c["aud"] for c in b} == {B_RES}
        assert len({c["jti"] for c in a}) == 1 and len({c["jti"] for c in b}) == 1
        assert default[0]["aud"] not in (A_RES, B_RES)
        a_tokens = {s.token for s in rs.since(mark, A)}
        assert not a_tokens & {s.token for s in rs.since(mark, B) + rs.since(mark, PLAIN_API)}
        # The provider's token file keeps them apart; status shows each origin's token and its real aud.
        status = ws.cli("status", "glew", "--json")
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)["providers"][0]
        tokens = {t["origin"]: t for t in report["origin_tokens"]}
        assert tokens[f"https://{A}:{rs.port}"]["aud"] == [A_RES]
        assert tokens[f"https://{A}:{rs.port}"]["resource_honoured"] is True
        assert tokens[f"https://{B}:{rs.port}"]["scopes"] == ["api"]
        assert tokens[f"https://{PLAIN_API}:{rs.port}"]["token"] == "provider"
        text = ws.cli("status", "glew").stdout
        assert f"https://{A}:{rs.port}: its own token (resource {A_RES})" in text and f"aud {A_RES}" in text
        # A 401 at one origin renews that origin's token only.
        rs.reject_next(1)
        mark = rs.mark()
        assert deployment.curl(rs.url("/me", A)).status == 200
        renewed = rs.since(mark, A)
        assert len(renewed) == 2 and bearer(renewed[1])["aud"] == A_RES
        assert bearer(renewed[1])["jti"] != a[0]["jti"]
        assert deployment.curl(rs.url("/me", B)).status == 200
        assert bearer(rs.since(mark, B)[-1])["jti"] == b[0]["jti"]
    finally:
        failure = deployment.stop()
        assert failure is None, failure


# MARK: - Client credentials with private_key_jwt (glewlwyd)


@needs_glewlwyd
def test_client_credentials_with_private_key_jwt_need_no_login(module_dir, idp, rs):
    sections = (config.provider("ci", idp.issuer(), client_id="ci-bot", grant="client_credentials", scopes="api")
                + origin_section(f"https://{CI}:{rs.port}", "ci", resource=CI_RES, ca_file=rs.ca_pem))
    ws = Workspace(module_dir / "client-credentials", sections, RESOLVE)
    # The key: made by proxyctl, 0600, its public half printed for the registration.
    made = ws.cli("key", "init", "ci", "--pem")
    assert made.returncode == 0, made.stderr
    key_file = ws.state / "keys" / "ci.client.pem"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert "PRIVATE" not in made.stdout and "BEGIN PUBLIC KEY" in made.stdout
    jwk = json.loads(ws.cli("key", "show", "ci").stdout)
    assert jwk["kty"] == "EC" and "d" not in jwk and jwk["alg"] == "ES256"
    idp.admin("POST", "/client/", {"client_id": "ci-bot", "name": "CI", "enabled": True, "confidential": True,
                                  "redirect_uri": [], "authorization_type": ["client_credentials"],
                                  "scope": ["api"], "pubkey": made.stdout,
                                  "token_endpoint_auth_method": ["private_key_jwt"]})
    # glewlwyd 2.7 wants its token endpoint as the assertion's audience (OpenID Connect Core §9), not the issuer
    # that draft-ietf-oauth-rfc7523bis makes the default: the refusal names the key that fixes it.
    refused = ws.cli("token", "ci")
    assert refused.returncode == 1, refused.stdout
    assert "set client_assertion_audience = token_endpoint in [provider ci]" in refused.stderr, refused.stderr
    sections = (config.provider("ci", idp.issuer(), client_id="ci-bot", grant="client_credentials", scopes="api",
                                client_assertion_audience="token_endpoint")
                + origin_section(f"https://{CI}:{rs.port}", "ci", resource=CI_RES, ca_file=rs.ca_pem))
    ws.sections = sections
    ws.write_config(0)
    # proxyctl token needs no login: the grant runs, the provider verifies the assertion.
    token = ws.cli("token", "ci")
    assert token.returncode == 0, token.stderr
    claims = unverified_claims(token.stdout.strip())
    assert claims["client_id"] == "ci-bot" and claims["sub"] == "ci-bot"
    # serve: no login either; the origin gets a token for its own resource.
    ws.ca_init()
    deployment = Deployment(ws, ws.start_proxy())
    try:
        mark = rs.mark()
        answer = deployment.curl(rs.url("/me", CI))
        assert answer.status == 200, answer.body[:300]
        first = bearer(rs.since(mark, CI)[0])
        assert first["aud"] == CI_RES and first["client_id"] == "ci-bot"
        # A 401: a new token from the grant (there is no refresh token), and one replay.
        rs.reject_next(1)
        mark = rs.mark()
        assert deployment.curl(rs.url("/me", CI)).status == 200
        seen = rs.since(mark, CI)
        assert len(seen) == 2 and bearer(seen[1])["jti"] != first["jti"]
        assert "refresh_token" not in json.loads((ws.state / "tokens" / "ci.json").read_text())
        status = ws.cli("status", "ci")
        assert status.returncode == 0 and "client_credentials (no sign-in needed)" in status.stdout, status.stdout
    finally:
        failure = deployment.stop()
        assert failure is None, failure


# MARK: - Token exchange, client secrets, CI (the fake)


@pytest.fixture
def sws(tmp_path):
    """A sign-in workspace whose recorded output must not hold a secret."""
    workspace = SignInWorkspace(tmp_path / "ws")
    yield workspace
    workspace.close()
    problems = workspace.hygiene_problems()
    assert not problems, "output hygiene:\n" + "\n".join(problems)


def write_secret(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def test_token_exchange_from_a_file_under_proxyctl_exec(tmp_path, sws):
    """A CI job: the runner's OIDC token in a file, exchanged for an access token; the client authenticates
    with client_secret_basic from a 0600 file; `proxyctl exec -- curl` reaches the API through a proxy that
    nobody signed in to."""
    subject = "ci-oidc-" + os.urandom(8).hex()
    secret = "client-secret-" + os.urandom(8).hex()
    fake = FakeIdP(access_token_format="jwt", subject_tokens=[subject], client_secret=secret).start()
    sws.fakes.append(fake)
    sws.secrets |= {subject, secret}
    rs = ResourceServer(tmp_path / "rs", [CI], audiences={CI: CI_RES})
    try:
        rs.trust(fake.issuer, fake.url("jwks"))
        token_file = tmp_path / "ci-token"
        token_file.write_text(subject + "\n")
        secret_file = write_secret(tmp_path / "client.secret", secret)
        port = free_port()
        sws.write_config(
            config.provider("ci", fake.issuer, grant="token_exchange", subject_token_file=token_file,
                            token_endpoint_auth_method="client_secret_basic", client_secret_file=secret_file,
                            scopes="api")
            + origin_section(f"https://{CI}:{rs.port}", "ci", resource=CI_RES, ca_file=rs.ca_pem))
        text = sws.config_path.read_text().replace("[proxy]\n", f"[proxy]\nlisten = 127.0.0.1:{port}\n"
                                                   f"resolve = {CI}=127.0.0.1\n", 1)
        sws.config_path.write_text(text)
        printed = sws.run("token", "ci")
        assert printed.returncode == 0, printed.stderr
        form = fake.requests("token")[-1].form
        assert form["grant_type"] == "urn:ietf:params:oauth:grant-type:token-exchange"
        assert form["subject_token"] == subject and "client_secret" not in form
        assert fake.client_auth_methods[-1] == "client_secret_basic"
        assert unverified_claims(printed.stdout.strip())["scope"] == "api"
        assert sws.run("ca", "init").returncode == 0
        serve = sws.start("serve")
        try:
            serve.wait_for_line(r"listening on")
            exec_run = sws.run("exec", "--", "curl", "-sS", "-o", "/dev/null", "-w", "STATUS %{http_code}",
                               rs.url("/me", CI), timeout=60)
            assert exec_run.returncode == 0, exec_run.stderr
            assert "STATUS 200" in exec_run.stdout, exec_run.stdout[-500:]
            seen = rs.since(0, CI)[-1]
            assert seen.error is None and unverified_claims(seen.token)["aud"] == CI_RES
        finally:
            serve.process.terminate()
            serve.finish(timeout=30)
        # A subject token the provider does not trust: the error names its file, never the token.
        (sws.state_dir / "tokens" / "ci.json").unlink()
        token_file.write_text("not-trusted-token\n")
        sws.secrets.add("not-trusted-token")
        refused = sws.run("token", "ci", "--origin", f"https://{CI}:{rs.port}")
        assert refused.returncode == 1 and str(token_file) in refused.stderr, refused.stderr
    finally:
        rs.close()
        fake.stop()


def test_client_secret_file_open_to_others_is_refused(tmp_path, sws):
    fake = FakeIdP(client_secret="s3cret-value-long").start()
    sws.fakes.append(fake)
    try:
        secret_file = tmp_path / "client.secret"
        secret_file.write_text("s3cret-value-long\n")
        secret_file.chmod(0o644)
        sws.write_config(config.provider("cc", fake.issuer, grant="client_credentials",
                                         token_endpoint_auth_method="client_secret_post",
                                         client_secret_file=secret_file))
        refused = sws.run("token", "cc")
        assert refused.returncode == 1 and "chmod 600" in refused.stderr, refused.stderr
        assert fake.count("token") == 0
        secret_file.chmod(0o600)
        sws.secrets.add("s3cret-value-long")
        done = sws.run("token", "cc")
        assert done.returncode == 0, done.stderr
        assert fake.client_auth_methods[-1] == "client_secret_post"
    finally:
        fake.stop()


def test_a_client_secret_file_alone_means_client_secret_basic(tmp_path, sws):
    """Issue 32 item 6: `grant = client_credentials` with `client_secret_file` and no
    `token_endpoint_auth_method` is what RFC 7591 calls the default, client_secret_basic (it was refused)."""
    secret = "client-secret-" + os.urandom(8).hex()
    fake = FakeIdP(client_secret=secret).start()
    sws.fakes.append(fake)
    sws.secrets.add(secret)
    try:
        secret_file = write_secret(tmp_path / "client.secret", secret)
        sws.write_config(config.provider("cc", fake.issuer, grant="client_credentials", client_secret_file=secret_file))
        checked = sws.run("serve", "--check")
        assert checked.returncode == 0, checked.stderr
        done = sws.run("token", "cc")
        assert done.returncode == 0, done.stderr
        assert fake.client_auth_methods[-1] == "client_secret_basic"
        request = fake.requests("token")[-1]
        assert request.form["grant_type"] == "client_credentials" and "client_secret" not in request.form
    finally:
        fake.stop()


@pytest.mark.parametrize("provider_wants", ["issuer", "token_endpoint"])
def test_the_client_assertion_names_the_issuer_unless_told_otherwise(tmp_path, sws, provider_wants):
    """Issue 32 item 5 (draft-ietf-oauth-rfc7523bis): a private_key_jwt assertion's `aud` is the issuer by
    default; a provider that wants its token endpoint there refuses it, and the error names
    client_assertion_audience, after which `token_endpoint` works. The fake checks the one `aud` it is told."""
    fake = FakeIdP(assertion_audience=provider_wants).start()
    sws.fakes.append(fake)
    try:
        sws.write_config(config.provider("cc", fake.issuer, grant="client_credentials"))
        made = sws.run("key", "init", "cc")
        assert made.returncode == 0, made.stderr
        fake.client_jwks.append(json.loads(sws.run("key", "show", "cc").stdout))
        # The public JWK's x and y look like secrets to the hygiene check; they are public by design.
        sws.results = [result for result in sws.results if result.argv[:1] != ["key"]]
        first = sws.run("token", "cc")
        assert fake.assertion_audiences[-1] == fake.issuer, "the default audience is the issuer, as one string"
        if provider_wants == "issuer":
            assert first.returncode == 0, first.stderr
        else:
            assert first.returncode == 1, first.stdout
            assert "invalid_client" in first.stderr, first.stderr
            assert (f"set client_assertion_audience = token_endpoint in [provider cc] of {sws.config_path}"
                    in first.stderr), first.stderr
            sws.write_config(config.provider("cc", fake.issuer, grant="client_credentials",
                                             client_assertion_audience="token_endpoint"))
            again = sws.run("token", "cc")
            assert again.returncode == 0, again.stderr
            assert fake.assertion_audiences[-1] == fake.url("token")
        assert fake.client_auth_methods[-1] == "private_key_jwt"
    finally:
        fake.stop()


# MARK: - A provider that ignores resource (the fake)


def test_status_says_when_the_provider_ignored_the_resource_indicator(tmp_path, sws):
    fake = FakeIdP(access_token_format="jwt", honour_resource=False).start()
    sws.fakes.append(fake)
    try:
        sws.write_config(config.provider("fake", fake.issuer, scopes="openid api", redirect_port=0)
                         + origin_section("https://a.test", "fake", resource=A_RES))
        assert sws.run("login", "fake", browser="fake").returncode == 0
        printed = sws.run("token", "fake", "--origin", "https://a.test")
        assert printed.returncode == 0, printed.stderr
        assert fake.requests("token")[-1].form["resource"] == A_RES
        authorize = fake.requests("authorize")[-1].params
        assert authorize.get("resource") == A_RES, "the sign-in asks for the origins' resources"
        status = sws.run("status", "fake")
        assert "the provider ignored the resource indicator" in status.stdout, status.stdout
        report = json.loads(sws.run("status", "fake", "--json").stdout)["providers"][0]
        assert report["origin_tokens"][0]["resource_honoured"] is False
        assert report["origin_tokens"][0]["aud"] == ["proxyctl-test-api"]
    finally:
        fake.stop()


# MARK: - Choosing the account


@pytest.mark.parametrize("prompt", ["login", "select_account", "consent"])
def test_prompt_reaches_the_authorization_request(sws, prompt):
    fake = FakeIdP().start()
    sws.fakes.append(fake)
    try:
        sws.write_config(config.provider("fake", fake.issuer, redirect_port=0))
        done = sws.run("login", "fake", "--prompt", prompt, browser="fake")
        assert done.returncode == 0, done.stderr
        assert fake.requests("authorize")[-1].params["prompt"] == prompt
    finally:
        fake.stop()


def test_an_unknown_prompt_is_a_usage_error(sws):
    sws.write_config(config.provider("fake", "https://idp.example", redirect_port=0))
    done = sws.run("login", "fake", "--prompt", "none")
    assert done.returncode == 64 and "login, select_account, consent" in done.stderr


def test_logout_end_session_opens_the_end_session_endpoint_from_discovery(sws):
    fake = FakeIdP().start()
    sws.fakes.append(fake)
    try:
        sws.write_config(config.provider("fake", fake.issuer, redirect_port=0))
        assert sws.run("login", "fake", browser="fake").returncode == 0
        id_token = sws.tokens("fake")["id_token"]
        done = sws.run("logout", "fake", "--end-session", browser="none")
        assert done.returncode == 0, done.stderr
        # The browser starts on its own (logout does not wait for it).
        opened = poll(lambda: [u for u in sws.browser_urls() if "/end_session" in u], message="the browser")[-1]
        assert opened.startswith(fake.url("end_session") + "?")
        assert f"id_token_hint={id_token}" in opened and "client_id=proxyctl-test" in opened
        assert sws.tokens("fake") is None
        # Without a browser the URL is printed, without the ID token.
        assert sws.run("login", "fake", browser="fake").returncode == 0
        printed = sws.run("logout", "fake", "--end-session", "--no-browser")
        assert printed.stdout.strip() == fake.url("end_session") + "?client_id=proxyctl-test"
    finally:
        fake.stop()


@needs_glewlwyd
def test_logout_end_session_with_glewlwyd(sws, idp):
    port = idp.callback_port
    sws.write_config(config.provider("glew", idp.issuer(), scopes="openid profile email", redirect_port=port))
    assert sws.run("login", "glew", browser="glewlwyd", glewlwyd=idp).returncode == 0
    done = sws.run("logout", "glew", "--end-session", browser="none")
    assert done.returncode == 0, done.stderr
    opened = poll(lambda: [u for u in sws.browser_urls() if "/end_session" in u], message="the browser")[-1]
    assert opened.startswith(idp.discovery()["end_session_endpoint"] + "?id_token_hint=")


# MARK: - token_store = secret-service (gnome-keyring-daemon, headless, on a private D-Bus session)


def status_text(sws, **env: str) -> str:
    """`proxyctl status fake`, not recorded for the hygiene check: it prints the DPoP key's thumbprint, which is
    public but looks like a token to the check."""
    done = subprocess.run([proxyctl_bin(), "status", "fake"], capture_output=True, text=True, timeout=30,
                          env=sws.env(**env), cwd=sws.root, stdin=subprocess.DEVNULL)
    return done.stdout


def test_token_store_secret_service_keeps_the_refresh_token_and_dpop_key_there(tmp_path, sws):
    service = HeadlessSecretService(sws.root).start()
    fake = FakeIdP(expires_in=2).start()
    sws.fakes.append(fake)
    try:
        sws.write_config(config.provider("fake", fake.issuer, redirect_port=0, token_binding="dpop"))
        text = sws.config_path.read_text().replace("[proxy]\n", "[proxy]\ntoken_store = secret-service\n", 1)
        sws.config_path.write_text(text)
        bus = {"DBUS_SESSION_BUS_ADDRESS": service.address}
        login = sws.run("login", "fake", browser="fake", **bus)
        assert login.returncode == 0, login.stderr
        state = sws.state_dir
        stored = json.loads((state / "tokens" / "fake.json").read_text())
        assert "refresh_token" not in stored and stored["refresh_token_store"] == "secret-service"
        attributes = ("application", "proxyctl", "state_dir", str(state), "provider", "fake")
        refresh = service.lookup(*attributes, "kind", "refresh_token")
        assert refresh and fake.refresh_token_state(refresh) == "active"
        # The DPoP key too: no key file.
        assert "BEGIN PRIVATE KEY" in (service.lookup(*attributes, "kind", "dpop_key") or "")
        assert not (state / "keys" / "fake.dpop.pem").exists()
        assert "held (in the Secret Service)" in status_text(sws, **bus)
        # A refresh spends the refresh token from the Secret Service and puts the rotated one there.
        wait_expired(sws, "fake")
        token = sws.run("token", "fake", **bus)
        assert token.returncode == 0, token.stderr
        assert fake.count("token", grant_type="refresh_token") == 1
        assert fake.requests("token")[-1].form["refresh_token"] == refresh
        rotated = service.lookup(*attributes, "kind", "refresh_token")
        assert rotated and rotated != refresh and fake.refresh_token_state(rotated) == "active"
        assert "refresh_token" not in json.loads((state / "tokens" / "fake.json").read_text())
        # logout removes it.
        assert sws.run("logout", "fake", **bus).returncode == 0
        assert service.lookup(*attributes, "kind", "refresh_token") is None
        # Without a Secret Service (a headless machine) the 0600 file is the fallback, and status says so.
        service.stop()
        assert sws.run("login", "fake", browser="fake").returncode == 0
        assert "refresh_token" in json.loads((state / "tokens" / "fake.json").read_text())
        status = status_text(sws)
        assert "token_store = secret-service: not available" in status, status
    finally:
        fake.stop()
        service.stop()
