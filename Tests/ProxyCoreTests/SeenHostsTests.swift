import Testing

@testable import ProxyCore

@Suite struct SeenHostsTests {
    static let wildcard = "https://*.corp.test"

    @Test func aNewHostIsWorthWritingABusyOneOnlyOnceAnHour() {
        var seen = SeenHosts()
        let first = seen.record("https://a.corp.test", under: Self.wildcard, at: 1_000)
        let busy = seen.record("https://a.corp.test", under: Self.wildcard, at: 1_500)
        let other = seen.record("https://b.corp.test", under: Self.wildcard, at: 1_600)
        let anHourLater = seen.record("https://a.corp.test", under: Self.wildcard, at: 1_000 + SeenHosts.refreshAfter)
        #expect(first && !busy && other && anHourLater)
        #expect(seen.hosts(of: Self.wildcard) == ["https://a.corp.test", "https://b.corp.test"])
        #expect(seen.hosts(of: "https://*.other.test").isEmpty)
    }

    @Test func theCountIsBoundedTheLeastRecentlySeenGoingFirst() {
        var seen = SeenHosts()
        for index in 0..<(SeenHosts.limit + 10) {
            seen.record("https://h\(index).corp.test", under: Self.wildcard, at: Int64(index))
        }
        let kept = seen.hosts(of: Self.wildcard)
        #expect(kept.count == SeenHosts.limit)
        #expect(!kept.contains("https://h0.corp.test") && !kept.contains("https://h9.corp.test"))
        #expect(kept.contains("https://h10.corp.test") && kept.contains("https://h265.corp.test"))
    }

    @Test func theFileReadsBackMergesAndForgetsRemovedWildcards() {
        var one = SeenHosts()
        one.record("https://a.corp.test", under: Self.wildcard, at: 10)
        one.record("https://x.gone.test", under: "https://*.gone.test", at: 10)
        var other = SeenHosts()
        other.record("https://a.corp.test", under: Self.wildcard, at: 50)
        other.record("https://b.corp.test", under: Self.wildcard, at: 20)
        let merged = one.merged(with: other)
        #expect(merged.hosts[Self.wildcard] == ["https://a.corp.test": 50, "https://b.corp.test": 20])
        #expect(SeenHosts(json: merged.json) == merged)
        #expect(merged.keeping([Self.wildcard]).hosts.keys.sorted() == [Self.wildcard])
        let text = JSON.serialize(merged.json)
        #expect(text.hasPrefix("{\"wildcards\":{\"https://*.corp.test\":{\"https://a.corp.test\":50"), "\(text)")
        // Hand-edited junk is skipped.
        guard
            case .success(let junk) = JSON.parse(
                Array(#"{"wildcards":{"w":{"not a url":1,"https://a.test":"x"}}}"#.utf8))
        else {
            Issue.record("not JSON")
            return
        }
        #expect(SeenHosts(json: junk).hosts.isEmpty)
    }
}
