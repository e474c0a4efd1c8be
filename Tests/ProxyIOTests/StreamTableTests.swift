import Testing

@testable import ProxyIO

/// `StreamTable` remembers the last stream looked up: what it answers must be what a dictionary would.
@Suite struct StreamTableTests {
    @Test func answersAsADictionaryWouldThroughAddsLookupsAndRemovals() {
        var table = StreamTable()
        var reference: [Int32: H2StreamIO] = [:]
        var seed: UInt64 = 0x9E37_79B9_7F4A_7C15
        func next() -> Int32 {
            seed = seed &* 6_364_136_223_846_793_005 &+ 1_442_695_040_888_963_407
            return Int32(truncatingIfNeeded: seed >> 33) & 15
        }
        for _ in 0..<5_000 {
            let id = next() * 2 + 1
            switch next() % 4 {
            case 0:
                let io = H2StreamIO(id: id)
                table[id] = io
                reference[id] = io
            case 1:
                table.removeValue(forKey: id)
                reference.removeValue(forKey: id)
            case 2:
                table[id] = nil
                reference[id] = nil
            default:
                #expect(table[id] === reference[id])
            }
            #expect(table[id] === reference[id])
            #expect(table.values.count == reference.count)
        }
        table.removeAll()
        for id in reference.keys { #expect(table[id] == nil) }
    }
}
