import ProxyCore
import ProxyTLS

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

/// The client's own key for `private_key_jwt` (RFC 7523 §2.2): ES256 (P-256), made by `proxyctl key init`,
/// kept 0600 under `<state_dir>/keys/NAME.client.pem` (or `client_key_file`). Its public JWK is what the
/// provider's client registration holds.
public struct ClientKey: Sendable {
    public let key: PrivateKey
    /// RFC 7638 thumbprint, used as the JWK's `kid`.
    public let kid: String

    public init(_ key: PrivateKey) throws {
        self.key = key
        self.kid = try key.thumbprint()
    }

    /// The key file of a provider: `client_key_file`, else `<state_dir>/keys/<provider>.client.pem`.
    public static func path(stateDirectory: String, provider: ProviderConfig) -> String {
        provider.clientKeyFile ?? "\(stateDirectory)/keys/\(provider.name).client.pem"
    }

    /// Reads the key; nil when the file does not exist.
    public static func load(path: String) throws -> ClientKey? {
        guard FileManager.default.fileExists(atPath: path) else { return nil }
        try SecretFile.checkPrivate(path, what: "the client key")
        guard let pem = FileManager.default.contents(atPath: path) else {
            throw AuthError.configuration(reason: "the client key \(path) cannot be read")
        }
        do {
            return try ClientKey(try PrivateKey.fromPEM(Array(pem)))
        } catch {
            throw AuthError.configuration(reason: "the client key \(path) is not a P-256 private key in PEM: \(error)")
        }
    }

    /// Makes a new key and stores it at `path` (0600 in a 0700 directory, atomically).
    public static func create(path: String) throws -> ClientKey {
        let key = try PrivateKey.generateP256()
        try SecureFile.makePrivateDirectory(PathText.parent(path))
        try SecureFile.write(try key.pem(), to: path, mode: 0o600)
        return try ClientKey(key)
    }

    /// The public JWK to register with the provider: `kty`, `crv`, `x`, `y`, plus `kid`, `use` and `alg`.
    public func publicJWK() throws -> JSONObject {
        var jwk = try key.publicJWK()
        jwk["kid"] = .string(kid)
        jwk["use"] = "sig"
        jwk["alg"] = "ES256"
        return jwk
    }
}

/// Files that hold a secret of the client (the client secret, its key): they must be the user's own and
/// readable by nobody else, or proxyctl refuses them (a static secret's `secret_file` too).
public enum SecretFile {
    public static func checkPrivate(_ path: String, what: String) throws(AuthError) {
        var info = stat()
        guard stat(path, &info) == 0 else {
            throw AuthError.configuration(
                reason: "\(what) \(path) cannot be read: \(String(cString: strerror(errno)))")
        }
        guard info.st_uid == getuid() else {
            throw AuthError.configuration(reason: "\(what) \(path) belongs to another user; it must be yours")
        }
        guard info.st_mode & 0o077 == 0 else {
            throw AuthError.configuration(
                reason: "\(what) \(path) can be read by other users; run: chmod 600 \(path)")
        }
    }

    /// The secret in the file: its first line, without the line end.
    public static func read(_ path: String, what: String) throws(AuthError) -> [UInt8] {
        try checkPrivate(path, what: what)
        guard let data = FileManager.default.contents(atPath: path) else {
            throw AuthError.configuration(reason: "\(what) \(path) cannot be read")
        }
        let bytes = Array(data.prefix { $0 != 0x0A && $0 != 0x0D })
        guard !bytes.isEmpty else { throw AuthError.configuration(reason: "\(what) \(path) is empty") }
        return bytes
    }
}

/// Client authentication at the token endpoint (RFC 6749 §2.3, RFC 7523 §2.2, OpenID Connect Core §9),
/// applied to every token request of a confidential client. The secret and the key never leave this value:
/// nothing here is logged or printed, and every assertion is new (its own `jti`, one minute of life).
public struct ClientAuthentication: Sendable {
    public let method: ClientAuthMethod
    public let clientID: String
    private let secret: [UInt8]?
    private let key: ClientKey?
    /// Whom a client assertion names as its audience (`client_assertion_audience`).
    public let audience: AssertionAudience

    static let assertionType = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"

    init(
        method: ClientAuthMethod, clientID: String, secret: [UInt8]?, key: ClientKey?,
        audience: AssertionAudience = .issuer
    ) {
        self.method = method
        self.clientID = clientID
        self.secret = secret
        self.key = key
        self.audience = audience
    }

    /// The provider's client authentication, reading its secret or key; nil for a public client.
    public static func load(provider: ProviderConfig, stateDirectory: String) throws -> ClientAuthentication? {
        switch provider.effectiveClientAuth {
        case .none:
            return nil
        case .privateKeyJWT:
            let path = ClientKey.path(stateDirectory: stateDirectory, provider: provider)
            guard let key = try ClientKey.load(path: path) else {
                throw AuthError.configuration(
                    reason:
                        "[provider \(provider.name)] authenticates with private_key_jwt, and there is no client key at \(path); run: proxyctl key init \(provider.name), then register the public key it prints with the provider"
                )
            }
            return ClientAuthentication(
                method: .privateKeyJWT, clientID: provider.clientID, secret: nil, key: key,
                audience: provider.clientAssertionAudience)
        case .clientSecretBasic, .clientSecretPost, .clientSecretJWT:
            guard let file = provider.clientSecretFile else {
                throw AuthError.configuration(reason: "[provider \(provider.name)] has no client_secret_file")
            }
            let secret = try SecretFile.read(file, what: "the client secret file")
            return ClientAuthentication(
                method: provider.effectiveClientAuth, clientID: provider.clientID, secret: secret, key: nil,
                audience: provider.clientAssertionAudience)
        }
    }

    /// The form parameters and header fields of a token request authenticated this way. `parameters` carry
    /// `client_id` as a public client would send it. `issuer` and `tokenEndpoint` are the provider's, from its
    /// metadata: a client assertion names one of them as its audience.
    func apply(
        to parameters: [(String, String)], issuer: String, tokenEndpoint: String, now: Int64
    ) throws -> (parameters: [(String, String)], headers: [(name: String, value: String)]) {
        var form = parameters
        if !form.contains(where: { $0.0 == "client_id" }) { form.append(("client_id", clientID)) }
        switch method {
        case .none:
            return (form, [])
        case .clientSecretBasic:
            // RFC 6749 §2.3.1: both form-urlencoded, then joined with ":" and base64.
            form.removeAll { $0.0 == "client_id" }
            let user = FormEncoding.percentEncode(clientID)
            let password = FormEncoding.percentEncode(String(decoding: secret ?? [], as: UTF8.self))
            let credentials = Base64.encode(Array("\(user):\(password)".utf8))
            return (form, [("Authorization", "Basic \(credentials)")])
        case .clientSecretPost:
            form.append(("client_secret", String(decoding: secret ?? [], as: UTF8.self)))
            return (form, [])
        case .clientSecretJWT, .privateKeyJWT:
            form.append(("client_assertion_type", Self.assertionType))
            let aud = audience == .issuer ? issuer : tokenEndpoint
            form.append(("client_assertion", try assertion(audience: aud, now: now)))
            return (form, [])
        }
    }

    /// A client assertion (RFC 7523 §3): `iss` and `sub` the client, `aud` one string (the issuer by default,
    /// as draft-ietf-oauth-rfc7523bis §3 requires; the token endpoint for providers that want OpenID Connect
    /// Core §9's), a fresh `jti`, `iat` and `exp` one minute later.
    func assertion(audience: String, now: Int64) throws -> String {
        var claims = JSONObject()
        claims["iss"] = .string(clientID)
        claims["sub"] = .string(clientID)
        claims["aud"] = .string(audience)
        claims["jti"] = .string(Crypto.randomToken(bytes: 16))
        claims["iat"] = .int(now)
        claims["exp"] = .int(now + 60)
        var header = JSONObject()
        let signature: ([UInt8]) throws -> [UInt8]
        if method == .privateKeyJWT, let key {
            header["alg"] = "ES256"
            header["typ"] = "JWT"
            header["kid"] = .string(key.kid)
            signature = { try key.key.signES256($0) }
        } else if let secret {
            header["alg"] = "HS256"
            header["typ"] = "JWT"
            signature = { Crypto.hmacSHA256(key: secret, message: $0) }
        } else {
            throw AuthError.configuration(reason: "no client key or secret to sign the client assertion")
        }
        let signingInput =
            Base64.urlEncode(Array(JSON.serialize(.object(header)).utf8)) + "."
            + Base64.urlEncode(Array(JSON.serialize(.object(claims)).utf8))
        return signingInput + "." + Base64.urlEncode(try signature(Array(signingInput.utf8)))
    }
}
