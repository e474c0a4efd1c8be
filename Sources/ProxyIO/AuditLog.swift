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
/// when the server stops or the log is replaced): one `write` for a pass's requests, where each request made one.
/// The file's size is looked at (`fstat`) once a second, and before a write that could take it past `maxBytes`;
/// in between, this process counts what it wrote (another process's lines count from the next look).
final class AuditLog {
    let path: String
    let maxBytes: Int
    private let logger: Logger
    private let peers: PeerLookup
    private var fd: Int32 = -1
    private var warned = false
    private let uid = Int(geteuid())
    /// Lines of this pass of the loop, not yet written.
    private let held = AuditLines()
    private var flushTask: LoopTimer?
    private static let heldLimit = 64 * 1024
    /// The file's size when it was last looked at (`fstat`), with the lines written since, and the second it was
    /// looked at: it is looked at once a second, and whenever the next write could take it past `maxBytes`.
    private var knownSize = 0
    private var sizeCheckedAt: Int64?

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
        // Known at once for every exchange of a connection after its first: no closure to make.
        if let known = peers.clientIfKnown(connection: connection) {
            return line(record, time: now, known: known, client: client, ownerAdmitted: ownerAdmitted)
        }
        peers.client(connection: connection) { [self] known in
            line(record, time: now, known: known, client: client, ownerAdmitted: ownerAdmitted)
        }
    }

    private func line(
        _ record: ExchangeRecord, time: Int64, known: PeerLookup.Client, client: String, ownerAdmitted: Bool
    ) {
        let first = held.isEmpty
        held.append(
            record, time: time, uid: known.uid ?? (ownerAdmitted ? uid : nil), process: known.process,
            client: client)
        appended(first: first)
    }

    /// The line of a request refused for carrying another origin's placeholder (a refused use of that origin's
    /// credential; the placeholder is not in it).
    func refused(_ use: RefusedCredentialUse, connection: UInt64, client: String, ownerAdmitted: Bool) {
        let now = Int64(time(nil))
        peers.client(connection: connection) { [self] known in
            let entry = AuditEntry(
                use, time: now, uid: known.uid ?? (ownerAdmitted ? uid : nil), process: known.process, client: client)
            let first = held.isEmpty
            held.append(entry)
            appended(first: first)
        }
    }

    /// A line was held: written at the end of the pass (now, past `heldLimit`).
    private func appended(first: Bool) {
        if held.count >= Self.heldLimit {
            flush()
        } else if first {
            flushTask?.fireInThisPass()
        }
    }

    /// Writes the held lines now (the loop is about to stop, say).
    func flush() {
        guard !held.isEmpty else { return }
        held.withBytes { writeLines($0) }
        held.removeAll(keepingAtMost: Self.heldLimit * 2)
    }

    private func writeLines(_ lines: UnsafeRawBufferPointer) {
        if fd < 0 {
            fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0o600)
            sizeCheckedAt = nil
        }
        guard fd >= 0 else { return fail() }
        // Other processes append to the file too: their lines count from the next look, at most a second later.
        let now = Int64(time(nil))
        if sizeCheckedAt != now || knownSize + lines.count > maxBytes {
            var info = stat()
            if fstat(fd, &info) == 0 {
                knownSize = Int(info.st_size)
                sizeCheckedAt = now
                if knownSize + lines.count > maxBytes, knownSize > 0 {
                    // Another process may have rotated it already: only the file this one still has open is moved.
                    var current = stat()
                    if stat(path, &current) == 0, current.st_ino == info.st_ino { _ = rename(path, path + ".1") }
                    close(fd)
                    fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0o600)
                    guard fd >= 0 else { return fail() }
                    knownSize = 0
                }
            }
        }
        let written = write(fd, lines.baseAddress, lines.count)
        if written > 0 { knownSize += written }
        if written != lines.count { fail() }
    }

    private func fail() {
        guard !warned else { return }
        warned = true
        logger.warn("the audit log \(path) cannot be written: \(String(cString: strerror(errno)))")
    }
}
