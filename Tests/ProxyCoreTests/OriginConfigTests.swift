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
