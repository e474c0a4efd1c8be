import CLibevent
import COpenSSL

/// The client's end of a `ClientDriver`'s connection, whichever carries it: the proxy's TLS on the socket
/// (`TLSSocket`, the usual intercepted connection), or a bufferevent (a plain socket; one end of a buffer pair,
/// an HTTP/2 connection's WebSocket stream; TLS as a filter over bytes the client sent early). The driver reads
/// and writes through it without asking which.
struct ClientSide {
    /// The bufferevent carrying the connection; nil while `tls` carries it.
    private(set) var bev: OpaquePointer?
    private(set) var tls: TLSSocket?
    /// The TLS session of an intercepted connection (owned by `tls` or the bufferevent).
    private(set) var ssl: OpaquePointer?

    init(bev: OpaquePointer?, ssl: OpaquePointer? = nil) {
        self.bev = bev
        self.ssl = ssl
    }

    init(tls: TLSSocket, ssl: OpaquePointer) {
        self.tls = tls
        self.ssl = ssl
    }

    /// Something still carries the connection.
    var exists: Bool { tls != nil || bev != nil }
    var input: OpaquePointer? { tls?.input ?? bev.map { bufferevent_get_input($0) } }
    var output: OpaquePointer? { tls?.output ?? bev.map { bufferevent_get_output($0) } }
    /// The socket, or -1 (a buffer pair, a filter).
    var fd: Int32 { tls?.fd ?? bev.map { bufferevent_getfd($0) } ?? -1 }

    /// Reads from the client on or off.
    func setReading(_ on: Bool) {
        if let tls {
            tls.setReading(on)
        } else if let bev {
            if on { bufferevent_enable(bev, Int16(EV_READ)) } else { bufferevent_disable(bev, Int16(EV_READ)) }
        }
    }

    /// The write callback comes when a write leaves at most `mark` bytes in the output.
    func setWriteLowWater(_ mark: Int) {
        if let tls {
            tls.writeLowWater = mark
        } else if let bev {
            bufferevent_setwatermark(bev, Int16(EV_WRITE), mark, 0)
        }
    }

    /// Sends the end of what the proxy writes (close_notify where TLS runs, a FIN) and keeps reading: false when
    /// there is no socket of its own to shut, or the client already ended its side (nothing to linger for).
    func shutWrite() -> Bool {
        if let tls { return tls.shutWrite() && !tls.readEnded }
        guard let bev else { return false }
        return LingeringClose.shutWrite(bev)
    }

    /// What OpenSSL said of the failure that ended the handshake.
    var tlsFailure: String {
        if let tls { return tls.failure ?? "connection closed" }
        guard let bev else { return "connection closed" }
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

    /// The TLS socket becomes an OpenSSL bufferevent, with what its buffers hold, for what takes bufferevents
    /// (HTTP/2, a relay). False when libevent could not make one (the connection is then closed).
    mutating func intoBufferevent(options: Int32) -> Bool {
        guard let tls else { return bev != nil }
        self.tls = nil
        bev = tls.intoBufferevent(options: options)
        return bev != nil
    }

    /// The bufferevent and its TLS session for the next owner (a relay, HTTP/2), callbacks off: no longer this
    /// side's. Nil while a `TLSSocket` carries the connection (`intoBufferevent` first).
    mutating func release() -> (bev: OpaquePointer, ssl: OpaquePointer?)? {
        guard let bev else { return nil }
        bufferevent_setcb(bev, nil, nil, nil, nil)
        defer { forget() }
        return (bev, ssl)
    }

    /// Another owner took the connection (or its descriptor): nothing of it is this side's any more.
    mutating func forget() {
        bev = nil
        tls = nil
        ssl = nil
    }

    /// Closes the connection.
    mutating func close() {
        if let bev { bufferevent_free(bev) }
        tls?.close()
        forget()
    }
}
