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

    private static func nameThread(_ name: String) {
        proxyctl_name_thread(String(decoding: name.utf8.prefix(15), as: UTF8.self))
    }
}
