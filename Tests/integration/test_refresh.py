"""Refreshing tokens with the real binary: many `proxyctl token` processes at once (one refresh, no lost
rotation), and what the user sees when a refresh fails. Same private workspaces and output-hygiene check as
test_login.py (signin.py).
"""
from __future__ import annotations

import json
import re

import requests

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
