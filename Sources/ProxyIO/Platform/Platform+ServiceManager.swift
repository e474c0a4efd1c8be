#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// MARK: - The service manager (systemd; docs/porting.md has launchd's counterparts)

extension Platform {
    /// The listening sockets a service manager passed to this process (systemd's socket activation:
    /// sd_listen_fds(3): `LISTEN_PID` names this process, `LISTEN_FDS` counts descriptors from 3 on). The variables
    /// are removed from the environment, so that the commands proxyctl starts do not take the sockets for theirs;
    /// the descriptors become close-on-exec. Empty when none were passed.
    public static func takeListenSockets() -> [Int32] {
        defer {
            unsetenv("LISTEN_PID")
            unsetenv("LISTEN_FDS")
            unsetenv("LISTEN_FDNAMES")
        }
        guard let pid = getenv("LISTEN_PID").flatMap({ Int32(String(cString: $0)) }), pid == getpid(),
            let count = getenv("LISTEN_FDS").flatMap({ Int32(String(cString: $0)) }), count > 0
        else { return [] }
        let first: Int32 = 3  // SD_LISTEN_FDS_START
        return (first..<first + count).map { fd in
            _ = fcntl(fd, F_SETFD, fcntl(fd, F_GETFD) | FD_CLOEXEC)
            return fd
        }
    }

    /// Tells the service manager about the service (sd_notify(3): `READY=1`, `RELOADING=1`, `STOPPING=1`,
    /// `STATUS=...`), one datagram to `$NOTIFY_SOCKET` (a path, or `@name` in Linux's abstract namespace). Nothing
    /// happens without the variable. Returns whether the datagram went out.
    @discardableResult
    public static func notifyServiceManager(_ state: String) -> Bool {
        guard let socketPath = getenv("NOTIFY_SOCKET").map({ String(cString: $0) }), !socketPath.isEmpty else {
            return false
        }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        var path = Array(socketPath.utf8)
        if path.first == UInt8(ascii: "@") { path[0] = 0 }  // the abstract namespace
        let capacity = MemoryLayout.size(ofValue: address.sun_path)
        guard path.count < capacity else { return false }
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            raw.copyBytes(from: path)
        }
        let length = socklen_t(MemoryLayout<sockaddr_un>.offset(of: \.sun_path)! + path.count)
        let fd = datagramSocket(family: AF_UNIX)
        guard fd >= 0 else { return false }
        defer { close(fd) }
        let bytes = Array(state.utf8)
        let sent = withUnsafePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { socketAddress in
                bytes.withUnsafeBytes { sendto(fd, $0.baseAddress, $0.count, 0, socketAddress, length) }
            }
        }
        return sent == bytes.count
    }
}
