#!/usr/bin/env python3
"""Side-by-side benchmark of proxyctl, tinyproxy and squid against direct connections.

Driven by scripts/bench, which checks the tools, builds proxyctl and owns the temp dir; run that, not
this. Only the standard library is used. Every process started here is started in its own session and
ended (TERM, then KILL) on exit, on SIGTERM/SIGINT/SIGHUP and on errors. Everything listens on
127.0.0.1 on ports that the OS picked. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
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


def wait_for_port(port: int, child: subprocess.Popen, name: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise BenchError(f"{name} exited with status {child.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"{name} did not listen on 127.0.0.1:{port} within {timeout:.0f}s")


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


def start_origin(processes: Processes, directory: Path, www: Path, cert: Path, sizes) -> tuple[Origin, subprocess.Popen]:
    https_port, http_port = free_port(), free_port()
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
}}
""")
    child = processes.start(
        ["nginx", "-e", str(nginx_dir / "error.log"), "-p", str(nginx_dir), "-c", str(conf)],
        stderr=open(nginx_dir / "stderr.log", "wb"),
    )
    wait_for_port(https_port, child, "nginx")
    wait_for_port(http_port, child, "nginx")
    return Origin(https_port, http_port, cert, sizes[0], sizes[1]), child


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


def bulk(origin: Origin, proxy: Proxy | None, limit: int | None = None) -> Sample:
    url = f"https://127.0.0.1:{origin.https_port}/bulk.bin"
    argv = ["curl", "-sS", "--fail", "-o", "/dev/null", "--cacert", str(origin.cert),
            "-w", "%{size_download} %{time_total}"]
    argv += ["-x", proxy.url] if proxy else ["--noproxy", "*"]
    if limit is not None:
        argv += ["-r", f"0-{limit - 1}"]
    argv.append(url)

    def body():
        before = cpu_seconds(proxy.pid) if proxy else None
        size, seconds = run(argv, env=CLIENT_ENV).split()
        after = cpu_seconds(proxy.pid) if proxy else None
        return int(size), float(seconds), None if proxy is None else after - before

    (size, seconds, cpu), foreign = measured(body)
    if size != (limit or origin.bulk_bytes):
        raise BenchError(f"bulk download via {proxy.name if proxy else 'direct'} got {size} bytes")
    return Sample(size / seconds, cpu, size / GIB, foreign)


def hey(url: str, proxy: Proxy | None, requests: int, keepalive: bool) -> Sample:
    argv = ["hey", "-c", str(CONCURRENCY), "-n", str(requests), "-t", "30"]
    if not keepalive:
        argv.append("-disable-keepalive")
    if proxy:
        argv += ["-x", proxy.url]
    argv.append(url)

    def body():
        before = cpu_seconds(proxy.pid) if proxy else None
        output = run(argv, env=CLIENT_ENV)
        after = cpu_seconds(proxy.pid) if proxy else None
        return output, None if proxy is None else after - before

    (output, cpu), foreign = measured(body)
    rate = re.search(r"Requests/sec:\s+([0-9.]+)", output)
    ok = re.search(r"\[200\]\s+(\d+) responses", output)
    who = proxy.name if proxy else "direct"
    if not rate or not ok or int(ok.group(1)) != requests or "Error distribution" in output:
        raise BenchError(f"hey via {who} did not get {requests} × 200:\n{output[-3000:]}")
    return Sample(float(rate.group(1)), cpu, requests, foreign)


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


def plan(quick: bool) -> Plan:
    if quick:
        return Plan(True, 1, 64 << 20, 256, 2000, 500, 2000, 1000, 200)
    return Plan(False, 3, GIB, 256, 20000, 5000, 20000, 1000, 1000)


@dataclass
class Results:
    samples: dict = field(default_factory=dict)  # (row, target) -> [Sample]
    idle: dict = field(default_factory=dict)  # target -> [dict]
    retries: list = field(default_factory=list)  # samples taken a second time after a failure


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
        for row, measure, warmup in rows:
            if warmup:
                for target in TARGETS:
                    with quiet_settle():
                        warmup(running.get(target))
            for index in range(p.runs):
                for target in TARGETS:
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
# The report


def first_line(argv: list[str]) -> str:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        text = (result.stdout or result.stderr).strip()
        return text.splitlines()[0] if text else "?"
    except Exception:
        return "?"


def machine_info(proxyctl: str, repo: Path) -> list[tuple[str, str]]:
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
        ("nginx (origin)", first_line(["nginx", "-v"])),
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

    bulk_label = f"{p.bulk_bytes / GIB:g} GiB" if p.bulk_bytes >= GIB else f"{p.bulk_bytes >> 20} MiB"
    lines: list[str] = []
    add = lines.append
    add("# Benchmarks")
    add("")
    add("Generated by `scripts/bench`; do not edit by hand, run it again. "
        + ("**Quick smoke-test run (`BENCH_QUICK=1`): 1 run, smaller sizes — not for comparison.**"
           if p.quick else f"Each cell is the median of {p.runs} runs."))
    add("")
    add(f"- Date: {started} (took {elapsed / 60:.1f} min)")
    add(f"- Command: `{command}`")
    for key, value in info:
        add(f"- {key}: {value}")
    add("")
    add("Client (curl, hey, Python), proxy and origin (nginx) all share the same "
        f"{os.cpu_count()} cores, so every CPU cycle the proxy spends is taken from the client and the "
        "origin: **CPU per request (or per GiB) matters more than req/s**, and the throughput ratios understate "
        "what a proxy would do with cores of its own. Throughput is a ratio to direct (no proxy) measured in "
        "the same run, right before the proxies; the absolute direct figure is in the direct column.")
    add("")
    foreign = [s.foreign for samples in results.samples.values() for s in samples]
    add(f"Other processes on the machine (not started by the bench) kept a median of {median(foreign):.2f} and at "
        f"most {max(foreign):.2f} cores busy during the samples (`other load` in the last table: busy time from "
        "`/proc/stat`, steal included, less the CPU of the bench's own processes; kernel threads that the bench's "
        "own traffic wakes, such as disk flushes of tinyproxy's log, count as other load too)"
        + (f"; the bench waited {waited:.0f} s in all for that load to drop below 0.25 cores before samples."
           if waited else "."))
    add("")
    add("## Results")
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
    add("## Method")
    add("")
    add(f"- **Origin**: nginx, `worker_processes auto`, access log off, files on {storage}: a "
        f"{bulk_label} incompressible file and a {p.small_bytes}-byte one. HTTPS with TLS 1.3 and a "
        "self-signed ECDSA P-256 certificate; no session resumption, so every new connection is a full "
        "handshake. A plain-HTTP listener serves the same files for row 4.")
    add("- **Proxies**, each started by the script on 127.0.0.1 with a temp config, all three running during "
        "rows 1–4, and started afresh for each run of row 5:")
    add("  - proxyctl: `proxyctl serve --config <temp> --listen 127.0.0.1:0`, `log_level = info` (the default: a "
        "line per request/tunnel on stderr, sent to a file).")
    add("  - tinyproxy: `tinyproxy -d`, Debian's defaults (`LogLevel Info` to a file, Via header) with "
        "`MaxClients 2000` for row 5 and no `ConnectPort` line (CONNECT to any port).")
    add("  - squid: `squid -N` (one worker, no master process), `cache deny all` and `cache_mem 0`, its "
        "default `access_log daemon:…` (a `log_file_daemon` helper process, counted with squid), CONNECT "
        "to any port allowed.")
    add("- **CPU**: utime + stime from `/proc/PID/stat` of the proxy's whole process tree (squid's log "
        "daemon included), read before and after each measurement, divided by CLK_TCK "
        f"({CLK_TCK} Hz, so ±{1e6 / CLK_TCK / max(p.plain_requests, 1):.1f} µs/req resolution at "
        f"{p.plain_requests:,} requests).")
    add(f"- **Row 1**: `curl -x http://127.0.0.1:PORT --cacert … https://127.0.0.1:ORIGIN/bulk.bin -o /dev/null` "
        "(direct: `--noproxy '*'`); throughput = bytes / `time_total`.")
    add(f"- **Row 2**: `hey -c {CONCURRENCY} -n {p.keepalive_requests} -x http://127.0.0.1:PORT "
        "https://127.0.0.1:ORIGIN/small.txt` — hey sends CONNECT for https:// URLs and keeps the "
        f"{CONCURRENCY} tunnels alive.")
    add(f"- **Row 3**: as row 2 with `-disable-keepalive` and `-n {p.new_tunnel_requests}`: a new TCP "
        "connection, CONNECT and TLS handshake per request.")
    add(f"- **Row 4**: `hey -c {CONCURRENCY} -n {p.plain_requests} -x http://127.0.0.1:PORT "
        "http://127.0.0.1:ORIGIN/small.txt` — absolute-form requests over keep-alive client connections.")
    add(f"- Every row starts with a discarded warm-up per target (row 1: a "
        f"{min(p.bulk_bytes, 256 << 20) >> 20} MiB download; rows 2–4: {p.warmup_requests} requests, half that for "
        "row 3); every hey run must return all 200s with no errors or the bench fails. In a full run, each sample "
        "waits (up to 30 s, 10 min in all) for other processes' load to drop below 0.25 cores.")
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
    if results.retries:
        add(f"- Samples taken again after a failed first try: {', '.join(results.retries)}.")
    add("")
    add("## Every run")
    add("")
    add("| Scenario | Target | " + " | ".join(f"run {i + 1}" for i in range(p.runs)) + " |")
    add("|---|---|" + "---|" * p.runs)
    for row, unit in (("bulk", "MB/s"), ("keepalive", "req/s"), ("newtunnel", "req/s"), ("plain", "req/s")):
        for target in TARGETS:
            cells = []
            for index, sample in enumerate(results.samples[(row, target)]):
                value = f"{sample.value / 1e6:,.0f} MB/s" if unit == "MB/s" else f"{sample.value:,.0f} req/s"
                if sample.cpu is not None:
                    direct = results.samples[(row, "direct")][index].value
                    per = (f"{sample.cpu / sample.units:.2f} CPU-s/GiB" if unit == "MB/s"
                           else f"{sample.cpu / sample.units * 1e6:.0f} µs/req")
                    value += f" ({sample.value / direct:.2f}×, {per})"
                value += f"; other load {sample.foreign:.2f}"
                cells.append(value)
            add(f"| {row} | {target} | " + " | ".join(cells) + " |")
    for target in PEERS:
        cells = [
            f"{s['before_kib']:,} → {s['after_kib']:,} KiB, anonymous {s['anon_before_kib']:,} → "
            f"{s['anon_after_kib']:,} ({s['per_tunnel_kib']:.1f} KiB/tunnel, "
            f"{s['processes']} proc, {s['threads']} thr)"
            for s in results.idle[target]
        ]
        add(f"| idle | {target} | " + " | ".join(cells) + " |")
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
        www, storage = prepare_www(args.tmp, p.bulk_bytes, p.small_bytes)
        origin, _ = start_origin(processes, args.tmp, www, cert, (p.bulk_bytes, p.small_bytes))
        log(f"origin: https://127.0.0.1:{origin.https_port} and http://127.0.0.1:{origin.http_port} ({storage})")
        global LOAD
        LOAD = Load(processes, wait=not p.quick)
        proxies = Proxies(processes, args.tmp, args.proxyctl)
        results = Results()
        measure_throughput_rows(p, origin, proxies, results)
        measure_idle_row(p, proxies, results)
        info = machine_info(args.proxyctl, args.repo)
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
