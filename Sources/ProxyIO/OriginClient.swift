import CCurl
import CLibevent
import COpenSSL
import Foundation
import ProxyCore
import ProxyTLS

/// A request to a protected origin in flight: a libcurl transfer (`InterceptTransfer`) or one of the proxy's
/// own HTTP/1.1 client (`OriginTransfer`). Its callbacks reach the owner at the top of the loop, never inside
/// a call the owner made.
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
}

/// The proxy's own kept connections to protected origins (for `OriginTransfer`), by origin: the most
/// recently used first, each closed after `keepMilliseconds` unused or when the origin closes it meanwhile.
/// One per `ConnectionContext`, so a reload (new `resolve`, new origins) starts with new connections.
final class OriginPool {
    private let loop: EventLoop
    private var idle: [String: [OriginConnection]] = [:]
    /// Kept connections per origin beyond which a released one is closed.
    static let perOriginLimit = 64
    /// A kept connection unused this long is closed (origins close theirs after 60-75 s; libcurl keeps
    /// its for 118 s).
    static let keepMilliseconds = 55_000

    init(loop: EventLoop) { self.loop = loop }

    /// A kept connection to `key`'s origin, taken out of the pool; nil when there is none.
    func take(_ key: String) -> OriginConnection? {
        while var list = idle[key], let connection = list.popLast() {
            idle[key] = list.isEmpty ? nil : list
            connection.idleTimer?.cancel()
            // Bytes the origin sent while the connection was unused (a 408 before closing, say) are not a
            // response to the next request.
            if let bev = connection.bev, evbuffer_get_length(bufferevent_get_input(bev)) == 0 { return connection }
            connection.close()
        }
        return nil
    }

    /// Keeps `connection` for the next request to its origin.
    func keep(_ connection: OriginConnection) {
        var list = idle[connection.key] ?? []
        guard list.count < Self.perOriginLimit else {
            connection.close()
            return
        }
        connection.pool = self
        list.append(connection)
        idle[connection.key] = list
        if connection.idleTimer == nil {
            connection.idleTimer = LoopTimer(loop: loop) { [unowned self, unowned connection] in drop(connection) }
        }
        connection.idleTimer?.schedule(milliseconds: Self.keepMilliseconds)
    }

    /// Closes a kept connection (its time ran out, or the origin closed it or sent bytes unasked).
    func drop(_ connection: OriginConnection) {
        connection.close()
        guard var list = idle[connection.key], let index = list.firstIndex(where: { $0 === connection }) else {
            return
        }
        list.remove(at: index)
        idle[connection.key] = list.isEmpty ? nil : list
    }

    /// Closes every kept connection (shutdown).
    func closeAll() {
        for list in idle.values { for connection in list { connection.close() } }
        idle = [:]
    }

    deinit { closeAll() }
}

/// One connection to an origin (TLS for https), used by one `OriginTransfer` at a time and kept in the
/// `OriginPool` between requests. Its bufferevent's callbacks go to the transfer using it, or to the pool.
final class OriginConnection {
    let key: String
    private(set) var bev: OpaquePointer?
    weak var user: OriginTransfer?
    weak var pool: OriginPool?
    var idleTimer: LoopTimer?

    init(key: String, bev: OpaquePointer) {
        self.key = key
        self.bev = bev
        bufferevent_setcb(
            bev, originReadCallback, nil, originEventCallback, Unmanaged.passUnretained(self).toOpaque())
        bufferevent_enable(bev, Int16(EV_READ | EV_WRITE))
    }

    func close() {
        idleTimer?.cancel()
        guard let bev else { return }
        bufferevent_free(bev)
        self.bev = nil
    }

    deinit { close() }

    fileprivate func readable() {
        if let user {
            user.readable()
        } else {
            // Bytes the origin sent unasked: the connection is out of step.
            pool?.drop(self)
        }
    }

    fileprivate func event(_ events: Int16) {
        if let user {
            user.connectionEvent(events)
        } else {
            pool?.drop(self)
        }
    }
}

private let originReadCallback: bufferevent_data_cb = { _, context in
    let connection = Unmanaged<OriginConnection>.fromOpaque(context!).takeUnretainedValue()
    withExtendedLifetime(connection) { connection.readable() }
}
private let originEventCallback: bufferevent_event_cb = { _, events, context in
    let connection = Unmanaged<OriginConnection>.fromOpaque(context!).takeUnretainedValue()
    withExtendedLifetime(connection) { connection.event(events) }
}

/// One GET or HEAD to a protected origin on the proxy's own HTTP/1.1 client: carries out what its
/// `OriginExchange` decides (which connection, the head written, the response read and handed to the owner as
/// libcurl's callbacks would, the timer, the connection kept or closed). Decides nothing itself; flow control
/// is the owner's, as with libcurl: a paused response keeps what was read and stops reading the origin.
final class OriginTransfer: UpstreamTransfer {
    unowned let owner: any TransferOwner
    private let context: ConnectionContext
    private let connectionID: UInt64
    var paused = false
    private(set) var cancelled = false
    var tag: Int32 = 0
    var uploadOffset = 0

    private var machine: OriginExchange
    private let key: String
    private let hop: HostPort
    private let https: Bool
    private let caFile: String?
    /// The connection the request is on, once there is one.
    private var connection: OriginConnection?
    /// A connection being made: its socket, the addresses left, and whether TLS is being set up on it.
    private var dialing: OpaquePointer?
    private var addresses: [SocketAddress] = []
    private var addressIndex = 0
    private var dialingTLS = false
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
    private var deferredTimer: LoopTimer?

    private enum Step {
        case action(OriginExchange.Action)
        case body([UInt8])
    }

    /// nil when `request` cannot be sent this way (its URL does not parse).
    init?(
        owner: any TransferOwner, request: UpstreamRequest, authorization: [(name: String, value: [UInt8])],
        context: ConnectionContext, connectionID: UInt64
    ) {
        guard case .success(let url) = AbsoluteURL.parse(request.url),
            let head = UpstreamRequest.http1Head(
                method: request.method, url: request.url, fields: request.fields, credential: authorization)
        else { return nil }
        self.owner = owner
        self.context = context
        self.connectionID = connectionID
        hop = url.authority
        https = url.scheme == "https"
        caFile = request.caFile
        key = "\(url.scheme)://\(url.authority) \(request.caFile ?? "")"
        machine = OriginExchange(
            method: request.method, url: request.url, head: head, connectTimeout: request.connectTimeout,
            idleTimeout: request.idleTimeout)
    }

    deinit {
        if let dialing { Self.abandon(dialing) }
        connection?.close()
    }

    // MARK: - UpstreamTransfer

    func start() {
        lastActivity = EventLoop.monotonicMilliseconds()
        var out: [OriginExchange.Action] = []
        machine.start(&out)
        run(out)
    }

    func resume() {
        guard !cancelled else { return }
        // At the top of the loop, not inside the owner's call.
        later(nil)
    }

    func cancel() {
        guard !cancelled else { return }
        cancelled = true
        stash = []
        deferred = []
        var out: [OriginExchange.Action] = []
        machine.handle(.cancel, &out)
        run(out)
        timer = nil
        deferredTimer = nil
    }

    // MARK: - Carrying out the machine's actions

    /// Runs `actions`; `input` is what `.deliverBody` ranges point into. Stops handing over to the owner when it
    /// pauses (the rest is stashed) or cancels (only the connection's release still happens).
    private func run(_ actions: [OriginExchange.Action], input: UnsafeRawBufferPointer? = nil) {
        var index = 0
        while index < actions.count {
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
                guard let bev = connection?.bev else { continue }
                bytes.withUnsafeBytes { _ = bufferevent_write(bev, $0.baseAddress, $0.count) }
            case .deliverHead(let bytes), .deliverTrailers(let bytes):
                bytes.withUnsafeBytes { owner.transferHeader(self, $0) }
            case .deliverBody(let range):
                guard let input else { continue }
                let data = UnsafeRawBufferPointer(rebasing: input[range])
                if owner.transferBody(self, data) == proxyctl_writefunc_pause() {
                    paused = true
                    stash.append(.body(Array(data)))
                }
            case .release(let reusable):
                release(reusable: reusable)
            case .finish(let failure, let detail):
                timer?.cancel()
                owner.transferFinished(self, failure, detail: detail)
            case .log(let line):
                context.logger.info("conn=\(connectionID) \(line)")
            }
        }
    }

    /// Whether `action` must wait behind response bytes the owner has not taken yet.
    private static func isOrdered(_ action: OriginExchange.Action) -> Bool {
        switch action {
        case .deliverHead, .deliverBody, .deliverTrailers, .release, .finish: true
        case .connect, .arm, .write, .log: false
        }
    }

    private static func step(_ action: OriginExchange.Action, _ input: UnsafeRawBufferPointer?) -> Step {
        if case .deliverBody(let range) = action, let input {
            return .body(Array(UnsafeRawBufferPointer(rebasing: input[range])))
        }
        return .action(action)
    }

    private func handle(_ event: OriginExchange.Event) {
        var out: [OriginExchange.Action] = []
        machine.handle(event, &out)
        run(out)
    }

    /// `event` (or, for nil, the stashed response and what the connection holds) at the top of the loop.
    private func later(_ event: OriginExchange.Event?) {
        if let event { deferred.append(event) }
        if deferredTimer == nil {
            deferredTimer = LoopTimer(loop: context.loop) { [unowned self] in runDeferred() }
        }
        deferredTimer?.schedule(milliseconds: 0)
    }

    private func runDeferred() {
        while !cancelled, !deferred.isEmpty {
            handle(deferred.removeFirst())
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
                if owner.transferBody(self, bytes.withUnsafeBytes { $0 }) == proxyctl_writefunc_pause() {
                    paused = true
                    stash.append(contentsOf: steps[position...])
                    return
                }
            }
        }
        guard !cancelled, !paused, let bev = connection?.bev else { return }
        bufferevent_enable(bev, Int16(EV_READ))
        readable()
    }

    // MARK: - The connection

    private func connect(reuse: Bool) {
        if reuse, let kept = context.origins.take(key), kept.bev != nil {
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
                transfer.later(.connectFailed(.dns, detail: "cannot resolve \(transfer.hop.host)"))
            case .failure(.temporary(let reason)):
                transfer.later(.connectFailed(.dns, detail: "cannot resolve \(transfer.hop.host): \(reason)"))
            }
        }
    }

    /// Connects to the next address (TCP first; TLS is set up on the socket once it is connected).
    private func dial() {
        guard addressIndex < addresses.count,
            let bev = bufferevent_socket_new(context.loop.base, -1, Int32(BEV_OPT_DEFER_CALLBACKS.rawValue))
        else {
            later(.connectFailed(.connect, detail: "cannot connect to \(hop)"))
            return
        }
        dialing = bev
        dialingTLS = false
        bufferevent_setcb(bev, nil, nil, dialEventCallback, Unmanaged.passUnretained(self).toOpaque())
        let status = addresses[addressIndex].withSockaddr { pointer, length in
            bufferevent_socket_connect(bev, UnsafeMutablePointer(mutating: pointer), Int32(length))
        }
        if status != 0 { dialFailed(proxyctl_errno()) }
    }

    fileprivate func dialEvent(_ events: Int16) {
        guard let bev = dialing else { return }
        let what = Int32(events)
        if dialingTLS {
            dialing = nil
            if what & Int32(BEV_EVENT_CONNECTED) != 0 {
                established(bev)
            } else {
                let failure: (UpstreamFailure, String)
                if let ssl = bufferevent_openssl_get_ssl(bev), let reason = tlsVerifyFailure(ssl) {
                    failure = (.certificate, "the certificate of \(hop) does not verify: \(reason)")
                } else {
                    failure = (.tls, "TLS handshake with \(hop) failed: \(Self.tlsErrors(bev))")
                }
                bufferevent_free(bev)
                handle(.connectFailed(failure.0, detail: failure.1))
            }
            return
        }
        guard what & Int32(BEV_EVENT_CONNECTED) != 0 else {
            var code = proxyctl_socket_error(bufferevent_getfd(bev))
            if code == 0 { code = proxyctl_errno() }
            dialFailed(code)
            return
        }
        let fd = bufferevent_getfd(bev)
        _ = proxyctl_set_nodelay(fd)
        bufferevent_free(bev)  // not BEV_OPT_CLOSE_ON_FREE: the socket lives on
        dialing = nil
        let options = Int32(BEV_OPT_CLOSE_ON_FREE.rawValue | BEV_OPT_DEFER_CALLBACKS.rawValue)
        guard https else {
            guard let plain = bufferevent_socket_new(context.loop.base, fd, options) else {
                _ = Glibc.close(fd)
                return handle(.connectFailed(.other, detail: "cannot use the connection to \(hop)"))
            }
            return established(plain)
        }
        let ssl: OpaquePointer
        do {
            ssl = try context.tlsClients.makeSSL(serverName: hop.host, caFile: caFile)
        } catch {
            _ = Glibc.close(fd)
            return handle(.connectFailed(.tls, detail: "TLS with \(hop) cannot start: \(error)"))
        }
        guard
            let secure = bufferevent_openssl_socket_new(context.loop.base, fd, ssl, BUFFEREVENT_SSL_CONNECTING, options)
        else {
            SSL_free(ssl)
            _ = Glibc.close(fd)
            return handle(.connectFailed(.tls, detail: "TLS with \(hop) cannot start"))
        }
        bufferevent_openssl_set_allow_dirty_shutdown(secure, 1)
        dialing = secure
        dialingTLS = true
        bufferevent_setcb(secure, nil, nil, dialEventCallback, Unmanaged.passUnretained(self).toOpaque())
        bufferevent_enable(secure, Int16(EV_READ | EV_WRITE))
    }

    /// TCP to the current address failed: the next one, or the end.
    private func dialFailed(_ code: Int32) {
        if let bev = dialing { Self.abandon(bev) }
        dialing = nil
        addressIndex += 1
        if addressIndex < addresses.count { return dial() }
        let reason = code == 0 ? "unreachable" : String(cString: strerror(code))
        later(.connectFailed(.connect, detail: "cannot connect to \(hop): \(reason)"))
    }

    private func established(_ bev: OpaquePointer) {
        ClientDriver.tune(bev)
        let made = OriginConnection(key: key, bev: bev)
        made.user = self
        connection = made
        lastActivity = EventLoop.monotonicMilliseconds()
        handle(.connected(reused: false))
    }

    /// Closes a socket bufferevent made without BEV_OPT_CLOSE_ON_FREE (a TCP connect in progress).
    private static func abandon(_ bev: OpaquePointer) {
        let fd = bufferevent_getfd(bev)
        bufferevent_free(bev)
        if fd >= 0 { _ = Glibc.close(fd) }
    }

    private func release(reusable: Bool) {
        if let dialing {
            if dialingTLS { bufferevent_free(dialing) } else { Self.abandon(dialing) }
            self.dialing = nil
        }
        attempt += 1  // a resolver answer still to come is for nobody
        defer { peerClosed = false }
        guard let used = connection else { return }
        connection = nil
        used.user = nil
        if reusable, !peerClosed, let bev = used.bev, evbuffer_get_length(bufferevent_get_input(bev)) == 0 {
            context.origins.keep(used)
        } else {
            used.close()
        }
    }

    /// Reads what the connection holds into the machine, segment by segment, until the owner pauses or the
    /// response ends.
    fileprivate func readable() {
        lastActivity = EventLoop.monotonicMilliseconds()
        while !cancelled, !paused, !machine.isFinished, let bev = connection?.bev {
            let input = bufferevent_get_input(bev)
            let length = evbuffer_get_contiguous_space(input)
            guard length > 0, let start = evbuffer_pullup(input, length) else { break }
            let bytes = UnsafeRawBufferPointer(start: start, count: length)
            var out: [OriginExchange.Action] = []
            _ = machine.received(bytes, &out)
            // The bytes are handed over first (the ranges point into them), then drained, then the connection is
            // released: back to the pool with nothing of this response left in it.
            let split = out.firstIndex { if case .release = $0 { true } else { false } } ?? out.count
            run(Array(out[..<split]), input: bytes)
            // The owner may have cancelled meanwhile: the connection is then gone.
            if let still = connection?.bev, still == bev { evbuffer_drain(input, length) }
            if split < out.count { run(Array(out[split...]), input: bytes) }
        }
        if paused, let bev = connection?.bev { bufferevent_disable(bev, Int16(EV_READ)) }
        if peerClosed, !paused, !cancelled, !machine.isFinished { handle(.closed) }
    }

    fileprivate func connectionEvent(_ events: Int16) {
        let what = Int32(events)
        lastActivity = EventLoop.monotonicMilliseconds()
        if what & Int32(BEV_EVENT_EOF) != 0 {
            peerClosed = true
            if let bev = connection?.bev, paused || evbuffer_get_length(bufferevent_get_input(bev)) > 0 { return }
            handle(.closed)
        } else if what & Int32(BEV_EVENT_ERROR) != 0 {
            let detail: String
            if let bev = connection?.bev, bufferevent_openssl_get_ssl(bev) != nil {
                detail = "the connection to \(hop) broke: \(Self.tlsErrors(bev))"
            } else {
                let code = proxyctl_errno()
                detail = "the connection to \(hop) broke: \(String(cString: strerror(code)))"
            }
            peerClosed = true
            handle(.broken(detail: detail))
        }
    }

    private func armTimer(_ milliseconds: Int) {
        if timer == nil {
            timer = LoopTimer(loop: context.loop) { [unowned self] in
                let idle = paused ? 0 : Int(EventLoop.monotonicMilliseconds() - lastActivity)
                handle(.timerFired(idle: idle))
            }
        }
        timer?.schedule(milliseconds: milliseconds)
    }

    private static func tlsErrors(_ bev: OpaquePointer) -> String {
        var messages: [String] = []
        while true {
            let code = bufferevent_get_openssl_error(bev)
            if code == 0 { break }
            var buffer = [CChar](repeating: 0, count: 200)
            ERR_error_string_n(code, &buffer, buffer.count)
            messages.append(String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self))
        }
        return messages.isEmpty ? "connection closed" : messages.joined(separator: "; ")
    }
}

private let dialEventCallback: bufferevent_event_cb = { _, events, context in
    let transfer = Unmanaged<OriginTransfer>.fromOpaque(context!).takeUnretainedValue()
    withExtendedLifetime(transfer) { transfer.dialEvent(events) }
}
