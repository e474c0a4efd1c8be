/// The process on the other end of a client connection, as the kernel names it, for the audit log (issue 31: "the
/// client's uid and, where the kernel says, pid and executable"). The I/O layer asks the kernel which processes
/// hold the client's socket (Linux: the socket's inode from NETLINK_SOCK_DIAG, then `/proc/PID/fd`); what that
/// answer means is decided here, so that a field is absent rather than wrong.
public struct ClientProcess: Sendable, Equatable {
    /// Its process id; nil when no single process holds the socket.
    public var pid: Int?
    /// `/proc/PID/exe` as the kernel reads it (a replaced binary keeps its ` (deleted)`); nil when unreadable.
    public var executable: String?

    public init(pid: Int?, executable: String?) {
        self.pid = pid
        self.executable = executable
    }

    /// One process that holds the client's socket: its pid, and its executable if it could be read.
    public struct Holder: Sendable, Equatable {
        public let pid: Int
        public let executable: String?

        public init(pid: Int, executable: String?) {
            self.pid = pid
            self.executable = executable
        }
    }

    /// What the holders of the client's socket say. One process: it. Several (a process that forked after it
    /// connected, each copy holding the descriptor): no pid, since which of them sent the request is not known,
    /// and the executable only if they all run the same one. None (the client has gone, lives in another PID
    /// namespace, or is another user's the proxy may not look at): nil.
    public static func from(holders: [Holder]) -> ClientProcess? {
        var pids: [Int] = []
        for holder in holders where !pids.contains(holder.pid) { pids.append(holder.pid) }
        guard let first = holders.first else { return nil }
        if pids.count == 1 {
            let executable = holders.lazy.compactMap(\.executable).first
            return ClientProcess(pid: first.pid, executable: executable)
        }
        guard let executable = first.executable, holders.allSatisfy({ $0.executable == executable }) else {
            return nil
        }
        return ClientProcess(pid: nil, executable: executable)
    }

    /// The inode of the socket a descriptor's link names: `socket:[12345]` (what readlink(2) gives for
    /// `/proc/PID/fd/N` when N is a socket); nil for any other link (files, pipes, anon inodes).
    ///
    /// Inlinable and free of allocations: the audit log's `/proc` scan calls it for every descriptor of every
    /// process of the client's user (a generic call across modules, unspecialised, with the prefix made as an
    /// array each time, was most of that scan's instructions).
    @inlinable
    public static func socketInode(link: UnsafeRawBufferPointer) -> UInt64? {
        // "socket:[" is 8 bytes; then at least one digit and "]".
        guard link.count > 9, link[link.count - 1] == UInt8(ascii: "]"), link[0] == UInt8(ascii: "s"),
            link[1] == UInt8(ascii: "o"), link[2] == UInt8(ascii: "c"), link[3] == UInt8(ascii: "k"),
            link[4] == UInt8(ascii: "e"), link[5] == UInt8(ascii: "t"), link[6] == UInt8(ascii: ":"),
            link[7] == UInt8(ascii: "[")
        else {
            return nil
        }
        var inode: UInt64 = 0
        for index in 8..<(link.count - 1) {
            let byte = link[index]
            guard byte >= UInt8(ascii: "0"), byte <= UInt8(ascii: "9") else { return nil }
            let (times, overflow) = inode.multipliedReportingOverflow(by: 10)
            let (sum, carry) = times.addingReportingOverflow(UInt64(byte - UInt8(ascii: "0")))
            guard !overflow, !carry else { return nil }
            inode = sum
        }
        return inode
    }

    /// The pid a `/proc` entry's name is (`1234`); nil for the others (`self`, `net`, `sys`, ...).
    @inlinable
    public static func pid(directoryName name: UnsafeRawBufferPointer) -> Int? {
        guard !name.isEmpty, name.count <= 10, name[0] != UInt8(ascii: "0") else { return nil }
        var pid = 0
        for byte in name {
            guard byte >= UInt8(ascii: "0"), byte <= UInt8(ascii: "9") else { return nil }
            pid = pid * 10 + Int(byte - UInt8(ascii: "0"))
        }
        return pid
    }
}
