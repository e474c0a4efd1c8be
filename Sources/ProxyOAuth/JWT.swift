import ProxyCore
import ProxyTLS

/// A compact JWS (RFC 7515 §7.1) carrying a JWT: parsed, not yet trusted.
public struct JWT: Sendable {
    public let header: JSONObject
    public let claims: JSONObject
    public let signature: [UInt8]
    /// ASCII(BASE64URL(header) || "." || BASE64URL(payload)): what the signature covers.
    public let signingInput: [UInt8]

    public struct ParseError: Error, Sendable, Equatable, CustomStringConvertible {
        public let reason: String
        public var description: String { reason }
    }

    /// Parses `compact`; any deviation from the compact serialisation is an error.
    public static func parse(_ compact: String) -> Result<JWT, ParseError> {
        let parts = compact.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3 else { return .failure(ParseError(reason: "not a compact JWS (expected 3 parts)")) }
        guard parts.allSatisfy(isBase64URL) else {
            return .failure(ParseError(reason: "a JWS part is not unpadded base64url"))
        }
        guard let headerBytes = Base64.decode(parts[0]), let payloadBytes = Base64.decode(parts[1]),
            let signature = Base64.decode(parts[2])
        else { return .failure(ParseError(reason: "a JWS part is not valid base64url")) }
        guard case .success(.object(let header)) = JSON.parse(headerBytes) else {
            return .failure(ParseError(reason: "the JWS header is not a JSON object"))
        }
        guard case .success(.object(let claims)) = JSON.parse(payloadBytes) else {
            return .failure(ParseError(reason: "the JWT claims are not a JSON object"))
        }
        guard header["alg"]?.string != nil else { return .failure(ParseError(reason: "the JWS header has no alg")) }
        // RFC 7515 §4.1.11: unknown critical extensions make the JWS invalid.
        if header["crit"] != nil { return .failure(ParseError(reason: "the JWS uses critical extensions")) }
        let signingInput = Array(parts[0].utf8) + [UInt8(ascii: ".")] + Array(parts[1].utf8)
        return .success(JWT(header: header, claims: claims, signature: signature, signingInput: signingInput))
    }

    static func isBase64URL(_ part: Substring) -> Bool {
        part.utf8.allSatisfy { byte in
            ASCIIClass.isAlphanumeric(byte) || byte == UInt8(ascii: "-") || byte == UInt8(ascii: "_")
        }
    }

    public var algorithm: String { header["alg"]?.string ?? "" }
    public var keyID: String? { header["kid"]?.string }
}

enum ASCIIClass {
    static func isAlphanumeric(_ byte: UInt8) -> Bool {
        (byte >= 0x30 && byte <= 0x39) || (byte >= 0x41 && byte <= 0x5A) || (byte >= 0x61 && byte <= 0x7A)
    }
}

/// A JSON Web Key Set (RFC 7517 §5).
public struct JWKSet: Sendable {
    public struct Key: Sendable {
        public let kid: String?
        public let kty: String
        public let alg: String?
        public let use: String?
        public let jwk: JSONObject
    }

    public let keys: [Key]

    public static func parse(_ document: JSONObject) -> Result<JWKSet, JWT.ParseError> {
        guard let array = document["keys"]?.array else {
            return .failure(JWT.ParseError(reason: "the JWKS has no keys array"))
        }
        var keys: [Key] = []
        for value in array {
            guard let jwk = value.object, let kty = jwk["kty"]?.string else { continue }
            keys.append(
                Key(kid: jwk["kid"]?.string, kty: kty, alg: jwk["alg"]?.string, use: jwk["use"]?.string, jwk: jwk))
        }
        return .success(JWKSet(keys: keys))
    }

    /// Keys that may have made a signature with `algorithm` and `kid`: by kid when the token names one, else
    /// every key of the right type. Encryption keys (`use: enc`) never verify signatures.
    public func candidates(algorithm: JWSAlgorithm, kid: String?) -> [Key] {
        keys.filter { key in
            key.kty == algorithm.keyType && key.use != "enc" && (key.alg == nil || key.alg == algorithm.rawValue)
                && (kid == nil || key.kid == kid)
        }
    }
}

/// Verifies a JWT's signature against a key set.
public enum JWSVerifier {
    public enum Outcome: Sendable, Equatable {
        case valid
        /// No key in the set matches the token's kid: the provider may have rotated its keys.
        case unknownKey
        case invalid(String)
    }

    public static func verify(
        _ jwt: JWT, keys: JWKSet, allowed: Set<JWSAlgorithm> = Set(JWSAlgorithm.allCases)
    ) -> Outcome {
        // "none" and HMAC algorithms are never accepted: a public client has no shared secret.
        guard let algorithm = JWSAlgorithm(rawValue: jwt.algorithm), allowed.contains(algorithm) else {
            return .invalid("is signed with \(AuthText.clip(jwt.algorithm, 20)), which is not accepted")
        }
        let candidates = keys.candidates(algorithm: algorithm, kid: jwt.keyID)
        if candidates.isEmpty { return .unknownKey }
        for candidate in candidates {
            guard let key = try? CryptoKey.publicKey(jwk: candidate.jwk) else { continue }
            if key.verify(algorithm, signature: jwt.signature, signingInput: jwt.signingInput) { return .valid }
        }
        return .invalid("has a signature that does not verify with the provider's keys")
    }
}
