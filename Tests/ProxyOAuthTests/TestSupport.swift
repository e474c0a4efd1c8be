import Foundation
import ProxyCore
import Synchronization
import TestFixtures
import Testing

@testable import ProxyOAuth

/// A JSON object from its text; records an issue and throws when the text is not one.
func jsonObject(_ text: String, sourceLocation: SourceLocation = #_sourceLocation) throws -> JSONObject {
    try #require(try JSON.parse(text).get().object, sourceLocation: sourceLocation)
}

/// A key set of the given JWKs (JSON texts).
func keySet(_ jwks: String...) throws -> JWKSet {
    let document = JSONObject([("keys", .array(try jwks.map { .object(try jsonObject($0)) }))])
    return try JWKSet.parse(document).get()
}

/// A JWK text with members replaced (nil removes).
func modifiedJWK(_ jwk: String, _ changes: [String: JSONValue?]) throws -> String {
    var object = try jsonObject(jwk)
    for (name, value) in changes { object[name] = value }
    return JSON.serialize(.object(object))
}

/// The parsed token; throws the parse error when it does not parse.
func parsedJWT(_ compact: String) throws -> JWT {
    try JWT.parse(compact).get()
}

/// base64url of a JSON object's compact serialisation.
func encodedPart(_ object: JSONObject) -> String {
    Base64.urlEncode(Array(JSON.serialize(.object(object)).utf8))
}

/// The category and message of an `AuthError`, for asserting which rule fired.
func authError(_ error: any Error) -> (category: String, message: String)? {
    guard let error = error as? AuthError else { return nil }
    return (error.category, error.description)
}

/// A value shared between a test and the closures it hands out.
final class Shared<Value: Sendable>: Sendable {
    private let storage: Mutex<Value>

    init(_ value: Value) { storage = Mutex(value) }

    var value: Value { storage.withLock { $0 } }
    func set(_ value: Value) { storage.withLock { $0 = value } }
    func update(_ change: (inout Value) -> Void) { storage.withLock { change(&$0) } }
}

/// The permission bits of a file or directory, not following symbolic links.
func mode(_ path: String) -> mode_t? {
    var info = stat()
    guard lstat(path, &info) == 0 else { return nil }
    return info.st_mode & 0o7777
}

/// Writes `text` to `path` in place (open, truncate, write), as a careless tool would.
func writeInPlace(_ path: String, _ text: String) throws {
    let fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0o600)
    try #require(fd >= 0)
    defer { close(fd) }
    let bytes = Array(text.utf8)
    let written = bytes.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
    try #require(written == bytes.count)
}

/// How long a refresh may take in a test that is not about that deadline: far beyond any run of the suite. A
/// deadline measured on the wall clock made such tests fail on a loaded 2-core machine, where a refresh task could
/// wait its turn on Swift's cooperative pool for longer than `token_timeout`'s 30 s default while other suites ran;
/// a test about the deadline names its own (`tokenTimeout: 200`).
let unhurriedTokenTimeout = 30 * 60_000

/// The test provider's configuration.
func testProvider(name: String = "test", tokenTimeout: Int = unhurriedTokenTimeout) -> ProviderConfig {
    var provider = ProviderConfig(name: name)
    provider.tokenTimeout = tokenTimeout
    provider.issuer = JWSFixtures.issuer
    provider.clientID = JWSFixtures.clientID
    provider.scopes = ["openid", "profile"]
    return provider
}

/// Stored tokens for the test provider.
func storedTokens(
    provider: String = "test", accessToken: String = "access-1", refreshToken: String? = "refresh-1",
    issuedAt: Int64, expiresAt: Int64?, generation: Int64 = 1, subject: String? = JWSFixtures.subject
) -> TokenSet {
    TokenSet(
        provider: provider, issuer: JWSFixtures.issuer, clientID: JWSFixtures.clientID, accessToken: accessToken,
        tokenType: "Bearer", issuedAt: issuedAt, expiresAt: expiresAt, refreshToken: refreshToken, idToken: nil,
        scope: "openid profile", identity: subject.map(Identity.init(subject:)), generation: generation)
}

/// An in-memory identity provider: a discovery document, the fixture JWKS and a token endpoint that answers
/// with `tokenReply`, counting requests.
final class FakeProvider: HTTPTransport {
    static let discoveryURL = JWSFixtures.issuer + "/.well-known/openid-configuration"
    static let jwksURL = JWSFixtures.issuer + "/jwks"
    static let tokenURL = JWSFixtures.issuer + "/token"

    /// One token request as the endpoint saw it.
    struct TokenRequest: Sendable {
        let index: Int
        let form: [String: String]
    }

    private struct Counters {
        /// "token" and "jwks", in the order the requests came.
        var order: [String] = []
        var tokenRequests: [TokenRequest] = []
        var discoveryRequests = 0
        var jwksRequests = 0
    }

    private let counters = Mutex(Counters())
    private let delay: Duration
    private let tokenReply: @Sendable (TokenRequest) async throws -> HTTPResponse

    /// `tokenReply` is called with the 1-based index of the request and its form.
    init(delay: Duration = .zero, tokenReply: @escaping @Sendable (TokenRequest) async throws -> HTTPResponse) {
        self.delay = delay
        self.tokenReply = tokenReply
    }

    var tokenRequests: [TokenRequest] { counters.withLock { $0.tokenRequests } }
    var discoveryRequests: Int { counters.withLock { $0.discoveryRequests } }
    var jwksRequests: Int { counters.withLock { $0.jwksRequests } }
    var order: [String] { counters.withLock { $0.order } }

    func send(_ request: HTTPRequest) async throws -> HTTPResponse {
        switch (request.method, request.url) {
        case ("GET", Self.discoveryURL):
            counters.withLock { $0.discoveryRequests += 1 }
            return Self.json(
                200,
                [
                    "issuer": .string(JWSFixtures.issuer),
                    "authorization_endpoint": "https://idp.example.com/authorize",
                    "token_endpoint": .string(Self.tokenURL), "jwks_uri": .string(Self.jwksURL),
                    "code_challenge_methods_supported": ["S256"],
                ])
        case ("GET", Self.jwksURL):
            counters.withLock {
                $0.jwksRequests += 1
                $0.order.append("jwks")
            }
            let keys = try [JWSFixtures.rsa1, JWSFixtures.ec1].map { JSONValue.object(try jsonObject($0)) }
            return Self.json(200, ["keys": .array(keys)])
        case ("POST", Self.tokenURL):
            let form = Dictionary(
                (FormEncoding.decode(String(decoding: request.body, as: UTF8.self)) ?? []), uniquingKeysWith: { $1 })
            let tokenRequest = counters.withLock { counters in
                let tokenRequest = TokenRequest(index: counters.tokenRequests.count + 1, form: form)
                counters.tokenRequests.append(tokenRequest)
                counters.order.append("token")
                return tokenRequest
            }
            if delay > .zero { try await Task.sleep(for: delay) }
            return try await tokenReply(tokenRequest)
        default:
            return HTTPResponse(status: 404)
        }
    }

    static func json(_ status: Int, _ object: JSONObject, headers: [(name: String, value: String)] = []) -> HTTPResponse
    {
        HTTPResponse(
            status: status, headers: [("Content-Type", "application/json")] + headers,
            body: Array(JSON.serialize(.object(object)).utf8))
    }

    static func json(_ status: Int, _ value: JSONValue, headers: [(name: String, value: String)] = []) -> HTTPResponse {
        json(status, value.object ?? JSONObject(), headers: headers)
    }

    /// A successful token response.
    static func tokens(
        access: String, refresh: String? = nil, expiresIn: Int64 = 3600, idToken: String? = nil
    ) -> HTTPResponse {
        var object = JSONObject([
            ("access_token", .string(access)), ("token_type", "Bearer"), ("expires_in", .int(expiresIn)),
        ])
        if let refresh { object["refresh_token"] = .string(refresh) }
        if let idToken { object["id_token"] = .string(idToken) }
        return json(200, object)
    }
}
