"""Proxy authentication on a listener other machines can reach."""

from __future__ import annotations

import base64
import uuid

import pytest
import requests

from fixtures.http import Reader, Response, basic
from fixtures.proxy import run_proxyctl


USER, PASSWORD = "alice", "Wonderland-Pa55w0rd"
OTHER_USER, OTHER_PASSWORD = "bob", "Another-S3cret"


def token() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture
def auth_file(tmp_path):
    path = tmp_path / "proxy-users"
    path.write_text(f"{USER}:{PASSWORD}\n{OTHER_USER}:{OTHER_PASSWORD}\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def auth_proxy(proxy_factory, auth_file):
    proxy = proxy_factory(listen="0.0.0.0:0", proxy_auth_file=str(auth_file))
    assert proxy.listen_host == "0.0.0.0"
    return proxy


def secrets_in(text: str) -> list[str]:
    found = []
    for secret in (PASSWORD, OTHER_PASSWORD, "wrong-password"):
        if secret in text:
            found.append(secret)
    for user, password in ((USER, PASSWORD), (OTHER_USER, OTHER_PASSWORD), (USER, "wrong-password")):
        encoded = base64.b64encode(f"{user}:{password}".encode()).decode()
        if encoded in text:
            found.append(encoded)
    return found


def assert_407(response: Response) -> None:
    assert response.status == 407, response.head
    assert response.header("proxy-authenticate").startswith("Basic realm="), response.head
    assert response.header("proxy-status").startswith("proxyctl; error=http_request_denied")
    assert response.body.endswith(b"\n") and response.body.count(b"\n") == 1


@pytest.mark.parametrize("form", ["absolute", "connect"])
def test_no_credentials_is_407(form, auth_proxy, echo_origin):
    tag = token()
    raw = (f"GET {echo_origin.url('/noauth/' + tag)} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n\r\n"
           if form == "absolute" else f"CONNECT {echo_origin.authority} HTTP/1.1\r\nHost: {echo_origin.authority}"
                                      f"\r\n\r\n").encode()
    with auth_proxy.connect() as sock:
        sock.sendall(raw)
        assert_407(Reader(sock).read_response())
    assert echo_origin.requests_with(tag) == []


@pytest.mark.parametrize("password", ["wrong-password", ""])
def test_wrong_credentials_are_407(password, auth_proxy, echo_origin):
    with auth_proxy.connect() as sock:
        sock.sendall(f"GET {echo_origin.url('/wrong')} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n"
                     f"Proxy-Authorization: {basic(USER, password)}\r\n\r\n".encode())
        assert_407(Reader(sock).read_response())
    assert not secrets_in(auth_proxy.log())


def test_right_credentials_work_and_the_origin_never_sees_them(auth_proxy, echo_origin):
    tag = token()
    with auth_proxy.connect() as sock:
        reader = Reader(sock)
        # A client typically tries without credentials first, then again on the same connection.
        sock.sendall(f"GET {echo_origin.url('/auth/' + tag)} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n\r\n"
                     .encode())
        first = reader.read_response()
        assert_407(first)
        if first.header("connection") == "close":
            sock.close()
            sock = auth_proxy.connect()
            reader = Reader(sock)
        sock.sendall(f"GET {echo_origin.url('/auth/' + tag)} HTTP/1.1\r\nHost: {echo_origin.authority}\r\n"
                     f"Proxy-Authorization: {basic(USER, PASSWORD)}\r\nX-After: 1\r\n\r\n".encode())
        response = reader.read_response()
        sock.close()
    assert response.status == 200
    received = echo_origin.wait_request(tag)
    assert b"proxy-authorization" not in received.head.lower()
    assert b"X-After: 1\r\n" in received.head
    assert not secrets_in(auth_proxy.log())


def test_right_credentials_open_a_tunnel(auth_proxy, https_origin, cert, curl):
    for user, password in ((USER, PASSWORD), (OTHER_USER, OTHER_PASSWORD)):
        result = curl("--fail", "-x", f"http://{user}:{password}@127.0.0.1:{auth_proxy.port}",
                      "--cacert", str(cert.ca_pem), https_origin.url("/authed-tunnel", host="localhost"))
        assert result.returncode == 0, result.stderr
        assert result.stdout == b"origin GET /authed-tunnel\n"
    auth_proxy.wait_log(rf"CONNECT localhost:{https_origin.port} status=200", count=2)
    assert not secrets_in(auth_proxy.log())


def test_requests_with_credentials_in_the_proxy_url(auth_proxy, http_origin):
    with requests.Session() as session:
        session.trust_env = False
        session.proxies = {"http": f"http://{USER}:{PASSWORD}@127.0.0.1:{auth_proxy.port}"}
        with session.get(http_origin.url("/requests-auth"), timeout=20) as answer:
            assert answer.status_code == 200
    with requests.get(http_origin.url("/requests-noauth"), proxies={"http": auth_proxy.url}, timeout=20) as answer:
        assert answer.status_code == 407
    assert not secrets_in(auth_proxy.log())


def test_refuses_to_listen_on_all_interfaces_without_proxy_auth_file(tmp_path):
    conf = tmp_path / "open.conf"
    conf.write_text("[proxy]\nlog_level = info\n")
    result = run_proxyctl(tmp_path, "serve", "--config", str(conf), "--listen", "0.0.0.0:0")
    assert result.returncode == 1
    assert "proxy_auth_file" in result.stderr and "0.0.0.0" in result.stderr

    conf.write_text("[proxy]\nlog_level = info\nlisten = 0.0.0.0:0\n")
    result = run_proxyctl(tmp_path, "serve", "--config", str(conf))
    assert result.returncode == 1
    assert f"{conf}:3:" in result.stderr and "proxy_auth_file" in result.stderr


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_refuses_an_auth_file_others_can_read(mode, tmp_path, auth_file):
    auth_file.chmod(mode)
    conf = tmp_path / "auth.conf"
    conf.write_text(f"[proxy]\nlisten = 0.0.0.0:0\nproxy_auth_file = {auth_file}\n")
    result = run_proxyctl(tmp_path, "serve", "--config", str(conf))
    assert result.returncode == 1
    assert "chmod 600" in result.stderr and str(auth_file) in result.stderr
    assert PASSWORD not in result.stderr + result.stdout
