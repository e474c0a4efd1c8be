import CLibevent
import ProxyCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// What the request bodies kept for replays may hold at once in the whole process, in memory and in spool
/// files; each connection gets `connectionShare` of each (`ReplayAccount`). Without it every body may keep
/// `replay_memory` in memory: 4 HTTP/2 connections of 100 streams each uploading 1 MiB to a slow origin held
/// 400 MiB. Loop-confined, like the connections that use it.
final class ReplayBudget {
    struct Limits: Equatable {
        var memory: Int
        var spool: Int
    }
    /// The process's limits (a reload may change them; what is kept already stays until its exchange ends).
    var limits: Limits
    /// A connection may hold this fraction of each limit: one client cannot take the whole budget.
    static let connectionShare = 4
    private(set) var memory = 0
    private(set) var spool = 0

    init(_ limits: Limits) { self.limits = limits }

    var connectionLimits: Limits {
        Limits(memory: limits.memory / Self.connectionShare, spool: limits.spool / Self.connectionShare)
    }

    fileprivate func take(memory count: Int) { memory += count }
    fileprivate func take(spool count: Int) { spool += count }
    fileprivate func give(memory: Int, spool: Int) {
        self.memory -= memory
        self.spool -= spool
    }
}

/// One connection's share of the `ReplayBudget`: what its exchanges' bodies hold, and what they may still take.
final class ReplayAccount {
    let budget: ReplayBudget
    private(set) var memory = 0
    private(set) var spool = 0

    init(_ budget: ReplayBudget) { self.budget = budget }

    /// Memory a body may take now, of `wanted`.
    func memoryRoom(_ wanted: Int) -> Int {
        let connection = budget.connectionLimits.memory - memory
        let process = budget.limits.memory - budget.memory
        return max(0, min(wanted, connection, process))
    }

    /// Whether `count` more bytes may go to a spool file.
    func spoolRoom(_ count: Int) -> Bool {
        spool + count <= budget.connectionLimits.spool && budget.spool + count <= budget.limits.spool
    }

    fileprivate func took(memory count: Int) {
        memory += count
        budget.take(memory: count)
    }

    fileprivate func took(spool count: Int) {
        spool += count
        budget.take(spool: count)
    }

    fileprivate func gave(memory: Int, spool: Int) {
        self.memory -= memory
        self.spool -= spool
        budget.give(memory: memory, spool: spool)
    }
}

/// A request body kept so that the request can be sent again (after a token refresh or a DPoP nonce
/// challenge): in memory up to `memoryLimit`, then in an unlinked 0600 file, as far as its connection's
/// `ReplayAccount` lets it. When the exchange says the body is too large to keep (`startStreaming`), or the
/// account has no room left (`append` says so, the exchange is told), what is stored is sent, then the rest
/// streams through a queue.
final class RequestBody {
    let memoryLimit: Int
    private let spoolDirectory: String
    private let account: ReplayAccount?
    private var memory: [UInt8] = []
    private var spool: Int32 = -1
    private var spooled = 0
    /// Bytes beyond the stored part, waiting to be read by the transfer (streaming mode only).
    private var queue: [UInt8] = []
    private var queueStart = 0
    /// Bytes received so far.
    private(set) var received = 0
    /// All bytes of the body have been received.
    private(set) var complete = false
    /// The body outgrew the spool: it can be sent once only.
    private(set) var streaming = false

    init(memoryLimit: Int, spoolDirectory: String, account: ReplayAccount? = nil) {
        self.memoryLimit = memoryLimit
        self.spoolDirectory = spoolDirectory
        self.account = account
    }

    deinit {
        if spool >= 0 { close(spool) }
        account?.gave(memory: memory.count, spool: spooled)
    }

    var stored: Int { memory.count + spooled }
    var replayable: Bool { !streaming }
    /// Bytes waiting in the streaming queue.
    var queued: Int { queue.count - queueStart }

    /// From now on bytes are queued for the transfer and not kept (`ProtectedExchange` decides when).
    func startStreaming() { streaming = true }

    func finish() { complete = true }

    /// Keeps `bytes`; false when the account had no room for all of them: the body streams from here on (its
    /// exchange must be told: `ProtectedExchange.bodyBeyondBudget`). Throws when the spool file cannot be
    /// written.
    func append(_ bytes: UnsafeRawBufferPointer) throws -> Bool {
        received += bytes.count
        if streaming {
            enqueue(bytes[...])
            return true
        }
        var remaining = bytes[...]
        // Memory holds the body's first bytes and the spool the rest: once a byte went to the spool, memory the
        // account gets back meanwhile (another body's exchange ended) is not for this body.
        if spooled == 0 && memory.count < memoryLimit {
            let wanted = min(memoryLimit - memory.count, remaining.count)
            let take = account?.memoryRoom(wanted) ?? wanted
            memory.append(contentsOf: remaining.prefix(take))
            account?.took(memory: take)
            remaining = remaining.dropFirst(take)
        }
        if remaining.isEmpty { return true }
        if let account, !account.spoolRoom(remaining.count) {
            streaming = true
            enqueue(remaining)
            return false
        }
        let before = spooled
        defer { account?.took(spool: spooled - before) }
        try writeSpool(UnsafeRawBufferPointer(rebasing: remaining))
        return true
    }

    private func enqueue(_ bytes: Slice<UnsafeRawBufferPointer>) {
        if queueStart > 0 && queueStart == queue.count {
            queue.removeAll(keepingCapacity: true)
            queueStart = 0
        }
        queue.append(contentsOf: bytes)
    }

    private func writeSpool(_ bytes: UnsafeRawBufferPointer) throws {
        if spool < 0 {
            try FileManager.default.createDirectory(
                atPath: spoolDirectory, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
            let path = "\(spoolDirectory)/body-\(getpid())-\(UInt64.random(in: 0...UInt64.max))"
            spool = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0o600)
            guard spool >= 0 else { throw POSIXError(.init(rawValue: errno) ?? .EIO) }
            // Unlinked at once: the bytes disappear with the descriptor, even if the process dies.
            unlink(path)
        }
        var offset = 0
        while offset < bytes.count {
            let written = pwrite(spool, bytes.baseAddress! + offset, bytes.count - offset, off_t(spooled))
            if written < 0 && errno == EINTR { continue }
            guard written > 0 else { throw POSIXError(.init(rawValue: errno) ?? .EIO) }
            offset += written
            spooled += written
        }
    }

    /// Copies bytes starting at `offset` of the body into `buffer`; returns the count, 0 at the end of what
    /// is available. In streaming mode, bytes past the stored part are consumed from the queue.
    func read(at offset: Int, into buffer: UnsafeMutableRawBufferPointer) -> Int {
        if offset < memory.count {
            let count = min(buffer.count, memory.count - offset)
            memory.withUnsafeBytes { source in
                buffer.baseAddress!.copyMemory(from: source.baseAddress! + offset, byteCount: count)
            }
            return count
        }
        if offset < stored {
            let count = min(buffer.count, stored - offset)
            let read = pread(spool, buffer.baseAddress, count, off_t(offset - memory.count))
            return max(0, read)
        }
        guard streaming, queued > 0 else { return 0 }
        let count = min(buffer.count, queued)
        queue.withUnsafeBytes { source in
            buffer.baseAddress!.copyMemory(from: source.baseAddress! + queueStart, byteCount: count)
        }
        queueStart += count
        return count
    }
}
