import Testing

@testable import ProxyCore

/// RFC 9728 protected resource metadata, the URL rules of every fetch it leads to, the challenge parameters that
/// name it, and the client registration (RFC 7591) checks: tables of documents and the decisions made on them.
@Suite struct ResourceMetadataTests {
    static func json(_ text: String) -> JSONValue { try! JSON.parse(text).get() }

    static func url(_ text: String) -> AbsoluteURL { try! AbsoluteURL.parse(text).get() }

    @Test func aWellFormedDocumentIsRead() throws {
        let parsed = try ProtectedResourceMetadata.parse(
            Self.json(
                """
                {"resource": "https://api.example.com", "authorization_servers": ["https://login.example.com/r",
                 "https://login.example.com/r"], "scopes_supported": ["api", "api.read", "api"],
                 "dpop_bound_access_tokens_required": true, "dpop_signing_alg_values_supported": ["ES256"],
                 "resource_name": "The API\\u001b[31m", "bearer_methods_supported": ["header"]}
                """)
        ).get()
        #expect(parsed.resource == "https://api.example.com")
        #expect(parsed.authorizationServers == ["https://login.example.com/r"])
        #expect(parsed.scopesSupported == ["api", "api.read"])
        #expect(parsed.dpopBoundAccessTokensRequired)
        #expect(parsed.dpopSigningAlgorithms == ["ES256"])
        // Text for a terminal carries no escape sequence.
        #expect(parsed.resourceName?.contains("\u{1b}") == false)
    }

    @Test(arguments: [
        ("[]", "not a JSON object"),
        (#"{"authorization_servers": ["https://a.example"]}"#, "has no resource"),
        (#"{"resource": "ftp://api.example.com", "authorization_servers": ["https://a.example"]}"#, "not usable"),
        (#"{"resource": "https://api.example.com"}"#, "names no authorization server"),
        (#"{"resource": "https://api.example.com", "authorization_servers": []}"#, "not a list of issuer URLs"),
        (#"{"resource": "https://api.example.com", "authorization_servers": "https://a.example"}"#, "not a list"),
        (#"{"resource": "https://api.example.com", "authorization_servers": [7]}"#, "something other"),
        (#"{"resource": "https://api.example.com", "authorization_servers": ["http://a.example"]}"#, "loopback"),
        (#"{"resource": "https://api.example.com", "authorization_servers": ["file:///etc/passwd"]}"#, "not usable"),
        (#"{"resource": "https://api.example.com", "authorization_servers": ["https://a.example/?x=1"]}"#, "query"),
        (#"{"resource": "https://api.example.com", "authorization_servers": ["https://a.example/$(id) x"]}"#, "space"),
        (
            #"{"resource": "https://api.example.com", "authorization_servers": ["https://a.example"], "scopes_supported": ["a b"]}"#,
            "not a scope"
        ),
        (
            #"{"resource": "https://api.example.com", "authorization_servers": ["https://a.example"], "scopes_supported": "api"}"#,
            "not a list of scopes"
        ),
        (
            #"{"resource": "https://api.example.com", "authorization_servers": ["https://a.example"], "dpop_bound_access_tokens_required": "yes"}"#,
            "not true or false"
        ),
    ])
    func aDocumentProxyctlHalfUnderstandsIsRefused(document: String, reason: String) {
        guard case .failure(let error) = ProtectedResourceMetadata.parse(Self.json(document)) else {
            Issue.record("accepted \(document)")
            return
        }
        #expect(error.message.contains(reason), "\(error.message)")
    }

    @Test func seventeenServersAreNotAList() {
        let servers = (0..<17).map { "\"https://a\($0).example\"" }.joined(separator: ",")
        let document = #"{"resource": "https://api.example.com", "authorization_servers": [\#(servers)]}"#
        guard case .failure = ProtectedResourceMetadata.parse(Self.json(document)) else {
            Issue.record("accepted")
            return
        }
    }

    @Test(arguments: [
        ("https://api.example.com", "https://api.example.com/.well-known/oauth-protected-resource"),
        ("https://api.example.com/", "https://api.example.com/.well-known/oauth-protected-resource"),
        ("https://api.example.com:8443/mcp", "https://api.example.com:8443/.well-known/oauth-protected-resource/mcp"),
        ("https://API.example.com/a/b/", "https://api.example.com/.well-known/oauth-protected-resource/a/b"),
        ("https://api.example.com/a?x=1", "https://api.example.com/.well-known/oauth-protected-resource/a?x=1"),
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/.well-known/oauth-protected-resource/v1"),
    ])
    func theWellKnownURLInsertsItsPathAfterTheHost(resource: String, expected: String) {
        #expect(ProtectedResourceMetadata.wellKnownURL(for: Self.url(resource)) == expected)
    }

    @Test(arguments: [
        ("https://api.example.com", "https://api.example.com", true),
        ("https://api.example.com/", "https://api.example.com", true),
        ("HTTPS://API.Example.com:443", "https://api.example.com", true),
        ("https://api.example.com/mcp", "https://api.example.com/mcp", true),
        ("https://api.example.com/mcp/", "https://api.example.com/mcp", false),
        ("https://api.example.com/other", "https://api.example.com/mcp", false),
        ("https://api.example.com:8443", "https://api.example.com", false),
        ("https://evil.example", "https://api.example.com", false),
        ("https://api.example.com.evil.example", "https://api.example.com", false),
        ("http://api.example.com", "https://api.example.com", false),
        ("not a url", "https://api.example.com", false),
    ])
    func theResourceMustBeTheOneAskedAbout(named: String, expected: String, matches: Bool) {
        #expect(ProtectedResourceMetadata.matches(named, Self.url(expected)) == matches)
    }

    @Test func theAuthorizationServerIsTheOneListedOrTheOneNamed() throws {
        let one = ProtectedResourceMetadata(resource: "https://api", authorizationServers: ["https://a"])
        let two = ProtectedResourceMetadata(resource: "https://api", authorizationServers: ["https://a", "https://b"])
        #expect(try one.chooseAuthorizationServer(named: nil).get() == "https://a")
        #expect(try two.chooseAuthorizationServer(named: "https://b").get() == "https://b")
        guard case .failure(let several) = two.chooseAuthorizationServer(named: nil),
            case .failure(let other) = one.chooseAuthorizationServer(named: "https://a/")
        else {
            Issue.record("chose without the user")
            return
        }
        #expect(several.message.contains("several authorization servers (https://a, https://b)"))
        #expect(other.message.contains("is not one of"))
    }

    // MARK: - URLs

    @Test(arguments: [
        ("https://login.example.com/auth?x=1", true, nil as String?),
        ("http://127.0.0.1:9/auth", true, nil),
        ("http://localhost:9/auth", true, nil),
        ("http://[::1]:9/auth", true, nil),
        ("http://login.example.com/auth", true, "loopback"),
        ("file:///etc/passwd", true, "https"),
        ("javascript:alert(1)", true, "https"),
        ("https://a.example/x y", true, "space"),
        ("https://a.example/`id`", true, "0x60"),
        ("https://a.example/\"", true, "0x22"),
        ("https://a.example/|sh", true, "0x7C"),
        ("https://a.example/\n", true, "0xA"),
        ("https://a.example/é", true, "0xC3"),
        ("https://a.example/#frag", true, "fragment"),
        ("https://a.example/?q", false, "query"),
        ("https://user@a.example/", true, "https"),
        ("https://a.example/$(touch$IFS/tmp/x);id&x='", true, nil),
        ("", true, "https"),
    ])
    func onlyHttpsOrLoopbackURLsOfURLCharacters(url: String, allowQuery: Bool, problem: String?) {
        let found = MetadataURL.problem(url, allowQuery: allowQuery)
        if let problem {
            #expect(found?.contains(problem) == true, "\(url): \(found ?? "accepted")")
        } else {
            #expect(found == nil, "\(url): \(found ?? "")")
        }
        if allowQuery { #expect((MetadataURL.browserProblem(url) == nil) == (problem == nil)) }
    }

    @Test(arguments: [
        ("https://api.example.com/.well-known/x", "/.well-known/y", "https://api.example.com/.well-known/y"),
        ("https://api.example.com/a", "https://api.example.com:443/b", "https://api.example.com:443/b"),
        ("https://api.example.com/a", "https://evil.example/b", nil as String?),
        ("https://api.example.com/a", "//evil.example/b", nil),
        ("https://api.example.com/a", "http://api.example.com/b", nil),
        ("https://api.example.com/a", "https://api.example.com:8443/b", nil),
        ("https://api.example.com/a", "file:///etc/passwd", nil),
        ("https://api.example.com/a", "relative", nil),
    ])
    func redirectsAreFollowedWithinTheirOriginOnly(from: String, location: String, expected: String?) {
        switch MetadataURL.redirect(from: from, to: location) {
        case .success(let target): #expect(target == expected)
        case .failure(let error):
            #expect(expected == nil, "\(error)")
            #expect(error.message.contains("never fetched from another origin"))
        }
    }

    // MARK: - Challenges

    @Test func theChallengeNamesItsMetadataAndTheScopeItWants() {
        let challenges = ChallengeParser.parse([
            #"Basic realm="x", Bearer error="insufficient_scope", scope="api admin", resource_metadata="https://api.example.com/.well-known/oauth-protected-resource""#
        ])
        #expect(challenges.resourceMetadata == "https://api.example.com/.well-known/oauth-protected-resource")
        #expect(challenges.insufficientScope == ["api", "admin"])
        #expect(challenges.scope == ["api", "admin"])
        // Basic's parameters mean nothing; a URL a fetch would refuse is not named; a scope with a quote is none.
        #expect(
            ChallengeParser.parse([#"Basic resource_metadata="https://a.example/m""#]).resourceMetadata == nil)
        #expect(
            ChallengeParser.parse([#"Bearer resource_metadata="file:///etc/passwd""#]).resourceMetadata == nil)
        #expect(
            ChallengeParser.parse([#"Bearer resource_metadata="http://api.example.com/m""#]).resourceMetadata == nil)
        #expect(ChallengeParser.parse([#"Bearer error="insufficient_scope", scope="a\"b""#]).insufficientScope == nil)
        #expect(ChallengeParser.parse([#"Bearer error="invalid_token", scope="api""#]).insufficientScope == nil)
        #expect(ChallengeParser.parse([#"DPoP error="insufficient_scope", scope="api""#]).insufficientScope == ["api"])
    }

    // MARK: - Registration

    static let request = ClientRegistrationRequest(
        redirectURI: "http://127.0.0.1:17755/callback", device: true, scopes: ["openid", "api"], dpopBound: false)

    @Test func theRegistrationRequestIsANativePublicClient() throws {
        let body = try JSON.parse(Self.request.body).get()
        #expect(body["token_endpoint_auth_method"]?.string == "none")
        #expect(body["application_type"]?.string == "native")
        #expect(body["redirect_uris"]?.stringList == ["http://127.0.0.1:17755/callback"])
        #expect(
            body["grant_types"]?.stringList == [
                "authorization_code", "refresh_token", "urn:ietf:params:oauth:grant-type:device_code",
            ])
        #expect(body["response_types"]?.stringList == ["code"])
        #expect(body["scope"]?.string == "openid api")
        #expect(body["client_secret"] == nil && body["dpop_bound_access_tokens"] == nil)
    }

    @Test func aRegistrationAnswerIsCheckedAndKeptWithoutASecret() throws {
        let answer = Self.json(
            """
            {"client_id": "abc123", "client_secret": "s3cret", "registration_access_token": "rat",
             "registration_client_uri": "https://as.example/register/abc123", "client_id_issued_at": 1700000000,
             "redirect_uris": ["http://127.0.0.1:17755/callback"], "grant_types": ["authorization_code"]}
            """)
        let registration = try ClientRegistration.parse(
            answer, issuer: "https://as.example", request: Self.request, now: 5
        ).get()
        #expect(registration.clientID == "abc123" && registration.issuedAt == 1_700_000_000)
        #expect(registration.secretIgnored && registration.redirectPort == 17755)
        #expect(!JSON.serialize(registration.stored).contains("s3cret"))
        #expect(ClientRegistration(stored: registration.stored) == registration.withoutFlag)
    }

    @Test(arguments: [
        (#"{"client_secret": "x"}"#, "no client_id"),
        (#"{"client_id": "a b"}"#, "not usable"),
        (#"{"client_id": "a\nclient_id = b"}"#, "not usable"),
        (##"{"client_id": "#x"}"##, "not usable"),
        (#"{"client_id": "a", "redirect_uris": ["https://evil.example/cb"]}"#, "other redirect URIs"),
        (#"{"client_id": "a", "token_endpoint_auth_method": "client_secret_basic"}"#, "confidential client"),
        (#"{"client_id": "a", "grant_types": ["client_credentials"]}"#, "without the authorization_code"),
        (#"{"client_id": "a", "registration_access_token": "a b"}"#, "not a token"),
        (#"{"client_id": "a", "registration_client_uri": "file:///x"}"#, "not usable"),
    ])
    func aRegistrationAnswerProxyctlCannotUseIsRefused(answer: String, reason: String) {
        guard
            case .failure(let error) = ClientRegistration.parse(
                Self.json(answer), issuer: "https://as.example", request: Self.request, now: 0)
        else {
            Issue.record("accepted \(answer)")
            return
        }
        #expect(error.message.contains(reason), "\(error.message)")
    }

    @Test func theClientComesFromTheFlagsThenTheDocumentThenARegistration() throws {
        func decide(
            _ id: String?, _ url: String?, cimd: Bool, _ endpoint: String?
        ) -> Result<ClientChoice, DiscoveryError> {
            ClientChoice.decide(
                clientID: id, clientMetadataURL: url, metadataDocumentsSupported: cimd, registrationEndpoint: endpoint,
                issuer: "https://as")
        }
        #expect(try decide("id", "https://c/m.json", cimd: true, "https://as/r").get() == .given("id"))
        #expect(
            try decide(nil, "https://c/m.json", cimd: true, "https://as/r").get()
                == .metadataDocument("https://c/m.json"))
        #expect(
            try decide(nil, "https://c/m.json", cimd: false, "https://as/r").get()
                == .register(endpoint: "https://as/r"))
        #expect(try decide(nil, nil, cimd: true, "https://as/r").get() == .register(endpoint: "https://as/r"))
        guard case .failure(let none) = decide(nil, nil, cimd: false, nil),
            case .failure(let documents) = decide(nil, nil, cimd: true, nil),
            case .failure(let refused) = decide(nil, "https://c/m.json", cimd: false, nil)
        else {
            Issue.record("a client without a way to get one")
            return
        }
        #expect(none.message.contains("--client-id ID") && !none.message.contains("--client-metadata-url"))
        #expect(documents.message.contains("--client-metadata-url URL"))
        #expect(refused.message.contains("accepts no Client ID Metadata Document"))
        #expect(ClientChoice.metadataURLProblem("https://c.example/m.json") == nil)
        #expect(ClientChoice.metadataURLProblem("https://c.example/") != nil)
        #expect(ClientChoice.metadataURLProblem("http://127.0.0.1/m.json") != nil)
    }
}

extension ClientRegistration {
    /// The registration as read back: the flag about a secret is not kept.
    fileprivate var withoutFlag: ClientRegistration {
        var copy = self
        copy.secretIgnored = false
        return copy
    }
}
