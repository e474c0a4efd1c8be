import COpenSSL
import ProxyCore

/// An OpenSSL failure, with the library's error queue drained into the message.
public struct CryptoError: Error, Sendable, CustomStringConvertible {
    public let operation: String
    public let details: [String]

    init(_ operation: String) {
        self.operation = operation
        self.details = CryptoError.drainQueue()
    }

    public var description: String {
        details.isEmpty ? operation : "\(operation): \(details.joined(separator: "; "))"
    }

    /// Empties OpenSSL's error queue of this thread, as a TLS read or write must start with (else
    /// `SSL_get_error` may report an old error). Looks first: `ERR_clear_error` resets all 16 slots of the queue
    /// (about 800 instructions, four times per intercepted request), and the queue is nearly always empty.
    @inline(__always)
    public static func clearQueue() {
        if ERR_peek_error() != 0 { ERR_clear_error() }
    }

    /// OpenSSL's error queue of this thread as messages, oldest first; the queue is empty afterwards.
    public static func drainQueue() -> [String] {
        var messages: [String] = []
        var buffer = [CChar](repeating: 0, count: 256)
        while proxyctl_ERR_get_error_string(&buffer, buffer.count) != 0 {
            messages.append(String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self))
        }
        return messages
    }
}

/// Hashing and randomness.
public enum Crypto {
    /// Cryptographically strong random bytes (RAND_bytes).
    public static func randomBytes(_ count: Int) -> [UInt8] {
        var bytes = [UInt8](repeating: 0, count: count)
        guard RAND_bytes(&bytes, Int32(count)) == 1 else {
            // Without randomness nothing secure can be made: stop rather than continue with zeros.
            fatalError("RAND_bytes failed: \(CryptoError.drainQueue())")
        }
        return bytes
    }

    /// base64url of `count` random bytes: state, nonce, PKCE verifier, jti.
    public static func randomToken(bytes count: Int = 32) -> String {
        Base64.urlEncode(randomBytes(count))
    }

    public static func sha256(_ bytes: some Collection<UInt8>) -> [UInt8] {
        var digest = [UInt8](repeating: 0, count: 32)
        let input = Array(bytes)
        input.withUnsafeBufferPointer { buffer in
            _ = SHA256(buffer.baseAddress, buffer.count, &digest)
        }
        return digest
    }

    public static func sha256(_ text: String) -> [UInt8] { sha256(Array(text.utf8)) }

    /// HMAC-SHA256 (RFC 2104) of `message` keyed by `key`: the HS256 JWS algorithm.
    public static func hmacSHA256(key: [UInt8], message: [UInt8]) -> [UInt8] {
        var digest = [UInt8](repeating: 0, count: 32)
        var length: UInt32 = 32
        key.withUnsafeBufferPointer { keyBuffer in
            message.withUnsafeBufferPointer { messageBuffer in
                _ = HMAC(
                    EVP_sha256(), keyBuffer.baseAddress, Int32(keyBuffer.count), messageBuffer.baseAddress,
                    messageBuffer.count, &digest, &length)
            }
        }
        return digest
    }
}

/// JWS algorithms this project verifies (RFC 7518 §3).
public enum JWSAlgorithm: String, Sendable, CaseIterable {
    case rs256 = "RS256"
    case rs384 = "RS384"
    case rs512 = "RS512"
    case ps256 = "PS256"
    case ps384 = "PS384"
    case ps512 = "PS512"
    case es256 = "ES256"
    case es384 = "ES384"

    var digest: String {
        switch self {
        case .rs256, .ps256, .es256: "SHA256"
        case .rs384, .ps384, .es384: "SHA384"
        case .rs512, .ps512: "SHA512"
        }
    }

    public var keyType: String {
        switch self {
        case .es256, .es384: "EC"
        default: "RSA"
        }
    }

    /// Bytes of r and of s in a raw ECDSA signature.
    var ecCoordinateSize: Int { self == .es384 ? 48 : 32 }

    var curve: String { self == .es384 ? "P-384" : "P-256" }
}

/// An OpenSSL key; frees it when released.
public final class CryptoKey: @unchecked Sendable {
    // @unchecked Sendable: the EVP_PKEY is immutable after construction and OpenSSL 3 allows concurrent
    // use of one key by several operations.
    let pkey: OpaquePointer

    init(_ pkey: OpaquePointer) { self.pkey = pkey }

    deinit { EVP_PKEY_free(pkey) }

    /// A public key from a JWK's members (RFC 7518 §6): RSA (`n`, `e`) or EC (`crv`, `x`, `y`).
    public static func publicKey(jwk: JSONObject) throws -> CryptoKey {
        switch jwk["kty"]?.string {
        case "RSA":
            guard let n = jwk["n"]?.string.flatMap(Base64.decode), let e = jwk["e"]?.string.flatMap(Base64.decode),
                !n.isEmpty, !e.isEmpty
            else { throw CryptoError("RSA JWK without valid n and e") }
            // OSSL_PARAM_BLD_push_BN keeps references to the name and the number, not copies: both must outlive
            // OSSL_PARAM_BLD_to_param and EVP_PKEY_fromdata, which run inside fromData.
            let modulus = BN_bin2bn(n, Int32(n.count), nil)
            let exponent = BN_bin2bn(e, Int32(e.count), nil)
            defer {
                BN_free(modulus)
                BN_free(exponent)
            }
            return try fromData(type: "RSA") { builder in
                OSSL_PARAM_BLD_push_BN(builder, cString("n"), modulus) == 1
                    && OSSL_PARAM_BLD_push_BN(builder, cString("e"), exponent) == 1
            }
        case "EC":
            let size: Int
            switch jwk["crv"]?.string {
            case "P-256": size = 32
            case "P-384": size = 48
            default: throw CryptoError("EC JWK with an unsupported curve")
            }
            guard let x = jwk["x"]?.string.flatMap(Base64.decode), let y = jwk["y"]?.string.flatMap(Base64.decode),
                x.count == size, y.count == size
            else { throw CryptoError("EC JWK without valid x and y") }
            let point = [0x04] + x + y
            let group: StaticString = size == 32 ? "P-256" : "P-384"
            // The builder keeps references to the names, the group and the point (not copies), so the point's
            // pointer must stay valid around the whole of fromData.
            return try point.withUnsafeBytes { raw in
                try fromData(type: "EC") { builder in
                    OSSL_PARAM_BLD_push_utf8_string(builder, cString("group"), cString(group), 0) == 1
                        && OSSL_PARAM_BLD_push_octet_string(builder, cString("pub"), raw.baseAddress, raw.count) == 1
                }
            }
        default:
            throw CryptoError("JWK with an unsupported key type")
        }
    }

    /// A NUL-terminated C string in static storage. OSSL_PARAM_BLD and EVP_PKEY_CTX_new_from_name keep the
    /// pointers they are given instead of copying the text; a Swift String bridged for the call (small strings
    /// live on the stack) would dangle by the time OpenSSL reads it.
    /// A pointer to a string literal's static storage: OpenSSL keeps some names by pointer (the key type in
    /// an EVP_PKEY_CTX, parameter names in OSSL_PARAM_BLD), so temporary Swift string bridges must not be used.
    static func cString(_ text: StaticString) -> UnsafePointer<CChar> {
        UnsafeRawPointer(text.utf8Start).assumingMemoryBound(to: CChar.self)
    }

    private static func fromData(type: StaticString, _ fill: (OpaquePointer?) -> Bool) throws -> CryptoKey {
        guard let builder = OSSL_PARAM_BLD_new() else { throw CryptoError("OSSL_PARAM_BLD_new") }
        defer { OSSL_PARAM_BLD_free(builder) }
        guard fill(builder), let params = OSSL_PARAM_BLD_to_param(builder) else {
            throw CryptoError("building \(type) key parameters")
        }
        defer { OSSL_PARAM_free(params) }
        guard let context = EVP_PKEY_CTX_new_from_name(nil, cString(type), nil) else {
            throw CryptoError("EVP_PKEY_CTX_new")
        }
        defer { EVP_PKEY_CTX_free(context) }
        var key: OpaquePointer? = nil
        guard EVP_PKEY_fromdata_init(context) == 1,
            EVP_PKEY_fromdata(context, &key, proxyctl_EVP_PKEY_PUBLIC_KEY(), params) == 1, let key
        else { throw CryptoError("importing \(type) key") }
        return CryptoKey(key)
    }

    /// Verifies a JWS signature (RFC 7515) over `signingInput` with `algorithm`.
    public func verify(_ algorithm: JWSAlgorithm, signature: [UInt8], signingInput: [UInt8]) -> Bool {
        guard let typeName = EVP_PKEY_get0_type_name(pkey).map({ String(cString: $0) }), typeName == algorithm.keyType
        else { return false }
        var signatureToCheck = signature
        if algorithm.keyType == "EC" {
            // JWS carries r||s; OpenSSL wants DER (RFC 7518 §3.4).
            guard let der = ECDSASignature.rawToDER(signature, coordinateSize: algorithm.ecCoordinateSize) else {
                return false
            }
            signatureToCheck = der
        }
        guard let context = EVP_MD_CTX_new() else { return false }
        defer { EVP_MD_CTX_free(context) }
        var keyContext: OpaquePointer? = nil
        guard EVP_DigestVerifyInit_ex(context, &keyContext, algorithm.digest, nil, nil, pkey, nil) == 1 else {
            _ = CryptoError.drainQueue()
            return false
        }
        switch algorithm {
        case .ps256, .ps384, .ps512:
            // RFC 7518 §3.5: MGF1 with the same hash, salt as long as the hash.
            guard EVP_PKEY_CTX_set_rsa_padding(keyContext, RSA_PKCS1_PSS_PADDING) == 1,
                EVP_PKEY_CTX_set_rsa_pss_saltlen(keyContext, -1) == 1
            else { return false }
        default:
            break
        }
        let result = EVP_DigestVerify(
            context, signatureToCheck, signatureToCheck.count, signingInput, signingInput.count)
        _ = CryptoError.drainQueue()
        return result == 1
    }
}

/// ECDSA signature encodings.
public enum ECDSASignature {
    /// raw r||s (JWS) to DER (X9.62).
    public static func rawToDER(_ raw: [UInt8], coordinateSize: Int) -> [UInt8]? {
        guard raw.count == coordinateSize * 2, let signature = ECDSA_SIG_new() else { return nil }
        defer { ECDSA_SIG_free(signature) }
        guard let r = BN_bin2bn(raw, Int32(coordinateSize), nil) else { return nil }
        guard
            let s = raw.withUnsafeBufferPointer({
                BN_bin2bn($0.baseAddress! + coordinateSize, Int32(coordinateSize), nil)
            })
        else {
            BN_free(r)
            return nil
        }
        guard ECDSA_SIG_set0(signature, r, s) == 1 else {
            BN_free(r)
            BN_free(s)
            return nil
        }
        var pointer: UnsafeMutablePointer<UInt8>? = nil
        let length = i2d_ECDSA_SIG(signature, &pointer)
        guard length > 0, let pointer else { return nil }
        defer { proxyctl_OPENSSL_free(pointer) }
        return Array(UnsafeBufferPointer(start: pointer, count: Int(length)))
    }

    /// DER (X9.62) to raw r||s (JWS), each left-padded to `coordinateSize` bytes.
    public static func derToRaw(_ der: [UInt8], coordinateSize: Int) -> [UInt8]? {
        var cursor: UnsafePointer<UInt8>? = nil
        return der.withUnsafeBufferPointer { buffer -> [UInt8]? in
            cursor = buffer.baseAddress
            guard let signature = d2i_ECDSA_SIG(nil, &cursor, buffer.count) else { return nil }
            defer { ECDSA_SIG_free(signature) }
            // Trailing garbage after the DER structure is not a signature.
            guard cursor == buffer.baseAddress! + buffer.count else { return nil }
            var raw = [UInt8](repeating: 0, count: coordinateSize * 2)
            let r = ECDSA_SIG_get0_r(signature)
            let s = ECDSA_SIG_get0_s(signature)
            let okR = raw.withUnsafeMutableBufferPointer { BN_bn2binpad(r, $0.baseAddress, Int32(coordinateSize)) }
            let okS = raw.withUnsafeMutableBufferPointer {
                BN_bn2binpad(s, $0.baseAddress! + coordinateSize, Int32(coordinateSize))
            }
            return okR == coordinateSize && okS == coordinateSize ? raw : nil
        }
    }
}
