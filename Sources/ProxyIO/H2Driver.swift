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
    let id: UInt64
    let peer: String
    let clientAddress: String
    private var machine: H2Session
    private var client: OpaquePointer?
    private var session: OpaquePointer?
    private var streams = StreamTable()
    private var timers: [ConnectionTimer: LoopTimer] = [:]
    private var lastActivity: Int64
    private let started: Int64
    private var closed = false
    private var closingAfterFlush = false
    /// The last frame went out and the sending side is shut: input is read and dropped until the client closes
    /// (or `lingerTimer` fires). See `LingeringClose`.
    private var lingering = false
    private var lingerTimer: LoopTimer?
    /// Bounds the wait for a client that stops reading while the last responses are still going out.
    private var flushDeadline: LoopTimer?
    /// Events raised inside nghttp2's callbacks (or while actions run) wait until the current call returned.
    private var queued: [H2Session.Event] = []
    /// What this connection's request bodies keep for replays, of the process's budget.
    private lazy var replay = ReplayAccount(context.replayBudget)
    private var handling = false
    private var actions: [H2Session.Action] = []
    private var afterHandling: [() -> Void] = []
    /// Runs `flush` at the end of the loop's pass (`flushSoon`).
    private lazy var flushTask = LoopTimer(loop: context.loop) { [unowned self] in flush() }

    /// The per-stream state the I/O needs: the body store, the transfer, the response bytes waiting for the
    /// client's flow-control window.
    final class StreamIO {
        let id: Int32
        var fields: [H2Field] = []
        var fieldBytes = 0
        /// Why the header block being received is over the limits (its further fields are not kept).
        var overLimit: String?
        /// The stream's exchange with the origin (its body, tokens and transfer): from its request head on.
        var exchange: ExchangeIO?
        /// Bytes of the request body received but not yet acknowledged to the client (flow control).
        var unacknowledged = 0
        /// Response bytes waiting for the client's window: a chain of blocks, so what the client took is freed
        /// as it goes (an array with a start offset grew by every byte taken while bytes were left in it).
        let pending = evbuffer_new()!
        var responseEnded = false
        var trailers: [H2Field] = []
        /// The data provider returned NGHTTP2_ERR_DEFERRED: resume it when bytes come.
        var deferred = false
        /// nghttp2 closed the stream.
        var closed = false
        /// An exchange runs for the stream (from its first action to `exchangeFinished`).
        var inExchange = false
        /// A WebSocket stream: our end of the pair whose other end an HTTP/1.1 `ClientDriver` reads.
        var tunnel: TunnelEnd?
        /// The machine wants no more of the request body (`dropRequestBody`).
        var bodyUnwanted = false

        init(id: Int32) { self.id = id }

        deinit { evbuffer_free(pending) }

        var pendingCount: Int { evbuffer_get_length(pending) }
    }

    init(
        context: ConnectionContext, id: UInt64, peer: String, client clientAddress: String, origin: OriginConfig,
        bufferevent: OpaquePointer, misdirected: String?
    ) {
        self.context = context
        self.id = id
        self.peer = peer
        self.clientAddress = clientAddress
        self.started = EventLoop.monotonicMilliseconds()
        self.lastActivity = started
        self.client = bufferevent
        machine = H2Session(
            origin: origin, frontDoor: context.frontDoor, misdirected: misdirected,
            keySeed: UInt64.random(in: 1...UInt64.max))
        setUpSession()
    }

    /// Starts serving, once the server's table holds this connection.
    func begin() {
        guard let client else { return }
        bufferevent_setcb(client, h2ReadCallback, h2WriteCallback, h2EventCallback, contextPointer)
        bufferevent_enable(client, Int16(EV_READ | EV_WRITE))
        actions.removeAll(keepingCapacity: true)
        machine.start(now: started, &actions)
        run(actions)
        // The client's connection preface may have come with the handshake.
        readable()
    }

    deinit {
        if let session { nghttp2_session_del(session) }
    }

    private var contextPointer: UnsafeMutableRawPointer { Unmanaged.passUnretained(self).toOpaque() }

    /// The server side of nghttp2, with the limits of the known HTTP/2 denial-of-service shapes set.
    private func setUpSession() {
        var callbacks: OpaquePointer?
        nghttp2_session_callbacks_new(&callbacks)
        defer { nghttp2_session_callbacks_del(callbacks) }
        nghttp2_session_callbacks_set_on_begin_headers_callback(callbacks, h2BeginHeaders)
        nghttp2_session_callbacks_set_on_header_callback(callbacks, h2Header)
        nghttp2_session_callbacks_set_on_frame_recv_callback(callbacks, h2FrameReceived)
        nghttp2_session_callbacks_set_on_data_chunk_recv_callback(callbacks, h2DataChunk)
        nghttp2_session_callbacks_set_on_stream_close_callback(callbacks, h2StreamClosed)
        var option: OpaquePointer?
        nghttp2_option_new(&option)
        defer { nghttp2_option_del(option) }
        // Window updates are sent once a body's bytes are kept or taken by the transfer (end-to-end flow
        // control), not when they arrive.
        nghttp2_option_set_no_auto_window_update(option, 1)
        // Rapid reset (CVE-2023-44487): a token bucket of RST_STREAMs, then GOAWAY.
        nghttp2_option_set_stream_reset_rate_limit(option, H2Limits.resetBurst, H2Limits.resetRate)
        // CONTINUATION flood (CVE-2024-27316 and kin): at most this many CONTINUATION frames per header block.
        nghttp2_option_set_max_continuations(option, H2Limits.maxContinuations)
        // PING and SETTINGS floods: ACKs queued but unwritten (a client that does not read) end the session.
        nghttp2_option_set_max_outbound_ack(option, H2Limits.maxOutboundAcks)
        nghttp2_option_set_max_settings(option, H2Limits.maxSettings)
        nghttp2_session_server_new2(&session, callbacks, contextPointer, option)
        let settings = context.settings
        var entries = [
            nghttp2_settings_entry(
                settings_id: Int32(NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS.rawValue),
                value: UInt32(H2Limits.maxConcurrentStreams)),
            nghttp2_settings_entry(
                settings_id: Int32(NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE.rawValue),
                value: UInt32(settings.headLimits.maxHeadBytes)),
            nghttp2_settings_entry(
                settings_id: Int32(NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE.rawValue), value: UInt32(H2Limits.streamWindow)),
            // RFC 8441: WebSocket over HTTP/2 (extended CONNECT with :protocol).
            nghttp2_settings_entry(settings_id: Int32(NGHTTP2_SETTINGS_ENABLE_CONNECT_PROTOCOL.rawValue), value: 1),
        ]
        nghttp2_submit_settings(session, UInt8(NGHTTP2_FLAG_NONE.rawValue), &entries, entries.count)
        // The connection's own window: room for several streams' bodies in flight.
        nghttp2_session_set_local_window_size(session, UInt8(NGHTTP2_FLAG_NONE.rawValue), 0, H2Limits.connectionWindow)
    }

    var isIdle: Bool { machine.isIdle }

    // MARK: - Bytes from the client

    fileprivate func readable() {
        guard !closed, let client else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        let input = bufferevent_get_input(client)
        if lingering {
            evbuffer_drain(input, Buffers.length(input))
            return
        }
        while Buffers.length(input) > 0 && !closed {
            var consumed = 0
            Buffers.forEachSegment(input) { segment in
                guard !closed, let taken = receive(segment) else { return false }
                consumed += taken
                return true
            }
            // Closed (a connection error, or an event of the frames): the bufferevent went with `input`.
            if closed { return }
            evbuffer_drain(input, consumed)
            if consumed == 0 { break }
        }
        if Buffers.length(input) == 0 { readRecordsLeft() }
        processQueued()
    }

    /// Gives the client's bytes to nghttp2: how many it took, or nil when they broke the connection (logged,
    /// what is due flushed, closed).
    private func receive(_ bytes: UnsafeRawBufferPointer) -> Int? {
        let result = nghttp2_session_mem_recv(
            session, bytes.baseAddress?.assumingMemoryBound(to: UInt8.self), bytes.count)
        guard result < 0 else { return result }
        let reason = String(cString: nghttp2_strerror(Int32(result)))
        context.logger.info("conn=\(id) client=\(peer) h2 connection error: \(reason)")
        flush()
        close()
        return nil
    }

    /// Reads the TLS records still waiting in the socket and gives them to nghttp2 now. libevent's OpenSSL
    /// bufferevent reads one record per pass of the loop; a client's HTTP/2 frames come in many small records
    /// (a request's HEADERS is one), so one record per pass was one `epoll_wait` and one pass per stream. Read
    /// here, after what the bufferevent read, until OpenSSL wants more from the socket or `recordsPerPass` were
    /// read (the rest is the next pass's, so that one client cannot hold the loop): without read-ahead OpenSSL
    /// holds nothing beyond the record it is reading, so no bytes wait where only a readiness event would
    /// bring them back, and the socket, not yet empty, is still readable.
    private func readRecordsLeft() {
        guard let client, let ssl = bufferevent_openssl_get_ssl(client) else { return }
        withUnsafeTemporaryAllocation(of: UInt8.self, capacity: Self.recordSize) { buffer in
            for _ in 0..<Self.recordsPerPass {
                guard !closed else { return }
                CryptoError.clearQueue()
                let count = SSL_read(ssl, buffer.baseAddress, Int32(buffer.count))
                if count <= 0 {
                    let error = SSL_get_error(ssl, count)
                    CryptoError.clearQueue()
                    // WANT_READ: the socket is empty (a partial record stays with OpenSSL, and the bufferevent
                    // reads the rest when it comes). Anything else (the client's close_notify, a reset, a bad
                    // record) ends the connection as the bufferevent's own read would have.
                    if error != SSL_ERROR_WANT_READ && error != SSL_ERROR_WANT_WRITE {
                        event(Int16(BEV_EVENT_READING | BEV_EVENT_EOF))
                    }
                    return
                }
                guard receive(UnsafeRawBufferPointer(start: buffer.baseAddress, count: Int(count))) != nil else {
                    return
                }
            }
        }
    }

    /// The largest TLS record's plaintext.
    private static let recordSize = 16 * 1024
    private static let recordsPerPass = 64

    fileprivate func writable() {
        guard !closed else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        flush()
        if !closed && closingAfterFlush && Buffers.length(clientOutput) == 0 && everythingSent { finishAfterFlush() }
    }

    /// nghttp2 has nothing more to write and every stream is closed there (its last frame was handed over):
    /// the machine's exchanges can end before the client has their responses (flow control holds them back,
    /// and only the client's WINDOW_UPDATEs let them go), so "after flush" waits for these too.
    private var everythingSent: Bool {
        guard let session else { return true }
        return nghttp2_session_want_write(session) == 0 && streams.values.allSatisfy(\.closed)
    }

    fileprivate func event(_ events: Int16) {
        // While lingering, the client's end (or a reset) is what was waited for.
        if !lingering { handle(.clientGone) }
        close()
    }

    /// Everything went out: shut the sending side and linger, or close when there is no socket to shut.
    private func finishAfterFlush() {
        guard !closed, !lingering else { return }
        guard let client, LingeringClose.shutWrite(client) else { return close() }
        lingering = true
        flushDeadline = nil
        for timer in timers.values { timer.cancel() }
        bufferevent_enable(client, Int16(EV_READ))
        let timer = LoopTimer(loop: context.loop) { [unowned self] in close() }
        timer.schedule(milliseconds: LingeringClose.milliseconds)
        lingerTimer = timer
    }

    private var clientOutput: OpaquePointer? { client.map { bufferevent_get_output($0) } }

    /// Writes what nghttp2 has to send, while the socket's buffer has room.
    private func flush() {
        guard !closed, !lingering, let session, let output = clientOutput else { return }
        while Buffers.length(output) < context.highWater {
            var data: UnsafePointer<UInt8>?
            let length = nghttp2_session_mem_send(session, &data)
            if length < 0 {
                context.logger.info(
                    "conn=\(id) client=\(peer) h2 send error: \(String(cString: nghttp2_strerror(Int32(length))))")
                return close()
            }
            if length == 0 { break }
            evbuffer_add(output, data, length)
        }
        if nghttp2_session_want_read(session) == 0 && nghttp2_session_want_write(session) == 0 {
            closingAfterFlush = true
            if Buffers.length(output) == 0 { return finishAfterFlush() }
        }
        if closingAfterFlush && Buffers.length(output) == 0 && everythingSent { return finishAfterFlush() }
        // The data source may have made room for a paused transfer: resume it now that nghttp2 returned.
        if !handling && !afterHandling.isEmpty { processQueued() }
    }

    // MARK: - Events into the machine

    private func handle(_ event: H2Session.Event) {
        if closed { return }
        queued.append(event)
        if !handling { processQueued() }
    }

    private func processQueued() {
        guard !handling else { return }
        handling = true
        while !queued.isEmpty && !closed {
            let event = queued.removeFirst()
            // A request whose stream nghttp2 closed in the same read (HEADERS then RST_STREAM) was withdrawn
            // before the machine saw it: nothing will ever end it there, so it never begins.
            switch event {
            case .requestHeaders(let stream, _, _), .requestHeadTooLarge(let stream, _, _):
                if streams[stream] == nil { continue }
            default:
                break
            }
            actions.removeAll(keepingCapacity: true)
            machine.handle(event, now: EventLoop.monotonicMilliseconds(), &actions)
            run(actions)
        }
        handling = false
        let work = afterHandling
        afterHandling.removeAll()
        for job in work where !closed { job() }
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
            if closed {
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
            submit(stream, fields, provider: !endStream)
        case .respond(let stream, let fields, let body):
            let io = streamIO(stream)
            evbuffer_drain(io.pending, io.pendingCount)
            body.withUnsafeBytes { _ = evbuffer_add(io.pending, $0.baseAddress, $0.count) }
            io.responseEnded = true
            submit(stream, fields, provider: !body.isEmpty)
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
            nghttp2_submit_rst_stream(session, UInt8(NGHTTP2_FLAG_NONE.rawValue), stream, code.rawValue)
        case .dropRequestBody(let stream):
            guard let io = streams[stream] else { return }
            io.bodyUnwanted = true
            if io.unacknowledged > 0 {
                // Streamed bytes the transfer never took: the connection's window gets them back.
                nghttp2_session_consume(session, stream, io.unacknowledged)
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
            let last = nghttp2_session_get_last_proc_stream_id(session)
            nghttp2_submit_goaway(session, UInt8(NGHTTP2_FLAG_NONE.rawValue), last, code.rawValue, nil, 0)
        case .closeAfterFlush:
            // The client is still read: its WINDOW_UPDATEs let the last responses out (nghttp2 refuses new
            // streams after the GOAWAY that came first).
            guard !closingAfterFlush else { return }
            closingAfterFlush = true
            let deadline = LoopTimer(loop: context.loop) { [unowned self] in close() }
            deadline.schedule(milliseconds: context.settings.idleTimeout)
            flushDeadline = deadline
        case .arm(let timer, let milliseconds):
            self.timer(timer).schedule(milliseconds: milliseconds)
        case .disarm(let timer):
            timers[timer]?.cancel()
        case .requestFinished(let outcome):
            context.owner.count(outcome)
        case .auditRefusal(let use):
            context.audit(use, connection: id, client: peer)
        case .log(let line):
            log(line)
        case .openTunnel(let stream, let head):
            openTunnel(stream, head: head)
        case .consumeTunnel(let stream, let count):
            guard let end = streams[stream]?.tunnel else { return }
            evbuffer_drain(bufferevent_get_input(end.bev), count)
        case .tunnelToStream(let stream, let count):
            guard let io = streams[stream], let end = io.tunnel else { return }
            _ = evbuffer_remove_buffer(bufferevent_get_input(end.bev), io.pending, count)
            if io.pendingCount >= context.highWater {
                // The client's stream window is full: stop reading the tunnel until it drained.
                bufferevent_disable(end.bev, Int16(EV_READ))
            }
            resumeData(io)
        case .endTunnelInput(let stream):
            guard let end = streams[stream]?.tunnel else { return }
            bufferevent_flush(end.bev, Int16(EV_WRITE), BEV_FINISHED)
        case .closeTunnel(let stream):
            guard let io = streams[stream], let end = io.tunnel else { return }
            io.tunnel = nil
            io.inExchange = false
            end.close()
            if io.closed { streams.removeValue(forKey: stream) }
        }
    }

    /// A WebSocket stream's HTTP/1.1 side: a `ClientDriver` on one end of a buffer pair, fed the upgrade request
    /// `H2Session` made, running it as it runs any upgrade (tokens, the origin's TLS, refresh and replay).
    private func openTunnel(_ stream: Int32, head: [UInt8]) {
        var pair: [OpaquePointer?] = [nil, nil]
        let options = Int32(BEV_OPT_CLOSE_ON_FREE.rawValue | BEV_OPT_DEFER_CALLBACKS.rawValue)
        guard bufferevent_pair_new(context.loop.base, options, &pair) == 0, let inner = pair[0], let outer = pair[1]
        else {
            queued.append(.tunnelEnded(stream))
            return
        }
        let io = streamIO(stream)
        let end = TunnelEnd(driver: self, stream: stream, bev: outer)
        io.tunnel = end
        io.inExchange = true
        let driver = ClientDriver(
            context: context, id: id, peer: peer, client: clientAddress, origin: machine.origin, pair: inner)
        context.owner.adopt(driver)
        driver.begin()
        bufferevent_setwatermark(outer, Int16(EV_WRITE), context.highWater / 2, 0)
        bufferevent_setcb(outer, tunnelReadCallback, tunnelWriteCallback, tunnelEventCallback, end.pointer)
        bufferevent_enable(outer, Int16(EV_READ | EV_WRITE))
        Buffers.append(head, to: bufferevent_get_output(outer))
    }

    /// Bytes from a WebSocket stream's HTTP/1.1 side.
    fileprivate func tunnelReadable(_ end: TunnelEnd) {
        guard !closed, let io = streams[end.stream], io.tunnel === end else { return }
        lastActivity = EventLoop.monotonicMilliseconds()
        actions.removeAll(keepingCapacity: true)
        machine.tunnelData(end.stream, EvbufferView(bufferevent_get_input(end.bev)), now: lastActivity, &actions)
        handling = true
        run(actions)
        handling = false
        processQueued()
    }

    /// The HTTP/1.1 side took what the client sent: the client may send more.
    fileprivate func tunnelWritable(_ end: TunnelEnd) {
        guard !closed, let io = streams[end.stream], io.tunnel === end, io.unacknowledged > 0 else { return }
        nghttp2_session_consume(session, io.id, io.unacknowledged)
        io.unacknowledged = 0
        flush()
    }

    fileprivate func tunnelEvent(_ end: TunnelEnd, _ events: Int16) {
        guard !closed, let io = streams[end.stream], io.tunnel === end else { return }
        // What came before the end goes first.
        tunnelReadable(end)
        guard streams[end.stream]?.tunnel === end else { return }
        handle(.tunnelEnded(io.id))
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

    private func streamIO(_ stream: Int32) -> StreamIO {
        if let io = streams[stream] { return io }
        let made = StreamIO(id: stream)
        streams[stream] = made
        return made
    }

    /// Submits a response head; with `provider`, the body comes from the stream's pending bytes.
    private func submit(_ stream: Int32, _ fields: [H2Field], provider: Bool) {
        withHeaderList(fields) { list, count in
            if provider {
                var data = nghttp2_data_provider(
                    source: nghttp2_data_source(ptr: nil), read_callback: h2ReadResponseBody)
                nghttp2_submit_response(session, stream, list, count, &data)
            } else {
                nghttp2_submit_response(session, stream, list, count, nil)
            }
        }
    }

    private func resumeData(_ io: StreamIO) {
        if io.deferred {
            io.deferred = false
            nghttp2_session_resume_data(session, io.id)
        }
    }

    /// nghttp2's data source callback: the stream's pending response bytes, as many as the window allows.
    fileprivate func responseBody(
        _ stream: Int32, _ buffer: UnsafeMutablePointer<UInt8>, _ length: Int, _ flags: UnsafeMutablePointer<UInt32>
    ) -> Int {
        guard let io = streams[stream] else { return Int(NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE.rawValue) }
        let count = min(length, io.pendingCount)
        if count > 0 {
            evbuffer_remove(io.pending, buffer, count)
            lastActivity = EventLoop.monotonicMilliseconds()
            if io.pendingCount < context.highWater / 2, let end = io.tunnel {
                bufferevent_enable(end.bev, Int16(EV_READ))
            }
            // The client caught up: let the transfer go on.
            if io.pendingCount < context.highWater / 2 { io.exchange?.resumeResponse() }
        }
        if io.pendingCount == 0 {
            if io.responseEnded {
                flags.pointee |= NGHTTP2_DATA_FLAG_EOF.rawValue
                if !io.trailers.isEmpty {
                    flags.pointee |= NGHTTP2_DATA_FLAG_NO_END_STREAM.rawValue
                    withHeaderList(io.trailers) { list, count in
                        nghttp2_submit_trailer(session, stream, list, count)
                    }
                    io.trailers = []
                }
            } else if count == 0 {
                io.deferred = true
                return Int(NGHTTP2_ERR_DEFERRED.rawValue)
            }
        }
        return count
    }

    /// Calls `body` with an nghttp2 header list for `fields`, its names and values in one buffer that lives
    /// for the call (nghttp2 copies them).
    private func withHeaderList(_ fields: [H2Field], _ body: (UnsafePointer<nghttp2_nv>, Int) -> Void) {
        let total = fields.reduce(0) { $0 + $1.name.count + $1.value.count }
        withUnsafeTemporaryAllocation(of: UInt8.self, capacity: max(1, total)) { bytes in
            withUnsafeTemporaryAllocation(of: nghttp2_nv.self, capacity: max(1, fields.count)) { list in
                var offset = 0
                for (index, field) in fields.enumerated() {
                    let name = bytes.baseAddress! + offset
                    _ = UnsafeMutableBufferPointer(start: name, count: field.name.count).initialize(from: field.name)
                    offset += field.name.count
                    let value = bytes.baseAddress! + offset
                    _ = UnsafeMutableBufferPointer(start: value, count: field.value.count).initialize(from: field.value)
                    offset += field.value.count
                    list[index] = nghttp2_nv(
                        name: name, value: value, namelen: field.name.count, valuelen: field.value.count,
                        flags: UInt8(NGHTTP2_NV_FLAG_NONE.rawValue))
                }
                body(UnsafePointer(list.baseAddress!), fields.count)
            }
        }
    }

    // MARK: - nghttp2's callbacks (inside nghttp2_session_mem_recv)

    fileprivate func beginHeaders(_ stream: Int32) {
        let io = streamIO(stream)
        io.fields.removeAll()
        io.fieldBytes = 0
        io.overLimit = nil
    }

    /// One header field. A request's fields beyond the limits (an HPACK bomb, say) are decoded on but not
    /// kept, and the machine hears of the list as too large; trailers beyond them reset the stream (false).
    fileprivate func header(
        _ stream: Int32, name: UnsafeRawBufferPointer, value: UnsafeRawBufferPointer, trailers: Bool
    ) -> Bool {
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

    fileprivate func frameReceived(_ frame: UnsafePointer<nghttp2_frame>) {
        let header = frame.pointee.hd
        let endStream = header.flags & UInt8(NGHTTP2_FLAG_END_STREAM.rawValue) != 0
        switch Int(header.type) {
        case Int(NGHTTP2_HEADERS.rawValue):
            guard let io = streams[header.stream_id] else { return }
            let fields = io.fields
            io.fields = []
            if frame.pointee.headers.cat == NGHTTP2_HCAT_REQUEST {
                io.exchange = ExchangeIO(
                    driver: self, context: context, origin: machine.origin, connectionID: id,
                    generation: UInt64(header.stream_id), tag: header.stream_id, replay: replay)
                if let reason = io.overLimit {
                    queued.append(.requestHeadTooLarge(header.stream_id, fields, reason: reason))
                } else {
                    queued.append(.requestHeaders(header.stream_id, fields, endStream: endStream))
                }
            } else {
                queued.append(.requestTrailers(header.stream_id, fields))
            }
        case Int(NGHTTP2_DATA.rawValue):
            if endStream { queued.append(.requestData(header.stream_id, count: 0, endStream: true)) }
        default:
            break
        }
    }

    /// Request body bytes: kept in the stream's store now (they are only valid during the callback).
    fileprivate func dataChunk(_ stream: Int32, _ data: UnsafeRawBufferPointer) {
        if let io = streams[stream], let end = io.tunnel {
            // A WebSocket stream's bytes go to its HTTP/1.1 side; acknowledged once that side took them.
            let output = bufferevent_get_output(end.bev)
            evbuffer_add(output, data.baseAddress, data.count)
            if Buffers.length(output) < context.highWater {
                nghttp2_session_consume(session, stream, data.count)
            } else {
                io.unacknowledged += data.count
            }
            return
        }
        guard let io = streams[stream], let exchange = io.exchange, !io.bodyUnwanted else {
            nghttp2_session_consume(session, stream, data.count)
            return
        }
        // Kept (or, once streaming, queued for the transfer); a spool that cannot be written is the exchange's
        // event at the top of the loop. A paused transfer goes on.
        exchange.keep(data)
        if exchange.body.streaming {
            // Streaming on unkept: acknowledged when the transfer takes it.
            io.unacknowledged += data.count
        } else {
            nghttp2_session_consume(session, stream, data.count)
        }
        queued.append(.requestData(stream, count: data.count, endStream: false))
    }

    /// nghttp2 closed the stream: its I/O state goes once no exchange needs it (the machine decides whether
    /// the exchange ends with it).
    fileprivate func streamClosed(_ stream: Int32, errorCode: UInt32) {
        guard let io = streams[stream] else { return }
        io.closed = true
        if io.inExchange {
            queued.append(.streamClosed(stream, errorCode: errorCode))
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

    /// The response bytes of the transfer's current callback (`.writeBody` takes them).
    private var transferData: UnsafeRawBufferPointer?

    private func current(_ exchange: ExchangeIO) -> StreamIO? {
        guard !closed, let io = streams[exchange.tag], io.exchange === exchange else { return nil }
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
        actions.removeAll(keepingCapacity: true)
        event(&machine, lastActivity, &actions)
        handling = true
        run(actions)
        handling = false
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
        nghttp2_session_consume(session, io.id, acknowledged)
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
        guard !closed else { return }
        // Ended by the proxy (a protocol error, a flood, GOAWAY): the exchanges in flight end as aborted.
        if !machine.isIdle { handle(.clientGone) }
        guard !closed else { return }
        closed = true
        for io in streams.values {
            io.exchange?.cancel()
            io.tunnel?.close()
            io.tunnel = nil
        }
        streams.removeAll()
        timers.removeAll()
        lingerTimer = nil
        flushDeadline = nil
        if let client {
            bufferevent_free(client)
            self.client = nil
        }
        context.logger.debug(
            "conn=\(id) client=\(peer) h2 \(machine.origin.authority): \(machine.requests) stream(s) in \(LogText.duration(EventLoop.monotonicMilliseconds() - started))"
        )
        context.owner.connectionClosed(self)
    }
}

/// Limits of the HTTP/2 connections the proxy serves (announced in SETTINGS, or nghttp2 options).
enum H2Limits {
    static let maxConcurrentStreams = 100
    /// Per stream: how much body a client may send before its bytes are kept or taken.
    static let streamWindow = 1 << 20
    static let connectionWindow: Int32 = 16 << 20
    static let resetBurst: UInt64 = 200
    static let resetRate: UInt64 = 50
    static let maxContinuations = 8
    static let maxOutboundAcks = 1000
    static let maxSettings = 32
}

// MARK: - C callbacks (user data: the H2Driver, unretained; the server's table owns it)

private func driver(_ pointer: UnsafeMutableRawPointer?) -> H2Driver {
    Unmanaged<H2Driver>.fromOpaque(pointer!).takeUnretainedValue()
}

private let h2ReadCallback: bufferevent_data_cb = { _, context in driver(context).readable() }
private let h2WriteCallback: bufferevent_data_cb = { _, context in driver(context).writable() }
private let h2EventCallback: bufferevent_event_cb = { _, events, context in driver(context).event(events) }

private let h2BeginHeaders:
    @convention(c) (OpaquePointer?, UnsafePointer<nghttp2_frame>?, UnsafeMutableRawPointer?) -> Int32 = {
        _, frame, user in
        if let frame, Int(frame.pointee.hd.type) == Int(NGHTTP2_HEADERS.rawValue) {
            driver(user).beginHeaders(frame.pointee.hd.stream_id)
        }
        return 0
    }

private let h2Header:
    @convention(c) (
        OpaquePointer?, UnsafePointer<nghttp2_frame>?, UnsafePointer<UInt8>?, Int, UnsafePointer<UInt8>?, Int, UInt8,
        UnsafeMutableRawPointer?
    ) -> Int32 = { _, frame, name, nameLength, value, valueLength, _, user in
        guard let frame else { return 0 }
        let accepted = driver(user).header(
            frame.pointee.hd.stream_id, name: UnsafeRawBufferPointer(start: name, count: nameLength),
            value: UnsafeRawBufferPointer(start: value, count: valueLength),
            trailers: frame.pointee.headers.cat != NGHTTP2_HCAT_REQUEST)
        return accepted ? 0 : NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE.rawValue
    }

private let h2FrameReceived:
    @convention(c) (OpaquePointer?, UnsafePointer<nghttp2_frame>?, UnsafeMutableRawPointer?) -> Int32 = {
        _, frame, user in
        if let frame { driver(user).frameReceived(frame) }
        return 0
    }

private let h2DataChunk:
    @convention(c) (OpaquePointer?, UInt8, Int32, UnsafePointer<UInt8>?, Int, UnsafeMutableRawPointer?) -> Int32 = {
        _, _, stream, data, length, user in
        driver(user).dataChunk(stream, UnsafeRawBufferPointer(start: data, count: length))
        return 0
    }

private let h2StreamClosed: @convention(c) (OpaquePointer?, Int32, UInt32, UnsafeMutableRawPointer?) -> Int32 = {
    _, stream, errorCode, user in
    driver(user).streamClosed(stream, errorCode: errorCode)
    return 0
}

private let h2ReadResponseBody:
    @convention(c) (
        OpaquePointer?, Int32, UnsafeMutablePointer<UInt8>?, Int, UnsafeMutablePointer<UInt32>?,
        UnsafeMutablePointer<nghttp2_data_source>?, UnsafeMutableRawPointer?
    ) -> Int = { _, stream, buffer, length, flags, _, user in
        driver(user).responseBody(stream, buffer!, length, flags!)
    }

/// Our end of a WebSocket stream's buffer pair (the context pointer of its callbacks).
final class TunnelEnd {
    unowned let driver: H2Driver
    let stream: Int32
    let bev: OpaquePointer
    private var closed = false

    init(driver: H2Driver, stream: Int32, bev: OpaquePointer) {
        self.driver = driver
        self.stream = stream
        self.bev = bev
    }

    var pointer: UnsafeMutableRawPointer { Unmanaged.passUnretained(self).toOpaque() }

    /// Ends the pair: the other side reads its end (EOF), then this end is freed.
    func close() {
        guard !closed else { return }
        closed = true
        bufferevent_setcb(bev, nil, nil, nil, nil)
        bufferevent_flush(bev, Int16(EV_WRITE), BEV_FINISHED)
        bufferevent_free(bev)
    }
}

private func tunnelEnd(_ pointer: UnsafeMutableRawPointer?) -> TunnelEnd {
    Unmanaged<TunnelEnd>.fromOpaque(pointer!).takeUnretainedValue()
}

private let tunnelReadCallback: bufferevent_data_cb = { _, context in
    let end = tunnelEnd(context)
    end.driver.tunnelReadable(end)
}
private let tunnelWriteCallback: bufferevent_data_cb = { _, context in
    let end = tunnelEnd(context)
    end.driver.tunnelWritable(end)
}
private let tunnelEventCallback: bufferevent_event_cb = { _, events, context in
    let end = tunnelEnd(context)
    end.driver.tunnelEvent(end, events)
}

/// An `H2Driver`'s streams by id, remembering the last one looked up: nghttp2's callbacks and the session's
/// actions come in runs for one stream (a callback per field of a header block, several actions per event),
/// and a dictionary lookup hashes the id (SipHash) every time: about 45 lookups per request, 5,000
/// instructions (`scripts/instructions --h2`).
struct StreamTable {
    private var table: [Int32: H2Driver.StreamIO] = [:]
    private var last: H2Driver.StreamIO?

    subscript(id: Int32) -> H2Driver.StreamIO? {
        mutating get {
            if let last, last.id == id { return last }
            let found = table[id]
            if found != nil { last = found }
            return found
        }
        set {
            table[id] = newValue
            last = newValue
        }
    }

    mutating func removeValue(forKey id: Int32) {
        table.removeValue(forKey: id)
        if last?.id == id { last = nil }
    }

    mutating func removeAll() {
        table.removeAll()
        last = nil
    }

    var values: Dictionary<Int32, H2Driver.StreamIO>.Values { table.values }
}
