"""256 MiB each way with curl, through a CONNECT tunnel (https://) and as absolute-form plain HTTP."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from fixtures.content import MiB, expected_sha256, write_generated
from fixtures.proxy import clean_env


SIZE = 256 * MiB


@pytest.fixture(scope="module")
def upload_file(tmp_path_factory):
    return write_generated(tmp_path_factory.mktemp("upload") / "upload.bin", SIZE)


def curl_sha256(args: list[str], timeout: float = 120) -> tuple[str, int, bytes]:
    """Runs curl writing the body to stdout and hashes it as it streams; returns (sha256, size, stderr)."""
    process = subprocess.Popen(["curl", "-sS", "--fail", *args, "-o", "-"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=clean_env())
    digest = hashlib.sha256()
    size = 0
    while True:
        block = process.stdout.read(MiB)
        if not block:
            break
        digest.update(block)
        size += len(block)
    stderr = process.stderr.read()
    assert process.wait(timeout) == 0, stderr
    return digest.hexdigest(), size, stderr


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["tunnel", "plain"])
def test_download_256MiB(mode, proxy, http_origin, https_origin, cert):
    origin = https_origin if mode == "tunnel" else http_origin
    url = origin.url(f"/gen/{SIZE}", host="localhost")
    mark = proxy.mark()
    digest, size, _ = curl_sha256(["-x", proxy.url, "--cacert", str(cert.ca_pem), url])
    assert size == SIZE
    assert digest == expected_sha256(SIZE)
    if mode == "tunnel":
        line = proxy.wait_log(rf"CONNECT localhost:{origin.port} status=200 up=(\d+) down=(\d+)", since=mark)[0]
        assert int(line.group(2)) > SIZE  # TLS records add a little
    else:
        line = proxy.wait_log(rf"GET http://localhost:{origin.port}/gen/{SIZE} status=200 up=(\d+) down=(\d+)",
                              since=mark)[0]
        assert SIZE < int(line.group(2)) < SIZE + 1024  # the body and one response head


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["tunnel", "plain"])
def test_upload_256MiB(mode, proxy, http_origin, https_origin, cert, upload_file, curl):
    origin = https_origin if mode == "tunnel" else http_origin
    # -T streams the file from disk (PUT); curl sends Expect: 100-continue, so the interim 100 travels too.
    result = curl("--fail", "-x", proxy.url, "--cacert", str(cert.ca_pem), "-T", str(upload_file),
                  origin.url("/upload", host="localhost"), timeout=120)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["size"] == SIZE
    assert answer["sha256"] == expected_sha256(SIZE)
