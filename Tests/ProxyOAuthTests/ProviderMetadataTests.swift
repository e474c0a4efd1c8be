import ProxyCore
import Testing

@testable import ProxyOAuth

private func document(_ issuer: String, _ extra: [(String, JSONValue)] = []) -> JSONObject {
    var object = JSONObject([
        ("issuer", .string(issuer)), ("authorization_endpoint", .string(issuer + "/authorize")),
        ("token_endpoint", .string(issuer + "/token")), ("jwks_uri", .string(issuer + "/jwks")),
    ])
    for (name, value) in extra { object[name] = value }
    return object
}

/// The configuration error's reason; records an issue for success or another category.
private func configurationError(
    _ result: Result<ProviderMetadata, AuthError>, sourceLocation: SourceLocation = #_sourceLocation
) -> String? {
    switch result {
    case .failure(.configuration(let reason)): return reason
    case .failure(let error):
        Issue.record("unexpected \(error.category): \(error)", sourceLocation: sourceLocation)
    case .success(let metadata):
        Issue.record("accepted \(metadata)", sourceLocation: sourceLocation)
    }
    return nil
}

@Suite struct ProviderMetadataParseTests {
    @Test func readsEveryField() throws {
        let issuer = "https://idp.example.com/realms/dev"
        let metadata = try ProviderMetadata.parse(
            document(
                issuer,
                [
                    ("device_authorization_endpoint", .string(issuer + "/device")),
                    ("pushed_authorization_request_endpoint", .string(issuer + "/par")),
                    ("require_pushed_authorization_requests", true),
                    ("revocation_endpoint", .string(issuer + "/revoke")),
                    ("userinfo_endpoint", .string(issuer + "/userinfo")),
                    ("end_session_endpoint", .string(issuer + "/logout")),
                    ("code_challenge_methods_supported", ["plain", "S256"]),
                    ("dpop_signing_alg_values_supported", ["ES256"]),
                    ("authorization_response_iss_parameter_supported", true),
                    ("id_token_signing_alg_values_supported", ["RS256", "ES256"]),
                    ("grant_types_supported", ["authorization_code", "refresh_token"]),
                    ("scopes_supported", ["openid", "offline_access"]),
                    ("prompt_values_supported", ["none", "login", "create"]),
                ]),
            expectedIssuer: issuer
        ).get()
        #expect(metadata.issuer == issuer)
        #expect(metadata.authorizationEndpoint == issuer + "/authorize")
        #expect(metadata.tokenEndpoint == issuer + "/token")
        #expect(metadata.jwksURI == issuer + "/jwks")
        #expect(metadata.deviceAuthorizationEndpoint == issuer + "/device")
        #expect(metadata.pushedAuthorizationRequestEndpoint == issuer + "/par")
        #expect(metadata.requirePushedAuthorizationRequests)
        #expect(metadata.revocationEndpoint == issuer + "/revoke")
        #expect(metadata.userinfoEndpoint == issuer + "/userinfo")
        #expect(metadata.endSessionEndpoint == issuer + "/logout")
        #expect(metadata.codeChallengeMethods == ["plain", "S256"])
        #expect(metadata.supportsS256)
        #expect(metadata.dpopSigningAlgorithms == ["ES256"])
        #expect(metadata.issParameterSupported)
        #expect(metadata.idTokenSigningAlgorithms == ["RS256", "ES256"])
        #expect(metadata.grantTypes == ["authorization_code", "refresh_token"])
        #expect(metadata.scopesSupported == ["openid", "offline_access"])
        #expect(metadata.promptValues == ["none", "login", "create"])
    }

    @Test func optionalFieldsDefault() throws {
        let metadata = try ProviderMetadata.parse(
            JSONObject([("issuer", "https://idp.example.com"), ("token_endpoint", "https://idp.example.com/token")]),
            expectedIssuer: "https://idp.example.com"
        ).get()
        #expect(metadata.authorizationEndpoint == nil)
        #expect(metadata.jwksURI == nil)
        #expect(!metadata.requirePushedAuthorizationRequests)
        #expect(!metadata.issParameterSupported)
        // Providers that do not list PKCE methods get the benefit of the doubt.
        #expect(metadata.supportsS256)
    }

    @Test func plainOnlyPKCEIsNotS256() throws {
        let metadata = try ProviderMetadata.parse(
            document("https://idp.example.com", [("code_challenge_methods_supported", ["plain"])]),
            expectedIssuer: "https://idp.example.com"
        ).get()
        #expect(!metadata.supportsS256)
    }

    @Test(arguments: [
        ("https://idp.example.com/", "https://idp.example.com"),
        ("https://idp.example.com", "https://idp.example.com/"),
        ("https://IDP.example.com", "https://idp.example.com"),
        ("https://idp.example.com/realms/other", "https://idp.example.com/realms/dev"),
        ("https://evil.example.com", "https://idp.example.com"),
        ("http://idp.example.com", "https://idp.example.com"),
    ])
    func issuerMismatchIsAConfigurationError(_ claimed: String, _ expected: String) {
        // OpenID Connect Discovery §4.3: exactly the configured issuer, no normalisation.
        let reason = configurationError(ProviderMetadata.parse(document(claimed), expectedIssuer: expected))
        #expect(reason?.contains("set issuer to exactly the provider's value") == true)
        #expect(reason?.contains(expected) == true)
    }

    @Test func missingIssuerOrTokenEndpoint() {
        var noIssuer = document("https://idp.example.com")
        noIssuer["issuer"] = nil
        #expect(
            configurationError(ProviderMetadata.parse(noIssuer, expectedIssuer: "https://idp.example.com"))?
                .contains("no issuer") == true)
        var numericIssuer = document("https://idp.example.com")
        numericIssuer["issuer"] = 1
        #expect(
            configurationError(ProviderMetadata.parse(numericIssuer, expectedIssuer: "https://idp.example.com")) != nil)
        var noToken = document("https://idp.example.com")
        noToken["token_endpoint"] = nil
        #expect(
            configurationError(ProviderMetadata.parse(noToken, expectedIssuer: "https://idp.example.com"))?
                .contains("no token_endpoint") == true)
    }

    @Test(arguments: [
        "token_endpoint", "authorization_endpoint", "device_authorization_endpoint",
        "pushed_authorization_request_endpoint", "revocation_endpoint", "jwks_uri",
    ])
    func plainHTTPEndpointsOfARemoteProviderAreRefused(_ name: String) {
        let issuer = "https://idp.example.com"
        let doc = document(issuer, [(name, "http://idp.example.com/endpoint")])
        let reason = configurationError(ProviderMetadata.parse(doc, expectedIssuer: issuer))
        #expect(reason?.contains(name) == true)
        #expect(reason?.contains("https") == true)
    }

    @Test func endpointsThatAreNotURLsAreRefused() {
        let issuer = "https://idp.example.com"
        for value in ["/token", "token", "ftp://idp.example.com/token", "https://idp.example.com/token#frag"] {
            let doc = document(issuer, [("token_endpoint", .string(value))])
            #expect(configurationError(ProviderMetadata.parse(doc, expectedIssuer: issuer)) != nil, "\(value)")
        }
    }

    @Test(arguments: ["http://127.0.0.1:5556/dex", "http://localhost:8080/realms/dev", "http://[::1]:9000"])
    func plainHTTPIsAcceptedOnLoopback(_ issuer: String) throws {
        let metadata = try ProviderMetadata.parse(document(issuer), expectedIssuer: issuer).get()
        #expect(metadata.tokenEndpoint == issuer + "/token")
    }

    @Test func endpointsWithAQueryAreAccepted() throws {
        let issuer = "https://idp.example.com"
        let doc = document(issuer, [("authorization_endpoint", "https://idp.example.com/authorize?tenant=a")])
        let metadata = try ProviderMetadata.parse(doc, expectedIssuer: issuer).get()
        #expect(metadata.authorizationEndpoint == "https://idp.example.com/authorize?tenant=a")
    }
}

@Suite struct DiscoveryURLTests {
    @Test func issuerWithoutPath() {
        let expected = [
            "https://idp.example.com/.well-known/openid-configuration",
            "https://idp.example.com/.well-known/oauth-authorization-server",
        ]
        #expect(ProviderMetadata.discoveryURLs(issuer: "https://idp.example.com") == expected)
        #expect(ProviderMetadata.discoveryURLs(issuer: "https://idp.example.com/") == expected)
    }

    @Test func issuerWithPathInsertsTheWellKnownSegmentAfterTheHost() {
        // OpenID Connect Discovery §4: appended; RFC 8414 §3.1: inserted between host and path.
        #expect(
            ProviderMetadata.discoveryURLs(issuer: "https://idp.example.com/realms/dev") == [
                "https://idp.example.com/realms/dev/.well-known/openid-configuration",
                "https://idp.example.com/.well-known/oauth-authorization-server/realms/dev",
            ])
        #expect(
            ProviderMetadata.discoveryURLs(issuer: "https://idp.example.com/tenant/") == [
                "https://idp.example.com/tenant/.well-known/openid-configuration",
                "https://idp.example.com/.well-known/oauth-authorization-server/tenant",
            ])
    }

    @Test func portsAreKept() {
        #expect(
            ProviderMetadata.discoveryURLs(issuer: "http://127.0.0.1:5556/dex") == [
                "http://127.0.0.1:5556/dex/.well-known/openid-configuration",
                "http://127.0.0.1:5556/.well-known/oauth-authorization-server/dex",
            ])
        #expect(
            ProviderMetadata.discoveryURLs(issuer: "https://idp.example.com:8443") == [
                "https://idp.example.com:8443/.well-known/openid-configuration",
                "https://idp.example.com:8443/.well-known/oauth-authorization-server",
            ])
    }

    @Test func aWrongIssuerGetsItsLikelyIssuers() {
        #expect(
            ProviderMetadata.issuerCandidates(for: "https://login.example.com/realms/dev/extra") == [
                "https://login.example.com/realms/dev", "https://login.example.com/realms", "https://login.example.com",
            ])
        // A discovery URL given as the issuer: the issuer before /.well-known/ first.
        #expect(
            ProviderMetadata.issuerCandidates(
                for: "http://127.0.0.1:5556/api/oidc/.well-known/openid-configuration") == [
                    "http://127.0.0.1:5556/api/oidc", "http://127.0.0.1:5556/api", "http://127.0.0.1:5556",
                ])
        #expect(ProviderMetadata.issuerCandidates(for: "https://idp.example.com") == [])
        #expect(ProviderMetadata.issuerCandidates(for: "https://idp.example.com/a/b/c/d/e").count == 4)
        #expect(
            ProviderMetadata.describeTried([
                ("https://x.test/a/.well-known/openid-configuration", 404),
                ("https://x.test/.well-known/oauth-authorization-server/a", 404),
            ])
                == "https://x.test/a/.well-known/openid-configuration answered 404 (OpenID Connect Discovery), https://x.test/.well-known/oauth-authorization-server/a answered 404 (RFC 8414)"
        )
    }
}
