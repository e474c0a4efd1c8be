"""An HTTPS API that accepts one key in one header and nothing else (issue 31): the origin of the static-secret
tests.

`KeyOrigin(directory, names, header="X-API-Key", key="...")` listens on 127.0.0.1 with a leaf for `names` from a
test CA of its own (`ca_pem`, the origin's `ca_file`). A request whose `header` field is exactly `key` (compared
as given: `Bearer K`, `Basic ...`, or the bare key) gets 200 with JSON naming the method, the path and the header
field names it received (never a value: the tests search every output for the key); anything else gets 401 with
`WWW-Authenticate: Bearer`. `KeyOrigin(directory, names, shape={"CF-Access-Client-Id": ID, ...})` accepts only
that shape: each of its fields exactly once with exactly its value, and no other credential field
(`CREDENTIAL_FIELDS`), so that a pair with one field missing, doubled or joined by an `Authorization` is refused. `key` can be changed while it runs (a key that rotated); every request is recorded
(`requests`: method, path, the fields exactly as received, status) for the tests to check what the origin saw.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from fixtures.pki import ServerIdentity
from fixtures.tls_server import QuietHandler, TLSHTTPServer


@dataclass
class Received:
    method: str
    path: str
    headers: list[tuple[str, str]]
    status: int

    def values(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


# Fields that carry credentials: in shape mode a request with one the shape does not name is refused.
CREDENTIAL_FIELDS = ("authorization", "proxy-authorization", "x-api-key", "cf-access-client-id",
                     "cf-access-client-secret", "cookie")


class _Handler(QuietHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self):
        origin: KeyOrigin = self.server.owner
        self.read_body()
        headers = list(self.headers.items())
        with origin.lock:
            shape = dict(origin.shape) if origin.shape else {origin.header: origin.key}
            strict = origin.shape is not None
        ok = all([v for k, v in headers if k.lower() == name.lower()] == [value] for name, value in shape.items())
        if strict:
            named = {name.lower() for name in shape}
            ok = ok and not any(k.lower() in CREDENTIAL_FIELDS and k.lower() not in named for k, _ in headers)
        status = 200 if ok else 401
        with origin.lock:
            origin.requests.append(Received(self.command, self.path, headers, status))
        body = json.dumps({"method": self.command, "path": self.path, "authorized": ok,
                           "fields": sorted({k.lower() for k, _ in headers})}).encode() + b"\n"
        self.send_response(status)
        if not ok:
            self.send_header("WWW-Authenticate", 'Bearer error="invalid_token"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _answer


class KeyOrigin:
    def __init__(self, directory: Path, names: list[str], header: str = "", key: str = "",
                 shape: dict[str, str] | None = None):
        assert (shape is None) != (not header), "either header and key, or a shape"
        self.identity = ServerIdentity.make(directory, "key origin", names)
        self.header = header
        self.key = key
        self.shape = shape
        self.lock = threading.Lock()
        self.requests: list[Received] = []
        self.server = TLSHTTPServer(_Handler, tls=self.identity.server_context(), owner=self).start()
        self.port = self.server.port

    @property
    def ca_pem(self) -> Path:
        return self.identity.ca_pem

    def accept(self, key: str) -> None:
        """From now on only `key` is accepted (the old one expired)."""
        with self.lock:
            self.key = key

    def mark(self) -> int:
        with self.lock:
            return len(self.requests)

    def since(self, mark: int) -> list[Received]:
        with self.lock:
            return list(self.requests[mark:])

    def close(self) -> None:
        self.server.close()
