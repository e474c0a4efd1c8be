import Testing

@testable import ProxyCore

/// The audit log's held lines: each line as `AuditEntry` writes it alone, one after the other, whatever the
/// seconds and sizes.
@Suite struct AuditLinesTests {
    private func record(target: String = "/v1/items?key=SECRET", provider: String = "corp") -> ExchangeRecord {
        ExchangeRecord(
            method: "GET", origin: "https://a.test", provider: provider, target: target, status: 200, attempts: 1,
            keptClientAuthorization: false, attached: true, refreshed: false, nonceRetried: false, stepUp: false,
            answeredByProxy: false, note: nil, close: false)
    }

    private func lines(of held: AuditLines) -> [String] {
        held.withBytes { String(decoding: $0, as: UTF8.self) }.split(separator: "\n", omittingEmptySubsequences: false)
            .map(String.init)
    }

    /// The start a line shares with the others of its second is written again when the second changes, in either
    /// direction (a refused request's line carries the time it was refused, which can be a second before).
    @Test func eachLineHasItsOwnSecond() throws {
        let held = AuditLines()
        let times: [Int64] = [1_767_323_045, 1_767_323_045, 1_767_323_046, 1_767_323_044, 0]
        for time in times { held.append(record(), time: time, uid: 1000, client: "127.0.0.1:5000") }
        let written = lines(of: held)
        #expect(written.count == times.count + 1 && written.last == "")
        for (line, time) in zip(written, times) {
            let entry = try #require(AuditEntry.parse(line))
            #expect(entry.time == time && entry.path == "/v1/items" && entry.uid == 1000)
            #expect(line.hasPrefix(#"{"time":"\#(AuditEntry.timestamp(time))","ts":\#(time),"origin":"#))
        }
    }

    /// A buffer that starts small grows to hold lines longer than it, and keeps the bytes it had.
    @Test func theBufferGrowsAndKeepsWhatItHeld() throws {
        let held = AuditLines(capacity: 64)
        let long = "/" + String(repeating: "a\"b", count: 700)
        var expected: [UInt8] = []
        for index in 0..<40 {
            let target = index % 3 == 0 ? long + "?q" : "/short/\(index)"
            let time = 100 + Int64(index / 7)
            held.append(record(target: target, provider: "p\(index)"), time: time, uid: nil, client: "[::1]:\(index)")
            expected +=
                AuditEntry(
                    time: time, origin: "https://a.test", method: "GET", path: AuditEntry.pathOnly(target),
                    credential: "p\(index)", kind: "token", status: 200, attempts: 1, refreshed: false,
                    replacedClientCredential: false, placeholder: false, uid: nil, client: "[::1]:\(index)"
                ).jsonLine
        }
        // As a Bool: a difference is shown by the counts and the lines read back, not as 60,000 bytes.
        let same = held.withBytes { [UInt8]($0) } == expected
        #expect(same)
        #expect(held.count == expected.count)
        #expect(lines(of: held).dropLast().compactMap(AuditEntry.parse).filter { $0.path == long }.count == 14)
    }

    /// Emptied, it holds nothing and takes lines again.
    @Test func emptiedItTakesLinesAgain() throws {
        let held = AuditLines(capacity: 64)
        held.append(record(target: "/" + String(repeating: "x", count: 4000)), time: 1, uid: nil, client: "c")
        #expect(held.count > 4000)
        held.removeAll(keepingAtMost: 128)
        #expect(held.isEmpty && held.count == 0 && held.withBytes { $0.count } == 0)
        held.append(record(), time: 2, uid: nil, client: "c")
        let entry = try #require(lines(of: held).first.flatMap(AuditEntry.parse))
        #expect(entry.time == 2 && entry.path == "/v1/items" && lines(of: held).count == 2)
    }

    /// A refused use's entry and an exchange's record go through one writer: the entry's own line.
    @Test func anEntryIsHeldAsItsOwnLine() throws {
        var entry = AuditEntry(
            time: 1_767_323_045, origin: "https://a.test", method: "POST", path: "/p", credential: "secret:b",
            kind: "secret", status: 403, attempts: 0, refreshed: false, replacedClientCredential: false,
            placeholder: true, uid: 7, client: "127.0.0.1:1",
            process: ClientProcess(pid: 9, executable: "/usr/bin/curl"))
        entry.refused = "placeholder"
        entry.placeholderOf = "https://b.test"
        entry.placeholderEnv = "B_KEY"
        let held = AuditLines()
        held.append(record(), time: 1_767_323_045, uid: nil, client: "c")
        let first = held.count
        held.append(entry)
        #expect(held.withBytes { [UInt8]($0.dropFirst(first)) } == entry.jsonLine)
        #expect(lines(of: held).dropLast().last.flatMap(AuditEntry.parse) == entry)
    }
}
