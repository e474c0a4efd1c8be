"""The package on a machine without Swift (docs/packaging.md): in a clean Debian 12 root (mmdebstrap minbase, no
toolchain; `scripts/debian-root`), `apt-get install ./proxyctl_*.deb` with every dependency from Debian, then
`proxyctl --version`, `serve` with curl through a passthrough tunnel, and `exec -- curl` against a protected
origin whose token comes from client credentials, all run inside the root (its libc, its libcurl 7.88, its curl).
The README's Install section as written: its apt-get line installs the package, and its tarball lines and
INSTALL.md's per-user ones install the tarball under a user's home, whose proxyctl, manual page, completion and
systemd user unit work.

scripts/test runs this module as a step of its own with PROXYCTL_DEBIAN_ROOT (a root made by `scripts/debian-root
make`), PROXYCTL_DEB (the package) and PROXYCTL_TARBALL (the tarball beside it); without them it is skipped. The servers (the provider, the origins) run
outside the root on loopback, which the root shares."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from fixtures import config
from fixtures.jose import unverified_claims
from fixtures.proxy import poll
from idp_fake import FakeIdP
from resource_server import ResourceServer

REPOSITORY = Path(__file__).resolve().parents[2]
ROOT = os.environ.get("PROXYCTL_DEBIAN_ROOT")
DEB = os.environ.get("PROXYCTL_DEB")
TARBALL = os.environ.get("PROXYCTL_TARBALL")

pytestmark = pytest.mark.skipif(not ROOT or not DEB, reason="scripts/test's Debian 12 root step sets "
                                "PROXYCTL_DEBIAN_ROOT and PROXYCTL_DEB")


def readme_block(heading: str) -> list[str]:
    """The command lines of the first sh block after `heading` in the README's Install section, comments cut."""
    text = (REPOSITORY / "README.md").read_text()
    install = text[text.index("## Install\n"):text.index("\n## ", text.index("## Install\n") + 1)]
    block = re.search(r"```sh\n(.*?)```", install[install.index(heading):], re.S).group(1)
    return [line.split("  #")[0].rstrip() for line in block.splitlines() if line.strip()]


class DebianRoot:
    """A writable copy of the cached root (one per module); commands run inside it with a test's directory mounted
    at the same path and HOME in it."""

    def __init__(self, path: Path):
        self.path = path
        subprocess.run([REPOSITORY / "scripts/debian-root", "copy", ROOT, self.path], check=True)
        # The test's origins by name, as a machine's own resolver would find them.
        with open(self.path / "etc/hosts", "a") as hosts:
            hosts.write("127.0.0.1 plain.test api.test\n")
        self.share = path.parent

    def command(self, *words: str, env: dict[str, str] | None = None) -> list[str]:
        variables = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.share / "home"), "LANG": "C.UTF-8"}
        variables.update(env or {})
        return [str(REPOSITORY / "scripts/debian-root"), "run", str(self.path), "--bind", str(self.share),
                "--bind", str(Path(DEB).resolve().parent), "--", "env", "-i",
                *[f"{name}={value}" for name, value in variables.items()], *words]

    def run(self, *words: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*words, env=env), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The root with the package installed by apt-get, as a user installs it."""
    made = DebianRoot(tmp_path_factory.mktemp("debian") / "root")
    # The README's line, where the package is (the root has no sudo: it runs as root).
    [line, _] = readme_block("**The Debian package**")
    assert line == f"sudo apt-get install ./{Path(DEB).name}", f"the README names {line}; scripts/package made {DEB}"
    installed = made.run("sh", "-c", f'cd "$1" && {line.removeprefix("sudo ")} -y -q', "sh",
                         str(Path(DEB).resolve().parent), env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=120)
    assert installed.returncode == 0 and "Setting up proxyctl" in installed.stdout, installed.stdout + installed.stderr
    yield made
    subprocess.run(["rm", "-rf", str(made.path)], check=True)


def test_the_package_installs_and_runs_where_there_is_no_swift(root):
    version = root.run("proxyctl", "--version")
    assert version.returncode == 0 and re.fullmatch(r"proxyctl \d+\.\d+\.\d+ \(commit \S+\)\n", version.stdout), \
        version.stdout + version.stderr
    nothing = root.run("sh", "-c", "command -v swift swiftc; ls /opt; ldconfig -p | grep -ci swift")
    assert nothing.stdout.strip() == "0", nothing.stdout
    libraries = root.run("ldd", "/usr/bin/proxyctl")
    assert libraries.returncode == 0 and "not found" not in libraries.stdout, libraries.stdout
    curl = root.run("dpkg-query", "-W", "-f", "${Version}", "libcurl4")
    assert curl.stdout.startswith("7.88."), curl.stdout  # Debian 12's own libcurl, not the backport
    files = root.run("dpkg", "-L", "proxyctl").stdout.split()
    for expected in ("/usr/bin/proxyctl", "/usr/share/doc/proxyctl/copyright",
                     "/usr/share/doc/proxyctl/examples/proxy.conf.example", "/usr/lib/systemd/user/proxyctl.service",
                     "/usr/lib/systemd/user/proxyctl.socket", "/usr/share/man/man1/proxyctl.1.gz",
                     "/usr/share/bash-completion/completions/proxyctl", "/usr/share/zsh/vendor-completions/_proxyctl",
                     "/usr/share/fish/vendor_completions.d/proxyctl.fish"):
        assert expected in files, files
    completed = root.run("bash", "-c", "source /usr/share/bash-completion/completions/proxyctl; "
                         "COMP_WORDS=(proxyctl ser); COMP_CWORD=1; _proxyctl; echo ${COMPREPLY[*]}")
    # "ser", not "se": `secret` (issue 31) shares the first two letters.
    assert completed.stdout == "serve\n", completed.stdout + completed.stderr


def test_serve_passes_a_tunnel_through(root):
    tmp_path = root.share / "tunnel"
    tmp_path.mkdir()
    origin = ResourceServer(tmp_path / "plain", ["plain.test"], require_token=False)
    serve = None
    try:
        log = tmp_path / "serve.log"
        with open(log, "wb") as out:
            serve = subprocess.Popen(root.command("proxyctl", "serve", "--listen", "127.0.0.1:0"), stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        listening = poll(lambda: re.search(r"listening on http://127\.0\.0\.1:(\d+)", log.read_text()), 15,
                         message="serve in the root to listen")
        port = listening.group(1)
        # curl inside the root, through the proxy: a blind tunnel, so the origin's own certificate verifies.
        fetched = root.run("curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--proxy",
                           f"http://127.0.0.1:{port}", "--cacert", str(origin.ca_pem), origin.url("/me"))
        assert fetched.stdout == "200", fetched.stdout + fetched.stderr
        assert origin.since(0)[-1].path == "/me"
        poll(lambda: f"CONNECT plain.test:{origin.port}" in log.read_text(), 10, message="the tunnel's log line")
    finally:
        if serve is not None:
            serve.terminate()
            assert serve.wait(timeout=30) == 0
        origin.close()


def test_exec_curl_reaches_a_protected_origin_with_client_credentials(root):
    tmp_path = root.share / "exec"
    tmp_path.mkdir()
    secret = "root-secret-" + os.urandom(8).hex()
    provider = FakeIdP(access_token_format="jwt", client_secret=secret).start()
    api = ResourceServer(tmp_path / "api", ["api.test"])
    try:
        api.trust(provider.issuer, provider.url("jwks"))
        secret_file = tmp_path / "client.secret"
        secret_file.write_text(secret + "\n")
        secret_file.chmod(0o600)
        conf = tmp_path / "proxy.conf"
        conf.write_text(config.proxy(state_dir=tmp_path / "state")
                        + config.provider("ci", provider.issuer, grant="client_credentials",
                                          token_endpoint_auth_method="client_secret_basic",
                                          client_secret_file=secret_file, scopes="api")
                        + config.origin(f"https://api.test:{api.port}", "ci", ca_file=api.ca_pem))
        made = root.run("proxyctl", "ca", "init", "--config", str(conf))
        assert made.returncode == 0, made.stderr
        run = root.run("proxyctl", "exec", "--config", str(conf), "--", "curl", "-sS", "-o", "/dev/null", "-w",
                       "%{http_code}", api.url("/me"), timeout=90)
        assert run.returncode == 0 and run.stdout == "200", run.stdout + run.stderr
        seen = api.since(0)[-1]
        assert seen.error is None and seen.token, seen
        assert unverified_claims(seen.token)["iss"] == provider.issuer
        assert provider.client_auth_methods[-1] == "client_secret_basic"
    finally:
        api.close()
        provider.stop()


@pytest.mark.skipif(not TARBALL, reason="scripts/test's Debian 12 root step sets PROXYCTL_TARBALL")
def test_the_tarball_installs_for_one_user_as_the_readme_and_install_md_say(root):
    """The README's tarball lines, then INSTALL.md's per-user lines, run by a shell in the root as written (with
    the tarball copied into a directory of the user's): the binary on ~/.local/bin runs, every file lands where
    INSTALL.md says, bash completes with the completion, and the user unit starts the binary that was installed."""
    tarball = Path(TARBALL).resolve()
    lines = readme_block("**The tarball**")
    assert lines[0] == f"tar xzf {tarball.name} && cd {tarball.name.removesuffix('.tar.gz')}", \
        f"the README names {lines[0]}; scripts/package made {tarball.name}"
    work = root.share / "tarball"
    work.mkdir()
    (work / tarball.name).write_bytes(tarball.read_bytes())
    home = work / "home"
    env = {"HOME": str(home), "PATH": f"{home}/.local/bin:/usr/bin:/bin"}
    readme = root.run("sh", "-ec", f'cd "$1"\n' + "\n".join(lines), "sh", str(work), env=env)
    assert readme.returncode == 0, readme.stderr
    tree = work / tarball.name.removesuffix(".tar.gz")
    guide = (tree / "INSTALL.md").read_text()
    per_user = guide[guide.index("For one user"):guide.index("For every user")]
    commands = [line.strip().split("   #")[0] for line in per_user.splitlines() if line.startswith("    ")]
    assert len(commands) >= 7, per_user
    installed = root.run("sh", "-ec", f'cd "$1"\n' + "\n".join(commands), "sh", str(tree), env=env)
    assert installed.returncode == 0, installed.stderr
    version = root.run("sh", "-c", "command -v proxyctl && proxyctl --version", env=env)
    assert version.stdout.startswith(f"{home}/.local/bin/proxyctl\nproxyctl "), version.stdout + version.stderr
    for path in (".local/share/man/man1/proxyctl.1.gz", ".local/share/bash-completion/completions/proxyctl",
                 ".config/fish/completions/proxyctl.fish", ".zfunc/_proxyctl", ".config/systemd/user/proxyctl.socket"):
        assert (home / path).is_file(), path
    completed = root.run("bash", "-c", "source ~/.local/share/bash-completion/completions/proxyctl; "
                         "COMP_WORDS=(proxyctl ex); COMP_CWORD=1; _proxyctl; echo ${COMPREPLY[*]}", env=env)
    assert completed.stdout == "exec\n", completed.stdout + completed.stderr
    # The unit runs what was installed (%h is the user's home), not /usr/bin/proxyctl, which is the package's.
    unit = (home / ".config/systemd/user/proxyctl.service").read_text()
    [exec_start] = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert exec_start == "ExecStart=%h/.local/bin/proxyctl serve", exec_start
    assert (home / ".local/bin/proxyctl").stat().st_mode & 0o111
