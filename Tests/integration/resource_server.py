"""A protected resource server for the protected-origin tests, with its own test CA, and the CA helpers the
name-constraint tests use to sign certificates with any CA key.

`ResourceServer` is an HTTPS server on 127.0.0.1 (port from the kernel) whose certificate names the host
names it is reached as through proxyctl's `resolve` setting (e.g. `api.test`), signed by a CA made here with
`cryptography` (`server.ca.ca_pem` is the file to give as the origin's `ca_file`). It checks every Bearer
token the way an OAuth 2.0 resource server does (RFC 6750, RFC 9068), with PyJWT and the JWKS of the
issuers it was told to trust (`trust(issuer, jwks_uri)`): `typ` at+jwt, the signature (RS256/PS256/ES256,
key by `kid`, JWKS fetched again once for an unknown kid), `iss`, `exp`, `iat`, `sub`, `jti`.

    GET|POST|PUT|... /anything       200 JSON: method, path, host, body size and SHA-256, the token's sub, jti,
                                     iss, aud, scope
    GET /download/SIZE               SIZE bytes of support.generate() content (Content-Length)
    GET /redirect?to=URL             302 to URL (never followed by anyone but the client)
    GET /public/...                  200 JSON about the request, no token needed
    /repo.git/...                    `git http-backend` (CGI) for the bare repository made by `make_git_repo`
    anything, no or a bad token      401 with WWW-Authenticate: Bearer (error="invalid_token" for a bad one)

With `require_token=False` it is a plain HTTPS origin: no path needs a token (a non-protected host).

Every request body is read to its end and hashed before the answer, so a 401 never cuts an upload short.
Every request is recorded (`requests`, `mark()`/`since(mark)`): method, path, the header fields exactly as
received, body size and SHA-256, the status answered, the verified claims and the raw token (kept in memory
only, never printed). Test controls: `reject_next(n)` answers the next n requests that carry an otherwise
valid token with 401 invalid_token (forcing proxyctl's refresh-and-replay path), `revoke(jti)` rejects one
token until the end.

DPoP mode (`ResourceServer(..., dpop=True)`, RFC 9449 §7): a request may also come as `Authorization: DPoP
<token>` with one `DPoP` proof, which `DPoPVerifier` checks with PyJWT/cryptography (not proxyctl's JOSE code):
`typ` dpop+jwt, alg ES256, a public EC P-256 `jwk` without private members, the signature over that key,
`htm` = the method, `htu` = the normalised request URL (https, Host field lower-case, default port left out,
no query or fragment), `iat` within ±60 s, a `jti` never seen before, `ath` = base64url(SHA-256(token)), and
the token's `cnf.jkt` = the proof key's RFC 7638 thumbprint. A DPoP-bound token sent as Bearer is refused.
Nonces (RFC 9449 §9), per authority: with `rs.dpop.require_nonce = True` a proof without the current nonce
gets 401 `WWW-Authenticate: DPoP error="use_dpop_nonce"` and `DPoP-Nonce`; with `rs.dpop.rotate_on_success`
every 200 hands out the next nonce (the old one then fails); `rs.dpop.new_nonce(authority)` makes the
client's nonce stale. Refusals in DPoP mode use the DPoP scheme (`error="invalid_token"`,
`error="invalid_dpop_proof"`). Without `dpop=True` nothing changes: Bearer only, as above.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import http.server
import ipaddress
import json
import os
import secrets
import shutil
import socket
import socketserver
import ssl
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import jwt
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import support
from support import MiB

# MARK: - Certificates


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(common_name: str):
    """A self-signed EC P-256 CA (no name constraints): (key, certificate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "proxyctl tests"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(days=1))
        .not_valid_after(_now() + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def sign_leaf(ca_key, ca_cert: x509.Certificate, names: list, common_name: str | None = None):
    """A TLS server certificate signed by (ca_key, ca_cert) for `names` (str: DNS name, ipaddress object: IP
    address): (key, certificate). Works with any CA key `cryptography` can load, proxyctl's own included."""
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.IPAddress(n) if isinstance(n, (ipaddress.IPv4Address, ipaddress.IPv6Address)) else x509.DNSName(n)
            for n in names]
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name or str(names[0]))])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(hours=1))
        .not_valid_after(_now() + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def write_pair(directory: Path, stem: str, key, cert: x509.Certificate) -> tuple[Path, Path]:
    """Writes STEM.pem (the certificate) and STEM-key.pem (0600); returns both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
    cert_path.write_bytes(_pem(cert))
    key_path.write_bytes(_key_pem(key))
    os.chmod(key_path, 0o600)
    return cert_path, key_path


def fingerprint(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


@dataclass
class ServerIdentity:
    """A test CA and a leaf it signed for some host names, as files."""
    ca_pem: Path
    cert_pem: Path
    key_pem: Path
    leaf_der: bytes
    ca_der: bytes

    @classmethod
    def make(cls, directory: Path, label: str, hosts: list[str]) -> "ServerIdentity":
        ca_key, ca_cert = make_ca(f"{label} test CA")
        key, leaf = sign_leaf(ca_key, ca_cert, list(hosts))
        directory.mkdir(parents=True, exist_ok=True)
        ca_pem = directory / "ca.pem"
        ca_pem.write_bytes(_pem(ca_cert))
        cert_pem, key_pem = write_pair(directory, "server", key, leaf)
        return cls(ca_pem, cert_pem, key_pem, leaf.public_bytes(serialization.Encoding.DER),
                   ca_cert.public_bytes(serialization.Encoding.DER))

    @property
    def leaf_sha256(self) -> str:
        return fingerprint(self.leaf_der)

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_pem, self.key_pem)
        return context


# MARK: - Token verification


class TokenError(Exception):
    pass


class Verifier:
    """Checks access tokens against the JWKS of trusted issuers (PyJWT + cryptography)."""

    ALGORITHMS = ["RS256", "PS256", "ES256"]

    def __init__(self, leeway: int = 0):
        self.leeway = leeway                         # seconds of clock skew allowed on exp and iat
        self.issuers: dict[str, str] = {}            # iss -> jwks_uri
        self.keys: dict[tuple[str, str], object] = {}
        self.lock = threading.Lock()
        self.http = requests.Session()
        self.http.trust_env = False                  # never through a proxy from the test's environment

    def trust(self, issuer: str, jwks_uri: str) -> None:
        with self.lock:
            self.issuers[issuer] = jwks_uri

    def _fetch(self, issuer: str) -> None:
        answer = self.http.get(self.issuers[issuer], timeout=10)
        answer.raise_for_status()
        for jwk in answer.json().get("keys", []):
            if "kid" in jwk and jwk.get("use", "sig") == "sig":
                self.keys[(issuer, jwk["kid"])] = jwt.PyJWK(jwk).key

    def _key(self, issuer: str, kid: str):
        with self.lock:
            if (issuer, kid) not in self.keys:
                self._fetch(issuer)          # RFC 7517: an unknown kid may be a new key; fetch once more
            key = self.keys.get((issuer, kid))
        if key is None:
            raise TokenError(f"unknown key {kid!r}")
        return key

    def verify(self, token: str) -> dict:
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError as error:
            raise TokenError(f"not a JWT: {error}") from None
        # RFC 9068 §4: the resource server checks that typ is at+jwt.
        if str(header.get("typ", "")).lower() not in ("at+jwt", "application/at+jwt"):
            raise TokenError(f"typ is {header.get('typ')!r}, not at+jwt")
        issuer = unverified.get("iss")
        if issuer not in self.issuers:
            raise TokenError(f"untrusted issuer {issuer!r}")
        key = self._key(issuer, header.get("kid", ""))
        try:
            return jwt.decode(token, key, algorithms=self.ALGORITHMS, issuer=issuer, leeway=self.leeway,
                              options={"require": ["exp", "iat", "iss", "sub", "jti"], "verify_aud": False})
        except jwt.PyJWTError as error:
            raise TokenError(str(error) or type(error).__name__) from None


# MARK: - DPoP proofs (RFC 9449), verified with PyJWT and cryptography


# JWK members that only a private key has (RFC 7518 §6.2.2, §6.3.2, §6.4.1).
PRIVATE_JWK_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})
DPOP_MAX_SKEW = 60


class DPoPError(Exception):
    """A refused proof; `error` is the DPoP error code of the challenge (invalid_dpop_proof, use_dpop_nonce)."""

    def __init__(self, message: str, error: str = "invalid_dpop_proof"):
        super().__init__(message)
        self.error = error


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwk_thumbprint(jwk: dict) -> str:
    """RFC 7638 SHA-256 thumbprint of a public JWK (EC or RSA): the required members, sorted, no spaces."""
    required = {"EC": ("crv", "kty", "x", "y"), "RSA": ("e", "kty", "n"), "OKP": ("crv", "kty", "x")}[jwk["kty"]]
    canonical = json.dumps({k: jwk[k] for k in required}, separators=(",", ":"), sort_keys=True)
    return b64url(hashlib.sha256(canonical.encode()).digest())


def ec_public_jwk(public_key) -> dict:
    """The JWK of a P-256 public key (RFC 7518 §6.2.1: x and y padded to 32 bytes)."""
    numbers = public_key.public_numbers()
    return {"kty": "EC", "crv": "P-256", "x": b64url(numbers.x.to_bytes(32, "big")),
            "y": b64url(numbers.y.to_bytes(32, "big"))}


def key_file_thumbprint(path: Path) -> str:
    """The RFC 7638 thumbprint of the EC private key in a PEM file (proxyctl's DPoP key file)."""
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    return jwk_thumbprint(ec_public_jwk(key.public_key()))


def access_token_hash(token: str) -> str:
    """RFC 9449 §4.2 `ath`: base64url(SHA-256(ASCII(token)))."""
    return b64url(hashlib.sha256(token.encode("ascii")).digest())


def normalized_htu(url: str) -> str:
    """The `htu` a proof for `url` must carry (RFC 9449 §4.3, RFC 3986 §6.2.2-6.2.3): scheme and host
    lower-case, the scheme's default port left out, an empty path as /, no query, no fragment."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    port = parts.port
    authority = host if port is None or port == {"https": 443, "http": 80}.get(scheme) else f"{host}:{port}"
    return f"{scheme}://{authority}{parts.path or '/'}"


@dataclass
class Proof:
    """A verified DPoP proof."""
    raw: str = field(repr=False)
    header: dict
    claims: dict
    jkt: str

    @property
    def jti(self) -> str:
        return self.claims["jti"]

    @property
    def nonce(self) -> str | None:
        return self.claims.get("nonce")


def verify_dpop_proof(proof: str, method: str, url: str, access_token: str | None = None,
                      now: float | None = None, max_skew: int = DPOP_MAX_SKEW) -> Proof:
    """Checks one proof as RFC 9449 §4.3 says, except the stateful parts (jti replay, nonce): DPoPVerifier.
    With `access_token`, `ath` must bind it; without, there must be no `ath` (a token request)."""
    try:
        header = jwt.get_unverified_header(proof)
    except jwt.PyJWTError as error:
        raise DPoPError(f"not a JWS: {error}") from None
    if header.get("typ") != "dpop+jwt":
        raise DPoPError(f"typ is {header.get('typ')!r}, not dpop+jwt")
    if header.get("alg") != "ES256":
        raise DPoPError(f"alg is {header.get('alg')!r}, not ES256")
    jwk = header.get("jwk")
    if not isinstance(jwk, dict):
        raise DPoPError("no jwk in the header")
    leaked = sorted(PRIVATE_JWK_MEMBERS & set(jwk))
    if leaked:
        raise DPoPError(f"the jwk has private members {leaked}")
    if jwk.get("kty") != "EC" or jwk.get("crv") != "P-256":
        raise DPoPError(f"the jwk is {jwk.get('kty')}/{jwk.get('crv')}, not EC/P-256")
    try:
        key = jwt.PyJWK(jwk, algorithm="ES256").key
        claims = jwt.decode(proof, key, algorithms=["ES256"],
                            options={"verify_aud": False, "verify_iat": False, "verify_exp": False,
                                     "verify_nbf": False, "require": ["jti", "htm", "htu", "iat"]})
    except jwt.PyJWTError as error:
        raise DPoPError(f"bad proof: {error}") from None
    if claims["htm"] != method:
        raise DPoPError(f"htm {claims['htm']!r} is not the method {method!r}")
    expected = normalized_htu(url)
    if claims["htu"] != expected:
        raise DPoPError(f"htu {claims['htu']!r} is not {expected!r}")
    iat = claims["iat"]
    now = time.time() if now is None else now
    if not isinstance(iat, int) or isinstance(iat, bool) or abs(now - iat) > max_skew:
        raise DPoPError(f"iat {iat!r} is not within {max_skew}s of now")
    if not isinstance(claims["jti"], str) or len(claims["jti"]) < 16:
        raise DPoPError("jti is too short to be unique")
    if access_token is not None:
        if claims.get("ath") != access_token_hash(access_token):
            raise DPoPError("ath does not match the access token")
    elif "ath" in claims:
        raise DPoPError("ath in a proof that goes with no access token")
    return Proof(proof, header, claims, jwk_thumbprint(jwk))


class DPoPVerifier:
    """Proofs with replay detection (every jti once) and server nonces per authority (RFC 9449 §9)."""

    def __init__(self, max_skew: int = DPOP_MAX_SKEW):
        self.max_skew = max_skew
        self.lock = threading.Lock()
        self.jtis: set[str] = set()
        self.require_nonce = False
        self.rotate_on_success = False
        self.nonces: dict[str, str] = {}          # authority -> the nonce accepted now
        self.issued: list[str] = []               # every nonce handed out (for the tests' secret scans)
        self.proofs: list[str] = []               # every proof received (likewise)

    def new_nonce(self, authority: str) -> str:
        """A new current nonce for `authority`; the previous one stops working."""
        nonce = secrets.token_urlsafe(24)
        with self.lock:
            self.nonces[authority.lower()] = nonce
            self.issued.append(nonce)
        return nonce

    def current_nonce(self, authority: str) -> str:
        with self.lock:
            nonce = self.nonces.get(authority.lower())
        return nonce or self.new_nonce(authority)

    def check(self, proof: str, method: str, url: str, authority: str, access_token: str | None = None) -> Proof:
        with self.lock:
            self.proofs.append(proof)
        verified = verify_dpop_proof(proof, method, url, access_token, max_skew=self.max_skew)
        with self.lock:
            if verified.jti in self.jtis:
                raise DPoPError(f"jti {verified.jti!r} was used before (a replayed proof)")
            self.jtis.add(verified.jti)
        if self.require_nonce:
            current = self.current_nonce(authority)
            if verified.nonce != current:
                raise DPoPError("a fresh nonce is needed" if verified.nonce else "a nonce is needed",
                                error="use_dpop_nonce")
        return verified


# MARK: - The server


@dataclass
class Seen:
    """One request as the resource server received it."""
    number: int
    connection: int
    method: str
    path: str
    headers: list[tuple[str, str]]
    body_size: int = 0
    body_sha256: str = ""
    status: int = 0
    claims: dict | None = None
    token: str | None = field(default=None, repr=False)
    error: str | None = None
    scheme: str | None = None                 # the Authorization scheme, lower-case
    proof: Proof | None = None                # DPoP mode: the verified proof
    dpop_error: str | None = None             # DPoP mode: the DPoP error code of a refusal
    response_headers: list[tuple[str, str]] = field(default_factory=list)  # extra fields of the answer

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    def header_values(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key.lower() == name.lower()]

    @property
    def host(self) -> str | None:
        return self.header("Host")

    @property
    def jti(self) -> str | None:
        return self.claims.get("jti") if self.claims else None


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "resource-server"
    sys_version = ""

    def log_message(self, format, *args):  # noqa: A002 - quiet
        pass

    def handle(self):
        try:
            super().handle()
        except (ConnectionError, ssl.SSLError, TimeoutError, OSError):
            pass

    # Every method goes through one path.
    def do_GET(self):
        self._serve()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    def _read_body(self, keep: bool) -> tuple[int, str, bytes]:
        digest = hashlib.sha256()
        kept = bytearray()
        size = 0

        def take(data: bytes):
            nonlocal size
            digest.update(data)
            size += len(data)
            if keep:
                kept.extend(data)

        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline(65537)
                length = int(line.split(b";")[0].strip(), 16)
                if length == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                while length > 0:
                    data = self.rfile.read(min(length, MiB))
                    if not data:
                        raise ConnectionError("body cut short")
                    take(data)
                    length -= len(data)
                self.rfile.readline(3)
        else:
            remaining = int(self.headers.get("Content-Length", "0") or 0)
            while remaining > 0:
                data = self.rfile.read(min(remaining, MiB))
                if not data:
                    raise ConnectionError("body cut short")
                take(data)
                remaining -= len(data)
        return size, digest.hexdigest(), bytes(kept)

    def _send(self, status: int, body: bytes = b"", content_type: str = "application/json",
              headers: list[tuple[str, str]] = ()) -> None:
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        if status not in (204, 304):
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: dict, headers: list[tuple[str, str]] = ()) -> None:
        self._send(status, json.dumps(obj).encode(), headers=headers)

    def _serve(self):
        rs: ResourceServer = self.server.owner
        url = urllib.parse.urlsplit(self.path)
        is_git = url.path.startswith("/repo.git/")
        seen = rs._record_start(self.server.local.number, self.command, self.path, list(self.headers.items()))
        try:
            seen.body_size, seen.body_sha256, body = self._read_body(keep=is_git)
        except (ConnectionError, ValueError, OSError):
            seen.error = "body cut short"
            self.close_connection = True
            return
        public = not rs.require_token or url.path.startswith("/public/")
        if not public:
            verdict = rs._check(seen)
            if verdict is not None:
                seen.status = 401
                self._json(401, {"error": seen.dpop_error or ("invalid_token" if seen.token else "no_token")},
                           headers=[("WWW-Authenticate", verdict), *seen.response_headers])
                return
            if rs.dpop is not None and seen.proof is not None and rs.dpop.rotate_on_success:
                # RFC 9449 §8.2: the next nonce may come with any response, 200s included.
                seen.response_headers.append(("DPoP-Nonce", rs.dpop.new_nonce(seen.host or "")))
        info = {"method": self.command, "path": self.path, "host": self.headers.get("Host"),
                "body_size": seen.body_size, "body_sha256": seen.body_sha256,
                "authorization": self.headers.get("Authorization") is not None}
        if seen.claims:
            info.update({k: seen.claims.get(k) for k in ("sub", "jti", "iss", "aud", "scope", "client_id")})
        if seen.proof is not None:
            info.update({"token_type": "DPoP", "dpop_jkt": seen.proof.jkt, "proof_jti": seen.proof.jti})
        parts = url.path.strip("/").split("/")
        if is_git:
            seen.status = rs._git(self, url, body)
        elif parts[0] == "download" and len(parts) == 2:
            seen.status = 200
            self._download(int(parts[1]))
        elif parts[0] == "redirect":
            target = urllib.parse.parse_qs(url.query).get("to", ["https://elsewhere.test/"])[0]
            seen.status = 302
            self._send(302, b"redirecting\n", "text/plain", headers=[("Location", target), *seen.response_headers])
        else:
            seen.status = 200
            # ?echo=NAME: the answer carries each named request field back as NAME-Echo, byte for byte (both
            # directions read and write field values as Latin-1, so any obs-text byte survives the round trip).
            echoed = [(f"{name}-Echo", value) for name in urllib.parse.parse_qs(url.query).get("echo", [])
                      for value in seen.header_values(name)]
            self._json(200, info, headers=[*seen.response_headers, *echoed])

    def _download(self, size: int):
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        for block in support.generate(size):
            self.wfile.write(block)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = False
    request_queue_size = 1024

    def __init__(self, owner: "ResourceServer", tls: ssl.SSLContext):
        self.owner = owner
        self.tls = tls
        self.connections = 0
        self.count_lock = threading.Lock()
        self.local = threading.local()  # the number of the connection this thread serves
        super().__init__(("127.0.0.1", 0), _Handler)

    def finish_request(self, request, client_address):
        # The TLS handshake runs in the connection's thread, not in the accepting one.
        with self.count_lock:
            self.connections += 1
            number = self.connections
        try:
            request.settimeout(30)
            tls = self.tls.wrap_socket(request, server_side=True)
            tls.settimeout(120)
        except (ssl.SSLError, OSError):
            return
        self.local.number = number
        try:
            super().finish_request(tls, client_address)
        finally:
            try:
                tls.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            tls.close()

    def handle_error(self, request, client_address):
        pass


class ResourceServer:
    """See the module docstring."""

    def __init__(self, workdir: Path, hosts: list[str], label: str = "api", require_token: bool = True,
                 dpop: bool = False):
        self.workdir = workdir
        self.hosts = list(hosts)
        self.require_token = require_token
        self.dpop: DPoPVerifier | None = DPoPVerifier() if dpop else None
        self.identity = ServerIdentity.make(workdir / "tls", label, self.hosts)
        self.verifier = Verifier()
        self.lock = threading.Lock()
        self.requests: list[Seen] = []
        self._reject = 0
        self.revoked: set[str] = set()
        self.git_root: Path | None = None
        self.server = _Server(self, self.identity.server_context())
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    # --- addresses

    @property
    def ca_pem(self) -> Path:
        return self.identity.ca_pem

    def url(self, path: str, host: str | None = None) -> str:
        return f"https://{host or self.hosts[0]}:{self.port}{path}"

    def authority(self, host: str | None = None) -> str:
        return f"{host or self.hosts[0]}:{self.port}"

    # --- controls

    def trust(self, issuer: str, jwks_uri: str) -> None:
        self.verifier.trust(issuer, jwks_uri)

    def reject_next(self, count: int) -> None:
        """The next `count` requests with an otherwise valid token get 401 invalid_token."""
        with self.lock:
            self._reject = count

    def revoke(self, jti: str) -> None:
        with self.lock:
            self.revoked.add(jti)

    def mark(self) -> int:
        with self.lock:
            return len(self.requests)

    def since(self, mark: int = 0, host: str | None = None) -> list[Seen]:
        """Requests received after `mark`, optionally only those whose Host names `host`."""
        with self.lock:
            seen = list(self.requests[mark:])
        if host is not None:
            seen = [s for s in seen if (s.host or "").split(":")[0] == host]
        return seen

    # --- internals

    def _record_start(self, connection: int, method: str, path: str, headers) -> Seen:
        with self.lock:
            seen = Seen(len(self.requests) + 1, connection, method, path, headers)
            self.requests.append(seen)
        return seen

    def _check(self, seen: Seen) -> str | None:
        """None when the request carries a good token; else the WWW-Authenticate value of the 401."""
        realm = 'Bearer realm="api"'
        authorization = seen.header("Authorization")
        if authorization is None:
            if self.dpop is not None:
                return realm + ', DPoP algs="ES256"'
            return realm  # RFC 6750 §3.1: no error code when the request had no credentials
        scheme, _, token = authorization.partition(" ")
        seen.scheme = scheme.lower()
        if self.dpop is not None and seen.scheme == "dpop" and token.strip():
            return self._check_dpop(seen, token.strip())
        if scheme.lower() != "bearer" or not token.strip():
            seen.error = "not a Bearer token"
            return realm + ', error="invalid_token", error_description="not a Bearer token"'
        seen.token = token.strip()
        try:
            seen.claims = self.verifier.verify(seen.token)
        except TokenError as error:
            seen.error = str(error)
            return realm + f', error="invalid_token", error_description="{_quote(str(error))}"'
        if self.dpop is not None and isinstance(seen.claims.get("cnf"), dict):
            # RFC 9449 §7.1: a DPoP-bound token is not accepted as a Bearer token.
            seen.error = "a DPoP-bound token sent as Bearer"
            return realm + f', error="invalid_token", error_description="{seen.error}"'
        return self._test_rejections(seen, realm)

    def _test_rejections(self, seen: Seen, challenge: str) -> str | None:
        """The test's own refusals (revoked jti, reject_next) of an otherwise good request."""
        with self.lock:
            if seen.claims.get("jti") in self.revoked:
                seen.error = "revoked"
            elif self._reject > 0:
                self._reject -= 1
                seen.error = "rejected by the test"
        if seen.error:
            return challenge + f', error="invalid_token", error_description="{seen.error}"'
        return None

    def _check_dpop(self, seen: Seen, token: str) -> str | None:
        """RFC 9449 §7.1: a DPoP token with exactly one valid proof bound to it."""
        challenge = 'DPoP algs="ES256"'
        seen.token = token
        proofs = seen.header_values("DPoP")
        if len(proofs) != 1:
            seen.error, seen.dpop_error = f"{len(proofs)} DPoP fields, not one", "invalid_dpop_proof"
            return challenge + f', error="invalid_dpop_proof", error_description="{seen.error}"'
        try:
            seen.claims = self.verifier.verify(token)
        except TokenError as error:
            seen.error, seen.dpop_error = str(error), "invalid_token"
            return challenge + f', error="invalid_token", error_description="{_quote(str(error))}"'
        authority = seen.host or ""
        url = f"https://{authority}{seen.path}"
        try:
            seen.proof = self.dpop.check(proofs[0], seen.method, url, authority, access_token=token)
        except DPoPError as error:
            seen.error, seen.dpop_error = str(error), error.error
            if error.error == "use_dpop_nonce":
                seen.response_headers.append(("DPoP-Nonce", self.dpop.current_nonce(authority)))
            return challenge + f', error="{error.error}", error_description="{_quote(str(error))}"'
        cnf = seen.claims.get("cnf")
        bound = cnf.get("jkt") if isinstance(cnf, dict) else None
        if bound != seen.proof.jkt:
            seen.error, seen.dpop_error = f"cnf.jkt {bound!r} is not the proof key's thumbprint", "invalid_token"
            return challenge + f', error="invalid_token", error_description="{_quote(seen.error)}"'
        verdict = self._test_rejections(seen, challenge)
        if verdict is not None:
            seen.dpop_error = "invalid_token"
        return verdict

    # --- git

    def make_git_repo(self, files: dict[str, bytes]) -> Path:
        """A bare repository `repo.git` with one commit holding `files`, served at /repo.git."""
        root = self.workdir / "git"
        source = root / "source"
        source.mkdir(parents=True)
        env = git_env(root / "home")
        for name, content in files.items():
            (source / name).write_bytes(content)
        for command in (["git", "init", "-q", "-b", "main", str(source)],
                        ["git", "-C", str(source), "add", "."],
                        ["git", "-C", str(source), "commit", "-q", "-m", "protected content"],
                        ["git", "clone", "-q", "--bare", str(source), str(root / "repo.git")]):
            subprocess.run(command, check=True, env=env, capture_output=True, timeout=30)
        self.git_root = root
        return root / "repo.git"

    def _git(self, handler: _Handler, url, body: bytes) -> int:
        if self.git_root is None:
            handler._json(404, {"error": "no repository"})
            return 404
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.git_root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "GATEWAY_INTERFACE": "CGI/1.1",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "REQUEST_METHOD": handler.command,
            "PATH_INFO": urllib.parse.unquote(url.path),
            "QUERY_STRING": url.query,
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_ADDR": "127.0.0.1",
            "REMOTE_USER": "token-holder",
            "HOME": str(self.git_root / "home"),
        }
        if handler.headers.get("Content-Type"):
            env["CONTENT_TYPE"] = handler.headers["Content-Type"]
        for name, value in handler.headers.items():
            key = "HTTP_" + name.upper().replace("-", "_")
            if key not in ("HTTP_AUTHORIZATION", "HTTP_CONTENT_LENGTH", "HTTP_CONTENT_TYPE"):
                env[key] = value
        done = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True, timeout=60)
        head, separator, out = done.stdout.partition(b"\r\n\r\n")
        if not separator:
            head, separator, out = done.stdout.partition(b"\n\n")
        status = 200
        headers = []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers.append((name.strip(), value.strip()))
        if done.returncode != 0 and not head:
            status, out, headers = 500, done.stderr[-500:], [("Content-Type", "text/plain")]
        handler.send_response(status)
        for name, value in headers:
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(out)))
        handler.end_headers()
        handler.wfile.write(out)
        return status

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', "'")[:200]


def git_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment for git that reads no user or system configuration."""
    home.mkdir(parents=True, exist_ok=True)
    env = support.clean_env(HOME=str(home), GIT_CONFIG_NOSYSTEM="1", GIT_TERMINAL_PROMPT="0",
                            GIT_AUTHOR_NAME="Test", GIT_AUTHOR_EMAIL="test@example.test",
                            GIT_COMMITTER_NAME="Test", GIT_COMMITTER_EMAIL="test@example.test")
    env.pop("GIT_DIR", None)
    env.update(extra)
    return env


def git_available() -> bool:
    return shutil.which("git") is not None
