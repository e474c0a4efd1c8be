"""What the bench measures and how: the CPU of a process tree from /proc, the load of other work on the machine
(`Load`), one sample per client run (curl for bulk downloads, hey for request rates), idle tunnels' memory, and
the rows: a discarded warm-up per target, then `Plan.runs` rounds of every target in turn (`run_rows`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from benchlib.harness import (BASELINE, BENCH_HOST, CLIENT_ENV, H2_HOST, BenchError, InterceptSetup, InterceptTarget,
                              InterceptTargets, Origin, Processes, Proxies, Proxy, check_h2_origin, check_headers,
                              check_post, log, origin_protocols, run, start_ws_echo)

CLK_TCK = os.sysconf("SC_CLK_TCK")
GIB = 1 << 30
CONCURRENCY = 50
# The intercept section's rows, by the number the report gives them (BENCH_ROWS names either).
INTERCEPT_ROWS = {"6": "i-keepalive", "6b": "i-rate", "6c": "i-post", "6d": "i-h2", "7": "i-bulk", "8": "i-newconn"}

T = TypeVar("T")


# MARK: - The plan and the results


@dataclass
class Plan:
    """How much of everything: a full run, or a quick smoke test of the bench itself."""
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
    ws_messages: int = 20000  # WebSocket echoes of 1 KiB, one after another, per sample
    # BENCH_ROWS: the intercept rows to measure (INTERCEPT_ROWS' values); None: all of them.
    intercept_rows: frozenset[str] | None = None

    def measures(self, row: str) -> bool:
        """Whether this run measures the intercept row `row` (say "i-post")."""
        return self.intercept_rows is None or row in self.intercept_rows


def plan(quick: bool, intercept_rows: frozenset[str] | None = None, rounds: int | None = None) -> Plan:
    """The full run's plan, or the quick one; `intercept_rows`: BENCH_ROWS (`intercept_rows()`), None for all;
    `rounds`: BENCH_ROUNDS (`rounds()`), None for the plan's own (3, or 1 when quick)."""
    if quick:
        return Plan(True, rounds or 1, 64 << 20, 256, 2000, 500, 2000, 1000, 200, intercept_keepalive_requests=2000,
                    intercept_new_requests=500, intercept_rate_requests=4000, dpop_proofs=5000, speed_seconds=1,
                    ws_messages=2000, intercept_rows=intercept_rows)
    return Plan(False, rounds or 3, GIB, 256, 20000, 5000, 20000, 1000, 1000, intercept_rows=intercept_rows)


def rounds(text: str) -> int | None:
    """BENCH_ROUNDS: how many rounds of every row (a whole number from 1 to 99); None when empty (the plan's
    own). More rounds narrow a median where the machine's spread between rounds is larger than the change
    being measured. BenchError otherwise."""
    if not text.strip():
        return None
    if not text.strip().isdigit() or not 1 <= int(text) <= 99:
        raise BenchError(f"BENCH_ROUNDS: {text!r} is not a number of rounds from 1 to 99")
    return int(text)


def intercept_rows(names: str) -> frozenset[str] | None:
    """BENCH_ROWS ("6,6c,6d": row numbers or names such as i-post, separated by commas) as row names; None when
    empty (every row). BenchError for a name that is no intercept row."""
    if not names.strip():
        return None
    rows = set()
    for name in (part.strip() for part in names.split(",") if part.strip()):
        if name in INTERCEPT_ROWS:
            rows.add(INTERCEPT_ROWS[name])
        elif name in INTERCEPT_ROWS.values():
            rows.add(name)
        else:
            raise BenchError(f"BENCH_ROWS: no intercept row {name!r} (rows: {', '.join(INTERCEPT_ROWS)})")
    return frozenset(rows)


@dataclass
class Sample:
    """One measurement of one target."""
    value: float  # bytes/s or requests/s
    cpu: float | None  # proxy CPU seconds during the sample
    units: float  # GiB or requests
    foreign: float = 0.0  # cores kept busy by processes the bench did not start, during the sample
    # What the proxy's process tree did meanwhile beyond its CPU (`counters`), for the log: a sample dearer than
    # its neighbours shows there whether it faulted, woke or was preempted more.
    detail: Counter | None = None


@dataclass
class Results:
    """Everything measured, for the report."""
    samples: dict = field(default_factory=dict)  # (row, target) -> [Sample]
    idle: dict = field(default_factory=dict)  # target -> [dict]
    retries: list = field(default_factory=list)  # samples taken a second time after a failure
    rewarmed: Counter = field(default_factory=Counter)  # row: samples warmed up again first (STALE_SECONDS)
    intercept_checks: dict = field(default_factory=dict)  # target -> what the origin saw at /headers
    post_checks: dict = field(default_factory=dict)  # target -> what the origin saw of a POST (row 6c)
    h2_checks: dict = field(default_factory=dict)  # target -> what bench-h2.test saw at /headers (row 6d)
    h2_protocols: dict = field(default_factory=dict)  # target -> Counter of protocols in row 6d's samples
    dpop: list = field(default_factory=list)  # per run: DPoPBench's JSON plus openssl speed's rates
    intercept_token: str = ""  # the access token every intercept target sends


# MARK: - CPU and memory of a process tree


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (so index 0 is proc(5)'s field 3, the state), or None
    when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def descendants(root: int) -> list[int]:
    """root and every process below it (squid's log daemon, nginx's workers)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(entry)) is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry))
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
        if (fields := stat_fields(pid)) is not None:
            ticks += int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    return ticks / CLK_TCK


def counters(root: int) -> Counter:
    """User and system ticks (as `cpu_seconds`), minor faults, read- and write-like system calls and their bytes
    (/proc/PID/io: read, recv, write, send and their kin), and voluntary and involuntary context switches (every
    thread's) of the process tree of `root`, to be subtracted from a later reading."""
    total: Counter = Counter()
    for pid in descendants(root):
        if (fields := stat_fields(pid)) is None:
            continue
        total["user"] += int(fields[11])
        total["sys"] += int(fields[12])
        total["minflt"] += int(fields[7])
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("syscr", "syscw", "rchar", "wchar"):
                    total[key] += int(value)
            for task in Path(f"/proc/{pid}/task").iterdir():
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        total["vcs"] += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        total["nvcs"] += int(line.split()[1])
        except OSError:  # gone meanwhile, or /proc/PID/io not ours to read: its CPU still counts
            continue
    return total


def detail_said(detail: Counter | None) -> str:
    """A sample's `detail` for the log line: " (user 1.31s, sys 0.62s, minflt 120, vcs 800, nvcs 11000, reads ...,
    writes ...)"."""
    if not detail:
        return ""
    return (f" (user {detail['user'] / CLK_TCK:.2f}s, sys {detail['sys'] / CLK_TCK:.2f}s, minflt {detail['minflt']}, "
            f"vcs {detail['vcs']}, nvcs {detail['nvcs']}, reads {detail['syscr']} of {detail['rchar']} B, "
            f"writes {detail['syscw']} of {detail['wchar']} B)")


@dataclass
class Footprint:
    """Memory and size of a process tree."""
    rss_kib: int
    anon_kib: int  # RssAnon: the part that is not mapped files (shared libraries)
    processes: int
    threads: int


def footprint(root: int) -> Footprint:
    """VmRSS, RssAnon, processes and threads of the process tree of `root`."""
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


# MARK: - Other work on the machine


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
        """Cores kept busy by others between two snapshots."""
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


_load: Load | None = None


def watch_load(processes: Processes, wait: bool) -> Load:
    """From now on every sample records the other load meanwhile and, with `wait`, waits for it to drop."""
    global _load
    _load = Load(processes, wait)
    return _load


@contextmanager
def no_settling() -> Iterator[None]:
    """Within it, samples do not wait for the machine to calm down (warm-ups)."""
    saved = _load.wait if _load else None
    if _load:
        _load.wait = False
    try:
        yield
    finally:
        if _load:
            _load.wait = saved


def measured(body: Callable[[], T]) -> tuple[T, float]:
    """Runs body() between two load snapshots; returns its result and the foreign load meanwhile."""
    if _load is None:
        return body(), 0.0
    _load.settle()
    before = _load.snapshot()
    result = body()
    return result, _load.foreign(before, _load.snapshot())


# MARK: - Samples


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
        before = counters(pid) if pid else None
        output = run(argv, env=CLIENT_ENV)
        return output, None if before is None else counters(pid) - before

    (output, detail), foreign = measured(body)
    cpu = None if detail is None else (detail["user"] + detail["sys"]) / CLK_TCK
    rate = re.search(r"Requests/sec:\s+([0-9.]+)", output)
    ok = re.search(r"\[200\]\s+(\d+) responses", output)
    if not rate or not ok or int(ok.group(1)) != requests or "Error distribution" in output:
        raise BenchError(f"hey via {who} did not get {requests} × 200:\n{output[-3000:]}")
    return Sample(float(rate.group(1)), cpu, requests, foreign, detail)


def hey_argv(requests: int, keepalive: bool) -> list[str]:
    argv = ["hey", "-c", str(CONCURRENCY), "-n", str(requests), "-t", "30"]
    if not keepalive:
        argv.append("-disable-keepalive")
    return argv


def bulk(origin: Origin, proxy: Proxy | None, limit: int | None = None) -> Sample:
    """A bulk download over HTTPS, through `proxy` (a CONNECT tunnel) or direct."""
    url = f"https://127.0.0.1:{origin.https_port}/bulk.bin"
    argv = ["curl", "-sS", "--fail", "-o", "/dev/null", "--cacert", str(origin.ca),
            "-w", "%{size_download} %{time_total}"]
    argv += ["-x", proxy.url] if proxy else ["--noproxy", "*"]
    if limit is not None:
        argv += ["-r", f"0-{limit - 1}"]
    argv.append(url)
    return curl_sample(argv, CLIENT_ENV, proxy.pid if proxy else None, proxy.name if proxy else "direct",
                       limit or origin.bulk_bytes)


def hey(url: str, proxy: Proxy | None, requests: int, keepalive: bool) -> Sample:
    """Small requests at full speed, through `proxy` or direct."""
    argv = hey_argv(requests, keepalive)
    if proxy:
        argv += ["-x", proxy.url]
    argv.append(url)
    return hey_sample(argv, proxy.pid if proxy else None, proxy.name if proxy else "direct", requests)


async def _idle_tunnels(proxy_port: int, count: int, measure: Callable[[], T]) -> tuple[int, T]:
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
    """The proxy's memory before and with `count` idle CONNECT tunnels open."""
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


def intercept_bulk(target: InterceptTarget, expected: int, limit: int | None = None) -> Sample:
    """A bulk download from the protected origin through an intercept target."""
    argv = ["curl", "-sS", "--fail", "-o", "/dev/null", "-w", "%{size_download} %{time_total}", *target.curl_args]
    if limit is not None:
        argv += ["-r", f"0-{limit - 1}"]
    argv.append(target.curl_base + "/bulk.bin")
    return curl_sample(argv, target.curl_env, target.pid, target.name, limit or expected)


def intercept_hey(target: InterceptTarget, requests: int, keepalive: bool, rate: int | None = None) -> Sample:
    """Small requests to the protected origin through an intercept target, at full speed or at `rate`."""
    argv = hey_argv(requests, keepalive)
    if rate is not None:
        argv += ["-q", f"{rate / CONCURRENCY:g}"]  # hey's -q is per worker
    argv += target.hey_args + [target.hey_base + "/small.txt"]
    return hey_sample(argv, target.pid, target.name, requests)


def intercept_post(target: InterceptTarget, requests: int, body: Path) -> Sample:
    """Row 6c: POSTs of `body` to the protected origin's /upload (answered as row 6's GETs are, once the origin
    read the whole body) through an intercept target, keep-alive, at full speed."""
    argv = hey_argv(requests, True) + ["-m", "POST", "-D", str(body), "-T", "application/octet-stream"]
    argv += target.hey_args + [target.hey_base + "/upload"]
    return hey_sample(argv, target.pid, target.name, requests)


def intercept_h2(target: InterceptTarget, requests: int, origin: Origin, results: Results | None = None) -> Sample:
    """Row 6d: small requests to https://bench-h2.test (an origin that offers HTTP/2) through an intercept target,
    keep-alive, at full speed; then the origin's access log must show every one of them in the protocol of the
    target's route (HTTP/2.0 through proxyctl), else BenchError: a sample of the wrong protocol is not row 6d's.
    With `results`, the protocols seen are added to `results.h2_protocols`."""
    route = target.h2
    if route is None or origin.h2_log is None:
        raise BenchError(f"{target.name} has no route to {H2_HOST}")
    offset = origin.h2_log.stat().st_size
    argv = hey_argv(requests, True) + target.hey_args + [route.hey_base + "/small.txt"]
    sample = hey_sample(argv, target.pid, target.name, requests)
    # nginx writes its buffered log lines within `flush` (100 ms) of the last one.
    deadline = time.monotonic() + 5
    seen = origin_protocols(origin.h2_log, offset)
    while sum(seen.values()) < requests and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = origin_protocols(origin.h2_log, offset)
    if route.protocol is None or set(seen) != {route.protocol} or seen[route.protocol] < requests:
        found = ", ".join(f"{count:,} {protocol}" for protocol, count in seen.most_common()) or "nothing"
        raise BenchError(f"row 6d via {target.name}: {H2_HOST}'s access log shows {found} for {requests:,} requests, "
                         f"not all {route.protocol}: the row would not measure what it says")
    if results is not None:
        results.h2_protocols.setdefault(target.name, Counter()).update(seen)
    return sample


# MARK: - The rows


Row = tuple[str, Callable, Callable | None]  # name, measure(target), warm-up(target)


def round_order(targets: tuple[str, ...], index: int) -> tuple[str, ...]:
    """The targets in the order round `index` measures them: proxyctl and BASELINE (next to each other,
    `with_baseline`) trade places every other round, so that neither binary is always the one measured second
    (on a warmer or busier machine) and a before / after change is not the order's."""
    if index % 2 == 0 or "proxyctl" not in targets or BASELINE not in targets:
        return targets
    order = list(targets)
    first, second = order.index("proxyctl"), order.index(BASELINE)
    order[first], order[second] = order[second], order[first]
    return tuple(order)


# A target whose last sample of a row ended longer ago than this is warmed up again before its next one. The
# proxies close an origin connection left unused for 55 s (proxyctl's pool; nginx's upstream keepalive_timeout is
# longer): row 6b's samples last 10 s, so a round of five targets takes about a minute, and with proxyctl and
# BASELINE trading places a target waited four samples' time in one round and six in the next. After six, its 50
# origin connections were gone (seen with ss) and the sample paid 50 new origin handshakes, some 5 million
# instructions each (scripts/instructions), a few % of the sample's CPU: a bias that fell on one binary in one
# round and on the other in the next, depending on seconds of settling.
STALE_SECONDS = 30


def run_rows(p: Plan, rows: list[Row], targets: tuple[str, ...], running: dict, results: Results) -> None:
    """Each row: a discarded warm-up per target, then p.runs rounds of every target in turn (so each round's
    samples are close in time and comparable to that round's direct sample), proxyctl and BASELINE trading
    places every other round (`round_order`); a target whose last sample ended over STALE_SECONDS before is
    warmed up again first, so that every sample starts with the connections a busy client keeps warm."""
    for row, measure, warmup in rows:
        last_end: dict[str, float] = {}
        if warmup:
            for target in targets:
                with no_settling():
                    warmup(running.get(target))
                last_end[target] = time.monotonic()
        for index in range(p.runs):
            for target in round_order(targets, index):
                if warmup and time.monotonic() - last_end[target] > STALE_SECONDS:
                    with no_settling():
                        warmup(running.get(target))
                    results.rewarmed[row] += 1
                try:
                    sample = measure(running.get(target))
                except (BenchError, subprocess.TimeoutExpired) as error:
                    # One more try: a lost request under load should not cost a whole run.
                    log(f"{row} run {index + 1} {target} failed, trying once more: {str(error)[:500]}")
                    results.retries.append(f"{row} run {index + 1} {target}")
                    sample = measure(running.get(target))
                results.samples.setdefault((row, target), []).append(sample)
                last_end[target] = time.monotonic()
                cpu = "" if sample.cpu is None else f", proxy CPU {sample.cpu:.2f}s"
                log(f"{row} run {index + 1}/{p.runs} {target}: {sample.value:,.1f}/s{cpu}, "
                    f"other load {sample.foreign:.2f} cores{detail_said(sample.detail)}")


def measure_throughput_rows(p: Plan, origin: Origin, proxies: Proxies, results: Results) -> None:
    """Rows 1-4: bulk, keep-alive tunnels, new tunnels, plain HTTP; every peer running throughout."""
    running = {name: proxies.start(name) for name in proxies.peers}
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
        run_rows(p, rows, ("direct",) + proxies.peers, running, results)
    finally:
        for proxy in running.values():
            proxies.stop(proxy)


def measure_idle_row(p: Plan, proxies: Proxies, results: Results) -> None:
    """Row 5: idle tunnels, a fresh proxy for each run."""
    for index in range(p.runs):
        for name in proxies.peers:
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


def measure_intercept_rows(p: Plan, setup: InterceptSetup, targets: InterceptTargets, results: Results) -> None:
    """Rows 6-8, 6b, 6c and 6d (those p.intercept_rows names): the protected origin through every intercept target,
    each checked first at /headers (and for row 6c with a POST whose body the origin echoes, for row 6d at
    bench-h2.test, which must see the protocol the row is about); every target running throughout."""
    running: dict[str, InterceptTarget] = {}
    h2_names = targets.h2_names if p.measures("i-h2") else ()
    # The targets of the rows measured: those of row 6 for rows 6, 6c, 7 and 8.
    needed = set(h2_names) | set(targets.rate_names if p.measures("i-rate") else ())
    if any(p.measures(row) for row in ("i-keepalive", "i-post", "i-bulk", "i-newconn")):
        needed |= set(targets.names)
    try:
        for name in (name for name in targets.names if name in needed):
            running[name] = targets.start(name)
            target = running[name]
            results.intercept_checks[name] = check_headers(target, targets, setup.token)
            log(f"intercept {name}: {target.hey_args or target.hey_base} (pid {target.pid}); "
                f"origin saw {results.intercept_checks[name]}")
            if p.measures("i-post"):  # row 6c runs on every target, as row 6 does
                results.post_checks[name] = check_post(target, targets, setup.token)
                log(f"intercept {name}: a POST to /upload-echo arrived with {results.post_checks[name]}")
            if name in h2_names:
                results.h2_checks[name] = check_h2_origin(target, targets, setup.token)
                log(f"intercept {name}: {H2_HOST} saw {results.h2_checks[name]}")

        def count(target: InterceptTarget, requests: int) -> int:
            # mitmproxy is some 50 times slower: fewer requests keep its samples to seconds, not minutes.
            return max(CONCURRENCY * 2, requests // p.mitmproxy_divisor) if target.name == "mitmproxy" else requests

        def measured_rows(rows: list[Row]) -> list[Row]:
            return [row for row in rows if p.measures(row[0])]

        bulk_bytes = setup.origin.bulk_bytes
        body = setup.post_body
        # Row 6c right after row 6, so that the two rows' CPU per request (GET against POST) are close in time.
        rows = measured_rows([
            ("i-keepalive", lambda t: intercept_hey(t, count(t, p.intercept_keepalive_requests), True),
             lambda t: intercept_hey(t, count(t, p.warmup_requests), True)),
            ("i-post", lambda t: intercept_post(t, count(t, p.intercept_keepalive_requests), body),
             lambda t: intercept_post(t, count(t, p.warmup_requests), body)),
            ("i-bulk", lambda t: intercept_bulk(t, bulk_bytes),
             lambda t: intercept_bulk(t, bulk_bytes, min(bulk_bytes, 256 << 20))),
            ("i-newconn", lambda t: intercept_hey(t, count(t, p.intercept_new_requests), False),
             lambda t: intercept_hey(t, count(t, p.warmup_requests // 2), False)),
        ])
        run_rows(p, rows, targets.names, running, results)
        origin = setup.origin
        h2_rows = measured_rows([
            ("i-h2", lambda t: intercept_h2(t, p.intercept_keepalive_requests, origin, results),
             lambda t: intercept_h2(t, p.warmup_requests, origin)),
        ])
        run_rows(p, h2_rows, targets.h2_names, running, results)
        rate_rows = measured_rows([
            ("i-rate", lambda t: intercept_hey(t, p.intercept_rate_requests, True, p.intercept_rate),
             lambda t: intercept_hey(t, p.warmup_requests, True, p.intercept_rate)),
        ])
        run_rows(p, rate_rows, targets.rate_names, running, results)
        for name, target in running.items():
            if target.child is not None and target.child.poll() is not None:
                raise BenchError(f"{name} exited during the intercept rows ({target.child.returncode})")
    finally:
        for target in running.values():
            if target.child is not None:
                targets.processes.stop(target.child, timeout=15)


# MARK: - Protocols: HTTP/2 and WebSocket to a protected origin


def loadgen_sample(argv: list[str], env: dict, pid: int | None, who: str, count_key: str, expected: int) -> Sample:
    """One loadgen run (it prints JSON with `count_key` and `seconds`); the CPU of pid's tree meanwhile."""

    def body():
        before = cpu_seconds(pid) if pid else None
        output = json.loads(run(argv, env=env, timeout=600))
        after = cpu_seconds(pid) if pid else None
        return output, None if pid is None else after - before

    (output, cpu), foreign = measured(body)
    if output.get(count_key) != expected or output.get("errors", 0):
        raise BenchError(f"loadgen via {who}: {output}")
    return Sample(expected / output["seconds"], cpu, expected, foreign)


def measure_protocol_rows(p: Plan, setup: InterceptSetup, targets: InterceptTargets, loadgen: str,
                          results: Results) -> None:
    """Rows 11-13: HTTP/2 against HTTP/1.1 through proxyctl (small requests on one connection, a bulk
    download), and WebSocket echoes direct and through proxyctl; all in the same rounds."""
    echo, ws_port = start_ws_echo(targets.processes, loadgen, setup)
    targets.extra_origins = [f"https://{BENCH_HOST}:{ws_port}"]
    proxyctl = targets.start_protocols_proxyctl()
    origin = setup.origin
    try:
        proxy = proxyctl.hey_args[1]
        bundle = proxyctl.curl_env["CURL_CA_BUNDLE"]
        small = f"https://{BENCH_HOST}/small.txt"
        ws_url = f"wss://{BENCH_HOST}:{ws_port}/echo"
        checked = json.loads(run([loadgen, "ws", "-url", ws_url, "-n", "10", "-proxy", proxy, "-cacert", bundle]))
        results.intercept_checks["proxyctl (WebSocket)"] = f"upgrade with Authorization: {checked['authorization']}"
        if checked["authorization"] != "bearer":
            raise BenchError(f"the WebSocket origin saw no token through proxyctl: {checked}")

        def h1(target, requests: int) -> Sample:
            return hey_sample(hey_argv(requests, True) + ["-x", proxy, small], target.pid, "proxyctl", requests)

        def h2(target, requests: int) -> Sample:
            argv = [loadgen, "h2", "-url", small, "-n", str(requests), "-c", str(CONCURRENCY), "-proxy", proxy,
                    "-cacert", bundle]
            return loadgen_sample(argv, CLIENT_ENV, target.pid, "proxyctl", "requests", requests)

        def bulk(target, version: str, limit: int | None = None) -> Sample:
            argv = ["curl", "-sS", "--fail", version, "-o", "/dev/null", "-w", "%{size_download} %{time_total}"]
            if limit is not None:
                argv += ["-r", f"0-{limit - 1}"]
            argv.append(f"https://{BENCH_HOST}/bulk.bin")
            return curl_sample(argv, proxyctl.curl_env, target.pid, "proxyctl", limit or origin.bulk_bytes)

        def ws(target, messages: int) -> Sample:
            argv = [loadgen, "ws", "-url", ws_url, "-n", str(messages), "-size", "1024"]
            if target is None:  # direct: to the echo server with its own CA
                argv += ["-connect-to", f"{origin.bench_address}:{ws_port}", "-cacert", str(origin.ca)]
            else:
                argv += ["-proxy", proxy, "-cacert", bundle]
            return loadgen_sample(argv, CLIENT_ENV, target.pid if target else None, "proxyctl", "messages", messages)

        running = {"direct": None, "proxyctl": proxyctl}
        bulk_warm = min(origin.bulk_bytes, 256 << 20)
        rows = [
            ("p-h1", lambda t: h1(t, p.intercept_keepalive_requests), lambda t: h1(t, p.warmup_requests)),
            ("p-h2", lambda t: h2(t, p.intercept_keepalive_requests), lambda t: h2(t, p.warmup_requests)),
            ("p-h1bulk", lambda t: bulk(t, "--http1.1"), lambda t: bulk(t, "--http1.1", bulk_warm)),
            ("p-h2bulk", lambda t: bulk(t, "--http2"), lambda t: bulk(t, "--http2", bulk_warm)),
        ]
        run_rows(p, rows, ("proxyctl",), running, results)
        ws_rows = [("p-ws", lambda t: ws(t, p.ws_messages), lambda t: ws(t, p.ws_messages // 10))]
        run_rows(p, ws_rows, ("direct", "proxyctl"), running, results)
    finally:
        targets.processes.stop(proxyctl.child, timeout=15)
        targets.processes.stop(echo, timeout=5)


# MARK: - DPoP proofs on one core, against OpenSSL's own ES256 signing rate


def openssl_sign_rate(seconds: int) -> tuple[float, float]:
    """`openssl speed -seconds N ecdsap256`: (sign/s, verify/s)."""
    output = run(["openssl", "speed", "-seconds", str(seconds), "ecdsap256"], timeout=120)
    match = re.search(r"256 bits ecdsa \(nistp256\)\s+[0-9.]+s\s+[0-9.]+s\s+([0-9.]+)\s+([0-9.]+)", output)
    if not match:
        raise BenchError(f"cannot read openssl speed's output:\n{output[-1000:]}")
    return float(match.group(1)), float(match.group(2))


def measure_dpop(p: Plan, dpop_bench: str, token_bytes: int, key: Path | None, results: Results) -> None:
    """Rows 9 and 10's reference: OpenSSL's signing rate, then DPoPBench's proofs, alternating."""
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
