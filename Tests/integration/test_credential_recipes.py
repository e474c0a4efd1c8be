"""The recipes of docs/protected-origins.md ("API keys and other credentials") run as written, end to end (issue
31): a Cloudflare Access service token pair (two fields, one from `proxyctl secret set`, one from a file) and Basic
with a token as the password (`{basic:USER}`), each against a fixture origin (`key_origin.KeyOrigin` with a shape)
that accepts only that shape; and `secret = NAME` kept in a real Secret Service (`token_store = secret-service`:
gnome-keyring on a private D-Bus session, `fixtures.secret_service`), set and removed with `proxyctl secret`.

Each recipe's ini block is read from the document itself, so a recipe that stops working fails here; only the
origin's port, its `ca_file` and the directory of its files (`~/.config/proxyctl/`) are filled in. curl sends no
credential of its own: the origin must see exactly the recipe's fields, and the secrets appear in no output.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
from pathlib import Path

import pytest

from fixtures.deployment import Deployment, Workspace
from fixtures.proxy import clean_env, poll, proxyctl_bin
from fixtures.secret_service import HeadlessSecretService
from key_origin import CREDENTIAL_FIELDS, KeyOrigin

DOC = Path(__file__).resolve().parents[2] / "docs" / "protected-origins.md"
CF_ID = "cf-id-" + "3d2c1b0a" * 4 + ".access"
CF_SECRET = "cf-secret-" + "7e6f5a4b3c2d1e0f" * 4
REGISTRY_TOKEN = "registry-token-" + "0a9b8c7d6e5f" * 3
SECRETS = (CF_ID, CF_SECRET, REGISTRY_TOKEN)


def recipe(title: str) -> str:
    """The ini block that follows the paragraph of docs/protected-origins.md beginning with `title`."""
    text = DOC.read_text()
    start = text.index("\n" + title)
    found = re.compile(r"```ini\n(.*?)```", re.S).search(text, start)
    assert found, f"no ini block after {title!r} in {DOC}"
    return found.group(1)


def fill_in(block: str, origin: KeyOrigin, files: Path) -> tuple[str, str]:
    """The recipe with the origin's port and ca_file and the files' directory; and the origin's URL."""
    url = re.search(r"^\[origin (https://[^\]]+)\]$", block, re.M).group(1)
    local = f"{url}:{origin.port}"
    block = block.replace(f"[origin {url}]", f"[origin {local}]\nca_file = {origin.ca_pem}")
    return block.replace("~/.config/proxyctl/", f"{files}/"), local


def private_file(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def assert_no_secret(text: str | bytes, where: str) -> None:
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    for secret in SECRETS:
        assert secret not in text, f"a secret in {where}"


def secret_set(ws: Workspace, name: str, value: str, **env: str) -> subprocess.CompletedProcess:
    """`proxyctl secret set NAME` with the value on standard input (never argv)."""
    home = ws.root / "cli-home"
    home.mkdir(exist_ok=True)
    return subprocess.run([proxyctl_bin(), "secret", "set", name, "--config", str(ws.config_path)],
                          input=value + "\n", capture_output=True, text=True, timeout=60,
                          env=clean_env(HOME=str(home), **env))


def check_origin_saw_exactly(origin: KeyOrigin, mark: int, expected: dict[str, str]) -> None:
    """One request reached the origin, with each expected field once and no other credential field."""
    seen = origin.since(mark)
    assert [r.status for r in seen] == [200], [(r.status, [k for k, _ in r.headers]) for r in seen]
    for name, value in expected.items():
        assert seen[0].values(name) == [value], name
    named = {name.lower() for name in expected}
    extra = [k for k, _ in seen[0].headers if k.lower() in CREDENTIAL_FIELDS and k.lower() not in named]
    assert extra == [], f"credential fields the recipe does not name: {extra}"


def run_recipe(tmp_path: Path, title: str, host: str, shape: dict[str, str], prepare, proxy_keys=None,
               env=None, http: str = "--http1.1"):
    """Serves the recipe `title` against an origin accepting only `shape`, curls it with no credential of its
    own and checks what the origin saw. `prepare(ws, files)` stores the recipe's secrets."""
    origin = KeyOrigin(tmp_path / "origin-pki", [host], shape=shape)
    files = tmp_path / "config-proxyctl"
    block, url = fill_in(recipe(title), origin, files)
    ws = Workspace(tmp_path / "ws", block + "\n", f"{host}=127.0.0.1", **(proxy_keys or {}))
    ws.ca_init()
    prepare(ws, files)
    proxy = ws.start_proxy(**(env or {}))
    deployment = Deployment(ws, proxy)
    try:
        mark = origin.mark()
        answer = deployment.curl(f"{url}/recipe", http)
        assert answer.status == 200, (answer.status, answer.body, answer.stderr, proxy.log()[-2000:])
        assert json.loads(answer.body)["authorized"] is True
        check_origin_saw_exactly(origin, mark, shape)
        # The audit line is written once the scan for curl's process has answered (up to 250 ms under load).
        audit = ws.state / "audit.log"
        poll(lambda: audit.exists() and '"/recipe"' in audit.read_text(), message="the audit line")
        for text, where in ((answer.body, "curl's output"), (proxy.log(), "the proxy's log"),
                            (audit.read_text(), "the audit log")):
            assert_no_secret(text, where)
        return deployment, origin, url
    except BaseException:
        deployment.stop()
        origin.close()
        raise


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
def test_the_cloudflare_access_pair_recipe(tmp_path, http):
    shape = {"CF-Access-Client-Id": CF_ID, "CF-Access-Client-Secret": CF_SECRET}

    def prepare(ws, files):
        private_file(files / "cf-client-id", CF_ID)
        stored = secret_set(ws, "cf-secret", CF_SECRET)
        assert stored.returncode == 0, stored.stderr
        assert_no_secret(stored.stdout + stored.stderr, "secret set's output")
        assert (ws.state / "secrets" / "cf-secret").stat().st_mode & 0o777 == 0o600

    deployment, origin, _ = run_recipe(tmp_path, "A Cloudflare Access service token", "internal.example.com",
                                       shape, prepare, http=http)
    try:
        # The client's own pair (a tool that was given one) never reaches the origin beside the proxy's.
        mark = origin.mark()
        answer = deployment.curl(f"https://internal.example.com:{origin.port}/own-pair", http,
                                 "-H", "CF-Access-Client-Id: tool", "-H", "CF-Access-Client-Secret: tool")
        assert answer.status == 200, answer.body
        check_origin_saw_exactly(origin, mark, shape)
    finally:
        assert deployment.stop() is None
        origin.close()


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
def test_the_basic_recipe(tmp_path, http):
    basic = "Basic " + base64.b64encode(f"ci-bot:{REGISTRY_TOKEN}".encode()).decode()

    def prepare(ws, files):
        private_file(files / "registry.token", REGISTRY_TOKEN)

    deployment, origin, _ = run_recipe(tmp_path, "Basic with a token as the password", "registry.example.com",
                                       {"Authorization": basic}, prepare, http=http)
    try:
        # A client's own Basic (curl -u) is replaced by the recipe's, never doubled.
        mark = origin.mark()
        answer = deployment.curl(f"https://registry.example.com:{origin.port}/own-basic", http, "-u", "me:mine")
        assert answer.status == 200, answer.body
        check_origin_saw_exactly(origin, mark, {"Authorization": basic})
    finally:
        assert deployment.stop() is None
        origin.close()


def test_a_secret_kept_in_the_secret_service_is_set_used_and_removed(tmp_path):
    """`token_store = secret-service`: `proxyctl secret set` puts the value in the Secret Service (no file), a serve
    reads it from there for the Cloudflare recipe, `proxyctl secret rm` removes it, and a serve started afterwards
    answers naming `proxyctl secret set` instead of sending anything."""
    service = HeadlessSecretService(tmp_path / "secret-service").start()
    bus = {"DBUS_SESSION_BUS_ADDRESS": service.address}
    shape = {"CF-Access-Client-Id": CF_ID, "CF-Access-Client-Secret": CF_SECRET}
    state: dict = {}

    def prepare(ws, files):
        private_file(files / "cf-client-id", CF_ID)
        stored = secret_set(ws, "cf-secret", CF_SECRET, **bus)
        assert stored.returncode == 0, stored.stderr
        assert_no_secret(stored.stdout + stored.stderr, "secret set's output")
        state["ws"] = ws

    try:
        deployment, origin, url = run_recipe(tmp_path, "A Cloudflare Access service token", "internal.example.com",
                                             shape, prepare, proxy_keys={"token_store": "secret-service"},
                                             env=bus)
    except BaseException:
        service.stop()
        raise
    ws = state["ws"]
    attributes = ("application", "proxyctl", "state_dir", str(ws.state), "provider", "cf-secret",
                  "kind", "static_secret")
    try:
        assert service.lookup(*attributes) == CF_SECRET
        assert not (ws.state / "secrets" / "cf-secret").exists(), "the secret was written to a file too"
        assert deployment.stop() is None
        home = ws.root / "cli-home"
        removed = subprocess.run([proxyctl_bin(), "secret", "rm", "cf-secret", "--config", str(ws.config_path)],
                                 capture_output=True, text=True, timeout=60, env=clean_env(HOME=str(home), **bus),
                                 stdin=subprocess.DEVNULL)
        assert removed.returncode == 0, removed.stderr
        assert service.lookup(*attributes) is None
        # A serve started now finds no secret: it says how to store one and sends the origin nothing.
        proxy = ws.start_proxy("after-rm", **bus)
        again = Deployment(ws, proxy)
        try:
            mark = origin.mark()
            answer = again.curl(f"{url}/after-rm")
            assert answer.status >= 400 and answer.status != 401, (answer.status, answer.body)
            assert "proxyctl secret set cf-secret" in answer.body.decode() + (answer.header("proxy-status") or ""), \
                (answer.body, answer.header("proxy-status"))
            assert origin.since(mark) == []
        finally:
            assert again.stop() is None
    finally:
        origin.close()
        service.stop()
