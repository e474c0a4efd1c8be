import Dispatch

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// A program run without a shell (`posix_spawn`), with its standard streams as asked. Foundation's `Process` is
/// not part of FoundationEssentials, which is all the release links (no ICU: docs/packaging.md), and these are
/// the two uses proxyctl has: run a short command and read what it says (secret-tool, subject_token_command,
/// the runtimes `doctor` asks for their versions), and start one without waiting for it (a browser,
/// notify_command).
public enum ChildProcess {
    /// What the command reads on its standard input.
    public enum Input: Sendable {
        /// /dev/null.
        case null
        /// These bytes, then end of file.
        case bytes([UInt8])
    }

    /// Where a standard output or error stream goes.
    public enum Output: Sendable {
        /// /dev/null.
        case null
        /// proxyctl's own stream (the user sees the command's message).
        case inherit
        /// Kept and returned in the `Outcome`.
        case capture
    }

    /// How a command ended.
    public enum Termination: Sendable, Equatable, CustomStringConvertible {
        case exit(Int32)
        case signal(Int32)

        public var description: String {
            switch self {
            case .exit(let status): "exited with status \(status)"
            case .signal(let number): "was ended by signal \(number)"
            }
        }
    }

    /// A command that ran to its end (or was stopped at its timeout).
    public struct Outcome: Sendable {
        public var termination: Termination
        /// Its standard output, when captured.
        public var output: [UInt8]
        /// Its standard error, when captured.
        public var error: [UInt8]
        /// It was still running at the timeout and was sent SIGTERM.
        public var timedOut: Bool

        /// Exited with status 0.
        public var succeeded: Bool { termination == .exit(0) }
    }

    /// A command that could not be started: `errno` names why.
    public struct StartFailure: Error, Sendable, CustomStringConvertible {
        public let path: String
        public let errno: Int32
        public var description: String { "\(path): \(String(cString: strerror(errno)))" }
    }

    /// Runs `path` with `arguments` and waits for it on the calling thread. With a `timeout` (milliseconds) a
    /// command still running then gets SIGTERM (SIGKILL a second later), and what it wrote until then is
    /// returned.
    public static func run(
        _ path: String, _ arguments: [String], environment: [String: String]? = nil, input: Input = .null,
        output: Output = .capture, error: Output = .null, timeout milliseconds: Int? = nil
    ) throws(StartFailure) -> Outcome {
        var streams = Streams()
        defer { streams.closeAll() }
        let pid = try spawn(path, arguments, environment: environment, input: input, output, error, &streams)
        var deadline = milliseconds.map { now() + $0 }
        var outcome = Outcome(termination: .exit(0), output: [], error: [], timedOut: false)
        var pending = input.bytes[...]
        // One poll loop moves the input in and both outputs out, so that a command that fills one pipe while
        // the other is being waited on cannot stall.
        while streams.input >= 0 || streams.output >= 0 || streams.error >= 0 {
            var wait: Int32 = -1
            if let end = deadline {
                let left = end - now()
                if left <= 0 {
                    guard !outcome.timedOut else {
                        kill(pid, SIGKILL)
                        break
                    }
                    // What it writes while it ends still counts, for a second at most (a child of its own may
                    // keep the pipes open).
                    outcome.timedOut = true
                    kill(pid, SIGTERM)
                    streams.closeInput()
                    deadline = now() + 1000
                    continue
                }
                wait = Int32(clamping: left)
            }
            var fds: [pollfd] = []
            if streams.input >= 0 { fds.append(pollfd(fd: streams.input, events: Int16(POLLOUT), revents: 0)) }
            if streams.output >= 0 { fds.append(pollfd(fd: streams.output, events: Int16(POLLIN), revents: 0)) }
            if streams.error >= 0 { fds.append(pollfd(fd: streams.error, events: Int16(POLLIN), revents: 0)) }
            let ready = poll(&fds, nfds_t(fds.count), wait)
            if ready < 0 && errno != EINTR { break }
            for entry in fds where entry.revents != 0 {
                if entry.fd == streams.input {
                    let written = pending.withUnsafeBytes { write(entry.fd, $0.baseAddress, $0.count) }
                    if written > 0 { pending = pending.dropFirst(written) }
                    // Everything written, or EPIPE: the command ended without reading it all.
                    if pending.isEmpty || (written < 0 && errno != EINTR && errno != EAGAIN) { streams.closeInput() }
                } else if entry.fd == streams.output {
                    if !readSome(entry.fd, into: &outcome.output) { streams.closeOutput() }
                } else if entry.fd == streams.error {
                    if !readSome(entry.fd, into: &outcome.error) { streams.closeError() }
                }
            }
        }
        outcome.termination = waitFor(pid)
        return outcome
    }

    /// Starts `path` with standard input on /dev/null and returns at once; `ended` is called on a Dispatch
    /// thread when the command ends (the thread waits for it, so no zombie is left). Its outputs go to /dev/null
    /// or to proxyctl's own streams (`.capture` is taken as `.null`: nobody would read the pipe).
    @discardableResult
    public static func start(
        _ path: String, _ arguments: [String], environment: [String: String]? = nil, output: Output = .null,
        error: Output = .null, ended: (@Sendable (Termination) -> Void)? = nil
    ) throws(StartFailure) -> pid_t {
        var streams = Streams()
        defer { streams.closeAll() }
        let pid = try spawn(
            path, arguments, environment: environment, input: .null, output == .inherit ? .inherit : .null,
            error == .inherit ? .inherit : .null, &streams)
        DispatchQueue.global().async {
            let termination = waitFor(pid)
            ended?(termination)
        }
        return pid
    }

    /// The full path of `command` found on `path` (colon-separated, as $PATH), or nil; a command with a slash is
    /// itself when executable.
    public static func which(_ command: String, path: String?) -> String? {
        func executable(_ file: String) -> Bool {
            var info = stat()
            return stat(file, &info) == 0 && info.st_mode & S_IFMT == S_IFREG && access(file, X_OK) == 0
        }
        if command.contains("/") { return executable(command) ? command : nil }
        for directory in (path ?? "/usr/local/bin:/usr/bin:/bin").split(separator: ":") {
            let candidate = "\(directory)/\(command)"
            if executable(candidate) { return candidate }
        }
        return nil
    }

    // MARK: - posix_spawn

    /// The parent's ends of the pipes to the command, -1 when closed.
    private struct Streams {
        var input: Int32 = -1
        var output: Int32 = -1
        var error: Int32 = -1
        /// The command's ends, closed in the parent once it started.
        var childEnds: [Int32] = []

        mutating func closeInput() { Self.shut(&input) }
        mutating func closeOutput() { Self.shut(&output) }
        mutating func closeError() { Self.shut(&error) }
        mutating func closeAll() {
            closeInput()
            closeOutput()
            closeError()
            closeChildEnds()
        }
        mutating func closeChildEnds() {
            for fd in childEnds { _ = close(fd) }
            childEnds = []
        }
        private static func shut(_ fd: inout Int32) {
            if fd >= 0 { _ = close(fd) }
            fd = -1
        }
    }

    private static func spawn(
        _ path: String, _ arguments: [String], environment: [String: String]?, input: Input, _ output: Output,
        _ error: Output, _ streams: inout Streams
    ) throws(StartFailure) -> pid_t {
        // An opaque pointer in Darwin's headers, a struct in glibc's (docs/porting.md).
        #if canImport(Darwin)
            var actions: posix_spawn_file_actions_t = nil
        #else
            var actions = posix_spawn_file_actions_t()
        #endif
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        // Pipes are made close-on-exec, so that only the dup2 copies reach the command (and no other child).
        func pipeEnds() throws(StartFailure) -> (read: Int32, write: Int32) {
            var ends: [Int32] = [-1, -1]
            guard pipe(&ends) == 0 else { throw StartFailure(path: path, errno: errno) }
            _ = fcntl(ends[0], F_SETFD, FD_CLOEXEC)
            _ = fcntl(ends[1], F_SETFD, FD_CLOEXEC)
            return (ends[0], ends[1])
        }
        switch input {
        case .null: posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0)
        case .bytes:
            let ends = try pipeEnds()
            streams.input = ends.write
            streams.childEnds.append(ends.read)
            posix_spawn_file_actions_adddup2(&actions, ends.read, 0)
        }
        for (fd, choice) in [(Int32(1), output), (Int32(2), error)] {
            switch choice {
            case .inherit: break
            case .null: posix_spawn_file_actions_addopen(&actions, fd, "/dev/null", O_WRONLY, 0)
            case .capture:
                let ends = try pipeEnds()
                if fd == 1 { streams.output = ends.read } else { streams.error = ends.read }
                streams.childEnds.append(ends.write)
                posix_spawn_file_actions_adddup2(&actions, ends.write, fd)
            }
        }
        // The command starts with no signal blocked and every disposition at its default: proxyctl ignores
        // SIGPIPE and blocks the signals it waits for, and a child would inherit both.
        #if canImport(Darwin)
            var attributes: posix_spawnattr_t = nil
        #else
            var attributes = posix_spawnattr_t()
        #endif
        posix_spawnattr_init(&attributes)
        defer { posix_spawnattr_destroy(&attributes) }
        var none = sigset_t()
        sigemptyset(&none)
        posix_spawnattr_setsigmask(&attributes, &none)
        var defaults = sigset_t()
        sigfillset(&defaults)
        posix_spawnattr_setsigdefault(&attributes, &defaults)
        posix_spawnattr_setflags(&attributes, Int16(POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF))

        let argv = ([path] + arguments).map { strdup($0) } + [nil]
        let variables = environment ?? ProcessInfo.processInfo.environment
        let envp = variables.map { strdup("\($0.key)=\($0.value)") } + [nil]
        defer {
            for pointer in argv { free(pointer) }
            for pointer in envp { free(pointer) }
        }
        var pid = pid_t()
        let result = posix_spawn(&pid, path, &actions, &attributes, argv, envp)
        streams.closeChildEnds()
        guard result == 0 else { throw StartFailure(path: path, errno: result) }
        if streams.input >= 0 { _ = fcntl(streams.input, F_SETFL, fcntl(streams.input, F_GETFL) | O_NONBLOCK) }
        return pid
    }

    /// Reads what is there; false at end of file or on an error.
    private static func readSome(_ fd: Int32, into bytes: inout [UInt8]) -> Bool {
        var buffer = [UInt8](repeating: 0, count: 16384)
        while true {
            let count = buffer.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
            if count > 0 {
                bytes.append(contentsOf: buffer[..<count])
                return true
            }
            if count < 0 && errno == EINTR { continue }
            return false
        }
    }

    private static func waitFor(_ pid: pid_t) -> Termination {
        var status: Int32 = 0
        while waitpid(pid, &status, 0) < 0 {
            if errno != EINTR { return .exit(-1) }
        }
        // WIFEXITED / WTERMSIG are macros: the low seven bits are the signal, the next byte the exit code.
        let signal = status & 0x7f
        return signal == 0 ? .exit((status >> 8) & 0xff) : .signal(signal)
    }

    /// Milliseconds on the monotonic clock.
    private static func now() -> Int {
        var time = timespec()
        clock_gettime(CLOCK_MONOTONIC, &time)
        return time.tv_sec * 1000 + time.tv_nsec / 1_000_000
    }
}

extension ChildProcess.Input {
    fileprivate var bytes: [UInt8] {
        if case .bytes(let bytes) = self { return bytes }
        return []
    }
}
