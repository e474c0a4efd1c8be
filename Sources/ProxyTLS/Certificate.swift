import COpenSSL
import ProxyCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// An X.509 certificate; frees it when released.
public final class Certificate: @unchecked Sendable {
    // @unchecked Sendable: never modified after it is built or read.
    let x509: OpaquePointer

    init(_ x509: OpaquePointer) { self.x509 = x509 }

    deinit { X509_free(x509) }

    public static func fromPEM(_ pem: [UInt8]) throws -> Certificate {
        let bio = pem.withUnsafeBytes { BIO_new_mem_buf($0.baseAddress, Int32($0.count)) }
        guard let bio else { throw CryptoError("BIO_new_mem_buf") }
        defer { BIO_free(bio) }
        guard let x509 = PEM_read_bio_X509(bio, nil, nil, nil) else { throw CryptoError("reading a PEM certificate") }
        return Certificate(x509)
    }

    public static func fromDER(_ der: [UInt8]) throws -> Certificate {
        let x509 = der.withUnsafeBufferPointer { buffer -> OpaquePointer? in
            var cursor = buffer.baseAddress
            return d2i_X509(nil, &cursor, buffer.count)
        }
        guard let x509 else { throw CryptoError("reading a DER certificate") }
        return Certificate(x509)
    }

    public func pem() throws -> [UInt8] {
        guard let bio = BIO_new(BIO_s_mem()) else { throw CryptoError("BIO_new") }
        defer { BIO_free(bio) }
        guard PEM_write_bio_X509(bio, x509) == 1 else { throw CryptoError("writing a PEM certificate") }
        return PrivateKey.drain(bio)
    }

    /// DER encoding.
    public func der() -> [UInt8] {
        var pointer: UnsafeMutablePointer<UInt8>? = nil
        let length = i2d_X509(x509, &pointer)
        guard length > 0, let pointer else { return [] }
        defer { proxyctl_OPENSSL_free(pointer) }
        return Array(UnsafeBufferPointer(start: pointer, count: Int(length)))
    }

    /// SHA-256 of the DER, as colon-separated hex (what browsers show).
    public var fingerprint: String {
        Crypto.sha256(der()).map { String($0, radix: 16, uppercase: true).leftPadded2 }.joined(separator: ":")
    }

    /// The end of the validity period, seconds since 1970.
    public var notAfter: Int64 {
        var tm = tm()
        guard ASN1_TIME_to_tm(X509_get0_notAfter(x509), &tm) == 1 else { return 0 }
        return Int64(timegm(&tm))
    }

    public var notBefore: Int64 {
        var tm = tm()
        guard ASN1_TIME_to_tm(X509_get0_notBefore(x509), &tm) == 1 else { return 0 }
        return Int64(timegm(&tm))
    }

    /// The subject as one line (RFC 2253).
    public var subject: String {
        guard let bio = BIO_new(BIO_s_mem()) else { return "" }
        defer { BIO_free(bio) }
        X509_NAME_print_ex(bio, X509_get_subject_name(x509), 0, proxyctl_XN_FLAG_RFC2253())
        return String(decoding: PrivateKey.drain(bio), as: UTF8.self)
    }

    /// An extension's value as OpenSSL prints it (e.g. the name constraints), or nil.
    public func extensionText(nid: Int32) -> String? {
        let index = X509_get_ext_by_NID(x509, nid, -1)
        guard index >= 0, let ext = X509_get_ext(x509, index), let bio = BIO_new(BIO_s_mem()) else { return nil }
        defer { BIO_free(bio) }
        guard X509V3_EXT_print(bio, ext, 0, 0) == 1 else { return nil }
        return String(decoding: PrivateKey.drain(bio), as: UTF8.self)
    }

    public static let nameConstraintsNID = NID_name_constraints

    /// Whether `key` is the private key of this certificate's public key.
    func matches(_ key: PrivateKey) -> Bool { X509_check_private_key(x509, key.pkey) == 1 }

    /// Whether `issuer`'s key signed this certificate.
    func isSigned(by issuer: Certificate) -> Bool {
        guard let key = X509_get0_pubkey(issuer.x509) else { return false }
        return X509_verify(x509, key) == 1
    }

    /// The certificate's name constraints as they bear on DNS names (RFC 5280 §4.2.1.10), read from the extension
    /// itself; nil when it has none. Address ranges count only as "every address excluded" or not.
    public func nameConstraints() throws -> NameConstraints? {
        var critical: Int32 = 0
        guard let raw = X509_get_ext_d2i(x509, NID_name_constraints, &critical, nil) else {
            if critical == -1 { return nil }
            throw CryptoError("the name constraints of \(subject) cannot be read")
        }
        let constraints = raw.assumingMemoryBound(to: NAME_CONSTRAINTS.self)
        defer { NAME_CONSTRAINTS_free(constraints) }
        let permitted = try Self.subtrees(constraints.pointee.permittedSubtrees)
        let excluded = try Self.subtrees(constraints.pointee.excludedSubtrees)
        // Every IPv4 address (0.0.0.0/0) and every IPv6 address (::/0): an address and a mask of zeros.
        let everyV4 = [UInt8](repeating: 0, count: 8)
        let everyV6 = [UInt8](repeating: 0, count: 32)
        return NameConstraints(
            permittedDNS: permitted.dns, excludedDNS: excluded.dns,
            excludesEveryAddress: excluded.addresses.contains(everyV4) && excluded.addresses.contains(everyV6))
    }

    /// The DNS names and address ranges (address then mask) of a STACK_OF(GENERAL_SUBTREE).
    private static func subtrees(_ stack: OpaquePointer?) throws -> (dns: [String], addresses: [[UInt8]]) {
        guard let stack else { return ([], []) }
        var dns: [String] = []
        var addresses: [[UInt8]] = []
        for index in 0..<OPENSSL_sk_num(stack) {
            guard let subtree = OPENSSL_sk_value(stack, index)?.assumingMemoryBound(to: GENERAL_SUBTREE.self),
                let base = subtree.pointee.base
            else { throw CryptoError("an empty name constraint") }
            func bytes(_ string: UnsafeMutablePointer<ASN1_STRING>?) -> [UInt8] {
                guard let string, let data = ASN1_STRING_get0_data(string) else { return [] }
                return Array(UnsafeBufferPointer(start: data, count: Int(ASN1_STRING_length(string))))
            }
            switch base.pointee.type {
            case GEN_DNS: dns.append(String(decoding: bytes(base.pointee.d.dNSName), as: UTF8.self))
            case GEN_IPADD: addresses.append(bytes(base.pointee.d.iPAddress))
            default: continue
            }
        }
        return (dns, addresses)
    }
}

/// Builds certificates: the local CA and the leaves it signs.
enum CertificateBuilder {
    struct Name {
        var commonName: String
        var organization: String?
    }

    /// A certificate for `subject`'s key, signed by `issuerKey` (self-signed when `issuer` is nil), with the
    /// extensions in OpenSSL's config syntax (`X509V3_EXT_nconf_nid`).
    static func build(
        subject: Name, subjectKey: PrivateKey, issuer: Certificate?, issuerKey: PrivateKey, notBefore: Int64,
        notAfter: Int64, extensions: [(Int32, String)]
    ) throws -> Certificate {
        guard let x509 = X509_new() else { throw CryptoError("X509_new") }
        let certificate = Certificate(x509)
        guard X509_set_version(x509, 2) == 1 else { throw CryptoError("X509_set_version") }
        // RFC 5280 §4.1.2.2: a positive serial of at most 20 bytes; 16 random bytes with the top bit clear.
        var serialBytes = Crypto.randomBytes(16)
        serialBytes[0] &= 0x7F
        serialBytes[0] |= 0x01
        guard let serial = BN_bin2bn(serialBytes, Int32(serialBytes.count), nil) else { throw CryptoError("BN_bin2bn") }
        defer { BN_free(serial) }
        guard BN_to_ASN1_INTEGER(serial, X509_get_serialNumber(x509)) != nil else { throw CryptoError("serial") }
        guard X509_time_adj_ex(X509_getm_notBefore(x509), 0, Int(notBefore - Int64(time(nil))), nil) != nil,
            X509_time_adj_ex(X509_getm_notAfter(x509), 0, Int(notAfter - Int64(time(nil))), nil) != nil
        else { throw CryptoError("validity") }
        let name = X509_get_subject_name(x509)
        for (field, value) in [("CN", Optional(subject.commonName)), ("O", subject.organization)] {
            guard let value else { continue }
            guard X509_NAME_add_entry_by_txt(name, field, MBSTRING_UTF8, value, -1, -1, 0) == 1 else {
                throw CryptoError("subject \(field)")
            }
        }
        guard X509_set_issuer_name(x509, issuer.map { X509_get_subject_name($0.x509) } ?? name) == 1,
            X509_set_pubkey(x509, subjectKey.pkey) == 1
        else { throw CryptoError("issuer or key") }
        var context = X509V3_CTX()
        proxyctl_X509V3_set_ctx_nodb(&context)
        X509V3_set_ctx(&context, issuer?.x509 ?? x509, x509, nil, nil, 0)
        for (nid, value) in extensions {
            guard let ext = X509V3_EXT_nconf_nid(nil, &context, nid, value) else {
                throw CryptoError("extension \(String(cString: OBJ_nid2sn(nid))) = \(value)")
            }
            defer { X509_EXTENSION_free(ext) }
            guard X509_add_ext(x509, ext, -1) == 1 else { throw CryptoError("X509_add_ext") }
        }
        guard X509_sign(x509, issuerKey.pkey, EVP_sha256()) > 0 else { throw CryptoError("X509_sign") }
        // Read back from its DER: a certificate that was read keeps its encoding, which a TLS server copies into
        // each handshake's Certificate message; one built here would be encoded again for every handshake
        // (twice: its length, then its bytes; 68,000 instructions of a new connection's 2.8 million).
        return try Certificate.fromDER(certificate.der())
    }
}

extension String {
    var leftPadded2: String { count >= 2 ? self : "0" + self }
}
