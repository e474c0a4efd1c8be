"""Shell completions and the manual page, both made from the command table (`proxyctl completion bash|zsh|fish`,
`proxyctl help --man`; docs/packaging.md): bash offers the subcommands, a command's flags and an option's fixed
values; fish (when installed) the same through its own `complete -C`; zsh's script parses; the manual names every
command, argument and flag that `--help` names, and groff renders it without a warning."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fixtures.proxy import clean_env, proxyctl_bin


def proxyctl(*args: str) -> str:
    done = subprocess.run([proxyctl_bin(), *args], capture_output=True, text=True, timeout=30, env=clean_env())
    assert done.returncode == 0, done.stderr
    return done.stdout


def bash_completes(script: Path, words: list[str], cwd: Path) -> list[str]:
    """What `_proxyctl` offers for the command line `words` (the cursor on the last word) in a real bash."""
    driver = (f"source {script}\nCOMP_WORDS=({' '.join(repr(w) for w in words)})\n"
              "COMP_CWORD=$((${#COMP_WORDS[@]} - 1))\nCOMPREPLY=()\n_proxyctl\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n")
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", driver], capture_output=True, text=True,
                          timeout=30, cwd=cwd, env=clean_env())
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line]


def commands_and_flags() -> dict[str, tuple[set[str], set[str]]]:
    """Every command path `--help` names, with the flags and arguments its help lists."""
    found: dict[str, tuple[set[str], set[str]]] = {}

    def walk(path: list[str]) -> None:
        text = proxyctl("help", *path) if path else proxyctl("--help")
        flags = set(re.findall(r"^  (?:-\w, )?(--[a-z][a-z-]*)", text, re.M))
        arguments = set(re.findall(r"^  (<[a-z-]+>)", text, re.M))
        found[" ".join(path)] = (flags, arguments)
        subcommands = text.split("SUBCOMMANDS:\n", 1)
        if len(subcommands) == 2:
            for name in re.findall(r"^  ([a-z][a-z-]*)\s", subcommands[1], re.M):
                walk(path + [name])

    walk([])
    return found


def test_bash_offers_subcommands_flags_and_values(tmp_path):
    script = tmp_path / "completion.bash"
    script.write_text(proxyctl("completion", "bash"))
    if shutil.which("shellcheck"):
        checked = subprocess.run(["shellcheck", "-s", "bash", str(script)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout
    (tmp_path / "proxy.conf").write_text("")
    top = bash_completes(script, ["proxyctl", ""], tmp_path)
    for command in commands_and_flags()[""][0] | {"init", "serve", "login", "exec", "ca", "completion", "help"}:
        assert command in top, (command, top)
    assert bash_completes(script, ["proxyctl", "st"], tmp_path) == ["status", "step-up"]
    serve = bash_completes(script, ["proxyctl", "serve", "--"], tmp_path)
    assert sorted(serve) == sorted(commands_and_flags()["serve"][0]), serve
    assert bash_completes(script, ["proxyctl", "ca", ""], tmp_path)[:3] == ["init", "show", "export"]
    assert bash_completes(script, ["proxyctl", "ca", "export", "--format", ""], tmp_path) == ["pem", "pkcs12"]
    assert bash_completes(script, ["proxyctl", "serve", "--log-level", "w"], tmp_path) == ["warn"]
    assert bash_completes(script, ["proxyctl", "serve", "--config", "pro"], tmp_path) == ["proxy.conf"]
    assert bash_completes(script, ["proxyctl", "serve", "--listen", ""], tmp_path) == []  # an address: nothing
    assert bash_completes(script, ["proxyctl", "completion", ""], tmp_path) == ["bash", "zsh", "fish", "--help",
                                                                                "-h"]
    # The command exec runs completes as a command, and what follows as files.
    assert "bash" in bash_completes(script, ["proxyctl", "exec", "--", "bas"], tmp_path)
    assert bash_completes(script, ["proxyctl", "exec", "bash", "prox"], tmp_path) == ["proxy.conf"]
    # An option's value is no subcommand: `--config ca` does not make `ca` the command.
    assert "--check" in bash_completes(script, ["proxyctl", "serve", "--config", "ca", "--"], tmp_path)


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_offers_the_same(tmp_path):
    script = tmp_path / "proxyctl.fish"
    script.write_text(proxyctl("completion", "fish"))
    assert subprocess.run(["fish", "--no-execute", str(script)], timeout=30).returncode == 0

    def fish(line: str) -> list[str]:
        done = subprocess.run(["fish", "--no-config", "-c", f"source {script}; complete -C '{line}'"],
                              capture_output=True, text=True, timeout=30, env=clean_env())
        assert done.returncode == 0, done.stderr
        return [entry.split("\t")[0] for entry in done.stdout.splitlines()]

    assert {"init", "serve", "ca", "completion"} <= set(fish("proxyctl "))
    assert set(fish("proxyctl serve --")) == commands_and_flags()["serve"][0]
    assert fish("proxyctl ca ") == ["export", "init", "show"]
    assert fish("proxyctl ca export --format ") == ["pem", "pkcs12"]
    assert "--force" in fish("proxyctl ca init --") and "--issuer" not in fish("proxyctl ca init --")


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_script_parses(tmp_path):
    script = tmp_path / "_proxyctl"
    script.write_text(proxyctl("completion", "zsh"))
    assert script.read_text().startswith("#compdef proxyctl\n")
    done = subprocess.run(["zsh", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_the_manual_names_every_command_and_flag_help_names(tmp_path):
    page = tmp_path / "proxyctl.1"
    page.write_text(proxyctl("help", "--man"))
    warnings = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", str(page)], capture_output=True, text=True,
                              timeout=30)
    assert warnings.returncode == 0 and warnings.stderr == "", warnings.stderr
    # Each command's section (.SS, its usage line) holds every flag and argument its --help lists.
    sections: dict[str, str] = {}
    for part in page.read_text().replace("\\-", "-").split("\n.SS ")[1:]:
        heading = part.split("\n", 1)[0]
        words = re.match(r"proxyctl((?: [a-z][a-z-]*)*)", heading).group(1).strip()
        sections[words] = part
    top = page.read_text().replace("\\-", "-").split("\n.SH COMMANDS")[0]
    for command, (flags, arguments) in commands_and_flags().items():
        if command == "":
            text = top
        else:
            assert command in sections, (command, sorted(sections))
            text = sections[command]
            # -h, --help is in every --help; the manual says it once, among proxyctl's own options.
            assert "--help" in flags and "every subcommand" in top
            flags = flags - {"--help"}
        for name in flags | arguments:
            assert name in text, (command, name)
    rendered = subprocess.run(["man", "-l", str(page)], capture_output=True, text=True, timeout=30,
                              env=clean_env(MANWIDTH="100"))
    plain = re.sub(".\b", "", rendered.stdout).replace("‐", "-")  # no overstrike, no typographic hyphen
    assert rendered.returncode == 0 and "proxyctl exec [--config <file>]" in plain, plain
