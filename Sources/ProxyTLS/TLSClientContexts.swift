import COpenSSL
import ProxyCore

/// TLS client contexts for the connections the proxy makes to origins itself (its own client, and protocol
/// upgrades): the peer is verified against `ca_file` when the origin names one (the system's roots otherwise),
/// the name is checked against the certificate, and ALPN offers http/1.1 (an upgrade is an HTTP/1.1 thing), or
/// h2 first where the request may go in HTTP/2. One context per trust file, made on first use. Used on the
/// loop thread only.
public final class TLSClientContexts {
    private var contexts: [String: OpaquePointer] = [:]

    public init() {}

    deinit {
        for context in contexts.values { SSL_CTX_free(context) }
    }

    /// A client SSL object for `serverName` (a DNS name, or an IP address checked as one), trusting `caFile`;
    /// with `offerHTTP2`, ALPN offers `h2` before `http/1.1` (RFC 9113 §3.2) and the origin chooses.
    public func makeSSL(serverName: String, caFile: String?, offerHTTP2: Bool = false) throws -> OpaquePointer {
        let context = try self.context(caFile: caFile)
        guard let ssl = SSL_new(context) else { throw CryptoError("SSL_new") }
        if offerHTTP2 {
            let alpn: [UInt8] = [2] + Array("h2".utf8) + [8] + Array("http/1.1".utf8)
            _ = alpn.withUnsafeBufferPointer { SSL_set_alpn_protos(ssl, $0.baseAddress, UInt32($0.count)) }
        }
        if IPAddress.parse(serverName[...]) != nil {
            // No SNI for an address (RFC 6066 §3); the certificate must name the address.
            guard X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), serverName) == 1 else {
                SSL_free(ssl)
                throw CryptoError("checking \(serverName) against the certificate")
            }
        } else {
            guard proxyctl_SSL_set_tlsext_host_name(ssl, serverName) == 1, SSL_set1_host(ssl, serverName) == 1 else {
                SSL_free(ssl)
                throw CryptoError("setting the server name \(serverName)")
            }
        }
        return ssl
    }

    private func context(caFile: String?) throws -> OpaquePointer {
        let key = caFile ?? ""
        if let existing = contexts[key] { return existing }
        guard let context = SSL_CTX_new(TLS_client_method()) else { throw CryptoError("SSL_CTX_new") }
        SSL_CTX_set_verify(context, SSL_VERIFY_PEER, nil)
        let trusted =
            caFile.map { SSL_CTX_load_verify_locations(context, $0, nil) == 1 }
            ?? (SSL_CTX_set_default_verify_paths(context) == 1)
        guard trusted, proxyctl_SSL_CTX_set_min_proto_version(context, TLS1_2_VERSION) == 1 else {
            SSL_CTX_free(context)
            throw CryptoError(caFile.map { "cannot read the trusted certificates in \($0)" } ?? "no trusted roots")
        }
        // An origin that closes without close_notify ends the stream like a close (see TLSServerContexts).
        SSL_CTX_set_options(context, proxyctl_SSL_OP_IGNORE_UNEXPECTED_EOF())
        let alpn: [UInt8] = [8] + Array("http/1.1".utf8)
        _ = alpn.withUnsafeBufferPointer { SSL_CTX_set_alpn_protos(context, $0.baseAddress, UInt32($0.count)) }
        contexts[key] = context
        return context
    }
}

/// Why a client handshake failed, when the certificate was the reason (nil otherwise).
public func tlsVerifyFailure(_ ssl: OpaquePointer) -> String? {
    let result = SSL_get_verify_result(ssl)
    guard result != X509_V_OK else { return nil }
    return String(cString: X509_verify_cert_error_string(result))
}
