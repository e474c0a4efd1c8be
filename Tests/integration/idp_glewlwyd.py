"""A real OpenID provider for the integration tests: glewlwyd 2.7.5 (Debian package), run headless.

`scripts/bootstrap test` installs the package (`glewlwyd sqlite3 jq`); this module installs nothing.
Each `Glewlwyd()` gets a fresh temp dir, SQLite database, signing keys and a free loopback port, starts
`glewlwyd --config-file=...`, and configures it through the admin REST API:

- scopes `openid` (built in), `profile`, `email`, `api`, and `mfa` (needs the OTP scheme as a second factor:
  `amr` is then ["password", "otp"]);
- two OIDC plugin instances: `oidc` (DPoP allowed, nonces optional) and `oidcnonce` (DPoP nonces mandatory);
  both: PKCE required for public clients (S256 only), PAR allowed, device flow, refresh-token rolling with
  one-use "always" (reuse kills the chain), a replayed code revokes its tokens, RS256 (kid `rsa_kid`), JWKS
  shown, `iss` in authorization responses (RFC 9207, though not advertised), introspection/revocation and
  session management (end_session) enabled;
- with `ec_key=True` also an ES256 key (kid `ec_kid`) and a second client `proxyctl-test-es256` whose tokens
  are signed with it;
- a public client `proxyctl-test` with `http://127.0.0.1:PORT/callback` and `http://localhost:PORT/callback`
  for each port given (glewlwyd matches redirect URIs exactly: register every port a test uses, or call
  `add_redirect_ports`);
- a user `alice` with a name, an e-mail and an HOTP registration (for `mfa`; `next_otp()` gives codes);
- with `webapp=True` also glewlwyd's own web app (login.html, the consent page) for a real browser.

    with Glewlwyd(redirect_ports=[cb_port], access_token_duration=5) as idp:
        url = build_authorization_url(idp.issuer(), ...)      # your own client code
        location = idp.login_browser(url)                     # 'http://127.0.0.1:cb_port/callback?code=...'

Everything binds 127.0.0.1. Start-up takes about 0.2-0.4 s (state in /dev/shm). The server's log is in
`idp.log_path` (never printed); the temp dir is removed at stop() unless GLEWLWYD_KEEP=1.
"""
from __future__ import annotations

import atexit
import base64
import copy
import gzip
import hashlib
import hmac
import json
import os
import shutil
import sqlite3
import struct
import subprocess
import tempfile
import threading
import time
import urllib.parse
from typing import Iterable, Optional

import requests
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from fixtures.http import free_port
from fixtures.jose import b64url_uint

GLEWLWYD_BIN = shutil.which("glewlwyd") or "/usr/bin/glewlwyd"
INIT_SQL = "/usr/share/doc/glewlwyd/database/init.sqlite3.sql.gz"
MODULE_ROOT = "/usr/lib/glewlwyd"


def glewlwyd_available() -> bool:
    """True when the Debian package is installed (tests can skip on False)."""
    return os.path.exists(GLEWLWYD_BIN) and os.path.exists(INIT_SQL)


def _fast_tmp() -> Optional[str]:
    """tmpfs when there is one: glewlwyd's SQLite writes fsync, which costs about 10 ms each on disk."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def hotp(secret_b32: str, counter: int, digits: int = 6) -> str:
    """RFC 4226 HOTP (SHA-1), as glewlwyd's OTP scheme checks it."""
    key = base64.b32decode(secret_b32.upper() + "=" * (-len(secret_b32) % 8))
    mac = hmac.new(key, struct.pack(">Q", counter), hashlib.sha1).digest()
    offset = mac[-1] & 0x0F
    code = (struct.unpack(">I", mac[offset:offset + 4])[0] & 0x7FFFFFFF) % (10 ** digits)
    return str(code).zfill(digits)


def _private_jwk(key, kid: str, alg: str) -> dict:
    if isinstance(key, rsa.RSAPrivateKey):
        pn = key.private_numbers()
        pub = pn.public_numbers
        return {"kty": "RSA", "kid": kid, "alg": alg, "use": "sig", "n": b64url_uint(pub.n), "e": b64url_uint(pub.e),
                "d": b64url_uint(pn.d), "p": b64url_uint(pn.p), "q": b64url_uint(pn.q), "dp": b64url_uint(pn.dmp1),
                "dq": b64url_uint(pn.dmq1), "qi": b64url_uint(pn.iqmp)}
    pn = key.private_numbers()
    pub = pn.public_numbers
    size = (key.curve.key_size + 7) // 8
    return {"kty": "EC", "kid": kid, "alg": alg, "use": "sig", "crv": "P-256", "x": b64url_uint(pub.x, size),
            "y": b64url_uint(pub.y, size), "d": b64url_uint(pn.private_value, size)}


# The OIDC plugin's full parameter set as glewlwyd 2.7.5's admin UI sends it (webapp/admin.js defaults);
# `_plugin_parameters` overrides what the tests need.
OIDC_PLUGIN_DEFAULTS = \
    {'oauth-as-iss-id': False,
     'jwt-type': 'rsa',
     'jwt-key-size': '256',
     'jwks-uri': '',
     'jwks-private': '',
     'default-kid': '',
     'client-sign_kid-parameter': '',
     'jwks-public': '',
     'key': '',
     'cert': '',
     'access-token-duration': 3600,
     'refresh-token-duration': 1209600,
     'code-duration': 600,
     'refresh-token-rolling': True,
     'refresh-token-one-use': 'never',
     'client-refresh-token-one-use-parameter': 'refresh-token-one-use',
     'allow-non-oidc': False,
     'auth-type-code-enabled': True,
     'auth-type-code-revoke-replayed': False,
     'auth-type-token-enabled': True,
     'auth-type-id-token-enabled': True,
     'auth-type-none-enabled': True,
     'auth-type-password-enabled': False,
     'auth-type-client-enabled': True,
     'auth-type-device-enabled': False,
     'auth-type-refresh-enabled': True,
     'scope': [],
     'additional-parameters': [],
     'claims': [],
     'service-documentation': 'https://github.com/babelouest/glewlwyd/tree/master/docs',
     'op-policy-uri': '',
     'op-tos-uri': '',
     'jwks-show': True,
     'jwks-x5c': [],
     'request-parameter-allow': True,
     'request-uri-allow-https-non-secure': False,
     'request-parameter-allow-encrypted': True,
     'request-parameter-ietf-strict': False,
     'secret-type': 'pairwise',
     'address-claim': {'type': 'no',
                       'formatted': '',
                       'street_address': '',
                       'locality': '',
                       'region': '',
                       'postal_code': '',
                       'country': '',
                       'mandatory': False},
     'name-claim': 'on-demand',
     'name-claim-scope': [],
     'email-claim': 'no',
     'email-claim-scope': [],
     'scope-claim': 'no',
     'scope-claim-scope': [],
     'allowed-scope': ['openid'],
     'pkce-allowed': False,
     'pkce-method-plain-allowed': False,
     'pkce-required': False,
     'pkce-required-public-client': False,
     'pkce-scopes': [],
     'introspection-revocation-allowed': False,
     'introspection-revocation-auth-scope': [],
     'introspection-revocation-allow-target-client': True,
     'register-client-allowed': False,
     'register-client-auth-scope': [],
     'register-client-credentials-scope': [],
     'register-client-token-one-use': True,
     'register-client-management-allowed': True,
     'register-resource-specify-allowed': False,
     'register-resource-default': [],
     'register-default-properties': {},
     'session-management-allowed': False,
     'session-cookie-name': 'GLEWLWYD2_OIDC_SID',
     'session-cookie-expiration': 2419200,
     'front-channel-logout-allowed': True,
     'back-channel-logout-allowed': True,
     'client-pubkey-parameter': '',
     'client-jwks-parameter': 'jwks',
     'client-jwks_uri-parameter': 'jwks_uri',
     'request-maximum-exp': 3600,
     'encrypt-out-token-allow': False,
     'client-enc-parameter': 'enc',
     'client-alg-parameter': 'alg',
     'client-alg_kid-parameter': 'alg_kid',
     'client-encrypt_code-parameter': 'encrypt_code',
     'client-encrypt_at-parameter': 'encrypt_at',
     'client-encrypt_userinfo-parameter': 'encrypt_userinfo',
     'client-encrypt_id_token-parameter': 'encrypt_id_token',
     'client-encrypt_refresh_token-parameter': 'encrypt_refresh_token',
     'client-encrypt_introspection-parameter': 'encrypt_introspection',
     'device-authorization-expiration': 600,
     'device-authorization-interval': 5,
     'client-cert-header-name': 'SSL_CLIENT_CERT',
     'client-cert-use-endpoint-aliases': False,
     'client-cert-self-signed-allowed': False,
     'oauth-dpop-allowed': False,
     'oauth-dpop-iat-duration': 10,
     'oauth-dpop-iat-gap-duration': 0,
     'oauth-dpop-dpop_bound_access_tokens-property': 'dpop_bound_access_tokens',
     'oauth-dpop-nonce-mandatory': False,
     'oauth-dpop-nonce-counter': 10,
     'resource-allowed': False,
     'resource-scope': {},
     'resource-client-property': '',
     'resource-scope-and-client-property': False,
     'oauth-rar-allowed': False,
     'rar-types-client-property': 'authorization_details_types',
     'rar-allow-auth-unsigned': False,
     'rar-allow-auth-unencrypted': True,
     'rar-types': {},
     'oauth-par-allowed': False,
     'oauth-par-duration': 90,
     'oauth-par-required': False,
     'oauth-par-request_uri-prefix': 'urn:ietf:params:oauth:request_uri:',
     'prompt-continue-client-property': '',
     'restrict-scope-client-property': '',
     'oauth-ciba-allowed': False,
     'oauth-ciba-default-expiry': 600,
     'oauth-ciba-maximum-expiry': 1200,
     'oauth-ciba-mode-poll-allowed': True,
     'oauth-ciba-mode-ping-allowed': True,
     'oauth-ciba-mode-push-allowed': True,
     'oauth-ciba-allow-https-non-secure': False,
     'oauth-ciba-user-code-allowed': True,
     'oauth-ciba-user-code-property': 'user-code',
     'oauth-ciba-email-allowed': False,
     'oauth-ciba-email-host': '',
     'oauth-ciba-email-user': '',
     'oauth-ciba-email-password': '',
     'oauth-ciba-email-use-tls': False,
     'oauth-ciba-email-check-certificate': True,
     'oauth-ciba-email-port': 0,
     'oauth-ciba-email-from': '',
     'oauth-ciba-email-user-lang-property': 'lang',
     'oauth-ciba-email-content-type': 'text/plain; charset=utf-8',
     'oauth-ciba-email-templates': {'fr': {'oauth-ciba-email-subject': '',
                                           'oauth-ciba-email-body-pattern': '',
                                           'oauth-ciba-email-defaultLang': True}},
     'oauth-fapi-check-all': False,
     'oauth-fapi-allow-jarm': False,
     'oauth-fapi-add-s_hash': False,
     'oauth-fapi-verify-nbf': False,
     'oauth-fapi-allow-restrict-alg': False,
     'oauth-fapi-restrict-alg': [],
     'oauth-fapi-allow-multiple-kid': False,
     'oauth-fapi-ciba-confidential-client': False,
     'oauth-fapi-ciba-push-forbidden': False,
     'jwks-public-uri': '',
     'iss': '/'}


class GlewlwydError(RuntimeError):
    pass


class Glewlwyd:
    """A configured glewlwyd on 127.0.0.1. Context manager; `start()`/`stop()` also work directly."""

    ADMIN_USERNAME = "admin"          # built into init.sqlite3.sql
    ADMIN_PASSWORD = "password"
    PLUGINS = ("oidc", "oidcnonce")
    SCOPES = ("openid", "profile", "email", "api", "mfa")
    OTP_SCHEME = "otp"

    def __init__(self,
                 redirect_ports: Iterable[int] = (),
                 access_token_duration: int = 3600,
                 refresh_token_duration: int = 1209600,
                 code_duration: int = 600,
                 device_interval: int = 1,
                 device_expiration: int = 600,
                 dpop_nonce_counter: int = 2,
                 dpop_iat_duration: int = 60,
                 dpop_iat_gap: int = 2,
                 ec_key: bool = False,
                 client_id: str = "proxyctl-test",
                 username: str = "alice",
                 password: str = "alice-Pa55word!",
                 name: str = "Alice Liddell",
                 email: str = "alice@example.test",
                 log_level: str = "WARNING",
                 start_timeout: float = 10.0,
                 webapp: bool = False):
        self.redirect_ports = list(redirect_ports)
        # Serve glewlwyd's own web app (login.html, the consent page) for a real browser: see _webapp.
        self.webapp = webapp
        self.access_token_duration = access_token_duration
        self.refresh_token_duration = refresh_token_duration
        self.code_duration = code_duration
        self.device_interval = device_interval
        self.device_expiration = device_expiration
        self.dpop_nonce_counter = dpop_nonce_counter
        self.dpop_iat_duration = dpop_iat_duration
        self.dpop_iat_gap = dpop_iat_gap
        self.ec_key = ec_key
        self.client_id = client_id
        self.username = username
        self.password = password
        self.name = name
        self.email = email
        self.log_level = log_level
        self.start_timeout = start_timeout
        self.otp_secret = base64.b32encode(os.urandom(20)).decode().rstrip("=")
        self._otp_counter = 0
        self._otp_lock = threading.Lock()
        self.port: Optional[int] = None
        self.workdir: Optional[str] = None
        self.proc: Optional[subprocess.Popen] = None
        self.timings: dict = {}
        self._admin: Optional[requests.Session] = None
        self._log_file = None
        self.rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ec_private_key = ec.generate_private_key(ec.SECP256R1()) if ec_key else None
        self.rsa_kid = "rsa-" + os.urandom(4).hex()
        self.ec_kid = "ec-" + os.urandom(4).hex()

    # ------------------------------------------------------------------ properties

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "glewlwyd.log")

    def issuer(self, plugin: str = "oidc") -> str:
        return f"{self.base_url}/api/{plugin}"

    def discovery_url(self, plugin: str = "oidc") -> str:
        return self.issuer(plugin) + "/.well-known/openid-configuration"

    def discovery(self, plugin: str = "oidc") -> dict:
        r = requests.get(self.discovery_url(plugin), timeout=5)
        r.raise_for_status()
        return r.json()

    def token_endpoint(self, plugin: str = "oidc") -> str:
        return self.issuer(plugin) + "/token"

    def redirect_uris(self, port: int) -> list:
        return [f"http://127.0.0.1:{port}/callback", f"http://localhost:{port}/callback"]

    def redirect_uri(self, port: Optional[int] = None, host: str = "127.0.0.1") -> str:
        port = self.redirect_ports[0] if port is None else port
        return f"http://{host}:{port}/callback"

    @property
    def credentials(self) -> tuple:
        return (self.username, self.password)

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> "Glewlwyd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Glewlwyd":
        if not glewlwyd_available():
            raise GlewlwydError("glewlwyd is not installed: run scripts/bootstrap test")
        t0 = time.monotonic()
        atexit.register(self.stop)       # never leave a glewlwyd behind, even if the test run is aborted
        self.workdir = tempfile.mkdtemp(prefix="glewlwyd-", dir=_fast_tmp())
        self._init_db()
        t1 = time.monotonic()
        last_error = None
        for _attempt in range(3):  # the free port can be taken between our probe and glewlwyd's bind
            self.port = free_port()
            self._write_config()
            try:
                self._spawn()
                break
            except GlewlwydError as e:
                last_error = e
        else:
            self.stop()
            raise last_error
        t2 = time.monotonic()
        try:
            self._configure()
        except Exception:
            self.stop()
            raise
        t3 = time.monotonic()
        self.timings = {"db": t1 - t0, "spawn": t2 - t1, "configure": t3 - t2, "total": t3 - t0}
        return self

    def stop(self) -> None:
        atexit.unregister(self.stop)
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
            self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.workdir and os.path.isdir(self.workdir) and not os.environ.get("GLEWLWYD_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _init_db(self) -> None:
        # One statement per implicit transaction made the script take 2 s (an fsync each); in one
        # transaction without a journal it takes milliseconds.
        with gzip.open(INIT_SQL, "rt") as f:
            sql = f.read()
        db = sqlite3.connect(os.path.join(self.workdir, "glewlwyd.db"))
        try:
            db.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF; BEGIN;\n" + sql + "\nCOMMIT;")
        finally:
            db.close()

    def _write_config(self) -> None:
        conf = f"""
port={self.port}
bind_address="127.0.0.1"
external_url="{self.base_url}"
login_url="login.html"
api_prefix="api"
cookie_secure=0
session_expiration=86400
session_key="GLEWLWYD2_SESSION_ID"
admin_session_authentication="cookie"
profile_session_authentication="cookie"
allow_multiple_user_per_session=true
login_api_enabled=true
admin_scope="g_admin"
profile_scope="g_profile"
allow_origin="*"
allow_methods="GET, POST, PUT, DELETE, OPTIONS"
allow_headers="Origin, X-Requested-With, Content-Type, Accept, Bearer, Authorization, DPoP"
user_module_path="{MODULE_ROOT}/user"
client_module_path="{MODULE_ROOT}/client"
user_auth_scheme_module_path="{MODULE_ROOT}/scheme"
plugin_module_path="{MODULE_ROOT}/plugin"
hash_algorithm="SHA512"
log_mode="console"
log_level="{self.log_level}"
database = {{ type = "sqlite3"; path = "{os.path.join(self.workdir, 'glewlwyd.db')}"; }};
"""
        if self.webapp:
            conf += self._webapp()
        with open(os.path.join(self.workdir, "glewlwyd.conf"), "w") as f:
            f.write(conf)

    def _webapp(self) -> str:
        """The settings that make glewlwyd serve its web app at the root of external_url (login.html, where
        /auth sends a browser to sign in and consent). The package's webapp/config.json is a link to
        /etc/glewlwyd/config-2.7.json, which Debian installs as a directory holding config.json: the app
        cannot load its configuration from it. So the app is copied (about 3 MB; glewlwyd does not serve
        files through symbolic links) with that config.json itself."""
        source = "/usr/share/glewlwyd/webapp"
        webapp = os.path.join(self.workdir, "webapp")
        if not os.path.isdir(webapp):
            shutil.copytree(source, webapp, symlinks=False, ignore=lambda _d, names: ["config.json"])
            linked = os.path.realpath(os.path.join(source, "config.json"))
            if os.path.isdir(linked):
                linked = os.path.join(linked, "config.json")
            shutil.copyfile(linked, os.path.join(webapp, "config.json"))
        types = {".html": "text/html", ".css": "text/css", ".js": "application/javascript",
                 ".json": "application/json", ".png": "image/png", ".jpg": "image/jpeg", ".ico": "image/x-icon",
                 ".ttf": "font/ttf", ".woff": "font/woff", ".woff2": "font/woff2", ".svg": "image/svg+xml"}
        mime = ",\n".join(f'  {{ extension = "{ext}"; mime_type = "{kind}"; }}' for ext, kind in types.items())
        return f'static_files_path="{webapp}/"\nstatic_files_mime_types = (\n{mime}\n);\n'

    def _spawn(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [GLEWLWYD_BIN, f"--config-file={os.path.join(self.workdir, 'glewlwyd.conf')}"],
            stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + self.start_timeout
        delay = 0.01
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise GlewlwydError(f"glewlwyd exited with {self.proc.returncode}: {self._log_tail()}")
            try:
                r = requests.get(self.base_url + "/config", timeout=1)
                if r.status_code == 200 and r.json().get("api_prefix") == "api":
                    return
            except (requests.ConnectionError, requests.Timeout, ValueError):
                pass
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)
        self.proc.kill()
        self.proc.wait()
        raise GlewlwydError(f"glewlwyd did not answer GET /config within {self.start_timeout}s")

    def _log_tail(self, lines: int = 5) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return " | ".join(f.read().decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------------ admin API

    def admin_session(self) -> requests.Session:
        """A `requests.Session` logged in as the built-in administrator (cached; do not close it)."""
        if self._admin is None:
            s = requests.Session()
            r = s.post(self.base_url + "/api/auth/",
                       json={"username": self.ADMIN_USERNAME, "password": self.ADMIN_PASSWORD}, timeout=5)
            _check(r, "admin login")
            self._admin = s
        return self._admin

    def admin(self, method: str, path: str, body=None, expect=(200,)) -> requests.Response:
        """One admin REST call (`path` under /api); raises GlewlwydError unless the status is in `expect`."""
        r = self.admin_session().request(method, self.base_url + "/api" + path, json=body, timeout=10)
        if r.status_code == 401:  # g_admin needs a password younger than 600 s: sign in again
            self._admin.close()
            self._admin = None
            r = self.admin_session().request(method, self.base_url + "/api" + path, json=body, timeout=10)
        _check(r, f"{method} /api{path}", expect)
        return r

    def _configure(self) -> None:
        # Scopes. `openid` is built in; the rest need the password (a fresh session always has it).
        for scope, desc in (("profile", "Your name"), ("email", "Your e-mail address"), ("api", "The test API")):
            self.admin("POST", "/scope/", {"name": scope, "display_name": scope, "description": desc,
                                          "password_required": True, "password_max_age": 0, "scheme": {}})
        # The OTP scheme and a scope that needs it as a second factor.
        self.admin("POST", "/mod/scheme/", {
            "module": "otp", "name": self.OTP_SCHEME, "display_name": "One-time code", "expiration": 600,
            "max_use": 0, "allow_user_register": True, "enabled": True,
            "parameters": {"issuer": "proxyctl-test", "secret-minimum-size": 16, "otp-length": 6,
                           "hotp-allow": True, "hotp-window": 3, "totp-allow": True, "totp-window": 30,
                           "totp-start-offset": 0}})
        self.admin("POST", "/scope/", {
            "name": "mfa", "display_name": "mfa", "description": "Needs a second factor",
            "password_required": True, "password_max_age": 0,
            "scheme": {"otp": [{"scheme_type": "otp", "scheme_name": self.OTP_SCHEME,
                                "scheme_display_name": "One-time code"}]}})
        for plugin in self.PLUGINS:
            self.admin("POST", "/mod/plugin/", {
                "module": "oidc", "name": plugin, "display_name": f"OpenID Connect ({plugin})", "enabled": True,
                "parameters": self._plugin_parameters(plugin)})
        self.admin("POST", "/client/", self._client_body())
        if self.ec_key:
            # The database client backend stores only the properties its data-format lists: add sign_kid.
            mod = self.admin("GET", "/mod/client/database").json()
            mod["parameters"]["data-format"]["sign_kid"] = {"multiple": False, "read": True, "write": True}
            self.admin("PUT", "/mod/client/database", {k: mod[k] for k in ("module", "name", "display_name",
                                                                           "order", "parameters", "readonly")
                                                       if k in mod})
            self.admin("PUT", "/mod/client/database/reset")
            body = self._client_body()
            body.update({"client_id": self.client_id + "-es256", "name": "proxyctl test (ES256)",
                         "sign_kid": self.ec_kid})
            self.admin("POST", "/client/", body)
        self.admin("POST", "/user/", {
            "username": self.username, "name": self.name, "email": self.email, "password": self.password,
            "enabled": True, "scope": list(self.SCOPES)})
        # HOTP, not TOTP: glewlwyd accepts a TOTP code once and only in its own 30 s step, so a second
        # sign-in within 30 s would fail. HOTP codes are counted here, so every sign-in gets a fresh one.
        self.admin("POST", f"/delegate/{urllib.parse.quote(self.username)}/profile/scheme/register/", {
            "username": self.username, "scheme_type": "otp", "scheme_name": self.OTP_SCHEME,
            "value": {"type": "HOTP", "secret": self.otp_secret, "moving_factor": 0}})

    def _plugin_parameters(self, plugin: str) -> dict:
        p = copy.deepcopy(OIDC_PLUGIN_DEFAULTS)
        p.update({
            "iss": self.issuer(plugin),
            "oauth-as-iss-id": True,
            "jwt-type": "rsa", "jwt-key-size": "256",
            "access-token-duration": self.access_token_duration,
            "refresh-token-duration": self.refresh_token_duration,
            "code-duration": self.code_duration,
            "refresh-token-rolling": True,
            "refresh-token-one-use": "always",
            "auth-type-code-enabled": True,
            "auth-type-code-revoke-replayed": True,
            "auth-type-token-enabled": False,
            "auth-type-id-token-enabled": True,
            "auth-type-none-enabled": False,
            "auth-type-password-enabled": False,
            "auth-type-client-enabled": False,
            "auth-type-device-enabled": True,
            "auth-type-refresh-enabled": True,
            "device-authorization-expiration": self.device_expiration,
            "device-authorization-interval": self.device_interval,
            "jwks-show": True,
            "allowed-scope": list(self.SCOPES),
            "name-claim": "mandatory",
            "email-claim": "mandatory",
            "pkce-allowed": True,
            "pkce-method-plain-allowed": False,
            "pkce-required": False,
            "pkce-required-public-client": True,
            "introspection-revocation-allowed": True,
            "introspection-revocation-allow-target-client": True,
            "session-management-allowed": True,
            "oauth-par-allowed": True,
            "oauth-par-required": False,
            "oauth-dpop-allowed": True,
            "oauth-dpop-iat-duration": self.dpop_iat_duration,
            # How far in the future a proof's iat may be. glewlwyd compares it with time(2), which reads the
            # kernel's coarse clock (a few ms behind clock_gettime): with the default 0, a proof whose iat is
            # the current second is refused ("Invalid iat", 403 invalid_dpop_proof) about 0.2-0.4 % of the time.
            "oauth-dpop-iat-gap-duration": self.dpop_iat_gap,
            "oauth-dpop-nonce-mandatory": plugin == "oidcnonce",
            "oauth-dpop-nonce-counter": self.dpop_nonce_counter,
        })
        # Keys as a private JWKS (rather than `key`/`cert` PEMs) so that their kids are ours.
        keys = [_private_jwk(self.rsa_key, self.rsa_kid, "RS256")]
        if self.ec_key:
            keys.append(_private_jwk(self.ec_private_key, self.ec_kid, "ES256"))
        p.update({"jwks-private": json.dumps({"keys": keys}), "default-kid": self.rsa_kid,
                  "client-sign_kid-parameter": "sign_kid" if self.ec_key else "", "key": "", "cert": ""})
        return p

    def _client_body(self) -> dict:
        uris = [u for port in self.redirect_ports for u in self.redirect_uris(port)]
        return {"client_id": self.client_id, "name": "proxyctl test client", "description": "public client",
                "enabled": True, "confidential": False, "redirect_uri": uris,
                "authorization_type": ["code", "refresh_token", "device_authorization", "delete_token"],
                "scope": []}

    # ------------------------------------------------------------------ runtime changes

    def add_redirect_ports(self, ports: Iterable[int]) -> None:
        """Register more loopback callback ports on the client (glewlwyd matches redirect URIs exactly)."""
        for port in ports:
            if port not in self.redirect_ports:
                self.redirect_ports.append(port)
        body = self._client_body()
        self.admin("PUT", "/client/" + self.client_id, body)

    def set_plugin_parameters(self, plugin: str, **overrides) -> None:
        """Change parameters of a plugin instance (`**{'access-token-duration': 5}`) and reload it (about 20 ms)."""
        r = self.admin("GET", "/mod/plugin/" + plugin)
        mod = r.json()
        params = mod["parameters"]
        params.update(overrides)
        self.admin("PUT", "/mod/plugin/" + plugin, {"module": mod["module"], "name": plugin,
                                                    "display_name": mod.get("display_name", plugin),
                                                    "enabled": True, "parameters": params})
        # The PUT stores the parameters but the running instance keeps its old ones until it is reset.
        # Tokens, codes and sessions live in the database and survive the reset.
        self.admin("PUT", f"/mod/plugin/{plugin}/reset")

    def set_access_token_duration(self, seconds: int, plugins: Iterable[str] = PLUGINS) -> None:
        for plugin in plugins:
            self.set_plugin_parameters(plugin, **{"access-token-duration": seconds})

    # ------------------------------------------------------------------ the "browser"

    def user_session(self, username: Optional[str] = None, password: Optional[str] = None,
                     otp: bool = False) -> requests.Session:
        """A session logged in as the test user (password; plus the OTP factor when `otp`)."""
        s = requests.Session()
        r = s.post(self.base_url + "/api/auth/", json={"username": username or self.username,
                                                        "password": password or self.password}, timeout=5)
        _check(r, "user login")
        if otp:
            self.authenticate_otp(s, username)
        return s

    def next_otp(self) -> str:
        """The next one-time code of the test user (each code works once)."""
        with self._otp_lock:
            code = hotp(self.otp_secret, self._otp_counter)
            self._otp_counter += 1
            return code

    def authenticate_otp(self, session: requests.Session, username: Optional[str] = None) -> None:
        """Add the second factor (the `mfa` scope's OTP scheme) to a signed-in session."""
        r = session.post(self.base_url + "/api/auth/", json={
            "username": username or self.username, "scheme_type": "otp", "scheme_name": self.OTP_SCHEME,
            "value": {"value": self.next_otp()}}, timeout=5)
        _check(r, "OTP login")

    def login_browser(self, authorization_url: str, scope: Optional[str] = None,
                      session: Optional[requests.Session] = None, client_id: Optional[str] = None) -> str:
        """Play the user's browser: sign in, consent, and return the `Location` the authorization endpoint
        redirects to (e.g. 'http://127.0.0.1:PORT/callback?code=...&state=...&iss=...'), without following it.

        `scope` defaults to the URL's `scope` (or all scopes for a PAR `request_uri` URL); with `mfa` in it the
        OTP factor is added. Pass `session` to reuse a signed-in browser. Error redirects to the client
        (`?error=...`) are returned like any other; GlewlwydError if the server answers without a redirect or
        sends the browser to its login page (e.g. a second factor missing).
        """
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(authorization_url).query)
        if scope is None:
            scope = query.get("scope", [" ".join(self.SCOPES)])[0]
        s = session or self.user_session()
        if "mfa" in scope.split():
            self.authenticate_otp(s)
        self.grant(s, scope, client_id or query.get("client_id", [self.client_id])[0])
        sep = "&" if urllib.parse.urlsplit(authorization_url).query else "?"
        r = s.get(authorization_url + sep + "g_continue", allow_redirects=False, timeout=10)
        location = r.headers.get("Location")
        if r.status_code not in (301, 302, 303, 307) or not location:
            raise GlewlwydError(f"authorization endpoint answered {r.status_code} without a redirect: {r.text[:200]}")
        if "login.html" in location:
            raise GlewlwydError("authorization endpoint sent the browser to its login page: "
                                + _redact(location))
        return location

    def grant(self, session: requests.Session, scope: str, client_id: Optional[str] = None) -> None:
        """Record the user's consent for `scope` (space-separated) to the client."""
        client_id = client_id or self.client_id
        r = session.put(self.base_url + "/api/auth/grant/" + urllib.parse.quote(client_id), json={"scope": scope},
                        timeout=5)
        _check(r, "grant")

    def approve_device(self, user_code: str, plugin: str = "oidc", scope: Optional[str] = None,
                       session: Optional[requests.Session] = None, client_id: Optional[str] = None) -> None:
        """Approve a device-flow user code as the test user (what the user does on the verification page).

        `scope` is what the user consents to (default: all but `mfa`; with `mfa` the OTP factor is used too).
        """
        s = session or self.user_session()
        scope = scope or " ".join(x for x in self.SCOPES if x != "mfa")
        if "mfa" in scope.split():
            self.authenticate_otp(s)
        self.grant(s, scope, client_id)
        r = s.get(self.issuer(plugin) + "/device", params={"code": user_code, "g_continue": ""},
                  allow_redirects=False, timeout=10)
        location = r.headers.get("Location", "")
        if r.status_code not in (301, 302, 303) or "prompt=deviceComplete" not in location:
            raise GlewlwydError(f"device approval failed: {r.status_code} {_redact(location) or r.text[:200]}")

    # ------------------------------------------------------------------ server-side state

    def revoke_refresh_tokens(self, plugin: str = "oidc") -> int:
        """Disable every enabled refresh token of the test user on `plugin`, as the user would from their
        profile page; returns how many. (Disabling the user does NOT stop refresh in glewlwyd 2.7.5.)"""
        s = self.user_session()
        r = s.get(self.issuer(plugin) + "/token/", timeout=5)
        _check(r, "token list")
        count = 0
        for token in r.json():
            if token.get("enabled"):
                _check(s.delete(self.issuer(plugin) + "/token/" + token["token_hash"], timeout=5), "token delete")
                count += 1
        return count


def _redact(url: str) -> str:
    return url.split("?")[0] + ("?..." if "?" in url else "")


def _check(r: requests.Response, what: str, expect=(200,)) -> None:
    if r.status_code not in expect:
        raise GlewlwydError(f"{what}: HTTP {r.status_code} {r.text[:300]}")
