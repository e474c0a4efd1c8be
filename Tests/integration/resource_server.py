"""A protected resource server for the protected-origin and DPoP tests.

`ResourceServer` is an HTTPS server on 127.0.0.1 (port from the kernel) whose certificate names the host
names it is reached as through proxyctl's `resolve` setting (e.g. `api.test`), signed by a test CA of its own
(fixtures.pki; `server.ca_pem` is the file to give as the origin's `ca_file`). It checks every Bearer token
the way an OAuth 2.0 resource server does (RFC 6750, RFC 9068) with fixtures.jose's AccessTokenVerifier and
the JWKS of the issuers it was told to trust (`trust(issuer, jwks_uri)`): `typ` at+jwt, the signature
(RS256/PS256/ES256, key by `kid`, JWKS fetched again once for an unknown kid), `iss`, `exp`, `iat`, `sub`, `jti`.

    GET|POST|PUT|... /anything       200 JSON: method, path, host, body size and SHA-256, the token's sub, jti,
                                     iss, aud, scope
    GET /download/SIZE               SIZE bytes of fixtures.content.generate() (Content-Length); a
                                     connection closed mid-body leaves error "download cut short"
    GET /redirect?to=URL             302 to URL (never followed by anyone but the client)
    GET /events                      text/event-stream, chunked: each text put in `events`, as it is put; None ends
    GET /public/...                  200 JSON about the request, no token needed
    GET /files/NAME                  the bytes of `files[NAME]` (a wheel for pip, say)
    GET /hangup/TAG                  the first time for TAG: the connection is closed without a byte of answer
                                     (a kept connection the origin closed as the request came); then 200 JSON
    GET /raw/NAME                    the bytes of `raw[NAME]` as the whole answer, then the connection is closed
    /repo.git/...                    `git http-backend` (CGI) for the bare repository made by `make_git_repo`
    anything, no or a bad token      401 with WWW-Authenticate: Bearer (error="invalid_token" for a bad one)

With `require_token=False` it is a plain HTTPS origin: no path needs a token (a non-protected host).

Protected resource metadata (RFC 9728): `rs.publish_metadata(doc)` serves `doc` (a dict; `resource` may say
"{origin}", replaced by `https://HOST:PORT` of the request) as JSON at `/.well-known/oauth-protected-resource` and
any path below it, without a token, and with `challenge=True` (the default) every 401 also names it in
`resource_metadata="https://HOST:PORT/.well-known/oauth-protected-resource"` (RFC 9728 §5.1). `metadata_path` puts
it elsewhere (the challenge names it there, the well-known path answers 404). `rs.metadata_answer` may be set to a
function (path, host) -> (status, headers, body) for the adversarial answers (a redirect, 100 KiB of JSON).
`rs.require_scope[PREFIX] = "admin"`: a token without that scope gets 403 with `WWW-Authenticate: Bearer
error="insufficient_scope", scope="admin"` (RFC 6750 §3.1) on paths under PREFIX.

Every request body is read to its end and hashed before the answer, so a 401 never cuts an upload short.
Every request is recorded (`requests`, `mark()`/`since(mark)`): method, path, the header fields exactly as
received, body size and SHA-256, the status answered, the verified claims and the raw token (kept in memory
only, never printed). Test controls: `reject_next(n)` answers the next n requests that carry an otherwise
valid token with 401 invalid_token (forcing proxyctl's refresh-and-replay path), `revoke(jti)` rejects one
token until the end.

DPoP mode (`ResourceServer(..., dpop=True)`, RFC 9449 §7): a request may also come as `Authorization: DPoP
<token>` with one `DPoP` proof, which fixtures.jose's `DPoPVerifier` checks (PyJWT, not proxyctl's JOSE code)
against the request URL `https://HOST-FIELD/PATH`, the token and the token's `cnf.jkt`: every check of RFC 9449
§4.3 and a `jti` never seen before. A DPoP-bound token sent as Bearer is refused, and so is a token without
`cnf.jkt` sent as DPoP. Nonces (RFC 9449 §9), per authority: with `rs.dpop.require_nonce = True` a proof
without the current nonce gets 401 `WWW-Authenticate: DPoP error="use_dpop_nonce"` and `DPoP-Nonce`; with
`rs.dpop.rotate_on_success` every 200 hands out the next nonce (the old one then fails);
`rs.dpop.new_nonce(authority)` makes the client's nonce stale. Refusals in DPoP mode use the DPoP scheme
(`error="invalid_token"`, `error="invalid_dpop_proof"`). Without `dpop=True` nothing changes: Bearer only, as
above.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import ssl
import subprocess
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from fixtures.content import generate
from fixtures.http import auth_param, field_value, field_values
from fixtures.jose import AccessTokenVerifier, DPoPError, DPoPVerifier, Proof, TokenError
from fixtures.pki import ServerIdentity
from fixtures.proxy import clean_env
from fixtures.tls_server import QuietHandler, TLSHTTPServer


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
        return field_value(self.headers, name)

    def header_values(self, name: str) -> list[str]:
        return field_values(self.headers, name)

    @property
    def host(self) -> str | None:
        return self.header("Host")

    @property
    def jti(self) -> str | None:
        return self.claims.get("jti") if self.claims else None


class _Handler(QuietHandler):
    server_version = "resource-server"

    # Every method goes through one path.
    def do_GET(self):
        self._serve()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

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
            received = self.read_body(keep=is_git)
        except (ConnectionError, ValueError, OSError):
            seen.error = "body cut short"
            self.close_connection = True
            return
        seen.body_size, seen.body_sha256 = received.size, received.sha256
        answer = rs._metadata(url.path, seen.host or "")
        if answer is not None:
            seen.status, headers, body = answer
            self._send(seen.status, body, headers=headers)
            return
        public = not rs.require_token or url.path.startswith("/public/")
        if not public:
            verdict = rs._check(seen)
            if verdict is not None:
                seen.status = 401
                if rs.challenge_metadata and rs.metadata is not None:
                    verdict += f', resource_metadata="{rs.metadata_url(seen.host or "")}"'
                self._json(401, {"error": seen.dpop_error or ("invalid_token" if seen.token else "no_token")},
                           headers=[("WWW-Authenticate", verdict), *seen.response_headers])
                return
            needed = next((scope for prefix, scope in rs.require_scope.items() if url.path.startswith(prefix)), None)
            granted = str((seen.claims or {}).get("scope", "")).split()
            if needed is not None and needed not in granted:
                seen.status = 403
                seen.error = f"scope {needed} missing"
                self._json(403, {"error": "insufficient_scope"}, headers=[
                    ("WWW-Authenticate", f'Bearer error="insufficient_scope", scope="{needed}"'
                     + (f', resource_metadata="{rs.metadata_url(seen.host or "")}"'
                        if rs.challenge_metadata and rs.metadata is not None else "")),
                    *seen.response_headers])
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
        if parts[0] == "held":
            rs.held.wait(60)
        if is_git:
            seen.status = rs._git(self, url, bytes(received.data))
        elif parts[0] == "download" and len(parts) == 2:
            seen.status = 200
            self._download(int(parts[1]), seen)
        elif parts[0] == "files" and len(parts) == 2 and parts[1] in rs.files:
            seen.status = 200
            self._send(200, rs.files[parts[1]], "application/octet-stream", headers=seen.response_headers)
        elif parts[0] == "events" and self.command == "GET":
            seen.status = 200
            self._events(rs, seen)
        elif parts[0] == "hangup" and len(parts) == 2 and rs._hang_up_once(parts[1]):
            seen.status = 0
            seen.error = "hung up"
            self.close_connection = True
        elif parts[0] == "raw" and len(parts) == 2 and parts[1] in rs.raw:
            seen.status = 0
            self.wfile.write(rs.raw[parts[1]])
            self.close_connection = True
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

    def _events(self, rs: "ResourceServer", seen: Seen):
        """Server-sent events: one chunk per event the test hands over (`rs.events.put(text)`), written the
        moment it comes; None ends the stream."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while (event := rs.events.get(timeout=30)) is not None:
                data = f"data: {event}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (queue.Empty, ConnectionError, ssl.SSLError, OSError):
            seen.error = "event stream cut short"
            self.close_connection = True

    def _download(self, size: int, seen: Seen):
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        try:
            for block in generate(size):
                self.wfile.write(block)
        except (ConnectionError, ssl.SSLError, OSError):
            # The client (the proxy) closed the connection mid-body: recorded, for the tests of cancelling.
            seen.error = "download cut short"
            self.close_connection = True


class ResourceServer:
    """See the module docstring."""

    def __init__(self, workdir: Path, hosts: list[str], label: str = "api", require_token: bool = True,
                 dpop: bool = False, audiences: dict[str, str] | None = None):
        self.workdir = workdir
        # host -> the `aud` its tokens must carry (RFC 8707): a token meant for another origin is refused.
        self.audiences = dict(audiences or {})
        self.hosts = list(hosts)
        self.require_token = require_token
        self.dpop: DPoPVerifier | None = DPoPVerifier() if dpop else None
        self.identity = ServerIdentity.make(workdir / "tls", label, self.hosts)
        self.verifier = AccessTokenVerifier()
        self.lock = threading.Lock()
        self.requests: list[Seen] = []
        self._reject = 0
        self.revoked: set[str] = set()
        self.git_root: Path | None = None
        self.files: dict[str, bytes] = {}
        # What /raw/NAME answers, byte for byte; the tags /hangup/TAG was asked for.
        self.raw: dict[str, bytes] = {}
        self._hung_up: set[str] = set()
        # What /events sends next (see _Handler._events).
        self.events: queue.Queue[str | None] = queue.Queue()
        # /held/... answers once this is set (at most after 60 s): a slow origin that has read the requests.
        self.held = threading.Event()
        # RFC 9728 metadata (see the module docstring).
        self.metadata: dict | None = None
        self.challenge_metadata = True
        self.metadata_path = "/.well-known/oauth-protected-resource"
        self.metadata_answer = None
        self.require_scope: dict[str, str] = {}
        self.server = TLSHTTPServer(_Handler, self.identity.server_context(), io_timeout=120, owner=self).start()
        self.port = self.server.port

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

    def publish_metadata(self, doc: dict, challenge: bool = True,
                         path: str = "/.well-known/oauth-protected-resource") -> None:
        """Serve `doc` as the protected resource metadata (RFC 9728) at `path`, named in every 401 when `challenge`."""
        with self.lock:
            self.metadata = doc
            self.challenge_metadata = challenge
            self.metadata_path = path

    def metadata_url(self, host: str) -> str:
        return f"https://{host}{self.metadata_path}"

    def _metadata(self, path: str, host: str):
        """(status, headers, body) for a request of the metadata document, or None for any other path."""
        if self.metadata is None and self.metadata_answer is None:
            return None
        if self.metadata_answer is not None and path.startswith("/.well-known/"):
            return self.metadata_answer(path, host)
        if path == self.metadata_path or (path.startswith(self.metadata_path + "/")
                                          and self.metadata_path == "/.well-known/oauth-protected-resource"):
            doc = json.loads(json.dumps(self.metadata).replace("{origin}", f"https://{host}"))
            return 200, [], json.dumps(doc).encode()
        if path.startswith("/.well-known/"):
            return 404, [], b'{"error": "not_found"}'
        return None

    def reject_next(self, count: int) -> None:
        """The next `count` requests with an otherwise valid token get 401 invalid_token."""
        with self.lock:
            self._reject = count

    def revoke(self, jti: str) -> None:
        with self.lock:
            self.revoked.add(jti)

    def _hang_up_once(self, tag: str) -> bool:
        with self.lock:
            first = tag not in self._hung_up
            self._hung_up.add(tag)
            return first

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
            return realm + f', error="invalid_token", error_description="{auth_param(str(error))}"'
        if self.dpop is not None and isinstance(seen.claims.get("cnf"), dict):
            # RFC 9449 §7.1: a DPoP-bound token is not accepted as a Bearer token.
            seen.error = "a DPoP-bound token sent as Bearer"
            return realm + f', error="invalid_token", error_description="{seen.error}"'
        wanted = self.audiences.get((seen.host or "").split(":")[0])
        if wanted is not None:
            audience = seen.claims.get("aud")
            audiences = audience if isinstance(audience, list) else [audience]
            if wanted not in audiences:
                seen.error = f"aud {audience!r} is not {wanted}"
                return realm + f', error="invalid_token", error_description="{auth_param(seen.error)}"'
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
            return challenge + f', error="invalid_token", error_description="{auth_param(str(error))}"'
        cnf = seen.claims.get("cnf")
        bound = cnf.get("jkt") if isinstance(cnf, dict) else None
        if bound is None:
            seen.error, seen.dpop_error = "a token without cnf.jkt sent as DPoP", "invalid_token"
            return challenge + f', error="invalid_token", error_description="{seen.error}"'
        authority = seen.host or ""
        url = f"https://{authority}{seen.path}"
        try:
            seen.proof = self.dpop.check(proofs[0], seen.method, url, authority, access_token=token, jkt=bound)
        except DPoPError as error:
            seen.error, seen.dpop_error = str(error), error.error
            if error.error == "use_dpop_nonce":
                seen.response_headers.append(("DPoP-Nonce", self.dpop.current_nonce(authority)))
            return challenge + f', error="{error.error}", error_description="{auth_param(str(error))}"'
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
        self.server.close()


def git_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment for git that reads no user or system configuration."""
    home.mkdir(parents=True, exist_ok=True)
    env = clean_env(HOME=str(home), GIT_CONFIG_NOSYSTEM="1", GIT_TERMINAL_PROMPT="0",
                    GIT_AUTHOR_NAME="Test", GIT_AUTHOR_EMAIL="test@example.test",
                    GIT_COMMITTER_NAME="Test", GIT_COMMITTER_EMAIL="test@example.test")
    env.pop("GIT_DIR", None)
    env.update(extra)
    return env


def git_available() -> bool:
    return shutil.which("git") is not None
