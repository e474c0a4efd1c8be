import CCurl
import CLibevent
import CNghttp2
import ProxyCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// What an `OriginH2Session` tells the transfer of one of its streams. Every call comes at the top of the loop,
/// after nghttp2 returned (nothing is called from inside nghttp2 but the request body's reads).
protocol OriginStreamUser: AnyObject {
    /// A header block, the end, a reset or the loss of the connection (`OriginExchange`'s stream events).
    func streamEvent(_ event: OriginExchange.Event)
    /// Response body bytes of the stream (a copy: nghttp2's are valid only in its callback). The user calls
    /// `consume` once the owner took them, which opens the stream's window again.
    func streamData(_ bytes: [UInt8])
    /// Request body bytes for nghttp2 (its data source): a count, 0 at the end, or
    /// `proxyctl_readfunc_pause()` when the owner has none yet (`OriginH2Session.resumeBody` when it has).
    func streamReadBody(_ buffer: UnsafeMutableRawBufferPointer) -> Int
    /// The trailer fields to send after the request body (the client's own, or none).
    func streamTrailers() -> [H2Field]
}

/// One HTTP/2 connection to an origin (the origin chose `h2` by ALPN) on an `OriginConnection`, its streams
/// shared by the transfers of every client connection of a `ConnectionContext`: nghttp2 in client mode does the
/// frames, HPACK and flow control; each stream's events go to the `OriginTransfer` that opened it, whose
/// `OriginExchange` decides what they mean. Decides nothing itself.
///
/// Flow control is end to end: a stream's window opens as its owner takes the response bytes (`consume`), so a
/// slow client leaves at most a window of the response here; the connection's window is 16 streams' worth.
final class OriginH2Session: OriginConnectionUser {
    let key: OriginKey
    let connection: OriginConnection
    private let loop: EventLoop
    private var session: OpaquePointer?
    private var streams: [Int32: Stream] = [:]
    /// Events of streams read inside `nghttp2_session_mem_recv`, handed to their users once it returned.
    private var received: [(Int32, Received)] = []
    /// No new stream goes on this connection: the origin sent GOAWAY, or the connection ended.
    private(set) var goingAway = false
    private var closed = false
    /// Why nghttp2 ended the connection itself (a GOAWAY it sent for the origin's protocol error): the reason
    /// the streams fail with when the origin then closes, instead of the close alone.
    fileprivate var protocolError: String?
    /// The last stream id the origin's GOAWAY said it may process.
    private var goawayLastStream: Int32 = .max
    weak var pool: OriginPool?
    var idleTimer: LoopTimer?
    private lazy var flushTask = LoopTimer(loop: loop) { [unowned self] in
        withExtendedLifetime(self) { flush() }
    }
    private let limits: HTTPHeadLimits

    /// The state of one stream: its user, the header block being received.
    final class Stream {
        weak var user: (any OriginStreamUser)?
        var fields: [H2Field] = []
        var fieldBytes = 0
        var overLimit: String?
        /// END_STREAM came from the origin (its close that follows is no failure).
        var ended = false
        /// nghttp2 closed the stream (both sides ended it, or a reset): no frame may go on it any more.
        var closed = false

        init(user: any OriginStreamUser) { self.user = user }
    }

    private enum Received {
        case event(OriginExchange.Event)
        case data([UInt8])
    }

    /// Streams one connection carries at most at once, whatever the origin allows: past it, a new connection.
    static let maxStreams = 100
    /// The window of each stream (a paused owner leaves at most this much here) and of the connection.
    static let streamWindow: UInt32 = 1 << 20
    static let connectionWindow: Int32 = 16 << 20

    init(key: OriginKey, connection: OriginConnection, loop: EventLoop, limits: HTTPHeadLimits) {
        self.key = key
        self.connection = connection
        self.loop = loop
        self.limits = limits
        connection.user = self
        var callbacks: OpaquePointer?
        nghttp2_session_callbacks_new(&callbacks)
        defer { nghttp2_session_callbacks_del(callbacks) }
        nghttp2_session_callbacks_set_on_begin_headers_callback(callbacks, originBeginHeaders)
        nghttp2_session_callbacks_set_on_header_callback(callbacks, originHeader)
        nghttp2_session_callbacks_set_on_frame_recv_callback(callbacks, originFrameReceived)
        nghttp2_session_callbacks_set_on_data_chunk_recv_callback(callbacks, originDataChunk)
        nghttp2_session_callbacks_set_on_stream_close_callback(callbacks, originStreamClosed)
        nghttp2_session_callbacks_set_error_callback2(callbacks, originSessionError)
        var option: OpaquePointer?
        nghttp2_option_new(&option)
        defer { nghttp2_option_del(option) }
        // Windows open as owners take the bytes (`consume`), not as they arrive.
        nghttp2_option_set_no_auto_window_update(option, 1)
        nghttp2_session_client_new2(&session, callbacks, Unmanaged.passUnretained(self).toOpaque(), option)
        var entries = [
            nghttp2_settings_entry(settings_id: Int32(NGHTTP2_SETTINGS_ENABLE_PUSH.rawValue), value: 0),
            nghttp2_settings_entry(
                settings_id: Int32(NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE.rawValue), value: Self.streamWindow),
            nghttp2_settings_entry(
                settings_id: Int32(NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE.rawValue), value: UInt32(limits.maxHeadBytes)),
        ]
        nghttp2_submit_settings(session, UInt8(NGHTTP2_FLAG_NONE.rawValue), &entries, entries.count)
        nghttp2_session_set_local_window_size(session, UInt8(NGHTTP2_FLAG_NONE.rawValue), 0, Self.connectionWindow)
        flushSoon()
    }

    deinit {
        if let session { nghttp2_session_del(session) }
    }

    /// Whether a new stream may go on this connection.
    var hasCapacity: Bool {
        guard !goingAway, !closed, let session else { return false }
        let allowed = nghttp2_session_get_remote_settings(session, NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS)
        return streams.count < min(Int(allowed), Self.maxStreams)
    }

    var isIdle: Bool { streams.isEmpty }

    /// Opens a stream for `user` with `fields` (and the request body read from it when `body`); nil when the
    /// stream cannot be opened (the connection is going away).
    func open(_ user: any OriginStreamUser, fields: [H2Field], body: Bool) -> Int32? {
        guard hasCapacity else { return nil }
        idleTimer?.cancel()
        let id: Int32 = withHeaderList(fields) { list, count in
            if body {
                var provider = nghttp2_data_provider(
                    source: nghttp2_data_source(ptr: nil), read_callback: originReadRequestBody)
                return nghttp2_submit_request(session, nil, list, count, &provider, nil)
            }
            return nghttp2_submit_request(session, nil, list, count, nil, nil)
        }
        guard id > 0 else { return nil }
        streams[id] = Stream(user: user)
        flushSoon()
        return id
    }

    /// The user is done with `stream`: reset it if it is still open; nothing of it reaches the user any more.
    func release(_ stream: Int32) {
        guard let state = streams[stream] else { return }
        state.user = nil
        if !closed, !state.closed {
            // Still open in nghttp2: the response is not wanted (cancelled), or the request body is still going
            // out after the whole response came (RFC 9113 §8.1: the client may stop sending it).
            nghttp2_submit_rst_stream(
                session, UInt8(NGHTTP2_FLAG_NONE.rawValue), stream,
                state.ended ? NGHTTP2_NO_ERROR.rawValue : NGHTTP2_CANCEL.rawValue)
        }
        removeStream(stream)
        flushSoon()
    }

    /// The owner took `count` bytes of the stream's response: its window (and the connection's) opens again.
    func consume(_ stream: Int32, _ count: Int) {
        guard !closed, count > 0 else { return }
        nghttp2_session_consume(session, stream, count)
        flushSoon()
    }

    /// The owner has more of the request body after a pause.
    func resumeBody(_ stream: Int32) {
        guard !closed, streams[stream] != nil else { return }
        nghttp2_session_resume_data(session, stream)
        flushSoon()
    }

    private func flushSoon() {
        guard !closed else { return }
        flushTask.fireInThisPass()
    }

    /// Hands nghttp2's frames to the connection while its output has room (the rest when it drains).
    private func flush() {
        guard !closed, let session else { return }
        while true {
            if connection.outputLength >= OriginTransfer.bodyHighWater {
                // Only a socket that takes no more stops it (its write event armed); queued bytes alone would wait.
                connection.flush()
                if connection.outputLength >= OriginTransfer.bodyHighWater { break }
            }
            var data: UnsafePointer<UInt8>?
            let length = nghttp2_session_mem_send(session, &data)
            if length < 0 { return fail("HTTP/2 send error: \(String(cString: nghttp2_strerror(Int32(length))))") }
            if length == 0 { break }
            connection.queue(UnsafeRawBufferPointer(start: data, count: length))
        }
        // The frames of this pass in one write: a HEADERS frame and its DATA went as a record and a send(2) each.
        connection.flush()
        dispatch()
        if goingAway && streams.isEmpty { close() }
    }

    // MARK: - OriginConnectionUser

    func connectionReady(_ connection: OriginConnection) {}
    func connectionFailed(_ connection: OriginConnection, _ failure: UpstreamFailure, detail: String) {}

    func connectionReadable(_ connection: OriginConnection) {
        guard !closed else { return }
        var ended: String?
        reading: while !closed {
            let fill = connection.fill()
            if let failure = feed() {
                ended = failure
                break
            }
            switch fill {
            case .wouldBlock: break reading
            case .limit: continue
            case .ended:
                // nghttp2 stops reading once it has ended the connection itself for an error of the origin's.
                if let protocolError, let session, nghttp2_session_want_read(session) == 0 {
                    ended = "the origin broke HTTP/2 (\(protocolError))"
                } else {
                    ended = "the origin closed the connection"
                }
            case .failed(let detail): ended = detail
            }
            break
        }
        dispatch()
        if let ended { return fail(ended) }
        flushSoon()
    }

    /// Gives what the connection read to nghttp2; why the connection cannot go on, if it cannot.
    private func feed() -> String? {
        let input = connection.input
        var failure: String?
        var consumed = 0
        Buffers.forEachSegment(input) { segment in
            let result = nghttp2_session_mem_recv(
                session, segment.baseAddress?.assumingMemoryBound(to: UInt8.self), segment.count)
            guard result >= 0 else {
                failure = "the origin broke HTTP/2: \(String(cString: nghttp2_strerror(Int32(result))))"
                return false
            }
            consumed += result
            return true
        }
        evbuffer_drain(input, consumed)
        return failure
    }

    func connectionBroke(_ connection: OriginConnection, detail: String) {
        fail(detail)
    }

    func connectionDrained(_ connection: OriginConnection) {
        flushSoon()
    }

    /// Hands the events read to the streams' users, in order.
    private func dispatch() {
        while !received.isEmpty {
            let (stream, what) = received.removeFirst()
            guard let user = streams[stream]?.user else { continue }
            switch what {
            case .event(let event):
                // A stream that failed is closed in nghttp2 already: its record goes now.
                if case .streamFailed = event { removeStream(stream) }
                user.streamEvent(event)
            case .data(let bytes):
                user.streamData(bytes)
            }
        }
    }

    private func removeStream(_ stream: Int32) {
        guard streams.removeValue(forKey: stream) != nil else { return }
        guard streams.isEmpty else { return }
        if goingAway {
            flushSoon()  // what is due goes out, then the connection closes (`flush`)
        } else {
            pool?.idle(self)
        }
    }

    /// The connection is lost: every stream still open fails (refused when a GOAWAY had excluded it).
    private func fail(_ detail: String) {
        guard !closed else { return }
        goingAway = true
        let open = streams
        close()
        for (id, state) in open.sorted(by: { $0.key < $1.key }) {
            state.user?.streamEvent(.streamFailed(refused: id > goawayLastStream, detail: detail))
        }
    }

    func close() {
        guard !closed else { return }
        closed = true
        goingAway = true
        idleTimer?.cancel()
        flushTask.cancel()
        pool?.drop(self)
        connection.user = nil
        connection.close()
        streams = [:]
    }

    // MARK: - nghttp2's callbacks (inside nghttp2_session_mem_recv or _mem_send)

    fileprivate func beginHeaders(_ stream: Int32) {
        guard let state = streams[stream] else { return }
        state.fields = []
        state.fieldBytes = 0
        state.overLimit = nil
    }

    fileprivate func header(_ stream: Int32, name: UnsafeRawBufferPointer, value: UnsafeRawBufferPointer) {
        guard let state = streams[stream], state.overLimit == nil else { return }
        state.fieldBytes += name.count + value.count + 4
        if state.fieldBytes > limits.maxHeadBytes {
            state.overLimit = "the response head is larger than \(limits.maxHeadBytes) bytes"
        } else if state.fields.count >= limits.maxFields {
            state.overLimit = "the response head has more than \(limits.maxFields) fields"
        } else {
            state.fields.append(H2Field(Array(name), Array(value)))
        }
    }

    fileprivate func frameReceived(_ frame: UnsafePointer<nghttp2_frame>) {
        let header = frame.pointee.hd
        let endStream = header.flags & UInt8(NGHTTP2_FLAG_END_STREAM.rawValue) != 0
        switch Int(header.type) {
        case Int(NGHTTP2_HEADERS.rawValue):
            guard let state = streams[header.stream_id] else { return }
            let fields = state.fields
            state.fields = []
            if let reason = state.overLimit {
                received.append((header.stream_id, .event(.streamHeadTooLarge(reason: reason))))
            } else if fields.contains(where: { $0.name == H2Semantics.statusName }) {
                received.append((header.stream_id, .event(.streamHead(fields))))
            } else {
                // A block without :status after the response: its trailer fields (nghttp2 checked the shape).
                received.append((header.stream_id, .event(.streamTrailers(fields))))
            }
            if endStream {
                state.ended = true
                received.append((header.stream_id, .event(.streamEnded)))
            }
        case Int(NGHTTP2_DATA.rawValue):
            if endStream, let state = streams[header.stream_id] {
                state.ended = true
                received.append((header.stream_id, .event(.streamEnded)))
            }
        case Int(NGHTTP2_GOAWAY.rawValue):
            goingAway = true
            goawayLastStream = frame.pointee.goaway.last_stream_id
            pool?.drop(self)
        default:
            break
        }
    }

    fileprivate func dataChunk(_ stream: Int32, _ data: UnsafeRawBufferPointer) {
        guard streams[stream] != nil else {
            // Nobody wants it (a stream released meanwhile): the connection's window gets it back.
            nghttp2_session_consume(session, stream, data.count)
            return
        }
        received.append((stream, .data(Array(data))))
    }

    fileprivate func streamClosed(_ stream: Int32, errorCode: UInt32) {
        guard let state = streams[stream] else { return }
        // RFC 9113 §5.1: nothing but PRIORITY may be sent on a closed stream (a RST_STREAM there is a protocol
        // error to strict peers).
        state.closed = true
        // A stream that ended whole closes with NO_ERROR; its user already has the end.
        guard !state.ended else { return }
        // RFC 9113 §8.7: REFUSED_STREAM (which nghttp2 also gives the streams a GOAWAY left out) says the origin
        // did nothing with the request.
        let refused = errorCode == NGHTTP2_REFUSED_STREAM.rawValue
        let name = String(cString: nghttp2_http2_strerror(errorCode))
        received.append(
            (stream, .event(.streamFailed(refused: refused, detail: "the origin reset the stream: \(name)"))))
    }

    fileprivate func readRequestBody(
        _ stream: Int32, _ buffer: UnsafeMutablePointer<UInt8>, _ length: Int, _ flags: UnsafeMutablePointer<UInt32>
    ) -> Int {
        guard let user = streams[stream]?.user else { return Int(NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE.rawValue) }
        let count = user.streamReadBody(UnsafeMutableRawBufferPointer(start: buffer, count: length))
        if count == proxyctl_readfunc_pause() { return Int(NGHTTP2_ERR_DEFERRED.rawValue) }
        if count == 0 {
            flags.pointee |= NGHTTP2_DATA_FLAG_EOF.rawValue
            let trailers = user.streamTrailers().filter { $0.name.first != UInt8(ascii: ":") }
            if !trailers.isEmpty {
                flags.pointee |= NGHTTP2_DATA_FLAG_NO_END_STREAM.rawValue
                withHeaderList(H2Semantics.trailers(trailers.map { ($0.nameText, $0.value) })) { list, count in
                    _ = nghttp2_submit_trailer(session, stream, list, count)
                }
            }
        }
        return count
    }
}

/// Calls `body` with an nghttp2 header list for `fields`, its names and values in one buffer that lives for the
/// call (nghttp2 copies them).
func withHeaderList<Result>(_ fields: [H2Field], _ body: (UnsafePointer<nghttp2_nv>, Int) -> Result) -> Result {
    let total = fields.reduce(0) { $0 + $1.name.count + $1.value.count }
    return withUnsafeTemporaryAllocation(of: UInt8.self, capacity: max(1, total)) { bytes in
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
            return body(UnsafePointer(list.baseAddress!), fields.count)
        }
    }
}

// MARK: - C callbacks (user data: the OriginH2Session, unretained; its pool or transfers hold it)

private func originSession(_ pointer: UnsafeMutableRawPointer?) -> OriginH2Session {
    Unmanaged<OriginH2Session>.fromOpaque(pointer!).takeUnretainedValue()
}

private let originBeginHeaders:
    @convention(c) (OpaquePointer?, UnsafePointer<nghttp2_frame>?, UnsafeMutableRawPointer?) -> Int32 = {
        _, frame, user in
        if let frame, Int(frame.pointee.hd.type) == Int(NGHTTP2_HEADERS.rawValue) {
            originSession(user).beginHeaders(frame.pointee.hd.stream_id)
        }
        return 0
    }

private let originHeader:
    @convention(c) (
        OpaquePointer?, UnsafePointer<nghttp2_frame>?, UnsafePointer<UInt8>?, Int, UnsafePointer<UInt8>?, Int, UInt8,
        UnsafeMutableRawPointer?
    ) -> Int32 = { _, frame, name, nameLength, value, valueLength, _, user in
        guard let frame else { return 0 }
        originSession(user).header(
            frame.pointee.hd.stream_id, name: UnsafeRawBufferPointer(start: name, count: nameLength),
            value: UnsafeRawBufferPointer(start: value, count: valueLength))
        return 0
    }

private let originFrameReceived:
    @convention(c) (OpaquePointer?, UnsafePointer<nghttp2_frame>?, UnsafeMutableRawPointer?) -> Int32 = {
        _, frame, user in
        if let frame { originSession(user).frameReceived(frame) }
        return 0
    }

private let originDataChunk:
    @convention(c) (OpaquePointer?, UInt8, Int32, UnsafePointer<UInt8>?, Int, UnsafeMutableRawPointer?) -> Int32 = {
        _, _, stream, data, length, user in
        originSession(user).dataChunk(stream, UnsafeRawBufferPointer(start: data, count: length))
        return 0
    }

private let originStreamClosed: @convention(c) (OpaquePointer?, Int32, UInt32, UnsafeMutableRawPointer?) -> Int32 = {
    _, stream, errorCode, user in
    originSession(user).streamClosed(stream, errorCode: errorCode)
    return 0
}

private let originSessionError:
    @convention(c) (OpaquePointer?, Int32, UnsafePointer<CChar>?, Int, UnsafeMutableRawPointer?) -> Int32 = {
        _, code, message, length, user in
        let session = originSession(user)
        if session.protocolError == nil, let message {
            let bytes = UnsafeRawBufferPointer(start: message, count: length)
            session.protocolError = String(decoding: bytes, as: UTF8.self)
        }
        return 0
    }

private let originReadRequestBody:
    @convention(c) (
        OpaquePointer?, Int32, UnsafeMutablePointer<UInt8>?, Int, UnsafeMutablePointer<UInt32>?,
        UnsafeMutablePointer<nghttp2_data_source>?, UnsafeMutableRawPointer?
    ) -> Int = { _, stream, buffer, length, flags, _, user in
        originSession(user).readRequestBody(stream, buffer!, length, flags!)
    }
