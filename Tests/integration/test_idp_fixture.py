"""The real provider fixture (idp_glewlwyd.py): glewlwyd 2.7.5 started and configured per module, driven here
with plain `requests` the way proxyctl will drive it, so the sign-in tests can rely on what it does."""
from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
import urllib.parse

import jwt
import pytest
import requests
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from fixtures.http import free_port
from idp_glewlwyd import Glewlwyd, glewlwyd_available

pytestmark = pytest.mark.skipif(not glewlwyd_available(), reason="glewlwyd not installed (scripts/bootstrap test)")

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
ADVERTISED = ("pushed_authorization_request_endpoint", "require_pushed_authorization_requests",
              "device_authorization_endpoint", "revocation_endpoint", "dpop_signing_alg_values_supported",
              "authorization_response_iss_parameter_supported", "code_challenge_methods_supported",
              "end_session_endpoint")


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def idp():
    with Glewlwyd(redirect_ports=[free_port(), free_port()]) as server:
        yield server


def pkce() -> tuple:
    verifier = b64u(secrets.token_bytes(48))
    return verifier, b64u(hashlib.sha256(verifier.encode()).digest())


def authorization_url(idp: Glewlwyd, challenge: str, plugin: str = "oidc", scope: str = "openid profile email api",
                      redirect_uri: str = None, state: str = "st-1", nonce: str = "nonce-1") -> str:
    doc = idp.discovery(plugin)
    return doc["authorization_endpoint"] + "?" + urllib.parse.urlencode({
        "response_type": "code", "client_id": idp.client_id, "redirect_uri": redirect_uri or idp.redirect_uri(),
        "scope": scope, "state": state, "nonce": nonce, "code_challenge": challenge,
        "code_challenge_method": "S256"})


def query_of(url: str) -> dict:
    return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))


def code_exchange(idp: Glewlwyd, plugin: str = "oidc", scope: str = "openid profile email api",
                  headers: dict = None, redirect_uri: str = None) -> requests.Response:
    verifier, challenge = pkce()
    redirect_uri = redirect_uri or idp.redirect_uri()
    q = query_of(idp.login_browser(authorization_url(idp, challenge, plugin, scope, redirect_uri)))
    return requests.post(idp.token_endpoint(plugin), data={
        "grant_type": "authorization_code", "code": q["code"], "redirect_uri": redirect_uri,
        "client_id": idp.client_id, "code_verifier": verifier}, headers=headers, timeout=10)


def refresh(idp: Glewlwyd, token: str, plugin: str = "oidc", headers: dict = None) -> requests.Response:
    return requests.post(idp.token_endpoint(plugin), data={"grant_type": "refresh_token", "refresh_token": token,
                                                           "client_id": idp.client_id}, headers=headers, timeout=10)


def verify(idp: Glewlwyd, token: str, plugin: str = "oidc", audience=None) -> dict:
    keys = {k["kid"]: k for k in requests.get(idp.discovery(plugin)["jwks_uri"], timeout=5).json()["keys"]}
    header = jwt.get_unverified_header(token)
    key = keys[header["kid"]]
    return jwt.decode(token, jwt.PyJWK(key).key, algorithms=[header["alg"]], issuer=idp.issuer(plugin),
                      audience=audience or idp.client_id)


class DPoPKey:
    def __init__(self):
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.jwk = json.loads(ECAlgorithm.to_jwk(self.key.public_key()))
        canonical = json.dumps({k: self.jwk[k] for k in ("crv", "kty", "x", "y")}, separators=(",", ":"),
                               sort_keys=True)
        self.thumbprint = b64u(hashlib.sha256(canonical.encode()).digest())

    def proof(self, htm: str, htu: str, nonce: str = None, access_token: str = None) -> str:
        claims = {"jti": secrets.token_urlsafe(16), "htm": htm, "htu": htu, "iat": int(time.time())}
        if nonce:
            claims["nonce"] = nonce
        if access_token:
            claims["ath"] = b64u(hashlib.sha256(access_token.encode()).digest())
        return jwt.encode(claims, self.key, algorithm="ES256", headers={"typ": "dpop+jwt", "jwk": self.jwk})


# ------------------------------------------------------------------------------------------ discovery

def test_start_up_is_fast(idp, record_property):
    record_property("glewlwyd_start_s", round(idp.timings["total"], 3))     # shown in the summary
    assert idp.timings["total"] < 5
    assert requests.get(idp.base_url + "/config", timeout=5).status_code == 200

def test_discovery_document(idp):
    for plugin in Glewlwyd.PLUGINS:
        doc = idp.discovery(plugin)
        assert doc["issuer"] == idp.issuer(plugin)
        present = {f: doc[f] for f in ADVERTISED if f in doc}
        print(plugin, json.dumps(present, indent=1))      # visible with -s
        assert doc["code_challenge_methods_supported"] == ["S256"]
        assert doc["require_pushed_authorization_requests"] is False
        for f in ("pushed_authorization_request_endpoint", "device_authorization_endpoint", "revocation_endpoint",
                  "end_session_endpoint", "dpop_signing_alg_values_supported"):
            assert f in doc, f
        # glewlwyd sends `iss` on the redirect (oauth-as-iss-id) but does not advertise it (RFC 9207)
        assert "authorization_response_iss_parameter_supported" not in doc
        # and it does not list refresh_token although it grants it
        assert "refresh_token" not in doc["grant_types_supported"]


# ------------------------------------------------------------------------------------------ code + PKCE

def test_code_flow_with_pkce(idp):
    verifier, challenge = pkce()
    location = idp.login_browser(authorization_url(idp, challenge, state="the-state", nonce="the-nonce"))
    assert location.startswith(idp.redirect_uri() + "?")
    q = query_of(location)
    assert q["state"] == "the-state" and q["iss"] == idp.issuer() and q["code"]
    r = requests.post(idp.token_endpoint(), data={"grant_type": "authorization_code", "code": q["code"],
                                                  "redirect_uri": idp.redirect_uri(), "client_id": idp.client_id,
                                                  "code_verifier": verifier}, timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_type"] == "bearer" and body["expires_in"] == 3600 and body["scope"] == "openid profile email api"
    claims = verify(idp, body["id_token"])
    assert claims["nonce"] == "the-nonce" and claims["azp"] == idp.client_id
    assert claims["name"] == idp.name and claims["email"] == idp.email and claims["amr"] == ["password"]
    assert jwt.get_unverified_header(body["access_token"])["typ"] == "at+jwt"
    at = verify(idp, body["access_token"], audience="openid profile email api")  # aud is the scope string
    assert at["sub"] == claims["sub"]
    info = requests.get(idp.discovery()["userinfo_endpoint"],
                        headers={"Authorization": "Bearer " + body["access_token"]}, timeout=5)
    assert info.json() == {"sub": claims["sub"], "name": idp.name, "email": idp.email}
    # the code is single-use; glewlwyd answers 403 invalid_code (not RFC 6749's 400 invalid_grant)
    again = requests.post(idp.token_endpoint(), data={"grant_type": "authorization_code", "code": q["code"],
                                                      "redirect_uri": idp.redirect_uri(), "client_id": idp.client_id,
                                                      "code_verifier": verifier}, timeout=10)
    assert again.status_code == 403 and again.json() == {"error": "invalid_code"}


def test_wrong_verifier_and_missing_pkce(idp):
    _, challenge = pkce()
    q = query_of(idp.login_browser(authorization_url(idp, challenge)))
    r = requests.post(idp.token_endpoint(), data={"grant_type": "authorization_code", "code": q["code"],
                                                  "redirect_uri": idp.redirect_uri(), "client_id": idp.client_id,
                                                  "code_verifier": pkce()[0]}, timeout=10)
    assert r.status_code == 403 and r.json()["error"] == "invalid_code"
    url = authorization_url(idp, challenge).replace("&code_challenge=", "&x=")
    assert query_of(idp.login_browser(url))["error"] == "invalid_request"


def test_redirect_uris_are_exact(idp):
    port = idp.redirect_ports[1]
    assert code_exchange(idp, redirect_uri=f"http://localhost:{port}/callback").status_code == 200
    unregistered = free_port()
    uri = f"http://127.0.0.1:{unregistered}/callback"
    s = idp.user_session()
    idp.grant(s, "openid")
    r = s.get(authorization_url(idp, pkce()[1], scope="openid", redirect_uri=uri) + "&g_continue",
              allow_redirects=False, timeout=5)
    assert r.status_code == 403 and "Location" not in r.headers            # no redirect, empty body
    idp.add_redirect_ports([unregistered])
    assert code_exchange(idp, scope="openid", redirect_uri=uri).status_code == 200


# ------------------------------------------------------------------------------------------ refresh

def test_refresh_rotation_and_reuse_kills_the_chain(idp):
    first = code_exchange(idp).json()
    r = refresh(idp, first["refresh_token"])
    assert r.status_code == 200
    second = r.json()
    assert second["refresh_token"] != first["refresh_token"] and "id_token" not in second
    r = refresh(idp, first["refresh_token"])                    # replay of a used token
    assert r.status_code == 400 and r.content == b""           # glewlwyd: empty body
    r = refresh(idp, second["refresh_token"])                   # the chain is dead
    assert r.status_code == 400 and r.content == b""


def test_delete_token_and_server_side_revocation(idp):
    tokens = code_exchange(idp, scope="openid").json()
    r = requests.post(idp.token_endpoint(), data={"grant_type": "delete_token",
                                                  "refresh_token": tokens["refresh_token"],
                                                  "client_id": idp.client_id}, timeout=5)
    assert r.status_code == 200
    assert refresh(idp, tokens["refresh_token"]).status_code == 400
    tokens = code_exchange(idp, scope="openid").json()
    assert idp.revoke_refresh_tokens() >= 1
    assert refresh(idp, tokens["refresh_token"]).status_code == 400


def test_short_access_tokens_and_changing_the_duration():
    with Glewlwyd(access_token_duration=5) as short:
        dev = requests.post(short.discovery()["device_authorization_endpoint"],
                            data={"client_id": short.client_id, "scope": "openid"}, timeout=5).json()
        short.approve_device(dev["user_code"])
        body = requests.post(short.token_endpoint(), data={"grant_type": DEVICE_GRANT,
                                                           "device_code": dev["device_code"],
                                                           "client_id": short.client_id}, timeout=5).json()
        assert body["expires_in"] == 5
        claims = jwt.decode(body["access_token"], options={"verify_signature": False})
        assert claims["exp"] - claims["iat"] == 5
        short.set_access_token_duration(7)
        r = refresh(short, body["refresh_token"])          # the refresh token survives the plugin reload
        assert r.status_code == 200 and r.json()["expires_in"] == 7


# ------------------------------------------------------------------------------------------ device flow, PAR

def test_device_flow(idp):
    doc = idp.discovery()
    dev = requests.post(doc["device_authorization_endpoint"], data={"client_id": idp.client_id,
                                                                    "scope": "openid profile"}, timeout=5).json()
    assert dev["interval"] == 1 and dev["verification_uri_complete"].endswith(dev["user_code"])
    data = {"grant_type": DEVICE_GRANT, "device_code": dev["device_code"], "client_id": idp.client_id}
    assert requests.post(doc["token_endpoint"], data=data, timeout=5).json() == {"error": "authorization_pending"}
    # polled again at once: slow_down (glewlwyd compares whole seconds, so across a second boundary it is
    # authorization_pending again)
    assert requests.post(doc["token_endpoint"], data=data, timeout=5).json()["error"] in ("slow_down",
                                                                                          "authorization_pending")
    idp.approve_device(dev["user_code"])
    deadline = time.monotonic() + 10
    while True:                                   # poll at the advertised interval, as a client must
        time.sleep(dev["interval"])
        r = requests.post(doc["token_endpoint"], data=data, timeout=5)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        assert r.json()["error"] == "slow_down"
    assert r.status_code == 200, r.text
    assert verify(idp, r.json()["id_token"])["name"] == idp.name


def test_par(idp):
    doc = idp.discovery()
    verifier, challenge = pkce()
    r = requests.post(doc["pushed_authorization_request_endpoint"], data={
        "response_type": "code", "client_id": idp.client_id, "redirect_uri": idp.redirect_uri(), "scope": "openid api",
        "state": "par-state", "nonce": "par-nonce", "code_challenge": challenge, "code_challenge_method": "S256"},
        timeout=5)
    assert r.status_code == 201, r.text
    request_uri = r.json()["request_uri"]
    assert request_uri.startswith("urn:ietf:params:oauth:request_uri:") and r.json()["expires_in"] == 90
    url = doc["authorization_endpoint"] + "?" + urllib.parse.urlencode({"client_id": idp.client_id,
                                                                       "request_uri": request_uri})
    q = query_of(idp.login_browser(url, scope="openid api"))
    assert q["state"] == "par-state"
    r = requests.post(doc["token_endpoint"], data={"grant_type": "authorization_code", "code": q["code"],
                                                   "redirect_uri": idp.redirect_uri(), "client_id": idp.client_id,
                                                   "code_verifier": verifier}, timeout=10)
    assert r.status_code == 200 and verify(idp, r.json()["id_token"])["nonce"] == "par-nonce"


# ------------------------------------------------------------------------------------------ second factor

def test_mfa_scope_needs_the_otp_factor(idp):
    s = idp.user_session()                         # password only
    idp.grant(s, "openid mfa")
    r = s.get(authorization_url(idp, pkce()[1], scope="openid mfa") + "&g_continue", allow_redirects=False, timeout=5)
    assert "login.html" in r.headers["Location"]  # sent back to sign in
    for _ in range(2):                             # one-time codes: a second sign-in at once works too
        body = code_exchange(idp, scope="openid mfa").json()     # login_browser adds the OTP factor
        assert body["scope"] == "openid mfa"
        assert verify(idp, body["id_token"])["amr"] == ["password", "otp"]


# ------------------------------------------------------------------------------------------ DPoP

def test_dpop_nonce_dance(idp):
    plugin = "oidcnonce"
    doc = idp.discovery(plugin)
    te, ue = doc["token_endpoint"], doc["userinfo_endpoint"]
    key = DPoPKey()
    verifier, challenge = pkce()
    q = query_of(idp.login_browser(authorization_url(idp, challenge, plugin=plugin, scope="openid api")))
    data = {"grant_type": "authorization_code", "code": q["code"], "redirect_uri": idp.redirect_uri(),
            "client_id": idp.client_id, "code_verifier": verifier}
    r = requests.post(te, data=data, headers={"DPoP": key.proof("POST", te)}, timeout=10)
    assert r.status_code == 400 and r.json()["error"] == "use_dpop_nonce"
    nonce = r.headers["DPoP-Nonce"]
    r = requests.post(te, data=data, headers={"DPoP": key.proof("POST", te, nonce)}, timeout=10)
    assert r.status_code == 200, r.text
    nonce = r.headers.get("DPoP-Nonce", nonce)
    body = r.json()
    assert body["token_type"] == "DPoP"
    assert jwt.decode(body["access_token"], options={"verify_signature": False})["cnf"] == {"jkt": key.thumbprint}
    at = body["access_token"]
    for _ in range(2):     # the nonce is shared with the token endpoint; retry once if it was renewed meanwhile
        r = requests.get(ue, headers={"Authorization": "DPoP " + at, "DPoP": key.proof("GET", ue, nonce, at)},
                         timeout=5)
        if r.status_code != 401 or 'use_dpop_nonce' not in r.headers.get("WWW-Authenticate", ""):
            break
        nonce = r.headers["DPoP-Nonce"]
    assert r.status_code == 200 and r.json()["name"] == idp.name
    nonce = r.headers.get("DPoP-Nonce", nonce)
    # the same token as a bearer token: 401 without WWW-Authenticate
    r = requests.get(ue, headers={"Authorization": "Bearer " + at}, timeout=5)
    assert r.status_code == 401 and "WWW-Authenticate" not in r.headers
    # a proof for the right path on another origin spelling is refused (htu compared as a string)
    r = requests.post(te, data={"grant_type": "refresh_token", "refresh_token": body["refresh_token"],
                                "client_id": idp.client_id},
                      headers={"DPoP": key.proof("POST", te.replace("127.0.0.1", "localhost"), nonce)}, timeout=5)
    assert r.status_code in (400, 403)


def test_dpop_bound_refresh_without_nonces(idp):
    te = idp.token_endpoint("oidc")
    key = DPoPKey()
    r = code_exchange(idp, scope="openid", headers={"DPoP": key.proof("POST", te)})
    assert r.status_code == 200 and r.json()["token_type"] == "DPoP"
    rt = r.json()["refresh_token"]
    r = refresh(idp, rt, headers={"DPoP": DPoPKey().proof("POST", te)})       # another key
    assert r.status_code in (400, 403)
    r = refresh(idp, rt, headers={"DPoP": key.proof("POST", te)})
    assert r.status_code == 200 and r.json()["token_type"] == "DPoP"


# ------------------------------------------------------------------------------------------ ES256 keys

def test_es256_client():
    with Glewlwyd(ec_key=True) as server:
        keys = requests.get(server.discovery()["jwks_uri"], timeout=5).json()["keys"]
        assert sorted(k["kid"] for k in keys) == sorted([server.rsa_kid, server.ec_kid])
        for client_id, alg in ((server.client_id, "RS256"), (server.client_id + "-es256", "ES256")):
            dev = requests.post(server.discovery()["device_authorization_endpoint"],
                                data={"client_id": client_id, "scope": "openid"}, timeout=5).json()
            server.approve_device(dev["user_code"], client_id=client_id)
            body = requests.post(server.token_endpoint(), data={"grant_type": DEVICE_GRANT,
                                                                "device_code": dev["device_code"],
                                                                "client_id": client_id}, timeout=5).json()
            assert jwt.get_unverified_header(body["id_token"])["alg"] == alg
            assert verify(server, body["id_token"], audience=client_id)["azp"] == client_id
