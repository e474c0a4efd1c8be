"""A protected HTTPS resource that demands step-up authentication (RFC 9470), for test_stepup.py.

`StepUpServer` listens on 127.0.0.1 (port from the kernel) with a certificate for the host names it is reached
as through proxyctl's `resolve` setting, signed by a test CA of its own (`server.ca_pem` is the origin's
`ca_file`). It checks every access token as an OAuth 2.0 resource server does (RFC 6750, RFC 9068): PyJWT
against the JWKS of the issuers it trusts (`trust(issuer, jwks_uri)`), `typ` at+jwt, signature, `iss`, `exp`,
`iat`, `sub`, `jti`. A DPoP-bound token (`cnf.jkt`) must come as `Authorization: DPoP` with a proof (RFC 9449
§7) whose signature, `htm`, `htu`, `ath`, `iat`, `jti` and key thumbprint are checked; a Bearer token with
`cnf` is refused.

What a path demands is set per path prefix with `require(prefix, ...)` (the longest prefix wins):

    acr           acr values the token's `acr` claim must be one of (space-separated, as in acr_values)
    max_age       seconds: the token's sign-in time must be at most this old
    signed_in_after
                  Unix time: the sign-in time must not be earlier (a sign-in older than the moment the
                  resource started asking counts as too old; glewlwyd's tokens carry no auth_time, so their
                  `iat` stands in for it)
    reject_first  answer the first N requests that carry an otherwise good token with 401 invalid_token
                  (to make the proxy refresh and replay)
    dpop_nonce    DPoP proofs must carry this nonce; without it: 401 `DPoP error="use_dpop_nonce"` and a
                  `DPoP-Nonce` field (RFC 9449 §9)

The sign-in time is the token's `auth_time` when it is a positive number, else its `iat`. A token that falls
short gets RFC 9470 §3's answer: 401, `WWW-Authenticate: <scheme> error="insufficient_user_authentication",
error_description="...", acr_values="...", max_age="..."` (the scheme of the request's Authorization, Bearer
when there was none) and a JSON body. A strong enough token gets 200 with JSON naming the token's sub, jti,
acr and sign-in time. Paths without a requirement need a good token only.

Every request is recorded (`requests`, `mark()`/`since(mark)`): method, path, headers, the status, the kind of
answer (`ok`, `step_up`, `invalid_token`, `no_token`, `use_dpop_nonce`), the verified claims, the exact
WWW-Authenticate and body sent. Tokens are kept in memory only and never printed.
"""

from __future__ import annotations

import datetime
import hashlib
import http.server
import json
import socket
import socketserver
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# One token verifier and one RFC 7638 thumbprint for both resource-server fixtures.
from resource_server import TokenError, Verifier, b64url, jwk_thumbprint

# MARK: - A test CA and the server's certificate


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def make_identity(directory: Path, hosts: list[str]) -> tuple[Path, Path, Path]:
    """A CA and a leaf for `hosts`, as files: (ca.pem, server.pem, server-key.pem)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "proxyctl tests"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "step-up test CA")])
    ca = (x509.CertificateBuilder()
          .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(_now() - datetime.timedelta(days=1))
          .not_valid_after(_now() + datetime.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - datetime.timedelta(hours=1))
            .not_valid_after(_now() + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_pem, cert_pem, key_pem = directory / "ca.pem", directory / "server.pem", directory / "server-key.pem"
    ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_pem.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    key_pem.chmod(0o600)
    return ca_pem, cert_pem, key_pem


# MARK: - Tokens and DPoP proofs


class Refused(Exception):
    """A token or proof the server does not take: 401 invalid_token (or use_dpop_nonce)."""

    def __init__(self, message: str, kind: str = "invalid_token"):
        super().__init__(message)
        self.kind = kind


def verify_proof(proof: str | None, method: str, htu: str, token: str, jkt: str, seen_jtis: set[str],
                 nonce: str | None) -> dict:
    """RFC 9449 §4.3 and §7.1: the proof's claims, or Refused."""
    if not proof:
        raise Refused("a DPoP token without a DPoP proof")
    try:
        header = jwt.get_unverified_header(proof)
    except jwt.PyJWTError as error:
        raise Refused(f"unreadable DPoP proof: {error}") from None
    jwk = header.get("jwk")
    if header.get("typ") != "dpop+jwt" or not isinstance(jwk, dict) or "d" in jwk:
        raise Refused("DPoP proof without typ dpop+jwt and a public jwk")
    if header.get("alg") not in ("ES256", "RS256", "PS256"):
        raise Refused(f"DPoP proof alg {header.get('alg')!r}")
    try:
        claims = jwt.decode(proof, jwt.PyJWK(jwk).key, algorithms=[header["alg"]],
                            options={"require": ["iat", "jti", "htm", "htu"], "verify_aud": False,
                                     "verify_iat": False})
    except jwt.PyJWTError as error:
        raise Refused(f"DPoP proof: {error}") from None
    if claims["htm"] != method:
        raise Refused(f"DPoP proof htm {claims['htm']!r} for a {method}")
    if claims["htu"].lower() != htu.lower():
        raise Refused(f"DPoP proof htu {claims['htu']!r}, expected {htu!r}")
    if abs(time.time() - float(claims["iat"])) > 60:
        raise Refused("DPoP proof iat too far from now")
    if claims.get("ath") != b64url(hashlib.sha256(token.encode()).digest()):
        raise Refused("DPoP proof ath does not match the access token")
    if jwk_thumbprint(jwk) != jkt:
        raise Refused("DPoP proof key is not the one the token is bound to")
    if claims["jti"] in seen_jtis:
        raise Refused("DPoP proof jti used before")
    seen_jtis.add(claims["jti"])
    if nonce is not None and claims.get("nonce") != nonce:
        raise Refused("DPoP nonce required", kind="use_dpop_nonce")
    return claims


# MARK: - Requirements and records


@dataclass
class Requirement:
    acr: str | None = None
    max_age: int | None = None
    signed_in_after: float | None = None
    reject_first: int = 0
    dpop_nonce: str | None = None


@dataclass
class Seen:
    """One request as the server received it, and what it answered."""
    number: int
    method: str
    path: str
    headers: list[tuple[str, str]]
    status: int = 0
    kind: str = ""
    claims: dict | None = None
    error: str | None = None
    www_authenticate: str | None = None
    body: bytes = b""
    token: str | None = field(default=None, repr=False)
    proof: dict | None = None

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    @property
    def host(self) -> str | None:
        return self.header("Host")


def sign_in_time(claims: dict) -> int:
    """auth_time when the token has a real one, else iat (glewlwyd's access tokens have no auth_time)."""
    auth_time = claims.get("auth_time")
    if isinstance(auth_time, (int, float)) and auth_time > 0:
        return int(auth_time)
    return int(claims["iat"])


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', "'")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "stepup-server"
    sys_version = ""

    def log_message(self, format, *args):  # noqa: A002 - quiet
        pass

    def handle(self):
        try:
            super().handle()
        except (ConnectionError, ssl.SSLError, TimeoutError, OSError):
            pass

    def do_GET(self):
        self.server.owner._serve(self)

    do_POST = do_PUT = do_DELETE = do_HEAD = do_GET


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, owner: "StepUpServer", tls: ssl.SSLContext):
        self.owner = owner
        self.tls = tls
        super().__init__(("127.0.0.1", 0), _Handler)

    def finish_request(self, request, client_address):
        try:
            request.settimeout(30)
            tls = self.tls.wrap_socket(request, server_side=True)
            tls.settimeout(60)
        except (ssl.SSLError, OSError):
            return
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


class StepUpServer:
    """See the module docstring."""

    def __init__(self, workdir: Path, hosts: list[str]):
        self.hosts = list(hosts)
        self.ca_pem, cert_pem, key_pem = make_identity(workdir, self.hosts)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert_pem, key_pem)
        self.verifier = Verifier(leeway=5)
        self.lock = threading.Lock()
        self.requirements: dict[str, Requirement] = {}
        self.requests: list[Seen] = []
        self.proof_jtis: set[str] = set()
        self.server = _Server(self, context)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    # --- addresses

    def origin(self, host: str | None = None) -> str:
        return f"https://{host or self.hosts[0]}:{self.port}"

    def url(self, path: str, host: str | None = None) -> str:
        return self.origin(host) + path

    # --- controls

    def trust(self, issuer: str, jwks_uri: str) -> None:
        self.verifier.trust(issuer, jwks_uri)

    def require(self, prefix: str, acr: str | None = None, max_age: int | None = None,
                signed_in_after: float | None = None, reject_first: int = 0,
                dpop_nonce: str | None = None) -> Requirement:
        requirement = Requirement(acr, max_age, signed_in_after, reject_first, dpop_nonce)
        with self.lock:
            self.requirements[prefix] = requirement
        return requirement

    def mark(self) -> int:
        with self.lock:
            return len(self.requests)

    def since(self, mark: int = 0, path: str | None = None) -> list[Seen]:
        with self.lock:
            seen = list(self.requests[mark:])
        return [s for s in seen if path is None or s.path.startswith(path)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # --- serving

    def _requirement(self, path: str) -> Requirement | None:
        with self.lock:
            matches = [p for p in self.requirements if path.startswith(p)]
            return self.requirements[max(matches, key=len)] if matches else None

    def _serve(self, handler: _Handler) -> None:
        with self.lock:
            seen = Seen(len(self.requests) + 1, handler.command, handler.path, list(handler.headers.items()))
            self.requests.append(seen)
        length = int(handler.headers.get("Content-Length", "0") or 0)
        if length:
            handler.rfile.read(length)
        requirement = self._requirement(urllib.parse.urlsplit(handler.path).path)
        status, headers, body = self._decide(handler, seen, requirement)
        seen.status, seen.body = status, body
        seen.www_authenticate = next((v for k, v in headers if k == "WWW-Authenticate"), None)
        handler.send_response(status)
        for name, value in headers:
            handler.send_header(name, value)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)

    def _decide(self, handler: _Handler, seen: Seen, requirement: Requirement | None):
        authorization = seen.header("Authorization")
        scheme = "Bearer"

        def refuse(kind: str, error: str, extra: str = "", headers: list[tuple[str, str]] = ()):
            seen.kind, seen.error = kind, error
            challenge = f'{scheme} realm="stepup"'
            if kind != "no_token":
                challenge += f', error="{kind}", error_description="{_quote(error)}"'
            body = json.dumps({"error": kind, "error_description": error, "path": seen.path}).encode()
            return 401, [("WWW-Authenticate", challenge + extra), *headers], body

        if authorization is None:
            return refuse("no_token", "no access token")
        given_scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if given_scheme.lower() == "dpop":
            scheme = "DPoP"
        elif given_scheme.lower() != "bearer" or not token:
            return refuse("invalid_token", "not a Bearer or DPoP token")
        seen.token = token
        try:
            claims = self.verifier.verify(token)
        except TokenError as error:
            return refuse("invalid_token", str(error))
        seen.claims = claims
        jkt = (claims.get("cnf") or {}).get("jkt")
        if scheme == "DPoP" and not jkt:
            return refuse("invalid_token", "DPoP scheme with a token that is not DPoP-bound")
        if scheme == "Bearer" and jkt:
            return refuse("invalid_token", "a DPoP-bound token sent as a Bearer token")
        if scheme == "DPoP":
            htu = f"https://{seen.host}{urllib.parse.urlsplit(seen.path).path}"
            nonce = requirement.dpop_nonce if requirement else None
            try:
                with self.lock:
                    seen.proof = verify_proof(seen.header("DPoP"), seen.method, htu, token, jkt, self.proof_jtis,
                                              nonce)
            except Refused as error:
                if error.kind == "use_dpop_nonce":
                    # RFC 9449 §9: the challenge names only the nonce error.
                    seen.kind, seen.error = "use_dpop_nonce", str(error)
                    body = json.dumps({"error": "use_dpop_nonce"}).encode()
                    return 401, [("WWW-Authenticate", 'DPoP error="use_dpop_nonce", '
                                                      'error_description="Resource server requires nonce in '
                                                      'DPoP proof"'),
                                 ("DPoP-Nonce", nonce)], body
                return refuse("invalid_token", str(error))
        if requirement is not None:
            with self.lock:
                rejecting = requirement.reject_first > 0
                if rejecting:
                    requirement.reject_first -= 1
            if rejecting:
                return refuse("invalid_token", "rejected by the test")
            problems = []
            if requirement.acr is not None and claims.get("acr") not in requirement.acr.split():
                problems.append(f"acr {claims.get('acr')!r} is not one of {requirement.acr}")
            signed_in = sign_in_time(claims)
            if requirement.max_age is not None and time.time() - signed_in > requirement.max_age:
                problems.append(f"the sign-in is older than {requirement.max_age}s")
            if requirement.signed_in_after is not None and signed_in < requirement.signed_in_after:
                problems.append("the sign-in happened before this resource asked for a new one")
            if problems:
                # RFC 9470 §3: the error, and what would satisfy the resource.
                extra = ""
                if requirement.acr is not None:
                    extra += f', acr_values="{requirement.acr}"'
                if requirement.max_age is not None:
                    extra += f', max_age="{requirement.max_age}"'
                seen.kind, seen.error = "step_up", "; ".join(problems)
                challenge = (f'{scheme} realm="stepup", error="insufficient_user_authentication", '
                             f'error_description="A stronger or more recent sign-in is required"{extra}')
                body = json.dumps({"error": "insufficient_user_authentication", "path": seen.path,
                                   "acr_values": requirement.acr, "max_age": requirement.max_age}).encode()
                return 401, [("WWW-Authenticate", challenge)], body
        seen.kind = "ok"
        info = {"path": seen.path, "sub": claims.get("sub"), "jti": claims.get("jti"), "acr": claims.get("acr"),
                "sign_in_time": sign_in_time(claims), "scheme": scheme}
        return 200, [], json.dumps(info).encode()
