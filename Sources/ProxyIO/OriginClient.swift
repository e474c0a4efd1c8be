import CCurl
import CLibevent
import COpenSSL
import ProxyCore
import ProxyTLS

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// A request to a protected origin in flight on the proxy's own client (`OriginTransfer`). Its callbacks reach
/// the owner at the top of the loop, never inside a call the owner made.
protocol UpstreamTransfer: AnyObject {
    /// The owner paused the response (its client is slow); `resume()` lets it go on.
    var paused: Bool { get set }
    var cancelled: Bool { get }
    /// The owner's name for the transfer (an HTTP/2 stream's id).
    var tag: Int32 { get set }
    /// Bytes of the request body handed over so far (the read callback's position).
    var uploadOffset: Int { get set }
    func start()
    /// Goes on after the owner paused the response, or had no request body bytes for it yet.
    func resume()
    /// Stops the transfer: no callback of it reaches the owner any more. Safe inside its callbacks.
    func cancel()
    /// The connection the origin switched protocols on (its 101 delivered), taken once: the owner makes it a
    /// tunnel's. nil before a 101, or once taken.
    func takeSwitched() -> OriginConnection?
}

/// Who receives an upstream transfer's callbacks (the client connection's driver).
protocol TransferOwner: AnyObject {
    /// The response's trailer fields (parsed by the own client).
    func transferResponseTrailers(_ transfer: any UpstreamTransfer, _ fields: [H2Field])
    /// The response head, parsed once (`OriginExchange`).
    func transferResponseHead(_ transfer: any UpstreamTransfer, _ received: ReceivedHead)
    /// Response body bytes; returns the count taken, or `proxyctl_writefunc_pause()` (the owner's client is slow:
    /// `resume()` when it is not).
    func transferBody(_ transfer: any UpstreamTransfer, _ data: UnsafeRawBufferPointer) -> Int
    /// Request body bytes from the read position (`uploadOffset`); 0 at the end, or `proxyctl_readfunc_pause()`
    /// when none are there yet (`resume()` when there are).
    func transferRead(_ transfer: any UpstreamTransfer, _ buffer: UnsafeMutableRawBufferPointer) -> Int
    /// Moves the read position of the request body (back to its start, for a resend); false when the body was
    /// not kept.
    func transferSeek(_ transfer: any UpstreamTransfer, _ offset: Int) -> Bool
    /// The trailer fields to send after a request body of unknown length (the client's own, or none).
    func transferRequestTrailers(_ transfer: any UpstreamTransfer) -> [H2Field]
    func transferFinished(_ transfer: any UpstreamTransfer, _ failure: UpstreamFailure?, detail: String)
}

/// What makes two origin connections interchangeable: the origin, and the CA file its certificate is checked
/// against.
struct OriginKey: Hashable {
    let scheme: String
    let authority: HostPort
    let caFile: String?
    /// The upstream proxy a connection goes through (a tunnel, or absolute-form requests to an http origin).
    let proxy: HostPort?
    /// Hashed once: the pool looks a key up several times per request (take, keep), and the CA file's path
    /// made each lookup a SipHash over some 70 bytes.
    private let hash: Int

    init(scheme: String, authority: HostPort, caFile: String?, proxy: HostPort? = nil) {
        self.scheme = scheme
        self.authority = authority
        self.caFile = caFile
        self.proxy = proxy
        var hasher = Hasher()
        hasher.combine(scheme)
        hasher.combine(authority)
        hasher.combine(caFile)
        hasher.combine(proxy)
        hash = hasher.finalize()
    }

    static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.hash == rhs.hash && lhs.scheme == rhs.scheme && lhs.authority == rhs.authority && lhs.caFile == rhs.caFile
            && lhs.proxy == rhs.proxy
    }

    func hash(into hasher: inout Hasher) { hasher.combine(hash) }
}

/// The proxy's own kept connections to protected origins (for `OriginTransfer`), by origin: the most
/// recently used first, each closed after `keepMilliseconds` unused or when the origin closes it meanwhile.
/// One per `ConnectionContext`, so a reload (new `resolve`, new origins) starts with new connections.
final class OriginPool {
    private let loop: EventLoop
    private var idle: [OriginKey: [OriginConnection]] = [:]
    /// Kept connections per origin beyond which a released one is closed.
    static let perOriginLimit = 64
    /// A kept connection unused this long is closed (origins close theirs after 60-75 s; libcurl keeps
    /// its for 118 s).
    static let keepMilliseconds = 55_000

    init(loop: EventLoop) { self.loop = loop }

    /// The key of an origin: the last one made again when it is the same origin (comparing three strings costs
    /// less than hashing them, and one connection's requests go to one origin).
    func key(scheme: String, authority: HostPort, caFile: String?, proxy: HostPort?) -> OriginKey {
        if let last = lastKey, last.scheme == scheme, last.authority == authority, last.caFile == caFile,
            last.proxy == proxy
        {
            return last
        }
        let made = OriginKey(scheme: scheme, authority: authority, caFile: caFile, proxy: proxy)
        lastKey = made
        return made
    }

    private var lastKey: OriginKey?

    /// A kept connection to `key`'s origin, taken out of the pool; nil when there is none.
    func take(_ key: OriginKey) -> OriginConnection? {
        // In place (an origin's list stays, empty, when its last connection is taken): a copy of the list
        // out of the dictionary and back was an allocation per request.
        while let connection = idle[key]?.popLast() {
            connection.idleTimer?.cancel()
            connection.pool = nil
            // Bytes the origin sent while the connection was unused (a 408 before closing, say) are not a
            // response to the next request.
            if connection.isOpen, evbuffer_get_length(connection.input) == 0 { return connection }
            connection.close()
        }
        return nil
    }

    /// Keeps `connection` for the next request to its origin.
    func keep(_ connection: OriginConnection) {
        // One lookup, the list changed in place.
        guard connection.isOpen, Self.append(connection, to: &idle[connection.key, default: []]) else {
            connection.close()
            return
        }
        connection.pool = self
        connection.startReading()  // an idle connection still hears the origin close it
        if connection.idleTimer == nil {
            connection.idleTimer = LoopTimer(loop: loop) { [unowned self, unowned connection] in drop(connection) }
        }
        connection.idleTimer?.schedule(milliseconds: Self.keepMilliseconds)
    }

    private static func append(_ connection: OriginConnection, to list: inout [OriginConnection]) -> Bool {
        guard list.count < perOriginLimit else { return false }
        list.append(connection)
        return true
    }

    /// Closes a kept connection (its time ran out, or the origin closed it or sent bytes unasked).
    func drop(_ connection: OriginConnection) {
        connection.close()
        guard let index = idle[connection.key]?.firstIndex(where: { $0 === connection }) else { return }
        idle[connection.key]?.remove(at: index)
    }

    // MARK: - HTTP/2 connections, shared by the streams of every transfer

    /// HTTP/2 connections per origin, each carrying streams of any transfer while it has room.
    private var sessions: [OriginKey: [OriginH2Session]] = [:]

    /// An HTTP/2 connection to `key`'s origin with room for another stream, if there is one.
    func session(_ key: OriginKey) -> OriginH2Session? {
        sessions[key]?.first { $0.hasCapacity }
    }

    /// Shares a new HTTP/2 connection.
    func add(_ session: OriginH2Session) {
        session.pool = self
        sessions[session.key, default: []].append(session)
    }

    /// An HTTP/2 connection goes away (GOAWAY, its end): no new stream goes on it.
    func drop(_ session: OriginH2Session) {
        session.idleTimer?.cancel()
        guard let index = sessions[session.key]?.firstIndex(where: { $0 === session }) else { return }
        sessions[session.key]?.remove(at: index)
    }

    /// An HTTP/2 connection has no stream: closed after `keepMilliseconds` unless one comes.
    func idle(_ session: OriginH2Session) {
        if session.idleTimer == nil {
            // The timer is the session's, so it fires only while the session is there.
            session.idleTimer = LoopTimer(loop: loop) { [unowned session] in session.close() }
        }
        session.idleTimer?.schedule(milliseconds: Self.keepMilliseconds)
    }

    deinit {
        for list in idle.values { for connection in list { connection.close() } }
        for list in sessions.values { for session in list { session.close() } }
    }
}

/// What an `OriginConnection` tells the transfer using it.
protocol OriginConnectionUser: AnyObject {
    /// TCP, and TLS to an https origin, are up.
    func connectionReady(_ connection: OriginConnection)
    /// The connection could not be made (TCP or TLS).
    func connectionFailed(_ connection: OriginConnection, _ failure: UpstreamFailure, detail: String)
    /// The socket is readable: `fill()` takes what it has.
    func connectionReadable(_ connection: OriginConnection)
    /// Writing failed after the connection was made.
    func connectionBroke(_ connection: OriginConnection, detail: String)
    /// The socket took what was waiting to be written (most of it): more may be written.
    func connectionDrained(_ connection: OriginConnection)
}

/// One connection to an origin, used by one `OriginTransfer` at a time and kept in the `OriginPool` between
/// requests: a non-blocking socket with TLS (OpenSSL on the descriptor, read-ahead on) for https, read into
/// `input` until the socket has no more (a short read says so: no recv only to hear EAGAIN). Not a
/// bufferevent: libevent's OpenSSL bufferevent reads one TLS record per wakeup with two recv calls and knows
/// nothing of OpenSSL's read-ahead buffer, which made a download cost 9 syscalls and an event-loop pass per
/// 16 KiB; here a wakeup reads what the socket holds, 64 KiB per recv.
final class OriginConnection {
    enum Fill {
        /// The socket has nothing more for now (or, after a short read, most likely has not: epoll reports it
        /// again if it has).
        case wouldBlock
        /// `input` is full (`inputLimit`): take from it, then fill again.
        case limit
        /// The origin closed its sending side; everything before it is in `input`.
        case ended
        case failed(String)
    }

    let key: OriginKey
    let input: OpaquePointer
    private let loop: EventLoop
    private var fd: Int32
    private var ssl: OpaquePointer?
    private var readEvent: OpaquePointer?
    private var writeEvent: OpaquePointer?
    /// Bytes waiting for the socket: `pending[sent...]`. An array that keeps its storage between requests: an
    /// evbuffer allocated a chain for each request's head and freed it when the socket took it (about 1,000
    /// instructions per request, callgrind, bench row 6).
    private var pending: [UInt8] = []
    private var sent = 0
    /// Storage `pending` keeps once empty: a head's and more, not a large body's on every idle pooled connection.
    private static let keptCapacity = 16 * 1024
    private enum Phase { case connecting, handshaking, open, closed }
    private var phase = Phase.connecting
    private var reading = false
    /// TLS wants the socket writable to go on reading (a renegotiation), or readable to go on writing.
    private var readWantsWrite = false
    weak var user: (any OriginConnectionUser)?
    weak var pool: OriginPool?
    var idleTimer: LoopTimer?
    private let serverName: String
    private let tls: TLSClientContexts?
    private let caFile: String?
    private let offerHTTP2: Bool
    /// TLS waits for `startTLS` (a tunnel through the upstream proxy is asked for first).
    private let tlsLater: Bool
    /// The origin chose HTTP/2 in the TLS handshake (ALPN `h2`).
    private(set) var http2 = false

    /// Bytes read ahead of the transfer at most: what a paused owner leaves here is bounded like what it holds
    /// itself (`ConnectionContext.highWater`).
    static let inputLimit = 256 * 1024
    static let readSize = 64 * 1024
    /// The most one SSL_write or send takes.
    static let writePiece = 64 * 1024

    /// Starts a TCP connect to `address` (then TLS for `serverName` when `tls` is given); nil with the errno
    /// when the socket cannot even be made or the connect fails at once.
    init(
        key: OriginKey, loop: EventLoop, address: SocketAddress, serverName: String, tls: TLSClientContexts?,
        caFile: String?, offerHTTP2: Bool, tlsLater: Bool = false, user: any OriginConnectionUser
    ) throws(ConnectError) {
        self.tlsLater = tlsLater
        self.key = key
        self.loop = loop
        self.serverName = serverName
        self.tls = tls
        self.caFile = caFile
        self.offerHTTP2 = offerHTTP2
        self.user = user
        input = evbuffer_new()
        fd = Platform.tcpSocket(family: address.family, nonBlocking: true)
        guard fd >= 0 else { throw ConnectError(code: proxyctl_errno()) }
        let status = address.withSockaddr { socketConnect(fd, $0, $1) }
        if status != 0 && proxyctl_errno() != EINPROGRESS { throw ConnectError(code: proxyctl_errno()) }
        let context = Unmanaged.passUnretained(self).toOpaque()
        readEvent = event_new(loop.base, fd, Int16(EV_READ | EV_PERSIST), originEventCallback, context)
        writeEvent = event_new(loop.base, fd, Int16(EV_WRITE), originEventCallback, context)
        event_add(writeEvent, nil)  // writable: the connect finished (or failed)
    }

    struct ConnectError: Error { let code: Int32 }

    deinit {
        close()
        evbuffer_free(input)
    }

    var isOpen: Bool { phase == .open }

    func close() {
        idleTimer?.cancel()
        guard phase != .closed else { return }
        phase = .closed
        if let readEvent { event_free(readEvent) }
        if let writeEvent { event_free(writeEvent) }
        readEvent = nil
        writeEvent = nil
        if let ssl {
            SSL_free(ssl)
            self.ssl = nil
        }
        if fd >= 0 { socketClose(fd) }
        fd = -1
    }

    /// Gives the socket (and its TLS session) away, for a tunnel after a 101: with the bytes read but not taken
    /// and those written but not yet sent. The connection is closed without closing them; nil when it was not
    /// open.
    func handOver() -> (fd: Int32, ssl: OpaquePointer?, received: [UInt8], unsent: [UInt8])? {
        guard phase == .open else { return nil }
        if let ssl {
            // A bufferevent reads only when the socket is readable: what OpenSSL holds goes first, and records
            // are read one at a time from now on, as it expects.
            TLSSocket.readBuffered(ssl, into: input)
            SSL_set_read_ahead(ssl, 0)
        }
        let handed = (fd: fd, ssl: ssl, received: Self.take(input), unsent: Array(pending[sent...]))
        fd = -1
        ssl = nil
        close()
        return handed
    }

    private static func take(_ buffer: OpaquePointer) -> [UInt8] {
        let count = evbuffer_get_length(buffer)
        guard count > 0 else { return [] }
        var bytes = [UInt8](repeating: 0, count: count)
        bytes.withUnsafeMutableBytes { _ = evbuffer_remove(buffer, $0.baseAddress, count) }
        return bytes
    }

    func startReading() {
        guard phase == .open, !reading else { return }
        reading = true
        event_add(readEvent, nil)
    }

    func stopReading() {
        guard reading else { return }
        reading = false
        event_del(readEvent)
    }

    /// Writes `bytes` (now, or as the socket takes them).
    func send(_ bytes: [UInt8]) {
        bytes.withUnsafeBytes { send($0) }
    }

    /// Writes `bytes` (now, or as the socket takes them; copied).
    func send(_ bytes: UnsafeRawBufferPointer) {
        queue(bytes)
        flush()
    }

    /// Adds `bytes` to the output without writing (copied): what is queued together goes out in one `flush`, one
    /// TLS record and one send(2) where it fits (a POST's head and body, HTTP/2 frames; each written apart was a
    /// record and a system call of its own).
    func queue(_ bytes: UnsafeRawBufferPointer) {
        // What the socket took goes when it is half of what is held: each byte moves once at most.
        if sent > 0 && sent * 2 >= pending.count {
            pending.removeSubrange(..<sent)
            sent = 0
        }
        pending.append(contentsOf: bytes)
    }

    /// Whether bytes were read from the socket but not yet taken: in `input`, or in OpenSSL's buffers (a record
    /// read ahead, processed or not).
    var holdsUnread: Bool {
        if evbuffer_get_length(input) > 0 { return true }
        if let ssl { return SSL_has_pending(ssl) != 0 }
        return false
    }

    /// Bytes written but not yet taken by the socket.
    var outputLength: Int { pending.count - sent }

    /// Writes what `pending` holds, a piece at a time, until the socket takes no more.
    func flush() {
        while phase == .open, sent < pending.count {
            let piece = min(pending.count - sent, Self.writePiece)
            let start = sent
            let written: Int
            if let ssl {
                CryptoError.clearQueue()
                // SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER (set with the SSL): a retry after WANT_WRITE may come from
                // another address, the array having grown or its front having gone.
                let result = pending.withUnsafeBytes { SSL_write(ssl, $0.baseAddress! + start, Int32(piece)) }
                if result <= 0 {
                    switch SSL_get_error(ssl, result) {
                    case SSL_ERROR_WANT_WRITE, SSL_ERROR_WANT_READ:
                        event_add(writeEvent, nil)
                        return
                    default:
                        return broke("writing to the origin failed: \(tlsFailureText())")
                    }
                }
                written = Int(result)
            } else {
                written = pending.withUnsafeBytes {
                    socketSend(fd, UnsafeRawBufferPointer(rebasing: $0[start..<start + piece]))
                }
                if written < 0 {
                    let code = proxyctl_errno()
                    if code == EAGAIN || code == EWOULDBLOCK || code == EINTR {
                        event_add(writeEvent, nil)
                        return
                    }
                    return broke("writing to the origin failed: \(String(cString: strerror(code)))")
                }
            }
            sent += written
        }
        if sent == pending.count { emptyPending() }
    }

    private func emptyPending() {
        pending.removeAll(keepingCapacity: pending.capacity <= Self.keptCapacity)
        sent = 0
    }

    private func broke(_ detail: String) {
        emptyPending()
        if let user { user.connectionBroke(self, detail: detail) } else { pool?.drop(self) }
    }

    /// Reads what the socket (and OpenSSL's read-ahead) holds into `input`, up to `inputLimit`.
    func fill() -> Fill {
        guard phase == .open else { return .failed("the connection is closed") }
        readWantsWrite = false
        while evbuffer_get_length(input) < Self.inputLimit {
            var vector = iovec()
            guard evbuffer_reserve_space(input, Self.readSize, &vector, 1) == 1 else {
                return .failed("out of memory")
            }
            if let ssl {
                CryptoError.clearQueue()
                let result = SSL_read(ssl, vector.iov_base, Int32(min(vector.iov_len, Self.readSize)))
                if result > 0 {
                    vector.iov_len = Int(result)
                    evbuffer_commit_space(input, &vector, 1)
                    // A short record and nothing more with OpenSSL: the recv that brought it emptied the socket,
                    // and one more would only return EAGAIN.
                    if Int(result) < TLSSocket.recordSize && SSL_has_pending(ssl) == 0 { return .wouldBlock }
                    continue
                }
                switch SSL_get_error(ssl, result) {
                case SSL_ERROR_WANT_READ:
                    return .wouldBlock
                case SSL_ERROR_WANT_WRITE:
                    readWantsWrite = true
                    event_add(writeEvent, nil)
                    return .wouldBlock
                case SSL_ERROR_ZERO_RETURN:
                    return .ended
                case SSL_ERROR_SYSCALL where ERR_peek_error() == 0 && proxyctl_errno() == 0:
                    return .ended  // closed without close_notify (SSL_OP_IGNORE_UNEXPECTED_EOF makes this rare)
                default:
                    return .failed("reading from the origin failed: \(tlsFailureText())")
                }
            } else {
                let result = recv(fd, vector.iov_base, min(vector.iov_len, Self.readSize), 0)
                if result > 0 {
                    let asked = min(vector.iov_len, Self.readSize)
                    vector.iov_len = result
                    evbuffer_commit_space(input, &vector, 1)
                    if result < asked { return .wouldBlock }  // the socket gave all it had
                    continue
                }
                if result == 0 { return .ended }
                let code = proxyctl_errno()
                if code == EAGAIN || code == EWOULDBLOCK { return .wouldBlock }
                if code == EINTR { continue }
                return .failed("reading from the origin failed: \(String(cString: strerror(code)))")
            }
        }
        return .limit
    }

    fileprivate func event(_ what: Int16) {
        switch phase {
        case .closed:
            return
        case .connecting:
            let code = proxyctl_socket_error(fd)
            guard code == 0 else {
                return failed(.connect, "cannot connect: \(String(cString: strerror(code)))")
            }
            _ = proxyctl_set_nodelay(fd)
            guard tls != nil, !tlsLater else { return ready() }
            beginTLS()
        case .handshaking:
            handshake()
        case .open:
            if Int32(what) & Int32(EV_WRITE) != 0 {
                if readWantsWrite {
                    readWantsWrite = false
                    notifyReadable()
                }
                flush()
                // The socket took what waited: a request body may go on (not from `send`, which the user calls).
                if outputLength < Self.writePiece { user?.connectionDrained(self) }
            }
            if Int32(what) & Int32(EV_READ) != 0 { notifyReadable() }
        }
    }

    /// TLS to the origin over the open connection (a tunnel the upstream proxy opened); `connectionReady` again
    /// when it is up.
    func startTLS() {
        guard phase == .open, ssl == nil, tls != nil else { return failed(.tls, "TLS cannot start on this connection") }
        // What the upstream proxy sent is read and gone: bytes left here would be taken for the origin's.
        guard evbuffer_get_length(input) == 0 else { return failed(.tls, "bytes before TLS on this connection") }
        stopReading()
        beginTLS()
    }

    private func beginTLS() {
        guard let tls else { return }
        do {
            let made = try tls.makeSSL(serverName: serverName, caFile: caFile, offerHTTP2: offerHTTP2)
            SSL_set_fd(made, fd)
            SSL_set_read_ahead(made, 1)
            _ = proxyctl_SSL_set_mode(made, Int(SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER))
            SSL_set_default_read_buffer_len(made, Self.readSize)
            ssl = made
        } catch {
            return failed(.tls, "TLS cannot start: \(error)")
        }
        phase = .handshaking
        handshake()
    }

    private func notifyReadable() {
        if let user {
            user.connectionReadable(self)
        } else if case .wouldBlock = fill(), evbuffer_get_length(input) == 0 {
            return  // nothing after all
        } else {
            // The origin closed the idle connection, or sent bytes unasked: it is out of step.
            pool?.drop(self)
        }
    }

    private func handshake() {
        guard let ssl else { return }
        CryptoError.clearQueue()
        let result = SSL_connect(ssl)
        if result == 1 { return ready() }
        switch SSL_get_error(ssl, result) {
        case SSL_ERROR_WANT_READ:
            event_add(readEvent, nil)
        case SSL_ERROR_WANT_WRITE:
            event_add(writeEvent, nil)
        default:
            if let reason = tlsVerifyFailure(ssl) {
                failed(.certificate, reason)
            } else {
                failed(.tls, "TLS handshake failed: \(tlsFailureText())")
            }
        }
    }

    private func ready() {
        phase = .open
        if let ssl {
            var selected: UnsafePointer<UInt8>?
            var length: UInt32 = 0
            SSL_get0_alpn_selected(ssl, &selected, &length)
            http2 = length == 2 && selected?[0] == UInt8(ascii: "h") && selected?[1] == UInt8(ascii: "2")
        }
        event_del(readEvent)
        reading = false
        startReading()
        user?.connectionReady(self)
    }

    private func failed(_ failure: UpstreamFailure, _ detail: String) {
        close()
        user?.connectionFailed(self, failure, detail: detail)
    }

}

// The system calls, under names the classes' own `close` and `send` do not hide.
private func socketConnect(_ fd: Int32, _ address: UnsafePointer<sockaddr>, _ length: socklen_t) -> Int32 {
    connect(fd, address, length)
}
private func socketClose(_ fd: Int32) { Platform.closeDescriptor(fd) }
private func socketSend(_ fd: Int32, _ bytes: UnsafeRawBufferPointer) -> Int { Platform.send(fd, bytes) }

private let originEventCallback: event_callback_fn = { _, what, context in
    let connection = Unmanaged<OriginConnection>.fromOpaque(context!).takeUnretainedValue()
    withExtendedLifetime(connection) { connection.event(what) }
}

/// What makes an exchange's upstream transfer (`ConnectionContext.makeTransfer`): `makeUpstreamTransfer`, or a
/// test's fake that opens no socket. The arguments are `makeUpstreamTransfer`'s.
typealias UpstreamTransferFactory = (
    _ owner: any TransferOwner, _ request: UpstreamRequest, _ origin: OriginConfig,
    _ authorization: [(name: String, value: [UInt8])], _ context: ConnectionContext, _ connectionID: UInt64
) -> any UpstreamTransfer

/// The transfer for `request` to `origin`.
func makeUpstreamTransfer(
    owner: any TransferOwner, request: UpstreamRequest, origin: OriginConfig,
    authorization: [(name: String, value: [UInt8])], context: ConnectionContext, connectionID: UInt64
) -> any UpstreamTransfer {
    OriginTransfer(
        owner: owner, request: request, origin: origin, authorization: authorization, context: context,
        connectionID: connectionID)
}

/// One request to a protected origin on the proxy's own client: carries out what its `OriginExchange` decides
/// (which connection or stream, the head or header block written, the request body, the response read and
/// handed to the owner, the timer, the connection kept or closed) on an `OriginConnection` or a stream of an
/// `OriginH2Session`. Decides nothing itself; flow control is the owner's: a paused response keeps what was read and
/// stops reading the origin.
final class OriginTransfer: UpstreamTransfer, OriginConnectionUser, OriginStreamUser {
    /// The driver the exchange belongs to. Weak: a transfer kept alive by a resolver answer or a timer of its
    /// own past its driver's end (any shutdown order) finds no owner and does nothing, where an unowned
    /// reference would be read after its object was freed.
    private weak var owner: (any TransferOwner)?
    private let context: ConnectionContext
    private let connectionID: UInt64
    var paused = false
    private(set) var cancelled = false
    var tag: Int32 = 0
    var uploadOffset = 0

    private var machine: OriginExchange
    private let key: OriginKey
    /// Where connections go: the origin, or the upstream proxy.
    private let hop: HostPort
    /// The origin's host, for TLS (SNI and the certificate's name).
    private let serverName: String
    /// The request goes through a tunnel the upstream proxy opens (`.proxyConnected`, then `.startTLS`).
    private let tunnelled: Bool
    /// TLS over the tunnel is being set up (`connectionReady` again when it is up).
    private var startingTLS = false
    /// How a failure to reach `hop` is named: the origin, or the upstream proxy.
    private let hopFailure: (UpstreamFailure) -> UpstreamFailure
    private let https: Bool
    private let caFile: String?
    /// The connection the request is on, once there is one (HTTP/1.1).
    private var connection: OriginConnection?
    /// The connection after the origin's 101, until the owner takes it for a tunnel.
    private var switched: OriginConnection?
    /// The HTTP/2 connection the request is a stream of, and the stream, once there is one.
    private var session: OriginH2Session?
    private var stream: Int32 = 0
    /// Offer HTTP/2 to the origin (an https origin).
    private let offerHTTP2: Bool
    private let responseHeadLimits: HTTPHeadLimits
    /// A connection being made, and the addresses left to try.
    private var dialing: OriginConnection?
    private var addresses: [SocketAddress] = []
    private var addressIndex = 0
    /// Counts connection attempts, so that a resolver answer for an abandoned one is ignored.
    private var attempt = 0
    private var timer: LoopTimer?
    private var lastActivity: Int64 = 0
    /// What was left to hand over when the owner paused the response (body bytes copied).
    private var stash: [Step] = []
    /// The origin closed while read bytes were still waiting for a paused owner.
    private var peerClosed = false
    /// Events that must not reach the owner inside a call it made (a connection that failed at once).
    private var deferred: [OriginExchange.Event] = []
    /// Why the request cannot be sent at all, if it cannot.
    private var unsendable: String?
    /// The owner's call (`start`) is under way: nothing is read from it meanwhile.
    private var insideOwnerCall = false
    /// The machine asked for at most this many bytes of the request body (`.readBody`), not read yet.
    private var bodyRead: Int?
    private var pumping = false
    /// The piece of the request body read last (`.bodyRead`), written by `.writeBody`: as large as the machine
    /// asked for (a whole 64 KiB piece zeroed for every request was a quarter of a 4 KiB POST's instructions), never
    /// read beyond what the owner wrote into it.
    private var bodyPiece = UnsafeMutableRawBufferPointer(start: nil, count: 0)
    /// Request body bytes waiting in the connection's output beyond which no more are read.
    static let bodyHighWater = 256 * 1024
    private var deferredTimer: LoopTimer?
    /// Steps under way that hold the connection's writes (`holdingWrites`).
    private var holding = 0

    /// Response bytes go through the machine in pieces of at most this many bytes.
    static let readPiece = 64 * 1024

    private enum Step {
        case action(OriginExchange.Action)
        case body([UInt8])
    }

    /// nil when `request` cannot be sent this way (its URL does not parse).
    init(
        owner: any TransferOwner, request: UpstreamRequest, origin: OriginConfig,
        authorization: [(name: String, value: [UInt8])], context: ConnectionContext, connectionID: UInt64
    ) {
        let url: AbsoluteURL
        if let target = Self.target(of: request.url, at: origin) {
            // The origin's parts are parsed and normalised already: only the target is new.
            url = AbsoluteURL(scheme: origin.scheme, authority: origin.authority, pathAndQuery: target)
        } else if case .success(let parsed) = AbsoluteURL.parse(request.url) {
            url = parsed
        } else {
            // Not a URL this client can send (a fragment in the target): the exchange fails at its start.
            url = AbsoluteURL(scheme: origin.scheme, authority: origin.authority, pathAndQuery: "/")
            unsendable = "the request target cannot be sent to the origin (\(TargetText.withoutQuery(request.url)))"
        }
        self.owner = owner
        self.context = context
        self.connectionID = connectionID
        let proxy = request.upstreamProxy
        hop = proxy?.address ?? url.authority
        serverName = url.authority.host
        tunnelled = proxy != nil && url.scheme == "https"
        hopFailure = proxy == nil ? { $0 } : { _ in .proxy }
        https = url.scheme == "https"
        caFile = request.caFile
        key = context.origins.key(
            scheme: url.scheme, authority: url.authority, caFile: request.caFile, proxy: proxy?.address)
        offerHTTP2 = request.http2
        responseHeadLimits = request.responseHeadLimits
        machine = OriginExchange(
            request: OriginExchange.Request(
                method: request.method, url: url, target: request.requestTarget, fields: request.fields,
                body: request.originBody, credential: authorization, proxy: proxy, upgrade: request.upgrade),
            connectTimeout: request.connectTimeout, idleTimeout: request.idleTimeout,
            limits: request.responseHeadLimits)
    }

    deinit {
        dialing?.close()
        connection?.close()
        switched?.close()
        session?.release(stream)
        if let timer { context.spareTimer(timer) }
        bodyPiece.deallocate()
    }

    /// The origin-form target of `url` when it is `origin`'s URL followed by one (as `ProtectedExchange` makes
    /// it), else nil (the URL is parsed whole). A fragment is left to the parser, which refuses it.
    /// Compared in memory: `starts(with:)` and `contains` over the UTF-8 views went byte by byte through
    /// their indices, 1,600 instructions for a short URL.
    static func target(of url: String, at origin: OriginConfig) -> String? {
        let found = url.utf8.withContiguousStorageIfAvailable { whole in
            origin.url.utf8.withContiguousStorageIfAvailable { prefix -> String? in
                guard whole.count > prefix.count, let start = whole.baseAddress, let expected = prefix.baseAddress,
                    memcmp(start, expected, prefix.count) == 0
                else { return nil }
                let rest = UnsafeBufferPointer(rebasing: whole[prefix.count...])
                guard rest.first == UInt8(ascii: "/"), memchr(start + prefix.count, 0x23, rest.count) == nil  // '#'
                else { return nil }
                return String(decoding: rest, as: UTF8.self)
            }
        }
        guard case .some(.some(.some(let target))) = found else { return nil }
        return target
    }

    // MARK: - UpstreamTransfer

    func start() {
        lastActivity = EventLoop.monotonicMilliseconds()
        if let unsendable {
            return later(.connectFailed(.other, detail: unsendable))
        }
        var out = Array.takeScratch(from: &context.originActions, minimumCapacity: 8)
        // A kept connection is taken at once, and the request body would be read from the owner inside its own
        // call: that waits for the top of the loop.
        insideOwnerCall = true
        machine.start(&out)
        run(out)
        insideOwnerCall = false
        out.returnScratch(to: &context.originActions)
        // A kept connection's head waits for the body's first piece (read at the top of the loop) to go out with
        // it; without a body it goes now.
        if bodyRead != nil { later(nil) } else { connection?.flush() }
    }

    func resume() {
        guard !cancelled else { return }
        // The owner has more of the request body (nghttp2 reads it when the stream's window allows).
        if let session, stream != 0 { session.resumeBody(stream) }
        // At the top of the loop, not inside the owner's call.
        later(nil)
    }

    func takeSwitched() -> OriginConnection? {
        defer { switched = nil }
        return switched
    }

    func cancel() {
        guard !cancelled else { return }
        cancelled = true
        stash = []
        deferred = []
        bodyRead = nil
        var out: [OriginExchange.Action] = []
        machine.handle(.cancel, &out)
        run(out)
        timer?.cancel()
        deferredTimer?.cancel()
    }

    // MARK: - Carrying out the machine's actions

    /// Runs `actions`; `input` is what `.deliverBody` ranges point into. Stops handing over to the owner when it
    /// pauses (the rest is stashed) or cancels (only the connection's release still happens).
    private func run(
        _ actions: [OriginExchange.Action], _ range: Range<Int>? = nil, input: UnsafeRawBufferPointer? = nil
    ) {
        // `.write` and `.writeBody` queue; what they queued goes out when the outermost step is done.
        defer { flushUnlessHeld() }
        var index = range?.lowerBound ?? 0
        let end = range?.upperBound ?? actions.count
        while index < end {
            let action = actions[index]
            index += 1
            if cancelled {
                if case .release(let reusable) = action { release(reusable: reusable) }
                continue
            }
            if paused || !stash.isEmpty, Self.isOrdered(action) {
                // After a pause, what reaches the owner (and the connection's release) keeps its order.
                stash.append(Self.step(action, input))
                continue
            }
            switch action {
            case .connect(let reuse):
                connect(reuse: reuse)
            case .arm(let milliseconds):
                armTimer(milliseconds)
            case .write(let bytes):
                bytes.withUnsafeBytes { connection?.queue($0) }
            case .submit(let fields, let body):
                guard let session, let opened = session.open(self, fields: fields, body: body) else {
                    later(.streamFailed(refused: true, detail: "the connection to the origin went away"))
                    continue
                }
                stream = opened
            case .deliverHead(let received):
                owner?.transferResponseHead(self, received)
            case .deliverTrailers(let fields):
                owner?.transferResponseTrailers(self, fields)
            case .deliverBody(let range):
                guard let input else { continue }
                let data = UnsafeRawBufferPointer(rebasing: input[range])
                if owner?.transferBody(self, data) == proxyctl_writefunc_pause() {
                    paused = true
                    stash.append(.body(Array(data)))
                } else if let session {
                    session.consume(stream, data.count)
                }
            case .release(let reusable):
                release(reusable: reusable)
            case .finish(let failure, let detail):
                timer?.cancel()
                owner?.transferFinished(self, failure, detail: detail)
            case .log(let line):
                context.logger.info("conn=\(connectionID) \(line)")
            case .readBody(let most):
                bodyRead = most
            case .startTLS:
                startingTLS = true
                connection?.startTLS()
            case .rewindBody:
                // The owner's store rewinds the body (the read position back to 0) if it kept all of it.
                handle(.bodyRewound(owner?.transferSeek(self, 0) ?? false))
            case .writeBody(let count):
                connection?.queue(UnsafeRawBufferPointer(rebasing: bodyPiece[..<count]))
            case .switchProtocols(let headBytes):
                // Before the 101 reaches the owner, which starts the tunnel with this connection: the head's
                // bytes go, what follows them stays in the input for the tunnel (`readable` drains nothing more).
                guard let used = connection else { continue }
                connection = nil
                used.stopReading()
                used.user = nil
                evbuffer_drain(used.input, headBytes)
                timer?.cancel()
                switched = used
            }
        }
    }

    /// Reads the request body from the owner and hands it to the machine, while it asks for more and the
    /// connection takes it (what waits in the connection's output stays under `bodyHighWater`).
    private func pumpBody() {
        guard !insideOwnerCall, !pumping else { return }
        pumping = true
        defer { pumping = false }
        while let most = bodyRead, !cancelled, !machine.isFinished, let connection {
            if connection.outputLength >= Self.bodyHighWater {
                // What was queued goes now; only a socket that takes no more stops the pump, its write event
                // armed (`connectionDrained` goes on). Stopping with the bytes merely queued would wait forever.
                connection.flush()
                if connection.outputLength >= Self.bodyHighWater { break }
            }
            bodyRead = nil
            if bodyPiece.count < most {
                bodyPiece.deallocate()
                bodyPiece = .allocate(byteCount: most, alignment: 1)
            }
            let count = owner?.transferRead(self, UnsafeMutableRawBufferPointer(rebasing: bodyPiece[..<most])) ?? 0
            if count == proxyctl_readfunc_pause() {
                handle(.bodyPaused)
            } else if count == 0 {
                handle(.bodyEnded(trailers: owner?.transferRequestTrailers(self) ?? []))
            } else {
                lastActivity = EventLoop.monotonicMilliseconds()
                handle(.bodyRead(count))
            }
        }
    }

    /// Whether `action` must wait behind response bytes the owner has not taken yet.
    private static func isOrdered(_ action: OriginExchange.Action) -> Bool {
        switch action {
        case .deliverHead, .deliverBody, .deliverTrailers, .release, .finish: true
        case .connect, .arm, .write, .log, .readBody, .writeBody, .submit, .rewindBody, .startTLS, .switchProtocols:
            false
        }
    }

    private static func step(_ action: OriginExchange.Action, _ input: UnsafeRawBufferPointer?) -> Step {
        if case .deliverBody(let range) = action, let input {
            return .body(Array(UnsafeRawBufferPointer(rebasing: input[range])))
        }
        return .action(action)
    }

    private func handle(_ event: OriginExchange.Event) {
        var out = Array.takeScratch(from: &context.originActions, minimumCapacity: 8)
        holdingWrites {
            machine.handle(event, &out)
            run(out)
            if bodyRead != nil { pumpBody() }
        }
        out.returnScratch(to: &context.originActions)
    }

    /// Runs `body` with the connection's writes held, then writes them together (one TLS record and one send(2)
    /// for a head and the body's first piece, where two were before), unless an outer step or the owner's call
    /// holds them still.
    private func holdingWrites(_ body: () -> Void) {
        holding += 1
        body()
        holding -= 1
        flushUnlessHeld()
    }

    private func flushUnlessHeld() {
        if holding == 0, !insideOwnerCall { connection?.flush() }
    }

    /// `event` (or, for nil, the stashed response and what the connection holds) once the callback that asked
    /// has returned.
    private func later(_ event: OriginExchange.Event?) {
        if let event { deferred.append(event) }
        if deferredTimer == nil {
            // The owner may let go of the transfer inside the callback: it (and so the timer) lives until the end.
            deferredTimer = LoopTimer(loop: context.loop) { [unowned self] in
                withExtendedLifetime(self) { runDeferred() }
            }
        }
        // In this pass, once the callbacks already due have run: a timer of 0 ms waited for the next pass, one
        // more epoll_wait(2) for every request with a body.
        deferredTimer?.fireInThisPass()
    }

    private func runDeferred() {
        holdingWrites {
            while !cancelled, !deferred.isEmpty {
                handle(deferred.removeFirst())
            }
            // The owner has more of the request body (or the start left a read for now).
            if !cancelled, machine.isWaitingForBody { handle(.bodyResumed) }
            pumpBody()
        }
        guard !cancelled, !paused else { return }
        // Resumed: what was read before the pause first, then the connection.
        let steps = stash
        stash = []
        for (position, step) in steps.enumerated() {
            if cancelled { return }
            if paused {
                stash.append(contentsOf: steps[position...])
                return
            }
            switch step {
            case .action(let action):
                run([action])
            case .body(let bytes):
                let taken = bytes.withUnsafeBytes { owner?.transferBody(self, $0) ?? $0.count }
                if taken == proxyctl_writefunc_pause() {
                    paused = true
                    stash.append(contentsOf: steps[position...])
                    return
                }
                session?.consume(stream, bytes.count)
            }
        }
        guard !cancelled, !paused, let connection, session == nil else { return }
        connection.startReading()
        // What the connection's input or OpenSSL held while reading was stopped: nothing wakes the loop for it.
        // The socket's own bytes do (the read event is level-triggered): with nothing held nothing is read here,
        // where every POST's deferred run tried a read that found nothing (a recv(2) and about 2,400
        // instructions, callgrind, bench row 6c).
        if connection.holdsUnread { readable(fill: true) }
    }

    // MARK: - The connection

    private func connect(reuse: Bool) {
        if reuse, let shared = context.origins.session(key) {
            session = shared
            handle(.connected(reused: true, http2: true))
            return
        }
        if reuse, let kept = context.origins.take(key) {
            kept.user = self
            connection = kept
            handle(.connected(reused: true))
            return
        }
        attempt += 1
        let current = attempt
        let bound = LoopBound(self, loop: context.loop)
        context.resolver.resolve(hop, loop: context.loop) { result in
            let transfer = bound.value
            guard transfer.attempt == current, !transfer.cancelled, !transfer.machine.isFinished else { return }
            switch result {
            case .success(let found):
                transfer.addresses = found
                transfer.addressIndex = 0
                transfer.dial()
            case .failure(.notFound):
                transfer.later(
                    .connectFailed(transfer.hopFailure(.dns), detail: "cannot resolve \(transfer.hopName)"))
            case .failure(.temporary(let reason)):
                transfer.later(
                    .connectFailed(transfer.hopFailure(.dns), detail: "cannot resolve \(transfer.hopName): \(reason)"))
            }
        }
    }

    /// Connects to the next address; TCP failures go on to the one after it.
    private func dial() {
        while addressIndex < addresses.count {
            do {
                dialing = try OriginConnection(
                    key: key, loop: context.loop, address: addresses[addressIndex], serverName: serverName,
                    tls: https ? context.tlsClients : nil, caFile: caFile, offerHTTP2: offerHTTP2 && https,
                    tlsLater: tunnelled, user: self)
                return
            } catch {
                addressIndex += 1
                if addressIndex == addresses.count {
                    later(
                        .connectFailed(
                            hopFailure(.connect),
                            detail: "cannot connect to \(hopName): \(String(cString: strerror(error.code)))"))
                }
            }
        }
    }

    /// The hop as the messages name it.
    private var hopName: String { hop == key.authority ? "\(hop)" : "the upstream proxy \(hop)" }

    func connectionReady(_ made: OriginConnection) {
        if made === connection, startingTLS {
            // TLS to the origin through the upstream proxy's tunnel is up.
            startingTLS = false
            lastActivity = EventLoop.monotonicMilliseconds()
            connection = nil
            return connected(made)
        }
        guard made === dialing else { return }
        dialing = nil
        lastActivity = EventLoop.monotonicMilliseconds()
        if tunnelled {
            connection = made
            return handle(.proxyConnected)
        }
        connected(made)
    }

    /// A new connection (TCP, TLS) is ready for the request: an HTTP/2 one becomes shared, the request its first
    /// stream.
    private func connected(_ made: OriginConnection) {
        if made.http2 {
            // The origin chose HTTP/2: the connection becomes a shared one, this request its first stream.
            let shared = OriginH2Session(key: key, connection: made, loop: context.loop, limits: responseHeadLimits)
            context.origins.add(shared)
            session = shared
            handle(.connected(reused: false, http2: true))
            return
        }
        connection = made
        handle(.connected(reused: false))
    }

    func connectionFailed(_ made: OriginConnection, _ failure: UpstreamFailure, detail: String) {
        if made === connection, startingTLS {
            startingTLS = false
            connection = nil
            // The answer names the origin already (UpstreamFailure.describe).
            return handle(.connectFailed(failure, detail: detail))
        }
        guard made === dialing else { return }
        dialing = nil
        if failure == .connect, addressIndex + 1 < addresses.count {
            addressIndex += 1
            return dial()
        }
        // A TLS failure is the origin's (the answer names it already); others name the hop, which may be the
        // upstream proxy.
        let named = failure == .certificate || failure == .tls ? detail : "\(hopName): \(detail)"
        handle(.connectFailed(hopFailure(failure), detail: named))
    }

    func connectionBroke(_ used: OriginConnection, detail: String) {
        guard used === connection else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        handle(.broken(detail: "the connection to \(hop) broke: \(detail)"))
    }

    func connectionDrained(_ used: OriginConnection) {
        guard used === connection else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        holdingWrites { pumpBody() }
    }

    func connectionReadable(_ used: OriginConnection) {
        guard used === connection else { return }
        readable(fill: true)
    }

    // MARK: - OriginStreamUser (the HTTP/2 stream's events, at the top of the loop)

    func streamEvent(_ event: OriginExchange.Event) {
        guard !cancelled else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        // What reaches the owner waits behind response bytes it has not taken yet (`run` keeps the order).
        handle(event)
    }

    func streamData(_ bytes: [UInt8]) {
        guard !cancelled else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        var out = Array.takeScratch(from: &context.originActions, minimumCapacity: 4)
        defer { out.returnScratch(to: &context.originActions) }
        bytes.withUnsafeBytes { input in
            _ = machine.received(input, &out)
            run(out, input: input)
        }
    }

    func streamReadBody(_ buffer: UnsafeMutableRawBufferPointer) -> Int {
        guard !cancelled else { return 0 }
        lastActivity = EventLoop.monotonicMilliseconds()
        return owner?.transferRead(self, buffer) ?? 0
    }

    func streamTrailers() -> [H2Field] {
        owner?.transferRequestTrailers(self) ?? []
    }

    private func release(reusable: Bool) {
        dialing?.close()
        dialing = nil
        attempt += 1  // a resolver answer still to come is for nobody
        if let used = session {
            used.release(stream)
            session = nil
            stream = 0
        }
        defer { peerClosed = false }
        guard let used = connection else { return }
        connection = nil
        used.user = nil
        if reusable, !peerClosed, evbuffer_get_length(used.input) == 0 {
            context.origins.keep(used)
        } else {
            used.close()
        }
    }

    /// Reads what the connection holds into the machine, piece by piece, until the owner pauses, the response
    /// ends, or the socket has nothing more.
    private func readable(fill: Bool) {
        lastActivity = EventLoop.monotonicMilliseconds()
        var more = fill
        while !cancelled, !paused, !machine.isFinished, let used = connection {
            if more {
                more = false
                switch used.fill() {
                case .wouldBlock: break
                case .limit: more = true
                case .ended: peerClosed = true
                case .failed(let detail):
                    // What was read before the failure still counts (a response may have ended in it).
                    if evbuffer_get_length(used.input) == 0 {
                        return handle(.broken(detail: "the connection to \(hop) broke: \(detail)"))
                    }
                    peerClosed = true
                }
            }
            let input = used.input
            // A piece as `fill` read it (64 KiB), or small ones made contiguous: a memcpy costs less than a pass
            // through the machine.
            let contiguous = evbuffer_get_contiguous_space(input)
            let length = contiguous >= 16 * 1024 ? contiguous : min(evbuffer_get_length(input), Self.readPiece)
            guard length > 0, let start = evbuffer_pullup(input, length) else {
                if more { continue }
                break
            }
            let bytes = UnsafeRawBufferPointer(start: start, count: length)
            var out = Array.takeScratch(from: &context.originActions, minimumCapacity: 8)
            defer { out.returnScratch(to: &context.originActions) }
            _ = machine.received(bytes, &out)
            // The bytes are handed over first (the ranges point into them), then drained, then the connection is
            // released (back to the pool with nothing of this response left in it) or its TLS starts: a handshake
            // can finish within `startTLS` (the origin's whole flight already there when the process was
            // preempted between sending its hello and reading), and the HTTP/2 session made then must not find the
            // upstream proxy's answer in the input as its first bytes.
            let split =
                out.firstIndex {
                    switch $0 {
                    case .release, .startTLS: true
                    default: false
                    }
                } ?? out.count
            run(out, 0..<split, input: bytes)
            // The owner may have cancelled meanwhile: the connection is then gone.
            if connection === used { evbuffer_drain(input, length) }
            if split < out.count { run(out, split..<out.count, input: bytes) }
        }
        if paused { connection?.stopReading() }
        if peerClosed, !paused, !cancelled, !machine.isFinished, let used = connection,
            evbuffer_get_length(used.input) == 0
        {
            handle(.closed)
        }
    }

    private func armTimer(_ milliseconds: Int) {
        if timer == nil {
            timer = context.takeTimer { [unowned self] in
                withExtendedLifetime(self) {
                    let idle = paused ? 0 : Int(EventLoop.monotonicMilliseconds() - lastActivity)
                    handle(.timerFired(idle: idle))
                }
            }
        }
        timer?.schedule(milliseconds: milliseconds)
    }

}
