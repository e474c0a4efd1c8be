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

/// A request body kept so that the request can be sent again (after a token refresh or a DPoP nonce
/// challenge): in memory up to `memoryLimit`, then in an unlinked 0600 file. When the exchange says the body
/// is too large to keep (`startStreaming`), what is stored is sent, then the rest streams through a queue.
final class RequestBody {
    let memoryLimit: Int
    private let spoolDirectory: String
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

    init(memoryLimit: Int, spoolDirectory: String) {
        self.memoryLimit = memoryLimit
        self.spoolDirectory = spoolDirectory
    }

    deinit { if spool >= 0 { close(spool) } }

    var stored: Int { memory.count + spooled }
    var replayable: Bool { !streaming }
    /// Bytes waiting in the streaming queue.
    var queued: Int { queue.count - queueStart }

    /// From now on bytes are queued for the transfer and not kept (`ProtectedExchange` decides when).
    func startStreaming() { streaming = true }

    func finish() { complete = true }

    /// Keeps `bytes`. Throws when the spool file cannot be written.
    func append(_ bytes: UnsafeRawBufferPointer) throws {
        received += bytes.count
        if streaming {
            if queueStart > 0 && queueStart == queue.count {
                queue.removeAll(keepingCapacity: true)
                queueStart = 0
            }
            queue.append(contentsOf: bytes)
            return
        }
        var remaining = bytes[...]
        if memory.count < memoryLimit {
            let take = min(memoryLimit - memory.count, remaining.count)
            memory.append(contentsOf: remaining.prefix(take))
            remaining = remaining.dropFirst(take)
        }
        if remaining.isEmpty { return }
        try writeSpool(UnsafeRawBufferPointer(rebasing: remaining))
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
