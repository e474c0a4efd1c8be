"""Credentials for any API (issue 31), end to end with the real binary and curl: static secrets in other header
shapes, placeholders, secret_command run again on a 401, and the audit log.

The origins (`key_origin.KeyOrigin`) each accept exactly one key in one header: `keys.test` wants `X-API-Key: K1`
from a 0600 secret_file and exports a placeholder; `vault.test` wants `Authorization: Bearer K2` from a
secret_command (a script that counts its runs) whose key rotates; `plain.test` is not protected at all and must
never see a key. Every output (curl's, the proxy's log and stdout, /metrics, the audit log and `proxyctl audit`) is
searched for the secrets by value.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import config
from fixtures.deployment import Deployment, Workspace
from fixtures.http import free_port, run_curl
from fixtures.proxy import clean_env, poll, proxyctl_bin
from key_origin import KeyOrigin

KEYS, VAULT, PLAIN = "keys.test", "vault.test", "plain.test"
RESOLVE = ", ".join(f"{h}=127.0.0.1" for h in (KEYS, VAULT, PLAIN))
K1 = "k1-" + "a1b2c3d4e5f6" * 3
K2_OLD = "k2-old-" + "0f1e2d3c4b5a" * 3
K2_NEW = "k2-new-" + "9a8b7c6d5e4f" * 3
SECRETS = (K1, K2_OLD, K2_NEW)


def vault_script(directory: Path) -> Path:
    """A `secret_command`: prints the key in key.txt and counts its runs in runs.txt."""
    script = directory / "vault-key"
    script.write_text("#!/bin/sh\n"
                      f"echo run >> {directory / 'runs.txt'}\n"
                      f"cat {directory / 'key.txt'}\n")
    script.chmod(0o755)
    (directory / "key.txt").write_text(K2_OLD + "\n")
    return script


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("static-secrets")
    keys = KeyOrigin(root / "keys-pki", [KEYS], header="X-API-Key", key=K1)
    vault = KeyOrigin(root / "vault-pki", [VAULT], header="Authorization", key=f"Bearer {K2_OLD}")
    plain = KeyOrigin(root / "plain-pki", [PLAIN], header="X-API-Key", key=K1)
    secret_file = root / "keys.secret"
    secret_file.write_text(K1 + "\n")
    secret_file.chmod(0o600)
    vault_dir = root / "vault"
    vault_dir.mkdir()
    script = vault_script(vault_dir)
    sections = (
        config.section(f"origin https://{KEYS}:{keys.port}", secret_file=secret_file, ca_file=keys.ca_pem,
                       header="X-API-Key: {secret}", placeholder_env="KEYS_API_KEY")
        + config.section(f"origin https://{VAULT}:{vault.port}", secret_command=script, secret_ttl="1h",
                         ca_file=vault.ca_pem, placeholder_env="VAULT_TOKEN")
    )
    admin_port = free_port()
    ws = Workspace(root / "ws", sections, RESOLVE, admin_listen=f"127.0.0.1:{admin_port}")
    ws.ca_init()
    proxy = ws.start_proxy()
    deployment = Deployment(ws, proxy)
    yield {"ws": ws, "d": deployment, "keys": keys, "vault": vault, "plain": plain, "vault_dir": vault_dir,
           "admin": f"http://127.0.0.1:{admin_port}", "root": root}
    deployment.stop()
    for origin in (keys, vault, plain):
        origin.close()


def url(origin: KeyOrigin, host: str, path: str = "/anything") -> str:
    return f"https://{host}:{origin.port}{path}"


CURL = os.path.realpath(shutil.which("curl") or "curl")


def audit_entry(ws: Workspace, path: str) -> dict:
    """The audit line of the request to `path` (waiting for it: a line is written as its exchange ends), read
    with jq from `proxyctl audit --json`."""
    jq = shutil.which("jq")
    assert jq, "jq is needed (scripts/bootstrap test)"

    def found():
        done = ws.cli("audit", "--json")
        assert done.returncode == 0, done.stderr
        read = subprocess.run([jq, "-c", f"select(.path == {json.dumps(path)})"], input=done.stdout,
                              capture_output=True, text=True, check=True)
        return [json.loads(line) for line in read.stdout.splitlines()]
    entries = poll(found, message=f"the audit line of {path}")
    assert len(entries) == 1, entries
    return entries[0]


def assert_no_secret(text: str | bytes, where: str) -> None:
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    for secret in SECRETS:
        assert secret not in text, f"a secret in {where}"


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
def test_the_key_is_attached_in_its_header_with_no_client_help(setup, http):
    d, keys = setup["d"], setup["keys"]
    mark = keys.mark()
    answer = d.curl(url(keys, KEYS, f"/attach{http}"), http)
    assert answer.status == 200, answer.body
    assert json.loads(answer.body)["authorized"] is True
    seen = keys.since(mark)
    assert len(seen) == 1 and seen[0].values("X-API-Key") == [K1]
    assert seen[0].values("Authorization") == []
    assert_no_secret(answer.body, "curl's output")


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
def test_the_clients_own_key_field_is_replaced_never_doubled(setup, http):
    d, keys = setup["d"], setup["keys"]
    mark, log_mark = keys.mark(), d.proxy.mark()
    answer = d.curl(url(keys, KEYS, f"/replace{http}"), http, "-H", "X-API-Key: the-tools-own-key",
                    "-H", "x-api-key: another")
    assert answer.status == 200, answer.body
    assert keys.since(mark)[0].values("X-API-Key") == [K1]
    line = d.lines(log_mark, target=f"GET https://{KEYS}:{keys.port}/replace{http}", at_least=1)[0]
    assert "client_credential=replaced" in line


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
def test_the_placeholder_is_replaced_for_its_origin(setup, http):
    d, keys = setup["d"], setup["keys"]
    placeholder = d.exports["KEYS_API_KEY"]
    assert placeholder.startswith("proxyctl-placeholder-") and placeholder not in SECRETS
    mark, log_mark = keys.mark(), d.proxy.mark()
    answer = d.curl(url(keys, KEYS, f"/placeholder{http}"), http, "-H", f"X-API-Key: {placeholder}")
    assert answer.status == 200, answer.body
    assert keys.since(mark)[0].values("X-API-Key") == [K1]
    line = d.lines(log_mark, target=f"/placeholder{http}", at_least=1)[0]
    assert "placeholder=1" in line and "client_credential=replaced" not in line


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
@pytest.mark.parametrize("where", ["header", "other-field", "query", "basic"])
def test_a_placeholder_sent_to_another_origin_is_refused(setup, http, where):
    d, keys, vault = setup["d"], setup["keys"], setup["vault"]
    placeholder = d.exports["KEYS_API_KEY"]
    target = url(vault, VAULT, f"/stolen-{where}{http}")
    args = [http]
    if where == "header":
        args += ["-H", f"Authorization: Bearer {placeholder}"]
    elif where == "other-field":
        args += ["-H", f"X-Debug: sent {placeholder} along"]
    elif where == "query":
        target += f"?key={placeholder}"
    else:
        args += ["-u", f"user:{placeholder}"]
    mark, log_mark = vault.mark(), d.proxy.mark()
    answer = d.curl(target, *args)
    assert answer.status == 403, answer.body
    assert f"https://{KEYS}:{keys.port}" in answer.header("proxy-status"), answer.header("proxy-status")
    assert "KEYS_API_KEY" in answer.header("proxy-status")
    assert vault.since(mark) == []
    found = d.lines(log_mark, needle="status=403", target=f"/stolen-{where}", at_least=1)
    assert f"https://{KEYS}:{keys.port}" in found[0]
    # The audit log has it too: a refused use of the keys origin's credential at the vault, naming whose
    # placeholder it was and never the placeholder (nor the query that carried it).
    entry = audit_entry(setup["ws"], f"/stolen-{where}{http}")
    assert entry["origin"] == f"https://{VAULT}:{vault.port}" and entry["status"] == 403, entry
    assert entry["refused"] == "placeholder" and entry["placeholder_of"] == f"https://{KEYS}:{keys.port}", entry
    assert entry["placeholder_env"] == "KEYS_API_KEY" and entry["kind"] == "secret", entry
    assert entry["credential"].startswith("secret_file:") and entry["attempts"] == 0, entry
    # The client's process, where the kernel still said: curl may have gone (the 403 comes at once) before the scan
    # of /proc for its socket ran, and then the line names no process rather than a wrong one
    # (test_the_audit_line_names_the_clients_process_as_the_kernel_says checks that it is named).
    assert entry.get("executable", CURL) == CURL, entry
    audit = (setup["ws"].state / "audit.log").read_text()
    assert placeholder not in audit and "?key" not in audit
    text = setup["ws"].cli("audit", "--origin", f"https://{VAULT}:{vault.port}").stdout
    assert f"GET https://{VAULT}:{vault.port}/stolen-{where}{http} 403 refused: the placeholder of " \
        f"https://{KEYS}:{keys.port} (KEYS_API_KEY)" in text, text


def test_an_unprotected_host_sees_no_key(setup):
    d, plain = setup["d"], setup["plain"]
    mark = plain.mark()
    answer = run_curl(url(plain, PLAIN, "/nothing"), "--cacert", str(plain.ca_pem), "--resolve",
                      f"{PLAIN}:{plain.port}:127.0.0.1", env=d.client_env(), scratch=setup["root"] / "plain-curl")
    assert answer.status == 401
    seen = plain.since(mark)
    assert len(seen) == 1 and seen[0].values("X-API-Key") == [] and seen[0].values("Authorization") == []


def test_secret_command_runs_again_on_a_401_and_the_request_is_replayed_once(setup):
    d, vault, vault_dir = setup["d"], setup["vault"], setup["vault_dir"]
    first = d.curl(url(vault, VAULT, "/before-rotation"))
    assert first.status == 200, first.body
    runs = (vault_dir / "runs.txt").read_text().count("run")
    # The vault rotates the key: the cached one (secret_ttl 1h) is refused from now on.
    (vault_dir / "key.txt").write_text(K2_NEW + "\n")
    vault.accept(f"Bearer {K2_NEW}")
    mark, log_mark = vault.mark(), d.proxy.mark()
    answer = d.curl(url(vault, VAULT, "/after-rotation"), "-X", "POST", "--data-binary", "payload")
    assert answer.status == 200, answer.body
    seen = vault.since(mark)
    assert [r.status for r in seen] == [401, 200]
    assert seen[0].values("Authorization") == [f"Bearer {K2_OLD}"]
    assert seen[1].values("Authorization") == [f"Bearer {K2_NEW}"]
    assert (vault_dir / "runs.txt").read_text().count("run") == runs + 1
    line = d.lines(log_mark, target="/after-rotation", at_least=1)[0]
    assert "refreshed=1" in line and "attempts=2" in line
    # The new key is kept: the next request runs nothing.
    again = d.curl(url(vault, VAULT, "/after-rotation-again"))
    assert again.status == 200
    assert (vault_dir / "runs.txt").read_text().count("run") == runs + 1


def test_a_key_refused_after_the_command_ran_again_reaches_the_client_with_proxy_status(setup):
    d, vault, vault_dir = setup["d"], setup["vault"], setup["vault_dir"]
    vault.accept("Bearer nothing-the-command-gives")
    try:
        mark = vault.mark()
        answer = d.curl(url(vault, VAULT, "/never"))
        assert answer.status == 401
        assert "refresh" in answer.header("proxy-status")
        assert len(vault.since(mark)) == 2
    finally:
        vault.accept(f"Bearer {(vault_dir / 'key.txt').read_text().strip()}")


def test_exec_gives_the_tool_placeholders_only(setup):
    ws, keys = setup["ws"], setup["keys"]
    mark = keys.mark()
    home = ws.root / "cli-home"
    home.mkdir(exist_ok=True)
    done = subprocess.run(
        [proxyctl_bin(), "exec", "--config", str(ws.config_path), "--no-serve", "--", "sh", "-c",
         f'env | grep -c "{K1}" ; curl -sS -H "X-API-Key: $KEYS_API_KEY" '
         f'https://{KEYS}:{keys.port}/from-exec; echo; echo "$KEYS_API_KEY"'],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        env=clean_env(HOME=str(home), KEYS_API_KEY=K1))
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line]
    assert lines[0] == "0", "the real key reached the tool's environment"
    assert json.loads(lines[1])["authorized"] is True
    assert lines[2].startswith("proxyctl-placeholder-")
    assert keys.since(mark)[-1].values("X-API-Key") == [K1]
    assert_no_secret(done.stdout + done.stderr, "exec's output")


def test_the_audit_log_says_which_credential_went_where_and_holds_no_secret(setup):
    d, ws, keys, vault = setup["d"], setup["ws"], setup["keys"], setup["vault"]
    assert d.curl(url(keys, KEYS, "/audited?api_key=not-in-the-log")).status == 200
    assert d.curl(url(vault, VAULT, "/audited-too")).status == 200
    audit = ws.state / "audit.log"
    poll(lambda: audit.exists() and "/audited" in audit.read_text(), message="the audit line")
    assert oct(audit.stat().st_mode & 0o777) == "0o600"
    done = ws.cli("audit", "--json", "--origin", f"https://{KEYS}:{keys.port}")
    assert done.returncode == 0, done.stderr
    jq = shutil.which("jq")
    assert jq, "jq is needed (scripts/bootstrap test)"
    read = subprocess.run([jq, "-r", 'select(.path == "/audited") | [.credential, .kind, .status, .method] | @tsv'],
                          input=done.stdout, capture_output=True, text=True, check=True)
    credential, kind, status, method = read.stdout.strip().splitlines()[-1].split("\t")
    assert credential.startswith("secret_file:") and kind == "secret" and status == "200" and method == "GET"
    origins = subprocess.run([jq, "-r", ".origin"], input=done.stdout, capture_output=True, text=True, check=True)
    assert set(origins.stdout.split()) == {f"https://{KEYS}:{keys.port}"}
    everything = ws.cli("audit", "--since", "1h")
    poll(lambda: "/audited-too" in audit.read_text(), message="the second audit line")
    everything = ws.cli("audit", "--since", "1h")
    assert f"GET https://{VAULT}:{vault.port}/audited-too 200 secret secret_command:vault-key" in everything.stdout
    assert "not-in-the-log" not in audit.read_text()
    for text, where in ((audit.read_text(), "the audit log"), (done.stdout, "proxyctl audit --json"),
                        (everything.stdout, "proxyctl audit")):
        assert_no_secret(text, where)


def test_the_audit_log_moves_aside_past_its_size_and_loses_no_line(setup, tmp_path):
    """`audit_max_size`: a write that would take the log past it moves the log to audit.log.1 first (the one before
    is dropped). The proxy looks at the file's size once a second and counts its own writes in between, so a log
    moves aside at the line that would overfill it, not a second later, and no line is lost or written twice."""
    keys = setup["keys"]
    sections = config.section(f"origin https://{KEYS}:{keys.port}", secret_file=setup["root"] / "keys.secret",
                              ca_file=keys.ca_pem, header="X-API-Key: {secret}")
    ws = Workspace(tmp_path / "ws", sections, RESOLVE, audit_max_size="4KiB")
    ws.ca_init()
    deployment = Deployment(ws, ws.start_proxy())
    try:
        paths = [f"/rotate-{n:02d}" for n in range(30)]
        # One curl, one kept connection, one request at a time: a line per pass of the loop, about 330 bytes.
        # (run_curl puts its own URL last.)
        outputs = ["-o", "/dev/null"] * (len(paths) - 1)
        answer = deployment.curl(url(keys, KEYS, paths[-1]), *outputs, *[url(keys, KEYS, p) for p in paths[:-1]])
        assert answer.returncode == 0 and answer.status == 200, answer.stderr
        log, moved = ws.state / "audit.log", ws.state / "audit.log.1"
        poll(lambda: log.exists() and paths[-1] in log.read_text(), message="the last request's audit line")
        assert moved.exists(), "30 lines of about 330 bytes never moved a 4KiB log aside"
        kept = [json.loads(line) for line in moved.read_text().splitlines() + log.read_text().splitlines()]
        seen = [entry["path"] for entry in kept]
        # Two moves: the first file's lines are gone; what is left is the last of them, in order, each once.
        assert seen == paths[-len(seen):], seen
        assert len(seen) > 12, seen
        for file in (moved, log):
            assert file.stat().st_size <= 4096, (file, file.stat().st_size)
            assert oct(file.stat().st_mode & 0o777) == "0o600"
        # Moved aside at the line that would have overfilled it: no room was left for one more.
        longest = max(len(line) + 1 for line in moved.read_text().splitlines())
        assert moved.stat().st_size + longest > 4096, moved.stat().st_size
        assert all(entry["credential"].startswith("secret_file:") for entry in kept)
    finally:
        deployment.stop()


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
def test_the_audit_line_names_the_clients_process_as_the_kernel_says(setup, http):
    """Issue 31: the client's pid and executable where the kernel says: the process that holds the other end of
    the client's loopback connection (found once per connection, off the loop), read with jq."""
    d, keys = setup["d"], setup["keys"]
    path = f"/whose{http}"
    # Two requests half a second apart (--rate): curl is still running when the proxy looks for the holders of
    # its socket (scans start 20 to 250 ms apart, off the loop), as a client that is not gone at once would be.
    curl = subprocess.Popen(["curl", "-sS", "-o", "/dev/null", "-o", "/dev/null", "-w", "%{http_code}",
                             "--suppress-connect-headers", "--rate", "2/s", http, url(keys, KEYS, path),
                             url(keys, KEYS, f"{path}-again")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=d.client_env(), text=True)
    out, err = curl.communicate(timeout=60)
    assert out == "200200", err
    entry = audit_entry(setup["ws"], path)
    assert entry["pid"] == curl.pid and entry["executable"] == CURL, entry
    assert entry["uid"] == os.geteuid(), entry
    text = setup["ws"].cli("audit", "--origin", f"https://{KEYS}:{keys.port}").stdout
    assert f"pid={curl.pid} {CURL}" in text, text


FORKED_CLIENT = """
import os, socket, ssl, sys, time
proxy_port, authority, cafile, path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
sock = socket.create_connection(("127.0.0.1", proxy_port))
hold, release = os.pipe()
if os.fork() == 0:                      # a child holding the same socket until the parent is done
    os.close(release)
    os.read(hold, 1)
    os._exit(0)
sock.sendall(f"CONNECT {authority} HTTP/1.1\\r\\nHost: {authority}\\r\\n\\r\\n".encode())
head = b""
while b"\\r\\n\\r\\n" not in head:
    head += sock.recv(1)
assert head.startswith(b"HTTP/1.1 200"), head
tls = ssl.create_default_context(cafile=cafile).wrap_socket(sock, server_hostname=authority.split(":")[0])
tls.sendall(f"GET {path} HTTP/1.1\\r\\nHost: {authority}\\r\\nConnection: close\\r\\n\\r\\n".encode())
answer = b""
while chunk := tls.recv(65536):
    answer += chunk
print(answer.split(b"\\r\\n", 1)[0].decode(), flush=True)
time.sleep(1)                           # both alive while the proxy looks for the socket's holders
os.close(release)
os.wait()
"""


def test_a_socket_two_processes_hold_names_no_pid(setup, tmp_path):
    """A client that forked after connecting: two processes hold the socket, so no pid is named (absent rather
    than a guess); both run the same program, which is named."""
    d, keys = setup["d"], setup["keys"]
    script = tmp_path / "forked_client.py"
    script.write_text(FORKED_CLIENT)
    done = subprocess.run([sys.executable, str(script), str(d.proxy.port), f"{KEYS}:{keys.port}",
                           d.exports["SSL_CERT_FILE"], "/forked"], capture_output=True, text=True, timeout=60,
                          env=d.client_env())
    assert done.stdout.strip() == "HTTP/1.1 200 OK", done.stdout + done.stderr
    entry = audit_entry(setup["ws"], "/forked")
    assert "pid" not in entry, entry
    assert entry["executable"] == os.path.realpath(sys.executable), entry


def test_no_secret_in_the_log_stdout_or_metrics(setup):
    d = setup["d"]
    metrics = run_curl(setup["admin"] + "/metrics", env=clean_env(), scratch=setup["root"] / "metrics-curl")
    assert metrics.status == 200
    assert 'provider="static_secret"' in metrics.body.decode()
    assert_no_secret(metrics.body, "/metrics")
    assert_no_secret(d.proxy.log(), "the proxy's log")
    assert_no_secret(d.proxy.stdout_path.read_text(), "the proxy's stdout")
    status = d.ws.cli("status")
    assert_no_secret(status.stdout + status.stderr, "proxyctl status")


def test_a_secret_file_others_can_read_is_refused(tmp_path):
    secret = tmp_path / "api.secret"
    secret.write_text(K1 + "\n")
    secret.chmod(0o644)
    sections = config.section("origin https://keys.test", secret_file=secret)
    ws = Workspace(tmp_path / "ws", sections, "keys.test=127.0.0.1")
    ws.ca_init()
    check = subprocess.run([proxyctl_bin(), "serve", "--config", str(ws.config_path)], capture_output=True,
                           text=True, timeout=30, env=clean_env(HOME=str(tmp_path)), stdin=subprocess.DEVNULL)
    assert check.returncode != 0
    assert f"chmod 600 {secret}" in check.stderr
    assert_no_secret(check.stdout + check.stderr, "the refusal")
