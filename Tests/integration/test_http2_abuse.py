"""HTTP/2 abuse (issue 12): the known denial-of-service shapes, sent frame by frame on the TLS connection a
client opens through the proxy's CONNECT tunnel to a protected origin. Each ends the abusing connection (or
stream) after a bounded amount of work, with the error code RFC 9113 names (or the one nghttp2 chose, said
where it differs), while other clients are served meanwhile and after, and the proxy's memory stays flat.

The proxy runs nghttp2 as the server session; the limits under test are the ones H2Driver sets: rapid reset
(CVE-2023-44487) a token bucket of 200 RST_STREAMs refilled at 50/s, CONTINUATION flood (CVE-2024-27316) at
most 8 CONTINUATION frames per header block, outbound ACKs (PING and SETTINGS floods) at most 1000 queued,
at most 32 entries per SETTINGS frame, SETTINGS_MAX_CONCURRENT_STREAMS 100, SETTINGS_MAX_HEADER_LIST_SIZE
max_header_bytes (65,536), 1 MiB stream windows, a 16 MiB connection window, 256 KiB of response bytes per
stream before the upstream transfer pauses.

The client is `RawH2` below: frames and HPACK by hand (so nothing stops it from misbehaving), its own
flow-control bookkeeping, hyperframe-free. Memory bounds are asserted for the release binary only: with
AddressSanitizer the quarantine keeps freed blocks, so there the figures are recorded, not judged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import hpack
import pytest

from fixtures import config
from fixtures.content import MiB, expected_sha256
from fixtures.deployment import Deployment, Workspace
from fixtures.http import Reader
from fixtures.proxy import SANITIZER, clean_env, poll
from idp_fake import FakeIdP
from resource_server import ResourceServer

API = "api.test"
SCOPES = "openid profile email"
# What the proxy's memory may grow by during one abuse (release build): flat, with room for the allocator.
RSS_GROWTH_LIMIT_KIB = 16 * 1024

# RFC 9113 §7 error codes.
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 0x5, 0x6, 0x7, 0x8, 0xB
# Frame types and flags (RFC 9113 §6).
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8, 0x9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x3, 0x4, 0x6


# MARK: - Module fixtures: the fake provider, the resource server, one signed-in proxy


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("http2-abuse")


@pytest.fixture(scope="module")
def fake():
    with FakeIdP(access_token_format="jwt") as idp:
        yield idp


@pytest.fixture(scope="module")
def rs(module_dir, fake):
    server = ResourceServer(module_dir / "rs", [API])
    server.trust(fake.issuer, fake.url("jwks"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def deployment(module_dir, fake, rs):
    sections = (config.provider("fake", fake.issuer, scopes=SCOPES, redirect_port=0)
                + config.origin(f"https://{API}:{rs.port}", "fake", ca_file=rs.ca_pem, client_authorization="keep"))
    ws = Workspace(module_dir / "main", sections, f"{API}=127.0.0.1")
    ws.ca_init()
    ws.login_fake("fake")
    deployment = Deployment(ws, ws.start_proxy())
    yield deployment
    failure = deployment.stop()
    assert failure is None, failure


@pytest.fixture
def short_keepalive(deployment, tmp_path):
    """A second proxy on the module's state directory with keepalive_timeout 2s: an HTTP/2 connection without
    a stream in flight gets GOAWAY(NO_ERROR) 2 s after its last stream ended, so a stream the proxy failed to
    forget shows as a connection that never goes idle."""
    ws = Workspace(tmp_path / "own", deployment.ws.sections, deployment.ws.resolve, state=deployment.ws.state,
                   keepalive_timeout="2s")
    own = Deployment(ws, ws.start_proxy())
    yield own
    failure = own.stop()
    assert failure is None, failure


class Rss:
    """The proxy's RSS while a block runs: the baseline before it, the peak sampled every 20 ms."""

    def __init__(self, deployment: Deployment, record_property, name: str = "rss_growth_kib"):
        self.proxy = deployment.proxy
        self.record_property = record_property
        self.name = name
        self.baseline = self.peak = 0
        self.stop = threading.Event()

    def sample(self):
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, self.proxy.rss_kib())

    def __enter__(self):
        self.baseline = self.peak = self.proxy.rss_kib()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)
        self.peak = max(self.peak, self.proxy.rss_kib())
        self.record_property(self.name, self.growth)

    @property
    def growth(self) -> int:
        return self.peak - self.baseline

    def assert_flat(self, limit_kib: int = RSS_GROWTH_LIMIT_KIB):
        print(f"\nRSS baseline {self.baseline} KiB, peak {self.peak} KiB, growth {self.growth} KiB")
        if SANITIZER is None:
            assert self.growth < limit_kib, f"RSS grew by {self.growth} KiB (baseline {self.baseline} KiB)"


class HeldDownload:
    """Another client's download in flight during an abuse: a RawH2 connection of its own whose response is
    held by flow control (no WINDOW_UPDATE) until `finish()` takes the rest and checks every byte."""

    def __init__(self, deployment: Deployment, rs: ResourceServer, size: int = 8 * MiB):
        self.size = size
        self.client = RawH2(deployment, rs.authority(), auto_window=False)
        self.client.handshake()
        self.stream = self.client.open(f"/download/{size}")
        self.client.answers[self.stream].keep = False
        answer = self.client.answers[self.stream]
        self.client.wait(lambda: answer.headers, message="the held download's response head")
        assert answer.status == 200, answer

    def finish(self):
        answer = self.client.release(self.stream)
        self.client.close()
        assert answer.reset is None and answer.received == self.size, answer
        assert answer.digest.hexdigest() == expected_sha256(self.size)


def seen_by(rs: ResourceServer, mark: int, *prefixes: str) -> list:
    """The requests the origin received since `mark` whose path starts with one of `prefixes` (a test's own)."""
    return [s for s in rs.since(mark) if s.path.startswith(prefixes)]


def served(deployment: Deployment, rs: ResourceServer, path: str = "/served") -> None:
    """A new HTTP/2 connection gets its request answered."""
    with RawH2(deployment, rs.authority()) as client:
        answer = client.request(path)
        assert answer.status == 200, answer


# MARK: - Rapid reset (CVE-2023-44487)


def test_rapid_reset_ends_the_connection_with_goaway(deployment, rs, record_property):
    """10,000 HEADERS+RST_STREAM pairs as fast as the socket takes them: nghttp2's reset budget (a burst of
    200) runs out and the proxy answers GOAWAY(INTERNAL_ERROR, nghttp2's choice of code) naming a last stream
    near the 200th, then closes. The reset requests do not reach the origin (each is reset in the read that
    opened it; a read that splits a pair may let one start: at most the streams the GOAWAY accepted); a
    download in flight on another connection goes on and ends intact; memory stays flat."""
    mark, seen = deployment.proxy.mark(), rs.mark()
    held = HeldDownload(deployment, rs)
    with Rss(deployment, record_property) as rss, RawH2(deployment, rs.authority()) as attacker:
        attacker.handshake()
        block = request_block(attacker.authority, "/flood")
        pairs = 0
        while pairs < 10_000:
            batch = bytearray()
            for _ in range(500):
                stream = attacker.take_stream_id()
                batch += frame(HEADERS, END_HEADERS | END_STREAM, stream, block) + rst_stream(stream, CANCEL)
            if not attacker.send(bytes(batch)):
                break
            pairs += 500
        assert attacker.wait_closed(30), "the flooding connection was not closed"
    assert attacker.goaway is not None, "no GOAWAY before the close"
    last, code, _ = attacker.goaway
    assert code == INTERNAL_ERROR, attacker.goaway
    # Client streams are odd: stream n is the (n + 1) / 2-th of the flood. The budget is 200, refilled at 50/s.
    assert (last + 1) // 2 < 1000, f"the GOAWAY came only after stream {last}"
    record_property("rapid_reset_streams_accepted", (last + 1) // 2)
    upstream = len(seen_by(rs, seen, "/flood"))
    record_property("rapid_reset_requests_upstream", upstream)
    assert upstream <= (last + 1) // 2
    held.finish()
    served(deployment, rs, "/after-rapid-reset")
    rss.assert_flat()
    assert "crash" not in deployment.proxy.log_since(mark).lower()


def test_reset_streams_leave_nothing_behind(short_keepalive, rs):
    """150 HEADERS+RST_STREAM pairs (below the reset budget), each pair in one write, so that nghttp2 closes
    each stream in the same read that opened it; half of them for another authority (a request the proxy would
    answer itself). Then a real request. Once it is answered the connection has no stream in flight, so it
    must get GOAWAY(NO_ERROR) at keepalive_timeout (2 s): a stream the proxy kept in its books would hold the
    connection open (it did: the streams reset before the proxy looked at them stayed in flight forever). No
    reset request reached the origin."""
    seen = rs.mark()
    with RawH2(short_keepalive, rs.authority()) as client:
        client.handshake()
        for index in range(150):
            stream = client.take_stream_id()
            authority = client.authority if index % 2 else "other.test:443"
            client.send(frame(HEADERS, END_HEADERS | END_STREAM, stream, request_block(authority, "/reset-at-once"))
                        + rst_stream(stream, CANCEL))
        answer = client.request("/real")
        assert answer.status == 200, answer
        ended = time.monotonic()
        assert client.wait_closed(15), "the connection was never closed for being idle"
        assert client.goaway is not None and client.goaway[1] == NO_ERROR, client.goaway
        assert time.monotonic() - ended < 10
    assert [s.path for s in seen_by(rs, seen, "/real", "/reset-at-once")] == ["/real"]


# MARK: - CONTINUATION flood (CVE-2024-27316)


@pytest.mark.parametrize("continuations", [8, 9])
def test_a_header_block_may_take_eight_continuation_frames(deployment, rs, continuations):
    """A header block split over HEADERS and 8 CONTINUATION frames is a request like any other; with a ninth
    CONTINUATION the proxy ends the connection (nghttp2: too many CONTINUATION frames) without answering, and
    the request never reaches the origin."""
    mark, seen = deployment.proxy.mark(), rs.mark()
    with RawH2(deployment, rs.authority()) as client:
        client.handshake()
        fields = b"".join(literal(f"x-part-{i}".encode(), b"v" * 40) for i in range(continuations))
        block = request_block(client.authority, f"/continued/{continuations}", extra=fields)
        stream = client.take_stream_id()
        client.send(header_frames(stream, block, pieces=continuations + 1))
        if continuations == 8:
            answer = client.response(stream)
            assert answer.status == 200, answer
            origin = seen_by(rs, seen, "/continued/")
            assert len(origin) == 1 and origin[0].header("x-part-7") == "v" * 40
        else:
            assert client.wait_closed(20), "the connection stayed open after 9 CONTINUATION frames"
            assert not client.answers[stream].headers
            deployment.proxy.wait_log(r"h2 connection error: Too many CONTINUATION frames", since=mark)
            assert seen_by(rs, seen, "/continued/") == []


def test_continuation_flood_ends_the_connection(deployment, rs, record_property):
    """HEADERS without END_HEADERS, then CONTINUATION frames without end, 64 to a write (empty ones: no
    header bytes to count, only frames): the connection is closed after the ninth, so the flood stops at the
    socket buffers' worth of bytes; memory flat; another client's download goes on."""
    mark = deployment.proxy.mark()
    held = HeldDownload(deployment, rs)
    budget = 256 * MiB
    with Rss(deployment, record_property) as rss, RawH2(deployment, rs.authority()) as attacker:
        attacker.handshake()
        stream = attacker.take_stream_id()
        attacker.send(frame(HEADERS, END_STREAM, stream, request_block(attacker.authority, "/continuation-flood")))
        batch = frame(CONTINUATION, 0, stream) * 64
        sent = 0
        while sent < budget and attacker.send(batch):
            sent += len(batch)
        assert attacker.wait_closed(30)
    record_property("continuation_flood_bytes_sent", sent)
    assert sent < 32 * MiB, f"{sent} bytes of CONTINUATION frames were taken"
    deployment.proxy.wait_log(r"h2 connection error: Too many CONTINUATION frames", since=mark)
    held.finish()
    served(deployment, rs, "/after-continuation-flood")
    rss.assert_flat()


# MARK: - Header lists: HPACK bomb, too many bytes, too many fields


def test_hpack_bomb_is_refused_and_the_connection_goes_on(deployment, rs, record_property):
    """One 4,000-byte field enters the HPACK dynamic table, then the same header block references it 2,000
    times: 6 KB on the wire, 8 MB decoded, far beyond max_header_bytes. The stream gets 431 with Proxy-Status
    (as an HTTP/1.1 head over the limit does) and never reaches the origin; the connection's HPACK state is
    intact, so the next request on it can reference the entry once and is served with the field. Twenty bombs
    in a row leave memory flat."""
    seen = rs.mark()
    with Rss(deployment, record_property) as rss, RawH2(deployment, rs.authority()) as client:
        client.handshake()
        bomb = literal(b"x-bomb", b"b" * 4000, indexing=True) + indexed(62) * 2000
        answer = client.request("/bomb", extra=bomb)
        assert_too_large(answer)
        for _ in range(20):
            assert_too_large(client.request("/bomb", extra=indexed(62) * 2000))
        after = client.request("/after-bomb", extra=indexed(62))
        assert after.status == 200, after
    origin = seen_by(rs, seen, "/bomb", "/after-bomb")
    assert [s.path for s in origin] == ["/after-bomb"]
    assert origin[0].header("x-bomb") == "b" * 4000
    rss.assert_flat()


@pytest.mark.parametrize("shape", ["bytes", "fields"])
def test_a_header_list_over_the_limit_is_refused(deployment, rs, shape):
    """Plain literals: 20 fields of 4,000 bytes (80 KB, over max_header_bytes 65,536, sent as HEADERS and
    CONTINUATION frames) or 120 small fields (over max_headers 100) get 431 and never reach the origin; a list
    just under the limit (14 fields of 4,000 bytes) is passed on whole. The connection serves on."""
    seen = rs.mark()
    with RawH2(deployment, rs.authority()) as client:
        client.handshake()
        if shape == "bytes":
            over = b"".join(literal(f"x-big-{i}".encode(), b"a" * 4000) for i in range(20))
        else:
            over = b"".join(literal(f"x-many-{i}".encode(), b"a") for i in range(120))
        assert_too_large(client.request(f"/over/{shape}", extra=over))
        under = b"".join(literal(f"x-under-{i}".encode(), b"u" * 4000) for i in range(14))
        answer = client.request("/under", extra=under)
        assert answer.status == 200, answer
    origin = seen_by(rs, seen, "/over/", "/under")
    assert [s.path for s in origin] == ["/under"]
    assert all(origin[0].header(f"x-under-{i}") == "u" * 4000 for i in range(14))


def assert_too_large(answer: Answer):
    """The proxy's 431, as an HTTP/1.1 head over the limits gets it."""
    assert answer.status == 431, answer
    status = answer.headers["proxy-status"]
    assert status in ('proxyctl; error=http_request_error; details="header list larger than 65536 bytes"',
                      'proxyctl; error=http_request_error; details="more than 100 header fields"'), status
    assert answer.body.startswith(b"proxyctl: bad request: ")
    assert int(answer.headers["content-length"]) == len(answer.body)


# MARK: - Concurrent streams


def test_streams_beyond_the_limit_are_refused_before_the_settings_are_acknowledged(deployment, rs):
    """120 requests opened at once (bodies still to come, so all stay open) before the client has even read
    the server's SETTINGS: the 20 beyond SETTINGS_MAX_CONCURRENT_STREAMS 100 get RST_STREAM(REFUSED_STREAM),
    a stream error (RFC 9113 §5.1.2: safe to retry); the first 100 are answered once their bodies end, and only
    they reach the origin."""
    seen = rs.mark()
    with RawH2(deployment, rs.authority()) as client:
        streams = [client.open(f"/concurrent/{i}", method="POST", end_stream=False) for i in range(120)]
        client.handshake()
        assert client.server_settings[SETTINGS_MAX_CONCURRENT_STREAMS] == 100
        refused = streams[100:]
        client.wait(lambda: all(client.answers[s].reset is not None for s in refused), 30, "the refusals")
        assert {client.answers[s].reset for s in refused} == {REFUSED_STREAM}
        for stream in streams[:100]:
            client.send_body(stream, b"body", end_stream=True)
        client.wait(lambda: all(client.answers[s].ended for s in streams[:100]), 90, "100 answers")
        assert [client.answers[s].status for s in streams[:100]] == [200] * 100
        assert not client.closed and client.goaway is None
    paths = sorted(s.path for s in seen_by(rs, seen, "/concurrent/"))
    assert paths == sorted(f"/concurrent/{i}" for i in range(100))


def test_streams_beyond_the_acknowledged_limit_end_the_connection(deployment, rs):
    """The same once the client has acknowledged the SETTINGS: nghttp2 treats the 101st concurrent stream as a
    connection error, GOAWAY(PROTOCOL_ERROR) naming the 100th stream as the last (RFC 9113 §5.1.2 names a
    stream error, §5.4.1 lets an endpoint treat any stream error as a connection error: a client that ignores
    the limit it acknowledged loses the connection). The streams in flight end with it; at most those 100
    reached the origin; others are served."""
    seen = rs.mark()
    with RawH2(deployment, rs.authority()) as client:
        client.handshake()
        streams = [client.open(f"/acked/{i}", method="POST", end_stream=False) for i in range(101)]
        assert client.wait_closed(30)
        assert client.goaway is not None, "no GOAWAY"
        assert client.goaway[:2] == (streams[99], PROTOCOL_ERROR), client.goaway
        assert b"max concurrent streams" in client.goaway[2]
    assert len(seen_by(rs, seen, "/acked/")) <= 100
    served(deployment, rs, "/after-too-many-streams")


# MARK: - PING and SETTINGS floods


@pytest.mark.parametrize("kind", ["ping", "settings"])
def test_a_flood_from_a_client_that_never_reads_ends_the_connection(deployment, rs, kind, record_property):
    """PING (or empty SETTINGS) frames, 64 to a write, from a client that never reads (a 4 KiB receive
    buffer): every one asks for an ACK, which the proxy cannot write; once 1,000 wait the connection is
    closed (nghttp2: flooding detected) instead of queueing ACKs without end. Memory flat, another client's
    download goes on."""
    mark = deployment.proxy.mark()
    held = HeldDownload(deployment, rs)
    one = frame(PING, 0, 0, b"01234567") if kind == "ping" else frame(SETTINGS, 0, 0)
    batch = one * 64
    budget = 256 * MiB
    with Rss(deployment, record_property) as rss, RawH2(deployment, rs.authority(), rcvbuf=4096) as attacker:
        sent = 0
        while sent < budget and attacker.send(batch):
            sent += len(batch)
        assert attacker.send_error is not None, f"{sent} bytes of {kind} frames were all taken"
    record_property(f"{kind}_flood_bytes_sent", sent)
    deployment.proxy.wait_log(r"h2 connection error: Flooding was detected", since=mark)
    held.finish()
    served(deployment, rs, f"/after-{kind}-flood")
    rss.assert_flat()


# MARK: - Flow control: stalled and abandoned downloads


@pytest.mark.parametrize("stall", ["window", "socket"])
def test_a_stalled_download_keeps_memory_bounded(deployment, rs, stall, record_property):
    """A 64 MiB download the client does not take: `window`, it never sends WINDOW_UPDATE (the stream's 64 KiB
    window fills at once); `socket`, it opened every window wide (2 GiB) but never reads the socket (a 4 KiB
    receive buffer). The origin could send it all in a fraction of a second; for 3 s the proxy's memory must
    stay flat (at most 256 KiB pend per stream, then the upstream transfer pauses) while another client is
    served. Then the client takes the body: every byte arrives intact."""
    size = 64 * MiB
    if stall == "window":
        client = RawH2(deployment, rs.authority(), auto_window=False)
    else:
        client = RawH2(deployment, rs.authority(), settings={SETTINGS_INITIAL_WINDOW_SIZE: 2**31 - 1},
                       rcvbuf=4096)
        client.send(window_update(0, 2**31 - 1 - 65535))
    with client, Rss(deployment, record_property) as rss:
        if stall == "window":
            client.handshake()
        stream = client.open(f"/download/{size}")
        client.answers[stream].keep = False
        stalled = time.monotonic()
        served(deployment, rs, "/during-stall")
        while time.monotonic() - stalled < 3:
            time.sleep(0.1)
        rss_stalled = rss.peak
        answer = client.release(stream, timeout=120)
    assert answer.reset is None and answer.received == size, answer
    assert answer.digest.hexdigest() == expected_sha256(size)
    record_property("rss_growth_while_stalled_kib", rss_stalled - rss.baseline)
    rss.assert_flat()


def test_a_download_paced_by_the_stream_window_keeps_memory_bounded(deployment, rs, record_property):
    """32 MiB to a client that keeps the default 64 KiB stream window and gives back each DATA frame as it reads
    it, so the proxy always has bytes waiting for the window: its pending bytes for the stream stay under the
    high-water mark the whole way (they once grew with every byte the client took, 32 MiB here, because the
    stream's buffer was compacted only when it ran empty). Every byte arrives intact."""
    size = 32 * MiB
    with RawH2(deployment, rs.authority()) as client, Rss(deployment, record_property) as rss:
        client.handshake()
        stream = client.open(f"/download/{size}")
        client.answers[stream].keep = False
        answer = client.response(stream, timeout=120)
    assert answer.reset is None and answer.received == size, answer
    assert answer.digest.hexdigest() == expected_sha256(size)
    rss.assert_flat()


def test_a_stream_reset_mid_download_stops_the_upstream_transfer(short_keepalive, rs):
    """The client resets a 1 GiB download after 2 MiB: the proxy stops its transfer (the origin sees its
    connection closed mid-body), logs the exchange as aborted with the bytes it delivered, serves the next
    request on the same connection, and then holds nothing for the stream: the connection idles out at
    keepalive_timeout."""
    deployment = short_keepalive
    mark, seen = deployment.proxy.mark(), rs.mark()
    size = 1 << 30
    with RawH2(deployment, rs.authority()) as client:
        client.handshake()
        stream = client.open(f"/download/{size}")
        client.answers[stream].keep = False
        client.wait(lambda: client.answers[stream].received >= 2 * MiB, message="2 MiB of the download")
        client.send(rst_stream(stream, CANCEL))
        poll(lambda: seen_by(rs, seen, "/download/")[0].error, 30, message="the origin to see the cut")
        assert seen_by(rs, seen, "/download/")[0].error == "download cut short"
        line = deployment.lines(mark, needle=f"/download/{size} ", at_least=1)[0]
        assert 'note="aborted"' in line and line.endswith(f" h2={stream}"), line
        down = int(line.split(" down=")[1].split()[0])
        assert 2 * MiB <= down < size, line
        assert client.request("/after-reset").status == 200
        assert client.wait_closed(15) and client.goaway is not None and client.goaway[1] == NO_ERROR


def test_a_connection_error_mid_download_ends_the_exchange(deployment, rs):
    """A protocol error (WINDOW_UPDATE with increment 0) on a connection with a download in flight: GOAWAY
    (PROTOCOL_ERROR), the connection closes, the upstream transfer stops and the exchange is logged as aborted
    (the log once lost every stream of a connection the proxy closed itself)."""
    mark, seen = deployment.proxy.mark(), rs.mark()
    size = 1 << 30
    with RawH2(deployment, rs.authority()) as client:
        client.handshake()
        stream = client.open(f"/download/{size}")
        client.answers[stream].keep = False
        client.wait(lambda: client.answers[stream].received >= MiB, message="1 MiB of the download")
        client.send(window_update(0, 0))
        assert client.wait_closed(20)
        assert client.goaway is not None and client.goaway[1] == PROTOCOL_ERROR, client.goaway
    poll(lambda: seen_by(rs, seen, "/download/")[0].error, 30, message="the origin to see the cut")
    line = deployment.lines(mark, needle=f"/download/{size} ", at_least=1)[0]
    assert 'note="aborted"' in line, line


# MARK: - Request bodies the proxy no longer wants


def test_a_body_sent_after_the_answer_is_not_kept(deployment, rs):
    """A POST the proxy answers itself (421: the :authority is not the tunnel's) while its body is still
    coming: the client may finish sending (the windows keep opening, 8 MiB pass a 1 MiB stream window) but the
    bytes are dropped, not kept: the proxy holds no spool file for them (it once acknowledged and kept every
    byte, 200 MiB and more, in an unlinked file). The connection's window was given back for them: a 20 MiB
    upload (more than the 16 MiB connection window) on the same connection passes."""
    with RawH2(deployment, rs.authority()) as client:
        client.handshake()
        stream = client.take_stream_id()
        client.send(frame(HEADERS, END_HEADERS, stream, request_block("other.test:443", "/unwanted", "POST")))
        answer = client.answers[stream]
        client.wait(lambda: answer.headers, message="the 421")
        client.send_body(stream, b"z" * (8 * MiB - 1), end_stream=False)
        assert spooled_bytes(deployment) == 0
        client.send_body(stream, b"z", end_stream=True)
        client.response(stream)
        assert answer.status == 421 and answer.reset is None, answer
        assert int(answer.headers["content-length"]) == len(answer.body) > 0
        body = os.urandom(20 * MiB)
        after = client.request("/after-unwanted", method="POST", body=body)
        assert after.status == 200, after
        assert b'"body_size": %d' % len(body) in after.body


def test_reset_uploads_give_the_connection_window_back(deployment, rs):
    """64 uploads announced as 100 MB (more than replay_spool, so streamed to the origin and acknowledged
    only as the transfer takes them), each reset after 1 MiB (the stream's window): what the transfer had not
    taken yet must be given back to the connection's 16 MiB window. Every upload and then a 2 MiB one on the
    same connection pass; before, the window shrank with each reset until the connection could send nothing
    (stuck after some 30 resets)."""
    with RawH2(deployment, rs.authority()) as client:
        client.handshake()
        for index in range(64):
            stream = client.open(f"/reset-upload/{index}", method="POST", end_stream=False,
                                 extra=literal(28, b"100000000"))  # content-length
            client.send_body(stream, b"u" * MiB, end_stream=False, timeout=30)
            client.send(rst_stream(stream, CANCEL))
        body = os.urandom(2 * MiB)
        answer = client.request("/after-reset-uploads", method="POST", body=body, timeout=30)
        assert answer.status == 200, answer
        assert b'"body_sha256": "%s"' % hashlib.sha256(body).hexdigest().encode() in answer.body


def test_a_hundred_uploads_to_a_slow_origin_keep_memory_within_the_replay_budget(budget, rs, record_property):
    """A hundred streams on two connections each upload 1 MiB to an origin that answers only later: the copies
    kept for replays stay within the replay budget's memory (replay_memory_total 8 MiB here, a connection a
    quarter of it), the rest of them in the spool; every upload then gets its 200 with its own bytes, and the
    spool is empty again. Without the budget each copy kept replay_memory (1 MiB) in memory: 4 connections of
    100 such uploads took the proxy from 170 MB to 547 MB."""
    rs.held.clear()
    bodies = {}
    try:
        with Rss(budget, record_property) as rss, \
                RawH2(budget, rs.authority()) as one, RawH2(budget, rs.authority()) as two:
            for client in (one, two):
                client.handshake()
                for index in range(50):
                    body = os.urandom(MiB)
                    stream = client.open(f"/held/{id(client)}-{index}", method="POST", end_stream=False,
                                         extra=literal(28, str(MiB).encode()))  # content-length
                    client.send_body(stream, body, end_stream=True, timeout=60)
                    bodies[(client, stream)] = body
            poll(lambda: spooled_bytes(budget) > 50 * MiB, 30, message="the copies past the budget to be spooled")
            spooled = spooled_bytes(budget)
            rs.held.set()
            for (client, stream), body in bodies.items():
                answer = client.response(stream, timeout=60)
                assert answer.status == 200, answer
                assert b'"body_sha256": "%s"' % hashlib.sha256(body).hexdigest().encode() in answer.body
        record_property("replay_spooled_mib", round(spooled / MiB, 1))
        rss.assert_flat(48 * 1024)
        poll(lambda: spooled_bytes(budget) == 0, 10, message="the spool to be empty again")
    finally:
        rs.held.set()


@pytest.fixture
def budget(deployment, tmp_path):
    """A proxy of the deployment's origins with a small replay budget."""
    ws = Workspace(tmp_path / "budget", deployment.ws.sections, deployment.ws.resolve, state=deployment.ws.state,
                   replay_memory_total="8MiB")
    own = Deployment(ws, ws.start_proxy())
    yield own
    failure = own.stop()
    assert failure is None, failure


def spooled_bytes(deployment: Deployment) -> int:
    """Bytes in the proxy's unlinked request-body spool files."""
    total = 0
    for entry in Path(f"/proc/{deployment.proxy.pid}/fd").iterdir():
        try:
            target = os.readlink(entry)
            if target.endswith(" (deleted)") and "/body-" in target:
                total += os.stat(entry).st_size
        except OSError:
            pass
    return total


# MARK: - Frames that break the protocol


CONNECTION_ERRORS = {
    # name: (frames after the handshake, expected GOAWAY code)
    "connection window overflow": (lambda c: window_update(0, 2**31 - 1), FLOW_CONTROL_ERROR),
    "window update of zero": (lambda c: window_update(0, 0), PROTOCOL_ERROR),
    "window update of 3 bytes": (lambda c: frame(WINDOW_UPDATE, 0, 0, b"\0\0\1"), FRAME_SIZE_ERROR),
    "DATA on an idle stream": (lambda c: frame(DATA, 0, 99, b"idle"), PROTOCOL_ERROR),
    "DATA after END_STREAM": (lambda c: header_frames(1, request_block(c.authority, "/x"))
                              + frame(DATA, 0, 1, b"late"), STREAM_CLOSED),
    "DATA on a closed stream": ("closed", STREAM_CLOSED),
    "PING of 7 bytes": (lambda c: frame(PING, 0, 0, b"1234567"), FRAME_SIZE_ERROR),
    "SETTINGS on a stream": (lambda c: frame(SETTINGS, 0, 1), PROTOCOL_ERROR),
    "SETTINGS with 40 entries": (lambda c: frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 65535) * 40),
                                 ENHANCE_YOUR_CALM),
    "frame over SETTINGS_MAX_FRAME_SIZE": (lambda c: frame(DATA, 0, 1, b"x" * 20000), FRAME_SIZE_ERROR),
    "HEADERS on an even stream": (lambda c: header_frames(2, request_block(c.authority, "/even")), PROTOCOL_ERROR),
}


@pytest.mark.parametrize("name", list(CONNECTION_ERRORS))
def test_a_connection_error_gets_goaway_with_its_code(deployment, rs, name):
    """Each connection error of RFC 9113 ends the connection with GOAWAY carrying its code, and the proxy goes
    on serving others."""
    make, code = CONNECTION_ERRORS[name]
    with RawH2(deployment, rs.authority()) as client:
        client.handshake()
        if make == "closed":
            assert client.request("/closed-stream").status == 200
            client.send(frame(DATA, END_STREAM, 1, b"late"))
        else:
            client.send(make(client))
        assert client.wait_closed(20), "the connection stayed open"
        assert client.goaway is not None and client.goaway[1] == code, client.goaway
    served(deployment, rs, "/after-connection-error")


def test_stream_errors_and_unknown_frames_leave_the_connection_open(deployment, rs):
    """A WINDOW_UPDATE overflowing one stream's window resets only that stream (FLOW_CONTROL_ERROR); a frame
    of an unknown type is ignored (RFC 9113 §5.5); the connection serves on."""
    with RawH2(deployment, rs.authority()) as client:
        client.handshake()
        stream = client.open("/overflowed", method="POST", end_stream=False)
        client.send(window_update(stream, 2**31 - 1))
        client.wait(lambda: client.answers[stream].reset is not None, message="the stream's reset")
        assert client.answers[stream].reset == FLOW_CONTROL_ERROR
        client.send(frame(0x42, 0xFF, 0, b"an extension frame nobody knows"))
        assert client.request("/after-stream-error").status == 200
        assert client.goaway is None and not client.closed


# MARK: - Real clients


def test_curl_http2_prior_knowledge_through_the_proxy(deployment, rs):
    """curl --http2-prior-knowledge with an https URL behind HTTPS_PROXY: CONNECT, then TLS offering h2 (prior
    knowledge only changes cleartext requests); the proxy picks h2 and the request carries the token."""
    seen = rs.mark()
    done = subprocess.run(["curl", "-sS", "--http2-prior-knowledge", "-o", "/dev/null",
                           "-w", "%{http_code} %{http_version}", rs.url("/prior-knowledge")],
                          capture_output=True, text=True, env=deployment.client_env(), timeout=60)
    assert done.returncode == 0 and done.stdout == "200 2", done
    origin = seen_by(rs, seen, "/prior-knowledge")
    assert len(origin) == 1 and origin[0].header("authorization").startswith("Bearer ")


OTHER_USER = "nobody"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None,
                    reason="running a client as another user needs root and runuser")
def test_another_local_user_is_refused_before_http2_begins(deployment, rs):
    """protected_users = owner (the default) holds for HTTP/2 too: another local user's CONNECT to the
    protected origin gets 403 before any TLS, so no h2 connection (and no token) is ever made for them."""
    seen = rs.mark()
    proxy = deployment.exports["HTTPS_PROXY"]
    done = subprocess.run(["runuser", "-u", OTHER_USER, "--", "curl", "-sS", "--http2", "-k", "-x", proxy,
                           "-o", "/dev/null", "-w", "%{http_connect}", rs.url("/other-user")],
                          capture_output=True, text=True, timeout=60, env=clean_env())
    assert done.returncode == 56 and done.stdout == "403", done
    assert "CONNECT tunnel failed, response 403" in done.stderr
    assert seen_by(rs, seen, "/other-user") == []


# MARK: - Frames and HPACK by hand


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def rst_stream(stream: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream, struct.pack(">I", code))


def window_update(stream: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", increment))


def header_frames(stream: int, block: bytes, end_stream: bool = True, pieces: int | None = None) -> bytes:
    """HEADERS and the CONTINUATION frames `block` needs: 16 KiB a frame, or `pieces` frames."""
    size = 16384 if pieces is None else -(-len(block) // pieces)
    parts = [block[at:at + size] for at in range(0, len(block), size)] or [b""]
    assert pieces is None or len(parts) == pieces
    out = bytearray()
    for index, part in enumerate(parts):
        flags = END_HEADERS if index == len(parts) - 1 else 0
        if index == 0:
            out += frame(HEADERS, flags | (END_STREAM if end_stream else 0), stream, part)
        else:
            out += frame(CONTINUATION, flags, stream, part)
    return bytes(out)


def hpack_int(value: int, prefix: int, first: int = 0) -> bytes:
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes | int, value: bytes, indexing: bool = False) -> bytes:
    """A literal field (RFC 7541 §6.2), its name new or a static table index: without indexing, or with
    incremental indexing (the field enters the dynamic table, at index 62 while it is the newest)."""
    if isinstance(name, int):
        head = hpack_int(name, 6, 0x40) if indexing else hpack_int(name, 4)
    else:
        head = bytes([0x40 if indexing else 0x00]) + hpack_int(len(name), 7) + name
    return head + hpack_int(len(value), 7) + value


def indexed(index: int) -> bytes:
    return hpack_int(index, 7, 0x80)


def request_block(authority: str, path: str, method: str = "GET", extra: bytes = b"") -> bytes:
    """A request header block that changes no dynamic table: :method GET or POST and :scheme https from the
    static table, :authority and :path as literals without indexing, then `extra`."""
    method_field = {"GET": indexed(2), "POST": indexed(3)}[method]
    return method_field + indexed(7) + literal(1, authority.encode()) + literal(4, path.encode()) + extra


class Answer:
    def __init__(self):
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.digest = hashlib.sha256()
        self.received = 0
        self.ended = False
        self.reset: int | None = None
        self.keep = True

    @property
    def status(self) -> int:
        return int(self.headers.get(":status", "0"))

    def __repr__(self):
        return f"Answer({self.headers}, {bytes(self.body[:300])!r}, received={self.received}, reset={self.reset})"


class RawH2:
    """An HTTP/2 client connection to `authority` through the proxy's CONNECT tunnel, TLS trusting the
    proxy's CA, written frame by frame. It answers SETTINGS and PING as a client must, keeps the flow-control
    windows of both directions (with `auto_window` it gives back what it received at once), and otherwise
    sends exactly what it is told."""

    def __init__(self, deployment: Deployment, authority: str, settings: dict[int, int] | None = None,
                 rcvbuf: int | None = None, timeout: float = 30, auto_window: bool = True):
        proxy = urllib.parse.urlsplit(deployment.exports["HTTPS_PROXY"])
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        raw.settimeout(timeout)
        raw.connect(("127.0.0.1", proxy.port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        reader = Reader(raw, timeout)
        head = reader.read_head()
        assert head.status == 200 and not reader.buffer, head.head
        context = ssl.create_default_context(cafile=deployment.exports["SSL_CERT_FILE"])
        context.set_alpn_protocols(["h2"])
        self.sock = context.wrap_socket(raw, server_hostname=authority.rsplit(":", 1)[0])
        assert self.sock.selected_alpn_protocol() == "h2"
        self.authority = authority
        self.timeout = timeout
        self.auto_window = auto_window
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = 1 << 24
        self.buffer = bytearray()
        self.answers: dict[int, Answer] = {}
        self.next_stream = 1
        self.goaway: tuple[int, int, bytes] | None = None  # (last stream id, error code, debug data)
        self.closed = False
        self.send_error: Exception | None = None
        self.server_settings: dict[int, int] = {}
        self.settings_acked = 0
        self.pongs = 0
        self.header_stream = 0
        self.header_block = b""
        self.header_end_stream = False
        # What this side may send (RFC 9113 §6.9): the connection's window and each stream's.
        self.connection_window = 65535
        self.stream_windows: dict[int, int] = {}
        payload = b"".join(struct.pack(">HI", key, value) for key, value in (settings or {}).items())
        self.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0, payload))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.sock.close()

    # --- sending

    def send(self, data: bytes) -> bool:
        """False (and `send_error` set) when the connection no longer takes bytes."""
        try:
            self.sock.settimeout(self.timeout)
            self.sock.sendall(data)
            return True
        except (OSError, ssl.SSLError) as error:
            self.send_error = error
            return False

    def take_stream_id(self) -> int:
        """The next client stream id, its answer recorded from now on."""
        stream = self.next_stream
        self.next_stream += 2
        self.answers[stream] = Answer()
        return stream

    def open(self, path: str, method: str = "GET", end_stream: bool = True, extra: bytes = b"") -> int:
        stream = self.take_stream_id()
        self.send(header_frames(stream, request_block(self.authority, path, method, extra), end_stream))
        return stream

    def send_body(self, stream: int, body: bytes, end_stream: bool, timeout: float = 60,
                  stop_on_reset: bool = False) -> None:
        """DATA frames of at most 16 KiB, each sent once both windows have room for it."""
        offset = 0
        while offset < len(body) or (end_stream and offset == len(body)):
            answer = self.answers.get(stream)
            if stop_on_reset and answer is not None and answer.reset is not None:
                return

            def room() -> int:
                window = self.stream_windows.get(stream, self.server_settings.get(SETTINGS_INITIAL_WINDOW_SIZE,
                                                                                   65535))
                return min(self.connection_window, window, 16384, len(body) - offset)

            if offset < len(body):
                self.wait(lambda: room() > 0 or (stop_on_reset and answer is not None and answer.reset is not None),
                          timeout, f"flow-control window for stream {stream}")
                if stop_on_reset and answer.reset is not None:
                    return
            count = room() if offset < len(body) else 0
            last = end_stream and offset + count == len(body)
            self.send(frame(DATA, END_STREAM if last else 0, stream, body[offset:offset + count]))
            self.connection_window -= count
            self.stream_windows[stream] = self.stream_windows.get(
                stream, self.server_settings.get(SETTINGS_INITIAL_WINDOW_SIZE, 65535)) - count
            offset += count
            if last:
                return

    def request(self, path: str, method: str = "GET", body: bytes = b"", extra: bytes = b"",
                timeout: float = 30) -> Answer:
        if body:
            self.handshake()
        stream = self.open(path, method, end_stream=not body, extra=extra)
        if body:
            self.send_body(stream, body, end_stream=True, timeout=timeout)
        return self.response(stream, timeout)

    def release(self, stream: int, timeout: float = 60) -> Answer:
        """Reads the stream to its end, giving back every byte received (and, if it held them back, opening
        the connection's and the stream's windows wide first)."""
        if not self.auto_window:
            self.auto_window = True
            self.send(window_update(0, 1 << 30) + window_update(stream, 1 << 30))
        return self.response(stream, timeout)

    # --- receiving

    def pump(self, timeout: float | None = None) -> bool:
        """Reads once (up to `timeout` seconds) and handles the frames; False when the connection ended."""
        if self.closed:
            return False
        self.sock.settimeout(timeout if timeout is not None else self.timeout)
        try:
            data = self.sock.recv(1 << 20)
        except (TimeoutError, ssl.SSLWantReadError, BlockingIOError):
            return True
        except (OSError, ssl.SSLError):
            data = b""
        if not data:
            self.closed = True
            return False
        self.buffer += data
        replies = bytearray()
        while len(self.buffer) >= 9:
            length = int.from_bytes(self.buffer[:3], "big")
            if len(self.buffer) < 9 + length:
                break
            kind, flags = self.buffer[3], self.buffer[4]
            stream = int.from_bytes(self.buffer[5:9], "big") & 0x7FFFFFFF
            payload = bytes(self.buffer[9:9 + length])
            del self.buffer[:9 + length]
            replies += self.handle(kind, flags, stream, payload)
        if replies:
            self.send(bytes(replies))
        return True

    def handle(self, kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        answer = self.answers.get(stream)
        if kind == SETTINGS:
            if flags & ACK:
                self.settings_acked += 1
                return b""
            for at in range(0, len(payload), 6):
                key, value = struct.unpack(">HI", payload[at:at + 6])
                if key == SETTINGS_INITIAL_WINDOW_SIZE:
                    delta = value - self.server_settings.get(key, 65535)
                    self.stream_windows = {s: w + delta for s, w in self.stream_windows.items()}
                self.server_settings[key] = value
            return frame(SETTINGS, ACK, 0)
        if kind == PING:
            if flags & ACK:
                self.pongs += 1
                return b""
            return frame(PING, ACK, 0, payload)
        if kind == GOAWAY:
            last, code = struct.unpack(">II", payload[:8])
            self.goaway = (last & 0x7FFFFFFF, code, payload[8:])
            return b""
        if kind == WINDOW_UPDATE:
            increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if stream == 0:
                self.connection_window += increment
            else:
                initial = self.server_settings.get(SETTINGS_INITIAL_WINDOW_SIZE, 65535)
                self.stream_windows[stream] = self.stream_windows.get(stream, initial) + increment
            return b""
        if kind in (HEADERS, CONTINUATION):
            if kind == HEADERS:
                if flags & PADDED:
                    payload = payload[1:len(payload) - payload[0]]
                if flags & PRIORITY:
                    payload = payload[5:]
                self.header_stream, self.header_block = stream, b""
                self.header_end_stream = bool(flags & END_STREAM)
            self.header_block += payload
            if flags & END_HEADERS:
                fields = self.decoder.decode(self.header_block, raw=False)
                answer = self.answers.get(self.header_stream)
                if answer is not None:
                    if not answer.headers:
                        answer.headers = dict(fields)
                    answer.ended = answer.ended or self.header_end_stream
            return b""
        if kind == DATA:
            size = len(payload)
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if answer is not None:
                answer.received += len(payload)
                answer.digest.update(payload)
                if answer.keep:
                    answer.body += payload
                answer.ended = answer.ended or bool(flags & END_STREAM)
            if self.auto_window and size:
                return window_update(0, size) + window_update(stream, size)
            return b""
        if kind == RST_STREAM:
            if answer is not None:
                answer.reset = struct.unpack(">I", payload)[0]
                answer.ended = True
            return b""
        return b""

    def wait(self, predicate, timeout: float = 30, message: str = "a frame") -> bool:
        """Reads until `predicate()` holds (True) or the connection ended (False); fails after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.closed:
                return False
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"timed out after {timeout}s waiting for {message}"
            self.pump(min(remaining, 1.0))
        return True

    def handshake(self) -> None:
        """Waits for the server's SETTINGS (acknowledged as it comes) and its ACK of ours."""
        self.wait(lambda: self.settings_acked and self.server_settings, message="the SETTINGS exchange")

    def response(self, stream: int, timeout: float = 30) -> Answer:
        answer = self.answers[stream]
        self.wait(lambda: answer.ended, timeout, f"the end of stream {stream}")
        return answer

    def wait_closed(self, timeout: float = 30) -> bool:
        """Reads (and drops) everything until the connection ends; whether it did within `timeout` s."""
        deadline = time.monotonic() + timeout
        while not self.closed and time.monotonic() < deadline:
            self.pump(1.0)
        return self.closed
