import ProxyCore
import ProxyIO
import ProxyOAuth
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

/// What the running proxy holds for its protected origins, shared with the admin listener's thread: the
/// origins and each provider's token manager (replaced together by a SIGHUP).
final class RuntimeOrigins: Sendable {
    private let state: Mutex<(origins: [OriginConfig], managers: [String: TokenManager])>

    init(origins: [OriginConfig], managers: [String: TokenManager]) {
        state = Mutex((origins, managers))
    }

    var origins: [OriginConfig] { state.withLock { $0.origins } }
    var managers: [String: TokenManager] { state.withLock { $0.managers } }

    func replace(origins: [OriginConfig], managers: [String: TokenManager]) {
        state.withLock { $0 = (origins, managers) }
    }
}

/// Whether a provider's stored tokens let the proxy serve its origins, in words for people.
enum TokenReadiness {
    /// `usable`: an access token that is still valid, or a refresh token to get one.
    static func check(_ store: TokenStore, provider: String, now: Int64) -> (usable: Bool, text: String) {
        let tokens: TokenSet?
        do {
            tokens = try store.load(provider)
        } catch {
            return (false, "the token file of \(provider) cannot be read (\(error)); run: proxyctl login \(provider)")
        }
        guard let tokens else { return (false, "not signed in to \(provider); run: proxyctl login \(provider)") }
        let who = tokens.identity.map { " as \(StatusCommand.describeIdentity($0))" } ?? ""
        if !tokens.isExpired(at: now) {
            let until = tokens.expiresAt.map { ", token valid until \(HumanTime.describe($0, now: now))" } ?? ""
            return (true, "signed in to \(provider)\(who)\(until)")
        }
        if tokens.refreshToken != nil {
            return (
                true, "signed in to \(provider)\(who); the access token expired and is refreshed at the next request"
            )
        }
        return (
            false,
            "the access token of \(provider) expired and there is no refresh token; run: proxyctl login \(provider)"
        )
    }
}

/// The proxy as `serve` and `exec` run it: the configuration turned into a `ProxyServer` (token managers,
/// the local CA, DPoP keys), and the optional admin listener.
enum ProxyRuntime {
    /// The token managers, CA and keys for the protected origins of `configuration`; nil without origins.
    /// Managers in `reuse` are kept for providers whose settings did not change (a refresh in flight is then
    /// joined instead of repeated).
    static func interception(
        _ configuration: Configuration, stateDirectory: String?, loop: EventLoop, ca: LocalCA?,
        reuse: [String: TokenManager] = [:]
    ) throws -> Interception? {
        guard !configuration.origins.isEmpty, let stateDirectory else { return nil }
        let transport = CurlTransport(
            loop: loop, upstreamProxy: configuration.proxy.upstreamProxy,
            bypass: configuration.proxy.noUpstreamProxy,
            resolve: configuration.proxy.resolve)
        let store = TokenStore(stateDirectory: stateDirectory)
        var managers: [String: TokenManager] = [:]
        var keys: [String: DPoPKey] = [:]
        for provider in configuration.providers
        where configuration.origins.origins.contains(where: { $0.provider == provider.name }) {
            if provider.tokenBinding == .dpop {
                do {
                    if let key = try DPoPKey.load(stateDirectory: stateDirectory, provider: provider.name) {
                        keys[provider.name] = key
                    }
                } catch {
                    throw CommandFailure(message: "cannot read the DPoP key of \(provider.name): \(error)")
                }
            }
            if let existing = reuse[provider.name], existing.provider == provider {
                managers[provider.name] = existing
                continue
            }
            let client = ProviderClient(config: provider, transport: transport)
            if let key = keys[provider.name] {
                try runBlocking { await client.setDPoPKey(key) }
            }
            do {
                try prepareClient(provider, client: client, stateDirectory: stateDirectory)
            } catch let error as AuthError {
                throw error.commandFailure
            }
            // A machine grant with DPoP made its key just now.
            if !provider.needsSignIn, provider.tokenBinding == .dpop, keys[provider.name] == nil,
                let key = try? runBlocking({ await client.dpopKey })
            {
                keys[provider.name] = key
            }
            managers[provider.name] = TokenManager(provider: provider, store: store, client: client)
        }
        var secrets: [String: StaticSecret] = [:]
        for origin in configuration.origins.origins {
            guard let source = origin.secret, secrets[source.name] == nil else { continue }
            let secret = StaticSecret(source: source, stateDirectory: stateDirectory)
            do {
                try secret.checkAtStart()
            } catch {
                throw CommandFailure(message: "\(origin.file): [origin \(origin.url)]: \(error.description)")
            }
            secrets[source.name] = secret
        }
        return Interception(
            ca: ca, managers: managers, spoolDirectory: stateDirectory + "/spool", dpopKeys: keys,
            stateDirectory: stateDirectory, secrets: secrets)
    }

    /// The admin listener for `server`, when `admin_listen` is set: `/readyz` checks the listener and each
    /// protected origin's tokens; `/metrics` adds each provider's token expiry and refresh tally.
    static func startAdmin(
        _ settings: ProxySettings, server: ProxyServer, origins: RuntimeOrigins, stateDirectory: String?
    ) throws -> AdminServer? {
        guard let address = settings.adminListen else { return nil }
        let metrics = server.metrics
        let store = stateDirectory.map { TokenStore(stateDirectory: $0) }
        let readiness: ReadinessCheck = {
            var reasons: [String] = []
            if !metrics.isListening { reasons.append("the proxy is not accepting connections (stopping)") }
            let now = Int64(time(nil))
            for origin in origins.origins {
                guard let store else {
                    reasons.append("\(origin.url): no state directory for its tokens")
                    continue
                }
                if origin.secret != nil { continue }
                let check = TokenReadiness.check(store, provider: origin.provider, now: now)
                if !check.usable { reasons.append("\(origin.url): \(check.text)") }
            }
            return reasons
        }
        let facts: ProviderFactsSource = {
            var facts: [String: ProviderFacts] = [:]
            for (name, manager) in origins.managers {
                let expiry = (try? manager.store.load(name))??.expiresAt
                facts[name] = ProviderFacts(
                    tokenExpiry: expiry, refreshesOK: manager.tally.ok, refreshesFailed: manager.tally.failed)
            }
            return facts
        }
        do {
            return try AdminServer(
                address: address, settings: settings, version: Version.string, metrics: metrics,
                providerFacts: facts, readiness: readiness)
        } catch {
            throw CommandFailure(message: "\(error)")
        }
    }

    /// The lines `serve` prints when it starts: each protected origin and whether its tokens are usable.
    static func originSummary(_ configuration: Configuration, stateDirectory: String?) -> [String] {
        let now = Int64(time(nil))
        let store = stateDirectory.map { TokenStore(stateDirectory: $0) }
        var lines: [String] = []
        for origin in configuration.origins.origins {
            if let secret = origin.secret {
                let placeholder = origin.placeholderEnv.map { "; placeholder in $\($0)" } ?? ""
                lines.append("protected origin \(origin.url): static secret from \(secret.name)\(placeholder)")
                continue
            }
            guard let store else { continue }
            let check = TokenReadiness.check(store, provider: origin.provider, now: now)
            lines.append("protected origin \(origin.url): \(check.text)")
        }
        if configuration.origins.isEmpty {
            lines.append("no protected origins: every request passes through untouched")
        }
        return lines
    }
}
