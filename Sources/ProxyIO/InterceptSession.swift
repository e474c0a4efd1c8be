import CLibevent
import COpenSSL
import ProxyCore
import ProxyTLS

/// An intercepted tunnel to a protected https origin: TLS terminated with a leaf from the local CA, then
/// HTTP/1.1 requests (keep-alive, pipelining) each handled by an `InterceptedExchange`.
///
/// Fail closed: when the client's SNI names another host than the CONNECT authority, or a request's Host
/// does, the answer is 421 and no token is attached.
final class InterceptSession: ServerConnection, InterceptOwner {
    unowned let server: ProxyServer
    let connectionID: UInt64
    let peer: String
    let origin: OriginConfig
    private var client: OpaquePointer?
    private var ssl: OpaquePointer
    private var parser: HTTPHeadParser
    private var exchange: InterceptedExchange?
    private var handshakeDone = false
    /// Set when the SNI does not match the CONNECT authority: every request gets 421.
    private var misdirected: String?
    private var closing = false
    private var closed = false
    private let started = EventLoop.monotonicMilliseconds()
    private var requests = 0

    var clientBufferevent: OpaquePointer? { client }

    /// TLS directly on the socket `fd`.
    convenience init(
        server: ProxyServer, id: UInt64, peer: String, origin: OriginConfig, fd: Int32, ssl: OpaquePointer
    ) {
        let client = bufferevent_openssl_socket_new(
            server.loop.base, fd, ssl, BUFFEREVENT_SSL_ACCEPTING, Self.bufferOptions)
        self.init(server: server, id: id, peer: peer, origin: origin, ssl: ssl, client: client)
    }

    /// TLS as a filter over a bufferevent that already holds bytes from the client.
    convenience init(
        server: ProxyServer, id: UInt64, peer: String, origin: OriginConfig, underlying: OpaquePointer,
        ssl: OpaquePointer
    ) {
        let client = bufferevent_openssl_filter_new(
            server.loop.base, underlying, ssl, BUFFEREVENT_SSL_ACCEPTING, Self.bufferOptions)
        self.init(server: server, id: id, peer: peer, origin: origin, ssl: ssl, client: client)
    }

    private static let bufferOptions = Int32(BEV_OPT_CLOSE_ON_FREE.rawValue | BEV_OPT_DEFER_CALLBACKS.rawValue)

    private init(
        server: ProxyServer, id: UInt64, peer: String, origin: OriginConfig, ssl: OpaquePointer,
        client: OpaquePointer?
    ) {
        self.server = server
        self.connectionID = id
        self.peer = peer
        self.origin = origin
        self.ssl = ssl
        self.parser = HTTPHeadParser(kind: .request, limits: server.settings.headLimits)
        self.client = client
        setUp()
    }

    private func setUp() {
        guard let client else {
            server.logger.error("conn=\(connectionID) cannot start TLS for \(origin.url)")
            closed = true
            return
        }
        bufferevent_openssl_set_allow_dirty_shutdown(client, 1)
        ProxyServer.tune(client)
        let context = Unmanaged.passUnretained(self).toOpaque()
        bufferevent_setcb(
            client,
            { _, context in Unmanaged<InterceptSession>.fromOpaque(context!).takeUnretainedValue().readable() },
            { _, context in Unmanaged<InterceptSession>.fromOpaque(context!).takeUnretainedValue().writable() },
            { _, events, context in Unmanaged<InterceptSession>.fromOpaque(context!).takeUnretainedValue().event(events)
            },
            context)
        var handshake = timeval(milliseconds: server.settings.headerTimeout)
        bufferevent_set_timeouts(client, &handshake, &handshake)
        bufferevent_enable(client, Int16(EV_READ | EV_WRITE))
    }

    var isIdle: Bool { exchange == nil && !parser.hasPartialHead }

    // MARK: - Events

    private func event(_ events: Int16) {
        let what = Int32(events)
        if what & Int32(BEV_EVENT_CONNECTED) != 0 {
            handshakeDone = true
            // RFC 6066 §3: the SNI names the host the client means; it must be the CONNECT authority.
            if let name = tlsServerName(ssl) {
                var normalized = name.lowercased()
                // Some clients (Go behind a proxy) send host:port; the port must then be the tunnel's.
                if normalized.hasSuffix(":\(origin.authority.port)") {
                    normalized.removeLast(":\(origin.authority.port)".count)
                }
                if normalized.hasSuffix(".") { normalized.removeLast() }
                if normalized != origin.authority.host {
                    misdirected =
                        "the TLS server name \(ASCIIText.clip(name)) does not match the tunnel's \(origin.authority.host)"
                }
            }
            var idle = timeval(milliseconds: server.settings.keepAliveTimeout)
            var write = timeval(milliseconds: server.settings.idleTimeout)
            bufferevent_set_timeouts(client, &idle, &write)
            return
        }
        if what & Int32(BEV_EVENT_TIMEOUT) != 0 {
            if let exchange, !exchange.finished {
                // A slow origin or a slow client: the transfer has its own idle limit (LOW_SPEED_TIME).
                bufferevent_enable(client, Int16(EV_READ | EV_WRITE))
                return
            }
            if parser.hasPartialHead {
                respond(
                    ProxyResponse(
                        status: 408,
                        proxyStatus: ProxyStatus(error: .httpRequestError, details: "request head incomplete"),
                        message: "proxyctl: the request head did not arrive in time", close: true))
                return
            }
            return close()
        }
        if !handshakeDone {
            server.logger.info(
                "conn=\(connectionID) client=\(peer) CONNECT \(origin.authority) TLS handshake failed: \(tlsErrors()) (does the client trust the local CA? see proxyctl env)"
            )
            return close()
        }
        // EOF or error from the client.
        if what & Int32(BEV_EVENT_EOF) != 0, let exchange, !exchange.finished, exchange.body.complete {
            // The client finished sending; its answer can still be delivered.
            closing = true
            return
        }
        abort(nil)
    }

    private func tlsErrors() -> String {
        var messages: [String] = []
        while true {
            let code = bufferevent_get_openssl_error(client)
            if code == 0 { break }
            var buffer = [CChar](repeating: 0, count: 200)
            ERR_error_string_n(code, &buffer, buffer.count)
            messages.append(String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self))
        }
        return messages.isEmpty ? "connection closed" : messages.joined(separator: "; ")
    }

    private func readable() {
        if let exchange, !exchange.finished {
            exchange.pumpBody()
            return
        }
        if closing { return }
        readHeads()
    }

    private func writable() {
        if closing && exchange == nil && Buffers.length(bufferevent_get_output(client)) == 0 {
            return close()
        }
        exchange?.clientDrained()
    }

    // MARK: - Requests

    private func readHeads() {
        guard let client else { return }
        let input = bufferevent_get_input(client)
        while exchange == nil && !closing && Buffers.length(input) > 0 {
            let outcome = Buffers.readHead(&parser, from: input)
            switch outcome {
            case .needMore:
                var header = timeval(milliseconds: server.settings.headerTimeout)
                var write = timeval(milliseconds: server.settings.idleTimeout)
                bufferevent_set_timeouts(client, &header, &write)
                return
            case .failed(let error):
                return respond(FrontDoor.reject(error))
            case .complete(let head, _):
                handle(head)
            }
        }
    }

    private func handle(_ head: HTTPHead) {
        requests += 1
        if let misdirected {
            return refuse(head, .misdirected(misdirected))
        }
        let checked = MessageSemantics.interceptedRequest(head, scheme: "https", origin: origin.authority) { hasOwn in
            origin.clientAuthorization == .replace || !hasOwn
        }
        switch checked {
        case .failure(let refusal):
            refuse(head, refusal)
        case .success(let request):
            if request.upgrade {
                return refuse(
                    head, .unsupported("protocol upgrades (WebSocket) to protected origins are not supported"))
            }
            var idle = timeval(milliseconds: server.settings.idleTimeout)
            bufferevent_set_timeouts(client, &idle, &idle)
            let exchange = InterceptedExchange(owner: self, server: server, request: request, origin: origin)
            self.exchange = exchange
            exchange.start()
        }
    }

    private func refuse(_ head: HTTPHead, _ refusal: InterceptRefusal) {
        let response = refusal.response
        server.logger.info(
            "conn=\(connectionID) client=\(peer) \(head.method) \(origin.url)\(LogText.target(head.target)) status=\(response.status) answered-by=proxyctl reason=\"\(response.proxyStatus?.details ?? "")\""
        )
        respond(response)
    }

    private func respond(_ response: ProxyResponse) {
        guard let client else { return }
        Buffers.append(response.serialized(), to: bufferevent_get_output(client))
        if response.close {
            closeAfterFlush()
        }
    }

    func exchangeFinished(close: Bool) {
        exchange = nil
        if close || closing || server.draining {
            closeAfterFlush()
            return
        }
        guard let client else { return }
        bufferevent_setwatermark(client, Int16(EV_WRITE), 0, 0)
        bufferevent_enable(client, Int16(EV_READ))
        var idle = timeval(milliseconds: server.settings.keepAliveTimeout)
        var write = timeval(milliseconds: server.settings.idleTimeout)
        bufferevent_set_timeouts(client, &idle, &write)
        readHeads()
    }

    private func closeAfterFlush() {
        closing = true
        guard let client else { return }
        bufferevent_disable(client, Int16(EV_READ))
        bufferevent_setwatermark(client, Int16(EV_WRITE), 0, 0)
        if Buffers.length(bufferevent_get_output(client)) == 0 { close() }
    }

    func abort(_ reason: String?) {
        exchange?.abort()
        exchange = nil
        close()
    }

    func close() {
        guard !closed else { return }
        closed = true
        exchange?.abort()
        exchange = nil
        if let client {
            bufferevent_free(client)
            self.client = nil
        }
        server.logger.debug(
            "conn=\(connectionID) client=\(peer) CONNECT \(origin.authority) intercepted: \(requests) request(s) in \(LogText.duration(EventLoop.monotonicMilliseconds() - started))"
        )
        server.connectionClosed(self)
    }
}

enum ASCIIText {
    static func clip(_ text: String) -> String {
        let printable = String(text.unicodeScalars.map { $0.value >= 0x20 && $0.value < 0x7F ? Character($0) : "?" })
        return printable.count > 80 ? String(printable.prefix(80)) + "..." : printable
    }
}
