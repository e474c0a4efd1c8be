"""A fault-injecting fake OpenID provider for the sign-in tests.

A threaded `http.server` on 127.0.0.1 (port from the OS) that plays an OpenID Connect provider for one
PUBLIC client, scripted from Python (there is no control API over HTTP):

    with FakeIdP(expires_in=5) as idp:
        idp.fail("token", Fault.status(503, retry_after=2), Fault.invalid_grant())   # next two token requests
        idp.fail("token", Fault.id_token("wrong_aud"))                                # then a bad ID token
        ...  # run `proxyctl login` against idp.issuer
        assert idp.count("token", grant_type="refresh_token") == 1
        form = idp.requests("token")[-1].form                                         # what the client sent

Endpoints (relative to the issuer, which is `http://127.0.0.1:PORT` plus an optional `issuer_path`):
  discovery  /.well-known/openid-configuration and /.well-known/oauth-authorization-server
             (both the OIDC form `{issuer}/.well-known/...` and the RFC 8414 form `/.well-known/...{path}`)
  jwks       /jwks      RS256, PS256 and ES256 keys; `rotate_keys()` for unknown-kid refetch tests
  authorize  /authorize the user is signed in at once: 302 to redirect_uri with code, state and (when
                        advertised) iss; any loopback redirect URI on any port unless `redirect_uris` is set
  par        /par       RFC 9126; /authorize then takes `request_uri`
  token      /token     authorization_code (PKCE S256 checked), refresh_token (rotation + reuse detection),
                        urn:ietf:params:oauth:grant-type:device_code (scripted polling outcomes)
  device_authorization /device_authorization, and `device` /device?user_code=... (a "browser" approving)
  revoke     /revoke    RFC 7009; always 200; records what it got
  userinfo   /userinfo  Bearer or DPoP access token; 401 + WWW-Authenticate when expired/unknown/revoked
  end_session /end_session  RP-initiated logout: records the request, answers 200
  register   /register  RFC 7591, advertised with `registration=True`: a native public client (JSON body,
                        token_endpoint_auth_method none, loopback redirect URIs) gets a new client_id, which
                        becomes the fake's one client (its redirect URIs the only ones allowed), and a
                        registration_access_token; `registration_refused=(status, error)` refuses instead
Machine grants (for confidential clients): client_credentials and RFC 8693 token exchange
(`subject_tokens`: the subject tokens it accepts), with client authentication checked when configured:
`client_secret` (client_secret_basic, client_secret_post, client_secret_jwt) and `client_jwks` (public JWKs
for private_key_jwt; the assertion's signature, iss, sub, exp, jti and aud are checked: the issuer as its one
value, draft-ietf-oauth-rfc7523bis, or with `assertion_audience="token_endpoint"` the token endpoint). A
`resource` parameter (RFC 8707) becomes the JWT access token's `aud` (unless `honour_resource` is False).

Every request is counted per endpoint and recorded (method, path, query, form, headers, DPoP header) in
memory; nothing is ever printed or logged. Faults are queued per endpoint and each one is used by one
request (`fail`), or applied to every request (`fail_always`) until `clear_faults()`.

Control API (Python only):
  faults       fail(endpoint, *faults), fail_always(endpoint, fault), clear_faults([endpoint]), pending_faults()
               Fault.status(503|500|429, retry_after=2 | HTTP-date str | unix float), Fault.retry_after_date(),
               Fault.delay_only(s), Fault.stall(s) (carried out after s, even if the client left), Fault.malformed_json(), Fault.html(), Fault.invalid_grant(),
               Fault.oauth_error(error, desc, status), Fault.empty_400(), Fault.drop_connection(),
               Fault.use_dpop_nonce(nonce), Fault.id_token(*ID_TOKEN_DEFECTS), Fault.authorize_error(error, desc),
               Fault.user_not_registered(), Fault.wrong_iss(), Fault.missing_iss(), Fault.wrong_state();
               every constructor also takes delay=seconds
  observation  count(endpoint, **param_filter), counts(), requests(endpoint) (token requests carry `decided` and
               `answered` times), last_request(endpoint),
               wait_for(endpoint, n, timeout, **param_filter), reset_counts(), revocations, reuse_detected
  keys         jwks(), signing_key, rotate_keys(alg=None, publish_after=1, drop_old=False)
  device flow  script_device_polls(*outcomes, user_code=None), approve_device / deny_device / expire_device(user_code)
  tokens       issue_tokens(), introspect(access_token), refresh_token_state(rt), revoke_refresh_token(rt),
               revoke_all(), expire_access_tokens(); settings are plain attributes (idp.expires_in = 5, ...)
  helpers      authorization_url(redirect_uri, code_challenge, ...), login_browser(url) -> Location,
               pkce_pair(), jws(...), dpop_hook (called for requests with a DPoP header); base64url and RFC 7638
               thumbprints come from fixtures.jose
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import email.utils
import hashlib
import http.server
import json
import secrets
import socket
import threading
import time
import urllib.parse
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple

import requests
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from fixtures.jose import b64url, b64url_uint, jwk_thumbprint, unverified_header

ENDPOINTS = ("discovery", "jwks", "authorize", "par", "token", "device_authorization", "device", "revoke",
             "userinfo", "end_session", "register", "unknown")
TOKEN_EXCHANGE_GRANT = "urn:ietf:params:oauth:grant-type:token-exchange"
ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
PAR_PREFIX = "urn:ietf:params:oauth:request_uri:"
ID_TOKEN_DEFECTS = ("bad_signature", "wrong_aud", "wrong_iss", "expired", "iat_future", "wrong_nonce",
                    "missing_nonce", "missing_azp_multi_aud", "alg_none", "unknown_kid")
DEVICE_OUTCOMES = ("authorization_pending", "slow_down", "expired_token", "access_denied", "approve")


# ---------------------------------------------------------------------------------------------- JOSE

def pkce_pair() -> Tuple[str, str]:
    """(code_verifier, S256 code_challenge)."""
    verifier = b64url(secrets.token_bytes(48))
    return verifier, b64url(hashlib.sha256(verifier.encode()).digest())


_KEY_CACHE: Dict[Tuple[str, int], Any] = {}
_KEY_CACHE_LOCK = threading.Lock()


def _private_key(kty: str, slot: Optional[int]):
    """A private key; with a `slot`, the same one for every FakeIdP in this process (RSA key generation takes
    about 0.1 s, and a test run starts many fakes). Keys within one FakeIdP always use distinct slots."""
    def make():
        if kty == "EC":
            return ec.generate_private_key(ec.SECP256R1())
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    if slot is None:
        return make()
    with _KEY_CACHE_LOCK:
        if (kty, slot) not in _KEY_CACHE:
            _KEY_CACHE[(kty, slot)] = make()
        return _KEY_CACHE[(kty, slot)]


class SigningKey:
    """One signing key: RS256 or PS256 (RSA 2048) or ES256 (P-256), with a fresh random kid."""

    def __init__(self, alg: str, kid: Optional[str] = None, slot: Optional[int] = None):
        if alg not in ("RS256", "PS256", "ES256"):
            raise ValueError(f"unsupported alg {alg}")
        self.alg = alg
        self.kid = kid or f"{alg.lower()}-{secrets.token_hex(4)}"
        self.key = _private_key("EC" if alg == "ES256" else "RSA", slot)

    def public_jwk(self) -> dict:
        pub = self.key.public_key().public_numbers()
        if self.alg == "ES256":
            return {"kty": "EC", "crv": "P-256", "x": b64url_uint(pub.x, 32), "y": b64url_uint(pub.y, 32),
                    "kid": self.kid, "alg": self.alg, "use": "sig"}
        return {"kty": "RSA", "n": b64url_uint(pub.n), "e": b64url_uint(pub.e), "kid": self.kid, "alg": self.alg,
                "use": "sig"}

    def sign(self, data: bytes) -> bytes:
        if self.alg == "RS256":
            return self.key.sign(data, padding.PKCS1v15(), hashes.SHA256())
        if self.alg == "PS256":
            return self.key.sign(data, padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32), hashes.SHA256())
        r, s = decode_dss_signature(self.key.sign(data, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def jws(claims: dict, key: Optional[SigningKey], typ: str = "JWT", alg_none: bool = False,
        bad_signature: bool = False, extra_header: Optional[dict] = None) -> str:
    """A compact JWS. `alg_none` makes an unsigned `alg: none` token; `bad_signature` corrupts the signature."""
    header = {"typ": typ, "alg": "none"} if alg_none else {"typ": typ, "alg": key.alg, "kid": key.kid}
    header.update(extra_header or {})
    signing_input = (b64url(json.dumps(header, separators=(",", ":")).encode()) + "." +
                     b64url(json.dumps(claims, separators=(",", ":")).encode()))
    if alg_none:
        return signing_input + "."
    signature = bytearray(key.sign(signing_input.encode()))
    if bad_signature:
        signature[len(signature) // 2] ^= 0x01
    return signing_input + "." + b64url(bytes(signature))


# ---------------------------------------------------------------------------------------------- faults

@dataclasses.dataclass
class Fault:
    """One scripted misbehaviour. Build with the class methods; every fault takes `delay=` seconds too."""
    kind: str
    http_status: Optional[int] = None
    retry_after: Optional[str] = None
    delay: float = 0.0
    error: Optional[str] = None
    description: Optional[str] = None
    defects: Tuple[str, ...] = ()
    body: Optional[bytes] = None
    headers: Dict[str, str] = dataclasses.field(default_factory=dict)
    value: Optional[str] = None

    # generic, any endpoint
    @classmethod
    def status_code(cls, status: int, retry_after=None, body: Optional[bytes] = None, delay: float = 0.0,
                    headers: Optional[dict] = None) -> "Fault":
        """An HTTP error (500, 503, 429, ...). `retry_after`: seconds (int) or an HTTP-date (str, or a float
        Unix time, formatted for you)."""
        if isinstance(retry_after, float):
            retry_after = email.utils.formatdate(retry_after, usegmt=True)
        return cls("status", http_status=status, retry_after=None if retry_after is None else str(retry_after),
                   body=body, delay=delay, headers=dict(headers or {}))

    status = status_code  # the short name: Fault.status(503, retry_after=2)

    @classmethod
    def retry_after_date(cls, status: int, seconds_from_now: float, delay: float = 0.0) -> "Fault":
        return cls.status_code(status, retry_after=float(time.time() + seconds_from_now), delay=delay)

    @classmethod
    def delay_only(cls, seconds: float) -> "Fault":
        """Wait, then answer normally."""
        return cls("pass", delay=seconds)

    @classmethod
    def stall(cls, seconds: float) -> "Fault":
        """A provider stopped (SIGSTOP) with the request in its socket, resumed after `seconds`: it then carries
        the request out (a refresh token rotates) whether or not the client is still waiting for the answer."""
        return cls("pass", delay=seconds)

    @classmethod
    def malformed_json(cls, status: int = 200, delay: float = 0.0) -> "Fault":
        return cls("raw", http_status=status, body=b'{"access_token": "abc", "token_type": ', delay=delay,
                   headers={"Content-Type": "application/json"})

    @classmethod
    def html(cls, status: int = 200, delay: float = 0.0) -> "Fault":
        """A captive-portal style HTML page where JSON was expected."""
        return cls("raw", http_status=status, body=b"<html><body>Please sign in to the network</body></html>",
                   delay=delay, headers={"Content-Type": "text/html"})

    @classmethod
    def oauth_error(cls, error: str, description: Optional[str] = None, status: int = 400,
                    delay: float = 0.0, headers: Optional[dict] = None) -> "Fault":
        return cls("oauth_error", http_status=status, error=error, description=description, delay=delay,
                   headers=dict(headers or {}))

    @classmethod
    def invalid_grant(cls, description: Optional[str] = None, delay: float = 0.0) -> "Fault":
        return cls.oauth_error("invalid_grant", description, delay=delay)

    @classmethod
    def empty_400(cls, delay: float = 0.0) -> "Fault":
        """400 with an empty body, as glewlwyd answers a bad or reused refresh token."""
        return cls("raw", http_status=400, body=b"", delay=delay)

    @classmethod
    def drop_connection(cls, delay: float = 0.0) -> "Fault":
        """Close the connection without answering."""
        return cls("drop", delay=delay)

    @classmethod
    def use_dpop_nonce(cls, nonce: str, delay: float = 0.0) -> "Fault":
        """The DPoP nonce challenge: 400 at the token endpoint, 401 + WWW-Authenticate at userinfo."""
        return cls("use_dpop_nonce", value=nonce, delay=delay)

    # token endpoint
    @classmethod
    def id_token(cls, *defects: str, delay: float = 0.0) -> "Fault":
        """A successful token response whose ID token has these defects (see ID_TOKEN_DEFECTS)."""
        for d in defects:
            if d not in ID_TOKEN_DEFECTS:
                raise ValueError(f"unknown ID token defect {d!r}; known: {ID_TOKEN_DEFECTS}")
        return cls("id_token", defects=tuple(defects), delay=delay)

    # authorization endpoint
    @classmethod
    def authorize_error(cls, error: str = "access_denied", description: Optional[str] = None,
                        delay: float = 0.0) -> "Fault":
        """Redirect back with `error=...&error_description=...` (plus state and iss)."""
        return cls("authorize_error", error=error, description=description, delay=delay)

    @classmethod
    def user_not_registered(cls, delay: float = 0.0) -> "Fault":
        return cls.authorize_error("access_denied", "user_not_registered", delay=delay)

    @classmethod
    def wrong_iss(cls, value: str = "https://attacker.example", delay: float = 0.0) -> "Fault":
        """Redirect back with a code but an `iss` that is not the issuer (RFC 9207 mix-up)."""
        return cls("wrong_iss", value=value, delay=delay)

    @classmethod
    def missing_iss(cls, delay: float = 0.0) -> "Fault":
        return cls("missing_iss", delay=delay)

    @classmethod
    def wrong_state(cls, delay: float = 0.0) -> "Fault":
        return cls("wrong_state", delay=delay)


# ---------------------------------------------------------------------------------------------- records

@dataclasses.dataclass
class RecordedRequest:
    endpoint: str
    method: str
    path: str
    query: Dict[str, str]
    form: Dict[str, str]
    headers: Dict[str, str]          # lower-case names
    body: bytes
    time: float
    fault: Optional[Fault] = None
    decided: Optional[float] = None   # token endpoint: when the grant was carried out (a refresh token rotated)
    answered: Optional[float] = None  # token endpoint: when the answer was written (or the write failed)

    @property
    def dpop(self) -> Optional[str]:
        return self.headers.get("dpop")

    @property
    def params(self) -> Dict[str, str]:
        """Query and form parameters together (form wins)."""
        merged = dict(self.query)
        merged.update(self.form)
        return merged


@dataclasses.dataclass
class _Code:
    client_id: str
    redirect_uri: str
    scope: str
    nonce: Optional[str]
    code_challenge: Optional[str]
    code_challenge_method: Optional[str]
    auth_time: int
    expires_at: float
    dpop_jkt: Optional[str] = None
    used: bool = False


@dataclasses.dataclass
class _Refresh:
    family: str
    scope: str
    client_id: str
    nonce: Optional[str]
    auth_time: int
    dpop_jkt: Optional[str]
    state: str = "active"            # active | rotated | revoked


@dataclasses.dataclass
class _Access:
    scope: str
    client_id: str
    expires_at: float
    dpop_jkt: Optional[str]
    revoked: bool = False


@dataclasses.dataclass
class DeviceAuthorization:
    device_code: str
    user_code: str
    client_id: str
    scope: str
    expires_at: float
    interval: int
    status: str = "pending"          # pending | approved | denied | expired | used
    last_poll: float = 0.0
    script: Deque[str] = dataclasses.field(default_factory=collections.deque)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256         # 100+ concurrent callers must not overflow the listen backlog
    allow_reuse_address = False


# ---------------------------------------------------------------------------------------------- the IdP

class FakeIdP:
    """See the module docstring. All attributes set in __init__ may be changed while it runs."""

    def __init__(self,
                 client_id: str = "proxyctl-test",
                 issuer_path: str = "",
                 expires_in: Optional[int] = 3600,
                 access_token_format: str = "opaque",
                 access_token_audience: str = "proxyctl-test-api",
                 signing_alg: str = "RS256",
                 advertise_iss: bool = True,
                 require_pkce: bool = True,
                 require_par: bool = False,
                 redirect_uris: Optional[Iterable[str]] = None,
                 refresh_rotation: bool = True,
                 reuse_detection: bool = True,
                 issue_refresh_token: bool = True,
                 id_token_on_refresh: bool = True,
                 id_token_lifetime: int = 300,
                 code_lifetime: int = 600,
                 device_interval: int = 1,
                 device_expires_in: int = 600,
                 enforce_device_interval: bool = False,
                 dpop: bool = True,
                 granted_scope: Optional[str] = None,
                 claims: Optional[dict] = None,
                 acr: Optional[str] = None,
                 discovery_overrides: Optional[dict] = None,
                 client_secret: Optional[str] = None,
                 client_jwks: Optional[List[dict]] = None,
                 subject_tokens: Iterable[str] = (),
                 honour_resource: bool = True,
                 assertion_audience: str = "issuer",
                 registration: bool = False,
                 registration_refused: Optional[Tuple[int, str]] = None):
        self.client_id = client_id
        self.registration = registration
        self.registration_refused = registration_refused
        self.registered: List[dict] = []          # the client metadata of each registration
        self.client_secret = client_secret
        self.client_jwks = list(client_jwks or [])
        self.subject_tokens = set(subject_tokens)
        self.honour_resource = honour_resource
        # The one `aud` a client assertion may carry: "issuer" (draft-ietf-oauth-rfc7523bis §3) or
        # "token_endpoint" (OpenID Connect Core §9, what glewlwyd 2.7 wants).
        self.assertion_audience = assertion_audience
        self.assertion_audiences: List[Any] = []     # the `aud` of every client assertion received
        self.client_auth_methods: List[str] = []     # the method each token request authenticated with
        self._seen_jti: set = set()
        self.issuer_path = "/" + issuer_path.strip("/") if issuer_path.strip("/") else ""
        self.expires_in = expires_in
        self.access_token_format = access_token_format
        self.access_token_audience = access_token_audience
        self.signing_alg = signing_alg
        self.advertise_iss = advertise_iss
        self.require_pkce = require_pkce
        self.require_par = require_par
        self.redirect_uris = None if redirect_uris is None else list(redirect_uris)
        self.refresh_rotation = refresh_rotation
        self.reuse_detection = reuse_detection
        self.issue_refresh_token = issue_refresh_token
        self.id_token_on_refresh = id_token_on_refresh
        self.id_token_lifetime = id_token_lifetime
        self.code_lifetime = code_lifetime
        self.device_interval = device_interval
        self.device_expires_in = device_expires_in
        self.enforce_device_interval = enforce_device_interval
        self.dpop = dpop
        self.granted_scope = granted_scope
        self.claims = {"sub": "alice-0001", "name": "Alice Liddell", "email": "alice@example.test",
                       "email_verified": True}
        self.claims.update(claims or {})
        self.acr = acr
        self.discovery_overrides = dict(discovery_overrides or {})
        # DPoP hook (verification comes later): called as hook(endpoint, RecordedRequest) for every request that
        # carries a DPoP header; may return a Fault (e.g. Fault.use_dpop_nonce(...)) to answer with instead.
        self.dpop_hook: Optional[Callable[[str, RecordedRequest], Optional[Fault]]] = None

        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._faults: Dict[str, Deque[Fault]] = collections.defaultdict(collections.deque)
        self._always: Dict[str, Fault] = {}
        self._counts: Dict[str, int] = collections.Counter()
        self._records: Dict[str, List[RecordedRequest]] = collections.defaultdict(list)
        self._codes: Dict[str, _Code] = {}
        self._par: Dict[str, Tuple[dict, float]] = {}
        self._refresh: Dict[str, _Refresh] = {}
        self._access: Dict[str, _Access] = {}
        self._devices: Dict[str, DeviceAuthorization] = {}       # by device_code
        self._device_script: Deque[str] = collections.deque()
        self.revocations: List[Dict[str, str]] = []
        self.reuse_detected = 0

        self._slots = collections.Counter()                 # key-cache slots used, per key type
        self._keys: Dict[str, SigningKey] = {a: self._new_key(a) for a in ("RS256", "PS256", "ES256")}
        self._published: List[SigningKey] = list(self._keys.values())
        self._pending: List[Tuple[SigningKey, int]] = []    # (key, JWKS fetches until it is published)
        self._rogue_key = self._new_key("RS256", kid="never-published")
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None
        self.port: Optional[int] = None

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> "FakeIdP":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "FakeIdP":
        self._stop.clear()
        self._server = _Server(("127.0.0.1", 0), _handler_for(self))
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        name=f"FakeIdP:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()                 # wakes handlers sleeping in a delay
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # ------------------------------------------------------------------ addresses

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def issuer(self) -> str:
        return self.base_url + self.issuer_path

    def url(self, endpoint: str) -> str:
        paths = {"discovery": "/.well-known/openid-configuration", "jwks": "/jwks", "authorize": "/authorize",
                 "par": "/par", "token": "/token", "device_authorization": "/device_authorization",
                 "device": "/device", "revoke": "/revoke", "userinfo": "/userinfo", "end_session": "/end_session",
                 "register": "/register"}
        return self.issuer + paths[endpoint]

    @property
    def discovery_url(self) -> str:
        return self.url("discovery")

    def discovery_document(self) -> dict:
        doc = {
            "issuer": self.issuer,
            "authorization_endpoint": self.url("authorize"),
            "token_endpoint": self.url("token"),
            "userinfo_endpoint": self.url("userinfo"),
            "jwks_uri": self.url("jwks"),
            "revocation_endpoint": self.url("revoke"),
            "device_authorization_endpoint": self.url("device_authorization"),
            "pushed_authorization_request_endpoint": self.url("par"),
            "require_pushed_authorization_requests": self.require_par,
            "response_types_supported": ["code"],
            "response_modes_supported": ["query"],
            "grant_types_supported": ["authorization_code", "refresh_token", DEVICE_GRANT, "client_credentials",
                                      TOKEN_EXCHANGE_GRANT],
            "end_session_endpoint": self.url("end_session"),
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256", "PS256", "ES256"],
            "token_endpoint_auth_methods_supported": ["none", "client_secret_basic", "client_secret_post",
                                                      "client_secret_jwt", "private_key_jwt"],
            "revocation_endpoint_auth_methods_supported": ["none"],
            "code_challenge_methods_supported": ["S256"],
            "scopes_supported": ["openid", "profile", "email", "offline_access", "api"],
            "claims_supported": ["sub", "name", "email", "email_verified", "auth_time", "acr", "azp", "nonce"],
        }
        if self.advertise_iss:
            doc["authorization_response_iss_parameter_supported"] = True
        if self.dpop:
            doc["dpop_signing_alg_values_supported"] = ["ES256", "RS256", "PS256", "EdDSA"]
        if self.registration:
            doc["registration_endpoint"] = self.url("register")
        for k, v in self.discovery_overrides.items():
            if v is None:
                doc.pop(k, None)
            else:
                doc[k] = v
        return doc

    # ------------------------------------------------------------------ control API: faults

    def fail(self, endpoint: str, *faults: Fault) -> None:
        """Queue faults for the next requests to `endpoint`, one request each, in order."""
        _check_endpoint(endpoint)
        with self._lock:
            self._faults[endpoint].extend(faults)

    def fail_always(self, endpoint: str, fault: Fault) -> None:
        """Apply `fault` to every request to `endpoint` (after the queued ones) until clear_faults()."""
        _check_endpoint(endpoint)
        with self._lock:
            self._always[endpoint] = fault

    def clear_faults(self, endpoint: Optional[str] = None) -> None:
        with self._lock:
            for ep in ([endpoint] if endpoint else list(ENDPOINTS)):
                self._faults.pop(ep, None)
                self._always.pop(ep, None)

    def pending_faults(self, endpoint: str) -> int:
        with self._lock:
            return len(self._faults.get(endpoint, ()))

    # ------------------------------------------------------------------ control API: observation

    def count(self, endpoint: str, **param_filter: str) -> int:
        """Requests received by `endpoint` (faulted ones too); with filters, those whose query/form parameters
        match, e.g. count("token", grant_type="refresh_token")."""
        _check_endpoint(endpoint)
        with self._lock:
            if not param_filter:
                return self._counts[endpoint]
            return sum(1 for r in self._records[endpoint]
                       if all(r.params.get(k) == v for k, v in param_filter.items()))

    def counts(self) -> Dict[str, int]:
        with self._lock:
            return {ep: self._counts[ep] for ep in ENDPOINTS if self._counts[ep]}

    def requests(self, endpoint: str) -> List[RecordedRequest]:
        _check_endpoint(endpoint)
        with self._lock:
            return list(self._records[endpoint])

    def last_request(self, endpoint: str) -> Optional[RecordedRequest]:
        with self._lock:
            records = self._records[endpoint]
            return records[-1] if records else None

    def reset_counts(self) -> None:
        """Forget the counts, the recorded requests, the revocations and reuse_detected."""
        with self._lock:
            self._counts.clear()
            self._records.clear()
            self.revocations.clear()
            self.reuse_detected = 0

    def wait_for(self, endpoint: str, n: int = 1, timeout: float = 10.0, **param_filter: str) -> int:
        """Poll until `endpoint` has seen at least `n` (matching) requests; returns the count or raises."""
        deadline = time.monotonic() + timeout
        while True:
            c = self.count(endpoint, **param_filter)
            if c >= n:
                return c
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{endpoint}: {c} requests after {timeout}s, wanted {n}")
            time.sleep(0.01)

    # ------------------------------------------------------------------ control API: keys

    def _new_key(self, alg: str, kid: Optional[str] = None) -> SigningKey:
        kty = "EC" if alg == "ES256" else "RSA"
        slot = self._slots[kty]
        self._slots[kty] += 1
        return SigningKey(alg, kid=kid, slot=slot)

    @property
    def signing_key(self) -> SigningKey:
        return self._keys[self.signing_alg]

    def jwks(self) -> dict:
        with self._lock:
            return {"keys": [k.public_jwk() for k in self._published]}

    def rotate_keys(self, alg: Optional[str] = None, publish_after: int = 1, drop_old: bool = False) -> str:
        """Make a new key for `alg` (default: the signing alg) and sign with it from now on. It appears in the
        JWKS only after `publish_after` more JWKS fetches have been answered without it (0: at once), so a
        client that caches the JWKS sees an unknown kid and must refetch (maybe more than once). `drop_old`
        removes the previous key of that alg from the JWKS when the new one is published. Returns the kid."""
        alg = alg or self.signing_alg
        with self._lock:
            key = self._new_key(alg)
            old = self._keys[alg]
            self._keys[alg] = key
            if drop_old:
                key.replaces = old  # type: ignore[attr-defined]
            if publish_after <= 0:
                self._publish(key)
            else:
                self._pending.append((key, publish_after))
        return key.kid

    def _publish(self, key: SigningKey) -> None:
        old = getattr(key, "replaces", None)
        if old is not None and old in self._published:
            self._published.remove(old)
        self._published.append(key)

    # ------------------------------------------------------------------ control API: tokens and users

    def script_device_polls(self, *outcomes: str, user_code: Optional[str] = None) -> None:
        """Script the answers to device_code polls, one per poll: 'authorization_pending', 'slow_down',
        'expired_token', 'access_denied' or 'approve' (tokens are issued on that poll). Without `user_code` the
        script is shared by all device codes (one flow at a time); when it runs out, the device's state rules
        (pending until approve_device())."""
        for o in outcomes:
            if o not in DEVICE_OUTCOMES:
                raise ValueError(f"unknown device outcome {o!r}; known: {DEVICE_OUTCOMES}")
        with self._lock:
            if user_code is None:
                self._device_script.extend(outcomes)
            else:
                self._device_by_user_code(user_code).script.extend(outcomes)

    def approve_device(self, user_code: str) -> None:
        with self._lock:
            self._device_by_user_code(user_code).status = "approved"

    def deny_device(self, user_code: str) -> None:
        with self._lock:
            self._device_by_user_code(user_code).status = "denied"

    def expire_device(self, user_code: str) -> None:
        with self._lock:
            self._device_by_user_code(user_code).status = "expired"

    def device_authorizations(self) -> List[DeviceAuthorization]:
        with self._lock:
            return list(self._devices.values())

    def _device_by_user_code(self, user_code: str) -> DeviceAuthorization:
        for d in self._devices.values():
            if d.user_code == user_code.upper():
                return d
        raise KeyError(f"no device authorization with user code {user_code}")

    def revoke_refresh_token(self, refresh_token: str) -> None:
        """Server-side revocation of one refresh token (its family too)."""
        with self._lock:
            rt = self._refresh.get(refresh_token)
            if rt:
                self._revoke_family(rt.family)

    def revoke_all(self) -> None:
        """Revoke every refresh and access token issued so far (the user was signed out everywhere)."""
        with self._lock:
            for rt in self._refresh.values():
                rt.state = "revoked"
            for at in self._access.values():
                at.revoked = True

    def expire_access_tokens(self) -> None:
        """Make every access token issued so far expired (userinfo answers 401)."""
        with self._lock:
            for at in self._access.values():
                at.expires_at = 0

    def introspect(self, access_token: str) -> Optional[dict]:
        """What a resource server would learn about `access_token`: None if unknown, revoked or expired."""
        with self._lock:
            at = self._access.get(access_token)
            if at is None or at.revoked or at.expires_at <= time.time():
                return None
            info = {"active": True, "sub": self.claims["sub"], "scope": at.scope, "client_id": at.client_id,
                    "exp": int(at.expires_at)}
            if at.dpop_jkt:
                info["cnf"] = {"jkt": at.dpop_jkt}
            return info

    def refresh_token_state(self, refresh_token: str) -> Optional[str]:
        """'active', 'rotated' (used once, replaced), 'revoked', or None if never issued."""
        with self._lock:
            rt = self._refresh.get(refresh_token)
            return rt.state if rt else None

    def issue_tokens(self, scope: str = "openid profile email", nonce: Optional[str] = None) -> dict:
        """Mint a token response directly (e.g. to seed a client's store without a login)."""
        with self._lock:
            return self._token_response(scope, self.client_id, nonce, int(time.time()), None, (),
                                        with_refresh=True, with_id_token=True)

    # ------------------------------------------------------------------ helpers for tests

    def authorization_url(self, redirect_uri: str, code_challenge: Optional[str] = None, state: str = "state",
                          nonce: Optional[str] = "nonce", scope: str = "openid profile email", **extra) -> str:
        q = {"response_type": "code", "client_id": self.client_id, "redirect_uri": redirect_uri, "scope": scope,
             "state": state}
        if nonce is not None:
            q["nonce"] = nonce
        if code_challenge is not None:
            q.update(code_challenge=code_challenge, code_challenge_method="S256")
        q.update(extra)
        return self.url("authorize") + "?" + urllib.parse.urlencode(q)

    def login_browser(self, authorization_url: str) -> str:
        """Play the browser: GET the authorization URL and return the Location it redirects to (not followed)."""
        r = requests.get(authorization_url, allow_redirects=False, timeout=10)
        if r.status_code not in (302, 303) or "Location" not in r.headers:
            raise RuntimeError(f"authorization endpoint answered {r.status_code}: {r.text[:200]}")
        return r.headers["Location"]

    # ------------------------------------------------------------------ request handling (server threads)

    def _take_fault(self, endpoint: str) -> Optional[Fault]:
        with self._lock:
            q = self._faults.get(endpoint)
            if q:
                return q.popleft()
            return self._always.get(endpoint)

    def _record(self, rec: RecordedRequest) -> None:
        with self._lock:
            self._counts[rec.endpoint] += 1
            self._records[rec.endpoint].append(rec)

    def _route(self, path: str) -> str:
        p = self.issuer_path
        if path in (p + "/.well-known/openid-configuration", "/.well-known/openid-configuration" + p,
                    p + "/.well-known/oauth-authorization-server", "/.well-known/oauth-authorization-server" + p):
            return "discovery"
        if p and not path.startswith(p + "/"):
            return "unknown"
        name = path[len(p):].strip("/")
        return name if name in ENDPOINTS and name != "discovery" else "unknown"

    def _handle(self, h: "http.server.BaseHTTPRequestHandler", method: str) -> None:
        split = urllib.parse.urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        query, qdup = _parse(split.query)
        form, fdup = ({}, [])
        ctype = (h.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if method == "POST" and ctype == "application/x-www-form-urlencoded":
            form, fdup = _parse(body.decode("utf-8", "replace"))
        endpoint = self._route(split.path)
        rec = RecordedRequest(endpoint=endpoint, method=method, path=split.path, query=query, form=form,
                              headers={k.lower(): v for k, v in h.headers.items()}, body=body, time=time.time())
        fault = self._take_fault(endpoint)
        rec.fault = fault
        self._record(rec)
        if fault is None and rec.dpop and self.dpop_hook is not None:
            fault = self.dpop_hook(endpoint, rec)
        if fault is not None and fault.delay:
            if self._stop.wait(fault.delay):
                h.close_connection = True
                return
        if fault is not None and fault.kind in ("status", "raw", "oauth_error", "drop", "use_dpop_nonce"):
            return self._answer_fault(h, endpoint, fault)
        if fdup or qdup:
            if endpoint in ("token", "par", "device_authorization", "revoke"):
                return _send_json(h, 400, {"error": "invalid_request",
                                           "error_description": f"repeated parameter {(fdup or qdup)[0]}"})
        handler = getattr(self, "_ep_" + endpoint)
        handler(h, rec, fault)

    def _answer_fault(self, h, endpoint: str, f: Fault) -> None:
        if f.kind == "drop":
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        headers = dict(f.headers)
        if f.kind == "use_dpop_nonce":
            headers["DPoP-Nonce"] = f.value
            if endpoint == "token" or endpoint == "par":
                return _send_json(h, 400, {"error": "use_dpop_nonce",
                                           "error_description": "Authorization server requires nonce in DPoP proof"},
                                  headers)
            headers["WWW-Authenticate"] = 'DPoP error="use_dpop_nonce", error_description="nonce required"'
            return _send_json(h, 401, {"error": "use_dpop_nonce"}, headers)
        if f.retry_after is not None:
            headers["Retry-After"] = f.retry_after
        if f.kind == "oauth_error":
            body = {"error": f.error}
            if f.description:
                body["error_description"] = f.description
            return _send_json(h, f.http_status, body, headers)
        if f.kind == "status":
            body = f.body if f.body is not None else f"{f.http_status} {_reason(f.http_status)}\n".encode()
            headers.setdefault("Content-Type", "text/plain")
            return _send(h, f.http_status, body, headers)
        return _send(h, f.http_status, f.body or b"", headers)        # raw

    # --- endpoints -------------------------------------------------------------------------------------

    def _ep_unknown(self, h, rec, fault) -> None:
        _send_json(h, 404, {"error": "not_found"})

    def _ep_discovery(self, h, rec, fault) -> None:
        _send_json(h, 200, self.discovery_document())

    def _ep_register(self, h, rec, fault) -> None:
        if rec.method != "POST":
            return _send_json(h, 405, {"error": "invalid_request"})
        if self.registration_refused is not None:
            status, error = self.registration_refused
            return _send_json(h, status, {"error": error, "error_description": "registration is closed"})
        try:
            meta = json.loads(rec.body)
        except ValueError:
            return _send_json(h, 400, {"error": "invalid_client_metadata", "error_description": "not JSON"})
        uris = meta.get("redirect_uris") or []
        if meta.get("token_endpoint_auth_method") != "none" or not uris \
                or not all(self._loopback_uri(u) for u in uris):
            return _send_json(h, 400, {"error": "invalid_client_metadata"})
        client_id = "dyn-" + secrets.token_hex(8)
        with self._lock:
            self.registered.append(meta)
            self.client_id = client_id
            self.redirect_uris = list(uris)
        answer = dict(meta)
        answer.update({"client_id": client_id, "client_id_issued_at": int(time.time()),
                       "registration_access_token": "rat-" + secrets.token_urlsafe(24),
                       "registration_client_uri": self.url("register") + "/" + client_id})
        _send_json(h, 201, answer)

    @staticmethod
    def _loopback_uri(uri: str) -> bool:
        try:
            u = urllib.parse.urlsplit(uri)
            return u.scheme == "http" and u.hostname in ("127.0.0.1", "localhost", "::1") and u.port is not None
        except ValueError:
            return False

    def _ep_jwks(self, h, rec, fault) -> None:
        with self._lock:
            doc = {"keys": [k.public_jwk() for k in self._published]}
            still = []
            for key, n in self._pending:       # this fetch is answered without it; count it down
                if n - 1 <= 0:
                    self._publish(key)
                else:
                    still.append((key, n - 1))
            self._pending = still
        _send_json(h, 200, doc, {"Content-Type": "application/jwk-set+json"})

    def _ep_par(self, h, rec, fault) -> None:
        if rec.method != "POST":
            return _send_json(h, 405, {"error": "invalid_request"})
        params = dict(rec.form)
        if params.get("client_id") != self.client_id:
            return _send_json(h, 401, {"error": "invalid_client"})
        if "request_uri" in params:
            return _send_json(h, 400, {"error": "invalid_request", "error_description": "request_uri not allowed"})
        err = self._check_authorization_params(params)
        if err:
            return _send_json(h, 400, {"error": err[0], "error_description": err[1]})
        request_uri = PAR_PREFIX + secrets.token_urlsafe(24)
        with self._lock:
            self._par[request_uri] = (params, time.time() + 60)
        _send_json(h, 201, {"request_uri": request_uri, "expires_in": 60})

    def _check_authorization_params(self, q: Dict[str, str]) -> Optional[Tuple[str, str]]:
        if q.get("response_type") != "code":
            return ("unsupported_response_type", "only code")
        if self.require_pkce and not q.get("code_challenge"):
            return ("invalid_request", "PKCE code_challenge required")
        if q.get("code_challenge") and q.get("code_challenge_method") != "S256":
            return ("invalid_request", "only S256")
        if "openid" not in q.get("scope", "").split():
            return ("invalid_scope", "openid required")
        return None

    def _redirect_uri_ok(self, uri: str) -> bool:
        if self.redirect_uris is not None:
            return uri in self.redirect_uris
        try:
            u = urllib.parse.urlsplit(uri)
            return u.scheme == "http" and u.hostname in ("127.0.0.1", "localhost", "::1") and u.port is not None
        except ValueError:
            return False

    def _ep_authorize(self, h, rec, fault) -> None:
        q = dict(rec.params)
        if q.get("client_id") != self.client_id:
            return _send(h, 400, b"unknown client_id", {"Content-Type": "text/plain"})
        if "request_uri" in q:
            with self._lock:
                entry = self._par.pop(q["request_uri"], None)
            if entry is None or entry[1] < time.time():
                return _send(h, 400, b"invalid or expired request_uri", {"Content-Type": "text/plain"})
            q = dict(entry[0])
        elif self.require_par:
            return self._authorize_redirect(h, q, {"error": "invalid_request",
                                                   "error_description": "pushed authorization request required"})
        redirect_uri = q.get("redirect_uri", "")
        if not self._redirect_uri_ok(redirect_uri):
            return _send(h, 400, b"redirect_uri not allowed", {"Content-Type": "text/plain"})
        if fault is not None and fault.kind == "authorize_error":
            params = {"error": fault.error}
            if fault.description:
                params["error_description"] = fault.description
            return self._authorize_redirect(h, q, params)
        err = self._check_authorization_params(q)
        if err:
            return self._authorize_redirect(h, q, {"error": err[0], "error_description": err[1]})
        code = secrets.token_urlsafe(32)
        jkt = q.get("dpop_jkt")
        with self._lock:
            self._codes[code] = _Code(client_id=self.client_id, redirect_uri=redirect_uri, scope=q["scope"],
                                      nonce=q.get("nonce"), code_challenge=q.get("code_challenge"),
                                      code_challenge_method=q.get("code_challenge_method"),
                                      auth_time=int(time.time()), expires_at=time.time() + self.code_lifetime,
                                      dpop_jkt=jkt)
        self._authorize_redirect(h, q, {"code": code}, fault)

    def _authorize_redirect(self, h, q: Dict[str, str], params: Dict[str, str], fault: Optional[Fault] = None) -> None:
        out = dict(params)
        if "state" in q:
            out["state"] = q["state"]
        if fault is not None and fault.kind == "wrong_state":
            out["state"] = "not-" + q.get("state", "")
        if self.advertise_iss:
            out["iss"] = self.issuer
        if fault is not None and fault.kind == "wrong_iss":
            out["iss"] = fault.value
        if fault is not None and fault.kind == "missing_iss":
            out.pop("iss", None)
        uri = q.get("redirect_uri", "")
        sep = "&" if urllib.parse.urlsplit(uri).query else "?"
        _send(h, 302, b"", {"Location": uri + sep + urllib.parse.urlencode(out)})

    def _ep_device_authorization(self, h, rec, fault) -> None:
        if rec.method != "POST":
            return _send_json(h, 405, {"error": "invalid_request"})
        if rec.form.get("client_id") != self.client_id:
            return _send_json(h, 401, {"error": "invalid_client"})
        device_code = secrets.token_urlsafe(32)
        alphabet = "BCDFGHJKLMNPQRSTVWXZ"
        raw = "".join(secrets.choice(alphabet) for _ in range(8))
        user_code = raw[:4] + "-" + raw[4:]
        d = DeviceAuthorization(device_code=device_code, user_code=user_code, client_id=self.client_id,
                                scope=rec.form.get("scope", "openid"),
                                expires_at=time.time() + self.device_expires_in, interval=self.device_interval)
        with self._lock:
            self._devices[device_code] = d
        _send_json(h, 200, {"device_code": device_code, "user_code": user_code,
                            "verification_uri": self.url("device"),
                            "verification_uri_complete": self.url("device") + "?user_code=" + user_code,
                            "expires_in": self.device_expires_in, "interval": self.device_interval})

    def _ep_device(self, h, rec, fault) -> None:
        code = rec.params.get("user_code", "")
        try:
            self.approve_device(code)
        except KeyError:
            return _send(h, 404, b"<html><body>Unknown code</body></html>", {"Content-Type": "text/html"})
        _send(h, 200, b"<html><body>Device approved. You may close this window.</body></html>",
              {"Content-Type": "text/html"})

    def _ep_revoke(self, h, rec, fault) -> None:
        if rec.method != "POST":
            return _send_json(h, 405, {"error": "invalid_request"})
        form = dict(rec.form)
        with self._lock:
            self.revocations.append(form)
            token = form.get("token", "")
            if token in self._refresh:
                self._revoke_family(self._refresh[token].family)
            elif token in self._access:
                self._access[token].revoked = True
        _send(h, 200, b"", {"Cache-Control": "no-store"})

    def _ep_userinfo(self, h, rec, fault) -> None:
        auth = rec.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() not in ("bearer", "dpop") or not token:
            return _send(h, 401, b"", {"WWW-Authenticate": 'Bearer realm="fake"'})
        info = self.introspect(token.strip())
        if info is None:
            challenge = ('DPoP error="invalid_token"' if scheme.lower() == "dpop"
                         else 'Bearer error="invalid_token", error_description="expired or revoked"')
            return _send_json(h, 401, {"error": "invalid_token"}, {"WWW-Authenticate": challenge})
        claims = {k: v for k, v in self.claims.items()}
        _send_json(h, 200, claims)

    def _ep_end_session(self, h, rec, fault) -> None:
        _send(h, 200, b"signed out", {"Content-Type": "text/plain"})

    def _client_authentication(self, rec) -> Tuple[Optional[str], str]:
        """The authenticated client_id (None: refused) and the method, as RFC 6749 §2.3 and RFC 7523 §3 say."""
        form = rec.form
        basic = rec.headers.get("authorization", "")
        if basic.lower().startswith("basic "):
            try:
                user, _, password = base64.b64decode(basic[6:]).decode().partition(":")
                user, password = urllib.parse.unquote(user), urllib.parse.unquote(password)
            except Exception:  # noqa: BLE001
                return None, "client_secret_basic"
            ok = self.client_secret is not None and secrets.compare_digest(password, self.client_secret)
            return (user if ok else None), "client_secret_basic"
        if "client_secret" in form:
            ok = self.client_secret is not None and secrets.compare_digest(form["client_secret"], self.client_secret)
            return (form.get("client_id") if ok else None), "client_secret_post"
        if form.get("client_assertion_type") == ASSERTION_TYPE:
            import jwt as pyjwt
            assertion = form.get("client_assertion", "")
            try:
                header = pyjwt.get_unverified_header(assertion)
                if header.get("alg") == "HS256":
                    method, key = "client_secret_jwt", (self.client_secret or "").encode()
                    algorithms = ["HS256"]
                else:
                    method, algorithms = "private_key_jwt", ["ES256", "RS256"]
                    jwk = next(k for k in self.client_jwks if k.get("kid") in (None, header.get("kid")))
                    key = pyjwt.PyJWK(jwk).key
                self.assertion_audiences.append(pyjwt.decode(assertion, options={"verify_signature": False}).get("aud"))
                audience = self.issuer if self.assertion_audience == "issuer" else self.url("token")
                claims = pyjwt.decode(assertion, key, algorithms=algorithms, audience=audience,
                                      options={"require": ["iss", "sub", "aud", "exp", "jti"]})
                # rfc7523bis §3: the issuer as the sole audience value, a string.
                if claims["aud"] != audience:
                    raise ValueError("aud is not the one expected string")
            except Exception:  # noqa: BLE001 - any defect refuses the client
                return None, "jwt"
            if claims["iss"] != claims["sub"] or claims["jti"] in self._seen_jti:
                return None, method
            self._seen_jti.add(claims["jti"])
            return claims["iss"], method
        if self.client_secret is not None or self.client_jwks:
            return None, "none"              # a confidential client must authenticate
        return form.get("client_id"), "none"

    def _ep_token(self, h, rec, fault) -> None:
        if rec.method != "POST":
            return _send_json(h, 405, {"error": "invalid_request"})
        form = rec.form
        with self._lock:
            client_id, method = self._client_authentication(rec)
            self.client_auth_methods.append(method)
        if client_id != self.client_id:
            return _send_json(h, 401, {"error": "invalid_client"}, {"WWW-Authenticate": 'Basic realm="fake"'})
        jkt = _dpop_jkt(rec.dpop) if (self.dpop and rec.dpop) else None
        if rec.dpop and self.dpop and jkt is None:
            return _send_json(h, 400, {"error": "invalid_dpop_proof", "error_description": "unreadable proof"})
        defects = fault.defects if (fault is not None and fault.kind == "id_token") else ()
        grant = form.get("grant_type")
        grants = {"authorization_code": self._grant_code, "refresh_token": self._grant_refresh,
                  DEVICE_GRANT: self._grant_device, "client_credentials": self._grant_client_credentials,
                  TOKEN_EXCHANGE_GRANT: self._grant_token_exchange}
        if grant not in grants:
            return _send_json(h, 400, {"error": "unsupported_grant_type"})
        with self._lock:                 # decide under the lock, answer outside it
            status, body = grants[grant](form, jkt, defects)
            rec.decided = time.time()
        try:
            _send_json(h, status, body, {"Pragma": "no-cache"})
        finally:
            rec.answered = time.time()

    def _grant_code(self, form, jkt, defects) -> Tuple[int, dict]:
        code = self._codes.get(form.get("code", ""))
        if code is None or code.used or code.expires_at < time.time():
            return (400, {"error": "invalid_grant", "error_description": "code invalid, used or expired"})
        code.used = True
        if form.get("redirect_uri") != code.redirect_uri:
            return (400, {"error": "invalid_grant", "error_description": "redirect_uri mismatch"})
        if code.code_challenge:
            verifier = form.get("code_verifier", "")
            if b64url(hashlib.sha256(verifier.encode()).digest()) != code.code_challenge:
                return (400, {"error": "invalid_grant", "error_description": "PKCE verification failed"})
        elif form.get("code_verifier"):
            return (400, {"error": "invalid_grant", "error_description": "no code_challenge was sent"})
        if code.dpop_jkt and code.dpop_jkt != jkt:
            return (400, {"error": "invalid_dpop_proof", "error_description": "dpop_jkt mismatch"})
        # RFC 8707 §2.2: a resource on the code exchange is the access token's audience.
        return (200, self._token_response(code.scope, code.client_id, code.nonce, code.auth_time, jkt, defects,
                                          with_refresh=self.issue_refresh_token, with_id_token=True,
                                          resource=form.get("resource")))

    def _grant_refresh(self, form, jkt, defects) -> Tuple[int, dict]:
        token = form.get("refresh_token", "")
        rt = self._refresh.get(token)
        if rt is None or rt.state == "revoked":
            return (400, {"error": "invalid_grant", "error_description": "refresh token invalid"})
        if rt.state == "rotated":
            if self.reuse_detection:
                self.reuse_detected += 1
                self._revoke_family(rt.family)
            return (400, {"error": "invalid_grant", "error_description": "refresh token reused"})
        if rt.dpop_jkt and rt.dpop_jkt != jkt:
            return (400, {"error": "invalid_dpop_proof", "error_description": "key mismatch"})
        scope = form.get("scope") or rt.scope
        if self.refresh_rotation:
            rt.state = "rotated"
        resp = self._token_response(scope, rt.client_id, rt.nonce, rt.auth_time, rt.dpop_jkt or jkt, defects,
                                    with_refresh=self.refresh_rotation, with_id_token=self.id_token_on_refresh,
                                    family=rt.family, resource=form.get("resource"))
        return (200, resp)

    def _grant_client_credentials(self, form, jkt, defects) -> Tuple[int, dict]:
        scope = form.get("scope", "")
        return (200, self._token_response(scope, self.client_id, None, int(time.time()), jkt, defects,
                                          with_refresh=False, with_id_token=False, resource=form.get("resource")))

    def _grant_token_exchange(self, form, jkt, defects) -> Tuple[int, dict]:
        # RFC 8693 §2.1: subject_token and subject_token_type are required.
        if not form.get("subject_token") or not form.get("subject_token_type"):
            return (400, {"error": "invalid_request", "error_description": "subject_token missing"})
        if form["subject_token"] not in self.subject_tokens:
            return (400, {"error": "invalid_grant", "error_description": "subject token not trusted"})
        scope = form.get("scope", "")
        resp = self._token_response(scope, self.client_id, None, int(time.time()), jkt, defects,
                                    with_refresh=False, with_id_token=False,
                                    resource=form.get("resource") or form.get("audience"))
        resp["issued_token_type"] = "urn:ietf:params:oauth:token-type:access_token"
        return (200, resp)

    def _grant_device(self, form, jkt, defects) -> Tuple[int, dict]:
        d = self._devices.get(form.get("device_code", ""))
        if d is None:
            return (400, {"error": "invalid_grant", "error_description": "unknown device_code"})
        now = time.time()
        too_fast = self.enforce_device_interval and d.last_poll and now - d.last_poll < d.interval
        d.last_poll = now
        outcome = None
        if d.script:
            outcome = d.script.popleft()
        elif self._device_script:
            outcome = self._device_script.popleft()
        if outcome == "approve":
            d.status = "approved"
        elif outcome == "expired_token":
            d.status = "expired"
        elif outcome == "access_denied":
            d.status = "denied"
        elif outcome in ("authorization_pending", "slow_down"):
            if outcome == "slow_down":
                d.interval += 5
            return (400, {"error": outcome})
        if d.status == "used":
            return (400, {"error": "invalid_grant", "error_description": "device_code already used"})
        if d.status == "expired" or (d.status == "pending" and d.expires_at < now):
            d.status = "expired"
            return (400, {"error": "expired_token"})
        if d.status == "denied":
            return (400, {"error": "access_denied"})
        if too_fast and d.status == "pending":
            d.interval += 5
            return (400, {"error": "slow_down"})
        if d.status == "pending":
            return (400, {"error": "authorization_pending"})
        d.status = "used"
        return (200, self._token_response(d.scope, d.client_id, None, int(now), jkt, defects,
                                          with_refresh=self.issue_refresh_token, with_id_token=True))

    def _revoke_family(self, family: str) -> None:
        for rt in self._refresh.values():
            if rt.family == family:
                rt.state = "revoked"

    # --- token minting (call with the lock held) --------------------------------------------------------

    def _token_response(self, scope: str, client_id: str, nonce: Optional[str], auth_time: int,
                        jkt: Optional[str], defects: Iterable[str], with_refresh: bool, with_id_token: bool,
                        family: Optional[str] = None, resource: Optional[str] = None) -> dict:
        now = int(time.time())
        granted = self.granted_scope if self.granted_scope is not None else scope
        lifetime = self.expires_in if self.expires_in is not None else 3600
        if self.access_token_format == "jwt":
            audience = resource if (resource and self.honour_resource) else self.access_token_audience
            at_claims = {"iss": self.issuer, "sub": self.claims["sub"], "aud": audience,
                         "client_id": client_id, "scope": granted, "iat": now, "exp": now + lifetime,
                         "jti": secrets.token_urlsafe(16)}
            if jkt:
                at_claims["cnf"] = {"jkt": jkt}
            access_token = jws(at_claims, self.signing_key, typ="at+jwt")
        else:
            access_token = secrets.token_urlsafe(32)
        self._access[access_token] = _Access(scope=granted, client_id=client_id, expires_at=time.time() + lifetime,
                                             dpop_jkt=jkt)
        resp: Dict[str, Any] = {"access_token": access_token, "token_type": "DPoP" if jkt else "Bearer",
                                "scope": granted}
        if self.expires_in is not None:
            resp["expires_in"] = self.expires_in
        if with_refresh:
            refresh = secrets.token_urlsafe(48)
            self._refresh[refresh] = _Refresh(family=family or secrets.token_hex(8), scope=scope, client_id=client_id,
                                              nonce=nonce, auth_time=auth_time, dpop_jkt=jkt)
            resp["refresh_token"] = refresh
        if with_id_token and "openid" in scope.split():
            resp["id_token"] = self._id_token(client_id, nonce, auth_time, access_token, tuple(defects))
        return resp

    def _id_token(self, client_id: str, nonce: Optional[str], auth_time: int, access_token: str,
                  defects: Tuple[str, ...]) -> str:
        now = int(time.time())
        key = self.signing_key
        digest = hashlib.sha256(access_token.encode()).digest()
        claims: Dict[str, Any] = {"iss": self.issuer, "sub": self.claims["sub"], "aud": client_id, "azp": client_id,
                                  "iat": now, "exp": now + self.id_token_lifetime, "auth_time": auth_time,
                                  "at_hash": b64url(digest[:16]), "name": self.claims.get("name"),
                                  "email": self.claims.get("email")}
        if nonce is not None:
            claims["nonce"] = nonce
        if self.acr is not None:
            claims["acr"] = self.acr
        if "wrong_aud" in defects:
            claims["aud"] = "someone-else"
            claims["azp"] = "someone-else"
        if "wrong_iss" in defects:
            claims["iss"] = "https://attacker.example"
        if "expired" in defects:
            claims["iat"], claims["exp"] = now - 7200, now - 3600
        if "iat_future" in defects:
            claims["iat"], claims["exp"] = now + 3600, now + 7200
        if "wrong_nonce" in defects:
            claims["nonce"] = "not-" + (nonce or "the-nonce")
        if "missing_nonce" in defects:
            claims.pop("nonce", None)
        if "missing_azp_multi_aud" in defects:
            claims["aud"] = [client_id, "another-audience"]
            claims.pop("azp", None)
        if "unknown_kid" in defects:
            key = self._rogue_key
        return jws(claims, key, alg_none="alg_none" in defects, bad_signature="bad_signature" in defects)


# ---------------------------------------------------------------------------------------------- plumbing

def _check_endpoint(endpoint: str) -> None:
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}; known: {ENDPOINTS}")


def _parse(text: str) -> Tuple[Dict[str, str], List[str]]:
    pairs = urllib.parse.parse_qsl(text, keep_blank_values=True)
    out: Dict[str, str] = {}
    dups: List[str] = []
    for k, v in pairs:
        if k in out:
            dups.append(k)
        else:
            out[k] = v
    return out, dups


def _dpop_jkt(proof: str) -> Optional[str]:
    """The thumbprint of the key in a DPoP proof's header, WITHOUT verifying anything (verification: later,
    through FakeIdP.dpop_hook)."""
    try:
        header = unverified_header(proof)
        if header.get("typ") != "dpop+jwt" or not isinstance(header.get("jwk"), dict):
            return None
        return jwk_thumbprint(header["jwk"])
    except Exception:  # noqa: BLE001 - any malformed proof
        return None


def _reason(status: int) -> str:
    return http.server.BaseHTTPRequestHandler.responses.get(status, ("Error",))[0]


def _send(h, status: int, body: bytes, headers: Optional[dict] = None) -> None:
    h.send_response(status)
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if body and h.command != "HEAD":
        h.wfile.write(body)


def _send_json(h, status: int, obj: Any, headers: Optional[dict] = None) -> None:
    hdrs = {"Content-Type": "application/json", "Cache-Control": "no-store"}
    hdrs.update(headers or {})
    _send(h, status, json.dumps(obj).encode(), hdrs)


def _handler_for(idp: FakeIdP):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "FakeIdP/1.0"
        # The head and the body go out in two writes: with Nagle's algorithm the body waits for the client's
        # delayed ACK (40 ms on Linux), which no real provider adds and which would hide proxyctl's own timing.
        disable_nagle_algorithm = True

        def version_string(self):
            return self.server_version

        def do_GET(self):  # noqa: N802
            self._run("GET")

        def do_POST(self):  # noqa: N802
            self._run("POST")

        def _run(self, method: str) -> None:
            try:
                idp._handle(self, method)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            except Exception:  # noqa: BLE001 - a bug in the fake must not hang the client
                self.close_connection = True
                try:
                    _send_json(self, 500, {"error": "server_error", "error_description": "fake IdP bug"})
                except OSError:
                    pass

        def log_message(self, format, *args):  # noqa: A002 - never log: requests carry secrets
            pass

    return Handler
