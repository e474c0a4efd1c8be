#!/usr/bin/env python3
"""browser.py, plus a record of every URL it fetched (PROXYCTL_TEST_BROWSER_VISITS, one per line).

The sign-in tests use it as $BROWSER so that they learn the authorization codes that went through the
browser (the loopback redirect's `code=`), which no provider fixture exposes for glewlwyd; the output
hygiene checks then make sure proxyctl never prints them. Everything else is browser.py's behaviour.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import requests  # noqa: E402

import browser  # noqa: E402

_visits = os.environ.get("PROXYCTL_TEST_BROWSER_VISITS")
if _visits:
    _get = requests.Session.get

    def _recording_get(self, url, *args, **kwargs):
        with open(_visits, "a") as handle:
            handle.write(str(url) + "\n")
        return _get(self, url, *args, **kwargs)

    requests.Session.get = _recording_get


def _main() -> int:
    """browser.main(); a failure is appended to PROXYCTL_TEST_BROWSER_ERRORS (proxyctl discards the browser's
    output), so that a test can say why a sign-in never came back."""
    errors = os.environ.get("PROXYCTL_TEST_BROWSER_ERRORS")
    try:
        code = browser.main()
        problem = None if code == 0 else f"browser.py exited with {code}"
    except Exception as error:  # noqa: BLE001 - reported to the test, then re-raised
        code, problem = 1, f"browser.py failed: {type(error).__name__}: {error}"
    if problem and errors:
        with open(errors, "a") as handle:
            handle.write(problem + "\n")
    return code


if __name__ == "__main__":
    sys.exit(_main())
