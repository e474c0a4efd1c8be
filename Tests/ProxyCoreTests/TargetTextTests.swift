import Testing

@testable import ProxyCore

@Suite struct TargetTextTests {
    @Test(
        arguments: [
            ("/a?b=c", "/a", "b=c"),
            ("/a", "/a", nil),
            ("?", "", ""),
            ("/a?b?c", "/a", "b?c"),
            // A combining mark after the delimiter makes one Character with it; the bytes still say "?".
            ("/cb?\u{301}code=SECRET", "/cb", "\u{301}code=SECRET"),
            ("/caf\u{e9}?q=\u{e9}", "/caf\u{e9}", "q=\u{e9}"),
        ] as [(String, String, String?)])
    func splitsOnTheFirstDelimiterByte(text: String, before: String, after: String?) {
        let (head, tail) = TargetText.split(text, at: "?")
        #expect(Array(head.utf8) == Array(before.utf8))
        #expect(tail.map { Array($0.utf8) } == after.map { Array($0.utf8) })
    }

    @Test func withoutQueryDropsQueryAndFragment() {
        #expect(TargetText.withoutQuery("https://a.test/x?y#z") == "https://a.test/x")
        #expect(TargetText.withoutQuery("https://a.test/x#\u{301}z?y") == "https://a.test/x")
        #expect(TargetText.withoutQuery("https://a.test/x") == "https://a.test/x")
    }
}
