"""The portable fallbacks (docs/porting.md), run on Linux with PROXYCTL_PORTABLE=1: what a macOS build does where
Linux has calls of its own. Each test asserts behaviour a user sees, with the fallback the only way it can pass:

- tunnels copy through user space instead of splice(2): every byte both ways through a CONNECT tunnel with curl
  (the origin's own certificate verifying), and a client that stops reading while the origin keeps sending (the
  pump keeps what the client does not take and stops reading the origin, then delivers the rest);
- the kernel is not asked whose a client's socket is (NETLINK_SOCK_DIAG): `proxyctl exec`'s own proxy wants its
  run's credential from every client, the user's own included, and hands it to the command, whose curl reaches a
  protected origin that sees the token; `serve` takes the owner credential (a 0600 file in the state directory)
  from `proxyctl env`'s HTTPS_PROXY, and refuses protected origins (407, the origin never asked) to a client
  without it, with a wrong one, and to another local user, while passthrough stays open;
- signals reach `exec`'s command once with sigwait(3), which cannot tell the terminal's from kill(2)'s
  (test_exec.py's signal test runs both ways).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fixtures import config
from fixtures.content import MiB, expected_sha256, write_generated
from fixtures.http import Reader
from fixtures.jose import unverified_claims
from fixtures.proxy import Proxy, clean_env, poll, proxyctl_bin
from idp_fake import FakeIdP
from resource_server import ResourceServer

PORTABLE = {"PROXYCTL_PORTABLE": "1"}
API = "api.test"
SIZE = 24 * MiB
PORTABLE_LINE = "PROXYCTL_PORTABLE: the portable fallbacks run instead of Linux's own calls"


def portable_proxy(workdir: Path, conf: str) -> Proxy:
    proxy = Proxy(workdir, conf)
    proxy.env.update(PORTABLE)
    return proxy.start()


@pytest.fixture
def passthrough(tmp_path):
    proxy = portable_proxy(tmp_path / "proxy", config.proxy(log_level="info", connect_timeout="5s",
                                                            shutdown_grace="3s"))
    yield proxy
    assert proxy.stop() == 0, proxy.log()[-3000:]


def curl_sha256(*args: str) -> tuple[str, int]:
    """curl's body, hashed as it streams: (sha256, size)."""
    process = subprocess.Popen(["curl", "-sS", "--fail", *args, "-o", "-"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=clean_env())
    digest, size = hashlib.sha256(), 0
    while block := process.stdout.read(MiB):
        digest.update(block)
        size += len(block)
    stderr = process.stderr.read()
    assert process.wait(120) == 0, stderr
    return digest.hexdigest(), size


def test_a_tunnel_copies_every_byte_both_ways(passthrough, https_origin, cert, tmp_path):
    """curl through a CONNECT tunnel to an HTTPS origin, 24 MiB down and 24 MiB up: the origin's own certificate
    verifies (no byte changed), the SHA-256 of each direction is the sender's, the log line counts them."""
    assert PORTABLE_LINE in passthrough.log()
    mark = passthrough.mark()
    digest, size = curl_sha256("-x", passthrough.url, "--cacert", str(cert.ca_pem),
                               https_origin.url(f"/gen/{SIZE}", host="localhost"))
    assert (size, digest) == (SIZE, expected_sha256(SIZE))
    line = passthrough.wait_log(rf"CONNECT localhost:{https_origin.port} status=200 up=(\d+) down=(\d+)",
                                since=mark)[0]
    assert int(line.group(2)) > SIZE  # the body in TLS records
    upload = write_generated(tmp_path / "upload.bin", SIZE)
    sent = subprocess.run(["curl", "-sS", "--fail", "-x", passthrough.url, "--cacert", str(cert.ca_pem), "-T",
                           str(upload), https_origin.url("/upload", host="localhost")],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert sent.returncode == 0, sent.stderr
    assert f'"size": {SIZE}, "sha256": "{expected_sha256(SIZE)}"' in sent.stdout, sent.stdout


def test_a_client_that_stops_reading_gets_every_byte_when_it_reads_again(passthrough, http_origin):
    """The pump's backpressure: the client reads nothing for a while as the origin sends 16 MiB, so the proxy's
    writes to it come back short; what it did not take is kept and the origin is not read meanwhile; then the
    client reads everything, in order."""
    size = 16 * MiB
    # A small receive buffer, set before the connection is made (the window is agreed then).
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
    sock.settimeout(20)
    sock.connect(("127.0.0.1", passthrough.port))
    sock.sendall(f"CONNECT {http_origin.authority} HTTP/1.1\r\nHost: {http_origin.authority}\r\n\r\n".encode())
    reader = Reader(sock)
    assert reader.read_head().status == 200
    sock.sendall(f"GET /gen/{size} HTTP/1.1\r\nHost: {http_origin.authority}\r\nConnection: close\r\n\r\n".encode())
    time.sleep(1.5)
    response = reader.read_head()
    assert response.status == 200 and response.header("Content-Length") == str(size)
    digest = hashlib.sha256(reader.read_exact(size)).hexdigest()
    assert digest == expected_sha256(size)
    sock.close()


# MARK: - A protected origin without the kernel naming the client's user

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A provider that grants client credentials (no person needed) and a protected API that checks its tokens."""
    workdir = tmp_path_factory.mktemp("portable-site")
    secret = "portable-" + os.urandom(8).hex()
    provider = FakeIdP(access_token_format="jwt", client_secret=secret).start()
    api = ResourceServer(workdir / "api", [API])
    api.trust(provider.issuer, provider.url("jwks"))
    secret_file = workdir / "client.secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    yield provider, api, secret_file
    api.close()
    provider.stop()


def workspace(tmp_path: Path, site) -> tuple[Path, dict[str, str]]:
    """proxy.conf for the API (its own state directory, the local CA made) and the environment to run in."""
    provider, api, secret_file = site
    conf = tmp_path / "proxy.conf"
    conf.write_text(config.proxy(state_dir=tmp_path / "state", resolve=f"{API}=127.0.0.1", log_level="info",
                                 shutdown_grace="3s")
                    + config.provider("ci", provider.issuer, grant="client_credentials",
                                      token_endpoint_auth_method="client_secret_basic",
                                      client_secret_file=secret_file, scopes="api")
                    + config.origin(f"https://{API}:{api.port}", "ci", ca_file=api.ca_pem))
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"), **PORTABLE)
    env.pop("PROXYCTL_CONFIG", None)
    made = subprocess.run([proxyctl_bin(), "ca", "init", "--config", str(conf)], capture_output=True, text=True,
                          timeout=30, env=env, stdin=subprocess.DEVNULL)
    assert made.returncode == 0, made.stderr
    return conf, env


PROBE = textwrap.dedent("""\
    import base64, os, socket, sys, urllib.parse
    # CONNECT to the protected API without a credential, then with the one in HTTPS_PROXY: the status of each.
    proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
    def ask(header):
        sock = socket.create_connection((proxy.hostname, proxy.port))
        sock.sendall(b"CONNECT " + sys.argv[1].encode() + b" HTTP/1.1\\r\\nHost: " + sys.argv[1].encode()
                     + b"\\r\\n" + header + b"\\r\\n")
        return sock.recv(200).split(b" ")[1].decode()
    credential = base64.b64encode(f"{proxy.username}:{proxy.password}".encode())
    print("PROBE", ask(b""), ask(b"Proxy-Authorization: Basic " + credential + b"\\r\\n"))
    """)


def test_exec_gives_its_run_credential_to_the_command_and_wants_it_from_everyone(tmp_path, site):
    """`proxyctl exec` without a serve: its proxy cannot learn that the command is the user's own, so the run's
    credential is the only way in, for the user's processes too (with the kernel's answer they need none,
    test_exec.py); the command has it in HTTPS_PROXY, and its curl gets the API's 200 with a token the API
    checked."""
    provider, api, _ = site
    conf, env = workspace(tmp_path, site)
    mark = api.mark()
    script = f'{sys.executable} -c "$1" {API}:{api.port} && curl -sS -w "\\nSTATUS %{{http_code}}" "$2"'
    done = subprocess.run([proxyctl_bin(), "exec", "--config", str(conf), "--", "sh", "-c", script, "sh", PROBE,
                           api.url("/me")], capture_output=True, text=True, timeout=90, env=env,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PROBE 407 200" in done.stdout, done.stdout
    assert done.stdout.rstrip().endswith("STATUS 200"), done.stdout
    [seen] = api.since(mark)
    assert seen.error is None and seen.token, seen
    assert unverified_claims(seen.token)["iss"] == provider.issuer


def env_lines(conf: Path, env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run([proxyctl_bin(), "env", "--config", str(conf)], capture_output=True, text=True,
                          timeout=30, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return dict(re.findall(r"^export (\w+)='([^']*)';$", done.stdout, re.M))


OTHER_USER = "nobody"


def test_serve_takes_the_owner_credential_from_proxyctl_env_and_refuses_protected_origins_without_it(
        tmp_path, site, http_origin):
    """The same-user check without the kernel: `proxyctl env` (before serve runs, as a shell's rc file would)
    makes the owner credential and puts it in HTTPS_PROXY; serve takes the same one. curl with env's variables
    gets the API's 200 (the API sees the token); a client without the credential, one with another password and
    another local user get 407 naming how to get it, and the API sees none of them; passthrough stays open to
    all (passthrough_users = any)."""
    provider, api, _ = site
    conf, env = workspace(tmp_path, site)
    credential_file = tmp_path / "state" / "proxy-credential"
    early = env_lines(conf, env)
    assert credential_file.exists() and stat.S_IMODE(credential_file.stat().st_mode) == 0o600
    secret = credential_file.read_text().strip()
    assert len(secret) >= 32 and early["HTTPS_PROXY"] == f"http://proxyctl:{secret}@127.0.0.1:8080", early

    proxy = Proxy(tmp_path / "serve", None, args=("--config", str(conf)))
    proxy.env = env
    proxy.start()
    try:
        assert PORTABLE_LINE in proxy.log()
        assert f"protected origins need the credential in {credential_file}" in proxy.log()
        variables = env_lines(conf, env)
        assert variables["HTTPS_PROXY"] == f"http://proxyctl:{secret}@127.0.0.1:{proxy.port}", variables
        mark = api.mark()
        shell = subprocess.run(["sh", "-c", 'eval "$(proxyctl env --config "$1")" && curl -sS -w "\\nSTATUS '
                                '%{http_code}" "$2"', "sh", str(conf), api.url("/me")],
                               capture_output=True, text=True, timeout=60,
                               env={**env, "PATH": f"{Path(proxyctl_bin()).parent}:{os.environ['PATH']}"})
        assert shell.stdout.rstrip().endswith("STATUS 200"), shell.stdout + shell.stderr
        [seen] = api.since(mark)
        assert seen.token and unverified_claims(seen.token)["iss"] == provider.issuer

        bundle = variables["CURL_CA_BUNDLE"]
        refusals = {
            "none": ["-x", f"http://127.0.0.1:{proxy.port}"],
            "wrong": ["-x", f"http://proxyctl:{'x' * len(secret)}@127.0.0.1:{proxy.port}"],
        }
        answers = {}
        for name, proxy_args in refusals.items():
            answers[name] = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-D", "-", "--cacert", bundle,
                                            *proxy_args, api.url("/me")], capture_output=True, text=True,
                                           timeout=60, env=clean_env())
        if os.geteuid() == 0 and shutil.which("runuser"):
            # Another user who could read neither the file nor the user's environment.
            answers["other user"] = subprocess.run(
                ["runuser", "-u", OTHER_USER, "--", "curl", "-sS", "-o", "/dev/null", "-D", "-", "-x",
                 f"http://127.0.0.1:{proxy.port}", "--insecure", api.url("/me")],
                capture_output=True, text=True, timeout=60, env=clean_env())
        for name, answer in answers.items():
            assert answer.stdout.startswith("HTTP/1.1 407 "), (name, answer.stdout, answer.stderr)
            assert 'Proxy-Authenticate: Basic realm="proxyctl"' in answer.stdout, (name, answer.stdout)
            assert "protected_users" in answer.stdout, (name, answer.stdout)
        assert not api.since(mark)[1:], "a request without the owner credential reached the API"
        proxy.wait_log(r"CONNECT api\.test:\d+ status=407 answered-by=proxyctl reason=\"protected origins \(and the "
                       r"tokens for them\) serve only the user running proxyctl \(protected_users\)")
        # Passthrough: no credential needed, for anyone.
        open_ = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-x",
                                f"http://127.0.0.1:{proxy.port}", http_origin.url("/open")],
                               capture_output=True, text=True, timeout=60, env=clean_env())
        assert open_.stdout == "200", open_.stderr
    finally:
        assert proxy.stop() == 0, proxy.log()[-3000:]
