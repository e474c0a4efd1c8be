"""`proxyctl login / status / token / logout` with the real binary, against a real provider (glewlwyd 2.7.5)
and a fault-injecting fake one (FakeIdP). Everything runs in a private workspace (signin.Workspace): temporary
HOME, XDG directories and state_dir, fake browser openers on $PATH, stdin not a terminal. Every test ends
with the output-hygiene check of the `ws` fixture: no token, code or verifier in any output.
"""
from __future__ import annotations

import json
import os
import re
import stat
import time
import urllib.parse
from pathlib import Path

import pytest
import requests

from fixtures import config
from fixtures.http import free_port
from fixtures.proxy import poll
from idp_fake import Fault
from signin import (fake, fake_workspace, glewlwyd_factory, glewlwyd_workspace, printed_url,  # noqa: F401
                    wait_expired, ws)

# ID token defect -> what the message must name.
ID_TOKEN_DEFECTS = {"bad_signature": "signature", "wrong_aud": "aud", "wrong_iss": "https://attacker.example",
                    "expired": "expired", "iat_future": "future", "wrong_nonce": "nonce", "missing_nonce": "nonce",
                    "alg_none": "none", "unknown_kid": "never-published"}


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def userinfo(idp, access_token: str) -> requests.Response:
    return requests.get(idp.issuer("oidc") + "/userinfo", headers={"Authorization": f"Bearer {access_token}"},
                        timeout=10)


def login_ok(ws, *args, **options):
    result = ws.run("login", *args, **options)
    assert result.returncode == 0, str(result)
    return result


# ============================================================================================ glewlwyd


def test_glewlwyd_browser_login_status_token(ws, glewlwyd_factory):
    idp = glewlwyd_workspace(ws, glewlwyd_factory)
    login = login_ok(ws, browser="glewlwyd", glewlwyd=idp)
    assert "Signed in to glew as Alice Liddell <alice@example.test>" in login.stderr, str(login)
    assert login.stdout == "", str(login)
    urls = ws.browser_urls()
    assert len(urls) == 1 and urls[0] in login.stderr, "the browser gets the URL that is printed"
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(urls[0]).query)
    assert query["code_challenge_method"] == ["S256"] and query["redirect_uri"] == [idp.redirect_uri()]
    assert ws.opener_calls() == []
    codes = [u for u in ws.visits() if u.startswith(idp.redirect_uri() + "?") and "code=" in u]
    assert len(codes) == 1, "the browser's visits show the code, so the hygiene check looks for it"

    stored = ws.tokens("glew")
    sub = stored["identity"]["sub"]
    assert stored["refresh_token"] and stored["expires_at"] > time.time() + 600

    status = ws.run("status")
    assert status.returncode == 0, str(status)
    assert f"glew: signed in as Alice Liddell <alice@example.test> (sub {sub})" in status.stdout, str(status)
    assert re.search(r"scopes:\s+openid profile email", status.stdout), str(status)
    assert re.search(r"access token:\s+valid until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(in ", status.stdout), str(status)
    assert re.search(r"refresh token:\s+held", status.stdout), str(status)

    as_json = ws.run("status", "--json", "glew")
    assert as_json.returncode == 0, str(as_json)
    report = json.loads(as_json.stdout)["providers"]
    assert len(report) == 1
    entry = report[0]
    assert entry["provider"] == "glew" and entry["signed_in"] is True and entry["refresh_token"] is True
    assert entry["identity"] == {"sub": sub, "name": "Alice Liddell", "email": "alice@example.test"}
    assert entry["scopes"] == ["openid", "profile", "email"]
    assert entry["access_token_expires_at"] == stored["expires_at"] and entry["access_token_expired"] is False

    token = ws.run("token")
    assert token.returncode == 0, str(token)
    assert "secret" in token.stderr, str(token)
    printed = token.stdout.strip()
    assert token.stdout == printed + "\n" and printed == stored["access_token"]
    info = userinfo(idp, printed)
    assert info.status_code == 200, info.text
    assert info.json()["sub"] == sub and info.json()["email"] == "alice@example.test"

    # --config works like $PROXYCTL_CONFIG.
    explicit = ws.run("status", "--config", str(ws.config_path), env=ws.env(PROXYCTL_CONFIG="/nonexistent"))
    assert explicit.returncode == 0, str(explicit)


def test_glewlwyd_par_always(ws, glewlwyd_factory):
    idp = glewlwyd_workspace(ws, glewlwyd_factory, use_par="always")
    login_ok(ws, browser="glewlwyd", glewlwyd=idp)
    [url] = ws.browser_urls()
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    assert "request_uri" in query, url
    assert "code_challenge" not in query and "state" not in query and "redirect_uri" not in query, url
    assert userinfo(idp, ws.tokens("glew")["access_token"]).status_code == 200


def test_glewlwyd_device_flow(ws, glewlwyd_factory):
    idp = glewlwyd_workspace(ws, glewlwyd_factory)
    running = ws.start("login", "--device", browser="glewlwyd", glewlwyd=idp)
    uri = running.wait_for_line(r"^\s+(http\S+)\s*$").group(1)
    assert uri.startswith(idp.issuer("oidc")), uri
    code = running.wait_for_line(r"enter the code\s+(\S+)").group(1)
    idp.approve_device(code)
    result = running.finish(20)
    assert result.returncode == 0, str(result)
    assert "Signed in to glew as Alice Liddell" in result.stderr, str(result)
    assert ws.browser_urls() == [] and ws.opener_calls() == [], "the device flow opens no browser"
    stored = ws.tokens("glew")
    assert stored["refresh_token"] and userinfo(idp, stored["access_token"]).status_code == 200
    assert ws.run("status").returncode == 0


def test_glewlwyd_refresh_rotates(ws, glewlwyd_factory):
    idp = glewlwyd_workspace(ws, glewlwyd_factory, idp_options=dict(access_token_duration=1))
    login_ok(ws, browser="glewlwyd", glewlwyd=idp)
    before = ws.tokens("glew")
    assert before["expires_at"] - before["issued_at"] <= 2
    wait_expired(ws, "glew")
    expired = ws.run("status")
    assert expired.returncode == 0, "a refresh token is held: still signed in"
    assert re.search(r"access token:\s+expired", expired.stdout), str(expired)

    # The refreshed token must outlive the userinfo call below: a 1 s glewlwyd token dies at the next whole
    # second, 0.3 to 0.7 s after it was made.
    idp.set_access_token_duration(3600)
    token = ws.run("token")
    assert token.returncode == 0, str(token)
    after = ws.tokens("glew")
    assert token.stdout.strip() == after["access_token"] != before["access_token"]
    assert after["refresh_token"] != before["refresh_token"], "glewlwyd rotates refresh tokens"
    assert after["generation"] == before["generation"] + 1
    assert after["last_refresh"]["outcome"] == "ok"
    assert userinfo(idp, after["access_token"]).status_code == 200
    status = ws.run("status")
    assert re.search(r"last refresh:\s+ok", status.stdout), str(status)


def test_glewlwyd_logout(ws, glewlwyd_factory):
    idp = glewlwyd_workspace(ws, glewlwyd_factory)
    login_ok(ws, browser="glewlwyd", glewlwyd=idp)
    refresh_token = ws.tokens("glew")["refresh_token"]
    logout = ws.run("logout")
    assert logout.returncode == 0, str(logout)
    assert not ws.token_path("glew").exists()
    # glewlwyd refuses RFC 7009 revocation from a public client: the refresh token still works, and the
    # message must say so rather than claim it was revoked.
    still = requests.post(idp.token_endpoint(), data={"grant_type": "refresh_token", "refresh_token": refresh_token,
                                                      "client_id": idp.client_id}, timeout=10)
    assert still.status_code == 200, "precondition: glewlwyd did not revoke"
    ws.secrets.update(v for k, v in still.json().items() if k in ("access_token", "refresh_token", "id_token"))
    assert "Revoked" not in logout.stderr, str(logout)
    assert "did not revoke" in logout.stderr and "stays valid until it expires" in logout.stderr, str(logout)
    assert "Deleted the local tokens for glew" in logout.stderr, str(logout)
    status = ws.run("status")
    assert status.returncode == 1, str(status)
    assert "not signed in" in status.stdout and "proxyctl login glew" in status.stdout, str(status)
    again = ws.run("logout")
    assert again.returncode == 0 and "nothing to do" in again.stderr, str(again)


# ============================================================================================ fake provider


def test_fake_login_and_logout_revokes(ws, fake):
    fake_workspace(ws, fake)
    login = login_ok(ws, browser="fake")
    assert "Signed in to fake as Alice Liddell <alice@example.test> (sub alice-0001)" in login.stderr, str(login)
    assert fake.count("token", grant_type="authorization_code") == 1
    refresh_token = ws.tokens("fake")["refresh_token"]
    logout = ws.run("logout")
    assert logout.returncode == 0, str(logout)
    assert "Revoked the refresh token at the provider" in logout.stderr, str(logout)
    assert fake.revocations == [{"token": refresh_token, "token_type_hint": "refresh_token",
                                 "client_id": fake.client_id}]
    assert fake.refresh_token_state(refresh_token) == "revoked"
    assert not ws.token_path("fake").exists()
    assert ws.run("status").returncode == 1


def test_retry_after_1_is_waited_for_then_succeeds(ws, fake):
    fake_workspace(ws, fake)
    fake.fail("token", Fault.status(503, retry_after=1))
    started = time.monotonic()
    login = login_ok(ws, browser="fake")
    assert time.monotonic() - started >= 1.0
    assert fake.count("token", grant_type="authorization_code") == 2
    assert "Signed in to fake" in login.stderr, str(login)


def test_retry_after_is_honoured(ws, fake):
    """Retry-After: 2 must make proxyctl wait 2 s (its own back-off would retry after 1 s)."""
    fake_workspace(ws, fake)
    fake.fail("token", Fault.status(503, retry_after=2))
    login = login_ok(ws, browser="fake")
    [first, second] = fake.requests("token")
    assert second.time - first.time >= 1.9, f"retried after {second.time - first.time:.2f}s despite Retry-After: 2"
    assert "Signed in to fake" in login.stderr, str(login)


def test_429_with_long_retry_after_says_how_long_to_wait(ws, fake):
    fake_workspace(ws, fake)
    fake.fail("token", Fault.status(429, retry_after=300))
    login = ws.run("login", browser="fake")
    assert login.returncode == 1, str(login)
    assert login.elapsed < 15, "a 300 s Retry-After is reported, not slept through"
    assert "try again in 300s" in login.stderr, str(login)
    assert "429" in login.stderr, str(login)
    assert fake.count("token") == 1
    assert not ws.token_path("fake").exists()


def test_malformed_token_response_on_login_is_recoverable(ws, fake):
    fake_workspace(ws, fake)
    fake.fail("token", Fault.malformed_json())
    login = ws.run("login", browser="fake")
    assert login.returncode == 1, str(login)
    assert "not JSON" in login.stderr and "try again" in login.stderr, str(login)
    assert not ws.token_path("fake").exists()


@pytest.mark.parametrize("defect", ID_TOKEN_DEFECTS)
def test_bad_id_token_fails_login_and_stores_nothing(ws, fake, defect):
    fake_workspace(ws, fake)
    fake.fail("token", Fault.id_token(defect))
    login = ws.run("login", browser="fake")
    assert login.returncode == 1, str(login)
    assert "ID token" in login.stderr and "nothing was stored" in login.stderr, str(login)
    assert ID_TOKEN_DEFECTS[defect] in login.stderr, str(login)
    assert fake.count("token") == 1
    # A kid that is not in the key set is looked up once more (rotation), never more.
    assert fake.count("jwks") == (2 if defect == "unknown_kid" else 1)
    assert not ws.token_path("fake").exists()
    assert not list(ws.state_dir.glob("tokens/*"))
    assert ws.run("status").returncode == 1


def test_unknown_kid_refetches_jwks_once(ws, fake):
    fake_workspace(ws, fake)
    fake.rotate_keys(publish_after=1)
    login = login_ok(ws, browser="fake")
    assert "Signed in to fake" in login.stderr
    assert fake.count("jwks") == 2


def test_wrong_iss_in_authorization_response(ws, fake):
    fake_workspace(ws, fake)
    fake.fail("authorize", Fault.wrong_iss())
    login = ws.run("login", browser="fake")
    assert login.returncode == 1, str(login)
    assert "mix-up" in login.stderr and "https://attacker.example" in login.stderr, str(login)
    assert fake.count("token") == 0, "the code is not redeemed"
    assert not ws.token_path("fake").exists()


def test_missing_iss_when_advertised(ws, fake):
    fake_workspace(ws, fake)
    fake.fail("authorize", Fault.missing_iss())
    login = ws.run("login", browser="fake")
    assert login.returncode == 1, str(login)
    assert "iss" in login.stderr and "RFC 9207" in login.stderr, str(login)
    assert fake.count("token") == 0
    assert not ws.token_path("fake").exists()


def test_user_not_registered_retries_with_prompt_create(ws, fake):
    fake_workspace(ws, fake)
    fake.fail("authorize", Fault.user_not_registered())
    login = login_ok(ws, browser="fake")
    assert "not registered" in login.stderr, str(login)
    urls = ws.browser_urls()
    assert len(urls) == 2, urls
    first, second = (urllib.parse.parse_qs(urllib.parse.urlsplit(u).query) for u in urls)
    assert "prompt" not in first and second["prompt"] == ["create"]
    assert ws.tokens("fake")["access_token"]


def test_user_not_registered_twice_is_not_retried_forever(ws, fake):
    fake_workspace(ws, fake)
    fake.fail("authorize", Fault.user_not_registered(), Fault.user_not_registered())
    login = ws.run("login", browser="fake")
    assert login.returncode == 1, str(login)
    assert len(ws.browser_urls()) == 2
    assert not ws.token_path("fake").exists()


def test_access_denied(ws, fake):
    fake_workspace(ws, fake)
    fake.fail("authorize", Fault.authorize_error("access_denied", "The user said no"))
    login = ws.run("login", browser="fake")
    assert login.returncode == 1, str(login)
    assert "declined" in login.stderr, str(login)
    assert not ws.token_path("fake").exists()


def test_login_timeout(ws, fake):
    fake_workspace(ws, fake, login_timeout="2s")
    login = ws.run("login", browser="none")
    assert login.returncode == 1, str(login)
    assert 1.5 <= login.elapsed < 15, str(login)
    assert "nobody finished the sign-in within" in login.stderr and "run the login again" in login.stderr, str(login)
    # login starts the browser without waiting for it, and the browser records the URL after its imports: it can
    # still be starting when login gives up.
    assert len(poll(ws.browser_urls, 15, message="the browser to record the URL")) == 1
    assert not ws.token_path("fake").exists()


def test_login_names_its_redirect_uri_and_says_why_the_browser_may_not_come_back(ws, fake):
    # redirect_port = 0: a port of the login's own, which a provider matching redirect URIs exactly cannot know.
    fake_workspace(ws, fake, login_timeout="6s")
    running = ws.start("login", browser="none")
    waiting = running.wait_for_line(r"^Waiting for the provider to send the browser back to "
                                    r"(http://127\.0\.0\.1:(\d+)/callback) \(redirect_port = 0: a port of this login's own\)\.$")
    url = printed_url("".join(running.stderr_lines), "/authorize?")
    assert url.count(urllib.parse.quote(waiting.group(1), safe="")) == 1, "the URI it listens on"
    # After a third of login_timeout without the browser: the two usual causes, each with the key that fixes it.
    hint = running.wait_for_line(r"^No answer from the browser after 2s\. If the provider showed an error page")
    section = f"[provider fake] of {ws.config_path}"
    assert running.wait_for_line(r"redirect_port is 0 in (.*), so this login listens on a port of its own "
                                 r"\((\S+)\)").groups() == (section, waiting.group(1))
    assert running.wait_for_line(r"client id (\S+) is not the one registered at the provider: change client_id in "
                                 r"(.*)\.$").groups() == (fake.client_id, section)
    running.wait_for_line(r"^Still waiting \(login_timeout 6s; Ctrl-C stops\)\.$")
    assert hint and time.monotonic() - running.started >= 2
    # It does keep waiting: the URL opened by hand completes the sign-in.
    complete_in_browser(fake, url)
    result = running.finish(20)
    assert result.returncode == 0 and ws.tokens("fake")["access_token"], str(result)


def test_glewlwyd_with_a_redirect_uri_it_does_not_know(ws, glewlwyd_factory):
    # The newcomer's hang: glewlwyd matches redirect URIs exactly and this port is not registered. Its error
    # page never sends the browser back; the scripted browser then fails, and that is said at once.
    unregistered = free_port()
    idp = glewlwyd_workspace(ws, glewlwyd_factory, redirect_port=unregistered, login_timeout="6s")
    assert unregistered not in idp.redirect_ports
    login = ws.run("login", browser="glewlwyd", glewlwyd=idp)
    assert login.returncode == 1 and "nobody finished the sign-in within 6s" in login.stderr, str(login)
    uri = f"http://127.0.0.1:{unregistered}/callback"
    assert f"Waiting for the provider to send the browser back to {uri}.\n" in login.stderr, str(login)
    assert re.search(r"The browser did not open the sign-in page: \$BROWSER command \S+ exited with status 1\.\n"
                     r"Open this URL in a browser yourself; the login keeps waiting:\n\n    (http\S+)\n",
                     login.stderr).group(1) == ws.browser_urls()[0], str(login)
    section = f"[provider glew] of {ws.config_path}"
    assert (f"the redirect URI {uri} is not registered for client {idp.client_id} exactly as written: register it "
            f"at the provider, or set redirect_port in {section} to a port that is registered;") in login.stderr
    assert f"change client_id in {section}." in login.stderr, str(login)
    # The hint came before the failure, and the browser's failure before the hint.
    assert login.stderr.index("The browser did not open") < login.stderr.index("No answer from the browser") \
        < login.stderr.index("nobody finished")
    assert not ws.token_path("glew").exists()


@pytest.mark.parametrize("browser, problem", [
    ("false", r"The browser did not open the sign-in page: \$BROWSER command false exited with status 1\."),
    ("false:true", r"The browser did not open the sign-in page: \$BROWSER command false exited with status 1; "
                   r"trying the next command of \$BROWSER\."),
    ("/nonexistent/browser", r"^No browser could be started \(\$BROWSER command /nonexistent/browser is not found\); "
                             r"open the URL above in a browser on this machine\.$"),
])
def test_a_browser_that_fails_is_reported_at_once_and_the_login_keeps_waiting(ws, fake, browser, problem):
    fake_workspace(ws, fake)
    running = ws.start("login", BROWSER=browser)
    url = running.wait_for_line(r"^\s+(http://\S+/authorize\?\S+)\s*$").group(1)
    running.wait_for_line(problem)
    if browser.startswith("false"):
        # The URL again, to open by hand, right after the failure.
        poll(lambda: "".join(running.stderr_lines).count(f"    {url}\n") == 2, 10,
             message="the URL printed again after the failure")
    complete_in_browser(fake, url)
    result = running.finish(20)
    assert result.returncode == 0 and ws.tokens("fake")["access_token"], str(result)
    assert "No answer from the browser" not in result.stderr, "the hint comes only after a while"


def test_fake_device_flow_denied(ws, fake):
    fake_workspace(ws, fake)
    fake.script_device_polls("authorization_pending", "access_denied")
    login = ws.run("login", "--device")
    assert login.returncode == 1, str(login)
    assert "declined" in login.stderr, str(login)
    assert re.search(r"enter the code\s+\S+", login.stderr), str(login)
    assert not ws.token_path("fake").exists()


def test_login_options_reach_the_authorization_request(ws, fake):
    fake_workspace(ws, fake, resource="https://api.example.test", param_audience="https://api.example.test")
    login = login_ok(ws, "--create", "--acr-values", "urn:example:loa:2", "--max-age", "600", "--login-hint",
                     "alice@example.test", "--scope", "openid api", browser="fake")
    # The fake's discovery has no prompt_values_supported: --create is sent, with a word that it may do nothing.
    assert ("Note: the provider does not list create in prompt_values_supported, so it may show its usual sign-in "
            "page and create no account.\n") in login.stderr, str(login)
    [url] = ws.browser_urls()
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    assert query["scope"] == ["openid api"] and query["prompt"] == ["create"]
    assert query["acr_values"] == ["urn:example:loa:2"] and query["max_age"] == ["600"]
    assert query["login_hint"] == ["alice@example.test"]
    assert query["resource"] == ["https://api.example.test"] and query["audience"] == ["https://api.example.test"]
    assert ws.tokens("fake")["scope"] == "openid api"


def test_not_signed_in(ws, fake):
    fake_workspace(ws, fake)
    status = ws.run("status")
    assert status.returncode == 1 and "fake: not signed in (run: proxyctl login fake)" in status.stdout, str(status)
    assert json.loads(ws.run("status", "--json").stdout)["providers"][0]["signed_in"] is False
    token = ws.run("token")
    assert token.returncode == 1 and token.stdout == "", str(token)
    assert "not signed in to fake" in token.stderr and "proxyctl login fake" in token.stderr, str(token)
    assert fake.counts() == {}, "nothing to ask the provider"


def test_login_usage_errors(ws, fake):
    fake_workspace(ws, fake)
    for args in (("--device", "--no-browser"), ("--max-age", "soon")):
        result = ws.run("login", *args, browser="fake")
        assert result.returncode == 64, str(result)
        assert "Usage: proxyctl login" in result.stderr, str(result)
    assert ws.browser_urls() == [] and fake.counts() == {}


# ============================================================================================ no browser


def complete_in_browser(fake, url: str) -> None:
    """What the person does with a printed URL: open it, let the provider redirect to the loopback listener."""
    location = fake.login_browser(url)
    assert location.startswith("http://127.0.0.1:"), location
    requests.get(location, timeout=10)


def test_non_interactive_without_browser_prints_url_and_opens_nothing(ws, fake):
    fake_workspace(ws, fake)
    running = ws.start("login", display=":0")
    url = running.wait_for_line(r"^\s+(http://\S+/authorize\?\S+)\s*$").group(1)
    complete_in_browser(fake, url)
    result = running.finish(20)
    assert result.returncode == 0, str(result)
    assert ("No browser can be opened here: this is not an interactive terminal and $BROWSER is not set.\n"
            "Open the URL below in a browser yourself; or sign in with a code instead: proxyctl login --device fake.\n"
            "To sign in to fake, open this URL in a browser:\n") in result.stderr, str(result)
    assert "Opening the browser" not in result.stderr, str(result)
    assert ws.opener_calls() == [], "xdg-open must not be started"
    assert ws.tokens("fake")["access_token"]


def test_no_browser_flag(ws, fake):
    fake_workspace(ws, fake)
    running = ws.start("login", "--no-browser", browser="fake", display=":0")
    url = running.wait_for_line(r"^\s+(http://\S+/authorize\?\S+)\s*$").group(1)
    complete_in_browser(fake, url)
    result = running.finish(20)
    assert result.returncode == 0, str(result)
    # It says what to do with the URL, and never that a browser opens or cannot be opened.
    assert ("--no-browser: open the URL below in a browser yourself (from another machine, forward the port first: "
            "ssh -L PORT:127.0.0.1:PORT ...); or sign in with a code instead: proxyctl login --device fake.\n"
            "To sign in to fake, open this URL in a browser:\n") in result.stderr, str(result)
    assert "Opening the browser" not in result.stderr and "No browser" not in result.stderr, str(result)
    assert ws.browser_urls() == [] and ws.opener_calls() == []
    assert printed_url(result.stderr, "/authorize?") == url


# ============================================================================================ the store


def test_store_permissions_with_umask_000(ws, fake):
    fake_workspace(ws, fake)
    assert not ws.state_dir.exists()
    login_ok(ws, browser="fake", umask=0)
    assert mode(ws.state_dir) == 0o700
    assert mode(ws.state_dir / "tokens") == 0o700
    assert mode(ws.token_path("fake")) == 0o600
    for other in (ws.state_dir / "tokens").iterdir():
        assert mode(other) & 0o077 == 0, f"{other.name} is open to others: {oct(mode(other))}"


def test_store_loosened_directory_is_tightened(ws, fake):
    fake_workspace(ws, fake)
    login_ok(ws, browser="fake")
    os.chmod(ws.state_dir / "tokens", 0o755)
    os.chmod(ws.token_path("fake"), 0o644)
    login_ok(ws, browser="fake", umask=0)
    assert mode(ws.state_dir / "tokens") == 0o700
    assert mode(ws.token_path("fake")) == 0o600


def test_store_replaces_atomically_and_removes_leftover_temp_file(ws, fake):
    fake_workspace(ws, fake)
    fake.expires_in = 0                                     # stored already expired: the next `token` refreshes
    login_ok(ws, browser="fake")
    tokens_dir = ws.state_dir / "tokens"
    leftover = tokens_dir / ".fake.99999.12345.tmp"        # what a crash between write and rename leaves
    leftover.write_text('{"version": 1, "provider": "fake", "access_token": "half-writ')
    os.chmod(leftover, 0o600)
    before = ws.tokens("fake")
    inode = os.stat(ws.token_path("fake")).st_ino
    status = ws.run("status")
    assert status.returncode == 0, str(status)
    fake.expires_in = 3600
    token = ws.run("token")
    assert token.returncode == 0, str(token)
    after = ws.tokens("fake")
    assert token.stdout.strip() == after["access_token"] != before["access_token"]
    assert os.stat(ws.token_path("fake")).st_ino != inode, "the file is replaced by rename, not rewritten"
    assert mode(ws.token_path("fake")) == 0o600
    # The leftover never replaced the tokens (status read the real file), and the refresh, under the lock,
    # removed it: it could hold a refresh token.
    left = sorted(p.name for p in tokens_dir.iterdir() if p.name.endswith(".tmp"))
    assert left == [], f"temporary files left behind: {left}"


def test_damaged_token_file_is_reported(ws, fake):
    fake_workspace(ws, fake)
    ws.state_dir.joinpath("tokens").mkdir(parents=True)
    ws.token_path("fake").write_text('{"version": 1, "access_to')
    status = ws.run("status")
    assert status.returncode == 1, str(status)
    assert "damaged" in status.stdout + status.stderr and "proxyctl login fake" in status.stdout + status.stderr
    token = ws.run("token")
    assert token.returncode == 1 and token.stdout == "", str(token)


# ============================================================================================ configuration


def config_error(ws, text: str, *args: str):
    path = ws.root / "bad.conf"
    path.write_text(text)
    result = ws.run("login", *args, "--config", str(path), browser="fake", display=":0")
    assert ws.browser_urls() == [] and ws.opener_calls() == [], "no browser before the configuration is right"
    assert not ws.state_dir.exists()
    return path, result


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_config_missing_client_id(ws, fake):
    text = config.proxy(state_dir=ws.state_dir) + config.provider("fake", fake.issuer, client_id=None)
    path, result = config_error(ws, text)
    assert result.returncode == 1, str(result)
    assert f"{path}:{line_of(text, '[provider fake]')}" in result.stderr and "client_id" in result.stderr, str(result)
    assert fake.counts() == {}, "nothing is sent to the provider"


def test_config_key_typo_names_the_key_meant(ws, fake):
    text = config.proxy(state_dir=ws.state_dir) + config.provider("fake", fake.issuer, client_id=None) + \
        "clientid = proxyctl\n"
    path, result = config_error(ws, text)
    assert result.returncode == 1, str(result)
    assert f"{path}:{line_of(text, 'clientid =')}: [provider fake] clientid: unknown key; did you mean client_id?" \
        in result.stderr, str(result)
    assert "expected one of" not in result.stderr, str(result)


def test_config_http_issuer_not_loopback(ws):
    text = config.proxy(state_dir=ws.state_dir) + config.provider("corp", "http://login.example.com/realms/dev")
    path, result = config_error(ws, text)
    assert result.returncode == 1, str(result)
    assert f"{path}:{line_of(text, 'issuer =')}" in result.stderr and "issuer" in result.stderr, str(result)
    assert "https" in result.stderr, str(result)


def test_config_bad_use_par(ws, fake):
    text = config.proxy(state_dir=ws.state_dir) + config.provider("fake", fake.issuer, use_par="sometimes")
    path, result = config_error(ws, text)
    assert result.returncode == 1, str(result)
    assert f"{path}:{line_of(text, 'use_par =')}" in result.stderr and "use_par" in result.stderr, str(result)
    assert "auto, always or never" in result.stderr, str(result)


def test_config_several_providers_need_a_name(ws, fake):
    text = (config.proxy(state_dir=ws.state_dir) + config.provider("alpha", fake.issuer)
            + config.provider("beta", fake.issuer))
    _, result = config_error(ws, text)
    assert result.returncode == 64, str(result)
    assert "alpha" in result.stderr and "beta" in result.stderr, str(result)
    path = ws.root / "bad.conf"
    status = ws.run("status", "--config", str(path))
    assert status.returncode == 1, str(status)
    assert "alpha: not signed in" in status.stdout and "beta: not signed in" in status.stdout, str(status)
    for command in ("token", "logout"):
        other = ws.run(command, "--config", str(path))
        assert other.returncode == 64 and "alpha" in other.stderr and "beta" in other.stderr, str(other)


def test_config_unknown_provider(ws, fake):
    text = config.proxy(state_dir=ws.state_dir) + config.provider("fake", fake.issuer)
    _, result = config_error(ws, text, "nosuch")
    assert result.returncode == 1, str(result)
    assert "nosuch" in result.stderr and "fake" in result.stderr, str(result)
    for command in ("status", "token", "logout"):
        other = ws.run(command, "nosuch", "--config", str(ws.root / "bad.conf"))
        assert other.returncode == 1 and "nosuch" in other.stderr, str(other)


# ============================================================================================ the checker itself


def test_hygiene_check_catches_leaks(tmp_path):
    """The output-hygiene check of every test would notice a token, a code or a verifier-like string."""
    from signin import Result, Workspace
    probe = Workspace(tmp_path / "probe")
    probe.secrets.add("a-refresh-token-value")
    probe.results.append(Result(["status"], 0, "refresh a-refresh-token-value\n", "", 0.0))
    probe.results.append(Result(["token"], 0, "a-refresh-token-value\n", "", 0.0))            # token's stdout: allowed
    verifier = "Iv_qbbu0XT9Tn3xqDtZ_u1dBkdi3HJ70L1-2JyirjAo"
    probe.results.append(Result(["login"], 1, "", f"verifier {verifier}\n", 0.0))
    probe.results.append(Result(["login"], 0, "", f"  http://127.0.0.1:1/authorize?state={verifier}x\n", 0.0))
    problems = probe.hygiene_problems()
    assert len(problems) == 2, problems
    assert "proxyctl status` stdout contains a secret" in problems[0]
    assert "proxyctl login` stderr contains an unexplained secret-like string" in problems[1]


# ============================================================================================ the browser's pages


def test_the_browser_is_sent_to_a_clean_page_that_says_how_the_sign_in_ended(ws, fake):
    """The callback is answered with a 303 to /done (no code in the address bar or the history); /done says
    signed in, naming the provider and the account, only once the tokens are stored; a refusal's page gives the
    reason and the command to try again."""
    fake_workspace(ws, fake)
    running = ws.start("login", display=":0")
    url = running.wait_for_line(r"^\s+(http://\S+/authorize\?\S+)\s*$").group(1)
    callback = fake.login_browser(url)
    port = urllib.parse.urlsplit(callback).port
    answer = requests.get(callback, timeout=10)
    assert [r.status_code for r in answer.history] == [303], answer.history
    assert answer.history[0].headers["Location"] == "/done" and answer.url == f"http://127.0.0.1:{port}/done"
    assert answer.headers["Cache-Control"] == "no-store"
    assert ws.token_path("fake").exists(), "the page says signed in only once the tokens are stored"
    assert "<h1>Signed in to fake</h1>" in answer.text, answer.text
    assert ("<p>You are signed in to fake as Alice Liddell &lt;alice@example.test&gt;, and proxyctl has stored the "
            "tokens. Go back to the terminal; you can close this tab.</p>") in answer.text, answer.text
    assert running.finish(20).returncode == 0

    fake.fail("authorize", Fault.authorize_error("access_denied", "The user said no"))
    running = ws.start("login", display=":0")
    url = running.wait_for_line(r"^\s+(http://\S+/authorize\?\S+)\s*$").group(1)
    refused = requests.get(fake.login_browser(url), timeout=10)
    assert refused.url.endswith("/done") and [r.status_code for r in refused.history] == [303]
    assert "<h1>Sign-in to fake failed</h1>" in refused.text, refused.text
    assert ("<p>proxyctl could not sign you in: The sign-in was declined (access_denied: The user said no). Nothing "
            "was stored. To try again, run in the terminal: proxyctl login fake</p>") in refused.text, refused.text
    result = running.finish(20)
    assert result.returncode == 1 and "declined" in result.stderr, str(result)


def chromium_driver(download_dir: Path):
    """Headless Chromium (Debian's chromium and chromium-driver) under Selenium, without any proxy."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--no-first-run", "--no-default-browser-check", "--no-proxy-server",
                     "--window-size=1200,900", f"--user-data-dir={download_dir / 'profile'}"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def chromium_available() -> bool:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return False
    return os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)


@pytest.mark.skipif(not chromium_available(),
                    reason="chromium, chromium-driver or selenium missing (scripts/bootstrap test)")
def test_a_person_signs_in_with_chromium_on_glewlwyds_own_pages(ws, glewlwyd_factory):
    """`proxyctl login` as a person does it: the browser opens the sign-in URL, glewlwyd's own login page asks
    for the user name and password, its consent page for the scopes, then glewlwyd sends the browser back to
    proxyctl, which moves it on to /done and shows there whom it signed in. Screenshots and the page source of
    every step are kept in the test's directory when something fails."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    idp = glewlwyd_workspace(ws, glewlwyd_factory, idp_options=dict(webapp=True), login_timeout="90s")
    port = idp.redirect_ports[0]
    # $BROWSER: hands the URL to the browser this test drives (proxyctl cannot start a WebDriver session).
    handoff = ws.root / "browser-url"
    opener = ws.root / "open-in-chromium"
    opener.write_text(f'#!/bin/sh\nprintf "%s" "$1" > "{handoff}.tmp" && mv "{handoff}.tmp" "{handoff}"\n')
    opener.chmod(0o755)
    running = ws.start("login", env=ws.env(BROWSER=str(opener)))
    url = poll(lambda: handoff.exists() and handoff.read_text(), 20, message="proxyctl to open the browser")

    driver = chromium_driver(ws.root)
    shots = ws.root / "browser"
    shots.mkdir()
    step = "start"
    try:
        wait = WebDriverWait(driver, 20)
        step = "glewlwyd's login page"
        driver.get(url)
        wait.until(ready.visibility_of_element_located((By.ID, "username"))).send_keys(idp.username)
        driver.find_element(By.ID, "password").send_keys(idp.password)
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        step = "glewlwyd's consent page"
        for scope in ("profile", "email"):
            wait.until(ready.element_to_be_clickable((By.ID, f"grant-{scope}"))).click()
        driver.find_element(By.XPATH, "//button[normalize-space()='Grant access']").click()
        step = "glewlwyd's continue button"
        wait.until(ready.element_to_be_clickable(
            (By.CSS_SELECTOR, "button[title='Continue to client application']"))).click()
        step = "proxyctl's page"
        wait.until(lambda d: d.current_url == f"http://127.0.0.1:{port}/done"
                   and d.find_elements(By.TAG_NAME, "h1"))
        assert driver.find_element(By.TAG_NAME, "h1").text == "Signed in to glew"
        assert driver.find_element(By.TAG_NAME, "p").text == (
            "You are signed in to glew as Alice Liddell <alice@example.test>, and proxyctl has stored the tokens. "
            "Go back to the terminal; you can close this tab.")
        assert ws.tokens("glew")["refresh_token"], "the page came after the tokens were stored"
        # No code in the address bar, nor one step back in the history.
        assert "code=" not in driver.current_url
        driver.back()
        assert "code=" not in driver.current_url and "state=" not in driver.current_url, driver.current_url
    except Exception as error:
        driver.save_screenshot(str(shots / "failure.png"))
        (shots / "failure.html").write_text(driver.page_source)
        raise AssertionError(f"at {step} ({driver.current_url}): {error}; screenshot {shots / 'failure.png'}, page "
                             f"{shots / 'failure.html'}, glewlwyd log {idp.log_path}") from error
    finally:
        driver.quit()
    result = running.finish(30)
    assert result.returncode == 0, str(result)
    assert "Signed in to glew as Alice Liddell <alice@example.test>" in result.stderr, str(result)
