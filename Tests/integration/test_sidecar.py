"""The sidecar, outside a container: configuration from the environment only ($PROXYCTL_CONFIG_TEXT and the
single-key variables, with the precedence docs/sidecar.md states), JSON log lines, the start script
(container/entrypoint.sh) making the CA on the state volume and exporting the bundle for the app container,
and a device-flow login whose code goes to standard output and to notify_command.

No container runtime runs on this machine (no Docker engine), so the image itself is not built here.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from fixtures import config
from fixtures.http import Reader, connect, free_port
from fixtures.origins import Origin
from fixtures.proxy import REPO, clean_env, poll, proxyctl_bin
from idp_fake import FakeIdP

ENTRYPOINT = REPO / "container" / "entrypoint.sh"


def sidecar_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"), PROXYCTL_BIN=proxyctl_bin())
    env.pop("PROXYCTL_CONFIG", None)
    env.update(variables)
    return env


class Started:
    """A process whose standard error is read into a file; `line(pattern)` waits for a line."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path):
        self.log = log
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=log.open("wb"))

    def text(self) -> str:
        """The whole lines written so far (all of it once the process exited): a line still being written can
        be read in part, and a JSON line in part is no JSON."""
        exited = self.process.poll() is not None  # before the read: then the file is final
        data = self.log.read_bytes()
        return (data if exited else data[:data.rfind(b"\n") + 1]).decode(errors="replace")

    def line(self, pattern: str, timeout: float = 15) -> re.Match:
        def found():
            if self.process.poll() is not None:
                raise AssertionError(f"exited {self.process.returncode}:\n{self.text()}")
            return re.search(pattern, self.text())
        return poll(found, timeout, message=pattern)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(20)


def ask(port: int, url: str, credential: str | None = None) -> int:
    sock = connect(port)
    header = f"Proxy-Authorization: Basic {credential}\r\n" if credential else ""
    sock.sendall(f"GET {url} HTTP/1.1\r\nHost: x\r\n{header}Connection: close\r\n\r\n".encode())
    status = Reader(sock).read_response().status
    sock.close()
    return status


def test_environment_only_configuration_with_precedence_and_json_logs(tmp_path):
    users = tmp_path / "users"
    users.write_text("app:s3cret\n")
    users.chmod(0o600)
    port = free_port()
    env = sidecar_env(
        tmp_path,
        # The whole file in one variable; its listen is overridden by PROXYCTL_LISTEN.
        PROXYCTL_CONFIG_TEXT=config.proxy(listen="127.0.0.1:1", log_level="info", state_dir=tmp_path / "state"),
        PROXYCTL_LISTEN=f"0.0.0.0:{port}", PROXYCTL_PROXY_AUTH_FILE=str(users), PROXYCTL_LOG_FORMAT="json",
        PROXYCTL_ADMIN_LISTEN="127.0.0.1:0")
    serve = Started([proxyctl_bin(), "serve"], env, tmp_path / "serve.log")
    origin = Origin()
    try:
        serve.line(rf"listening on http://0\.0\.0\.0:{port}")
        assert ask(port, origin.url("/x")) == 407, "beyond loopback, every client authenticates"
        assert ask(port, origin.url("/x"), base64.b64encode(b"app:s3cret").decode()) == 200
        serve.line(r'"msg":"GET http://127\.0\.0\.1:\d+/x status=200')
        lines = [json.loads(line) for line in serve.text().splitlines() if line.strip()]
        assert all({"time", "level", "msg"} <= line.keys() for line in lines), lines
        access = [line for line in lines if "status=200" in line["msg"]]
        assert access and access[0]["conn"] >= 1 and access[0]["client"].startswith("127.0.0.1:"), access
        assert "s3cret" not in serve.text()
    finally:
        origin.close()
        assert serve.stop() == 0

    # --listen beats PROXYCTL_LISTEN, which beats the text; errors name the variable.
    check = subprocess.run([proxyctl_bin(), "serve", "--check"], env={**env, "PROXYCTL_LISTEN": "everywhere"},
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 1 and "$PROXYCTL_LISTEN: [proxy] listen: expected HOST:PORT" in check.stderr, check
    bad_text = subprocess.run([proxyctl_bin(), "serve", "--check"],
                              env={**env, "PROXYCTL_CONFIG_TEXT": "[proxy]\nlisten = 127.0.0.1:80\nbogus = 1\n"},
                              capture_output=True, text=True, timeout=30)
    assert bad_text.returncode == 1 and "$PROXYCTL_CONFIG_TEXT:3: [proxy] bogus: unknown key" in bad_text.stderr
    both = subprocess.run([proxyctl_bin(), "serve", "--check"], env={**env, "PROXYCTL_CONFIG": str(users)},
                          capture_output=True, text=True, timeout=30)
    assert both.returncode == 1 and "both PROXYCTL_CONFIG" in both.stderr, both
    flag_port = free_port()
    flagged = Started([proxyctl_bin(), "serve", "--listen", f"127.0.0.1:{flag_port}"], env, tmp_path / "flag.log")
    try:
        flagged.line(rf"listening on http://127\.0\.0\.1:{flag_port}")
    finally:
        assert flagged.stop() == 0


def test_start_script_makes_the_ca_exports_the_bundle_and_serves(tmp_path):
    port = free_port()
    export = tmp_path / "shared" / "proxyctl-ca.pem"
    export.parent.mkdir()
    text = (config.proxy(listen=f"127.0.0.1:{port}", state_dir=tmp_path / "volume")
            + config.provider("corp", "https://login.example.test")
            + config.origin("https://api.example.test", "corp"))
    env = sidecar_env(tmp_path, PROXYCTL_CONFIG_TEXT=text, PROXYCTL_CA_EXPORT=str(export))
    started = Started(["sh", str(ENTRYPOINT)], env, tmp_path / "sidecar.log")
    try:
        started.line(rf"listening on http://127\.0\.0\.1:{port}")
        assert (tmp_path / "volume" / "ca" / "ca.pem").exists()
        exported = export.read_text()
        assert exported.rstrip().endswith((tmp_path / "volume" / "ca" / "ca.pem").read_text().strip())
        # Written after the listening line (a write of its own): waited for, not looked for.
        started.line(r"protected origin https://api\.example\.test: not signed in to corp")
    finally:
        assert started.stop() == 0
    # A second start keeps the CA (the app containers trust it already).
    before = (tmp_path / "volume" / "ca" / "ca.pem").read_bytes()
    again = Started(["sh", str(ENTRYPOINT)], env, tmp_path / "again.log")
    try:
        again.line(rf"listening on http://127\.0\.0\.1:{port}")
        assert (tmp_path / "volume" / "ca" / "ca.pem").read_bytes() == before
    finally:
        assert again.stop() == 0
    # With arguments the script is proxyctl itself; a broken configuration stops it with the error named.
    status = subprocess.run(["sh", str(ENTRYPOINT), "status"], env=env, capture_output=True, text=True, timeout=30)
    assert "corp: not signed in" in status.stdout, status
    broken = subprocess.run(["sh", str(ENTRYPOINT)], env={**env, "PROXYCTL_CONFIG_TEXT": "[proxy]\nlisten = x\n"},
                            capture_output=True, text=True, timeout=30)
    assert broken.returncode == 1 and "$PROXYCTL_CONFIG_TEXT:2: [proxy] listen" in broken.stderr, broken


def test_device_login_puts_the_code_on_stdout_and_to_the_hook(tmp_path):
    hook_out = tmp_path / "hook.json"
    hook = tmp_path / "hook.py"
    # Written whole and closed, then renamed: the test reads the file as soon as it exists. (The file is closed
    # by `with`, not by whenever the interpreter collects it, which CPython does at once and others need not.)
    hook.write_text("import json, os, sys\n"
                    f"with open({str(hook_out) + '.part'!r}, 'w') as part:\n"
                    f"    json.dump({{k: v for k, v in os.environ.items() if k.startswith('PROXYCTL_')}} | "
                    f"{{'argv': sys.argv[1:]}}, part)\n"
                    f"os.replace({str(hook_out) + '.part'!r}, {str(hook_out)!r})\n")
    with FakeIdP(access_token_format="jwt", expires_in=3600) as fake:
        text = (config.proxy(state_dir=tmp_path / "volume", notify_command=f"{sys.executable} {hook}")
                + config.provider("fake", fake.issuer))
        env = sidecar_env(tmp_path, PROXYCTL_CONFIG_TEXT=text)
        login = subprocess.Popen([proxyctl_bin(), "login", "--device"], env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            poll(hook_out.exists, 15, message="notify_command to run")
            details = json.loads(hook_out.read_text())
            assert details["PROXYCTL_EVENT"] == "device_code" and details["PROXYCTL_PROVIDER"] == "fake"
            code = details["PROXYCTL_USER_CODE"]
            assert details["PROXYCTL_VERIFICATION_URI"].startswith(fake.issuer)
            assert code in details["argv"][-1]
            fake.approve_device(code)
            stdout, stderr = login.communicate(timeout=30)
        finally:
            if login.poll() is None:
                login.kill()
        assert login.returncode == 0, stderr
        assert re.search(rf"enter the code\s+{re.escape(code)}", stdout), stdout
        assert "Signed in to fake" in stderr
        assert (tmp_path / "volume" / "tokens" / "fake.json").exists()
