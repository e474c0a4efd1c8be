#!/usr/bin/env python3
"""A scripted browser for `proxyctl login`: set as $BROWSER, it is started with the authorization URL.

It plays the user: with PROXYCTL_TEST_BROWSER=glewlwyd it signs in to glewlwyd through its API (the
credentials come from the environment), consents, asks the authorization endpoint for the redirect, and
then follows the redirect to proxyctl's loopback listener, exactly as a browser would. With
PROXYCTL_TEST_BROWSER=fake it just follows the fake provider's redirects. Every URL it was given is
appended to PROXYCTL_TEST_BROWSER_LOG (one per line) so tests can inspect the request proxyctl built.
Nothing secret is printed.
"""
import os
import sys
import urllib.parse

import requests


def main() -> int:
    url = sys.argv[-1]
    log = os.environ.get("PROXYCTL_TEST_BROWSER_LOG")
    if log:
        with open(log, "a") as handle:
            handle.write(url + "\n")
    mode = os.environ.get("PROXYCTL_TEST_BROWSER", "fake")
    if mode == "none":
        return 0
    session = requests.Session()
    # A desktop browser does not read HTTPS_PROXY: neither does this one.
    session.trust_env = False
    if mode == "glewlwyd":
        base = os.environ["PROXYCTL_TEST_IDP_URL"]
        r = session.post(base + "/api/auth/", json={"username": os.environ["PROXYCTL_TEST_IDP_USER"],
                                                   "password": os.environ["PROXYCTL_TEST_IDP_PASSWORD"]}, timeout=10)
        r.raise_for_status()
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
        scope = query.get("scope", [os.environ.get("PROXYCTL_TEST_IDP_SCOPE", "openid")])[0]
        client_id = query.get("client_id", [""])[0]
        r = session.put(base + "/api/auth/grant/" + urllib.parse.quote(client_id), json={"scope": scope}, timeout=10)
        r.raise_for_status()
        sep = "&" if urllib.parse.urlsplit(url).query else "?"
        r = session.get(url + sep + "g_continue", allow_redirects=False, timeout=10)
        location = r.headers.get("Location")
        if r.status_code not in (301, 302, 303, 307) or not location or "login.html" in location:
            sys.stderr.write(f"browser.py: glewlwyd answered {r.status_code} without a usable redirect\n")
            return 1
        url = location
    # Follow redirects to the loopback listener, like a browser. Only loopback targets are followed.
    for _ in range(5):
        r = session.get(url, allow_redirects=False, timeout=10)
        location = r.headers.get("Location")
        if r.status_code in (301, 302, 303, 307) and location:
            url = urllib.parse.urljoin(url, location)
            continue
        return 0 if r.status_code < 500 else 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
