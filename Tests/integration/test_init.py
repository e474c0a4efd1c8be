"""A first run without reading the example file (`proxyctl init`, and `doctor` pointing at it): the redirect port
it writes and the URI it prints, the README's "Use it" against a provider that matches redirect URIs exactly, an
init of a second configuration that must not break a running serve, and a SIGHUP that adds a protected origin to
a running serve (the CA reissued with `ca init` first)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

from cryptography import x509

from fixtures import config
from fixtures.deployment import BROWSER
from fixtures.http import free_port, run_curl
from fixtures.proxy import clean_env, poll, proxyctl_bin
from idp_fake import FakeIdP
from resource_server import ResourceServer
from signin import glewlwyd_factory  # noqa: F401
from test_protected import Deployment, Workspace

API, MORE = "api.test", "more.test"


def run(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"))
    env.pop("PROXYCTL_CONFIG", None)
    return subprocess.run([proxyctl_bin(), *args], capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


def test_init_checks_the_provider_and_writes_a_working_configuration(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    doctor = run(home, "doctor")
    assert doctor.returncode == 1 and "proxyctl init --issuer" in doctor.stdout, doctor.stdout
    with FakeIdP() as fake:
        wrong = run(home, "init", "--issuer", fake.issuer + "/other", "--client-id", "proxyctl-test")
        assert wrong.returncode == 1, wrong
        done = run(home, "init", "--issuer", fake.issuer, "--client-id", "proxyctl-test",
                   "--origin", "https://api.example.test", "--origin", "https://git.example.test:8443", "--dpop")
        assert done.returncode == 0, done.stderr
        conf = home / "xdg" / "proxyctl" / "proxy.conf"
        text = conf.read_text()
        assert f"issuer = {fake.issuer}" in text and "token_binding = dpop" in text
        assert "[origin https://git.example.test:8443]" in text
        # The issuer's host is an address: the provider is "default", and init says how to name it.
        assert "[provider default]" in text and "provider = default" in text, text
        assert ("  provider name: default (the issuer's host is an address; --name NAME gives it a name of your "
                "choice)\n") in done.stderr, done.stderr
        listen = re.search(r"^listen = (127\.0\.0\.1:\d+)$", text, re.M).group(1)
        assert f"  proxyctl serve listens on {listen}" in done.stderr, done.stderr
        assert "PKCE with S256: offered" in done.stderr and "device flow: offered" in done.stderr, done.stderr
        assert "made the local CA for api.example.test, git.example.test" in done.stderr, done.stderr
        assert done.stdout.startswith("proxyctl login"), done.stdout
        assert run(home, "serve", "--check").returncode == 0
        # Never replaced without --force.
        again = run(home, "init", "--issuer", fake.issuer, "--client-id", "other")
        assert again.returncode == 1 and "--force" in again.stderr
        assert conf.read_text() == text
        forced = run(home, "init", "--issuer", fake.issuer, "--client-id", "other", "--force")
        assert forced.returncode == 0 and "client_id = other" in conf.read_text()
    down = run(home, "init", "--issuer", fake.issuer, "--client-id", "x", "--force")
    assert down.returncode == 1 and "cannot use" in down.stderr, down


def test_init_takes_the_issuer_as_the_provider_spells_it_and_names_the_one_meant(tmp_path):
    """A trailing slash the provider's issuer does not have is the provider's spelling once init has seen its
    discovery document (and said so, naming --issuer, not a proxy.conf that does not exist yet); a wrong path is
    named with both discovery URLs tried and the issuer the user probably meant."""
    home = tmp_path / "home"
    home.mkdir()
    with FakeIdP(issuer_path="realms/dev") as fake:
        slash = run(home, "init", "--issuer", fake.issuer + "/", "--client-id", "proxyctl-test")
        assert slash.returncode == 0, slash.stderr
        assert (f"  issuer: {fake.issuer}, as the provider names itself (--issuer had a trailing slash; an issuer "
                "must match exactly)\n") in slash.stderr, slash.stderr
        assert "proxy.conf has" not in slash.stderr
        conf = home / "xdg" / "proxyctl" / "proxy.conf"
        assert f"issuer = {fake.issuer}\n" in conf.read_text()

        wrong = run(home, "init", "--config", str(tmp_path / "wrong.conf"), "--issuer", fake.issuer + "/extra",
                    "--client-id", "proxyctl-test")
        assert wrong.returncode == 1, wrong
        assert wrong.stderr == (
            f"Checking {fake.issuer}/extra ...\n"
            f"proxyctl: cannot use {fake.issuer}/extra as a provider: no discovery document ("
            f"{fake.issuer}/extra/.well-known/openid-configuration answered 404 (OpenID Connect Discovery), "
            f"{fake.base_url}/.well-known/oauth-authorization-server/realms/dev/extra answered 404 (RFC 8414)); "
            f"{fake.issuer} has one: did you mean --issuer {fake.issuer}?\n"), wrong.stderr
        assert not (tmp_path / "wrong.conf").exists()


def ephemeral_range() -> range:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return range(int(low), int(high) + 1)


def test_init_writes_a_redirect_port_and_prints_the_redirect_uri_to_register(tmp_path, default_redirect_port):
    # default_redirect_port: this test listens on the default port itself (below), so it holds the lock that the
    # tests whose `proxyctl login` listens there hold; without it, a fresh clone's README test on another worker
    # failed at login ('cannot listen on 127.0.0.1:17755 ... Address already in use').
    home = tmp_path / "home"
    home.mkdir()
    with FakeIdP() as fake:
        done = run(home, "init", "--issuer", fake.issuer, "--client-id", "proxyctl-test")
        assert done.returncode == 0, done.stderr
        port = int(re.search(r"^redirect_port = (\d+)$", (home / "xdg" / "proxyctl" / "proxy.conf").read_text(),
                             re.M).group(1))
        # The fixed default unless something listens there now; never in the kernel's ephemeral range.
        assert port == 17755 or "17755 in use here" in done.stderr, done.stderr
        assert port not in ephemeral_range()
        uri = f"http://127.0.0.1:{port}/callback"
        assert f"  sign-in redirect: {uri} (redirect_port = {port}" in done.stderr, done.stderr
        assert ("Register this redirect URI for client proxyctl-test at the provider, exactly as written (many "
                f"providers compare it character for character):\n    {uri}\nNext:") in done.stderr, done.stderr

        # Replaced with --force: the port stays (the provider has it registered).
        again = run(home, "init", "--issuer", fake.issuer, "--client-id", "proxyctl-test", "--force")
        assert again.returncode == 0 and f"(redirect_port = {port}, as in the file replaced)" in again.stderr, again

        # Something listens on it: a second configuration gets the next free port, and says why.
        with socket.socket() as taken:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a login's connection may be in TIME_WAIT
            taken.bind(("127.0.0.1", port))
            taken.listen()
            other = run(home, "init", "--config", str(tmp_path / "other.conf"), "--issuer", fake.issuer,
                        "--client-id", "proxyctl-test")
            assert other.returncode == 0, other.stderr
            found = re.search(r"sign-in redirect: http://127\.0\.0\.1:(\d+)/callback \(redirect_port = (\d+); ports? "
                              r"([\d, ]+) in use here\)", other.stderr)
            assert found and found.group(1) == found.group(2) != str(port), other.stderr
            assert str(port) in found.group(3).split(", ")
            assert f"redirect_port = {found.group(1)}\n" in (tmp_path / "other.conf").read_text()

            # Given: taken as given, with a word when something listens there.
            given = run(home, "init", "--config", str(tmp_path / "given.conf"), "--issuer", fake.issuer,
                        "--client-id", "proxyctl-test", "--redirect-port", str(port))
            assert given.returncode == 0, given.stderr
            assert (f"sign-in redirect: http://127.0.0.1:{port}/callback (redirect_port = {port}; something listens "
                    "there now, and a login needs it free)") in given.stderr, given.stderr
        # listen: 127.0.0.1:8080 unless something listens there (another configuration's serve, say): then a free
        # port near it, so that both can be served.
        with socket.socket() as held:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                held.bind(("127.0.0.1", 8080))
                held.listen()
            except OSError:
                pass  # something else listens on 8080 already: the same case
            moved = run(home, "init", "--config", str(tmp_path / "listen.conf"), "--issuer", fake.issuer,
                        "--client-id", "proxyctl-test")
            assert moved.returncode == 0, moved.stderr
            listen = re.search(r"^listen = 127\.0\.0\.1:(\d+)$", (tmp_path / "listen.conf").read_text(), re.M)
            assert listen and 8080 < int(listen.group(1)) < 8180, moved.stderr
            assert (f"  proxyctl serve listens on 127.0.0.1:{listen.group(1)}; another program listens on 8080\n"
                    in moved.stderr), moved.stderr
        for bad in ("0", "65536", "http"):
            refused = run(home, "init", "--config", str(tmp_path / "bad.conf"), "--issuer", fake.issuer,
                          "--client-id", "proxyctl-test", "--redirect-port", bad)
            assert refused.returncode == 64 and "--redirect-port expects a port from 1 to 65535" in refused.stderr
        assert not (tmp_path / "bad.conf").exists()


def test_readme_use_it_against_a_provider_that_matches_redirect_uris_exactly(tmp_path, glewlwyd_factory,
                                                                           default_redirect_port):
    """The README's "Use it", command by command, against glewlwyd (which matches redirect URIs exactly): init
    with no redirect port, the redirect URI it prints registered at the provider, the `proxyctl login` it prints
    (the scripted browser signs in), then the `proxyctl exec -- curl` it prints gets the API's answer, which
    needs a token the API accepts. Two things the README's reader does not do: `--resolve` (api.test is not in
    DNS) and `--origin-ca-file` for the test API, whose certificate comes from a test CA."""
    idp = glewlwyd_factory()
    rs = ResourceServer(tmp_path / "rs", [API])
    try:
        rs.trust(idp.issuer(), idp.discovery()["jwks_uri"])
        home = tmp_path / "home"
        home.mkdir()
        origin = f"https://{API}:{rs.port}"
        init = run(home, "init", "--issuer", idp.issuer(), "--client-id", idp.client_id, "--origin", origin,
                   "--resolve", f"{API}=127.0.0.1", "--origin-ca-file", str(rs.ca_pem))
        assert init.returncode == 0, init.stderr
        assert f"  protected origin {origin}, its certificate checked against {rs.ca_pem}\n" in init.stderr
        uri = re.search(r"^Register this redirect URI for client \S+ at the provider.*\n    (\S+)$", init.stderr,
                        re.M).group(1)
        registered = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/callback", uri)
        assert registered, uri
        idp.add_redirect_ports([int(registered.group(1))])
        conf = home / "xdg" / "proxyctl" / "proxy.conf"
        assert f"[origin {origin}]\nprovider = " in conf.read_text() and f"ca_file = {rs.ca_pem}\n" in conf.read_text()

        # The commands as init printed them, run by a shell that finds proxyctl on PATH.
        login, use = init.stdout.splitlines()
        assert login.startswith("proxyctl login") and use == f"proxyctl exec -- curl {origin}/", init.stdout
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "proxyctl").symlink_to(Path(proxyctl_bin()).resolve())
        env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"), PATH=f"{bin_dir}:{os.environ['PATH']}",
                        BROWSER=BROWSER, PROXYCTL_TEST_BROWSER="glewlwyd", PROXYCTL_TEST_IDP_URL=idp.base_url,
                        PROXYCTL_TEST_IDP_USER=idp.username, PROXYCTL_TEST_IDP_PASSWORD=idp.password,
                        PROXYCTL_TEST_IDP_SCOPE="openid profile email")
        env.pop("PROXYCTL_CONFIG", None)
        signed_in = subprocess.run(["sh", "-c", login], capture_output=True, text=True, timeout=60, env=env,
                                   stdin=subprocess.DEVNULL)
        assert signed_in.returncode == 0, signed_in.stderr
        assert f"Waiting for the provider to send the browser back to {uri}.\n" in signed_in.stderr
        assert "Signed in to" in signed_in.stderr and "No answer from the browser" not in signed_in.stderr
        answer = subprocess.run(["sh", "-c", use], capture_output=True, text=True, timeout=60, env=env,
                                stdin=subprocess.DEVNULL)
        assert answer.returncode == 0, answer.stderr
        assert json.loads(answer.stdout)["sub"], answer.stdout
        [seen] = rs.since(0)
        assert seen.status == 200 and seen.header_values("Authorization")[0].startswith("Bearer ")
    finally:
        rs.close()


def shell_env(tmp_path: Path, home: Path, **extra: str) -> dict[str, str]:
    """The environment of a person's shell: HOME, XDG_CONFIG_HOME, and a PATH on which `proxyctl` is found."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "proxyctl").symlink_to(Path(proxyctl_bin()).resolve())
    env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"), PATH=f"{bin_dir}:{os.environ['PATH']}",
                    **extra)
    env.pop("PROXYCTL_CONFIG", None)
    return env


def sh(line: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


def test_init_of_a_second_configuration_keeps_a_running_serve_working(tmp_path):
    """The newcomer's second blocker: `init --config other.conf` with another origin, on the state directory
    (and so the local CA) a running serve uses. The CA is widened to cover both configurations, never narrowed;
    the CA the serve signs with stays trusted, so that the serve keeps working for new clients and for clients
    that loaded the bundle before; the second configuration works with the commands init printed. Then the
    CA's other commands: `ca init` keeps the other configuration's host, `ca init --force` drops it and names
    what breaks, and a SIGHUP mends the serve."""
    rs = ResourceServer(tmp_path / "rs", [API, MORE])
    try:
        with FakeIdP(access_token_format="jwt", expires_in=3600) as fake:
            rs.trust(fake.issuer, fake.url("jwks"))
            state = tmp_path / "xdg-state" / "proxyctl"  # the default state directory of the second one
            provider = config.provider("fake", fake.issuer, redirect_port=0)
            ws = Workspace(tmp_path / "a", provider + config.origin(f"https://{API}:{rs.port}", "fake",
                                                                   ca_file=rs.ca_pem),
                           f"{API}=127.0.0.1", state=state)
            ws.ca_init()
            ws.login_fake("fake")
            deployment = Deployment(ws, ws.start_proxy())
            try:
                assert deployment.curl(rs.url("/before", API)).status == 200
                # A client that loaded the bundle now and keeps it (a long-running program).
                loaded = tmp_path / "loaded-bundle.pem"
                loaded.write_bytes((state / "ca" / "bundle.pem").read_bytes())

                home = tmp_path / "home-b"
                home.mkdir()
                env = shell_env(tmp_path, home, XDG_STATE_HOME=str(tmp_path / "xdg-state"), BROWSER=BROWSER,
                                PROXYCTL_TEST_BROWSER="fake")
                other = tmp_path / "other.conf"
                init = subprocess.run(
                    [proxyctl_bin(), "init", "--config", str(other), "--issuer", fake.issuer, "--client-id",
                     "proxyctl-test", "--origin", f"https://{MORE}:{rs.port}", "--resolve", f"{MORE}=127.0.0.1",
                     "--redirect-port", str(free_port())],
                    capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
                assert init.returncode == 0, init.stderr
                assert (f"  made a new local CA for {API}, {MORE} ({state}/ca/ca.pem): it adds {MORE}; {API} stays "
                        f"covered for the other configurations that share {state}\n") in init.stderr, init.stderr
                assert re.search(rf"  the CA before it stays trusted \(in {re.escape(str(state))}/ca/bundle\.pem\) until "
                                 rf"it expires, \d{{4}}-.*, so a proxyctl serve running with it \(running: pid "
                                 rf"{deployment.proxy.pid}\) and the tools that trust it keep working\n", init.stderr)
                assert (f"  a running proxyctl serve (running: pid {deployment.proxy.pid}) keeps the CA it started with; "
                        f"one whose proxy.conf protects {MORE} moves to the new one at its next SIGHUP (kill -HUP "
                        f"{deployment.proxy.pid}); no restart is needed\n") in init.stderr, init.stderr
                # A serve of the first configuration starts with the wider CA: it covers its hosts.
                checked = ws.cli("serve", "--check")
                assert checked.returncode == 0, checked.stderr
                constraints = x509.load_pem_x509_certificate((state / "ca" / "ca.pem").read_bytes()).extensions \
                    .get_extension_for_class(x509.NameConstraints).value
                assert {n.value for n in constraints.permitted_subtrees} == {API, MORE}

                # The running serve keeps working: for a client that reads the bundle now, and one that loaded it
                # before.
                assert deployment.curl(rs.url("/after", API)).status == 200
                kept = run_curl(rs.url("/loaded-before", API), "--suppress-connect-headers",
                                env=deployment.client_env(CURL_CA_BUNDLE=str(loaded)), scratch=tmp_path / "curl")
                assert kept.status == 200, kept

                # The second configuration works with the commands init printed, once its test API's CA is
                # trusted: the proxy's answer before that names the fix.
                login, use = init.stdout.splitlines()
                assert use == f"proxyctl exec --config '{other}' -- curl https://{MORE}:{rs.port}/", init.stdout
                signed_in = sh(login, env)
                assert signed_in.returncode == 0, signed_in.stderr
                untrusted = sh(use, env)
                assert untrusted.stdout == (
                    f"proxyctl: the certificate of {MORE}:{rs.port} does not verify: unable to get local issuer "
                    "certificate; if the origin's certificate comes from a private CA, set ca_file = FILE "
                    f"(that CA's PEM) in [origin https://{MORE}:{rs.port}] of {other}\n"), untrusted
                other.write_text(other.read_text().replace(f"[origin https://{MORE}:{rs.port}]\n",
                                                           f"[origin https://{MORE}:{rs.port}]\nca_file = {rs.ca_pem}\n"))
                answer = sh(use, env)
                assert answer.returncode == 0 and json.loads(answer.stdout)["sub"], answer.stderr + answer.stdout
                assert rs.since(0, MORE)[-1].status == 200

                # ca init of the first configuration keeps the other's host, and says so.
                again = ws.cli("ca", "init")
                assert again.returncode == 0, again.stderr
                assert (f"The local CA already covers {API}; nothing to do (--force makes a new one). It also covers "
                        f"{MORE}, kept for the other configurations that share {state} (proxyctl ca init --force makes "
                        f"one for exactly {API} and drops {MORE}).") in again.stderr, again.stderr
                shown = ws.cli("ca", "show")
                assert shown.returncode == 0, shown.stdout
                assert f"also trusted: the CA it replaced, for {API}, until " in shown.stdout, shown.stdout
                assert (f"{MORE}: not in this proxy.conf; kept for the other configurations that share the state "
                        "directory") in shown.stdout
                # A reload keeps the CA the serve signs with: it still covers api.test and is trusted.
                mark = deployment.proxy.mark()
                deployment.proxy.signal(signal.SIGHUP)
                deployment.proxy.wait_log(r"SIGHUP: configuration reloaded", since=mark)
                assert run_curl(rs.url("/reloaded", API), "--suppress-connect-headers",
                                env=deployment.client_env(CURL_CA_BUNDLE=str(loaded)),
                                scratch=tmp_path / "curl").status == 200

                # --force: exactly this configuration's hosts; it names what it drops and the serve to signal.
                forced = ws.cli("ca", "init", "--force")
                assert forced.returncode == 0, forced.stderr
                assert (f"Made a new local CA for exactly: {API} (--force); the CAs before it are trusted no more. "
                        f"It drops {MORE}: a proxyctl serve or exec of another configuration sharing {state} that "
                        f"protects it fails until proxyctl ca init --config ITS_FILE makes a CA that covers it "
                        "again.") in forced.stderr, forced.stderr
                assert (f"A running proxyctl serve (running: pid {deployment.proxy.pid}) moves to it by itself within "
                        "a few seconds (no restart or SIGHUP is needed)") in forced.stderr, forced.stderr
                # Issue 32 item 4: the serve picks the new CA up by itself (it signed with one nobody trusts, curl
                # exit 60, until a SIGHUP): a client that reads the new bundle verifies it, no signal sent.
                picked = poll(lambda: (lambda a: a if a.status == 200 else None)(
                    deployment.curl(rs.url("/picked-up", API))), 15, message="the serve to move to the new CA")
                assert picked.status == 200
                deployment.proxy.wait_log(r"the local CA changed \(proxyctl ca init\): new connections get leaves "
                                          rf"from the CA for {API} \(SHA-256 ", since=mark)
            finally:
                assert deployment.stop() is None
    finally:
        rs.close()


def test_sighup_applies_a_new_origin(tmp_path):
    rs = ResourceServer(tmp_path / "rs", [API, MORE])
    try:
        with FakeIdP(access_token_format="jwt", expires_in=3600) as fake:
            rs.trust(fake.issuer, fake.url("jwks"))
            provider = config.provider("fake", fake.issuer, redirect_port=0)
            first = config.origin(f"https://{API}:{rs.port}", "fake", ca_file=rs.ca_pem)
            ws = Workspace(tmp_path / "ws", provider + first, f"{API}=127.0.0.1, {MORE}=127.0.0.1")
            ws.ca_init()
            ws.login_fake("fake")
            deployment = Deployment(ws, ws.start_proxy())
            try:
                assert deployment.curl(rs.url("/before", MORE)).returncode != 0, "not protected yet"
                # Add the origin; until the CA names it, the reload keeps the old origins and says why.
                ws.sections = provider + first + config.origin(f"https://{MORE}:{rs.port}", "fake", ca_file=rs.ca_pem)
                ws.write_config(ws.port)
                mark = deployment.proxy.mark()
                deployment.proxy.signal(signal.SIGHUP)
                pid = deployment.proxy.pid
                # The warning says what was not applied and why; the last line says exactly that, not "reloaded".
                deployment.proxy.wait_log(re.escape(
                    f"SIGHUP: [origin] and [provider] changes not applied: the protected hosts changed since the local "
                    f"CA was made (added {MORE}); its name constraints must name every protected host: run proxyctl "
                    "ca init to reissue it (the CA before it stays trusted until it expires); then send SIGHUP again "
                    f"(kill -HUP {pid})"), since=mark)
                deployment.proxy.wait_log(re.escape(
                    "SIGHUP: applied the rest of the configuration; not applied: [origin] and [provider] changes (see "
                    f"above); protected origins: https://{API}:{rs.port}"), since=mark)
                assert "configuration reloaded" not in deployment.proxy.log_since(mark)
                ws.ca_init()
                deployment.exports = ws.env()
                mark = deployment.proxy.mark()
                deployment.proxy.signal(signal.SIGHUP)
                deployment.proxy.wait_log(r"SIGHUP: configuration reloaded \(protected origins: .*more\.test", since=mark)
                answer = deployment.curl(rs.url("/after", MORE))
                assert answer.status == 200 and answer.json()["sub"], answer
                assert deployment.curl(rs.url("/still", API)).status == 200
            finally:
                assert deployment.stop() is None
    finally:
        rs.close()
