"""Memory and descriptors: a slow reader must not make the proxy buffer the download, a thousand tunnels must
fit, and a client that vanishes mid-transfer must leave nothing behind."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from fixtures.content import MiB, expected_sha256, generate
from fixtures.http import Reader, open_tunnel, reset_close
from fixtures.proxy import SANITIZER, poll


SIZE = 256 * MiB
RATE = 4 * MiB  # bytes per second while reading slowly
SLOW_SECONDS = 5.0
RSS_GROWTH_LIMIT_KIB = 32 * 1024


def open_download(proxy, mode: str, http_origin, https_origin, cert, size: int):
    """Starts GET /gen/size through the proxy (tunnel + TLS, or plain absolute-form); returns (socket, reader)
    positioned at the start of the body."""
    if mode == "tunnel":
        raw, _, answer = open_tunnel(proxy.port, f"localhost:{https_origin.port}")
        assert answer.status == 200
        sock = cert.client_context().wrap_socket(raw, server_hostname="localhost")
        sock.sendall(f"GET /gen/{size} HTTP/1.1\r\nHost: localhost:{https_origin.port}\r\n\r\n".encode())
    else:
        sock = proxy.connect()
        sock.sendall(f"GET {http_origin.url(f'/gen/{size}')} HTTP/1.1\r\nHost: {http_origin.authority}\r\n\r\n"
                     .encode())
    reader = Reader(sock, timeout=30)
    response = reader.read_head()
    assert response.status == 200
    assert int(response.header("content-length")) == size
    return sock, reader


@pytest.mark.heavy
@pytest.mark.skipif(SANITIZER is not None,
                    reason="a sanitizer's quarantine keeps freed buffers; the release binary's run checks the bound")
@pytest.mark.parametrize("mode", ["tunnel", "plain"])
def test_slow_reader_keeps_rss_bounded(mode, proxy, http_origin, https_origin, cert, record_property):
    """The origin can send 256 MiB in well under a second; the client reads at 4 MB/s. For SLOW_SECONDS the
    proxy has every chance to buffer the download if it ignored backpressure; its RSS must not grow by more
    than 32 MiB. Then the rest is read at full speed and the SHA-256 checked, so the whole 256 MiB crosses."""
    baseline = proxy.rss_kib()
    sock, reader = open_download(proxy, mode, http_origin, https_origin, cert, SIZE)
    digest = hashlib.sha256()
    received = 0
    peak = baseline
    started = time.monotonic()
    next_sample = started
    while time.monotonic() - started < SLOW_SECONDS:
        # Pace: never ahead of RATE.
        allowed = int((time.monotonic() - started) * RATE) - received
        if allowed <= 0:
            time.sleep(0.01)
        else:
            data = reader.read_some(min(allowed, 64 * 1024))
            assert data, "the download ended early"
            digest.update(data)
            received += len(data)
        if time.monotonic() >= next_sample:
            peak = max(peak, proxy.rss_kib())
            next_sample += 0.1
    peak = max(peak, proxy.rss_kib())
    slow_bytes = received
    while received < SIZE:
        data = reader.read_some(min(SIZE - received, MiB))
        assert data, f"the download ended after {received} bytes"
        digest.update(data)
        received += len(data)
    sock.close()
    growth = peak - baseline
    record_property("rss_growth_kib", growth)
    print(f"\n{mode}: RSS baseline {baseline} KiB, peak {peak} KiB, growth {growth} KiB "
          f"while {slow_bytes} bytes were read slowly")
    assert digest.hexdigest() == expected_sha256(SIZE)
    assert growth < RSS_GROWTH_LIMIT_KIB, f"RSS grew by {growth} KiB behind a slow reader"


TUNNELS = 1000


@pytest.mark.heavy
def test_a_thousand_concurrent_tunnels(proxy, record_property):
    baseline_rss = proxy.rss_kib()
    baseline_fds = proxy.fd_count()

    async def scenario():
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0, backlog=4096)
        port = server.sockets[0].getsockname()[1]
        opening = asyncio.Semaphore(200)

        async def open_one(index: int):
            async with opening:
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                writer.write(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head
                payload = f"tunnel {index} first;".encode() * 8
                writer.write(payload)
                assert await reader.readexactly(len(payload)) == payload
                return reader, writer

        async with server:
            tunnels = await asyncio.wait_for(asyncio.gather(*(open_one(i) for i in range(TUNNELS))), 90)
            # All open at once now: every one still carries its own bytes.
            open_rss = proxy.rss_kib()
            open_fds = proxy.fd_count()

            async def second(index: int):
                reader, writer = tunnels[index]
                payload = f"tunnel {index} second;".encode() * 8
                writer.write(payload)
                assert await reader.readexactly(len(payload)) == payload

            await asyncio.wait_for(asyncio.gather(*(second(i) for i in range(TUNNELS))), 60)
            for _, writer in tunnels:
                writer.close()
            await asyncio.gather(*(writer.wait_closed() for _, writer in tunnels), return_exceptions=True)
        return open_rss, open_fds

    open_rss, open_fds = asyncio.run(scenario())
    per_tunnel = (open_rss - baseline_rss) / TUNNELS
    record_property("rss_per_tunnel_kib", round(per_tunnel, 1))
    print(f"\n{TUNNELS} tunnels: RSS {baseline_rss} -> {open_rss} KiB ({per_tunnel:.1f} KiB per tunnel), "
          f"descriptors {baseline_fds} -> {open_fds}")
    assert open_fds >= baseline_fds + 2 * TUNNELS
    assert per_tunnel < 1024, "more than 1 MiB of RSS per idle tunnel"
    poll(lambda: proxy.fd_count() <= baseline_fds, 30, message="the tunnels' descriptors to be released")
    proxy.wait_log(r"CONNECT 127\.0\.0\.1:\d+ status=200", count=TUNNELS, timeout=30)


def warm_up(proxy, http_origin, https_origin, cert):
    """One complete request and one complete tunnel, so lazily created resources exist before the count."""
    sock, reader = open_download(proxy, "plain", http_origin, https_origin, cert, 1000)
    reader.read_exact(1000)
    sock.close()
    sock, reader = open_download(proxy, "tunnel", http_origin, https_origin, cert, 1000)
    reader.read_exact(1000)
    sock.close()


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("mode", ["tunnel", "plain"])
def test_client_vanishing_mid_download_frees_everything(mode, how, proxy, http_origin, https_origin, cert):
    warm_up(proxy, http_origin, https_origin, cert)
    baseline = proxy.settled_fd_count()
    mark = proxy.mark()
    sock, reader = open_download(proxy, mode, http_origin, https_origin, cert, SIZE)
    got = 0
    while got < 4 * MiB:
        got += len(reader.read_some(MiB))
    assert proxy.fd_count() >= baseline + 2
    if how == "reset":
        reset_close(sock)  # the TCP socket under TLS: no close_notify, just an RST
    else:
        sock.close()
    poll(lambda: proxy.fd_count() <= baseline, 15,
         message=f"descriptors back to {baseline} (now {proxy.fd_count()})")
    # The aborted transfer is still logged, with what was moved.
    line = proxy.wait_log(r"(CONNECT localhost|GET http://127\.0\.0\.1):\d+\S* status=200 up=\d+ down=(\d+)",
                          since=mark)[0]
    assert 4 * MiB <= int(line.group(2)) < SIZE


@pytest.mark.parametrize("mode", ["tunnel", "plain"])
def test_client_vanishing_mid_upload_frees_everything(mode, proxy, http_origin, https_origin, cert):
    warm_up(proxy, http_origin, https_origin, cert)
    baseline = proxy.settled_fd_count()
    if mode == "tunnel":
        raw, _, answer = open_tunnel(proxy.port, f"localhost:{https_origin.port}")
        assert answer.status == 200
        sock = cert.client_context().wrap_socket(raw, server_hostname="localhost")
        sock.sendall(f"PUT /upload HTTP/1.1\r\nHost: localhost:{https_origin.port}\r\n"
                     f"Content-Length: {SIZE}\r\n\r\n".encode())
    else:
        sock = proxy.connect()
        sock.sendall(f"PUT {http_origin.url('/upload')} HTTP/1.1\r\nHost: {http_origin.authority}\r\n"
                     f"Content-Length: {SIZE}\r\n\r\n".encode())
    sent = 0
    for block in generate(8 * MiB):
        sock.sendall(block)
        sent += len(block)
    reset_close(sock)
    poll(lambda: proxy.fd_count() <= baseline, 15,
         message=f"descriptors back to {baseline} (now {proxy.fd_count()})")
