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

    public init(ca: LocalCA, capacity: Int = 256) throws {
        self.ca = ca
        self.leafKey = try PrivateKey.generateP256()
        self.capacity = capacity
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
        guard ca.hosts.contains(host) else {
            throw CryptoError("\(host) is not covered by the local CA; run proxyctl ca init")
        }
        let leaf = try ca.issueLeaf(host: host, leafKey: leafKey, now: now)
        minted += 1
        guard let context = SSL_CTX_new(TLS_server_method()) else { throw CryptoError("SSL_CTX_new") }
        let entry = Entry(
            context: context, leaf: leaf, renewAt: now - LocalCA.backdate + LocalCA.leafValidity * 3 / 4)
        guard proxyctl_SSL_CTX_set_min_proto_version(context, TLS1_2_VERSION) == 1,
            SSL_CTX_use_certificate(context, leaf.x509) == 1, SSL_CTX_use_PrivateKey(context, leafKey.pkey) == 1,
            SSL_CTX_check_private_key(context) == 1
        else { throw CryptoError("setting up TLS for \(host)") }
        // Idle connections should not keep 34 KiB of TLS buffers each.
        _ = proxyctl_SSL_CTX_set_mode(context, Int(SSL_MODE_RELEASE_BUFFERS))
        // Stateful resumption (the session cache) is enough for a local proxy; tickets cost a signature-free
        // but real encryption per handshake that clients rarely use.
        SSL_CTX_set_options(context, proxyctl_SSL_OP_NO_TICKET())
        // ALPN: only HTTP/1.1 is spoken to clients (RFC 7301); clients that offer only h2 get no ALPN.
        SSL_CTX_set_alpn_select_cb(context, alpnSelect, nil)
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

/// "\x08http/1.1": the one protocol offered, in storage that lives for the whole process (the selected
/// protocol pointer handed back to OpenSSL may point into it).
private nonisolated(unsafe) let serverProtocols: UnsafeMutableBufferPointer<UInt8> = {
    let bytes: [UInt8] = [8] + Array("http/1.1".utf8)
    let buffer = UnsafeMutableBufferPointer<UInt8>.allocate(capacity: bytes.count)
    _ = buffer.initialize(from: bytes)
    return buffer
}()

private let alpnSelect:
    @convention(c) (
        OpaquePointer?, UnsafeMutablePointer<UnsafePointer<UInt8>?>?, UnsafeMutablePointer<UInt8>?,
        UnsafePointer<UInt8>?, UInt32, UnsafeMutableRawPointer?
    ) -> Int32 = { _, out, outLength, clientProtocols, clientLength, _ in
        var selected: UnsafeMutablePointer<UInt8>? = nil
        var selectedLength: UInt8 = 0
        let result = SSL_select_next_proto(
            &selected, &selectedLength, serverProtocols.baseAddress, UInt32(serverProtocols.count), clientProtocols,
            clientLength)
        guard result == OPENSSL_NPN_NEGOTIATED, let selected else { return SSL_TLSEXT_ERR_NOACK }
        out?.pointee = UnsafePointer(selected)
        outLength?.pointee = selectedLength
        return SSL_TLSEXT_ERR_OK
    }

/// The server name a client asked for in its TLS handshake (SNI), if any.
public func tlsServerName(_ ssl: OpaquePointer) -> String? {
    guard let name = SSL_get_servername(ssl, TLSEXT_NAMETYPE_host_name) else { return nil }
    return String(cString: name)
}
