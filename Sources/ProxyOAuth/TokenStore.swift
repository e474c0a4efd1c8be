import ProxyCore

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

/// The on-disk token store: one JSON file per provider under `<state_dir>/tokens/`, 0600 in 0700
/// directories, replaced atomically (temporary file, fsync, rename, fsync of the directory), and a lock
/// file per provider that serialises refreshes across processes (`flock`).
public struct TokenStore: Sendable {
    public let stateDirectory: String
    public var tokensDirectory: String { stateDirectory + "/tokens" }
    /// With `token_store = secret-service`: where the refresh token goes instead of the file (which keeps
    /// everything else, its layout and its lock). Nil: the file holds it all.
    public let secrets: SecretService?

    public init(stateDirectory: String, secrets: SecretService? = SecretService.configured) {
        self.stateDirectory = stateDirectory
        self.secrets = secrets
    }

    /// The member a token file carries when its refresh token is in the Secret Service.
    static let secretServiceMarker = "refresh_token_store"

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
            let parent = PathText.parent(directory)
            if !parent.isEmpty && parent != directory {
                var parentInfo = stat()
                if stat(parent, &parentInfo) != 0 {
                    try FileManager.default.createDirectory(atPath: parent, withIntermediateDirectories: true)
                }
            }
            guard mkdir(directory, 0o700) == 0 || errno == EEXIST else {
                throw StoreError(path: directory, "cannot create the directory", errno: errno)
            }
            guard stat(directory, &info) == 0 else {
                throw StoreError(path: directory, "cannot read the directory", errno: errno)
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
            throw StoreError(path: file, "cannot be read", errno: errno)
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
            if count < 0 { throw StoreError(path: file, "cannot be read", errno: errno) }
            if count == 0 { break }
            data.append(contentsOf: buffer[0..<count])
            if data.count > 4 << 20 { throw StoreError(path: file, "is too large to be a token file", kind: .damaged) }
        }
        guard case .success(let json) = JSON.parse(data), var tokens = TokenSet(json: json) else {
            throw StoreError(
                path: file, "is damaged; sign in again to replace it (proxyctl login \(provider))", kind: .damaged)
        }
        if json.object?[Self.secretServiceMarker]?.string == "secret-service", tokens.refreshToken == nil {
            tokens.refreshTokenInSecretService = true
            if let secret = try? (secrets ?? SecretService.configured)?.lookup(provider: provider, kind: .refreshToken)
            {
                tokens.refreshToken = String(decoding: secret, as: UTF8.self)
            }
        }
        return tokens
    }

    /// The bytes of `tokens`' file. With the Secret Service, the refresh token is stored there first and left
    /// out of the file (marked instead); when the service cannot take it, the 0600 file keeps it.
    static func fileBytes(_ tokens: TokenSet, secrets: SecretService?) -> [UInt8] {
        guard let secrets else { return serialize(tokens) }
        guard let refreshToken = tokens.refreshToken else {
            secrets.clear(provider: tokens.provider, kind: .refreshToken)
            return serialize(tokens)
        }
        guard (try? secrets.store(Array(refreshToken.utf8), provider: tokens.provider, kind: .refreshToken)) != nil,
            var object = tokens.json.object
        else { return serialize(tokens) }
        object["refresh_token"] = nil
        object[secretServiceMarker] = "secret-service"
        return Array(JSON.serialize(.object(object)).utf8) + [0x0A]
    }

    /// Replaces the stored tokens atomically: a crash leaves either the old file or the new one.
    public func save(_ tokens: TokenSet) throws {
        let bytes = Self.serialize(tokens)
        try reserve(tokens.provider, bytes: bytes.count).commit(tokens)
    }

    /// The bytes of a token file.
    static func serialize(_ tokens: TokenSet) -> [UInt8] {
        Array(JSON.serialize(tokens.json).utf8) + [0x0A]
    }

    /// Takes room for the next version of `provider`'s token file: a temporary file beside it (0600) holding
    /// `bytes` zero bytes, written and fsynced, so that a later `commit` of at most that many bytes needs
    /// no new blocks. A refresh reserves before it spends the refresh token: on a full disk it fails here,
    /// while the old refresh token is still good, instead of after the provider has rotated it.
    /// (Copy-on-write filesystems such as btrfs may still need space to overwrite; the commit then fails
    /// and the caller keeps the tokens in memory.)
    public func reserve(_ provider: String, bytes: Int) throws -> Reservation {
        try prepare()
        let file = path(for: provider)
        let temporary = "\(tokensDirectory)/.\(provider).\(getpid()).\(UInt32.random(in: 0...UInt32.max)).tmp"
        let fd = open(temporary, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0o600)
        guard fd >= 0 else { throw StoreError(path: file, "cannot be written", errno: errno) }
        let reservation = Reservation(
            fd: fd, temporary: temporary, file: file, directory: tokensDirectory, size: bytes, secrets: secrets)
        let zeros = [UInt8](repeating: 0, count: min(bytes, 16384))
        var written = 0
        while written < bytes {
            let count = zeros.withUnsafeBytes { write(fd, $0.baseAddress, min($0.count, bytes - written)) }
            if count < 0 && errno == EINTR { continue }
            if count <= 0 { throw StoreError(path: file, "cannot be written", errno: count < 0 ? errno : ENOSPC) }
            written += count
        }
        guard fsync(fd) == 0 else { throw StoreError(path: file, "cannot be written", errno: errno) }
        return reservation
    }

    /// Room taken for one token file (see `reserve`): committed once, or removed when let go.
    public final class Reservation {
        private var fd: Int32
        let temporary: String
        let file: String
        let directory: String
        /// The bytes reserved: a commit of at most this many needs no new blocks.
        public let size: Int
        let secrets: SecretService?
        /// Not committed yet, and still usable.
        public var isOpen: Bool { fd >= 0 }

        init(fd: Int32, temporary: String, file: String, directory: String, size: Int, secrets: SecretService?) {
            self.fd = fd
            self.temporary = temporary
            self.file = file
            self.directory = directory
            self.size = size
            self.secrets = secrets
        }

        deinit {
            if fd >= 0 {
                close(fd)
                unlink(temporary)
            }
        }

        /// Writes `tokens` over the placeholder, fsyncs, renames it over the token file and fsyncs the
        /// directory. On failure the reservation stays usable, so the caller can try again later.
        public func commit(_ tokens: TokenSet) throws {
            try commit(TokenStore.fileBytes(tokens, secrets: secrets))
        }

        func commit(_ bytes: [UInt8]) throws {
            guard fd >= 0 else { throw StoreError(path: file, "cannot be written: its reserved room was given up") }
            var written = 0
            while written < bytes.count {
                let count = bytes[written...].withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, off_t(written)) }
                if count < 0 && errno == EINTR { continue }
                if count <= 0 { throw StoreError(path: file, "cannot be written", errno: count < 0 ? errno : ENOSPC) }
                written += count
            }
            // Shrinking frees blocks and never needs new ones.
            guard ftruncate(fd, off_t(bytes.count)) == 0, fsync(fd) == 0 else {
                throw StoreError(path: file, "cannot be written", errno: errno)
            }
            guard rename(temporary, file) == 0 else {
                let failure = errno
                close(fd)
                fd = -1
                unlink(temporary)
                throw StoreError(path: file, "cannot be replaced", errno: failure)
            }
            close(fd)
            fd = -1
            TokenStore.syncDirectory(directory)
        }
    }

    /// Removes temporary files that other processes left beside `provider`'s token file when they were
    /// killed between writing and renaming (`.NAME.PID.N.tmp`): they may hold a refresh token. Called
    /// under the provider's lock, which every writer holds, so none of them is being written; this
    /// process's own are left alone (a `Reservation` removes its file itself).
    public func removeStaleTemporaries(_ provider: String) {
        guard let names = try? FileManager.default.contentsOfDirectory(atPath: tokensDirectory) else { return }
        let prefix = ".\(provider)."
        for name in names where name.hasPrefix(prefix) && name.hasSuffix(".tmp") {
            let middle = name.dropFirst(prefix.count).dropLast(4)
                .split(separator: ".", omittingEmptySubsequences: false)
            guard middle.count == 2, let pid = Int32(middle[0]), UInt32(middle[1]) != nil, pid != getpid() else {
                continue
            }
            unlink("\(tokensDirectory)/\(name)")
        }
    }

    /// Removes the stored tokens; true when there were some.
    @discardableResult
    public func delete(_ provider: String) throws -> Bool {
        (secrets ?? SecretService.configured)?.clear(provider: provider, kind: .refreshToken)
        let file = path(for: provider)
        if unlink(file) != 0 {
            if errno == ENOENT { return false }
            throw StoreError(path: file, "cannot be removed", errno: errno)
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
        // The modification time is st_mtim in glibc's struct stat, st_mtimespec in Darwin's (docs/porting.md).
        #if canImport(Darwin)
            let modified = info.st_mtimespec
        #else
            let modified = info.st_mtim
        #endif
        return FileVersion(
            inode: UInt64(info.st_ino), size: Int64(info.st_size),
            modified: Int64(modified.tv_sec) * 1_000_000_000 + Int64(modified.tv_nsec))
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
        let held = try await lock(provider, timeout: timeout)
        defer { held.release() }
        return try await body()
    }

    /// Takes the provider's cross-process lock (`flock`), waiting up to `timeout` milliseconds; it is held
    /// until `release()` or until the `Lock` goes away.
    public func lock(_ provider: String, timeout: Int = 60_000) async throws -> Lock {
        try prepare()
        let file = lockPath(for: provider)
        let fd = open(file, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0o600)
        guard fd >= 0 else { throw StoreError(path: file, "cannot be opened", errno: errno) }
        let held = Lock(fd: fd)
        let deadline = ContinuousClock.now + .milliseconds(timeout)
        var delay = 5
        while flock(fd, LOCK_EX | LOCK_NB) != 0 {
            guard errno == EWOULDBLOCK || errno == EINTR else {
                throw StoreError(path: file, "cannot be locked", errno: errno)
            }
            guard ContinuousClock.now < deadline else {
                throw AuthError.recoverable(
                    reason: "another proxyctl process has held the token lock for \(timeout / 1000)s (\(file))",
                    retryAfter: 5)
            }
            try await Task.sleep(for: .milliseconds(delay))
            delay = min(delay * 2, 100)
        }
        held.locked = true
        return held
    }

    /// A held provider lock.
    public final class Lock {
        private var fd: Int32
        fileprivate var locked = false

        init(fd: Int32) { self.fd = fd }

        deinit { release() }

        /// Lets the lock go (closing the descriptor releases the `flock`); later calls do nothing.
        public func release() {
            guard fd >= 0 else { return }
            if locked { flock(fd, LOCK_UN) }
            close(fd)
            fd = -1
        }
    }
}

/// A problem with a file in the state directory.
public struct StoreError: Error, Sendable, CustomStringConvertible {
    public let path: String
    public let reason: String
    public let kind: Kind
    /// The system error, when there was one.
    public let code: Int32?

    public enum Kind: Sendable, Equatable {
        /// The file is there but is not a token file: signing in again replaces it.
        case damaged
        /// Reading, writing or locking failed (a full disk, a quota, permissions, a read-only filesystem).
        case io
    }

    init(path: String, _ reason: String, kind: Kind = .io) {
        self.path = path
        self.reason = reason
        self.kind = kind
        self.code = nil
    }

    init(path: String, _ what: String, errno code: Int32) {
        self.path = path
        self.reason = "\(what): \(String(cString: strerror(code)))"
        self.kind = .io
        self.code = code
    }

    public var description: String { "\(path) \(reason)" }

    /// What the user can do about it.
    var fix: String {
        let directory = PathText.parent(path)
        switch code {
        case ENOSPC, EDQUOT, EFBIG: return "free space on the disk that holds \(directory)"
        case EACCES, EPERM, EROFS: return "make \(directory) writable by this user, or set state_dir in [proxy]"
        default: return "check \(directory) (state_dir in [proxy])"
        }
    }

    /// The error as the token users see it: a damaged file asks for a new sign-in (which replaces it); any
    /// other problem is the state directory's, named with its fix, and never blamed on the provider.
    public func authError(provider: String) -> AuthError {
        switch kind {
        case .damaged:
            .reauthenticate(reason: "the token file \(description)")
        case .io:
            .storage(reason: "proxyctl cannot keep tokens: \(description); \(fix)")
        }
    }
}
