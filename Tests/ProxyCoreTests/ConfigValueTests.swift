import Testing

@testable import ProxyCore

/// The value types of proxy.conf: durations, sizes, booleans and listen addresses.
@Suite struct ConfigValueTests {
    @Test(arguments: [
        ("500ms", 500),
        ("0ms", 0),
        ("10s", 10_000),
        ("5m", 300_000),
        ("1h", 3_600_000),
        ("10", 10_000),  // a bare number is seconds
        ("0", 0),
        ("90 s", 90_000),
        ("2 h", 7_200_000),
        ("5ms", 5),  // not "5m" followed by "s"
    ])
    func duration(text: String, milliseconds: Int) {
        #expect(ConfigValue.duration(text) == milliseconds)
    }

    @Test(arguments: [
        "5x", "", "ms", "s", "-1", "-5s", "1.5s", "5 m s", "5S", "5M", "five", "9223372036854775807h",
        "99999999999999999999",
    ])
    func invalidDuration(text: String) {
        #expect(ConfigValue.duration(text) == nil)
    }

    @Test(arguments: [
        ("65536", 65536),
        ("0", 0),
        ("64KiB", 65536),
        ("8k", 8192),
        ("8K", 8192),
        ("1MiB", 1 << 20),
        ("2M", 2 << 20),
        ("1GiB", 1 << 30),
        ("1G", 1 << 30),
        ("512B", 512),
        ("8 KiB", 8192),
    ])
    func size(text: String, bytes: Int) {
        #expect(ConfigValue.size(text) == bytes)
    }

    @Test(arguments: ["64KB", "64kib", "64kb", "1.5M", "-1", "-1K", "", "K", "KiB", "lots", "8 K B", "1T"])
    func invalidSize(text: String) {
        #expect(ConfigValue.size(text) == nil)
    }

    @Test func bool() {
        for text in ["true", "yes", "on", "1", "TRUE", "Yes"] { #expect(ConfigValue.bool(text) == true, "\(text)") }
        for text in ["false", "no", "off", "0", "Off"] { #expect(ConfigValue.bool(text) == false, "\(text)") }
        for text in ["", "2", "y", "enabled"] { #expect(ConfigValue.bool(text) == nil, "\(text)") }
    }

    @Test(arguments: [(7_200_000, "2h"), (300_000, "5m"), (90_000, "90s"), (1500, "1500ms"), (0, "0s")])
    func describeDuration(milliseconds: Int, text: String) {
        #expect(ConfigValue.describeDuration(milliseconds) == text)
        #expect(ConfigValue.duration(text) == milliseconds)
    }

    @Test(arguments: [
        ("127.0.0.1:8080", "127.0.0.1", 8080, false, true),
        ("0.0.0.0:3128", "0.0.0.0", 3128, false, false),
        ("localhost:9000", "127.0.0.1", 9000, false, true),
        ("[::1]:8080", "::1", 8080, true, true),
        ("[::]:0", "::", 0, true, false),
        ("10.0.0.1:65535", "10.0.0.1", 65535, false, false),
        ("[::ffff:127.0.0.1]:80", "::ffff:127.0.0.1", 80, true, true),
    ])
    func listenAddress(text: String, host: String, port: Int, isIPv6: Bool, isLoopback: Bool) throws {
        let address = try #require(ListenAddress.parse(text))
        #expect(address == ListenAddress(host: host, port: port, isIPv6: isIPv6))
        #expect(address.isLoopback == isLoopback)
        #expect(address.description == (text.hasPrefix("localhost") ? "127.0.0.1:\(port)" : text))
    }

    @Test(arguments: [
        "8080", "127.0.0.1", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:+1", "127.0.0.1:8o",
        "example.com:80", "[::1]", "[::1]:", "[::1]8080", "::1:8080", "[127.0.0.1]:80", "[localhost]:80",
        "256.0.0.1:80", ":80", "",
    ])
    func invalidListenAddress(text: String) {
        #expect(ListenAddress.parse(text) == nil)
    }
}
