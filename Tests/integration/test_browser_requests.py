"""Tokens on cross-site browser requests (issue 32 item 1): with a browser using the proxy, any web page could
have the browser send a request to a protected origin, and the proxy attached the user's token (cross-site
request forgery against every protected API). Now a request whose Fetch Metadata or Origin says a page of
another origin made it gets 403 with Proxy-Status naming the rule, and the origin sees nothing; the origin's
own pages, allowed web apps and tools (no Fetch Metadata, no Origin) get the token as before.

The shapes of the issue, sent by curl over HTTP/1.1 and HTTP/2 to an https origin (the resource server, which
verifies every token against the fake provider's keys) and to a plain-http loopback origin (the recording echo
origin): a GET with `Sec-Fetch-Mode: no-cors`, a form POST, each with `Origin: https://evil.example` and
`Sec-Fetch-Site: cross-site`. Then a real browser: headless Chromium through the proxy loads an attacker's
page that fires an image, a no-cors fetch and a form POST at the protected API.
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
import uuid
from pathlib import Path

import pytest

from fixtures import config
from fixtures.deployment import Deployment, Workspace
from fixtures.http import run_curl
from fixtures.origins import EchoOrigin
from fixtures.proxy import poll
from idp_fake import FakeIdP
from resource_server import ResourceServer

API = "api.test"
EVIL = "https://evil.example"
APP = "http://localhost:3000"
CROSS_SITE = ("-H", f"Origin: {EVIL}", "-H", "Sec-Fetch-Site: cross-site")
RULE = 'proxyctl; error=http_request_denied; details="request from a web page of another origin'

origin_section = functools.partial(config.origin, client_authorization="replace")


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("browser-requests")


@pytest.fixture(scope="module")
def fake():
    with FakeIdP(access_token_format="jwt") as idp:
        yield idp


@pytest.fixture(scope="module")
def rs(module_dir, fake):
    server = ResourceServer(module_dir / "rs", [API])
    server.trust(fake.issuer, fake.url("jwks"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def echo():
    origin = EchoOrigin()
    yield origin
    origin.close()


@pytest.fixture(scope="module")
def deployment(module_dir, fake, rs, echo):
    sections = (config.provider("fake", fake.issuer, scopes="openid profile email", redirect_port=0)
                + origin_section(f"https://{API}:{rs.port}", "fake", ca_file=rs.ca_pem,
                                 allowed_request_origins=APP)
                + origin_section(f"http://127.0.0.1:{echo.port}", "fake"))
    ws = Workspace(module_dir / "main", sections, f"{API}=127.0.0.1, evil.example=127.0.0.1")
    ws.ca_init()
    ws.login_fake("fake")
    deployment = Deployment(ws, ws.start_proxy())
    yield deployment
    failure = deployment.stop()
    assert failure is None, failure


def unique(name: str) -> str:
    return f"/{name}/{uuid.uuid4().hex[:10]}"


def curl(deployment: Deployment, version: str, url: str, *args: str):
    """curl through the proxy with the environment `proxyctl env` set up, speaking HTTP/1.1 or HTTP/2 inside the
    tunnel (`version`: http1.1 or http2)."""
    return run_curl(url, f"--{version}", "--suppress-connect-headers", *args, env=deployment.client_env(),
                    scratch=deployment.ws.root / "curl")


def assert_refused(deployment: Deployment, answer, rule: str) -> None:
    """403, Proxy-Status naming the rule, no CORS field, and a body naming the two keys and the file."""
    assert answer.returncode == 0 and answer.status == 403, str(answer)
    assert answer.header("proxy-status").startswith(RULE), answer.header("proxy-status")
    assert rule in answer.header("proxy-status"), answer.header("proxy-status")
    assert answer.header("access-control-allow-origin") is None
    body = answer.body.decode()
    assert f"add allowed_request_origins = {EVIL} to [origin " in body, body
    assert f"] of {deployment.ws.config_path}, or set browser_requests = allow there" in body, body


@pytest.mark.parametrize("version", ["http1.1", "http2"])
@pytest.mark.parametrize("shape", ["no-cors GET", "form POST"])
def test_a_request_from_another_site_gets_no_token_and_never_reaches_the_origin(deployment, rs, version, shape):
    path = unique("csrf")
    mark, seen = deployment.proxy.mark(), rs.mark()
    if shape == "no-cors GET":
        extra = ("-H", "Sec-Fetch-Mode: no-cors", "-H", "Sec-Fetch-Dest: image")
    else:
        extra = ("-H", "Sec-Fetch-Mode: navigate", "-H", "Content-Type: application/x-www-form-urlencoded",
                 "--data-raw", "amount=99&to=mallory")
    answer = curl(deployment, version, rs.url(path), *CROSS_SITE, *extra)
    assert_refused(deployment, answer, "Origin is another origin")
    line = deployment.lines(mark, needle="status=403", target=path, at_least=1)[0]
    assert "answered-by=proxyctl" in line and ("h2=" in line) == (version == "http2"), line
    # Sec-Fetch-Site alone (a no-cors GET carries no Origin) is enough.
    alone = curl(deployment, version, rs.url(path + "/site"), "-H", "Sec-Fetch-Site: cross-site",
                 "-H", "Sec-Fetch-Mode: no-cors")
    assert alone.status == 403 and "Sec-Fetch-Site: cross-site" in alone.header("proxy-status"), str(alone)
    assert not [s for s in rs.since(seen, API) if path in s.path]


@pytest.mark.parametrize("version", ["http1.1", "http2"])
def test_the_origins_own_pages_allowed_apps_and_tools_still_get_the_token(deployment, rs, version):
    path = unique("own")
    seen = rs.mark()
    own = f"https://{API}:{rs.port}"
    requests = [
        ("tool", ()),
        ("same-origin", ("-H", f"Origin: {own}", "-H", "Sec-Fetch-Site: same-origin")),
        ("navigation", ("-H", "Sec-Fetch-Site: none", "-H", "Sec-Fetch-Mode: navigate")),
        ("allowed app", ("-H", f"Origin: {APP}", "-H", "Sec-Fetch-Site: cross-site")),
        ("allowed app's image", ("-H", "Sec-Fetch-Site: cross-site", "-H", f"Referer: {APP}/dashboard")),
    ]
    for name, args in requests:
        answer = curl(deployment, version, rs.url(f"{path}/{name.replace(' ', '-')}"), *args)
        assert answer.status == 200, (name, str(answer))
    got = [s for s in rs.since(seen, API) if path in s.path]
    assert len(got) == len(requests)
    for s in got:
        assert s.error is None and s.token, (s.path, s.error)


def test_a_plain_http_protected_origin_through_the_front_door(deployment, echo):
    path = unique("csrf-http")
    proxy = ("-x", deployment.exports["HTTP_PROXY"])
    refused = run_curl(echo.url(path), *proxy, *CROSS_SITE, "-H", "Sec-Fetch-Mode: no-cors",
                       env=deployment.client_env(), scratch=deployment.ws.root / "curl")
    assert_refused(deployment, refused, "Origin is another origin")
    form = run_curl(echo.url(path + "/form"), *proxy, *CROSS_SITE, "--data-raw", "amount=99",
                    env=deployment.client_env(), scratch=deployment.ws.root / "curl")
    assert_refused(deployment, form, "Origin is another origin")
    assert echo.requests_with(path) == []
    # A tool's request gets the token, as before.
    tool = run_curl(echo.url(path + "/tool"), *proxy, env=deployment.client_env(),
                    scratch=deployment.ws.root / "curl")
    assert tool.status == 200, str(tool)
    [received] = echo.requests_with(path)
    assert b"\r\nAuthorization: Bearer ey" in received.head


def test_browser_requests_allow_turns_the_rule_off(module_dir, fake, rs):
    sections = (config.provider("fake", fake.issuer, scopes="openid profile email", redirect_port=0)
                + origin_section(f"https://{API}:{rs.port}", "fake", ca_file=rs.ca_pem))
    ws = Workspace(module_dir / "allow", sections, f"{API}=127.0.0.1", browser_requests="allow")
    ws.ca_init()
    ws.login_fake("fake")
    deployment = Deployment(ws, ws.start_proxy())
    try:
        path = unique("allowed")
        answer = curl(deployment, "http1.1", rs.url(path), *CROSS_SITE)
        assert answer.status == 200, str(answer)
    finally:
        failure = deployment.stop()
        assert failure is None, failure


# MARK: - A real browser


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def chromium_available() -> bool:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return False
    return os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)


class AttackerSite:
    """http://evil.example:PORT/: a page that fires requests at the protected API the moment it loads."""

    def __init__(self, page: str):
        body = page.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.skipif(not chromium_available(),
                    reason="chromium, chromium-driver or selenium missing (scripts/bootstrap test)")
def test_chromium_on_an_attackers_page_cannot_use_the_token(deployment, rs, tmp_path):
    """Headless Chromium with the proxy as its proxy server opens a page on another site that loads an image
    from the protected API, fetches it in no-cors mode and posts a form to it: the browser's own Fetch Metadata
    and Origin fields get each a 403 from the proxy and the API sees none of them. The API's own page, opened
    by the user, gets the token."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    tag = uuid.uuid4().hex[:10]
    api = f"https://{API}:{rs.port}"
    page = f"""<!doctype html><title>cute cats</title>
<img src="{api}/attack-img-{tag}">
<form id="f" method="POST" action="{api}/attack-form-{tag}"><input name="amount" value="99"></form>
<script>
fetch("{api}/attack-fetch-{tag}", {{mode: "no-cors", method: "POST", body: "x=1"}})
  .finally(() => document.getElementById("f").submit());
</script>"""
    site = AttackerSite(page)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    proxy_url = deployment.exports["HTTPS_PROXY"]
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--no-first-run", "--no-default-browser-check", f"--proxy-server={proxy_url}",
                     # The proxy's local CA is not in Chromium's NSS store here; what is tested is the proxy's rule.
                     "--ignore-certificate-errors", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    mark, seen = deployment.proxy.mark(), rs.mark()
    try:
        driver.set_page_load_timeout(30)
        driver.get(f"http://evil.example:{site.port}/")
        for kind in ("img", "fetch", "form"):
            line = deployment.lines(mark, needle="status=403", target=f"/attack-{kind}-{tag}", at_least=1)[0]
            assert "answered-by=proxyctl" in line, line
        assert not [s for s in rs.since(seen, API) if tag in s.path], "the API saw the attacker's requests"
        # The user opens the API's own page: a navigation (Sec-Fetch-Site: none) gets the token.
        driver.get(f"{api}/own-page-{tag}")
        poll(lambda: [s for s in rs.since(seen, API) if f"own-page-{tag}" in s.path] or None, 15,
             message="the API's own page reached the API")
        [own] = [s for s in rs.since(seen, API) if f"own-page-{tag}" in s.path]
        assert own.error is None and own.token and own.header("sec-fetch-site") == "none", own.headers
    finally:
        driver.quit()
        site.close()
