"""Fixtures: the proxyctl process under test, origin servers (HTTP, HTTPS, raw echo) and tinyproxy.

The binary comes from $PROXYCTL_BIN (default .build/release/proxyctl). Each proxyctl runs with its own
temporary HOME and XDG directories, so the user's real configuration is never read.
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from fixtures import config
from fixtures.origins import EchoOrigin, Origin, Tinyproxy
from fixtures.pki import ServerIdentity
from fixtures.proxy import Proxy, clean_env, proxyctl_bin


def pytest_configure(config):
    # 1,000 tunnels need 2,000+ descriptors in this process (the clients and the echo server's ends).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def pytest_report_header(config):
    return f"proxyctl: {proxyctl_bin()}"


_measurements: list[tuple[str, str, object]] = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        for name, value in report.user_properties:
            _measurements.append((report.nodeid.split("::")[-1], name, value))


def pytest_terminal_summary(terminalreporter):
    """Measurements the tests record for information (record_property), such as RSS per tunnel."""
    if _measurements:
        terminalreporter.section("proxyctl measurements")
        for test, name, value in _measurements:
            terminalreporter.line(f"{test}: {name} = {value}")


@pytest.fixture(autouse=True)
def _no_proxy_crashed():
    """Fails the test if a proxyctl started during it crashed: with the ASan build (scripts/test runs the
    connection tests against one) a use after free is a report in the log, not a lucky pass."""
    before = len(Proxy.instances)
    yield
    reports = [(p.log_path, p.crash_report()) for p in Proxy.instances[before:]]
    crashed = [f"{path}:\n{report}" for path, report in reports if report]
    assert not crashed, "proxyctl crashed:\n" + "\n\n".join(crashed)


def pytest_sessionfinish(session, exitstatus):
    """Proxies started outside a test (module fixtures) are checked once at the end."""
    crashed = [(p.log_path, p.crash_report()) for p in Proxy.instances]
    crashed = [(path, report) for path, report in crashed if report]
    if crashed:
        for path, report in crashed:
            print(f"\nproxyctl crashed ({path}):\n{report}")
        session.exitstatus = 1


@pytest.fixture(scope="session", autouse=True)
def _binary_exists():
    path = proxyctl_bin()
    if not os.access(path, os.X_OK):
        pytest.exit(
            f"{path} is not an executable; build it (swift build -c release --product proxyctl) "
            "or set PROXYCTL_BIN",
            returncode=2,
        )


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("session")


@pytest.fixture(scope="session")
def cert(session_dir) -> ServerIdentity:
    """The HTTPS origin's certificate (localhost, 127.0.0.1) and its CA: clients trust `cert.ca_pem`."""
    return ServerIdentity.make(session_dir / "origin-tls", "origin", ["localhost", "127.0.0.1"])


@pytest.fixture(scope="session")
def http_origin():
    origin = Origin()
    yield origin
    origin.close()


@pytest.fixture(scope="session")
def https_origin(cert):
    origin = Origin(cert.server_context())
    yield origin
    origin.close()


@pytest.fixture(scope="session")
def echo_origin():
    origin = EchoOrigin()
    yield origin
    origin.close()


# Defaults for the proxies of the tests: short enough that a hung test fails fast, long enough for a slow CI.
DEFAULTS = dict(log_level="info", connect_timeout="5s", shutdown_grace="3s")


class ProxyFactory:
    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.started: list[Proxy] = []

    def __call__(self, listen: str | None = "127.0.0.1:0", raw_config: str | None = None,
                 args: tuple[str, ...] = (), start: bool = True, **keys) -> Proxy:
        """Starts proxyctl with a [proxy] section made of DEFAULTS and `keys` (or with `raw_config`)."""
        text = raw_config if raw_config is not None else config.proxy(**{**DEFAULTS, **keys})
        proxy = Proxy(self.tmp_path / f"proxy{len(self.started)}", text, listen=listen, args=args)
        self.started.append(proxy)
        return proxy.start() if start else proxy

    def stop_all(self):
        failures = []
        for proxy in self.started:
            if proxy.process is None:
                continue
            running = proxy.process.poll() is None
            code = proxy.stop()
            crash = proxy.crash_report()
            if crash:
                failures.append(f"proxyctl crashed; log {proxy.log_path}:\n{crash}")
            elif running and code != 0:
                failures.append(f"proxyctl exited with {code} on SIGTERM; log {proxy.log_path}:\n{proxy.log()[-3000:]}")
        return failures


@pytest.fixture
def proxy_factory(tmp_path):
    """Starts proxyctl processes; at the end each still running one gets SIGTERM and must exit 0."""
    factory = ProxyFactory(tmp_path)
    yield factory
    failures = factory.stop_all()
    assert not failures, "\n".join(failures)


@pytest.fixture
def proxy(proxy_factory) -> Proxy:
    """A proxyctl with the default test configuration on 127.0.0.1 and a free port."""
    return proxy_factory()


@pytest.fixture
def refusing_port():
    """A port that refuses connections: bound (so that no other worker's bind to port 0 gets it while the test
    runs) but not listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture(scope="session")
def tinyproxy(session_dir, https_origin, echo_origin, http_origin):
    if shutil.which("tinyproxy") is None:
        pytest.skip("tinyproxy is not installed (scripts/bootstrap test installs it)")
    upstream = Tinyproxy(session_dir / "tinyproxy", [https_origin.port, echo_origin.port, http_origin.port]).start()
    yield upstream
    upstream.stop()


@pytest.fixture(scope="session")
def curl():
    path = shutil.which("curl")
    if path is None:
        pytest.skip("curl is not installed")

    def run(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([path, "-sS", *args], capture_output=True, timeout=timeout, env=clean_env(),
                              **kwargs)

    return run


@pytest.fixture
def default_redirect_port():
    """`proxyctl init`'s default sign-in redirect port (17755, below the ephemeral range, so no outgoing connection
    takes it) for a test whose `proxyctl login` listens on it: one such test at a time across pytest-xdist's
    workers, by a file lock, so that no other worker's login holds the port meanwhile (two fresh clones failed
    on it: 'cannot listen on 127.0.0.1:17755 for the sign-in redirect: Address already in use')."""
    import fcntl
    import tempfile
    with open(Path(tempfile.gettempdir()) / "proxyctl-tests-redirect-port-17755.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield 17755
