import CLibevent

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// MARK: - Whose process is on the other end of a TCP connection (Linux: NETLINK_SOCK_DIAG)

extension Platform {
    /// Asks the kernel which user's process holds the other end of accepted loopback TCP connections: one
    /// NETLINK_SOCK_DIAG query per connection, as ss(8) makes, on a netlink socket kept for the lookup's life
    /// (opening one per connection was four more system calls on every new connection). Where the kernel cannot
    /// say (`namesSocketOwner` false: macOS has LOCAL_PEERCRED for Unix sockets only), every answer is nil and the
    /// owner credential stands in (docs/porting.md). One thread at a time.
    final class SocketOwnerLookup {
        private var link: Int32 = -1
        private var sequence: UInt32 = 0

        deinit { if link >= 0 { close(link) } }

        /// The uid owning the client end of `fd`, or nil when it is not known (a peer on another machine, no
        /// netlink, or a system that cannot say).
        func uid(ofClient fd: Int32) -> Int? {
            guard Platform.namesSocketOwner else { return nil }
            let uid = proxyctl_tcp_peer_uid(fd, &link, &sequence)
            return uid < 0 ? nil : Int(uid)
        }
    }
}
