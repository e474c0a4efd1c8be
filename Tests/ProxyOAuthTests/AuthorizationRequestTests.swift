import ProxyCore
import ProxyTLS
import TestFixtures
import Testing

@testable import ProxyOAuth

private let redirectURI = "http://127.0.0.1:53682/callback"

private func request(
    scopes: [String] = ["openid", "profile", "email"], options: LoginOptions = LoginOptions(),
    configure: (inout ProviderConfig) -> Void = { _ in }
) -> AuthorizationRequest {
    var provider = testProvider()
    provider.scopes = scopes
    configure(&provider)
    return AuthorizationRequest(provider: provider, options: options, redirectURI: redirectURI)
}

private func metadata(issParameterSupported: Bool = false) -> ProviderMetadata {
    var metadata = ProviderMetadata(issuer: JWSFixtures.issuer, tokenEndpoint: JWSFixtures.issuer + "/token")
    metadata.issParameterSupported = issParameterSupported
    return metadata
}

private func values(_ parameters: [(String, String)], _ name: String) -> [String] {
    parameters.filter { $0.0 == name }.map(\.1)
}

private func isBase64URL(_ text: String) -> Bool {
    text.utf8.allSatisfy { byte in
        byte == 0x2D || byte == 0x5F || (0x30...0x39).contains(byte) || (0x41...0x5A).contains(byte)
            || (0x61...0x7A).contains(byte)
    }
}

@Suite struct PKCETests {
    @Test func rfc7636AppendixB() {
        let pkce = PKCE(verifier: "dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk")
        #expect(pkce.challenge == "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM")
        #expect(pkce.verifier == "dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk")
    }

    @Test func randomVerifiersAreLongEnoughAndDistinct() {
        let verifiers = (0..<50).map { _ in PKCE() }
        #expect(Set(verifiers.map(\.verifier)).count == 50)
        for pkce in verifiers {
            // RFC 7636 §4.1: 43 to 128 characters of the unreserved set; §4.2: the challenge is 43 characters.
            #expect(pkce.verifier.count == 43)
            #expect(isBase64URL(pkce.verifier))
            #expect(pkce.challenge.count == 43)
            #expect(pkce.challenge == PKCE(verifier: pkce.verifier).challenge)
        }
    }
}

@Suite struct AuthorizationRequestParameterTests {
    @Test func codeFlowParametersInOrder() {
        let authorization = request()
        let parameters = authorization.parameters
        #expect(
            parameters.map(\.0) == [
                "response_type", "client_id", "redirect_uri", "scope", "state", "nonce", "code_challenge",
                "code_challenge_method",
            ])
        #expect(values(parameters, "response_type") == ["code"])
        #expect(values(parameters, "client_id") == [JWSFixtures.clientID])
        #expect(values(parameters, "redirect_uri") == [redirectURI])
        #expect(values(parameters, "scope") == ["openid profile email"])
        #expect(values(parameters, "state") == [authorization.state])
        #expect(values(parameters, "nonce") == [authorization.nonce])
        #expect(values(parameters, "code_challenge") == [authorization.pkce.challenge])
        #expect(values(parameters, "code_challenge_method") == ["S256"])
    }

    @Test func openidComesFirstAndNothingIsAdded() {
        #expect(request(scopes: ["profile", "openid"]).scopes == ["openid", "profile"])
        #expect(request(scopes: []).scopes == ["openid"])
        #expect(request(scopes: ["api", "api"]).scopes == ["openid", "api"])
        var options = LoginOptions()
        options.scopes = ["read:repo"]
        #expect(values(request(options: options).parameters, "scope") == ["openid read:repo"])
        // offline_access is never added (providers differ on it; a refresh token comes without it from most)...
        for scopes in [["openid"], ["openid", "profile"], ["email"]] {
            #expect(!request(scopes: scopes).scopes.contains("offline_access"))
        }
        // ...and kept when configured.
        #expect(request(scopes: ["openid", "offline_access"]).scopes == ["openid", "offline_access"])
    }

    @Test func stateNonceAndVerifierAreRandomAndDistinct() {
        let requests = (0..<20).map { _ in request() }
        var seen = Set<String>()
        for authorization in requests {
            for value in [authorization.state, authorization.nonce, authorization.pkce.verifier] {
                #expect(value.count == 43)
                #expect(isBase64URL(value))
                seen.insert(value)
            }
        }
        #expect(seen.count == 60)
    }

    @Test func optionalParameters() {
        var options = LoginOptions()
        options.acrValues = "urn:example:mfa"
        options.maxAge = 300
        options.loginHint = "jane@example.com"
        options.create = true
        let parameters = request(options: options) { provider in
            provider.resources = ["https://api.example.com", "https://files.example.com"]
            provider.extraParameters = [("audience", "api"), ("ui_locales", "de")]
        }.parameters
        #expect(values(parameters, "acr_values") == ["urn:example:mfa"])
        #expect(values(parameters, "max_age") == ["300"])
        #expect(values(parameters, "login_hint") == ["jane@example.com"])
        #expect(values(parameters, "prompt") == ["create"])
        // RFC 8707 §2: one resource parameter per resource.
        #expect(values(parameters, "resource") == ["https://api.example.com", "https://files.example.com"])
        #expect(values(parameters, "audience") == ["api"])
        #expect(values(parameters, "ui_locales") == ["de"])
    }

    /// RFC 8707 §2.2 on the token request that ends the sign-in: the provider's own resources; else the one
    /// resource of its origins when none of them uses the provider's own token (what `init --origin` writes),
    /// that origin's key then getting the token too; else none (several resources would ask for one token for
    /// all of them).
    @Test func theTokenRequestAsksForTheOneOriginsResourceOrTheProvidersOwn() {
        var alone = LoginOptions()
        alone.originResources = ["https://api.example.com"]
        alone.providerTokenUsed = false
        let single = request(options: alone) { _ in }
        #expect(values(single.parameters, "resource") == ["https://api.example.com"])
        #expect(single.tokenResources == ["https://api.example.com"])
        #expect(single.audienceKey == TokenKey(provider: "test", resource: "https://api.example.com"))

        var shared = alone
        shared.providerTokenUsed = true
        #expect(request(options: shared) { _ in }.tokenResources.isEmpty, "another origin uses the provider's token")
        #expect(request(options: shared) { _ in }.audienceKey == nil)

        var several = alone
        several.originResources = ["https://api.example.com", "https://files.example.com"]
        let both = request(options: several) { _ in }
        #expect(values(both.parameters, "resource") == ["https://api.example.com", "https://files.example.com"])
        #expect(both.tokenResources.isEmpty && both.audienceKey == nil)

        let own = request(options: alone) { provider in provider.resources = ["https://gateway.example.com"] }
        #expect(own.tokenResources == ["https://gateway.example.com"] && own.audienceKey == nil)
    }

    @Test func optionsOverrideTheConfiguredAcrAndHint() {
        var options = LoginOptions()
        options.acrValues = "gold"
        let parameters = request(options: options) { provider in
            provider.acrValues = "silver"
            provider.loginHint = "configured@example.com"
        }.parameters
        #expect(values(parameters, "acr_values") == ["gold"])
        #expect(values(parameters, "login_hint") == ["configured@example.com"])
        #expect(values(request().parameters, "acr_values").isEmpty)
        #expect(values(request().parameters, "prompt").isEmpty)
        #expect(values(request().parameters, "max_age").isEmpty)
    }
}

@Suite struct AuthorizationResponseCheckTests {
    @Test func codeWithStateAndIssuer() {
        let authorization = request()
        let query = [("code", "SplxlOBeZQQYbYS6WxSbIA"), ("state", authorization.state), ("iss", JWSFixtures.issuer)]
        #expect(
            authorization.check(query, metadata: metadata(issParameterSupported: true))
                == .success(.code("SplxlOBeZQQYbYS6WxSbIA")))
    }

    @Test func codeWithoutIssuerWhenTheProviderDoesNotPromiseOne() {
        let authorization = request()
        let query = [("state", authorization.state), ("code", "abc")]
        #expect(authorization.check(query, metadata: metadata()) == .success(.code("abc")))
    }

    @Test func wrongOrMissingStateIsRefused() {
        let authorization = request()
        let other = request()
        for query in [[("code", "abc"), ("state", other.state)], [("code", "abc")], [("code", "abc"), ("state", "")]] {
            guard case .failure(.cancelled(let reason)) = authorization.check(query, metadata: metadata()) else {
                Issue.record("accepted \(query)")
                continue
            }
            #expect(reason.contains("state mismatch"))
        }
        // An error response with the wrong state is refused too: it belongs to another sign-in.
        let error = [("error", "access_denied"), ("state", other.state)]
        guard case .failure(.cancelled) = authorization.check(error, metadata: metadata()) else {
            Issue.record("accepted an error for another sign-in")
            return
        }
    }

    @Test func wrongIssuerIsRefused() {
        // RFC 9207 §2.4: the iss parameter must equal the issuer, whether or not the provider advertised it.
        let authorization = request()
        for supported in [true, false] {
            for iss in ["https://evil.example.com", JWSFixtures.issuer + "/", ""] {
                let query = [("code", "abc"), ("state", authorization.state), ("iss", iss)]
                guard
                    case .failure(.configuration(let reason)) = authorization.check(
                        query, metadata: metadata(issParameterSupported: supported))
                else {
                    Issue.record("accepted iss \(iss)")
                    continue
                }
                #expect(reason.contains("mix-up"))
            }
        }
    }

    @Test func missingIssuerIsRefusedWhenPromised() {
        let authorization = request()
        let query = [("code", "abc"), ("state", authorization.state)]
        guard
            case .failure(.configuration(let reason)) = authorization.check(
                query, metadata: metadata(issParameterSupported: true))
        else {
            Issue.record("accepted a response without iss")
            return
        }
        #expect(reason.contains("RFC 9207"))
    }

    @Test func errorResponsesAreReturnedAsErrors() {
        let authorization = request()
        let query = [
            ("error", "access_denied"), ("error_description", "The user said no"),
            ("error_uri", "https://idp.example.com/errors/1"), ("state", authorization.state),
            ("iss", JWSFixtures.issuer),
        ]
        #expect(
            authorization.check(query, metadata: metadata(issParameterSupported: true))
                == .success(
                    .error(
                        OAuthErrorResponse(
                            error: "access_denied", description: "The user said no",
                            uri: "https://idp.example.com/errors/1"))))
        // An error wins over a code sent alongside it.
        let both = [("state", authorization.state), ("code", "abc"), ("error", "server_error")]
        #expect(
            authorization.check(both, metadata: metadata())
                == .success(.error(OAuthErrorResponse(error: "server_error", description: nil))))
    }

    @Test func errorDescriptionsAreSanitised() {
        let authorization = request()
        let query = [
            ("state", authorization.state), ("error", "access_denied\u{1B}[2J"), ("error_description", "a\nb"),
        ]
        guard case .success(.error(let error)) = authorization.check(query, metadata: metadata()) else {
            Issue.record("not an error response")
            return
        }
        #expect(error.error == "access_denied?[2J")
        #expect(error.description == "a?b")
    }

    @Test func neitherCodeNorError() {
        let authorization = request()
        for query in [[("state", authorization.state)], [("state", authorization.state), ("code", "")]] {
            guard case .failure(.cancelled(let reason)) = authorization.check(query, metadata: metadata()) else {
                Issue.record("accepted \(query)")
                continue
            }
            #expect(reason.contains("neither a code nor an error"))
        }
    }
}

/// What `proxyctl login` says when the browser does not come back: when, and the key that fixes each cause.
@Suite struct RedirectHintTests {
    @Test func comesAfter45sOrAThirdOfAShortLoginTimeout() {
        #expect(LoginFlow.redirectHintDelay(loginTimeout: 300_000) == 45_000)
        #expect(LoginFlow.redirectHintDelay(loginTimeout: 6_000) == 2_000)
        #expect(LoginFlow.redirectHintDelay(loginTimeout: 20_000) == 6_000)  // whole seconds
        #expect(LoginFlow.redirectHintDelay(loginTimeout: 900) == 300)
    }

    @Test func aFixedPortNamesTheURIToRegisterAndBothKeys() {
        var provider = testProvider(name: "corp")
        provider.redirectPort = 17755
        let lines = LoginFlow.redirectHint(
            provider: provider, redirectURI: "http://127.0.0.1:17755/callback", file: "/home/me/proxy.conf")
        #expect(
            lines.first
                == "No answer from the browser after 45s. If the provider showed an error page instead of signing you in, the usual causes are:"
        )
        #expect(
            lines[1]
                == "  - the redirect URI http://127.0.0.1:17755/callback is not registered for client \(JWSFixtures.clientID) exactly as written: register it at the provider, or set redirect_port in [provider corp] of /home/me/proxy.conf to a port that is registered;"
        )
        #expect(lines[2].hasSuffix("change client_id in [provider corp] of /home/me/proxy.conf."))
        #expect(lines.last == "Still waiting (login_timeout 5m; Ctrl-C stops).")
    }

    @Test func portZeroSaysThatThePortChangesAtEachLogin() {
        let lines = LoginFlow.redirectHint(
            provider: testProvider(name: "corp"), redirectURI: "http://127.0.0.1:40001/callback", file: nil)
        #expect(lines[1].contains("redirect_port is 0 in [provider corp], so this login listens on a port of its own"))
        #expect(lines[1].contains("register http://127.0.0.1:PORT/callback for the client"))
    }
}
