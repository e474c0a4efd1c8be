"""The bench's run (scripts/bench starts it as `python -m benchlib`, with everything it needs checked, built
and installed; run that, not this): the origin, then the passthrough rows, the intercept rows and the DPoP rows
(all, or the sections BENCH_ONLY names; of the intercept rows, those BENCH_ROWS names), then the report. With
--baseline (BENCH_BASELINE), a second proxyctl binary runs wherever proxyctl does, and the report compares the two.
Every process started here is started in its own session and ended (TERM, then KILL) on exit, on
SIGTERM/SIGINT/SIGHUP and on errors.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchlib.harness import (BENCH_HOST, H2_HOST, BenchError, InterceptSetup, InterceptTargets, Processes, Proxies,
                              fake_access_token, log, make_certificates, prepare_www, start_origin, write_post_body)
from benchlib.measurement import (Results, intercept_rows, measure_dpop, measure_idle_row, measure_intercept_rows,
                                  measure_protocol_rows, measure_throughput_rows, plan, rounds, watch_load)
from benchlib.report import binaries, machine_info, write_report

SECTIONS = ("passthrough", "intercept", "protocols", "dpop")


def main() -> int:
    """Runs the bench; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchlib", description=__doc__)
    parser.add_argument("--proxyctl", required=True)
    parser.add_argument("--proxyctl-built", action="store_true",
                        help="scripts/bench built --proxyctl from --repo (not given by BENCH_PROXYCTL)")
    parser.add_argument("--baseline", help="BENCH_BASELINE: another proxyctl binary, run as proxyctl-before "
                                           "wherever proxyctl runs, for the report's before / after table")
    parser.add_argument("--tmp", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--repo", required=True, type=Path)
    parser.add_argument("--command", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mitmdump", required=True, help="mitmproxy's mitmdump (from the bench's own venv)")
    parser.add_argument("--dpop-bench", help="Tests/Bench's DPoPBench, release build (for the dpop section)")
    parser.add_argument("--loadgen", help="scripts/benchlib/loadgen, built (HTTP/2 and WebSocket; for the protocols "
                                          "section)")
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

    only = os.environ.get("BENCH_ONLY", "")  # for working on the bench itself: some of SECTIONS
    sections = set(only.split(",")) if only else set(SECTIONS)
    if sections - set(SECTIONS):
        log(f"error: BENCH_ONLY names no section {', '.join(sorted(sections - set(SECTIONS)))} "
            f"(sections: {', '.join(SECTIONS)})")
        return 1
    for section, tool, given in (("dpop", "--dpop-bench", args.dpop_bench), ("protocols", "--loadgen", args.loadgen)):
        if section in sections and not given:
            log(f"error: the {section} section needs {tool}")
            return 1
    try:
        p = plan(args.quick, intercept_rows(os.environ.get("BENCH_ROWS", "")), rounds(os.environ.get("BENCH_ROUNDS", "")))
    except BenchError as error:
        log(f"error: {error}")
        return 1
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    processes = Processes(args.tmp / "children.pids")
    www: Path | None = None
    # Which binaries run, before any of them starts (checked again at the end: a rebuild meanwhile is reported).
    proxyctls = binaries(args.proxyctl, args.repo if args.proxyctl_built else None, args.baseline)
    try:
        log(f"preparing the origin ({p.bulk_bytes >> 20} MiB file) in {args.tmp}")
        certificates = make_certificates(args.tmp / "tls")
        www, storage = prepare_www(args.tmp, p.bulk_bytes, p.small_bytes)
        origin = start_origin(processes, args.tmp, www, certificates, (p.bulk_bytes, p.small_bytes))
        log(f"origin: https://127.0.0.1:{origin.https_port}, http://127.0.0.1:{origin.http_port}, "
            f"https://{BENCH_HOST} on {origin.bench_address}:{origin.bench_port} and https://{H2_HOST} (h2) on "
            f"{origin.h2_address}:443 ({storage})")
        load = watch_load(processes, wait=not p.quick)
        proxies = Proxies(processes, args.tmp, args.proxyctl, args.baseline)
        results = Results()
        if "passthrough" in sections:
            measure_throughput_rows(p, origin, proxies, results)
            measure_idle_row(p, proxies, results)
        setup = InterceptSetup(origin, fake_access_token(int(time.time())), certificates.bench, args.mitmdump,
                               write_post_body(args.tmp))
        targets = InterceptTargets(processes, args.tmp, args.proxyctl, setup, args.baseline)
        results.intercept_token = setup.token
        if "intercept" in sections:
            measure_intercept_rows(p, setup, targets, results)
        if "protocols" in sections:
            measure_protocol_rows(p, setup, targets, args.loadgen, results)
        if "dpop" in sections:
            key = targets.dpop.path if targets.dpop else None
            measure_dpop(p, args.dpop_bench, len(setup.token), key, results)
        for name, binary in proxyctls.items():
            if not binary.check_unchanged():
                log(f"warning: the {name} binary {binary.path} changed during the run (the report says so)")
        info = machine_info(proxyctls, args.mitmdump)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_report(args.out, p, results, info, args.command, storage, started, time.monotonic() - t0,
                     load.waited, binaries=proxyctls)
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
