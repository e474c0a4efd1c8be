import ProxyCore
import Testing

@testable import ProxyIO

/// The own client takes an origin's parsed parts from its `OriginConfig` and only the target from the URL; a
/// URL that is not the origin's URL followed by an origin-form target is parsed whole, as before.
@Suite struct OriginTransferTests {
    let origin = OriginConfig(scheme: "https", authority: HostPort(host: "api.test", port: 443, kind: .name))

    @Test func theTargetIsWhatFollowsTheOriginsURL() {
        #expect(origin.url == "https://api.test")
        #expect(OriginTransfer.target(of: "https://api.test/v1/items?page=2", at: origin) == "/v1/items?page=2")
        #expect(OriginTransfer.target(of: "https://api.test/", at: origin) == "/")
        let long = "/" + String(repeating: "a", count: 300)
        #expect(OriginTransfer.target(of: "https://api.test" + long, at: origin) == long)
    }

    @Test func anythingElseIsLeftToTheParser() {
        for url in [
            "https://api.test",  // no target
            "https://api.test.evil/x",  // another host that starts the same
            "https://api.test:8443/x",  // another port
            "http://api.test/x",  // another scheme
            "https://api.test/x#fragment",  // refused by the parser
            "https://api.test?q",
        ] {
            #expect(OriginTransfer.target(of: url, at: origin) == nil, "\(url)")
        }
    }
}
