"""The sidecar image (Containerfile, docs/sidecar.md) built from the package and run with podman as the docs lay it
out: a pod whose containers share one network namespace, proxyctl in one with its state volume, a shared volume
for the CA bundle and the client secret mounted as a secret; an app container beside it whose curl reaches a
protected origin through the sidecar. The origin sees the token (client credentials: nobody signs in), the bundle
appears on the shared volume, /healthz and /metrics answer, and SIGTERM ends proxyctl with exit 0.

scripts/test runs this module as a step of its own ("container image") with PROXYCTL_IMAGE (the image built from
Containerfile) and PROXYCTL_APP_IMAGE (Debian with curl, Tests/integration/container/app.Containerfile); without
them it is skipped. The pod uses the host's network (what podman can do on these machines:
../shared/tools/containers-here), so the proxy's and the admin listener's ports are free ones rather than 8080 and
9464; the provider and the origin run on the host's loopback."""
from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

import pytest

from fixtures import config
from fixtures.http import free_port
from fixtures.jose import unverified_claims
from fixtures.proxy import poll
from idp_fake import FakeIdP
from resource_server import ResourceServer

IMAGE = os.environ.get("PROXYCTL_IMAGE")
APP_IMAGE = os.environ.get("PROXYCTL_APP_IMAGE")

pytestmark = pytest.mark.skipif(not IMAGE or not APP_IMAGE, reason="scripts/test's container image step sets "
                                "PROXYCTL_IMAGE and PROXYCTL_APP_IMAGE")


def podman(*words: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *words], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check:
        assert done.returncode == 0, f"podman {' '.join(words)}: {done.stderr}"
    return done


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


class Pod:
    """The pod of the test and what belongs to it (volumes, a secret), all removed at the end."""

    def __init__(self, name: str):
        self.name = name
        self.state = f"{name}-state"
        self.shared = f"{name}-shared"
        self.secret = f"{name}-client-secret"

    def close(self) -> None:
        podman("pod", "rm", "--force", "--time", "5", self.name, check=False)
        podman("volume", "rm", "--force", self.state, self.shared, check=False)
        podman("secret", "rm", self.secret, check=False)


def test_the_sidecar_scenario(tmp_path):
    secret = "pod-secret-" + os.urandom(8).hex()
    provider = FakeIdP(access_token_format="jwt", client_secret=secret).start()
    api = ResourceServer(tmp_path / "api", ["api.test"])
    pod = Pod(f"proxyctl-test-{os.getpid()}-{os.urandom(3).hex()}")
    try:
        api.trust(provider.issuer, provider.url("jwks"))
        listen, admin = free_port(), free_port()
        # The pod: one network namespace (the host's, here).
        podman("pod", "create", "--name", pod.name, "--network", "host")
        podman("volume", "create", pod.state)
        podman("volume", "create", pod.shared)
        secret_file = tmp_path / "client-secret"
        secret_file.write_text(secret + "\n")
        podman("secret", "create", pod.secret, str(secret_file))
        # `resolve` stands in for the cluster's DNS: the API's name on the host's loopback (with the host's network,
        # podman keeps the host's /etc/hosts).
        proxy_conf = (config.proxy(resolve="api.test=127.0.0.1")
                      + config.provider("corp", provider.issuer, grant="client_credentials",
                                      token_endpoint_auth_method="client_secret_basic",
                                      client_secret_file="/run/secrets/client-secret", scopes="api")
                      + config.origin(f"https://api.test:{api.port}", "corp", ca_file="/etc/proxyctl/api-ca.pem"))
        podman("run", "--detach", "--pod", pod.name, "--name", f"{pod.name}-proxyctl",
               "--volume", f"{pod.state}:/var/lib/proxyctl", "--volume", f"{pod.shared}:/shared",
               "--volume", f"{api.ca_pem}:/etc/proxyctl/api-ca.pem:ro",
               "--secret", f"{pod.secret},type=mount,target=client-secret,uid=10001,mode=0400",
               "--env", f"PROXYCTL_CONFIG_TEXT={proxy_conf}",
               "--env", f"PROXYCTL_LISTEN=127.0.0.1:{listen}", "--env", f"PROXYCTL_ADMIN_LISTEN=127.0.0.1:{admin}",
               IMAGE)
        sidecar = f"{pod.name}-proxyctl"

        def logs() -> str:
            done = podman("logs", sidecar, check=False)
            return done.stdout + done.stderr

        def healthy() -> bool:
            try:
                return get(f"http://127.0.0.1:{admin}/healthz")[0] == 200
            except OSError:
                return False

        poll(healthy, 30, interval=0.2, message="the sidecar's /healthz")
        bundle = Path(podman("volume", "inspect", "--format", "{{.Mountpoint}}", pod.shared).stdout.strip())
        bundle /= "proxyctl-ca.pem"
        assert bundle.is_file(), logs()
        assert bundle.read_text().count("BEGIN CERTIFICATE") > 1  # the system roots and the local CA

        # The app: another container of the pod, another user, the proxy and the bundle from the environment.
        app = podman("run", "--rm", "--pod", pod.name, "--user", "20000:20000",
                     "--volume", f"{pod.shared}:/shared:ro",
                     "--env", f"HTTPS_PROXY=http://127.0.0.1:{listen}",
                     "--env", "SSL_CERT_FILE=/shared/proxyctl-ca.pem", APP_IMAGE,
                     "curl", "-sS", "-w", "\nSTATUS %{http_code}", api.url("/me"), check=False)
        assert app.returncode == 0 and "STATUS 200" in app.stdout, app.stdout + app.stderr + logs()
        seen = api.since(0)[-1]
        assert seen.error is None and seen.token, seen
        assert unverified_claims(seen.token)["iss"] == provider.issuer
        assert provider.client_auth_methods[-1] == "client_secret_basic"

        status, metrics = get(f"http://127.0.0.1:{admin}/metrics")
        assert status == 200 and 'proxyctl_tokens_attached_total{provider="corp"} 1' in metrics, metrics
        assert 'proxyctl_requests_total{kind="intercepted",status_class="2xx"} 1' in metrics, metrics
        lines = [json.loads(line) for line in logs().splitlines() if line.startswith("{")]
        assert lines, logs()  # the image logs JSON
        assert secret not in logs() and seen.token not in logs()

        podman("kill", "--signal", "TERM", sidecar)
        exit_code = podman("wait", sidecar, timeout=60).stdout.strip()
        assert exit_code == "0", logs()
    finally:
        pod.close()
        api.close()
        provider.stop()

