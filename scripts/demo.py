"""The proxyctl demo on loopback, driven step by step (run by scripts/demo).

It starts a real OpenID provider (glewlwyd), a protected API (HTTPS with its own CA, checking every token
against the provider's keys), an unprotected HTTPS site, and proxyctl; then it does what a user does, with
the commands shown as they run. The "browser" that signs in is scripted (Tests/integration/browser.py):
it types the demo user's password into glewlwyd for you.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fixtures_on_path  # noqa: F401  (Tests/integration on sys.path: the fixtures below)
from fixtures.http import free_port
from fixtures.jose import AccessTokenVerifier, TokenError
from fixtures.pki import CertificateAuthority, ServerIdentity
from fixtures.tls_server import QuietHandler, TLSHTTPServer
from idp_glewlwyd import Glewlwyd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BIN = os.environ.get("PROXYCTL_BIN", os.path.join(ROOT, ".build", "release", "proxyctl"))
BOLD, CYAN, DIM, RESET = "\033[1m", "\033[36m", "\033[2m", "\033[0m"


def say(text: str) -> None:
    print(f"\n{BOLD}{text}{RESET}", flush=True)


def run(args: list[str], env: dict[str, str], show: str | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """Runs a command, printing it as a user would type it and its output."""
    print(f"{CYAN}$ {show or ' '.join(args)}{RESET}", flush=True)
    result = subprocess.run(args, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    for line in (result.stdout + result.stderr).rstrip().splitlines():
        print("  " + line)
    if check and result.returncode != 0:
        raise SystemExit(f"demo step failed: {show or ' '.join(args)}")
    return result


def make_tls(directory: Path, name: str) -> ServerIdentity:
    """A CA and a leaf for `name` (the demo sites' own certificates)."""
    return CertificateAuthority.make(f"demo CA for {name}").issue(directory / name, [name])


def serve_https(port: int, identity: ServerIdentity, handler: type[QuietHandler]) -> TLSHTTPServer:
    """An HTTPS server on 127.0.0.1:`port` presenting `identity`, serving in the background."""
    return TLSHTTPServer(handler, identity.server_context(), port=port).start()


def api_handler(idp: Glewlwyd, step_up_after: list[int]) -> type[QuietHandler]:
    """The protected API: /me needs a valid token; /payroll also needs a sign-in after `step_up_after[0]`."""
    verifier = AccessTokenVerifier()
    verifier.trust(idp.issuer(), idp.discovery()["jwks_uri"])

    class Handler(QuietHandler):
        def answer(self, status, body, extra=()):
            data = (json.dumps(body, indent=None) + "\n").encode()
            self.send_response(status)
            for name, value in extra:
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
            try:
                claims = verifier.verify(token)
            except TokenError as error:
                return self.answer(401, {"error": "invalid_token", "detail": str(error)},
                                   [("WWW-Authenticate", 'Bearer error="invalid_token"')])
            if self.path == "/payroll" and claims["iat"] < step_up_after[0]:
                return self.answer(401, {"error": "insufficient_user_authentication"},
                                   [("WWW-Authenticate", 'Bearer error="insufficient_user_authentication", '
                                     'error_description="Sign in again to see payroll", max_age=60')])
            self.answer(200, {"path": self.path, "sub": claims["sub"], "scope": claims.get("scope"),
                              "token_expires_in": claims["exp"] - int(time.time())})

    return Handler


class Site(QuietHandler):
    def do_GET(self):
        body = f"Hello from an unprotected site. Authorization header seen: {self.headers.get('Authorization')}\n"
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    work = tempfile.mkdtemp(prefix="proxyctl-demo.")
    processes = []
    try:
        callback, api_port, site_port, proxy_port = free_port(), free_port(), free_port(), free_port()
        api_tls = make_tls(Path(work), "api.demo.test")
        site_tls = make_tls(Path(work), "www.demo.test")
        say("Starting a real OpenID provider (glewlwyd) on loopback, with a short access-token lifetime (8 s)")
        with Glewlwyd(redirect_ports=[callback], access_token_duration=8) as idp:
            print(f"  issuer: {idp.issuer()}")
            step_up_after = [0]
            serve_https(api_port, api_tls, api_handler(idp, step_up_after))
            serve_https(site_port, site_tls, Site)
            print(f"  protected API:    https://api.demo.test:{api_port} (checks every token with the provider's keys)")
            print(f"  unprotected site: https://www.demo.test:{site_port}")

            home = os.path.join(work, "home")
            os.makedirs(home)
            config = os.path.join(home, "proxy.conf")
            with open(config, "w") as f:
                f.write(f"""[proxy]
listen = 127.0.0.1:{proxy_port}
state_dir = {home}/state
# the demo's made-up host names point at loopback
resolve = api.demo.test=127.0.0.1, www.demo.test=127.0.0.1

[provider demo]
issuer = {idp.issuer()}
client_id = {idp.client_id}
scopes = openid profile email
redirect_port = {callback}

[origin https://api.demo.test:{api_port}]
provider = demo
ca_file = {api_tls.ca_pem}
""")
            env = dict(os.environ, HOME=home, PROXYCTL_CONFIG=config, PATH=os.path.dirname(BIN) + ":" + os.environ["PATH"],
                       BROWSER=f"{sys.executable} {os.path.join(ROOT, 'Tests', 'integration', 'browser.py')}",
                       PROXYCTL_TEST_BROWSER="glewlwyd", PROXYCTL_TEST_IDP_URL=idp.base_url,
                       PROXYCTL_TEST_IDP_USER=idp.username, PROXYCTL_TEST_IDP_PASSWORD=idp.password)
            for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "NO_PROXY", "no_proxy"):
                env.pop(name, None)
            say("The configuration: one provider, one protected origin (everything else passes through)")
            print(DIM + open(config).read() + RESET)

            say("1. Sign in (the browser is scripted here; proxyctl prints the URL it opens)")
            run(["proxyctl", "login"], env, check=True)
            run(["proxyctl", "status"], env)

            say("2. Make the local CA (name-constrained to the protected host only) and start the proxy")
            run(["proxyctl", "ca", "init"], env, check=True)
            log_path = os.path.join(work, "proxy.log")
            log = open(log_path, "w")
            proxy = subprocess.Popen(["proxyctl", "serve"], env=env, stderr=log, stdin=subprocess.DEVNULL)
            processes.append(proxy)
            for _ in range(100):
                if "listening on" in open(log_path).read():
                    break
                time.sleep(0.05)
            exported = run(["proxyctl", "env"], env, show='eval "$(proxyctl env)"  # shown below')
            for name, value in re.findall(r"export (\w+)='([^']*)'", exported.stdout):
                env[name] = value

            say("3. curl the protected API: the proxy attaches the token, curl knows nothing about OAuth")
            run(["curl", "-sS", f"https://api.demo.test:{api_port}/me"], env, show=f"curl https://api.demo.test:{api_port}/me")

            say("4. The unprotected site passes through a blind tunnel: its own certificate, no token")
            run(["curl", "-sS", "--cacert", str(site_tls.ca_pem), f"https://www.demo.test:{site_port}/"], env,
                show=f"curl --cacert www-ca.pem https://www.demo.test:{site_port}/")

            say("5. Wait for the access token to expire: the proxy refreshes it and the request just works")
            time.sleep(9)
            run(["curl", "-sS", f"https://api.demo.test:{api_port}/me"], env, show=f"curl https://api.demo.test:{api_port}/me")

            say("6. A step-up challenge (RFC 9470) is passed on with Proxy-Status naming the fix, never swallowed")
            step_up_after[0] = int(time.time()) + 1
            time.sleep(1.1)
            run(["curl", "-sS", "-i", f"https://api.demo.test:{api_port}/payroll"], env,
                show=f"curl -i https://api.demo.test:{api_port}/payroll")
            run(["proxyctl", "status"], env)
            run(["proxyctl", "step-up"], env, check=True)
            run(["curl", "-sS", f"https://api.demo.test:{api_port}/payroll"], env,
                show=f"curl https://api.demo.test:{api_port}/payroll")

            say("7. Errors name the fix: an unknown host, then a sign-out and the proxy's own 401")
            run(["curl", "-sS", "-i", "http://no-such-host.invalid/"], env, show="curl -i http://no-such-host.invalid/")
            run(["proxyctl", "logout"], env)
            run(["curl", "-sS", "-i", f"https://api.demo.test:{api_port}/me"], env,
                show=f"curl -i https://api.demo.test:{api_port}/me")

            say("The proxy's log: one line per request or tunnel; never a token, a code or a query string")
            proxy.terminate()
            proxy.wait(timeout=15)
            log.close()
            print(DIM + open(log_path).read() + RESET)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
