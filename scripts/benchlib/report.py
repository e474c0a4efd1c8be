"""docs/benchmarks.md: the machine and the versions, one table per section (passthrough, intercept path,
DPoP) with the targets and earlier figures of reference.toml, the method, and every run's figures; with a
baseline binary (BENCH_BASELINE), a before / after table of proxyctl against it first."""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import re
import statistics
import subprocess
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchlib.harness import (BASELINE, H2_HOST, INTERCEPT_LABELS, INTERCEPT_PEERS, INTERCEPT_TARGETS, PEERS,
                              POST_BYTES, TARGETS, with_baseline)
from benchlib.measurement import CLK_TCK, CONCURRENCY, GIB, INTERCEPT_ROWS, STALE_SECONDS, Plan, Results

REFERENCE = Path(__file__).with_name("reference.toml")
SYMBOLS = {"at_least": "≥", "at_most": "≤", "below": "<"}
OURS = ("proxyctl", "proxyctl-dpop")
# The intercept rows in the order the tables list them (6, 6b, 6c, 6d, 7, 8).
INTERCEPT_ORDER = tuple(INTERCEPT_ROWS.values())


class Reference:
    """The targets and earlier figures of reference.toml, by cell: `ROW.METRIC`."""

    def __init__(self, table: dict):
        self.table = table

    @classmethod
    def load(cls, path: Path = REFERENCE) -> "Reference":
        with open(path, "rb") as data:
            return cls(tomllib.load(data))

    def _entry(self, key: str) -> dict:
        row, metric = key.rsplit(".", 1)
        return self.table.get(row, {}).get(metric, {})

    def _target(self, key: str) -> tuple[str, float | str] | None:
        target = self._entry(key).get("target")
        if not target:
            return None
        [(relation, bound)] = target.items()
        return relation, bound

    def target(self, key: str, signature_us: float | None = None) -> str:
        """The target as the report writes it ("≥ 0.9×", "≤ nginx"), or "—"."""
        found = self._target(key)
        if found is None:
            return "—"
        relation, bound = found
        if bound == "signature":
            return f"{SYMBOLS[relation]} one signature ({signature_us:.0f} µs)"
        unit = self._entry(key).get("unit", "")
        text = bound if isinstance(bound, str) else f"{bound:g}"
        return f"{SYMBOLS[relation]} {text}" + (unit if unit == "×" else f" {unit}" if unit else "")

    def check(self, key: str, value: float, **figures: float) -> str:
        """" ✅" when `value` meets the target, " ❌" when not, "" without a target. A target named after a
        figure of this run ("nginx", "signature") takes it from `figures`."""
        found = self._target(key)
        if found is None:
            return ""
        relation, bound = found
        limit = figures[bound] if isinstance(bound, str) else bound
        met = {"at_least": value >= limit, "at_most": value <= limit, "below": value < limit}[relation]
        return " ✅" if met else " ❌"

    def earlier(self, key: str) -> str:
        """The earlier-reference cell's text, padded for the table: " squid 48 ", or " " when there is none."""
        text = self._entry(key).get("earlier")
        return f" {text} " if text else " "


# MARK: - The machine


def first_line(argv: list[str]) -> str:
    """The first line a command prints (a version), or "?"."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        text = (result.stdout or result.stderr).strip()
        return text.splitlines()[0] if text else "?"
    except Exception:
        return "?"


def git_head(tree: Path) -> str:
    """The short commit of a git work tree's HEAD, and whether tracked files have uncommitted changes."""
    commit = first_line(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    return commit + (" with uncommitted changes" if dirty else "")


def file_digest(path: str) -> str:
    """The first 12 hex digits of a file's SHA-256."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def swift_runtime(path: str) -> str:
    """How a binary has the Swift runtime: linked in (`--static-swift-stdlib`, as scripts/package and scripts/test
    build proxyctl) or from shared libraries (ldd names libswiftCore.so). A dynamic build runs some 1% more
    instructions per intercepted request (every retain and release through the PLT; scripts/instructions, the same
    commit both ways: 167,109 against 165,400), so two binaries compared should be linked alike."""
    needed = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    return "shared Swift runtime" if "libswiftCore.so" in needed else "static Swift runtime"


def runs_said(p: Plan) -> str:
    """The plan's rounds in words: "1 run", "3 runs"."""
    return f"{p.runs} run{'s' if p.runs > 1 else ''}"


@dataclass
class Binary:
    """A proxyctl binary of the run, as found when the run began: what `proxyctl --version` prints, where the
    binary comes from, how it has the Swift runtime, and its checksum, to tell whether the file was replaced
    during the run."""
    path: str
    version: str
    source: str
    digest: str
    runtime: str  # swift_runtime(path)
    changed: bool = False  # replaced during the run (a rebuild): its figures may mix two builds

    def __str__(self) -> str:
        warning = "; **the file changed during the run: its figures may mix two builds**" if self.changed else ""
        return f"{self.version} ({self.source}; {self.runtime}{warning})"

    def check_unchanged(self) -> bool:
        """Whether the file is still the one described; marks it `changed` when not."""
        self.changed = self.changed or file_digest(self.path) != self.digest
        return not self.changed


def describe_binary(path: str, built_from: Path | None = None, given_by: str = "") -> Binary:
    """Which proxyctl binary `path` is: what `proxyctl --version` prints, and either the commit of the work tree
    `built_from` that this run built it from, or the variable that named it (`given_by`: BENCH_PROXYCTL,
    BENCH_BASELINE), its path, checksum and modification time, and the git work tree it lies in, if any, with that
    tree's HEAD (the binary may be older than that)."""
    version = first_line([path, "--version"])
    digest = file_digest(path)
    runtime = swift_runtime(path)
    if built_from is not None:
        return Binary(path, version, f"release build of commit {git_head(built_from)}, as scripts/package builds it",
                      digest, runtime)
    modified = datetime.datetime.fromtimestamp(os.stat(path).st_mtime, datetime.timezone.utc)
    source = f"{given_by}={path}, sha256 {digest}…, modified {modified:%Y-%m-%d %H:%M:%S UTC}"
    tree = subprocess.run(["git", "-C", str(Path(path).parent), "rev-parse", "--show-toplevel"],
                          capture_output=True, text=True).stdout.strip()
    if tree:
        source += f"; it lies in the git work tree {tree}, whose HEAD was {git_head(Path(tree))} when the run began"
    return Binary(path, version, source, digest, runtime)


def binaries(proxyctl: str, built_from: Path | None, baseline: str | None) -> dict[str, Binary]:
    """Each proxyctl binary of the run, by target name, described when the run begins: proxyctl (built by this
    run from the work tree `built_from`, or given by BENCH_PROXYCTL when that is None), and BASELINE with a
    baseline binary."""
    found = {"proxyctl": describe_binary(proxyctl, built_from, "BENCH_PROXYCTL")}
    if baseline is not None:
        found[BASELINE] = describe_binary(baseline, given_by="BENCH_BASELINE")
    return found


def machine_info(proxyctl: dict[str, Binary], mitmdump: str) -> list[tuple[str, str]]:
    """The machine, the OS and every program's version, for the report's head; `proxyctl`: each proxyctl binary
    of the run (`binaries()`)."""
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
    hey_version = first_line(["dpkg-query", "-W", "-f=${Version}", "hey"])
    return [
        ("nproc", str(os.cpu_count())),
        ("CPU", cpu),
        ("Memory", f"{mem_kib / (1 << 20):.1f} GiB"),
        ("Kernel", f"{platform.system()} {platform.release()} ({platform.machine()})"),
        ("OS", os_name),
        *((name, str(binary)) for name, binary in proxyctl.items()),
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


# MARK: - The report


def median(values: list[float]) -> float:
    return statistics.median(values)


def fmt_ratio(value: float) -> str:
    return f"{value:.2f}×"


def fmt_change(before: float, after: float) -> str:
    """after against before, in per cent ("+3.1%"); "—" when before is not a positive figure."""
    if before <= 0:
        return "—"
    return f"{round((after / before - 1) * 100, 1) + 0.0:+.1f}%"  # + 0.0: no "-0.0%"


@dataclass
class Comparison:
    """One line of the before / after table: a figure of a row, for proxyctl and for BASELINE."""
    row: str
    metric: str
    higher_is_better: bool
    runs: Callable[[str], list[float]]  # a target's figure in each run
    fmt: Callable[[float], str]


class Report:
    """The report's lines, section by section."""

    def __init__(self, p: Plan, results: Results, storage: str, reference: Reference):
        self.p = p
        self.results = results
        self.storage = storage
        self.ref = reference
        self.lines: list[str] = []
        self.passthrough = ("bulk", "direct") in results.samples and bool(results.idle)
        # The intercept rows this run measured (BENCH_ROWS may have left some out).
        self.intercept_rows = tuple(row for row in INTERCEPT_ORDER if (row, "direct") in results.samples)
        self.intercept = bool(self.intercept_rows)
        self.dpop = bool(results.dpop)
        self.protocols = ("p-ws", "direct") in results.samples
        self.rated = self.has("i-rate")
        self.baseline = BASELINE in results.idle or any(target == BASELINE for _, target in results.samples)
        self.bulk_label = f"{p.bulk_bytes / GIB:g} GiB" if p.bulk_bytes >= GIB else f"{p.bulk_bytes >> 20} MiB"
        self.token_bytes = len(results.intercept_token) if results.intercept_token else "~900"
        # Each row's number and scenario, as every table names them.
        self.scenarios = {
            "bulk": ("1", f"CONNECT bulk {self.bulk_label} download over HTTPS (curl)"),
            "keepalive": ("2", f"Small HTTPS requests, keep-alive tunnels, c={CONCURRENCY} (hey -x)"),
            "newtunnel": ("3", f"New CONNECT + TLS handshake per request, c={CONCURRENCY} (hey -disable-keepalive)"),
            "plain": ("4", f"Plain-HTTP absolute-form requests, c={CONCURRENCY} (hey -x, http:// URL)"),
            "idle": ("5", f"{p.idle_count:,} idle CONNECT tunnels (Python asyncio client)"),
            "i-keepalive": ("6", f"Small HTTPS requests, keep-alive, c={CONCURRENCY} (hey; -x for the forward "
                                 "proxies)"),
            "i-rate": ("6b", f"As row 6 at a fixed {p.intercept_rate:,} req/s (hey -q), equal load for every target"),
            "i-post": ("6c", f"As row 6 with POSTs of a {POST_BYTES / 1024:g} KiB body (hey -m POST -D), read whole "
                             "by the origin"),
            "i-h2": ("6d", f"As row 6 against an origin that offers HTTP/2 ({H2_HOST}, ALPN h2): proxyctl speaks h2 "
                           "upstream"),
            "i-bulk": ("7", f"Bulk {self.bulk_label} download (curl)"),
            "i-newconn": ("8", f"New connection + TLS handshake per request, c={CONCURRENCY} "
                               "(hey -disable-keepalive)"),
        }

    def add(self, line: str) -> None:
        self.lines.append(line)

    # --- figures

    def rewarmed_said(self) -> str:
        """The samples of this run warmed up again before they were taken, by row: "; in this run: row 6b 20
        samples", or nothing."""
        counts = self.results.rewarmed
        if not counts:
            return ""
        rows = ", ".join(f"row {self.scenarios.get(row, (row,))[0]} {n} sample{'s' if n > 1 else ''}"
                         for row, n in counts.items())
        return f"; in this run: {rows}"

    def has(self, row: str) -> bool:
        """Whether this run measured the row (its direct column: every row has one)."""
        return (row, "direct") in self.results.samples

    def ran(self, row: str, targets: tuple[str, ...]) -> tuple[str, ...]:
        """Those of `targets` that this run measured in `row`."""
        return tuple(t for t in targets if (row, t) in self.results.samples)

    def row_numbers(self, target: str) -> str:
        """The intercept rows `target` ran in this run, as the prose names them ("rows 6–8, 6b, 6c and 6d")."""
        numbers = [self.scenarios[row][0] for row in self.intercept_rows if (row, target) in self.results.samples]
        if {"6", "7", "8"} <= set(numbers):
            numbers = ["6–8"] + [n for n in numbers if n not in ("6", "7", "8")]
        if not numbers:
            return "no intercept row"
        return ("row " if numbers != ["6–8"] and len(numbers) == 1 else "rows ") + " and ".join(
            ", ".join(numbers).rsplit(", ", 1))

    def cpu_vs_row6(self, row: str, target: str) -> list[float]:
        """Each run's CPU per request of `target` in `row` over the same run's in row 6 (GET, HTTP/1.1 origin)."""
        return [mine / get for mine, get in zip(self.cpu_runs(row, target, 1e6),
                                                self.cpu_runs("i-keepalive", target, 1e6))]

    def ratios(self, row: str, target: str) -> list[float]:
        """Each run's figure of `target` over that run's direct figure."""
        direct = self.results.samples[(row, "direct")]
        mine = self.results.samples[(row, target)]
        return [m.value / d.value for m, d in zip(mine, direct)]

    def cpu_runs(self, row: str, target: str, scale: float) -> list[float]:
        """Each run's CPU seconds per unit (GiB, or request), times `scale`."""
        return [s.cpu / s.units * scale for s in self.results.samples[(row, target)]]

    def cpu_per(self, row: str, target: str, scale: float) -> float:
        """The median CPU seconds per unit (GiB, or request), times `scale`."""
        return median(self.cpu_runs(row, target, scale))

    def absolute(self, row: str, target: str, unit: str) -> str:
        value = median([s.value for s in self.results.samples[(row, target)]])
        if unit == "MB/s":
            return f"{value / 1e6:,.0f} MB/s"
        return f"{value:,.0f} req/s"

    # --- sections

    def head(self, info: list[tuple[str, str]], command: str, started: str, elapsed: float, waited: float) -> None:
        p, results = self.p, self.results
        add = self.add
        add("# Benchmarks")
        add("")
        add("Generated by `scripts/bench`; do not edit by hand, run it again. "
            + (f"**Quick smoke-test run (`BENCH_QUICK=1`): {runs_said(p)}, smaller sizes — not for comparison.**"
               if p.quick else f"Each cell is the median of {p.runs} runs."))
        if not (self.passthrough and self.protocols and self.dpop and self.intercept_rows == INTERCEPT_ORDER):
            add("**Partial run (`BENCH_ONLY`, `BENCH_ROWS`): some sections or rows were not measured.**")
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
            add(f"Other processes on the machine (not started by the bench) kept a median of {median(foreign):.2f} "
                f"and at most {max(foreign):.2f} cores busy during the samples (`other load` in the last table: "
                "busy time from `/proc/stat`, steal included, less the CPU of the bench's own processes; kernel "
                "threads that the bench's own traffic wakes, such as disk flushes of tinyproxy's log, count as "
                "other load too)"
                + (f"; the bench waited {waited:.0f} s in all for that load to drop below 0.25 cores before samples."
                   if waited else "."))
            add("")

    def passthrough_table(self) -> None:
        p, results, ref, add = self.p, self.results, self.ref, self.add
        add("## Passthrough: blind tunnels and plain HTTP")
        add("")
        add("| # | Scenario | Metric | Target (issue) | direct | proxyctl | tinyproxy | squid | earlier reference |")
        add("|---|---|---|---|---|---|---|---|---|")
        rows = [("bulk", "throughput × direct", "MB/s"), ("keepalive", "req/s × direct", "req/s"),
                ("newtunnel", "req/s × direct", "req/s"), ("plain", "req/s × direct", "req/s")]
        for row, metric, unit in rows:
            number, scenario = self.scenarios[row]
            r = {t: median(self.ratios(row, t)) for t in PEERS}
            throughput, cpu = f"{row}.throughput", f"{row}.cpu"
            add(f"| {number} | {scenario} | {metric} | {ref.target(throughput)} | "
                f"1.00× ({self.absolute(row, 'direct', unit)}) | "
                f"{fmt_ratio(r['proxyctl'])}{ref.check(throughput, r['proxyctl'])} | "
                f"{fmt_ratio(r['tinyproxy'])} | {fmt_ratio(r['squid'])} |{ref.earlier(throughput)}|")
            if row == "bulk":
                c = {t: self.cpu_per(row, t, 1.0) for t in PEERS}
                cells = [f"{c['proxyctl']:.2f}{ref.check(cpu, c['proxyctl'])}", f"{c['tinyproxy']:.2f}",
                         f"{c['squid']:.2f}"]
                cpu_metric = "proxy CPU-s per GiB"
            else:
                c = {t: self.cpu_per(row, t, 1e6) for t in PEERS}
                cells = [f"{c['proxyctl']:.0f}{ref.check(cpu, c['proxyctl'])}", f"{c['tinyproxy']:.0f}",
                         f"{c['squid']:.0f}"]
                cpu_metric = "proxy CPU µs/req"
            add(f"| {number} | | {cpu_metric} | {ref.target(cpu)} | — | {' | '.join(cells)} |{ref.earlier(cpu)}|")
        # 5. idle tunnels
        per = {t: median([s["per_tunnel_kib"] for s in results.idle[t]]) for t in PEERS}
        total_mb = {t: median([s["after_kib"] for s in results.idle[t]]) * 1024 / 1e6 for t in PEERS}
        anon_mb = {t: median([s["anon_after_kib"] for s in results.idle[t]]) * 1024 / 1e6 for t in PEERS}
        model = {}
        for t in PEERS:
            last = results.idle[t][-1]
            model[t] = f"{last['processes']} proc, {last['threads']} thr"
        add(f"| 5 | {self.scenarios['idle'][1]} | KiB RSS per idle tunnel | "
            f"{ref.target('idle.per_tunnel')} | — | "
            f"{per['proxyctl']:.1f}{ref.check('idle.per_tunnel', per['proxyctl'])} | "
            f"{per['tinyproxy']:.1f} | {per['squid']:.1f} |{ref.earlier('idle.per_tunnel')}|")
        add(f"| 5 | | total RSS with the tunnels open (of which anonymous) | {ref.target('idle.total')} | — | "
            f"{total_mb['proxyctl']:.1f} MB ({anon_mb['proxyctl']:.1f})"
            f"{ref.check('idle.total', total_mb['proxyctl'])} | "
            f"{total_mb['tinyproxy']:.1f} MB ({anon_mb['tinyproxy']:.1f}) | "
            f"{total_mb['squid']:.1f} MB ({anon_mb['squid']:.1f}) |{ref.earlier('idle.total')}|")
        add(f"| 5 | | processes / threads with the tunnels open | {ref.target('idle.model')} | — | "
            f"{model['proxyctl']} | {model['tinyproxy']} | {model['squid']} |{ref.earlier('idle.model')}|")
        add("")
        add("✅/❌: proxyctl against the issue's target. Earlier reference: figures measured before on this kind of "
            "machine, quoted in the issue; not from this run.")
        add("")

    def intercept_table(self) -> None:
        results, ref, add = self.results, self.ref, self.add
        micro = lambda v: f"{v:,.0f}"  # noqa: E731

        def cells(key: str | None, values: dict, fmt: Callable[[float], str]) -> str:
            """A cell per intercept peer, "—" for one that did not run the row; the proxyctl columns checked against
            the target `key` (none without a key)."""
            figures = {"nginx": values["nginx"]} if "nginx" in values else {}
            return " | ".join(
                (fmt(values[t]) + (ref.check(key, values[t], **figures) if key and t in OURS else ""))
                if t in values else "—" for t in INTERCEPT_PEERS)

        add("## Intercept path: a protected origin, token attached")
        add("")
        add("The client asks for `https://bench.test/…` (nginx serving the same files from "
            f"{self.storage}); each target adds `Authorization` on the way. proxyctl terminates TLS with its local "
            "CA, attaches the token (Bearer, or DPoP with a fresh proof per request) and re-encrypts to the origin "
            "with its own HTTP client (libcurl in builds before issue 28), which offers the origin HTTP/2 by ALPN: "
            f"bench.test's listener answers HTTP/1.1, {H2_HOST}'s (row 6d, same files) HTTP/2. nginx does the same "
            "as a TLS-terminating reverse proxy (the C reference; HTTP/1.1 to every origin); mitmproxy as a forward "
            "proxy with an addon. \"≥ nginx\" means at least the nginx column of this run; \"—\": the target does "
            "not run that row.")
        add("")
        add("| # | Scenario | Metric | Target (issue) | direct | proxyctl (Bearer) | proxyctl (DPoP) | nginx | "
            "mitmproxy | earlier reference |")
        add("|---|---|---|---|---|---|---|---|---|---|")
        for row in self.intercept_rows:
            number, scenario = self.scenarios[row]
            peers = self.ran(row, INTERCEPT_PEERS)
            if row == "i-rate":
                rate = {t: median([s.value for s in results.samples[(row, t)]]) for t in peers}
                add(f"| {number} | {scenario} | req/s achieved | — | "
                    f"{self.absolute(row, 'direct', 'req/s').removesuffix(' req/s')} | {cells(None, rate, micro)} | |")
                add(f"| {number} | | proxy CPU µs/req | {ref.target('i-rate.cpu')} | — | "
                    f"{cells('i-rate.cpu', {t: self.cpu_per(row, t, 1e6) for t in peers}, micro)} |"
                    f"{ref.earlier('i-rate.cpu')}|")
                continue
            bulk = row == "i-bulk"
            throughput, cpu = f"{row}.throughput", f"{row}.cpu"
            ratio = {t: median(self.ratios(row, t)) for t in peers}
            add(f"| {number} | {scenario} | {'throughput' if bulk else 'req/s'} × direct | {ref.target(throughput)} | "
                f"1.00× ({self.absolute(row, 'direct', 'MB/s' if bulk else 'req/s')}) | "
                f"{cells(throughput, ratio, fmt_ratio)} |{ref.earlier(throughput)}|")
            per = {t: self.cpu_per(row, t, 1.0 if bulk else 1e6) for t in peers}
            add(f"| {number} | | {'proxy CPU-s per GiB' if bulk else 'proxy CPU µs/req'} | {ref.target(cpu)} | — | "
                f"{cells(cpu, per, (lambda v: f'{v:.2f}') if bulk else micro)} |{ref.earlier(cpu)}|")
            if row in ("i-post", "i-h2") and self.has("i-keepalive"):
                # The issue compares these rows' CPU per request with row 6's: per run, then the median.
                key = f"{row}.cpu_vs_row6"
                versus = {t: median(self.cpu_vs_row6(row, t)) for t in self.ran("i-keepalive", peers)}
                what = "GET" if row == "i-post" else "HTTP/1.1 origin"
                add(f"| {number} | | proxy CPU µs/req ÷ row 6's ({what}) | {ref.target(key)} | — | "
                    f"{cells(key, versus, fmt_ratio)} |{ref.earlier(key)}|")
            if row == "i-h2":
                add(f"| {number} | | protocol at the origin (its access log, every request of the samples) | — | "
                    f"{self.protocols_seen('direct')} | "
                    + " | ".join(self.protocols_seen(t) if t in peers else "—" for t in INTERCEPT_PEERS) + " | |")
        add("")
        add("✅/❌: each proxyctl column against the target; the targets are the issue's (nginx's figures of this "
            "run, 0.9× direct for new connections, and for POSTs a CPU per request within 15% of row 6's GETs). "
            "Earlier reference: measured before on this machine, quoted in the issue; not from this run.")
        add("")
        add("What the origin received, checked once per target before the samples (`/headers` echoes the request's "
            "fields; for row 6c, `/upload-echo` also the body it read; for row 6d, " + H2_HOST + "'s `/headers` also "
            "the protocol):")
        add("")
        for name in with_baseline(INTERCEPT_TARGETS, self.baseline):
            if name not in results.intercept_checks:
                continue  # not started: none of its rows was measured (BENCH_ROWS)
            add(f"- {INTERCEPT_LABELS[name]}: {results.intercept_checks[name]}")
            if name in results.post_checks:
                add(f"  - a POST (row 6c): {results.post_checks[name]}")
            if name in results.h2_checks:
                add(f"  - {H2_HOST} (row 6d): {results.h2_checks[name]}")
        add("")

    def protocols_table(self) -> None:
        """Rows 11-13: HTTP/2 and WebSocket to a protected origin through proxyctl."""
        add, samples = self.add, self.results.samples

        def rate(row: str, target: str = "proxyctl") -> float:
            return median([s.value for s in samples[(row, target)]])

        def per(row: str, scale: float) -> float:
            return self.cpu_per(row, "proxyctl", scale)

        def mark(ok: bool) -> str:
            return " ✅" if ok else " ❌"

        h1, h2 = rate("p-h1"), rate("p-h2")
        h1c, h2c = per("p-h1", 1e6), per("p-h2", 1e6)
        b1, b2 = rate("p-h1bulk"), rate("p-h2bulk")
        b1c, b2c = per("p-h1bulk", 1.0), per("p-h2bulk", 1.0)
        wd, wp = rate("p-ws", "direct"), rate("p-ws")
        wc = per("p-ws", 1e6)
        add("## Protocols: HTTP/2 and WebSocket to a protected origin")
        add("")
        add("The same proxyctl (Bearer) and origin as rows 6-8, in rounds of their own. HTTP/2 is what the client "
            "speaks to proxyctl (ALPN h2); proxyctl speaks HTTP/1.1 to the origin (bench.test's listener offers no "
            "h2; row 6d is the one against an origin that does), so the rows compare the client side. The WebSocket "
            "origin is a Go echo server on the origin's address (`loadgen wsecho`), protected like bench.test; the "
            "client sends 1 KiB binary messages one after another, each waiting for its echo.")
        add("")
        add("| # | Scenario | Metric | Target (issue) | HTTP/1.1 | HTTP/2 |")
        add("|---|---|---|---|---|---|")
        add(f"| 11 | Small HTTPS requests, c={CONCURRENCY}: keep-alive connections (hey) vs {CONCURRENCY} streams on "
            f"one connection (loadgen h2) | req/s | h2 ≥ h1 | {h1:,.0f} | {h2:,.0f} ({h2 / h1:.2f}×){mark(h2 >= h1)} |")
        add(f"| 11 | | proxy CPU µs/req | h2 ≤ h1 | {h1c:.0f} | {h2c:.0f}{mark(h2c <= h1c)} |")
        add(f"| 12 | Bulk {self.bulk_label} download (curl --http1.1 / --http2) | MB/s | h2 within 10% of h1 | "
            f"{b1 / 1e6:,.0f} | {b2 / 1e6:,.0f} ({b2 / b1:.2f}×){mark(b2 >= 0.9 * b1)} |")
        add(f"| 12 | | proxy CPU-s per GiB | — | {b1c:.2f} | {b2c:.2f} |")
        add("")
        add("| # | Scenario | Metric | direct | proxyctl |")
        add("|---|---|---|---|---|")
        add(f"| 13 | WebSocket echo of 1 KiB messages, one at a time (loadgen ws) | messages/s | {wd:,.0f} | "
            f"{wp:,.0f} ({wp / wd:.2f}×) |")
        add(f"| 13 | | µs per message (round trip) | {1e6 / wd:.0f} | {1e6 / wp:.0f} (+{1e6 / wp - 1e6 / wd:.0f}) |")
        add(f"| 13 | | proxy CPU µs/message | — | {wc:.1f} |")
        add("")

    def dpop_table(self) -> None:
        p, results, ref, add = self.p, self.results, self.ref, self.add
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
        add(f"| 9 | ES256 (ECDSA P-256) signatures on one core | signatures/s | {ref.target('dpop.signatures')} | "
            f"{sign:,.0f} sign/s ({signature_us:.1f} µs) | `PrivateKey.signES256` alone: {alone:,.0f}/s "
            f"({fmt_ratio(alone_ratio)}, {1e6 / alone:.1f} µs) |{ref.earlier('dpop.signatures')}|")
        add(f"| 9 | DPoP proofs on one core (`DPoPKey.proof`, Tests/Bench) | proofs/s × raw signing | "
            f"{ref.target('dpop.proofs')} | 1.00× | {proofs:,.0f}/s = {fmt_ratio(proof_ratio)}"
            f"{ref.check('dpop.proofs', proof_ratio)} ({1e6 / proofs:.1f} µs/proof) |{ref.earlier('dpop.proofs')}|")
        if self.intercept:
            def delta(row: str) -> float:
                """Per run, the DPoP column's CPU µs/request less the Bearer column's."""
                return median([(d.cpu - b.cpu) / d.units * 1e6 for d, b in
                               zip(results.samples[(row, "proxyctl-dpop")], results.samples[(row, "proxyctl")])])

            def overhead(value: float) -> str:
                return f"{value:+.0f}{ref.check('dpop.overhead', value, signature=signature_us)}"

            parts = [(row, what) for row, what in
                     (("i-keepalive", "keep-alive at full speed"),
                      ("i-rate", f"keep-alive at {p.intercept_rate:,} req/s (row 6b, equal load)"),
                      ("i-newconn", "new connections"))
                     if (row, "proxyctl-dpop") in results.samples and (row, "proxyctl") in results.samples]
            if parts:
                add(f"| 10 | Intercept path, DPoP − Bearer (rows 6, 6b and 8, same run) | proxy CPU µs/req | "
                    f"{ref.target('dpop.overhead', signature_us)} | — | "
                    + "; ".join(f"{what}: {overhead(delta(row))}" for row, what in parts)
                    + f" |{ref.earlier('dpop.overhead')}|")
        add("")
        add("✅/❌: proxyctl against the issue's target; the raw signing rate is `openssl speed` of this run.")
        add("")

    def comparisons(self) -> list[Comparison]:
        """The figures the before / after table compares, row by row, for the rows this run measured."""
        results = self.results
        micro = lambda v: f"{v:,.0f}"  # noqa: E731
        decimals = lambda v: f"{v:.2f}"  # noqa: E731

        def throughput_and_cpu(row: str) -> list[Comparison]:
            """A row's throughput as a ratio to direct, and the proxy's CPU per GiB (bulk rows) or per request."""
            bulk = row.endswith("bulk")
            return [
                Comparison(row, "throughput × direct" if bulk else "req/s × direct", True,
                           lambda t: self.ratios(row, t), fmt_ratio),
                Comparison(row, "proxy CPU-s per GiB" if bulk else "proxy CPU µs/req", False,
                           lambda t: self.cpu_runs(row, t, 1.0 if bulk else 1e6), decimals if bulk else micro),
            ]

        found: list[Comparison] = []
        if self.passthrough:
            for row in ("bulk", "keepalive", "newtunnel", "plain"):
                found += throughput_and_cpu(row)
            found += [
                Comparison("idle", "KiB RSS per idle tunnel", False,
                           lambda t: [s["per_tunnel_kib"] for s in results.idle[t]], lambda v: f"{v:.1f}"),
                Comparison("idle", "total RSS with the tunnels open", False,
                           lambda t: [s["after_kib"] * 1024 / 1e6 for s in results.idle[t]], lambda v: f"{v:.1f} MB"),
            ]
        for row in self.intercept_rows:
            if (row, BASELINE) not in results.samples:
                continue
            if row == "i-rate":
                found += [
                    Comparison("i-rate", "req/s achieved", True,
                               lambda t: [s.value for s in results.samples[("i-rate", t)]], micro),
                    Comparison("i-rate", "proxy CPU µs/req", False, lambda t: self.cpu_runs("i-rate", t, 1e6), micro),
                ]
                continue
            found += throughput_and_cpu(row)
            if row in ("i-post", "i-h2") and ("i-keepalive", BASELINE) in results.samples:
                found.append(Comparison(row, "proxy CPU µs/req ÷ row 6's", False,
                                        lambda t, row=row: self.cpu_vs_row6(row, t), fmt_ratio))
        return found

    def before_after_table(self, binaries: dict[str, Binary]) -> None:
        """proxyctl against BASELINE (the BENCH_BASELINE binary) in every row both ran, from the same rounds of
        this run; `binaries`: what each binary is (`binaries()`)."""
        p, add = self.p, self.add
        add(f"## Before / after: proxyctl against {BASELINE} (BENCH_BASELINE)")
        add("")
        add(f"- after, `proxyctl`: {binaries['proxyctl']}")
        add(f"- before, `{BASELINE}`: {binaries[BASELINE]}")
        if binaries["proxyctl"].version == binaries[BASELINE].version:
            add(f"- Both print the same `proxyctl --version` ({binaries[BASELINE].version}): what follows it above "
                "tells them apart.")
        if binaries["proxyctl"].runtime != binaries[BASELINE].runtime:
            add(f"- **The two are linked differently ({binaries['proxyctl'].runtime} against "
                f"{binaries[BASELINE].runtime}): part of every change below is the linking's, about 1% of "
                "instructions per intercepted request. Build both with `--static-swift-stdlib`.**")
        add("")
        add(f"The two binaries ran in the same run, set up alike: forward proxies in rows 1–5, Bearer intercept "
            f"targets in {self.row_numbers(BASELINE)} (no DPoP column for {BASELINE}). In every round of a row, "
            f"{BASELINE} and proxyctl were measured one right after the other, trading places every other round "
            "(proxyctl first in rounds 1, 3, …), both after direct (the ratios' denominator). Change: "
            "after / before − 1, of the medians; each run: the same of one round's figures, which shows how much "
            "of a change is noise. ↑: higher is better, ↓: lower is better."
            + (f" **Quick run: {runs_said(p)} of small sizes, a smoke test; not evidence of a change.**"
               if p.quick else ""))
        add("")
        add(f"| # | Scenario | Metric | before ({BASELINE}) | after (proxyctl) | change | each run |")
        add("|---|---|---|---|---|---|---|")
        previous = ""
        for comparison in self.comparisons():
            before, after = comparison.runs(BASELINE), comparison.runs("proxyctl")
            number, scenario = self.scenarios[comparison.row]
            runs = ", ".join(fmt_change(b, a) for b, a in zip(before, after))
            add(f"| {number} | {scenario if comparison.row != previous else ''} | {comparison.metric} "
                f"{'↑' if comparison.higher_is_better else '↓'} | {comparison.fmt(median(before))} | "
                f"{comparison.fmt(median(after))} | {fmt_change(median(before), median(after))} | {runs} |")
            previous = comparison.row
        add("")
        protocols = {t: self.protocols_seen(t) for t in ("proxyctl", BASELINE)}
        if all(protocols.values()):
            same = protocols["proxyctl"] == protocols[BASELINE]
            add(f"Row 6d: {H2_HOST}'s access log shows {BASELINE} speaking {protocols[BASELINE]} to it and proxyctl "
                f"{protocols['proxyctl']}"
                + ("." if same else ": the change in that row includes the change of the upstream protocol."))
            add("")

    def protocols_seen(self, target: str) -> str:
        """The protocols row 6d's origin logged for `target`'s samples ("HTTP/2.0", or counts when mixed), "" when
        it ran no row 6d."""
        counts = self.results.h2_protocols.get(target)
        if not counts:
            return ""
        if len(counts) == 1:
            return next(iter(counts))
        return ", ".join(f"{count:,} {protocol}" for protocol, count in counts.most_common())

    def method(self) -> None:
        p, results, add = self.p, self.results, self.add
        add("## Method")
        add("")
        if self.passthrough or self.intercept:
            add(f"- **Origin**: nginx, `worker_processes auto`, access log off, files on {self.storage}: a "
                f"{self.bulk_label} incompressible file and a {p.small_bytes}-byte one. HTTPS with TLS 1.3 and ECDSA "
                "P-256 certificates from one test CA; no session resumption, so every new connection is a full "
                "handshake. Four listeners: https with a leaf for 127.0.0.1 (rows 1–3), plain HTTP (row 4), "
                "https for `bench.test` (rows 6–8, 6b, 6c, and `/headers`, which echoes `Authorization` and `DPoP`) "
                f"and https with `http2` for `{H2_HOST}` (row 6d: the same files, ALPN h2 offered; its access log, "
                "the only one on, has each request's `$server_protocol`), each on port 443 of a loopback address "
                "picked at random (127.x.y.z), so that every client sends the same plain host name as its TLS server "
                "name (hey sends `host:port` for other ports, which proxyctl accepts only when the port is the "
                "tunnel's). `bench.test/upload` takes row 6c's POSTs: the mirror module (`mirror` to an internal "
                "`return 204`) reads the whole body into memory (`client_body_buffer_size 64k`) before the answer, "
                "which is `/small.txt`'s, as in row 6 (`error_page 404 = /small.txt`, the static handler finding "
                "no file `upload`); `return` alone would discard the body, perhaps after answering, and a static "
                "file answers POSTs with 405.")
        if self.passthrough:
            add("- **Passthrough proxies** (rows 1–5), each started by the script on 127.0.0.1 with a temp config, all "
                "three running during rows 1–4, and started afresh for each run of row 5:")
            add("  - proxyctl: `proxyctl serve --config <temp> --listen 127.0.0.1:0`, `log_level = info` (the default: "
                "a line per request/tunnel on stderr, sent to a file).")
            add("  - tinyproxy: `tinyproxy -d`, Debian's defaults (`LogLevel Info` to a file, Via header) with "
                "`MaxClients 2000` for row 5 and no `ConnectPort` line (CONNECT to any port).")
            add("  - squid: `squid -N` (one worker, no master process), `cache deny all` and `cache_mem 0`, its "
                "default `access_log daemon:…` (a `log_file_daemon` helper process, counted with squid), CONNECT "
                "to any port allowed.")
        add("- **CPU**: utime + stime from `/proc/PID/stat` of the proxy's whole process tree (squid's log "
            "daemon, nginx's workers included), read before and after each measurement, divided by CLK_TCK "
            f"({CLK_TCK} Hz, so ±{1e6 / CLK_TCK / max(p.plain_requests, 1):.1f} µs/req resolution at "
            f"{p.plain_requests:,} requests).")
        if self.passthrough:
            add("- **Row 1**: `curl -x http://127.0.0.1:PORT --cacert … https://127.0.0.1:ORIGIN/bulk.bin -o "
                "/dev/null` "
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
            "for new connections), and a target whose last sample of the row ended over "
            f"{STALE_SECONDS} s before gets it again before its next one (proxyctl closes origin connections unused "
            "for 55 s: a sample after a longer wait paid 50 new origin handshakes"
            f"{self.rewarmed_said()}); every hey run must return all 200s with no errors or the bench fails. In a full "
            "run, each sample waits (up to 30 s, 10 min in all) for other processes' load to drop below 0.25 cores.")
        if self.passthrough:
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
        if self.intercept:
            mitm_keepalive = max(CONCURRENCY * 2, p.intercept_keepalive_requests // p.mitmproxy_divisor)
            mitm_new = max(CONCURRENCY * 2, p.intercept_new_requests // p.mitmproxy_divisor)
            add(f"- **Intercept targets** ({self.row_numbers('direct')}), all running during those rows, each "
                "on 127.0.0.1 with a temp config; every one sends the same JWT-shaped access token of "
                f"{self.token_bytes} bytes:")
            add("  - proxyctl (Bearer and DPoP, two instances): `proxyctl serve` with `state_dir` in the temp dir, "
                f"`resolve = bench.test=127.x.y.z,{H2_HOST}=127.x'.y'.z'`, `[provider bench]` with "
                f"`token_binding = bearer` or `dpop`, `[origin https://bench.test]` and `[origin https://{H2_HOST}]` "
                "with `ca_file` = the test CA, `log_level = info`. `proxyctl ca init` "
                "made the local CA; the tokens are written into the token store in proxyctl's format "
                "(`tokens/bench.json`, 30 days' expiry, so nothing is refreshed and no provider is contacted; "
                "`proxyctl status` must report them signed in), and for DPoP `keys/bench.dpop.pem` (PKCS#8 P-256) "
                "with its RFC 7638 thumbprint as `dpop_jkt`. The clients use what `proxyctl env` prints: "
                "`HTTPS_PROXY` (hey `-x`, curl) and `CURL_CA_BUNDLE`.")
            add("  - nginx: a second nginx, `worker_processes auto`, `listen … ssl` with the bench.test leaf, "
                "`proxy_pass https://upstream` with `keepalive 128`, `proxy_http_version 1.1`, "
                "`proxy_set_header Connection \"\"`, `proxy_set_header Authorization \"Bearer …\"`, "
                "`proxy_ssl_verify on` against the test CA, `proxy_ssl_session_reuse on`, "
                "`proxy_max_temp_file_size 0` (responses stream through memory buffers, nothing spooled to disk), "
                "`client_body_buffer_size 64k` (row 6c's bodies kept in memory too); access log off, no TLS session "
                "resumption for clients. hey and curl talk to it directly (curl "
                f"`--resolve bench.test:PORT:127.0.0.1`); a second server of the same nginx, on another port, proxies "
                f"to `{H2_HOST}` for row 6d, in HTTP/1.1 (nginx's proxy module speaks no HTTP/2 to upstreams).")
            add("  - mitmproxy: `mitmdump --listen-host 127.0.0.1 -s add_bearer.py --set "
                "ssl_verify_upstream_trusted_ca=<test CA> --set stream_large_bodies=1m` (default flow log to a file, "
                "like proxyctl's info log), from a venv of its own (`.bench/venv`, PyPI `mitmproxy`); the addon sets "
                "`Authorization` in the `request` hook and sends `bench.test` to the origin's address in "
                "`server_connect`. curl "
                f"trusts mitmproxy's CA. Being about 50× slower, it gets fewer requests: {mitm_keepalive:,} (rows "
                "6 and 6c) and "
                f"{mitm_new:,} (row 8); the rates are per second all the same. It has no row 6d: it speaks to an "
                "origin what the client spoke to it (HTTP/1.1 from hey), so that row would repeat row 6.")
            add(f"- **Row 6**: `hey -c {CONCURRENCY} -n {p.intercept_keepalive_requests} -x $HTTPS_PROXY "
                "https://bench.test/small.txt` for the forward proxies; `https://127.0.0.1:PORT/small.txt` to nginx, "
                "`https://127.x.y.z/small.txt` (direct) to the origin. hey does not verify certificates; curl does "
                "(below).")
            if self.rated:
                add(f"- **Row 6b**: as row 6 with `-q {p.intercept_rate / CONCURRENCY:g}` (requests per second per "
                    f"worker: {p.intercept_rate:,} req/s in all) and `-n {p.intercept_rate_requests}`, for direct, "
                    "both proxyctl columns and nginx (mitmproxy cannot keep up with that rate). At full speed (row 6) "
                    "a slower target also pays more CPU per request, because each wake-up finds fewer events to batch; "
                    "at an equal offered load the CPU per request compares the work alone.")
            if self.has("i-post"):
                add("- **Row 6c**: as row 6 with `-m POST -D <file> -T application/octet-stream` and the URL's "
                    f"path `/upload`: {POST_BYTES:,} bytes (base64 characters of random bytes) per request, with "
                    "`Content-Length`, on the same keep-alive connections, for every target of row 6; the answer is "
                    "row 6's. Measured right after row 6, in rounds of its own. Checked once per target before the "
                    "samples: a POST of the same body to `/upload-echo`, whose answer must give back the token (a "
                    "DPoP proof for POST) and the body byte for byte. \"÷ row 6's\": per run, the target's CPU per "
                    "request here over its CPU per request in row 6 of the same round number, then the median; the "
                    "issue wants POSTs within 15% of GETs (≤ 1.15×).")
            if self.has("i-h2"):
                add(f"- **Row 6d**: as row 6 against `https://{H2_HOST}/small.txt` (direct: "
                    "`https://127.x'.y'.z'/…`; nginx: its second server), for direct, both proxyctl columns and "
                    "nginx. hey speaks HTTP/1.1 (it speaks h2 only with `-h2`) to the proxy, or to the origin direct; "
                    f"proxyctl's own client offers h2 to the origin, which takes it, so the {CONCURRENCY} client "
                    "connections' "
                    "requests go upstream as HTTP/2 streams. Checked, and the row fails (BenchError) otherwise: before "
                    f"the samples, a request per target to `{H2_HOST}/headers`, which echoes `$server_protocol` "
                    "(HTTP/2.0 through proxyctl, HTTP/1.1 direct and through nginx); after every sample, warm-ups "
                    "included, the origin's access log, in which each of the sample's requests must have that "
                    "protocol. \"÷ row 6's\" as for row 6c: the h2 upstream's CPU per request against the HTTP/1.1 "
                    "upstream's of row 6.")
            if self.has("i-bulk"):
                add(f"- **Row 7**: curl downloads `/bulk.bin` ({self.bulk_label}) as in row 1: with `HTTPS_PROXY` "
                    "and `CURL_CA_BUNDLE` from `proxyctl env`, `-x … --cacert <mitmproxy CA>`, or `--resolve` and the "
                    "test CA for nginx and direct.")
            if self.has("i-newconn"):
                add(f"- **Row 8**: as row 6 with `-disable-keepalive` and `-n {p.intercept_new_requests}`: a new "
                    "client connection (CONNECT for the forward proxies) and TLS handshake per request; the proxies "
                    "may reuse their connections to the origin (proxyctl through its connection pool, libcurl's "
                    "connection cache before issue 28; nginx through its keepalive pool; mitmproxy opens one per "
                    "client connection).")
        if self.dpop:
            add(f"- **Row 9**: `openssl speed -seconds {p.speed_seconds} ecdsap256` (sign/s per CPU second, one "
                "process) "
                f"and `Tests/Bench` `DPoPBench --proofs {p.dpop_proofs}` (release build; one thread): "
                "`DPoPKey.proof(method:url:accessToken:nonce:now:)` as the proxy calls it for every request (fresh "
                f"`jti`, `htm`, `htu`, `iat`, `ath` of the {self.token_bytes}-byte token), with the proxyctl (DPoP) "
                "target's key, per CPU second (`CLOCK_PROCESS_CPUTIME_ID`); then `PrivateKey.signES256` alone over a "
                f"signing input of the proof's length. Alternating, {p.runs} times each.")
            if self.intercept:
                add("- **Row 10**: per run, the DPoP column's CPU µs/request less the Bearer column's, in rows 6, 6b "
                    "and 8 (those measured); the target is the issue's (40 µs at equal load, row 6b).")
        if self.protocols:
            add(f"- **Rows 11–13**: a proxyctl (Bearer) of their own, protecting bench.test and the WebSocket echo "
                f"origin (`https://bench.test:PORT`, `loadgen wsecho` with the bench.test leaf). Row 11: `hey -c "
                f"{CONCURRENCY} -n {p.intercept_keepalive_requests} -x $HTTPS_PROXY` (HTTP/1.1, {CONCURRENCY} "
                f"keep-alive connections) against `loadgen h2 -c {CONCURRENCY} -n {p.intercept_keepalive_requests}` "
                "(Go's net/http through the proxy's CONNECT, ALPN h2, one connection carrying "
                f"{CONCURRENCY} streams at a time; the connection is opened before the clock starts). Row 12: "
                "`curl --http1.1` and `curl --http2` with `proxyctl env`'s variables. Row 13: `loadgen ws -n "
                f"{p.ws_messages} -size 1024`, a WebSocket through the proxy (or straight to the echo origin), "
                "100 unmeasured echoes first; the origin's 101 says whether the upgrade carried a Bearer token, "
                "checked once. `scripts/benchlib/loadgen` is Go's standard library only, built by scripts/bench.")
        if self.baseline:
            add(f"- **{BASELINE}** (`BENCH_BASELINE`): the baseline binary, started by the same code as proxyctl "
                "with the same configuration: a forward proxy in rows 1–4 (running throughout) and row 5 (afresh "
                f"for each run), and a Bearer intercept target in {self.row_numbers(BASELINE)}, with a "
                "`state_dir`, local CA (`proxyctl ca init` of that binary) and token file of its own, made the same "
                "way. In every round it is measured next to proxyctl: right after it in rounds 1, 3, …, right before it "
                "in rounds 2, 4, ….")
        if results.retries:
            add(f"- Samples taken again after a failed first try: {', '.join(results.retries)}.")
        add("")

    def every_run(self) -> None:
        p, results, add = self.p, self.results, self.add
        add("## Every run")
        add("")
        add("| Scenario | Target | " + " | ".join(f"run {i + 1}" for i in range(p.runs)) + " |")
        add("|---|---|" + "---|" * p.runs)
        table = []
        if self.passthrough:
            table += [(row, unit, with_baseline(TARGETS, self.baseline)) for row, unit in
                      (("bulk", "MB/s"), ("keepalive", "req/s"), ("newtunnel", "req/s"), ("plain", "req/s"))]
        table += [(row, "MB/s" if row == "i-bulk" else "req/s",
                   self.ran(row, with_baseline(INTERCEPT_TARGETS, self.baseline))) for row in self.intercept_rows]
        if self.protocols:
            table += [("p-h1", "req/s", ("proxyctl",)), ("p-h2", "req/s", ("proxyctl",)),
                      ("p-h1bulk", "MB/s", ("proxyctl",)), ("p-h2bulk", "MB/s", ("proxyctl",)),
                      ("p-ws", "msg/s", ("direct", "proxyctl"))]
        for row, unit, targets in table:
            for target in targets:
                cells = []
                for index, sample in enumerate(results.samples[(row, target)]):
                    value = (f"{sample.value / 1e6:,.0f} MB/s" if unit == "MB/s"
                             else f"{sample.value:,.0f} {unit}")
                    if sample.cpu is not None:
                        per = (f"{sample.cpu / sample.units:.2f} CPU-s/GiB" if unit == "MB/s"
                               else f"{sample.cpu / sample.units * 1e6:.1f} µs/{unit.split('/')[0]}")
                        if (row, "direct") in results.samples:
                            direct = results.samples[(row, "direct")][index].value
                            value += f" ({sample.value / direct:.2f}×, {per})"
                        else:
                            value += f" ({per})"
                    value += f"; other load {sample.foreign:.2f}"
                    cells.append(value)
                add(f"| {row} | {INTERCEPT_LABELS.get(target, target) if row.startswith('i-') else target} | "
                    + " | ".join(cells) + " |")
        if self.passthrough:
            for target in with_baseline(PEERS, self.baseline):
                cells = [
                    f"{s['before_kib']:,} → {s['after_kib']:,} KiB, anonymous {s['anon_before_kib']:,} → "
                    f"{s['anon_after_kib']:,} ({s['per_tunnel_kib']:.1f} KiB/tunnel, "
                    f"{s['processes']} proc, {s['threads']} thr)"
                    for s in results.idle[target]
                ]
                add(f"| idle | {target} | " + " | ".join(cells) + " |")
        if self.dpop:
            add("| dpop | openssl speed | " + " | ".join(
                f"{d['openssl_sign_per_s']:,.0f} sign/s; other load {d['foreign_openssl']:.2f}"
                for d in results.dpop) + " |")
            add("| dpop | DPoPKey.proof | " + " | ".join(
                f"{d['proofs_per_cpu_s']:,.0f} proofs/s ({d['proofs_per_cpu_s'] / d['openssl_sign_per_s']:.2f}×, "
                f"{d['proof_bytes']} bytes); other load {d['foreign_proofs']:.2f}" for d in results.dpop) + " |")
            add("| dpop | signES256 alone | " + " | ".join(
                f"{d['signatures_per_cpu_s']:,.0f}/s ({d['signatures_per_cpu_s'] / d['openssl_sign_per_s']:.2f}×)"
                for d in results.dpop) + " |")
        add("")


def write_report(out: Path, p: Plan, results: Results, info: list[tuple[str, str]], command: str, storage: str,
                 started: str, elapsed: float, waited: float, reference: Reference | None = None,
                 binaries: dict[str, Binary] | None = None) -> None:
    """Writes the report of a run to `out`; `binaries`: what each proxyctl binary is (`binaries()`), for the
    before / after table of a run with a baseline."""
    report = Report(p, results, storage, reference or Reference.load())
    report.head(info, command, started, elapsed, waited)
    if report.baseline:
        if binaries is None or BASELINE not in binaries:
            raise ValueError("a run with a baseline needs what each proxyctl binary is (binaries)")
        report.before_after_table(binaries)
    if report.passthrough:
        report.passthrough_table()
    if report.intercept:
        report.intercept_table()
    if report.protocols:
        report.protocols_table()
    if report.dpop:
        report.dpop_table()
    report.method()
    report.every_run()
    out.write_text("\n".join(report.lines))
