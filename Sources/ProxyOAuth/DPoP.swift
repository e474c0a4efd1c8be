import ProxyCore
import ProxyTLS
import Synchronization

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// A DPoP key (RFC 9449): an ES256 (P-256) key kept beside the tokens, with its public JWK and thumbprint
/// computed once.
public final class DPoPKey: Sendable {
    public let key: PrivateKey
    /// RFC 7638 thumbprint: the `dpop_jkt` and the tokens' `cnf.jkt`.
    public let thumbprint: String
    /// base64url of the protected header `{"typ":"dpop+jwt","alg":"ES256","jwk":{...}}`, built once.
    let encodedHeader: String
    /// The last access token's `ath`: the same token signs many proofs.
    private let lastHash = Mutex<(token: String, ath: String)?>(nil)
    /// Random bytes for the proofs' `jti`s, drawn from OpenSSL for 64 proofs at a time: a draw is a call into
    /// its generator and a getpid system call (its fork check), about 8,000 instructions for 12 bytes.
    private let jtiBytes = Mutex<(bytes: [UInt8], used: Int)>(([], 0))
    static let jtiLength = 12

    public init(_ key: PrivateKey) throws {
        self.key = key
        self.thumbprint = try key.thumbprint()
        let jwk = JSON.serialize(.object(try key.publicJWK()))
        self.encodedHeader = Base64.urlEncode(Array(#"{"typ":"dpop+jwt","alg":"ES256","jwk":\#(jwk)}"#.utf8))
    }

    /// The key file of a provider: `<state_dir>/keys/<provider>.dpop.pem`, 0600.
    public static func path(stateDirectory: String, provider: String) -> String {
        "\(stateDirectory)/keys/\(provider).dpop.pem"
    }

    /// Reads the provider's key; nil when there is none yet.
    public static func load(stateDirectory: String, provider: String) throws -> DPoPKey? {
        // token_store = secret-service: the key is in the Secret Service; the file is the fallback.
        if let service = SecretService.configured, service.stateDirectory == stateDirectory,
            let pem = try? service.lookup(provider: provider, kind: .dpopKey)
        {
            return try DPoPKey(try PrivateKey.fromPEM(pem))
        }
        let file = path(stateDirectory: stateDirectory, provider: provider)
        guard let pem = FileManager.default.contents(atPath: file) else { return nil }
        return try DPoPKey(try PrivateKey.fromPEM(Array(pem)))
    }

    /// Makes a new key and stores it (0600, atomically), replacing any earlier one.
    public static func create(stateDirectory: String, provider: String) throws -> DPoPKey {
        let key = try PrivateKey.generateP256()
        if let service = SecretService.configured, service.stateDirectory == stateDirectory,
            (try? service.store(try key.pem(), provider: provider, kind: .dpopKey)) != nil
        {
            // An older key file would be read if the Secret Service went away: it must not outlive its key.
            unlink(path(stateDirectory: stateDirectory, provider: provider))
            return try DPoPKey(key)
        }
        try SecureFile.makePrivateDirectory(stateDirectory)
        try SecureFile.makePrivateDirectory(stateDirectory + "/keys")
        try SecureFile.write(try key.pem(), to: path(stateDirectory: stateDirectory, provider: provider), mode: 0o600)
        return try DPoPKey(key)
    }

    /// A DPoP proof JWT (RFC 9449 §4.2) for a request: `htm` and `htu` name it, `ath` binds an access token,
    /// `nonce` is the server's latest. A fresh `jti` (96 random bits) each time.
    public func proof(
        method: String, url: String, accessToken: String? = nil, nonce: String? = nil, now: Int64
    ) throws
        -> String
    {
        // Built as bytes: as String appends (a scalar at a time for the JSON strings) the proof's own work
        // was a fifth of its ES256 signature (`scripts/instructions --dpop`).
        var claims: [UInt8] = []
        claims.reserveCapacity(160 + url.utf8.count + (nonce?.utf8.count ?? 0))
        claims.append(contentsOf: #"{"jti":""#.utf8)
        let jti = jtiBytes.withLock { state -> ArraySlice<UInt8> in
            if state.used + Self.jtiLength > state.bytes.count {
                state = (Crypto.randomBytes(Self.jtiLength * 64), 0)
            }
            defer { state.used += Self.jtiLength }
            return state.bytes[state.used..<state.used + Self.jtiLength]
        }
        claims.append(contentsOf: Base64.urlEncode(jti).utf8)
        claims.append(contentsOf: #"","htm":"#.utf8)
        JSON.writeString(method, to: &claims)
        claims.append(contentsOf: #","htu":"#.utf8)
        JSON.writeString(DPoPKey.htu(url), to: &claims)
        claims.append(contentsOf: #","iat":"#.utf8)
        claims.append(contentsOf: String(now).utf8)
        if let accessToken {
            // RFC 9449 §4.2: ath = base64url(SHA-256(ASCII(access token))).
            let ath = lastHash.withLock { cached -> String in
                if let cached, cached.token == accessToken { return cached.ath }
                let fresh = Base64.urlEncode(Crypto.sha256(accessToken.utf8))
                cached = (accessToken, fresh)
                return fresh
            }
            claims.append(contentsOf: #","ath":""#.utf8)
            claims.append(contentsOf: ath.utf8)
            claims.append(UInt8(ascii: "\""))
        }
        if let nonce {
            claims.append(contentsOf: #","nonce":"#.utf8)
            JSON.writeString(nonce, to: &claims)
        }
        claims.append(UInt8(ascii: "}"))
        var jwt: [UInt8] = []
        jwt.reserveCapacity(encodedHeader.utf8.count + claims.count * 4 / 3 + 92)
        jwt.append(contentsOf: encodedHeader.utf8)
        jwt.append(UInt8(ascii: "."))
        jwt.append(contentsOf: Base64.urlEncode(claims).utf8)
        let signature = try key.signES256(jwt)
        jwt.append(UInt8(ascii: "."))
        jwt.append(contentsOf: Base64.urlEncode(signature).utf8)
        return String(decoding: jwt, as: UTF8.self)
    }

    /// `htu` (RFC 9449 §4.2, §4.3): the URI without query and fragment, scheme and host lower-case, the
    /// default port left out.
    public static func htu(_ url: String) -> String {
        guard case .success(let parsed) = AbsoluteURL.parse(TargetText.split(url, at: "#").before) else {
            return TargetText.withoutQuery(url)
        }
        let path = TargetText.split(parsed.pathAndQuery, at: "?").before
        return "\(parsed.scheme)://\(parsed.hostFieldValue)\(path.isEmpty ? "/" : path)"
    }
}

/// The latest DPoP nonce of each server (authorization server or resource origin), from the `DPoP-Nonce`
/// field of every response, 200s included (RFC 9449 §8, §9).
public final class DPoPNonces: Sendable {
    private struct State {
        var nonces: [String: String] = [:]
        /// The origin of each URL asked about: the callers ask with the few URLs of their origins and token
        /// endpoints, once per request, and parsing one costs more than the rest of the lookup.
        var origins: [String: String] = [:]

        mutating func origin(_ url: String) -> String? {
            if let known = origins[url] { return known }
            guard let origin = DPoPNonces.origin(url) else { return nil }
            if origins.count >= 64 { origins.removeAll(keepingCapacity: true) }
            origins[url] = origin
            return origin
        }
    }

    private let state = Mutex(State())

    public init() {}

    /// The nonce for the server of `url` (by origin).
    public func nonce(for url: String) -> String? {
        state.withLock { state in state.origin(url).flatMap { state.nonces[$0] } }
    }

    public func remember(_ nonce: String?, for url: String) {
        guard let nonce, !nonce.isEmpty else { return }
        state.withLock { state in
            guard let key = state.origin(url) else { return }
            state.nonces[key] = nonce
        }
    }

    static func origin(_ url: String) -> String? {
        guard case .success(let parsed) = AbsoluteURL.parse(url) else { return nil }
        return "\(parsed.scheme)://\(parsed.authority)"
    }
}
