"""The command line as a person meets it: help in the shape swift-argument-parser users know, exit codes
0 / 1 / 64, `exec` and `doctor`, and `env` output a shell can eval."""
import os
import re
import subprocess

from fixtures.proxy import clean_env, proxyctl_bin


def run(*args, home, env=None, stdin=subprocess.DEVNULL):
    full = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / "xdg"), XDG_STATE_HOME=str(home / "state"))
    full.pop("PROXYCTL_CONFIG", None)
    full.update(env or {})
    return subprocess.run([proxyctl_bin(), *args], env=full, capture_output=True, text=True, timeout=30,
                          stdin=stdin)


def test_help_has_the_usual_shape(tmp_path):
    top = run("--help", home=tmp_path)
    assert top.returncode == 0
    for heading in ("OVERVIEW:", "USAGE: proxyctl <subcommand>", "OPTIONS:", "SUBCOMMANDS:"):
        assert heading in top.stdout, top.stdout
    for command in ("serve", "login", "logout", "status", "token", "step-up", "ca", "env", "exec", "doctor"):
        assert f"\n  {command} " in top.stdout, command
    assert run(home=tmp_path).stdout == top.stdout  # no arguments: the same help
    serve = run("help", "serve", home=tmp_path)
    assert serve.returncode == 0 and "USAGE: proxyctl serve [--config <file>]" in serve.stdout
    assert run("serve", "--help", home=tmp_path).stdout == serve.stdout
    nested = run("help", "ca", "init", home=tmp_path)
    assert nested.returncode == 0 and "USAGE: proxyctl ca init" in nested.stdout


def words(text: str) -> str:
    """Help text with its line wrapping undone."""
    return " ".join(text.split())


def test_help_says_where_to_start_and_where_files_go(tmp_path):
    top = words(run("--help", home=tmp_path).stdout)
    assert ("Start with `proxyctl init --issuer URL --client-id ID --origin URL`: it checks the provider, writes "
            "proxy.conf and prints the next commands.") in top, top
    init = words(run("help", "init", home=tmp_path).stdout)
    assert ("(--config, else $PROXYCTL_CONFIG, else $XDG_CONFIG_HOME/proxyctl/proxy.conf, "
            "~/.config/proxyctl/proxy.conf when XDG_CONFIG_HOME is not set)") in init, init
    assert "--origin-ca-file <file>" in init, init
    serve = words(run("help", "serve", home=tmp_path).stdout)
    assert ("SIGTERM and SIGINT let open transfers finish and a token refresh in flight store its answer (within "
            "shutdown_grace), then exit.") in serve, serve
    status = words(run("help", "status", home=tmp_path).stdout)
    assert "1 when a sign-in is needed" in status and "a refresh token the provider refused" in status, status


def test_version_and_usage_errors(tmp_path):
    version = run("--version", home=tmp_path)
    assert version.returncode == 0 and version.stdout.strip().count(".") == 2
    for args, needle in [(("frobnicate",), "Unknown subcommand 'frobnicate'"),
                         (("serve", "--bogus"), "Unknown option '--bogus'"),
                         (("serve", "--listen"), "Missing value for '--listen <host:port>'"),
                         (("serve", "--listen", "nonsense"), "--listen expects HOST:PORT"),
                         (("login", "--max-age", "soon"), "--max-age expects a number of seconds"),
                         (("exec",), "Missing expected argument '<command>'")]:
        result = run(*args, home=tmp_path)
        assert result.returncode == 64, (args, result.stderr)
        assert needle in result.stderr, (args, result.stderr)
        assert "Usage: proxyctl" in result.stderr and "--help' for more information" in result.stderr


def test_failures_exit_1_with_a_message(tmp_path):
    missing = run("serve", "--config", str(tmp_path / "nope.conf"), home=tmp_path)
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    no_provider = run("login", home=tmp_path)
    assert no_provider.returncode == 1 and "[provider NAME]" in no_provider.stderr


def test_exec_runs_the_command_with_the_proxy_variables(tmp_path):
    conf = tmp_path / "proxy.conf"
    conf.write_text("[proxy]\nlisten = 127.0.0.1:18765\n")
    result = run("exec", "--config", str(conf), "--", "sh", "-c", 'echo "$HTTPS_PROXY $http_proxy"; exit 7',
                 home=tmp_path)
    assert result.returncode == 7, result.stderr
    # No serve runs for this configuration: exec started a proxy of its own, with a credential for the run.
    https, http = result.stdout.split()
    assert https == http and re.fullmatch(r"http://proxyctl:[A-Za-z0-9_-]{32}@127\.0\.0\.1:\d+", https), https
    assert not https.endswith(":18765")
    # The command's own options are not proxyctl's.
    listed = run("exec", "--config", str(conf), "ls", "-d", str(tmp_path), home=tmp_path)
    assert listed.returncode == 0 and listed.stdout.strip() == str(tmp_path)
    missing = run("exec", "--config", str(conf), "no-such-program-here", home=tmp_path)
    assert missing.returncode == 127 and "command not found" in missing.stderr


def test_env_output_evaluates_in_sh(tmp_path):
    conf = tmp_path / "proxy.conf"
    conf.write_text("[proxy]\nlisten = 127.0.0.1:18766\n")
    printed = run("env", "--config", str(conf), home=tmp_path)
    assert printed.returncode == 0
    shell = subprocess.run(["sh", "-c", printed.stdout + '\necho "$HTTPS_PROXY|$HTTP_PROXY"'], capture_output=True,
                           text=True, env={"PATH": os.environ["PATH"]})
    assert shell.stdout.strip() == "http://127.0.0.1:18766|http://127.0.0.1:18766"
    fish = run("env", "--config", str(conf), "--shell", "fish", home=tmp_path)
    assert "set -gx HTTPS_PROXY 'http://127.0.0.1:18766';" in fish.stdout
    assert run("env", "--shell", "tcsh", home=tmp_path).returncode == 64


def test_doctor_names_every_fix(tmp_path):
    conf = tmp_path / "proxy.conf"
    conf.write_text("[proxy]\nlisten = 127.0.0.1:18767\n\n[provider corp]\nissuer = https://login.example.test\n"
                    "client_id = proxyctl\n\n[origin https://api.example.test]\nprovider = corp\n")
    result = run("doctor", "--config", str(conf), home=tmp_path)
    assert result.returncode == 1
    assert "corp: not signed in" in result.stdout and "-> proxyctl login corp" in result.stdout
    assert "there is no local CA for api.example.test" in result.stdout and "-> proxyctl ca init" in result.stdout
    assert "nothing listens on 127.0.0.1:18767" in result.stdout
    assert "HTTPS_PROXY is not set" in result.stdout and 'eval "$(proxyctl env)"' in result.stdout
    broken = tmp_path / "broken.conf"
    broken.write_text("[proxy]\nlisten = 127.0.0.1:80800\n")
    port = run("serve", "--check", "--config", str(broken), home=tmp_path)
    assert port.returncode == 1 and (f"{broken}:2: [proxy] listen: port 80800 out of range (1-65535, or 0 for any "
                                     'free port), got "127.0.0.1:80800"') in port.stderr, port.stderr
    flag = run("serve", "--listen", "127.0.0.1:80800", home=tmp_path)
    assert flag.returncode == 64 and ("--listen: port 80800 out of range (1-65535, or 0 for any free port), got "
                                      "'127.0.0.1:80800'") in flag.stderr, flag.stderr
    broken.write_text("[proxy]\nlisten = here\n")
    bad = run("doctor", "--config", str(broken), home=tmp_path)
    assert bad.returncode == 1 and "broken.conf:2" in bad.stdout
