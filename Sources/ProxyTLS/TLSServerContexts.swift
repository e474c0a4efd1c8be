import COpenSSL
import ProxyCore

/// TLS server contexts for protected hosts, one per host, each with a leaf certificate from the local CA.
///
/// Leaves are minted on first use and cached (at most `capacity` hosts); a leaf is minted again when less
/// than a quarter of its validity is left. All leaves share one P-256 key made at start-up, so minting costs
/// one signature. Used on the loop thread only.
public final class TLSServerContexts {
    public let ca: LocalCA
    private let leafKey: PrivateKey
    private var cache: [String: Entry] = [:]
    private var order: [String] = []
    public let capacity: Int
    /// Whether ALPN offers h2 (before http/1.1) to clients; a change applies to handshakes from then on.
    public var http2: Bool {
        didSet {
            if http2 != oldValue {
                cache.removeAll()
                order.removeAll()
            }
        }
    }
    /// Leaves minted so far (for logs and tests).
    public private(set) var minted = 0

    final class Entry {
        let context: OpaquePointer
        let leaf: Certificate
        let renewAt: Int64

        init(context: OpaquePointer, leaf: Certificate, renewAt: Int64) {
            self.context = context
            self.leaf = leaf
            self.renewAt = renewAt
        }

        deinit { SSL_CTX_free(context) }
    }

    public init(ca: LocalCA, capacity: Int = 256, http2: Bool = true) throws {
        self.ca = ca
        self.leafKey = try PrivateKey.generateP256()
        self.capacity = capacity
        self.http2 = http2
    }

    /// A new server-side SSL object for `host` (which must be one of the CA's hosts).
    public func makeSSL(for host: String, now: Int64 = Int64(time(nil))) throws -> OpaquePointer {
        let entry = try context(for: host, now: now)
        guard let ssl = SSL_new(entry.context) else { throw CryptoError("SSL_new") }
        return ssl
    }

    /// The leaf currently served for `host`.
    public func leaf(for host: String) -> Certificate? { cache[host]?.leaf }

    func context(for host: String, now: Int64) throws -> Entry {
        if let entry = cache[host], now < entry.renewAt { return entry }
        guard ca.covers([host]) else {
            throw CryptoError("\(host) is not covered by the local CA; run proxyctl ca init")
        }
        let leaf = try ca.issueLeaf(host: host, leafKey: leafKey, now: now)
        minted += 1
        guard let context = SSL_CTX_new(TLS_server_method()) else { throw CryptoError("SSL_CTX_new") }
        let entry = Entry(
            context: context, leaf: leaf, renewAt: now - LocalCA.backdate + LocalCA.leafValidity * 3 / 4)
        guard proxyctl_SSL_CTX_set_min_proto_version(context, TLS1_2_VERSION) == 1,
            SSL_CTX_use_certificate(context, leaf.x509) == 1, SSL_CTX_use_PrivateKey(context, leafKey.pkey) == 1,
            SSL_CTX_check_private_key(context) == 1,
            // The intermediate goes after the leaf: clients trust the root only.
            ca.isLegacy || proxyctl_SSL_CTX_add1_chain_cert(context, ca.issuer.x509) == 1
        else { throw CryptoError("setting up TLS for \(host)") }
        // Idle connections should not keep 34 KiB of TLS buffers each.
        _ = proxyctl_SSL_CTX_set_mode(context, Int(SSL_MODE_RELEASE_BUFFERS))
        // Stateful resumption (the session cache) is enough for a local proxy; tickets cost a signature-free
        // but real encryption per handshake that clients rarely use.
        SSL_CTX_set_options(context, proxyctl_SSL_OP_NO_TICKET())
        // TLS 1.3 sends its resumption tickets after the handshake; OpenSSL's default of two costs a key
        // derivation, a cached session and a write each per connection. Clients that resume (Node's agents,
        // Java) use one per new connection, and a resumed handshake is given a fresh one.
        _ = SSL_CTX_set_num_tickets(context, 1)
        // A peer that closes without close_notify (most clients do) ends the stream like a close, as it did
        // before OpenSSL 3; HTTP framing and WebSocket's close handshake say whether a message was whole.
        SSL_CTX_set_options(context, proxyctl_SSL_OP_IGNORE_UNEXPECTED_EOF())
        // ALPN (RFC 7301): h2 first when enabled, then http/1.1; a client that offers neither gets no ALPN
        // and speaks HTTP/1.1.
        SSL_CTX_set_alpn_select_cb(
            context, alpnSelect, UnsafeMutableRawPointer(http2 ? h2Protocols.baseAddress : http1Protocols.baseAddress))
        if cache[host] == nil {
            order.append(host)
            if order.count > capacity {
                cache.removeValue(forKey: order.removeFirst())
            }
        }
        cache[host] = entry
        return entry
    }
}

/// The protocols offered, in ALPN wire form and the server's order of preference, in storage that lives for the
/// whole process (the selected protocol pointer handed back to OpenSSL points into it): "\x08http/1.1", and
/// "\x02h2\x08http/1.1". The first byte before each list is its total length.
private nonisolated(unsafe) let http1Protocols = alpnList(["http/1.1"])
private nonisolated(unsafe) let h2Protocols = alpnList(["h2", "http/1.1"])

private func alpnList(_ names: [String]) -> UnsafeMutableBufferPointer<UInt8> {
    let wire = names.flatMap { [UInt8($0.utf8.count)] + Array($0.utf8) }
    let bytes = [UInt8(wire.count)] + wire
    let buffer = UnsafeMutableBufferPointer<UInt8>.allocate(capacity: bytes.count)
    _ = buffer.initialize(from: bytes)
    return buffer
}

private let alpnSelect:
    @convention(c) (
        OpaquePointer?, UnsafeMutablePointer<UnsafePointer<UInt8>?>?, UnsafeMutablePointer<UInt8>?,
        UnsafePointer<UInt8>?, UInt32, UnsafeMutableRawPointer?
    ) -> Int32 = { _, out, outLength, clientProtocols, clientLength, argument in
        guard let list = argument?.assumingMemoryBound(to: UInt8.self) else { return SSL_TLSEXT_ERR_NOACK }
        var selected: UnsafeMutablePointer<UInt8>? = nil
        var selectedLength: UInt8 = 0
        let result = SSL_select_next_proto(
            &selected, &selectedLength, list + 1, UInt32(list[0]), clientProtocols, clientLength)
        guard result == OPENSSL_NPN_NEGOTIATED, let selected else { return SSL_TLSEXT_ERR_NOACK }
        out?.pointee = UnsafePointer(selected)
        outLength?.pointee = selectedLength
        return SSL_TLSEXT_ERR_OK
    }

/// The application protocol the TLS handshake chose (ALPN), if any.
public func tlsSelectedProtocol(_ ssl: OpaquePointer) -> String? {
    var data: UnsafePointer<UInt8>? = nil
    var length: UInt32 = 0
    SSL_get0_alpn_selected(ssl, &data, &length)
    guard let data, length > 0 else { return nil }
    return String(decoding: UnsafeBufferPointer(start: data, count: Int(length)), as: UTF8.self)
}

/// The server name a client asked for in its TLS handshake (SNI), if any.
public func tlsServerName(_ ssl: OpaquePointer) -> String? {
    guard let name = SSL_get_servername(ssl, TLSEXT_NAMETYPE_host_name) else { return nil }
    return String(cString: name)
}
