import Foundation
import ProxyCore

/// The on-disk token store: one JSON file per provider under `<state_dir>/tokens/`, 0600 in 0700
/// directories, replaced atomically (temporary file, fsync, rename, fsync of the directory), and a lock
/// file per provider that serialises refreshes across processes (`flock`).
public struct TokenStore: Sendable {
    public let stateDirectory: String
    public var tokensDirectory: String { stateDirectory + "/tokens" }

    public init(stateDirectory: String) {
        self.stateDirectory = stateDirectory
    }

    /// The default state directory: `$XDG_STATE_HOME/proxyctl`, else `~/.local/state/proxyctl`.
    public static func defaultStateDirectory(environment: [String: String]) -> String? {
        if let base = environment["XDG_STATE_HOME"], base.hasPrefix("/") { return base + "/proxyctl" }
        guard let home = environment["HOME"], !home.isEmpty else { return nil }
        return home + "/.local/state/proxyctl"
    }

    public func path(for provider: String) -> String { "\(tokensDirectory)/\(provider).json" }
    func lockPath(for provider: String) -> String { "\(tokensDirectory)/\(provider).lock" }

    /// Creates the state and tokens directories (0700), and tightens them if they are open to others.
    public func prepare() throws {
        for directory in [stateDirectory, tokensDirectory] {
            try Self.makePrivateDirectory(directory)
        }
    }

    static func makePrivateDirectory(_ directory: String) throws {
        var info = stat()
        if stat(directory, &info) != 0 {
            let parent = (directory as NSString).deletingLastPathComponent
            if !parent.isEmpty && parent != directory {
                var parentInfo = stat()
                if stat(parent, &parentInfo) != 0 {
                    try FileManager.default.createDirectory(atPath: parent, withIntermediateDirectories: true)
                }
            }
            guard mkdir(directory, 0o700) == 0 || errno == EEXIST else {
                throw StoreError(path: directory, "cannot create the directory: \(String(cString: strerror(errno)))")
            }
            guard stat(directory, &info) == 0 else {
                throw StoreError(path: directory, "cannot read the directory: \(String(cString: strerror(errno)))")
            }
        }
        guard info.st_mode & S_IFMT == S_IFDIR else { throw StoreError(path: directory, "is not a directory") }
        guard info.st_uid == getuid() else {
            throw StoreError(
                path: directory, "belongs to another user; proxyctl keeps secrets only in its own directories")
        }
        if info.st_mode & 0o077 != 0 {
            guard chmod(directory, 0o700) == 0 else {
                throw StoreError(path: directory, "is open to other users and cannot be made private (chmod 700)")
            }
        }
    }

    /// The stored tokens, or nil when there are none.
    public func load(_ provider: String) throws -> TokenSet? {
        let file = path(for: provider)
        let fd = open(file, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)
        if fd < 0 {
            if errno == ENOENT { return nil }
            throw StoreError(path: file, "cannot be read: \(String(cString: strerror(errno)))")
        }
        defer { close(fd) }
        var info = stat()
        guard fstat(fd, &info) == 0 else { throw StoreError(path: file, "cannot be read") }
        if info.st_mode & 0o077 != 0 {
            // Someone loosened it: make it private again before reading secrets from it.
            _ = fchmod(fd, 0o600)
        }
        var data = [UInt8]()
        var buffer = [UInt8](repeating: 0, count: 16384)
        while true {
            let count = read(fd, &buffer, buffer.count)
            if count < 0 && errno == EINTR { continue }
            if count < 0 { throw StoreError(path: file, "cannot be read: \(String(cString: strerror(errno)))") }
            if count == 0 { break }
            data.append(contentsOf: buffer[0..<count])
            if data.count > 4 << 20 { throw StoreError(path: file, "is too large to be a token file") }
        }
        guard case .success(let json) = JSON.parse(data), let tokens = TokenSet(json: json) else {
            throw StoreError(path: file, "is damaged; sign in again to replace it (proxyctl login \(provider))")
        }
        return tokens
    }

    /// Replaces the stored tokens atomically: a crash leaves either the old file or the new one.
    public func save(_ tokens: TokenSet) throws {
        try prepare()
        let file = path(for: tokens.provider)
        let temporary = "\(tokensDirectory)/.\(tokens.provider).\(getpid()).\(UInt32.random(in: 0...UInt32.max)).tmp"
        let bytes = Array(JSON.serialize(tokens.json).utf8) + [0x0A]
        let fd = open(temporary, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0o600)
        guard fd >= 0 else {
            throw StoreError(path: temporary, "cannot be created: \(String(cString: strerror(errno)))")
        }
        var written = 0
        var failure: String? = nil
        while written < bytes.count {
            let count = bytes[written...].withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
            if count < 0 && errno == EINTR { continue }
            if count <= 0 {
                failure = String(cString: strerror(errno))
                break
            }
            written += count
        }
        if failure == nil && fsync(fd) != 0 { failure = String(cString: strerror(errno)) }
        close(fd)
        if let failure {
            unlink(temporary)
            throw StoreError(path: file, "cannot be written: \(failure)")
        }
        guard rename(temporary, file) == 0 else {
            let reason = String(cString: strerror(errno))
            unlink(temporary)
            throw StoreError(path: file, "cannot be replaced: \(reason)")
        }
        Self.syncDirectory(tokensDirectory)
    }

    /// Removes the stored tokens; true when there were some.
    @discardableResult
    public func delete(_ provider: String) throws -> Bool {
        let file = path(for: provider)
        if unlink(file) != 0 {
            if errno == ENOENT { return false }
            throw StoreError(path: file, "cannot be removed: \(String(cString: strerror(errno)))")
        }
        Self.syncDirectory(tokensDirectory)
        return true
    }

    /// Identifies the file's current version (inode, size, modification time) without reading it: a
    /// running proxy notices tokens written by another process.
    public func version(_ provider: String) -> FileVersion? {
        Self.version(atPath: path(for: provider))
    }

    /// The version of the file at `path` (one stat(2)).
    public static func version(atPath path: String) -> FileVersion? {
        var info = stat()
        guard stat(path, &info) == 0 else { return nil }
        return FileVersion(
            inode: UInt64(info.st_ino), size: Int64(info.st_size),
            modified: Int64(info.st_mtim.tv_sec) * 1_000_000_000 + Int64(info.st_mtim.tv_nsec))
    }

    public struct FileVersion: Sendable, Equatable {
        public let inode: UInt64
        public let size: Int64
        public let modified: Int64
    }

    static func syncDirectory(_ directory: String) {
        let fd = open(directory, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if fd >= 0 {
            _ = fsync(fd)
            close(fd)
        }
    }

    /// Takes the provider's cross-process lock, runs `body`, releases the lock. Waiting polls without blocking
    /// a thread; after `timeout` milliseconds it gives up with a recoverable error.
    public func withLock<T: Sendable>(
        _ provider: String, timeout: Int = 60_000, isolation: isolated (any Actor)? = #isolation,
        _ body: () async throws -> T
    ) async throws -> T {
        try prepare()
        let file = lockPath(for: provider)
        let fd = open(file, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0o600)
        guard fd >= 0 else { throw StoreError(path: file, "cannot be opened: \(String(cString: strerror(errno)))") }
        defer { close(fd) }
        let deadline = ContinuousClock.now + .milliseconds(timeout)
        var delay = 5
        while flock(fd, LOCK_EX | LOCK_NB) != 0 {
            guard errno == EWOULDBLOCK || errno == EINTR else {
                throw StoreError(path: file, "cannot be locked: \(String(cString: strerror(errno)))")
            }
            guard ContinuousClock.now < deadline else {
                throw AuthError.recoverable(
                    reason: "another proxyctl process has held the token lock for \(timeout / 1000)s (\(file))",
                    retryAfter: 5)
            }
            try await Task.sleep(for: .milliseconds(delay))
            delay = min(delay * 2, 100)
        }
        defer { flock(fd, LOCK_UN) }
        return try await body()
    }
}

/// A problem with a file in the state directory.
public struct StoreError: Error, Sendable, CustomStringConvertible {
    public let path: String
    public let reason: String

    init(path: String, _ reason: String) {
        self.path = path
        self.reason = reason
    }

    public var description: String { "\(path) \(reason)" }
}
