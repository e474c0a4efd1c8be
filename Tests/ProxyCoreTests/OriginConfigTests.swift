import Testing

@testable import ProxyCore

@Suite struct OriginConfigTests {
    let parser = ConfigParser(homeDirectory: "/home/ada", baseDirectory: "/etc/proxyctl")
    let provider = "[provider corp]\nissuer = https://login.example.com\nclient_id = proxyctl\n"

    func parse(_ text: String) -> Result<Configuration, ConfigErrors> { parser.parse(text, file: "proxy.conf") }

    @Test func parsesAndNormalisesOrigins() throws {
        let config = try parse(
            provider + "[origin HTTPS://API.Example.COM.:443]\nprovider = corp\nclient_authorization = replace\n"
                + "[origin http://127.0.0.1:8000]\nprovider = corp\n"
        ).get()
        #expect(config.origins.origins.count == 2)
        let api = try #require(
            config.origins.match(scheme: "https", authority: HostPort(host: "api.example.com", port: 443, kind: .name)))
        #expect(api.url == "https://api.example.com")
        #expect(api.clientAuthorization == .replace)
        #expect(config.origins.tlsHosts == ["api.example.com"])
        #expect(
            config.origins.match(scheme: "http", authority: HostPort(host: "127.0.0.1", port: 8000, kind: .ipv4)) != nil
        )
    }

    /// Issue 31: a client's own credential is replaced by default, for an origin with a provider as for one with a
    /// secret; `keep` (or the older `client_authorization = keep`) only when written.
    @Test func theClientsOwnCredentialIsReplacedByDefaultForProvidersToo() throws {
        let config = try parse(
            provider + "[origin https://a.example.com]\nprovider = corp\n"
                + "[origin https://b.example.com]\nprovider = corp\nclient_authorization = keep\n"
                + "[origin https://c.example.com]\nprovider = corp\nclient_credential = keep\n"
                + "[origin https://d.example.com]\nsecret_file = /k\n"
        ).get()
        let policies = config.origins.origins.map { ($0.url, $0.clientAuthorization) }
        #expect(policies.map(\.0) == (["a", "b", "c", "d"].map { "https://\($0).example.com" }))
        #expect(policies.map(\.1) == [.replace, .keep, .keep, .replace])
        #expect(config.origins.origins[0].attachesToken(clientHasAuthorization: true))
    }

    @Test(arguments: [
        ("https", "api.example.com.evil.test", 443), ("https", "evil.test", 443), ("https", "api.example.com", 8443),
        ("https", "sub.api.example.com", 443), ("http", "api.example.com", 80), ("https", "example.com", 443),
    ])
    func matchingIsExact(scheme: String, host: String, port: Int) throws {
        let config = try parse(provider + "[origin https://api.example.com]\nprovider = corp\n").get()
        #expect(config.origins.match(scheme: scheme, authority: HostPort(host: host, port: port, kind: .name)) == nil)
    }

    @Test(arguments: [
        "[origin http://api.example.com]", "[origin https://10.0.0.1]", "[origin https://api.example.com/v1]",
        "[origin ftp://api.example.com]", "[origin https://api.example.com?x=1]", "[origin]",
    ])
    func rejectedOrigins(header: String) {
        guard case .failure(let errors) = parse(provider + header + "\nprovider = corp\n") else {
            Issue.record("\(header) was accepted")
            return
        }
        #expect(errors.errors.first?.line == 4)
    }

    @Test func duplicateOriginsAfterNormalisation() throws {
        guard
            case .failure(let errors) = parse(
                provider
                    + "[origin https://api.example.com]\nprovider = corp\n[origin https://API.example.com.:443/]\nprovider = corp\n"
            )
        else {
            Issue.record("duplicates accepted")
            return
        }
        #expect(errors.errors.map(\.line) == [6])
        #expect(errors.errors[0].message.contains("line 4"))
    }

    @Test func originNeedsAKnownProvider() {
        guard case .failure(let errors) = parse(provider + "[origin https://api.example.com]\nprovider = other\n")
        else {
            Issue.record("unknown provider accepted")
            return
        }
        #expect(errors.errors[0].key == "provider")
        #expect(errors.errors[0].line == 5)
        #expect(errors.errors[0].message.contains("corp"))
        guard case .failure(let missing) = parse(provider + "[origin https://api.example.com]\n") else {
            Issue.record("missing provider accepted")
            return
        }
        #expect(missing.errors[0].key == "provider")
    }

    @Test func badClientAuthorization() {
        guard
            case .failure(let errors) = parse(
                provider + "[origin https://api.example.com]\nprovider = corp\nclient_authorization = merge\n")
        else {
            Issue.record("accepted")
            return
        }
        #expect(errors.errors[0].key == "client_authorization")
    }
}

/// `[origin https://*.DOMAIN]`: every host below DOMAIN, the most specific section winning, the CA's `.DOMAIN`.
@Suite struct WildcardOriginTests {
    let parser = ConfigParser(homeDirectory: "/home/ada", baseDirectory: "/etc/proxyctl")
    let provider = "[provider corp]\nissuer = https://login.example.com\nclient_id = proxyctl\n"

    func table(_ sections: String) throws -> OriginTable {
        try parser.parse(provider + sections, file: "p.conf").get().origins
    }

    func host(_ name: String, _ port: Int = 443) -> HostPort { HostPort(host: name, port: port, kind: .name) }

    @Test(arguments: [
        ("a.corp.example", 443, "https://*.corp.example"), ("x.y.corp.example", 443, "https://*.corp.example"),
        ("api.corp.example", 443, nil as String?), ("deep.eu.corp.example", 443, "https://*.eu.corp.example"),
        ("eu.corp.example", 443, "https://*.corp.example"), ("corp.example", 443, "not matched"),
        ("a.corp.example", 8443, "not matched"), ("evilcorp.example", 443, "not matched"),
        ("a.corp.example.evil.test", 443, "not matched"), ("corp.example.", 443, "not matched"),
        ("*.corp.example", 443, "not matched"), ("a.*.corp.example", 443, "not matched"),
    ])
    func theMostSpecificSectionWins(name: String, port: Int, pattern: String?) throws {
        let origins = try table(
            "[origin https://*.corp.example]\nprovider = corp\nresource = https://*.corp.example/\n"
                + "[origin https://api.corp.example]\nprovider = corp\n"
                + "[origin https://*.eu.corp.example]\nprovider = corp\n")
        let found = origins.match(scheme: "https", authority: host(name, port))
        if pattern == "not matched" {
            #expect(found == nil)
            return
        }
        let origin = try #require(found)
        #expect(origin.pattern == pattern && !origin.isWildcard)
        #expect(origin.url == "https://\(name)" && origin.authority == host(name, port))
        if pattern == "https://*.corp.example" {
            let labels = name.dropLast(".corp.example".count)
            #expect(origin.resource == "https://\(labels).corp.example/")
            #expect(origin.tokenKey.resource == "https://\(labels).corp.example/")
        }
        #expect(origins.match(scheme: "http", authority: host(name, port)) == nil)
    }

    @Test func theCAPermitsTheDomainsBelowAndTheExactHosts() throws {
        let origins = try table(
            "[origin https://*.corp.example]\nprovider = corp\n[origin https://api.corp.example]\nprovider = corp\n"
                + "[origin https://other.test]\nprovider = corp\n")
        #expect(origins.tlsHosts == [".corp.example", "api.corp.example", "other.test"])
        let constraints = NameConstraints.exactly(origins.tlsHosts)
        // api.corp.example's own subtree is not excluded: the wildcard covers x.api.corp.example.
        #expect(constraints.excludedDNS == [".other.test"])
        for permitted in ["a.corp.example", "x.api.corp.example", "api.corp.example", "other.test"] {
            #expect(constraints.permits(dnsName: permitted), "\(permitted)")
        }
        for refused in [
            "corp.example", "sub.other.test", "evilcorp.example", "a.corp.example.evil", "10.0.0.1", "*.corp.example",
        ] {
            #expect(!constraints.permits(dnsName: refused), "\(refused)")
        }
        #expect(NameConstraints.display(".corp.example") == "*.corp.example")
        #expect(origins.wildcard(covering: "https://a.corp.example")?.url == "https://*.corp.example")
        #expect(origins.wildcard(covering: "https://api.corp.example") == nil)
        #expect(origins.wildcard(covering: "https://other.test") == nil)
    }

    /// Two exact hosts, one below the other (found by FuzzConfig): the upper host's excluded subtree took the
    /// lower host from the CA, whose leaf every client then refused.
    @Test func theCAPermitsAnExactHostBelowAnother() throws {
        let origins = try table(
            "[origin https://corp.example]\nprovider = corp\n[origin https://api.corp.example]\nprovider = corp\n"
                + "[origin https://v2.api.corp.example]\nprovider = corp\n[origin https://other.test]\nprovider = corp\n"
        )
        let constraints = NameConstraints.exactly(origins.tlsHosts)
        #expect(constraints.excludedDNS == [".other.test", ".v2.api.corp.example"])
        for permitted in ["corp.example", "api.corp.example", "v2.api.corp.example", "other.test"] {
            #expect(constraints.permits(dnsName: permitted), "\(permitted)")
            #expect(origins.match(scheme: "https", authority: host(permitted, 443))?.url == "https://\(permitted)")
        }
        for refused in ["x.v2.api.corp.example", "sub.other.test", "evilcorp.example", "example", "10.0.0.1"] {
            #expect(!constraints.permits(dnsName: refused), "\(refused)")
        }
    }

    @Test(arguments: [
        ("[origin https://*.com]", "top-level domain"), ("[origin https://*.internal]", "top-level domain"),
        ("[origin https://*]", "written https://*.DOMAIN"),
        ("[origin https://a.*.corp.example]", "written https://*.DOMAIN"),
        ("[origin https://*.*.corp.example]", "written https://*.DOMAIN"),
        ("[origin https://x*.corp.example]", "written"),
        ("[origin http://*.localhost]", "https://"), ("[origin https://*.10.0.0.1]", "host name"),
        ("[origin https://*..corp.example]", "host name"),
    ])
    func badPatternsAreNamed(header: String, reason: String) {
        guard case .failure(let errors) = parser.parse(provider + header + "\nprovider = corp\n", file: "p.conf") else {
            Issue.record("\(header) was accepted")
            return
        }
        #expect(errors.errors.first?.message.contains(reason) == true, "\(errors)")
    }

    @Test func aWildcardAndItsDomainAreTwoSectionsAndStarsOnlyGoInAWildcardsResource() throws {
        let origins = try table(
            "[origin https://corp.example]\nprovider = corp\n[origin https://*.corp.example:8443]\nprovider = corp\n")
        #expect(origins.origins.map(\.url) == ["https://corp.example", "https://*.corp.example:8443"])
        #expect(
            origins.match(scheme: "https", authority: host("a.corp.example", 8443))?.url
                == "https://a.corp.example:8443")
        guard
            case .failure = parser.parse(
                provider
                    + "[origin https://*.corp.example]\nprovider = corp\n[origin https://*.CORP.example.]\nprovider = corp\n",
                file: "p.conf"),
            case .failure = parser.parse(
                provider + "[origin https://api.test]\nprovider = corp\nresource = https://*.api.test/\n",
                file: "p.conf"),
            case .failure = parser.parse(
                provider + "[origin https://*.api.test]\nprovider = corp\nresource = https://*.*.api.test/\n",
                file: "p.conf")
        else {
            Issue.record("accepted")
            return
        }
    }
}
