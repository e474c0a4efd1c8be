"""A protected HTTPS resource that demands step-up authentication (RFC 9470), for test_stepup.py.

`StepUpServer` listens on 127.0.0.1 (port from the kernel) with a certificate for the host names it is reached
as through proxyctl's `resolve` setting, signed by a test CA of its own (fixtures.pki; `server.ca_pem` is the
origin's `ca_file`). It checks every access token as an OAuth 2.0 resource server does (RFC 6750, RFC 9068),
with fixtures.jose's AccessTokenVerifier against the JWKS of the issuers it trusts (`trust(issuer, jwks_uri)`):
`typ` at+jwt, signature, `iss`, `exp`, `iat`, `sub`, `jti`. A DPoP-bound token (`cnf.jkt`) must come as
`Authorization: DPoP` with a proof (RFC 9449 §7) that fixtures.jose's DPoPVerifier takes (every check of §4.3,
the key the token is bound to, a `jti` never seen before); a Bearer token with `cnf` is refused.

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

import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from fixtures.http import auth_param, field_value
from fixtures.jose import AccessTokenVerifier, DPoPError, DPoPVerifier, TokenError
from fixtures.pki import ServerIdentity
from fixtures.tls_server import QuietHandler, TLSHTTPServer

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
    proof: dict | None = None                 # the claims of the verified DPoP proof

    def header(self, name: str) -> str | None:
        return field_value(self.headers, name)

    @property
    def host(self) -> str | None:
        return self.header("Host")


def sign_in_time(claims: dict) -> int:
    """auth_time when the token has a real one, else iat (glewlwyd's access tokens have no auth_time)."""
    auth_time = claims.get("auth_time")
    if isinstance(auth_time, (int, float)) and auth_time > 0:
        return int(auth_time)
    return int(claims["iat"])


class _Handler(QuietHandler):
    server_version = "stepup-server"

    def do_GET(self):
        self.server.owner._serve(self)

    do_POST = do_PUT = do_DELETE = do_HEAD = do_GET


class StepUpServer:
    """See the module docstring."""

    def __init__(self, workdir: Path, hosts: list[str]):
        self.hosts = list(hosts)
        identity = ServerIdentity.make(workdir, "step-up", self.hosts)
        self.ca_pem = identity.ca_pem
        self.verifier = AccessTokenVerifier(leeway=5)
        self.dpop = DPoPVerifier()
        self.lock = threading.Lock()
        self.requirements: dict[str, Requirement] = {}
        self.requests: list[Seen] = []
        self.server = TLSHTTPServer(_Handler, identity.server_context(), io_timeout=60, owner=self).start()
        self.port = self.server.port

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
        self.server.close()

    # --- serving

    def _requirement(self, path: str) -> Requirement | None:
        with self.lock:
            matches = [p for p in self.requirements if path.startswith(p)]
            return self.requirements[max(matches, key=len)] if matches else None

    def _serve(self, handler: _Handler) -> None:
        with self.lock:
            seen = Seen(len(self.requests) + 1, handler.command, handler.path, list(handler.headers.items()))
            self.requests.append(seen)
        handler.read_body()
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
                challenge += f', error="{kind}", error_description="{auth_param(error)}"'
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
            proof = seen.header("DPoP")
            if not proof:
                return refuse("invalid_token", "a DPoP token without a DPoP proof")
            nonce = requirement.dpop_nonce if requirement else None
            try:
                seen.proof = self.dpop.check(proof, seen.method, f"https://{seen.host}{seen.path}", seen.host or "",
                                             access_token=token, jkt=jkt, nonce=nonce).claims
            except DPoPError as error:
                if error.error == "use_dpop_nonce":
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
