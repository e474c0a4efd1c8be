import ProxyCore
import Synchronization

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// Hands out usable tokens for one provider and refreshes them: single-flight inside the process, under
/// the provider's file lock across processes, and always persisting a rotated refresh token before anyone
/// receives the new access token.
///
/// A refresh token is spent the moment the provider rotates it (RFC 6749 §6, RFC 9700 §4.14.2: sending it
/// again makes a provider with reuse detection revoke the whole session), so a refresh is built to keep
/// its answer whatever happens around it:
/// - room for the answer is written to disk before the request (`TokenStore.reserve`), so a full disk
///   fails while the old refresh token is still good;
/// - the request is never sent twice once it went out; an unanswered one stays open (up to
///   `refreshRequestLimit`) and callers that stop waiting after `token_timeout` get `.pending`, while the
///   next ones join the same flight;
/// - the answer is written the instant it is read and checked (the provider's keys are fetched before the
///   request), and kept in memory, with the lock held, when the write fails;
/// - `gate` tells a process that is stopping whether a refresh is out, so it can wait for its answer.
public actor TokenManager {
    public nonisolated let provider: ProviderConfig
    public nonisolated let store: TokenStore
    public let client: ProviderClient
    /// Entered while a refresh token is out at the provider and its answer is not on disk yet.
    public nonisolated let gate = RefreshGate()
    /// Refresh flights that ended with tokens, or with an error (the metrics).
    public nonisolated let tally = RefreshTally()
    private var cached: TokenSet?
    private var cachedVersion: TokenStore.FileVersion?
    /// The refresh in flight per token key: every caller joins it, and it runs to its end even when they stop
    /// waiting. Flights for different keys of one provider are serialised by the provider's lock.
    private var flights: [String: Flight] = [:]
    private var flightCount = 0
    /// Refreshed tokens that could not be written yet (a full disk): kept in memory and written again at
    /// each use, with the provider's lock held meanwhile so that no other process spends the refresh token
    /// they replaced.
    private var unsaved: Unsaved?
    /// Seconds since 1970; tests move time.
    private var clock: @Sendable () -> Int64
    /// Token requests made by this manager (for tests and status).
    public private(set) var refreshCount = 0

    /// How long a refresh request may stay unanswered before its outcome is given up as unknown
    /// (milliseconds). Long on purpose: a provider that stalls usually answers in the end, and the answer
    /// holds the only copy of the rotated refresh token.
    public static let refreshRequestLimit = 600_000
    /// The `Retry-After` given while a refresh is pending.
    static let pendingRetryAfter = 5

    private struct Flight {
        let id: Int
        let task: Task<TokenSet, any Error>
        let started: ContinuousClock.Instant
    }

    private struct Unsaved {
        var tokens: TokenSet
        var reservation: TokenStore.Reservation?
        let lock: TokenStore.Lock
        var failure: StoreError
    }

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

    /// Usable tokens: the stored ones while fresh, else refreshed ones. Waits for a refresh up to the
    /// provider's `token_timeout`, then throws `.pending` (the refresh goes on).
    public func currentTokens() async throws -> TokenSet {
        try await currentTokens(for: defaultKey, waitingAtMost: .milliseconds(provider.tokenTimeout))
    }

    /// Usable tokens; `patience` nil waits for a refresh until it ends.
    public func currentTokens(waitingAtMost patience: Duration?) async throws -> TokenSet {
        try await currentTokens(for: defaultKey, waitingAtMost: patience)
    }

    /// The provider's own token: what `proxyctl login` stores.
    public nonisolated var defaultKey: TokenKey { TokenKey(provider: provider.name) }

    /// A usable token of `key`, as `TokenSet.view(for:)` shows it: from the store while fresh, else obtained
    /// (a refresh, with the key's `resource` and `scope` when it has them, or the provider's grant). Waits up
    /// to `patience` (default `token_timeout`; nil: until the refresh ends).
    public func currentTokens(for key: TokenKey, waitingAtMost patience: Duration?? = nil) async throws -> TokenSet {
        let patience = patience ?? .milliseconds(provider.tokenTimeout)
        do {
            if let tokens = try unsavedTokens(), let view = tokens.view(for: key), view.isFresh(at: clock()) {
                return view
            }
            let stored = try storedTokens()
            if provider.needsSignIn {
                guard let stored else { throw notSignedIn }
                try checkBelongsToProvider(stored)
            }
            let belongs = stored.map { $0.issuer == provider.issuer && $0.clientID == provider.clientID } ?? false
            let view = belongs ? stored?.view(for: key) : nil
            if let view, view.isUsable(at: clock()) { return view }
            return try await refresh(key, replacing: view?.generation ?? Int64.min, patience)
        } catch let error as StoreError {
            throw error.authError(provider: provider.name)
        }
    }

    /// Refreshes because the tokens of `generation` were rejected or are stale. When the stored tokens are
    /// already newer than that (someone refreshed meanwhile), they are returned without a new request.
    public func refresh(replacing generation: Int64) async throws -> TokenSet {
        try await refresh(defaultKey, replacing: generation)
    }

    /// Obtains a new token of `key` because the one of `generation` was rejected; a newer one already stored
    /// is returned without a request. With a machine grant this runs the grant again (there is no refresh token).
    public func refresh(_ key: TokenKey, replacing generation: Int64) async throws -> TokenSet {
        do {
            return try await refresh(key, replacing: generation, .milliseconds(provider.tokenTimeout))
        } catch let error as StoreError {
            throw error.authError(provider: provider.name)
        }
    }

    private func refresh(_ key: TokenKey, replacing generation: Int64, _ patience: Duration?) async throws -> TokenSet {
        if let pending = try unsavedTokens() {
            if let view = pending.view(for: key), view.generation > generation, !view.isExpired(at: clock()) {
                return view
            }
            throw unsavedFailure
        }
        if let current = try storedTokens(), current.issuer == provider.issuer, current.clientID == provider.clientID,
            let view = current.view(for: key), view.generation > generation, !view.accessToken.isEmpty,
            !view.isExpired(at: clock())
        {
            return view
        }
        if let flight = flights[key.id] { return try await wait(for: flight, patience) }
        flightCount += 1
        let id = flightCount
        let tally = self.tally
        let task = Task {
            defer { endFlight(key.id, id) }
            do {
                let tokens = try await obtainUnderLock(key, replacing: generation)
                tally.record(ok: true)
                return tokens
            } catch {
                tally.record(ok: false)
                throw error
            }
        }
        let started = Flight(id: id, task: task, started: .now)
        flights[key.id] = started
        return try await wait(for: started, patience)
    }

    private func endFlight(_ key: String, _ id: Int) {
        if flights[key]?.id == id { flights[key] = nil }
    }

    /// The flight's tokens, or `.pending` once `patience` has passed since it started.
    private func wait(for flight: Flight, _ patience: Duration?) async throws -> TokenSet {
        guard let patience else { return try await flight.task.value }
        // Past the deadline, answer at once: during a long stall every request would otherwise leave a waiter.
        if ContinuousClock.now < flight.started + patience,
            let tokens = try await value(of: flight.task, before: flight.started + patience)
        {
            return tokens
        }
        let waited = (ContinuousClock.now - flight.started).components.seconds
        throw AuthError.pending(
            reason:
                "the provider has not answered the token refresh for \(provider.name) in \(waited)s; the request stays open and its answer will be stored, and the refresh token is not sent again meanwhile",
            retryAfter: Self.pendingRetryAfter)
    }

    /// Whether refreshed tokens are waiting to be written (a full disk).
    public var hasUnsavedTokens: Bool { unsaved != nil }

    /// Tries again to write refreshed tokens that could not be written; true when none are left unsaved.
    @discardableResult
    public func saveUnsaved() -> Bool {
        (try? unsavedTokens()) == nil
    }

    /// The refreshed tokens still waiting to be written, after one more attempt to write them; nil when
    /// there are none (any more).
    private func unsavedTokens() throws -> TokenSet? {
        guard var pending = unsaved else { return nil }
        do {
            let reservation =
                try pending.reservation.flatMap { $0.isOpen ? $0 : nil }
                ?? store.reserve(provider.name, bytes: Self.room(for: pending.tokens))
            pending.reservation = reservation
            try reservation.commit(pending.tokens)
        } catch let error as StoreError {
            pending.failure = error
            if pending.reservation?.isOpen == false { pending.reservation = nil }
            unsaved = pending
            return pending.tokens
        }
        unsaved = nil
        pending.lock.release()
        gate.leave()
        remember(pending.tokens)
        return nil
    }

    private var unsavedFailure: AuthError {
        let failure = unsaved.map { "\($0.failure.description); \($0.failure.fix)" } ?? "unknown"
        return .storage(
            reason:
                "the refreshed tokens for \(provider.name) are not written yet (\(failure)); they are kept in memory and written as soon as there is room"
        )
    }

    /// Room for the refreshed token file: the current one and as much again (at least 8 KiB) for longer tokens.
    static func room(for tokens: TokenSet) -> Int {
        let current = TokenStore.serialize(tokens).count
        return current + max(current, 8192)
    }

    /// Takes the provider's lock and obtains a token of `key`: by refreshing (the provider's token, the ID
    /// token, or a token for an origin's audience) or by the provider's machine grant.
    private func obtainUnderLock(_ key: TokenKey, replacing generation: Int64) async throws -> TokenSet {
        if !provider.needsSignIn { return try await grantUnderLock(key, replacing: generation) }
        let refreshed = try await refreshUnderLock(key, replacing: generation)
        guard let view = refreshed.view(for: key) else {
            throw AuthError.reauthenticate(
                reason:
                    key.kind == .idToken
                    ? "there is no ID token for \(provider.name); run: proxyctl login \(provider.name)"
                    : "the provider gave no token for \(key); run: proxyctl login \(provider.name)")
        }
        if key.kind == .idToken && (view.generation <= generation || view.isExpired(at: clock())) {
            // The provider refreshed without a new ID token (glewlwyd does): only a sign-in makes one.
            throw AuthError.reauthenticate(
                reason:
                    "the ID token for \(provider.name) has expired and the provider gives no new one on refresh; run: proxyctl login \(provider.name)"
            )
        }
        return view
    }

    private func refreshUnderLock(_ key: TokenKey, replacing generation: Int64) async throws -> TokenSet {
        let lock = try await store.lock(provider.name)
        var keepLock = false
        defer { if !keepLock { lock.release() } }
        // A process killed between writing and renaming its temporary file leaves a refresh token behind.
        store.removeStaleTemporaries(provider.name)
        // Another process may have refreshed while we waited for the lock: read the file again.
        guard let onDisk = try store.load(provider.name) else { throw notSignedIn }
        try checkBelongsToProvider(onDisk)
        remember(onDisk)
        if let view = onDisk.view(for: key), view.generation > generation, view.isUsable(at: clock()) {
            return onDisk
        }
        // The ID token comes with the provider's own refresh.
        let audience = key.kind == .accessToken && !key.isProviderDefault
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
        // Room for the answer before the refresh token is spent: a full disk fails here, while it is still good.
        let reservation = try store.reserve(provider.name, bytes: Self.room(for: onDisk))
        // The keys that sign a refreshed ID token, fetched now: between reading the answer and writing it
        // there is then only local work, the window in which a kill loses the rotated refresh token.
        if onDisk.idToken != nil { _ = try? await client.jwks(refresh: false) }
        guard gate.enter() else {
            throw AuthError.cancelled(reason: "proxyctl is stopping; the tokens of \(provider.name) were not refreshed")
        }
        defer { if !keepLock { gate.leave() } }
        refreshCount += 1
        var parameters: [(String, String)] = [
            ("grant_type", "refresh_token"), ("refresh_token", refreshToken), ("client_id", provider.clientID),
        ]
        if audience {
            // RFC 8707 §2.2 and RFC 6749 §6: a token for one resource, with no more than the scopes it needs.
            if let resource = key.resource { parameters.append(("resource", resource)) }
            if let scopes = key.scopes { parameters.append(("scope", scopes.joined(separator: " "))) }
        }
        let outcome: Result<TokenResponse, TokenEndpointError>
        do {
            outcome = try await client.postToken(parameters, resendable: false, timeout: Self.refreshRequestLimit)
        } catch let error as AuthError {
            record(onDisk, failure: error, into: reservation)
            throw error
        }
        switch outcome {
        case .success(let response):
            let tokens = try await adopt(response, previous: onDisk, key: audience ? key : nil, into: reservation)
            if case .failure(let failure) = tokens.saved {
                // Keep the lock (and the gate) until the write succeeds: the file still holds the spent token.
                keepLock = true
                unsaved = Unsaved(tokens: tokens.tokens, reservation: reservation, lock: lock, failure: failure)
            }
            return tokens.tokens
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
                record(dead, failure: error, into: reservation)
            } else {
                record(onDisk, failure: error, into: reservation)
            }
            throw error
        }
    }

    /// Checks the refreshed tokens, then writes them at once into the room taken before the request (the
    /// rotated refresh token exists nowhere else), and returns them with the outcome of the write.
    private func adopt(
        _ response: TokenResponse, previous: TokenSet, key: TokenKey?, into reservation: TokenStore.Reservation
    ) async throws -> (tokens: TokenSet, saved: Result<Void, StoreError>) {
        let updated: TokenSet
        do {
            if let key {
                updated = try checkAudience(response, previous: previous, key: key)
            } else {
                updated = try await check(response, previous: previous)
            }
        } catch let error as AuthError {
            // The old refresh token was spent by this answer: never send it again.
            var dead = previous
            dead.refreshToken = nil
            record(dead, failure: error, into: reservation)
            throw error
        }
        do {
            try reservation.commit(updated)
        } catch let error as StoreError {
            cached = updated
            return (updated, .failure(error))
        }
        remember(updated)
        return (updated, .success(()))
    }

    /// The tokens a refresh answer makes of `previous`, or why they cannot be used.
    private func check(_ response: TokenResponse, previous: TokenSet) async throws -> TokenSet {
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
            updated.idTokenSince = nil
        } else {
            updated.idTokenSince = previous.idTokenGeneration
        }
        updated.dpopThumbprint = type == "DPoP" ? previous.dpopThumbprint : nil
        updated.accessGeneration = nil
        updated.generation = previous.generation + 1
        updated.lastRefresh = TokenSet.RefreshRecord(at: now, outcome: "ok")
        return updated
    }

    /// The tokens a refresh for `key`'s audience makes of `previous`: the key's own token is added; the
    /// provider's access token and ID token stay as they were (their generations too), and a rotated refresh
    /// token replaces the old one.
    private func checkAudience(_ response: TokenResponse, previous: TokenSet, key: TokenKey) throws -> TokenSet {
        guard let type = TokenEndpoint.normalizedType(response.tokenType) else {
            throw AuthError.configuration(
                reason: "the provider issued an unsupported token type \(AuthText.clip(response.tokenType, 20))")
        }
        let now = clock()
        var updated = previous
        updated.accessGeneration = previous.accessGeneration ?? previous.generation
        updated.idTokenSince = previous.idTokenGeneration
        updated.generation = previous.generation + 1
        updated.refreshToken = response.refreshToken ?? previous.refreshToken
        updated.audienceTokens[key.id] = TokenSet.AudienceToken(
            accessToken: response.accessToken, tokenType: type, issuedAt: now,
            expiresAt: response.expiresIn.map { now + Int64($0) },
            scope: response.scope ?? key.scopes?.joined(separator: " "),
            generation: updated.generation, dpopThumbprint: type == "DPoP" ? previous.dpopThumbprint : nil)
        updated.lastRefresh = TokenSet.RefreshRecord(at: now, outcome: "ok")
        return updated
    }

    // MARK: - Machine grants

    /// Runs the provider's grant (client credentials, token exchange) for `key` under the provider's lock and
    /// stores the token: no person, no refresh token; a new token is a new grant. Resending a grant request is
    /// harmless (nothing is rotated), so it follows the usual retry rules.
    private func grantUnderLock(_ key: TokenKey, replacing generation: Int64) async throws -> TokenSet {
        let lock = try await store.lock(provider.name)
        defer { lock.release() }
        store.removeStaleTemporaries(provider.name)
        var onDisk = try store.load(provider.name)
        if let stored = onDisk, stored.issuer != provider.issuer || stored.clientID != provider.clientID {
            onDisk = nil
        }
        if let stored = onDisk {
            remember(stored)
            if let view = stored.view(for: key), view.generation > generation, view.isUsable(at: clock()) {
                return view
            }
        }
        var parameters: [(String, String)]
        let scopes = key.scopes ?? provider.scopes.filter { $0 != "openid" }
        let resources = key.resource.map { [$0] } ?? provider.resources
        switch provider.grant {
        case .clientCredentials:
            parameters = [("grant_type", "client_credentials"), ("client_id", provider.clientID)]
        case .tokenExchange:
            let subject = try await SubjectToken.read(provider, timeout: provider.tokenTimeout)
            parameters = [
                ("grant_type", "urn:ietf:params:oauth:grant-type:token-exchange"), ("client_id", provider.clientID),
                ("subject_token", subject), ("subject_token_type", provider.subjectTokenType),
                ("requested_token_type", "urn:ietf:params:oauth:token-type:access_token"),
            ]
            if let audience = provider.audience { parameters.append(("audience", audience)) }
        case .authorizationCode:
            throw AuthError.configuration(reason: "[provider \(provider.name)] signs in with proxyctl login")
        }
        for resource in resources { parameters.append(("resource", resource)) }
        if !scopes.isEmpty { parameters.append(("scope", scopes.joined(separator: " "))) }
        refreshCount += 1
        let outcome = try await client.postToken(parameters, resendable: true)
        let response: TokenResponse
        switch outcome {
        case .success(let answer): response = answer
        case .failure(let failure): throw classifyGrantFailure(failure)
        }
        guard let type = TokenEndpoint.normalizedType(response.tokenType) else {
            throw AuthError.configuration(
                reason: "the provider issued an unsupported token type \(AuthText.clip(response.tokenType, 20))")
        }
        let now = clock()
        var updated =
            onDisk
            ?? TokenSet(
                provider: provider.name, issuer: provider.issuer, clientID: provider.clientID, accessToken: "",
                tokenType: "Bearer", issuedAt: now, expiresAt: now, refreshToken: nil, idToken: nil, scope: nil,
                identity: nil, generation: 0)
        let bound = type == "DPoP" ? await client.dpopKey?.thumbprint : nil
        if key.isProviderDefault {
            updated.accessToken = response.accessToken
            updated.tokenType = type
            updated.issuedAt = now
            updated.expiresAt = response.expiresIn.map { now + Int64($0) }
            updated.scope = response.scope ?? (scopes.isEmpty ? nil : scopes.joined(separator: " "))
            updated.dpopThumbprint = bound
            updated.accessGeneration = nil
            updated.generation += 1
        } else {
            updated.accessGeneration = updated.accessGeneration ?? updated.generation
            updated.generation += 1
            updated.audienceTokens[key.id] = TokenSet.AudienceToken(
                accessToken: response.accessToken, tokenType: type, issuedAt: now,
                expiresAt: response.expiresIn.map { now + Int64($0) },
                scope: response.scope ?? (scopes.isEmpty ? nil : scopes.joined(separator: " ")),
                generation: updated.generation, dpopThumbprint: bound)
        }
        updated.lastRefresh = TokenSet.RefreshRecord(at: now, outcome: "ok")
        do {
            try store.save(updated)
            remember(updated)
        } catch {
            // Nothing is lost when this cannot be written: the next grant makes a new token.
            cached = updated
        }
        guard let view = updated.view(for: key) else {
            throw AuthError.rejected(reason: "the provider's answer held no token for \(key)")
        }
        return view
    }

    /// What a failed machine grant means for the user: there is nobody to sign in, so the fix is the
    /// registration, the key or secret, or the subject token.
    func classifyGrantFailure(_ failure: TokenEndpointError) -> AuthError {
        let what = provider.grant == .tokenExchange ? "token exchange" : "client credentials grant"
        switch failure {
        case .oauth(let error, let status, _):
            switch error.error {
            case "invalid_grant", "invalid_token", "http_400":
                if provider.grant == .tokenExchange {
                    let source = provider.subjectTokenFile ?? provider.subjectTokenCommand?.first ?? "-"
                    return .reauthenticate(
                        reason:
                            "the provider refused the subject token from \(source) (\(error.summary)); it may have expired or not be trusted for this client"
                    )
                }
                return .configuration(
                    reason: "the provider refused the \(what) for client \(provider.clientID) (\(error.summary))")
            case "invalid_client", "unauthorized_client", "unsupported_grant_type", "http_401", "http_403",
                "invalid_scope", "invalid_target":
                return .configuration(
                    reason:
                        "the provider refused the \(what) for client \(provider.clientID) (\(error.summary), HTTP \(status)); check its registration, the client key or secret, and the scopes and resource asked for"
                        + provider.clientRefusalHint(error.error)
                )
            default:
                return .recoverable(reason: "the provider refused the \(what) (\(error.summary))", retryAfter: nil)
            }
        case .unavailable(let status, let retryAfter):
            return .recoverable(reason: "the provider is unavailable (HTTP \(status))", retryAfter: retryAfter)
        case .malformed(let reason), .unanswered(let reason):
            return .recoverable(reason: reason, retryAfter: nil)
        }
    }

    /// Records a failed refresh in the token file. The failure matters more than its record: when the write
    /// fails, the record is kept in memory only.
    private func record(_ tokens: TokenSet, failure: AuthError, into reservation: TokenStore.Reservation) {
        var updated = tokens
        updated.lastRefresh = TokenSet.RefreshRecord(
            at: clock(), outcome: failure.category, reason: failure.description)
        if (try? reservation.commit(updated)) != nil {
            remember(updated)
        } else {
            cached = updated
        }
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
                // glewlwyd answers a bad or reused refresh token with an empty 400: no code, but the same meaning.
                let why =
                    error.error.hasPrefix("http_")
                    ? "HTTP \(status) without an error code: it has expired, was revoked, or was used already"
                    : error.summary
                return .reauthenticate(
                    reason:
                        "the provider refused the refresh token (\(why)); sign in again: proxyctl login \(provider.name)"
                )
            case "invalid_client", "unauthorized_client", "unsupported_grant_type", "http_403":
                return .configuration(
                    reason:
                        "the provider refused the refresh for client \(provider.clientID) (\(error.summary), HTTP \(status)); check its registration"
                        + provider.clientRefusalHint(error.error)
                )
            case "invalid_scope":
                return .reauthenticate(
                    reason: "the provider refused the scopes on refresh (\(error.summary)); sign in again")
            case "invalid_target":
                // RFC 8707 §2: the resource is unknown to the provider or not covered by the grant.
                return .configuration(
                    reason:
                        "the provider refused the resource asked for (\(error.summary)); check resource in the [origin] section, that the provider knows it, and that its refresh tokens keep every resource of the sign-in (a host under a wildcard origin is asked for by the next proxyctl login \(provider.name), once a request met it)"
                )
            default:
                return .recoverable(reason: "the provider refused the refresh (\(error.summary))", retryAfter: nil)
            }
        case .unavailable(let status, let retryAfter):
            return .recoverable(reason: "the provider is unavailable (HTTP \(status))", retryAfter: retryAfter)
        case .malformed(let reason):
            return .recoverable(reason: reason, retryAfter: nil)
        case .unanswered(let reason):
            // The provider may have rotated the refresh token without our seeing the new one; sending the
            // old one again would then look like a stolen token being replayed (RFC 9700 §4.14.2).
            return .reauthenticate(
                reason:
                    "the provider took the refresh request and gave no answer (\(reason)); it may have replaced the refresh token, so the old one is not sent again; run: proxyctl login \(provider.name)"
            )
        }
    }

    func setClock(_ clock: @escaping @Sendable () -> Int64) { self.clock = clock }
}

/// `task`'s value, or nil when `deadline` comes first; the task goes on either way.
private func value<T: Sendable>(
    of task: Task<T, any Error>, before deadline: ContinuousClock.Instant
) async throws -> T? {
    let first = FirstOutcome<T?>()
    return try await withCheckedThrowingContinuation { continuation in
        first.wait(continuation)
        let timer = Task {
            // Cancelled when the task ended first: then the deadline must not answer in its stead.
            guard (try? await Task.sleep(until: deadline, clock: .continuous)) != nil else { return }
            first.resume(with: .success(nil))
        }
        Task {
            let result = await task.result
            first.resume(with: result.map { $0 })
            timer.cancel()
        }
    }
}

/// Resumes a continuation with whichever outcome comes first.
private final class FirstOutcome<T: Sendable>: Sendable {
    private let continuation = Mutex<CheckedContinuation<T, any Error>?>(nil)

    func wait(_ waiting: CheckedContinuation<T, any Error>) {
        continuation.withLock { $0 = waiting }
    }

    func resume(with outcome: Result<T, any Error>) {
        continuation.withLock { $0.take() }?.resume(with: outcome)
    }
}

extension ProviderConfig {
    /// "; " and the client assertion's audience hint when the token endpoint refused the client itself
    /// (`invalid_client`, RFC 6749 §5.2; or a 401 or 403 without an error code, glewlwyd's answer to an
    /// assertion it does not accept) and the assertion named the issuer; "" otherwise.
    func clientRefusalHint(_ code: String) -> String {
        guard ["invalid_client", "http_401", "http_403"].contains(code), let hint = assertionAudienceHint else {
            return ""
        }
        return "; " + hint
    }
}
