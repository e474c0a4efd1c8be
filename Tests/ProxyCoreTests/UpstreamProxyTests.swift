import Testing

@testable import ProxyCore

/// `upstream_proxy`: the corporate proxy URL and its credentials.
@Suite struct UpstreamProxyTests {
    @Test func plainAddress() throws {
        let proxy = try UpstreamProxy.parse("http://proxy.corp.example:3128").get()
        #expect(proxy.address == HostPort(host: "proxy.corp.example", port: 3128, kind: .name))
        #expect(proxy.username == nil)
        #expect(proxy.password == nil)
        #expect(proxy.authorization == nil)
        #expect(proxy.description == "http://proxy.corp.example:3128")
    }

    @Test(arguments: [
        ("http://proxy", HostPort(host: "proxy", port: 8080, kind: .name)),  // 8080 when the port is absent
        ("HTTP://Proxy.Example:3128/", HostPort(host: "proxy.example", port: 3128, kind: .name)),
        ("http://10.0.0.1:3128", HostPort(host: "10.0.0.1", port: 3128, kind: .ipv4)),
        ("http://[::1]:3128", HostPort(host: "::1", port: 3128, kind: .ipv6)),
    ])
    func addresses(text: String, address: HostPort) throws {
        #expect(try UpstreamProxy.parse(text).get().address == address)
    }

    @Test func credentials() throws {
        let proxy = try UpstreamProxy.parse("http://user:pass@proxy:3128").get()
        #expect(proxy.username == "user")
        #expect(proxy.password == "pass")
        // RFC 7617 §2: base64("user:pass").
        #expect(proxy.authorization == "Basic dXNlcjpwYXNz")
        #expect(!proxy.description.contains("pass"))
        #expect(proxy.description == "http://proxy:3128")
    }

    @Test func percentEncodedCredentials() throws {
        let proxy = try UpstreamProxy.parse("http://us%65r%40corp:p%40ss%3Aw%2Fo%25rd%C3%A9@proxy:3128").get()
        #expect(proxy.username == "user@corp")
        #expect(proxy.password == "p@ss:w/o%rd\u{E9}")
        #expect(proxy.authorization == "Basic " + Base64.encode("user@corp:p@ss:w/o%rd\u{E9}".utf8))
    }

    @Test func unencodedAtInPasswordUsesTheLastAt() throws {
        let proxy = try UpstreamProxy.parse("http://user:p@ss@proxy:3128").get()
        #expect(proxy.password == "p@ss")
        #expect(proxy.address.host == "proxy")
    }

    @Test func userWithoutPassword() throws {
        let proxy = try UpstreamProxy.parse("http://user@proxy:3128").get()
        #expect(proxy.username == "user")
        #expect(proxy.password == nil)
        #expect(proxy.authorization == "Basic dXNlcjo=")
        let empty = try UpstreamProxy.parse("http://user:@proxy:3128").get()
        #expect(empty.password == "")
        #expect(empty.authorization == "Basic dXNlcjo=")
    }

    @Test(arguments: [
        "proxy:3128",  // scheme missing
        "//proxy:3128",
        "https://proxy:3128",  // only http:// proxies
        "socks5://proxy:1080",
        "http:/proxy:3128",
        "http://proxy:3128/path",
        "http://proxy:3128//",
        "http://proxy:0",
        "http://proxy:70000",
        "http://",
        "http://@proxy:3128",
        "http://:secret@proxy:3128",
        "http://us%zzer:pw@proxy:3128",
        "http://user:pw%4@proxy:3128",
        "http://user:pw%C3@proxy:3128",  // not UTF-8 once decoded
        "http://user:pw@",
        "http://pro xy:3128",
    ])
    func invalid(text: String) {
        #expect(throws: ValueError.self) { try UpstreamProxy.parse(text).get() }
    }

    @Test(arguments: [
        "http://user:TopSecret99@pro xy:3128",
        "https://user:TopSecret99@proxy:3128",
        "user:TopSecret99@proxy:3128",
        "http://user:TopSecret99@proxy:3128/x",
        "http://user:TopSecret99%zz@proxy:3128",
        "http://user:TopSecret99@proxy:99999",
        "http://user:TopSecret99@[::1",
    ])
    func errorNeverContainsThePassword(text: String) {
        guard case .failure(let error) = UpstreamProxy.parse(text) else {
            Issue.record("a bad URL was accepted")
            return
        }
        #expect(!error.message.contains("TopSecret99"))
        #expect(!error.description.contains("TopSecret99"))
    }
}

/// `no_upstream_proxy`: which targets go direct, in the spirit of `NO_PROXY`.
@Suite struct BypassListTests {
    private func list(_ text: String) throws -> BypassList { try BypassList.parse(text).get() }

    private func name(_ host: String) -> HostPort { HostPort(host: host, port: 443, kind: .name) }

    private func target(_ authority: String) throws -> HostPort {
        try HostPort.parse(authority[...], defaultPort: 443).get()
    }

    @Test func domainMatchesItselfAndSubdomains() throws {
        for text in ["example.com", ".example.com", "*.example.com", "EXAMPLE.COM", "example.com."] {
            let bypass = try list(text)
            #expect(bypass.domains == ["example.com"], "\(text)")
            #expect(bypass.matches(name("example.com")), "\(text)")
            #expect(bypass.matches(name("www.example.com")), "\(text)")
            #expect(bypass.matches(name("a.b.example.com")), "\(text)")
            #expect(!bypass.matches(name("badexample.com")), "\(text)")
            #expect(!bypass.matches(name("example.com.evil.test")), "\(text)")
            #expect(!bypass.matches(name("example.org")), "\(text)")
            #expect(!bypass.matches(name("com")), "\(text)")
        }
    }

    @Test func targetsAreNormalisedBeforeMatching() throws {
        let bypass = try list("example.com")
        #expect(bypass.matches(try target("WWW.Example.COM.:8443")))
    }

    @Test func starMatchesEverything() throws {
        let bypass = try list("*")
        #expect(bypass.matchesAll)
        #expect(bypass.matches(name("anything.test")))
        #expect(bypass.matches(try target("10.1.2.3")))
        #expect(bypass.matches(try target("[::1]")))
    }

    @Test func emptyListMatchesNothing() throws {
        for text in ["", " ", ",,", " , \t"] {
            let bypass = try list(text)
            #expect(bypass == BypassList(), "\(text.debugDescription)")
            #expect(!bypass.matches(name("example.com")))
            #expect(!bypass.matches(try target("127.0.0.1")))
        }
    }

    @Test func cidrAndAddressEntriesMatchIPLiteralTargets() throws {
        let bypass = try list("10.0.0.0/8, 192.168.1.5 fd00::/8\t::1")
        #expect(bypass.ranges.count == 4)
        #expect(bypass.domains.isEmpty)
        #expect(bypass.matches(try target("10.200.0.1")))
        #expect(!bypass.matches(try target("11.0.0.1")))
        #expect(bypass.matches(try target("192.168.1.5")))
        #expect(!bypass.matches(try target("192.168.1.6")))
        #expect(bypass.matches(try target("[fd12::1]")))
        #expect(!bypass.matches(try target("[fe80::1]")))
        #expect(bypass.matches(try target("[::1]:8080")))
        // A range never matches a name, even one that resolves into it.
        #expect(!bypass.matches(name("localhost")))
        #expect(!bypass.matches(name("10.example")))
    }

    @Test func domainEntriesDoNotMatchIPLiterals() throws {
        let bypass = try list("localhost, 0.1")
        #expect(bypass.matches(name("localhost")))
        #expect(!bypass.matches(try target("127.0.0.1")))
        #expect(!bypass.matches(try target("10.0.0.1")))
    }

    @Test func mixedList() throws {
        let bypass = try list("localhost,.internal.example, 127.0.0.0/8 ,*.Corp.Example.")
        #expect(bypass.domains == ["localhost", "internal.example", "corp.example"])
        #expect(bypass.ranges == [try #require(CIDR.parse("127.0.0.0/8"))])
        #expect(bypass.matches(name("git.corp.example")))
        #expect(bypass.matches(name("svc.internal.example")))
        #expect(bypass.matches(try target("127.0.0.1")))
        #expect(!bypass.matches(name("example.com")))
    }

    @Test(arguments: ["exa@mple.com", ".", "*.", "a%20b", "10.0.0.0/33", "exa/mple", "[::1]", "\"quoted\""])
    func invalidEntries(text: String) {
        #expect(throws: ValueError.self) { try BypassList.parse("ok.example, \(text)").get() }
    }
}
