import CLibevent
import COpenSSL
import ProxyCore
import ProxyOAuth
import ProxyTLS

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Runs one client connection's `ConnectionMachine` on libevent: plain sockets and TLS-terminated ones
/// alike (the bufferevent differs, the machine does not). It reports what happens as events, and carries
/// out the actions: bytes between buffers, the upstream connection of a forwarded request, timers, the exchange
/// with a protected origin (its `ExchangeIO`, whose transfer runs on the proxy's own client; after a 101 to an
/// upgrade, that transfer's connection becomes the tunnel's), tunnels, logs.
///
/// It decides nothing about HTTP. What it does decide is mechanics: flow control (a reader is paused while
/// the buffer toward its destination holds more than `highWater` bytes).
///
/// Owned by the server's connection table from accept to close; libevent reaches it through unretained
/// context pointers, which `close()` disconnects (freeing the bufferevents, ending the exchange's transfer)
/// before the table lets it go.
final class ClientDriver: ServerConnection, ExchangeDriver {
    let context: ConnectionContext
    let id: UInt64
    let peer: String
    let clientAddress: String
    private var machine: ConnectionMachine
    /// The client's connection as a bufferevent: a plain socket, one end of a buffer pair (a WebSocket stream of
    /// an HTTP/2 connection), or TLS as a filter over bytes the client sent early. Nil while `tlsSocket` carries it.
    private var client: OpaquePointer?
    /// The client's connection when the proxy's TLS runs on its socket (the usual intercepted connection).
    private var tlsSocket: TLSSocket?
    /// The TLS session of an intercepted connection (owned by `tlsSocket` or the bufferevent).
    private var ssl: OpaquePointer?
    private var upstream: OpaquePointer?
    /// The upstream bufferevent is connecting (its first event is CONNECTED or the failure).
    private var upstreamConnecting = false
    /// The own client's connection to a protected origin that answered an upgrade with 101, from the exchange's
    /// end until the tunnel takes it.
    private var switched: OriginConnection?
    private var addresses: [SocketAddress] = []
    /// Counts the resolves asked for: an answer is taken only while it is for the latest.
    private var resolving = 0
    /// What this connection's request bodies keep for replays, of the process's budget.
    private lazy var replay = ReplayAccount(context.replayBudget)
    private var timers = TimerSlots()
    /// When a byte last moved on this connection (either side, the transfer included).
    private var lastActivity: Int64
    private let started: Int64
    private var closed = false
    private var closingAfterFlush = false
    /// The last bytes went out and the sending side is shut: input is read and dropped until the client closes
    /// (or `lingerTimer` fires). See `LingeringClose`.
    private var lingering = false
    private var lingerTimer: LoopTimer?

    // Flow control.
    private var machineWantsClient = false
    /// Reading from the client is paused because the buffer toward the next hop (or the transfer's body
    /// queue) is full.
    private var clientThrottled = false
    /// Reading from the upstream (or the transfer) is paused because the client's output is full.
    private var upstreamThrottled = false

    /// The exchange with a protected origin in flight (its body, tokens and transfer), and how many this
    /// connection has had (each one's generation).
    private var exchangeIO: ExchangeIO?
    private var exchanges: UInt64 = 0
    /// The response bytes of the transfer's current callback (`.writeResponseBody` writes them).
    private var transferData: UnsafeRawBufferPointer?

    // Events raised while actions run wait until they have all run (the views the machine saw stay valid).
    private var handling = false
    private var queued: [ConnectionMachine.Event] = []
    private var actions: [ConnectionMachine.Action] = []
    /// Work to do once the current events are handled (calls into the exchange's transfer that may call back).
    private var afterHandling: [() -> Void] = []

    /// A plain client connection on `fd`, just accepted.
    init(context: ConnectionContext, id: UInt64, fd: Int32, peer: String, client: String) {
        self.context = context
        self.id = id
        self.peer = peer
        self.clientAddress = client
        self.started = EventLoop.monotonicMilliseconds()
        self.lastActivity = started
        machine = ConnectionMachine(
            role: .frontDoor, frontDoor: context.frontDoor, hasLocalCA: context.tlsContexts != nil,
            peer: context.peers.identify(fd, connection: id, settings: context.frontDoor, audited: context.audit != nil)
        )
        self.client = bufferevent_socket_new(context.loop.base, fd, Int32(BEV_OPT_CLOSE_ON_FREE.rawValue))
        _ = proxyctl_set_nodelay(fd)
        setUpClient()
        handle(.start)
    }

    /// A TLS-terminated connection for a protected origin, on `fd` or over `underlying` (a bufferevent that
    /// already holds bytes the client sent early).
    init(
        context: ConnectionContext, id: UInt64, peer: String, client: String, origin: OriginConfig,
        ssl: OpaquePointer, fd: Int32, underlying: OpaquePointer?
    ) {
        self.context = context
        self.id = id
        self.peer = peer
        self.clientAddress = client
        self.started = EventLoop.monotonicMilliseconds()
        self.lastActivity = started
        self.ssl = ssl
        machine = ConnectionMachine(
            role: .intercepted(origin), frontDoor: context.frontDoor, hasLocalCA: context.tlsContexts != nil)
        if let underlying {
            self.client = bufferevent_openssl_filter_new(
                context.loop.base, underlying, ssl, BUFFEREVENT_SSL_ACCEPTING, Self.tlsOptions)
            if let bev = self.client { bufferevent_openssl_set_allow_dirty_shutdown(bev, 1) }
            setUpClient()
        } else {
            let socket = TLSSocket(loop: context.loop, fd: fd, ssl: ssl)
            socket.user = self
            tlsSocket = socket
        }
        handle(.start)
    }

    /// The HTTP/1.1 side of a WebSocket stream of an HTTP/2 connection (RFC 8441): `pair` is one end of a
    /// buffer pair whose other end the `H2Driver` writes the upgrade request into. The connection is already
    /// inside the intercepted tunnel (no TLS of its own); `begin()` starts it once the server's table holds it.
    init(
        context: ConnectionContext, id: UInt64, peer: String, client: String, origin: OriginConfig, pair: OpaquePointer
    ) {
        self.context = context
        self.id = id
        self.peer = peer
        self.clientAddress = client
        self.started = EventLoop.monotonicMilliseconds()
        self.lastActivity = started
        machine = ConnectionMachine(
            role: .intercepted(origin), frontDoor: context.frontDoor, hasLocalCA: context.tlsContexts != nil)
        self.client = pair
        setUpClient()
    }

    /// Starts a connection made by `init(...pair:)`.
    func begin() {
        handle(.start)
        handle(.tlsEstablished(serverName: nil, protocol: "http/1.1"))
    }

    private var contextPointer: UnsafeMutableRawPointer { Unmanaged.passUnretained(self).toOpaque() }

    /// The options of the OpenSSL bufferevents the client's TLS runs on.
    private static let tlsOptions = Int32(BEV_OPT_CLOSE_ON_FREE.rawValue | BEV_OPT_DEFER_CALLBACKS.rawValue)

    private func setUpClient() {
        guard let client else {
            context.logger.error("conn=\(id) cannot set up the client connection")
            closed = true
            return
        }
        Self.tune(client)
        bufferevent_setcb(client, clientReadCallback, clientWriteCallback, clientEventCallback, contextPointer)
        bufferevent_enable(client, Int16(EV_WRITE))
    }

    /// Large single reads and writes keep the syscall count per GiB low.
    static func tune(_ bev: OpaquePointer?) {
        bufferevent_set_max_single_read(bev, 256 * 1024)
        bufferevent_set_max_single_write(bev, 256 * 1024)
    }

    var isIdle: Bool { machine.isIdle && exchangeIO?.hasTransfer != true }

    // MARK: - Events into the machine

    private func handle(_ event: ConnectionMachine.Event) {
        if closed { return }
        if handling {
            queued.append(event)
            return
        }
        handling = true
        var next: ConnectionMachine.Event? = event
        while let current = next, !closed {
            actions.removeAll(keepingCapacity: true)
            machine.handle(
                current, client: EvbufferView(clientInput), upstream: EvbufferView(upstreamInput),
                now: EventLoop.monotonicMilliseconds(), &actions)
            run(actions)
            next = queued.isEmpty ? nil : queued.removeFirst()
        }
        queued.removeAll()
        handling = false
        let work = afterHandling
        afterHandling.removeAll()
        for job in work where !closed { job() }
    }

    private var clientInput: OpaquePointer? { tlsSocket?.input ?? client.map { bufferevent_get_input($0) } }
    private var upstreamInput: OpaquePointer? { upstream.map { bufferevent_get_input($0) } }

    // MARK: - Actions

    private func run(_ actions: [ConnectionMachine.Action]) {
        for action in actions {
            if closed {
                // After the connection closed only bookkeeping remains.
                switch action {
                case .log(let line): log(line)
                case .exchangeFinished(let record): exchangeFinished(record)
                case .requestFinished(let outcome): context.owner.count(outcome)
                case .auditRefusal(let use): context.audit(use, connection: id, client: peer)
                default: continue
                }
                continue
            }
            perform(action)
        }
    }

    private func perform(_ action: ConnectionMachine.Action) {
        switch action {
        case .consumeClient(let count):
            evbuffer_drain(clientInput, count)
        case .writeClient(let bytes):
            Buffers.append(bytes, to: clientOutput)
            exchangeIO?.down += bytes.count
            throttleUpstreamIfNeeded()
        case .readClient(let on):
            machineWantsClient = on
            updateClientReading()
        case .closeAfterFlush:
            closingAfterFlush = true
            setClientReading(false)
            if Buffers.length(clientOutput) == 0 { finishAfterFlush() }
        case .closeNow:
            close()
        case .resetClient:
            let fd = tlsSocket?.fd ?? client.map { bufferevent_getfd($0) } ?? -1
            if fd >= 0 { proxyctl_set_linger_reset(fd) }
            close()

        case .resolve(let hop):
            // Each connect the machine starts asks anew; an answer for an earlier one (a request answered or
            // abandoned meanwhile) is for nobody, and must not give its addresses to the next.
            resolving += 1
            let bound = LoopBound(self, loop: context.loop)
            let asked = resolving
            context.resolver.resolve(hop, loop: context.loop) { result in
                guard bound.value.resolving == asked else { return }
                bound.value.resolved(result)
            }
        case .connect(let index):
            connect(to: index)
        case .closeUpstream:
            precondition(upstream != nil, "closeUpstream without an upstream connection")
            bufferevent_free(upstream)
            upstream = nil
            upstreamConnecting = false
            upstreamThrottled = false
            clientThrottled = false
            updateClientReading()
        case .writeUpstream(let bytes):
            Buffers.append(bytes, to: upstreamOutput)
            throttleClientIfNeeded()
        case .consumeUpstream(let count):
            evbuffer_drain(upstreamInput, count)
        case .moveClientToUpstream(let count):
            Buffers.move(count, from: clientInput, to: upstreamOutput)
            throttleClientIfNeeded()
        case .moveUpstreamToClient(let count):
            Buffers.move(count, from: upstreamInput, to: clientOutput)
            throttleUpstreamIfNeeded()
        case .startTunnel(let label, let status):
            startTunnel(label: label, status: status)
        case .startInterception(let origin, let answer):
            startInterception(origin, answer: answer)
        case .startHTTP2(let origin, let misdirected):
            startHTTP2(origin, misdirected: misdirected)

        case .arm(let timer, let milliseconds):
            self.timer(timer).schedule(milliseconds: milliseconds)
        case .disarm(let timer):
            timers[timer]?.cancel()

        case .keepBody(let count):
            keepBody(count)
        case .requestTrailers(let fields):
            exchangeIO?.requestTrailers = fields
        case .exchange(let output, let origin):
            exchange(for: origin).perform(output)
        case .writeResponseBody:
            guard let data = transferData, !data.isEmpty else { return }
            evbuffer_add(clientOutput, data.baseAddress, data.count)
            exchangeIO?.down += data.count
        case .exchangeFinished(let record):
            exchangeFinished(record)
        case .log(let line):
            log(line)
        case .requestFinished(let outcome):
            context.owner.count(outcome)
        case .auditRefusal(let use):
            context.audit(use, connection: id, client: peer)
        }
    }

    private func log(_ line: LogLine) { context.logger.connection(id, peer: peer, line) }

    private func timer(_ kind: ConnectionTimer) -> LoopTimer {
        if let existing = timers[kind] { return existing }
        let made = LoopTimer(loop: context.loop) { [unowned self] in
            handle(.timerFired(kind, lastActivity: lastActivity))
        }
        timers[kind] = made
        return made
    }

    private var clientOutput: OpaquePointer? { tlsSocket?.output ?? client.map { bufferevent_get_output($0) } }
    private var upstreamOutput: OpaquePointer? { upstream.map { bufferevent_get_output($0) } }

    // MARK: - Flow control (mechanics: the machine says what it wants to read, buffers say when)

    private func updateClientReading() {
        guard !lingering else { return }
        setClientReading(machineWantsClient && !clientThrottled && !closingAfterFlush)
    }

    /// Reads from the client on or off, on whichever carries its connection.
    private func setClientReading(_ on: Bool) {
        if let tlsSocket {
            tlsSocket.setReading(on)
        } else if let client {
            if on { bufferevent_enable(client, Int16(EV_READ)) } else { bufferevent_disable(client, Int16(EV_READ)) }
        }
    }

    /// The client's write callback comes when a write leaves at most `mark` bytes in its output.
    private func setClientWriteLowWater(_ mark: Int) {
        if let tlsSocket {
            tlsSocket.writeLowWater = mark
        } else if let client {
            bufferevent_setwatermark(client, Int16(EV_WRITE), mark, 0)
        }
    }

    private var hasClient: Bool { tlsSocket != nil || client != nil }

    /// The buffer toward the next hop (or the transfer's body queue) is full: stop reading the client until
    /// it drains below half.
    private func throttleClientIfNeeded() {
        let queued = upstream.map { Buffers.length(bufferevent_get_output($0)) } ?? (exchangeIO?.body.queued ?? 0)
        guard queued >= context.highWater, !clientThrottled else { return }
        clientThrottled = true
        if let upstream { bufferevent_setwatermark(upstream, Int16(EV_WRITE), context.highWater / 2, 0) }
        updateClientReading()
    }

    private func clientMayReadAgain() {
        guard clientThrottled else { return }
        clientThrottled = false
        if let upstream { bufferevent_setwatermark(upstream, Int16(EV_WRITE), 0, 0) }
        updateClientReading()
    }

    /// The client's output is full: stop reading the next hop until it drains below half.
    private func throttleUpstreamIfNeeded() {
        guard Buffers.length(clientOutput) >= context.highWater, !upstreamThrottled, hasClient else { return }
        upstreamThrottled = true
        setClientWriteLowWater(context.highWater / 2)
        if let upstream { bufferevent_disable(upstream, Int16(EV_READ)) }
    }

    private func upstreamMayReadAgain() {
        guard upstreamThrottled, hasClient else { return }
        upstreamThrottled = false
        setClientWriteLowWater(0)
        if let upstream { bufferevent_enable(upstream, Int16(EV_READ)) }
        exchangeIO?.resumeResponse()
    }

    // MARK: - Client callbacks

    fileprivate func clientReadable() {
        if lingering {
            if let input = clientInput { evbuffer_drain(input, Buffers.length(input)) }
            return
        }
        lastActivity = EventLoop.monotonicMilliseconds()
        handle(.clientData)
    }

    fileprivate func clientWritable() {
        lastActivity = EventLoop.monotonicMilliseconds()
        if closingAfterFlush {
            if Buffers.length(clientOutput) == 0 { finishAfterFlush() }
            return
        }
        upstreamMayReadAgain()
    }

    /// The last bytes went out: shut the sending side and linger, or close when there is no socket to shut.
    private func finishAfterFlush() {
        guard !closed, !lingering else { return }
        if let tlsSocket {
            // A client that already ended its side has nothing left to linger for.
            guard tlsSocket.shutWrite(), !tlsSocket.readEnded else { return close() }
        } else {
            guard let client, LingeringClose.shutWrite(client) else { return close() }
        }
        lingering = true
        endExchange()
        if let upstream {
            bufferevent_free(upstream)
            self.upstream = nil
        }
        timers.cancelAll()
        setClientReading(true)
        let timer = LoopTimer(loop: context.loop) { [unowned self] in close() }
        timer.schedule(milliseconds: LingeringClose.milliseconds)
        lingerTimer = timer
    }

    fileprivate func clientEvent(_ events: Int16) {
        if lingering {
            // The client's end (or a reset) is what was waited for.
            return close()
        }
        let what = Int32(events)
        if what & Int32(BEV_EVENT_CONNECTED) != 0 {
            lastActivity = EventLoop.monotonicMilliseconds()
            handle(
                .tlsEstablished(
                    serverName: ssl.flatMap { tlsServerName($0) }, protocol: ssl.flatMap { tlsSelectedProtocol($0) }))
            return
        }
        if let ssl, SSL_is_init_finished(ssl) == 0 {
            handle(.tlsFailed(reason: tlsErrors()))
            return
        }
        let eof = what & Int32(BEV_EVENT_EOF) != 0 && what & Int32(BEV_EVENT_ERROR) == 0
        handle(.clientEnded(reset: !eof))
    }

    private func tlsErrors() -> String {
        if let tlsSocket { return tlsSocket.failure ?? "connection closed" }
        return client.map { Self.tlsErrors($0) } ?? "connection closed"
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

    // MARK: - The next hop

    private func resolved(_ result: Result<[SocketAddress], ResolveError>) {
        switch result {
        case .success(let found):
            addresses = found
            handle(.resolved(.addresses(found.map(\.ipString))))
        case .failure(.notFound):
            handle(.resolved(.notFound))
        case .failure(.temporary(let reason)):
            handle(.resolved(.failed(reason: reason)))
        }
    }

    private func connect(to index: Int) {
        precondition(upstream == nil, "a connect started while an upstream connection was still open")
        guard index < addresses.count else {
            return queued.append(.upstreamConnectFailed(.noSocket(reason: "no address to connect to")))
        }
        guard let bev = bufferevent_socket_new(context.loop.base, -1, Int32(BEV_OPT_CLOSE_ON_FREE.rawValue)) else {
            return queued.append(.upstreamConnectFailed(.noSocket(reason: "cannot make a socket")))
        }
        upstream = bev
        upstreamConnecting = true
        bufferevent_setcb(bev, upstreamReadCallback, upstreamWriteCallback, upstreamEventCallback, contextPointer)
        let status = addresses[index].withSockaddr { pointer, length in
            bufferevent_socket_connect(bev, UnsafeMutablePointer(mutating: pointer), Int32(length))
        }
        if status != 0 { queued.append(.upstreamConnectFailed(Self.connectFailure(proxyctl_errno()))) }
    }

    private static func connectFailure(_ code: Int32) -> ConnectFailure {
        switch code {
        case ECONNREFUSED: .refused
        case ETIMEDOUT: .timedOut
        case 0: .other(reason: "unreachable")
        default: .other(reason: String(cString: strerror(code)))
        }
    }

    fileprivate func upstreamReadable() {
        lastActivity = EventLoop.monotonicMilliseconds()
        handle(.upstreamData)
    }

    fileprivate func upstreamWritable() {
        lastActivity = EventLoop.monotonicMilliseconds()
        clientMayReadAgain()
    }

    fileprivate func upstreamEvent(_ events: Int16) {
        let what = Int32(events)
        guard let upstream else { return }
        if what & Int32(BEV_EVENT_CONNECTED) != 0 {
            upstreamConnecting = false
            let fd = bufferevent_getfd(upstream)
            _ = proxyctl_set_nodelay(fd)
            Self.tune(upstream)
            bufferevent_enable(upstream, Int16(EV_READ | EV_WRITE))
            lastActivity = EventLoop.monotonicMilliseconds()
            handle(.upstreamConnected)
            return
        }
        let error = what & Int32(BEV_EVENT_ERROR) != 0
        if upstreamConnecting {
            var code = proxyctl_socket_error(bufferevent_getfd(upstream))
            if code == 0 { code = proxyctl_errno() }
            if what & Int32(BEV_EVENT_TIMEOUT) != 0 { code = ETIMEDOUT }
            handle(.upstreamConnectFailed(Self.connectFailure(code)))
            return
        }
        handle(.upstreamEnded(reset: error))
    }

    // MARK: - Tunnels and interception

    /// Hands both sockets to a `SpliceTunnel`, with whatever the bufferevents still hold (our "200
    /// Connection established", bytes the client sent early, bytes after an upstream proxy's answer) as
    /// the first bytes of each direction.
    private func startTunnel(label: TunnelLabel, status: Int) {
        handOverTLSSocket()
        var upstreamSSL: OpaquePointer? = nil
        if upstream == nil, let switched {
            self.switched = nil
            (upstream, upstreamSSL) = adopt(switched)
        }
        guard let clientBev = client, let upstreamBev = upstream else {
            return close()
        }
        if ssl != nil || upstreamSSL != nil || bufferevent_getfd(clientBev) < 0 {
            // TLS on either side (an upgraded connection to a protected origin), or a client that is an HTTP/2
            // stream: the bytes must pass through OpenSSL or the pair, so a relay between the two bufferevents
            // instead of splice.
            bufferevent_setcb(clientBev, nil, nil, nil, nil)
            bufferevent_setcb(upstreamBev, nil, nil, nil, nil)
            let relay = RelayTunnel(
                context: context, id: id, peer: peer, client: clientAddress, label: label, status: status,
                started: started, clientBev: clientBev, clientSSL: ssl, upstreamBev: upstreamBev,
                upstreamSSL: upstreamSSL)
            client = nil
            ssl = nil
            upstream = nil
            context.owner.adopt(relay)
            finishHandOff()
            relay.begin()
            return
        }
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
        let tunnel = SpliceTunnel(
            context: context, id: id, peer: peer, client: clientAddress, label: label, status: status,
            started: started,
            clientFD: clientFD,
            upstreamFD: upstreamFD, toUpstream: toUpstream, toClient: toClient)
        context.owner.adopt(tunnel)
        finishHandOff()
    }

    /// A bufferevent on the socket of the own client's connection the origin switched protocols on (OpenSSL's
    /// on its TLS session, already open, for an https origin); what the origin sent after its 101 goes to the
    /// client first, what waited to be written to the origin to it.
    private func adopt(_ connection: OriginConnection) -> (OpaquePointer?, OpaquePointer?) {
        guard let (fd, tls, received, unsent) = connection.handOver() else { return (nil, nil) }
        let options = Int32(BEV_OPT_CLOSE_ON_FREE.rawValue | BEV_OPT_DEFER_CALLBACKS.rawValue)
        let made: OpaquePointer?
        if let tls {
            made = bufferevent_openssl_socket_new(context.loop.base, fd, tls, BUFFEREVENT_SSL_OPEN, options)
            if made == nil { SSL_free(tls) }
            if let made { bufferevent_openssl_set_allow_dirty_shutdown(made, 1) }
        } else {
            made = bufferevent_socket_new(context.loop.base, fd, options)
        }
        guard let made else {
            Platform.closeDescriptor(fd)
            return (nil, nil)
        }
        Self.tune(made)
        Buffers.append(received, to: clientOutput)
        Buffers.append(unsent, to: bufferevent_get_output(made))
        return (made, tls)
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

    /// How TLS for an intercepted CONNECT starts, once `send` took `sent` bytes of the machine's `answer` (-1 for
    /// none: an error or a full socket) and the bufferevent held bytes either way (`buffered`, then nothing was
    /// sent): on the socket itself when the whole answer went and nothing waits, else as a filter over the
    /// bufferevent, which sends what is left of the answer first and keeps what the client sent early.
    enum InterceptionStart: Equatable {
        case onTheSocket
        case overTheBufferevent(rest: ArraySlice<UInt8>)
    }

    static func interceptionStart(answer: [UInt8], sent: Int, buffered: Bool) -> InterceptionStart {
        if buffered { return .overTheBufferevent(rest: answer[...]) }
        if sent >= answer.count { return .onTheSocket }
        return .overTheBufferevent(rest: answer[max(0, sent)...])
    }

    /// CONNECT to a protected origin: the machine's 200, then a TLS driver takes the socket over.
    private func startInterception(_ origin: OriginConfig, answer: [UInt8]) {
        guard let contexts = context.tlsContexts, let bev = client else {
            queued.append(.interceptionFailed(origin, reason: "no local CA"))
            return
        }
        let ssl: OpaquePointer
        do {
            ssl = try contexts.makeSSL(for: origin.authority.host)
        } catch {
            queued.append(.interceptionFailed(origin, reason: "\(error)"))
            return
        }
        let fd = bufferevent_getfd(bev)
        let buffered =
            Buffers.length(bufferevent_get_input(bev)) != 0 || Buffers.length(bufferevent_get_output(bev)) != 0
        let sent =
            buffered ? 0 : answer.withUnsafeBytes { Platform.send(fd, $0) }
        let session: ClientDriver
        switch Self.interceptionStart(answer: answer, sent: sent, buffered: buffered) {
        case .onTheSocket:
            // The usual case: TLS directly on the socket. The bufferevent lets go of the descriptor.
            bufferevent_setfd(bev, -1)
            bufferevent_free(bev)
            client = nil
            session = ClientDriver(
                context: context, id: id, peer: peer, client: clientAddress, origin: origin, ssl: ssl, fd: fd,
                underlying: nil)
        case .overTheBufferevent(let rest):
            // The client sent bytes before our answer, or the socket took part of it: TLS as a filter over the
            // existing bufferevent, which keeps those bytes and sends the rest of the 200 first.
            Buffers.append(Array(rest), to: bufferevent_get_output(bev))
            bufferevent_setcb(bev, nil, nil, nil, nil)
            client = nil
            session = ClientDriver(
                context: context, id: id, peer: peer, client: clientAddress, origin: origin, ssl: ssl, fd: -1,
                underlying: bev)
        }
        context.owner.adopt(session)
        context.owner.interceptionStarted()
        // The audit log's client process: looked for during the handshake, while the client waits.
        if context.audit != nil { context.peers.resolve(connection: id) }
        finishHandOff()
    }

    /// The client chose HTTP/2 in the handshake: an `H2Driver` takes the TLS bufferevent over.
    private func startHTTP2(_ origin: OriginConfig, misdirected: String?) {
        handOverTLSSocket()
        guard let bev = client else { return close() }
        bufferevent_setcb(bev, nil, nil, nil, nil)
        client = nil
        ssl = nil
        let session = H2Driver(
            context: context, id: id, peer: peer, client: clientAddress, origin: origin, bufferevent: bev,
            misdirected: misdirected)
        context.owner.adopt(session)
        finishHandOff()
        session.begin()
    }

    /// The TLS socket becomes an OpenSSL bufferevent (`client`), with what its buffers hold, for a driver
    /// that takes bufferevents (HTTP/2, a relay).
    private func handOverTLSSocket() {
        guard let tlsSocket else { return }
        self.tlsSocket = nil
        client = tlsSocket.intoBufferevent(options: Self.tlsOptions)
        if client == nil { context.logger.error("conn=\(id) cannot hand the TLS connection over") }
    }

    /// Another connection took the sockets: this one is done without closing them.
    private func finishHandOff() {
        closed = true
        timers.removeAll()
        context.owner.connectionClosed(self)
    }

    // MARK: - The exchange with a protected origin

    /// The exchange's I/O for `origin`: the one in flight, or a new one (the exchange's first output).
    private func exchange(for origin: OriginConfig) -> ExchangeIO {
        if let exchangeIO { return exchangeIO }
        exchanges += 1
        let made = ExchangeIO(
            driver: self, context: context, origin: origin, connectionID: id, generation: exchanges,
            replay: replay)
        exchangeIO = made
        return made
    }

    /// Keeps `count` bytes of the client's input as request body (the exchange's first outputs made its I/O).
    private func keepBody(_ count: Int) {
        guard let io = exchangeIO else { preconditionFailure("request body without an exchange") }
        var remaining = count
        Buffers.forEachSegment(clientInput) { segment in
            let piece = UnsafeRawBufferPointer(rebasing: segment.prefix(remaining))
            guard io.keep(piece) else { return false }
            remaining -= piece.count
            return remaining > 0
        }
        evbuffer_drain(clientInput, count)
        throttleClientIfNeeded()
    }

    // MARK: - ExchangeDriver (at the top of the loop, never inside `handle`; only the current exchange's)

    func exchange(_ io: ExchangeIO, event: ExchangeIO.Event) {
        guard !closed, io === exchangeIO else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        switch event {
        case .tokens(let grant): handle(.tokens(grant))
        case .refreshed(let grant): handle(.refreshed(grant))
        case .credentialFailed(let answer): handle(.credentialFailed(answer))
        case .resourceMetadata(let verdict): handle(.resourceMetadata(verdict))
        case .bodyNotKept(let directory): handle(.bodyNotKept(directory: directory))
        case .bodyBeyondBudget: handle(.bodyBeyondBudget)
        case .transferFinished(let failure, let detail): handle(.transferFinished(failure, detail: detail))
        case .responseHead(let received):
            transferEvent { machine, now, out in machine.transferResponseHead(received, now: now, &out) }
        case .responseTrailers(let fields):
            transferEvent { machine, now, out in machine.transferTrailers(fields, now: now, &out) }
        }
    }

    private func transferEvent(_ event: (inout ConnectionMachine, Int64, inout [ConnectionMachine.Action]) -> Void) {
        precondition(!handling, "a transfer callback inside an event of the same connection")
        // The driver's action array: nothing else uses it outside `handling`.
        actions.removeAll(keepingCapacity: true)
        event(&machine, lastActivity, &actions)
        handling = true
        run(actions)
        handling = false
        if !queued.isEmpty {
            let first = queued.removeFirst()
            handle(first)
        }
    }

    func exchange(_ io: ExchangeIO, responseBody data: UnsafeRawBufferPointer) -> Bool {
        guard !closed, io === exchangeIO else { return true }
        precondition(!handling, "a transfer callback inside an event of the same connection")
        lastActivity = EventLoop.monotonicMilliseconds()
        if Buffers.length(clientOutput) >= context.highWater, hasClient {
            // A slow client pauses the transfer; the client's write callback resumes it.
            upstreamThrottled = true
            setClientWriteLowWater(context.highWater / 2)
            return false
        }
        transferData = data
        handle(.transferBody(count: data.count))
        transferData = nil
        return true
    }

    func exchange(_ io: ExchangeIO, bodyTaken count: Int) {
        guard !closed, io === exchangeIO else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        // The transfer took what the client sent (or waits for more): the client may send more.
        if count == 0 || (io.body.streaming && io.body.queued < context.highWater / 2) { clientMayReadAgain() }
    }

    /// The exchange ended: its line in the log and its counts; its transfer stops.
    private func exchangeFinished(_ record: ExchangeRecord) {
        // After a 101 the exchange's connection is the tunnel's (`.startTunnel` follows).
        if record.status == 101 { switched = exchangeIO?.takeSwitched() }
        if let io = exchangeIO {
            io.finish(record, peer: peer)
        } else {
            // Answered before any I/O of the exchange.
            ExchangeIO.report(
                record, up: 0, down: 0, milliseconds: EventLoop.monotonicMilliseconds() - started, context: context,
                connectionID: id, peer: peer)
        }
        exchangeIO = nil
    }

    /// Stops the exchange in flight, if any (the connection ends).
    private func endExchange() {
        exchangeIO?.cancel()
        exchangeIO = nil
    }

    // MARK: - Ending

    func shutdown() { handle(.shutdown) }

    /// Ends the connection at once (the shutdown grace ran out).
    func abort(_ reason: String?) {
        handle(.abort(reason: reason))
        close()
    }

    func close() {
        guard !closed else { return }
        closed = true
        endExchange()
        timers.removeAll()
        lingerTimer = nil
        if let upstream {
            bufferevent_free(upstream)
            self.upstream = nil
        }
        if let client {
            bufferevent_free(client)
            self.client = nil
        }
        if let tlsSocket {
            tlsSocket.close()
            self.tlsSocket = nil
        }
        if case .intercepted(let origin) = machine.role {
            context.logger.debug(
                "conn=\(id) client=\(peer) CONNECT \(origin.authority) intercepted: \(machine.requests) request(s) in \(LogText.duration(EventLoop.monotonicMilliseconds() - started))"
            )
        }
        context.owner.connectionClosed(self)
    }
}

extension ClientDriver: TLSSocketUser {
    func socketReadable() { clientReadable() }
    func socketWritable() { clientWritable() }
    func socketEvent(_ events: Int16) { clientEvent(events) }
}

// MARK: - libevent callbacks (context: the ClientDriver, unretained; the server's table owns it)

private let clientReadCallback: bufferevent_data_cb = { _, context in
    Unmanaged<ClientDriver>.fromOpaque(context!).takeUnretainedValue().clientReadable()
}
private let clientWriteCallback: bufferevent_data_cb = { _, context in
    Unmanaged<ClientDriver>.fromOpaque(context!).takeUnretainedValue().clientWritable()
}
private let clientEventCallback: bufferevent_event_cb = { _, events, context in
    Unmanaged<ClientDriver>.fromOpaque(context!).takeUnretainedValue().clientEvent(events)
}
private let upstreamReadCallback: bufferevent_data_cb = { _, context in
    Unmanaged<ClientDriver>.fromOpaque(context!).takeUnretainedValue().upstreamReadable()
}
private let upstreamWriteCallback: bufferevent_data_cb = { _, context in
    Unmanaged<ClientDriver>.fromOpaque(context!).takeUnretainedValue().upstreamWritable()
}
private let upstreamEventCallback: bufferevent_event_cb = { _, events, context in
    Unmanaged<ClientDriver>.fromOpaque(context!).takeUnretainedValue().upstreamEvent(events)
}

/// A connection's timers, a slot per kind: an array indexed by the kind, where a dictionary hashed the kind for
/// every arm and disarm (four per request).
struct TimerSlots {
    private var slots = [LoopTimer?](repeating: nil, count: ConnectionTimer.allCases.count)

    subscript(kind: ConnectionTimer) -> LoopTimer? {
        get { slots[Self.index(kind)] }
        set { slots[Self.index(kind)] = newValue }
    }

    func cancelAll() {
        for case let timer? in slots { timer.cancel() }
    }

    mutating func removeAll() {
        for index in slots.indices { slots[index] = nil }
    }

    private static func index(_ kind: ConnectionTimer) -> Int {
        switch kind {
        case .head: 0
        case .keepAlive: 1
        case .connect: 2
        case .idle: 3
        case .upstreamKeepAlive: 4
        }
    }
}
