/// Protocol upgrades (WebSocket, RFC 6455) to protected origins, on either way in (inside an intercepted TLS
/// tunnel, or a plain request to a protected `http://` origin).
///
/// An upgrade is a forwarded exchange on a connection of the proxy's own (the driver's upstream bufferevent,
/// not yet the own client's `OriginConnection`): the token rides on the upgrade request, the origin's answer goes through `AuthExchange`
/// like any other (a 401 is refreshed once and replayed once on a new connection, a DPoP nonce challenge
/// retried once, a step-up challenge passed on with Proxy-Status, a 401 naming the origin's resource metadata
/// checked against the provider first, as a plain request's is), and after `101 Switching Protocols` both
/// sides become a tunnel. An https origin gets TLS from the proxy (`.startUpstreamTLS`), through the upstream
/// proxy's CONNECT when one applies.
extension ConnectionMachine {
    struct ProtectedUpgrade: Sendable {
        let origin: OriginConfig
        /// The request as it goes upstream, without credentials (the I/O layer adds them).
        let forward: FrontDoorDecision.Forward
        let target: String
        /// Deciding the token's fate; nil when the client's own Authorization travels instead.
        var auth: AuthExchange?
        var credential: UpstreamRequest.Credential?
        /// The tokens last granted are bound to a key (they go with a DPoP proof).
        var boundToKey = false
        let proxy: UpstreamProxy?
        /// The origin's 401 while its resource metadata is checked (`.checkResourceMetadata`): the client's
        /// answer, without its body, when the metadata names another authorization server.
        var held: HTTPHead? = nil
        var attempts = 0
        let started: Int64

        var tls: Bool { origin.scheme == "https" }
    }

    mutating func beginProtectedUpgrade(
        _ request: InterceptedRequest, origin: OriginConfig, kept: HostPort?, head: HTTPHead, _ out: inout [Action]
    ) {
        if kept != nil {
            out.append(.disarm(.upstreamKeepAlive))
            out.append(.closeUpstream)
        }
        guard request.framing == .none else {
            return refuse(
                head, origin: origin, .unsupported(reason: "an upgrade request with a body is not supported"), &out)
        }
        guard case .success(let url) = AbsoluteURL.parse(origin.url + request.target) else {
            return refuse(
                head, origin: origin,
                .badRequest(HTTPParseError(.malformed, "the request target does not make a URL with the origin")),
                &out)
        }
        var bytes = Array("\(request.method) \(request.target) HTTP/1.1\r\nHost: \(url.hostFieldValue)\r\n".utf8)
        for (name, value) in request.upstreamFields {
            bytes += Array(name.utf8) + [ASCII.colon, ASCII.space] + value + [ASCII.cr, ASCII.lf]
        }
        // Upgrade and Connection are hop-by-hop: the proxy asks the origin for the same protocols itself.
        var protocols: [UInt8] = []
        for index in head.indices(named: "upgrade") {
            if !protocols.isEmpty { protocols += Array(", ".utf8) }
            protocols += head.valueBytes(at: index)
        }
        bytes += Array("Connection: Upgrade\r\nUpgrade: ".utf8) + protocols + [ASCII.cr, ASCII.lf, ASCII.cr, ASCII.lf]
        let forward = FrontDoorDecision.Forward(
            url: url, upstream: nil, head: bytes, framing: .none, keepAlive: false, upgrade: true,
            method: request.method)
        var upgrade = ProtectedUpgrade(
            origin: origin, forward: forward, target: request.target, auth: nil, credential: nil,
            proxy: frontDoor.upstream(for: origin.authority), started: now)
        out.append(.readClient(false))
        guard origin.attachesToken(clientHasAuthorization: request.clientAuthorization) else {
            return connectUpgrade(upgrade, &out)
        }
        var auth = AuthExchange(
            origin: origin.url, provider: origin.credentialName, replayable: true,
            // As for a plain request (`ProtectedExchange`): a static secret has no authorization server for the
            // metadata to contradict.
            checksResourceMetadata: origin.secret == nil)
        let first = auth.start()
        upgrade.auth = auth
        performUpgrade(first, upgrade, &out)
    }

    /// Carries out what `AuthExchange` decided for the upgrade.
    private mutating func performUpgrade(
        _ action: AuthExchange.Action, _ upgrade: ProtectedUpgrade, _ out: inout [Action]
    ) {
        var upgrade = upgrade
        let origin = upgrade.origin
        switch action {
        case .getTokens:
            state = .awaitingUpgradeTokens(upgrade)
            out.append(.exchange(.getTokens(key: origin.tokenKey), origin))
        case .refresh(let replacing):
            state = .awaitingUpgradeTokens(upgrade)
            out.append(.exchange(.refreshTokens(key: origin.tokenKey, replacing: replacing), origin))
        case .send(let generation, let nonce):
            upgrade.credential = UpstreamRequest.Credential(
                generation: generation, dpopNonce: nonce, boundToKey: upgrade.boundToKey,
                headers: origin.credentialHeaders)
            connectUpgrade(upgrade, &out)
        case .respond(let answer):
            if case .signInNeeded(_, let reason) = answer {
                out.append(.exchange(.signInNeeded(reason: reason), origin))
            }
            answerUpgrade(upgrade, answer, &out)
        case .deliver:
            preconditionFailure("ConnectionMachine: an upgrade delivery without a response")
        case .checkResourceMetadata:
            // Only the origin's answer leads to a check, and `upgradeResponse` handles that.
            preconditionFailure("ConnectionMachine: an upgrade's metadata check without a response")
        }
    }

    /// The answer to the upgrade's `.checkResourceMetadata`: another authorization server ends the upgrade with
    /// the origin's 401 (its head; the body went with the connection) and Proxy-Status naming the mismatch, and
    /// the user is told which `proxyctl init --origin` to run; otherwise the usual refresh and replay.
    mutating func upgradeMetadata(_ verdict: ResourceMetadataVerdict, _ out: inout [Action]) {
        guard case .awaitingUpgradeTokens(var upgrade) = state, let held = upgrade.held, var auth = upgrade.auth
        else { return }
        upgrade.held = nil
        let action = auth.handle(.resourceMetadata(verdict))
        upgrade.auth = auth
        guard case .deliver(let proxyStatus) = action else { return performUpgrade(action, upgrade, &out) }
        let origin = upgrade.origin
        if let servers = auth.otherServers { out.append(.exchange(.wrongAuthorizationServer(servers), origin)) }
        let status = proxyStatus ?? ProxyStatus(receivedStatus: held.status)
        let framing = Set(held.indices(named: "content-length") + held.indices(named: "transfer-encoding"))
        let hopByHop = Set(held.indices(named: "connection") + held.indices(named: "keep-alive"))
        let response = held.serialized(
            drop: { framing.contains($0) || hopByHop.contains($0) },
            extra: [("Content-Length", "0"), ("Connection", "close"), ("Proxy-Status", status.fieldValue)])
        out.append(.writeClient(response))
        out.append(.exchangeFinished(upgradeRecord(upgrade, status: held.status, note: status.details)))
        closeAfterFlush(&out)
    }

    /// The answer to the tokens (or the refresh) the upgrade waits for.
    mutating func upgradeTokens(_ result: Result<TokenGrant, TokenFailure>, refreshed: Bool, _ out: inout [Action]) {
        // While the metadata is checked nothing was asked of the tokens: an answer then is not this upgrade's.
        guard case .awaitingUpgradeTokens(var upgrade) = state, upgrade.held == nil, var auth = upgrade.auth else {
            return
        }
        let event: AuthExchange.Event
        switch result {
        case .success(let grant):
            if let nonce = grant.dpopNonce { auth.learnNonce(nonce) }
            upgrade.boundToKey = grant.boundToKey
            event = refreshed ? .refreshed(generation: grant.generation) : .tokens(generation: grant.generation)
        case .failure(let failure):
            event = refreshed ? .refreshFailed(failure) : .tokensFailed(failure)
        }
        let action = auth.handle(event)
        upgrade.auth = auth
        performUpgrade(action, upgrade, &out)
    }

    private mutating func connectUpgrade(_ upgrade: ProtectedUpgrade, _ out: inout [Action]) {
        var upgrade = upgrade
        upgrade.attempts += 1
        startConnect(.protectedUpgrade(upgrade), hop: upgrade.proxy?.address ?? upgrade.origin.authority, &out)
    }

    /// Connected to the origin (or through the upstream proxy's CONNECT to it).
    mutating func upgradeConnected(_ upgrade: ProtectedUpgrade, _ out: inout [Action]) {
        guard upgrade.tls else { return sendUpgrade(upgrade, &out) }
        state = .upstreamTLS(upgrade)
        out.append(.startUpstreamTLS(serverName: upgrade.origin.authority.host, caFile: upgrade.origin.caFile))
        out.append(.arm(.connect, milliseconds: settings.connectTimeout))
    }

    mutating func upstreamTLSEstablished(_ out: inout [Action]) {
        guard case .upstreamTLS(let upgrade) = state else { return }
        out.append(.disarm(.connect))
        sendUpgrade(upgrade, &out)
    }

    mutating func upstreamTLSFailed(_ failure: UpstreamFailure, detail: String, _ out: inout [Action]) {
        guard case .upstreamTLS(let upgrade) = state else { return }
        out.append(.disarm(.connect))
        out.append(.closeUpstream)
        state = .awaitingUpgradeTokens(upgrade)
        answerUpgrade(
            upgrade,
            .upstreamFailed(
                failure, hop: upgrade.origin.authority, detail: detail, origin: OriginTrust(upgrade.origin)), &out)
    }

    private mutating func sendUpgrade(_ upgrade: ProtectedUpgrade, _ out: inout [Action]) {
        beginForwarding(
            upgrade.forward, hop: upgrade.origin.authority, reused: false, retried: false, protected: upgrade, &out)
    }

    /// The credential could not be attached to the upgrade request (no DPoP key, no proof).
    mutating func upgradeCredentialFailed(_ answer: ProxyAnswer, _ out: inout [Action]) {
        guard case .forwarding(let forwarding) = state, let upgrade = forwarding.protected,
            !forwarding.clientSawResponse
        else { return }
        out.append(.closeUpstream)
        out.append(.disarm(.idle))
        state = .awaitingUpgradeTokens(upgrade)
        answerUpgrade(upgrade, answer, &out)
    }

    /// The origin's final (or 101) answer to an upgrade request with a token: false when it is not the
    /// client's (the request goes again with a fresh token or nonce, or the proxy answers instead).
    mutating func upgradeResponse(
        _ head: HTTPHead, _ forwarding: inout Forwarding, _ out: inout [Action]
    ) -> (
        deliver: Bool, proxyStatus: ProxyStatus?
    ) {
        guard var upgrade = forwarding.protected else { return (true, nil) }
        let origin = upgrade.origin
        let nonce = head.values(named: "dpop-nonce").last
        if let nonce { out.append(.exchange(.rememberNonce(nonce), origin)) }
        guard var auth = upgrade.auth else { return (true, nil) }
        let challenges = ChallengeParser.parse(head.values(named: "www-authenticate"))
        let action = auth.handle(.response(status: head.status, challenges: challenges, dpopNonce: nonce))
        upgrade.auth = auth
        forwarding.protected = upgrade
        switch action {
        case .deliver(let proxyStatus):
            if let challenge = auth.stepUp { out.append(.exchange(.recordStepUp(challenge), origin)) }
            return (true, proxyStatus)
        case .checkResourceMetadata(let url):
            // The 401 is the client's if the metadata names another server: its head is kept meanwhile; the
            // connection (and the body) goes, as for a refresh.
            out.append(.closeUpstream)
            out.append(.disarm(.idle))
            upgrade.held = head
            state = .awaitingUpgradeTokens(upgrade)
            out.append(.exchange(.checkResourceMetadata(url: url), origin))
            return (false, nil)
        case .send, .refresh, .respond, .getTokens:
            // This connection's answer is not the client's: it goes, and the upgrade goes on without it.
            out.append(.closeUpstream)
            out.append(.disarm(.idle))
            state = .awaitingUpgradeTokens(upgrade)
            performUpgrade(action, upgrade, &out)
            return (false, nil)
        }
    }

    /// The proxy answers the upgrade itself (no token, the origin could not be reached over TLS).
    private mutating func answerUpgrade(_ upgrade: ProtectedUpgrade, _ answer: ProxyAnswer, _ out: inout [Action]) {
        let response = answer.response
        out.append(.writeClient(response.serialized(headRequest: false)))
        out.append(
            .exchangeFinished(
                upgradeRecord(
                    upgrade, status: answer.status, note: response.proxyStatus?.details, answeredByProxy: true,
                    proxyError: response.proxyStatus?.error?.rawValue)))
        closeAfterFlush(&out)
    }

    func upgradeRecord(
        _ upgrade: ProtectedUpgrade, status: Int, note: String?, answeredByProxy: Bool = false,
        proxyError: String? = nil
    ) -> ExchangeRecord {
        ExchangeRecord(
            method: upgrade.forward.method, origin: upgrade.origin.url, provider: upgrade.origin.credentialName,
            target: upgrade.target, status: status, attempts: upgrade.attempts,
            keptClientAuthorization: upgrade.auth == nil, attached: upgrade.credential != nil,
            refreshed: upgrade.auth?.refreshed ?? false, nonceRetried: upgrade.auth?.nonceRetried ?? false,
            stepUp: upgrade.auth?.stepUp != nil, answeredByProxy: answeredByProxy, note: note, close: true,
            proxyError: proxyError)
    }
}
