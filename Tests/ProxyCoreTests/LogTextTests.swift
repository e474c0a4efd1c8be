import Testing

@testable import ProxyCore

/// How URLs, targets, durations and numbers appear in log lines (`LogText`, `LogLineBuilder`): never a query.
struct LogTextTests {
    private func url(_ text: String) throws -> AbsoluteURL {
        guard case .success(let url) = AbsoluteURL.parse(text) else { throw ParseFailed() }
        return url
    }

    private struct ParseFailed: Error {}

    @Test func queriesNeverReachTheLog() throws {
        let url = try AbsoluteURL.parse("http://api.test/cb?code=SECRET&state=x").get()
        let text = LogText.url(url)
        #expect(!text.contains("SECRET"))
        #expect(text == "http://api.test/cb?...")
        #expect(LogText.target("/cb?access_token=SECRET") == "/cb?...")
    }

    /// "?" followed by a combining mark is one Character: the query must be cut all the same.
    @Test func queriesBehindACombiningMarkNeverReachTheLog() throws {
        let url = try AbsoluteURL.parse("http://api.test/cb?\u{301}code=SECRET").get()
        #expect(!LogText.url(url).contains("SECRET"))
        #expect(LogText.url(url) == "http://api.test/cb?...")
        #expect(!LogText.target("/cb?\u{301}access_token=SECRET").contains("SECRET"))
        #expect(LogText.target("/cb?\u{301}access_token=SECRET") == "/cb?...")
    }

    @Test func durations() {
        #expect(LogText.duration(12) == "12ms")
        #expect(LogText.duration(1234) == "1.23s")
        #expect(LogText.duration(60_050) == "60.05s")
    }

    @Test(arguments: [
        ("http://a.test/x", "http://a.test/x"),
        ("HTTP://A.Test:80/x?code=secret", "http://a.test/x?..."),
        ("https://a.test:443", "https://a.test/"),
        ("https://a.test:8443/p/q?", "https://a.test:8443/p/q?..."),
        ("http://[::1]:8080/?token=1", "http://[::1]:8080/?..."),
        ("http://127.0.0.1./?", "http://127.0.0.1/?..."),
    ])
    func urlsLoseTheirQuery(_ given: String, _ logged: String) throws {
        #expect(LogText.url(try url(given)) == logged)
    }

    @Test(arguments: [
        ("/x", "/x"),
        ("/x?access_token=1", "/x?..."),
        ("?", "?..."),
        ("/\u{1}\u{7F}é", "/???"),
        (String(repeating: "a", count: 200), String(repeating: "a", count: 200)),
        (String(repeating: "a", count: 201) + "?q", String(repeating: "a", count: 200) + "...?..."),
        ("*", "*"),
    ])
    func targetsAreClippedPrintableAndLoseTheirQuery(_ given: String, _ logged: String) {
        #expect(LogText.target(given) == logged)
    }

    @Test(arguments: [
        (Int64(0), "0ms"), (999, "999ms"), (1000, "1.00s"), (1009, "1.00s"), (1010, "1.01s"), (2050, "2.05s"),
        (61_999, "61.99s"), (-5, "-5ms"),
    ])
    func durations(_ milliseconds: Int64, _ logged: String) {
        #expect(LogText.duration(milliseconds) == logged)
    }

    @Test func numbersAreDecimal() {
        var line = LogLineBuilder(capacity: 8)
        for value in [0, 7, 10, 65_535, -12, Int.max, Int.min] {
            line.append(value)
            line.append(" ")
        }
        line.append(UInt64.max)
        #expect(
            line.text == "0 7 10 65535 -12 \(Int.max) \(Int.min) \(UInt64.max)")
    }

    @Test func anExchangeRecordsLineHasNoQueryAndNamesWhatHappened() {
        let record = ExchangeRecord(
            method: "GET", origin: "https://api.test", provider: "corp", target: "/v1/items?key=secret", status: 200,
            attempts: 2, keptClientAuthorization: true, attached: true, refreshed: true, nonceRetried: true,
            stepUp: false, answeredByProxy: false, note: "a note", close: false)
        #expect(
            record.logLine(up: 12, down: 3456, milliseconds: 1234)
                == "GET https://api.test/v1/items?... status=200 up=12 down=3456 duration=1.23s intercepted=corp"
                + " token=client attempts=2 refreshed=1 nonce_retry=1 note=\"a note\"")
    }
}
