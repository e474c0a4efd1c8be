"""scripts/bench's Python side: a side-by-side benchmark of proxyctl against direct connections and its peers
(tinyproxy and squid on the passthrough paths, nginx as a reverse proxy and mitmproxy on the intercept path, a
protected origin whose requests get a Bearer or DPoP token) and of DPoP proof generation against OpenSSL's raw
signing rate.

    harness       the processes: the nginx origin, the passthrough proxies, the intercept targets
    measurement   the load, the CPU accounting and the rows (samples per target)
    report        docs/benchmarks.md, with the targets and earlier figures of reference.toml
    __main__      the run: `python -m benchlib` (scripts/bench runs it; run that, not this)

The certificates, the DPoP key and the checks of what the protected origin received come from the integration
tests' fixtures (Tests/integration/fixtures, put on sys.path by scripts/fixtures_on_path.py).
"""

import fixtures_on_path  # noqa: F401  (Tests/integration on sys.path, before any module imports `fixtures`)
