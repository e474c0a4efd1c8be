import Dispatch
import ProxyCore
import ProxyTLS
import Synchronization

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

/// The static secret of an `[origin]` without a provider (`secret_file`, `secret_command`, `secret`), handed to
/// the proxy as a `TokenSet` whose access token is the secret, so that it travels the one way tokens do (the
/// broker, the exchange's generation, refresh once and replay once on a 401). The value is never logged, never in
/// an error, never in argv.
///
/// `cached` is the loop's fast path (a stat for a file, the clock for a command's output); `load` and `refresh`
/// block (a command runs, the Secret Service is asked) and run off the loop, one at a time per secret.
public final class StaticSecret: Sendable {
    public let source: SecretSource
    /// For `secret = NAME`: where `proxyctl secret set` keeps it without the Secret Service.
    public let stateDirectory: String?

    private struct State {
        var value: [UInt8]?
        var generation: Int64 = 0
        /// When the value was read (monotonic seconds): a command's output is kept for its `secret_ttl`.
        var loadedAt: Int64 = 0
        /// The file's version when it was read (`secret_file`, a stored secret's file).
        var version: TokenStore.FileVersion?
    }

    private let state = Mutex(State())
    /// Held while a value is being read: two requests that find it stale run the command once.
    private let loading = Mutex(())

    public init(source: SecretSource, stateDirectory: String?) {
        self.source = source
        self.stateDirectory = stateDirectory
    }

    /// The file that holds a secret stored with `proxyctl secret set NAME` when the Secret Service is not used.
    public static func storedPath(stateDirectory: String, name: String) -> String {
        stateDirectory + "/secrets/" + name
    }

    /// The secret as tokens, if what was read is still good: without running anything.
    public func cached() -> TokenSet? {
        let current = state.withLock { $0 }
        guard let value = current.value, fresh(current) else { return nil }
        return tokens(value, generation: current.generation)
    }

    private func fresh(_ current: State) -> Bool {
        switch source {
        case .file(let path):
            return TokenStore.version(atPath: path) == current.version
        case .command(_, let ttl):
            return Self.monotonicSeconds() - current.loadedAt < Int64(ttl)
        case .stored(let name):
            if SecretService.configured != nil { return Self.monotonicSeconds() - current.loadedAt < 60 }
            guard let stateDirectory else { return false }
            return TokenStore.version(atPath: Self.storedPath(stateDirectory: stateDirectory, name: name))
                == current.version
        }
    }

    /// The secret, read again when what was read is stale. Blocks.
    public func load() throws(AuthError) -> TokenSet {
        try loading.withLock { _ throws(AuthError) -> TokenSet in
            if let cached = cached() { return cached }
            return try read()
        }
    }

    /// The secret after a 401 with the one of `replacing`: read again (a command run again) unless someone
    /// already did since. Blocks.
    public func refresh(replacing generation: Int64) throws(AuthError) -> TokenSet {
        try loading.withLock { _ throws(AuthError) -> TokenSet in
            let current = state.withLock { $0 }
            if let value = current.value, current.generation > generation {
                return tokens(value, generation: current.generation)
            }
            return try read()
        }
    }

    private func read() throws(AuthError) -> TokenSet {
        var version: TokenStore.FileVersion?
        let value: [UInt8]
        switch source {
        case .file(let path):
            version = TokenStore.version(atPath: path)
            value = try SecretFile.read(path, what: "the secret_file")
        case .command(let words, _):
            value = try Self.run(words)
        case .stored(let name):
            if let service = SecretService.configured {
                do {
                    guard let stored = try service.lookup(provider: name, kind: .staticSecret) else {
                        throw AuthError.configuration(
                            reason: "no secret is stored as \(name); run: proxyctl secret set \(name)")
                    }
                    value = Array(stored.prefix { $0 != 0x0A && $0 != 0x0D })
                } catch let error as AuthError {
                    throw error
                } catch {
                    throw AuthError.recoverable(reason: "\(error)", retryAfter: nil)
                }
            } else {
                guard let stateDirectory else {
                    throw AuthError.configuration(reason: "no state directory holds the secret \(name)")
                }
                let path = Self.storedPath(stateDirectory: stateDirectory, name: name)
                guard FileManager.default.fileExists(atPath: path) else {
                    throw AuthError.configuration(
                        reason: "no secret is stored as \(name); run: proxyctl secret set \(name)")
                }
                version = TokenStore.version(atPath: path)
                value = try SecretFile.read(path, what: "the stored secret")
            }
        }
        try Self.check(value, from: source)
        let now = Self.monotonicSeconds()
        let generation = state.withLock { current in
            if current.value != value || current.generation == 0 { current.generation += 1 }
            current.value = value
            current.loadedAt = now
            current.version = version
            return current.generation
        }
        return tokens(value, generation: generation)
    }

    /// A secret goes into a header field: visible ASCII and spaces only (RFC 9110 §5.5), never quoted back.
    static func check(_ value: [UInt8], from source: SecretSource) throws(AuthError) {
        guard !value.isEmpty else { throw AuthError.configuration(reason: "\(source.name) gave an empty secret") }
        guard value.count <= 16 << 10, value.allSatisfy({ $0 == 0x20 || $0 == 0x09 || ($0 > 0x20 && $0 < 0x7F) })
        else {
            throw AuthError.configuration(
                reason:
                    "\(source.name) gave a secret a header cannot carry (control or non-ASCII bytes, or over 16 KiB)"
            )
        }
    }

    private func tokens(_ value: [UInt8], generation: Int64) -> TokenSet {
        TokenSet(
            provider: source.name, issuer: "", clientID: "", accessToken: String(decoding: value, as: UTF8.self),
            tokenType: "Bearer", issuedAt: Int64(time(nil)), expiresAt: nil, refreshToken: nil, idToken: nil,
            scope: nil, identity: nil, generation: generation)
    }

    /// Runs `secret_command` without a shell, standard input closed, for at most 30 s: the first line of its
    /// standard output. Its standard error is not passed on (it might echo the secret); a failure names the exit
    /// status only.
    static func run(_ words: [String]) throws(AuthError) -> [UInt8] {
        let name = SecretSource.command(words, ttl: 0).name
        let path = ProcessInfo.processInfo.environment["PATH"]
        guard let executable = words[0].contains("/") ? words[0] : ChildProcess.which(words[0], path: path) else {
            throw AuthError.configuration(reason: "\(name) is not found on PATH")
        }
        let outcome: ChildProcess.Outcome
        do {
            outcome = try ChildProcess.run(
                executable, Array(words.dropFirst()), output: .capture, error: .null, timeout: 30_000)
        } catch {
            throw AuthError.configuration(reason: "\(name) cannot be run: \(error)")
        }
        guard outcome.succeeded, !outcome.timedOut else {
            var how = "stopped after 30 s"
            if !outcome.timedOut, case .exit(let status) = outcome.termination { how = "exit \(status)" }
            if !outcome.timedOut, case .signal(let signal) = outcome.termination { how = "signal \(signal)" }
            throw AuthError.recoverable(reason: "\(name) failed (\(how))", retryAfter: nil)
        }
        var line = Array(outcome.output.prefix { $0 != 0x0A && $0 != 0x0D })
        while line.last == 0x20 || line.last == 0x09 { line.removeLast() }
        return line
    }

    static func monotonicSeconds() -> Int64 {
        var now = timespec()
        clock_gettime(CLOCK_MONOTONIC, &now)
        return Int64(now.tv_sec)
    }

    /// Checks that the secret can be had, before the proxy starts: a secret file that others may read is
    /// refused (naming `chmod 600`); a command is not run (it may be slow or ask for a person).
    public func checkAtStart() throws(AuthError) {
        switch source {
        case .file(let path): try SecretFile.checkPrivate(path, what: "the secret_file")
        case .command, .stored: break
        }
    }
}

/// The values of `{secret_file:PATH}` in `header` templates: each file the user's own and 0600, read again when it
/// changes (one stat per use). Loop thread or any: guarded.
public final class SecretFileValues: Sendable {
    private let cache = Mutex<[String: (version: TokenStore.FileVersion?, value: [UInt8])]>([:])

    public init() {}

    /// The first line of the file at `path`.
    public func value(_ path: String) throws(AuthError) -> [UInt8] {
        let version = TokenStore.version(atPath: path)
        if let cached = cache.withLock({ $0[path] }), version != nil, cached.version == version {
            return cached.value
        }
        let value = try SecretFile.read(path, what: "the {secret_file} of a header")
        try StaticSecret.check(value, from: .file(path))
        cache.withLock { $0[path] = (version, value) }
        return value
    }
}

/// The placeholders of `placeholder_env`: `proxyctl-placeholder-` and 32 hex digits, HMAC-SHA-256 of the origin and
/// the variable under a random key kept in the state directory (`placeholder-key`, 0600), so that `serve`, `env`
/// and `exec` on one state directory agree without talking, and another state directory's are different.
public enum PlaceholderKey {
    public static func path(stateDirectory: String) -> String { stateDirectory + "/placeholder-key" }

    /// The key, made on first use (two processes making it at once agree: the first link wins).
    public static func load(stateDirectory: String) throws -> [UInt8] {
        let path = path(stateDirectory: stateDirectory)
        if let data = FileManager.default.contents(atPath: path), data.count == 32 { return Array(data) }
        do {
            try SecureFile.makePrivateDirectory(stateDirectory)
            let temporary = path + ".\(getpid()).new"
            try SecureFile.write(Crypto.randomBytes(32), to: temporary, mode: 0o600)
            // link(2) fails when the key exists: another process made it first, and its key is the one.
            _ = link(temporary, path)
            unlink(temporary)
        } catch {
            throw AuthError.storage(reason: "the placeholder key \(path) cannot be made: \(error)")
        }
        guard let data = FileManager.default.contents(atPath: path), data.count == 32 else {
            throw AuthError.storage(reason: "the placeholder key \(path) cannot be read")
        }
        return Array(data)
    }

    /// The placeholder of `origin` (its URL) exported as `variable`.
    public static func placeholder(key: [UInt8], origin: String, variable: String) -> [UInt8] {
        let mac = Crypto.hmacSHA256(key: key, message: Array("\(origin)\n\(variable)".utf8))
        let hex = mac.prefix(16).map { byte in
            let digits = Array("0123456789abcdef".utf8)
            return [digits[Int(byte >> 4)], digits[Int(byte & 0xF)]]
        }.joined()
        return Array(Placeholders.prefix.utf8) + hex
    }

    /// Every origin of `configuration` gets the table of all placeholders (`OriginConfig.placeholders`); nothing
    /// happens without `placeholder_env`.
    public static func assign(_ configuration: inout Configuration, stateDirectory: String?) throws {
        let origins = configuration.origins.origins
        guard origins.contains(where: { $0.placeholderEnv != nil }) else { return }
        guard let stateDirectory else {
            throw AuthError.configuration(reason: "placeholder_env needs a state directory (state_dir, or HOME)")
        }
        let key = try load(stateDirectory: stateDirectory)
        var entries: [Placeholders.Entry] = []
        for origin in origins {
            guard let variable = origin.placeholderEnv else { continue }
            entries.append(
                Placeholders.Entry(
                    value: placeholder(key: key, origin: origin.url, variable: variable), origin: origin.url,
                    variable: variable, credential: origin.credentialName, staticSecret: origin.secret != nil))
        }
        let table = Placeholders(entries)
        configuration.origins = OriginTable(
            origins.map { origin in
                var origin = origin
                origin.placeholders = table
                return origin
            })
    }
}
