"""A gRPC origin for the tests: grpcio's server (gRPC's C core) over TLS on 127.0.0.1, with a generic service
`test.Echo` whose messages are raw bytes (no generated code):

    Unary(bytes) -> bytes               a JSON object: the request's size and SHA-256, the token's sub
    Download(8-byte count) -> stream    that many messages of 16 KiB
    Upload(stream bytes) -> bytes       a JSON object: how many messages, their total size and SHA-256
    Chat(stream) -> stream              each message back, reversed

Every call needs `authorization: Bearer <JWT>` verified against the trusted issuer's JWKS (fixtures.jose);
otherwise it ends with status UNAUTHENTICATED (16) and a `www-authenticate` trailer, as gRPC servers refuse a
credential. `reject_next(n)` refuses the next n calls' otherwise good tokens the same way (a revoked token).
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from concurrent import futures
from pathlib import Path

import grpc

from fixtures.jose import AccessTokenVerifier, TokenError
from fixtures.pki import ServerIdentity

SERVICE = "test.Echo"
CHUNK = 16 * 1024


class GrpcOrigin:
    def __init__(self, workdir: Path, host: str):
        self.host = host
        self.identity = ServerIdentity.make(workdir / "tls", "grpc", [host])
        self.verifier = AccessTokenVerifier()
        self.lock = threading.Lock()
        self.calls: list[dict] = []
        self._reject = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(self._unary),
            "Download": grpc.unary_stream_rpc_method_handler(self._download),
            "Upload": grpc.stream_unary_rpc_method_handler(self._upload),
            "Chat": grpc.stream_stream_rpc_method_handler(self._chat),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        credentials = grpc.ssl_server_credentials(
            [(self.identity.key_pem.read_bytes(), self.identity.cert_pem.read_bytes())])
        self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.server.start()

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def ca_pem(self) -> Path:
        return self.identity.ca_pem

    def trust(self, issuer: str, jwks_uri: str) -> None:
        self.verifier.trust(issuer, jwks_uri)

    def reject_next(self, count: int) -> None:
        with self.lock:
            self._reject = count

    def mark(self) -> int:
        with self.lock:
            return len(self.calls)

    def since(self, mark: int) -> list[dict]:
        with self.lock:
            return list(self.calls[mark:])

    def close(self) -> None:
        self.server.stop(0)

    # --- the service

    def _authorize(self, context: grpc.ServicerContext, method: str) -> dict | None:
        metadata = dict(context.invocation_metadata())
        authorization = metadata.get("authorization", "")
        call = {"method": method, "token": None, "status": "OK"}
        with self.lock:
            self.calls.append(call)
        scheme, _, token = authorization.partition(" ")
        refusal = None
        claims = None
        if scheme.lower() != "bearer" or not token:
            refusal = 'Bearer realm="grpc"'
        else:
            call["token"] = token
            try:
                claims = self.verifier.verify(token)
            except TokenError as error:
                refusal = f'Bearer realm="grpc", error="invalid_token", error_description="{error}"'
            with self.lock:
                if refusal is None and self._reject > 0:
                    self._reject -= 1
                    refusal = 'Bearer realm="grpc", error="invalid_token", error_description="rejected by the test"'
        if refusal is not None:
            call["status"] = "UNAUTHENTICATED"
            context.set_trailing_metadata((("www-authenticate", refusal),))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")
        return claims

    def _unary(self, request: bytes, context) -> bytes:
        claims = self._authorize(context, "Unary")
        return json.dumps({"size": len(request), "sha256": hashlib.sha256(request).hexdigest(),
                           "sub": claims.get("sub")}).encode()

    def _download(self, request: bytes, context):
        self._authorize(context, "Download")
        (count,) = struct.unpack(">Q", request)
        for index in range(count):
            yield bytes([index % 251]) * CHUNK

    def _upload(self, requests, context) -> bytes:
        self._authorize(context, "Upload")
        digest, count, total = hashlib.sha256(), 0, 0
        for message in requests:
            digest.update(message)
            count += 1
            total += len(message)
        return json.dumps({"count": count, "size": total, "sha256": digest.hexdigest()}).encode()

    def _chat(self, requests, context):
        self._authorize(context, "Chat")
        for message in requests:
            yield message[::-1]
