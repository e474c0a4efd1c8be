"""Real Python HTTP clients through the proxy: requests and httpx, configured by parameter and by environment."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
import requests

from fixtures.content import MiB, expected_sha256, generate


SIZE = 8 * MiB + 1


@pytest.fixture
def proxy_env(monkeypatch, proxy):
    """HTTP_PROXY and HTTPS_PROXY point at the proxy; nothing excludes loopback."""
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    return proxy


def check_download(body: bytes) -> None:
    assert len(body) == SIZE
    assert hashlib.sha256(body).hexdigest() == expected_sha256(SIZE)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_requests_with_proxies_parameter(scheme, proxy, http_origin, https_origin, cert):
    origin = https_origin if scheme == "https" else http_origin
    mark = proxy.mark()
    with requests.Session() as session:
        session.trust_env = False
        with session.get(origin.url(f"/gen/{SIZE}", host="localhost"), proxies={scheme: proxy.url},
                         verify=str(cert.ca_pem), timeout=30) as answer:
            assert answer.status_code == 200
            check_download(answer.content)
        upload = b"".join(generate(2 * MiB))
        with session.post(origin.url("/upload", host="localhost"), data=upload, proxies={scheme: proxy.url},
                          verify=str(cert.ca_pem), timeout=30) as answer:
            assert answer.json()["sha256"] == hashlib.sha256(upload).hexdigest()
    if scheme == "http":
        proxy.wait_log(rf"GET http://localhost:{http_origin.port}/gen/{SIZE} status=200", since=mark)
        proxy.wait_log(rf"POST http://localhost:{http_origin.port}/upload status=200", since=mark)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_requests_with_proxy_environment(scheme, proxy_env, http_origin, https_origin, cert):
    origin = https_origin if scheme == "https" else http_origin
    mark = proxy_env.mark()
    baseline_fds = proxy_env.fd_count()
    with requests.Session() as session:  # trust_env is on: the proxy comes from HTTP_PROXY / HTTPS_PROXY
        with session.get(origin.url(f"/gen/{SIZE}?chunked=1", host="localhost"), verify=str(cert.ca_pem),
                         timeout=30) as answer:
            assert answer.status_code == 200
            check_download(answer.content)
        # Proof that it went through the proxy: a request line in its log, or for https the tunnel that
        # the session keeps open (the client's connection and the one to the origin).
        if scheme == "http":
            proxy_env.wait_log(rf"GET http://localhost:{http_origin.port}/gen/{SIZE}\?\.\.\. status=200",
                               since=mark)
        else:
            assert proxy_env.fd_count() >= baseline_fds + 2


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_httpx_with_proxy_parameter(scheme, proxy, http_origin, https_origin, cert):
    origin = https_origin if scheme == "https" else http_origin
    with httpx.Client(proxy=proxy.url, verify=str(cert.ca_pem), trust_env=False, timeout=30) as client:
        digest = hashlib.sha256()
        size = 0
        with client.stream("GET", origin.url(f"/gen/{SIZE}", host="localhost")) as answer:
            assert answer.status_code == 200
            for block in answer.iter_bytes():
                digest.update(block)
                size += len(block)
        assert size == SIZE and digest.hexdigest() == expected_sha256(SIZE)
        answer = client.post(origin.url("/upload", host="localhost"), content=generate(3 * MiB))
        assert answer.status_code == 200
        # httpx streams a generator body with chunked framing.
        assert json.loads(answer.content)["sha256"] == expected_sha256(3 * MiB)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_httpx_with_proxy_environment(scheme, proxy_env, http_origin, https_origin, cert):
    origin = https_origin if scheme == "https" else http_origin
    mark = proxy_env.mark()
    with httpx.Client(verify=str(cert.ca_pem), trust_env=True, timeout=30) as client:
        for index in range(3):
            answer = client.get(origin.url(f"/httpx-env/{index}", host="localhost"))
            assert answer.status_code == 200
            assert answer.text == f"origin GET /httpx-env/{index}\n"
    if scheme == "http":
        proxy_env.wait_log(rf"GET http://localhost:{http_origin.port}/httpx-env/\d status=200", since=mark, count=3)
    else:
        proxy_env.wait_log(rf"CONNECT localhost:{https_origin.port} status=200", since=mark)
