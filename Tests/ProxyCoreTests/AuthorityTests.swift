import Testing

@testable import ProxyCore

/// IP address text (RFC 4291 §2.2, dotted quads without octal ambiguity) and CIDR ranges.
@Suite struct IPAddressTests {
    @Test(arguments: [
        ("0.0.0.0", UInt32(0)),
        ("127.0.0.1", 0x7F00_0001),
        ("10.1.2.3", 0x0A01_0203),
        ("255.255.255.255", 0xFFFF_FFFF),
        ("192.168.0.10", 0xC0A8_000A),
        ("1.0.0.100", 0x0100_0064),
    ])
    func ipv4(text: String, value: UInt32) {
        #expect(IPAddress.parse(text) == .v4(value))
    }

    @Test(arguments: [
        "01.2.3.4",  // leading zero: octal to some parsers
        "1.2.3.04",
        "1.2.3.00",
        "256.1.1.1",
        "1.2.3.256",
        "1.2.3.1000",
        "1.2.3",
        "1.2.3.4.5",
        "1.2.3.4.",
        ".1.2.3",
        "1..2.3",
        "1.2.3.-4",
        "1.2.3.4 ",
        " 1.2.3.4",
        "0x7f.0.0.1",
        "2130706433",
        "a.b.c.d",
        "",
    ])
    func invalidIPv4(text: String) {
        #expect(IPAddress.parse(text) == nil)
    }

    @Test(arguments: [
        ("::", UInt64(0), UInt64(0)),
        ("::1", 0, 1),
        ("1::", 0x0001_0000_0000_0000, 0),
        ("2001:db8::1", 0x2001_0DB8_0000_0000, 1),
        ("2001:0db8:0000:0000:0000:0000:0000:0001", 0x2001_0DB8_0000_0000, 1),
        ("2001:DB8:0:0:8:800:200C:417A", 0x2001_0DB8_0000_0000, 0x0008_0800_200C_417A),
        ("1:2:3:4:5:6:7:8", 0x0001_0002_0003_0004, 0x0005_0006_0007_0008),
        ("1:2:3:4:5:6:7::", 0x0001_0002_0003_0004, 0x0005_0006_0007_0000),
        ("::2:3:4:5:6:7:8", 0x0000_0002_0003_0004, 0x0005_0006_0007_0008),
        ("fe80::1:2", 0xFE80_0000_0000_0000, 0x0000_0000_0001_0002),
        ("ff02::", 0xFF02_0000_0000_0000, 0),
        // A trailing dotted IPv4 part (RFC 4291 §2.2 form 3).
        ("::1.2.3.4", 0, 0x0000_0000_0102_0304),
        ("::ffff:127.0.0.1", 0, 0x0000_FFFF_7F00_0001),
        ("::FFFF:10.0.0.1", 0, 0x0000_FFFF_0A00_0001),
        ("64:ff9b::192.0.2.33", 0x0064_FF9B_0000_0000, 0x0000_0000_C000_0221),
        ("1:2:3:4:5:6:1.2.3.4", 0x0001_0002_0003_0004, 0x0005_0006_0102_0304),
        ("0:0:0:0:0:ffff:1.2.3.4", 0, 0x0000_FFFF_0102_0304),
    ])
    func ipv6(text: String, high: UInt64, low: UInt64) {
        #expect(IPAddress.parse(text) == .v6(high, low))
    }

    @Test(arguments: [
        ":",
        ":::",
        "1:::2",
        "1::2::3",
        ":1",
        "1:",
        "1:2:3:4:5:6:7",
        "1:2:3:4:5:6:7:8:9",
        "1:2:3:4:5:6:7:8::",
        "::1:2:3:4:5:6:7:8",
        "12345::",
        "g::1",
        "::1.2.3",
        "::1.2.3.256",
        "::01.2.3.4",
        "1.2.3.4::",
        "::1.2.3.4:5",
        "1:2:3:4:5:6:7:1.2.3.4",
        "[::1]",
        "::1%eth0",
        " ::1",
    ])
    func invalidIPv6(text: String) {
        #expect(IPAddress.parse(text) == nil)
    }

    @Test func loopback() throws {
        for text in ["127.0.0.1", "127.255.0.9", "::1", "::ffff:127.0.0.1"] {
            #expect(try #require(IPAddress.parse(text)).isLoopback, "\(text)")
        }
        for text in ["128.0.0.1", "0.0.0.0", "::", "::2", "10.0.0.1", "::ffff:10.0.0.1", "fe80::1"] {
            #expect(!(try #require(IPAddress.parse(text)).isLoopback), "\(text)")
        }
    }

    @Test func cidrParse() throws {
        let range = try #require(CIDR.parse("10.0.0.0/8"))
        #expect(range.address == .v4(0x0A00_0000))
        #expect(range.prefix == 8)
        #expect(CIDR.parse("10.1.2.3")?.prefix == 32)
        #expect(CIDR.parse("fd00::")?.prefix == 128)
        #expect(CIDR.parse("::/0")?.prefix == 0)
        for bad in ["10.0.0.0/33", "10.0.0.0/-1", "10.0.0.0/", "10.0.0.0/a", "fd00::/129", "example.com/8", "/8", ""] {
            #expect(CIDR.parse(bad) == nil, "\(bad)")
        }
    }

    @Test(arguments: [
        ("10.0.0.0/8", "10.0.0.0", true),
        ("10.0.0.0/8", "10.255.255.255", true),
        ("10.0.0.0/8", "11.0.0.0", false),
        ("10.0.0.0/8", "9.255.255.255", false),
        ("192.168.1.0/24", "192.168.1.77", true),
        ("192.168.1.0/24", "192.168.2.1", false),
        ("192.168.1.128/25", "192.168.1.127", false),
        ("192.168.1.128/25", "192.168.1.200", true),
        ("172.16.0.0/12", "172.31.255.255", true),
        ("172.16.0.0/12", "172.32.0.0", false),
        ("10.1.2.3/32", "10.1.2.3", true),
        ("10.1.2.3/32", "10.1.2.4", false),
        ("10.1.2.3", "10.1.2.3", true),
        ("0.0.0.0/0", "203.0.113.9", true),
        ("1.2.3.4/0", "255.255.255.255", true),
        ("0.0.0.0/0", "::1", false),  // families never match
        ("fd00::/8", "fd12:3456::1", true),
        ("fd00::/8", "fe00::1", false),
        ("2001:db8::/32", "2001:db8:ffff::1", true),
        ("2001:db8::/32", "2001:db9::1", false),
        ("2001:db8::/64", "2001:db8::ffff:ffff:ffff:ffff", true),
        ("2001:db8::/64", "2001:db8:0:1::", false),
        ("2001:db8::/65", "2001:db8::7fff:ffff:ffff:ffff", true),
        ("2001:db8::/65", "2001:db8::8000:0:0:0", false),
        ("::1/128", "::1", true),
        ("::1/128", "::2", false),
        ("::1", "::1", true),
        ("::/0", "2001:db8::1", true),
        ("::/0", "1.2.3.4", false),
        ("::ffff:0:0/96", "::ffff:10.0.0.1", true),
    ])
    func cidrContains(range: String, address: String, expected: Bool) throws {
        let cidr = try #require(CIDR.parse(range))
        let ip = try #require(IPAddress.parse(address))
        #expect(cidr.contains(ip) == expected)
    }
}

/// `host[:port]` as in CONNECT and URLs (RFC 9112 §3.2.3, RFC 3986 §3.2).
@Suite struct HostPortTests {
    @Test(arguments: [
        ("example.com:443", nil, "example.com", 443, HostPort.Kind.name),
        ("Example.COM:8080", nil, "example.com", 8080, .name),
        ("example.com.:443", nil, "example.com", 443, .name),  // trailing dot removed
        ("example.com", 80, "example.com", 80, .name),
        ("example.com:", 80, "example.com", 80, .name),  // RFC 3986 §3.2.3: empty port means default
        ("localhost:1", nil, "localhost", 1, .name),
        ("10.0.0.1:65535", nil, "10.0.0.1", 65535, .ipv4),
        ("[::1]:8443", nil, "::1", 8443, .ipv6),
        ("[2001:DB8::A]:443", nil, "2001:db8::a", 443, .ipv6),
        ("[::1]", 80, "::1", 80, .ipv6),
        ("xn--nxasmq6b.example:443", nil, "xn--nxasmq6b.example", 443, .name),
        ("1.2.3.4.5.example:80", nil, "1.2.3.4.5.example", 80, .name),  // numeric labels, but a name
    ])
    func parse(text: String, defaultPort: Int?, host: String, port: Int, kind: HostPort.Kind) throws {
        let parsed = try HostPort.parse(text[...], defaultPort: defaultPort).get()
        #expect(parsed == HostPort(host: host, port: port, kind: kind))
    }

    @Test(arguments: [
        "user@example.com:443", "u:p@example.com:443", "example.com", "example.com:", ":443", "[::1]", "[::1]x:443",
        "[::1:443", "[zz::1]:443", "[]:443", "example.com:0", "example.com:65536", "example.com:123456",
        "example.com:+80", "example.com:8 0", "exa mple.com:80", "exa/mple.com:80", "::1:443", "a:b:443",
        ".:443",
        // Numeric forms inet_aton would read as addresses (octal, hex, short, one number).
        "01.2.3.4:80", "127.1:80", "0x7f.0.0.1:80", "2130706433:80", "0x7f000001:80", "1.2.3.4.5:80",
    ])
    func invalid(text: String) {
        #expect(throws: HTTPParseError.self) { try HostPort.parse(text[...], defaultPort: nil).get() }
    }

    /// `isSpelled(by:)` lets a Host field skip the parse; it may say yes only where the parse gives the same
    /// authority, and says yes to the usual spellings.
    @Test func aHostFieldSpelledAsTheAuthorityNeedsNoParse() throws {
        let authorities = [
            HostPort(host: "api.test", port: 443, kind: .name), HostPort(host: "api.test", port: 8443, kind: .name),
            HostPort(host: "127.0.0.1", port: 443, kind: .ipv4), HostPort(host: "::1", port: 443, kind: .ipv6),
        ]
        let spellings = [
            "api.test", "api.test:443", "api.test:8443", "api.test:08443", "api.test:", "api.test.", "API.test",
            "api.test:443x", "api.test:0", "api.test:65536", "api.testx", "api.tes", "127.0.0.1", "127.0.0.1:443",
            "127.0.0.1.:443", "127.0.0.1:4430", "[::1]:443", "::1", "", ":443", "api.test:+443", "api.test::443",
        ]
        for authority in authorities {
            for spelling in spellings {
                let bytes = Array(spelling.utf8)[...]
                guard authority.isSpelled(by: bytes, defaultPort: 443) else { continue }
                #expect(
                    try HostPort.parse(spelling[...], defaultPort: 443).get() == authority,
                    "\(spelling) is not \(authority)")
            }
        }
        let spelled = { (authority: HostPort, text: String) in
            authority.isSpelled(by: Array(text.utf8)[...], defaultPort: 443)
        }
        #expect(spelled(authorities[0], "api.test") && spelled(authorities[0], "api.test:443"))
        #expect(spelled(authorities[1], "api.test:8443") && !spelled(authorities[1], "api.test"))
        #expect(spelled(authorities[2], "127.0.0.1:443"))
        #expect(!spelled(authorities[0], "API.test") && !spelled(authorities[0], "api.test."))
        #expect(!spelled(authorities[3], "[::1]:443"))
    }

    @Test func description() {
        #expect(HostPort(host: "example.com", port: 443, kind: .name).description == "example.com:443")
        #expect(HostPort(host: "::1", port: 443, kind: .ipv6).description == "[::1]:443")
        #expect(HostPort(host: "::1", port: 443, kind: .ipv6).hostForURL == "[::1]")
        #expect(HostPort(host: "10.0.0.1", port: 80, kind: .ipv4).hostForURL == "10.0.0.1")
    }
}

/// Absolute-form request targets (RFC 9112 §3.2.2).
@Suite struct AbsoluteURLTests {
    @Test(arguments: [
        ("http://example.com/a/b?c=d", "http", "example.com", 80, "/a/b?c=d"),
        ("http://example.com", "http", "example.com", 80, "/"),
        ("http://example.com?q=1", "http", "example.com", 80, "/?q=1"),
        ("http://example.com/", "http", "example.com", 80, "/"),
        ("http://example.com:8080", "http", "example.com", 8080, "/"),
        ("http://example.com:/x", "http", "example.com", 80, "/x"),
        ("https://example.com/x", "https", "example.com", 443, "/x"),
        ("HTTP://EXAMPLE.com/Path", "http", "example.com", 80, "/Path"),
        ("http://[::1]:8080/x", "http", "::1", 8080, "/x"),
        ("http://10.0.0.1/", "http", "10.0.0.1", 80, "/"),
        ("http://example.com/a//b?x=http://y", "http", "example.com", 80, "/a//b?x=http://y"),
    ])
    func parse(text: String, scheme: String, host: String, port: Int, path: String) throws {
        let url = try AbsoluteURL.parse(text).get()
        #expect(url.scheme == scheme)
        #expect(url.authority.host == host)
        #expect(url.authority.port == port)
        #expect(url.pathAndQuery == path)
    }

    @Test(arguments: [
        "http://example.com/#frag", "http://example.com#", "http://user@example.com/", "http://u:p@example.com/",
        "ftp://example.com/", "ws://example.com/", "example.com/", "/path", "http:/example.com", "http://",
        "http:///path", "http://example.com:0/", "http://example.com:65536/", "http://exa mple.com/",
    ])
    func invalid(text: String) {
        #expect(throws: HTTPParseError.self) { try AbsoluteURL.parse(text).get() }
    }

    @Test(arguments: [
        ("http://example.com/", "example.com"),
        ("http://example.com:80/", "example.com"),
        ("http://example.com:443/", "example.com:443"),
        ("https://example.com:443/", "example.com"),
        ("https://example.com:80/", "example.com:80"),
        ("http://Example.COM:8080/", "example.com:8080"),
        ("http://[::1]/", "[::1]"),
        ("http://[::1]:8080/", "[::1]:8080"),
    ])
    func hostFieldValue(text: String, expected: String) throws {
        let url = try AbsoluteURL.parse(text).get()
        #expect(url.hostFieldValue == expected)
        #expect(url.hasDefaultPort == !expected.hasSuffix(":\(url.authority.port)"))
    }
}
