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

/// The audit log: every use of a credential as one JSON line (`AuditEntry`) appended to `state_dir/audit.log`
/// (0600, O_APPEND: the serves and the exec proxies of one state directory write to one file, a line in one write),
/// moved to `audit.log.1` when it passes `maxBytes` (the one before is dropped). Loop thread only. A write that
/// fails is said once in the log and the proxy goes on: the audit log records, it does not gate.
///
/// A line names the client's user, pid and executable where the kernel says (`PeerLookup.client`): it is written
/// when the connection's process is known, a moment after the exchange ended at most (the lookup began with the
/// connection's interception), with the time the exchange ended.
///
/// The lines of one pass of the loop are held and written together at its end (`flush`; at once past 64 KiB, and
/// when the server stops or the log is replaced): one `write` and one `fstat` for a pass's requests, where each
/// request made both.
final class AuditLog {
    let path: String
    let maxBytes: Int
    private let logger: Logger
    private let peers: PeerLookup
    private var fd: Int32 = -1
    private var warned = false
    private let uid = Int(geteuid())
    /// Lines of this pass of the loop, not yet written.
    private var held: [UInt8] = []
    private var flushTask: LoopTimer?
    private static let heldLimit = 64 * 1024

    init(stateDirectory: String, maxBytes: Int, logger: Logger, peers: PeerLookup, loop: EventLoop) {
        self.path = stateDirectory + "/audit.log"
        self.maxBytes = maxBytes
        self.logger = logger
        self.peers = peers
        flushTask = LoopTimer(loop: loop) { [weak self] in self?.flush() }
    }

    deinit {
        flush()
        if fd >= 0 { close(fd) }
    }

    /// The exchange's line, if the proxy attached a credential in it. `ownerAdmitted`: the front door admitted only
    /// the proxy's own user (`protected_users = owner`), which names the user where the kernel did not.
    func record(_ record: ExchangeRecord, connection: UInt64, client: String, ownerAdmitted: Bool) {
        guard record.attached else { return }
        let now = Int64(time(nil))
        peers.client(connection: connection) { [self] known in
            guard
                let line = AuditEntry.jsonLine(
                    record, time: now, uid: known.uid ?? (ownerAdmitted ? uid : nil), process: known.process,
                    client: client)
            else { return }
            append(line)
        }
    }

    /// The line of a request refused for carrying another origin's placeholder (a refused use of that origin's
    /// credential; the placeholder is not in it).
    func refused(_ use: RefusedCredentialUse, connection: UInt64, client: String, ownerAdmitted: Bool) {
        let now = Int64(time(nil))
        peers.client(connection: connection) { [self] known in
            let entry = AuditEntry(
                use, time: now, uid: known.uid ?? (ownerAdmitted ? uid : nil), process: known.process, client: client)
            append(entry.jsonLine)
        }
    }

    /// Holds `line` for the end of the pass.
    private func append(_ line: [UInt8]) {
        let first = held.isEmpty
        held.append(contentsOf: line)
        if held.count >= Self.heldLimit {
            flush()
        } else if first {
            flushTask?.fireInThisPass()
        }
    }

    /// Writes the held lines now (the loop is about to stop, say).
    func flush() {
        guard !held.isEmpty else { return }
        writeLines(held)
        held.removeAll(keepingCapacity: held.capacity <= Self.heldLimit * 2)
    }

    private func writeLines(_ line: [UInt8]) {
        if fd < 0 { fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0o600) }
        guard fd >= 0 else { return fail() }
        var info = stat()
        if fstat(fd, &info) == 0, Int(info.st_size) + line.count > maxBytes, info.st_size > 0 {
            // Another process may have rotated it already: only the file this one still has open is moved.
            var current = stat()
            if stat(path, &current) == 0, current.st_ino == info.st_ino { _ = rename(path, path + ".1") }
            close(fd)
            fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0o600)
            guard fd >= 0 else { return fail() }
        }
        let written = line.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
        if written != line.count { fail() }
    }

    private func fail() {
        guard !warned else { return }
        warned = true
        logger.warn("the audit log \(path) cannot be written: \(String(cString: strerror(errno)))")
    }
}
