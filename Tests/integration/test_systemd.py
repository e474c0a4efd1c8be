"""proxyctl as a systemd user service (packaging/systemd, docs/packaging.md): socket activation through Debian's
systemd-socket-activate, which listens and passes the socket as systemd does (LISTEN_FDS, LISTEN_PID), and a
notify socket of the test's own standing in for the service manager ($NOTIFY_SOCKET: READY=1, RELOADING=1,
STOPPING=1); `proxyctl env` naming the socket's address; the units as systemd-analyze reads them."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from fixtures.http import free_port
from fixtures.proxy import clean_env, poll, proxyctl_bin

REPOSITORY = Path(__file__).resolve().parents[2]
UNITS = REPOSITORY / "packaging" / "systemd"

pytestmark = pytest.mark.skipif(shutil.which("systemd-socket-activate") is None,
                                reason="systemd-socket-activate (Debian package systemd) is not installed")


class NotifySocket:
    """A datagram socket that takes sd_notify(3) messages, as the service manager would."""

    def __init__(self, path: Path):
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(str(path))
        self.messages: list[str] = []

    def wait_for(self, state: str, timeout: float = 10) -> list[str]:
        """Every message until one has the line `state`, which is the last."""
        self.socket.settimeout(timeout)
        taken = []
        while True:
            message = self.socket.recv(4096).decode()
            self.messages.append(message)
            taken.append(message)
            if state in message.split("\n"):
                return taken

    def close(self) -> None:
        self.socket.close()


class Activated:
    """`systemd-socket-activate -l ADDRESS proxyctl serve ...`: the socket listens before proxyctl exists, which
    starts (as the same process) at the first connection."""

    def __init__(self, tmp_path: Path, address: str, *serve_args: str, notify: NotifySocket | None = None):
        self.home = tmp_path / "home"
        self.home.mkdir(exist_ok=True)
        self.log_path = tmp_path / "activated.log"
        variables = {"HOME": str(self.home), "XDG_CONFIG_HOME": str(self.home / "xdg"),
                     "XDG_STATE_HOME": str(self.home / "state"), "PATH": os.environ["PATH"]}
        if notify is not None:
            variables["NOTIFY_SOCKET"] = str(notify.path)
        command = ["systemd-socket-activate", "--listen", address]
        for name, value in variables.items():
            command += ["--setenv", f"{name}={value}"]
        command += [proxyctl_bin(), "serve", *serve_args]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        poll(lambda: "Listening on" in self.log(), 10, message="systemd-socket-activate to listen")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)


def through(port: int, url: str) -> str:
    """The status curl gets for `url` through the proxy on `port`."""
    done = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--proxy", f"http://127.0.0.1:{port}",
                           url], capture_output=True, text=True, timeout=30, env=clean_env())
    return done.stdout + done.stderr


def write_config(path: Path, listen: str) -> Path:
    path.write_text(f"[proxy]\nlisten = {listen}\n")
    return path


def env_lines(home: Path, *args: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"), XDG_STATE_HOME=str(home / "state"))
    env.pop("PROXYCTL_CONFIG", None)
    env.update(extra or {})
    done = subprocess.run([proxyctl_bin(), "env", *args], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return dict(re.findall(r"export ([A-Z_]+)='?([^';]*)'?;", done.stdout))


def test_serve_takes_the_socket_reports_readiness_reloads_and_stops(tmp_path, http_origin):
    notify = NotifySocket(tmp_path / "notify.sock")
    port = free_port()
    # listen in the file says another address: the socket from the service manager wins.
    config = write_config(tmp_path / "proxy.conf", f"127.0.0.1:{free_port()}")
    activated = Activated(tmp_path, f"127.0.0.1:{port}", "--config", str(config), notify=notify)
    try:
        # The first connection starts proxyctl, and is served.
        answer = through(port, http_origin.url("/hello"))
        assert answer == "200", (answer, activated.log())
        ready = notify.wait_for("READY=1")
        assert f"STATUS=listening on http://127.0.0.1:{port}" in ready[-1], notify.messages
        assert f"listening on http://127.0.0.1:{port} (the socket from the service manager)" in activated.log()
        assert through(port, http_origin.url("/again")) == "200"

        # proxyctl env names the socket's address (the running serve's record), not listen in the file.
        variables = env_lines(activated.home, "--config", str(config))
        assert variables["HTTPS_PROXY"] == f"http://127.0.0.1:{port}", variables

        # systemctl --user reload = SIGHUP: RELOADING=1, then READY=1 once the file is read again.
        activated.process.send_signal(signal.SIGHUP)
        reloading = notify.wait_for("READY=1")
        assert "RELOADING=1" in reloading[0].split("\n"), notify.messages
        poll(lambda: "SIGHUP: configuration reloaded" in activated.log(), 10, message="the reload")
        # A new listen in the file cannot move systemd's socket: the reload says where to change it.
        write_config(config, f"127.0.0.1:{free_port()}")
        activated.process.send_signal(signal.SIGHUP)
        notify.wait_for("READY=1")
        poll(lambda: "change ListenStream= of proxyctl.socket" in activated.log(), 10, message="the listen warning")
        assert through(port, http_origin.url("/after")) == "200"

        assert activated.stop() == 0, activated.log()
        assert "STOPPING=1" in notify.wait_for("STOPPING=1")[-1].split("\n")
    finally:
        activated.stop()
        notify.close()


def test_a_socket_other_machines_can_reach_needs_proxy_authentication(tmp_path):
    port = free_port("0.0.0.0")
    activated = Activated(tmp_path, f"0.0.0.0:{port}")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        assert activated.process.wait(timeout=30) == 1
        assert f"the socket from the service manager, 0.0.0.0:{port}, is reachable from other machines" in \
            activated.log(), activated.log()
    finally:
        activated.stop()


def test_sockets_meant_for_another_process_are_left_alone(tmp_path):
    # LISTEN_PID names another process (sd_listen_fds(3)): descriptor 3 is not for proxyctl, which binds listen.
    home = tmp_path / "home"
    port = free_port()
    env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"), LISTEN_PID="1", LISTEN_FDS="1")
    with open(tmp_path / "serve.log", "wb") as log:
        process = subprocess.Popen([proxyctl_bin(), "serve", "--listen", f"127.0.0.1:{port}"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        poll(lambda: f"listening on http://127.0.0.1:{port}\n" in (tmp_path / "serve.log").read_text(), 10,
             message="serve to listen")
        assert "the socket from the service manager" not in (tmp_path / "serve.log").read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_env_names_the_address_of_an_active_proxyctl_socket(tmp_path):
    """Before the first connection no serve runs: `proxyctl env` asks systemd where proxyctl.socket listens (a
    systemctl of the test's own answers as `systemctl --user show` does)."""
    home = tmp_path / "home"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    answer = tmp_path / "answer"
    systemctl = bin_dir / "systemctl"
    systemctl.write_text(f"#!/bin/sh\necho \"$*\" >>{tmp_path / 'asked'}\ncat {answer}\n")
    systemctl.chmod(0o755)
    extra = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "XDG_RUNTIME_DIR": str(tmp_path)}
    answer.write_text("ActiveState=active\nListen=127.0.0.1:18081 (Stream)\n")
    assert env_lines(home, extra=extra)["HTTPS_PROXY"] == "http://127.0.0.1:18081"
    assert (tmp_path / "asked").read_text().startswith("--user show proxyctl.socket")
    answer.write_text("ActiveState=inactive\nListen=127.0.0.1:18081 (Stream)\n")
    assert env_lines(home, extra=extra)["HTTPS_PROXY"] == "http://127.0.0.1:8080"  # the default listen
    # A configuration of its own (--config) is not the one proxyctl.service serves.
    answer.write_text("ActiveState=active\nListen=127.0.0.1:18081 (Stream)\n")
    config = write_config(tmp_path / "other.conf", "127.0.0.1:18099")
    assert env_lines(home, "--config", str(config), extra=extra)["HTTPS_PROXY"] == "http://127.0.0.1:18099"


def test_the_units_pass_systemd_analyze(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    for name in ("proxyctl.service", "proxyctl.socket"):
        text = (UNITS / name).read_text().replace("/usr/bin/proxyctl", proxyctl_bin())
        (tmp_path / name).write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "proxyctl.socket"),
                           str(tmp_path / "proxyctl.service")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stdout + done.stderr
    service = (UNITS / "proxyctl.service").read_text()
    assert "Type=notify" in service and "ExecReload=/bin/kill -HUP $MAINPID" in service
    assert "ListenStream=127.0.0.1:8080" in (UNITS / "proxyctl.socket").read_text()
