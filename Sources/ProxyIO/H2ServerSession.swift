import CLibevent
import CNghttp2
import ProxyCore

/// The server side of nghttp2 for one `H2Driver`: the session with the limits of the known HTTP/2
/// denial-of-service shapes set, and the submissions the driver makes in the session's terms (heads, trailers,
/// resets, GOAWAY, window updates). nghttp2's callbacks, which come only inside `receive` and `send` (and the
/// data source, inside `send`), reach the driver; the driver owns the session, and the session's deinit frees it.
final class H2ServerSession {
    private let session: OpaquePointer

    /// nghttp2 for `driver`'s connection, which its callbacks reach (unretained: the driver owns the session).
    init?(driver: H2Driver, settings: ProxySettings) {
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
        var made: OpaquePointer?
        nghttp2_session_server_new2(&made, callbacks, Unmanaged.passUnretained(driver).toOpaque(), option)
        guard let made else { return nil }
        session = made
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

    deinit { nghttp2_session_del(session) }

    /// Gives the client's bytes to nghttp2 (its callbacks run meanwhile): how many it took, or why they broke the
    /// connection.
    func receive(_ bytes: UnsafeRawBufferPointer) -> Result<Int, H2SessionError> {
        let result = nghttp2_session_mem_recv(
            session, bytes.baseAddress?.assumingMemoryBound(to: UInt8.self), bytes.count)
        return result < 0 ? .failure(H2SessionError(code: Int32(result))) : .success(result)
    }

    /// Adds the frames nghttp2 has to send to `output` while it holds fewer than `limit` bytes.
    func send(into output: OpaquePointer, below limit: Int) -> Result<Void, H2SessionError> {
        while Buffers.length(output) < limit {
            var data: UnsafePointer<UInt8>?
            let length = nghttp2_session_mem_send(session, &data)
            if length < 0 { return .failure(H2SessionError(code: Int32(length))) }
            if length == 0 { break }
            evbuffer_add(output, data, length)
        }
        return .success(())
    }

    var wantsRead: Bool { nghttp2_session_want_read(session) != 0 }
    var wantsWrite: Bool { nghttp2_session_want_write(session) != 0 }

    /// Submits a response head; with `provider`, the body comes from the driver's data source.
    func submitResponse(_ stream: Int32, _ fields: [H2Field], provider: Bool) {
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

    func submitTrailer(_ stream: Int32, _ fields: [H2Field]) {
        _ = withHeaderList(fields) { list, count in nghttp2_submit_trailer(session, stream, list, count) }
    }

    func reset(_ stream: Int32, code: UInt32) {
        nghttp2_submit_rst_stream(session, UInt8(NGHTTP2_FLAG_NONE.rawValue), stream, code)
    }

    /// GOAWAY naming the last stream nghttp2 handed over.
    func goaway(code: UInt32) {
        let last = nghttp2_session_get_last_proc_stream_id(session)
        nghttp2_submit_goaway(session, UInt8(NGHTTP2_FLAG_NONE.rawValue), last, code, nil, 0)
    }

    /// `count` bytes of `stream`'s DATA were kept or taken: the client's windows get them back.
    func consume(_ stream: Int32, _ count: Int) {
        nghttp2_session_consume(session, stream, count)
    }

    /// The data source of `stream` has bytes again (it had deferred).
    func resumeData(_ stream: Int32) {
        nghttp2_session_resume_data(session, stream)
    }
}

/// An error nghttp2 returned, in its words.
struct H2SessionError: Error, CustomStringConvertible {
    let code: Int32
    var description: String { String(cString: nghttp2_strerror(code)) }
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

// MARK: - nghttp2's callbacks (user data: the H2Driver, unretained; it owns the session)

private func driver(_ pointer: UnsafeMutableRawPointer?) -> H2Driver {
    Unmanaged<H2Driver>.fromOpaque(pointer!).takeUnretainedValue()
}

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
