#!/usr/bin/env python3
"""Side-by-side benchmark of proxyctl against direct connections and its peers: tinyproxy and squid on the
passthrough paths, nginx (reverse proxy) and mitmproxy on the intercept path (a protected origin whose
requests get a Bearer or DPoP token), and DPoP proof generation against OpenSSL's raw signing rate.

Driven by scripts/bench, which checks the tools, builds proxyctl and DPoPBench, installs mitmproxy and owns
the temp dir; run that, not this. Only the standard library is used. Every process started here is started in its own session and
ended (TERM, then KILL) on exit, on SIGTERM/SIGINT/SIGHUP and on errors. Everything listens on
127.0.0.1 on ports that the OS picked. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import hashlib
import json
import os
import platform
import random
import re
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
GIB = 1 << 30
CONCURRENCY = 50
PEERS = ("proxyctl", "tinyproxy", "squid")
TARGETS = ("direct",) + PEERS


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


class BenchError(Exception):
    pass


# --------------------------------------------------------------------------------------------------
# Processes


class Processes:
    """Every child started by the harness, ended in reverse order on exit."""

    def __init__(self, pid_file: Path | None = None) -> None:
        self.children: list[subprocess.Popen] = []
        self.pid_file = pid_file

    def start(self, argv: list[str], *, stdout=None, stderr=None, env=None) -> subprocess.Popen:
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
        for child in reversed(list(self.children)):
            try:
                self.stop(child, timeout=5.0)
            except Exception as error:  # keep going: everything must be ended
                log(f"could not stop pid {child.pid}: {error}")


def descendants(root: int) -> list[int]:
    """root and every process below it (squid's log daemon, nginx's workers)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue.extend(parents.get(pid, []))
    return found


def cpu_seconds(root: int) -> float:
    """utime + stime of the process tree, threads included (dead threads' time stays in the process)."""
    ticks = 0
    for pid in descendants(root):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks += int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    return ticks / CLK_TCK


@dataclass
class Footprint:
    rss_kib: int
    anon_kib: int  # RssAnon: the part that is not mapped files (shared libraries)
    processes: int
    threads: int


def footprint(root: int) -> Footprint:
    rss = anon = processes = threads = 0
    for pid in descendants(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        processes += 1
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1])
            elif line.startswith("RssAnon:"):
                anon += int(line.split()[1])
            elif line.startswith("Threads:"):
                threads += int(line.split()[1])
    return Footprint(rss, anon, processes, threads)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int, child: subprocess.Popen, name: str, timeout: float = 20.0,
                  address: str = "127.0.0.1") -> None:
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


def run(argv: list[str], timeout: float = 600, env=None) -> str:
    result = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, env=env
    )
    if result.returncode != 0:
        raise BenchError(f"{shlex.join(argv)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return result.stdout


# --------------------------------------------------------------------------------------------------
# The origin: nginx with TLS and plain HTTP, files on tmpfs


@dataclass
class Origin:
    https_port: int
    http_port: int
    cert: Path
    bulk_bytes: int
    small_bytes: int
    # The intercept path's origin: https://bench.test on port 443 of bench_address, a leaf from a test CA.
    bench_address: str = ""
    bench_port: int = 443
    bench_ca: Path | None = None


def make_certificate(directory: Path) -> Path:
    cert, key = directory / "origin-cert.pem", directory / "origin-key.pem"
    run([
        "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
    ])
    key.chmod(0o644)
    return cert


def prepare_www(directory: Path, bulk_bytes: int, small_bytes: int) -> tuple[Path, str]:
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


def make_test_ca(directory: Path) -> tuple[Path, Path, Path]:
    """A test CA and a leaf for bench.test signed by it (the protected origin needs a host name and a CA that
    proxyctl's `ca_file` and nginx's `proxy_ssl_trusted_certificate` can trust). Returns CA, leaf, leaf key."""
    ca, ca_key = directory / "test-ca.pem", directory / "test-ca-key.pem"
    leaf, leaf_key, csr = directory / "bench-cert.pem", directory / "bench-key.pem", directory / "bench.csr"
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(["openssl", "req", "-x509", *curve, "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
         "-subj", "/CN=proxyctl bench test CA", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
    run(["openssl", "req", "-new", *curve, "-keyout", str(leaf_key), "-out", str(csr), "-subj", "/CN=bench.test"])
    extensions = directory / "bench-ext.cnf"
    extensions.write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                          "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:bench.test\n")
    run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
         "-days", "2", "-sha256", "-extfile", str(extensions), "-out", str(leaf)])
    leaf_key.chmod(0o644)  # nginx's workers read it as an unprivileged user
    return ca, leaf, leaf_key


def free_loopback_443() -> str:
    """A loopback address (127.0.0.0/8) whose port 443 is free: the protected origin's.

    It must be the default port: hey sends the Host field, port included, as the TLS server name
    (`ServerName: b.Request.Host`), and proxyctl answers an SNI of `bench.test:PORT` with 421 Misdirected
    Request. With the origin on 443 both are plain `bench.test`. Port 443 needs root (or
    CAP_NET_BIND_SERVICE); the address is picked at random and checked, so other work's ports are safe.
    """
    rng = random.SystemRandom()
    for _ in range(50):
        address = f"127.{rng.randint(64, 254)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
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


def start_origin(processes: Processes, directory: Path, www: Path, cert: Path, sizes,
                 bench: tuple[Path, Path, Path]) -> tuple[Origin, subprocess.Popen]:
    https_port, http_port = free_port(), free_port()
    bench_address, bench_port = free_loopback_443(), 443
    bench_ca, bench_cert, bench_key = bench
    conf = directory / "nginx.conf"
    nginx_dir = directory / "nginx"
    nginx_dir.mkdir()
    nginx_dir.chmod(0o777)
    conf.write_text(f"""
daemon off;
master_process on;
worker_processes auto;
pid {nginx_dir}/nginx.pid;
error_log {nginx_dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 120s;
    keepalive_requests 1000000;
    client_body_temp_path {nginx_dir}/body;
    proxy_temp_path {nginx_dir}/proxy;
    fastcgi_temp_path {nginx_dir}/fastcgi;
    uwsgi_temp_path {nginx_dir}/uwsgi;
    scgi_temp_path {nginx_dir}/scgi;
    default_type application/octet-stream;
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache off;
    ssl_session_tickets off;
    server {{
        listen 127.0.0.1:{https_port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {cert.parent / 'origin-key.pem'};
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
        server_name bench.test;
        ssl_certificate {bench_cert};
        ssl_certificate_key {bench_key};
        root {www};
        location = /headers {{
            default_type text/plain;
            return 200 "authorization=$http_authorization\ndpop=$http_dpop\nhost=$http_host\n";
        }}
    }}
}}
""")
    child = processes.start(
        ["nginx", "-e", str(nginx_dir / "error.log"), "-p", str(nginx_dir), "-c", str(conf)],
        stderr=open(nginx_dir / "stderr.log", "wb"),
    )
    wait_for_port(https_port, child, "nginx")
    wait_for_port(http_port, child, "nginx")
    wait_for_port(bench_port, child, "nginx", address=bench_address)
    return Origin(https_port, http_port, cert, sizes[0], sizes[1], bench_address, bench_port, bench_ca), child


# --------------------------------------------------------------------------------------------------
# The proxies, each with a temp config, logging as it does by default (to a file here)


@dataclass
class Proxy:
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
    def __init__(self, processes: Processes, directory: Path, proxyctl: str) -> None:
        self.processes = processes
        self.directory = directory
        self.proxyctl = proxyctl
        self.serial = 0

    def _dir(self, name: str) -> Path:
        self.serial += 1
        path = self.directory / f"{name}-{self.serial}"
        path.mkdir()
        # squid and tinyproxy drop root for an unprivileged user that must write its logs here.
        path.chmod(0o777)
        return path

    def start(self, name: str) -> Proxy:
        return getattr(self, f"_start_{name}")(self._dir(name))

    def stop(self, proxy: Proxy) -> None:
        self.processes.stop(proxy.child, timeout=15)

    def _start_proxyctl(self, work: Path) -> Proxy:
        conf = work / "proxy.conf"
        conf.write_text("[proxy]\nlisten = 127.0.0.1:0\nlog_level = info\n")
        log_path = work / "proxyctl.log"
        env = dict(os.environ, XDG_CONFIG_HOME=str(work), HOME=str(work))
        env.pop("PROXYCTL_CONFIG", None)
        child = self.processes.start(
            [self.proxyctl, "serve", "--config", str(conf), "--listen", "127.0.0.1:0"],
            stderr=open(log_path, "wb"),
            env=env,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log_path.read_text(errors="replace"))
            if match:
                port = int(match.group(1))
                wait_for_port(port, child, "proxyctl")
                return Proxy("proxyctl", port, child, log_path)
            if child.poll() is not None:
                raise BenchError(f"proxyctl exited ({child.returncode}): {log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        raise BenchError("proxyctl did not print its listening address")

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
        child = self.processes.start(
            ["tinyproxy", "-d", "-c", str(conf)], stderr=open(work / "stderr.log", "wb")
        )
        wait_for_port(port, child, "tinyproxy")
        return Proxy("tinyproxy", port, child, log_path)

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
        child = self.processes.start(
            ["squid", "-N", "-f", str(conf)], stderr=open(work / "stderr.log", "wb")
        )
        wait_for_port(port, child, "squid")
        return Proxy("squid", port, child, log_path)


# --------------------------------------------------------------------------------------------------
# Measurements


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    return env


CLIENT_ENV = clean_env()


@dataclass
class Sample:
    value: float  # bytes/s or requests/s
    cpu: float | None  # proxy CPU seconds during the sample
    units: float  # GiB or requests
    foreign: float = 0.0  # cores kept busy by processes the bench did not start, during the sample


class Load:
    """CPU used on the machine by processes that the bench did not start: other work skews the figures.

    Busy time from /proc/stat (steal included) less the CPU of the bench's own children (origin, proxies),
    of its finished children (curl, hey) and of itself.
    """

    def __init__(self, processes: Processes, wait: bool, limit: float = 0.25, patience: float = 30.0,
                 budget: float = 600.0):
        self.processes = processes
        self.wait = wait
        self.limit = limit
        self.patience = patience
        self.budget = budget  # seconds of waiting in all; then samples are taken as they come
        self.waited = 0.0

    @staticmethod
    def _busy() -> float:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return (sum(values) - values[3] - values[4]) / CLK_TCK  # all but idle and iowait

    def _ours(self) -> float:
        total = sum(cpu_seconds(child.pid) for child in self.processes.children if child.poll() is None)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            usage = resource.getrusage(who)
            total += usage.ru_utime + usage.ru_stime
        return total

    def snapshot(self) -> tuple[float, float, float]:
        return time.monotonic(), self._busy(), self._ours()

    @staticmethod
    def foreign(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
        wall = after[0] - before[0]
        return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / wall) if wall > 0 else 0.0

    def settle(self) -> None:
        """Waits (a while) for other work on the machine to calm down before a sample."""
        if not self.wait or self.waited >= self.budget:
            return
        start = time.monotonic()
        while True:
            before = self.snapshot()
            time.sleep(1.0)
            load = self.foreign(before, self.snapshot())
            if load <= self.limit:
                return
            if time.monotonic() - start > self.patience or self.waited >= self.budget:
                log(f"other processes keep {load:.2f} cores busy; measuring anyway")
                return
            self.waited += 1.0


LOAD: Load | None = None


class quiet_settle:
    """Within it, samples do not wait for the machine to calm down (warm-ups)."""

    def __enter__(self):
        self.saved = LOAD.wait if LOAD else None
        if LOAD:
            LOAD.wait = False

    def __exit__(self, *exc):
        if LOAD:
            LOAD.wait = self.saved


def measured(body):
    """Runs body() between two load snapshots; returns its result and the foreign load meanwhile."""
    if LOAD is None:
        return body(), 0.0
    LOAD.settle()
    before = LOAD.snapshot()
    result = body()
    return result, LOAD.foreign(before, LOAD.snapshot())


def curl_sample(argv: list[str], env: dict, pid: int | None, who: str, expected: int) -> Sample:
    """One curl download (argv prints `%{size_download} %{time_total}`); the CPU of pid's tree meanwhile."""

    def body():
        before = cpu_seconds(pid) if pid else None
        size, seconds = run(argv, env=env).split()
        after = cpu_seconds(pid) if pid else None
        return int(size), float(seconds), None if pid is None else after - before

    (size, seconds, cpu), foreign = measured(body)
    if size != expected:
        raise BenchError(f"bulk download via {who} got {size} bytes, not {expected}")
    return Sample(size / seconds, cpu, size / GIB, foreign)


def hey_sample(argv: list[str], pid: int | None, who: str, requests: int) -> Sample:
    """One hey run that must get `requests` × 200; the CPU of pid's tree meanwhile."""

    def body():
        before = cpu_seconds(pid) if pid else None
        output = run(argv, env=CLIENT_ENV)
        after = cpu_seconds(pid) if pid else None
        return output, None if pid is None else after - before

    (output, cpu), foreign = measured(body)
    rate = re.search(r"Requests/sec:\s+([0-9.]+)", output)
    ok = re.search(r"\[200\]\s+(\d+) responses", output)
    if not rate or not ok or int(ok.group(1)) != requests or "Error distribution" in output:
        raise BenchError(f"hey via {who} did not get {requests} × 200:\n{output[-3000:]}")
    return Sample(float(rate.group(1)), cpu, requests, foreign)


def hey_argv(requests: int, keepalive: bool) -> list[str]:
    argv = ["hey", "-c", str(CONCURRENCY), "-n", str(requests), "-t", "30"]
    if not keepalive:
        argv.append("-disable-keepalive")
    return argv


def bulk(origin: Origin, proxy: Proxy | None, limit: int | None = None) -> Sample:
    url = f"https://127.0.0.1:{origin.https_port}/bulk.bin"
    argv = ["curl", "-sS", "--fail", "-o", "/dev/null", "--cacert", str(origin.cert),
            "-w", "%{size_download} %{time_total}"]
    argv += ["-x", proxy.url] if proxy else ["--noproxy", "*"]
    if limit is not None:
        argv += ["-r", f"0-{limit - 1}"]
    argv.append(url)
    return curl_sample(argv, CLIENT_ENV, proxy.pid if proxy else None, proxy.name if proxy else "direct",
                       limit or origin.bulk_bytes)


def hey(url: str, proxy: Proxy | None, requests: int, keepalive: bool) -> Sample:
    argv = hey_argv(requests, keepalive)
    if proxy:
        argv += ["-x", proxy.url]
    argv.append(url)
    return hey_sample(argv, proxy.pid if proxy else None, proxy.name if proxy else "direct", requests)


async def _idle_tunnels(proxy_port: int, count: int, measure) -> tuple[int, object]:
    accepted: list[asyncio.StreamWriter] = []

    async def on_accept(reader, writer):
        accepted.append(writer)
        try:
            await reader.read()  # until the tunnel closes
        except (Exception, asyncio.CancelledError):
            pass  # the tunnel closed, or the loop is ending
        writer.close()

    sink = await asyncio.start_server(on_accept, "127.0.0.1", 0, backlog=4096)
    sink_port = sink.sockets[0].getsockname()[1]
    gate = asyncio.Semaphore(64)
    clients: list[asyncio.StreamWriter] = []

    async def open_tunnel():
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
            writer.write(
                f"CONNECT 127.0.0.1:{sink_port} HTTP/1.1\r\nHost: 127.0.0.1:{sink_port}\r\n\r\n".encode()
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            if not re.match(rb"HTTP/1\.[01] 200", head):
                raise BenchError(f"CONNECT answered {head[:80]!r}")
            clients.append(writer)

    try:
        await asyncio.gather(*(open_tunnel() for _ in range(count)))
        deadline = time.monotonic() + 10
        while len(accepted) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if len(accepted) < count:
            raise BenchError(f"only {len(accepted)} of {count} tunnels reached the sink")
        await asyncio.sleep(1.0)  # let the proxy settle (lazy allocations, log writes)
        result = measure()
    finally:
        for writer in clients + accepted:
            writer.close()
        await asyncio.sleep(0.5)
        sink.close()
        await sink.wait_closed()
    return len(accepted), result


def idle_tunnels(proxy: Proxy, count: int) -> dict:
    # Warm up: a few tunnels opened and closed, so one-time allocations are in the baseline.
    asyncio.run(_idle_tunnels(proxy.port, 20, lambda: None))
    time.sleep(1.0)
    before = footprint(proxy.pid)
    _, after = asyncio.run(_idle_tunnels(proxy.port, count, lambda: footprint(proxy.pid)))
    return {
        "before_kib": before.rss_kib,
        "after_kib": after.rss_kib,
        "anon_before_kib": before.anon_kib,
        "anon_after_kib": after.anon_kib,
        "per_tunnel_kib": (after.rss_kib - before.rss_kib) / count,
        "processes_before": before.processes,
        "threads_before": before.threads,
        "processes": after.processes,
        "threads": after.threads,
    }


# --------------------------------------------------------------------------------------------------
# The run


@dataclass
class Plan:
    quick: bool
    runs: int
    bulk_bytes: int
    small_bytes: int
    keepalive_requests: int
    new_tunnel_requests: int
    plain_requests: int
    idle_count: int
    warmup_requests: int
    intercept_keepalive_requests: int = 20000
    intercept_new_requests: int = 5000
    # Row 6b: keep-alive requests at a fixed offered load that every target but mitmproxy sustains, so the CPU
    # per request is compared at equal batching (a slower target otherwise pays more per request: fewer
    # events per wake-up).
    intercept_rate: int = 2000  # requests per second, all hey workers together
    intercept_rate_requests: int = 20000
    mitmproxy_divisor: int = 5  # mitmproxy gets this many times fewer requests
    dpop_proofs: int = 50000
    speed_seconds: int = 3  # openssl speed -seconds


def plan(quick: bool) -> Plan:
    if quick:
        return Plan(True, 1, 64 << 20, 256, 2000, 500, 2000, 1000, 200, intercept_keepalive_requests=2000,
                    intercept_new_requests=500, intercept_rate_requests=4000, dpop_proofs=5000, speed_seconds=1)
    return Plan(False, 3, GIB, 256, 20000, 5000, 20000, 1000, 1000)


@dataclass
class Results:
    samples: dict = field(default_factory=dict)  # (row, target) -> [Sample]
    idle: dict = field(default_factory=dict)  # target -> [dict]
    retries: list = field(default_factory=list)  # samples taken a second time after a failure
    intercept_checks: dict = field(default_factory=dict)  # target -> what the origin saw at /headers
    dpop: list = field(default_factory=list)  # per run: DPoPBench's JSON plus openssl speed's rates
    intercept_token: str = ""  # the access token every intercept target sends


def run_rows(p: Plan, rows, targets, running: dict, results: Results) -> None:
    """Each row: a discarded warm-up per target, then p.runs rounds of every target in turn (so each round's
    samples are close in time and comparable to that round's direct sample)."""
    for row, measure, warmup in rows:
        if warmup:
            for target in targets:
                with quiet_settle():
                    warmup(running.get(target))
        for index in range(p.runs):
            for target in targets:
                try:
                    sample = measure(running.get(target))
                except (BenchError, subprocess.TimeoutExpired) as error:
                    # One more try: a lost request under load should not cost a whole run.
                    log(f"{row} run {index + 1} {target} failed, trying once more: {str(error)[:500]}")
                    results.retries.append(f"{row} run {index + 1} {target}")
                    sample = measure(running.get(target))
                results.samples.setdefault((row, target), []).append(sample)
                cpu = "" if sample.cpu is None else f", proxy CPU {sample.cpu:.2f}s"
                log(f"{row} run {index + 1}/{p.runs} {target}: {sample.value:,.1f}/s{cpu}, "
                    f"other load {sample.foreign:.2f} cores")


def measure_throughput_rows(p: Plan, origin: Origin, proxies: Proxies, results: Results) -> None:
    running = {name: proxies.start(name) for name in PEERS}
    for name, proxy in running.items():
        log(f"{name} listening on {proxy.url} (pid {proxy.pid})")
    try:
        https_small = f"https://127.0.0.1:{origin.https_port}/small.txt"
        http_small = f"http://127.0.0.1:{origin.http_port}/small.txt"
        rows = [
            ("bulk", lambda proxy: bulk(origin, proxy),
             lambda proxy: bulk(origin, proxy, min(origin.bulk_bytes, 256 << 20))),
            ("keepalive", lambda proxy: hey(https_small, proxy, p.keepalive_requests, True),
             lambda proxy: hey(https_small, proxy, p.warmup_requests, True)),
            ("newtunnel", lambda proxy: hey(https_small, proxy, p.new_tunnel_requests, False),
             lambda proxy: hey(https_small, proxy, p.warmup_requests // 2, False)),
            ("plain", lambda proxy: hey(http_small, proxy, p.plain_requests, True),
             lambda proxy: hey(http_small, proxy, p.warmup_requests, True)),
        ]
        run_rows(p, rows, TARGETS, running, results)
    finally:
        for proxy in running.values():
            proxies.stop(proxy)


def measure_idle_row(p: Plan, proxies: Proxies, results: Results) -> None:
    for index in range(p.runs):
        for name in PEERS:
            proxy = proxies.start(name)  # fresh, so the baseline is an idle, warmed-up proxy
            try:
                sample = idle_tunnels(proxy, p.idle_count)
            finally:
                proxies.stop(proxy)
            results.idle.setdefault(name, []).append(sample)
            log(
                f"idle run {index + 1}/{p.runs} {name}: {sample['before_kib']} -> {sample['after_kib']} KiB, "
                f"{sample['per_tunnel_kib']:.1f} KiB/tunnel, {sample['processes']} process(es), "
                f"{sample['threads']} thread(s)"
            )


# --------------------------------------------------------------------------------------------------
# The intercept path: a protected origin whose requests get a token attached


INTERCEPT_PEERS = ("proxyctl", "proxyctl-dpop", "nginx", "mitmproxy")
INTERCEPT_TARGETS = ("direct",) + INTERCEPT_PEERS
RATE_TARGETS = ("direct", "proxyctl", "proxyctl-dpop", "nginx")  # mitmproxy cannot sustain row 6b's rate
INTERCEPT_LABELS = {
    "direct": "direct",
    "proxyctl": "proxyctl (Bearer)",
    "proxyctl-dpop": "proxyctl (DPoP)",
    "nginx": "nginx (reverse proxy)",
    "mitmproxy": "mitmproxy",
}
BENCH_HOST = "bench.test"
PROVIDER = "bench"
# Never contacted: the tokens are written straight into proxyctl's token store and outlive the run, so
# nothing is refreshed (a refresh would fail on this name, and the bench with it).
ISSUER = "https://idp.bench.test"
CLIENT_ID = "proxyctl-bench"


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64u_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def fake_access_token(now: int) -> str:
    """A JWT-shaped access token of a typical provider's length (about 900 bytes). Nobody verifies it."""
    header = {"alg": "RS256", "typ": "at+jwt", "kid": "bench-key-1"}
    claims = {
        "iss": ISSUER, "sub": "3f6c1a52-bench-user", "aud": f"https://{BENCH_HOST}", "client_id": CLIENT_ID,
        "scope": "openid profile email api.read api.write", "iat": now, "nbf": now, "exp": now + 30 * 86400,
        "auth_time": now, "jti": b64u(os.urandom(16)), "sid": b64u(os.urandom(16)), "acr": "1", "amr": ["pwd"],
        "name": "Bench User", "preferred_username": "bench", "email": "bench@example.com",
    }
    encode = lambda value: b64u(json.dumps(value, separators=(",", ":")).encode())
    return f"{encode(header)}.{encode(claims)}.{b64u(os.urandom(256))}"


@dataclass
class DPoPMaterial:
    key: Path  # PKCS#8 PEM, where proxyctl reads it
    public_pem: Path
    x: str
    y: str
    thumbprint: str  # RFC 7638


def make_dpop_key(key: Path, public_pem: Path) -> DPoPMaterial:
    run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key)])
    key.chmod(0o600)
    run(["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(public_pem)])
    der = subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout", "-outform", "DER"],
                         capture_output=True, check=True).stdout
    # SubjectPublicKeyInfo of a P-256 key: 26 bytes of algorithm and bit string header, then 04 || x || y.
    if len(der) != 91 or der[-65] != 4:
        raise BenchError(f"unexpected public key encoding from openssl ({len(der)} bytes)")
    x, y = b64u(der[-64:-32]), b64u(der[-32:])
    canonical = '{"crv":"P-256","kty":"EC","x":"%s","y":"%s"}' % (x, y)
    return DPoPMaterial(key, public_pem, x, y, b64u(hashlib.sha256(canonical.encode()).digest()))


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


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

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child else None


@dataclass
class InterceptSetup:
    origin: Origin
    token: str
    bench_cert: Path
    bench_key: Path
    mitmdump: str


class InterceptTargets:
    def __init__(self, processes: Processes, directory: Path, proxyctl: str, setup: InterceptSetup) -> None:
        self.processes = processes
        self.directory = directory
        self.proxyctl = proxyctl
        self.setup = setup
        self.dpop: DPoPMaterial | None = None

    @property
    def origin_url(self) -> str:
        return f"https://{BENCH_HOST}"  # port 443

    def _dir(self, name: str) -> Path:
        path = self.directory / f"intercept-{name}"
        path.mkdir()
        path.chmod(0o777)  # nginx's workers run unprivileged and write their temp files here
        return path

    def start(self, name: str) -> InterceptTarget:
        if name == "direct":
            origin = self.setup.origin
            return InterceptTarget(
                "direct", None, [], f"https://{origin.bench_address}",
                ["--noproxy", "*", "--cacert", str(origin.bench_ca),
                 "--resolve", f"{BENCH_HOST}:{origin.bench_port}:{origin.bench_address}"],
                self.origin_url, CLIENT_ENV, None)
        if name == "proxyctl":
            return self._start_proxyctl(self._dir(name), "bearer")
        if name == "proxyctl-dpop":
            return self._start_proxyctl(self._dir(name), "dpop")
        if name == "nginx":
            return self._start_nginx(self._dir(name))
        if name == "mitmproxy":
            return self._start_mitmproxy(self._dir(name))
        raise BenchError(f"no intercept target {name}")

    def _start_proxyctl(self, work: Path, binding: str) -> InterceptTarget:
        origin = self.setup.origin
        state = work / "state"
        port = free_port()
        conf = work / "proxy.conf"
        conf.write_text(f"""[proxy]
listen = 127.0.0.1:{port}
log_level = info
state_dir = {state}
resolve = {BENCH_HOST}={origin.bench_address}

[provider {PROVIDER}]
issuer = {ISSUER}
client_id = {CLIENT_ID}
scopes = openid
token_binding = {binding}

[origin {self.origin_url}]
provider = {PROVIDER}
ca_file = {origin.bench_ca}
""")
        env = dict(os.environ, XDG_CONFIG_HOME=str(work), XDG_STATE_HOME=str(work), HOME=str(work))
        env.pop("PROXYCTL_CONFIG", None)
        run([self.proxyctl, "ca", "init", "--config", str(conf)], env=env)
        # The tokens, as `proxyctl login` would have stored them (TokenSet's JSON, version 1).
        now = int(time.time())
        tokens = {
            "version": 1, "provider": PROVIDER, "issuer": ISSUER, "client_id": CLIENT_ID,
            "token_type": "DPoP" if binding == "dpop" else "Bearer", "access_token": self.setup.token,
            "issued_at": now, "expires_at": now + 30 * 86400, "refresh_token": b64u(os.urandom(32)),
            "scope": "openid", "generation": 1,
        }
        details = {}
        if binding == "dpop":
            keys = state / "keys"
            keys.mkdir(mode=0o700, exist_ok=True)
            self.dpop = make_dpop_key(keys / f"{PROVIDER}.dpop.pem", work / "dpop-public.pem")
            tokens["dpop_jkt"] = self.dpop.thumbprint
            details["thumbprint"] = self.dpop.thumbprint
        (state / "tokens").mkdir(mode=0o700, exist_ok=True)
        write_private(state / "tokens" / f"{PROVIDER}.json", json.dumps(tokens, indent=2))
        status = json.loads(run([self.proxyctl, "status", "--config", str(conf), "--json"], env=env))
        signed_in = [p for p in status.get("providers", []) if p.get("provider") == PROVIDER]
        if not signed_in or not signed_in[0].get("signed_in"):
            raise BenchError(f"proxyctl does not take the bench's token file: {status}")
        # What a user would do: eval "$(proxyctl env)". The clients take the proxy and the CA bundle from it.
        exported = dict(re.findall(r"^export ([A-Z_a-z0-9]+)='([^']*)';?$",
                                   run([self.proxyctl, "env", "--config", str(conf)], env=env), re.M))
        if "HTTPS_PROXY" not in exported or "CURL_CA_BUNDLE" not in exported:
            raise BenchError(f"proxyctl env printed no HTTPS_PROXY or CURL_CA_BUNDLE: {exported}")
        log_path = work / "proxyctl.log"
        child = self.processes.start([self.proxyctl, "serve", "--config", str(conf)],
                                     stderr=open(log_path, "wb"), env=env)
        deadline = time.monotonic() + 20
        while True:
            if re.search(rf"listening on http://127\.0\.0\.1:{port}\b", log_path.read_text(errors="replace")):
                break
            if child.poll() is not None:
                raise BenchError(f"proxyctl ({binding}) exited ({child.returncode}): {log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise BenchError(f"proxyctl ({binding}) did not print its listening address")
            time.sleep(0.05)
        wait_for_port(port, child, "proxyctl")
        curl_env = dict(CLIENT_ENV, HTTPS_PROXY=exported["HTTPS_PROXY"], CURL_CA_BUNDLE=exported["CURL_CA_BUNDLE"])
        details["log"] = str(log_path)
        return InterceptTarget(
            "proxyctl-dpop" if binding == "dpop" else "proxyctl", child, ["-x", exported["HTTPS_PROXY"]],
            self.origin_url, [], self.origin_url, curl_env, "DPoP" if binding == "dpop" else "Bearer", details)

    def _start_nginx(self, work: Path) -> InterceptTarget:
        origin = self.setup.origin
        port = free_port()
        conf = work / "nginx.conf"
        # The C reference: TLS terminated with a bench.test leaf, the header added, re-encrypted to the origin
        # over kept-alive, verified connections. Responses stream through memory buffers (no temp files).
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
    upstream protected_origin {{
        server {origin.bench_address}:{origin.bench_port};
        keepalive 128;
        keepalive_requests 1000000;
        keepalive_timeout 120s;
    }}
    server {{
        listen 127.0.0.1:{port} ssl;
        server_name {BENCH_HOST};
        ssl_certificate {self.setup.bench_cert};
        ssl_certificate_key {self.setup.bench_key};
        location / {{
            proxy_pass https://protected_origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host {BENCH_HOST};
            proxy_set_header Authorization "Bearer {self.setup.token}";
            proxy_ssl_server_name on;
            proxy_ssl_name {BENCH_HOST};
            proxy_ssl_verify on;
            proxy_ssl_trusted_certificate {origin.bench_ca};
            proxy_ssl_session_reuse on;
            proxy_max_temp_file_size 0;
        }}
    }}
}}
""")
        child = self.processes.start(["nginx", "-e", str(work / "error.log"), "-p", str(work), "-c", str(conf)],
                                     stderr=open(work / "stderr.log", "wb"))
        wait_for_port(port, child, "nginx (reverse proxy)")
        return InterceptTarget(
            "nginx", child, [], f"https://127.0.0.1:{port}",
            ["--noproxy", "*", "--cacert", str(origin.bench_ca), "--resolve", f"{BENCH_HOST}:{port}:127.0.0.1"],
            f"https://{BENCH_HOST}:{port}", CLIENT_ENV, "Bearer", {"config": str(conf)})

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
             "--set", f"confdir={confdir}", "--set", f"ssl_verify_upstream_trusted_ca={origin.bench_ca}",
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


def verify_dpop_proof(proof: str, material: DPoPMaterial, token: str, url: str, directory: Path) -> None:
    """Checks a proof the origin received: header, claims (RFC 9449 §4.2) and the ES256 signature (openssl)."""
    parts = proof.split(".")
    if len(parts) != 3:
        raise BenchError(f"the DPoP proof is not a compact JWS: {proof[:80]}")
    header, claims = json.loads(b64u_decode(parts[0])), json.loads(b64u_decode(parts[1]))
    jwk = header.get("jwk", {})
    problems = []
    if header.get("typ") != "dpop+jwt" or header.get("alg") != "ES256":
        problems.append(f"header {header}")
    if (jwk.get("kty"), jwk.get("crv"), jwk.get("x"), jwk.get("y")) != ("EC", "P-256", material.x, material.y):
        problems.append("jwk is not the key in state_dir/keys")
    if claims.get("htm") != "GET" or claims.get("htu") != url:
        problems.append(f"htm/htu {claims.get('htm')} {claims.get('htu')} (wanted GET {url})")
    if claims.get("ath") != b64u(hashlib.sha256(token.encode()).digest()):
        problems.append("ath does not hash the access token")
    if not claims.get("jti") or abs(int(claims.get("iat", 0)) - time.time()) > 120:
        problems.append(f"jti/iat {claims}")
    signature = b64u_decode(parts[2])
    if len(signature) != 64:
        problems.append(f"signature of {len(signature)} bytes")
    else:
        def der_int(value: bytes) -> bytes:
            value = value.lstrip(b"\0") or b"\0"
            if value[0] & 0x80:
                value = b"\0" + value
            return b"\x02" + bytes([len(value)]) + value

        body = der_int(signature[:32]) + der_int(signature[32:])
        (directory / "proof.sig").write_bytes(b"\x30" + bytes([len(body)]) + body)
        (directory / "proof.input").write_bytes(f"{parts[0]}.{parts[1]}".encode())
        verified = subprocess.run(
            ["openssl", "dgst", "-sha256", "-verify", str(material.public_pem), "-signature",
             str(directory / "proof.sig"), str(directory / "proof.input")], capture_output=True, text=True)
        if verified.returncode != 0:
            problems.append(f"ES256 signature does not verify: {verified.stdout.strip()} {verified.stderr.strip()}")
    if problems:
        raise BenchError("the DPoP proof the origin received is wrong: " + "; ".join(problems))


def check_headers(target: InterceptTarget, targets: InterceptTargets, token: str) -> str:
    """One request to /headers through the target: the origin must see the token (and a valid proof)."""
    output = run(["curl", "-sS", "--fail", *target.curl_args, target.curl_base + "/headers"], env=target.curl_env)
    seen = dict(line.split("=", 1) for line in output.splitlines() if "=" in line)
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
        verify_dpop_proof(seen.get("dpop", ""), targets.dpop, token, f"{targets.origin_url}/headers",
                          targets.directory)
        return "Authorization: DPoP <token> and a DPoP proof whose claims and ES256 signature verify"
    if seen.get("dpop"):
        raise BenchError(f"via {target.name} a Bearer request carried a DPoP proof")
    return "Authorization: Bearer <token>"


def intercept_bulk(target: InterceptTarget, expected: int, limit: int | None = None) -> Sample:
    argv = ["curl", "-sS", "--fail", "-o", "/dev/null", "-w", "%{size_download} %{time_total}", *target.curl_args]
    if limit is not None:
        argv += ["-r", f"0-{limit - 1}"]
    argv.append(target.curl_base + "/bulk.bin")
    return curl_sample(argv, target.curl_env, target.pid, target.name, limit or expected)


def intercept_hey(target: InterceptTarget, requests: int, keepalive: bool, rate: int | None = None) -> Sample:
    argv = hey_argv(requests, keepalive)
    if rate is not None:
        argv += ["-q", f"{rate / CONCURRENCY:g}"]  # hey's -q is per worker
    argv += target.hey_args + [target.hey_base + "/small.txt"]
    return hey_sample(argv, target.pid, target.name, requests)


def measure_intercept_rows(p: Plan, setup: InterceptSetup, targets: InterceptTargets, results: Results) -> None:
    running: dict[str, InterceptTarget] = {}
    try:
        for name in INTERCEPT_TARGETS:
            running[name] = targets.start(name)
            target = running[name]
            results.intercept_checks[name] = check_headers(target, targets, setup.token)
            log(f"intercept {name}: {target.hey_args or target.hey_base} (pid {target.pid}); "
                f"origin saw {results.intercept_checks[name]}")

        def count(target: InterceptTarget, requests: int) -> int:
            # mitmproxy is some 50 times slower: fewer requests keep its samples to seconds, not minutes.
            return max(CONCURRENCY * 2, requests // p.mitmproxy_divisor) if target.name == "mitmproxy" else requests

        bulk_bytes = setup.origin.bulk_bytes
        rows = [
            ("i-keepalive", lambda t: intercept_hey(t, count(t, p.intercept_keepalive_requests), True),
             lambda t: intercept_hey(t, count(t, p.warmup_requests), True)),
            ("i-bulk", lambda t: intercept_bulk(t, bulk_bytes),
             lambda t: intercept_bulk(t, bulk_bytes, min(bulk_bytes, 256 << 20))),
            ("i-newconn", lambda t: intercept_hey(t, count(t, p.intercept_new_requests), False),
             lambda t: intercept_hey(t, count(t, p.warmup_requests // 2), False)),
        ]
        run_rows(p, rows, INTERCEPT_TARGETS, running, results)
        rate_rows = [
            ("i-rate", lambda t: intercept_hey(t, p.intercept_rate_requests, True, p.intercept_rate),
             lambda t: intercept_hey(t, p.warmup_requests, True, p.intercept_rate)),
        ]
        run_rows(p, rate_rows, RATE_TARGETS, running, results)
        for name, target in running.items():
            if target.child is not None and target.child.poll() is not None:
                raise BenchError(f"{name} exited during the intercept rows ({target.child.returncode})")
    finally:
        for target in running.values():
            if target.child is not None:
                targets.processes.stop(target.child, timeout=15)


# --------------------------------------------------------------------------------------------------
# DPoP proofs on one core, against OpenSSL's own ES256 signing rate


def openssl_sign_rate(seconds: int) -> tuple[float, float]:
    """`openssl speed -seconds N ecdsap256`: (sign/s, verify/s)."""
    output = run(["openssl", "speed", "-seconds", str(seconds), "ecdsap256"], timeout=120)
    match = re.search(r"256 bits ecdsa \(nistp256\)\s+[0-9.]+s\s+[0-9.]+s\s+([0-9.]+)\s+([0-9.]+)", output)
    if not match:
        raise BenchError(f"cannot read openssl speed's output:\n{output[-1000:]}")
    return float(match.group(1)), float(match.group(2))


def measure_dpop(p: Plan, dpop_bench: str, token_bytes: int, key: Path | None, results: Results) -> None:
    for index in range(p.runs):
        (sign, verify), foreign = measured(lambda: openssl_sign_rate(p.speed_seconds))
        argv = [dpop_bench, "--proofs", str(p.dpop_proofs), "--token-bytes", str(token_bytes)]
        if key is not None:
            argv += ["--key", str(key)]
        bench, foreign_proofs = measured(lambda: json.loads(run(argv, timeout=300)))
        sample = dict(bench, openssl_sign_per_s=sign, openssl_verify_per_s=verify, foreign_openssl=foreign,
                      foreign_proofs=foreign_proofs)
        results.dpop.append(sample)
        log(f"dpop run {index + 1}/{p.runs}: openssl {sign:,.0f} sign/s; proxyctl {bench['proofs_per_cpu_s']:,.0f} "
            f"proofs/s, signES256 alone {bench['signatures_per_cpu_s']:,.0f}/s; other load {foreign:.2f}, "
            f"{foreign_proofs:.2f}")


# --------------------------------------------------------------------------------------------------
# The report


def first_line(argv: list[str]) -> str:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        text = (result.stdout or result.stderr).strip()
        return text.splitlines()[0] if text else "?"
    except Exception:
        return "?"


def machine_info(proxyctl: str, repo: Path, mitmdump: str) -> list[tuple[str, str]]:
    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
    os_name = "?"
    if Path("/etc/os-release").exists():
        match = re.search(r'PRETTY_NAME="([^"]+)"', Path("/etc/os-release").read_text())
        os_name = match.group(1) if match else "?"
    commit = first_line(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    hey_version = first_line(["dpkg-query", "-W", "-f=${Version}", "hey"])
    return [
        ("nproc", str(os.cpu_count())),
        ("CPU", cpu),
        ("Memory", f"{mem_kib / (1 << 20):.1f} GiB"),
        ("Kernel", f"{platform.system()} {platform.release()} ({platform.machine()})"),
        ("OS", os_name),
        ("proxyctl", f"{first_line([proxyctl, '--version'])} (release build of commit {commit}"
                     f"{' with uncommitted changes' if dirty else ''})"),
        ("tinyproxy", first_line(["tinyproxy", "-v"])),
        ("squid", first_line(["squid", "-v"])),
        ("nginx (origin, reverse proxy)", first_line(["nginx", "-v"])),
        ("mitmproxy", first_line([mitmdump, "--version"]) + " (PyPI, in .bench/venv)"),
        ("DPoPBench", "Tests/Bench, release build of this work tree"),
        ("hey (client)", f"hey {hey_version} (Debian package)"),
        ("curl (client)", first_line(["curl", "--version"])),
        ("OpenSSL", first_line(["openssl", "version"])),
        ("Python (idle-tunnel client)", platform.python_version()),
    ]


def median(values: list[float]) -> float:
    return statistics.median(values)


def fmt_ratio(value: float) -> str:
    return f"{value:.2f}×"


def verdict(ok: bool) -> str:
    return "✅" if ok else "❌"


def write_report(out: Path, p: Plan, results: Results, info, command: str, storage: str, started: str,
                 elapsed: float, waited: float) -> None:
    def ratios(row: str, target: str) -> list[float]:
        direct = results.samples[(row, "direct")]
        mine = results.samples[(row, target)]
        return [m.value / d.value for m, d in zip(mine, direct)]

    def cpu_per(row: str, target: str, scale: float) -> float:
        return median([s.cpu / s.units * scale for s in results.samples[(row, target)]])

    def absolute(row: str, target: str, unit: str) -> str:
        value = median([s.value for s in results.samples[(row, target)]])
        if unit == "MB/s":
            return f"{value / 1e6:,.0f} MB/s"
        return f"{value:,.0f} req/s"

    passthrough = ("bulk", "direct") in results.samples and bool(results.idle)
    intercept = ("i-bulk", "direct") in results.samples
    dpop = bool(results.dpop)
    bulk_label = f"{p.bulk_bytes / GIB:g} GiB" if p.bulk_bytes >= GIB else f"{p.bulk_bytes >> 20} MiB"
    lines: list[str] = []
    add = lines.append
    add("# Benchmarks")
    add("")
    add("Generated by `scripts/bench`; do not edit by hand, run it again. "
        + ("**Quick smoke-test run (`BENCH_QUICK=1`): 1 run, smaller sizes — not for comparison.**"
           if p.quick else f"Each cell is the median of {p.runs} runs."))
    if not (passthrough and intercept and dpop):
        add("**Partial run (`BENCH_ONLY`): some sections were not measured.**")
    add("")
    add(f"- Date: {started} (took {elapsed / 60:.1f} min)")
    add(f"- Command: `{command}`")
    for key, value in info:
        add(f"- {key}: {value}")
    add("")
    add("Clients (curl, hey, Python), proxy and origin (nginx) all share the same "
        f"{os.cpu_count()} cores, so every CPU cycle the proxy spends is taken from the client and the "
        "origin: **CPU per request (or per GiB) matters more than req/s**, and the throughput ratios understate "
        "what a proxy would do with cores of its own. Throughput is a ratio to direct (no proxy) measured in "
        "the same run, right before the proxies; the absolute direct figure is in the direct column.")
    add("")
    foreign = [s.foreign for samples in results.samples.values() for s in samples]
    foreign += [d[k] for d in results.dpop for k in ("foreign_openssl", "foreign_proofs")]
    if foreign:
        add(f"Other processes on the machine (not started by the bench) kept a median of {median(foreign):.2f} and "
            f"at most {max(foreign):.2f} cores busy during the samples (`other load` in the last table: busy time "
            "from `/proc/stat`, steal included, less the CPU of the bench's own processes; kernel threads that the "
            "bench's own traffic wakes, such as disk flushes of tinyproxy's log, count as other load too)"
            + (f"; the bench waited {waited:.0f} s in all for that load to drop below 0.25 cores before samples."
               if waited else "."))
        add("")

    if passthrough:
        add("## Passthrough: blind tunnels and plain HTTP")
        add("")
        add("| # | Scenario | Metric | Target (issue) | direct | proxyctl | tinyproxy | squid | earlier reference |")
        add("|---|---|---|---|---|---|---|---|---|")
        # 1. bulk
        r = {t: median(ratios("bulk", t)) for t in PEERS}
        c = {t: cpu_per("bulk", t, 1.0) for t in PEERS}
        add(f"| 1 | CONNECT bulk {bulk_label} download over HTTPS (curl) | throughput × direct | ≥ 0.9× | "
            f"1.00× ({absolute('bulk', 'direct', 'MB/s')}) | {fmt_ratio(r['proxyctl'])} {verdict(r['proxyctl'] >= 0.9)} | "
            f"{fmt_ratio(r['tinyproxy'])} | {fmt_ratio(r['squid'])} | squid 0.78× |")
        add(f"| 1 | | proxy CPU-s per GiB | ≤ 0.4 | — | {c['proxyctl']:.2f} {verdict(c['proxyctl'] <= 0.4)} | "
            f"{c['tinyproxy']:.2f} | {c['squid']:.2f} | squid 0.77 |")
        # 2. keep-alive tunnels
        r = {t: median(ratios("keepalive", t)) for t in PEERS}
        c = {t: cpu_per("keepalive", t, 1e6) for t in PEERS}
        add(f"| 2 | Small HTTPS requests, keep-alive tunnels, c={CONCURRENCY} (hey -x) | req/s × direct | ≥ 0.7× | "
            f"1.00× ({absolute('keepalive', 'direct', 'req/s')}) | {fmt_ratio(r['proxyctl'])} {verdict(r['proxyctl'] >= 0.7)} | "
            f"{fmt_ratio(r['tinyproxy'])} | {fmt_ratio(r['squid'])} | squid 0.54× |")
        add(f"| 2 | | proxy CPU µs/req | — | — | {c['proxyctl']:.0f} | {c['tinyproxy']:.0f} | {c['squid']:.0f} | squid 48 |")
        # 3. new tunnels
        r = {t: median(ratios("newtunnel", t)) for t in PEERS}
        c = {t: cpu_per("newtunnel", t, 1e6) for t in PEERS}
        add(f"| 3 | New CONNECT + TLS handshake per request, c={CONCURRENCY} (hey -disable-keepalive) | req/s × direct | ≥ 0.9× | "
            f"1.00× ({absolute('newtunnel', 'direct', 'req/s')}) | {fmt_ratio(r['proxyctl'])} {verdict(r['proxyctl'] >= 0.9)} | "
            f"{fmt_ratio(r['tinyproxy'])} | {fmt_ratio(r['squid'])} | squid 0.84× |")
        add(f"| 3 | | proxy CPU µs/req | — | — | {c['proxyctl']:.0f} | {c['tinyproxy']:.0f} | {c['squid']:.0f} | |")
        # 4. plain HTTP
        r = {t: median(ratios("plain", t)) for t in PEERS}
        c = {t: cpu_per("plain", t, 1e6) for t in PEERS}
        add(f"| 4 | Plain-HTTP absolute-form requests, c={CONCURRENCY} (hey -x, http:// URL) | req/s × direct | ≥ 0.5× | "
            f"1.00× ({absolute('plain', 'direct', 'req/s')}) | {fmt_ratio(r['proxyctl'])} {verdict(r['proxyctl'] >= 0.5)} | "
            f"{fmt_ratio(r['tinyproxy'])} | {fmt_ratio(r['squid'])} | squid 0.34× |")
        add(f"| 4 | | proxy CPU µs/req | ≤ 90 | — | {c['proxyctl']:.0f} {verdict(c['proxyctl'] <= 90)} | "
            f"{c['tinyproxy']:.0f} | {c['squid']:.0f} | squid 143 |")
        # 5. idle tunnels
        per = {t: median([s["per_tunnel_kib"] for s in results.idle[t]]) for t in PEERS}
        total = {t: median([s["after_kib"] for s in results.idle[t]]) for t in PEERS}
        anon = {t: median([s["anon_after_kib"] for s in results.idle[t]]) for t in PEERS}
        model = {}
        for t in PEERS:
            last = results.idle[t][-1]
            model[t] = f"{last['processes']} proc, {last['threads']} thr"
        add(f"| 5 | {p.idle_count:,} idle CONNECT tunnels (Python asyncio client) | KiB RSS per idle tunnel | ≤ 8 | — | "
            f"{per['proxyctl']:.1f} {verdict(per['proxyctl'] <= 8)} | {per['tinyproxy']:.1f} | {per['squid']:.1f} | "
            "squid 32, tinyproxy 19 |")
        add(f"| 5 | | total RSS with the tunnels open (of which anonymous) | < 20 MB | — | "
            f"{total['proxyctl'] * 1024 / 1e6:.1f} MB ({anon['proxyctl'] * 1024 / 1e6:.1f}) "
            f"{verdict(total['proxyctl'] * 1024 < 20e6)} | "
            f"{total['tinyproxy'] * 1024 / 1e6:.1f} MB ({anon['tinyproxy'] * 1024 / 1e6:.1f}) | "
            f"{total['squid'] * 1024 / 1e6:.1f} MB ({anon['squid'] * 1024 / 1e6:.1f}) | |")
        add(f"| 5 | | processes / threads with the tunnels open | — | — | {model['proxyctl']} | {model['tinyproxy']} | "
            f"{model['squid']} | tinyproxy: a thread per tunnel |")
        add("")
        add("✅/❌: proxyctl against the issue's target. Earlier reference: figures measured before on this kind of "
            "machine, quoted in the issue; not from this run.")
        add("")

    if intercept:
        ik = {t: median(ratios("i-keepalive", t)) for t in INTERCEPT_PEERS}
        ikc = {t: cpu_per("i-keepalive", t, 1e6) for t in INTERCEPT_PEERS}
        ib = {t: median(ratios("i-bulk", t)) for t in INTERCEPT_PEERS}
        ibc = {t: cpu_per("i-bulk", t, 1.0) for t in INTERCEPT_PEERS}
        inew = {t: median(ratios("i-newconn", t)) for t in INTERCEPT_PEERS}
        inc = {t: cpu_per("i-newconn", t, 1e6) for t in INTERCEPT_PEERS}
        rated = ("i-rate", "direct") in results.samples
        if rated:
            irate = {t: median([s.value for s in results.samples[("i-rate", t)]]) for t in RATE_TARGETS}
            iratec = {t: cpu_per("i-rate", t, 1e6) for t in RATE_TARGETS if t != "direct"}
        ours = ("proxyctl", "proxyctl-dpop")

        def cells(values: dict, fmt, ok=None) -> str:
            out = []
            for t in INTERCEPT_PEERS:
                cell = fmt(values[t])
                if ok is not None and t in ours:
                    cell += f" {verdict(ok(values[t]))}"
                out.append(cell)
            return " | ".join(out)

        add("## Intercept path: a protected origin, token attached")
        add("")
        add("The client asks for `https://bench.test/…` (nginx serving the same files from "
            f"{storage}); each target adds `Authorization` on the way. proxyctl terminates TLS with its local CA, "
            "attaches the token (Bearer, or DPoP with a fresh proof per request) and re-encrypts to the origin "
            "through libcurl; nginx does the same as a TLS-terminating reverse proxy (the C reference); mitmproxy "
            "as a forward proxy with an addon. \"≥ nginx\" means at least the nginx column of this run.")
        add("")
        add("| # | Scenario | Metric | Target (issue) | direct | proxyctl (Bearer) | proxyctl (DPoP) | nginx | "
            "mitmproxy | earlier reference |")
        add("|---|---|---|---|---|---|---|---|---|---|")
        add(f"| 6 | Small HTTPS requests, keep-alive, c={CONCURRENCY} (hey; -x for the forward proxies) | "
            f"req/s × direct | ≥ nginx | 1.00× ({absolute('i-keepalive', 'direct', 'req/s')}) | "
            f"{cells(ik, fmt_ratio, lambda v: v >= ik['nginx'])} | nginx 0.51×, mitmproxy 0.02× |")
        add(f"| 6 | | proxy CPU µs/req | ≤ nginx | — | {cells(ikc, lambda v: f'{v:,.0f}', lambda v: v <= ikc['nginx'])} | "
            "nginx 81, mitmproxy 3,060 |")
        if rated:
            def rate_cells(fmt, ok=None) -> str:
                out = []
                for t in INTERCEPT_PEERS:
                    if t not in iratec:
                        out.append("—")
                        continue
                    cell = fmt(t)
                    if ok is not None and t in ours:
                        cell += f" {verdict(ok(t))}"
                    out.append(cell)
                return " | ".join(out)

            add(f"| 6b | As row 6 at a fixed {p.intercept_rate:,} req/s (hey -q), equal load for every target | "
                f"req/s achieved | — | {irate['direct']:,.0f} | {rate_cells(lambda t: f'{irate[t]:,.0f}')} | |")
            add(f"| 6b | | proxy CPU µs/req | ≤ nginx | — | "
                f"{rate_cells(lambda t: f'{iratec[t]:,.0f}', lambda t: iratec[t] <= iratec['nginx'])} | |")
        add(f"| 7 | Bulk {bulk_label} download (curl) | throughput × direct | ≥ nginx | "
            f"1.00× ({absolute('i-bulk', 'direct', 'MB/s')}) | {cells(ib, fmt_ratio, lambda v: v >= ib['nginx'])} | |")
        add(f"| 7 | | proxy CPU-s per GiB | ≤ nginx | — | {cells(ibc, lambda v: f'{v:.2f}', lambda v: v <= ibc['nginx'])} | "
            "nginx 2.25 |")
        add(f"| 8 | New connection + TLS handshake per request, c={CONCURRENCY} (hey -disable-keepalive) | "
            f"req/s × direct | ≥ 0.9× | 1.00× ({absolute('i-newconn', 'direct', 'req/s')}) | "
            f"{cells(inew, fmt_ratio, lambda v: v >= 0.9)} | |")
        add(f"| 8 | | proxy CPU µs/req | ≤ nginx | — | {cells(inc, lambda v: f'{v:,.0f}', lambda v: v <= inc['nginx'])} | |")
        add("")
        add("✅/❌: each proxyctl column against the target; the targets are the issue's (nginx's figures of this run, "
            "and 0.9× direct for new connections). Earlier reference: measured before on this machine, quoted in the "
            "issue; not from this run.")
        add("")
        add("What the origin received, checked once per target before the samples (its `/headers` echoes them):")
        add("")
        for name in INTERCEPT_TARGETS:
            add(f"- {INTERCEPT_LABELS[name]}: {results.intercept_checks.get(name, '?')}")
        add("")

    if dpop:
        sign = median([d["openssl_sign_per_s"] for d in results.dpop])
        proofs = median([d["proofs_per_cpu_s"] for d in results.dpop])
        proof_ratio = median([d["proofs_per_cpu_s"] / d["openssl_sign_per_s"] for d in results.dpop])
        alone = median([d["signatures_per_cpu_s"] for d in results.dpop])
        alone_ratio = median([d["signatures_per_cpu_s"] / d["openssl_sign_per_s"] for d in results.dpop])
        signature_us = 1e6 / sign
        add("## DPoP")
        add("")
        add("| # | Scenario | Metric | Target (issue) | OpenSSL (`openssl speed`) | proxyctl | earlier reference |")
        add("|---|---|---|---|---|---|---|")
        add(f"| 9 | ES256 (ECDSA P-256) signatures on one core | signatures/s | — | {sign:,.0f} sign/s "
            f"({signature_us:.1f} µs) | `PrivateKey.signES256` alone: {alone:,.0f}/s ({fmt_ratio(alone_ratio)}, "
            f"{1e6 / alone:.1f} µs) | about 35,000 sign/s |")
        add(f"| 9 | DPoP proofs on one core (`DPoPKey.proof`, Tests/Bench) | proofs/s × raw signing | ≥ 0.6× | 1.00× | "
            f"{proofs:,.0f}/s = {fmt_ratio(proof_ratio)} {verdict(proof_ratio >= 0.6)} ({1e6 / proofs:.1f} µs/proof) | |")
        if intercept:
            def delta(row: str) -> float:
                return median([(d.cpu - b.cpu) / d.units * 1e6 for d, b in
                               zip(results.samples[(row, "proxyctl-dpop")], results.samples[(row, "proxyctl")])])

            dk, dn = delta("i-keepalive"), delta("i-newconn")
            rated_delta = ""
            if ("i-rate", "proxyctl-dpop") in results.samples:
                dr = delta("i-rate")
                rated_delta = (f"; keep-alive at {p.intercept_rate:,} req/s (row 6b, equal load): "
                               f"{dr:+.0f} {verdict(dr <= signature_us)}")
            add(f"| 10 | Intercept path, DPoP − Bearer (rows 6, 6b and 8, same run) | proxy CPU µs/req | "
                f"≤ one signature ({signature_us:.0f} µs) | — | keep-alive at full speed: {dk:+.0f} "
                f"{verdict(dk <= signature_us)}{rated_delta}; new connections: {dn:+.0f} "
                f"{verdict(dn <= signature_us)} | ~30 µs |")
        add("")
        add("✅/❌: proxyctl against the issue's target; the raw signing rate is `openssl speed` of this run.")
        add("")

    add("## Method")
    add("")
    if passthrough or intercept:
        add(f"- **Origin**: nginx, `worker_processes auto`, access log off, files on {storage}: a "
            f"{bulk_label} incompressible file and a {p.small_bytes}-byte one. HTTPS with TLS 1.3 and ECDSA P-256 "
            "certificates; no session resumption, so every new connection is a full handshake. Three listeners: "
            "https with a self-signed certificate for 127.0.0.1 (rows 1–3), plain HTTP (row 4), and https for "
            "`bench.test` with a leaf from a test CA (rows 6–8, and `/headers`, which echoes `Authorization` and "
            "`DPoP`) on port 443 of a loopback address picked at random (127.x.y.z), so that every client sends "
            "the same plain host name as its TLS server name (hey sends `host:port` for other ports, which proxyctl "
            "accepts only when the port is the tunnel's).")
    if passthrough:
        add("- **Passthrough proxies** (rows 1–5), each started by the script on 127.0.0.1 with a temp config, all "
            "three running during rows 1–4, and started afresh for each run of row 5:")
        add("  - proxyctl: `proxyctl serve --config <temp> --listen 127.0.0.1:0`, `log_level = info` (the default: a "
            "line per request/tunnel on stderr, sent to a file).")
        add("  - tinyproxy: `tinyproxy -d`, Debian's defaults (`LogLevel Info` to a file, Via header) with "
            "`MaxClients 2000` for row 5 and no `ConnectPort` line (CONNECT to any port).")
        add("  - squid: `squid -N` (one worker, no master process), `cache deny all` and `cache_mem 0`, its "
            "default `access_log daemon:…` (a `log_file_daemon` helper process, counted with squid), CONNECT "
            "to any port allowed.")
    add("- **CPU**: utime + stime from `/proc/PID/stat` of the proxy's whole process tree (squid's log "
        "daemon, nginx's workers included), read before and after each measurement, divided by CLK_TCK "
        f"({CLK_TCK} Hz, so ±{1e6 / CLK_TCK / max(p.plain_requests, 1):.1f} µs/req resolution at "
        f"{p.plain_requests:,} requests).")
    if passthrough:
        add(f"- **Row 1**: `curl -x http://127.0.0.1:PORT --cacert … https://127.0.0.1:ORIGIN/bulk.bin -o /dev/null` "
            "(direct: `--noproxy '*'`); throughput = bytes / `time_total`.")
        add(f"- **Row 2**: `hey -c {CONCURRENCY} -n {p.keepalive_requests} -x http://127.0.0.1:PORT "
            "https://127.0.0.1:ORIGIN/small.txt` — hey sends CONNECT for https:// URLs and keeps the "
            f"{CONCURRENCY} tunnels alive.")
        add(f"- **Row 3**: as row 2 with `-disable-keepalive` and `-n {p.new_tunnel_requests}`: a new TCP "
            "connection, CONNECT and TLS handshake per request.")
        add(f"- **Row 4**: `hey -c {CONCURRENCY} -n {p.plain_requests} -x http://127.0.0.1:PORT "
            "http://127.0.0.1:ORIGIN/small.txt` — absolute-form requests over keep-alive client connections.")
    add(f"- Every row starts with a discarded warm-up per target (bulk rows: a "
        f"{min(p.bulk_bytes, 256 << 20) >> 20} MiB download; request rows: {p.warmup_requests} requests, half that "
        "for new connections); every hey run must return all 200s with no errors or the bench fails. In a full run, "
        "each sample waits (up to 30 s, 10 min in all) for other processes' load to drop below 0.25 cores.")
    if passthrough:
        add(f"- **Row 5**: a fresh proxy, 20 tunnels opened and closed as a warm-up, then VmRSS (summed over the "
            f"proxy's processes) before and 1 s after {p.idle_count:,} CONNECTs to a local asyncio TCP sink "
            "are answered 200 and reached the sink; KiB per tunnel = (after − before) / tunnels. RSS counts the "
            "resident pages of mapped shared libraries (file-backed, shared with other processes that map them); "
            "the anonymous part (RssAnon: heap, stacks) is in parentheses.")
        add("- tinyproxy logs at Info to its `LogFile` as Debian's config does, and flushes that file to disk "
            "(fsync) after every line, several lines per request: with the temp dir on a real disk, that and its "
            "new thread per client connection (it does not keep client connections alive) dominate its rows 2–4 "
            "figures.")
        add("- tinyproxy 1.11 is one process with a thread per client connection (threads-per-tunnel shows in "
            "the processes/threads row; thread stacks are only partly resident), so its RSS is that one "
            "process's, summed with any others in its tree.")
    if intercept:
        mitm_keepalive = max(CONCURRENCY * 2, p.intercept_keepalive_requests // p.mitmproxy_divisor)
        mitm_new = max(CONCURRENCY * 2, p.intercept_new_requests // p.mitmproxy_divisor)
        add("- **Intercept targets** (rows 6–8), all running during the three rows, each on 127.0.0.1 with a temp "
            "config; every one sends the same JWT-shaped access token of "
            f"{len(results.intercept_token) if results.intercept_token else '~900'} bytes:")
        add("  - proxyctl (Bearer and DPoP, two instances): `proxyctl serve` with `state_dir` in the temp dir, "
            "`resolve = bench.test=127.x.y.z`, `[provider bench]` with `token_binding = bearer` or `dpop`, "
            "`[origin https://bench.test]` with `ca_file` = the test CA, `log_level = info`. `proxyctl ca init` "
            "made the local CA; the tokens are written into the token store in proxyctl's format "
            "(`tokens/bench.json`, 30 days' expiry, so nothing is refreshed and no provider is contacted; "
            "`proxyctl status` must report them signed in), and for DPoP `keys/bench.dpop.pem` (PKCS#8 P-256 from "
            "`openssl genpkey`) with its RFC 7638 thumbprint as `dpop_jkt`. The clients use what `proxyctl env` "
            "prints: `HTTPS_PROXY` (hey `-x`, curl) and `CURL_CA_BUNDLE`.")
        add("  - nginx: a second nginx, `worker_processes auto`, `listen … ssl` with the bench.test leaf, "
            "`proxy_pass https://upstream` with `keepalive 128`, `proxy_http_version 1.1`, "
            "`proxy_set_header Connection \"\"`, `proxy_set_header Authorization \"Bearer …\"`, "
            "`proxy_ssl_verify on` against the test CA, `proxy_ssl_session_reuse on`, "
            "`proxy_max_temp_file_size 0` (responses stream through memory buffers, nothing spooled to disk); "
            "access log off, no TLS session resumption for clients. hey and curl talk to it directly (curl "
            "`--resolve bench.test:PORT:127.0.0.1`).")
        add("  - mitmproxy: `mitmdump --listen-host 127.0.0.1 -s add_bearer.py --set "
            "ssl_verify_upstream_trusted_ca=<test CA> --set stream_large_bodies=1m` (default flow log to a file, "
            "like proxyctl's info log), from a venv of its own (`.bench/venv`, PyPI `mitmproxy`); the addon sets "
            "`Authorization` in the `request` hook and sends `bench.test` to the origin's address in "
            "`server_connect`. curl "
            f"trusts mitmproxy's CA. Being about 50× slower, it gets fewer requests: {mitm_keepalive:,} (row 6) and "
            f"{mitm_new:,} (row 8); the rates are per second all the same.")
        add(f"- **Row 6**: `hey -c {CONCURRENCY} -n {p.intercept_keepalive_requests} -x $HTTPS_PROXY "
            "https://bench.test/small.txt` for the forward proxies; `https://127.0.0.1:PORT/small.txt` to nginx, "
            "`https://127.x.y.z/small.txt` (direct) to the origin. hey does not verify certificates; curl does "
            "(below).")
        add(f"- **Row 7**: curl downloads `/bulk.bin` ({bulk_label}) as in row 1: with `HTTPS_PROXY` and "
            "`CURL_CA_BUNDLE` from `proxyctl env`, `-x … --cacert <mitmproxy CA>`, or `--resolve` and the test CA "
            "for nginx and direct.")
        add(f"- **Row 8**: as row 6 with `-disable-keepalive` and `-n {p.intercept_new_requests}`: a new client "
            "connection (CONNECT for the forward proxies) and TLS handshake per request; the proxies may reuse "
            "their connections to the origin (proxyctl through libcurl's connection cache, nginx through its "
            "keepalive pool; mitmproxy opens one per client connection).")
        if ("i-rate", "direct") in results.samples:
            add(f"- **Row 6b**: as row 6 with `-q {p.intercept_rate / CONCURRENCY:g}` (requests per second per "
                f"worker: {p.intercept_rate:,} req/s in all) and `-n {p.intercept_rate_requests}`, for direct, "
                "both proxyctl columns and nginx (mitmproxy cannot keep up with that rate). At full speed (row 6) a "
                "slower target also pays more CPU per request, because each wake-up finds fewer events to batch; at "
                "an equal offered load the CPU per request compares the work alone.")
    if dpop:
        add(f"- **Row 9**: `openssl speed -seconds {p.speed_seconds} ecdsap256` (sign/s per CPU second, one process) and "
            f"`Tests/Bench` `DPoPBench --proofs {p.dpop_proofs}` (release build; one thread): `DPoPKey.proof(method:"
            "url:accessToken:nonce:now:)` as the proxy calls it for every request (fresh `jti`, `htm`, `htu`, `iat`, "
            f"`ath` of the {len(results.intercept_token) if results.intercept_token else '~900'}-byte token), with "
            "the proxyctl (DPoP) target's key, per CPU second (`CLOCK_PROCESS_CPUTIME_ID`); then "
            "`PrivateKey.signES256` alone over a signing input of the proof's length. Alternating, "
            f"{p.runs} times each.")
        if intercept:
            add("- **Row 10**: per run, the DPoP column's CPU µs/request less the Bearer column's, in rows 6, 6b and "
                "8; the target is one raw signature from row 9.")
    if results.retries:
        add(f"- Samples taken again after a failed first try: {', '.join(results.retries)}.")
    add("")
    add("## Every run")
    add("")
    add("| Scenario | Target | " + " | ".join(f"run {i + 1}" for i in range(p.runs)) + " |")
    add("|---|---|" + "---|" * p.runs)
    table = []
    if passthrough:
        table += [(row, unit, TARGETS) for row, unit in
                  (("bulk", "MB/s"), ("keepalive", "req/s"), ("newtunnel", "req/s"), ("plain", "req/s"))]
    if intercept:
        table += [(row, unit, INTERCEPT_TARGETS) for row, unit in
                  (("i-keepalive", "req/s"), ("i-bulk", "MB/s"), ("i-newconn", "req/s"))]
        if ("i-rate", "direct") in results.samples:
            table.append(("i-rate", "req/s", RATE_TARGETS))
    for row, unit, targets in table:
        for target in targets:
            cells_ = []
            for index, sample in enumerate(results.samples[(row, target)]):
                value = f"{sample.value / 1e6:,.0f} MB/s" if unit == "MB/s" else f"{sample.value:,.0f} req/s"
                if sample.cpu is not None:
                    direct = results.samples[(row, "direct")][index].value
                    per = (f"{sample.cpu / sample.units:.2f} CPU-s/GiB" if unit == "MB/s"
                           else f"{sample.cpu / sample.units * 1e6:.0f} µs/req")
                    value += f" ({sample.value / direct:.2f}×, {per})"
                value += f"; other load {sample.foreign:.2f}"
                cells_.append(value)
            add(f"| {row} | {INTERCEPT_LABELS.get(target, target) if row.startswith('i-') else target} | "
                + " | ".join(cells_) + " |")
    if passthrough:
        for target in PEERS:
            cells_ = [
                f"{s['before_kib']:,} → {s['after_kib']:,} KiB, anonymous {s['anon_before_kib']:,} → "
                f"{s['anon_after_kib']:,} ({s['per_tunnel_kib']:.1f} KiB/tunnel, "
                f"{s['processes']} proc, {s['threads']} thr)"
                for s in results.idle[target]
            ]
            add(f"| idle | {target} | " + " | ".join(cells_) + " |")
    if dpop:
        add("| dpop | openssl speed | " + " | ".join(
            f"{d['openssl_sign_per_s']:,.0f} sign/s; other load {d['foreign_openssl']:.2f}" for d in results.dpop) + " |")
        add("| dpop | DPoPKey.proof | " + " | ".join(
            f"{d['proofs_per_cpu_s']:,.0f} proofs/s ({d['proofs_per_cpu_s'] / d['openssl_sign_per_s']:.2f}×, "
            f"{d['proof_bytes']} bytes); other load {d['foreign_proofs']:.2f}" for d in results.dpop) + " |")
        add("| dpop | signES256 alone | " + " | ".join(
            f"{d['signatures_per_cpu_s']:,.0f}/s ({d['signatures_per_cpu_s'] / d['openssl_sign_per_s']:.2f}×)"
            for d in results.dpop) + " |")
    add("")
    out.write_text("\n".join(lines))


# --------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--proxyctl", required=True)
    parser.add_argument("--tmp", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--repo", required=True, type=Path)
    parser.add_argument("--command", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mitmdump", required=True, help="mitmproxy's mitmdump (from the bench's own venv)")
    parser.add_argument("--dpop-bench", required=True, help="Tests/Bench's DPoPBench, release build")
    args = parser.parse_args()

    def on_signal(number, _frame):
        raise SystemExit(128 + number)

    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, on_signal)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 8192:
        log(f"error: the open-file hard limit ({hard}) is below 8192, too few for 1,000 tunnels; raise it")
        return 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    p = plan(args.quick)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    processes = Processes(args.tmp / "children.pids")
    www: Path | None = None
    try:
        log(f"preparing the origin ({p.bulk_bytes >> 20} MiB file) in {args.tmp}")
        cert = make_certificate(args.tmp)
        bench_ca, bench_cert, bench_key = make_test_ca(args.tmp)
        www, storage = prepare_www(args.tmp, p.bulk_bytes, p.small_bytes)
        origin, _ = start_origin(processes, args.tmp, www, cert, (p.bulk_bytes, p.small_bytes),
                                 (bench_ca, bench_cert, bench_key))
        log(f"origin: https://127.0.0.1:{origin.https_port}, http://127.0.0.1:{origin.http_port} and "
            f"https://{BENCH_HOST} on {origin.bench_address}:{origin.bench_port} ({storage})")
        global LOAD
        LOAD = Load(processes, wait=not p.quick)
        proxies = Proxies(processes, args.tmp, args.proxyctl)
        results = Results()
        only = os.environ.get("BENCH_ONLY", "")  # for working on the bench itself: passthrough, intercept, dpop
        sections = set(only.split(",")) if only else {"passthrough", "intercept", "dpop"}
        if "passthrough" in sections:
            measure_throughput_rows(p, origin, proxies, results)
            measure_idle_row(p, proxies, results)
        setup = InterceptSetup(origin, fake_access_token(int(time.time())), bench_cert, bench_key, args.mitmdump)
        targets = InterceptTargets(processes, args.tmp, args.proxyctl, setup)
        results.intercept_token = setup.token
        if "intercept" in sections:
            measure_intercept_rows(p, setup, targets, results)
        if "dpop" in sections:
            key = targets.dpop.key if targets.dpop else None
            measure_dpop(p, args.dpop_bench, len(setup.token), key, results)
        info = machine_info(args.proxyctl, args.repo, args.mitmdump)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_report(args.out, p, results, info, args.command, storage, started, time.monotonic() - t0,
                     LOAD.waited)
        log(f"wrote {args.out}")
        return 0
    except BenchError as error:
        log(f"error: {error}")
        return 1
    finally:
        processes.stop_all()
        if www is not None and os.path.ismount(www):
            subprocess.run(["umount", "-l", str(www)], capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
