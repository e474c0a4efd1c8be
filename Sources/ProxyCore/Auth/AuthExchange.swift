/// Why no token could be attached, as the exchange needs to know it.
public enum TokenFailure: Error, Sendable, Equatable {
    /// No tokens, or the provider rejected the refresh token: the user must run `proxyctl login`.
    case signInNeeded(reason: String)
    /// The provider is unreachable or overloaded; retry after `retryAfter` seconds.
    case unavailable(reason: String, retryAfter: Int?)
    /// A refresh is at the provider and has not been answered yet; it goes on, and the refresh token is not
    /// sent again meanwhile. Retry after `retryAfter` seconds.
    case pending(reason: String, retryAfter: Int)
    /// proxyctl cannot keep tokens in its state directory (a full disk, permissions): nothing to do with the
    /// provider, and nothing a retry fixes until the user does.
    case storage(reason: String)
    /// proxy.conf or the provider's registration is wrong.
    case configuration(reason: String)
}

/// The per-request authentication exchange with a protected origin: attach the token, classify the
/// response, refresh once and replay once on a 401, retry once on a DPoP nonce challenge, surface step-up
/// challenges, never loop.
///
/// Pure: events in, actions out. The I/O layer sends what `.send` says and reports what came back. Every
/// reachable sequence is covered by `AuthExchangeTests`.
public struct AuthExchange: Sendable {
    public enum Event: Sendable, Equatable {
        /// Usable tokens are available (from the store or a proactive refresh).
        case tokens(generation: Int64)
        case tokensFailed(TokenFailure)
        /// The origin answered. `challenges` come from every `WWW-Authenticate` line (`ChallengeParser`);
        /// `dpopNonce` from the `DPoP-Nonce` field.
        case response(status: Int, challenges: [Challenge], dpopNonce: String?)
        /// The refresh after a 401 succeeded with tokens of `generation`.
        case refreshed(generation: Int64)
        case refreshFailed(TokenFailure)
        /// What the origin's protected resource metadata (named by its 401) says of the provider, after
        /// `.checkResourceMetadata`.
        case resourceMetadata(ResourceMetadataVerdict)
    }

    public enum Action: Sendable, Equatable {
        /// Get usable tokens for the provider (refreshing proactively when they are stale).
        case getTokens
        /// Send the request with the tokens of `generation`; with DPoP, a fresh proof carrying `nonce`.
        case send(generation: Int64, nonce: String?)
        /// Refresh because the tokens of `replacing` were rejected (single-flight; may reuse newer tokens).
        case refresh(replacing: Int64)
        /// Pass the origin's response to the client, with `proxyStatus` added when set.
        case deliver(proxyStatus: ProxyStatus?)
        /// Answer the client ourselves; the origin is not contacted (again).
        case respond(ProxyAnswer)
        /// The 401 names its protected resource metadata (RFC 9728 §5.1) on the origin's own origin: learn
        /// whether it names the configured provider's issuer before refreshing (a token of another authorization
        /// server never becomes one the origin accepts).
        case checkResourceMetadata(url: String)
    }

    /// Where the exchange is.
    enum State: Sendable, Equatable {
        /// Nothing done yet. -> `.waitingForTokens`
        case idle
        /// `.getTokens` issued. -> `.waitingForResponse` or `.done`
        case waitingForTokens
        /// `.send` issued. -> `.done`, `.waitingForResponse` (nonce retry), `.refreshing`
        case waitingForResponse
        /// `.refresh` issued after a 401. -> `.waitingForResponse` (replay) or `.done`
        case refreshing
        /// `.checkResourceMetadata` issued after a 401. -> `.refreshing` or `.done`
        case checkingMetadata
        /// A final action was issued; further events are programming errors.
        case done
    }

    public let origin: String
    public let provider: String
    /// The request body is kept, so the request can be sent again (false once it outgrew the store).
    public private(set) var replayable: Bool
    private(set) var state = State.idle
    private(set) var nonceRetried = false
    private(set) var refreshed = false
    /// The step-up challenge that was passed on to the client, if any (for recording it).
    public private(set) var stepUp: Challenge?
    private var generation: Int64 = 0
    private var nonce: String?
    /// Whether a 401's `resource_metadata` is looked at (the exchanges whose I/O can fetch it).
    let checksResourceMetadata: Bool
    private(set) var metadataChecked = false
    /// What the origin's metadata said, when it named other authorization servers than the provider's.
    public private(set) var otherServers: [String]?

    /// - Parameter knownNonce: the last DPoP nonce seen from this origin, used on the first proof.
    /// - Parameter checksResourceMetadata: a 401 naming the origin's metadata is checked against the provider
    ///   before a refresh (`.checkResourceMetadata`).
    public init(
        origin: String, provider: String, replayable: Bool, knownNonce: String? = nil,
        checksResourceMetadata: Bool = false
    ) {
        self.origin = origin
        self.provider = provider
        self.replayable = replayable
        self.nonce = knownNonce
        self.checksResourceMetadata = checksResourceMetadata
    }

    /// The request body outgrew what is kept for a replay (it streams on, once): a 401 is then passed on.
    public mutating func bodyNotKept() {
        replayable = false
    }

    /// The origin's latest DPoP nonce as other exchanges saw it (RFC 9449 §9: a nonce is valid for the
    /// origin, not for one request): used by the next proof unless this exchange's own responses bring one.
    public mutating func learnNonce(_ latest: String) {
        nonce = latest
    }

    public mutating func start() -> Action {
        precondition(state == .idle, "start() called twice")
        state = .waitingForTokens
        return .getTokens
    }

    public mutating func handle(_ event: Event) -> Action {
        switch (state, event) {
        case (.waitingForTokens, .tokens(let generation)):
            self.generation = generation
            state = .waitingForResponse
            return .send(generation: generation, nonce: nonce)

        case (.waitingForTokens, .tokensFailed(let failure)), (.refreshing, .refreshFailed(let failure)):
            state = .done
            return .respond(answer(for: failure))

        case (.waitingForResponse, .response(let status, let challenges, let dpopNonce)):
            if let dpopNonce { nonce = dpopNonce }
            // RFC 6750 §3.1: the token lacks a scope the origin names. A refresh gives the same scopes; a sign-in
            // asking for it is what helps, as for a step-up.
            if status == 401 || status == 403,
                let scopeChallenge = challenges.first(where: { $0.insufficientScope != nil }),
                let scopes = scopeChallenge.insufficientScope
            {
                state = .done
                stepUp = scopeChallenge
                return .deliver(
                    proxyStatus: ProxyStatus(
                        details:
                            "the origin needs the scope \(scopes.joined(separator: " ")): run proxyctl step-up \(origin)",
                        receivedStatus: status))
            }
            guard status == 401 else {
                state = .done
                return .deliver(proxyStatus: nil)
            }
            // RFC 9470 §3: a step-up challenge cannot be answered by refreshing; the user must sign in again
            // with a stronger method. Pass it on, say what to run.
            if let stepUp = challenges.first(where: { $0["error"] == "insufficient_user_authentication" }) {
                state = .done
                self.stepUp = stepUp
                var wanted: [String] = []
                if let acr = stepUp["acr_values"] { wanted.append("acr_values \(acr)") }
                if let maxAge = stepUp["max_age"] { wanted.append("max_age \(maxAge)") }
                let detail = wanted.isEmpty ? "" : " (\(wanted.joined(separator: ", ")))"
                return .deliver(
                    proxyStatus: ProxyStatus(
                        details: "step-up required\(detail): run proxyctl step-up \(origin)", receivedStatus: 401))
            }
            // RFC 9449 §9: when the only challenge is DPoP use_dpop_nonce with a nonce, retry once with it.
            let onlyNonceChallenge =
                challenges.count == 1 && challenges[0].scheme == "dpop" && challenges[0]["error"] == "use_dpop_nonce"
            if onlyNonceChallenge && dpopNonce != nil && !nonceRetried {
                nonceRetried = true
                guard replayable else { return deliverUnreplayable(retry: "with the DPoP nonce it asked for") }
                return .send(generation: generation, nonce: nonce)
            }
            if onlyNonceChallenge {
                state = .done
                return .deliver(
                    proxyStatus: ProxyStatus(
                        details: nonceRetried
                            ? "the origin asked for a DPoP nonce again after a retry with one; not retried twice"
                            : "the origin asked for a DPoP nonce without sending one",
                        receivedStatus: 401))
            }
            if refreshed {
                state = .done
                return .deliver(
                    proxyStatus: ProxyStatus(
                        details:
                            "the origin refused a freshly refreshed token; not retried again (check the token's scopes or audience)",
                        receivedStatus: 401))
            }
            if checksResourceMetadata, !metadataChecked, let url = challenges.resourceMetadata,
                MetadataURL.sameOrigin(url, origin)
            {
                metadataChecked = true
                state = .checkingMetadata
                return .checkResourceMetadata(url: url)
            }
            return refreshOrDeliver()

        case (.checkingMetadata, .resourceMetadata(let verdict)):
            if case .otherServers(let servers) = verdict {
                // RFC 9728 §7.3 (and the issue): nothing switches authorization servers by itself; the user is told.
                state = .done
                otherServers = servers
                return .deliver(
                    proxyStatus: ProxyStatus(
                        error: .proxyConfigurationError,
                        details:
                            "the origin's resource metadata names the authorization server \(servers.joined(separator: ", ")), not the issuer of [provider \(provider)]; set it up with: proxyctl init --origin \(origin)",
                        receivedStatus: 401))
            }
            return refreshOrDeliver()

        case (.refreshing, .refreshed(let generation)):
            self.generation = generation
            state = .waitingForResponse
            return .send(generation: generation, nonce: nonce)

        default:
            preconditionFailure("AuthExchange: \(event) in state \(state)")
        }
    }

    /// The 401 that is neither a step-up nor a nonce challenge: refresh once and replay, unless that was done.
    private mutating func refreshOrDeliver() -> Action {
        guard replayable else { return deliverUnreplayable(retry: "after a token refresh") }
        refreshed = true
        state = .refreshing
        return .refresh(replacing: generation)
    }

    private mutating func deliverUnreplayable(retry: String) -> Action {
        state = .done
        return .deliver(
            proxyStatus: ProxyStatus(
                details: "the request body was too large to keep, so the request was not sent again \(retry); retry it",
                receivedStatus: 401))
    }

    /// The proxy's own answer when no token can be attached.
    func answer(for failure: TokenFailure) -> ProxyAnswer {
        switch failure {
        case .signInNeeded(let reason): .signInNeeded(provider: provider, reason: reason)
        case .unavailable(let reason, let retryAfter):
            .providerUnavailable(origin: origin, reason: reason, retryAfter: max(1, retryAfter ?? 5))
        case .pending(let reason, let retryAfter):
            .refreshPending(origin: origin, reason: reason, retryAfter: max(1, retryAfter))
        case .storage(let reason): .tokenStorageFailed(origin: origin, reason: reason)
        case .configuration(let reason): .providerMisconfigured(origin: origin, provider: provider, reason: reason)
        }
    }
}
