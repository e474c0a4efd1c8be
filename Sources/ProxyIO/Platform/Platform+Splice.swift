import CLibevent

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

// MARK: - Moving tunnel bytes in the kernel (Linux: splice(2))

extension Platform {
    /// A pipe for splicing, non-blocking and close-on-exec (pipe2(2)), as large as the system allows up to
    /// `size`; nil where tunnels do not splice (`splices` false) or no pipe can be had.
    static func splicePipe(size: Int) -> (read: Int32, write: Int32)? {
        guard splices else { return nil }
        var fds: [Int32] = [0, 0]
        guard proxyctl_pipe(&fds) == 0 else { return nil }
        // A bigger pipe means fewer system calls per gigabyte; the default (64 KiB) still works.
        _ = proxyctl_set_pipe_size(fds[1], Int32(size))
        return (fds[0], fds[1])
    }

    /// splice(2): moves up to `length` bytes from `from` to `to`, one of them a pipe, without copying them
    /// through user space; non-blocking. What the call returns (-1 and errno: EAGAIN, or EINVAL/ENOSYS where this
    /// kind of socket cannot be spliced, or where the system has no splice).
    static func splice(from: Int32, to: Int32, length: Int) -> Int {
        proxyctl_splice(from, to, length)
    }
}
