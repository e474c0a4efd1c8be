#!/usr/bin/env python3
"""Soak test: mutated request streams against a running (AddressSanitizer) `proxyctl serve` for N minutes.

Run it through scripts/soak, which installs the test dependencies, builds the ASan binary and calls this
with the venv's python. Everything runs in a private network namespace with only a loopback interface
(this script re-executes itself under `unshare --net`): a mutated host name or address can make the proxy
resolve or connect anywhere, and in the namespace that can only fail.

What runs, all on 127.0.0.1: a plain HTTP origin, an HTTPS origin reached by blind CONNECT, a raw echo
origin (with canned odd responses: 101, 103, broken framing, short bodies), a silent origin that accepts and
never answers (504), the fake OpenID provider, a ResourceServer as the protected https origin api.test
(mapped by `resolve`; it verifies every token) and a protected http:// loopback origin. A workspace gets
`proxyctl ca init` and `proxyctl login` against the fake, then `proxyctl serve` runs with short timers
(header 5 s, idle 10 s, keep-alive 2 s) so that every timer fires many times during the soak.

Then, until the time is up:
  workers   each opens one client connection per stream: a seed (a valid request sequence covering one
            connection path: keep-alive, pipelining, GET then CONNECT, host switches, TLS tunnels,
            intercepted TLS with requests inside, Upgrade, Expect: 100-continue, bodies cut short, answers
            of the proxy's own), mutated or not (byte flips, inserted CR/LF/NUL/obs-text/huge numbers,
            deleted and duplicated ranges, Content-Length and chunk sizes replaced, header lines duplicated,
            truncation; inside intercepted TLS the plaintext is mutated), sent in random pieces with small
            pauses, and ended by a clean close, a half-close, an RST or a stall. All random choices come
            from --seed, the worker number and the stream number.
  liveness  every second a plain GET and an intercepted GET (the token must reach the resource server,
            which verifies it) must be answered within LIVENESS_DEADLINE seconds.
  memory    RSS and descriptors are sampled every SAMPLE_INTERVAL seconds.

The verdict fails on: a sanitizer report or crash, the proxy exiting, any liveness failure, RSS growing by
more than --rss-growth-mib after the warm-up (the first WARMUP_SHARE of the run), descriptors that do not
settle back once the workers stop, connections still open at SIGTERM (only the grace period ends them), or
SIGTERM not ending the proxy with 0 within its shutdown_grace. The
last STREAMS_KEPT streams of each worker are written to the work directory on failure (`--replay DIR`
sends them again to a fresh proxy).

Why ASAN_OPTIONS quarantine_size_mb=64: AddressSanitizer holds freed memory in a quarantine (256 MiB by
default) to catch uses after free. Until it is full, RSS grows with every free, which would look like a
leak for the first minutes of a run. 64 MiB still catches a use shortly after a free and fills within the
warm-up, after which RSS measures what proxyctl keeps.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import dataclasses
import fcntl
import itertools
import json
import os
import random
import re
import select
import shutil
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "Tests" / "integration"))

from fixtures import config  # noqa: E402
from fixtures.http import Reader, connect, open_tunnel, reset_close  # noqa: E402
from fixtures.origins import EchoOrigin, Origin  # noqa: E402
from fixtures.pki import ServerIdentity  # noqa: E402
from fixtures.proxy import Proxy, clean_env, poll, proxyctl_bin  # noqa: E402
from idp_fake import FakeIdP  # noqa: E402
from resource_server import ResourceServer  # noqa: E402

MiB = 1 << 20
ASAN_OPTIONS = "detect_leaks=0:halt_on_error=1:quarantine_size_mb=64"
WARMUP_SHARE = 0.2           # share of the run before RSS is taken as the reference
SAMPLE_INTERVAL = 2.0        # seconds between RSS and descriptor samples
LIVENESS_INTERVAL = 1.0      # seconds between liveness rounds
LIVENESS_DEADLINE = 5.0      # seconds a liveness request may take
STREAM_DEADLINE = 25.0       # hard limit on one stream, pauses included
READ_LIMIT = 4 * MiB         # bytes a stream reads before it stops reading
STREAMS_KEPT = 6             # recent streams kept per worker for reproduction
SHUTDOWN_GRACE = 3.0         # the proxy's shutdown_grace
TOKEN_LIFETIME = 90          # seconds an access token lasts: refreshes happen under load
API_HOST = "api.test"        # the protected https origin (the ResourceServer)
SUBJECT = "alice-0001"       # the fake provider's subject, which the resource server echoes for a good token
TUNNEL_OK = b"HTTP/1.1 200 Connection established\r\n\r\n"
# A status line wherever it starts: a response may follow a body that does not end in a line break.
STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3})[ \r]")
# What a valid stream may be answered (1xx, 101, success); seeds that expect more add to it.
SUCCESS = frozenset({100, 101, 103, 200, 204})
IN_TUNNEL = SUCCESS | {501}  # the HTTPS origin behind a blind tunnel has no HEAD


# MARK: - Isolation


def in_private_network() -> bool:
    """Whether this process sees no network interface but loopback."""
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return [line.split(":")[0].strip() for line in lines] == ["lo"]


def loopback_up() -> None:
    """Brings `lo` up (a new network namespace starts with it down), with the SIOCSIFFLAGS ioctl."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def isolate() -> None:
    """Re-executes this script in a new network namespace (loopback only), or brings its loopback up."""
    if not in_private_network():
        if os.environ.get("SOAK_NETNS") == "1":
            sys.exit("soak: still seeing other network interfaces inside `unshare --net`; refusing to run")
        unshare = shutil.which("unshare")
        if unshare is None:
            sys.exit("soak: `unshare` (util-linux) is needed to run in a loopback-only network namespace")
        os.environ["SOAK_NETNS"] = "1"
        os.execv(unshare, [unshare, "--net", "--", sys.executable, *sys.argv])
    loopback_up()


# MARK: - Fixtures


class SilentOrigin:
    """Accepts connections and reads them, never answering: the proxy's response timer must give 504."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._drain, args=(sock,), daemon=True).start()

    @staticmethod
    def _drain(sock: socket.socket) -> None:
        sock.settimeout(60)
        with sock:
            try:
                while sock.recv(65536):
                    pass
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


# Raw responses of the echo origin, by a token in the request target: the odd things origins send.
CANNED: dict[str, tuple[bytes, bool]] = {
    "/canned/early-hints": (b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"
                            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
    "/canned/double-length": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok", True),
    "/canned/bad-chunk": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n", True),
    "/canned/short-body": (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this much", True),
    "/canned/until-close": (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nthe body ends at the close", True),
    "/canned/extra-bytes": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n\r\n", False),
    "/canned/huge-length": (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\nx", True),
    "/canned/garbage": (b"SSH-2.0-not-http\r\n\r\n", True),
    "/canned/no-content-body": (b"HTTP/1.1 204 No Content\r\nContent-Length: 4\r\n\r\nbody", False),
    "/canned/upgrade": (b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
                        False),
}


@dataclasses.dataclass(frozen=True)
class Ports:
    """Where everything listens. Streams name these ports; a replay maps a saved run's ports to these."""

    proxy: int
    http: int             # plain HTTP origin
    https: int            # HTTPS origin, blind tunnel
    echo: int             # raw echo origin
    silent: int           # accepts, never answers
    closed: int           # nothing listens
    protected_http: int   # protected http:// loopback origin
    api: int              # ResourceServer (api.test), protected https origin
    idp: int              # the fake OpenID provider


class Deployment:
    """The origins, the fake provider, the resource server, a signed-in workspace and `proxyctl serve`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.cert = ServerIdentity.make(workdir / "origin-tls", "origin", ["localhost", "127.0.0.1"])
        self.http = Origin()
        self.https = Origin(self.cert.server_context())
        self.protected_http = Origin()
        self.echo = EchoOrigin()
        for token, (response, close) in CANNED.items():
            self.echo.respond(token, response, close)
        self.silent = SilentOrigin()
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        self.closed_port = closed.getsockname()[1]
        closed.close()
        # Access tokens last 90 s: the proxy refreshes them several times under load.
        self.idp = FakeIdP(access_token_format="jwt", expires_in=TOKEN_LIFETIME).start()
        self.rs = ResourceServer(workdir / "rs", [API_HOST])
        self.rs.trust(self.idp.issuer, self.idp.url("jwks"))
        self.state = workdir / "state"
        self.proxy = Proxy(workdir / "proxy", self._config())
        self.ca_pem = self.state / "ca" / "ca.pem"

    def _config(self) -> str:
        resolve = ", ".join(f"{host}=127.0.0.1" for host in (API_HOST, "origin-a.test", "origin-b.test"))
        head = config.proxy(
            log_level="info", state_dir=str(self.state), resolve=resolve, connect_timeout="3s",
            header_timeout="5s", idle_timeout="10s", keepalive_timeout="2s", shutdown_grace=f"{SHUTDOWN_GRACE:g}s",
            # Bodies above 64 KiB to a protected origin go to a spool file: that path runs too.
            replay_memory="64KiB", replay_spool="1MiB")
        return (head + f"\n[provider fake]\nissuer = {self.idp.issuer}\nclient_id = proxyctl-test\n"
                "scopes = openid profile email\nredirect_port = 0\n"
                f"\n[origin https://{API_HOST}:{self.rs.port}]\nprovider = fake\nclient_authorization = keep\n"
                f"ca_file = {self.rs.ca_pem}\n"
                f"\n[origin http://127.0.0.1:{self.protected_http.port}]\nprovider = fake\n"
                "client_authorization = replace\n")

    def _cli(self, *args: str, **env: str) -> None:
        home = self.workdir / "cli-home"
        home.mkdir(exist_ok=True)
        full = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"))
        for name in ("PROXYCTL_CONFIG", "BROWSER", "DISPLAY"):
            full.pop(name, None)
        full.update(env)
        done = subprocess.run([proxyctl_bin(), *args, "--config", str(self.proxy.config_path)],
                              capture_output=True, text=True, timeout=120, env=full, cwd=self.workdir,
                              stdin=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"proxyctl {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")

    def start(self) -> Ports:
        """CA, sign-in, then the proxy."""
        self._cli("ca", "init")
        browser = f"{sys.executable} {REPO / 'Tests' / 'integration' / 'browser.py'}"
        self._cli("login", "fake", BROWSER=browser, PROXYCTL_TEST_BROWSER="fake")
        self.proxy.start(timeout=60)
        return Ports(proxy=self.proxy.port, http=self.http.port, https=self.https.port, echo=self.echo.port,
                     silent=self.silent.port, closed=self.closed_port, protected_http=self.protected_http.port,
                     api=self.rs.port, idp=self.idp.port)

    def intercept_context(self) -> ssl.SSLContext:
        """A client context that trusts only the proxy's local CA (what `proxyctl env` hands to clients)."""
        return ssl.create_default_context(cafile=str(self.ca_pem))

    def close(self) -> None:
        if self.proxy.process is not None and self.proxy.process.poll() is None:
            self.proxy.process.kill()
            self.proxy.process.wait(10)
        for server in (self.http, self.https, self.protected_http, self.echo, self.silent, self.rs):
            server.close()
        self.idp.stop()


# MARK: - Streams: what a client sends on one connection


@dataclasses.dataclass
class Part:
    """Bytes to send, then up to `wait` seconds for the answer (until it goes quiet), before the next part."""

    data: bytes
    wait: float = 0.0


@dataclasses.dataclass
class Seed:
    """A valid request sequence on one connection. `tls`: None, "origin" (TLS to the HTTPS origin through a
    blind tunnel) or "intercept" (TLS with the proxy's local CA); `inner` is sent inside that TLS once the
    proxy answered the CONNECT in `outer`. `ending` forces how the stream ends (else it is drawn). `patience`:
    the seconds of quiet that end the reading (else drawn); `expected`: the statuses it may get unmutated."""

    name: str
    outer: list[Part]
    requests: int
    tls: str | None = None
    inner: list[Part] = dataclasses.field(default_factory=list)
    patience: float | None = None
    ending: str | None = None
    expected: frozenset[int] | None = SUCCESS  # statuses a valid stream may see (None: any)


def request(method: str, target: str, host: str, fields: Iterable[str] = (), *, body: bytes | None = None,
            chunks: list[bytes] | None = None, trailers: Iterable[str] = (), version: str = "HTTP/1.1") -> bytes:
    """One request, framed by Content-Length (`body`) or chunked (`chunks`, with trailers), or bodiless."""
    lines = [f"{method} {target} {version}", f"Host: {host}", *fields]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    if chunks is not None:
        lines.append("Transfer-Encoding: chunked")
    out = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    if body is not None:
        out += body
    if chunks is not None:
        for index, chunk in enumerate(chunks):
            extension = b";ext=%d" % index if index % 2 else b""
            out += b"%x%s\r\n%s\r\n" % (len(chunk), extension, chunk)
        out += b"0\r\n" + b"".join(t.encode("latin-1") + b"\r\n" for t in trailers) + b"\r\n"
    return out


class Seeds:
    """The seed streams, built for the current ports with a stream's own random generator."""

    def __init__(self, ports: Ports) -> None:
        self.p = ports
        self.http = f"127.0.0.1:{ports.http}"
        self.echo = f"127.0.0.1:{ports.echo}"
        self.api = f"{API_HOST}:{ports.api}"
        self.protected = f"127.0.0.1:{ports.protected_http}"
        self.builders: list[tuple[int, Callable[[random.Random], Seed]]] = [
            (6, self.keepalive), (2, self.head_then_get), (4, self.post), (4, self.pipelined),
            (6, self.get_then_connect_tls), (3, self.pipelined_get_connect_tls), (2, self.get_then_refused_connect),
            (3, self.get_then_connect_raw), (4, self.switch_hosts), (3, self.tunnel_tls), (10, self.intercepted),
            (4, self.intercepted_http), (3, self.upgrade), (2, self.expect_continue), (4, self.cut_short),
            (6, self.proxy_answers), (4, self.odd_responses), (2, self.http10),
        ]

    def draw(self, rng: random.Random) -> Seed:
        weights = [weight for weight, _ in self.builders]
        builder = rng.choices([b for _, b in self.builders], weights)[0]
        return builder(rng)

    # Building blocks

    def _body(self, rng: random.Random, sizes: tuple[int, ...] = (0, 1, 17, 1000, 5000, 70000)) -> bytes:
        size = rng.choice(sizes)
        return (b"soak-body-" * (size // 10 + 1))[:size]

    def _plain_request(self, rng: random.Random, authority: str | None = None) -> bytes:
        """A random valid request in absolute form to the plain HTTP origin (HEAD: to the echo origin)."""
        authority = authority or self.http
        kind = rng.choice(["get", "get", "gen", "head", "post", "chunked"])
        path = f"/k/{rng.randrange(10**6)}"
        if kind == "get":
            return request("GET", f"http://{authority}{path}?q={rng.randrange(100)}", authority,
                           ["Accept: */*", "User-Agent: soak"])
        if kind == "gen":
            size = rng.choice([0, 10, 1000, 65536, 300000])
            query = rng.choice(["", "?chunked=1"])
            return request("GET", f"http://{authority}/gen/{size}{query}", authority)
        if kind == "head":
            # The HTTP origin has no HEAD; the echo origin answers HEAD with a body, which the proxy must drop.
            return request("HEAD", f"http://{self.echo}{path}", self.echo)
        if kind == "post":
            return request("POST", f"http://{authority}/upload", authority, ["Content-Type: application/octet-stream"],
                           body=self._body(rng))
        chunks = [self._body(rng, (1, 10, 100, 4000)) for _ in range(rng.randint(1, 4))]
        return request("POST", f"http://{authority}/upload", authority, ["Trailer: X-Sum"], chunks=chunks,
                       trailers=["X-Sum: 1234"])

    def _origin_form(self, rng: random.Random, host: str, allow_upgrade: bool = False) -> bytes:
        """A random valid request in origin form, for inside a tunnel or an intercepted TLS session."""
        kind = rng.choice(["get", "get", "head", "post", "chunked", "download", "expect", "auth"]
                          + (["upgrade", "misdirected"] if allow_upgrade else []))
        path = f"/anything/{rng.randrange(10**6)}"
        if kind == "get":
            return request("GET", f"{path}?x={rng.randrange(99)}", host, ["Accept: application/json"])
        if kind == "head":
            return request("HEAD", path, host)
        if kind == "post":
            return request("POST", path, host, ["Content-Type: application/octet-stream"],
                           body=self._body(rng, (0, 10, 3000, 70000, 120000)))
        if kind == "chunked":
            chunks = [self._body(rng, (1, 10, 1000, 20000)) for _ in range(rng.randint(1, 4))]
            return request("PUT", path, host, ["Trailer: X-Sum"], chunks=chunks, trailers=["X-Sum: 99"])
        if kind == "download":
            return request("GET", f"/download/{rng.choice([0, 100, 70000, 500000])}", host)
        if kind == "expect":
            return request("POST", path, host, ["Expect: 100-continue"], body=self._body(rng, (10, 5000)))
        if kind == "auth":
            return request("GET", path, host, ["Authorization: Bearer not-a-real-token"])
        if kind == "upgrade":
            return request("GET", path, host, ["Connection: Upgrade", "Upgrade: websocket"])
        return request("GET", path, "elsewhere.test")

    # Seeds

    def keepalive(self, rng: random.Random) -> Seed:
        count = rng.randint(1, 4)
        return Seed("keepalive", [Part(self._plain_request(rng), 1.0) for _ in range(count)], count)

    def head_then_get(self, rng: random.Random) -> Seed:
        path = f"/h/{rng.randrange(1000)}"
        return Seed("head-then-get", [Part(request("HEAD", f"http://{self.echo}{path}", self.echo), 1.0),
                                      Part(request("GET", f"http://{self.http}{path}", self.http), 1.0)], 2)

    def post(self, rng: random.Random) -> Seed:
        chunks = [self._body(rng, (1, 100, 8000)) for _ in range(rng.randint(1, 5))]
        framed = rng.choice([
            request("POST", f"http://{self.http}/upload", self.http, body=self._body(rng)),
            request("POST", f"http://{self.http}/upload", self.http, ["Trailer: X-A, X-B"], chunks=chunks,
                    trailers=["X-A: 1", "X-B: two words"]),
        ])
        return Seed("post", [Part(framed, 1.0)], 1)

    def pipelined(self, rng: random.Random) -> Seed:
        count = rng.randint(2, 5)
        return Seed("pipelined", [Part(b"".join(self._plain_request(rng) for _ in range(count)), 2.0)], count)

    def _connect(self, authority: str) -> bytes:
        return request("CONNECT", authority, authority)

    def get_then_connect_tls(self, rng: random.Random) -> Seed:
        """The use-after-free of e5df87c: a kept-alive upstream, then a CONNECT on the same connection."""
        target = f"localhost:{self.p.https}"
        inner = [Part(self._origin_form(rng, target), 1.0) for _ in range(rng.randint(1, 3))]
        return Seed("get-then-connect-tls", [Part(self._plain_request(rng), 1.0), Part(self._connect(target))],
                    1 + len(inner), tls="origin", inner=inner, expected=IN_TUNNEL)

    def pipelined_get_connect_tls(self, rng: random.Random) -> Seed:
        target = f"localhost:{self.p.https}"
        return Seed("pipelined-get-connect-tls", [Part(self._plain_request(rng) + self._connect(target))], 2,
                    tls="origin", inner=[Part(self._origin_form(rng, target), 1.0)], expected=IN_TUNNEL)

    def get_then_refused_connect(self, rng: random.Random) -> Seed:
        return Seed("get-then-refused-connect", [Part(self._plain_request(rng), 1.0),
                                                 Part(self._connect(f"127.0.0.1:{self.p.closed}"), 1.0)], 2,
                    expected=SUCCESS | {502})

    def get_then_connect_raw(self, rng: random.Random) -> Seed:
        """GET, then a tunnel to the echo origin with plain HTTP inside (so mutations reach the tunnel)."""
        inside = b"".join(request("GET", f"/in-tunnel/{i}", self.echo) for i in range(rng.randint(1, 3)))
        return Seed("get-then-connect-raw", [Part(self._plain_request(rng), 1.0), Part(self._connect(self.echo), 1.0),
                                             Part(inside, 1.0)], 3)

    def switch_hosts(self, rng: random.Random) -> Seed:
        a, b = f"origin-a.test:{self.p.http}", f"origin-b.test:{self.p.echo}"
        wait = rng.choice([0.0, 1.0])
        parts = [Part(request("GET", f"http://{a}/host-a", a), wait),
                 Part(request("GET", f"http://{b}/host-b", b), wait), Part(self._plain_request(rng, a), wait)]
        if rng.random() < 0.5:
            parts.append(Part(request("GET", f"http://{self.protected}/protected", self.protected), wait))
        return Seed("switch-hosts", parts, len(parts))

    def tunnel_tls(self, rng: random.Random) -> Seed:
        target = f"localhost:{self.p.https}"
        count = rng.randint(1, 4)
        pipelined = rng.random() < 0.3
        if pipelined:
            inner = [Part(b"".join(self._origin_form(rng, target) for _ in range(count)), 1.0)]
        else:
            inner = [Part(self._origin_form(rng, target), 1.0) for _ in range(count)]
        return Seed("tunnel-tls", [Part(self._connect(target))], 1 + count, tls="origin", inner=inner,
                    expected=IN_TUNNEL)

    def intercepted(self, rng: random.Random) -> Seed:
        """CONNECT to the protected origin, TLS with the local CA, requests inside (token attached)."""
        count = rng.randint(1, 4)
        if rng.random() < 0.3:
            inner = [Part(b"".join(self._origin_form(rng, self.api, True) for _ in range(count)), 2.0)]
        else:
            inner = []
            for _ in range(count):
                data = self._origin_form(rng, self.api, True)
                if b"Expect: 100-continue" in data:
                    head, _, body = data.partition(b"\r\n\r\n")
                    inner += [Part(head + b"\r\n\r\n", 0.5), Part(body, 1.5)]
                else:
                    inner.append(Part(data, 1.5))
        # 401: the client's own Authorization is kept (and refused); 421: another Host; 501: an Upgrade.
        return Seed("intercepted", [Part(self._connect(self.api))], 1 + count, tls="intercept", inner=inner,
                    expected=SUCCESS | {401, 421, 501},
                    )

    def intercepted_http(self, rng: random.Random) -> Seed:
        """The protected http:// origin (token attached in the clear on loopback), mixed on one connection
        with plain requests and a CONNECT afterwards."""
        wait = rng.choice([0.0, 1.5])
        parts = [Part(request("GET", f"http://{self.protected}/p/{rng.randrange(100)}", self.protected), wait),
                 Part(request("POST", f"http://{self.protected}/upload", self.protected, body=self._body(rng)), wait)]
        if rng.random() < 0.5:
            parts.append(Part(self._plain_request(rng), wait))
        if rng.random() < 0.5:
            parts.append(Part(self._connect(self.echo), 1.0))
            parts.append(Part(request("GET", "/after-protected", self.echo), 1.0))
        return Seed("intercepted-http", parts, len(parts))

    def upgrade(self, rng: random.Random) -> Seed:
        """Upgrade: the echo origin switches protocols (the proxy then splices), the HTTP origin does not."""
        if rng.random() < 0.6:
            head = request("GET", f"http://{self.echo}/canned/upgrade", self.echo,
                           ["Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13"])
            return Seed("upgrade", [Part(head, 1.0), Part(request("GET", "/after-upgrade", self.echo), 1.0)], 2)
        head = request("GET", f"http://{self.http}/no-upgrade", self.http, ["Connection: Upgrade", "Upgrade: h2c"])
        return Seed("upgrade-refused", [Part(head, 1.0), Part(self._plain_request(rng), 1.0)], 2)

    def expect_continue(self, rng: random.Random) -> Seed:
        body = self._body(rng, (10, 5000, 70000))
        head = request("POST", f"http://{self.http}/upload", self.http, ["Expect: 100-continue"], body=body)
        head, _, body = head.partition(b"\r\n\r\n")
        return Seed("expect-continue", [Part(head + b"\r\n\r\n", rng.choice([0.0, 1.0])), Part(body, 1.0)], 1)

    def cut_short(self, rng: random.Random) -> Seed:
        """The client goes away mid-request-body, or mid-response, or mid-TLS-request."""
        kind = rng.choice(["request-body", "chunked-body", "response", "slow-response", "intercepted-body",
                           "intercepted-download"])
        if kind == "request-body":
            data = request("POST", f"http://{self.http}/upload", self.http, body=self._body(rng, (5000, 70000)))
            return Seed("cut-request-body", [Part(data[:rng.randrange(len(data) // 2, len(data))])], 1,
                        ending=rng.choice(["close", "reset", "half-close"]), patience=0.3, expected=None)
        if kind == "chunked-body":
            data = request("POST", f"http://{self.http}/upload", self.http, chunks=[b"a" * 3000, b"b" * 3000])
            return Seed("cut-chunked-body", [Part(data[:rng.randrange(100, len(data) - 3)])], 1,
                        ending=rng.choice(["close", "reset", "half-close"]), patience=0.3, expected=None)
        if kind == "response":
            data = request("GET", f"http://{self.http}/gen/{rng.choice([2 * MiB, 8 * MiB])}", self.http)
            return Seed("cut-response", [Part(data, rng.choice([0.05, 0.3]))], 1,
                        ending=rng.choice(["close", "reset", "stall"]), patience=0.0, expected=None)
        if kind == "slow-response":
            data = request("GET", f"http://{self.http}/slow/200000?seconds=3", self.http)
            return Seed("cut-slow-response", [Part(data, rng.choice([0.2, 1.0]))], 1,
                        ending=rng.choice(["close", "reset"]), patience=0.0, expected=None)
        if kind == "intercepted-download":
            # Larger than the client reads: the proxy holds the transfer back (backpressure) when it goes away.
            data = request("GET", f"/download/{rng.choice([3 * MiB, 10**12])}", self.api)
            return Seed("cut-intercepted-download", [Part(self._connect(self.api))], 2, tls="intercept",
                        inner=[Part(data, rng.choice([0.05, 0.3]))], ending=rng.choice(["close", "reset", "stall"]),
                        patience=0.0, expected=None)
        data = request("POST", "/anything/cut", self.api, body=self._body(rng, (5000, 120000)))
        return Seed("cut-intercepted-body", [Part(self._connect(self.api))], 1, tls="intercept",
                    inner=[Part(data[:rng.randrange(len(data) // 2, len(data))])],
                    ending=rng.choice(["close", "reset", "half-close"]), patience=0.3, expected=None)

    def proxy_answers(self, rng: random.Random) -> Seed:
        """Requests the proxy answers itself: 400, 408, 414, 431, 502, 504, 508."""
        kind = rng.choice(["400-garbage", "400-origin-form", "400-https", "408", "414", "431-count", "431-size",
                           "502-refused", "502-connect-refused", "502-dns", "504", "508"])
        http, answers = self.http, {
            "400-garbage": b"GARBAGE\r\n\r\n",
            "400-origin-form": request("GET", "/", "127.0.0.1"),
            "400-https": request("GET", f"https://{self.http}/", self.http),
            "414": request("GET", f"http://{self.http}/{'x' * 9000}", self.http),
            "431-count": request("GET", f"http://{self.http}/many", self.http, [f"X-F{i}: {i}" for i in range(120)]),
            "431-size": request("GET", f"http://{self.http}/big", self.http, ["X-Big: " + "y" * 70000]),
            "502-refused": request("GET", f"http://127.0.0.1:{self.p.closed}/", f"127.0.0.1:{self.p.closed}"),
            "502-connect-refused": self._connect(f"127.0.0.1:{self.p.closed}"),
            "502-dns": request("GET", "http://nowhere.invalid/", "nowhere.invalid"),
            "504": request("GET", f"http://127.0.0.1:{self.p.silent}/", f"127.0.0.1:{self.p.silent}"),
            "508": self._connect(f"127.0.0.1:{self.p.proxy}"),
        }
        if kind == "408":
            return Seed("proxy-408", [Part(f"GET http://{http}/partial HTTP/1.1\r\nHost: {http}\r\n".encode())], 1,
                        patience=7.0, expected=frozenset({408}))
        patience = 12.0 if kind == "504" else None  # 504: past idle_timeout (10 s)
        parts = [Part(answers[kind], 1.0)]
        if rng.random() < 0.5:
            parts.append(Part(self._plain_request(rng), 1.0))  # after a keep-alive answer, or refused
        return Seed(f"proxy-{kind}", parts, len(parts), patience=patience, expected=SUCCESS | {int(kind[:3])})

    def odd_responses(self, rng: random.Random) -> Seed:
        """Origins that answer oddly (1xx, broken framing, short bodies, bytes after the end)."""
        names = [name for name in CANNED if name != "/canned/upgrade"]
        count = rng.randint(1, 3)
        parts = [Part(request("GET", f"http://{self.echo}{rng.choice(names)}", self.echo), 1.0) for _ in range(count)]
        return Seed("odd-responses", parts, count, expected=SUCCESS | {502})

    def http10(self, rng: random.Random) -> Seed:
        fields = rng.choice([[], ["Connection: keep-alive"]])
        parts = [Part(request("GET", f"http://{self.http}/ten/{i}", self.http, fields, version="HTTP/1.0"), 1.0)
                 for i in range(2)]
        return Seed("http10", parts, 2)


# MARK: - Mutations


class Mutator:
    """Byte-level mutations of one request stream, every choice drawn from the stream's generator."""

    INTERESTING = [b"\r", b"\n", b"\r\n", b"\x00", b":", b" ", b"\t", b"\x7f", b"\x80", b"\xff", b"\xe9", b";",
                   b",", b'"', b"\r\n\r\n", b"\r\n ", b"99999999999999999999", b"-1", b"0x", b"%00",
                   b"Transfer-Encoding: chunked\r\n", b"Content-Length: 5\r\n", b"Connection: close\r\n"]
    NUMBERS = [b"0", b"-1", b"+5", b"-0", b"9223372036854775807", b"9223372036854775808",
               b"18446744073709551615", b"18446744073709551616", b"ffffffffffffffff", b"0x10", b"1e3", b" 7",
               b"7 7", b"", b"000000000000000000000000000000007", b"zz", b"1_0", b"\xb9"]
    CONTENT_LENGTH = re.compile(rb"(?i)content-length:[ \t]*(\d+)")
    CHUNK_SIZE = re.compile(rb"\r\n([0-9a-fA-F]+)(?:;[^\r\n]*)?\r\n")
    DIGITS = re.compile(rb"\d+")
    FIELD_LINE = re.compile(rb"\r\n([!#-'*+.0-9A-Z^-z|~-]+:[^\r\n]*)")

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.operations: list[Callable[[bytes], tuple[bytes, str]]] = [
            self.flip, self.flip, self.insert, self.insert, self.delete, self.duplicate, self.number, self.number,
            self.field, self.truncate]

    def mutate(self, data: bytes) -> tuple[bytes, str]:
        """One mutation of `data`, and its description."""
        if not data:
            return self.insert(data)
        return self.rng.choice(self.operations)(data)

    def flip(self, data: bytes) -> tuple[bytes, str]:
        at = self.rng.randrange(len(data))
        value = data[at] ^ (1 << self.rng.randrange(8)) if self.rng.random() < 0.7 else self.rng.randrange(256)
        return data[:at] + bytes([value]) + data[at + 1:], f"flip {at}: {data[at]:#04x}->{value:#04x}"

    def insert(self, data: bytes) -> tuple[bytes, str]:
        at = self.rng.randrange(len(data) + 1)
        token = self.rng.choice(self.INTERESTING) if self.rng.random() < 0.8 else self.rng.randbytes(
            self.rng.randint(1, 8))
        return data[:at] + token + data[at:], f"insert {token!r} at {at}"

    def delete(self, data: bytes) -> tuple[bytes, str]:
        at = self.rng.randrange(len(data))
        count = self.rng.randint(1, max(1, min(64, (len(data) - at))))
        return data[:at] + data[at + count:], f"delete {count} at {at}"

    def duplicate(self, data: bytes) -> tuple[bytes, str]:
        at = self.rng.randrange(len(data))
        count = self.rng.randint(1, max(1, min(256, len(data) - at)))
        to = self.rng.randrange(len(data) + 1)
        return data[:to] + data[at:at + count] + data[to:], f"duplicate {count} from {at} to {to}"

    def number(self, data: bytes) -> tuple[bytes, str]:
        """Replaces a Content-Length value, a chunk size or (less often) any other number."""
        spots = [m.span(1) for m in self.CONTENT_LENGTH.finditer(data)] + [m.span(1)
                                                                            for m in self.CHUNK_SIZE.finditer(data)]
        if not spots or self.rng.random() < 0.2:
            spots += [m.span() for m in self.DIGITS.finditer(data)]
        if not spots:
            return self.insert(data)
        start, end = self.rng.choice(spots)
        old = data[start:end]
        value = int(old, 16) if not old.isdigit() else int(old)
        hexadecimal = not old.isdigit()
        shifted = [value + 5, max(value - 1, 0), value * 2]
        candidates = self.NUMBERS + [(b"%x" if hexadecimal else b"%d") % n for n in shifted]
        new = self.rng.choice(candidates)
        return data[:start] + new + data[end:], f"number {old!r}->{new!r} at {start}"

    def field(self, data: bytes) -> tuple[bytes, str]:
        """Duplicates a header field line, as it is or with another value."""
        lines = list(self.FIELD_LINE.finditer(data))
        if not lines:
            return self.duplicate(data)
        line = self.rng.choice(lines)
        copy = line.group(0)
        if self.rng.random() < 0.4:
            name = copy.split(b":", 1)[0]
            copy = name + b": " + self.rng.choice([b"0", b"1", b"chunked", b"close", b"identity", b"x" * 100])
        return data[:line.end()] + copy + data[line.end():], f"field {copy[2:40]!r} after {line.end()}"

    def truncate(self, data: bytes) -> tuple[bytes, str]:
        at = self.rng.randrange(len(data))
        return data[:at], f"truncate at {at} of {len(data)}"


# MARK: - Plans: a stream as it is sent


@dataclasses.dataclass
class Segment:
    """A part as sent: its writes (bytes, pause after) and the wait for an answer after it."""

    writes: list[tuple[bytes, float]]
    wait: float


@dataclasses.dataclass
class Plan:
    """One stream: a seed, its mutations, how it is cut into writes, and how it ends."""

    worker: int
    index: int
    seed: str
    requests: int
    mutations: list[str]
    tls: str | None
    outer: list[Segment]
    inner: list[Segment]
    ending: str          # close, half-close, reset, stall
    linger: float        # reset: seconds read before the RST; stall: seconds without reading
    patience: float      # seconds of quiet that end the reading

    def to_json(self) -> dict:
        def segments(items: list[Segment]) -> list[dict]:
            return [{"writes": [[base64.b64encode(data).decode(), pause] for data, pause in s.writes],
                     "wait": s.wait} for s in items]

        record = dataclasses.asdict(self)
        record.update(outer=segments(self.outer), inner=segments(self.inner))
        return record

    @classmethod
    def from_json(cls, record: dict, remap: Callable[[bytes], bytes]) -> Plan:
        """A saved plan; `remap` rewrites each part (a port may be split across writes) before it is cut into
        the same writes again."""
        def segments(items: list[dict]) -> list[Segment]:
            out = []
            for item in items:
                pieces = [(base64.b64decode(data), pause) for data, pause in item["writes"]]
                data = remap(b"".join(piece for piece, _ in pieces))
                cuts = [0]
                for piece, _ in pieces:
                    cuts.append(cuts[-1] + len(piece))
                cuts[-1] = len(data)
                spans = itertools.pairwise(cuts)
                out.append(Segment([(data[a:b], pause) for (a, b), (_, pause) in zip(spans, pieces, strict=True)],
                                   item["wait"]))
            return out

        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in record.items() if k in fields}
        values.update(outer=segments(record["outer"]), inner=segments(record["inner"]))
        return cls(**values)

    def text(self) -> str:
        """The stream for a person: every write with escapes, the pauses, the ending."""
        out = [f"seed {self.seed}, worker {self.worker}, stream {self.index}, tls {self.tls}, ending {self.ending} "
               f"(linger {self.linger}s, patience {self.patience}s)", *[f"mutation: {m}" for m in self.mutations]]
        for label, items in (("outer", self.outer), ("inside TLS", self.inner)):
            for number, segment in enumerate(items):
                out.append(f"--- {label} part {number} (then wait up to {segment.wait}s for the answer)")
                out += [f"write {data!r}" + (f"  pause {pause}s" if pause else "") for data, pause in segment.writes]
        return "\n".join(out) + "\n"


def plan_stream(seed: Seed, rng: random.Random, worker: int, index: int) -> Plan:
    """Mutates a seed (or not: about a third of the streams stay valid) and decides writes and ending."""
    mutator = Mutator(rng)
    outer = [Part(p.data, p.wait) for p in seed.outer]
    inner = [Part(p.data, p.wait) for p in seed.inner]
    mutations: list[str] = []
    if rng.random() < 0.65:
        for _ in range(rng.choice([1, 1, 1, 2, 2, 3, 5])):
            # Inside TLS, the plaintext is what gets mutated (the tunnel's CONNECT still changes sometimes).
            parts = inner if inner and rng.random() < 0.75 else outer
            part = rng.choices(parts, [len(p.data) + 1 for p in parts])[0]
            part.data, description = mutator.mutate(part.data)
            mutations.append(("inner: " if parts is inner else "") + description)
    # Mostly short; sometimes past keepalive_timeout (2 s), so that the proxy's keep-alive timer ends it.
    patience = seed.patience if seed.patience is not None else rng.choice([0.3, 0.3, 1.0, 2.5])
    if mutations and rng.random() < 0.15:
        patience = max(patience, 6.0)  # past header_timeout: a head left incomplete gets its 408
    ending = seed.ending or rng.choices(["close", "half-close", "reset", "stall"], [5, 2, 2, 1])[0]
    linger = {"reset": rng.choice([0.0, 0.05, 0.5, patience]), "stall": rng.choice([0.5, 1.5, 4.0])}.get(ending, 0.0)
    return Plan(worker, index, seed.name, seed.requests, mutations, seed.tls,
                [split(p, rng) for p in outer], [split(p, rng) for p in inner], ending, linger, patience)


def split(part: Part, rng: random.Random) -> Segment:
    """Cuts a part into writes: whole, a few pieces with pauses, or its first bytes one small piece at a time."""
    data = part.data
    mode = rng.choice(["whole", "whole", "pieces", "dribble"]) if len(data) > 1 else "whole"
    if mode == "whole":
        return Segment([(data, 0.0)], part.wait)
    if mode == "pieces":
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 6))))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        return Segment([(p, rng.choice([0.0, 0.001, 0.01, 0.05, 0.2])) for p in pieces], part.wait)
    writes: list[tuple[bytes, float]] = []
    at = 0
    while at < min(len(data), 300):
        size = rng.randint(1, 16)
        writes.append((data[at:at + size], rng.choice([0.0, 0.001, 0.005])))
        at += size
    if at < len(data):
        writes.append((data[at:], 0.0))
    return Segment(writes, part.wait)


# MARK: - The client side of one stream


class Deadline(Exception):
    """The stream ran out of time."""


class Link:
    """One client connection to the proxy. Non-blocking underneath: sending always keeps reading (so a proxy
    that answers while we send never deadlocks us), TLS runs on memory BIOs over the same socket, and every
    wait is bounded by the stream's deadline. Plaintext received is kept up to READ_LIMIT bytes."""

    def __init__(self, port: int, deadline: float) -> None:
        self.deadline = deadline
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=3)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.client_port = self.sock.getsockname()[1]
        self.tls: ssl.SSLObject | None = None
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.handshaking = False
        self.data = bytearray()
        self.sent = 0
        self.received = 0
        self.eof = False
        self.closed = False

    @property
    def full(self) -> bool:
        return self.received >= READ_LIMIT

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Deadline()
        return left

    def _keep(self, data: bytes) -> None:
        self.received += len(data)
        if len(self.data) < READ_LIMIT:
            self.data += data[:READ_LIMIT - len(self.data)]

    def _take(self, raw: bytes) -> None:
        if self.tls is None:
            self._keep(raw)
            return
        self.incoming.write(raw)
        while not self.handshaking:
            try:
                plain = self.tls.read(65536)
            except ssl.SSLWantReadError:
                return
            except ssl.SSLZeroReturnError:
                self.eof = True
                return
            if not plain:
                self.eof = True
                return
            self._keep(plain)

    def _recv(self) -> bool:
        raw = self.sock.recv(256 * 1024)
        if not raw:
            self.eof = True
            return False
        self._take(raw)
        return True

    def pull(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for bytes; whether any arrived (False at EOF or the byte limit)."""
        if self.eof or self.full:
            return False
        readable, _, _ = select.select([self.sock], [], [], max(0.0, min(timeout, self.remaining())))
        return bool(readable) and self._recv()

    def _send_raw(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            reading = [self.sock] if not (self.eof or self.full) else []
            readable, writable, _ = select.select(reading, [self.sock], [], self.remaining())
            if readable:
                self._recv()
            if writable:
                view = view[self.sock.send(view):]

    def send(self, data: bytes) -> None:
        self.sent += len(data)
        if self.tls is not None:
            self.tls.write(data)
            data = self.outgoing.read()
        self._send_raw(data)

    def send_segments(self, segments: list[Segment]) -> None:
        for segment in segments:
            for data, pause in segment.writes:
                self.send(data)
                if pause:
                    self.pull(pause)
            self.settle(segment.wait)

    def settle(self, wait: float, quiet: float = 0.15) -> None:
        """Reads for up to `wait` seconds: until an answer arrived and then nothing more for `quiet` seconds."""
        end = time.monotonic() + wait
        answered = False
        while (left := end - time.monotonic()) > 0:
            if self.pull(min(left, quiet) if answered else left):
                answered = True
            elif answered or self.eof or self.full:
                return

    def read_until_quiet(self, patience: float) -> None:
        while self.pull(patience):
            pass

    def tunnel(self, timeout: float) -> bytes | None:
        """Waits for the proxy's answer to the CONNECT; the bytes after it, or None without one."""
        end = time.monotonic() + timeout
        while TUNNEL_OK not in self.data:
            left = end - time.monotonic()
            if left <= 0 or not self.pull(left):
                return None
        at = self.data.find(TUNNEL_OK) + len(TUNNEL_OK)
        leftover = bytes(self.data[at:])
        del self.data[at:]
        return leftover

    def start_tls(self, context: ssl.SSLContext, hostname: str, leftover: bytes) -> None:
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname=hostname)
        self.incoming.write(leftover)
        self.handshaking = True
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._send_raw(self.outgoing.read())
                self.pull(self.remaining())
                if self.eof:
                    raise ssl.SSLError("the connection closed during the TLS handshake") from None
        self.handshaking = False
        self._send_raw(self.outgoing.read())

    def _close_notify(self) -> None:
        if self.tls is not None and not self.handshaking:
            with contextlib.suppress(ssl.SSLError):  # SSLWantReadError: the peer's close_notify is not awaited
                self.tls.unwrap()
            self._send_raw(self.outgoing.read())

    def end(self, kind: str, linger: float, patience: float) -> str:
        """Ends the stream the planned way; the outcome as the client saw it."""
        if kind == "close":
            self.read_until_quiet(patience)
            self._close_notify()
        elif kind == "half-close":
            self._close_notify()
            self.sock.shutdown(socket.SHUT_WR)
            self.read_until_quiet(patience)
        elif kind == "reset":
            self.settle(linger, quiet=linger)
            reset_close(self.sock)
            self.closed = True
        else:
            time.sleep(min(linger, self.remaining()))
        state = "byte limit" if self.full else "proxy closed" if self.eof else "open"
        return f"{kind}, {state}"

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


@dataclasses.dataclass
class Outcome:
    """What one stream did, from the client's side."""

    outcome: str
    sent: int = 0
    received: int = 0
    statuses: list[int] = dataclasses.field(default_factory=list)
    client_port: int = 0


def run_plan(plan: Plan, proxy_port: int, contexts: dict[str, tuple[ssl.SSLContext, str]]) -> Outcome:
    """Sends one stream and reads what comes back. Client-side errors are outcomes, never exceptions."""
    deadline = time.monotonic() + STREAM_DEADLINE
    link: Link | None = None
    try:
        link = Link(proxy_port, deadline)
        link.send_segments(plan.outer)
        if plan.tls is not None:
            leftover = link.tunnel(min(5.0, link.remaining()))
            if leftover is None:
                outcome = "no tunnel, " + link.end(plan.ending, plan.linger, 0.2)
            else:
                context, hostname = contexts[plan.tls]
                link.start_tls(context, hostname, leftover)
                link.send_segments(plan.inner)
                outcome = link.end(plan.ending, plan.linger, plan.patience)
        else:
            outcome = link.end(plan.ending, plan.linger, plan.patience)
    except Deadline:
        outcome = "stream deadline"
    except ssl.SSLError as error:
        outcome = f"TLS error ({getattr(error, 'reason', None) or 'closed'})"
    except ConnectionRefusedError:
        outcome = "proxy refused the connection"
    except (ConnectionResetError, BrokenPipeError):
        outcome = "reset by the proxy"
    except OSError as error:
        outcome = f"socket error ({error.strerror or type(error).__name__})"
    if link is None:
        return Outcome(outcome)
    link.close()
    statuses = [int(code) for code in STATUS_LINE.findall(bytes(link.data))]
    return Outcome(outcome, link.sent, link.received, statuses, link.client_port)


# MARK: - Observing the proxy


def descriptor_kinds(pid: int, ports: Ports) -> collections.Counter[str]:
    """The proxy's descriptors by what they are: its listener, client connections, connections to each
    fixture (by port, from /proc/net/tcp), other sockets (Unix sockets, and TCP sockets whose connection is
    over: the kernel lists those nowhere), and everything else (log, pipes, event fds)."""
    names = {ports.http: "http origin", ports.https: "https origin", ports.echo: "echo origin",
             ports.silent: "silent origin", ports.protected_http: "protected http origin", ports.api: API_HOST,
             ports.idp: "provider"}
    sockets: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            local_port, remote_port = int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)
            if state == "0A":
                sockets[inode] = "listener"
            elif local_port == ports.proxy:
                sockets[inode] = "client"
            else:
                sockets[inode] = f"to {names.get(remote_port, 'elsewhere')}"
    kinds: collections.Counter[str] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            kinds[sockets.get(target[len("socket:["):-1], "other socket (unix, closed tcp)")] += 1
        elif target.startswith("pipe:"):
            kinds["pipe"] += 1
        elif target.startswith("anon_inode:"):
            kinds[target[len("anon_inode:"):]] += 1
        else:
            kinds["file " + target] += 1
    return kinds


# Connections curl keeps open for later transfers (to protected origins and the provider): not a leak.
POOLED = (f"to {API_HOST}", "to protected http origin", "to provider")
# Descriptors the runtime makes once, lazily, for the whole process (libdispatch's timers and wake-ups, used
# by Swift concurrency for token refreshes): a few more after the load is not a leak, a number that grows
# with the load would be.
RUNTIME = ("[timerfd]", "[eventfd]", "[eventpoll]")
RUNTIME_SLACK = 4


def log_statuses(path: Path) -> tuple[collections.Counter[int], collections.Counter[int], collections.Counter[str]]:
    """From the proxy's log: every request's and tunnel's status, those the proxy answered itself (its own
    responses and failed next hops), and the lines by level."""
    answers: collections.Counter[int] = collections.Counter()
    own: collections.Counter[int] = collections.Counter()
    levels: collections.Counter[str] = collections.Counter()
    status = re.compile(r" status=(\d+)")
    level = re.compile(r"^\d{4}-\d\d-\d\dT\S+ (\w+) ")
    with open(path, encoding="utf-8", errors="replace") as log:
        for line in log:
            found = level.match(line)
            if found:
                levels[found.group(1)] += 1
            if " conn=" not in line:
                continue
            found = status.search(line)
            if found:
                answers[int(found.group(1))] += 1
                if "answered-by=proxyctl" in line or " error=" in line or " rejected " in line:
                    own[int(found.group(1))] += 1
    return answers, own, levels


def counts(counter: collections.Counter, limit: int = 14) -> str:
    items = sorted(counter.items(), key=lambda kv: (-kv[1], str(kv[0])))
    text = ", ".join(f"{key} ×{value}" for key, value in items[:limit])
    return text + (f", … ({len(items) - limit} more)" if len(items) > limit else "") if items else "none"


def mib(kib: float) -> str:
    return f"{kib / 1024:.1f} MiB"


def amount(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


# MARK: - The soak


class Soak:
    """Workers, the liveness checker and the memory sampler around one deployment."""

    def __init__(self, deployment: Deployment, ports: Ports, seed: int, workers: int) -> None:
        self.deployment = deployment
        self.proxy = deployment.proxy
        self.ports = ports
        self.seed = seed
        self.workers = workers
        self.seeds = Seeds(ports)
        origin_context = deployment.cert.client_context()
        self.contexts = {"origin": (origin_context, "localhost"),
                         "intercept": (deployment.intercept_context(), API_HOST)}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.streams = 0
        self.valid_streams = 0
        self.requests = 0
        self.sent = 0
        self.received = 0
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.valid_statuses: collections.Counter[int] = collections.Counter()
        # Valid streams answered with a status their seed does not expect (not a failure: for a person to read).
        self.odd_answers: collections.Counter[str] = collections.Counter()
        self.odd_examples: list[str] = []
        self.client_bug = ""  # the first unexpected exception of a worker, with its traceback
        self.recent: list[collections.deque[tuple[float, Plan, Outcome]]] = [
            collections.deque(maxlen=STREAMS_KEPT) for _ in range(workers)]
        self.liveness_rounds = 0
        self.liveness_failures: list[str] = []
        self.samples: list[tuple[float, int, int]] = []   # (seconds, RSS KiB, descriptors)
        self.fds_baseline: collections.Counter[str] = collections.Counter()
        self.load_seconds = 0.0  # how long the load ran
        self.crash: str | None = None
        self._log_offset = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # Workers

    def worker(self, number: int) -> None:
        index = 0
        while not self.stop.is_set():
            rng = random.Random(f"{self.seed}/{number}/{index}")
            seed = self.seeds.draw(rng)
            plan = plan_stream(seed, rng, number, index)
            started = self.elapsed()
            try:
                result = run_plan(plan, self.ports.proxy, self.contexts)
            except Exception as error:  # noqa: BLE001 - a bug of this script: counted and shown, the worker goes on
                result = Outcome(f"unexpected client exception ({type(error).__name__})")
                with self.lock:
                    if not self.client_bug:
                        self.client_bug = traceback.format_exc()
            odd = [] if plan.mutations or seed.expected is None else sorted(set(result.statuses) - seed.expected)
            with self.lock:
                self.streams += 1
                self.requests += plan.requests
                self.sent += result.sent
                self.received += result.received
                self.outcomes[result.outcome] += 1
                if not plan.mutations:
                    self.valid_streams += 1
                    self.valid_statuses.update(result.statuses)
                for status in odd:
                    self.odd_answers[f"{plan.seed} {status}"] += 1
                if odd and len(self.odd_examples) < 20:
                    self.odd_examples.append(f"outcome: {result.outcome}; statuses seen {result.statuses}\n"
                                             + plan.text())
                self.recent[number].append((started, plan, result))
            if result.outcome == "proxy refused the connection":
                self.stop.wait(0.5)  # the proxy is gone or overwhelmed: the monitor tells which
            index += 1

    # Liveness

    def check_plain(self, number: int) -> None:
        target = f"/alive/{number}"
        with connect(self.ports.proxy, timeout=LIVENESS_DEADLINE) as sock:
            sock.sendall(f"GET http://127.0.0.1:{self.ports.http}{target} HTTP/1.1\r\nHost: 127.0.0.1:"
                         f"{self.ports.http}\r\nConnection: close\r\n\r\n".encode())
            response = Reader(sock, LIVENESS_DEADLINE).read_response()
        if response.status != 200 or response.body != f"origin GET {target}\n".encode():
            raise AssertionError(f"answered {response.status} {response.body[:200]!r}")

    def check_intercepted(self, number: int) -> None:
        authority = f"{API_HOST}:{self.ports.api}"
        sock, _, answer = open_tunnel(self.ports.proxy, authority, timeout=LIVENESS_DEADLINE)
        with sock:
            if answer.status != 200:
                raise AssertionError(f"CONNECT answered {answer.status}")
            context, hostname = self.contexts["intercept"]
            with context.wrap_socket(sock, server_hostname=hostname) as tls:
                tls.settimeout(LIVENESS_DEADLINE)
                tls.sendall(f"GET /anything/alive-{number} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
                response = Reader(tls, LIVENESS_DEADLINE).read_response()
        if response.status != 200 or json.loads(response.body).get("sub") != SUBJECT:
            raise AssertionError(f"answered {response.status} {response.body[:200]!r}")

    def liveness_round(self) -> list[str]:
        """One plain and one intercepted request; the failures, each with the time it happened."""
        failures = []
        for name, check in (("plain GET", self.check_plain), ("intercepted GET", self.check_intercepted)):
            begun = time.monotonic()
            try:
                check(self.liveness_rounds)
                took = time.monotonic() - begun
                if took > LIVENESS_DEADLINE:
                    raise AssertionError(f"took {took:.1f}s")
            except Exception as error:  # noqa: BLE001 - every failure of the check is a finding
                failures.append(f"{self.elapsed():7.1f}s {name}: {type(error).__name__}: {error}"[:400])
        self.liveness_rounds += 1
        self.liveness_failures += failures
        return failures

    def liveness(self) -> None:
        while not self.stop.wait(LIVENESS_INTERVAL):
            self.liveness_round()

    # Memory, descriptors, crashes

    def check_crash(self) -> str | None:
        """A sanitizer report or trap in the new part of the log, or the process gone."""
        with open(self.proxy.log_path, "rb") as log:
            log.seek(max(0, self._log_offset - 64))  # a marker may straddle two reads
            fresh = log.read().decode("utf-8", "replace")
            self._log_offset = log.tell()
        if any(marker in fresh for marker in Proxy.CRASH_MARKERS) or self.proxy.process.poll() is not None:
            return self.proxy.crash_report() or f"proxyctl exited with {self.proxy.process.poll()}"
        return None

    def monitor(self) -> None:
        next_sample = 0.0
        while not self.stop.wait(0.5):
            crash = self.check_crash()
            if crash:
                self.crash = crash
                self.stop.set()
                return
            if self.elapsed() >= next_sample:
                next_sample = self.elapsed() + SAMPLE_INTERVAL
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it just exited
                    self.samples.append((self.elapsed(), self.proxy.rss_kib(), self.proxy.fd_count()))

    # The run

    def run(self, seconds: float) -> None:
        """Runs the load for `seconds` (less after a crash or Ctrl-C), then stops and joins every thread."""
        threads = [threading.Thread(target=self.worker, args=(n,), name=f"worker-{n}", daemon=True)
                   for n in range(self.workers)]
        helpers = [threading.Thread(target=self.monitor, daemon=True), threading.Thread(target=self.liveness,
                                                                                        daemon=True)]
        for thread in helpers + threads:
            thread.start()
        deadline = self.started + seconds
        next_report = self.started + 30
        try:
            while not self.stop.wait(max(0.0, min(deadline, next_report) - time.monotonic())):
                if time.monotonic() >= deadline:
                    break
                next_report += 30
                rss, fds = self.samples[-1][1:] if self.samples else (0, 0)
                print(f"soak: {self.elapsed() / 60:4.1f} min  streams {self.streams}  rss {mib(rss)}  fds {fds}  "
                      f"liveness failures {len(self.liveness_failures)}", flush=True)
        except KeyboardInterrupt:
            print("soak: interrupted; stopping the load and checking what ran", flush=True)
        finally:
            self.load_seconds = self.elapsed()
            self.stop.set()
            for thread in threads + helpers:
                thread.join(STREAM_DEADLINE + 10)
        if self.crash is None:
            self.crash = self.check_crash()

    def save_streams(self, directory: Path) -> list[str]:
        """Writes the kept streams (JSON for --replay, text for people); returns those whose client port is
        among the last ten the log names before the end (or the crash report), most recent first."""
        directory.mkdir(parents=True, exist_ok=True)
        tail = self.proxy.log()[-20000:]
        if self.crash:
            cut = min((tail.find(m) for m in Proxy.CRASH_MARKERS if m in tail), default=len(tail))
            tail = tail[:cut]
        recent_ports: list[str] = []
        for port in reversed(re.findall(r"client=127\.0\.0\.1:(\d+)", tail)):
            if port not in recent_ports and len(recent_ports) < 10:
                recent_ports.append(port)
        named: dict[str, str] = {}
        everything = sorted((entry for recent in self.recent for entry in recent), key=lambda e: e[0])
        for started, plan, result in everything:
            stem = f"{started:08.2f}s-w{plan.worker:02d}-s{plan.index:06d}-{plan.seed}"
            record = {**plan.to_json(), "started": started, "outcome": result.outcome,
                      "client_port": result.client_port, "ports": dataclasses.asdict(self.ports)}
            (directory / f"{stem}.json").write_text(json.dumps(record, indent=1))
            (directory / f"{stem}.txt").write_text(f"outcome: {result.outcome}; client port {result.client_port}; "
                                                   f"statuses seen {result.statuses}\n" + plan.text())
            if str(result.client_port) in recent_ports:
                named[str(result.client_port)] = stem
        return [named[port] for port in recent_ports if port in named]


# MARK: - Verdict


@dataclasses.dataclass
class Memory:
    """RSS over the run: the warm-up reference, the peak, the end, and the growth after the warm-up."""

    warm: int
    peak: int
    end: int
    growth: int
    slope_per_min: float

    @classmethod
    def of(cls, samples: list[tuple[float, int, int]], seconds: float) -> Memory | None:
        warm = [rss for t, rss, _ in samples if t <= seconds * WARMUP_SHARE]
        after = [(t, rss) for t, rss, _ in samples if t > seconds * WARMUP_SHARE]
        if not warm or len(after) < 3:
            return None
        end = int(statistics.median(rss for _, rss in after[-5:]))
        slope = statistics.linear_regression([t for t, _ in after], [rss for _, rss in after]).slope * 60
        return cls(max(warm), max(rss for _, rss, _ in samples), end, end - max(warm), slope)


def verdict(soak: Soak, args: argparse.Namespace, workdir: Path) -> int:
    """Settles, stops the proxy, checks everything and prints the summary; the exit code."""
    proxy, ports = soak.proxy, soak.ports
    problems: list[str] = []
    if soak.crash:
        problems.append("the proxy crashed or exited")
    kinds_end: collections.Counter[str] = collections.Counter()
    stop_text, settle_text = "not reached", ""
    if not soak.crash:
        if soak.liveness_round():
            problems.append("no answer after the load")

        def settled() -> bool:
            """Every kind of descriptor but curl's pooled connections is back to its count before the load."""
            nonlocal kinds_end
            kinds_end = descriptor_kinds(proxy.pid, ports)
            return all(
                count <= soak.fds_baseline[kind] + (RUNTIME_SLACK if kind in RUNTIME else 0)
                for kind, count in kinds_end.items() if kind not in POOLED)

        begun = time.monotonic()
        try:
            poll(settled, timeout=30, interval=0.5, message="descriptors to settle")
            settle_text = f", settled {time.monotonic() - begun:.1f}s after the load"
        except AssertionError:
            problems.append("descriptors did not settle back within 30 s")
        if sum(kinds_end[k] for k in POOLED) > 2 * args.workers + 8:
            problems.append("more pooled connections than transfers could have used")
        begun = time.monotonic()
        try:
            code = proxy.stop(timeout=SHUTDOWN_GRACE + 5)
            took = time.monotonic() - begun
            stop_text = f"SIGTERM -> exit {code} in {took:.1f}s (shutdown_grace {SHUTDOWN_GRACE:g}s)"
            if code != 0:
                problems.append(f"SIGTERM gave exit code {code}")
            if took > SHUTDOWN_GRACE + 1:
                problems.append(f"the proxy took {took:.1f}s to stop, past its shutdown_grace")
        except subprocess.TimeoutExpired:
            stop_text = f"SIGTERM -> still running after {SHUTDOWN_GRACE + 5:.0f}s (killed)"
            problems.append("the proxy did not stop on SIGTERM")
        stuck = proxy.log().partition("grace period over")[2].splitlines()[1:]
        stuck = [line for line in stuck if " conn=" in line]
        if stuck:
            problems.append(f"{len(stuck)} connection(s) still open at SIGTERM, closed only by the grace period")
            stop_text += "; still open then:\n" + "\n".join(f"                   {line[25:400]}" for line in stuck[:10])
        report = proxy.crash_report()
        if report:
            soak.crash = report
            problems.append("a sanitizer report or crash in the log")
    if soak.liveness_failures:
        problems.append(f"{len(soak.liveness_failures)} liveness failure(s)")
    memory = Memory.of(soak.samples, soak.load_seconds)
    bound = args.rss_growth_mib * 1024
    if memory and memory.growth > bound:
        problems.append(f"RSS grew by {mib(memory.growth)} after the warm-up (bound {args.rss_growth_mib} MiB)")
    answers, own, levels = log_statuses(proxy.log_path)
    fds_end = sum(kinds_end.values())

    lines = [
        "", "soak summary",
        f"  seed             {soak.seed}   (scripts/soak --seed {soak.seed} repeats every stream's choices)",
        f"  ran              {soak.load_seconds / 60:.1f} min ({soak.load_seconds:.0f} s) of load, {args.workers} "
        f"workers, binary {proxyctl_bin()}",
        f"  streams          {soak.streams} ({soak.valid_streams} valid, {soak.streams - soak.valid_streams} mutated),"
        f" {soak.requests} requests in the seeds",
        f"  bytes            sent {amount(soak.sent)}, received {amount(soak.received)}",
        f"  proxy answers    {counts(answers)}   (log)",
        f"  its own answers  {counts(own)}",
        f"  log lines        {counts(levels)}",
        f"  client outcomes  {counts(soak.outcomes, 20)}",
        f"  valid streams    saw {counts(soak.valid_statuses)}",
        f"  odd answers      {counts(soak.odd_answers)}   (valid streams, statuses their seed does not expect)",
    ]
    if soak.odd_examples:
        odd = workdir / "odd-answers"
        odd.mkdir(exist_ok=True)
        for number, example in enumerate(soak.odd_examples):
            (odd / f"{number:02d}.txt").write_text(example)
        lines.append(f"                   examples: {odd}")
    if memory:
        lines.append(f"  RSS              warm-up {mib(memory.warm)}, peak {mib(memory.peak)}, end {mib(memory.end)}; "
                     f"growth after warm-up {mib(memory.growth)} (bound {args.rss_growth_mib} MiB), "
                     f"trend {memory.slope_per_min / 1024:+.2f} MiB/min")
    else:
        lines.append("  RSS              too few samples")
    lines += [
        f"  descriptors      baseline {sum(soak.fds_baseline.values())} ({counts(soak.fds_baseline)}); "
        f"end {fds_end} ({counts(kinds_end)}){settle_text}",
        f"  liveness         {soak.liveness_rounds} rounds, {len(soak.liveness_failures)} failures",
        *[f"                   {failure}" for failure in soak.liveness_failures[:20]],
        f"  tokens           {soak.deployment.idp.count('token', grant_type='refresh_token')} refresh grants at the "
        f"provider (access tokens last {TOKEN_LIFETIME} s)",
        f"  shutdown         {stop_text}",
        f"  verdict          {'FAILED: ' + '; '.join(problems) if problems else 'clean'}",
        f"  proxy log        {proxy.log_path}",
    ]
    if problems:
        streams = workdir / "streams"
        named = soak.save_streams(streams)  # the streams the proxy served last, most recent first
        lines.append(f"  streams          the last {STREAMS_KEPT} of each worker: {streams}")
        if soak.crash:
            for stem in named:
                lines.append(f"                   among the last connections in the log before the crash: {stem}")
        lines.append(f"  replay           scripts/soak --binary {proxyctl_bin()} --replay {streams}")
    if soak.client_bug:
        lines += ["", "a worker's first unexpected exception (a bug of scripts/soak.py):", soak.client_bug]
    if soak.crash:
        lines += ["", "crash report (from the proxy's log):", soak.crash[:6000]]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    (workdir / "summary.txt").write_text(text)
    (workdir / "samples.csv").write_text("seconds,rss_kib,fds\n" + "".join(f"{t:.1f},{rss},{fds}\n"
                                                                        for t, rss, fds in soak.samples))
    return 1 if problems else 0


# MARK: - Replay


def replay(directory: Path, deployment: Deployment, ports: Ports) -> int:
    """Sends saved streams again, one after the other in their original order, to a fresh proxy."""
    records = sorted((json.loads(p.read_text()) for p in directory.glob("*.json")), key=lambda r: r["started"])
    if not records:
        print(f"soak: no saved streams in {directory}", file=sys.stderr)
        return 2
    old = records[0]["ports"]
    mapping = {old[name]: value for name, value in dataclasses.asdict(ports).items()}
    number = re.compile(rb":(\d{1,5})(?!\d)")

    def remap(data: bytes) -> bytes:
        return number.sub(lambda m: b":%d" % mapping.get(int(m.group(1)), int(m.group(1))), data)

    soak = Soak(deployment, ports, seed=0, workers=1)
    for record in records:
        plan = Plan.from_json(record, remap)
        result = run_plan(plan, ports.proxy, soak.contexts)
        print(f"soak: replayed {record['started']:8.2f}s w{plan.worker} s{plan.index} {plan.seed}: {result.outcome}")
        if soak.check_crash():
            break
    time.sleep(3)  # past keepalive_timeout: timers of what the streams left behind fire
    crash = soak.check_crash()
    if crash:
        print(f"soak: the replay crashed the proxy, during or after the last stream above; log "
              f"{deployment.proxy.log_path}\n{crash[:6000]}")
        return 1
    failures = soak.liveness_round()
    print("soak: no crash on replay" + (f"; liveness failures: {failures}" if failures else ""))
    return 1 if failures else 0


# MARK: - Main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the load runs (default 10)")
    parser.add_argument("--workers", type=int, default=16, help="concurrent client connections (default 16)")
    parser.add_argument("--seed", type=int, default=None, help="seed of every random choice (default: random)")
    parser.add_argument("--binary", type=Path, default=REPO / ".build-asan" / "release" / "proxyctl",
                        help="the proxyctl to test (default .build-asan/release/proxyctl)")
    parser.add_argument("--rss-growth-mib", type=float, default=48.0,
                        help="the most RSS may grow after the warm-up, in MiB (default 48)")
    parser.add_argument("--workdir", type=Path, default=None, help="where logs and streams go (default: a new "
                        "temporary directory, removed after a clean run unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory after a clean run")
    parser.add_argument("--replay", type=Path, default=None, metavar="DIR",
                        help="send the streams saved in DIR again instead of soaking")
    args = parser.parse_args()
    if not os.access(args.binary, os.X_OK):
        print(f"soak: {args.binary} is not an executable", file=sys.stderr)
        return 2
    isolate()
    os.environ["PROXYCTL_BIN"] = str(args.binary.resolve())
    # The caller's own ASAN_OPTIONS come last, so they win.
    os.environ["ASAN_OPTIONS"] = ":".join(filter(None, [ASAN_OPTIONS, os.environ.get("ASAN_OPTIONS")]))
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="proxyctl-soak."))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"soak: {'replay' if args.replay else f'seed {seed}'}, work directory {workdir}", flush=True)
    deployment = Deployment(workdir)
    code = 2
    try:
        ports = deployment.start()
        if args.replay is not None:
            return replay(args.replay, deployment, ports)
        soak = Soak(deployment, ports, seed, args.workers)
        first = soak.liveness_round()
        if first:
            print("soak: the proxy does not answer before any load:\n  " + "\n  ".join(first), file=sys.stderr)
            return 2
        soak.liveness_failures.clear()
        soak.fds_baseline = descriptor_kinds(deployment.proxy.pid, ports)
        print(f"soak: proxy {proxyctl_bin()} on {deployment.proxy.address}, ASAN_OPTIONS="
              f"{os.environ['ASAN_OPTIONS']}; {args.workers} workers for {args.minutes:g} min", flush=True)
        soak.run(args.minutes * 60)
        code = verdict(soak, args, workdir)
        return code
    finally:
        deployment.close()
        if code == 0 and args.workdir is None and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
