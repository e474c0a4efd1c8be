import Testing

@testable import ProxyCore

/// The port `proxyctl init` writes as `redirect_port`: the fixed default when it is free, the file's own port
/// when one is replaced, else the next free one, never inside the kernel's ephemeral range.
@Suite struct RedirectPortTests {
    @Test func theDefaultWhenItIsFree() throws {
        let choice = try #require(RedirectPort.choose(existing: nil, ephemeral: 32768...60999, isFree: { _ in true }))
        #expect(choice.port == 17755 && choice.reason == .preferred)
    }

    @Test func thePortOfTheFileReplacedStays() throws {
        let choice = try #require(RedirectPort.choose(existing: 8250, ephemeral: 32768...60999, isFree: { _ in false }))
        #expect(choice.port == 8250 && choice.reason == .kept)
        // A file with redirect_port = 0 (any port) has nothing registered to keep.
        let fresh = try #require(RedirectPort.choose(existing: 0, ephemeral: 32768...60999, isFree: { _ in true }))
        #expect(fresh.reason == .preferred)
    }

    @Test func theNextFreeOneWhenTheDefaultIsBusy() throws {
        let busy: Set<Int> = [17755, 17756]
        let choice = try #require(
            RedirectPort.choose(existing: nil, ephemeral: 32768...60999, isFree: { !busy.contains($0) }))
        #expect(choice.port == 17757 && choice.reason == .fallback(busy: [17755, 17756]))
    }

    @Test func beyondTheNearbyPortsThenWrappingBelowTheDefault() throws {
        // Everything from the default up to the ephemeral range is taken: the first free one from 1024.
        let choice = try #require(
            RedirectPort.choose(existing: nil, ephemeral: 32768...60999, isFree: { $0 < 17755 && $0 >= 5000 }))
        #expect(choice.port == 5000)
        #expect(choice.reason == .fallback(busy: Array(17755...17765)))
        let above = try #require(
            RedirectPort.choose(existing: nil, ephemeral: 32768...60999, isFree: { $0 == 30000 }))
        #expect(above.port == 30000)
    }

    @Test func neverInsideTheEphemeralRange() throws {
        // An unusual range that starts just above the default: only the ports below it are candidates.
        let range = 17758...60999
        let choice = try #require(RedirectPort.choose(existing: nil, ephemeral: range, isFree: { $0 >= 17757 }))
        #expect(choice.port == 17757)
        #expect(RedirectPort.choose(existing: nil, ephemeral: range, isFree: { $0 >= 17758 }) == nil)
    }

    @Test func anUnknownRangeIsTakenForLinuxsDefault() throws {
        // Where the range cannot be read (docs/porting.md: macOS, PROXYCTL_PORTABLE=1), 32768-60999 is assumed,
        // which lies below macOS's 49152-65535 too: a candidate is never at or above 32768.
        let choice = try #require(RedirectPort.choose(existing: nil, ephemeral: nil, isFree: { $0 >= 32000 }))
        #expect(choice.port == 32000)
        #expect(RedirectPort.choose(existing: nil, ephemeral: nil, isFree: { $0 >= 32768 }) == nil)
    }

    @Test func aRangeThatLeavesNoRoomBelowTheDefaultKeepsTheDefault() throws {
        let choice = try #require(RedirectPort.choose(existing: nil, ephemeral: 1024...65535, isFree: { _ in true }))
        #expect(choice.port == 17755)
    }

    @Test(arguments: [
        ("32768\t60999\n", 32768...60999), ("1024 65535", 1024...65535),
    ])
    func ephemeralRange(text: String, range: ClosedRange<Int>) {
        #expect(RedirectPort.ephemeralRange(text) == range)
    }

    @Test(arguments: ["", "32768", "60999 32768", "0 100", "1 70000", "a b"])
    func ephemeralRangeRefusesNonsense(text: String) {
        #expect(RedirectPort.ephemeralRange(text) == nil)
    }
}
