/// What the proxy does with a request head: the whole decision, made without any I/O.
public enum FrontDoorDecision: Sendable, Equatable {
    /// Answer the client directly and (when the answer's response closes) close the connection.
    case respond(ProxyAnswer)
    /// Open a blind tunnel to `target`, through `upstream` when set.
    case tunnel(target: HostPort, upstream: UpstreamProxy?)
    /// Forward the request: connect to `target` (or `upstream`) and send `head`, then the body.
    case forward(Forward)
    /// CONNECT to a protected origin: terminate TLS with the local CA and handle each request.
    case interceptTunnel(OriginConfig)
    /// An absolute-form request to a protected `http://` origin (loopback only): handle it with the token.
    case interceptRequest(OriginConfig, InterceptedRequest)

    public struct Forward: Sendable, Equatable {
        public let url: AbsoluteURL
        public let upstream: UpstreamProxy?
        /// The head to send, with hop-by-hop fields removed and the target in the form the next hop needs.
        public let head: [UInt8]
        public let framing: BodyFraming
        public let keepAlive: Bool
        public let upgrade: Bool
        public let method: String
    }
}

extension FrontDoorDecision {
    /// What a request with this decision counts as in the metrics.
    public var outcomeKind: RequestOutcome.Kind {
        switch self {
        case .respond: .proxy
        case .tunnel, .interceptTunnel: .connect
        case .forward: .passthrough
        case .interceptRequest: .intercepted
        }
    }
}

/// The front door of the proxy: turns a request head into a decision.
public struct FrontDoor: Sendable {
    public var settings: ProxySettings
    /// Who may use the proxy; nil means anyone who can reach the listener (loopback only).
    public var credentials: ProxyCredentials?
    /// The address the listener actually bound (the port may have been 0 in the settings).
    public var boundAddress: ListenAddress
    /// The protected origins: the only traffic that is intercepted.
    public var origins: OriginTable
    /// Where the system cannot name the user of a client's socket (docs/porting.md: macOS, or
    /// `PROXYCTL_PORTABLE=1`), the secret that stands for "a process of the user running proxyctl": only that
    /// user can read it (a 0600 file in the state directory), and `proxyctl env` and `exec` put it in the proxy URL
    /// they hand to that user's tools. A request from an unidentified peer that carries it (`Proxy-Authorization:
    /// Basic`) is the owner's; one without it gets 407 where `protected_users` or `passthrough_users` keep
    /// something for the owner. Nil where the kernel says who the peer is.
    public var ownerCredential: ProxyCredentials?

    public init(
        settings: ProxySettings, credentials: ProxyCredentials?, boundAddress: ListenAddress,
        origins: OriginTable = OriginTable(), ownerCredential: ProxyCredentials? = nil
    ) {
        self.settings = settings
        self.credentials = credentials
        self.boundAddress = boundAddress
        self.origins = origins
        self.ownerCredential = ownerCredential
    }

    /// - Parameter peer: who is on the other end, for `protected_users` and `passthrough_users`.
    public func decide(_ head: HTTPHead, peer: PeerIdentity = .owner) -> FrontDoorDecision {
        let semantics: RequestSemantics
        switch MessageSemantics.request(head) {
        case .failure(let error): return .respond(.badRequest(error))
        case .success(let checked): semantics = checked
        }
        // The owner credential names the peer the kernel could not; what it says otherwise (missing, wrong) is
        // for the answer below.
        var peer = peer
        var ownerCheck: ProxyCredentials.Check? = nil
        if peer == .unknown, let ownerCredential {
            let check = ownerCredential.check(semantics.proxyAuthorization.map { head.value(at: $0) })
            if case .allowed = check { peer = .owner } else { ownerCheck = check }
        }
        let decision = route(head, semantics, peer: peer)
        // Local users: the tokens are the proxy's user's; loopback is no access control on a shared machine.
        let authenticated = credentials != nil
        let protected: Bool
        switch decision {
        case .interceptTunnel, .interceptRequest:
            if peer.admitted(by: settings.protectedUsers, authenticated: authenticated) { return decision }
            protected = true
        case .tunnel, .forward:
            if peer.admitted(by: settings.passthroughUsers, authenticated: authenticated) { return decision }
            protected = false
        case .respond:
            return decision
        }
        if let ownerCheck {
            return .respond(
                .ownerCredentialRequired(
                    credentialSent: ownerCheck == .invalid, protected: protected,
                    close: semantics.framing != .none || !semantics.keepAlive))
        }
        return .respond(.notForThisUser(peer, protected: protected))
    }

    private func route(_ head: HTTPHead, _ semantics: RequestSemantics, peer: PeerIdentity) -> FrontDoorDecision {
        // `proxyctl exec`'s own proxy: the run's credential, or a process of the user who started it (Java
        // cannot send proxy credentials for HTTPS without code of its own).
        if let credentials, !(settings.ownerNeedsNoCredentials && peer == .owner) {
            let value = semantics.proxyAuthorization.map { head.value(at: $0) }
            switch credentials.check(value) {
            case .allowed: break
            case .missing, .invalid:
                // The body of the request (if any) was not read: the framing is unknown here.
                return .respond(
                    .proxyAuthenticationRequired(
                        credentialsSent: value != nil, close: semantics.framing != .none || !semantics.keepAlive))
            }
        }

        switch semantics.target {
        case .notProxyRequest:
            return .respond(
                .notProxyRequest(
                    listen: boundAddress.description, close: semantics.framing != .none || !semantics.keepAlive))
        case .connect(let target):
            if isLoop(target) { return .respond(.loopDetected(target)) }
            if let origin = origins.match(scheme: "https", authority: target) { return .interceptTunnel(origin) }
            return .tunnel(target: target, upstream: upstream(for: target))
        case .absolute(let url):
            guard url.scheme == "http" else {
                return .respond(.httpsURLInPlainRequest(close: semantics.framing != .none || !semantics.keepAlive))
            }
            if isLoop(url.authority) { return .respond(.loopDetected(url.authority)) }
            if let origin = origins.match(scheme: "http", authority: url.authority) {
                switch MessageSemantics.interceptedRequest(head, for: origin) {
                case .failure(let refusal): return .respond(refusal.answer)
                case .success(let request): return .interceptRequest(origin, request)
                }
            }
            let upstream = upstream(for: url.authority)
            var extra: [(name: String, value: String)] = []
            if let replacement = semantics.replacementHost { extra.append(("Host", replacement)) }
            if semantics.upgrade { extra.append(("Connection", "upgrade")) }
            if let authorization = upstream?.authorization { extra.append(("Proxy-Authorization", authorization)) }
            // Direct: origin-form (RFC 9112 §3.2.1). Through another proxy: absolute-form, as received.
            let target = upstream == nil ? url.pathAndQuery : head.target
            let outgoing = head.serialized(
                requestLine: (head.method, target, head.version),
                drop: { semantics.dropped.contains($0) },
                extra: extra
            )
            return .forward(
                FrontDoorDecision.Forward(
                    url: url,
                    upstream: upstream,
                    head: outgoing,
                    framing: semantics.framing,
                    keepAlive: semantics.keepAlive,
                    upgrade: semantics.upgrade,
                    method: head.method
                ))
        }
    }

    /// The settings of an exchange with `origin`, from this snapshot.
    public func exchangeSettings(for origin: OriginConfig) -> ProtectedExchange.Settings {
        ProtectedExchange.Settings(
            replaySpool: max(settings.replaySpool, settings.replayMemory), connectTimeout: settings.connectTimeout,
            idleTimeout: settings.idleTimeout, responseHeadLimits: settings.headLimits,
            upstreamProxy: upstream(for: origin.authority))
    }

    public func upstream(for target: HostPort) -> UpstreamProxy? {
        guard let proxy = settings.upstreamProxy, !settings.noUpstreamProxy.matches(target) else { return nil }
        return proxy
    }

    /// A request whose target is this proxy itself would come back to us forever. IPv4-mapped IPv6 forms
    /// (`[::ffff:127.0.0.1]`, `[::ffff:7f00:1]`) are the IPv4 addresses they map; a name is checked again
    /// once resolved (`ConnectionMachine` compares every address it would connect to).
    public func isLoop(_ target: HostPort) -> Bool {
        guard target.port == boundAddress.port else { return false }
        let listenAddress = IPAddress.parse(boundAddress.host)?.unmapped
        let targetAddress = IPAddress.parse(target.host)?.unmapped
        if let targetAddress, targetAddress == listenAddress { return true }
        // Connecting to 0.0.0.0 or :: reaches this machine on Linux.
        if targetAddress == .v4(0) || targetAddress == .v6(0, 0) { return true }
        let listensEverywhere = listenAddress == .v4(0) || listenAddress == .v6(0, 0)
        if target.host == "localhost" { return listensEverywhere || (listenAddress?.isLoopback ?? false) }
        // Listening on every address: any loopback address of this machine reaches us.
        return listensEverywhere && (targetAddress?.isLoopback ?? false)
    }
}
