import CLibevent
import COpenSSL
import Foundation
import ProxyTLS
import Testing

@testable import ProxyIO

/// `TLSSocket` with real TLS: the proxy's server session (a leaf from a local CA) on one end of a socket pair,
/// an OpenSSL client on the other, the loop run a pass at a time. What the client receives is checked as bytes
/// on the wire (TLS records counted before the client decrypts them) and as plaintext.
@Suite(.serialized) struct TLSSocketTests {
    /// What the socket reported, in order.
    final class Recorder: TLSSocketUser {
        var events: [String] = []
        var received: [UInt8] = []
        var onConnected: (() -> Void)?
        var onReadable: (() -> Void)?
        weak var socket: TLSSocket?

        func socketReadable() {
            events.append("readable")
            if let socket {
                let input = socket.input
                let count = evbuffer_get_length(input)
                var bytes = [UInt8](repeating: 0, count: count)
                _ = bytes.withUnsafeMutableBytes { evbuffer_remove(input, $0.baseAddress, count) }
                received += bytes
            }
            onReadable?()
        }
        func socketWritable() { events.append("writable") }
        func socketEvent(_ events: Int16) {
            let what = Int32(events)
            if what & Int32(BEV_EVENT_CONNECTED) != 0 {
                self.events.append("connected")
                onConnected?()
            } else if what & Int32(BEV_EVENT_EOF) != 0 {
                self.events.append("eof")
            } else {
                self.events.append("error")
            }
        }
    }

    /// One connection: the server's `TLSSocket` on `pair[0]`, a client session on `pair[1]` (non-blocking).
    final class Connection {
        let loop = EventLoop()
        let socket: TLSSocket
        let recorder = Recorder()
        let client: OpaquePointer
        let clientContext: OpaquePointer
        let clientFD: Int32

        init() throws {
            let ca = try LocalCA.create(hosts: ["api.test"], label: "test")
            let contexts = try TLSServerContexts(ca: ca, http2: false)
            let ssl = try contexts.makeSSL(for: "api.test")
            var pair: [Int32] = [0, 0]
            try #require(socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &pair) == 0)
            for fd in pair { _ = fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) }
            clientFD = pair[1]
            clientContext = try #require(SSL_CTX_new(TLS_client_method()))
            client = try #require(SSL_new(clientContext))
            SSL_set_fd(client, clientFD)
            SSL_set_connect_state(client)
            socket = TLSSocket(loop: loop, fd: pair[0], ssl: ssl)
            socket.user = recorder
            recorder.socket = socket
        }

        deinit {
            socket.close()
            SSL_free(client)
            SSL_CTX_free(clientContext)
            close(clientFD)
        }

        /// One pass of the loop, without waiting.
        func pass() { event_base_loop(loop.base, EVLOOP_NONBLOCK) }

        func handshake() throws {
            for _ in 0..<100 {
                let done = SSL_do_handshake(client) == 1
                pass()
                if done && recorder.events.contains("connected") { return }
            }
            Issue.record("the handshake did not finish")
        }

        func clientWrite(_ text: String) {
            let bytes = Array(text.utf8)
            #expect(bytes.withUnsafeBytes { SSL_write(client, $0.baseAddress, Int32($0.count)) } == Int32(bytes.count))
        }

        /// The application-data records waiting in the client's socket, by their headers (not consumed).
        func recordsWaiting() -> [Int] {
            var raw = [UInt8](repeating: 0, count: 1 << 20)
            let count = raw.withUnsafeMutableBytes { recv(clientFD, $0.baseAddress, $0.count, Int32(MSG_PEEK)) }
            var records: [Int] = []
            var offset = 0
            while count > 0 && offset + 5 <= count {
                let length = Int(raw[offset + 3]) << 8 | Int(raw[offset + 4])
                if raw[offset] == 23 { records.append(length) }
                offset += 5 + length
            }
            return records
        }

        /// Everything the client can read now, decrypted.
        func clientReadAll() -> [UInt8] {
            var bytes: [UInt8] = []
            var buffer = [UInt8](repeating: 0, count: 16_384)
            while true {
                let count = buffer.withUnsafeMutableBytes { SSL_read(client, $0.baseAddress, Int32($0.count)) }
                if count <= 0 { return bytes }
                bytes += buffer[0..<Int(count)]
            }
        }
    }

    @Test func aRequestArrivesAndAResponseAddedInPiecesLeavesAsOneRecordInTheSamePass() throws {
        let connection = try Connection()
        connection.socket.setReading(true)
        try connection.handshake()
        _ = connection.clientReadAll()  // the session tickets
        connection.recorder.onReadable = {
            // Head and body added one after the other, as the driver does.
            Buffers.append(Array("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n".utf8), to: connection.socket.output)
            Buffers.append(Array("hello".utf8), to: connection.socket.output)
        }
        connection.clientWrite("GET / HTTP/1.1\r\nHost: api.test\r\n\r\n")
        connection.pass()
        #expect(
            String(decoding: connection.recorder.received, as: UTF8.self) == "GET / HTTP/1.1\r\nHost: api.test\r\n\r\n")
        // One pass: read, answered, written.
        let records = connection.recordsWaiting()
        #expect(records.count == 1, "head and body in one record, got \(records)")
        #expect(
            String(decoding: connection.clientReadAll(), as: UTF8.self)
                == "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        #expect(evbuffer_get_length(connection.socket.output) == 0)
        #expect(connection.recorder.events == ["connected", "readable", "writable"])
    }

    @Test func aClientThatDoesNotReadHoldsTheOutputUntilItDrainsToTheLowWaterMark() throws {
        let connection = try Connection()
        try connection.handshake()
        _ = connection.clientReadAll()
        let payload = (0..<(4 << 20)).map { UInt8(truncatingIfNeeded: $0 &* 31) }
        connection.socket.writeLowWater = 64 * 1024
        Buffers.append(payload, to: connection.socket.output)
        connection.pass()
        // The socket pair's buffer is full long before 4 MiB: the rest waits, and nothing says writable yet.
        #expect(evbuffer_get_length(connection.socket.output) > 64 * 1024)
        #expect(!connection.recorder.events.contains("writable"))
        var received: [UInt8] = []
        for _ in 0..<10_000 where received.count < payload.count {
            received += connection.clientReadAll()
            connection.pass()
        }
        #expect(received == payload)
        #expect(connection.recorder.events.filter { $0 == "writable" }.count >= 1)
        #expect(evbuffer_get_length(connection.socket.output) == 0)
    }

    @Test func theClientsEndComesAfterItsBytesAndTheAnswerStillGoesOut() throws {
        let connection = try Connection()
        connection.socket.setReading(true)
        try connection.handshake()
        _ = connection.clientReadAll()
        connection.clientWrite("last request")
        #expect(SSL_shutdown(connection.client) == 0)  // close_notify sent, the answer not yet read
        connection.pass()
        connection.pass()
        #expect(String(decoding: connection.recorder.received, as: UTF8.self) == "last request")
        #expect(connection.recorder.events == ["connected", "readable", "eof"])
        #expect(connection.socket.readEnded)
        Buffers.append(Array("answer".utf8), to: connection.socket.output)
        connection.pass()
        #expect(String(decoding: connection.clientReadAll(), as: UTF8.self) == "answer")
    }

    @Test func aHandOverRightAfterTheHandshakeKeepsTheRecordsThatCameWithIt() throws {
        let connection = try Connection()
        connection.socket.setReading(true)
        var bev: OpaquePointer?
        // As an HTTP/2 client does: its first bytes right behind its Finished, before the server saw either.
        connection.recorder.onConnected = {
            bev = connection.socket.intoBufferevent(options: Int32(BEV_OPT_CLOSE_ON_FREE.rawValue))
        }
        for _ in 0..<100 where SSL_do_handshake(connection.client) != 1 { connection.pass() }
        connection.clientWrite("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        for _ in 0..<100 where bev == nil { connection.pass() }
        let handed = try #require(bev)
        defer { bufferevent_free(handed) }
        #expect(connection.socket.fd == -1 && connection.socket.ssl == nil)
        var received: [UInt8] = []
        bufferevent_enable(handed, Int16(EV_READ | EV_WRITE))
        for _ in 0..<100 where received.count < 24 {
            let input = bufferevent_get_input(handed)
            let count = evbuffer_get_length(input)
            var bytes = [UInt8](repeating: 0, count: count)
            _ = bytes.withUnsafeMutableBytes { evbuffer_remove(input, $0.baseAddress, count) }
            received += bytes
            connection.pass()
        }
        #expect(String(decoding: received, as: UTF8.self) == "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        // The bufferevent writes on the same session.
        Buffers.append(Array("settings".utf8), to: bufferevent_get_output(handed))
        for _ in 0..<10 { connection.pass() }
        #expect(String(decoding: connection.clientReadAll(), as: UTF8.self).hasSuffix("settings"))
    }

    @Test func aFailedHandshakeIsAnErrorWithOpenSSLsReason() throws {
        let connection = try Connection()
        #expect(send(connection.clientFD, "GET / HTTP/1.1\r\n\r\n", 18, 0) == 18)
        for _ in 0..<10 { connection.pass() }
        #expect(connection.recorder.events == ["error"])
        #expect(connection.socket.failure?.contains("http request") == true, "\(connection.socket.failure ?? "")")
    }
}
