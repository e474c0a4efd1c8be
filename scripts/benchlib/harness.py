"""The bench's processes: every child in its own session and ended on exit (`Processes`), the origin (nginx
serving a bulk and a small file over HTTPS and HTTP, https://bench.test, the protected origin, which also takes
POSTs, and https://bench-h2.test, the same files from a listener that offers HTTP/2), the passthrough proxies
(proxyctl, tinyproxy, squid) and the intercept targets (proxyctl with a Bearer and with a DPoP token, nginx as a
TLS-terminating reverse proxy, mitmproxy with an addon). With a baseline binary (BENCH_BASELINE),
`proxyctl-before` runs wherever proxyctl does: as a passthrough proxy and as a Bearer intercept target, started
by the same functions. Everything listens on 127.0.0.1 (the protected origins: port 443 of other loopback
addresses) on ports the OS picked.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from fixtures import config
from fixtures.http import free_port
from fixtures.jose import DPoPError, b64url, key_file_thumbprint, verify_dpop_proof
from fixtures.pki import CertificateAuthority, ServerIdentity, new_key_pem
from fixtures.proxy import clean_env

PEERS = ("proxyctl", "tinyproxy", "squid")
TARGETS = ("direct",) + PEERS
INTERCEPT_PEERS = ("proxyctl", "proxyctl-dpop", "nginx", "mitmproxy")
INTERCEPT_TARGETS = ("direct",) + INTERCEPT_PEERS
RATE_TARGETS = ("direct", "proxyctl", "proxyctl-dpop", "nginx")  # mitmproxy cannot sustain row 6b's rate
# Row 6d (an origin that offers HTTP/2): mitmproxy speaks to the origin what the client spoke to it (HTTP/1.1 from
# hey), so it would only repeat row 6, some 50 times slower.
H2_TARGETS = ("direct", "proxyctl", "proxyctl-dpop", "nginx")
# The BENCH_BASELINE binary: started as proxyctl is (passthrough, and intercept with a Bearer token).
BASELINE = "proxyctl-before"
INTERCEPT_LABELS = {
    "direct": "direct",
    "proxyctl": "proxyctl (Bearer)",
    BASELINE: f"{BASELINE} (Bearer)",
    "proxyctl-dpop": "proxyctl (DPoP)",
    "nginx": "nginx (reverse proxy)",
    "mitmproxy": "mitmproxy",
}
BENCH_HOST = "bench.test"
# The protected origin of row 6d: the same files as bench.test, from a listener with `http2` (ALPN h2). Not a
# subdomain of bench.test: proxyctl's local CA excludes the subdomains of each protected host (`.bench.test`), and
# an excluded subtree wins over a permitted one, so it would sign no leaf for h2.bench.test.
H2_HOST = "bench-h2.test"
# Row 6c's request body (application/octet-stream; base64 characters, so that /upload-echo's answer is text).
POST_BYTES = 4096
PROVIDER = "bench"
# Never contacted: the tokens are written straight into proxyctl's token store and outlive the run, so
# nothing is refreshed (a refresh would fail on this name, and the bench with it).
ISSUER = "https://idp.bench.test"
CLIENT_ID = "proxyctl-bench"
# The clients' environment (curl, hey): no proxy variable of the user's.
CLIENT_ENV = clean_env()


def with_baseline(names: tuple[str, ...], baseline: bool) -> tuple[str, ...]:
    """`names` (targets of some rows) with BASELINE right after proxyctl when the run has a baseline binary, so
    that each round measures the two binaries one right after the other (`round_order` swaps them every other
    round); `names` unchanged otherwise."""
    if not baseline:
        return names
    after = names.index("proxyctl") + 1
    return names[:after] + (BASELINE,) + names[after:]


def proxyctl_keys() -> dict[str, str]:
    """Extra [proxy] keys for the proxyctl under test only, never the baseline (BENCH_PROXYCTL_KEYS, as
    `key=value;key=value`): a setting's cost as a row of its own, say `audit_max_size=0` against the default,
    with BENCH_BASELINE the same binary."""
    keys: dict[str, str] = {}
    for pair in os.environ.get("BENCH_PROXYCTL_KEYS", "").split(";"):
        if not pair.strip():
            continue
        key, equals, value = pair.partition("=")
        if not equals or not key.strip():
            raise BenchError(f"BENCH_PROXYCTL_KEYS: {pair!r} is not key=value")
        keys[key.strip()] = value.strip()
    return keys


def log(message: str) -> None:
    """A progress line on stderr."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


class BenchError(Exception):
    """Something that makes the run's figures worthless: the bench stops and says what."""


def run(argv: list[str], timeout: float = 600, env: dict[str, str] | None = None) -> str:
    """Runs a command to completion; its stdout, or BenchError with its stderr."""
    result = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, env=env
    )
    if result.returncode != 0:
        raise BenchError(f"{shlex.join(argv)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return result.stdout


def write_private(path: Path, text: str) -> None:
    """Writes `text` to a file only its owner can read (0600 from the start)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


# MARK: - Processes


class Processes:
    """Every child started by the harness, ended in reverse order on exit."""

    def __init__(self, pid_file: Path | None = None) -> None:
        self.children: list[subprocess.Popen] = []
        self.pid_file = pid_file

    def start(self, argv: list[str], *, stdout=None, stderr=None, env=None) -> subprocess.Popen:
        """Starts `argv` in a session of its own (so that its helpers end with it)."""
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=stdout if stdout is not None else subprocess.DEVNULL,
            stderr=stderr if stderr is not None else subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self.children.append(child)
        if self.pid_file is not None:
            # scripts/bench ends these process groups too, should the harness itself die.
            with open(self.pid_file, "a") as out:
                out.write(f"{child.pid}\n")
        return child

    def stop(self, child: subprocess.Popen, timeout: float = 10.0) -> None:
        """SIGTERM to the child's process group, SIGKILL after `timeout`, and to any helper left over."""
        if child.poll() is None:
            # Each child leads its own process group: squid's log daemon and nginx's workers go with it.
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.wait(5)
        # Helpers that outlived their leader (same process group) go too.
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        """Stops every child still known, the last started first."""
        for child in reversed(list(self.children)):
            try:
                self.stop(child, timeout=5.0)
            except Exception as error:  # keep going: everything must be ended
                log(f"could not stop pid {child.pid}: {error}")


def wait_for_port(port: int, child: subprocess.Popen, name: str, timeout: float = 20.0,
                  address: str = "127.0.0.1") -> None:
    """Waits until `child` accepts connections on `address`:`port`; BenchError if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise BenchError(f"{name} exited with status {child.returncode} before listening on {port}")
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"{name} did not listen on {address}:{port} within {timeout:.0f}s")


def wait_for_log(child: subprocess.Popen, log_path: Path, pattern: str, name: str, timeout: float = 20.0) -> re.Match:
    """Waits until `pattern` appears in the log file a child writes; BenchError if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        match = re.search(pattern, log_path.read_text(errors="replace"))
        if match:
            return match
        if child.poll() is not None:
            raise BenchError(f"{name} exited ({child.returncode}): {log_path.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise BenchError(f"{name} did not print its listening address")
        time.sleep(0.05)


# MARK: - The origin: nginx with TLS and plain HTTP, files on tmpfs


def start_nginx(processes: Processes, work: Path, http: str) -> subprocess.Popen:
    """nginx in the foreground with its configuration, pid, logs and temp files in `work`: the settings both
    nginx of the bench share (workers per core, no access log, long keep-alive, no TLS session resumption)
    and `http`, the rest of its http block (its servers)."""
    conf = work / "nginx.conf"
    conf.write_text(f"""
daemon off;
master_process on;
worker_processes auto;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    keepalive_timeout 120s;
    keepalive_requests 1000000;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache off;
    ssl_session_tickets off;
{http}}}
""")
    return processes.start(["nginx", "-e", str(work / "error.log"), "-p", str(work), "-c", str(conf)],
                           stderr=open(work / "stderr.log", "wb"))


@dataclass
class Certificates:
    """The bench's test CA and the two leaves it issued: 127.0.0.1 (rows 1-4) and bench.test (rows 6-8)."""
    origin: ServerIdentity
    bench: ServerIdentity

    @property
    def ca(self) -> Path:
        return self.origin.ca_pem


def make_certificates(directory: Path) -> Certificates:
    """A test CA and its leaves, for localhost and 127.0.0.1 and for bench.test and bench-h2.test (the protected
    origins need a host name and a CA that proxyctl's `ca_file` and nginx's `proxy_ssl_trusted_certificate` can
    trust). The keys are readable by all: nginx's workers read them as an unprivileged user."""
    ca = CertificateAuthority.make("proxyctl bench test CA")
    return Certificates(ca.issue(directory, ["localhost", "127.0.0.1"], stem="origin", key_mode=0o644),
                        ca.issue(directory, [BENCH_HOST, H2_HOST], stem="bench", key_mode=0o644))


@dataclass
class Origin:
    """Where the origin listens and what it serves."""
    https_port: int
    http_port: int
    ca: Path  # the CA of both its certificates
    bulk_bytes: int
    small_bytes: int
    # The intercept path's origin: https://bench.test on port 443 of bench_address.
    bench_address: str = ""
    bench_port: int = 443
    # Row 6d's origin: https://bench-h2.test on port 443 of h2_address, offering HTTP/2; its access log has
    # each request's protocol (`$server_protocol`), one line per request.
    h2_address: str = ""
    h2_log: Path | None = None


def prepare_www(directory: Path, bulk_bytes: int, small_bytes: int) -> tuple[Path, str]:
    """The origin's files (bulk.bin, small.txt) on a tmpfs when the bench runs as root; (directory, what
    storage it is)."""
    www = directory / "www"
    www.mkdir()
    storage = "plain directory (page cache)"
    if os.geteuid() == 0:
        size = bulk_bytes + (64 << 20)
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "proxyctl-bench", str(www)],
            capture_output=True,
        )
        if mounted.returncode == 0:
            storage = "tmpfs"
    www.chmod(0o755)
    # Incompressible bytes; a 4 MiB random block repeated is as good as 1 GiB of random for TLS and copies.
    block = os.urandom(4 << 20)
    with open(www / "bulk.bin", "wb") as out:
        remaining = bulk_bytes
        while remaining > 0:
            chunk = block[: min(len(block), remaining)]
            out.write(chunk)
            remaining -= len(chunk)
    (www / "small.txt").write_bytes(b"x" * (small_bytes - 1) + b"\n")
    for path in www.iterdir():
        path.chmod(0o644)
    return www, storage


def free_loopback_443(taken: tuple[str, ...] = ()) -> str:
    """A loopback address (127.0.0.0/8) whose port 443 is free, and not one of `taken`: a protected origin's.

    It must be the default port: hey sends the Host field, port included, as the TLS server name
    (`ServerName: b.Request.Host`), and proxyctl answers an SNI of `bench.test:PORT` with 421 Misdirected
    Request. With the origin on 443 both are plain `bench.test`. Port 443 needs root (or
    CAP_NET_BIND_SERVICE); the address is picked at random and checked, so other work's ports are safe.
    """
    rng = random.SystemRandom()
    for _ in range(50):
        address = f"127.{rng.randint(64, 254)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
        if address in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 443))
                return address
            except PermissionError:
                raise BenchError("the intercept rows' origin listens on port 443 (see free_loopback_443): "
                                 "run the bench as root, or give python and nginx CAP_NET_BIND_SERVICE")
            except OSError:
                continue
    raise BenchError("found no loopback address with port 443 free")


def start_origin(processes: Processes, directory: Path, www: Path, certificates: Certificates,
                 sizes: tuple[int, int]) -> Origin:
    """nginx serving `www`: https and http on 127.0.0.1, https://bench.test on port 443 of a loopback address of
    its own, with /headers echoing what a request arrived with and /upload taking POSTs (row 6c), and
    https://bench-h2.test on port 443 of another, offering HTTP/2 (row 6d) and logging each request's protocol."""
    https_port, http_port = free_port(), free_port()
    bench_address, bench_port = free_loopback_443(), 443
    h2_address = free_loopback_443(taken=(bench_address,))
    nginx_dir = directory / "nginx"
    nginx_dir.mkdir()
    nginx_dir.chmod(0o777)
    h2_log = nginx_dir / "h2-access.log"
    headers = 'return 200 "authorization=$http_authorization\\ndpop=$http_dpop\\nhost=$http_host\\n'
    child = start_nginx(processes, nginx_dir, f"""
    sendfile on;
    tcp_nopush on;
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{https_port} ssl;
        ssl_certificate {certificates.origin.cert_pem};
        ssl_certificate_key {certificates.origin.key_pem};
        root {www};
    }}
    server {{
        listen 127.0.0.1:{http_port};
        root {www};
    }}
    # The protected origin of the intercept rows: same files, a bench.test leaf from the test CA, and
    # /headers echoing what a request arrived with (checked once per target).
    server {{
        listen {bench_address}:{bench_port} ssl;
        server_name {BENCH_HOST};
        ssl_certificate {certificates.bench.cert_pem};
        ssl_certificate_key {certificates.bench.key_pem};
        root {www};
        location = /headers {{
            default_type text/plain;
            {headers}";
        }}
        # Row 6c's POSTs. A static file answers no POST (405), and `return` would discard the body unread into
        # any variable; the mirror module reads the whole body (into memory: client_body_buffer_size) before the
        # content phase, whose static handler finds no file, and error_page answers with /small.txt as a GET:
        # the same answer as row 6's, after the body was read whole (a short body would never be answered).
        location = /upload {{
            client_body_buffer_size 64k;
            mirror /upload-read;
            log_not_found off;
            error_page 404 = /small.txt;
        }}
        # The same, answering with what arrived, body included (checked once per target).
        location = /upload-echo {{
            client_body_buffer_size 64k;
            mirror /upload-read;
            log_not_found off;
            error_page 404 = @upload-echo;
        }}
        location = /upload-read {{
            internal;
            return 204;
        }}
        location @upload-echo {{
            default_type text/plain;
            {headers}length=$content_length\\nbody=$request_body";
        }}
    }}
    # Row 6d's origin: the same files and /headers (with the protocol) on a listener that offers HTTP/2 by ALPN,
    # so that a client that offers h2 (proxyctl's own) speaks HTTP/2 to it; every request's protocol goes to its
    # access log, which the bench reads after each sample.
    log_format bench_protocol '$server_protocol $request_method $status';
    server {{
        listen {h2_address}:443 ssl http2;
        server_name {H2_HOST};
        ssl_certificate {certificates.bench.cert_pem};
        ssl_certificate_key {certificates.bench.key_pem};
        root {www};
        access_log {h2_log} bench_protocol buffer=64k flush=100ms;
        location = /headers {{
            default_type text/plain;
            {headers}protocol=$server_protocol\\n";
        }}
    }}
""")
    wait_for_port(https_port, child, "nginx")
    wait_for_port(http_port, child, "nginx")
    wait_for_port(bench_port, child, "nginx", address=bench_address)
    wait_for_port(443, child, "nginx", address=h2_address)
    return Origin(https_port, http_port, certificates.ca, sizes[0], sizes[1], bench_address, bench_port,
                  h2_address, h2_log)


# MARK: - The passthrough proxies, each with a temp config, logging as it does by default (to a file here)


@dataclass
class Proxy:
    """A running passthrough proxy."""
    name: str
    port: int
    child: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.child.pid


class Proxies:
    """Starts proxyctl, tinyproxy and squid (and proxyctl-before, with a baseline binary) as forward proxies, each
    in a directory of its own."""

    def __init__(self, processes: Processes, directory: Path, proxyctl: str, baseline: str | None = None) -> None:
        self.processes = processes
        self.directory = directory
        self.proxyctl = proxyctl
        self.baseline = baseline
        self.serial = 0

    @property
    def peers(self) -> tuple[str, ...]:
        """The passthrough peers of this run: PEERS, with BASELINE when there is a baseline binary."""
        return with_baseline(PEERS, self.baseline is not None)

    def _dir(self, name: str) -> Path:
        self.serial += 1
        path = self.directory / f"{name}-{self.serial}"
        path.mkdir()
        # squid and tinyproxy drop root for an unprivileged user that must write its logs here.
        path.chmod(0o777)
        return path

    def start(self, name: str) -> Proxy:
        """A fresh instance of the peer `name` (one of `peers`), listening."""
        if name == "proxyctl":
            return self._start_proxyctl(self._dir(name), self.proxyctl, name)
        if name == BASELINE and self.baseline is not None:
            return self._start_proxyctl(self._dir(name), self.baseline, name)
        if name == "tinyproxy":
            return self._start_tinyproxy(self._dir(name))
        if name == "squid":
            return self._start_squid(self._dir(name))
        raise BenchError(f"no passthrough peer {name}")

    def stop(self, proxy: Proxy) -> None:
        self.processes.stop(proxy.child, timeout=15)

    def _start_proxyctl(self, work: Path, binary: str, name: str) -> Proxy:
        """The proxyctl binary `binary` as the forward proxy `name` (proxyctl, or BASELINE)."""
        conf = work / "proxy.conf"
        extra = proxyctl_keys() if name != BASELINE else {}
        conf.write_text(config.proxy(listen="127.0.0.1:0", log_level="info", **extra))
        log_path = work / "proxyctl.log"
        env = dict(os.environ, XDG_CONFIG_HOME=str(work), HOME=str(work))
        env.pop("PROXYCTL_CONFIG", None)
        child = self.processes.start(
            [binary, "serve", "--config", str(conf), "--listen", "127.0.0.1:0"],
            stderr=open(log_path, "wb"),
            env=env,
        )
        port = int(wait_for_log(child, log_path, r"listening on http://127\.0\.0\.1:(\d+)", name).group(1))
        wait_for_port(port, child, name)
        return Proxy(name, port, child, log_path)

    def _start_tinyproxy(self, work: Path) -> Proxy:
        port = free_port()
        conf = work / "tinyproxy.conf"
        log_path = work / "tinyproxy.log"
        user = "User nobody\nGroup nogroup\n" if os.geteuid() == 0 else ""
        # Debian's defaults otherwise (LogLevel Info, Via header on); no ConnectPort line lets CONNECT reach
        # any port; MaxClients covers the 1,000 idle tunnels.
        conf.write_text(f"""{user}Port {port}
Listen 127.0.0.1
Timeout 600
LogFile "{log_path}"
LogLevel Info
PidFile "{work}/tinyproxy.pid"
MaxClients 2000
Allow 127.0.0.1
ViaProxyName "tinyproxy"
""")
        return self._started("tinyproxy", port, ["tinyproxy", "-d", "-c", str(conf)], work, log_path)

    def _start_squid(self, work: Path) -> Proxy:
        port = free_port()
        conf = work / "squid.conf"
        log_path = work / "access.log"
        # No caching at all; access_log keeps squid's default module (daemon: a log_file_daemon helper,
        # whose CPU and memory are counted with squid's). CONNECT may reach any port of 127.0.0.1.
        conf.write_text(f"""http_port 127.0.0.1:{port}
acl localhost src 127.0.0.1/32
http_access allow localhost
http_access deny all
cache deny all
cache_mem 0 MB
access_log daemon:{log_path} squid
cache_log {work}/cache.log
cache_store_log none
pid_filename {work}/squid.pid
coredump_dir {work}
netdb_filename none
pinger_enable off
max_filedescriptors 16384
shutdown_lifetime 0 seconds
visible_hostname localhost
""")
        return self._started("squid", port, ["squid", "-N", "-f", str(conf)], work, log_path)

    def _started(self, name: str, port: int, argv: list[str], work: Path, log_path: Path) -> Proxy:
        """Starts `argv` (stderr to a file in `work`) and waits until it listens on `port`."""
        child = self.processes.start(argv, stderr=open(work / "stderr.log", "wb"))
        wait_for_port(port, child, name)
        return Proxy(name, port, child, log_path)


# MARK: - The intercept path: a protected origin whose requests get a token attached


def fake_access_token(now: int) -> str:
    """A JWT-shaped access token of a typical provider's length (about 900 bytes). Nobody verifies it."""
    header = {"alg": "RS256", "typ": "at+jwt", "kid": "bench-key-1"}
    claims = {
        "iss": ISSUER, "sub": "3f6c1a52-bench-user", "aud": f"https://{BENCH_HOST}", "client_id": CLIENT_ID,
        "scope": "openid profile email api.read api.write", "iat": now, "nbf": now, "exp": now + 30 * 86400,
        "auth_time": now, "jti": b64url(os.urandom(16)), "sid": b64url(os.urandom(16)), "acr": "1", "amr": ["pwd"],
        "name": "Bench User", "preferred_username": "bench", "email": "bench@example.com",
    }

    def encode(value: dict) -> str:
        return b64url(json.dumps(value, separators=(",", ":")).encode())

    return f"{encode(header)}.{encode(claims)}.{b64url(os.urandom(256))}"


@dataclass
class DPoPKey:
    """The DPoP key of the proxyctl (DPoP) target."""
    path: Path  # PKCS#8 PEM, where proxyctl reads it
    thumbprint: str  # RFC 7638


@dataclass
class H2Route:
    """How the clients reach row 6d's origin (https://bench-h2.test) through one target, and the protocol the origin
    must see its requests arrive in."""
    hey_base: str  # URL without the path (hey's other arguments are the target's hey_args)
    curl_args: list[str]
    curl_base: str
    # nginx's $server_protocol: "HTTP/2.0" from proxyctl's own client, "HTTP/1.1" from the others. None for the
    # baseline binary, which may predate HTTP/2 to origins: what the first request shows (check_h2_origin), held
    # from then on.
    protocol: str | None


@dataclass
class InterceptTarget:
    """How the clients reach the protected origin through one target, and whose CPU counts."""

    name: str
    child: subprocess.Popen | None  # None: direct
    hey_args: list[str]  # e.g. ["-x", proxy]
    hey_base: str  # URL without the path
    curl_args: list[str]
    curl_base: str
    curl_env: dict
    expect_authorization: str | None  # "Bearer" or "DPoP", checked once at /headers
    details: dict = field(default_factory=dict)
    h2: H2Route | None = None  # None: the target does not run row 6d

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child else None


@dataclass
class InterceptSetup:
    """What every intercept target shares: the origin, the token, the bench.test certificate and row 6c's body."""
    origin: Origin
    token: str
    bench: ServerIdentity
    mitmdump: str
    post_body: Path


def write_post_body(directory: Path) -> Path:
    """Row 6c's request body: POST_BYTES of base64 characters from random bytes (incompressible enough, and
    text, so that the origin's echo of it can be compared), in `directory`."""
    path = directory / "post-body.txt"
    path.write_bytes(base64.b64encode(os.urandom(POST_BYTES * 3 // 4))[:POST_BYTES])
    return path


class InterceptTargets:
    """Starts the intercept targets (INTERCEPT_TARGETS, and BASELINE with a baseline binary), each in a directory
    of its own."""

    def __init__(self, processes: Processes, directory: Path, proxyctl: str, setup: InterceptSetup,
                 baseline: str | None = None) -> None:
        self.processes = processes
        self.directory = directory
        self.proxyctl = proxyctl
        self.baseline = baseline
        self.setup = setup
        self.dpop: DPoPKey | None = None
        # Protected origins besides https://bench.test and https://bench-h2.test for the proxyctl targets started
        # from now on (the WebSocket echo server of the protocols rows).
        self.extra_origins: list[str] = []

    @property
    def names(self) -> tuple[str, ...]:
        """The targets of rows 6-8 in this run: INTERCEPT_TARGETS, with BASELINE when there is a baseline binary."""
        return with_baseline(INTERCEPT_TARGETS, self.baseline is not None)

    @property
    def rate_names(self) -> tuple[str, ...]:
        """The targets of row 6b in this run: RATE_TARGETS, with BASELINE when there is a baseline binary."""
        return with_baseline(RATE_TARGETS, self.baseline is not None)

    @property
    def origin_url(self) -> str:
        return f"https://{BENCH_HOST}"  # port 443

    @property
    def h2_url(self) -> str:
        return f"https://{H2_HOST}"  # port 443

    @property
    def h2_names(self) -> tuple[str, ...]:
        """The targets of row 6d in this run: H2_TARGETS, with BASELINE when there is a baseline binary."""
        return with_baseline(H2_TARGETS, self.baseline is not None)

    def _dir(self, name: str) -> Path:
        path = self.directory / f"intercept-{name}"
        path.mkdir()
        path.chmod(0o777)  # nginx's workers run unprivileged and write their temp files here
        return path

    def start(self, name: str) -> InterceptTarget:
        """The target `name`, running (direct: just how to reach the origin)."""
        if name == "direct":
            origin = self.setup.origin
            # hey speaks HTTP/1.1 unless told -h2, and so does curl here, to check what hey gets.
            h2 = H2Route(f"https://{origin.h2_address}",
                         ["--noproxy", "*", "--http1.1", "--cacert", str(origin.ca),
                          "--resolve", f"{H2_HOST}:443:{origin.h2_address}"], self.h2_url, "HTTP/1.1")
            return InterceptTarget(
                "direct", None, [], f"https://{origin.bench_address}",
                ["--noproxy", "*", "--cacert", str(origin.ca),
                 "--resolve", f"{BENCH_HOST}:{origin.bench_port}:{origin.bench_address}"],
                self.origin_url, CLIENT_ENV, None, h2=h2)
        if name == "proxyctl":
            return self._start_proxyctl(self._dir(name), "bearer", self.proxyctl, name)
        if name == BASELINE and self.baseline is not None:
            return self._start_proxyctl(self._dir(name), "bearer", self.baseline, name)
        if name == "proxyctl-dpop":
            return self._start_proxyctl(self._dir(name), "dpop", self.proxyctl, name)
        if name == "nginx":
            return self._start_nginx(self._dir(name))
        if name == "mitmproxy":
            return self._start_mitmproxy(self._dir(name))
        raise BenchError(f"no intercept target {name}")

    def _start_proxyctl(self, work: Path, binding: str, binary: str, name: str) -> InterceptTarget:
        """The proxyctl binary `binary` as the intercept target `name`, with a token bound as `binding` ("bearer"
        or "dpop"): its own state_dir, local CA and token store, set up as a user would have them."""
        origin = self.setup.origin
        state = work / "state"
        port = free_port()
        conf = work / "proxy.conf"
        extra = proxyctl_keys() if name != BASELINE else {}
        conf.write_text(config.proxy(listen=f"127.0.0.1:{port}", log_level="info", state_dir=state,
                                     resolve=f"{BENCH_HOST}={origin.bench_address},{H2_HOST}={origin.h2_address}",
                                     **extra)
                        + config.provider(PROVIDER, ISSUER, client_id=CLIENT_ID, scopes="openid",
                                          token_binding=binding)
                        + config.origin(self.origin_url, PROVIDER, ca_file=origin.ca)
                        + config.origin(self.h2_url, PROVIDER, ca_file=origin.ca)
                        + "".join(config.origin(url, PROVIDER, ca_file=origin.ca) for url in self.extra_origins))
        env = dict(os.environ, XDG_CONFIG_HOME=str(work), XDG_STATE_HOME=str(work), HOME=str(work))
        env.pop("PROXYCTL_CONFIG", None)
        run([binary, "ca", "init", "--config", str(conf)], env=env)
        # The tokens, as `proxyctl login` would have stored them (TokenSet's JSON, version 1).
        now = int(time.time())
        tokens = {
            "version": 1, "provider": PROVIDER, "issuer": ISSUER, "client_id": CLIENT_ID,
            "token_type": "DPoP" if binding == "dpop" else "Bearer", "access_token": self.setup.token,
            "issued_at": now, "expires_at": now + 30 * 86400, "refresh_token": b64url(os.urandom(32)),
            "scope": "openid", "generation": 1,
        }
        details = {}
        if binding == "dpop":
            keys = state / "keys"
            keys.mkdir(mode=0o700, exist_ok=True)
            key = keys / f"{PROVIDER}.dpop.pem"
            write_private(key, new_key_pem().decode())
            self.dpop = DPoPKey(key, key_file_thumbprint(key))
            tokens["dpop_jkt"] = self.dpop.thumbprint
            details["thumbprint"] = self.dpop.thumbprint
        (state / "tokens").mkdir(mode=0o700, exist_ok=True)
        write_private(state / "tokens" / f"{PROVIDER}.json", json.dumps(tokens, indent=2))
        status = json.loads(run([binary, "status", "--config", str(conf), "--json"], env=env))
        signed_in = [p for p in status.get("providers", []) if p.get("provider") == PROVIDER]
        if not signed_in or not signed_in[0].get("signed_in"):
            raise BenchError(f"{name} does not take the bench's token file: {status}")
        # What a user would do: eval "$(proxyctl env)". The clients take the proxy and the CA bundle from it.
        exported = dict(re.findall(r"^export ([A-Z_a-z0-9]+)='([^']*)';?$",
                                   run([binary, "env", "--config", str(conf)], env=env), re.M))
        if "HTTPS_PROXY" not in exported or "CURL_CA_BUNDLE" not in exported:
            raise BenchError(f"{name}: proxyctl env printed no HTTPS_PROXY or CURL_CA_BUNDLE: {exported}")
        log_path = work / "proxyctl.log"
        child = self.processes.start([binary, "serve", "--config", str(conf)],
                                     stderr=open(log_path, "wb"), env=env)
        wait_for_log(child, log_path, rf"listening on http://127\.0\.0\.1:{port}\b", f"{name} ({binding})")
        wait_for_port(port, child, name)
        curl_env = dict(CLIENT_ENV, HTTPS_PROXY=exported["HTTPS_PROXY"], CURL_CA_BUNDLE=exported["CURL_CA_BUNDLE"])
        details["log"] = str(log_path)
        # Its own client offers h2 to an https origin. A binary from before issue 28 sent a bodiless GET through its
        # own HTTP/1.1 client, and anything else through libcurl, which offered h2: the baseline is held to what it
        # is seen to speak, proxyctl to HTTP/2.
        h2 = H2Route(self.h2_url, [], self.h2_url, None if name == BASELINE else "HTTP/2.0")
        return InterceptTarget(
            name, child, ["-x", exported["HTTPS_PROXY"]],
            self.origin_url, [], self.origin_url, curl_env, "DPoP" if binding == "dpop" else "Bearer", details, h2)

    def start_protocols_proxyctl(self) -> InterceptTarget:
        """proxyctl (Bearer) for the protocols rows, with the extra origins, in a directory of its own."""
        return self._start_proxyctl(self._dir("protocols"), "bearer", self.proxyctl, "proxyctl")

    def _start_nginx(self, work: Path) -> InterceptTarget:
        origin = self.setup.origin
        port, h2_port = free_port(), free_port()

        def reverse_proxy(listen_port: int, upstream: str, address: str, host: str) -> str:
            # The C reference: TLS terminated with the bench leaf, the header added, re-encrypted to the origin
            # over kept-alive, verified connections. Request bodies (row 6c) and responses stay in memory buffers
            # (no temp files).
            return f"""
    upstream {upstream} {{
        server {address}:443;
        keepalive 128;
        keepalive_requests 1000000;
        keepalive_timeout 120s;
    }}
    server {{
        listen 127.0.0.1:{listen_port} ssl;
        server_name {host};
        ssl_certificate {self.setup.bench.cert_pem};
        ssl_certificate_key {self.setup.bench.key_pem};
        client_body_buffer_size 64k;
        location / {{
            proxy_pass https://{upstream};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host {host};
            proxy_set_header Authorization "Bearer {self.setup.token}";
            proxy_ssl_server_name on;
            proxy_ssl_name {host};
            proxy_ssl_verify on;
            proxy_ssl_trusted_certificate {origin.ca};
            proxy_ssl_session_reuse on;
            proxy_max_temp_file_size 0;
        }}
    }}
"""

        # Row 6d through nginx: its proxy module speaks HTTP/1.x to upstreams whatever they offer (HTTP/2 only
        # for gRPC), so this is the same work as row 6 against the h2 origin: the C reference for proxyctl's h2.
        child = start_nginx(self.processes, work,
                            reverse_proxy(port, "protected_origin", origin.bench_address, BENCH_HOST)
                            + reverse_proxy(h2_port, "protected_h2_origin", origin.h2_address, H2_HOST))
        wait_for_port(port, child, "nginx (reverse proxy)")
        wait_for_port(h2_port, child, "nginx (reverse proxy)")
        h2 = H2Route(f"https://127.0.0.1:{h2_port}",
                     ["--noproxy", "*", "--cacert", str(origin.ca), "--resolve", f"{H2_HOST}:{h2_port}:127.0.0.1"],
                     f"https://{H2_HOST}:{h2_port}", "HTTP/1.1")
        return InterceptTarget(
            "nginx", child, [], f"https://127.0.0.1:{port}",
            ["--noproxy", "*", "--cacert", str(origin.ca), "--resolve", f"{BENCH_HOST}:{port}:127.0.0.1"],
            f"https://{BENCH_HOST}:{port}", CLIENT_ENV, "Bearer", {"config": str(work / "nginx.conf")}, h2)

    def _start_mitmproxy(self, work: Path) -> InterceptTarget:
        origin = self.setup.origin
        port = free_port()
        confdir = work / "conf"
        token_file = work / "token"
        write_private(token_file, self.setup.token)
        addon = work / "add_bearer.py"
        addon.write_text(MITMPROXY_ADDON)
        env = dict(CLIENT_ENV, HOME=str(work), BENCH_TOKEN_FILE=str(token_file),
                   BENCH_RESOLVE=f"{BENCH_HOST}={origin.bench_address}",
                   BENCH_PROTECTED=f"{BENCH_HOST}:{origin.bench_port}")
        log_path = work / "mitmdump.log"
        child = self.processes.start(
            [self.setup.mitmdump, "--listen-host", "127.0.0.1", "--listen-port", str(port),
             "--set", f"confdir={confdir}", "--set", f"ssl_verify_upstream_trusted_ca={origin.ca}",
             "--set", "stream_large_bodies=1m", "-s", str(addon)],
            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env)
        wait_for_port(port, child, "mitmdump", timeout=60)
        ca = confdir / "mitmproxy-ca-cert.pem"
        if not ca.exists():
            raise BenchError(f"mitmproxy made no CA in {confdir}")
        proxy = f"http://127.0.0.1:{port}"
        return InterceptTarget("mitmproxy", child, ["-x", proxy], self.origin_url,
                               ["-x", proxy, "--cacert", str(ca)], self.origin_url, CLIENT_ENV, "Bearer",
                               {"log": str(log_path), "addon": str(addon)})


# mitmproxy's addon: the header for the protected origin, and bench.test resolved to the origin (mitmproxy has
# no resolve option; the address is changed just before it connects, the SNI and Host stay bench.test).
MITMPROXY_ADDON = '''"""proxyctl bench: adds Authorization: Bearer to requests for the protected origin."""
import os

from mitmproxy import http

TOKEN = open(os.environ["BENCH_TOKEN_FILE"]).read().strip()
RESOLVE = dict(pair.split("=", 1) for pair in os.environ.get("BENCH_RESOLVE", "").split(",") if pair)
PROTECTED = os.environ["BENCH_PROTECTED"]


class AddBearer:
    def server_connect(self, data):
        host, port = data.server.address
        if host in RESOLVE:
            data.server.address = (RESOLVE[host], port)

    def request(self, flow: http.HTTPFlow) -> None:
        # pretty_host: the Host field (request.host is the address connected to, 127.0.0.1 by then).
        if f"{flow.request.pretty_host}:{flow.request.port}" == PROTECTED:
            flow.request.headers["Authorization"] = "Bearer " + TOKEN


addons = [AddBearer()]
'''


def check_headers(target: InterceptTarget, targets: InterceptTargets, token: str) -> str:
    """One request to /headers through the target: the origin must see the token (and, for DPoP, a proof that
    fixtures.jose verifies: its claims, its ES256 signature and the key in state_dir/keys). What it saw."""
    output = run(["curl", "-sS", "--fail", *target.curl_args, target.curl_base + "/headers"], env=target.curl_env)
    return _check_credentials(target, targets, token, _fields(output), "GET", f"{targets.origin_url}/headers")


def check_post(target: InterceptTarget, targets: InterceptTargets, token: str) -> str:
    """One POST of row 6c's body to /upload-echo through the target: the origin must see the token (and a DPoP
    proof for POST) as at /headers, and the body byte for byte. What it saw."""
    body = targets.setup.post_body.read_text()
    output = run(["curl", "-sS", "--fail", *target.curl_args, "-H", "Content-Type: application/octet-stream",
                  "--data-binary", f"@{targets.setup.post_body}", target.curl_base + "/upload-echo"],
                 env=target.curl_env)
    seen = _fields(output)
    credentials = _check_credentials(target, targets, token, seen, "POST", f"{targets.origin_url}/upload-echo")
    if seen.get("body") != body:
        raise BenchError(f"via {target.name} the origin read a body of {len(seen.get('body', ''))} bytes "
                         f"(Content-Length {seen.get('length')!r}), not the {len(body)} bytes sent")
    return f"{credentials}; the {len(body):,}-byte body read whole (Content-Length {seen.get('length')})"


def check_h2_origin(target: InterceptTarget, targets: InterceptTargets, token: str) -> str:
    """One request to row 6d's origin's /headers through the target: the token as at bench.test, and the protocol
    the origin saw must be the route's (HTTP/2.0 through proxyctl); else BenchError, before any sample. A route
    without a protocol (the baseline's) takes the one seen. What it saw."""
    route = target.h2
    if route is None:
        raise BenchError(f"{target.name} has no route to {H2_HOST}")
    output = run(["curl", "-sS", "--fail", *route.curl_args, route.curl_base + "/headers"], env=target.curl_env)
    seen = _fields(output)
    credentials = _check_credentials(target, targets, token, seen, "GET", f"{targets.h2_url}/headers")
    protocol = seen.get("protocol", "")
    if route.protocol is None and protocol in ("HTTP/1.1", "HTTP/2.0"):
        route.protocol = protocol
        if protocol != "HTTP/2.0":
            log(f"{target.name} speaks {protocol} to {H2_HOST}: its row 6d is the before of HTTP/2 upstream (the "
                "report says so)")
        return f"{credentials}; upstream {protocol} (the baseline is held to what it speaks)"
    if protocol != route.protocol:
        raise BenchError(f"via {target.name} {H2_HOST} saw a request in {protocol or 'no protocol'!r}, not "
                         f"{route.protocol}: row 6d would not measure what it says (does the origin's listener "
                         "offer h2, and does the target's client offer it?)")
    return f"{credentials}; upstream {protocol}"


def origin_protocols(log: Path, offset: int) -> Counter:
    """The requests row 6d's origin logged from byte `offset` of its access log on, by `$server_protocol`."""
    with open(log, "rb") as lines:
        lines.seek(offset)
        return Counter(line.split(b" ", 1)[0].decode(errors="replace") for line in lines.read().splitlines() if line)


def _fields(output: str) -> dict[str, str]:
    """The `name=value` lines of an origin's echo (the last, `body=`, may hold anything but a newline)."""
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


def _check_credentials(target: InterceptTarget, targets: InterceptTargets, token: str, seen: dict[str, str],
                       method: str, url: str) -> str:
    """What the origin says a request through the target arrived with (`seen`), checked: no Authorization direct,
    else the target's kind of token, and for DPoP a proof for `method` and `url`. What it saw, in words."""
    authorization = seen.get("authorization", "")
    if target.expect_authorization is None:
        if authorization:
            raise BenchError(f"direct requests arrived with Authorization: {authorization[:40]}")
        return "no Authorization (direct)"
    wanted = f"{target.expect_authorization} {token}"
    if authorization != wanted:
        raise BenchError(f"via {target.name} the origin got Authorization {authorization[:60]!r}, "
                         f"not {target.expect_authorization} + the bench's token")
    if target.expect_authorization == "DPoP":
        try:
            verify_dpop_proof(seen.get("dpop", ""), method, url, access_token=token, jkt=targets.dpop.thumbprint)
        except DPoPError as error:
            raise BenchError(f"the DPoP proof the origin received is wrong: {error}") from None
        return "Authorization: DPoP <token> and a DPoP proof whose claims and ES256 signature verify"
    if seen.get("dpop"):
        raise BenchError(f"via {target.name} a Bearer request carried a DPoP proof")
    return "Authorization: Bearer <token>"


def start_ws_echo(processes: Processes, loadgen: str, setup: InterceptSetup) -> tuple[subprocess.Popen, int]:
    """The WebSocket echo origin (loadgen wsecho) with the bench.test leaf, on the origin's loopback address;
    the process and its port."""
    address = setup.origin.bench_address
    child = processes.start([loadgen, "wsecho", "-listen", f"{address}:0", "-cert", str(setup.bench.cert_pem),
                             "-key", str(setup.bench.key_pem)], stdout=subprocess.PIPE)
    line = child.stdout.readline().decode().strip()
    if not line or ":" not in line:
        raise BenchError(f"the WebSocket echo origin did not start: {line!r}")
    return child, int(line.rsplit(":", 1)[1])
