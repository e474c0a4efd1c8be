"""Refreshing tokens with the real binary: many `proxyctl token` processes at once (one refresh, no lost
rotation), and what the user sees when a refresh fails. Same private workspaces and output-hygiene check as
test_login.py (signin.py).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests

from fixtures.content import fill
from fixtures.proxy import poll

from idp_fake import Fault
from signin import (fake, fake_workspace, glewlwyd_factory, glewlwyd_workspace, wait_expired, ws)  # noqa: F401

PROCESSES = 24


def storm(ws, count: int = PROCESSES):
    """`count` `proxyctl token` processes started together; their results."""
    running = [ws.start("token") for _ in range(count)]
    return [r.finish(60) for r in running]


def login_expired_fake(ws, fake):
    """Signs in to the fake with an access token that is stored already expired (expires_in 0)."""
    fake_workspace(ws, fake)
    fake.expires_in = 0
    login = ws.run("login", browser="fake")
    assert login.returncode == 0, str(login)
    fake.expires_in = 3600
    tokens = ws.tokens("fake")
    assert tokens["expires_at"] == tokens["issued_at"] and tokens["refresh_token"]
    return tokens


def test_concurrent_token_processes_glewlwyd(ws, glewlwyd_factory):
    """glewlwyd kills the whole refresh chain when a refresh token is used twice: 24 processes refreshing at
    once must take turns, and the last rotated refresh token must be the one on disk."""
    idp = glewlwyd_workspace(ws, glewlwyd_factory, idp_options=dict(access_token_duration=1))
    login = ws.run("login", browser="glewlwyd", glewlwyd=idp)
    assert login.returncode == 0, str(login)
    first = ws.tokens("glew")
    wait_expired(ws, "glew")
    results = storm(ws)
    failed = [str(r) for r in results if r.returncode != 0]
    assert not failed, f"{len(failed)} of {PROCESSES} failed; first:\n{failed[0]}"
    assert all(re.fullmatch(r"[\w.-]+\n", r.stdout) for r in results)
    after = ws.tokens("glew")
    assert after["refresh_token"] != first["refresh_token"]
    # No lost rotation: once the access token has expired again, the refresh token on disk still works.
    wait_expired(ws, "glew")
    # The last refresh's token must outlive the userinfo call below: a 1 s glewlwyd token dies at the next whole
    # second, 0.3 to 0.7 s after it was made.
    idp.set_access_token_duration(3600)
    again = ws.run("token")
    assert again.returncode == 0, str(again)
    final = ws.tokens("glew")
    assert final["generation"] > after["generation"] and final["last_refresh"]["outcome"] == "ok"
    info = requests.get(idp.issuer() + "/userinfo", headers={"Authorization": "Bearer " + final["access_token"]},
                        timeout=10)
    assert info.status_code == 200, info.text


def test_concurrent_token_processes_fake_one_refresh(ws, fake):
    before = login_expired_fake(ws, fake)
    # The refresh takes a second at the provider: every process starts while it is in flight.
    fake.fail("token", Fault.delay_only(1.0))
    results = storm(ws)
    failed = [str(r) for r in results if r.returncode != 0]
    assert not failed, f"{len(failed)} of {PROCESSES} failed; first:\n{failed[0]}"
    assert fake.count("token", grant_type="refresh_token") == 1
    assert fake.reuse_detected == 0
    after = ws.tokens("fake")
    assert {r.stdout for r in results} == {after["access_token"] + "\n"}
    assert after["generation"] == before["generation"] + 1
    assert fake.refresh_token_state(before["refresh_token"]) == "rotated"
    assert fake.refresh_token_state(after["refresh_token"]) == "active"


def test_refresh_retries_503_with_retry_after(ws, fake):
    login_expired_fake(ws, fake)
    fake.fail("token", Fault.status(503, retry_after=1))
    token = ws.run("token")
    assert token.returncode == 0, str(token)
    assert fake.count("token", grant_type="refresh_token") == 2
    assert token.stdout.strip() == ws.tokens("fake")["access_token"]


def test_refresh_429_with_long_retry_after(ws, fake):
    login_expired_fake(ws, fake)
    fake.fail("token", Fault.status(429, retry_after=300))
    token = ws.run("token")
    assert token.returncode == 1, str(token)
    assert token.stdout == ""
    assert "try again in 300s" in token.stderr, str(token)
    assert fake.count("token", grant_type="refresh_token") == 1
    status = ws.run("status")
    assert status.returncode == 0, "the refresh token is kept after a passing failure"


def assert_reauthentication_needed(ws, fake, token):
    assert token.returncode == 1, str(token)
    assert token.stdout == "", str(token)
    assert "proxyctl login fake" in token.stderr, str(token)
    status = ws.run("status")
    assert status.returncode == 1, str(status)
    assert re.search(r"last refresh:\s+failed \(reauthenticate: ", status.stdout), str(status)
    assert re.search(r"next step:\s+proxyctl login fake", status.stdout), str(status)
    report = json.loads(ws.run("status", "--json").stdout)["providers"][0]
    assert report["signed_in"] is False and report["refresh_token"] is False
    assert report["last_refresh"]["outcome"] == "reauthenticate"
    # Nothing more is sent to the provider for a refresh token it refused.
    refreshes = fake.count("token", grant_type="refresh_token")
    again = ws.run("token")
    assert again.returncode == 1 and "proxyctl login fake" in again.stderr, str(again)
    assert fake.count("token", grant_type="refresh_token") == refreshes


def test_refresh_invalid_grant(ws, fake):
    login_expired_fake(ws, fake)
    fake.fail("token", Fault.invalid_grant("refresh token revoked"))
    token = ws.run("token")
    assert "invalid_grant" in token.stderr, str(token)
    assert_reauthentication_needed(ws, fake, token)


def test_refresh_empty_400(ws, fake):
    login_expired_fake(ws, fake)
    fake.fail("token", Fault.empty_400())
    token = ws.run("token")
    assert_reauthentication_needed(ws, fake, token)


def test_a_refused_refresh_token_while_the_access_token_is_valid(ws, fake):
    """The newcomer's case: the provider refuses the refresh token (glewlwyd's empty 400) while the access
    token still has time left. The message says what happened and what to run; status does not say "signed in"
    with exit 0, but when the access token stops and that a sign-in is needed (exit 1, help status)."""
    fake_workspace(ws, fake)
    login = ws.run("login", browser="fake")
    assert login.returncode == 0, str(login)
    # The access token is in its last minute (proxyctl refreshes 60 s before expiry) but not expired.
    path = ws.token_path("fake")
    tokens = json.loads(path.read_text())
    now = int(time.time())
    tokens["issued_at"], tokens["expires_at"] = now - 3000, now + 50
    path.write_text(json.dumps(tokens))
    fake.fail("token", Fault.empty_400())
    token = ws.run("token")
    assert ("the provider refused the refresh token (HTTP 400 without an error code: it has expired, was revoked, or "
            "was used already); sign in again: proxyctl login fake") in token.stderr, str(token)
    assert "no error details" not in token.stderr
    status = ws.run("status")
    assert status.returncode == 1, str(status)
    assert re.search(r"^fake: sign-in needed \(the provider refused the refresh token\) as ", status.stdout, re.M), \
        status.stdout
    assert re.search(r"^  access token:  valid until .*\(in \d+s\); nothing can renew it: origins may refuse it "
                     r"already, and every request will after that$", status.stdout, re.M), status.stdout
    assert re.search(r"^  next step:     proxyctl login fake$", status.stdout, re.M), status.stdout
    report = json.loads(ws.run("status", "--json").stdout)["providers"][0]
    assert report["signed_in"] is False and report["refresh_refused"] is True
    assert report["access_token_expired"] is False and report["access_token_expires_at"] == now + 50


def test_refresh_malformed_json_is_recoverable(ws, fake):
    before = login_expired_fake(ws, fake)
    fake.fail("token", Fault.malformed_json())
    token = ws.run("token")
    assert token.returncode == 1, str(token)
    assert token.stdout == ""
    assert "not JSON" in token.stderr and "try again" in token.stderr, str(token)
    assert "proxyctl login" not in token.stderr, "a passing failure does not ask for a new sign-in"
    stored = ws.tokens("fake")
    assert stored["refresh_token"] == before["refresh_token"]
    assert stored["last_refresh"]["outcome"] == "recoverable"
    status = ws.run("status")
    assert status.returncode == 0, str(status)
    assert re.search(r"last refresh:\s+failed \(recoverable: ", status.stdout), str(status)
    # The malformed answer did not consume the refresh token at the fake (it never looked at it): next try works.
    retry = ws.run("token")
    assert retry.returncode == 0, str(retry)
    assert retry.stdout.strip() == ws.tokens("fake")["access_token"]


def test_glewlwyd_revoked_refresh_token(ws, glewlwyd_factory):
    """glewlwyd's own answer to a refresh token the user revoked (an empty 400): sign in again."""
    idp = glewlwyd_workspace(ws, glewlwyd_factory, idp_options=dict(access_token_duration=1))
    login = ws.run("login", browser="glewlwyd", glewlwyd=idp)
    assert login.returncode == 0, str(login)
    assert idp.revoke_refresh_tokens() >= 1
    wait_expired(ws, "glew")
    token = ws.run("token")
    assert token.returncode == 1, str(token)
    assert "proxyctl login glew" in token.stderr, str(token)
    status = ws.run("status")
    assert status.returncode == 1, str(status)
    assert re.search(r"last refresh:\s+failed \(reauthenticate: ", status.stdout), str(status)


# ---------------------------------------------------------------------------------------------- faults
# A refresh token is spent the moment the provider rotates it: each test below makes sure a fault around a
# refresh never leaves proxyctl holding the spent one (which the fake's reuse detection, like glewlwyd's and
# most providers', answers by revoking the whole session).


def assert_session_kept(ws, fake):
    """The refresh token on disk is the live one at the fake, nothing was reused, and it still refreshes."""
    stored = ws.tokens("fake")
    assert fake.reuse_detected == 0
    assert fake.refresh_token_state(stored["refresh_token"]) == "active", stored.get("last_refresh")
    again = ws.run("token")
    assert again.returncode == 0, str(again)


def test_stalled_refresh_is_waited_for_and_never_sent_again(ws, fake):
    """A provider that stops with the refresh in its socket and carries it out later: the request stays open
    past token_timeout (with a note saying why) and its answer is stored; the refresh token is sent once."""
    fake_workspace(ws, fake, token_timeout="1s")
    fake.expires_in = 0
    assert ws.run("login", browser="fake").returncode == 0
    fake.expires_in = 3600
    before = ws.tokens("fake")
    fake.fail("token", Fault.stall(3.0))
    token = ws.run("token")
    assert token.returncode == 0, str(token)
    assert "has not answered the token refresh in 1s" in token.stderr, str(token)
    assert fake.count("token", grant_type="refresh_token") == 1
    assert token.stdout.strip() == ws.tokens("fake")["access_token"]
    assert fake.refresh_token_state(before["refresh_token"]) == "rotated"
    assert_session_kept(ws, fake)


@pytest.mark.heavy
def test_stall_past_the_old_request_timeout_keeps_the_session(ws, fake):
    """The issue's case as it was seen: the provider stalls past 30 s (the old token request timeout); the
    timed-out refresh was resent with the same refresh token and reuse detection revoked the session."""
    before = login_expired_fake(ws, fake)
    fake.fail("token", Fault.stall(33.0))
    token = ws.run("token", timeout=90)
    assert token.returncode == 0, str(token)
    assert fake.count("token", grant_type="refresh_token") == 1
    assert fake.refresh_token_state(before["refresh_token"]) == "rotated"
    assert_session_kept(ws, fake)


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_during_refresh_waits_for_the_answer(ws, fake, signal_number):
    """Ctrl-C or `timeout` while the refresh is at the provider: the command stops once the answer is stored
    (and dies by the signal, printing no token), instead of leaving the provider to rotate the token for
    nobody."""
    before = login_expired_fake(ws, fake)
    fake.fail("token", Fault.stall(1.5))
    running = ws.start("token")
    fake.wait_for("token", 1, timeout=20, grant_type="refresh_token")
    running.process.send_signal(signal_number)
    result = running.finish(30)
    assert result.returncode == -signal_number, str(result)
    assert result.stdout == "", "an interrupted command prints no token"
    poll(lambda: fake.refresh_token_state(before["refresh_token"]) == "rotated", timeout=20,
                 message="the fake to carry out the refresh")
    assert ws.tokens("fake")["generation"] == before["generation"] + 1, "the answer was not stored"
    assert "stopping once the token refresh in flight is answered and stored" in result.stderr, str(result)
    assert_session_kept(ws, fake)


def has_open(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open."""
    try:
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def test_signal_without_a_refresh_in_flight_stops_at_once(ws, fake):
    """Waiting for the lock (another process holds it) is not a refresh in flight: SIGINT stops at once."""
    login_expired_fake(ws, fake)
    with open(ws.state_dir / "tokens" / "fake.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        running = ws.start("token")
        poll(lambda: has_open(running.process.pid, ws.state_dir / "tokens" / "fake.lock"), timeout=20,
                     message="proxyctl token to wait for the lock")
        running.process.send_signal(signal.SIGINT)
        result = running.finish(10)
    assert result.returncode == -signal.SIGINT, str(result)
    assert "stopping once" not in result.stderr
    assert fake.count("token", grant_type="refresh_token") == 0


def test_signal_waits_at_most_shutdown_grace(ws, fake):
    """A provider that does not answer within shutdown_grace: the command gives up then (bounded), saying so."""
    fake_workspace(ws, fake)
    ws.config_path.write_text(ws.config_path.read_text().replace("[proxy]\n", "[proxy]\nshutdown_grace = 1s\n", 1))
    fake.expires_in = 0
    assert ws.run("login", browser="fake").returncode == 0
    fake.expires_in = 3600
    fake.fail("token", Fault.stall(60.0))
    running = ws.start("token")
    fake.wait_for("token", 1, timeout=20, grant_type="refresh_token")
    started = time.monotonic()
    running.process.send_signal(signal.SIGTERM)
    result = running.finish(20)
    assert result.returncode == -signal.SIGTERM, str(result)
    assert "did not answer within the grace period" in result.stderr, str(result)
    assert time.monotonic() - started < 10


@pytest.fixture
def tiny_state_dir(ws):
    """ws.state_dir on a 512 KiB tmpfs of its own, so that a test can fill it (root and mount(2) needed)."""
    ws.state_dir.mkdir(mode=0o700)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(ws.state_dir)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield ws.state_dir
    finally:
        subprocess.run(["umount", "-l", str(ws.state_dir)], check=False)


def test_full_state_dir_spends_no_refresh_token(ws, fake, tiny_state_dir):
    """Room for the answer is taken before the refresh token is sent: on a full disk the refresh fails while
    the refresh token is still good, with a message naming the disk; after freeing space it works."""
    before = login_expired_fake(ws, fake)
    filler = fill(tiny_state_dir)
    token = ws.run("token")
    assert token.returncode == 1, str(token)
    assert token.stdout == ""
    assert fake.count("token", grant_type="refresh_token") == 0, "a refresh token was spent with no room to keep"
    assert "No space left on device" in token.stderr and "free space" in token.stderr, str(token)
    assert "proxyctl login" not in token.stderr, "a full disk does not need a new sign-in"
    assert ws.tokens("fake")["refresh_token"] == before["refresh_token"]
    assert fake.refresh_token_state(before["refresh_token"]) == "active"
    filler.unlink()
    again = ws.run("token")
    assert again.returncode == 0, str(again)
    assert fake.count("token", grant_type="refresh_token") == 1
    assert_session_kept(ws, fake)


def test_temporary_files_of_killed_refreshes_are_removed(ws, fake):
    """`proxyctl token` killed (-9) mid-refresh leaves its temporary token file behind (the room it reserved,
    or a written file not yet renamed, holding a refresh token); the next refresh removes every such file."""
    login_expired_fake(ws, fake)
    tokens_dir = ws.state_dir / "tokens"
    fake.fail("token", Fault.stall(1.0))
    running = ws.start("token")
    fake.wait_for("token", 1, timeout=20, grant_type="refresh_token")
    running.kill()
    # A kill between writing and renaming: a full token file under a dead process's name.
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout.strip()
    written = tokens_dir / f".fake.{dead}.12345.tmp"
    written.write_text(ws.token_path("fake").read_text())
    written.chmod(0o600)
    poll(lambda: fake.requests("token")[-1].answered is not None, timeout=20, message="the fake's answer")
    ws.run("token")        # whatever its outcome (the killed refresh was carried out), it takes the lock
    left = sorted(p.name for p in tokens_dir.iterdir() if p.name.endswith(".tmp"))
    assert left == [], left
