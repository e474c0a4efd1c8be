"""Helpers for the sign-in tests (test_login.py, test_refresh.py): a private workspace per test, proxyctl
runs that record their output, and the output-hygiene check.

Every proxyctl run gets a temporary HOME, XDG directories and state_dir, a $PATH whose first directory
holds fake `xdg-open` & co. that only record that they were called, no $DISPLAY unless a test sets one,
and no $BROWSER unless a test asks for the scripted browser (recording_browser.py, which is browser.py
plus a record of the URLs it fetched). stdin is /dev/null, so proxyctl never sees a terminal.

Output hygiene: every run's stderr, and stdout except `proxyctl token`'s, is kept; at the end of each test
the `ws` fixture fails if any of it contains a secret the test saw: access, refresh and ID tokens (from
snapshots of the token file after every run), authorization codes (from the browser's visits), and with
the fake provider every code, PKCE verifier, device code and token it issued or received. A PKCE verifier
that glewlwyd never reveals is caught by a second rule: no run of 40+ base64url characters may appear
unless it is a query value of a URL printed in the same output (state, nonce, code_challenge, ...).
"""
from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from fixtures import config
from fixtures.http import free_port
from fixtures.proxy import clean_env, proxyctl_bin
from idp_fake import FakeIdP
from idp_glewlwyd import Glewlwyd, glewlwyd_available

HERE = Path(__file__).resolve().parent
BROWSER_SCRIPT = HERE / "recording_browser.py"
FAKE_OPENERS = ("xdg-open", "sensible-browser", "x-www-browser", "www-browser", "gnome-open", "kde-open",
                "firefox", "chromium", "google-chrome", "open")
PYTHON = sys.executable

# Runs of base64url characters this long look like a PKCE verifier, a code or a token.
_LONG_RUN = re.compile(r"[A-Za-z0-9_-]{40,}")
_URL = re.compile(r"https?://[^\s\"'<>]+")


@dataclass
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    elapsed: float
    notes: str = ""          # what the test environment noticed meanwhile (scripted browser failures)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def __str__(self) -> str:
        return (f"$ proxyctl {' '.join(self.argv)}  -> exit {self.returncode} in {self.elapsed:.1f}s\n"
                f"--- stdout\n{self.stdout}--- stderr\n{self.stderr}" + (f"--- notes\n{self.notes}" if self.notes else ""))


class Running:
    """A proxyctl process still running, its output read line by line in the background."""

    def __init__(self, workspace: "Workspace", argv: list[str], process: subprocess.Popen, started: float):
        self.workspace = workspace
        self.argv = argv
        self.process = process
        self.started = started
        self._lines: "queue.Queue[str]" = queue.Queue()
        self.stderr_lines: list[str] = []
        self.stdout_chunks: list[str] = []
        self._threads = [threading.Thread(target=self._pump_err, daemon=True),
                         threading.Thread(target=self._pump_out, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _pump_err(self):
        for line in self.process.stderr:
            self.stderr_lines.append(line)
            self._lines.put(line)

    def _pump_out(self):
        for chunk in self.process.stdout:
            self.stdout_chunks.append(chunk)

    def wait_for_line(self, pattern: str, timeout: float = 15.0) -> re.Match:
        """The first stderr line (from the start) matching `pattern`; fails after `timeout` or at exit."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for line in self.stderr_lines[seen:]:
                seen += 1
                match = regex.search(line)
                if match:
                    return match
            if self.process.poll() is not None and all(not t.is_alive() for t in self._threads[:1]):
                if seen == len(self.stderr_lines):
                    raise AssertionError(f"proxyctl exited ({self.process.returncode}) without a line matching "
                                         f"{pattern!r}:\n{''.join(self.stderr_lines)}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no stderr line matching {pattern!r} within {timeout}s:\n"
                                     f"{''.join(self.stderr_lines)}")
            try:
                self._lines.get(timeout=min(remaining, 0.1))
            except queue.Empty:
                pass

    def finish(self, timeout: float = 30.0) -> Result:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            raise AssertionError(f"proxyctl {' '.join(self.argv)} did not exit within {timeout}s:\n"
                                 f"{''.join(self.stderr_lines)}{self.workspace.browser_errors()}")
        for thread in self._threads:
            thread.join(5)
        result = Result(self.argv, self.process.returncode, "".join(self.stdout_chunks), "".join(self.stderr_lines),
                        time.monotonic() - self.started, self.workspace.browser_errors())
        self.workspace._recorded(result)
        return result

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)


class Workspace:
    """One test's private world: HOME, XDG directories, state_dir, proxy.conf, fake browser openers."""

    def __init__(self, root: Path):
        self.root = root
        self.home = root / "home"
        self.state_dir = root / "state"          # created by proxyctl itself
        self.config_path = root / "proxy.conf"
        self.fake_bin = root / "fake-bin"
        self.opener_log = root / "openers.log"
        self.browser_log = root / "browser.log"
        self.visits_log = root / "visits.log"
        self.browser_errors_log = root / "browser-errors.log"
        for directory in (self.home, self.fake_bin, root / "xdg-config", root / "xdg-state", root / "xdg-cache",
                          root / "xdg-data", root / "xdg-runtime"):
            directory.mkdir(parents=True, exist_ok=True)
        os.chmod(root / "xdg-runtime", 0o700)
        for name in FAKE_OPENERS:
            script = self.fake_bin / name
            script.write_text(f'#!/bin/sh\necho "{name} $*" >> "{self.opener_log}"\nexit 0\n')
            script.chmod(0o755)
        self.results: list[Result] = []
        self.secrets: set[str] = set()
        self.fakes: list[FakeIdP] = []
        self.running: list[Running] = []
        self.hygiene = True

    # ------------------------------------------------------------------ configuration

    def write_config(self, *sections: str, state_dir: bool = True, path: Optional[Path] = None) -> Path:
        text = config.proxy(state_dir=self.state_dir if state_dir else None) + "".join(sections)
        target = path or self.config_path
        target.write_text(text)
        return target

    def env(self, browser: Optional[str] = None, glewlwyd: Optional[Glewlwyd] = None, display: Optional[str] = None,
            **extra: str) -> dict[str, str]:
        """The environment of a run. `browser`: None (no $BROWSER), or the scripted browser's mode
        (glewlwyd, fake, none)."""
        env = clean_env()
        for key in list(env):
            if key.startswith(("XDG_", "SSH_", "PROXYCTL_")) or key in ("BROWSER", "DISPLAY", "WAYLAND_DISPLAY"):
                del env[key]
        env.update(HOME=str(self.home), XDG_CONFIG_HOME=str(self.root / "xdg-config"),
                   XDG_STATE_HOME=str(self.root / "xdg-state"), XDG_CACHE_HOME=str(self.root / "xdg-cache"),
                   XDG_DATA_HOME=str(self.root / "xdg-data"), XDG_RUNTIME_DIR=str(self.root / "xdg-runtime"),
                   PROXYCTL_CONFIG=str(self.config_path),
                   PATH=f"{self.fake_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        if display is not None:
            env["DISPLAY"] = display
        if browser is not None:
            env.update(BROWSER=f"{PYTHON} {BROWSER_SCRIPT}", PROXYCTL_TEST_BROWSER=browser,
                       PROXYCTL_TEST_BROWSER_LOG=str(self.browser_log),
                       PROXYCTL_TEST_BROWSER_VISITS=str(self.visits_log),
                       PROXYCTL_TEST_BROWSER_ERRORS=str(self.browser_errors_log))
            if glewlwyd is not None:
                env.update(PROXYCTL_TEST_IDP_URL=glewlwyd.base_url, PROXYCTL_TEST_IDP_USER=glewlwyd.username,
                           PROXYCTL_TEST_IDP_PASSWORD=glewlwyd.password,
                           PROXYCTL_TEST_IDP_SCOPE="openid profile email")
        env.update(extra)
        return env

    # ------------------------------------------------------------------ runs

    def start(self, *args: str, env: Optional[dict] = None, umask: int = -1, **env_options) -> Running:
        argv = [str(a) for a in args]
        process = subprocess.Popen([proxyctl_bin(), *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env or self.env(**env_options),
                                   cwd=self.root, umask=umask)
        running = Running(self, argv, process, time.monotonic())
        self.running.append(running)
        return running

    def run(self, *args: str, timeout: float = 30.0, **options) -> Result:
        return self.start(*args, **options).finish(timeout)

    def _recorded(self, result: Result) -> None:
        self.results.append(result)
        self.harvest()

    # ------------------------------------------------------------------ what is on disk

    def token_path(self, provider: str) -> Path:
        return self.state_dir / "tokens" / f"{provider}.json"

    def tokens(self, provider: str) -> Optional[dict]:
        try:
            return json.loads(self.token_path(provider).read_text())
        except FileNotFoundError:
            return None

    def harvest(self) -> None:
        """Remembers the secrets now in the token files and the browser's visits."""
        self.secrets |= seen_secrets(self.state_dir, self.visits())

    def browser_urls(self) -> list[str]:
        """The URLs proxyctl handed to the scripted browser."""
        return self.browser_log.read_text().splitlines() if self.browser_log.exists() else []

    def visits(self) -> list[str]:
        return self.visits_log.read_text().splitlines() if self.visits_log.exists() else []

    def browser_errors(self) -> str:
        return self.browser_errors_log.read_text() if self.browser_errors_log.exists() else ""

    def opener_calls(self) -> list[str]:
        return self.opener_log.read_text().splitlines() if self.opener_log.exists() else []

    # ------------------------------------------------------------------ output hygiene

    def all_secrets(self) -> set[str]:
        self.harvest()
        found = set(self.secrets)
        for idp in self.fakes:
            found |= fake_secrets(idp)
        return {s for s in found if s and len(s) >= 8}

    def hygiene_problems(self) -> list[str]:
        secrets = self.all_secrets()
        problems = []
        for result in self.results:
            streams = [("stderr", result.stderr)]
            if not (result.argv and result.argv[0] == "token"):
                streams.append(("stdout", result.stdout))
            for stream, text in streams:
                for secret in secrets:
                    if secret in text:
                        problems.append(f"`proxyctl {' '.join(result.argv)}` {stream} contains a secret "
                                        f"({secret[:6]}...{len(secret)} chars)")
                allowed = set()
                for url in _URL.findall(text):
                    for values in urllib.parse.parse_qs(urllib.parse.urlsplit(url).query).values():
                        allowed.update(values)
                for run in _LONG_RUN.findall(text):
                    if not any(run in value for value in allowed):
                        problems.append(f"`proxyctl {' '.join(result.argv)}` {stream} contains an unexplained "
                                        f"secret-like string ({run[:6]}...{len(run)} chars)")
        return problems

    def close(self) -> None:
        for running in self.running:
            running.kill()


def seen_secrets(state_dir: Path, visits: list[str]) -> set[str]:
    """The tokens in state_dir's token files, and the authorization codes in the URLs the browser visited."""
    found: set[str] = set()
    for path in (state_dir / "tokens").glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found.update(data[key] for key in ("access_token", "refresh_token", "id_token")
                     if isinstance(data.get(key), str))
    for url in visits:
        found.update(urllib.parse.parse_qs(urllib.parse.urlsplit(url).query).get("code", []))
    return found


def fake_secrets(idp: FakeIdP) -> set[str]:
    """Every code, verifier, device code and token the fake provider issued or received."""
    found: set[str] = set()
    for record in idp.requests("token"):
        for key in ("code", "code_verifier", "refresh_token", "device_code"):
            if record.form.get(key):
                found.add(record.form[key])
    with idp._lock:  # noqa: SLF001 - the fixture's own records of what it issued
        found.update(idp._codes)
        found.update(idp._access)
        found.update(idp._refresh)
        found.update(idp._devices)
    return found


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture
def ws(tmp_path):
    """A Workspace; at the end, no recorded output may contain a secret."""
    workspace = Workspace(tmp_path / "ws")
    yield workspace
    workspace.close()
    if workspace.hygiene:
        problems = workspace.hygiene_problems()
        assert not problems, "output hygiene:\n" + "\n".join(problems)


@pytest.fixture
def fake(ws):
    """A FakeIdP (expires_in 3600, iss advertised) whose issued secrets the hygiene check knows."""
    idp = FakeIdP().start()
    ws.fakes.append(idp)
    yield idp
    idp.stop()


@pytest.fixture
def glewlwyd_factory():
    """Starts Glewlwyd instances (skips when the package is missing); all stopped at the end."""
    if not glewlwyd_available():
        pytest.skip("glewlwyd is not installed (scripts/bootstrap test)")
    started: list[Glewlwyd] = []

    def make(**kwargs) -> Glewlwyd:
        idp = Glewlwyd(**kwargs).start()
        started.append(idp)
        return idp

    yield make
    for idp in started:
        idp.stop()


def glewlwyd_workspace(ws: Workspace, factory, name: str = "glew", plugin: str = "oidc", **provider_keys):
    """A glewlwyd with a fixed callback port registered, and `ws` configured for it. Returns the idp."""
    port = free_port()
    idp = factory(redirect_ports=[port], **provider_keys.pop("idp_options", {}))
    keys = dict(scopes="openid profile email", redirect_port=port, login_timeout="20s")
    keys.update(provider_keys)
    ws.write_config(config.provider(name, idp.issuer(plugin), idp.client_id, **keys))
    return idp


def fake_workspace(ws: Workspace, idp: FakeIdP, name: str = "fake", **provider_keys) -> None:
    keys = dict(scopes="openid profile email", redirect_port=0, login_timeout="20s")
    keys.update(provider_keys)
    ws.write_config(config.provider(name, idp.issuer, idp.client_id, **keys))


def printed_url(text: str, marker: str) -> str:
    """The indented URL line of a login's stderr that contains `marker`."""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("http") and marker in stripped:
            return stripped
    raise AssertionError(f"no URL with {marker!r} on stderr:\n{text}")


def wait_expired(ws: Workspace, provider: str, margin: float = 0.05) -> None:
    """Sleeps until the stored access token's expires_at (whole seconds) has passed."""
    expires_at = ws.tokens(provider)["expires_at"]
    delay = expires_at - time.time() + margin
    assert delay < 30, f"the access token expires in {delay:.0f}s; the test expected a short lifetime"
    if delay > 0:
        time.sleep(delay)
