import Dispatch
import ProxyCore
import ProxyOAuth

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

/// Where an exchange's I/O (`ExchangeIO`) gets its tokens and makes their credential field values: the server's
/// `TokenBroker`, or a test's scripted source. A class-bound protocol: `ConnectionContext` holds one for every
/// connection it serves, so a call is a witness-table call, with nothing boxed or allocated per request. The
/// completions run on the loop.
protocol ExchangeTokens: AnyObject {
    /// A usable token of `key` when one is at hand on the loop (`tokens` would complete at once with it): the
    /// exchange goes on without a completion to make and keep; nil when `tokens` must be asked.
    func tokensAtHand(_ key: TokenKey) -> TokenSet?
    /// A usable token of `key`.
    func tokens(_ key: TokenKey, completion: @escaping (Result<TokenSet, AuthError>) -> Void)
    /// Newer tokens than those of `generation`, which the origin rejected.
    func refresh(
        _ key: TokenKey, replacing generation: Int64, completion: @escaping (Result<TokenSet, AuthError>) -> Void)
    /// The value of the credential field `header` for `tokens`, in `scheme`.
    func headerValue(_ header: CredentialHeader, _ tokens: TokenSet, scheme: String) throws(AuthError) -> [UInt8]
    /// The issuer of `provider`, as configured.
    func issuer(of provider: String) -> String?
}

extension TokenBroker: ExchangeTokens {}

/// Gives connections on the loop the tokens of each provider, through the providers' `TokenManager`s.
///
/// Usable tokens are cached on the loop for up to a second, so most requests get their token without
/// leaving the loop thread; the cache is refreshed through the manager, which notices tokens written by
/// `proxyctl login` in another process and refreshes proactively before expiry.
final class TokenBroker {
    let loop: EventLoop
    private let managers: [String: TokenManager]
    /// Usable tokens per key (an origin's own audience and scopes, or the provider's token).
    private var snapshots: [TokenKey: Snapshot] = [:] {
        didSet { recent = nil }
    }
    private typealias Snapshot = (tokens: TokenSet, checkedAt: Int64, version: TokenStore.FileVersion?)
    /// The snapshot `cachedTokens` found last, with its key and token file (forgotten whenever `snapshots`
    /// changes): a pass's requests go to one origin as a rule, and keys compared (the same strings, the origin's)
    /// cost less than two dictionary lookups, which hashed the key's strings for every request (about 1,300
    /// instructions, callgrind, bench row 6). A class: a tuple of the key and snapshot was copied field by field
    /// on every use (about 600 instructions).
    private var recent: Recent?
    private final class Recent {
        let key: TokenKey
        let file: String
        let snapshot: Snapshot
        init(key: TokenKey, file: String, snapshot: Snapshot) {
            self.key = key
            self.file = file
            self.snapshot = snapshot
        }
    }
    /// How long a cached snapshot is trusted without asking the manager (milliseconds).
    let snapshotLifetime: Int64 = 1000

    /// Each provider's token file, for the per-request stat.
    private let tokenFiles: [String: String]

    /// The static secrets of origins without a provider, by `SecretSource.name` (`TokenKey(staticSecret:)`).
    private let secrets: [String: StaticSecret]
    /// The files `{secret_file:PATH}` templates read.
    let fileValues = SecretFileValues()

    init(loop: EventLoop, managers: [String: TokenManager], secrets: [String: StaticSecret] = [:]) {
        self.loop = loop
        self.managers = managers
        self.secrets = secrets
        self.tokenFiles = managers.mapValues { $0.store.path(for: $0.provider.name) }
    }

    var providers: [String] { Array(managers.keys) }

    /// The issuer of `provider`, as configured.
    func issuer(of provider: String) -> String? { managers[provider]?.provider.issuer }

    /// The last `Authorization` field value made, and of which token.
    private var lastAuthorization: (type: String, token: String, value: [UInt8])?

    /// The `Authorization` field value of `tokens` in `scheme` ("Bearer <token>", "DPoP <token>": the exchange
    /// chose it), made once per token rather than once per request (a provider's token is often a kilobyte).
    func authorizationValue(_ tokens: TokenSet, scheme: String) -> [UInt8] {
        if let last = lastAuthorization, last.token == tokens.accessToken, last.type == scheme {
            return last.value
        }
        var value: [UInt8] = []
        value.reserveCapacity(scheme.utf8.count + 1 + tokens.accessToken.utf8.count)
        value += scheme.utf8
        value.append(UInt8(ascii: " "))
        value += tokens.accessToken.utf8
        lastAuthorization = (scheme, tokens.accessToken, value)
        return value
    }

    /// The value of the credential field `header` for `tokens` (a provider's token or a static secret), in `scheme`
    /// where the template has one: the one place a credential becomes a header value. The default field's value is
    /// made once per token (`authorizationValue`); a `{secret_file:PATH}` is read through `fileValues`.
    func headerValue(_ header: CredentialHeader, _ tokens: TokenSet, scheme: String) throws(AuthError) -> [UInt8] {
        if header == .authorizationDefault { return authorizationValue(tokens, scheme: scheme) }
        let files = fileValues
        do {
            return try header.render(credential: tokens.accessToken.utf8, scheme: scheme) { path in
                try files.value(path)
            }
        } catch let error as AuthError {
            throw error
        } catch {
            throw AuthError.configuration(reason: "a {secret_file} of a header cannot be read")
        }
    }

    /// Whether a refresh token is out at a provider with its answer not stored yet (shutdown waits for it).
    var refreshInFlight: Bool { managers.values.contains { !$0.gate.isIdle } }

    /// Tokens usable right now without leaving the loop, if the cache has them. One stat(2) makes sure no
    /// other process (`proxyctl login`, `step-up`, `logout`) replaced the file since; requests handled in
    /// the same pass of the loop (sockets that were ready together) share it.
    func cachedTokens(_ key: TokenKey) -> TokenSet? {
        let found: Recent
        if let recent, recent.key == key {
            found = recent
        } else {
            guard let snapshot = snapshots[key], let file = tokenFiles[key.provider] else { return nil }
            found = Recent(key: key, file: file, snapshot: snapshot)
            recent = found
        }
        let now = EventLoop.monotonicMilliseconds()
        guard now - found.snapshot.checkedAt < snapshotLifetime, found.snapshot.tokens.isFresh(at: Int64(time(nil))),
            fileVersion(found.file) == found.snapshot.version
        else { return nil }
        return found.snapshot.tokens
    }

    /// The token file's version as stat(2) last saw it, and in which pass of the loop. One file, the last one
    /// asked about: a pass's requests go to one provider's origins as a rule, and a string compared costs less
    /// than the dictionary (hashing, and an allocation every pass) that kept one version per file.
    fileprivate var versionSeen: (pass: Int64, file: String, version: TokenStore.FileVersion?)?

    private func fileVersion(_ file: String) -> TokenStore.FileVersion? {
        let pass = loop.passStamp()
        if let seen = versionSeen, seen.pass == pass, seen.file == file { return seen.version }
        let version = TokenStore.version(atPath: file)
        versionSeen = (pass, file, version)
        return version
    }

    /// The static secret or the tokens of `key` cached on the loop, if usable: what `tokens` completes with at once.
    func tokensAtHand(_ key: TokenKey) -> TokenSet? {
        key.isStaticSecret ? secrets[key.provider]?.cached() : cachedTokens(key)
    }

    /// A usable token of `key` (as `TokenSet.view(for:)` shows it); `completion` runs on the loop.
    func tokens(_ key: TokenKey, completion: @escaping (Result<TokenSet, AuthError>) -> Void) {
        if let atHand = tokensAtHand(key) { return completion(.success(atHand)) }
        if key.isStaticSecret {
            guard let secret = secrets[key.provider] else {
                return completion(.failure(.configuration(reason: "no secret named \(key.provider)")))
            }
            return offLoop(completion) {
                do throws(AuthError) { return .success(try secret.load()) } catch { return .failure(error) }
            }
        }
        run(key, completion: completion) { manager in try await manager.currentTokens(for: key) }
    }

    /// Refreshes because the tokens of `generation` were rejected; newer tokens are reused when someone
    /// already refreshed. `completion` runs on the loop.
    func refresh(
        _ key: TokenKey, replacing generation: Int64, completion: @escaping (Result<TokenSet, AuthError>) -> Void
    ) {
        if key.isStaticSecret {
            guard let secret = secrets[key.provider] else {
                return completion(.failure(.configuration(reason: "no secret named \(key.provider)")))
            }
            // secret_command runs again (a vault's short-lived key), a file is read again; once for every
            // request that was refused with the same value.
            return offLoop(completion) {
                do throws(AuthError) {
                    return .success(try secret.refresh(replacing: generation))
                } catch {
                    return .failure(error)
                }
            }
        }
        if let snapshot = snapshots[key], snapshot.tokens.generation > generation,
            !snapshot.tokens.isExpired(at: Int64(Date().timeIntervalSince1970))
        {
            completion(.success(snapshot.tokens))
            return
        }
        snapshots.removeValue(forKey: key)
        run(key, completion: completion) { manager in try await manager.refresh(key, replacing: generation) }
    }

    /// Runs `work` (blocking: a command, the Secret Service) on a worker thread; `completion` on the loop.
    private func offLoop(
        _ completion: @escaping (Result<TokenSet, AuthError>) -> Void,
        _ work: @escaping @Sendable () -> Result<TokenSet, AuthError>
    ) {
        let callback = LoopBound(completion, loop: loop)
        let loop = self.loop
        DispatchQueue.global().async {
            let result = work()
            loop.post { callback.value(result) }
        }
    }

    private func run(
        _ key: TokenKey, completion: @escaping (Result<TokenSet, AuthError>) -> Void,
        _ work: @escaping @Sendable (TokenManager) async throws -> TokenSet
    ) {
        let provider = key.provider
        guard let manager = managers[provider] else {
            completion(.failure(.configuration(reason: "no provider named \(provider)")))
            return
        }
        let callback = LoopBound(completion, loop: loop)
        let broker = LoopBound(self, loop: loop)
        let loop = self.loop
        Task {
            let result: Result<TokenSet, AuthError>
            do {
                result = .success(try await work(manager))
            } catch let error as AuthError {
                result = .failure(error)
            } catch let error as StoreError {
                result = .failure(error.authError(provider: provider))
            } catch {
                result = .failure(.recoverable(reason: "\(error)", retryAfter: nil))
            }
            loop.post {
                if case .success(let tokens) = result {
                    broker.value.snapshots[key] = (
                        tokens, EventLoop.monotonicMilliseconds(), manager.store.version(provider)
                    )
                    // The file was just looked at again: what this pass saw before is older.
                    broker.value.versionSeen = nil
                }
                callback.value(result)
            }
        }
    }
}

extension AuthError {
    /// What the per-request exchange needs to know.
    var tokenFailure: TokenFailure {
        switch self {
        case .reauthenticate(let reason), .cancelled(let reason): .signInNeeded(reason: reason)
        case .stepUp(_, _, let reason): .signInNeeded(reason: reason)
        case .recoverable(let reason, let retryAfter): .unavailable(reason: reason, retryAfter: retryAfter)
        case .pending(let reason, let retryAfter): .pending(reason: reason, retryAfter: retryAfter)
        case .storage(let reason): .storage(reason: reason)
        case .configuration(let reason), .rejected(let reason): .configuration(reason: reason)
        }
    }
}
