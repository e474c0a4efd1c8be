import ProxyCore
import TestFixtures
import Testing

@testable import ProxyOAuth

/// A transport that answers with `route` and remembers every URL asked for.
private final class RoutedTransport: HTTPTransport {
    private let log = Shared<[String]>([])
    private let route: @Sendable (HTTPRequest) async throws -> HTTPResponse

    init(_ route: @escaping @Sendable (HTTPRequest) async throws -> HTTPResponse) { self.route = route }

    var urls: [String] { log.value }

    func send(_ request: HTTPRequest) async throws -> HTTPResponse {
        log.update { $0.append(request.url) }
        return try await route(request)
    }
}

private func discoveryDocument(issuer: String = JWSFixtures.issuer) -> HTTPResponse {
    FakeProvider.json(
        200,
        [
            "issuer": .string(issuer), "token_endpoint": .string(JWSFixtures.issuer + "/token"),
            "jwks_uri": .string(JWSFixtures.issuer + "/jwks"),
        ])
}

private func client(_ transport: RoutedTransport, issuer: String = JWSFixtures.issuer) async -> ProviderClient {
    var config = testProvider()
    config.issuer = issuer
    let client = ProviderClient(config: config, transport: transport)
    await client.setSleep { _ in }
    return client
}

@Suite struct ProviderClientDiscoveryTests {
    @Test func discoveryIsFetchedOnce() async throws {
        let transport = RoutedTransport { _ in discoveryDocument() }
        let provider = await client(transport)
        for _ in 0..<3 { _ = try await provider.discover() }
        #expect(transport.urls == [FakeProvider.discoveryURL])
    }

    @Test func fallsBackToRFC8414When404() async throws {
        let issuer = "https://idp.example.com/tenant"
        let transport = RoutedTransport { request in
            request.url.contains("oauth-authorization-server")
                ? discoveryDocument(issuer: issuer) : HTTPResponse(status: 404)
        }
        let metadata = try await client(transport, issuer: issuer).discover()
        #expect(metadata.issuer == issuer)
        #expect(
            transport.urls == [
                "https://idp.example.com/tenant/.well-known/openid-configuration",
                "https://idp.example.com/.well-known/oauth-authorization-server/tenant",
            ])
    }

    @Test func noDocumentAnywhereIsAConfigurationError() async throws {
        let transport = RoutedTransport { _ in HTTPResponse(status: 404) }
        let error = try await #require(throws: AuthError.self) { try await client(transport).discover() }
        #expect(error.category == "configuration")
        #expect(error.description.contains("check issuer in [provider test]"))
    }

    @Test func issuerMismatchIsAConfigurationError() async throws {
        let transport = RoutedTransport { _ in discoveryDocument(issuer: "https://idp.example.com/") }
        let error = try await #require(throws: AuthError.self) { try await client(transport).discover() }
        #expect(error.category == "configuration")
    }

    @Test func outageIsRecoverableWithItsRetryAfter() async throws {
        let transport = RoutedTransport { _ in HTTPResponse(status: 503, headers: [("Retry-After", "30")]) }
        let error = try await #require(throws: AuthError.self) { try await client(transport).discover() }
        guard case .recoverable(_, let retryAfter) = error else {
            Issue.record("expected recoverable, got \(error)")
            return
        }
        #expect(retryAfter == 30)
    }

    @Test func unreachableProviderIsRecoverableAndCertificateProblemsAreConfiguration() async throws {
        let down = RoutedTransport { _ in throw TransportError.unreachable("connection refused") }
        #expect(
            try await #require(throws: AuthError.self) { try await client(down).discover() }.category == "recoverable")
        let badCertificate = RoutedTransport { _ in throw TransportError.certificate("unknown CA") }
        let error = try await #require(throws: AuthError.self) { try await client(badCertificate).discover() }
        #expect(error.category == "configuration")
        #expect(error.description.contains("ca_file"))
    }
}

@Suite struct ProviderClientKeysTests {
    @Test func keySetIsCachedUntilARefreshIsAsked() async throws {
        let key = try jsonObject(JWSFixtures.rsa1)
        let transport = RoutedTransport { request in
            request.url == FakeProvider.jwksURL ? FakeProvider.json(200, ["keys": [.object(key)]]) : discoveryDocument()
        }
        let provider = await client(transport)
        #expect(try await provider.jwks(refresh: false).keys.map(\.kid) == ["rsa-1"])
        _ = try await provider.jwks(refresh: false)
        #expect(transport.urls.filter { $0 == FakeProvider.jwksURL }.count == 1)
        _ = try await provider.jwks(refresh: true)
        #expect(transport.urls.filter { $0 == FakeProvider.jwksURL }.count == 2)
    }

    @Test func brokenKeySetIsRecoverable() async throws {
        let transport = RoutedTransport { request in
            request.url == FakeProvider.jwksURL
                ? HTTPResponse(status: 200, body: Array("{}".utf8)) : discoveryDocument()
        }
        let error = try await #require(throws: AuthError.self) { try await client(transport).jwks(refresh: false) }
        #expect(error.category == "recoverable")
    }
}

@Suite struct ProviderClientTokenRetryTests {
    @Test func retryAfterLongerThanTheLimitIsNotWaitedFor() async throws {
        let transport = RoutedTransport { request in
            request.url == FakeProvider.tokenURL
                ? HTTPResponse(status: 429, headers: [("Retry-After", "6")]) : discoveryDocument()
        }
        let error = try await #require(throws: AuthError.self) {
            try await client(transport).postToken([("grant_type", "refresh_token")])
        }
        #expect(error == .recoverable(reason: "the provider's token endpoint is unavailable (HTTP 429)", retryAfter: 6))
        #expect(transport.urls.filter { $0 == FakeProvider.tokenURL }.count == 1)
    }

    @Test func oauthErrorsAreNotRetried() async throws {
        let transport = RoutedTransport { request in
            request.url == FakeProvider.tokenURL
                ? FakeProvider.json(400, ["error": "invalid_grant"]) : discoveryDocument()
        }
        let outcome = try await client(transport).postToken([("grant_type", "refresh_token")])
        guard case .failure(.oauth(let error, 400, nil)) = outcome else {
            Issue.record("unexpected \(outcome)")
            return
        }
        #expect(error.error == "invalid_grant")
        #expect(transport.urls.filter { $0 == FakeProvider.tokenURL }.count == 1)
    }

    @Test func tokenRequestIsAFormPost() async throws {
        let seen = Shared<HTTPRequest?>(nil)
        let transport = RoutedTransport { request in
            guard request.url == FakeProvider.tokenURL else { return discoveryDocument() }
            seen.set(request)
            return FakeProvider.tokens(access: "a")
        }
        _ = try await client(transport).postToken([("grant_type", "refresh_token"), ("refresh_token", "r t+")])
        let request = try #require(seen.value)
        #expect(request.method == "POST")
        #expect(String(decoding: request.body, as: UTF8.self) == "grant_type=refresh_token&refresh_token=r%20t%2B")
        #expect(request.headers.first { $0.name == "Content-Type" }?.value == "application/x-www-form-urlencoded")
        #expect(request.headers.first { $0.name == "DPoP" } == nil)
    }
}
