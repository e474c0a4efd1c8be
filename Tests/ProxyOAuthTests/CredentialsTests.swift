import Foundation
import ProxyCore
import ProxyTLS
import TestFixtures
import Testing

@testable import ProxyOAuth

private let now = Int64(Date().timeIntervalSince1970)

/// A manager over a fresh store and an in-memory provider.
private struct Setup {
    let temporary: TemporaryDirectory
    let store: TokenStore
    let fake: FakeProvider
    let manager: TokenManager

    init(
        provider: ProviderConfig = testProvider(), initial: TokenSet? = nil,
        authentication: ClientAuthentication? = nil,
        reply: @escaping @Sendable (FakeProvider.TokenRequest) async throws -> HTTPResponse
    ) async throws {
        temporary = try TemporaryDirectory()
        store = TokenStore(stateDirectory: temporary.path + "/state")
        if let initial { try store.save(initial) }
        fake = FakeProvider(tokenReply: reply)
        let client = ProviderClient(config: provider, transport: fake)
        await client.setClientAuthentication(authentication)
        manager = TokenManager(provider: provider, store: store, client: client)
    }
}

@Suite struct AudienceTokenTests {
    static let key = TokenKey(provider: "test", resource: "https://a.test/", scopes: ["api.read"])

    @Test func aTokenForAnOriginsAudienceComesFromTheRefreshTokenWithResourceAndScope() async throws {
        let setup = try await Setup(initial: storedTokens(issuedAt: now - 10, expiresAt: now + 3600)) { request in
            FakeProvider.tokens(access: "for-a-\(request.index)", refresh: "refresh-\(request.index + 1)")
        }
        let view = try await setup.manager.currentTokens(for: Self.key)
        #expect(view.accessToken == "for-a-1")
        let form = try #require(setup.fake.tokenRequests.first?.form)
        #expect(form["grant_type"] == "refresh_token" && form["refresh_token"] == "refresh-1")
        #expect(form["resource"] == "https://a.test/" && form["scope"] == "api.read")
        // The provider's own token is untouched; the rotated refresh token is stored; the origin's token is kept.
        let disk = try #require(try setup.store.load("test"))
        #expect(disk.accessToken == "access-1" && disk.refreshToken == "refresh-2")
        #expect(disk.view(for: TokenKey(provider: "test"))?.generation == 1)
        #expect(disk.audienceTokens[Self.key.id]?.accessToken == "for-a-1")
        #expect(disk.view(for: Self.key)?.generation == view.generation && view.generation == 2)
        // Cached: no second request; the provider's token needs none either.
        #expect(try await setup.manager.currentTokens(for: Self.key).accessToken == "for-a-1")
        #expect(try await setup.manager.currentTokens().accessToken == "access-1")
        #expect(setup.fake.tokenRequests.count == 1)
        // Another audience gets its own token, never this one.
        let other = TokenKey(provider: "test", resource: "https://b.test/")
        #expect(try await setup.manager.currentTokens(for: other).accessToken == "for-a-2")
        #expect(setup.fake.tokenRequests.last?.form["resource"] == "https://b.test/")
        #expect(setup.fake.tokenRequests.last?.form["scope"] == nil)
        // A 401 for the origin's token gets a new one for that key only.
        let renewed = try await setup.manager.refresh(Self.key, replacing: view.generation)
        #expect(renewed.accessToken == "for-a-3")
        #expect(try setup.store.load("test")?.accessToken == "access-1")
    }

    @Test func theTokenFileKeepsAudienceTokensAcrossARefreshOfTheProvidersToken() throws {
        var tokens = storedTokens(issuedAt: now, expiresAt: now + 60)
        tokens.audienceTokens["resource=https://a.test/"] = TokenSet.AudienceToken(
            accessToken: "aud", tokenType: "Bearer", issuedAt: now, expiresAt: now + 60, scope: nil, generation: 1,
            dpopThumbprint: nil)
        tokens.accessGeneration = 1
        tokens.generation = 2
        let parsed = try #require(TokenSet(json: tokens.json))
        #expect(parsed == tokens)
        #expect(parsed.view(for: TokenKey(provider: "test"))?.generation == 1)
        #expect(parsed.view(for: TokenKey(provider: "test", resource: "https://a.test/"))?.accessToken == "aud")
        #expect(parsed.view(for: TokenKey(provider: "test", resource: "https://b.test/")) == nil)
        #expect(parsed.view(for: TokenKey(provider: "test", kind: .idToken)) == nil, "no ID token held")
    }
}

@Suite struct IDTokenOriginTests {
    @Test func anIDTokenOriginSeesTheIDTokenAsABearerTokenWithItsOwnExpiry() throws {
        var tokens = storedTokens(issuedAt: now, expiresAt: now + 60)
        tokens.idToken = JWSFixtures.rs256
        tokens.dpopThumbprint = "bound"
        let view = try #require(tokens.view(for: TokenKey(provider: "test", kind: .idToken)))
        #expect(view.accessToken == JWSFixtures.rs256 && view.tokenType == "Bearer" && view.dpopThumbprint == nil)
        #expect(view.expiresAt == JWSFixtures.expiresAt && view.generation == tokens.generation)
    }
}

@Suite struct ClientAuthenticationTests {
    @Test func privateKeyJWTAssertionIsSignedByTheClientKeyForTheIssuer() throws {
        let directory = try TemporaryDirectory()
        let key = try ClientKey.create(path: directory.path + "/keys/ci.client.pem")
        #expect(mode(directory.path + "/keys/ci.client.pem") == 0o600)
        let authentication = ClientAuthentication(method: .privateKeyJWT, clientID: "ci-bot", secret: nil, key: key)
        let applied = try authentication.apply(
            to: [("grant_type", "client_credentials")], issuer: "https://idp.test",
            tokenEndpoint: "https://idp.test/token",
            now: 1000)
        let form = Dictionary(applied.parameters, uniquingKeysWith: { $1 })
        #expect(applied.headers.isEmpty)
        #expect(form["client_assertion_type"] == "urn:ietf:params:oauth:client-assertion-type:jwt-bearer")
        let jwt = try parsedJWT(try #require(form["client_assertion"]))
        #expect(jwt.algorithm == "ES256" && jwt.keyID == key.kid)
        #expect(jwt.claims["iss"]?.string == "ci-bot" && jwt.claims["sub"]?.string == "ci-bot")
        // draft-ietf-oauth-rfc7523bis §3: the issuer identifier, as one string.
        #expect(jwt.claims["aud"]?.string == "https://idp.test")
        #expect(jwt.claims["exp"]?.int == 1060 && jwt.claims["iat"]?.int == 1000)
        let verifier = try CryptoKey.publicKey(jwk: try key.publicJWK())
        #expect(verifier.verify(.es256, signature: jwt.signature, signingInput: jwt.signingInput))
        // Each assertion is new.
        let again = try authentication.apply(
            to: [], issuer: "https://idp.test", tokenEndpoint: "https://idp.test/token", now: 1000)
        #expect(again.parameters.first { $0.0 == "client_assertion" }?.1 != form["client_assertion"])
        // The printed JWK is public only.
        let jwk = try key.publicJWK()
        #expect(jwk["d"] == nil && jwk["kid"]?.string == key.kid && jwk["alg"] == "ES256")
    }

    @Test func clientSecretMethods() throws {
        let basic = ClientAuthentication(
            method: .clientSecretBasic, clientID: "ci:bot", secret: Array("s e/cret".utf8), key: nil)
        let applied = try basic.apply(
            to: [("client_id", "ci:bot")], issuer: "https://idp.test", tokenEndpoint: "https://idp.test/token", now: 0)
        #expect(applied.parameters.isEmpty, "client_id moves to the Authorization field")
        // RFC 6749 §2.3.1: form-encoded first, then base64.
        #expect(applied.headers.first?.value == "Basic " + Base64.encode(Array("ci%3Abot:s%20e%2Fcret".utf8)))
        let post = ClientAuthentication(method: .clientSecretPost, clientID: "ci", secret: Array("sec".utf8), key: nil)
        let posted = try post.apply(to: [], issuer: "https://idp.test", tokenEndpoint: "https://idp.test/token", now: 0)
        #expect(posted.parameters.map(\.0) == ["client_id", "client_secret"] && posted.headers.isEmpty)
        let hmac = ClientAuthentication(method: .clientSecretJWT, clientID: "ci", secret: Array("sec".utf8), key: nil)
        let assertion = try hmac.assertion(audience: "https://idp.test/token", now: 5)
        let jwt = try parsedJWT(assertion)
        #expect(jwt.algorithm == "HS256")
        #expect(jwt.signature == Crypto.hmacSHA256(key: Array("sec".utf8), message: jwt.signingInput))
    }

    /// `client_assertion_audience = token_endpoint`: OpenID Connect Core §9's audience, for providers that want it.
    @Test(arguments: [ClientAuthMethod.privateKeyJWT, .clientSecretJWT])
    func theAssertionNamesTheTokenEndpointWhenAsked(method: ClientAuthMethod) throws {
        let directory = try TemporaryDirectory()
        let key = method == .privateKeyJWT ? try ClientKey.create(path: directory.path + "/k.pem") : nil
        let secret: [UInt8]? = method == .clientSecretJWT ? Array("sec".utf8) : nil
        for (audience, expected) in [
            (AssertionAudience.issuer, "https://idp.test"), (.tokenEndpoint, "https://idp.test/t"),
        ] {
            let authentication = ClientAuthentication(
                method: method, clientID: "ci", secret: secret, key: key, audience: audience)
            let applied = try authentication.apply(
                to: [], issuer: "https://idp.test", tokenEndpoint: "https://idp.test/t", now: 0)
            let assertion = try #require(applied.parameters.first { $0.0 == "client_assertion" }?.1)
            #expect(try parsedJWT(assertion).claims["aud"]?.string == expected)
        }
    }

    /// Every attempt at the token endpoint gets a new assertion, a DPoP nonce retry included (a provider refuses a
    /// `jti` it has seen), and each names the issuer from the provider's metadata.
    @Test func aNonceRetryCarriesAFreshAssertion() async throws {
        let directory = try TemporaryDirectory()
        let key = try ClientKey.create(path: directory.path + "/ci.pem")
        var provider = MachineGrantTests.provider(.clientCredentials)
        provider.tokenBinding = .dpop
        let fake = FakeProvider { request in
            request.index == 1
                ? FakeProvider.json(400, ["error": "use_dpop_nonce"], headers: [("DPoP-Nonce", "n-1")])
                : FakeProvider.tokens(access: "machine", expiresIn: 600)
        }
        let client = ProviderClient(config: provider, transport: fake)
        await client.setDPoPKey(try DPoPKey(try PrivateKey.generateP256()))
        await client.setClientAuthentication(
            ClientAuthentication(method: .privateKeyJWT, clientID: "proxyctl-test", secret: nil, key: key))
        guard case .success = try await client.postToken([("grant_type", "client_credentials")]) else {
            Issue.record("the retry did not succeed")
            return
        }
        let assertions = try fake.tokenRequests.map { try parsedJWT(try #require($0.form["client_assertion"])) }
        #expect(assertions.count == 2)
        #expect(Set(assertions.compactMap { $0.claims["jti"]?.string }).count == 2)
        #expect(assertions.allSatisfy { $0.claims["aud"]?.string == JWSFixtures.issuer })
    }

    /// A provider that refuses the client while the assertion names the issuer: the message names the key to set.
    @Test func aRefusedAssertionNamesClientAssertionAudience() async throws {
        let directory = try TemporaryDirectory()
        let key = try ClientKey.create(path: directory.path + "/ci.pem")
        var provider = MachineGrantTests.provider(.clientCredentials)
        provider.file = "/etc/proxyctl/ci.conf"
        let setup = try await Setup(
            provider: provider,
            authentication: ClientAuthentication(
                method: .privateKeyJWT, clientID: "proxyctl-test", secret: nil, key: key)
        ) { _ in FakeProvider.json(401, ["error": "invalid_client"]) }
        do {
            _ = try await setup.manager.currentTokens()
            Issue.record("succeeded")
        } catch let error as AuthError {
            #expect(
                error.description.contains(
                    "set client_assertion_audience = token_endpoint in [provider test] of /etc/proxyctl/ci.conf"),
                "\(error)")
        }
        // Named already, or no assertion at all: no hint.
        provider.clientAssertionAudience = .tokenEndpoint
        #expect(provider.assertionAudienceHint == nil)
        provider.clientAssertionAudience = .issuer
        provider.clientAuthMethod = .clientSecretBasic
        #expect(provider.assertionAudienceHint == nil)
    }

    @Test func hmacSHA256MatchesRFC4231TestCase2() {
        let digest = Crypto.hmacSHA256(key: Array("Jefe".utf8), message: Array("what do ya want for nothing?".utf8))
        #expect(
            digest.map { String(format: "%02x", $0) }.joined()
                == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")
    }

    @Test func aSecretFileOpenToOthersIsRefused() throws {
        let directory = try TemporaryDirectory()
        let file = directory.path + "/secret"
        try writeInPlace(file, "s3cret\n")
        #expect(try SecretFile.read(file, what: "the client secret file") == Array("s3cret".utf8))
        chmod(file, 0o644)
        #expect(throws: AuthError.self) { try SecretFile.read(file, what: "the client secret file") }
    }
}

@Suite struct MachineGrantTests {
    static func provider(_ grant: ProviderGrant) -> ProviderConfig {
        var provider = testProvider()
        provider.grant = grant
        provider.scopes = ["openid", "api"]
        return provider
    }

    @Test func clientCredentialsNeedNoLoginAndRunAgainOnA401() async throws {
        let directory = try TemporaryDirectory()
        let key = try ClientKey.create(path: directory.path + "/ci.pem")
        let setup = try await Setup(
            provider: Self.provider(.clientCredentials),
            authentication: ClientAuthentication(
                method: .privateKeyJWT, clientID: "proxyctl-test", secret: nil, key: key)
        ) { request in FakeProvider.tokens(access: "machine-\(request.index)", expiresIn: 600) }
        let first = try await setup.manager.currentTokens()
        #expect(first.accessToken == "machine-1" && first.refreshToken == nil)
        let form = try #require(setup.fake.tokenRequests.first?.form)
        #expect(form["grant_type"] == "client_credentials" && form["scope"] == "api")
        #expect(form["client_assertion"] != nil && form["refresh_token"] == nil)
        #expect(try await setup.manager.currentTokens().accessToken == "machine-1", "stored and reused")
        #expect(try await setup.manager.refresh(replacing: first.generation).accessToken == "machine-2")
        // An origin's own audience is a grant with its resource.
        let audience = TokenKey(provider: "test", resource: "https://a.test/")
        #expect(try await setup.manager.currentTokens(for: audience).accessToken == "machine-3")
        #expect(setup.fake.tokenRequests.last?.form["resource"] == "https://a.test/")
        #expect(try await setup.manager.currentTokens().accessToken == "machine-2")
    }

    @Test func tokenExchangeSendsTheSubjectTokenFromItsFile() async throws {
        let directory = try TemporaryDirectory()
        var provider = Self.provider(.tokenExchange)
        provider.subjectTokenFile = directory.path + "/ci-token"
        provider.audience = "api"
        try writeInPlace(directory.path + "/ci-token", "eyJ.subject.one\n")
        let setup = try await Setup(provider: provider) { request in
            FakeProvider.tokens(access: "exchanged-\(request.index)", expiresIn: 600)
        }
        #expect(try await setup.manager.currentTokens().accessToken == "exchanged-1")
        let form = try #require(setup.fake.tokenRequests.first?.form)
        #expect(form["grant_type"] == "urn:ietf:params:oauth:grant-type:token-exchange")
        #expect(form["subject_token"] == "eyJ.subject.one" && form["audience"] == "api")
        #expect(form["subject_token_type"] == "urn:ietf:params:oauth:token-type:jwt")
        // The file is read anew at each exchange (CI systems rotate it in place).
        try writeInPlace(directory.path + "/ci-token", "eyJ.subject.two")
        _ = try await setup.manager.refresh(replacing: 1)
        #expect(setup.fake.tokenRequests.last?.form["subject_token"] == "eyJ.subject.two")
    }

    @Test func aSubjectTokenCommandIsRunWithoutAShell() async throws {
        var provider = Self.provider(.tokenExchange)
        provider.subjectTokenCommand = ["/bin/echo", "eyJ.from.command"]
        #expect(try await SubjectToken.read(provider, timeout: 5000) == "eyJ.from.command")
        provider.subjectTokenCommand = ["/bin/false"]
        await #expect(throws: AuthError.self) { try await SubjectToken.read(provider, timeout: 5000) }
        provider.subjectTokenCommand = ["/bin/echo", "two words"]
        await #expect(throws: AuthError.self) { try await SubjectToken.read(provider, timeout: 5000) }
    }

    @Test func aRefusedSubjectTokenNamesItsSource() async throws {
        let directory = try TemporaryDirectory()
        var provider = Self.provider(.tokenExchange)
        provider.subjectTokenFile = directory.path + "/ci-token"
        try writeInPlace(directory.path + "/ci-token", "expired")
        let setup = try await Setup(provider: provider) { _ in
            FakeProvider.json(400, ["error": "invalid_grant"])
        }
        do {
            _ = try await setup.manager.currentTokens()
            Issue.record("succeeded")
        } catch let error as AuthError {
            #expect(error.description.contains(directory.path + "/ci-token"))
            #expect(!error.description.contains("expired\""))
        }
    }
}
