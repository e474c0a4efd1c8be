import CLibevent

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// What proxyctl asks of the operating system beyond POSIX sockets and files, in one place (docs/porting.md).
public enum Platform {
    /// Starts `body` on a detached thread named `name` (cut to the 15 bytes Linux keeps). Foundation's `Thread`
    /// is not in FoundationEssentials, which is all the release links.
    public static func startThread(name: String, _ body: @escaping @Sendable () -> Void) {
        final class Start {
            let name: String
            let body: @Sendable () -> Void
            init(name: String, body: @escaping @Sendable () -> Void) {
                self.name = name
                self.body = body
            }
        }
        let context = Unmanaged.passRetained(Start(name: name, body: body)).toOpaque()
        var thread = pthread_t()
        let result = pthread_create(
            &thread, nil,
            { context in
                let start = Unmanaged<Start>.fromOpaque(context!).takeRetainedValue()
                Platform.nameThread(start.name)
                start.body()
                return nil
            }, context)
        precondition(result == 0, "pthread_create failed: \(result)")
        pthread_detach(thread)
    }

    /// `$TMPDIR`, else /tmp (what `NSTemporaryDirectory` answers, without its trailing slash).
    public static var temporaryDirectory: String {
        guard let value = getenv("TMPDIR"), value.pointee != 0 else { return "/tmp" }
        let text = String(cString: value)
        return text.count > 1 && text.hasSuffix("/") ? String(text.dropLast()) : text
    }

    // MARK: - The service manager (systemd; docs/porting.md has launchd's counterparts)

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
    /// `STATUS=...`), one datagram to `$NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace). Nothing
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
        let fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
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

    private static func nameThread(_ name: String) {
        proxyctl_name_thread(String(decoding: name.utf8.prefix(15), as: UTF8.self))
    }
}
