/// Audit log lines not yet written (`AuditEntry`'s JSON lines, each with its newline): the audit log holds a pass
/// of the loop's lines here and writes them in one `write`. Each line is written in place at the end of one buffer
/// kept between passes, and the start that every line of one second shares (`{"time":"…","ts":…`) is written once
/// per second and copied. Made in an array of its own and then appended, with its timestamp written field by field,
/// a line cost about 1,400 instructions more (callgrind, bench row 6). One thread at a time.
public final class AuditLines {
    private var storage: UnsafeMutablePointer<UInt8>
    private var capacity: Int
    /// Bytes held.
    public private(set) var count = 0
    /// The second `stamp` was written for.
    private var stampSecond: Int64?
    private var stamp: [UInt8] = []

    public init(capacity: Int = 16 * 1024) {
        self.capacity = max(capacity, 64)
        storage = .allocate(capacity: self.capacity)
    }

    deinit { storage.deallocate() }

    public var isEmpty: Bool { count == 0 }

    /// Appends the line of an exchange in which the proxy attached its credential, written from the record
    /// (`parse` reads it back as an entry); false, and nothing appended, when it attached none.
    @discardableResult
    public func append(
        _ record: ExchangeRecord, time: Int64, uid: Int?, process: ClientProcess? = nil, client: String
    ) -> Bool {
        guard record.attached else { return false }
        let kind = AuditEntry.kind(staticSecret: record.staticSecret)
        let executable = process?.executable
        let bound = AuditEntry.membersBound(
            origin: record.origin, method: record.method, path: record.target, credential: record.provider,
            kind: kind, refused: nil, placeholderOf: nil, placeholderEnv: nil, executable: executable, client: client)
        write(time: time, membersBound: bound) { out in
            AuditEntry.writeMembers(
                to: &out, origin: record.origin, method: record.method, path: record.target, pathIsTarget: true,
                credential: record.provider, kind: kind, status: record.status, attempts: record.attempts,
                refreshed: record.refreshed, replacedClientCredential: record.clientCredentialReplaced,
                placeholder: record.placeholderUsed, refused: nil, placeholderOf: nil, placeholderEnv: nil, uid: uid,
                pid: process?.pid, executable: executable, client: client)
        }
        return true
    }

    /// Appends `entry`'s line (`entry.jsonLine`).
    public func append(_ entry: AuditEntry) {
        let bound = AuditEntry.membersBound(
            origin: entry.origin, method: entry.method, path: entry.path, credential: entry.credential,
            kind: entry.kind, refused: entry.refused, placeholderOf: entry.placeholderOf,
            placeholderEnv: entry.placeholderEnv, executable: entry.executable, client: entry.client)
        write(time: entry.time, membersBound: bound) { entry.writeMembers(to: &$0) }
    }

    /// The bytes held.
    public func withBytes<Result>(_ body: (UnsafeRawBufferPointer) throws -> Result) rethrows -> Result {
        try body(UnsafeRawBufferPointer(start: storage, count: count))
    }

    /// Empties it; storage that a burst grew past `keepingAtMost` bytes is given back.
    public func removeAll(keepingAtMost limit: Int) {
        count = 0
        guard capacity > limit else { return }
        storage.deallocate()
        capacity = max(limit, 64)
        storage = .allocate(capacity: capacity)
    }

    /// The stamp of `time`'s second, then what `members` writes (at most `membersBound` bytes), at the end.
    private func write(time: Int64, membersBound: Int, _ members: (inout ByteWriter) -> Void) {
        if stampSecond != time {
            stamp = ByteWriter.bytes(atMost: AuditEntry.stampBound) { AuditEntry.writeStamp(time, to: &$0) }
            stampSecond = time
        }
        reserve(stamp.count + membersBound)
        count += ByteWriter.write(at: storage + count, capacity: capacity - count) { out in
            out.write(stamp)
            members(&out)
        }
    }

    /// Room for `more` bytes after those held.
    private func reserve(_ more: Int) {
        guard count + more > capacity else { return }
        let grown = max(capacity * 2, count + more)
        let larger = UnsafeMutablePointer<UInt8>.allocate(capacity: grown)
        larger.initialize(from: storage, count: count)
        storage.deallocate()
        storage = larger
        capacity = grown
    }
}
