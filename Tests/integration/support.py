"""Helpers shared by the integration tests: the proxyctl process, origin servers, raw HTTP on sockets.

Everything listens on 127.0.0.1 with a port chosen by the kernel (port 0). Nothing here sleeps for a fixed
time to wait for something: `poll` waits for a condition with a deadline.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import http.server
import json
import os
import random
import re
import select
import signal
import socket
import socketserver
import ssl
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Set by scripts/test when PROXYCTL_BIN is a sanitizer build ("address"): memory figures then measure the
# sanitizer, not proxyctl.
SANITIZER = os.environ.get("PROXYCTL_SANITIZER") or None
MiB = 1 << 20


def proxyctl_bin() -> str:
    """The binary under test: $PROXYCTL_BIN, else .build/release/proxyctl in the repository."""
    configured = os.environ.get("PROXYCTL_BIN")
    path = Path(configured) if configured else REPO / ".build" / "release" / "proxyctl"
    if not path.is_absolute():
        path = Path.cwd() / path
    return str(path)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any proxy variable, so that no client or tool picks up the user's proxy."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(extra)
    return env


def poll(predicate, timeout: float = 10.0, interval: float = 0.02, message: str = "condition"):
    """Calls `predicate` until it returns something truthy, which is returned; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


# MARK: - Deterministic content

_BLOCK = MiB
_BASE = random.Random(0x5EED_2026).randbytes(_BLOCK)


def generate(size: int):
    """`size` bytes of deterministic pseudo-random content, 1 MiB at a time, never held whole in memory.

    Block i is the base block rotated by a different offset, so a lost, repeated or reordered block changes
    the SHA-256.
    """
    index = 0
    remaining = size
    while remaining > 0:
        offset = (index * 7919) % _BLOCK
        block = _BASE[offset:] + _BASE[:offset]
        if remaining < _BLOCK:
            block = block[:remaining]
        yield block
        remaining -= len(block)
        index += 1


@functools.lru_cache(maxsize=None)
def expected_sha256(size: int) -> str:
    digest = hashlib.sha256()
    for block in generate(size):
        digest.update(block)
    return digest.hexdigest()


def write_generated(path: Path, size: int) -> Path:
    with open(path, "wb") as out:
        for block in generate(size):
            out.write(block)
    return path


# MARK: - Certificates


@dataclass
class TestCert:
    cert_pem: Path
    key_pem: Path
    der: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.der).hexdigest()

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_pem, self.key_pem)
        return context

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert_pem))


def make_cert(directory: Path) -> TestCert:
    """A self-signed certificate for localhost and 127.0.0.1 (made with `cryptography`)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, crl_sign=False, encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_pem = directory / "origin-cert.pem"
    key_pem = directory / "origin-key.pem"
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return TestCert(cert_pem, key_pem, cert.public_bytes(serialization.Encoding.DER))


# MARK: - Raw HTTP on a socket


@dataclass
class Response:
    version: str
    status: int
    reason: str
    head: bytes  # the head exactly as received, final CRLF included
    fields: list[tuple[str, str]]
    body: bytes = b""
    raw_body: bytes = b""  # the body as framed on the wire (chunk lines included)

    def header(self, name: str) -> str | None:
        for key, value in self.fields:
            if key.lower() == name.lower():
                return value
        return None

    def headers(self, name: str) -> list[str]:
        return [value for key, value in self.fields if key.lower() == name.lower()]

    @property
    def total_bytes(self) -> int:
        return len(self.head) + len(self.raw_body)


class Reader:
    """Buffered reads from a socket (plain or TLS), with a deadline on every wait."""

    def __init__(self, sock: socket.socket, timeout: float = 20.0):
        self.sock = sock
        self.buffer = bytearray()
        self.eof = False
        sock.settimeout(timeout)

    def _fill(self, size: int = 256 * 1024) -> bool:
        if self.eof:
            return False
        data = self.sock.recv(size)
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    def read_until(self, delimiter: bytes, limit: int = 1 << 22) -> bytes:
        while True:
            index = self.buffer.find(delimiter)
            if index >= 0:
                end = index + len(delimiter)
                out = bytes(self.buffer[:end])
                del self.buffer[:end]
                return out
            if len(self.buffer) > limit:
                raise AssertionError(f"no {delimiter!r} within {limit} bytes")
            if not self._fill():
                raise EOFError(f"connection closed before {delimiter!r}; got {bytes(self.buffer[:300])!r}")

    def read_exact(self, count: int) -> bytes:
        while len(self.buffer) < count:
            if not self._fill():
                raise EOFError(f"connection closed after {len(self.buffer)} of {count} bytes")
        out = bytes(self.buffer[:count])
        del self.buffer[:count]
        return out

    def read_some(self, maximum: int) -> bytes:
        """Up to `maximum` bytes: what is buffered, else one recv. Empty at EOF."""
        if not self.buffer:
            self._fill(maximum)
        out = bytes(self.buffer[:maximum])
        del self.buffer[: len(out)]
        return out

    def read_to_eof(self) -> bytes:
        try:
            while self._fill():
                pass
        except ConnectionResetError:
            self.eof = True
        out = bytes(self.buffer)
        self.buffer.clear()
        return out

    def closed_by_peer(self, timeout: float = 10.0) -> bool:
        """Whether the peer closes the connection (EOF or reset) within `timeout` with nothing more sent."""
        if self.buffer:
            return False
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except ConnectionResetError:
            return True
        except (socket.timeout, TimeoutError):
            return False
        if data:
            self.buffer += data
            return False
        self.eof = True
        return True

    def read_head(self) -> Response:
        head = self.read_until(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        version, _, rest = lines[0].decode("latin-1").partition(" ")
        status_text, _, reason = rest.partition(" ")
        fields = []
        for line in lines[1:]:
            name, _, value = line.decode("latin-1").partition(":")
            fields.append((name, value.strip(" \t")))
        return Response(version, int(status_text), reason, head, fields)

    def read_response(self, method: str = "GET") -> Response:
        """One response; 1xx interim responses are skipped. A body ending at EOF is read to EOF."""
        while True:
            response = self.read_head()
            if response.status >= 200 or response.status == 101:
                break
        self.read_body(response, method)
        return response

    def read_body(self, response: Response, method: str = "GET") -> None:
        if method == "HEAD" or response.status in (204, 304) or response.status < 200:
            return
        if any("chunked" in v.lower() for v in response.headers("transfer-encoding")):
            raw = bytearray()
            body = bytearray()
            while True:
                line = self.read_until(b"\r\n")
                raw += line
                size = int(line.split(b";")[0].strip(), 16)
                if size == 0:
                    while True:
                        trailer = self.read_until(b"\r\n")
                        raw += trailer
                        if trailer == b"\r\n":
                            break
                    break
                data = self.read_exact(size + 2)
                raw += data
                body += data[:-2]
            response.body, response.raw_body = bytes(body), bytes(raw)
        elif response.header("content-length") is not None:
            response.body = response.raw_body = self.read_exact(int(response.header("content-length")))
        else:
            response.body = response.raw_body = self.read_to_eof()


def connect(port: int, host: str = "127.0.0.1", timeout: float = 20.0) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def reset_close(sock: socket.socket) -> None:
    """Closes with an RST (SO_LINGER 0): the way a killed client disappears."""
    import struct

    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def open_tunnel(proxy_port: int, target: str, extra: bytes = b"", timeout: float = 20.0):
    """Opens a CONNECT tunnel through the proxy; returns (socket, reader, response to CONNECT)."""
    sock = connect(proxy_port, timeout=timeout)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n".encode() + extra + b"\r\n")
    reader = Reader(sock, timeout)
    response = reader.read_head()
    if response.status == 200:
        assert not reader.buffer, f"bytes after the CONNECT answer: {bytes(reader.buffer[:100])!r}"
    return sock, reader, response


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# MARK: - proxyctl


# Signals only a crash sends (a test that stops a proxy uses SIGTERM, SIGINT or SIGKILL).
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGILL, signal.SIGBUS, signal.SIGTRAP, signal.SIGFPE}


class Proxy:
    """A running `proxyctl serve` with its own configuration file, HOME and XDG directories and log file."""

    LISTENING = re.compile(r"listening on http://(\S+):(\d+)")
    # Every proxyctl a test started, in order: conftest checks each for a crash (sanitizer report, trap).
    instances: list["Proxy"] = []

    def __init__(self, workdir: Path, config: str | None, listen: str | None = "127.0.0.1:0",
                 args: tuple[str, ...] = ()):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.home = workdir / "home"
        self.home.mkdir(exist_ok=True)
        self.config_path = workdir / "proxy.conf"
        if config is not None:
            self.config_path.write_text(config)
        self.log_path = workdir / "proxyctl.log"
        self.stdout_path = workdir / "proxyctl.stdout"
        command = [proxyctl_bin(), "serve"]
        if config is not None:
            command += ["--config", str(self.config_path)]
        if listen is not None:
            command += ["--listen", listen]
        command += list(args)
        self.command = command
        self.env = clean_env(HOME=str(self.home), XDG_CONFIG_HOME=str(workdir / "xdg"),
                             XDG_STATE_HOME=str(workdir / "xdg-state"), XDG_CACHE_HOME=str(workdir / "xdg-cache"))
        self.env.pop("PROXYCTL_CONFIG", None)
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.listen_host = ""

    def start(self, timeout: float = 15.0) -> "Proxy":
        Proxy.instances.append(self)
        with open(self.log_path, "wb") as log, open(self.stdout_path, "wb") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=log, stdin=subprocess.DEVNULL,
                                            env=self.env, cwd=self.workdir)

        def listening():
            found = self.LISTENING.search(self.log())
            if found:
                return found
            if self.process.poll() is not None:
                raise AssertionError(f"proxyctl exited with {self.process.returncode}: {self.log()}")
            return None

        found = poll(listening, timeout, message=f"proxyctl to listen (log: {self.log_path})")
        self.listen_host, self.port = found.group(1), int(found.group(2))
        return self

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_bytes().decode("utf-8", "replace")

    def mark(self) -> int:
        """The current length of the log; pass it to `log_since` or `wait_log` to see only newer lines."""
        return len(self.log_path.read_bytes())

    def log_since(self, mark: int) -> str:
        return self.log_path.read_bytes()[mark:].decode("utf-8", "replace")

    def wait_log(self, pattern: str, since: int = 0, timeout: float = 10.0, count: int = 1) -> list[re.Match]:
        """Waits until `pattern` matches `count` times in the log written after `since`; returns the matches."""
        compiled = re.compile(pattern)

        def found():
            matches = list(compiled.finditer(self.log_since(since)))
            return matches if len(matches) >= count else None

        return poll(found, timeout, message=f"log line /{pattern}/ x{count} in {self.log_path}")

    def connect(self, timeout: float = 20.0) -> socket.socket:
        return connect(self.port, timeout=timeout)

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self, timeout: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    CRASH_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "Fatal error:",
                     "Illegal instruction", "Segmentation fault")

    def crash_report(self) -> str | None:
        """What the process left behind if it crashed: a sanitizer report or a Swift runtime trap in its log,
        or death by a signal that only a crash sends. None when it ran (or stopped) cleanly."""
        log = self.log()
        for marker in self.CRASH_MARKERS:
            at = log.find(marker)
            if at >= 0:
                return log[max(0, at - 200):at + 4000]
        code = self.process.poll() if self.process else None
        if code is not None and code < 0 and -code in CRASH_SIGNALS:
            return f"killed by signal {-code}; log tail:\n{log[-3000:]}"
        return None

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def settled_fd_count(self, timeout: float = 10.0) -> int:
        """The descriptor count once it has stopped changing for a while."""
        samples: list[int] = []

        def stable():
            samples.append(self.fd_count())
            return len(samples) >= 10 and len(set(samples[-10:])) == 1

        poll(stable, timeout, interval=0.05, message="the proxy's descriptor count to settle")
        return samples[-1]

    def request_lines(self, since: int = 0) -> list[str]:
        """Log lines of finished requests and tunnels (those with a status= field and a conn= id)."""
        return [line for line in self.log_since(since).splitlines() if " conn=" in line and " status=" in line]


def config(**keys) -> str:
    """A [proxy] section from keyword arguments (values as written in proxy.conf)."""
    lines = ["[proxy]"]
    for key, value in keys.items():
        if value is not None:
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


# MARK: - Origin: HTTP and HTTPS


class _OriginHandler(http.server.BaseHTTPRequestHandler):
    """GET /gen/SIZE[?chunked=1|close=1]  deterministic content of SIZE bytes
    GET /slow/SIZE?seconds=S            the same, spread over S seconds in 20 pieces
    POST|PUT /upload                    reads the body (Content-Length or chunked), answers size and SHA-256
    GET anything else                   a short text naming the path
    """

    protocol_version = "HTTP/1.1"
    server_version = "origin"
    sys_version = ""

    def log_message(self, format, *args):  # noqa: A002 - quiet
        pass

    def handle(self):
        try:
            super().handle()
        except (ConnectionError, ssl.SSLError, TimeoutError, OSError):
            pass

    def _send_generated(self, size: int, chunked: bool, close: bool, pace: float = 0.0):
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif close:
            self.send_header("Connection", "close")
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(size))
        self.end_headers()
        pieces = 20 if pace else 0
        piece_size = max(1, size // pieces) if pieces else 0
        try:
            for block in generate(size):
                views = [block] if not pace else [block[i:i + piece_size] for i in range(0, len(block), piece_size)]
                for view in views:
                    if chunked:
                        self.wfile.write(b"%x\r\n" % len(view) + view + b"\r\n")
                    else:
                        self.wfile.write(view)
                    if pace:
                        time.sleep(pace / pieces)
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except (ConnectionError, ssl.SSLError, OSError):
            self.close_connection = True

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        parts = url.path.strip("/").split("/")
        if parts[0] == "gen" and len(parts) == 2:
            self._send_generated(int(parts[1]), "chunked" in query, "close" in query)
        elif parts[0] == "slow" and len(parts) == 2:
            self._send_generated(int(parts[1]), False, False, pace=float(query.get("seconds", ["2"])[0]))
        else:
            body = f"origin {self.command} {self.path}\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def _read_body(self, digest) -> tuple[int, list[str], list[str]]:
        size = 0
        extensions: list[str] = []
        trailers: list[str] = []
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline(65537).decode("latin-1").rstrip("\r\n")
                length_text, _, extension = line.partition(";")
                if extension:
                    extensions.append(extension)
                length = int(length_text.strip(), 16)
                if length == 0:
                    while True:
                        trailer = self.rfile.readline(65537)
                        if trailer in (b"\r\n", b"\n", b""):
                            break
                        trailers.append(trailer.decode("latin-1").rstrip("\r\n"))
                    break
                while length > 0:
                    data = self.rfile.read(min(length, MiB))
                    if not data:
                        raise ConnectionError("body cut short")
                    digest.update(data)
                    size += len(data)
                    length -= len(data)
                self.rfile.readline(3)
        else:
            remaining = int(self.headers.get("Content-Length", "0"))
            while remaining > 0:
                data = self.rfile.read(min(remaining, MiB))
                if not data:
                    raise ConnectionError("body cut short")
                digest.update(data)
                size += len(data)
                remaining -= len(data)
        return size, extensions, trailers

    def do_POST(self):
        digest = hashlib.sha256()
        size, extensions, trailers = self._read_body(digest)
        self.server.uploads.append(size)
        body = json.dumps(
            {"size": size, "sha256": digest.hexdigest(), "extensions": extensions, "trailers": trailers,
             "path": self.path}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = do_POST


class _OriginServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = False
    request_queue_size = 1024

    def __init__(self, tls: ssl.SSLContext | None):
        self.tls = tls
        self.uploads: list[int] = []
        super().__init__(("127.0.0.1", 0), _OriginHandler)

    def finish_request(self, request, client_address):
        # The TLS handshake runs in the connection's thread, not in the accepting one.
        if self.tls is None:
            return super().finish_request(request, client_address)
        try:
            request.settimeout(30)
            tls = self.tls.wrap_socket(request, server_side=True)
            tls.settimeout(None)
        except (ssl.SSLError, OSError):
            return
        # wrap_socket detached `request`, so the server's own shutdown_request cannot close it: close here.
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


class Origin:
    """A threaded HTTP (or HTTPS) origin server on 127.0.0.1."""

    def __init__(self, tls: ssl.SSLContext | None = None):
        self.server = _OriginServer(tls)
        self.port = self.server.server_address[1]
        self.scheme = "https" if tls else "http"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    @property
    def authority(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


# MARK: - Origin: raw echo


@dataclass
class RecordedRequest:
    connection: int
    head: bytes
    body: bytes  # exactly as received, chunk framing and trailers included
    method: str
    target: str


@dataclass
class _Canned:
    response: bytes
    close: bool


class EchoOrigin:
    """A raw-socket HTTP/1.1 origin that records the exact bytes of every request it receives.

    It answers `200` with the body `echo METHOD TARGET conn=N`, or with a raw response registered for a
    token that occurs in the target (`respond`). It keeps connections alive unless the request says
    `Connection: close` or the canned response asks for a close.
    """

    def __init__(self):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1024)
        self.port = self.listener.getsockname()[1]
        self.requests: list[RecordedRequest] = []
        self.canned: dict[str, _Canned] = {}
        self.condition = threading.Condition()
        self.connections = 0
        self.open_connections = 0
        self.running = True
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def authority(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def respond(self, token: str, response: bytes, close: bool = False) -> None:
        with self.condition:
            self.canned[token] = _Canned(response, close)

    def wait_request(self, token: str, timeout: float = 10.0) -> RecordedRequest:
        deadline = time.monotonic() + timeout
        with self.condition:
            while True:
                for request in self.requests:
                    if token in request.target or token.encode() in request.head:
                        return request
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"the echo origin received no request with {token!r}")
                self.condition.wait(remaining)

    def requests_with(self, token: str) -> list[RecordedRequest]:
        with self.condition:
            return [r for r in self.requests if token in r.target or token.encode() in r.head]

    def _accept(self):
        while self.running:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self.condition:
                self.connections += 1
                number = self.connections
            threading.Thread(target=self._serve, args=(sock, number), daemon=True).start()

    def _serve(self, sock: socket.socket, number: int):
        with self.condition:
            self.open_connections += 1
        reader = Reader(sock, timeout=120)
        try:
            while True:
                try:
                    head = reader.read_until(b"\r\n\r\n", limit=1 << 20)
                except (EOFError, OSError):
                    return
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                method, _, rest = request_line.partition(" ")
                target = rest.rpartition(" ")[0]
                fields = [line.decode("latin-1").partition(":") for line in head[:-4].split(b"\r\n")[1:]]
                names = {name.strip().lower(): value.strip() for name, _, value in fields}
                body = bytearray()
                try:
                    if "chunked" in names.get("transfer-encoding", "").lower():
                        while True:
                            line = reader.read_until(b"\r\n")
                            body += line
                            size = int(line.split(b";")[0].strip(), 16)
                            if size == 0:
                                while True:
                                    trailer = reader.read_until(b"\r\n")
                                    body += trailer
                                    if trailer == b"\r\n":
                                        break
                                break
                            body += reader.read_exact(size + 2)
                    elif "content-length" in names:
                        body += reader.read_exact(int(names["content-length"]))
                except (EOFError, OSError, ValueError):
                    return
                with self.condition:
                    self.requests.append(RecordedRequest(number, head, bytes(body), method, target))
                    self.condition.notify_all()
                    canned = next((c for token, c in self.canned.items() if token in target), None)
                if canned is not None:
                    sock.sendall(canned.response)
                    if canned.close:
                        return
                else:
                    text = f"echo {method} {target} conn={number}\n".encode()
                    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n"
                                 % len(text) + text)
                if "close" in names.get("connection", "").lower():
                    return
        except OSError:
            return
        finally:
            with self.condition:
                self.open_connections -= 1
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self):
        self.running = False
        self.listener.close()


# MARK: - tinyproxy


class Tinyproxy:
    """tinyproxy on 127.0.0.1 with Basic authentication, as the upstream proxy of proxyctl."""

    USER = "chain-user"
    PASSWORD = "chain-Secret-42"

    def __init__(self, workdir: Path, connect_ports: list[int]):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "tinyproxy.log"
        self.connect_ports = connect_ports
        self.process: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> "Tinyproxy":
        # tinyproxy cannot listen on port 0: take a port the kernel handed out, and retry if it was taken in
        # between.
        for _ in range(5):
            probe = socket.socket()
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
            probe.close()
            conf = self.workdir / "tinyproxy.conf"
            conf.write_text(
                "\n".join(
                    [
                        f"Port {self.port}",
                        "Listen 127.0.0.1",
                        "Timeout 120",
                        f'LogFile "{self.log_path}"',
                        "LogLevel Connect",
                        "MaxClients 200",
                        "Allow 127.0.0.1",
                        f"BasicAuth {self.USER} {self.PASSWORD}",
                        *[f"ConnectPort {port}" for port in self.connect_ports],
                    ]
                )
                + "\n"
            )
            self.log_path.write_text("")
            self.process = subprocess.Popen(["tinyproxy", "-d", "-c", str(conf)], stdout=subprocess.DEVNULL,
                                            stderr=subprocess.STDOUT, env=clean_env())

            def ready():
                if self.process.poll() is not None:
                    return "exited"
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    return "up"
                except OSError:
                    return None

            if poll(ready, 10, message="tinyproxy to listen") == "up":
                return self
        raise AssertionError(f"tinyproxy did not start: {self.log_path.read_text()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def url(self, user: str | None = USER, password: str | None = PASSWORD) -> str:
        credentials = f"{user}:{password}@" if user is not None else ""
        return f"http://{credentials}127.0.0.1:{self.port}"

    def stop(self):
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def wait_readable(sock: socket.socket, timeout: float) -> bool:
    readable, _, _ = select.select([sock], [], [], timeout)
    return bool(readable)


def fill(directory: Path) -> Path:
    """Writes a file in `directory` until the filesystem is full (to the last byte); returns it."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def run_proxyctl(workdir: Path, *args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    """Runs proxyctl to completion with a private HOME and XDG directories; output is text."""
    home = workdir / "run-home"
    home.mkdir(parents=True, exist_ok=True)
    env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"))
    env.pop("PROXYCTL_CONFIG", None)
    return subprocess.run([proxyctl_bin(), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=workdir, stdin=subprocess.DEVNULL)
