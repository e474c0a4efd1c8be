import Foundation
import ProxyCore

/// Hands out usable tokens for one provider and refreshes them: single-flight inside the process, under
/// the provider's file lock across processes, and always persisting a rotated refresh token before anyone
/// receives the new access token.
public actor TokenManager {
    public nonisolated let provider: ProviderConfig
    public nonisolated let store: TokenStore
    public let client: ProviderClient
    private var cached: TokenSet?
    private var cachedVersion: TokenStore.FileVersion?
    private var refreshing: Task<TokenSet, any Error>?
    /// Seconds since 1970; tests move time.
    private var clock: @Sendable () -> Int64
    /// Token requests made by this manager (for tests and status).
    public private(set) var refreshCount = 0

    public init(
        provider: ProviderConfig, store: TokenStore, client: ProviderClient,
        clock: @escaping @Sendable () -> Int64 = { Int64(Date().timeIntervalSince1970) }
    ) {
        self.provider = provider
        self.store = store
        self.client = client
        self.clock = clock
    }

    private var notSignedIn: AuthError {
        .reauthenticate(reason: "not signed in to \(provider.name); run: proxyctl login \(provider.name)")
    }

    /// The stored tokens as they are now (re-read when another process changed the file), without refreshing.
    public func storedTokens() throws -> TokenSet? {
        let version = store.version(provider.name)
        if version == nil {
            cached = nil
            cachedVersion = nil
            return nil
        }
        if version != cachedVersion || cached == nil {
            cached = try store.load(provider.name)
            cachedVersion = version
        }
        return cached
    }

    /// Usable tokens: the stored ones while fresh, else refreshed ones.
    public func currentTokens() async throws -> TokenSet {
        guard let tokens = try storedTokens() else { throw notSignedIn }
        try checkBelongsToProvider(tokens)
        if tokens.isFresh(at: clock()) { return tokens }
        return try await refresh(replacing: tokens.generation)
    }

    /// Refreshes because the tokens of `generation` were rejected or are stale. When the stored tokens are
    /// already newer than that (someone refreshed meanwhile), they are returned without a new request.
    public func refresh(replacing generation: Int64) async throws -> TokenSet {
        if let current = try storedTokens(), current.generation > generation, !current.isExpired(at: clock()) {
            return current
        }
        if let refreshing { return try await refreshing.value }
        let task = Task { try await self.refreshUnderLock(replacing: generation) }
        refreshing = task
        defer { refreshing = nil }
        return try await task.value
    }

    private func refreshUnderLock(replacing generation: Int64) async throws -> TokenSet {
        try await store.withLock(provider.name) {
            // Another process may have refreshed while we waited for the lock: read the file again.
            guard let onDisk = try store.load(provider.name) else { throw notSignedIn }
            try checkBelongsToProvider(onDisk)
            remember(onDisk)
            if onDisk.generation > generation && onDisk.isFresh(at: clock()) { return onDisk }
            if let bound = onDisk.dpopThumbprint, await client.dpopKey?.thumbprint != bound {
                // `proxyctl login --new-key` may have made a new key since this process started.
                if let key = try? DPoPKey.load(stateDirectory: store.stateDirectory, provider: provider.name),
                    key.thumbprint == bound
                {
                    await client.setDPoPKey(key)
                }
            }
            if let bound = onDisk.dpopThumbprint, await client.dpopKey?.thumbprint != bound {
                throw AuthError.reauthenticate(
                    reason:
                        "the tokens for \(provider.name) are bound to a DPoP key that is no longer there; run: proxyctl login \(provider.name)"
                )
            }
            guard let refreshToken = onDisk.refreshToken else {
                throw AuthError.reauthenticate(
                    reason:
                        "the access token for \(provider.name) has expired and there is no refresh token; run: proxyctl login \(provider.name)"
                )
            }
            refreshCount += 1
            let parameters: [(String, String)] = [
                ("grant_type", "refresh_token"), ("refresh_token", refreshToken), ("client_id", provider.clientID),
            ]
            let outcome: Result<TokenResponse, TokenEndpointError>
            do {
                outcome = try await client.postToken(parameters)
            } catch let error as AuthError {
                try record(onDisk, failure: error)
                throw error
            }
            switch outcome {
            case .success(let response):
                return try await adopt(response, previous: onDisk)
            case .failure(let failure):
                let error = classifyRefreshFailure(failure)
                if case .reauthenticate = error {
                    // A process that does not take the lock may have rotated the token: look once more.
                    if let again = try store.load(provider.name), again.refreshToken != refreshToken,
                        again.isFresh(at: clock())
                    {
                        remember(again)
                        return again
                    }
                    var dead = onDisk
                    dead.refreshToken = nil
                    try record(dead, failure: error)
                } else {
                    try record(onDisk, failure: error)
                }
                throw error
            }
        }
    }

    /// Stores the refreshed tokens (the rotated refresh token first of all), then returns them.
    private func adopt(_ response: TokenResponse, previous: TokenSet) async throws -> TokenSet {
        guard let type = TokenEndpoint.normalizedType(response.tokenType) else {
            throw AuthError.configuration(
                reason: "the provider issued an unsupported token type \(AuthText.clip(response.tokenType, 20))")
        }
        if previous.dpopThumbprint != nil && type != "DPoP" && provider.dpopRequired {
            throw AuthError.configuration(
                reason:
                    "the provider refreshed DPoP tokens as \(type) tokens, and dpop_required = true in [provider \(provider.name)]"
            )
        }
        let now = clock()
        var updated = previous
        updated.accessToken = response.accessToken
        updated.tokenType = type
        updated.issuedAt = now
        updated.expiresAt = response.expiresIn.map { now + Int64($0) }
        // RFC 6749 §6: without a new refresh token, the old one stays valid.
        updated.refreshToken = response.refreshToken ?? previous.refreshToken
        updated.scope = response.scope ?? previous.scope
        if let idToken = response.idToken {
            // OpenID Connect Core §12.2: same issuer and subject; no nonce on refresh.
            let validator = IDTokenValidator(issuer: provider.issuer, clientID: provider.clientID, nonce: nil, now: now)
            let identity = try await validator.validate(idToken) { refresh in try await client.jwks(refresh: refresh) }
            if let subject = previous.identity?.subject, identity.subject != subject {
                throw AuthError.reauthenticate(reason: "the provider refreshed tokens for another user; sign in again")
            }
            updated.idToken = idToken
            updated.identity = identity
        }
        updated.dpopThumbprint = type == "DPoP" ? previous.dpopThumbprint : nil
        updated.generation = previous.generation + 1
        updated.lastRefresh = TokenSet.RefreshRecord(at: now, outcome: "ok")
        try store.save(updated)
        remember(updated)
        return updated
    }

    private func record(_ tokens: TokenSet, failure: AuthError) throws {
        var updated = tokens
        updated.lastRefresh = TokenSet.RefreshRecord(
            at: clock(), outcome: failure.category, reason: failure.description)
        try store.save(updated)
        remember(updated)
    }

    private func remember(_ tokens: TokenSet) {
        cached = tokens
        cachedVersion = store.version(provider.name)
    }

    private func checkBelongsToProvider(_ tokens: TokenSet) throws {
        guard tokens.issuer == provider.issuer, tokens.clientID == provider.clientID else {
            throw AuthError.reauthenticate(
                reason:
                    "the stored tokens for \(provider.name) were issued by another issuer or client; run: proxyctl login \(provider.name)"
            )
        }
    }

    /// What a failed refresh means for the user.
    func classifyRefreshFailure(_ failure: TokenEndpointError) -> AuthError {
        switch failure {
        case .oauth(let error, let status, _):
            switch error.error {
            case "invalid_grant", "http_400", "http_401", "invalid_token":
                // glewlwyd answers a bad or reused refresh token with an empty 400.
                return .reauthenticate(
                    reason:
                        "the provider no longer accepts the refresh token (\(error.summary)); run: proxyctl login \(provider.name)"
                )
            case "invalid_client", "unauthorized_client", "unsupported_grant_type", "http_403":
                return .configuration(
                    reason:
                        "the provider refused the refresh for client \(provider.clientID) (\(error.summary), HTTP \(status)); check its registration"
                )
            case "invalid_scope":
                return .reauthenticate(
                    reason: "the provider refused the scopes on refresh (\(error.summary)); sign in again")
            default:
                return .recoverable(reason: "the provider refused the refresh (\(error.summary))", retryAfter: nil)
            }
        case .unavailable(let status, let retryAfter):
            return .recoverable(reason: "the provider is unavailable (HTTP \(status))", retryAfter: retryAfter)
        case .malformed(let reason):
            return .recoverable(reason: reason, retryAfter: nil)
        }
    }

    func setClock(_ clock: @escaping @Sendable () -> Int64) { self.clock = clock }
}
