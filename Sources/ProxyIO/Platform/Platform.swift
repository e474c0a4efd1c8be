import CLibevent
import ProxyCore

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// What proxyctl asks of the operating system beyond POSIX sockets and files, in one place (docs/porting.md).
///
/// Every call that Linux alone has (splice(2), NETLINK_SOCK_DIAG, /proc, glibc's allocator, sigwaitinfo's sender)
/// is made here and nowhere else, and each has a portable fallback that the rest of the program cannot tell from
/// it: a read/write pump for tunnels, the owner credential where the kernel cannot name a client's user, and so
/// on. A port to another system (macOS first) changes this namespace, not its callers.
///
/// `PROXYCTL_PORTABLE=1` in the environment makes Linux take every fallback too, so that the integration suite
/// runs them (Tests/integration/test_portable.py) on the only system it has.
public enum Platform {
    /// The fallbacks were asked for (`PROXYCTL_PORTABLE=1`); read once, at the first use.
    public static let portable: Bool = {
        guard let value = getenv("PROXYCTL_PORTABLE") else { return false }
        let text = String(cString: value)
        return !text.isEmpty && text != "0"
    }()

    /// Linux's own calls are used: on Linux, unless `portable`.
    static let linux: Bool = {
        #if os(Linux)
            return !portable
        #else
            return false
        #endif
    }()

    /// Tunnels move bytes with splice(2), socket to pipe to socket, without copying them through user space;
    /// else a read/write pump through one buffer per loop (`SpliceTunnel`).
    public static var splices: Bool { linux }

    /// The kernel names the user of the process on the other end of a loopback TCP connection (a
    /// NETLINK_SOCK_DIAG query); else `protected_users = owner` and `passthrough_users = owner` take the owner
    /// credential instead (`OwnerCredential`, ProxyOAuth).
    public static var namesSocketOwner: Bool { linux }

    /// What `serve` says at start when `portable` is set.
    public static var portableSummary: String {
        "PROXYCTL_PORTABLE: the portable fallbacks run instead of Linux's own calls (docs/porting.md): tunnels copy "
            + "through user space instead of splice(2), and the kernel is not asked whose a client's socket is"
    }

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
        #if canImport(Darwin)
            var thread: pthread_t? = nil
        #else
            var thread = pthread_t()
        #endif
        let result = pthread_create(
            &thread, nil,
            { context in
                let start = Unmanaged<Start>.fromOpaque(context!).takeRetainedValue()
                Platform.nameThread(start.name)
                start.body()
                return nil
            }, context)
        precondition(result == 0, "pthread_create failed: \(result)")
        #if canImport(Darwin)
            pthread_detach(thread!)
        #else
            pthread_detach(thread)
        #endif
    }

    /// The calling thread, as a number to compare (pthread_t is an integer in glibc, a pointer in Darwin).
    public static var currentThread: UInt {
        #if canImport(Darwin)
            UInt(bitPattern: pthread_self())
        #else
            UInt(pthread_self())
        #endif
    }

    /// `$TMPDIR`, else /tmp (what `NSTemporaryDirectory` answers, without its trailing slash).
    public static var temporaryDirectory: String {
        guard let value = getenv("TMPDIR"), value.pointee != 0 else { return "/tmp" }
        let text = String(cString: value)
        return text.count > 1 && text.hasSuffix("/") ? String(text.dropLast()) : text
    }

    private static func nameThread(_ name: String) {
        proxyctl_name_thread(String(decoding: name.utf8.prefix(15), as: UTF8.self))
    }

    // MARK: - The process

    /// Streaming buffers are allocated and freed all the time: glibc is kept from mapping and trimming them
    /// (mallopt(3); measured in docs/performance.md). Other allocators are left as they are.
    public static func tuneAllocator() {
        if linux { proxyctl_tune_allocator() }
    }

    /// The process's open-file limit (its soft limit).
    public static func openFileLimit() -> Int {
        var limit = rlimit()
        guard getrlimit(fileLimitResource, &limit) == 0 else { return 1024 }
        // RLIM_INFINITY is all ones (the macro does not import as an unsigned constant).
        return limit.rlim_cur >= rlim_t(Int.max) ? 1 << 20 : Int(limit.rlim_cur)
    }

    /// Raises the soft open-file limit to the hard one. macOS refuses a soft limit above its per-process maximum
    /// (OPEN_MAX, 10240) when the hard limit is unlimited: that much is taken then.
    public static func raiseOpenFileLimit() {
        var limit = rlimit()
        guard getrlimit(fileLimitResource, &limit) == 0, limit.rlim_cur < limit.rlim_max else { return }
        let hard = limit.rlim_max
        limit.rlim_cur = hard
        if setrlimit(fileLimitResource, &limit) != 0 {
            limit.rlim_cur = min(hard, 10240)
            _ = setrlimit(fileLimitResource, &limit)
        }
    }

    private static var fileLimitResource: Int32 {
        #if canImport(Glibc)
            Int32(RLIMIT_NOFILE.rawValue)
        #else
            RLIMIT_NOFILE
        #endif
    }

    /// The kernel's range of ephemeral ports (`/proc/sys/net/ipv4/ip_local_port_range`), which a sign-in's fixed
    /// redirect port should stay below; nil where it cannot be read (`RedirectPort.choose` then assumes Linux's
    /// default, 32768-60999, below macOS's 49152-65535 too).
    public static var ephemeralPorts: ClosedRange<Int>? {
        guard linux, let text = readSmallFile("/proc/sys/net/ipv4/ip_local_port_range") else { return nil }
        return RedirectPort.ephemeralRange(text)
    }

    /// A small file's text (a /proc file: its size is 0 to stat, so read until the end).
    private static func readSmallFile(_ path: String) -> String? {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var bytes = [UInt8](repeating: 0, count: 256)
        let count = bytes.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
        guard count > 0 else { return nil }
        return String(decoding: bytes[0..<count], as: UTF8.self)
    }

    // MARK: - Signals

    /// Waits for one of the signals in `set` (blocked in every thread). `fromTerminal`: the kernel sent it on
    /// the terminal's behalf (Ctrl-C, Ctrl-\, a window change: `si_code` SI_KERNEL), so the terminal's whole
    /// foreground process group got it too. Where the sender cannot be told (sigwait(3)), false. Nil when the
    /// wait was interrupted.
    public static func waitForSignal(_ set: sigset_t) -> (number: Int32, fromTerminal: Bool)? {
        var waited = set
        #if os(Linux)
            if linux {
                var info = siginfo_t()
                let number = sigwaitinfo(&waited, &info)
                guard number > 0 else { return nil }
                return (number, info.si_code == 0x80)  // SI_KERNEL
            }
        #endif
        var number: Int32 = 0
        guard sigwait(&waited, &number) == 0 else { return nil }
        return (number, false)
    }
}
