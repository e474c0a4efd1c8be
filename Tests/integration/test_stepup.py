"""Step-up authentication (RFC 9470) end to end: a protected origin (stepup_server.py) answers 401 with
error="insufficient_user_authentication"; the proxy passes that answer on untouched with a Proxy-Status naming
`proxyctl step-up ORIGIN`, refreshes nothing and replays nothing, records the challenge for `proxyctl status`,
logs it once and runs notify_command; `proxyctl step-up` signs in again with the challenge's acr_values and
max_age; the SAME request then succeeds through the SAME running proxy.

Providers: the fault-injecting fake (its tokens carry `acr` and `auth_time`, see StepUpFakeIdP) for exact
counts, and glewlwyd, whose max_age enforcement stands in for acr (it issues no acr).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from fixtures import config
from fixtures.http import CurlAnswer, free_port, run_curl
from fixtures.jose import unverified_claims
from fixtures.proxy import Proxy, clean_env, poll, proxyctl_bin
from idp_fake import FakeIdP, jws
from idp_glewlwyd import Glewlwyd, glewlwyd_available
from signin import fake_secrets, seen_secrets
from stepup_server import StepUpServer

HERE = Path(__file__).resolve().parent
BROWSER = f"{sys.executable} {HERE / 'recording_browser.py'}"
HOST, OTHER = "stepup.test", "other.test"
MFA, PASSWORD_ACR, HARDWARE = "urn:test:mfa", "urn:test:password", "urn:test:hwk"
SCOPES = "openid profile email"

NOTIFY_SCRIPT = """\
import json, os, sys
record = {"argv": sys.argv[2:], "env": {k: v for k, v in os.environ.items() if k.startswith("PROXYCTL_")}}
with open(sys.argv[1], "a") as out:
    out.write(json.dumps(record) + "\\n")
"""


# MARK: - A fake provider whose tokens say how the user signed in


class StepUpFakeIdP(FakeIdP):
    """FakeIdP whose JWT access tokens carry `acr` and `auth_time` (RFC 9068 §2.2.1), like its ID tokens.

    A sign-in's acr is the first value of the authorization request's acr_values that is in `supported_acr`,
    else `default_acr`; refreshed tokens keep the acr and auth_time of their sign-in (a refresh never makes a
    sign-in stronger or more recent). `auth_time_offset` is added to the auth_time of the next sign-ins
    (negative: the user signed in long ago)."""

    def __init__(self, **kwargs):
        super().__init__(access_token_format="jwt", **kwargs)
        self.default_acr = PASSWORD_ACR
        self.supported_acr = {PASSWORD_ACR, MFA, HARDWARE}
        self.auth_time_offset = 0
        self._sign_in_by_code: dict[str, tuple[str, int]] = {}
        self._sign_in_by_refresh: dict[str, tuple[str, int]] = {}

    def _authorize_redirect(self, h, q, params, fault=None):
        if "code" in params:   # recorded before the browser can follow the redirect
            wanted = [v for v in q.get("acr_values", "").split() if v in self.supported_acr]
            with self._lock:
                self._sign_in_by_code[params["code"]] = (wanted[0] if wanted else self.default_acr,
                                                          int(time.time()) + self.auth_time_offset)
        super()._authorize_redirect(h, q, params, fault)

    def _restamp(self, body: dict, sign_in: tuple[str, int], client_id: str, nonce, defects) -> None:
        acr, auth_time = sign_in
        old = body["access_token"]
        claims = unverified_claims(old)
        claims.update(acr=acr, auth_time=auth_time)
        new = jws(claims, self.signing_key, typ="at+jwt")
        self._access[new] = self._access.pop(old)
        body["access_token"] = new
        if "id_token" in body:
            saved, self.acr = self.acr, acr
            try:
                body["id_token"] = self._id_token(client_id, nonce, auth_time, new, tuple(defects))
            finally:
                self.acr = saved
        if "refresh_token" in body:
            self._sign_in_by_refresh[body["refresh_token"]] = sign_in

    def _grant_code(self, form, jkt, defects):
        code = self._codes.get(form.get("code", ""))
        sign_in = self._sign_in_by_code.get(form.get("code", ""))
        status, body = super()._grant_code(form, jkt, defects)
        if status == 200 and sign_in:
            self._restamp(body, sign_in, code.client_id, code.nonce, defects)
        return status, body

    def _grant_refresh(self, form, jkt, defects):
        rt = self._refresh.get(form.get("refresh_token", ""))
        sign_in = self._sign_in_by_refresh.get(form.get("refresh_token", ""))
        status, body = super()._grant_refresh(form, jkt, defects)
        if status == 200 and sign_in:
            self._restamp(body, sign_in, rt.client_id, rt.nonce, defects)
        return status, body


# MARK: - A workspace: proxy.conf, state_dir, recorded proxyctl runs, a running proxy, curl through it


class World:
    def __init__(self, root: Path, sections: str, resolve: str):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.state = root / "state"
        self.config_path = root / "proxy.conf"
        self.notify_log = root / "notify.jsonl"
        self.browser_log = root / "browser.log"
        self.visits_log = root / "visits.log"
        self.browser_errors = root / "browser-errors.log"
        script = root / "notify.py"
        script.write_text(NOTIFY_SCRIPT)
        self.config_path.write_text(config.proxy(
            log_level="info", connect_timeout="5s", shutdown_grace="3s", state_dir=self.state, resolve=resolve,
            notify_command=f"{sys.executable} {script} {self.notify_log}") + sections)
        self.runs: list[subprocess.CompletedProcess] = []
        self.curls: list[CurlAnswer] = []
        self.secrets: set[str] = set()
        self.fakes: list[FakeIdP] = []
        self.proxy: Proxy | None = None
        self.last_curl = 0.0

    # --- proxyctl commands

    def cli(self, *args: str, browser: str | None = None, timeout: float = 30, **env: str):
        home = self.root / "cli-home"
        home.mkdir(exist_ok=True)
        full = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"))
        for key in [k for k in full if k.startswith("PROXYCTL_") or k in ("BROWSER", "DISPLAY")]:
            del full[key]
        if browser is not None:
            full.update(BROWSER=BROWSER, PROXYCTL_TEST_BROWSER=browser,
                        PROXYCTL_TEST_BROWSER_LOG=str(self.browser_log),
                        PROXYCTL_TEST_BROWSER_VISITS=str(self.visits_log),
                        PROXYCTL_TEST_BROWSER_ERRORS=str(self.browser_errors))
        full.update(env)
        done = subprocess.run([proxyctl_bin(), *args, "--config", str(self.config_path)],
                              capture_output=True, text=True, timeout=timeout, env=full, cwd=self.root,
                              stdin=subprocess.DEVNULL)
        self.runs.append(done)
        self.harvest()
        return done

    def ca_init(self) -> None:
        done = self.cli("ca", "init")
        assert done.returncode == 0, done.stderr

    def login_fake(self, provider: str = "fake", *args: str) -> None:
        done = self.cli("login", provider, *args, browser="fake")
        assert done.returncode == 0, f"proxyctl login: {done.stderr[-2000:]}{self.browser_problems()}"

    def glewlwyd_env(self, idp: Glewlwyd) -> dict[str, str]:
        return dict(PROXYCTL_TEST_IDP_URL=idp.base_url, PROXYCTL_TEST_IDP_USER=idp.username,
                    PROXYCTL_TEST_IDP_PASSWORD=idp.password, PROXYCTL_TEST_IDP_SCOPE=SCOPES)

    def browser_urls(self) -> list[str]:
        return self.browser_log.read_text().splitlines() if self.browser_log.exists() else []

    def browser_problems(self) -> str:
        return self.browser_errors.read_text() if self.browser_errors.exists() else ""

    # --- state on disk

    def tokens(self, provider: str) -> dict:
        return json.loads((self.state / "tokens" / f"{provider}.json").read_text())

    def pending(self) -> list[dict]:
        path = self.state / "step-up.json"
        return json.loads(path.read_text())["pending"] if path.exists() else []

    def wait_pending(self, origins: list[str]) -> list[dict]:
        """The pending step-ups once they name exactly `origins`: the proxy records a challenge off its event
        loop, a moment after it passed the 401 on."""
        return poll(lambda: (lambda p: p if [e["origin"] for e in p] == origins else None)(self.pending()), 5,
                    message=f"step-up.json to list {origins}")

    def notifications(self) -> list[dict]:
        if not self.notify_log.exists():
            return []
        text = self.notify_log.read_text()
        return [json.loads(line) for line in text.split("\n")[:-1]]   # complete lines only

    def wait_notifications(self, count: int) -> list[dict]:
        return poll(lambda: (lambda n: n if len(n) >= count else None)(self.notifications()), 10,
                    message=f"{count} notify_command run(s)")

    # --- the proxy and a client

    def start_proxy(self) -> Proxy:
        self.proxy = Proxy(self.root / "serve", None, listen="127.0.0.1:0",
                           args=("--config", str(self.config_path))).start()
        return self.proxy

    def curl(self, url: str, *args: str) -> CurlAnswer:
        """curl through the proxy, trusting the proxy's local CA; the same arguments every time."""
        answer = run_curl(url, "--proxy", self.proxy.url, "--cacert", str(self.state / "ca" / "ca.pem"), *args,
                          env=clean_env(), scratch=self.root / "curl", timeout=30)
        self.curls.append(answer)
        self.last_curl = time.monotonic()
        return answer

    def wait_past_token_cache(self) -> None:
        """Waits until the proxy's in-memory copy of the tokens (kept up to 1 s without a look at the token
        file) is stale for sure. Only test_step_up_round_trip retries at once after `proxyctl step-up`, as a
        user would; the other tests are about something else and take the cache out of the picture."""
        poll(lambda: time.monotonic() - self.last_curl > 1.05, 5, message="the proxy's token cache to age")

    def exchange_lines(self, mark: int, count: int) -> list[str]:
        """The log lines of intercepted requests written after `mark`, once there are `count` of them."""
        def found():
            lines = [line for line in self.proxy.log_since(mark).splitlines() if " intercepted=" in line]
            return lines if len(lines) >= count else None
        return poll(found, 10, message=f"{count} intercepted request line(s)")

    # --- nothing secret anywhere

    def harvest(self) -> None:
        visits = self.visits_log.read_text().splitlines() if self.visits_log.exists() else []
        self.secrets |= seen_secrets(self.state, visits)
        # Private keys (the local CA's, DPoP keys): every base64 line of them.
        for pem in [*self.state.glob("ca/*key*.pem"), *self.state.glob("keys/*.pem")]:
            self.secrets.update(line for line in pem.read_text().splitlines()
                                if len(line) >= 40 and not line.startswith("-----"))

    def hygiene_problems(self) -> list[str]:
        self.harvest()
        secrets = set(self.secrets)
        for fake in self.fakes:
            secrets |= fake_secrets(fake)
        needles = set()
        for secret in secrets:
            parts = secret.split(".")
            if len(parts) == 3:           # a JWT: its claims and its signature are secret, its header is not
                needles.update(p for p in parts[1:] if len(p) >= 16)
            elif len(secret) >= 8:
                needles.add(secret)
        texts = [(f"`proxyctl {' '.join(run.args[1:-2])}` {name}", text) for run in self.runs
                 for name, text in (("stdout", run.stdout), ("stderr", run.stderr))]
        if self.proxy is not None:
            texts.append(("the proxy's log", self.proxy.log()))
            texts.append(("the proxy's stdout", self.proxy.stdout_path.read_text(errors="replace")))
        texts += [(f"curl answer {i}", f"{c.headers} {c.body!r} {c.stderr}") for i, c in enumerate(self.curls)]
        if self.notify_log.exists():
            texts.append(("notify_command's argv and environment", self.notify_log.read_text()))
        if (self.state / "step-up.json").exists():
            texts.append(("step-up.json", (self.state / "step-up.json").read_text()))
        return [f"{where} contains a secret ({needle[:6]}...)" for where, text in texts for needle in needles
                if needle in text]

    def stop(self) -> str | None:
        if self.proxy is None or self.proxy.process is None:
            return None
        running = self.proxy.process.poll() is None
        code = self.proxy.stop()
        return f"proxyctl exited with {code} on SIGTERM:\n{self.proxy.log()[-3000:]}" if running and code else None


# This module's providers: its scopes, the fake's redirect port (any), and a short sign-in timeout.
provider_section = functools.partial(config.provider, scopes=SCOPES, redirect_port=0, login_timeout="20s")


RESOLVE = f"{HOST}=127.0.0.1, {OTHER}=127.0.0.1"


# MARK: - Fixtures


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    stepup = StepUpServer(tmp_path_factory.mktemp("stepup-server"), [HOST, OTHER])
    yield stepup
    stepup.close()


@pytest.fixture(scope="module")
def fake(server):
    with StepUpFakeIdP() as idp:
        server.trust(idp.issuer, idp.url("jwks"))
        yield idp


@pytest.fixture
def make_world(tmp_path):
    """Makes workspaces; at the end their proxies must stop cleanly and nothing secret may have been
    printed or logged anywhere."""
    worlds: list[World] = []

    def make(sections: str, name: str = "world") -> World:
        world = World(tmp_path / name, sections, RESOLVE)
        worlds.append(world)
        return world

    yield make
    failures = [f for f in (w.stop() for w in worlds) if f]
    problems = [p for w in worlds for p in w.hygiene_problems()]
    assert not failures, "\n".join(failures)
    assert not problems, "output hygiene:\n" + "\n".join(problems)


def fake_world(make_world, fake: StepUpFakeIdP, server: StepUpServer, *, login: bool = True, backdate: int = 0,
               dpop: bool = False, name: str = "world") -> World:
    """A workspace for the fake provider with both origins, its CA made, signed in (the sign-in `backdate`
    seconds ago, as far as auth_time says), and its proxy running."""
    keys = {"token_binding": "dpop"} if dpop else {}
    world = make_world(provider_section("fake", fake.issuer, **keys)
                       + config.origin(server.origin(HOST), "fake", ca_file=server.ca_pem)
                       + config.origin(server.origin(OTHER), "fake", ca_file=server.ca_pem), name)
    world.fakes.append(fake)
    world.ca_init()
    if login:
        fake.auth_time_offset = -backdate
        try:
            world.login_fake()
        finally:
            fake.auth_time_offset = 0
    world.start_proxy()
    return world


def step_up_details(origin: str, acr: str | None, max_age: int | None) -> str:
    wanted = ([f"acr_values {acr}"] if acr else []) + ([f"max_age {max_age}"] if max_age is not None else [])
    return f"step-up required{' (' + ', '.join(wanted) + ')' if wanted else ''}: run proxyctl step-up {origin}"


def assert_step_up_passed_on(answer: CurlAnswer, seen, origin: str, acr: str | None, max_age: int | None) -> None:
    """The origin's 401 as it sent it (WWW-Authenticate, body), plus the proxy's Proxy-Status."""
    assert answer.status == 401, answer
    assert seen.kind == "step_up" and seen.status == 401, seen
    assert answer.headers_named("WWW-Authenticate") == [seen.www_authenticate], answer
    assert answer.body == seen.body
    assert answer.header("Content-Type") == "application/json"
    assert answer.header("Proxy-Status") == (f'proxyctl; received-status=401; '
                                             f'details="{step_up_details(origin, acr, max_age)}"'), answer


# MARK: - 1. The round trip with the fake provider


VARIANTS = {
    "acr": dict(acr=MFA, max_age=None),
    "max_age": dict(acr=None, max_age=300),
    "both": dict(acr=MFA, max_age=300),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_up_round_trip(variant, make_world, fake, server):
    acr, max_age = VARIANTS[variant]["acr"], VARIANTS[variant]["max_age"]
    prefix = f"/round-trip-{variant}/"
    server.require(prefix, acr=acr, max_age=max_age)
    # The first sign-in: password only (acr urn:test:password), ten minutes ago as far as auth_time says.
    world = fake_world(make_world, fake, server, backdate=600)
    origin, url = server.origin(HOST), server.url(prefix + "report?q=1")
    first_claims = unverified_claims(world.tokens("fake")["access_token"])
    assert first_claims["acr"] == PASSWORD_ACR and time.time() - first_claims["auth_time"] >= 600

    token_requests = fake.count("token")
    mark, seen_mark = world.proxy.mark(), server.mark()
    answer = world.curl(url)
    first_done = time.monotonic()
    [seen] = server.since(seen_mark)              # exactly one request: no replay
    assert_step_up_passed_on(answer, seen, origin, acr, max_age)
    assert seen.claims["jti"] == first_claims["jti"]
    assert fake.count("token") == token_requests  # no refresh (nor any other token request)
    [line] = world.exchange_lines(mark, 1)
    assert "status=401" in line and "refreshed=1" not in line and "attempts=" not in line, line

    # Recorded for `proxyctl status` and `proxyctl step-up`.
    [pending] = world.wait_pending([origin])
    assert pending["origin"] == origin and pending["provider"] == "fake"
    assert pending.get("acr_values") == acr and pending.get("max_age") == max_age
    assert abs(pending["at"] - time.time()) < 30
    status = world.cli("status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert "Pending step-ups" in status.stdout and f"run proxyctl step-up {origin}" in status.stdout, status.stdout
    for part in ([f"acr_values {acr}"] if acr else []) + ([f"max_age {max_age}"] if max_age else []):
        assert part in status.stdout, status.stdout
    as_json = world.cli("status", "--json")
    assert as_json.returncode == 0, as_json.stderr
    [listed] = json.loads(as_json.stdout)["pending_step_ups"]
    assert listed["origin"] == origin and listed["provider"] == "fake"
    assert listed["command"] == f"proxyctl step-up {origin}"
    assert listed.get("acr_values") == acr and listed.get("max_age") == max_age

    # The same challenge again, a moment later: passed on again, but logged and announced once. (The proxy
    # keeps the tokens it uses in memory for up to a second without looking at the token file. This request
    # comes more than a second after the first, so the proxy reads the tokens afresh and caches them again;
    # `proxyctl step-up` and the retry below then run within that second, as a quick user's would.)
    poll(lambda: time.monotonic() - first_done > 1.05, 5, message="a second to pass")
    again_sent = time.monotonic()
    again = world.curl(url)
    assert_step_up_passed_on(again, server.since(seen_mark)[-1], origin, acr, max_age)
    assert len(server.since(seen_mark)) == 2
    world.exchange_lines(mark, 2)
    warnings = [line for line in world.proxy.log_since(mark).splitlines() if "step-up:" in line]
    assert len(warnings) == 1, warnings
    assert "warn" in warnings[0].lower() and f"run: proxyctl step-up {origin}" in warnings[0], warnings
    [note] = world.wait_notifications(1)
    assert note["env"]["PROXYCTL_EVENT"] == "step_up"
    assert note["env"]["PROXYCTL_PROVIDER"] == "fake" and note["env"]["PROXYCTL_ORIGIN"] == origin
    assert note["env"]["PROXYCTL_COMMAND"] == f"proxyctl step-up {origin}"
    assert len(note["argv"]) == 1 and f"proxyctl step-up {origin}" in note["argv"][0], note
    assert fake.count("token") == token_requests

    # proxyctl step-up, no argument: one is pending.
    authorizations = fake.count("authorize")
    started = time.monotonic()
    done = world.cli("step-up", browser="fake")
    step_up_took = time.monotonic() - started
    assert done.returncode == 0, done.stderr + world.browser_problems()
    assert f"{origin} asked for a stronger sign-in" in done.stderr, done.stderr
    assert f"Step-up satisfied for: {origin}" in done.stderr, done.stderr
    [browser_url] = world.browser_urls()[1:]      # the first was the first sign-in's
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(browser_url).query)
    assert query.get("acr_values") == ([acr] if acr else None), browser_url
    assert query.get("max_age") == ([str(max_age)] if max_age else None), browser_url
    assert fake.count("authorize") == authorizations + 1
    assert fake.last_request("authorize").query.get("acr_values") == acr
    tokens = world.tokens("fake")
    stepped = unverified_claims(tokens["access_token"])
    assert stepped["acr"] == (acr or PASSWORD_ACR) and time.time() - stepped["auth_time"] < 30
    assert tokens["identity"].get("acr") == (acr or PASSWORD_ACR)
    assert world.pending() == []
    status = world.cli("status")
    assert "Pending step-ups" not in status.stdout, status.stdout
    assert json.loads(world.cli("status", "--json").stdout)["pending_step_ups"] == []

    # The same curl command, the same proxy process, at once: now it goes through.
    pid = world.proxy.pid
    seen_mark = server.mark()
    retried = time.monotonic()
    answer = world.curl(url)
    [seen] = server.since(seen_mark)
    stale = None
    if seen.claims["jti"] == first_claims["jti"]:
        stale = (f"the retry right after `proxyctl step-up` went out with the token from before the step-up "
                 f"({retried - again_sent:.2f}s after the previous request; step-up took {step_up_took:.2f}s) "
                 f"and got {answer.status} {answer.header('Proxy-Status')!r}, while step-up.json lists "
                 f"{[p['origin'] for p in world.pending()]} (so the `proxyctl step-up` it names finds nothing)")
        world.wait_past_token_cache()              # the rest is checked on the request a second later
        seen_mark = server.mark()
        answer = world.curl(url)
        stale += f"; a second later the same request got {answer.status}"
    assert answer.status == 200, f"{answer}; {stale or ''}"
    assert answer.header("Proxy-Status") is None
    data = json.loads(answer.body)
    assert data["jti"] == stepped["jti"] and data["acr"] == (acr or PASSWORD_ACR)
    assert [s.kind for s in server.since(seen_mark)] == ["ok"]
    assert world.proxy.process.poll() is None and world.proxy.pid == pid
    assert len(world.notifications()) == 1
    assert stale is None, stale


def test_a_challenge_that_comes_back_after_a_step_up_is_pending_again(make_world, fake, server):
    """A step-up is done and cleared; later the origin asks for the same thing again (here: a sign-in newer
    than any the proxy holds, same max_age). The proxy again names `proxyctl step-up`, so that command must
    find the challenge pending again."""
    server.require("/comes-back/", max_age=300)
    world = fake_world(make_world, fake, server, backdate=600)
    origin, url = server.origin(HOST), server.url("/comes-back/x")
    assert world.curl(url).status == 401
    world.wait_pending([origin])
    done = world.cli("step-up", browser="fake")
    assert done.returncode == 0, done.stderr + world.browser_problems()
    assert world.pending() == []

    server.require("/comes-back/", max_age=300, signed_in_after=time.time() + 3600)   # no token will do
    seen_mark = server.mark()
    answer = world.curl(url)
    [seen] = server.since(seen_mark)
    assert_step_up_passed_on(answer, seen, origin, None, 300)
    world.wait_pending([origin])  # the origin asked again, the Proxy-Status says to run step-up: recorded again
    listed = world.cli("status")
    assert f"run proxyctl step-up {origin}" in listed.stdout, listed.stdout


# MARK: - 1b. A step-up challenge after a refresh, and after a DPoP nonce retry


def test_step_up_after_a_refresh_is_passed_on(make_world, fake, server):
    """The origin refuses the token once (the proxy refreshes and replays), then asks for a step-up: that
    answer reaches the client with the step-up Proxy-Status, and nothing is tried a third time."""
    server.require("/after-refresh/", acr=MFA, reject_first=1)
    world = fake_world(make_world, fake, server)
    origin = server.origin(HOST)
    refreshes = fake.count("token", grant_type="refresh_token")
    mark, seen_mark = world.proxy.mark(), server.mark()
    answer = world.curl(server.url("/after-refresh/x"))
    first, second = server.since(seen_mark)
    assert (first.kind, second.kind) == ("invalid_token", "step_up")
    assert first.claims["jti"] != second.claims["jti"]
    assert_step_up_passed_on(answer, second, origin, MFA, None)
    assert fake.count("token", grant_type="refresh_token") == refreshes + 1
    [line] = world.exchange_lines(mark, 1)
    assert "status=401" in line and "refreshed=1" in line, line
    [pending] = world.wait_pending([origin])
    assert pending["origin"] == origin and pending["acr_values"] == MFA and "max_age" not in pending
    [note] = world.wait_notifications(1)
    assert note["env"]["PROXYCTL_EVENT"] == "step_up"

    done = world.cli("step-up", origin, browser="fake")
    assert done.returncode == 0, done.stderr + world.browser_problems()
    world.wait_past_token_cache()
    seen_mark = server.mark()
    answer = world.curl(server.url("/after-refresh/x"))
    assert answer.status == 200, answer
    assert [s.kind for s in server.since(seen_mark)] == ["ok"]


def test_step_up_after_a_dpop_nonce_retry_is_passed_on(make_world, fake, server):
    """DPoP-bound tokens: the origin first wants a DPoP nonce (the proxy retries once with it), then a
    step-up. The DPoP step-up challenge reaches the client; after `proxyctl step-up` the same request succeeds
    (with the nonce the proxy remembered, at the first try)."""
    server.require("/dpop/", acr=MFA, dpop_nonce="stepup-nonce-1")
    world = fake_world(make_world, fake, server, dpop=True)
    assert world.tokens("fake")["token_type"] == "DPoP"
    origin = server.origin(HOST)
    token_requests = fake.count("token")
    mark, seen_mark = world.proxy.mark(), server.mark()
    answer = world.curl(server.url("/dpop/x"))
    first, second = server.since(seen_mark)
    assert (first.kind, second.kind) == ("use_dpop_nonce", "step_up"), (first, second)
    assert first.header("DPoP") and second.proof["nonce"] == "stepup-nonce-1"
    assert_step_up_passed_on(answer, second, origin, MFA, None)
    assert answer.header("WWW-Authenticate").startswith('DPoP realm="stepup", '
                                                        'error="insufficient_user_authentication"')
    assert fake.count("token") == token_requests
    [line] = world.exchange_lines(mark, 1)
    assert "status=401" in line and "refreshed=1" not in line, line
    world.wait_pending([origin])

    done = world.cli("step-up", browser="fake")
    assert done.returncode == 0, done.stderr + world.browser_problems()
    assert world.tokens("fake")["token_type"] == "DPoP"
    world.wait_past_token_cache()
    seen_mark = server.mark()
    answer = world.curl(server.url("/dpop/x"))
    assert answer.status == 200, answer
    [ok] = server.since(seen_mark)
    assert ok.kind == "ok" and ok.proof["nonce"] == "stepup-nonce-1" and json.loads(answer.body)["scheme"] == "DPoP"


# MARK: - 2. glewlwyd: a recent sign-in (max_age) stands in for acr


@pytest.mark.skipif(not glewlwyd_available(), reason="glewlwyd is not installed (scripts/bootstrap test)")
def test_glewlwyd_max_age_step_up(make_world, server):
    callback = free_port()
    with Glewlwyd(redirect_ports=[callback]) as idp:
        server.trust(idp.issuer(), idp.discovery()["jwks_uri"])
        world = make_world(provider_section("glew", idp.issuer(), redirect_port=callback)
                           + config.origin(server.origin(HOST), "glew", ca_file=server.ca_pem), "glew")
        world.ca_init()
        done = world.cli("login", "glew", browser="glewlwyd", **world.glewlwyd_env(idp))
        assert done.returncode == 0, done.stderr + world.browser_problems()
        issued = unverified_claims(world.tokens("glew")["access_token"])
        assert "auth_time" not in issued and "acr" not in issued
        # From now on the resource wants a sign-in at most 60 s old and newer than the one the proxy holds
        # (glewlwyd's access tokens have no auth_time: their iat stands in for it).
        server.require("/recent/", max_age=60, signed_in_after=issued["iat"] + 1)
        world.start_proxy()
        origin, url = server.origin(HOST), server.url("/recent/data")
        mark, seen_mark = world.proxy.mark(), server.mark()
        answer = world.curl(url)
        [seen] = server.since(seen_mark)
        assert_step_up_passed_on(answer, seen, origin, None, 60)
        assert 'max_age="60"' in seen.www_authenticate and "acr_values" not in seen.www_authenticate
        [pending] = world.wait_pending([origin])
        assert pending["origin"] == origin and pending["provider"] == "glew" and pending["max_age"] == 60
        generation = world.tokens("glew")["generation"]
        [line] = world.exchange_lines(mark, 1)
        assert "refreshed=1" not in line, line

        # glewlwyd reads the kernel's coarse clock, a few ms behind time.time(): a margin keeps the new iat
        # in the next second for sure.
        poll(lambda: time.time() >= issued["iat"] + 1.1, 5, message="the next second")
        done = world.cli("step-up", browser="glewlwyd", **world.glewlwyd_env(idp))
        assert done.returncode == 0, done.stderr + world.browser_problems()
        assert "max_age 60" in done.stderr and f"Step-up satisfied for: {origin}" in done.stderr, done.stderr
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(world.browser_urls()[-1]).query)
        assert query.get("max_age") == ["60"] and "acr_values" not in query, world.browser_urls()[-1]
        after = world.tokens("glew")
        assert after["generation"] > generation and unverified_claims(after["access_token"])["iat"] >= issued["iat"] + 1
        assert world.pending() == []

        world.wait_past_token_cache()
        seen_mark = server.mark()
        answer = world.curl(url)
        assert answer.status == 200, answer
        assert json.loads(answer.body)["jti"] == unverified_claims(after["access_token"])["jti"]
        assert [s.kind for s in server.since(seen_mark)] == ["ok"]
        world.stop()


# MARK: - 3. Not signed in


def test_not_signed_in_is_answered_by_the_proxy_and_announced(make_world, fake, server):
    world = fake_world(make_world, fake, server, login=False)
    origin = server.origin(HOST)
    seen_mark = server.mark()
    answer = world.curl(server.url("/anything"))
    assert answer.status == 401, answer
    proxy_status = answer.header("Proxy-Status") or ""
    assert proxy_status.startswith("proxyctl; error=http_request_denied"), proxy_status
    assert 'details="sign-in needed: run proxyctl login fake"' in proxy_status, proxy_status
    assert b"proxyctl login fake" in answer.body or b"not signed in" in answer.body.lower(), answer
    assert server.since(seen_mark) == []
    [note] = world.wait_notifications(1)
    assert note["env"]["PROXYCTL_EVENT"] == "sign_in"
    assert note["env"]["PROXYCTL_PROVIDER"] == "fake" and note["env"]["PROXYCTL_ORIGIN"] == origin
    assert note["env"]["PROXYCTL_COMMAND"] == "proxyctl login fake"
    assert len(note["argv"]) == 1 and origin in note["argv"][0], note
    # At most once a minute per provider.
    assert world.curl(server.url("/anything")).status == 401
    world.exchange_lines(0, 2)
    assert len(world.notifications()) == 1
    assert world.pending() == []


# MARK: - 4. proxyctl step-up's own answers


def test_step_up_command_without_one_or_with_several_pending(make_world, fake, server):
    world = fake_world(make_world, fake, server)
    nothing = world.cli("step-up")
    assert nothing.returncode == 0 and "No step-up is pending" in nothing.stderr, nothing.stderr
    assert len(world.browser_urls()) == 1          # no sign-in was started (the one URL is the first login's)

    server.require("/cli-a/", acr=MFA)
    server.require("/cli-b/", acr=HARDWARE, max_age=120)
    a, b = server.origin(HOST), server.origin(OTHER)
    assert world.curl(server.url("/cli-a/x", HOST)).status == 401
    world.wait_pending([a])
    assert world.curl(server.url("/cli-b/x", OTHER)).status == 401
    world.wait_pending([a, b])

    unknown = world.cli("step-up", "https://unknown.test:4443")
    assert unknown.returncode == 1, unknown.stderr
    assert "no step-up is pending for https://unknown.test:4443" in unknown.stderr, unknown.stderr
    assert a in unknown.stderr and b in unknown.stderr, unknown.stderr
    several = world.cli("step-up")
    assert several.returncode == 64, several.stderr
    assert a in several.stderr and b in several.stderr, several.stderr
    assert len(world.browser_urls()) == 1

    # Naming one: its own requirements are asked for, and only what this sign-in satisfies is cleared.
    done = world.cli("step-up", b, browser="fake")
    assert done.returncode == 0, done.stderr + world.browser_problems()
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(world.browser_urls()[-1]).query)
    assert query.get("acr_values") == [HARDWARE] and query.get("max_age") == ["120"]
    assert [p["origin"] for p in world.pending()] == [a]
    world.wait_past_token_cache()
    assert world.curl(server.url("/cli-b/x", OTHER)).status == 200
    assert world.curl(server.url("/cli-a/x", HOST)).status == 401
    notes = world.wait_notifications(2)
    assert sorted(n["env"]["PROXYCTL_ORIGIN"] for n in notes) == sorted([a, b])
