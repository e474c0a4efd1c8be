import CLibevent
import ProxyCore
import ProxyTLS

/// One client connection: reads request heads, asks the front door what to do, and runs the answer
/// (a response of its own, a blind tunnel, or a forwarded exchange).
///
/// Owned by `ProxyServer.connections` from accept to close; libevent reaches it through `Unmanaged` contexts
/// on its bufferevents. Lives on the loop thread only.
final class ClientConnection: ServerConnection, InterceptOwner {
    /// Where the connection is in its life. Transitions are noted on each case.
    enum Phase {
        /// Waiting for or parsing a request head. -> `.connecting` (tunnel or forward), `.forwarding` (reused
        /// upstream), `.closing` (an answer of ours that ends the connection), stays on keep-alive answers.
        case readingHead
        /// Resolving and connecting to the next hop. -> `.upstreamHandshake`, `.forwarding`, `.closing`, or closed
        /// when a `SpliceTunnel` takes the sockets over.
        case connecting
        /// CONNECT sent to the upstream proxy, reading its answer. -> a `SpliceTunnel`, or `.closing`.
        case upstreamHandshake
        /// A request and its response in flight. -> `.readingHead` (keep-alive), `.closing`, a `SpliceTunnel`
        /// (101).
        case forwarding
        /// A request to a protected http:// origin in flight (`intercepted`). -> `.readingHead`, `.closing`.
        case intercepting
        /// Flushing the last bytes to the client, then closed.
        case closing
        case closed
    }

    /// What to do once the next hop is connected.
    enum Pending {
        case tunnel(target: HostPort, upstream: UpstreamProxy?)
        case forward(FrontDoorDecision.Forward)
    }

    unowned let server: ProxyServer
    let id: UInt64
    let peer: String
    private(set) var client: OpaquePointer?
    private var upstream: OpaquePointer?
    /// The address `upstream` is connected to (the origin, or the upstream proxy), for reuse.
    private var upstreamKey: HostPort?
    private var upstreamReused = false
    var phase = Phase.readingHead
    private var parser: HTTPHeadParser
    private var pending: Pending?
    private var exchange: Exchange?
    private var tunnel: TunnelInfo?
    private var resolveTimer: LoopTimer?
    private var addresses: [SocketAddress] = []
    private var addressIndex = 0
    private var lastConnectError: Int32 = 0
    private var connectDeadline: Int64 = 0
    private var clientEOF = false
    private var intercepted: InterceptedExchange?

    // InterceptOwner
    var clientBufferevent: OpaquePointer? { client }
    var connectionID: UInt64 { id }

    /// Per-request state of a forwarded exchange.
    final class Exchange {
        let forward: FrontDoorDecision.Forward
        let started: Int64
        var requestBody: FramedBody
        var responseParser: HTTPHeadParser
        var responseHeadDone = false
        var responseBody = FramedBody(.none)
        var status = 0
        var closeAfter = false
        var serverCloses = false
        var bytesUp = 0
        var bytesDown = 0
        /// Any byte of a response reached the client (then no answer of ours can be sent any more).
        var clientSawResponse = false
        var retried = false
        /// Bytes of response heads read from the upstream (interim ones included).
        var bytesDownHead = 0

        init(forward: FrontDoorDecision.Forward, limits: HTTPHeadLimits) {
            self.forward = forward
            self.started = EventLoop.monotonicMilliseconds()
            self.responseParser = HTTPHeadParser(kind: .response, limits: limits)
            self.requestBody = FramedBody(forward.framing == .untilClose ? .none : forward.framing)
        }
    }

    /// What a tunnel being set up is for (the `SpliceTunnel` logs it).
    struct TunnelInfo {
        let target: String
        let started = EventLoop.monotonicMilliseconds()
    }

    init(server: ProxyServer, id: UInt64, fd: Int32, peer: String) {
        self.server = server
        self.id = id
        self.peer = peer
        self.parser = HTTPHeadParser(kind: .request, limits: server.settings.headLimits)
        client = bufferevent_socket_new(server.loop.base, fd, Int32(BEV_OPT_CLOSE_ON_FREE.rawValue))
        _ = proxyctl_set_nodelay(fd)
        ProxyServer.tune(client)
        bufferevent_setcb(client, clientReadCallback, clientWriteCallback, clientEventCallback, context)
        setClientReadTimeout(server.settings.headerTimeout)
        bufferevent_enable(client, Int16(EV_READ | EV_WRITE))
    }

    private var context: UnsafeMutableRawPointer { Unmanaged.passUnretained(self).toOpaque() }

    // MARK: - Client side

    func clientReadable() {
        switch phase {
        case .readingHead:
            readHeads()
        case .forwarding:
            if let exchange, !exchange.requestBody.isComplete {
                pumpRequestBody(exchange)
            } else if Buffers.length(bufferevent_get_input(client)) > server.settings.headLimits.maxHeadBytes {
                // Pipelined requests wait until the current response is done; do not buffer without bound.
                bufferevent_disable(client, Int16(EV_READ))
            }
        case .intercepting:
            if let intercepted, !intercepted.finished { intercepted.pumpBody() }
        case .connecting, .upstreamHandshake:
            bufferevent_disable(client, Int16(EV_READ))
        case .closing, .closed:
            evbuffer_drain(bufferevent_get_input(client), Buffers.length(bufferevent_get_input(client)))
        }
    }

    func clientWritable() {
        switch phase {
        case .closing:
            if Buffers.length(bufferevent_get_output(client)) == 0 { close() }
        case .forwarding:
            // The client caught up: let the response flow again.
            if let upstream { bufferevent_enable(upstream, Int16(EV_READ)) }
        case .intercepting:
            intercepted?.clientDrained()
        default:
            break
        }
    }

    func clientEvent(_ events: Int16) {
        let what = Int32(events)
        if what & Int32(BEV_EVENT_TIMEOUT) != 0 {
            clientTimedOut(reading: what & Int32(BEV_EVENT_READING) != 0)
            return
        }
        if what & Int32(BEV_EVENT_EOF) != 0 && what & Int32(BEV_EVENT_ERROR) == 0 {
            clientEOF = true
            switch phase {
            case .forwarding:
                // A client may shut down its sending side after the request; the response still goes back.
                if let exchange, !exchange.requestBody.isComplete { abort("client closed during the request body") }
            case .readingHead:
                close()
            case .intercepting:
                if let intercepted, !intercepted.body.complete { abort("client closed during the request body") }
            case .connecting, .upstreamHandshake:
                // The answer can still be delivered when the client only half-closed.
                break
            case .closing, .closed:
                break
            }
            return
        }
        // Errors: reset by peer and the like. Nothing more can be delivered.
        abort(phase == .readingHead ? nil : "client connection error")
    }

    private func clientTimedOut(reading: Bool) {
        switch phase {
        case .readingHead:
            if parser.hasPartialHead {
                respond(
                    ProxyResponse(
                        status: 408,
                        proxyStatus: ProxyStatus(error: .httpRequestError, details: "request head incomplete"),
                        message:
                            "proxyctl: the request head did not arrive within \(ConfigValue.describeDuration(server.settings.headerTimeout))",
                        close: true))
            } else {
                close()
            }
        case .forwarding:
            if let exchange, EventLoop.monotonicMilliseconds() - lastIOActivity < Int64(server.settings.idleTimeout) {
                _ = exchange
                bufferevent_enable(client, Int16(reading ? EV_READ : EV_WRITE))
            } else {
                abort("idle timeout")
            }
        default:
            abort("client timeout")
        }
    }

    private func setClientReadTimeout(_ milliseconds: Int) {
        var read = timeval(milliseconds: milliseconds)
        var write = timeval(milliseconds: server.settings.idleTimeout)
        bufferevent_set_timeouts(client, &read, &write)
    }

    // MARK: - Request heads

    private func readHeads() {
        let input = bufferevent_get_input(client)
        while phase == .readingHead {
            if Buffers.length(input) == 0 { return }
            let outcome = Buffers.readHead(&parser, from: input)
            switch outcome {
            case .needMore:
                setClientReadTimeout(server.settings.headerTimeout)
                return
            case .failed(let error):
                server.logger.info(
                    "conn=\(id) client=\(peer) rejected status=\(error.status) reason=\"\(error.reason)\"")
                respond(FrontDoor.reject(error))
                return
            case .complete(let head, _):
                handle(head)
            }
        }
    }

    private func handle(_ head: HTTPHead) {
        switch server.frontDoor.decide(head) {
        case .respond(let response):
            server.logger.info(
                "conn=\(id) client=\(peer) \(head.method) \(LogText.target(head.target)) status=\(response.status) answered-by=proxyctl"
                    + (response.proxyStatus?.details.map { " reason=\"\($0)\"" } ?? ""))
            respond(response, headRequest: head.method == "HEAD")
        case .tunnel(let target, let upstream):
            // A connection kept alive from an earlier forwarded request is of no use to a tunnel; it must go
            // before the connect starts (its bufferevent points at this connection).
            dropUpstream()
            pending = .tunnel(target: target, upstream: upstream)
            tunnel = TunnelInfo(target: target.description)
            startConnect(to: upstream?.address ?? target)
        case .interceptTunnel(let origin):
            startInterception(origin)
        case .interceptRequest(let origin, let request):
            phase = .intercepting
            var idle = timeval(milliseconds: server.settings.idleTimeout)
            bufferevent_set_timeouts(client, &idle, &idle)
            let exchange = InterceptedExchange(owner: self, server: server, request: request, origin: origin)
            intercepted = exchange
            exchange.start()
        case .forward(let forward):
            pending = .forward(forward)
            let key = forward.upstream?.address ?? forward.url.authority
            if let upstream, upstreamKey == key {
                // Reuse the idle connection to the same next hop.
                _ = upstream
                upstreamReused = true
                phase = .forwarding
                beginExchange(forward)
            } else {
                dropUpstream()
                startConnect(to: key)
            }
        }
    }

    /// Sends an answer of our own. Keeps reading heads when the connection stays open.
    private func respond(_ response: ProxyResponse, headRequest: Bool = false) {
        Buffers.append(response.serialized(headRequest: headRequest), to: bufferevent_get_output(client))
        if response.close || clientEOF || server.draining {
            closeAfterFlush()
        } else {
            phase = .readingHead
            bufferevent_enable(client, Int16(EV_READ))
            setClientReadTimeout(server.settings.keepAliveTimeout)
        }
    }

    // MARK: - Interception

    /// The intercepted exchange is over.
    func exchangeFinished(close: Bool) {
        intercepted = nil
        if close || clientEOF || server.draining {
            closeAfterFlush()
            return
        }
        phase = .readingHead
        bufferevent_setwatermark(client, Int16(EV_WRITE), 0, 0)
        bufferevent_enable(client, Int16(EV_READ))
        setClientReadTimeout(server.settings.keepAliveTimeout)
        if Buffers.length(bufferevent_get_input(client)) > 0 { readHeads() }
    }

    /// CONNECT to a protected origin: answer 200, then hand the socket to an `InterceptSession`, which
    /// terminates TLS with a leaf from the local CA.
    private func startInterception(_ origin: OriginConfig) {
        guard let contexts = server.tlsContexts, let bev = client else {
            return respond(
                ProxyResponse(
                    status: 502,
                    proxyStatus: ProxyStatus(error: .proxyConfigurationError, details: "no local CA"),
                    message: "proxyctl: \(origin.url) is protected but there is no local CA; run proxyctl ca init",
                    close: true))
        }
        let ssl: OpaquePointer
        do {
            ssl = try contexts.makeSSL(for: origin.authority.host)
        } catch {
            server.logger.error("conn=\(id) cannot set up TLS for \(origin.url): \(error)")
            return respond(
                ProxyResponse(
                    status: 502, proxyStatus: ProxyStatus(error: .proxyInternalError, details: "TLS set-up failed"),
                    message: "proxyctl: cannot set up TLS for \(origin.url): \(error)", close: true))
        }
        dropUpstream()
        let session: InterceptSession
        let fd = bufferevent_getfd(bev)
        if Buffers.length(bufferevent_get_input(bev)) == 0 && Buffers.length(bufferevent_get_output(bev)) == 0
            && Self.sendAll(fd, Self.connectEstablished)
        {
            // The usual case: TLS directly on the socket. The bufferevent lets go of the descriptor.
            bufferevent_setfd(bev, -1)
            bufferevent_free(bev)
            client = nil
            session = InterceptSession(server: server, id: id, peer: peer, origin: origin, fd: fd, ssl: ssl)
        } else {
            // The client sent bytes before our answer: TLS as a filter over the existing bufferevent, which
            // keeps them (and sends the 200 first).
            Buffers.append(Self.connectEstablished, to: bufferevent_get_output(bev))
            bufferevent_setcb(bev, nil, nil, nil, nil)
            client = nil
            session = InterceptSession(server: server, id: id, peer: peer, origin: origin, underlying: bev, ssl: ssl)
        }
        server.adopt(session)
        phase = .closed
        server.connectionClosed(self)
    }

    /// Writes a short answer straight to a fresh socket; false if it did not all go out at once.
    private static func sendAll(_ fd: Int32, _ bytes: [UInt8]) -> Bool {
        bytes.withUnsafeBytes { raw in
            let sent = send(fd, raw.baseAddress, raw.count, Int32(MSG_NOSIGNAL))
            return sent == raw.count
        }
    }

    // MARK: - Connecting

    private func startConnect(to target: HostPort) {
        // Invariant: a connect starts with no upstream. A kept-alive one left here would be overwritten while
        // its bufferevent still reached this connection, which its tunnel then frees (a use after free).
        precondition(upstream == nil, "a connect started while an upstream connection was still open")
        phase = .connecting
        bufferevent_disable(client, Int16(EV_READ))
        connectDeadline = EventLoop.monotonicMilliseconds() + Int64(server.settings.connectTimeout)
        addresses = []
        addressIndex = 0
        lastConnectError = 0
        if target.kind == .name {
            let timer = LoopTimer(loop: server.loop) { [unowned self] in
                resolveTimer = nil
                guard phase == .connecting, addresses.isEmpty else { return }
                connectFailed(
                    status: 504, error: .dnsTimeout, hop: target,
                    message:
                        "resolving \(target.host) took longer than \(ConfigValue.describeDuration(server.settings.connectTimeout))"
                )
            }
            timer.schedule(milliseconds: server.settings.connectTimeout)
            resolveTimer = timer
        }
        let bound = LoopBound(self, loop: server.loop)
        server.resolver.resolve(target, loop: server.loop) { result in
            bound.value.resolved(result, target: target)
        }
    }

    private func resolved(_ result: Result<[SocketAddress], ResolveError>, target: HostPort) {
        resolveTimer = nil
        guard phase == .connecting, addresses.isEmpty else { return }
        switch result {
        case .success(let found):
            addresses = found
            attemptConnect(target: target)
        case .failure(.notFound):
            connectFailed(
                status: 502, error: .dnsError, hop: target, message: "cannot resolve \(target.host): no such host")
        case .failure(.temporary(let reason)):
            connectFailed(
                status: 502, error: .dnsError, hop: target, message: "cannot resolve \(target.host): \(reason)")
        }
    }

    private func attemptConnect(target: HostPort) {
        while addressIndex < addresses.count {
            let address = addresses[addressIndex]
            addressIndex += 1
            let remaining = connectDeadline - EventLoop.monotonicMilliseconds()
            if remaining <= 0 { break }
            guard let bev = bufferevent_socket_new(server.loop.base, -1, Int32(BEV_OPT_CLOSE_ON_FREE.rawValue)) else {
                continue
            }
            bufferevent_setcb(bev, upstreamReadCallback, upstreamWriteCallback, upstreamEventCallback, context)
            var timeout = timeval(milliseconds: Int(remaining))
            bufferevent_set_timeouts(bev, nil, &timeout)
            upstream = bev
            upstreamKey = target
            upstreamReused = false
            let status = address.withSockaddr { pointer, length in
                bufferevent_socket_connect(bev, UnsafeMutablePointer(mutating: pointer), Int32(length))
            }
            if status == 0 { return }
            lastConnectError = proxyctl_errno()
            dropUpstream()
        }
        if lastConnectError == ETIMEDOUT || EventLoop.monotonicMilliseconds() >= connectDeadline {
            connectFailed(
                status: 504, error: .connectionTimeout, hop: target,
                message:
                    "connecting to \(target) took longer than \(ConfigValue.describeDuration(server.settings.connectTimeout))"
            )
        } else if lastConnectError == ECONNREFUSED {
            connectFailed(
                status: 502, error: .connectionRefused, hop: target, message: "\(target) refused the connection")
        } else {
            let reason = lastConnectError == 0 ? "unreachable" : String(cString: strerror(lastConnectError))
            connectFailed(
                status: 502, error: .destinationUnavailable, hop: target,
                message: "cannot connect to \(target): \(reason)")
        }
    }

    private func connectFailed(
        status: Int, error: ProxyStatus.ErrorType, hop: HostPort, message: String, receivedStatus: Int? = nil
    ) {
        dropUpstream()
        let viaProxy: Bool
        switch pending {
        case .tunnel(_, let upstream): viaProxy = upstream != nil
        case .forward(let forward): viaProxy = forward.upstream != nil
        case nil: viaProxy = false
        }
        let text = viaProxy ? "upstream proxy: \(message)" : message
        let target = pendingTarget
        server.logger.info(
            "conn=\(id) client=\(peer) \(target) status=\(status) error=\(error.rawValue) reason=\"\(text)\"")
        pending = nil
        tunnel = nil
        respond(
            ProxyResponse(
                status: status,
                proxyStatus: ProxyStatus(
                    error: error, details: text, receivedStatus: receivedStatus, nextHop: hop.description),
                message: "proxyctl: \(text)",
                close: true))
    }

    private var pendingTarget: String {
        switch pending {
        case .tunnel(let target, _): "CONNECT \(target)"
        case .forward(let forward): "\(forward.method) \(LogText.url(forward.url))"
        case nil: "-"
        }
    }

    private func upstreamConnected() {
        guard let bev = upstream else { return }
        let fd = bufferevent_getfd(bev)
        _ = proxyctl_set_nodelay(fd)
        ProxyServer.tune(bev)
        switch pending {
        case .tunnel(let target, let proxy):
            if let proxy {
                phase = .upstreamHandshake
                exchange = nil
                var request = "CONNECT \(target) HTTP/1.1\r\nHost: \(target)\r\n"
                if let authorization = proxy.authorization { request += "Proxy-Authorization: \(authorization)\r\n" }
                request += "\r\n"
                Buffers.append(Array(request.utf8), to: bufferevent_get_output(bev))
                parser = HTTPHeadParser(kind: .response, limits: server.settings.headLimits)
                setUpstreamTimeouts(read: server.settings.connectTimeout)
                bufferevent_enable(bev, Int16(EV_READ | EV_WRITE))
            } else {
                Buffers.append(Self.connectEstablished, to: bufferevent_get_output(client))
                startTunnel()
            }
        case .forward(let forward):
            phase = .forwarding
            beginExchange(forward)
        case nil:
            abort("connected without a pending request")
        }
    }

    private static let connectEstablished = Array("HTTP/1.1 200 Connection established\r\n\r\n".utf8)

    /// The upstream proxy answered our CONNECT.
    private func upstreamHandshakeReadable() {
        guard let bev = upstream else { return }
        let input = bufferevent_get_input(bev)
        let outcome = Buffers.readHead(&parser, from: input)
        let hop = upstreamKey ?? HostPort(host: "-", port: 0, kind: .name)
        switch outcome {
        case .needMore:
            return
        case .failed:
            parser = HTTPHeadParser(kind: .request, limits: server.settings.headLimits)
            connectFailed(status: 502, error: .httpProtocolError, hop: hop, message: "malformed answer to CONNECT")
        case .complete(let head, _):
            parser = HTTPHeadParser(kind: .request, limits: server.settings.headLimits)
            if (200..<300).contains(head.status) {
                Buffers.append(Self.connectEstablished, to: bufferevent_get_output(client))
                startTunnel()
            } else if head.status == 407 {
                let hasCredentials = {
                    if case .tunnel(_, let proxy?) = pending { return proxy.username != nil } else { return false }
                }()
                connectFailed(
                    status: 502, error: .proxyConfigurationError, hop: hop,
                    message: hasCredentials
                        ? "refused the credentials in upstream_proxy (407)"
                        : "requires credentials (407); add user:password to upstream_proxy",
                    receivedStatus: 407)
            } else {
                connectFailed(
                    status: 502, error: .connectionRefused, hop: hop, message: "answered \(head.status) to CONNECT",
                    receivedStatus: head.status)
            }
        }
    }

    // MARK: - Tunnel

    /// The next hop is ready: hand both sockets to a `SpliceTunnel`, with whatever the bufferevents still
    /// hold (our "200 Connection established", bytes the client sent early, bytes after an upstream proxy's
    /// answer) as the first bytes of each direction.
    private func startTunnel() {
        guard let clientBev = client, let upstreamBev = upstream else { return abort("tunnel without two sides") }
        let info = tunnel ?? TunnelInfo(target: upstreamKey?.description ?? "-")
        let clientFD = bufferevent_getfd(clientBev)
        let upstreamFD = bufferevent_getfd(upstreamBev)
        // The bufferevents let go of their descriptors (setfd -1), so freeing them closes nothing. That also
        // unfreezes their buffers, which can then be emptied.
        bufferevent_setfd(clientBev, -1)
        bufferevent_setfd(upstreamBev, -1)
        let toClient = Self.take(bufferevent_get_output(clientBev)) + Self.take(bufferevent_get_input(upstreamBev))
        let toUpstream = Self.take(bufferevent_get_output(upstreamBev)) + Self.take(bufferevent_get_input(clientBev))
        bufferevent_free(clientBev)
        client = nil
        bufferevent_free(upstreamBev)
        upstream = nil
        upstreamKey = nil
        pending = nil
        exchange = nil
        tunnel = nil
        let spliced = SpliceTunnel(
            server: server, id: id, peer: peer, target: info.target, started: info.started, clientFD: clientFD,
            upstreamFD: upstreamFD, toUpstream: toUpstream, toClient: toClient)
        server.adopt(spliced)
        phase = .closed
        server.connectionClosed(self)
    }

    /// Everything in `buffer`, removed from it. A bufferevent's buffers are frozen (the output at its front)
    /// while it has a descriptor; call this after bufferevent_setfd(-1).
    private static func take(_ buffer: OpaquePointer?) -> [UInt8] {
        let count = Buffers.length(buffer)
        guard count > 0 else { return [] }
        var bytes = [UInt8](repeating: 0, count: count)
        let taken = bytes.withUnsafeMutableBytes { evbuffer_remove(buffer, $0.baseAddress, count) }
        precondition(taken == count, "a bufferevent buffer was still frozen")
        return bytes
    }

    // MARK: - Forwarding

    private func beginExchange(_ forward: FrontDoorDecision.Forward) {
        pending = nil
        let exchange = Exchange(forward: forward, limits: server.settings.headLimits)
        self.exchange = exchange
        guard let bev = upstream else { return abort("no upstream") }
        Buffers.append(forward.head, to: bufferevent_get_output(bev))
        exchange.bytesUp += forward.head.count
        setUpstreamTimeouts(read: server.settings.idleTimeout)
        bufferevent_enable(bev, Int16(EV_READ | EV_WRITE))
        var idle = timeval(milliseconds: server.settings.idleTimeout)
        bufferevent_set_timeouts(client, &idle, &idle)
        if !exchange.requestBody.isComplete {
            bufferevent_enable(client, Int16(EV_READ))
            pumpRequestBody(exchange)
        }
        // Response bytes may already be waiting on a reused connection (they would be an error).
        if Buffers.length(bufferevent_get_input(bev)) > 0 { upstreamReadable() }
    }

    private var lastIOActivity: Int64 = 0

    /// Client body bytes to the upstream, following the request's framing.
    private func pumpRequestBody(_ exchange: Exchange) {
        guard let upstream else { return }
        let input = bufferevent_get_input(client)
        let output = bufferevent_get_output(upstream)
        let moved: Int
        switch exchange.requestBody.pass(from: input, to: output) {
        case .failure(let error): return badRequestBody(error)
        case .success(let count): moved = count
        }
        exchange.bytesUp += moved
        if moved > 0 { lastIOActivity = EventLoop.monotonicMilliseconds() }
        if Buffers.length(output) >= server.highWater {
            bufferevent_disable(client, Int16(EV_READ))
            bufferevent_setwatermark(upstream, Int16(EV_WRITE), server.highWater / 2, 0)
        }
    }

    private func badRequestBody(_ error: HTTPParseError) {
        server.logger.info("conn=\(id) client=\(peer) bad request body reason=\"\(error.reason)\"")
        if let exchange, !exchange.clientSawResponse {
            dropUpstream()
            self.exchange = nil
            respond(FrontDoor.reject(error))
        } else {
            abort("malformed request body")
        }
    }

    // MARK: - Upstream side

    func upstreamReadable() {
        switch phase {
        case .upstreamHandshake:
            upstreamHandshakeReadable()
        case .forwarding:
            if let exchange { readResponse(exchange) }
        case .readingHead, .closing:
            // Bytes from an idle upstream connection: it is not reusable.
            if phase == .readingHead { dropUpstream() }
        default:
            break
        }
    }

    func upstreamWritable() {
        switch phase {
        case .forwarding:
            if let exchange, !exchange.requestBody.isComplete { bufferevent_enable(client, Int16(EV_READ)) }
        default:
            break
        }
    }

    func upstreamEvent(_ events: Int16) {
        let what = Int32(events)
        if what & Int32(BEV_EVENT_CONNECTED) != 0 {
            upstreamConnected()
            return
        }
        if phase == .connecting {
            if what & Int32(BEV_EVENT_TIMEOUT) != 0 {
                lastConnectError = ETIMEDOUT
            } else if what & Int32(BEV_EVENT_ERROR) != 0 {
                lastConnectError = proxyctl_socket_error(bufferevent_getfd(upstream))
                if lastConnectError == 0 { lastConnectError = proxyctl_errno() }
            }
            let target = upstreamKey!
            dropUpstream()
            attemptConnect(target: target)
            return
        }
        if what & Int32(BEV_EVENT_TIMEOUT) != 0 {
            upstreamTimedOut()
            return
        }
        let isEOF = what & Int32(BEV_EVENT_EOF) != 0 && what & Int32(BEV_EVENT_ERROR) == 0
        switch phase {
        case .forwarding:
            guard let exchange else { return abort("upstream closed") }
            if isEOF && exchange.responseHeadDone && exchange.responseBody.framing == .untilClose {
                // The end of a read-until-close body.
                exchange.serverCloses = true
                dropUpstream()
                finishResponse(exchange)
            } else if !exchange.responseHeadDone && exchange.bytesDownHead == 0 && upstreamReused && !exchange.retried
                && exchange.forward.framing == .none
            {
                // A kept-alive connection the origin had closed: send the request again on a new one.
                exchange.retried = true
                let forward = exchange.forward
                self.exchange = nil
                dropUpstream()
                pending = .forward(forward)
                startConnect(to: forward.upstream?.address ?? forward.url.authority)
            } else if !exchange.clientSawResponse {
                dropUpstream()
                self.exchange = nil
                let hop = exchange.forward.upstream?.address ?? exchange.forward.url.authority
                let message = "\(hop) closed the connection before sending a complete response"
                server.logger.info(
                    "conn=\(id) client=\(peer) \(exchange.forward.method) \(LogText.url(exchange.forward.url)) status=502 error=http_response_incomplete"
                )
                respond(
                    ProxyResponse(
                        status: 502,
                        proxyStatus: ProxyStatus(
                            error: .httpResponseIncomplete, details: message, nextHop: hop.description),
                        message: "proxyctl: \(message)",
                        close: true))
            } else {
                logExchange(exchange, note: "response incomplete")
                self.exchange = nil
                dropUpstream()
                closeAfterFlush()
            }
        case .upstreamHandshake:
            let hop = upstreamKey ?? HostPort(host: "-", port: 0, kind: .name)
            connectFailed(
                status: 502, error: .connectionTerminated, hop: hop, message: "closed the connection during CONNECT")
        default:
            // An idle kept-alive connection went away.
            dropUpstream()
        }
    }

    private func upstreamTimedOut() {
        switch phase {
        case .upstreamHandshake:
            let hop = upstreamKey ?? HostPort(host: "-", port: 0, kind: .name)
            connectFailed(status: 504, error: .httpResponseTimeout, hop: hop, message: "no answer to CONNECT")
        case .forwarding:
            guard let exchange else { return abort("timeout") }
            if EventLoop.monotonicMilliseconds() - lastIOActivity < Int64(server.settings.idleTimeout) {
                bufferevent_enable(upstream, Int16(EV_READ | EV_WRITE))
                return
            }
            if !exchange.clientSawResponse {
                let hop = exchange.forward.upstream?.address ?? exchange.forward.url.authority
                dropUpstream()
                self.exchange = nil
                let message =
                    "\(hop) sent no response within \(ConfigValue.describeDuration(server.settings.idleTimeout))"
                server.logger.info(
                    "conn=\(id) client=\(peer) \(exchange.forward.method) \(LogText.url(exchange.forward.url)) status=504 error=http_response_timeout"
                )
                respond(
                    ProxyResponse(
                        status: 504,
                        proxyStatus: ProxyStatus(
                            error: .httpResponseTimeout, details: message, nextHop: hop.description),
                        message: "proxyctl: \(message)",
                        close: true))
            } else {
                abort("idle timeout")
            }
        default:
            dropUpstream()
        }
    }

    private func setUpstreamTimeouts(read: Int) {
        var readTimeout = timeval(milliseconds: read)
        var writeTimeout = timeval(milliseconds: server.settings.idleTimeout)
        bufferevent_set_timeouts(upstream, &readTimeout, &writeTimeout)
    }

    /// Reads the response head, then streams the body to the client.
    private func readResponse(_ exchange: Exchange) {
        guard let bev = upstream else { return }
        let input = bufferevent_get_input(bev)
        let output = bufferevent_get_output(client)
        lastIOActivity = EventLoop.monotonicMilliseconds()
        while !exchange.responseHeadDone {
            if Buffers.length(input) == 0 { return }
            let before = Buffers.length(input)
            let outcome = Buffers.readHead(&exchange.responseParser, from: input)
            exchange.bytesDownHead += before - Buffers.length(input)
            switch outcome {
            case .needMore:
                return
            case .failed(let error):
                return badResponse(exchange, error)
            case .complete(let head, _):
                switch MessageSemantics.response(
                    head, requestMethod: exchange.forward.method, upgradeRequested: exchange.forward.upgrade)
                {
                case .failure(let error):
                    return badResponse(exchange, error)
                case .success(let semantics):
                    exchange.status = head.status
                    if head.status == 407, let proxy = exchange.forward.upstream {
                        // The upstream proxy wants credentials: that is our configuration's problem, and
                        // passing its Proxy-Authenticate on would make the client think we asked.
                        return upstreamRefused(exchange, proxy: proxy)
                    }
                    if semantics.isInterim {
                        // 1xx (100 Continue, 103 Early Hints): pass on, then read the final response.
                        Buffers.append(head.serialized(drop: { semantics.dropped.contains($0) }), to: output)
                        exchange.clientSawResponse = true
                        continue
                    }
                    exchange.responseHeadDone = true
                    exchange.serverCloses = semantics.serverCloses
                    exchange.closeAfter =
                        !exchange.forward.keepAlive || semantics.framing == .untilClose || clientEOF || server.draining
                        || semantics.switchesProtocols
                    var extra: [(name: String, value: String)] = []
                    if exchange.closeAfter && !semantics.switchesProtocols && head.version == .http1_1 {
                        extra.append(("Connection", "close"))
                    }
                    let outgoing = head.serialized(drop: { semantics.dropped.contains($0) }, extra: extra)
                    Buffers.append(outgoing, to: output)
                    exchange.bytesDown += outgoing.count
                    exchange.clientSawResponse = true
                    if semantics.switchesProtocols {
                        return switchProtocols(exchange)
                    }
                    exchange.responseBody = FramedBody(semantics.framing)
                }
            }
        }
        pumpResponseBody(exchange)
    }

    private func pumpResponseBody(_ exchange: Exchange) {
        guard let bev = upstream else { return }
        let input = bufferevent_get_input(bev)
        let output = bufferevent_get_output(client)
        let moved: Int
        switch exchange.responseBody.pass(from: input, to: output) {
        case .failure(let error): return badResponse(exchange, error)
        case .success(let count): moved = count
        }
        exchange.bytesDown += moved
        if exchange.responseBody.isComplete {
            if Buffers.length(input) > 0 {
                // Bytes after the end of the response: the upstream connection is out of step.
                exchange.serverCloses = true
            }
            finishResponse(exchange)
            return
        }
        if Buffers.length(output) >= server.highWater {
            bufferevent_disable(bev, Int16(EV_READ))
            bufferevent_setwatermark(client, Int16(EV_WRITE), server.highWater / 2, 0)
        }
    }

    private func upstreamRefused(_ exchange: Exchange, proxy: UpstreamProxy) {
        let detail =
            proxy.username == nil
            ? "the upstream proxy requires credentials; add user:password to upstream_proxy"
            : "the upstream proxy refused the credentials in upstream_proxy"
        server.logger.info(
            "conn=\(id) client=\(peer) \(exchange.forward.method) \(LogText.url(exchange.forward.url)) status=502 error=proxy_configuration_error reason=\"\(detail)\""
        )
        dropUpstream()
        self.exchange = nil
        respond(
            ProxyResponse(
                status: 502,
                proxyStatus: ProxyStatus(
                    error: .proxyConfigurationError, details: detail, receivedStatus: 407,
                    nextHop: proxy.address.description),
                message: "proxyctl: \(detail)",
                close: true))
    }

    private func badResponse(_ exchange: Exchange, _ error: HTTPParseError) {
        let hop = exchange.forward.upstream?.address ?? exchange.forward.url.authority
        server.logger.info(
            "conn=\(id) client=\(peer) \(exchange.forward.method) \(LogText.url(exchange.forward.url)) status=502 error=http_protocol_error reason=\"\(error.reason)\""
        )
        dropUpstream()
        self.exchange = nil
        if exchange.clientSawResponse {
            closeAfterFlush()
        } else {
            respond(
                ProxyResponse(
                    status: 502,
                    proxyStatus: ProxyStatus(
                        error: .httpProtocolError, details: "invalid response: \(error.reason)",
                        nextHop: hop.description),
                    message: "proxyctl: \(hop) sent an invalid response (\(error.reason))",
                    close: true))
        }
    }

    /// The response is complete. The exchange ends when the request body is complete too.
    private func finishResponse(_ exchange: Exchange) {
        exchange.responseBody.senderClosed()
        if !exchange.requestBody.isComplete {
            // The origin answered before the whole body arrived (an early 413, say): the rest of the request
            // cannot be told apart from a next request, so the connection ends here.
            exchange.closeAfter = true
            exchange.serverCloses = true
        }
        finishExchange(exchange)
    }

    private func finishExchange(_ exchange: Exchange) {
        logExchange(exchange, note: nil)
        self.exchange = nil
        // Shutting down: a connection that finished its exchange is not kept for another one.
        if server.draining { exchange.closeAfter = true }
        if exchange.serverCloses || upstream == nil {
            dropUpstream()
        } else if let bev = upstream {
            // Keep the upstream connection for the next request to the same host; watch it for a close.
            var idle = timeval(milliseconds: server.settings.keepAliveTimeout)
            bufferevent_set_timeouts(bev, &idle, nil)
            bufferevent_setwatermark(bev, Int16(EV_WRITE), 0, 0)
            bufferevent_enable(bev, Int16(EV_READ))
        }
        if exchange.closeAfter {
            closeAfterFlush()
            return
        }
        phase = .readingHead
        upstreamReused = false
        bufferevent_setwatermark(client, Int16(EV_WRITE), 0, 0)
        bufferevent_enable(client, Int16(EV_READ))
        setClientReadTimeout(server.settings.keepAliveTimeout)
        // A pipelined request may already be waiting.
        if Buffers.length(bufferevent_get_input(client)) > 0 { readHeads() }
    }

    private func switchProtocols(_ exchange: Exchange) {
        logExchange(exchange, note: "switched protocols")
        self.exchange = nil
        tunnel = TunnelInfo(target: exchange.forward.url.authority.description)
        startTunnel()
    }

    private func logExchange(_ exchange: Exchange, note: String?) {
        guard server.logger.enabled(.info) else { return }
        let duration = EventLoop.monotonicMilliseconds() - exchange.started
        server.logger.info(
            "conn=\(id) client=\(peer) \(exchange.forward.method) \(LogText.url(exchange.forward.url)) status=\(exchange.status) up=\(exchange.bytesUp) down=\(exchange.bytesDown) duration=\(LogText.duration(duration))"
                + (note.map { " note=\"\($0)\"" } ?? ""))
    }

    // MARK: - Ending

    private func dropUpstream() {
        if let upstream {
            bufferevent_free(upstream)
            self.upstream = nil
        }
        upstreamKey = nil
        upstreamReused = false
    }

    private func closeAfterFlush() {
        dropUpstream()
        phase = .closing
        bufferevent_disable(client, Int16(EV_READ))
        bufferevent_setwatermark(client, Int16(EV_WRITE), 0, 0)
        if Buffers.length(bufferevent_get_output(client)) == 0 { close() }
    }

    /// Ends the connection at once; `reason` is logged when an exchange or a tunnel was in progress.
    func abort(_ reason: String?) {
        if let intercepted {
            intercepted.abort()
            self.intercepted = nil
        }
        if let exchange {
            logExchange(exchange, note: reason ?? "aborted")
        }
        close()
    }

    /// Whether nothing is in flight: a keep-alive connection waiting for its next request.
    var isIdle: Bool { phase == .readingHead && !parser.hasPartialHead }

    func close() {
        guard phase != .closed else { return }
        phase = .closed
        intercepted?.abort()
        intercepted = nil
        resolveTimer = nil
        dropUpstream()
        if let client {
            bufferevent_free(client)
            self.client = nil
        }
        server.connectionClosed(self)
    }
}

// MARK: - libevent callbacks (context: the ClientConnection, unretained; the server's table owns it)

private let clientReadCallback: bufferevent_data_cb = { _, context in
    Unmanaged<ClientConnection>.fromOpaque(context!).takeUnretainedValue().clientReadable()
}
private let clientWriteCallback: bufferevent_data_cb = { _, context in
    Unmanaged<ClientConnection>.fromOpaque(context!).takeUnretainedValue().clientWritable()
}
private let clientEventCallback: bufferevent_event_cb = { _, events, context in
    Unmanaged<ClientConnection>.fromOpaque(context!).takeUnretainedValue().clientEvent(events)
}
private let upstreamReadCallback: bufferevent_data_cb = { _, context in
    Unmanaged<ClientConnection>.fromOpaque(context!).takeUnretainedValue().upstreamReadable()
}
private let upstreamWriteCallback: bufferevent_data_cb = { _, context in
    Unmanaged<ClientConnection>.fromOpaque(context!).takeUnretainedValue().upstreamWritable()
}
private let upstreamEventCallback: bufferevent_event_cb = { _, events, context in
    Unmanaged<ClientConnection>.fromOpaque(context!).takeUnretainedValue().upstreamEvent(events)
}

/// How targets and durations appear in log lines.
enum LogText {
    /// The URL without its query: queries can carry secrets (`?code=`, `?access_token=`).
    static func url(_ url: AbsoluteURL) -> String {
        let (path, query) = TargetText.split(url.pathAndQuery, at: "?")
        return "\(url.scheme)://\(url.hostFieldValue)\(path)\(query == nil ? "" : "?...")"
    }

    /// A raw request target, cut at the query for the same reason.
    static func target(_ target: String) -> String {
        let (path, query) = TargetText.split(target, at: "?")
        return ASCII_printable(String(path.prefix(200))) + (query == nil ? "" : "?...")
    }

    static func duration(_ milliseconds: Int64) -> String {
        milliseconds < 1000
            ? "\(milliseconds)ms" : "\(milliseconds / 1000).\(String(milliseconds % 1000 / 10).leftPadding(to: 2))s"
    }

    private static func ASCII_printable(_ text: String) -> String {
        String(text.unicodeScalars.map { $0.value >= 0x21 && $0.value < 0x7F ? Character($0) : "?" })
    }
}
