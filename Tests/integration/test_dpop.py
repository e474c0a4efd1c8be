"""DPoP (RFC 9449) end to end: `token_binding = dpop` with a real provider (glewlwyd: plugin `oidc`, DPoP
allowed, and `oidcnonce`, nonces mandatory and rotating), the fault-injecting fake where an exact answer is
needed, and the resource server's DPoP mode (resource_server.py), which verifies every proof with PyJWT and
cryptography, a JOSE implementation independent of proxyctl's.

What is proven: the key file, its RFC 7638 thumbprint, `dpop_jkt`, `cnf.jkt` and `proxyctl status` agree;
refresh is bound to the key (and fails with a sign-in-again message once the key is replaced); DPoP tokens
work through the proxy (glewlwyd's userinfo as an http:// protected origin, the resource server over TLS);
nonces of the authorization server and of resource servers are picked up and retried at most once per
request, only when needed; bodies are replayed byte-identical with a fresh proof after a nonce challenge
and after a forced refresh; `dpop_required` refuses a provider without ES256 and a Bearer answer;
`login --new-key` rebinds; and no proof, DPoP key or nonce ever reaches the proxy's log or the CLI's output.

One glewlwyd, one DPoP resource server and one signed-in proxy (`glew`) serve the module; tests that need
other settings make their own workspace. Every proxy logs at debug level, so the secret scan reads the most
the proxy ever writes.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import json
import os
import re
import sqlite3
import ssl
import subprocess
import sys
import time
from pathlib import Path

import jwt
import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fixtures import config
from fixtures.content import expected_sha256, write_generated
from fixtures.deployment import Deployment, Workspace
from fixtures.http import free_port
from fixtures.pki import new_key_pem
from fixtures.jose import (DPoPError, DPoPVerifier, access_token_hash, b64url, ec_public_jwk, jwk_thumbprint,
                           key_file_thumbprint, normalized_htu, unverified_claims, verify_dpop_proof)
from idp_fake import FakeIdP, Fault
from idp_glewlwyd import Glewlwyd, glewlwyd_available
from resource_server import ResourceServer

pytestmark = pytest.mark.skipif(not glewlwyd_available(), reason="glewlwyd is not installed (scripts/bootstrap test)")

HERE = Path(__file__).resolve().parent
BROWSER = f"{sys.executable} {HERE / 'browser.py'}"
SCOPES = "openid profile email"
DAPI = "dpop.test"          # the DPoP resource server, as reached through the proxy
GLEW = "glew"               # the module's provider: glewlwyd plugin oidc, dpop_required


# MARK: - Configuration and CLI helpers


# This module's providers: DPoP-bound tokens, DPoP required, its scopes and a short sign-in timeout.
provider_section = functools.partial(config.provider, scopes=SCOPES, redirect_port=0, login_timeout="20s",
                                     token_binding="dpop", dpop_required=True)


class DebugWorkspace(Workspace):
    """test_protected's Workspace, with the proxy logging at debug level (the most it ever writes)."""

    LOG_LEVEL = "debug"

    def key_path(self, provider: str) -> Path:
        return self.state / "keys" / f"{provider}.dpop.pem"

    def thumbprint(self, provider: str) -> str:
        """The RFC 7638 thumbprint of the provider's key file, computed here with `cryptography`."""
        return key_file_thumbprint(self.key_path(provider))

    def stored(self, provider: str) -> dict | None:
        path = self.state / "tokens" / f"{provider}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def expire(self, provider: str) -> dict:
        """Makes the stored access token expired (atomically, 0600), so that the next use refreshes it."""
        path = self.state / "tokens" / f"{provider}.json"
        tokens = json.loads(path.read_text())
        tokens["expires_at"] = int(time.time()) - 30
        temporary = path.with_name(f".{provider}.test.tmp")
        temporary.write_text(json.dumps(tokens))
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
        return tokens


class Hygiene:
    """Everything the CLI printed and every proxy log of the module, and every DPoP secret the tests saw
    (proofs, private key material, nonces; access and refresh tokens too). `problems()` lists any secret
    found in any of the texts. `proxyctl token` prints the access token on stdout by design: that stdout is
    scanned for everything but access tokens."""

    def __init__(self):
        self.runs: list[tuple[str, str, str]] = []        # (label, stdout, stderr)
        self.logs: list[Path] = []
        self.secrets: dict[str, str] = {}                 # value -> what it is
        self.sources = []                                 # callables giving (kind, value) pairs at scan time

    def run(self, label: str, done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
        self.runs.append((label, done.stdout, done.stderr))
        return done

    def add(self, kind: str, *values: str | None) -> None:
        for value in values:
            if value and len(value) >= 12:
                self.secrets[value] = kind

    def add_proof(self, proof: str) -> None:
        # The whole proof, and its payload and signature on their own (a log might cut a proof short).
        self.add("DPoP proof", proof)
        _, payload, signature = proof.split(".")
        self.add("DPoP proof payload", payload)
        self.add("DPoP proof signature", signature)

    def add_key_file(self, path: Path) -> None:
        if not path.exists():
            return
        pem = path.read_text()
        body = [line for line in pem.splitlines() if line and not line.startswith("-----")]
        self.add("DPoP private key (PEM)", pem.strip(), "".join(body), *body)
        key = serialization.load_pem_private_key(pem.encode(), password=None)
        d = key.private_numbers().private_value.to_bytes(32, "big")
        self.add("DPoP private key (d)", b64url(d), d.hex(), base64.b64encode(d).decode())
        der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        self.add("DPoP private key (DER)", b64url(der), base64.b64encode(der).decode())

    def add_tokens(self, tokens: dict | None) -> None:
        if tokens:
            self.add("access token", tokens.get("access_token"))
            self.add("refresh token", tokens.get("refresh_token"))

    def problems(self) -> list[str]:
        for source in self.sources:
            for kind, value in source():
                if kind == "proof":
                    self.add_proof(value)
                elif kind == "key file":
                    self.add_key_file(value)
                elif kind == "tokens":
                    self.add_tokens(value)
                else:
                    self.add(kind, value)
        texts = []
        for label, stdout, stderr in self.runs:
            texts.append((f"`{label}` stderr", stderr, set()))
            texts.append((f"`{label}` stdout", stdout, {"access token"} if label.split()[1:2] == ["token"] else set()))
        for path in self.logs:
            if path.exists():
                texts.append((f"proxy log {path}", path.read_bytes().decode("utf-8", "replace"), set()))
        found = []
        for where, text, allowed in texts:
            for secret, kind in self.secrets.items():
                if kind not in allowed and secret in text:
                    found.append(f"{where} contains a {kind} ({secret[:6]}...{len(secret)} chars)")
        return found

    def assert_clean(self) -> None:
        problems = self.problems()
        assert not problems, "secrets in output:\n" + "\n".join(problems)


def login(ws: DebugWorkspace, provider: str, idp: Glewlwyd, hygiene: Hygiene,
          *extra: str) -> subprocess.CompletedProcess:
    done = ws.cli("login", provider, *extra, BROWSER=BROWSER, PROXYCTL_TEST_BROWSER="glewlwyd",
                  PROXYCTL_TEST_IDP_URL=idp.base_url, PROXYCTL_TEST_IDP_USER=idp.username,
                  PROXYCTL_TEST_IDP_PASSWORD=idp.password, PROXYCTL_TEST_IDP_SCOPE=SCOPES)
    hygiene.run(f"proxyctl login {provider} {' '.join(extra)}".strip(), done)
    hygiene.add_key_file(ws.key_path(provider))
    if (ws.state / "tokens" / f"{provider}.json").exists():
        hygiene.add_tokens(ws.tokens(provider))
    return done


def cli(ws: DebugWorkspace, hygiene: Hygiene, *args: str) -> subprocess.CompletedProcess:
    return hygiene.run("proxyctl " + " ".join(args), ws.cli(*args))


def status(ws: DebugWorkspace, hygiene: Hygiene, provider: str) -> tuple[str, dict]:
    text = cli(ws, hygiene, "status", provider)
    assert text.returncode == 0, text.stdout + text.stderr
    as_json = cli(ws, hygiene, "status", provider, "--json")
    assert as_json.returncode == 0, as_json.stdout + as_json.stderr
    return text.stdout, json.loads(as_json.stdout)


def find_key(obj, key: str) -> list:
    """Every value of `key` anywhere in a JSON structure."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                found.append(v)
            found += find_key(v, key)
    elif isinstance(obj, list):
        for v in obj:
            found += find_key(v, key)
    return found


def made_key_thumbprint(stderr: str) -> str:
    found = re.search(r"Made a new DPoP key \(thumbprint ([A-Za-z0-9_-]{43})\)", stderr)
    assert found, f"login did not say it made a key:\n{stderr}"
    return found.group(1)


def intercepted(dep: Deployment, mark: int, target: str, count: int) -> list[str]:
    """The `count` request lines logged after `mark` for `target` ("METHOD URL" without the query; waits for
    them; fails on more). Only the test's own target: the proxy writes a line after its client has the answer,
    so the line of an exchange before the mark can land after it."""
    lines = dep.lines(mark, target=target, at_least=count)
    assert len(lines) == count, f"expected {count} intercepted requests for {target} in the log, got {lines}"
    return lines


def logged_curl(dep: Deployment, url: str, *args: str):
    """curl through the proxy, returning once the request's log line is written (so that the next mark
    taken cannot catch it); (answer, log line)."""
    method = "POST" if "--data-binary" in args else "GET"
    mark = dep.proxy.mark()
    answer = dep.curl(url, *args)
    [line] = intercepted(dep, mark, f"{method} {url.split('?')[0]}", 1)
    return answer, line


def retries(line: str) -> tuple[int, bool, bool]:
    """(attempts, nonce retried, refreshed) of a request's log line."""
    attempts = re.search(r" attempts=(\d+)", line)
    return (int(attempts.group(1)) if attempts else 1, " nonce_retry=1" in line, " refreshed=1" in line)


def glewlwyd_db(idp: Glewlwyd, query: str, *args) -> list[tuple]:
    db = sqlite3.connect(os.path.join(idp.workdir, "glewlwyd.db"), timeout=10)
    try:
        return db.execute(query, args).fetchall()
    finally:
        db.close()


def glewlwyd_nonces(idp: Glewlwyd) -> list[tuple[str, str]]:
    return [("DPoP nonce", row[0]) for row in glewlwyd_db(idp, "SELECT gpodcn_nonce FROM gpo_dpop_client_nonce")]


def glewlwyd_proofs(idp: Glewlwyd, htm: str, htu: str) -> list[str]:
    """The thumbprints of the proofs glewlwyd accepted for (htm, htu), oldest first."""
    rows = glewlwyd_db(idp, "SELECT gpod_jkt FROM gpo_dpop WHERE gpod_htm = ? AND gpod_htu = ? ORDER BY gpod_id",
                       htm, htu)
    return [row[0] for row in rows]


def make_proof(key, method: str, url: str, token: str | None = None, header: dict | None = None,
               **claims) -> str:
    """A proof signed here (for the negative tests of the verifier)."""
    body = {"jti": b64url(os.urandom(12)), "htm": method, "htu": normalized_htu(url), "iat": int(time.time())}
    if token is not None:
        body["ath"] = access_token_hash(token)
    body.update(claims)
    head = {"typ": "dpop+jwt", "alg": "ES256", "jwk": ec_public_jwk(key.public_key())}
    head.update(header or {})
    return jwt.encode({k: v for k, v in body.items() if v is not None}, key, algorithm="ES256",
                      headers={k: v for k, v in head.items() if v is not None})


# MARK: - Module fixtures


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dpop")


@pytest.fixture(scope="module")
def hygiene():
    return Hygiene()


@pytest.fixture(scope="module")
def idp(hygiene):
    callback = free_port()
    with Glewlwyd(redirect_ports=[callback]) as server:
        server.callback_port = callback
        hygiene.sources.append(lambda: glewlwyd_nonces(server))
        yield server


@pytest.fixture(scope="module")
def rs(module_dir, idp, hygiene):
    server = ResourceServer(module_dir / "rs", [DAPI], label="dpop", dpop=True)
    server.trust(idp.issuer(), idp.discovery()["jwks_uri"])
    hygiene.sources.append(lambda: [("proof", p) for p in list(server.dpop.proofs)]
                           + [("DPoP nonce", n) for n in list(server.dpop.issued)])
    yield server
    server.close()


@contextlib.contextmanager
def glew_deployment(root: Path, idp: Glewlwyd, rs: ResourceServer, hygiene: Hygiene):
    """Signed in to glewlwyd (plugin oidc) with DPoP; the CA made; the proxy running for the resource
    server (https://dpop.test:PORT) and glewlwyd itself (http://127.0.0.1:PORT, for its userinfo)."""
    sections = (provider_section(GLEW, idp.issuer("oidc"), redirect_port=idp.callback_port)
                + config.origin(f"https://{DAPI}:{rs.port}", GLEW, ca_file=rs.ca_pem)
                + config.origin(f"http://127.0.0.1:{idp.port}", GLEW))
    ws = DebugWorkspace(root, sections, f"{DAPI}=127.0.0.1", replay_memory="1MiB", replay_spool="64MiB")
    hygiene.run("proxyctl ca init", ws.ca_init())
    done = login(ws, GLEW, idp, hygiene)
    assert done.returncode == 0, done.stderr
    deployment = Deployment(ws, ws.start_proxy())
    deployment.login = done
    hygiene.logs.append(deployment.proxy.log_path)
    hygiene.sources.append(lambda: [("key file", ws.key_path(GLEW)), ("tokens", ws.stored(GLEW))])
    try:
        yield deployment
    finally:
        failure = deployment.stop()
    assert failure is None, failure


@pytest.fixture(scope="module")
def glew(module_dir, idp, rs, hygiene):
    """The module's deployment signed in to glewlwyd with DPoP (glew_deployment)."""
    with glew_deployment(module_dir / "glew", idp, rs, hygiene) as deployment:
        yield deployment


def curl_nonces(hygiene: Hygiene, *answers) -> None:
    """Nonces the client saw in responses (passed through by the proxy) are secrets for the scan too."""
    for answer in answers:
        hygiene.add("DPoP nonce", answer.header("DPoP-Nonce"))


# MARK: - 1. glewlwyd (plugin oidc): the key, the thumbprint, the tokens


def test_login_binds_the_tokens_to_the_key_file(glew, idp, rs, hygiene):
    ws = glew.ws
    key_file = ws.key_path(GLEW)
    thumbprint = ws.thumbprint(GLEW)
    # The key file: private, in a private directory, an EC P-256 key.
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert (ws.state / "keys").stat().st_mode & 0o077 == 0
    assert isinstance(serialization.load_pem_private_key(key_file.read_bytes(), None).curve, ec.SECP256R1)
    # What login said and sent: the key it made, and dpop_jkt on the authorization request.
    assert made_key_thumbprint(glew.login.stderr) == thumbprint
    assert f"dpop_jkt={thumbprint}" in glew.login.stderr
    # The stored tokens.
    tokens = ws.tokens(GLEW)
    assert tokens["token_type"] == "DPoP" and tokens["dpop_jkt"] == thumbprint
    # The access token, verified with glewlwyd's JWKS: bound to the same key.
    claims = rs.verifier.verify(tokens["access_token"])
    assert claims["cnf"] == {"jkt": thumbprint}
    # status, as text and JSON.
    text, data = status(ws, hygiene, GLEW)
    assert re.search(rf"^\s*DPoP key:\s+{re.escape(thumbprint)}\s*$", text, re.M), text
    assert re.search(r"^\s*token type:\s+DPoP\s*$", text, re.M), text
    assert find_key(data, "dpop_jkt") == [thumbprint], data
    # glewlwyd's own records: the refresh token it issued and the proof it accepted for the code exchange.
    assert thumbprint in [row[0] for row in glewlwyd_db(idp, "SELECT gpor_dpop_jkt FROM gpo_refresh_token")]
    assert thumbprint in glewlwyd_proofs(idp, "POST", idp.token_endpoint("oidc"))
    hygiene.assert_clean()


def test_userinfo_through_the_proxy_with_a_dpop_token(glew, idp, hygiene):
    ws = glew.ws
    userinfo = idp.issuer("oidc") + "/userinfo"
    tokens = ws.tokens(GLEW)
    before = len(glewlwyd_proofs(idp, "GET", userinfo))
    mark = glew.proxy.mark()
    answers = [glew.curl(userinfo) for _ in range(2)]
    curl_nonces(hygiene, *answers)
    for answer in answers:
        assert answer.status == 200, answer
        assert answer.json()["sub"] == tokens["identity"]["sub"]
    for line in intercepted(glew, mark, f"GET {userinfo}", 2):
        assert "status=200" in line
        assert retries(line) == (1, False, False), line
    # glewlwyd accepted a proof for each, signed with the key of the token file.
    assert glewlwyd_proofs(idp, "GET", userinfo)[before:] == [ws.thumbprint(GLEW)] * 2
    # The token alone is worth nothing: as Bearer, or as DPoP without a proof, glewlwyd refuses it.
    for scheme in ("Bearer", "DPoP"):
        alone = requests.get(userinfo, headers={"Authorization": f"{scheme} {tokens['access_token']}"}, timeout=10)
        assert alone.status_code in (400, 401, 403), (scheme, alone.status_code, alone.text[:200])
    hygiene.assert_clean()


def test_refresh_is_bound_to_the_key(module_dir, idp, hygiene):
    """Forced expiry: the refresh works with the key; with the key file replaced by another key it fails
    with a sign-in-again message (and nothing is spent); glewlwyd too refuses a refresh signed with another
    key; signing in again binds the tokens to the key now in the file."""
    name = "bind"
    ws = DebugWorkspace(module_dir / name,
                        provider_section(name, idp.issuer("oidc"), redirect_port=idp.callback_port), None)
    hygiene.sources.append(lambda: [("key file", ws.key_path(name)), ("tokens", ws.stored(name))])
    done = login(ws, name, idp, hygiene)
    assert done.returncode == 0, done.stderr
    thumbprint = ws.thumbprint(name)
    first = ws.tokens(name)
    assert first["dpop_jkt"] == thumbprint

    ws.expire(name)
    refreshed = cli(ws, hygiene, "token", name)
    assert refreshed.returncode == 0, refreshed.stderr
    second = ws.tokens(name)
    hygiene.add_tokens(second)
    assert second["generation"] == first["generation"] + 1 and second["last_refresh"]["outcome"] == "ok"
    assert second["access_token"] != first["access_token"] and second["refresh_token"] != first["refresh_token"]
    assert refreshed.stdout.strip() == second["access_token"]
    assert second["token_type"] == "DPoP" and second["dpop_jkt"] == thumbprint
    assert unverified_claims(second["access_token"])["cnf"] == {"jkt": thumbprint}
    # The refresh carried a proof with the key (glewlwyd recorded two token requests with it: code, refresh).
    assert glewlwyd_proofs(idp, "POST", idp.token_endpoint("oidc")).count(thumbprint) == 2

    # Another key in the file: proxyctl notices before asking the provider, and says to sign in again.
    original = ws.key_path(name).read_bytes()
    ws.key_path(name).write_bytes(new_key_pem())
    hygiene.add_key_file(ws.key_path(name))
    other = ws.thumbprint(name)
    ws.expire(name)
    broken = cli(ws, hygiene, "token", name)
    assert broken.returncode != 0 and broken.stdout == "", broken
    assert "bound to a DPoP key that is no longer there" in broken.stderr, broken.stderr
    assert f"proxyctl login {name}" in broken.stderr, broken.stderr
    after = ws.tokens(name)
    assert after["refresh_token"] == second["refresh_token"] and after["generation"] == second["generation"]

    # The provider's side of the binding: with the token file made to name the other key, proxyctl signs the
    # refresh with it, and glewlwyd refuses it (the refresh token is bound to the first key).
    data = ws.tokens(name)
    data["dpop_jkt"] = other
    (ws.state / "tokens" / f"{name}.json").write_text(json.dumps(data))
    ws.expire(name)
    refused = cli(ws, hygiene, "token", name)
    assert refused.returncode != 0 and refused.stdout == "", refused
    assert "invalid_dpop_proof" in refused.stderr, refused.stderr
    assert ws.tokens(name)["refresh_token"] == second["refresh_token"]
    # That refusal spent nothing: with the right key back, the same refresh token still works.
    ws.key_path(name).write_bytes(original)
    data = ws.tokens(name)
    data["dpop_jkt"] = thumbprint
    (ws.state / "tokens" / f"{name}.json").write_text(json.dumps(data))
    ws.expire(name)
    again = cli(ws, hygiene, "token", name)
    assert again.returncode == 0, again.stderr
    hygiene.add_tokens(ws.tokens(name))

    # Signing in again with another key in the file binds the new tokens to that key.
    ws.key_path(name).write_bytes(new_key_pem())
    hygiene.add_key_file(ws.key_path(name))
    relogin = login(ws, name, idp, hygiene)
    assert relogin.returncode == 0, relogin.stderr
    assert "Made a new DPoP key" not in relogin.stderr      # it used the key in the file
    fresh = ws.tokens(name)
    assert fresh["dpop_jkt"] == ws.thumbprint(name) != thumbprint
    assert unverified_claims(fresh["access_token"])["cnf"] == {"jkt": fresh["dpop_jkt"]}
    hygiene.assert_clean()


# MARK: - 2. glewlwyd (plugin oidcnonce): mandatory, rotating nonces


def test_mandatory_rotating_nonces_at_glewlwyd(module_dir, idp, hygiene):
    name = "nonce"
    userinfo = idp.issuer("oidcnonce") + "/userinfo"
    sections = (provider_section(name, idp.issuer("oidcnonce"), redirect_port=idp.callback_port)
                + config.origin(f"http://127.0.0.1:{idp.port}", name))
    ws = DebugWorkspace(module_dir / name, sections, None)
    hygiene.sources.append(lambda: [("key file", ws.key_path(name)), ("tokens", ws.stored(name))])
    # The authorization server's nonce path: glewlwyd refuses every token request without its nonce, and
    # the login process starts with none.
    done = login(ws, name, idp, hygiene)
    assert done.returncode == 0, done.stderr
    thumbprint = ws.thumbprint(name)
    tokens = ws.tokens(name)
    assert tokens["token_type"] == "DPoP" and tokens["dpop_jkt"] == thumbprint
    assert unverified_claims(tokens["access_token"])["cnf"] == {"jkt": thumbprint}
    assert glewlwyd_db(idp, "SELECT count(*) FROM gpo_dpop_client_nonce")[0][0] >= 1

    dep = Deployment(ws, ws.start_proxy())
    hygiene.logs.append(dep.proxy.log_path)
    try:
        # The resource server's nonce path: the proxy starts with no nonce for this origin, so the first
        # request is challenged once; glewlwyd then rotates its nonce on 200s and the proxy follows.
        requests_made = 8
        nonces_before = {n for _, n in glewlwyd_nonces(idp)}
        mark = dep.proxy.mark()
        answers = [dep.curl(userinfo) for _ in range(requests_made)]
        curl_nonces(hygiene, *answers)
        assert [a.status for a in answers] == [200] * requests_made, [str(a) for a in answers if a.status != 200]
        assert all(a.header("Proxy-Status") is None for a in answers)
        assert all(a.json()["sub"] == tokens["identity"]["sub"] for a in answers)
        lines = intercepted(dep, mark, f"GET {userinfo}", requests_made)
        assert retries(lines[0]) == (2, True, False), lines[0]
        for line in lines[1:]:
            assert retries(line) == (1, False, False), f"a retry that was not needed: {line}"
        rotated = [a.header("DPoP-Nonce") for a in answers if a.header("DPoP-Nonce")]
        assert rotated, "glewlwyd handed out no nonce on a 200; the rotation path was not exercised"
        assert len(set(rotated)) == len(rotated)
        assert {n for _, n in glewlwyd_nonces(idp)} != nonces_before

        # A refresh in the proxy (no authorization-server nonce known to this process yet), then the
        # resource: every request still succeeds, each retried for a nonce at most once.
        ws.expire(name)
        mark = dep.proxy.mark()
        answers = [dep.curl(userinfo) for _ in range(3)]
        curl_nonces(hygiene, *answers)
        assert [a.status for a in answers] == [200] * 3, [str(a) for a in answers]
        after = ws.tokens(name)
        hygiene.add_tokens(after)
        assert after["generation"] == tokens["generation"] + 1 and after["dpop_jkt"] == thumbprint
        for line in intercepted(dep, mark, f"GET {userinfo}", 3):
            attempts, nonce_retry, refreshed = retries(line)
            assert attempts == (2 if nonce_retry else 1) and not refreshed, line
        assert not any(retries(line)[1] for line in dep.lines(mark)[1:]), "nonce retries after the first"

        # The CLI's refresh in a new process: the nonce path at the token endpoint again.
        ws.expire(name)
        token = cli(ws, hygiene, "token", name)
        assert token.returncode == 0, token.stderr
        hygiene.add_tokens(ws.tokens(name))
        assert ws.tokens(name)["generation"] == after["generation"] + 1
        hygiene.assert_clean()
    finally:
        failure = dep.stop()
    assert failure is None, failure


# MARK: - 3. dpop_required and providers that do not do DPoP


class BearerAnyway(FakeIdP):
    """A provider that advertises DPoP but answers a token request with a proof with a Bearer token."""

    def _token_response(self, *args, **kwargs):
        response = super()._token_response(*args, **kwargs)
        response["token_type"] = "Bearer"
        return response


def fake_workspace(root: Path, fake: FakeIdP, name: str, required: bool | None) -> DebugWorkspace:
    return DebugWorkspace(root, provider_section(name, fake.issuer, redirect_port=0, dpop_required=required), None)


def fake_login(ws: DebugWorkspace, name: str, hygiene: Hygiene, fake: FakeIdP) -> subprocess.CompletedProcess:
    done = ws.cli("login", name, BROWSER=BROWSER, PROXYCTL_TEST_BROWSER="fake")
    hygiene.run(f"proxyctl login {name}", done)
    hygiene.add_key_file(ws.key_path(name))
    for record in fake.requests("token"):
        if record.dpop:
            hygiene.add_proof(record.dpop)
    return done


@pytest.mark.parametrize("advertised", [None, ["RS256", "PS256"], []], ids=["absent", "no-es256", "empty"])
def test_dpop_required_refuses_a_provider_without_es256(tmp_path, hygiene, advertised):
    with FakeIdP(discovery_overrides={"dpop_signing_alg_values_supported": advertised}) as fake:
        assert "ES256" not in (fake.discovery_document().get("dpop_signing_alg_values_supported") or [])
        ws = fake_workspace(tmp_path, fake, "strict", required=True)
        done = fake_login(ws, "strict", hygiene, fake)
        assert done.returncode != 0, done.stderr
        assert "dpop_required = true" in done.stderr and "does not offer DPoP with ES256" in done.stderr, done.stderr
        assert "[provider strict]" in done.stderr, done.stderr
        # Nothing was started or stored: no authorization request, no token request, no tokens, no key.
        assert fake.count("authorize") == fake.count("par") == fake.count("token") == 0
        assert not (ws.state / "tokens" / "strict.json").exists()
        assert not ws.key_path("strict").exists()
        assert cli(ws, hygiene, "status", "strict").returncode == 1
    hygiene.assert_clean()


def test_dpop_not_required_falls_back_to_bearer_with_a_warning(tmp_path, hygiene):
    with FakeIdP(discovery_overrides={"dpop_signing_alg_values_supported": ["RS256"]}) as fake:
        ws = fake_workspace(tmp_path, fake, "lenient", required=False)
        done = fake_login(ws, "lenient", hygiene, fake)
        assert done.returncode == 0, done.stderr
        assert re.search(r"Warning: .*does not offer DPoP with ES256.*Bearer", done.stderr), done.stderr
        tokens = ws.tokens("lenient")
        hygiene.add_tokens(tokens)
        assert tokens["token_type"] == "Bearer" and "dpop_jkt" not in tokens
        [authorize] = fake.requests("authorize")
        assert "dpop_jkt" not in authorize.params
        assert [r.dpop for r in fake.requests("token")] == [None]
        assert not ws.key_path("lenient").exists()
        text, data = status(ws, hygiene, "lenient")
        assert "DPoP key" not in text and find_key(data, "dpop_jkt") == []
    hygiene.assert_clean()


@pytest.mark.parametrize("required", [True, False], ids=["required", "not-required"])
def test_bearer_answer_to_a_dpop_token_request(tmp_path, hygiene, required):
    with BearerAnyway() as fake:
        ws = fake_workspace(tmp_path, fake, "downgrade", required=required)
        done = fake_login(ws, "downgrade", hygiene, fake)
        [token_request] = fake.requests("token")
        assert token_request.dpop, "proxyctl sent no proof"
        assert verify_dpop_proof(token_request.dpop, "POST", fake.url("token")).jkt == ws.thumbprint("downgrade")
        if required:
            assert done.returncode != 0, done.stderr
            assert "answered a DPoP token request with a Bearer token" in done.stderr, done.stderr
            assert "dpop_required = true" in done.stderr, done.stderr
            assert not (ws.state / "tokens" / "downgrade.json").exists()
        else:
            assert done.returncode == 0, done.stderr
            assert "Warning: the provider issued a Bearer token although DPoP was asked for" in done.stderr
            tokens = ws.tokens("downgrade")
            hygiene.add_tokens(tokens)
            assert tokens["token_type"] == "Bearer" and "dpop_jkt" not in tokens
    hygiene.assert_clean()


def test_token_requests_carry_verified_proofs_and_answer_nonce_challenges(tmp_path, hygiene):
    """The fake checks every token request's proof (PyJWT) and, like a nonce-demanding authorization server,
    refuses any proof without its current nonce: login and refresh each answer the challenge once."""
    with FakeIdP(access_token_format="jwt") as fake:
        verifier = DPoPVerifier()
        verifier.require_nonce = True
        authority = f"127.0.0.1:{fake.port}"
        problems: list[str] = []

        def hook(endpoint, record):
            try:
                verifier.check(record.dpop, record.method, fake.url(endpoint), authority)
            except DPoPError as error:
                if error.error == "use_dpop_nonce":
                    return Fault.use_dpop_nonce(verifier.current_nonce(authority))
                problems.append(f"{endpoint}: {error}")
            return None

        fake.dpop_hook = hook
        ws = fake_workspace(tmp_path, fake, "fake", required=True)
        hygiene.sources.append(lambda: [("DPoP nonce", n) for n in verifier.issued])
        done = fake_login(ws, "fake", hygiene, fake)
        assert done.returncode == 0, done.stderr
        assert problems == []
        thumbprint = ws.thumbprint("fake")
        [authorize] = fake.requests("authorize")
        assert authorize.params["dpop_jkt"] == thumbprint
        login_proofs = [verify_dpop_proof(r.dpop, "POST", fake.url("token")) for r in fake.requests("token")]
        assert [p.nonce for p in login_proofs] == [None, verifier.issued[0]]
        assert len({p.jti for p in login_proofs}) == 2 and {p.jkt for p in login_proofs} == {thumbprint}
        tokens = ws.tokens("fake")
        hygiene.add_tokens(tokens)
        assert tokens["token_type"] == "DPoP" and tokens["dpop_jkt"] == thumbprint
        assert unverified_claims(tokens["access_token"])["cnf"] == {"jkt": thumbprint}

        # Refresh in a new process (no nonce known): challenged once, then accepted.
        verifier.new_nonce(authority)
        ws.expire("fake")
        token = cli(ws, hygiene, "token", "fake")
        for record in fake.requests("token"):
            hygiene.add_proof(record.dpop)
        assert token.returncode == 0, token.stderr
        assert problems == []
        refreshes = [r for r in fake.requests("token") if r.form.get("grant_type") == "refresh_token"]
        assert len(refreshes) == 2, "the refresh was not retried exactly once for the nonce"
        proofs = [verify_dpop_proof(r.dpop, "POST", fake.url("token")) for r in refreshes]
        assert proofs[0].nonce is None and proofs[1].nonce == verifier.issued[-1]
        assert {p.jkt for p in proofs} == {thumbprint} and proofs[0].jti != proofs[1].jti
        after = ws.tokens("fake")
        hygiene.add_tokens(after)
        assert after["generation"] == tokens["generation"] + 1 and after["dpop_jkt"] == thumbprint

        # A server that wants yet another nonce after the retry is not asked a third time.
        fake.dpop_hook = None
        fake.fail("token", Fault.use_dpop_nonce("nonce-one-0123456789"), Fault.use_dpop_nonce("nonce-two-0123456789"))
        hygiene.add("DPoP nonce", "nonce-one-0123456789", "nonce-two-0123456789")
        before = fake.count("token")
        ws.expire("fake")
        stubborn = cli(ws, hygiene, "token", "fake")
        for record in fake.requests("token"):
            hygiene.add_proof(record.dpop)
        assert stubborn.returncode != 0, stubborn.stderr
        assert fake.count("token") == before + 2
    hygiene.assert_clean()


def test_pushed_authorization_request_carries_dpop_jkt(tmp_path, hygiene):
    with FakeIdP() as fake:
        ws = DebugWorkspace(tmp_path, provider_section("par", fake.issuer, redirect_port=0, use_par="always"), None)
        done = fake_login(ws, "par", hygiene, fake)
        assert done.returncode == 0, done.stderr
        thumbprint = ws.thumbprint("par")
        [pushed] = fake.requests("par")
        assert pushed.form["dpop_jkt"] == thumbprint
        [authorize] = fake.requests("authorize")
        assert "request_uri" in authorize.params and "dpop_jkt" not in authorize.query
        [token_request] = fake.requests("token")
        assert verify_dpop_proof(token_request.dpop, "POST", fake.url("token")).jkt == thumbprint
        tokens = ws.tokens("par")
        hygiene.add_tokens(tokens)
        assert tokens["token_type"] == "DPoP" and tokens["dpop_jkt"] == thumbprint
    hygiene.assert_clean()


# MARK: - 4. The resource server's DPoP mode: its verifier, then through the proxy with curl


@pytest.fixture
def signer():
    return ec.generate_private_key(ec.SECP256R1())


URL = "https://api.example:8443/v1/items"
TOKEN = "an-access-token-0123456789"


def test_normalized_htu():
    assert normalized_htu("https://API.Example:443/a/b?c=d#e") == "https://api.example/a/b"
    assert normalized_htu("HTTP://h.test:80") == "http://h.test/"
    assert normalized_htu("https://h.test:8443/x?y") == "https://h.test:8443/x"


@pytest.mark.parametrize("defect", ["good", "typ", "alg", "private-jwk", "foreign-key", "htm", "htu-query",
                                    "htu-port", "iat-old", "iat-future", "ath", "no-ath", "no-jti"])
def test_resource_server_verifier_refuses_bad_proofs(signer, defect):
    """The verifier the proxy's proofs are checked with refuses each defect (so its passing means something)."""
    other = ec.generate_private_key(ec.SECP256R1())
    now = int(time.time())
    header, claims, key = {}, {}, signer
    if defect == "typ":
        header["typ"] = "JWT"
    elif defect == "alg":
        proof = jwt.encode({"jti": "x" * 16, "htm": "GET", "htu": normalized_htu(URL), "iat": now,
                            "ath": access_token_hash(TOKEN)}, "a-shared-secret-of-32-bytes-long!", algorithm="HS256",
                           headers={"typ": "dpop+jwt", "jwk": ec_public_jwk(signer.public_key())})
    elif defect == "private-jwk":
        jwk = ec_public_jwk(signer.public_key())
        jwk["d"] = b64url(signer.private_numbers().private_value.to_bytes(32, "big"))
        header["jwk"] = jwk
    elif defect == "foreign-key":
        key = other                                  # signed with a key other than the header's jwk
    elif defect == "htm":
        claims["htm"] = "POST"
    elif defect == "htu-query":
        claims["htu"] = URL + "?q=1"
    elif defect == "htu-port":
        claims["htu"] = "https://api.example/v1/items"
    elif defect == "iat-old":
        claims["iat"] = now - 61
    elif defect == "iat-future":
        claims["iat"] = now + 61
    elif defect == "ath":
        claims["ath"] = access_token_hash("another-token-0123456789")
    elif defect == "no-ath":
        claims["ath"] = None
    elif defect == "no-jti":
        claims["jti"] = None
    if defect == "foreign-key":
        header["jwk"] = ec_public_jwk(signer.public_key())
    if defect != "alg":
        proof = make_proof(key, "GET", URL, TOKEN, header=header, **claims)
    if defect == "good":
        verified = verify_dpop_proof(proof, "GET", URL + "?page=2", TOKEN)
        assert verified.jkt == jwk_thumbprint(ec_public_jwk(signer.public_key()))
        # ...but only once.
        verifier = DPoPVerifier()
        verifier.check(proof, "GET", URL, "api.example:8443", TOKEN)
        with pytest.raises(DPoPError, match="used before"):
            verifier.check(proof, "GET", URL, "api.example:8443", TOKEN)
        return
    with pytest.raises(DPoPError):
        verify_dpop_proof(proof, "GET", URL + "?page=2", TOKEN)


def direct(rs: ResourceServer, method: str, path: str, headers: dict) -> tuple[int, dict, bytes]:
    """A request straight to the resource server (not through the proxy), as dpop.test."""
    context = ssl.create_default_context(cafile=str(rs.ca_pem))
    context.check_hostname = False
    connection = http.client.HTTPSConnection("127.0.0.1", rs.port, context=context, timeout=10)
    try:
        connection.request(method, path, headers={"Host": rs.authority(), **headers})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def seen_proofs(seen) -> list:
    return [s.proof for s in seen]


def test_get_through_the_proxy_carries_a_verified_proof(glew, rs, hygiene):
    ws = glew.ws
    rs.dpop.require_nonce = False
    mark, seen_mark = glew.proxy.mark(), rs.mark()
    target = "/items/42?q=a%20b&sort=desc"
    answer = glew.curl(rs.url(target))
    assert answer.status == 200, answer
    tokens = ws.tokens(GLEW)
    thumbprint = ws.thumbprint(GLEW)
    [seen] = rs.since(seen_mark)
    assert seen.status == 200 and seen.path == target and seen.scheme == "dpop", seen.error
    assert seen.header_values("Authorization") == [f"DPoP {tokens['access_token']}"]
    proof = seen.proof
    # What the independent verifier already checked, spelled out: the URL without the query, with the port.
    assert proof.claims["htu"] == f"https://{DAPI}:{rs.port}/items/42" and proof.claims["htm"] == "GET"
    assert proof.claims["ath"] == access_token_hash(tokens["access_token"])
    assert abs(proof.claims["iat"] - time.time()) < 5
    assert len(base64.urlsafe_b64decode(proof.jti + "=" * (-len(proof.jti) % 4))) >= 12     # 96 random bits
    assert set(proof.header) == {"typ", "alg", "jwk"} and set(proof.header["jwk"]) == {"kty", "crv", "x", "y"}
    assert proof.jkt == thumbprint == seen.claims["cnf"]["jkt"]
    assert "nonce" not in proof.claims
    assert answer.json()["dpop_jkt"] == thumbprint and answer.json()["token_type"] == "DPoP"
    [line] = intercepted(glew, mark, f"GET https://{DAPI}:{rs.port}/items/42", 1)
    assert retries(line) == (1, False, False) and "status=200" in line, line
    assert "q=a" not in line

    # A fresh proof each time; and the resource server refuses a replayed one, or one for another URL.
    seen_mark = rs.mark()
    answer, _ = logged_curl(glew, rs.url(target))
    assert answer.status == 200 and answer.header("Proxy-Status") is None, answer
    [again] = rs.since(seen_mark)
    assert again.proof.jti != proof.jti
    auth = {"Authorization": f"DPoP {tokens['access_token']}"}
    status, fields, _ = direct(rs, "GET", target, {**auth, "DPoP": proof.raw})
    assert status == 401 and 'error="invalid_dpop_proof"' in fields["WWW-Authenticate"], fields
    status, fields, _ = direct(rs, "GET", "/elsewhere", {**auth, "DPoP": again.proof.raw})
    assert status == 401 and "htu" in fields["WWW-Authenticate"], fields
    status, fields, _ = direct(rs, "GET", target, {"Authorization": f"Bearer {tokens['access_token']}"})
    assert status == 401, fields                               # a DPoP-bound token is no Bearer token
    hygiene.assert_clean()


def post_body(ws: DebugWorkspace, name: str, size: int) -> tuple[Path, str]:
    path = ws.root / name
    write_generated(path, size)
    return path, expected_sha256(size)


def test_resource_nonces_challenge_and_rotation_through_the_proxy(glew, rs, hygiene):
    """The resource server demands its nonce and rotates it on every 200: the proxy, which knows no nonce
    for it yet, is challenged on the first request only; a POST after the nonce went stale is replayed
    byte-identical with a fresh proof carrying the new nonce."""
    rs.dpop.require_nonce = True
    rs.dpop.rotate_on_success = True
    try:
        authority = rs.authority()
        rs.dpop.new_nonce(authority)          # whatever nonce the proxy may hold for the origin is stale now
        mark, seen_mark = glew.proxy.mark(), rs.mark()
        answers = [glew.curl(rs.url(f"/nonce/{i}")) for i in range(4)]
        assert [a.status for a in answers] == [200] * 4, [str(a) for a in answers]
        assert all(a.header("Proxy-Status") is None for a in answers), [str(a) for a in answers]
        lines = intercepted(glew, mark, f"GET https://{DAPI}:{rs.port}/nonce/", 4)
        assert retries(lines[0]) == (2, True, False), lines[0]
        assert all(retries(line) == (1, False, False) for line in lines[1:]), lines
        seen = rs.since(seen_mark)
        assert [s.status for s in seen] == [401, 200, 200, 200, 200]
        assert seen[0].dpop_error == "use_dpop_nonce" and seen[0].proof is None
        nonces = [s.proof.nonce for s in seen[1:]]
        assert None not in nonces and len(set(nonces)) == 4           # a new nonce after every 200
        # The retry used the challenge's nonce; the client got each 200 with the nonce the proxy used next.
        assert nonces[0] == [v for k, v in seen[0].response_headers if k == "DPoP-Nonce"][0]
        assert [a.header("DPoP-Nonce") for a in answers[:3]] == nonces[1:]
        latest = answers[3].header("DPoP-Nonce")
        assert latest and latest not in nonces

        # The nonce goes stale behind the proxy's back; then a POST.
        rs.dpop.new_nonce(authority)
        body, digest = post_body(glew.ws, "nonce-upload.bin", 300 * 1024 + 3)
        mark, seen_mark = glew.proxy.mark(), rs.mark()
        answer = glew.curl(rs.url("/upload?kind=nonce"), "--data-binary", f"@{body}",
                           "-H", "Content-Type: application/octet-stream")
        assert answer.status == 200 and answer.header("Proxy-Status") is None, answer
        assert answer.json()["body_sha256"] == digest and answer.json()["method"] == "POST"
        first, second = rs.since(seen_mark)
        assert (first.status, first.dpop_error, second.status) == (401, "use_dpop_nonce", 200)
        assert first.method == second.method == "POST" and first.path == second.path == "/upload?kind=nonce"
        assert first.body_size == second.body_size == 300 * 1024 + 3
        assert first.body_sha256 == second.body_sha256 == digest
        first_proof = verify_dpop_proof(first.header("DPoP"), "POST", rs.url("/upload"),
                                        first.token, now=time.time())
        assert first_proof.jti != second.proof.jti and first_proof.jkt == second.proof.jkt
        assert first_proof.nonce == latest != second.proof.nonce
        assert second.proof.nonce == [v for k, v in first.response_headers if k == "DPoP-Nonce"][0]
        [line] = intercepted(glew, mark, f"POST https://{DAPI}:{rs.port}/upload?", 1)
        assert retries(line) == (2, True, False) and "status=200" in line, line
        curl_nonces(hygiene, answer, *answers)
    finally:
        rs.dpop.require_nonce = False
        rs.dpop.rotate_on_success = False
    hygiene.assert_clean()


def test_forced_401_refreshes_and_replays_the_post_with_a_fresh_proof(glew, rs, idp, hygiene):
    ws = glew.ws
    rs.dpop.require_nonce = True
    rs.dpop.rotate_on_success = True
    try:
        # Settle the nonce first (this request may be challenged), then force one 401.
        settle, _ = logged_curl(glew, rs.url("/settle"))
        assert settle.status == 200, settle
        curl_nonces(hygiene, settle)
        before = ws.tokens(GLEW)
        body, digest = post_body(ws, "refresh-upload.bin", 200 * 1024 + 1)
        rs.reject_next(1)
        mark, seen_mark = glew.proxy.mark(), rs.mark()
        answer = glew.curl(rs.url("/upload?kind=refresh"), "--data-binary", f"@{body}")
        assert answer.status == 200, answer
        assert answer.json()["body_sha256"] == digest
        after = ws.tokens(GLEW)
        hygiene.add_tokens(after)
        assert after["generation"] == before["generation"] + 1
        thumbprint = ws.thumbprint(GLEW)
        assert after["dpop_jkt"] == thumbprint
        assert unverified_claims(after["access_token"])["cnf"] == {"jkt": thumbprint}
        first, second = rs.since(seen_mark)
        assert (first.status, first.dpop_error, second.status) == (401, "invalid_token", 200)
        assert first.body_sha256 == second.body_sha256 == digest and first.body_size == second.body_size
        # Two distinct proofs for the same request: distinct jti, each bound to the token it came with.
        assert first.proof.jti != second.proof.jti
        assert first.token == before["access_token"] and second.token == after["access_token"]
        assert first.proof.claims["ath"] == access_token_hash(before["access_token"])
        assert second.proof.claims["ath"] == access_token_hash(after["access_token"])
        assert first.proof.jkt == second.proof.jkt == thumbprint
        [line] = intercepted(glew, mark, f"POST https://{DAPI}:{rs.port}/upload?", 1)
        assert retries(line) == (2, False, True) and "status=200" in line, line
        # The refresh itself carried a proof glewlwyd accepted, with the same key.
        assert glewlwyd_proofs(idp, "POST", idp.token_endpoint("oidc"))[-1] == thumbprint
        curl_nonces(hygiene, answer)
    finally:
        rs.dpop.require_nonce = False
        rs.dpop.rotate_on_success = False
    hygiene.assert_clean()


# MARK: - 5. login --new-key


def test_login_with_new_key_rebinds_the_tokens(module_dir, rs, idp, hygiene):
    """`login --new-key` on a deployment of its own: on the module's, it would replace the key that the
    tests of the first login compare with, and worksteal can run this test before them."""
    with glew_deployment(module_dir / "new-key", idp, rs, hygiene) as glew:
        ws = glew.ws
        old = ws.thumbprint(GLEW)
        old_pem = ws.key_path(GLEW).read_bytes()
        done = login(ws, GLEW, idp, hygiene, "--new-key")
        assert done.returncode == 0, done.stderr
        new = ws.thumbprint(GLEW)
        assert new != old and ws.key_path(GLEW).read_bytes() != old_pem
        assert made_key_thumbprint(done.stderr) == new and f"dpop_jkt={new}" in done.stderr
        assert ws.key_path(GLEW).stat().st_mode & 0o777 == 0o600
        tokens = ws.tokens(GLEW)
        assert tokens["dpop_jkt"] == new and rs.verifier.verify(tokens["access_token"])["cnf"] == {"jkt": new}
        text, data = status(ws, hygiene, GLEW)
        assert f"DPoP key:      {new}" in text and find_key(data, "dpop_jkt") == [new]
        # The running proxy signs with the new key from now on: the resource server and glewlwyd accept it.
        seen_mark = rs.mark()
        answer, line = logged_curl(glew, rs.url("/after-new-key"))
        assert answer.status == 200 and answer.json()["dpop_jkt"] == new, answer
        assert retries(line) == (1, False, False), line
        [seen] = rs.since(seen_mark)
        assert seen.proof.jkt == new and seen.token == tokens["access_token"]
        userinfo, _ = logged_curl(glew, idp.issuer("oidc") + "/userinfo")
        assert userinfo.status == 200, userinfo
        assert glewlwyd_proofs(idp, "GET", idp.issuer("oidc") + "/userinfo")[-1] == new
        # And it refreshes with it.
        rs.reject_next(1)
        refreshed, line = logged_curl(glew, rs.url("/refresh-with-new-key"))
        assert refreshed.status == 200, refreshed
        assert retries(line) == (2, False, True), line
        assert ws.tokens(GLEW)["dpop_jkt"] == new
        assert glewlwyd_proofs(idp, "POST", idp.token_endpoint("oidc"))[-1] == new
        hygiene.add_tokens(ws.tokens(GLEW))
        curl_nonces(hygiene, answer, userinfo)
        hygiene.assert_clean()


# MARK: - 6. No proof, key or nonce in the log or the CLI's output


def test_no_proof_key_or_nonce_in_logs_or_output(glew, rs, idp, hygiene):
    """Every secret of the module (each proof the resource server and the fake received, every key file, every
    nonce handed out, the tokens) against every CLI output and every proxy log (debug level)."""
    # Some traffic of its own first, so that the scan has something to read even when run alone.
    rs.dpop.require_nonce = True
    try:
        rs.dpop.new_nonce(rs.authority())
        answer, line = logged_curl(glew, rs.url("/scan"), "--data-binary", "scan me")
        assert answer.status == 200 and retries(line) == (2, True, False), (answer, line)
        curl_nonces(hygiene, answer)
        # Three more proofs (five of its own): worksteal can run this test first on a worker, before any other
        # test of the module made one.
        for index in range(3):
            more, _ = logged_curl(glew, rs.url(f"/scan/{index}"))
            assert more.status == 200, more
            curl_nonces(hygiene, more)
        for args in (("status", GLEW), ("status", GLEW, "--json"), ("token", GLEW), ("env",)):
            done = cli(glew.ws, hygiene, *args)
            assert done.returncode == 0, done.stderr
    finally:
        rs.dpop.require_nonce = False
    problems = hygiene.problems()
    kinds = set(hygiene.secrets.values())
    assert {"DPoP proof", "DPoP private key (PEM)", "DPoP private key (d)", "DPoP nonce"} <= kinds, kinds
    assert len([k for k in hygiene.secrets.values() if k == "DPoP proof"]) >= 5
    assert hygiene.runs and hygiene.logs
    assert not problems, "secrets in output:\n" + "\n".join(problems)
