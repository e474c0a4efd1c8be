import CLibevent
import ProxyCore

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// MARK: - Whose process is on the other end of a TCP connection (Linux: NETLINK_SOCK_DIAG)

extension Platform {
    /// The client end of an accepted loopback TCP connection, as the kernel names it: the user that owns it and
    /// the socket's inode (0 when the kernel gave none), by which `socketHolders` finds the process.
    struct ClientSocket: Equatable {
        let uid: Int
        let inode: UInt64
    }

    /// Asks the kernel which user's process holds the other end of accepted loopback TCP connections: one
    /// NETLINK_SOCK_DIAG query per connection, as ss(8) makes, on a netlink socket kept for the lookup's life
    /// (opening one per connection was four more system calls on every new connection). Where the kernel cannot
    /// say (`namesSocketOwner` false: macOS has LOCAL_PEERCRED for Unix sockets only), every answer is nil and the
    /// owner credential stands in (docs/porting.md). One thread at a time.
    final class SocketOwnerLookup {
        private var link: Int32 = -1
        private var sequence: UInt32 = 0

        deinit { if link >= 0 { close(link) } }

        /// The client end of `fd`, or nil when it is not known (a peer on another machine, no netlink, or a
        /// system that cannot say).
        func socket(ofClient fd: Int32) -> ClientSocket? {
            guard Platform.namesSocketOwner else { return nil }
            var inode: UInt64 = 0
            let uid = proxyctl_tcp_peer_socket(fd, &link, &sequence, &inode)
            return uid < 0 ? nil : ClientSocket(uid: Int(uid), inode: inode)
        }

        /// The uid owning the client end of `fd`, or nil when it is not known.
        func uid(ofClient fd: Int32) -> Int? { socket(ofClient: fd)?.uid }
    }

    // MARK: - Which processes hold a socket (Linux: /proc/PID/fd)

    /// The processes holding each socket of `inodes` (owned by one of `uids`), as ss(8) -p finds them: for every
    /// process of those users in /proc, readlink(2) on each entry of its fd directory, compared with `socket:[N]`;
    /// the executable from /proc/PID/exe. Blocking file-system work: off the loop. Bounded: at most `budget`
    /// descriptors are read in all (past that the holders found so far are the answer; `ClientProcess.from`
    /// decides what they name). The proxy's own process is skipped (it holds the other end, not this one).
    /// Processes of other users are read only if the proxy may (root), and the kernel refuses the rest.
    /// Elsewhere than Linux: nothing (no /proc; the audit log then has no pid, docs/porting.md).
    static func socketHolders(inodes: Set<UInt64>, uids: Set<Int>, budget: Int) -> [UInt64: [ClientProcess.Holder]] {
        var found: [UInt64: [ClientProcess.Holder]] = [:]
        guard linux, !inodes.isEmpty, let proc = opendir("/proc") else { return found }
        defer { closedir(proc) }
        let own = Int(getpid())
        var remaining = budget
        // Nothing is allocated per process or per descriptor: names are read where readdir left them, paths are
        // relative to the directory's descriptor, and a link is read into one buffer (a socket's is 8 bytes, up
        // to 20 digits and "]").
        let link = UnsafeMutableRawBufferPointer.allocate(byteCount: 64, alignment: 1)
        let fdPath = UnsafeMutablePointer<CChar>.allocate(capacity: 32)
        defer {
            link.deallocate()
            fdPath.deallocate()
        }
        while remaining > 0, let entry = readdir(proc) {
            let name = entryName(entry)
            let nameLength = strlen(name)
            guard let pid = ClientProcess.pid(directoryName: UnsafeRawBufferPointer(start: name, count: nameLength)),
                pid != own
            else { continue }
            var info = stat()
            guard fstatat(dirfd(proc), name, &info, 0) == 0, uids.contains(Int(info.st_uid)) else { continue }
            // "PID/fd", relative to /proc (a pid is at most 10 digits).
            fdPath.update(from: name, count: nameLength)
            for (offset, byte) in "/fd\0".utf8.enumerated() { fdPath[nameLength + offset] = CChar(bitPattern: byte) }
            let fdDirectory = openat(dirfd(proc), fdPath, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
            guard fdDirectory >= 0 else { continue }
            guard let fds = fdopendir(fdDirectory) else {
                close(fdDirectory)
                continue
            }
            var holds: [UInt64] = []
            while remaining > 0, let descriptor = readdir(fds) {
                let fdName = entryName(descriptor)
                guard fdName.pointee != CChar(bitPattern: UInt8(ascii: ".")) else { continue }
                remaining -= 1
                let length = readlinkat(dirfd(fds), fdName, link.baseAddress!, link.count)
                guard length > 0,
                    let inode = ClientProcess.socketInode(link: UnsafeRawBufferPointer(rebasing: link[..<length])),
                    inodes.contains(inode)
                else { continue }
                if !holds.contains(inode) { holds.append(inode) }
            }
            closedir(fds)
            guard !holds.isEmpty else { continue }
            let executable = readLink("/proc/\(pid)/exe")
            for inode in holds {
                found[inode, default: []].append(ClientProcess.Holder(pid: pid, executable: executable))
            }
        }
        return found
    }

    /// The name of a directory entry readdir(3) returned, where it lies: NUL-terminated, valid until the next
    /// readdir. Never copied as a field: `d_name` is declared 256 bytes long, but the kernel's record is only as
    /// long as the name, so copying the field (as `entry.pointee.d_name` does) reads past the end of the last
    /// record in readdir's buffer (AddressSanitizer caught it: heap-buffer-overflow, 2 bytes past a 32 KiB DIR
    /// buffer).
    private static func entryName(_ entry: UnsafeMutablePointer<dirent>) -> UnsafePointer<CChar> {
        let offset = MemoryLayout<dirent>.offset(of: \.d_name)!
        return (UnsafeRawPointer(entry) + offset).assumingMemoryBound(to: CChar.self)
    }

    /// CPU time the calling thread has used, in microseconds (CLOCK_THREAD_CPUTIME_ID): what a scan cost.
    static func threadCPUMicroseconds() -> Int64 {
        var now = timespec()
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now)
        return Int64(now.tv_sec) * 1_000_000 + Int64(now.tv_nsec) / 1000
    }

    /// readlink(2) of `path`; nil when it cannot be read.
    private static func readLink(_ path: String) -> String? {
        var buffer = [CChar](repeating: 0, count: 4096)
        let length = buffer.withUnsafeMutableBufferPointer { readlink(path, $0.baseAddress!, $0.count) }
        guard length > 0, length < buffer.count else { return nil }
        return String(decoding: buffer[..<length].map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }
}
