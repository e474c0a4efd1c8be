"""`proxyctl exec` as a new user meets it: with no `proxyctl serve` running it starts the proxy for the
command alone (a free loopback port, a credential made for the run), passes signals on, and exits with the
command's status; with a serve running it uses that. Also: several serves sharing a state_dir each keep
their own record, and `doctor` notices when HTTPS_PROXY points at a proxy that is gone.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse
from pathlib import Path

import pytest

from fixtures import config
from fixtures.http import Reader, connect
from fixtures.origins import Origin
from fixtures.proxy import Proxy, clean_env, poll, proxyctl_bin


def workspace(tmp_path: Path, **proxy_keys) -> tuple[Path, dict[str, str]]:
    conf = tmp_path / "proxy.conf"
    conf.write_text(config.proxy(state_dir=tmp_path / "state", **proxy_keys))
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"))
    env.pop("PROXYCTL_CONFIG", None)
    return conf, env


def run_exec(conf: Path, env: dict[str, str], *command: str, timeout: float = 60, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([proxyctl_bin(), "exec", "--config", str(conf), "--", *command], capture_output=True,
                          text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL, **popen)


@pytest.fixture
def origin():
    server = Origin()
    yield server
    server.close()


def test_exec_without_a_serve_starts_a_proxy_with_a_credential_for_the_run(tmp_path, origin):
    conf, env = workspace(tmp_path, listen="127.0.0.1:18799")
    script = textwrap.dedent("""\
        import base64, os, shutil, socket, subprocess, sys, urllib.parse, urllib.request
        proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
        print("PROXY", proxy.hostname, proxy.port, proxy.username, len(proxy.password or ""))
        print("BODY", urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
        probe = (
            "import socket, sys\\n"
            "def ask(header):\\n"
            "    sock = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\\n"
            "    sock.sendall(b'GET ' + sys.argv[2].encode() + b' HTTP/1.1\\\\r\\\\nHost: x\\\\r\\\\n' + header + b'Connection: close\\\\r\\\\n\\\\r\\\\n')\\n"
            "    return sock.recv(100).split(b' ')[1].decode()\\n"
            "print(ask(b''), ask(b'Proxy-Authorization: Basic ' + sys.argv[3].encode() + b'\\\\r\\\\n'))\\n")
        credential = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
        args = [str(proxy.port), sys.argv[1], credential]
        # This user's processes need no credential (Java cannot send one for HTTPS tunnels).
        print("OWNER", subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True).stdout.strip())
        # Another local user needs the run's credential.
        if os.geteuid() == 0 and shutil.which("setpriv"):
            other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                                    "-c", probe, *args], capture_output=True, text=True)
            print("OTHER", other.stdout.strip(), other.stderr.strip())
        """)
    done = run_exec(conf, env, sys.executable, "-c", script, origin.url("/hello"))
    assert done.returncode == 0, done.stderr
    found = re.search(r"PROXY 127\.0\.0\.1 (\d+) proxyctl (\d+)", done.stdout)
    assert found, done.stdout
    assert int(found.group(1)) != 18799, "a free port, not the configured one"
    assert int(found.group(2)) >= 32, "a long random password"
    assert "BODY " in done.stdout and "/hello" in done.stdout, done.stdout
    assert "OWNER 200 200" in done.stdout, done.stdout
    if os.geteuid() == 0:
        assert "OTHER 407 200" in done.stdout, done.stdout
    # The proxy is gone with the command, and it left no record for others to find.
    assert not list((tmp_path / "state" / "serve").glob("*.json")) if (tmp_path / "state" / "serve").exists() else True
    with pytest.raises(OSError):
        connect(int(found.group(1)), timeout=2).close()


def test_exit_status_is_the_commands_and_128_plus_the_signal(tmp_path):
    conf, env = workspace(tmp_path)
    assert run_exec(conf, env, "sh", "-c", "exit 7").returncode == 7
    assert run_exec(conf, env, "sh", "-c", "kill -TERM $$").returncode == 128 + signal.SIGTERM
    missing = run_exec(conf, env, "no-such-program-here")
    assert missing.returncode == 127 and "command not found" in missing.stderr


@pytest.mark.parametrize("portable", [False, True], ids=["linux", "portable"])
def test_signals_sent_to_proxyctl_reach_the_command(tmp_path, portable):
    """Each signal kill(2) sends to proxyctl reaches the command once: with sigwaitinfo(2), which names the
    sender, and with the portable fallback (PROXYCTL_PORTABLE=1, docs/porting.md), sigwait(3), which cannot."""
    conf, env = workspace(tmp_path)
    if portable:
        env["PROXYCTL_PORTABLE"] = "1"
    marker = tmp_path / "signals"
    script = textwrap.dedent(f"""\
        import signal, sys, time
        seen = []
        def note(number, frame):
            seen.append(number)
            open({str(marker)!r}, "a").write(f"{{number}}\\n")
            if number == signal.SIGTERM:
                sys.exit(3)
        for number in (signal.SIGHUP, signal.SIGWINCH, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(number, note)
        open({str(marker)!r}, "a").write("ready\\n")
        while True:
            time.sleep(0.05)
        """)
    process = subprocess.Popen([proxyctl_bin(), "exec", "--config", str(conf), "--", sys.executable, "-c", script],
                               env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        poll(lambda: marker.exists() and "ready" in marker.read_text(), 20, message="the command to start")
        for number in (signal.SIGHUP, signal.SIGWINCH, signal.SIGUSR1, signal.SIGINT):
            process.send_signal(number)
            poll(lambda: f"{int(number)}\n" in marker.read_text(), 10, message=f"signal {number} to arrive")
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 3
        # Each signal arrived once.
        lines = marker.read_text().split()
        assert sorted(lines[1:]) == sorted(str(int(n)) for n in (signal.SIGHUP, signal.SIGWINCH, signal.SIGUSR1,
                                                                  signal.SIGINT, signal.SIGTERM)), lines
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_exec_uses_a_running_serve_and_several_serves_keep_their_own_records(tmp_path):
    conf, env = workspace(tmp_path)
    first = Proxy(tmp_path / "first", None, listen="127.0.0.1:0", args=("--config", str(conf))).start()
    second = Proxy(tmp_path / "second", None, listen="127.0.0.1:0", args=("--config", str(conf))).start()
    try:
        records = tmp_path / "state" / "serve"
        poll(lambda: len(list(records.glob("*.json"))) == 2, 10, message="a record per serve")
        shown = run_exec(conf, env, "sh", "-c", 'echo "$HTTPS_PROXY"')
        assert shown.stdout.strip() in (first.url, second.url), shown
        # The serve that stops removes its own record only.
        assert second.stop() == 0
        assert [p.name for p in records.glob("*.json")] == [f"{first.pid}.json"]
        shown = run_exec(conf, env, "sh", "-c", 'echo "$HTTPS_PROXY"')
        assert shown.stdout.strip() == first.url, shown
        status = subprocess.run([proxyctl_bin(), "status", "--config", str(conf)], capture_output=True, text=True,
                                env=env, timeout=30)
        # doctor: HTTPS_PROXY at the serve that stopped is named, not "Everything looks right."
        doctor = subprocess.run([proxyctl_bin(), "doctor", "--config", str(conf)], capture_output=True, text=True,
                                env={**env, "HTTPS_PROXY": second.url}, timeout=30)
        assert doctor.returncode == 1, doctor.stdout
        assert f"proxyctl serve is running (pid {first.pid}" in doctor.stdout, doctor.stdout
        assert f"HTTPS_PROXY is {second.url}, and nothing listens there" in doctor.stdout, doctor.stdout
        assert "Everything looks right." not in doctor.stdout
        assert status.returncode in (0, 1)
    finally:
        first.stop()
        second.stop()


def test_doctor_for_someone_who_only_uses_exec(tmp_path):
    """Signed in, the CA made, no serve and nothing set in the shell: `exec` works, so doctor finds nothing to
    fix; it checks the runtimes with the variables exec gives its command and notes what only `eval "$(proxyctl
    env)"` needs. Once HTTPS_PROXY is set in the shell, the shell's own variables are checked again, and a wrong
    set-up is a problem."""
    from fixtures.deployment import Workspace
    from idp_fake import FakeIdP
    from resource_server import ResourceServer

    api = "api.test"
    rs = ResourceServer(tmp_path / "rs", [api])
    try:
        with FakeIdP(access_token_format="jwt", expires_in=3600) as fake:
            rs.trust(fake.issuer, fake.url("jwks"))
            ws = Workspace(tmp_path / "ws", config.provider("fake", fake.issuer, redirect_port=0)
                           + config.origin(f"https://{api}:{rs.port}", "fake", ca_file=rs.ca_pem), f"{api}=127.0.0.1")
            ws.ca_init()
            ws.login_fake("fake")
            home = tmp_path / "home"
            home.mkdir()
            used = run_exec(ws.config_path, clean_env(HOME=str(home)), "curl", "-sS", "-o", "/dev/null", "-w",
                            "%{http_code}", rs.url("/me", api))
            assert used.returncode == 0 and used.stdout == "200", used.stderr

            doctor = ws.cli("doctor")
            assert doctor.returncode == 0, doctor.stdout
            assert "FIX" not in doctor.stdout and doctor.stdout.endswith("\nEverything looks right.\n"), doctor.stdout
            assert ("  note  HTTPS_PROXY is not set here: proxyctl exec -- COMMAND sets it and each runtime's variables "
                    "for its command; only tools run directly in this shell need eval \"$(proxyctl env)\"\n"
                    "Runtimes on this machine, with the variables proxyctl exec sets for its command\n"
                    "  ok    curl: HTTPS_PROXY and CURL_CA_BUNDLE are set\n") in doctor.stdout, doctor.stdout

            # A shell pointed at a proxy that is not there, without the CA variables: real problems, named.
            shell = ws.cli("doctor", HTTPS_PROXY="http://127.0.0.1:9")
            assert shell.returncode == 1, shell.stdout
            assert ("  FIX   HTTPS_PROXY is http://127.0.0.1:9, and nothing listens there\n        -> start proxyctl "
                    "serve, then eval \"$(proxyctl env)\" again (or use proxyctl exec -- COMMAND)") in shell.stdout
            assert "  FIX   tools do not trust the local CA (SSL_CERT_FILE is " in shell.stdout, shell.stdout
            assert "  FIX   curl: does not trust the local CA (CURL_CA_BUNDLE is " in shell.stdout, shell.stdout
    finally:
        rs.close()
