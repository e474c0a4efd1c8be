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
final class ClientDriver: ServerConnection, ExchangeDriver, UpstreamSocketUser {
    let context: ConnectionContext
    let identity: ConnectionIdentity
    private var machine: ConnectionMachine
    /// The client's connection, whichever carries it.
    private var side: ClientSide
    /// The next hop of a forwarded request or a blind tunnel (made at the first `.resolve`).
    private var nextHop: UpstreamSocket?
    /// The own client's connection to a protected origin that answered an upgrade with 101, from the exchange's
    /// end until the tunnel takes it.
    private var switched: OriginConnection?
    /// What this connection's request bodies keep for replays, of the process's budget.
    private lazy var replay = ReplayAccount(context.replayBudget)
    private var timers = TimerSlots()
    /// When a byte last moved on this connection (either side, the transfer included).
    private var lastActivity: Int64
    private var phase = ClosePhase.open
    private var flow = Flow()

    /// The exchange with a protected origin in flight (its body, tokens and transfer); callbacks of any other
    /// are dropped.
    private var exchangeIO: ExchangeIO?
    /// The response bytes of the transfer's current callback (`.writeResponseBody` writes them).
    private var transferData: UnsafeRawBufferPointer?

    private var queue = MachineQueue<ConnectionMachine.Event, ConnectionMachine.Action>()

    /// Flow control, the driver's mechanics: a reader is paused while the buffer toward its destination holds
    /// more than `highWater` bytes.
    private struct Flow {
        /// The machine wants the client's bytes (`.readClient`).
        var machineWantsClient = false
        /// Reading from the client is paused: the buffer toward the next hop (or the transfer's body queue) is
        /// full.
        var clientThrottled = false
        /// Reading from the upstream (or the transfer) is paused: the client's output is full.
        var upstreamThrottled = false
    }

    /// A plain client connection on `fd`, just accepted.
    init(context: ConnectionContext, id: UInt64, fd: Int32, peer: String, client: String) {
        self.context = context
        self.identity = ConnectionIdentity(
            id: id, peer: peer, client: client, started: EventLoop.monotonicMilliseconds())
        self.lastActivity = identity.started
        machine = ConnectionMachine(
            role: .frontDoor, frontDoor: context.frontDoor, hasLocalCA: context.tlsContexts != nil,
            peer: context.peers.identify(fd, connection: id, settings: context.frontDoor, audited: context.audit != nil)
        )
        side = ClientSide(bev: bufferevent_socket_new(context.loop.base, fd, Int32(BEV_OPT_CLOSE_ON_FREE.rawValue)))
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
        self.identity = ConnectionIdentity(
            id: id, peer: peer, client: client, started: EventLoop.monotonicMilliseconds())
        self.lastActivity = identity.started
        machine = ConnectionMachine(
            role: .intercepted(origin), frontDoor: context.frontDoor, hasLocalCA: context.tlsContexts != nil)
        if let underlying {
            let bev = bufferevent_openssl_filter_new(
                context.loop.base, underlying, ssl, BUFFEREVENT_SSL_ACCEPTING, ClientHandOff.tlsOptions)
            if let bev { bufferevent_openssl_set_allow_dirty_shutdown(bev, 1) }
            side = ClientSide(bev: bev, ssl: ssl)
            setUpClient()
        } else {
            let socket = TLSSocket(loop: context.loop, fd: fd, ssl: ssl)
            side = ClientSide(tls: socket, ssl: ssl)
            socket.user = self
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
        self.identity = ConnectionIdentity(
            id: id, peer: peer, client: client, started: EventLoop.monotonicMilliseconds())
        self.lastActivity = identity.started
        machine = ConnectionMachine(
            role: .intercepted(origin), frontDoor: context.frontDoor, hasLocalCA: context.tlsContexts != nil)
        side = ClientSide(bev: pair)
        setUpClient()
    }

    /// Starts a connection made by `init(...pair:)`.
    func begin() {
        handle(.start)
        handle(.tlsEstablished(serverName: nil, protocol: "http/1.1"))
    }

    private func setUpClient() {
        guard let bev = side.bev else {
            context.logger.error("conn=\(id) cannot set up the client connection")
            phase = .closed
            return
        }
        Self.tune(bev)
        bufferevent_setcb(
            bev, clientReadCallback, clientWriteCallback, clientEventCallback, Unmanaged.passUnretained(self).toOpaque()
        )
        bufferevent_enable(bev, Int16(EV_WRITE))
    }

    /// Large single reads and writes keep the syscall count per GiB low.
    static func tune(_ bev: OpaquePointer?) {
        bufferevent_set_max_single_read(bev, 256 * 1024)
        bufferevent_set_max_single_write(bev, 256 * 1024)
    }

    var id: UInt64 { identity.id }
    var peer: String { identity.peer }
    var clientAddress: String { identity.client }

    var isIdle: Bool { machine.isIdle && exchangeIO?.hasTransfer != true }

    // MARK: - Events into the machine

    private func handle(_ event: ConnectionMachine.Event) {
        if phase.isClosed { return }
        if queue.handling {
            queue.events.append(event)
            return
        }
        queue.handling = true
        var next: ConnectionMachine.Event? = event
        while let current = next, !phase.isClosed {
            queue.actions.emptyKeepingStorage()
            machine.handle(
                current, client: EvbufferView(side.input), upstream: EvbufferView(nextHop?.input),
                now: EventLoop.monotonicMilliseconds(), &queue.actions)
            run(queue.actions)
            next = queue.events.isEmpty ? nil : queue.events.removeFirst()
        }
        queue.events.removeAll()
        queue.handling = false
    }

    // MARK: - Actions

    private func run(_ actions: [ConnectionMachine.Action]) {
        for action in actions {
            if phase.isClosed {
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
            evbuffer_drain(side.input, count)
        case .writeClient(let bytes):
            Buffers.append(bytes, to: side.output)
            exchangeIO?.down += bytes.count
            throttleUpstreamIfNeeded()
        case .readClient(let on):
            flow.machineWantsClient = on
            updateClientReading()
        case .closeAfterFlush:
            if case .open = phase { phase = .flushing(deadline: nil) }
            side.setReading(false)
            if Buffers.length(side.output) == 0 { finishAfterFlush() }
        case .closeNow:
            close()
        case .resetClient:
            if side.fd >= 0 { proxyctl_set_linger_reset(side.fd) }
            close()

        case .resolve(let hop):
            upstream.resolve(hop)
        case .connect(let index):
            if let failed = upstream.connect(to: index) { queue.events.append(failed) }
        case .closeUpstream:
            nextHop?.close()
            flow.upstreamThrottled = false
            flow.clientThrottled = false
            updateClientReading()
        case .writeUpstream(let bytes):
            Buffers.append(bytes, to: nextHop?.output)
            throttleClientIfNeeded()
        case .consumeUpstream(let count):
            evbuffer_drain(nextHop?.input, count)
        case .moveClientToUpstream(let count):
            Buffers.move(count, from: side.input, to: nextHop?.output)
            throttleClientIfNeeded()
        case .moveUpstreamToClient(let count):
            Buffers.move(count, from: nextHop?.input, to: side.output)
            throttleUpstreamIfNeeded()
        case .startTunnel(let label, let status):
            startTunnel(label: label, status: status)
        case .startInterception(let origin, let answer):
            startInterception(origin, answer: answer)
        case .startHTTP2(let origin, let misdirected):
            startHTTP2(origin, misdirected: misdirected)

        case .arm(let kind, let milliseconds):
            timers.arm(kind, milliseconds: milliseconds) {
                LoopTimer(loop: context.loop) { [unowned self] in handle(.timerFired(kind, lastActivity: lastActivity))
                }
            }
        case .disarm(let kind):
            timers.disarm(kind)

        case .keepBody(let count):
            keepBody(count)
        case .requestTrailers(let fields):
            exchangeIO?.requestTrailers = fields
        case .exchange(let output, let origin):
            exchange(for: origin).perform(output)
        case .writeResponseBody:
            guard let data = transferData, !data.isEmpty else { return }
            evbuffer_add(side.output, data.baseAddress, data.count)
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

    /// The next hop, made at its first use.
    private var upstream: UpstreamSocket {
        if let nextHop { return nextHop }
        let made = UpstreamSocket(context: context, user: self)
        nextHop = made
        return made
    }

    // MARK: - Flow control (mechanics: the machine says what it wants to read, buffers say when)

    private func updateClientReading() {
        switch phase {
        case .open: side.setReading(flow.machineWantsClient && !flow.clientThrottled)
        case .flushing: side.setReading(false)
        case .lingering, .closed: break
        }
    }

    /// The buffer toward the next hop (or the transfer's body queue) is full: stop reading the client until
    /// it drains below half.
    private func throttleClientIfNeeded() {
        let waiting = nextHop?.output.map { Buffers.length($0) } ?? (exchangeIO?.body.queued ?? 0)
        guard waiting >= context.highWater, !flow.clientThrottled else { return }
        flow.clientThrottled = true
        nextHop?.setWriteLowWater(context.highWater / 2)
        updateClientReading()
    }

    private func clientMayReadAgain() {
        guard flow.clientThrottled else { return }
        flow.clientThrottled = false
        nextHop?.setWriteLowWater(0)
        updateClientReading()
    }

    /// The client's output is full: stop reading the next hop until it drains below half.
    private func throttleUpstreamIfNeeded() {
        guard Buffers.length(side.output) >= context.highWater, !flow.upstreamThrottled, side.exists else { return }
        flow.upstreamThrottled = true
        side.setWriteLowWater(context.highWater / 2)
        nextHop?.setReading(false)
    }

    private func upstreamMayReadAgain() {
        guard flow.upstreamThrottled, side.exists else { return }
        flow.upstreamThrottled = false
        side.setWriteLowWater(0)
        nextHop?.setReading(true)
        exchangeIO?.resumeResponse()
    }

    // MARK: - Client callbacks

    fileprivate func clientReadable() {
        if phase.isLingering {
            if let input = side.input { evbuffer_drain(input, Buffers.length(input)) }
            return
        }
        lastActivity = EventLoop.monotonicMilliseconds()
        handle(.clientData)
    }

    fileprivate func clientWritable() {
        lastActivity = EventLoop.monotonicMilliseconds()
        switch phase {
        case .flushing: if Buffers.length(side.output) == 0 { finishAfterFlush() }
        case .open: upstreamMayReadAgain()
        case .lingering, .closed: break
        }
    }

    /// The last bytes went out: shut the sending side and linger, or close when there is no socket to shut.
    private func finishAfterFlush() {
        guard phase.isFlushing else { return }
        guard side.shutWrite() else { return close() }
        let timer = LoopTimer(loop: context.loop) { [unowned self] in close() }
        timer.schedule(milliseconds: LingeringClose.milliseconds)
        phase = .lingering(timer)
        endExchange()
        nextHop?.close()
        timers.cancelAll()
        side.setReading(true)
    }

    fileprivate func clientEvent(_ events: Int16) {
        if phase.isLingering {
            // The client's end (or a reset) is what was waited for.
            return close()
        }
        let what = Int32(events)
        if what & Int32(BEV_EVENT_CONNECTED) != 0 {
            lastActivity = EventLoop.monotonicMilliseconds()
            handle(
                .tlsEstablished(
                    serverName: side.ssl.flatMap { tlsServerName($0) },
                    protocol: side.ssl.flatMap { tlsSelectedProtocol($0) }))
            return
        }
        if let ssl = side.ssl, SSL_is_init_finished(ssl) == 0 {
            handle(.tlsFailed(reason: side.tlsFailure))
            return
        }
        let eof = what & Int32(BEV_EVENT_EOF) != 0 && what & Int32(BEV_EVENT_ERROR) == 0
        handle(.clientEnded(reset: !eof))
    }

    // MARK: - UpstreamSocketUser (the next hop)

    func upstream(_ event: ConnectionMachine.Event, activity: Bool) {
        if activity { lastActivity = EventLoop.monotonicMilliseconds() }
        handle(event)
    }

    func upstreamDrained() {
        lastActivity = EventLoop.monotonicMilliseconds()
        clientMayReadAgain()
    }

    // MARK: - Hand-offs

    /// A tunnel takes both connections (`ClientHandOff.tunnel`): the next hop's, or the one the origin switched
    /// protocols on after a 101.
    private func startTunnel(label: TunnelLabel, status: Int) {
        guard side.intoBufferevent(options: ClientHandOff.tlsOptions) else { return close() }
        let next: (bev: OpaquePointer, ssl: OpaquePointer?)?
        if let switched {
            self.switched = nil
            next = ClientHandOff.adopt(switched, loop: context.loop, clientOutput: side.output)
        } else {
            next = nextHop?.release().map { ($0, nil) }
        }
        guard let next else { return close() }
        guard let client = side.release() else {
            bufferevent_free(next.bev)
            return close()
        }
        let tunnel = ClientHandOff.tunnel(
            identity, context: context, label: label, status: status, client: client, upstream: next)
        context.owner.adopt(tunnel)
        finishHandOff()
        (tunnel as? RelayTunnel)?.begin()
    }

    /// CONNECT to a protected origin: the machine's 200, then a TLS driver takes the socket over.
    private func startInterception(_ origin: OriginConfig, answer: [UInt8]) {
        guard let bev = side.bev else { return queue.events.append(.interceptionFailed(origin, reason: "no local CA")) }
        switch ClientHandOff.intercept(identity, context: context, origin: origin, answer: answer, bev: bev) {
        case .failure(let failure):
            queue.events.append(.interceptionFailed(origin, reason: failure.reason))
        case .success(let session):
            side.forget()
            context.owner.adopt(session)
            context.owner.interceptionStarted()
            // The audit log's client process: looked for during the handshake, while the client waits.
            if context.audit != nil { context.peers.resolve(connection: id) }
            finishHandOff()
        }
    }

    /// The client chose HTTP/2 in the handshake: an `H2Driver` takes the TLS bufferevent over.
    private func startHTTP2(_ origin: OriginConfig, misdirected: String?) {
        guard side.intoBufferevent(options: ClientHandOff.tlsOptions), let (bev, _) = side.release() else {
            context.logger.error("conn=\(id) cannot hand the TLS connection over")
            return close()
        }
        let session = H2Driver(
            context: context, id: id, peer: peer, client: clientAddress, origin: origin, bufferevent: bev,
            misdirected: misdirected)
        context.owner.adopt(session)
        finishHandOff()
        session.begin()
    }

    /// Another connection took the sockets: this one is done without closing them.
    private func finishHandOff() {
        phase = .closed
        timers.removeAll()
        context.owner.connectionClosed(self)
    }

    // MARK: - The exchange with a protected origin

    /// The exchange's I/O for `origin`: the one in flight, or a new one (the exchange's first output).
    private func exchange(for origin: OriginConfig) -> ExchangeIO {
        if let exchangeIO { return exchangeIO }
        let made = ExchangeIO(driver: self, context: context, origin: origin, connectionID: id, replay: replay)
        exchangeIO = made
        return made
    }

    /// Keeps `count` bytes of the client's input as request body (the exchange's first outputs made its I/O).
    private func keepBody(_ count: Int) {
        guard let io = exchangeIO else { preconditionFailure("request body without an exchange") }
        var remaining = count
        Buffers.forEachSegment(side.input) { segment in
            let piece = UnsafeRawBufferPointer(rebasing: segment.prefix(remaining))
            guard io.keep(piece) else { return false }
            remaining -= piece.count
            return remaining > 0
        }
        evbuffer_drain(side.input, count)
        throttleClientIfNeeded()
    }

    // MARK: - ExchangeDriver (at the top of the loop, never inside `handle`; only the current exchange's)

    func exchange(_ io: ExchangeIO, event: ExchangeIO.Event) {
        guard !phase.isClosed, io === exchangeIO else { return }
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
        precondition(!queue.handling, "a transfer callback inside an event of the same connection")
        // The driver's action array: nothing else uses it outside `handle`.
        queue.actions.emptyKeepingStorage()
        event(&machine, lastActivity, &queue.actions)
        queue.handling = true
        run(queue.actions)
        queue.handling = false
        if !queue.events.isEmpty {
            let first = queue.events.removeFirst()
            handle(first)
        }
    }

    func exchange(_ io: ExchangeIO, responseBody data: UnsafeRawBufferPointer) -> Bool {
        guard !phase.isClosed, io === exchangeIO else { return true }
        precondition(!queue.handling, "a transfer callback inside an event of the same connection")
        lastActivity = EventLoop.monotonicMilliseconds()
        if Buffers.length(side.output) >= context.highWater, side.exists {
            // A slow client pauses the transfer; the client's write callback resumes it.
            flow.upstreamThrottled = true
            side.setWriteLowWater(context.highWater / 2)
            return false
        }
        transferData = data
        handle(.transferBody(count: data.count))
        transferData = nil
        return true
    }

    func exchange(_ io: ExchangeIO, bodyTaken count: Int) {
        guard !phase.isClosed, io === exchangeIO else { return }
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
                record, up: 0, down: 0, milliseconds: EventLoop.monotonicMilliseconds() - identity.started,
                context: context,
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
        guard !phase.isClosed else { return }
        phase = .closed
        endExchange()
        timers.removeAll()
        nextHop?.close()
        side.close()
        if case .intercepted(let origin) = machine.role {
            context.logger.debug(
                "conn=\(id) client=\(peer) CONNECT \(origin.authority) intercepted: \(machine.requests) request(s) in \(LogText.duration(EventLoop.monotonicMilliseconds() - identity.started))"
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
