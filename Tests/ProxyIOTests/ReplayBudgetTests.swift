import Foundation
import TestFixtures
import Testing

@testable import ProxyIO

/// Request bodies kept for replays share one budget per process, a quarter of it per connection: memory first
/// (up to each body's `replay_memory`), then the spool; past the connection's or the process's share a body
/// streams on, unkept, and says so once. What a body held comes back when it goes.
@Suite struct ReplayBudgetTests {
    let scratch: TemporaryDirectory
    /// The spool directory, made by the first body that spools.
    var spool: String { scratch.path + "/spool" }

    init() throws { scratch = try TemporaryDirectory() }

    func bytes(_ count: Int, _ value: UInt8 = 7) -> [UInt8] { [UInt8](repeating: value, count: count) }

    func append(_ body: RequestBody, _ count: Int, _ value: UInt8 = 7) throws -> Bool {
        try bytes(count, value).withUnsafeBytes { try body.append($0) }
    }

    /// Up to `count` bytes from `offset`, as the transfer reads them (a piece per call).
    func read(_ body: RequestBody, from offset: Int, _ count: Int) -> [UInt8] {
        var result: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: count)
        while result.count < count {
            let wanted = count - result.count
            let got = buffer.withUnsafeMutableBytes {
                body.read(at: offset + result.count, into: UnsafeMutableRawBufferPointer(rebasing: $0[..<wanted]))
            }
            if got == 0 { break }
            result += buffer.prefix(got)
        }
        return result
    }

    @Test func memoryThenSpoolWithinTheConnectionsShare() throws {
        let budget = ReplayBudget(.init(memory: 400, spool: 4_000))  // a connection: 100 and 1,000
        let account = ReplayAccount(budget)
        var body: RequestBody? = RequestBody(memoryLimit: 1_000, spoolDirectory: spool, account: account)
        #expect(try append(body!, 60))
        #expect(account.memory == 60 && account.spool == 0)
        #expect(try append(body!, 60), "40 more in memory (the connection's 100), 20 to the spool")
        #expect(account.memory == 100 && account.spool == 20)
        #expect(budget.memory == 100 && budget.spool == 20)
        #expect(body!.replayable && body!.stored == 120)
        #expect(read(body!, from: 90, 20) == bytes(20), "the kept body reads back across memory and spool")
        body = nil
        #expect(account.memory == 0 && account.spool == 0 && budget.memory == 0 && budget.spool == 0)
    }

    @Test func pastTheConnectionsShareTheBodyStreamsOnce() throws {
        let budget = ReplayBudget(.init(memory: 400, spool: 4_000))
        let account = ReplayAccount(budget)
        let body = RequestBody(memoryLimit: 1_000, spoolDirectory: spool, account: account)
        #expect(try append(body, 900, 1))
        #expect(try append(body, 300, 2) == false, "100 + 800 kept; 300 more would pass the spool's 1,000")
        #expect(body.streaming && !body.replayable)
        #expect(body.stored == 900 && body.queued == 300, "what did not fit waits for the transfer, not lost")
        #expect(try append(body, 50, 3), "streaming now: queued without a word")
        #expect(read(body, from: 0, 900) == bytes(900, 1))
        #expect(read(body, from: 900, 1_000) == bytes(300, 2) + bytes(50, 3), "the rest in order, once")
        #expect(read(body, from: 1_250, 10) == [])
        #expect(account.spool == 800, "streamed bytes are not counted as kept")
    }

    @Test func theProcessLimitBindsAcrossConnections() throws {
        let budget = ReplayBudget(.init(memory: 400, spool: 400))  // a connection: 100 and 100
        let accounts = (0..<5).map { _ in ReplayAccount(budget) }
        var bodies = accounts.map { RequestBody(memoryLimit: 1_000, spoolDirectory: spool, account: $0) }
        for body in bodies.prefix(4) { #expect(try append(body, 200)) }
        #expect(budget.memory == 400 && budget.spool == 400, "four connections took the whole budget")
        #expect(try append(bodies[4], 1) == false, "a fifth connection gets nothing kept")
        #expect(accounts[4].memory == 0 && bodies[4].streaming)
        bodies.removeFirst()
        #expect(budget.memory == 300 && budget.spool == 300, "the first body's share came back")
        let next = RequestBody(memoryLimit: 1_000, spoolDirectory: spool, account: accounts[0])
        #expect(try append(next, 150) && next.replayable)
    }

    @Test func memoryGivenBackMidBodyIsNotUsedOnceTheSpoolBegan() throws {
        // A body that spooled part of itself while memory was short, then finds memory free again (another
        // body's exchange ended): its next bytes still go to the spool, after the others, so it reads back in
        // order. The second HTTP/2 upload test under AddressSanitizer caught the body arriving reordered.
        let budget = ReplayBudget(.init(memory: 400, spool: 4_000))  // a connection: 100 and 1,000
        let account = ReplayAccount(budget)
        var other: RequestBody? = RequestBody(memoryLimit: 1_000, spoolDirectory: spool, account: account)
        #expect(try append(other!, 80, 9))
        let body = RequestBody(memoryLimit: 1_000, spoolDirectory: spool, account: account)
        #expect(try append(body, 50, 1), "20 in memory, 30 to the spool")
        other = nil  // 80 bytes of memory come back
        #expect(try append(body, 50, 2))
        #expect(account.memory == 20 && account.spool == 80)
        #expect(read(body, from: 0, 100) == bytes(50, 1) + bytes(50, 2), "the body in the order it came")
    }

    @Test func aBodyWithinItsOwnLimitNeedsNoSpoolWhenMemoryIsLeft() throws {
        let budget = ReplayBudget(.init(memory: 64 << 20, spool: 1 << 30))
        let account = ReplayAccount(budget)
        let body = RequestBody(memoryLimit: 1 << 20, spoolDirectory: spool, account: account)
        #expect(try append(body, 1 << 20))
        #expect(account.memory == 1 << 20 && account.spool == 0)
    }
}
