"""A WebSocket origin for the tests: the `websockets` library's asyncio server on 127.0.0.1 (TLS for wss, or
plain ws), on a thread of its own. Every upgrade needs `Authorization: Bearer <JWT>` verified against the
trusted issuer's JWKS (fixtures.jose), else 401 with WWW-Authenticate, as an API gateway refuses a WebSocket;
`reject_next(n)` refuses the next n otherwise good tokens (error="invalid_token"), `step_up_next(n)` asks for
a stronger sign-in (RFC 9470); with `metadata_servers` set, its 401s name its protected resource metadata
(RFC 9728 `resource_metadata`), served at the well-known URL with those authorization servers. Connected clients get every message echoed back; the text "bye" makes the
server close with code 1000.
"""

from __future__ import annotations

import asyncio
import http
import json
import threading
from pathlib import Path

from websockets.asyncio.server import serve
from websockets.datastructures import Headers
from websockets.http11 import Response

from fixtures.jose import AccessTokenVerifier, DPoPError, DPoPVerifier, TokenError
from fixtures.pki import ServerIdentity


class WebSocketOrigin:
    def __init__(self, workdir: Path, host: str, tls: bool = True, dpop: bool = False):
        self.host = host
        self.tls = tls
        # DPoP mode (RFC 9449 §7.1): a DPoP-bound token with one proof for GET and the upgrade's URL.
        self.dpop: DPoPVerifier | None = DPoPVerifier() if dpop else None
        self.identity = ServerIdentity.make(workdir / "tls", "ws", [host]) if tls else None
        self.verifier = AccessTokenVerifier()
        self.lock = threading.Lock()
        self.upgrades: list[dict] = []
        self._reject = 0
        self._step_up = 0
        # The authorization servers its RFC 9728 metadata names; None: no metadata and no resource_metadata.
        self.metadata_servers: list[str] | None = None
        self.metadata_fetches = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.port = 0
        self._stop: asyncio.Future | None = None
        threading.Thread(target=self._run, args=(started,), daemon=True, name=f"ws-origin-{host}").start()
        assert started.wait(10), "the WebSocket origin did not start"

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return f"{'wss' if self.tls else 'ws'}://{self.authority}{path}"

    @property
    def origin_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.authority}"

    @property
    def ca_pem(self) -> Path:
        assert self.identity is not None
        return self.identity.ca_pem

    def trust(self, issuer: str, jwks_uri: str) -> None:
        self.verifier.trust(issuer, jwks_uri)

    def reject_next(self, count: int) -> None:
        with self.lock:
            self._reject = count

    def step_up_next(self, count: int) -> None:
        with self.lock:
            self._step_up = count

    def mark(self) -> int:
        with self.lock:
            return len(self.upgrades)

    def since(self, mark: int) -> list[dict]:
        with self.lock:
            return list(self.upgrades[mark:])

    def close(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set_result, None)

    # --- the server

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve(started))

    async def _serve(self, started: threading.Event) -> None:
        context = self.identity.server_context() if self.identity else None
        self._stop = self.loop.create_future()
        async with serve(self._echo, "127.0.0.1", 0, ssl=context, process_request=self._check,
                         max_size=16 * 1024 * 1024, ping_interval=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            started.set()
            await self._stop

    def _check(self, connection, request) -> Response | None:
        if request.path.startswith("/.well-known/oauth-protected-resource") and self.metadata_servers is not None:
            with self.lock:
                self.metadata_fetches += 1
            document = json.dumps({"resource": self.origin_url,
                                   "authorization_servers": self.metadata_servers}).encode()
            return Response(200, "OK", Headers([("Content-Type", "application/json"),
                                                ("Content-Length", str(len(document)))]), document)
        authorization = request.headers.get("Authorization", "")
        scheme, _, token = authorization.partition(" ")
        record = {"path": request.path, "token": token or None, "status": 101, "sub": None,
                  "host": request.headers.get("Host")}
        with self.lock:
            self.upgrades.append(record)
        refusal = None
        extra: list[tuple[str, str]] = []
        if self.dpop is not None:
            refusal, extra = self._check_dpop(scheme, token, request, record)
        elif scheme.lower() != "bearer" or not token:
            refusal = 'Bearer realm="ws"'
        else:
            try:
                record["sub"] = self.verifier.verify(token).get("sub")
            except TokenError as error:
                refusal = f'Bearer realm="ws", error="invalid_token", error_description="{error}"'
            with self.lock:
                if refusal is None and self._step_up > 0:
                    self._step_up -= 1
                    refusal = ('Bearer realm="ws", error="insufficient_user_authentication", '
                               'error_description="a stronger sign-in is required", acr_values="urn:test:mfa"')
                elif refusal is None and self._reject > 0:
                    self._reject -= 1
                    refusal = 'Bearer realm="ws", error="invalid_token", error_description="rejected by the test"'
        if refusal is None:
            return None
        if self.metadata_servers is not None:
            refusal += f', resource_metadata="{self.origin_url}/.well-known/oauth-protected-resource"'
        record["status"] = 401
        body = b"a valid bearer token is required\n"
        headers = Headers([("WWW-Authenticate", refusal), *extra, ("Content-Type", "text/plain"),
                           ("Content-Length", str(len(body))), ("Connection", "close")])
        return Response(http.HTTPStatus.UNAUTHORIZED.value, "Unauthorized", headers, body)

    def _check_dpop(self, scheme: str, token: str, request, record: dict) -> tuple[str | None, list]:
        """The refusal of a DPoP upgrade, if any, and the fields it needs (a DPoP-Nonce challenge)."""
        challenge = 'DPoP algs="ES256"'
        proofs = request.headers.get_all("DPoP")
        record["scheme"] = scheme.lower()
        if scheme.lower() != "dpop" or not token or len(proofs) != 1:
            return challenge, []
        try:
            claims = self.verifier.verify(token)
        except TokenError as error:
            return challenge + f', error="invalid_token", error_description="{error}"', []
        jkt = (claims.get("cnf") or {}).get("jkt")
        authority = request.headers.get("Host", "")
        url = f"https://{authority}{request.path.split('?')[0]}"
        try:
            proof = self.dpop.check(proofs[0], "GET", url, authority, access_token=token, jkt=jkt)
        except DPoPError as error:
            extra = [("DPoP-Nonce", self.dpop.current_nonce(authority))] if error.error == "use_dpop_nonce" else []
            return challenge + f', error="{error.error}", error_description="{error}"', extra
        record["sub"] = claims.get("sub")
        record["proof_htm"] = proof.claims.get("htm")
        record["proof_nonce"] = proof.nonce
        return None, []

    async def _echo(self, websocket) -> None:
        async for message in websocket:
            if message == "bye":
                await websocket.close(1000, "bye")
                return
            await websocket.send(message)
