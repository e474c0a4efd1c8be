import Testing

@testable import ProxyCore

/// RFC 5280 §4.2.1.10 DNS name constraints, as the local CA checks a name before it signs a leaf (issue 32
/// item 3): the constraints it writes permit exactly its hosts.
@Suite struct NameConstraintsTests {
    static let ca = NameConstraints.exactly(["api.test", "git.example.com"])

    @Test(arguments: [
        ("api.test", true), ("API.Test.", true), ("git.example.com", true),
        ("sub.api.test", false), ("a.b.api.test", false), ("other.test", false), ("badapi.test", false),
        ("api.test.evil.test", false), ("example.com", false), ("x.git.example.com", false),
        ("127.0.0.1", false), ("::1", false), ("", false), (".api.test", false), ("api..test", false),
        ("localhost", false),
    ])
    func theLocalCAPermitsExactlyItsHosts(name: String, permitted: Bool) {
        #expect(Self.ca.permits(dnsName: name) == permitted)
    }

    @Test func subtreeRules() {
        // A constraint without a dot takes the name and every name made by adding labels on its left.
        let below = NameConstraints(permittedDNS: ["example.com"], excludedDNS: [], excludesEveryAddress: false)
        #expect(below.permits(dnsName: "example.com") && below.permits(dnsName: "a.b.example.com"))
        #expect(!below.permits(dnsName: "badexample.com") && !below.permits(dnsName: "example.com.evil"))
        // A leading dot: below it only.
        let only = NameConstraints(permittedDNS: [".example.com"], excludedDNS: [], excludesEveryAddress: false)
        #expect(!only.permits(dnsName: "example.com") && only.permits(dnsName: "a.example.com"))
        // No permitted DNS subtree: every name not excluded.
        let open = NameConstraints(permittedDNS: [], excludedDNS: ["evil.test"], excludesEveryAddress: false)
        #expect(open.permits(dnsName: "good.test") && !open.permits(dnsName: "x.evil.test"))
        // An empty constraint is every name.
        let all = NameConstraints(permittedDNS: [""], excludedDNS: [], excludesEveryAddress: false)
        #expect(all.permits(dnsName: "anything.test"))
        #expect(Self.ca.excludesEveryAddress)
    }
}
