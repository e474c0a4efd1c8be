import CLibevent
import CNghttp2
import COpenSSL
import ProxyCore
import ProxyOAuth
import ProxyTLS

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// Runs an `H2Session` on an HTTP/2 connection a client opened inside an intercepted TLS tunnel: nghttp2 reads
/// and writes the frames (HPACK, flow control, the protocol's own limits), its callbacks become the machine's
/// events, the machine's actions become nghttp2 submissions and exchanges on the proxy's own client
/// (`ExchangeIO`), one per stream.
///
/// Mechanics it owns: each stream's request body store (bytes are kept as nghttp2 hands them over, then the
/// machine is told) and the HTTP/2 flow-control windows (a client's DATA is acknowledged once it is kept or
/// once the transfer took it, so a slow origin slows the client instead of filling memory); each stream's
/// response buffer (a slow client stream pauses its transfer); and writing to the socket only while its
/// buffer is below the high-water mark.
final class H2Driver: ServerConnection, ExchangeDriver {
    let context: ConnectionContext
    let identity: ConnectionIdentity
    private var machine: H2Session
    private var client: OpaquePointer?
    private var frames: H2ServerSession?
    private var streams = StreamTable()
    private var timers = TimerSlots()
    private var lastActivity: Int64
    private var phase = ClosePhase.open
    /// What this connection's request bodies keep for replays, of the process's budget.
    private lazy var replay = ReplayAccount(context.replayBudget)
    /// Events raised inside nghttp2's callbacks (or while actions run) wait until the current call returned.
    private var queue = MachineQueue<H2Session.Event, H2Session.Action>()
    /// Runs `flush` at the end of the loop's pass (`flushSoon`).
    private lazy var flushTask = LoopTimer(loop: context.loop) { [unowned self] in flush() }
    /// The response bytes of the transfer's current callback (`.writeBody` takes them).
    private var transferData: UnsafeRawBufferPointer?

    init(
        context: ConnectionContext, id: UInt64, peer: String, client clientAddress: String, origin: OriginConfig,
        bufferevent: OpaquePointer, misdirected: String?
    ) {
        self.context = context
        self.identity = ConnectionIdentity(
            id: id, peer: peer, client: clientAddress, started: EventLoop.monotonicMilliseconds())
        self.lastActivity = identity.started
        self.client = bufferevent
        machine = H2Session(
            origin: origin, frontDoor: context.frontDoor, misdirected: misdirected,
            keySeed: UInt64.random(in: 1...UInt64.max))
        frames = H2ServerSession(driver: self, settings: context.settings)
    }

    /// Starts serving, once the server's table holds this connection.
    func begin() {
        guard let client else { return }
        guard frames != nil else {
            context.logger.error("conn=\(id) cannot set up HTTP/2")
            return close()
        }
        bufferevent_setcb(
            client, h2ReadCallback, h2WriteCallback, h2EventCallback, Unmanaged.passUnretained(self).toOpaque())
        bufferevent_enable(client, Int16(EV_READ | EV_WRITE))
        queue.actions.emptyKeepingStorage()
        machine.start(now: identity.started, &queue.actions)
        run(queue.actions)
        // The client's connection preface may have come with the handshake.
        readable()
    }

    var id: UInt64 { identity.id }
    var peer: String { identity.peer }
    var clientAddress: String { identity.client }

    var isIdle: Bool { machine.isIdle }

    // MARK: - Bytes from the client

    fileprivate func readable() {
        guard !phase.isClosed, let client else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        let input = bufferevent_get_input(client)
        if phase.isLingering {
            evbuffer_drain(input, Buffers.length(input))
            return
        }
        while Buffers.length(input) > 0 && !phase.isClosed {
            var consumed = 0
            Buffers.forEachSegment(input) { segment in
                guard !phase.isClosed, let taken = receive(segment) else { return false }
                consumed += taken
                return true
            }
            // Closed (a connection error, or an event of the frames): the bufferevent went with `input`.
            if phase.isClosed { return }
            evbuffer_drain(input, consumed)
            if consumed == 0 { break }
        }
        if Buffers.length(input) == 0, let ssl = bufferevent_openssl_get_ssl(client) {
            // libevent's OpenSSL bufferevent reads one record per pass of the loop, and a client's frames come in
            // many small records (a request's HEADERS is one): the rest now, a pass's worth at most.
            let ended = TLSSocket.readRecordsLeft(ssl, upTo: Self.recordsPerPass) {
                receive($0) != nil && !phase.isClosed
            }
            if ended && !phase.isClosed { event(Int16(BEV_EVENT_READING | BEV_EVENT_EOF)) }
        }
        processQueued()
    }

    /// TLS records read after what the bufferevent read, per pass (the rest is the next pass's, so that one
    /// client cannot hold the loop).
    private static let recordsPerPass = 64

    /// Gives the client's bytes to nghttp2: how many it took, or nil when they broke the connection (logged,
    /// what is due flushed, closed).
    private func receive(_ bytes: UnsafeRawBufferPointer) -> Int? {
        guard let frames else { return nil }
        switch frames.receive(bytes) {
        case .success(let taken):
            return taken
        case .failure(let error):
            context.logger.info("conn=\(id) client=\(peer) h2 connection error: \(error)")
            flush()
            close()
            return nil
        }
    }

    fileprivate func writable() {
        guard !phase.isClosed else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        flush()
        if phase.isFlushing && Buffers.length(clientOutput) == 0 && everythingSent { finishAfterFlush() }
    }

    /// nghttp2 has nothing more to write and every stream is closed there (its last frame was handed over):
    /// the machine's exchanges can end before the client has their responses (flow control holds them back,
    /// and only the client's WINDOW_UPDATEs let them go), so "after flush" waits for these too.
    private var everythingSent: Bool {
        guard let frames else { return true }
        return !frames.wantsWrite && streams.values.allSatisfy(\.closed)
    }

    fileprivate func event(_ events: Int16) {
        // While lingering, the client's end (or a reset) is what was waited for.
        if !phase.isLingering { handle(.clientGone) }
        close()
    }

    /// Everything went out: shut the sending side and linger, or close when there is no socket to shut.
    private func finishAfterFlush() {
        guard phase.isFlushing else { return }
        guard let client, LingeringClose.shutWrite(client) else { return close() }
        let timer = LoopTimer(loop: context.loop) { [unowned self] in close() }
        timer.schedule(milliseconds: LingeringClose.milliseconds)
        phase = .lingering(timer)
        timers.cancelAll()
        bufferevent_enable(client, Int16(EV_READ))
    }

    private var clientOutput: OpaquePointer? { client.map { bufferevent_get_output($0) } }

    /// Writes what nghttp2 has to send, while the socket's buffer has room.
    private func flush() {
        switch phase {
        case .open, .flushing: break
        case .lingering, .closed: return
        }
        guard let frames, let output = clientOutput else { return }
        if case .failure(let error) = frames.send(into: output, below: context.highWater) {
            context.logger.info("conn=\(id) client=\(peer) h2 send error: \(error)")
            return close()
        }
        if !frames.wantsRead && !frames.wantsWrite {
            if case .open = phase { phase = .flushing(deadline: nil) }
            if Buffers.length(output) == 0 { return finishAfterFlush() }
        }
        if phase.isFlushing && Buffers.length(output) == 0 && everythingSent { return finishAfterFlush() }
    }

    // MARK: - Events into the machine

    private func handle(_ event: H2Session.Event) {
        if phase.isClosed { return }
        queue.events.append(event)
        if !queue.handling { processQueued() }
    }

    private func processQueued() {
        guard !queue.handling else { return }
        queue.handling = true
        while !queue.events.isEmpty && !phase.isClosed {
            let event = queue.events.removeFirst()
            // A request whose stream nghttp2 closed in the same read (HEADERS then RST_STREAM) was withdrawn
            // before the machine saw it: nothing will ever end it there, so it never begins.
            switch event {
            case .requestHeaders(let stream, _, _), .requestHeadTooLarge(let stream, _, _):
                if streams[stream] == nil { continue }
            default:
                break
            }
            queue.actions.emptyKeepingStorage()
            machine.handle(event, now: EventLoop.monotonicMilliseconds(), &queue.actions)
            run(queue.actions)
        }
        queue.handling = false
        flushSoon()
    }

    /// nghttp2's frames go out once per pass of the loop: a stream's head, body and end (three events of its
    /// transfer) and the other streams' responses of the same pass are written by one run of `flush`, not one
    /// each (`scripts/instructions --h2`: four runs of nghttp2's sender per request before).
    private func flushSoon() {
        flushTask.fireInThisPass()
    }

    // MARK: - Actions

    private func run(_ actions: [H2Session.Action]) {
        for action in actions {
            if phase.isClosed {
                if case .exchangeFinished(let stream, let record) = action { exchangeFinished(stream, record) }
                if case .log(let line) = action { log(line) }
                continue
            }
            perform(action)
        }
    }

    private func perform(_ action: H2Session.Action) {
        switch action {
        case .submitResponse(let stream, let fields, let endStream):
            frames?.submitResponse(stream, fields, provider: !endStream)
        case .respond(let stream, let fields, let body):
            let io = streamIO(stream)
            evbuffer_drain(io.pending, io.pendingCount)
            body.withUnsafeBytes { _ = evbuffer_add(io.pending, $0.baseAddress, $0.count) }
            io.responseEnded = true
            frames?.submitResponse(stream, fields, provider: !body.isEmpty)
        case .writeBody(let stream):
            guard let data = transferData, let io = streams[stream] else { return }
            evbuffer_add(io.pending, data.baseAddress, data.count)
            io.exchange?.down += data.count
            resumeData(io)
        case .endStream(let stream, let trailers):
            guard let io = streams[stream] else { return }
            io.responseEnded = true
            io.trailers = trailers
            resumeData(io)
        case .resetStream(let stream, let code):
            frames?.reset(stream, code: code.rawValue)
        case .dropRequestBody(let stream):
            guard let io = streams[stream] else { return }
            io.bodyUnwanted = true
            if io.unacknowledged > 0 {
                // Streamed bytes the transfer never took: the connection's window gets them back.
                frames?.consume(stream, io.unacknowledged)
                io.unacknowledged = 0
            }
        case .requestTrailers(let stream, let fields):
            streams[stream]?.exchange?.requestTrailers = fields
        case .exchange(let stream, let output, _):
            guard let io = streams[stream] else { return }
            io.inExchange = true
            io.exchange?.perform(output)
        case .exchangeFinished(let stream, let record):
            exchangeFinished(stream, record)
        case .goaway(let code):
            frames?.goaway(code: code.rawValue)
        case .closeAfterFlush:
            // The client is still read: its WINDOW_UPDATEs let the last responses out (nghttp2 refuses new
            // streams after the GOAWAY that came first).
            guard case .open = phase else { return }
            let deadline = LoopTimer(loop: context.loop) { [unowned self] in close() }
            deadline.schedule(milliseconds: context.settings.idleTimeout)
            phase = .flushing(deadline: deadline)
        case .arm(let kind, let milliseconds):
            timers.arm(kind, milliseconds: milliseconds) {
                LoopTimer(loop: context.loop) { [unowned self] in handle(.timerFired(kind, lastActivity: lastActivity))
                }
            }
        case .disarm(let kind):
            timers.disarm(kind)
        case .requestFinished(let outcome):
            context.owner.count(outcome)
        case .auditRefusal(let use):
            context.audit(use, connection: id, client: peer)
        case .log(let line):
            log(line)
        case .openTunnel(let stream, let head):
            guard
                let end = TunnelEnd.open(
                    driver: self, stream: stream, head: head, context: context, origin: machine.origin)
            else { return queue.events.append(.tunnelEnded(stream)) }
            let io = streamIO(stream)
            io.tunnel = end
            io.inExchange = true
        case .consumeTunnel(let stream, let count):
            guard let end = streams[stream]?.tunnel else { return }
            evbuffer_drain(end.input, count)
        case .tunnelToStream(let stream, let count):
            guard let io = streams[stream], let end = io.tunnel else { return }
            _ = evbuffer_remove_buffer(end.input, io.pending, count)
            // The client's stream window is full: stop reading the tunnel until it drained.
            if io.pendingCount >= context.highWater { end.setReading(false) }
            resumeData(io)
        case .endTunnelInput(let stream):
            streams[stream]?.tunnel?.endInput()
        case .closeTunnel(let stream):
            guard let io = streams[stream], let end = io.tunnel else { return }
            io.tunnel = nil
            io.inExchange = false
            end.close()
            if io.closed { streams.removeValue(forKey: stream) }
        }
    }

    /// Bytes from a WebSocket stream's HTTP/1.1 side.
    func tunnelReadable(_ end: TunnelEnd) {
        guard !phase.isClosed, let io = streams[end.stream], io.tunnel === end else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        queue.actions.emptyKeepingStorage()
        machine.tunnelData(end.stream, EvbufferView(end.input), now: lastActivity, &queue.actions)
        queue.handling = true
        run(queue.actions)
        queue.handling = false
        processQueued()
    }

    /// The HTTP/1.1 side took what the client sent: the client may send more.
    func tunnelWritable(_ end: TunnelEnd) {
        guard !phase.isClosed, let io = streams[end.stream], io.tunnel === end, io.unacknowledged > 0 else { return }
        frames?.consume(io.id, io.unacknowledged)
        io.unacknowledged = 0
        flush()
    }

    func tunnelEvent(_ end: TunnelEnd, _ events: Int16) {
        guard !phase.isClosed, let io = streams[end.stream], io.tunnel === end else { return }
        // What came before the end goes first.
        tunnelReadable(end)
        guard streams[end.stream]?.tunnel === end else { return }
        handle(.tunnelEnded(io.id))
    }

    private func log(_ line: LogLine) { context.logger.connection(id, peer: peer, line) }

    private func streamIO(_ stream: Int32) -> H2StreamIO {
        if let io = streams[stream] { return io }
        let made = H2StreamIO(id: stream)
        streams[stream] = made
        return made
    }

    private func resumeData(_ io: H2StreamIO) {
        if io.deferred {
            io.deferred = false
            frames?.resumeData(io.id)
        }
    }

    /// nghttp2's data source callback: the stream's pending response bytes, as many as the window allows.
    func responseBody(
        _ stream: Int32, _ buffer: UnsafeMutablePointer<UInt8>, _ length: Int, _ flags: UnsafeMutablePointer<UInt32>
    ) -> Int {
        guard let io = streams[stream] else { return Int(NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE.rawValue) }
        let count = min(length, io.pendingCount)
        if count > 0 {
            evbuffer_remove(io.pending, buffer, count)
            lastActivity = EventLoop.monotonicMilliseconds()
            if io.pendingCount < context.highWater / 2 {
                // The client caught up: let the tunnel or the transfer go on.
                io.tunnel?.setReading(true)
                io.exchange?.resumeResponse()
            }
        }
        if io.pendingCount == 0 {
            if io.responseEnded {
                flags.pointee |= NGHTTP2_DATA_FLAG_EOF.rawValue
                if !io.trailers.isEmpty {
                    flags.pointee |= NGHTTP2_DATA_FLAG_NO_END_STREAM.rawValue
                    frames?.submitTrailer(stream, io.trailers)
                    io.trailers = []
                }
            } else if count == 0 {
                io.deferred = true
                return Int(NGHTTP2_ERR_DEFERRED.rawValue)
            }
        }
        return count
    }

    // MARK: - nghttp2's callbacks (inside `H2ServerSession.receive`)

    func beginHeaders(_ stream: Int32) {
        let io = streamIO(stream)
        io.fields.removeAll()
        io.fieldBytes = 0
        io.overLimit = nil
    }

    /// One header field. A request's fields beyond the limits (an HPACK bomb, say) are decoded on but not
    /// kept, and the machine hears of the list as too large; trailers beyond them reset the stream (false).
    func header(_ stream: Int32, name: UnsafeRawBufferPointer, value: UnsafeRawBufferPointer, trailers: Bool) -> Bool {
        let io = streamIO(stream)
        guard io.overLimit == nil else { return true }
        io.fieldBytes += name.count + value.count + 32
        let limits = context.settings.headLimits
        if io.fieldBytes > limits.maxHeadBytes {
            io.overLimit = "header list larger than \(limits.maxHeadBytes) bytes"
        } else if io.fields.count >= limits.maxFields {
            io.overLimit = "more than \(limits.maxFields) header fields"
        } else {
            io.fields.append(H2Field(Array(name), Array(value)))
            return true
        }
        guard trailers else { return true }
        context.logger.info("conn=\(id) client=\(peer) h2 stream \(stream) reset: trailers \(io.overLimit ?? "")")
        return false
    }

    func frameReceived(_ frame: UnsafePointer<nghttp2_frame>) {
        let header = frame.pointee.hd
        let endStream = header.flags & UInt8(NGHTTP2_FLAG_END_STREAM.rawValue) != 0
        switch Int(header.type) {
        case Int(NGHTTP2_HEADERS.rawValue):
            guard let io = streams[header.stream_id] else { return }
            let fields = io.fields
            io.fields = []
            if frame.pointee.headers.cat == NGHTTP2_HCAT_REQUEST {
                io.exchange = ExchangeIO(
                    driver: self, context: context, origin: machine.origin, connectionID: id, tag: header.stream_id,
                    replay: replay)
                if let reason = io.overLimit {
                    queue.events.append(.requestHeadTooLarge(header.stream_id, fields, reason: reason))
                } else {
                    queue.events.append(.requestHeaders(header.stream_id, fields, endStream: endStream))
                }
            } else {
                queue.events.append(.requestTrailers(header.stream_id, fields))
            }
        case Int(NGHTTP2_DATA.rawValue):
            if endStream { queue.events.append(.requestData(header.stream_id, count: 0, endStream: true)) }
        default:
            break
        }
    }

    /// Request body bytes: kept in the stream's store now (they are only valid during the callback).
    func dataChunk(_ stream: Int32, _ data: UnsafeRawBufferPointer) {
        if let io = streams[stream], let end = io.tunnel {
            // A WebSocket stream's bytes go to its HTTP/1.1 side; acknowledged once that side took them.
            evbuffer_add(end.output, data.baseAddress, data.count)
            if Buffers.length(end.output) < context.highWater {
                frames?.consume(stream, data.count)
            } else {
                io.unacknowledged += data.count
            }
            return
        }
        guard let io = streams[stream], let exchange = io.exchange, !io.bodyUnwanted else {
            frames?.consume(stream, data.count)
            return
        }
        // Kept (or, once streaming, queued for the transfer); a spool that cannot be written is the exchange's
        // event at the top of the loop. A paused transfer goes on.
        exchange.keep(data)
        if exchange.body.streaming {
            // Streaming on unkept: acknowledged when the transfer takes it.
            io.unacknowledged += data.count
        } else {
            frames?.consume(stream, data.count)
        }
        queue.events.append(.requestData(stream, count: data.count, endStream: false))
    }

    /// nghttp2 closed the stream: its I/O state goes once no exchange needs it (the machine decides whether
    /// the exchange ends with it).
    func streamClosed(_ stream: Int32, errorCode: UInt32) {
        guard let io = streams[stream] else { return }
        io.closed = true
        if io.inExchange {
            queue.events.append(.streamClosed(stream, errorCode: errorCode))
        } else {
            streams.removeValue(forKey: stream)
        }
    }

    // MARK: - Exchanges

    private func exchangeFinished(_ stream: Int32, _ record: ExchangeRecord) {
        guard let io = streams[stream], let exchange = io.exchange else {
            ExchangeIO.report(
                record, up: 0, down: 0, milliseconds: 0, context: context, connectionID: id, peer: peer)
            return
        }
        exchange.finish(record, peer: peer) { line in
            line.append(" h2=")
            line.append(stream)
        }
        io.exchange = nil
        io.inExchange = false
        // The response bytes still pending stay until nghttp2 has sent them and closed the stream.
        if io.closed { streams.removeValue(forKey: stream) }
    }

    // MARK: - ExchangeDriver (at the top of the loop; only a stream's current exchange)

    private func current(_ exchange: ExchangeIO) -> H2StreamIO? {
        guard !phase.isClosed, let io = streams[exchange.tag], io.exchange === exchange else { return nil }
        return io
    }

    func exchange(_ exchange: ExchangeIO, event: ExchangeIO.Event) {
        guard let io = current(exchange) else { return }
        let stream = io.id
        lastActivity = EventLoop.monotonicMilliseconds()
        switch event {
        case .tokens(let grant): handle(.tokens(stream, grant))
        case .refreshed(let grant): handle(.refreshed(stream, grant))
        case .credentialFailed(let answer): handle(.credentialFailed(stream, answer))
        case .resourceMetadata(let verdict): handle(.resourceMetadata(stream, verdict))
        case .bodyNotKept(let directory): handle(.bodyNotKept(stream, directory: directory))
        case .bodyBeyondBudget: handle(.bodyBeyondBudget(stream))
        case .transferFinished(let failure, let detail): handle(.transferFinished(stream, failure, detail: detail))
        case .responseHead(let received):
            transferEvent { machine, now, out in machine.transferResponseHead(stream, received, now: now, &out) }
        case .responseTrailers(let fields):
            transferEvent { machine, now, out in machine.transferTrailers(stream, fields, now: now, &out) }
        }
    }

    /// One event of a stream's transfer into the session, then its actions.
    private func transferEvent(_ event: (inout H2Session, Int64, inout [H2Session.Action]) -> Void) {
        queue.actions.emptyKeepingStorage()
        event(&machine, lastActivity, &queue.actions)
        queue.handling = true
        run(queue.actions)
        queue.handling = false
        processQueued()
    }

    func exchange(_ exchange: ExchangeIO, responseBody data: UnsafeRawBufferPointer) -> Bool {
        guard let io = current(exchange) else { return true }
        lastActivity = EventLoop.monotonicMilliseconds()
        // The client's stream window is full: the transfer pauses until the data source drained it.
        if io.pendingCount >= context.highWater { return false }
        transferData = data
        handle(.transferBody(io.id, count: data.count))
        transferData = nil
        return true
    }

    func exchange(_ exchange: ExchangeIO, bodyTaken count: Int) {
        guard let io = current(exchange), count > 0 else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        guard io.unacknowledged > 0 else { return }
        // Streamed bytes the transfer took: the client may send more.
        let acknowledged = min(io.unacknowledged, count)
        io.unacknowledged -= acknowledged
        frames?.consume(io.id, acknowledged)
        flush()
    }

    // MARK: - Ending

    func shutdown() { handle(.shutdown) }

    /// A reload: clients are told (GOAWAY) to open new connections, which get the new settings.
    func reload() { handle(.shutdown) }

    func abort(_ reason: String?) {
        handle(.clientGone)
        close()
    }

    func close() {
        guard !phase.isClosed else { return }
        // Ended by the proxy (a protocol error, a flood, GOAWAY): the exchanges in flight end as aborted.
        if !machine.isIdle { handle(.clientGone) }
        guard !phase.isClosed else { return }
        phase = .closed
        for io in streams.values {
            io.exchange?.cancel()
            io.tunnel?.close()
            io.tunnel = nil
        }
        streams.removeAll()
        timers.removeAll()
        if let client {
            bufferevent_free(client)
            self.client = nil
        }
        context.logger.debug(
            "conn=\(id) client=\(peer) h2 \(machine.origin.authority): \(machine.requests) stream(s) in \(LogText.duration(EventLoop.monotonicMilliseconds() - identity.started))"
        )
        context.owner.connectionClosed(self)
    }
}

// MARK: - C callbacks (user data: the H2Driver, unretained; the server's table owns it)

private func driver(_ pointer: UnsafeMutableRawPointer?) -> H2Driver {
    Unmanaged<H2Driver>.fromOpaque(pointer!).takeUnretainedValue()
}

private let h2ReadCallback: bufferevent_data_cb = { _, context in driver(context).readable() }
private let h2WriteCallback: bufferevent_data_cb = { _, context in driver(context).writable() }
private let h2EventCallback: bufferevent_event_cb = { _, events, context in driver(context).event(events) }
