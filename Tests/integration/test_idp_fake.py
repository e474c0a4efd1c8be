"""The fault-injecting fake OpenID provider (idp_fake.py), exercised with plain `requests`, so the sign-in tests
can trust it. Independent checks use PyJWT (signatures, claims) rather than the fake's own JOSE code."""
from __future__ import annotations

import concurrent.futures
import email.utils
import json
import secrets
import time
import urllib.parse

import jwt
import pytest
import requests
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from fixtures.jose import jwk_thumbprint
from idp_fake import DEVICE_GRANT, ID_TOKEN_DEFECTS, Fault, FakeIdP, pkce_pair

REDIRECT = "http://127.0.0.1:45123/callback"


@pytest.fixture
def idp():
    with FakeIdP() as fake:
        yield fake


def query_of(location: str) -> dict:
    return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(location).query))


def sign_in(idp: FakeIdP, nonce: str = "n-1", scope: str = "openid profile email", **extra) -> tuple:
    """(code, verifier, redirect query) after a successful authorization request."""
    verifier, challenge = pkce_pair()
    loc = idp.login_browser(idp.authorization_url(REDIRECT, challenge, state="s-1", nonce=nonce, scope=scope, **extra))
    q = query_of(loc)
    assert loc.startswith(REDIRECT + "?")
    return q.get("code"), verifier, q


def exchange(idp: FakeIdP, code: str, verifier: str, headers=None) -> requests.Response:
    return requests.post(idp.url("token"), data={"grant_type": "authorization_code", "code": code,
                                                 "redirect_uri": REDIRECT, "client_id": idp.client_id,
                                                 "code_verifier": verifier}, headers=headers, timeout=10)


def refresh(idp: FakeIdP, token: str, headers=None) -> requests.Response:
    return requests.post(idp.url("token"), data={"grant_type": "refresh_token", "refresh_token": token,
                                                 "client_id": idp.client_id}, headers=headers, timeout=10)


def login_tokens(idp: FakeIdP, **kw) -> dict:
    code, verifier, _ = sign_in(idp, **kw)
    r = exchange(idp, code, verifier)
    assert r.status_code == 200, r.text
    return r.json()


def verify_id_token(idp: FakeIdP, token: str, nonce: str = "n-1") -> dict:
    """What a careful client does: key by kid from the JWKS, alg from the key, aud, iss, exp, iat, nonce."""
    header = jwt.get_unverified_header(token)
    keys = {k["kid"]: k for k in requests.get(idp.url("jwks"), timeout=5).json()["keys"]}
    if header.get("alg") == "none":
        raise jwt.InvalidAlgorithmError("alg none")
    if header.get("kid") not in keys:
        raise LookupError("unknown kid")
    jwk = keys[header["kid"]]
    claims = jwt.decode(token, jwt.PyJWK(jwk).key, algorithms=[jwk["alg"]], audience=idp.client_id,
                        issuer=idp.issuer, options={"require": ["exp", "iat", "sub", "aud", "iss"]})
    if claims["iat"] > time.time() + 60:
        raise jwt.ImmatureSignatureError("iat in the future")
    if claims.get("nonce") != nonce:
        raise ValueError("nonce mismatch")
    if isinstance(claims["aud"], list) and len(claims["aud"]) > 1 and claims.get("azp") != idp.client_id:
        raise ValueError("multiple audiences without azp")
    return claims


def dpop_proof(key, htm: str, htu: str, nonce: str = None, ath: str = None) -> str:
    claims = {"jti": secrets.token_urlsafe(16), "htm": htm, "htu": htu, "iat": int(time.time())}
    if nonce:
        claims["nonce"] = nonce
    if ath:
        claims["ath"] = ath
    jwk = json.loads(ECAlgorithm.to_jwk(key.public_key()))
    return jwt.encode(claims, key, algorithm="ES256", headers={"typ": "dpop+jwt", "jwk": jwk})


# ------------------------------------------------------------------------------------------ discovery, keys

def test_discovery_both_well_known_documents(idp):
    for path in ("/.well-known/openid-configuration", "/.well-known/oauth-authorization-server"):
        doc = requests.get(idp.base_url + path, timeout=5).json()
        assert doc["issuer"] == idp.issuer
        for field in ("authorization_endpoint", "token_endpoint", "jwks_uri", "userinfo_endpoint",
                      "revocation_endpoint", "device_authorization_endpoint",
                      "pushed_authorization_request_endpoint"):
            assert doc[field].startswith(idp.issuer + "/")
        assert doc["code_challenge_methods_supported"] == ["S256"]
        assert doc["authorization_response_iss_parameter_supported"] is True
        assert "ES256" in doc["dpop_signing_alg_values_supported"]
    assert idp.count("discovery") == 2


def test_discovery_with_issuer_path_and_overrides():
    with FakeIdP(issuer_path="/realms/test", advertise_iss=False,
                 discovery_overrides={"device_authorization_endpoint": None, "x-extra": 1}) as idp:
        assert idp.issuer.endswith("/realms/test")
        oidc = requests.get(idp.issuer + "/.well-known/openid-configuration", timeout=5).json()
        rfc8414 = requests.get(idp.base_url + "/.well-known/oauth-authorization-server/realms/test", timeout=5).json()
        assert oidc == rfc8414
        assert oidc["token_endpoint"] == idp.base_url + "/realms/test/token"
        assert "authorization_response_iss_parameter_supported" not in oidc
        assert "device_authorization_endpoint" not in oidc and oidc["x-extra"] == 1
        assert requests.get(idp.base_url + "/token", timeout=5).status_code == 404
        loc = idp.login_browser(idp.authorization_url(REDIRECT, pkce_pair()[1]))
        assert "iss" not in query_of(loc)


def test_jwks_has_rs256_ps256_es256(idp):
    keys = requests.get(idp.url("jwks"), timeout=5).json()["keys"]
    assert sorted(k["alg"] for k in keys) == ["ES256", "PS256", "RS256"]
    assert len({k["kid"] for k in keys}) == 3
    assert all("d" not in k for k in keys)


@pytest.mark.parametrize("alg", ["RS256", "PS256", "ES256"])
def test_id_token_signed_with_each_alg(alg):
    with FakeIdP(signing_alg=alg, acr="urn:mfa") as idp:
        tokens = login_tokens(idp)
        assert jwt.get_unverified_header(tokens["id_token"])["alg"] == alg
        claims = verify_id_token(idp, tokens["id_token"])
        assert claims["sub"] == "alice-0001" and claims["name"] == "Alice Liddell"
        assert claims["email"] == "alice@example.test" and claims["azp"] == idp.client_id
        assert claims["acr"] == "urn:mfa" and abs(claims["auth_time"] - time.time()) < 30


def test_rotate_keys_publishes_after_n_fetches(idp):
    old_jwks = requests.get(idp.url("jwks"), timeout=5).json()       # a client's cached JWKS
    kid = idp.rotate_keys(publish_after=2)
    tokens = login_tokens(idp)
    assert jwt.get_unverified_header(tokens["id_token"])["kid"] == kid
    assert kid not in {k["kid"] for k in old_jwks["keys"]}
    seen = []
    for _ in range(3):
        seen.append(kid in {k["kid"] for k in requests.get(idp.url("jwks"), timeout=5).json()["keys"]})
    assert seen == [False, False, True]
    verify_id_token(idp, tokens["id_token"])
    assert idp.count("jwks") == 5


def test_rotate_keys_at_once_and_drop_old(idp):
    before = {k["kid"] for k in idp.jwks()["keys"]}
    kid = idp.rotate_keys("ES256", publish_after=0, drop_old=True)
    after = {k["kid"] for k in idp.jwks()["keys"]}
    assert kid in after and len(after) == 3 and len(before - after) == 1


# ------------------------------------------------------------------------------------------ code + PKCE

def test_code_flow_with_pkce(idp):
    code, verifier, q = sign_in(idp)
    assert q["state"] == "s-1" and q["iss"] == idp.issuer
    r = exchange(idp, code, verifier)
    assert r.status_code == 200 and r.headers["Cache-Control"] == "no-store"
    body = r.json()
    assert body["token_type"] == "Bearer" and body["expires_in"] == 3600 and body["scope"] == "openid profile email"
    assert verify_id_token(idp, body["id_token"])["nonce"] == "n-1"
    sent = idp.last_request("token").form
    assert sent["code_verifier"] == verifier and sent["client_id"] == idp.client_id
    assert idp.last_request("authorize").query["code_challenge_method"] == "S256"
    assert idp.introspect(body["access_token"])["scope"] == "openid profile email"
    # the code is single-use
    again = exchange(idp, code, verifier)
    assert again.status_code == 400 and again.json()["error"] == "invalid_grant"


def test_pkce_wrong_verifier_and_redirect_mismatch(idp):
    code, _, _ = sign_in(idp)
    r = exchange(idp, code, pkce_pair()[0])
    assert r.status_code == 400 and r.json() == {"error": "invalid_grant",
                                                 "error_description": "PKCE verification failed"}
    code, verifier, _ = sign_in(idp)
    r = requests.post(idp.url("token"), data={"grant_type": "authorization_code", "code": code,
                                              "redirect_uri": "http://127.0.0.1:1/callback",
                                              "client_id": idp.client_id, "code_verifier": verifier}, timeout=5)
    assert r.json()["error"] == "invalid_grant"


def test_authorize_refuses_missing_pkce_and_foreign_redirects(idp):
    loc = idp.login_browser(idp.authorization_url(REDIRECT, None, state="st"))
    assert query_of(loc)["error"] == "invalid_request" and query_of(loc)["state"] == "st"
    for bad in ("https://example.com/cb", "http://192.0.2.1:80/cb", "http://127.0.0.1/cb"):
        r = requests.get(idp.authorization_url(bad, pkce_pair()[1]), allow_redirects=False, timeout=5)
        assert r.status_code == 400 and "Location" not in r.headers
    # any loopback port and host spelling is fine (RFC 8252 7.3)
    for ok in ("http://localhost:1234/callback", "http://[::1]:9/cb"):
        assert "code=" in idp.login_browser(idp.authorization_url(ok, pkce_pair()[1]))


def test_exact_redirect_uris_when_configured():
    with FakeIdP(redirect_uris=[REDIRECT]) as idp:
        assert "code=" in idp.login_browser(idp.authorization_url(REDIRECT, pkce_pair()[1]))
        r = requests.get(idp.authorization_url("http://127.0.0.1:45124/callback", pkce_pair()[1]),
                         allow_redirects=False, timeout=5)
        assert r.status_code == 400


@pytest.mark.parametrize("fault,expect", [
    (Fault.authorize_error("access_denied", "The user cancelled"),
     {"error": "access_denied", "error_description": "The user cancelled"}),
    (Fault.user_not_registered(), {"error": "access_denied", "error_description": "user_not_registered"}),
])
def test_authorize_errors(idp, fault, expect):
    idp.fail("authorize", fault)
    q = query_of(idp.login_browser(idp.authorization_url(REDIRECT, pkce_pair()[1], state="st")))
    assert {k: q[k] for k in expect} == expect
    assert q["state"] == "st" and q["iss"] == idp.issuer and "code" not in q


def test_authorize_iss_and_state_faults(idp):
    idp.fail("authorize", Fault.wrong_iss(), Fault.missing_iss(), Fault.wrong_state())
    _, _, q1 = sign_in(idp)
    _, _, q2 = sign_in(idp)
    _, _, q3 = sign_in(idp)
    assert q1["iss"] == "https://attacker.example" and "code" in q1
    assert "iss" not in q2 and "code" in q2
    assert q3["state"] != "s-1"
    _, _, q4 = sign_in(idp)
    assert q4["iss"] == idp.issuer and q4["state"] == "s-1"


# ------------------------------------------------------------------------------------------ refresh

def test_refresh_rotation_and_reuse_detection(idp):
    first = login_tokens(idp)
    r = refresh(idp, first["refresh_token"])
    assert r.status_code == 200
    second = r.json()
    assert second["refresh_token"] != first["refresh_token"] and "id_token" in second
    assert idp.refresh_token_state(first["refresh_token"]) == "rotated"
    # replaying the old one is theft: the whole chain dies, the new token too
    r = refresh(idp, first["refresh_token"])
    assert r.status_code == 400 and r.json()["error"] == "invalid_grant"
    assert idp.reuse_detected == 1
    assert refresh(idp, second["refresh_token"]).json()["error"] == "invalid_grant"
    assert idp.refresh_token_state(second["refresh_token"]) == "revoked"
    assert idp.count("token", grant_type="refresh_token") == 3


def test_refresh_without_rotation():
    with FakeIdP(refresh_rotation=False, id_token_on_refresh=False, expires_in=None) as idp:
        tokens = login_tokens(idp)
        assert "expires_in" not in tokens
        for _ in range(2):
            body = refresh(idp, tokens["refresh_token"]).json()
            assert "refresh_token" not in body and "id_token" not in body and "access_token" in body


def test_server_side_revocation_and_expiry(idp):
    tokens = login_tokens(idp)
    auth = {"Authorization": "Bearer " + tokens["access_token"]}
    r = requests.get(idp.url("userinfo"), headers=auth, timeout=5)
    assert r.status_code == 200 and r.json()["email"] == "alice@example.test"
    idp.expire_access_tokens()
    r = requests.get(idp.url("userinfo"), headers=auth, timeout=5)
    assert r.status_code == 401 and 'error="invalid_token"' in r.headers["WWW-Authenticate"]
    idp.revoke_refresh_token(tokens["refresh_token"])
    assert refresh(idp, tokens["refresh_token"]).json()["error"] == "invalid_grant"
    other = login_tokens(idp)
    idp.revoke_all()
    assert refresh(idp, other["refresh_token"]).status_code == 400
    assert idp.introspect(other["access_token"]) is None


def test_jwt_access_tokens():
    with FakeIdP(access_token_format="jwt", expires_in=5) as idp:
        tokens = login_tokens(idp)
        header = jwt.get_unverified_header(tokens["access_token"])
        key = next(k for k in idp.jwks()["keys"] if k["kid"] == header["kid"])
        claims = jwt.decode(tokens["access_token"], jwt.PyJWK(key).key, algorithms=["RS256"],
                            audience="proxyctl-test-api", issuer=idp.issuer)
        assert header["typ"] == "at+jwt" and claims["exp"] - claims["iat"] == 5 and tokens["expires_in"] == 5


def test_issue_tokens_directly(idp):
    tokens = idp.issue_tokens(nonce="seed")
    assert verify_id_token(idp, tokens["id_token"], nonce="seed")["sub"] == "alice-0001"
    assert refresh(idp, tokens["refresh_token"]).status_code == 200
    assert idp.count("token", grant_type="refresh_token") == 1


# ------------------------------------------------------------------------------------------ PAR

def test_par_then_authorize_with_request_uri(idp):
    verifier, challenge = pkce_pair()
    r = requests.post(idp.url("par"), data={"response_type": "code", "client_id": idp.client_id,
                                            "redirect_uri": REDIRECT, "scope": "openid", "state": "par-state",
                                            "nonce": "n-1", "code_challenge": challenge,
                                            "code_challenge_method": "S256"}, timeout=5)
    assert r.status_code == 201
    request_uri = r.json()["request_uri"]
    assert request_uri.startswith("urn:ietf:params:oauth:request_uri:") and r.json()["expires_in"] > 0
    url = idp.url("authorize") + "?" + urllib.parse.urlencode({"client_id": idp.client_id, "request_uri": request_uri})
    q = query_of(idp.login_browser(url))
    assert q["state"] == "par-state"
    assert exchange(idp, q["code"], verifier).status_code == 200
    # a request_uri is single-use
    assert requests.get(url, allow_redirects=False, timeout=5).status_code == 400


def test_par_required():
    with FakeIdP(require_par=True) as idp:
        assert requests.get(idp.discovery_url, timeout=5).json()["require_pushed_authorization_requests"] is True
        q = query_of(idp.login_browser(idp.authorization_url(REDIRECT, pkce_pair()[1])))
        assert q["error"] == "invalid_request"


# ------------------------------------------------------------------------------------------ device flow

def start_device(idp: FakeIdP) -> dict:
    r = requests.post(idp.url("device_authorization"), data={"client_id": idp.client_id, "scope": "openid profile"},
                      timeout=5)
    assert r.status_code == 200
    return r.json()


def poll(idp: FakeIdP, device_code: str, headers=None) -> requests.Response:
    return requests.post(idp.url("token"), data={"grant_type": DEVICE_GRANT, "device_code": device_code,
                                                 "client_id": idp.client_id}, headers=headers, timeout=5)


def test_device_flow_scripted_then_approved_in_browser(idp):
    dev = start_device(idp)
    assert set(dev) >= {"device_code", "user_code", "verification_uri", "verification_uri_complete", "expires_in",
                        "interval"}
    idp.script_device_polls("authorization_pending", "slow_down")
    assert poll(idp, dev["device_code"]).json() == {"error": "authorization_pending"}
    assert poll(idp, dev["device_code"]).json() == {"error": "slow_down"}
    assert poll(idp, dev["device_code"]).json() == {"error": "authorization_pending"}   # state: still pending
    assert requests.get(dev["verification_uri_complete"], timeout=5).status_code == 200   # the user approves
    r = poll(idp, dev["device_code"])
    assert r.status_code == 200 and verify_id_token(idp, r.json()["id_token"], nonce=None)
    assert poll(idp, dev["device_code"]).json()["error"] == "invalid_grant"               # used
    assert idp.count("token", grant_type=DEVICE_GRANT) == 5


@pytest.mark.parametrize("outcome", ["expired_token", "access_denied"])
def test_device_flow_terminal_outcomes(idp, outcome):
    dev = start_device(idp)
    idp.script_device_polls(outcome, user_code=dev["user_code"])
    assert poll(idp, dev["device_code"]).json() == {"error": outcome}
    assert poll(idp, dev["device_code"]).json() == {"error": outcome}     # and it stays so


def test_device_flow_approve_deny_expire_from_python(idp):
    a, b, c = start_device(idp), start_device(idp), start_device(idp)
    idp.approve_device(a["user_code"])
    idp.deny_device(b["user_code"])
    idp.expire_device(c["user_code"])
    assert poll(idp, a["device_code"]).status_code == 200
    assert poll(idp, b["device_code"]).json()["error"] == "access_denied"
    assert poll(idp, c["device_code"]).json()["error"] == "expired_token"
    idp.script_device_polls("approve")
    d = start_device(idp)
    assert poll(idp, d["device_code"]).status_code == 200


def test_device_flow_interval_enforced():
    with FakeIdP(enforce_device_interval=True, device_interval=5) as idp:
        dev = start_device(idp)
        assert poll(idp, dev["device_code"]).json()["error"] == "authorization_pending"
        assert poll(idp, dev["device_code"]).json()["error"] == "slow_down"


# ------------------------------------------------------------------------------------------ revoke

def test_revoke_records_and_revokes(idp):
    tokens = login_tokens(idp)
    r = requests.post(idp.url("revoke"), data={"token": tokens["refresh_token"], "token_type_hint": "refresh_token",
                                               "client_id": idp.client_id}, timeout=5)
    assert r.status_code == 200 and r.content == b""
    assert idp.revocations == [{"token": tokens["refresh_token"], "token_type_hint": "refresh_token",
                                "client_id": idp.client_id}]
    assert refresh(idp, tokens["refresh_token"]).json()["error"] == "invalid_grant"
    # unknown tokens are fine too (RFC 7009 2.2)
    assert requests.post(idp.url("revoke"), data={"token": "nope", "client_id": idp.client_id},
                         timeout=5).status_code == 200


# ------------------------------------------------------------------------------------------ faults

def test_status_faults_with_retry_after(idp):
    when = time.time() + 120
    idp.fail("token", Fault.status(503, retry_after=7), Fault.retry_after_date(429, 120), Fault.status(500))
    tokens = idp.issue_tokens()
    r1 = refresh(idp, tokens["refresh_token"])
    r2 = refresh(idp, tokens["refresh_token"])
    r3 = refresh(idp, tokens["refresh_token"])
    assert (r1.status_code, r1.headers["Retry-After"]) == (503, "7")
    assert r2.status_code == 429
    assert abs(email.utils.parsedate_to_datetime(r2.headers["Retry-After"]).timestamp() - when) < 3
    assert r3.status_code == 500 and "Retry-After" not in r3.headers
    assert refresh(idp, tokens["refresh_token"]).status_code == 200      # faults used up; the token was untouched
    assert idp.pending_faults("token") == 0 and idp.count("token") == 4


def test_body_faults(idp):
    tokens = idp.issue_tokens()
    idp.fail("token", Fault.malformed_json(), Fault.empty_400(), Fault.invalid_grant("gone"), Fault.html())
    r = refresh(idp, tokens["refresh_token"])
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    with pytest.raises(ValueError):
        r.json()
    r = refresh(idp, tokens["refresh_token"])
    assert r.status_code == 400 and r.content == b""
    r = refresh(idp, tokens["refresh_token"])
    assert r.json() == {"error": "invalid_grant", "error_description": "gone"}
    r = refresh(idp, tokens["refresh_token"])
    assert r.headers["Content-Type"] == "text/html"


def test_delay_and_drop(idp):
    idp.fail("discovery", Fault.delay_only(0.4), Fault.drop_connection())
    start = time.monotonic()
    assert requests.get(idp.discovery_url, timeout=5).status_code == 200
    assert time.monotonic() - start >= 0.4
    with pytest.raises(requests.ConnectionError):
        requests.get(idp.discovery_url, timeout=5)
    idp.fail("discovery", Fault.delay_only(3))
    with pytest.raises(requests.Timeout):
        requests.get(idp.discovery_url, timeout=0.3)


def test_fail_always_until_cleared(idp):
    idp.fail_always("jwks", Fault.status(503))
    assert [requests.get(idp.url("jwks"), timeout=5).status_code for _ in range(3)] == [503] * 3
    idp.clear_faults("jwks")
    assert requests.get(idp.url("jwks"), timeout=5).status_code == 200
    with pytest.raises(ValueError):
        idp.fail("tokens", Fault.status(500))


@pytest.mark.parametrize("defect", ID_TOKEN_DEFECTS)
def test_id_token_defects_are_caught_by_a_careful_client(idp, defect):
    idp.fail("token", Fault.id_token(defect))
    bad = login_tokens(idp)["id_token"]
    with pytest.raises((jwt.InvalidTokenError, LookupError, ValueError)):
        verify_id_token(idp, bad)
    verify_id_token(idp, login_tokens(idp)["id_token"])          # the next one is fine
    header, claims = jwt.get_unverified_header(bad), jwt.decode(bad, options={"verify_signature": False})
    if defect == "missing_azp_multi_aud":
        assert claims["aud"] == [idp.client_id, "another-audience"] and "azp" not in claims
    if defect == "alg_none":
        assert header["alg"] == "none" and bad.endswith(".")
    if defect == "unknown_kid":
        assert header["kid"] not in {k["kid"] for k in idp.jwks()["keys"]}


# ------------------------------------------------------------------------------------------ concurrency

def test_concurrent_requests_are_all_counted():
    with FakeIdP() as idp:
        tokens = [idp.issue_tokens(scope="openid")["refresh_token"] for _ in range(100)]
        idp.fail_always("token", Fault.delay_only(0.2))            # all 100 in flight at once
        with concurrent.futures.ThreadPoolExecutor(max_workers=100) as pool:
            statuses = list(pool.map(lambda t: refresh(idp, t).status_code, tokens))
        assert statuses == [200] * 100
        assert idp.count("token") == 100 == idp.count("token", grant_type="refresh_token")
        assert idp.wait_for("token", 100, timeout=0.1) == 100
        with pytest.raises(TimeoutError):
            idp.wait_for("token", 101, timeout=0.05)


# ------------------------------------------------------------------------------------------ DPoP

def test_dpop_header_recorded_and_binds_tokens(idp):
    key = ec.generate_private_key(ec.SECP256R1())
    jkt = jwk_thumbprint(json.loads(ECAlgorithm.to_jwk(key.public_key())))
    code, verifier, _ = sign_in(idp)
    proof = dpop_proof(key, "POST", idp.url("token"))
    r = exchange(idp, code, verifier, headers={"DPoP": proof})
    body = r.json()
    assert body["token_type"] == "DPoP" and idp.last_request("token").dpop == proof
    assert idp.introspect(body["access_token"])["cnf"] == {"jkt": jkt}
    # the refresh token is bound to the key: another key is refused, the right one works
    other = ec.generate_private_key(ec.SECP256R1())
    r = refresh(idp, body["refresh_token"], headers={"DPoP": dpop_proof(other, "POST", idp.url("token"))})
    assert r.json()["error"] == "invalid_dpop_proof"
    r = refresh(idp, body["refresh_token"], headers={"DPoP": dpop_proof(key, "POST", idp.url("token"))})
    assert r.json()["token_type"] == "DPoP"


def test_dpop_nonce_dance_through_the_hook(idp):
    """The hook is where proof verification will go; here it only demands a server nonce."""
    nonce = "server-nonce-1"

    def hook(endpoint, rec):
        claims = jwt.decode(rec.dpop, options={"verify_signature": False})
        if claims.get("nonce") != nonce:
            return Fault.use_dpop_nonce(nonce)
        return None

    idp.dpop_hook = hook
    key = ec.generate_private_key(ec.SECP256R1())
    tokens = idp.issue_tokens()
    r = refresh(idp, tokens["refresh_token"], headers={"DPoP": dpop_proof(key, "POST", idp.url("token"))})
    assert r.status_code == 400 and r.json()["error"] == "use_dpop_nonce" and r.headers["DPoP-Nonce"] == nonce
    r = refresh(idp, tokens["refresh_token"],
                headers={"DPoP": dpop_proof(key, "POST", idp.url("token"), nonce=r.headers["DPoP-Nonce"])})
    assert r.status_code == 200 and r.json()["token_type"] == "DPoP"
    r = requests.get(idp.url("userinfo"), headers={"Authorization": "DPoP " + r.json()["access_token"],
                                                    "DPoP": dpop_proof(key, "GET", idp.url("userinfo"))}, timeout=5)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith('DPoP error="use_dpop_nonce"')


def test_nothing_is_printed(idp, capfd):
    login_tokens(idp)
    idp.fail("token", Fault.status(500))
    refresh(idp, "whatever")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
