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
final class AuditLog {
    let path: String
    let maxBytes: Int
    private let logger: Logger
    private var fd: Int32 = -1
    private var warned = false
    private let uid = Int(geteuid())

    init(stateDirectory: String, maxBytes: Int, logger: Logger) {
        self.path = stateDirectory + "/audit.log"
        self.maxBytes = maxBytes
        self.logger = logger
    }

    deinit {
        if fd >= 0 { close(fd) }
    }

    /// The exchange's line, if the proxy attached a credential in it. `ownerAdmitted`: the kernel named the client's
    /// user as the proxy's own (`protected_users = owner` admits no other).
    func record(_ record: ExchangeRecord, client: String, ownerAdmitted: Bool) {
        guard
            let entry = AuditEntry(
                record, time: Int64(time(nil)), uid: ownerAdmitted ? uid : nil, client: client)
        else { return }
        append(Array((entry.json + "\n").utf8))
    }

    private func append(_ line: [UInt8]) {
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
