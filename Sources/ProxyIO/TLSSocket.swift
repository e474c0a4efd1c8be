import CLibevent
import COpenSSL
import ProxyTLS

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// What a `TLSSocket` reports, as a bufferevent reports it to its callbacks.
protocol TLSSocketUser: AnyObject {
    /// New bytes are in `input`.
    func socketReadable()
    /// A write pass drained `output` to `writeLowWater` or below.
    func socketWritable()
    /// `BEV_EVENT_CONNECTED` (the handshake finished), or `BEV_EVENT_EOF` / `BEV_EVENT_ERROR` with
    /// `BEV_EVENT_READING` or `BEV_EVENT_WRITING`.
    func socketEvent(_ events: Int16)
}

/// The client's side of an intercepted connection: the proxy's TLS server session on the accepted socket,
/// with libevent buffers in (`input`, plaintext the client sent) and out (`output`, plaintext for the client).
///
/// It does what libevent's OpenSSL bufferevent did here, with fewer system calls:
/// - **Writes in the pass that made them.** Bytes added to `output` mark the write event active (no system
///   call); it runs when the current callbacks are done, so a response's head and body added one after the
///   other go out as one TLS record in one `write`. The socket's write interest is registered only when the
///   socket is full. The bufferevent registered it for every response and took it away again once the output
///   was empty: two `epoll_ctl`s and a pass of the loop per response.
/// - **Reads what the socket holds at once**: read-ahead on, a 64 KiB buffer, so one `recv` brings several
///   records. A read that brought a small record and left OpenSSL's buffer empty ends the pass: epoll (level
///   triggered) reports the socket again if more came, so a request costs no `recv` that returns EAGAIN.
/// - Read interest follows `setReading`; bytes OpenSSL holds already are read without waiting for the socket.
///
/// `OriginConnection` does the same for the proxy's connections to origins. A connection that turns into
/// HTTP/2 or a relay goes on as an OpenSSL bufferevent (`intoBufferevent`), with what the buffers hold.
final class TLSSocket {
    let input: OpaquePointer
    let output: OpaquePointer
    /// The socket; -1 once closed or handed over.
    private(set) var fd: Int32
    /// The TLS session (owned: freed by `close`); nil once closed or handed over.
    private(set) var ssl: OpaquePointer?
    private let loop: EventLoop
    private var readEvent: OpaquePointer?
    private var writeEvent: OpaquePointer?
    weak var user: (any TLSSocketUser)?

    private enum Phase { case handshaking, open, ended, closed }
    private var phase = Phase.handshaking
    /// The user wants what the client sends (`setReading`).
    private var readingWanted = false
    /// The client's end came (close_notify, or a FIN): nothing more to read, though writing goes on.
    private(set) var readEnded = false
    /// The read event is registered with the loop.
    private var readRegistered = false
    /// The write event is registered: the socket was full.
    private var writeRegistered = false
    /// The write event is active for this pass (bytes were added to `output`).
    private var writeScheduled = false
    /// OpenSSL needs the socket readable to go on writing, or writable to go on reading.
    private var writeWantsRead = false
    private var readWantsWrite = false
    /// `socketWritable` is due when a write pass leaves at most this many bytes in `output`.
    var writeLowWater = 0
    /// OpenSSL's account of the failure that ended the connection, when one did.
    private(set) var failure: String?

    /// Plaintext read per pass at most (a bufferevent's largest single read, as `ClientDriver.tune` sets).
    static let readPerPass = 256 * 1024
    /// OpenSSL's read-ahead buffer: what one `recv` can bring.
    static let readBuffer = 64 * 1024
    /// The largest TLS record's plaintext: what one `SSL_write` is given.
    static let recordSize = 16 * 1024

    /// Takes `fd` and `ssl` (a server session from `TLSServerContexts`) and waits for the ClientHello.
    init(loop: EventLoop, fd: Int32, ssl: OpaquePointer) {
        self.loop = loop
        self.fd = fd
        self.ssl = ssl
        input = evbuffer_new()
        output = evbuffer_new()
        SSL_set_fd(ssl, fd)
        SSL_set_accept_state(ssl)
        SSL_set_read_ahead(ssl, 1)
        SSL_set_default_read_buffer_len(ssl, Self.readBuffer)
        // A write retried after WANT_WRITE starts at the same byte of `output`, which may have moved or grown.
        _ = proxyctl_SSL_set_mode(ssl, Int(SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER))
        let context = Unmanaged.passUnretained(self).toOpaque()
        readEvent = event_new(loop.base, fd, Int16(EV_READ | EV_PERSIST), tlsSocketCallback, context)
        writeEvent = event_new(loop.base, fd, Int16(EV_WRITE), tlsSocketCallback, context)
        evbuffer_add_cb(output, tlsSocketOutputCallback, context)
        updateReadInterest()
    }

    deinit {
        close()
        evbuffer_free(input)
        evbuffer_free(output)
    }

    /// Reads what the client sends (on) or leaves it in the socket (off).
    func setReading(_ on: Bool) {
        guard readingWanted != on else { return }
        readingWanted = on
        updateReadInterest()
        // Records OpenSSL read ahead make no readiness event of their own.
        if on, phase == .open, !readEnded, let ssl, SSL_has_pending(ssl) != 0 {
            event_active(readEvent, Int32(EV_READ), 1)
        }
    }

    /// Sends close_notify and a FIN (the last bytes went out); the reading side stays open. False when the
    /// socket is gone.
    func shutWrite() -> Bool {
        guard fd >= 0, let ssl else { return false }
        CryptoError.clearQueue()
        _ = SSL_shutdown(ssl)
        CryptoError.clearQueue()
        return Platform.shutdownWrite(fd)
    }

    /// Frees the events and the session, closes the socket. Nothing is reported after this.
    func close() {
        if phase == .closed { return }
        phase = .closed
        freeEvents()
        if let ssl { SSL_free(ssl) }
        ssl = nil
        if fd >= 0 { Platform.closeDescriptor(fd) }
        fd = -1
    }

    /// Reads the TLS records still waiting in the socket of `ssl`, at most `limit`, giving each one's plaintext to
    /// `body` until it returns false; true when the connection ended meanwhile (the client's close_notify, a reset,
    /// a bad record), as the bufferevent's own read would have reported it. libevent's OpenSSL bufferevent reads
    /// one record per pass of the loop; a client's HTTP/2 frames come in many small records (a request's HEADERS
    /// is one), so one record per pass was one `epoll_wait` and one pass per stream. The driver reads here, after
    /// what the bufferevent read, until OpenSSL wants more from the socket or `limit` records were read (the rest
    /// is the next pass's, so that one client cannot hold the loop): without read-ahead OpenSSL holds nothing
    /// beyond the record it is reading, so no bytes wait where only a readiness event would bring them back, and
    /// the socket, not yet empty, is still readable.
    static func readRecordsLeft(
        _ ssl: OpaquePointer, upTo limit: Int, _ body: (UnsafeRawBufferPointer) -> Bool
    ) -> Bool {
        withUnsafeTemporaryAllocation(of: UInt8.self, capacity: recordSize) { buffer in
            for _ in 0..<limit {
                CryptoError.clearQueue()
                let count = SSL_read(ssl, buffer.baseAddress, Int32(buffer.count))
                if count <= 0 {
                    let error = SSL_get_error(ssl, count)
                    CryptoError.clearQueue()
                    // WANT_READ: the socket is empty (a partial record stays with OpenSSL, and the bufferevent
                    // reads the rest when it comes).
                    return error != SSL_ERROR_WANT_READ && error != SSL_ERROR_WANT_WRITE
                }
                guard body(UnsafeRawBufferPointer(start: buffer.baseAddress, count: Int(count))) else { return false }
            }
            return false
        }
    }

    /// Hands the socket and the session to a new OpenSSL bufferevent (HTTP/2, a relay), with the bytes both
    /// buffers hold and the records OpenSSL read ahead; this socket is then done. Nil (and closed) if libevent
    /// cannot make one.
    func intoBufferevent(options: Int32) -> OpaquePointer? {
        guard phase == .open || phase == .ended, let ssl, fd >= 0 else {
            close()
            return nil
        }
        // The bufferevent reads only when the socket is readable: take what OpenSSL holds first, and read
        // record by record from now on, as it expects.
        Self.readBuffered(ssl, into: input)
        SSL_set_read_ahead(ssl, 0)
        freeEvents()
        guard let bev = bufferevent_openssl_socket_new(loop.base, fd, ssl, BUFFEREVENT_SSL_OPEN, options) else {
            close()
            return nil
        }
        bufferevent_openssl_set_allow_dirty_shutdown(bev, 1)
        evbuffer_add_buffer(bufferevent_get_input(bev), input)
        evbuffer_add_buffer(bufferevent_get_output(bev), output)
        self.ssl = nil
        fd = -1
        phase = .closed
        return bev
    }

    // MARK: - Events

    fileprivate func event(_ what: Int16) {
        switch phase {
        case .handshaking:
            handshake()
        case .open:
            if Int32(what) & Int32(EV_WRITE) != 0 {
                writeRegistered = false  // a write event fires once
                if readWantsWrite {
                    readWantsWrite = false
                    fill()
                }
                if phase == .open { flush() }
            }
            if phase == .open, Int32(what) & Int32(EV_READ) != 0 {
                if writeWantsRead {
                    writeWantsRead = false
                    updateReadInterest()
                    flush()
                }
                if phase == .open, readingWanted, !readEnded { fill() }
            }
        case .ended, .closed:
            return
        }
    }

    fileprivate func outputGrew() {
        guard phase == .open, !writeScheduled, !writeRegistered, !writeWantsRead else { return }
        writeScheduled = true
        event_active(writeEvent, Int32(EV_WRITE), 1)
    }

    private func handshake() {
        guard let ssl else { return }
        CryptoError.clearQueue()
        let result = SSL_do_handshake(ssl)
        if result == 1 {
            phase = .open
            updateReadInterest()
            user?.socketEvent(Int16(BEV_EVENT_CONNECTED))
            guard phase == .open else { return }
            if evbuffer_get_length(output) > 0 { outputGrew() }
            // The client's first request often comes right after its Finished.
            if readingWanted { fill() }
            return
        }
        switch SSL_get_error(ssl, result) {
        case SSL_ERROR_WANT_READ:
            updateReadInterest()
        case SSL_ERROR_WANT_WRITE:
            registerWrite()
        default:
            end(Int16(BEV_EVENT_READING | BEV_EVENT_ERROR), failure: tlsFailureText())
        }
    }

    /// Reads into `input` until OpenSSL wants more from the socket, the socket looks empty, or `readPerPass`
    /// was read; then tells the user, and about the end after the bytes before it.
    private func fill() {
        guard let ssl else { return }
        var total = 0
        var ending: (events: Int16, failure: String?)?
        reading: while total < Self.readPerPass {
            var vector = iovec()
            guard evbuffer_reserve_space(input, Self.recordSize, &vector, 1) == 1 else {
                ending = (Int16(BEV_EVENT_READING | BEV_EVENT_ERROR), "out of memory")
                break
            }
            CryptoError.clearQueue()
            let result = SSL_read(ssl, vector.iov_base, Int32(min(vector.iov_len, Self.recordSize)))
            if result > 0 {
                vector.iov_len = Int(result)
                evbuffer_commit_space(input, &vector, 1)
                total += Int(result)
                // A small record and nothing more with OpenSSL: the recv that brought it emptied the socket.
                if Int(result) < Self.recordSize && SSL_has_pending(ssl) == 0 { break }
                continue
            }
            switch SSL_get_error(ssl, result) {
            case SSL_ERROR_WANT_READ:
                break reading
            case SSL_ERROR_WANT_WRITE:
                readWantsWrite = true
                registerWrite()
                break reading
            case SSL_ERROR_ZERO_RETURN:
                ending = (Int16(BEV_EVENT_READING | BEV_EVENT_EOF), nil)
            case SSL_ERROR_SYSCALL where ERR_peek_error() == 0 && proxyctl_errno() == 0:
                // Closed without close_notify: an end, as the bufferevent's allow_dirty_shutdown took it.
                CryptoError.clearQueue()
                ending = (Int16(BEV_EVENT_READING | BEV_EVENT_EOF), nil)
            default:
                ending = (Int16(BEV_EVENT_READING | BEV_EVENT_ERROR), tlsFailureText())
            }
            break
        }
        if ending == nil, total >= Self.readPerPass, SSL_has_pending(ssl) != 0 {
            event_active(readEvent, Int32(EV_READ), 1)
        }
        if total > 0 { user?.socketReadable() }
        guard let ending, phase == .open else { return }
        if Int32(ending.events) & Int32(BEV_EVENT_EOF) != 0 {
            // The client's end: reading stops, what is due still goes out.
            readEnded = true
            updateReadInterest()
            user?.socketEvent(ending.events)
        } else {
            end(ending.events, failure: ending.failure)
        }
    }

    /// Writes `output` record by record while the socket takes it.
    private func flush() {
        writeScheduled = false
        guard phase == .open, let ssl, !writeWantsRead else { return }
        var wrote = false
        writing: while true {
            let length = evbuffer_get_length(output)
            if length == 0 { break }
            let count = min(length, Self.recordSize)
            guard let bytes = evbuffer_pullup(output, count) else {
                return end(Int16(BEV_EVENT_WRITING | BEV_EVENT_ERROR), failure: "out of memory")
            }
            CryptoError.clearQueue()
            let result = SSL_write(ssl, bytes, Int32(count))
            if result > 0 {
                evbuffer_drain(output, Int(result))
                wrote = true
                continue
            }
            switch SSL_get_error(ssl, result) {
            case SSL_ERROR_WANT_WRITE:
                registerWrite()
            case SSL_ERROR_WANT_READ:
                writeWantsRead = true
                updateReadInterest()
            default:
                return end(Int16(BEV_EVENT_WRITING | BEV_EVENT_ERROR), failure: tlsFailureText())
            }
            break writing
        }
        if wrote && evbuffer_get_length(output) <= writeLowWater { user?.socketWritable() }
    }

    private func registerWrite() {
        guard !writeRegistered else { return }
        writeRegistered = true
        event_add(writeEvent, nil)
    }

    private func updateReadInterest() {
        let wanted =
            switch phase {
            case .handshaking: true
            case .open: !readEnded && (readingWanted || writeWantsRead)
            case .ended, .closed: false
            }
        guard wanted != readRegistered, let readEvent else { return }
        readRegistered = wanted
        if wanted { event_add(readEvent, nil) } else { event_del(readEvent) }
    }

    /// The connection failed: no more reading or writing, then the user hears of it.
    private func end(_ events: Int16, failure: String?) {
        self.failure = failure
        phase = .ended
        if let readEvent { event_del(readEvent) }
        if let writeEvent { event_del(writeEvent) }
        readRegistered = false
        writeRegistered = false
        writeScheduled = false
        user?.socketEvent(events)
    }

    /// Moves the plaintext of the records OpenSSL holds complete into `input` (no socket read: a partial
    /// record stays with OpenSSL, which reads the rest when the socket brings it).
    /// Reads into `input` what OpenSSL holds of `ssl` already (decrypted, or read ahead from the socket), before
    /// a bufferevent takes the session over: it reads only when the socket is readable, so bytes left in OpenSSL
    /// would wait there.
    static func readBuffered(_ ssl: OpaquePointer, into input: OpaquePointer) {
        while SSL_has_pending(ssl) != 0 {
            var vector = iovec()
            guard evbuffer_reserve_space(input, Self.recordSize, &vector, 1) == 1 else { return }
            CryptoError.clearQueue()
            let result = SSL_read(ssl, vector.iov_base, Int32(min(vector.iov_len, Self.recordSize)))
            guard result > 0 else {
                CryptoError.clearQueue()
                return
            }
            vector.iov_len = Int(result)
            evbuffer_commit_space(input, &vector, 1)
        }
    }

    private func freeEvents() {
        evbuffer_remove_cb(output, tlsSocketOutputCallback, Unmanaged.passUnretained(self).toOpaque())
        if let readEvent { event_free(readEvent) }
        if let writeEvent { event_free(writeEvent) }
        readEvent = nil
        writeEvent = nil
        readRegistered = false
        writeRegistered = false
        writeScheduled = false
    }

}

/// What OpenSSL's error queue says of a failed TLS call (the queue is empty afterwards), else the system
/// error, else "connection closed". For the proxy's TLS on both sides (`TLSSocket`, `OriginConnection`).
func tlsFailureText() -> String {
    let messages = CryptoError.drainQueue()
    let errno = proxyctl_errno()
    if messages.isEmpty && errno != 0 { return String(cString: strerror(errno)) }
    return messages.isEmpty ? "connection closed" : messages.joined(separator: "; ")
}

// MARK: - libevent callbacks (context: the TLSSocket, unretained; its owner keeps it until `close`)

private let tlsSocketCallback: event_callback_fn = { _, what, context in
    // The user may let the socket go from inside the callback: it lives until the callback returns.
    let socket = Unmanaged<TLSSocket>.fromOpaque(context!).takeUnretainedValue()
    withExtendedLifetime(socket) { socket.event(what) }
}

private let tlsSocketOutputCallback: evbuffer_cb_func = { _, info, context in
    guard let info, info.pointee.n_added > 0 else { return }
    Unmanaged<TLSSocket>.fromOpaque(context!).takeUnretainedValue().outputGrew()
}
