import CLibevent

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// MARK: - Sockets and descriptors

extension Platform {
    /// A close-on-exec TCP socket of `family` (AF_INET, AF_INET6), non-blocking when asked; -1 and errno on
    /// failure. Linux sets both flags in socket(2) itself; elsewhere (and with `portable`) fcntl(2) sets them.
    public static func tcpSocket(family: Int32, nonBlocking: Bool) -> Int32 {
        proxyctl_socket(family, 0, nonBlocking ? 1 : 0, linux ? 1 : 0)
    }

    /// A close-on-exec datagram socket of `family` (AF_UNIX for the service manager).
    static func datagramSocket(family: Int32) -> Int32 {
        proxyctl_socket(family, 1, 0, linux ? 1 : 0)
    }

    /// SOCK_STREAM as getsockopt(SO_TYPE) and getaddrinfo's hints spell it (an enum in glibc's headers, an integer
    /// in Darwin's).
    public static var streamSocketType: Int32 {
        #if canImport(Glibc)
            Int32(SOCK_STREAM.rawValue)
        #else
            SOCK_STREAM
        #endif
    }

    /// Sends what `bytes` holds on a socket without raising SIGPIPE (MSG_NOSIGNAL on Linux; elsewhere SIGPIPE is
    /// ignored for the whole process, `EventLoop.initializeLibraries`). What send(2) returns.
    public static func send(_ fd: Int32, _ bytes: UnsafeRawBufferPointer) -> Int {
        #if canImport(Glibc)
            Glibc.send(fd, bytes.baseAddress, bytes.count, linux ? proxyctl_msg_nosignal() : 0)
        #else
            Darwin.send(fd, bytes.baseAddress, bytes.count, 0)
        #endif
    }

    /// shutdown(SHUT_WR): the peer reads an end of stream. Whether it worked.
    @discardableResult
    public static func shutdownWrite(_ fd: Int32) -> Bool {
        #if canImport(Glibc)
            Glibc.shutdown(fd, Int32(SHUT_WR)) == 0
        #else
            Darwin.shutdown(fd, SHUT_WR) == 0
        #endif
    }

    /// close(2), for types whose own `close()` hides the C library's.
    public static func closeDescriptor(_ fd: Int32) {
        #if canImport(Glibc)
            _ = Glibc.close(fd)
        #else
            _ = Darwin.close(fd)
        #endif
    }
}
