import COpenSSL
import Dispatch
import ProxyCore
import Synchronization

/// An EC P-256 private key: the local CA's key, leaf keys, DPoP keys.
public final class PrivateKey: @unchecked Sendable {
    // @unchecked Sendable: the EVP_PKEY is not changed after creation; OpenSSL 3 allows concurrent use.
    let pkey: OpaquePointer

    init(_ pkey: OpaquePointer) { self.pkey = pkey }

    deinit {
        signer.withLock { context in
            if let context { EVP_PKEY_CTX_free(context) }
        }
        presigned.withLock { $0.clear() }
        EVP_PKEY_free(pkey)
    }

    /// A new P-256 key.
    public static func generateP256() throws -> PrivateKey {
        guard let context = EVP_PKEY_CTX_new_from_name(nil, CryptoKey.cString("EC"), nil) else {
            throw CryptoError("EVP_PKEY_CTX_new_from_name")
        }
        defer { EVP_PKEY_CTX_free(context) }
        var key: OpaquePointer? = nil
        guard EVP_PKEY_keygen_init(context) == 1, EVP_PKEY_CTX_set_group_name(context, CryptoKey.cString("P-256")) == 1,
            EVP_PKEY_generate(context, &key) == 1, let key
        else { throw CryptoError("generating a P-256 key") }
        return PrivateKey(key)
    }

    /// Reads a PEM private key (PKCS#8 or traditional).
    public static func fromPEM(_ pem: [UInt8]) throws -> PrivateKey {
        let bio = pem.withUnsafeBytes { BIO_new_mem_buf($0.baseAddress, Int32($0.count)) }
        guard let bio else { throw CryptoError("BIO_new_mem_buf") }
        defer { BIO_free(bio) }
        guard let key = PEM_read_bio_PrivateKey(bio, nil, nil, nil) else {
            throw CryptoError("reading a PEM private key")
        }
        return PrivateKey(key)
    }

    /// PKCS#8 PEM, unencrypted (the file's permissions protect it).
    public func pem() throws -> [UInt8] {
        guard let bio = BIO_new(BIO_s_mem()) else { throw CryptoError("BIO_new") }
        defer { BIO_free(bio) }
        guard PEM_write_bio_PrivateKey(bio, pkey, nil, nil, 0, nil, nil) == 1 else {
            throw CryptoError("writing a PEM key")
        }
        return Self.drain(bio)
    }

    /// The public key as SubjectPublicKeyInfo PEM ("BEGIN PUBLIC KEY"), for registrations that take PEM.
    public func publicPEM() throws -> [UInt8] {
        guard let bio = BIO_new(BIO_s_mem()) else { throw CryptoError("BIO_new") }
        defer { BIO_free(bio) }
        guard PEM_write_bio_PUBKEY(bio, pkey) == 1 else { throw CryptoError("writing a PEM public key") }
        return Self.drain(bio)
    }

    static func drain(_ bio: OpaquePointer) -> [UInt8] {
        var pointer: UnsafeMutablePointer<CChar>? = nil
        let length = proxyctl_BIO_get_mem_data(bio, &pointer)
        guard length > 0, let pointer else { return [] }
        return Array(UnsafeRawBufferPointer(start: pointer, count: length))
    }

    /// The public point's coordinates (32 bytes each) for a JWK.
    public func publicCoordinates() throws -> (x: [UInt8], y: [UInt8]) {
        var buffer = [UInt8](repeating: 0, count: 65)
        var length = 0
        guard EVP_PKEY_get_octet_string_param(pkey, CryptoKey.cString("pub"), &buffer, buffer.count, &length) == 1,
            length == 65,
            buffer[0] == 0x04
        else { throw CryptoError("reading the public key") }
        return (Array(buffer[1..<33]), Array(buffer[33..<65]))
    }

    /// The public key as a JWK (RFC 7518 §6.2), members in the RFC 7638 order.
    public func publicJWK() throws -> JSONObject {
        let (x, y) = try publicCoordinates()
        return JSONObject([
            ("crv", "P-256"), ("kty", "EC"), ("x", .string(Base64.urlEncode(x))), ("y", .string(Base64.urlEncode(y))),
        ])
    }

    /// The JWK thumbprint (RFC 7638): base64url(SHA-256 of the required members in lexical order, no spaces).
    public func thumbprint() throws -> String {
        let (x, y) = try publicCoordinates()
        let canonical =
            #"{"crv":"P-256","kty":"EC","x":""# + Base64.urlEncode(x) + #"","y":""# + Base64.urlEncode(y) + #""}"#
        return Base64.urlEncode(Crypto.sha256(canonical))
    }

    /// A signing context set up once and reused (setting one up costs a tenth of a signature); a lock makes
    /// it safe to sign from several threads.
    private let signer = Mutex<OpaquePointer?>(nil)

    /// ECDSA nonces made ahead for `signES256`, once `signAhead()` asked for them. A pair (k⁻¹, r = (k·G).x) is
    /// the scalar multiplication that is most of a P-256 signature; pairs are made in batches on a background
    /// queue, where OpenSSL's precomputed tables for G stay in the cache, and a signature only finishes one
    /// pair with its digest. Made in situ, between a proxy's requests, a signature found those tables evicted:
    /// DPoP cost up to four times `openssl speed`'s signature per request (bench row 10). Each pair is random
    /// (OpenSSL's ECDSA_sign_setup), used once, and cleared from memory when used or when the key goes.
    private let presigned = Mutex<Presigned>(Presigned())
    static let presignBatch = 64
    /// A refill starts when this few are left.
    static let presignLow = 16

    struct Presigned: @unchecked Sendable {
        // @unchecked Sendable: OpenSSL objects owned by the state, touched only while its lock is held (the
        // refill makes pairs with an EC_KEY of its own, then hands them over under the lock).
        var enabled = false
        var refilling = false
        var pairs: [(kinv: OpaquePointer, r: OpaquePointer)] = []
        /// The EC_KEY that finishes signatures (a copy of the key's own, made at the first).
        var signingKey: OpaquePointer?
        /// Signatures made from pairs (for tests).
        var used = 0

        mutating func clear() {
            for pair in pairs {
                BN_clear_free(pair.kinv)
                BN_clear_free(pair.r)
            }
            pairs.removeAll()
            if let signingKey { proxyctl_ec_key_free(signingKey) }
            signingKey = nil
        }
    }

    /// Keeps ECDSA nonces made ahead for this key's signatures (`presigned`): for a key that signs per request,
    /// a proxy's DPoP key.
    public func signAhead() {
        let start = presigned.withLock { state -> Bool in
            state.enabled = true
            guard !state.refilling else { return false }
            state.refilling = true
            return true
        }
        if start { refill() }
    }

    /// Pairs ready, and signatures made from pairs so far.
    var presignedCounts: (ready: Int, used: Int) { presigned.withLock { ($0.pairs.count, $0.used) } }

    /// Makes pairs until the pool holds a batch, off the calling thread.
    private func refill() {
        DispatchQueue.global(qos: .utility).async { [self] in
            var made: [(kinv: OpaquePointer, r: OpaquePointer)] = []
            if let key = proxyctl_ec_key_copy(pkey) {
                let wanted = Self.presignBatch - presigned.withLock { $0.pairs.count }
                for _ in 0..<max(0, wanted) {
                    var kinv: OpaquePointer? = nil
                    var r: OpaquePointer? = nil
                    guard proxyctl_ecdsa_presign(key, &kinv, &r) == 1, let kinv, let r else {
                        BN_clear_free(kinv)
                        BN_clear_free(r)
                        _ = CryptoError.drainQueue()
                        break
                    }
                    made.append((kinv, r))
                }
                proxyctl_ec_key_free(key)
            }
            presigned.withLock { state in
                state.pairs.append(contentsOf: made)
                state.refilling = false
            }
        }
    }

    /// A signature from a pair made ahead, if there is one (nil: sign the usual way).
    private func signPresigned(_ digest: [UInt8]) -> [UInt8]? {
        var raw = [UInt8](repeating: 0, count: 64)
        let (signed, startRefill) = presigned.withLock { state -> (Bool, Bool) in
            guard state.enabled else { return (false, false) }
            var signed = false
            if let pair = state.pairs.popLast() {
                if state.signingKey == nil { state.signingKey = proxyctl_ec_key_copy(pkey) }
                if let key = state.signingKey {
                    signed = proxyctl_ecdsa_sign_presigned(key, digest, pair.kinv, pair.r, &raw) == 1
                    if !signed { _ = CryptoError.drainQueue() }
                }
                BN_clear_free(pair.kinv)
                BN_clear_free(pair.r)
                if signed { state.used += 1 }
            }
            let refill = !state.refilling && state.pairs.count <= Self.presignLow
            if refill { state.refilling = true }
            return (signed, refill)
        }
        if startRefill { refill() }
        return signed ? raw : nil
    }

    /// An ES256 signature over `message` in JWS form: raw r||s, 64 bytes (RFC 7518 §3.4).
    public func signES256(_ message: [UInt8]) throws -> [UInt8] {
        let digest = Crypto.sha256(message)
        if let raw = signPresigned(digest) { return raw }
        var der = [UInt8](repeating: 0, count: 80)
        var length = der.count
        let signed = signer.withLock { context -> Bool in
            if context == nil {
                guard let made = EVP_PKEY_CTX_new_from_pkey(nil, pkey, nil), EVP_PKEY_sign_init(made) == 1 else {
                    return false
                }
                context = made
            }
            return EVP_PKEY_sign(context, &der, &length, digest, digest.count) == 1
        }
        guard signed else { throw CryptoError("EVP_PKEY_sign") }
        guard let raw = ECDSASignature.derToRaw(Array(der[0..<length]), coordinateSize: 32) else {
            throw CryptoError("converting an ECDSA signature")
        }
        return raw
    }
}
