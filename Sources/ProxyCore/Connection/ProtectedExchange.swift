/// One request to a protected origin, whatever protocol the client spoke (an HTTP/1.1 request on an
/// intercepted connection or on the front door, later an HTTP/2 stream): keep the body for replay, attach
/// the token through `AuthExchange` (refresh once and replay once on a 401, one DPoP nonce retry, step-up
/// passed on), send the request upstream, check the response head, and deliver it or answer ourselves.
///
/// Pure: events in, outputs out. The I/O layer keeps the body bytes, runs the transfer (the proxy's own client) the
/// `.send` output describes (attaching the token of the named generation), and writes what `.deliverHead`
/// and `.deliverBody` say. The client protocol layer (`ConnectionMachine` for HTTP/1.1) frames the head and
/// the body for its client.
public struct ProtectedExchange: Sendable {
    /// What the exchange needs from the settings, captured when its connection was accepted.
    public struct Settings: Sendable, Equatable {
        /// Bodies up to this size are kept for replay (memory, then an unlinked spool file).
        public var replaySpool: Int
        public var connectTimeout: Int
        public var idleTimeout: Int
        /// Limits for the origin's response head (the same as the passthrough path's).
        public var responseHeadLimits: HTTPHeadLimits
        /// The upstream proxy for the origin's authority, if one applies.
        public var upstreamProxy: UpstreamProxy?

        public init(
            replaySpool: Int, connectTimeout: Int, idleTimeout: Int, responseHeadLimits: HTTPHeadLimits,
            upstreamProxy: UpstreamProxy? = nil
        ) {
            self.replaySpool = replaySpool
            self.connectTimeout = connectTimeout
            self.idleTimeout = idleTimeout
            self.responseHeadLimits = responseHeadLimits
            self.upstreamProxy = upstreamProxy
        }
    }

    public enum Output: Sendable, Equatable {
        /// Keep the body's bytes in memory or a file up to now; from here on they stream and are not kept.
        case streamBody
        /// The whole request body has been received.
        case bodyEnded
        /// Get a usable token of `key` (the origin's provider, audience, scopes and kind: `OriginConfig.tokenKey`).
        case getTokens(key: TokenKey)
        /// Refresh the token of `key` because the one of `replacing` was rejected (single-flight).
        case refreshTokens(key: TokenKey, replacing: Int64)
        /// Start the upstream transfer the description says.
        case send(UpstreamRequest)
        /// Stop the upstream transfer (nothing of it is needed any more).
        case cancelTransfer
        /// Send the client the origin's response head.
        indirect case deliverHead(UpstreamResponse)
        /// Pass the body bytes of the current upstream callback to the client.
        case deliverBody(count: Int)
        /// The response body is complete; the origin's trailer fields follow it (gRPC's status, say).
        case endBody(trailers: [H2Field])
        /// Answer the client ourselves; nothing of a response has reached it.
        indirect case respond(ProxyAnswer)
        /// Remember the origin's latest DPoP nonce for the next request (RFC 9449 §9).
        case rememberNonce(String)
        /// The origin demands a stronger sign-in (RFC 9470): record it for `proxyctl step-up`.
        case recordStepUp(Challenge)
        /// No token can be had without the user: tell them.
        case signInNeeded(reason: String)
        /// Fetch the origin's protected resource metadata at `url` (on the origin itself) and answer with
        /// `resourceMetadata(_:)`: what it says of the provider, before the refresh a 401 would cause.
        case checkResourceMetadata(url: String)
        /// The origin's metadata names only these authorization servers, not the provider's: tell the user which
        /// `proxyctl init --origin` to run (the client gets the origin's 401 with `Proxy-Status`).
        case wrongAuthorizationServer([String])
        /// The exchange is over (`close`: the client connection cannot carry another request).
        case finished(ExchangeRecord)
    }

    /// Where the exchange is. Each case says where it goes next.
    enum Phase: Sendable, Equatable {
        /// Not begun. -> `.gettingTokens`, `.sending`
        case starting
        /// `.getTokens` issued. -> `.sending`, `.done` (answered)
        case gettingTokens
        /// `.refreshTokens` issued after a 401. -> `.sending` (the replay), `.done` (answered)
        case refreshing
        /// A transfer runs; its response head has not come. -> `.delivering`, `.discarding`, `.done` (an
        /// unusable head: the transfer is stopped and the client answered at once)
        case sending
        /// The head went to the client; body bytes follow. -> `.done`
        case delivering
        /// The transfer's response is not for the client (a retry follows when it ends); `held` is that
        /// response. -> `.refreshing`, `.sending`, `.awaitingBody`, or `.done` delivering the held response
        /// (without its body) when the request body outgrew the store meanwhile
        case discarding(then: AuthExchange.Action, held: UpstreamResponse)
        /// The origin answered (401, a nonce challenge) before the client finished sending the body: the rest
        /// is kept, then the request goes again. -> `.refreshing`, `.sending`, or `.done` delivering the held
        /// response (without its body) when the body outgrows the store
        case awaitingBody(then: AuthExchange.Action, held: UpstreamResponse)
        /// `.checkResourceMetadata` issued for the 401 `held` (its body discarded). -> `.refreshing`, or `.done`
        /// delivering the held response without its body
        case checkingMetadata(held: UpstreamResponse)
        case done
    }

    public let request: InterceptedRequest
    public let origin: OriginConfig
    public let settings: Settings
    /// Whether the proxy attaches its token (else the client's own Authorization travels).
    private let attach: Bool
    private let knownNonce: String?
    /// The auth exchange, once sending has begun; nil when nothing is attached.
    private var auth: AuthExchange?
    private(set) var phase = Phase.starting
    private var bodyReceived = 0
    private var bodyComplete = false
    private var streaming = false
    private var generation: Int64 = 0
    /// The tokens of `generation` are bound to a key (they go with a DPoP proof).
    private var boundToKey = false
    private var attempts = 0
    private var delivered: UpstreamResponse?
    private var answered: ProxyAnswer?
    /// An upstream transfer is running (between `.send` and `transferFinished`).
    private var transferRunning = false
    private var begun = false

    /// - Parameter knownNonce: the origin's last DPoP nonce, for the first proof (`TokenGrant` can bring a
    ///   newer one).
    public init(request: InterceptedRequest, origin: OriginConfig, settings: Settings, knownNonce: String?) {
        self.request = request
        self.origin = origin
        self.settings = settings
        self.attach = origin.attachesToken(clientHasAuthorization: request.clientAuthorization)
        self.knownNonce = knownNonce
        if request.framing == .none { bodyComplete = true }
    }

    /// Whether the exchange has ended.
    public var isFinished: Bool { phase == .done }
    /// Whether the request body has arrived whole (only then can the client connection carry another request).
    public var isBodyComplete: Bool { bodyComplete }
    /// Whether the origin's response is being passed to the client.
    public var isDelivering: Bool { phase == .delivering }
    /// Whether a response head (the origin's or ours) reached the client.
    public var responseStarted: Bool { delivered != nil || answered != nil }

    // MARK: - The request body

    /// Starts the exchange: the request goes upstream as soon as there is a token, its body following as it
    /// arrives (a copy is kept for a replay, up to `replay_spool`), in the framing the client chose.
    public mutating func start(_ out: inout [Output]) {
        if bodyComplete { out.append(.bodyEnded) }
        if case .contentLength(let length) = request.framing, length > UInt64(settings.replaySpool) {
            // Too large to keep: it streams from the start, once.
            streaming = true
            out.append(.streamBody)
        }
        begin(&out)
    }

    /// The I/O layer kept `count` more body bytes (after `.streamBody`, queued them for the transfer).
    public mutating func bodyReceived(_ count: Int, _ out: inout [Output]) {
        bodyReceived += count
        if bodyReceived > settings.replaySpool { stopKeeping(&out) }
    }

    /// The bodies kept for a replay hold all the I/O layer may keep (its connection's or the process's budget of
    /// memory and spool): the rest of this one streams, and it cannot be sent again.
    public mutating func bodyBeyondBudget(_ out: inout [Output]) {
        stopKeeping(&out)
    }

    private mutating func stopKeeping(_ out: inout [Output]) {
        guard !streaming else { return }
        streaming = true
        auth?.bodyNotKept()
        out.append(.streamBody)
        if case .awaitingBody(_, let held) = phase { deliverUnsent(held, &out) }
    }

    /// The request body is complete.
    public mutating func bodyEnded(_ out: inout [Output]) {
        bodyComplete = true
        out.append(.bodyEnded)
        if case .awaitingBody(let action, let held) = phase { perform(action, held: held, &out) }
    }

    /// The body could not be kept (the spool file could not be written).
    public mutating func bodyNotKept(directory: String, _ out: inout [Output]) {
        fail(.bodyNotKept(directory: directory), &out)
    }

    /// The request cannot go on (a malformed body): answer, or close when a response already started.
    public mutating func refuse(_ answer: ProxyAnswer, _ out: inout [Output]) {
        fail(answer, &out)
    }

    /// The request body can be sent again (for a refresh or a nonce retry).
    public var replayable: Bool { !streaming }

    private mutating func begin(_ out: inout [Output]) {
        guard !begun else { return }
        begun = true
        guard attach else {
            send(credential: nil, &out)
            return
        }
        // The body is replayable unless it outgrew the spool (or was known to be too large from the start).
        // Changed in place (`auth?.`), here and below: a copy out and back was a copy of its strings.
        auth = AuthExchange(
            origin: origin.url, provider: origin.credentialName, replayable: !streaming, knownNonce: knownNonce,
            // A static secret has no authorization server for a 401's resource metadata to contradict.
            checksResourceMetadata: origin.secret == nil)
        guard let first = auth?.start() else { return }
        perform(first, &out)
    }

    // MARK: - Tokens

    /// The answer to `.getTokens`.
    public mutating func tokens(_ result: Result<TokenGrant, TokenFailure>, _ out: inout [Output]) {
        // The I/O layer answers each `.getTokens` once (ExchangeIO): anything else is a bug, found in debug builds.
        assert(phase == .gettingTokens, "ProtectedExchange: tokens nobody asked for")
        guard phase == .gettingTokens else { return }
        switch result {
        case .success(let grant):
            generation = grant.generation
            boundToKey = grant.boundToKey
            if let nonce = grant.dpopNonce { auth?.learnNonce(nonce) }
            handle(.tokens(generation: grant.generation), &out)
        case .failure(let failure):
            handle(.tokensFailed(failure), &out)
        }
    }

    /// The answer to `.refreshTokens`.
    public mutating func refreshed(_ result: Result<TokenGrant, TokenFailure>, _ out: inout [Output]) {
        // Not only while waiting: a gRPC refusal on an open request stream refreshes with nobody waiting.
        guard phase == .refreshing else { return }
        switch result {
        case .success(let grant):
            generation = grant.generation
            boundToKey = grant.boundToKey
            if let nonce = grant.dpopNonce { auth?.learnNonce(nonce) }
            handle(.refreshed(generation: grant.generation), &out)
        case .failure(let failure):
            handle(.refreshFailed(failure), &out)
        }
    }

    /// The token could not be attached: no DPoP key for it, or the proof could not be signed.
    /// Only right after `.send`: the I/O layer then started no transfer.
    public mutating func credentialFailed(_ answer: ProxyAnswer, _ out: inout [Output]) {
        assert(phase == .sending, "ProtectedExchange: a credential failure without a .send")
        guard phase == .sending else { return }
        transferRunning = false
        fail(answer, &out)
    }

    private mutating func handle(_ event: AuthExchange.Event, _ out: inout [Output]) {
        guard let action = auth?.handle(event) else { return }
        perform(action, &out)
    }

    private mutating func perform(_ action: AuthExchange.Action, _ out: inout [Output]) {
        switch action {
        case .getTokens:
            phase = .gettingTokens
            out.append(.getTokens(key: origin.tokenKey))
        case .refresh(let replacing):
            phase = .refreshing
            out.append(.refreshTokens(key: origin.tokenKey, replacing: replacing))
        case .send(let generation, let nonce):
            send(
                credential: UpstreamRequest.Credential(
                    generation: generation, dpopNonce: nonce, boundToKey: boundToKey,
                    headers: origin.credentialHeaders),
                &out)
        case .deliver:
            // Only an origin's response leads to a delivery, and `responseComplete` handles that itself.
            preconditionFailure("ProtectedExchange: a delivery without a response")
        case .respond(let answer):
            if case .signInNeeded(_, let reason) = answer { out.append(.signInNeeded(reason: reason)) }
            fail(answer, &out)
        case .checkResourceMetadata:
            // Only a response leads to a check, and `perform(_:held:)` handles that.
            preconditionFailure("ProtectedExchange: a metadata check without a response")
        }
    }

    /// An action decided on the response `held`, whose transfer has ended.
    private mutating func perform(_ action: AuthExchange.Action, held: UpstreamResponse, _ out: inout [Output]) {
        guard case .checkResourceMetadata(let url) = action else { return perform(action, &out) }
        phase = .checkingMetadata(held: held)
        out.append(.checkResourceMetadata(url: url))
    }

    /// The answer to `.checkResourceMetadata`.
    public mutating func resourceMetadata(_ verdict: ResourceMetadataVerdict, _ out: inout [Output]) {
        guard case .checkingMetadata(let held) = phase, let action = auth?.handle(.resourceMetadata(verdict)) else {
            return
        }
        guard case .deliver(let proxyStatus) = action else { return perform(action, &out) }
        if let servers = auth?.otherServers { out.append(.wrongAuthorizationServer(servers)) }
        // The 401's body was discarded while the check ran: the client gets its head, fields and all.
        deliver(held.withoutBody(proxyStatus: proxyStatus ?? ProxyStatus(receivedStatus: held.head.status)), &out)
        out.append(.endBody(trailers: []))
        finish(close: false, note: proxyStatus?.details, &out)
    }

    // MARK: - Upstream

    private mutating func send(credential: UpstreamRequest.Credential?, _ out: inout [Output]) {
        attempts += 1
        phase = .sending
        transferRunning = true
        let body: UpstreamRequest.Body
        switch request.framing {
        case .none, .untilClose: body = .none
        // The client's framing is kept: its Content-Length, or chunks of a length nobody knows in advance.
        case .contentLength(let length): body = .length(Int(clamping: length))
        case .chunked: body = .streaming
        }
        var fields = request.upstreamFields
        if request.upgrade {
            // Upgrade and Connection are hop-by-hop: the proxy asks the origin for the same protocols itself.
            fields.append(("Connection", Array("Upgrade".utf8)))
            fields.append(("Upgrade", request.upgradeProtocols))
        }
        let upstream = UpstreamRequest(
            method: request.method,
            // `OPTIONS *` (asterisk-form): the URL names the origin, the target is sent as it came.
            url: request.target == "*" ? origin.url + "/" : origin.url + request.target,
            requestTarget: request.target == "*" ? "*" : nil, fields: fields,
            credential: credential, body: body, http2: origin.scheme == "https" && !request.upgrade,
            connectTimeout: settings.connectTimeout, idleTimeout: settings.idleTimeout,
            caFile: origin.caFile, upstreamProxy: settings.upstreamProxy, attempt: attempts,
            responseHeadLimits: settings.responseHeadLimits, upgrade: request.upgrade)
        out.append(.send(upstream))
    }

    /// A response head the proxy's own client read (`OriginExchange`): parsed once, with this exchange's limits.
    /// Interim (1xx) heads are the client's business (the transfer reads past them); a 101 to an upgrade is final.
    public mutating func upstreamResponseHead(_ received: ReceivedHead, _ out: inout [Output]) {
        guard phase == .sending, received.head.status >= 200 || received.semantics?.switchesProtocols == true
        else { return }
        responseComplete(received.head, checked: received.semantics, &out)
    }

    /// Trailer fields of the response being delivered (parsed by the own client: `HTTPHeadParser.trailerFields`,
    /// or HTTP/2's), passed on at the body's end.
    private var trailers: [H2Field] = []

    /// The trailer fields after the response's body.
    public mutating func upstreamTrailers(_ fields: [H2Field]) {
        guard phase == .delivering else { return }
        trailers = fields
    }

    /// `checked`: the head's semantics when the reader that parsed it found them sound.
    private mutating func responseComplete(_ head: HTTPHead, checked: ResponseSemantics?, _ out: inout [Output]) {
        let semantics: ResponseSemantics
        if let checked {
            semantics = checked
        } else {
            switch MessageSemantics.response(head, requestMethod: request.method, upgradeRequested: request.upgrade) {
            case .failure(let error):
                fail(.invalidResponse(origin.authority, reason: error.reason), &out)
                return
            case .success(let checked): semantics = checked
            }
        }
        let response = UpstreamResponse(head: head, semantics: semantics, proxyStatus: nil)
        guard auth != nil else {
            deliver(response, &out)
            return
        }
        let challenges = ChallengeParser.parse(head.values(named: "www-authenticate"))
        let nonce = head.values(named: "dpop-nonce").last
        if let nonce { out.append(.rememberNonce(nonce)) }
        // gRPC says "token expired" as 200 with grpc-status 16 (UNAUTHENTICATED) in a trailers-only response:
        // for the refresh-once/replay-once rule that is a 401.
        let unauthenticated = head.status == 200 && head.values(named: "grpc-status").last == "16"
        guard
            let action = auth?.handle(
                .response(status: unauthenticated ? 401 : head.status, challenges: challenges, dpopNonce: nonce))
        else { return }
        switch action {
        case .deliver(var proxyStatus):
            if let challenge = auth?.stepUp { out.append(.recordStepUp(challenge)) }
            // RFC 9209: received-status is what came, the 200 of a gRPC refusal.
            if unauthenticated, proxyStatus?.receivedStatus != nil { proxyStatus?.receivedStatus = head.status }
            var withStatus = response
            withStatus.proxyStatus = proxyStatus
            deliver(withStatus, &out)
        case .send where unauthenticated && !bodyComplete, .refresh where unauthenticated && !bodyComplete,
            .checkResourceMetadata where unauthenticated && !bodyComplete:
            // A gRPC call refused while its request stream is still open (a bidirectional or a long
            // client-streaming call) cannot wait for the stream's end to be sent again: the program gets the
            // refusal now, with what to do.
            var withStatus = response
            withStatus.proxyStatus = ProxyStatus(
                details:
                    "the call was refused UNAUTHENTICATED while its request stream was still open, so it was not sent again; call again",
                receivedStatus: head.status)
            // The token is refreshed all the same (nobody waits for it), so that calling again works.
            if case .refresh(let replacing) = action {
                out.append(.refreshTokens(key: origin.tokenKey, replacing: replacing))
            }
            deliver(withStatus, &out)
        case .send, .refresh, .checkResourceMetadata:
            // Retried (or checked) once this transfer has ended; its body is not the client's business.
            phase = .discarding(then: action, held: response)
        case .getTokens, .respond:
            perform(action, &out)
        }
    }

    private mutating func deliver(_ response: UpstreamResponse, _ out: inout [Output]) {
        phase = .delivering
        delivered = response
        out.append(.deliverHead(response))
        if response.semantics.switchesProtocols {
            // A 101 to the upgrade request: the exchange is over, its connection the tunnel's (the transfer's end
            // that follows is not waited for).
            transferRunning = false
            finish(close: true, note: "switched protocols", &out)
        }
    }

    /// Bytes of a response that is not the client's business (a 401 before a retry) are read to the end
    /// while few, so that the connection can carry the retry; beyond this the transfer stops instead.
    static let discardLimit = 64 * 1024
    private var discarded = 0

    /// `count` body bytes of the upstream response arrived.
    public mutating func upstreamBody(_ count: Int, _ out: inout [Output]) {
        switch phase {
        case .delivering:
            out.append(.deliverBody(count: count))
        case .discarding:
            discarded += count
            if discarded > Self.discardLimit {
                out.append(.cancelTransfer)
                transferFinished(nil, &out, cancelled: true)
            }
        default:
            break
        }
    }

    /// The transfer ended: `failure` nil when it completed.
    public mutating func transferFinished(_ failure: (UpstreamFailure, detail: String)?, _ out: inout [Output]) {
        transferFinished(failure, &out, cancelled: false)
    }

    private mutating func transferFinished(
        _ failure: (UpstreamFailure, detail: String)?, _ out: inout [Output], cancelled: Bool
    ) {
        guard transferRunning else { return }
        transferRunning = false
        switch phase {
        case .discarding(let action, let held):
            discarded = 0
            if streaming {
                // The body outgrew the store while this response came: what was sent of it is gone.
                deliverUnsent(held, &out)
            } else if bodyComplete {
                perform(action, held: held, &out)
            } else {
                // The origin answered before the whole body came: keep the rest, then send again.
                phase = .awaitingBody(then: action, held: held)
            }
        case .delivering:
            if let failure {
                // The response is cut short: the client sees the connection close before its end.
                finish(close: true, note: "upstream failed mid-response: \(failure.detail)", cutShort: true, &out)
            } else {
                out.append(.endBody(trailers: trailers))
                finish(close: false, note: nil, &out)
            }
        case .sending:
            let (kind, detail) = failure ?? (.incomplete, "no response")
            fail(
                kind.answer(
                    hop: origin.authority, proxy: settings.upstreamProxy, detail: detail, origin: OriginTrust(origin)),
                &out)
        case .starting, .gettingTokens, .refreshing, .awaitingBody, .checkingMetadata, .done:
            break
        }
    }

    /// The request cannot go again (its body was not kept): the client gets the origin's answer that was held
    /// for the retry, without its body (discarded). Its transfer is over, so the exchange ends with it.
    private mutating func deliverUnsent(_ held: UpstreamResponse, _ out: inout [Output]) {
        deliver(
            held.withoutBody(
                proxyStatus: ProxyStatus(
                    details: "the request body was too large to keep, so the request was not sent again; retry it",
                    receivedStatus: held.head.status)), &out)
        out.append(.endBody(trailers: []))
        finish(close: false, note: nil, &out)
    }

    /// Ends the exchange with an answer of ours, or (when a response was already delivered) by closing.
    private mutating func fail(_ answer: ProxyAnswer, _ out: inout [Output]) {
        guard phase != .done else { return }
        if transferRunning {
            transferRunning = false
            out.append(.cancelTransfer)
        }
        if delivered == nil {
            answered = answer
            out.append(.respond(answer))
            finish(close: answer.response.close, note: answer.response.proxyStatus?.details, &out)
        } else {
            finish(close: true, note: answer.response.proxyStatus?.details, cutShort: true, &out)
        }
    }

    /// `cutShort`: a response had begun and will not be complete.
    private mutating func finish(close: Bool, note: String?, cutShort: Bool = false, _ out: inout [Output]) {
        phase = .done
        out.append(.finished(record(close: close, note: note, cutShort: cutShort)))
    }

    /// The client went away or the proxy shuts down: stop.
    public mutating func abort(_ out: inout [Output]) {
        guard phase != .done else { return }
        if transferRunning {
            transferRunning = false
            out.append(.cancelTransfer)
        }
        finish(close: true, note: "aborted", cutShort: delivered != nil, &out)
    }

    private func record(close: Bool, note: String?, cutShort: Bool) -> ExchangeRecord {
        ExchangeRecord(
            method: request.method, origin: origin.url, provider: origin.credentialName, target: request.target,
            status: delivered?.head.status ?? answered?.status ?? 0, attempts: attempts,
            keptClientAuthorization: begun && auth == nil, attached: auth != nil && generation != 0,
            refreshed: auth?.refreshed ?? false, nonceRetried: auth?.nonceRetried ?? false,
            stepUp: auth?.stepUp != nil, answeredByProxy: answered != nil, note: note, close: close,
            cutShort: cutShort, proxyError: answered?.response.proxyStatus?.error?.rawValue,
            clientCredentialReplaced: auth != nil && request.clientAuthorization,
            placeholderUsed: request.placeholderUsed, staticSecret: origin.secret != nil)
    }
}

/// Tokens the I/O layer holds for a request, named by their generation (the token itself never enters the
/// machines), and the origin's latest DPoP nonce seen by any exchange.
public struct TokenGrant: Sendable, Equatable {
    public let generation: Int64
    public let dpopNonce: String?
    /// The token is bound to a key (RFC 9449, `token_type` DPoP): it goes with a proof.
    public let boundToKey: Bool

    public init(generation: Int64, dpopNonce: String? = nil, boundToKey: Bool = false) {
        self.generation = generation
        self.dpopNonce = dpopNonce
        self.boundToKey = boundToKey
    }
}

/// A request to send upstream for a protected origin: everything the transfer needs, decided here; the
/// I/O layer carries it out on the proxy's own client (`OriginExchange`). No secret is in it: the token is named
/// by its generation.
public struct UpstreamRequest: Sendable, Equatable {
    /// Attach the tokens of `generation`: `Authorization: Bearer <token>` (RFC 6750 §2.1), or for a token bound to
    /// a key `Authorization: DPoP <token>` and a fresh `DPoP` proof carrying `dpopNonce` (RFC 9449 §7). The I/O
    /// layer writes the fields; which ones is decided here.
    /// The fields are the origin's `header` lines (`CredentialHeader`), or `Authorization` with the scheme.
    public struct Credential: Sendable, Equatable {
        public let generation: Int64
        public let dpopNonce: String?
        public let boundToKey: Bool
        /// The fields to attach, as templates the I/O layer fills in with the credential.
        public let headers: [CredentialHeader]

        public init(
            generation: Int64, dpopNonce: String?, boundToKey: Bool = false,
            headers: [CredentialHeader] = [.authorizationDefault]
        ) {
            self.generation = generation
            self.dpopNonce = dpopNonce
            self.boundToKey = boundToKey
            self.headers = headers
        }

        /// The `Authorization` scheme.
        public var scheme: String { boundToKey ? "DPoP" : "Bearer" }
    }

    public enum Body: Sendable, Equatable {
        case none
        /// The whole body is known: this many bytes.
        case length(Int)
        /// The body streams and its length is not known.
        case streaming
    }

    /// The fields, behind one reference: the request goes from the exchange through the connection machine
    /// to the driver and its transfer (four copies per request as a struct of fifteen fields; callgrind, bench
    /// row 6). `Boxed`: copied on write.
    private struct Fields: Sendable {
        var method: String
        var url: String
        var requestTarget: String?
        var fields: [(name: String, value: [UInt8])]
        var credential: Credential?
        var body: Body
        var http2: Bool
        var connectTimeout: Int
        var idleTimeout: Int
        var caFile: String?
        var upstreamProxy: UpstreamProxy?
        var attempt: Int
        var responseHeadLimits: HTTPHeadLimits
        var upgrade: Bool
    }

    @Boxed private var stored: Fields

    public var method: String { stored.method }
    public var url: String { stored.url }
    /// A request target other than the URL's path (only `*`).
    public var requestTarget: String? { stored.requestTarget }
    /// Field lines as the client sent them, minus hop-by-hop fields, Host, framing and (when a token is
    /// attached) its Authorization.
    public var fields: [(name: String, value: [UInt8])] { stored.fields }
    public var credential: Credential? { stored.credential }
    public var body: Body { stored.body }
    /// Offer HTTP/2 (https origins); HTTP/1.1 otherwise.
    public var http2: Bool { stored.http2 }
    public var connectTimeout: Int { stored.connectTimeout }
    /// The transfer ends when no byte moves for this long.
    public var idleTimeout: Int { stored.idleTimeout }
    public var caFile: String? { stored.caFile }
    public var upstreamProxy: UpstreamProxy? { stored.upstreamProxy }
    /// 1 for the first send, 2 for a replay or retry.
    public var attempt: Int { stored.attempt }
    /// An upgrade request (`Connection: Upgrade` among `fields`): a new HTTP/1.1 connection, handed over on a 101.
    public var upgrade: Bool { stored.upgrade }
    /// The limits of the response head (the own client reads it once, with these).
    public var responseHeadLimits: HTTPHeadLimits {
        get { stored.responseHeadLimits }
        _modify { yield &stored.responseHeadLimits }
    }

    init(
        method: String, url: String, requestTarget: String?, fields: [(name: String, value: [UInt8])],
        credential: Credential?, body: Body, http2: Bool, connectTimeout: Int, idleTimeout: Int, caFile: String?,
        upstreamProxy: UpstreamProxy?, attempt: Int,
        responseHeadLimits: HTTPHeadLimits = HTTPHeadLimits(), upgrade: Bool = false
    ) {
        _stored = Boxed(
            wrappedValue: Fields(
                method: method, url: url, requestTarget: requestTarget, fields: fields, credential: credential,
                body: body, http2: http2, connectTimeout: connectTimeout, idleTimeout: idleTimeout, caFile: caFile,
                upstreamProxy: upstreamProxy, attempt: attempt,
                responseHeadLimits: responseHeadLimits, upgrade: upgrade))
    }

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.method == rhs.method && lhs.url == rhs.url && lhs.requestTarget == rhs.requestTarget
            && lhs.fields.map(\.name) == rhs.fields.map(\.name)
            && lhs.fields.map(\.value) == rhs.fields.map(\.value) && lhs.credential == rhs.credential
            && lhs.body == rhs.body && lhs.http2 == rhs.http2 && lhs.connectTimeout == rhs.connectTimeout
            && lhs.idleTimeout == rhs.idleTimeout && lhs.caFile == rhs.caFile
            && lhs.upstreamProxy == rhs.upstreamProxy && lhs.attempt == rhs.attempt
            && lhs.responseHeadLimits == rhs.responseHeadLimits && lhs.upgrade == rhs.upgrade
    }
}

/// The origin's response head, checked, and the `Proxy-Status` the proxy adds (a step-up, an unrepeated 401).
public struct UpstreamResponse: Sendable {
    public let head: HTTPHead
    public let semantics: ResponseSemantics
    public var proxyStatus: ProxyStatus?
}

extension UpstreamResponse {
    /// The head alone, its body discarded: framed as empty, with `proxyStatus` saying why.
    func withoutBody(proxyStatus: ProxyStatus) -> UpstreamResponse {
        let dropped = semantics.dropped.union(head.indices(named: "content-length")).union(
            head.indices(named: "transfer-encoding"))
        let empty = ResponseSemantics(
            framing: .none, isInterim: false, switchesProtocols: false, serverCloses: semantics.serverCloses,
            dropped: dropped)
        return UpstreamResponse(head: head, semantics: empty, proxyStatus: proxyStatus)
    }
}

extension UpstreamResponse: Equatable {
    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.head.bytes == rhs.head.bytes && lhs.proxyStatus == rhs.proxyStatus
    }
}

/// What an exchange with a protected origin came to: for the log line and the counters of `proxyctl status`.
///
/// A class of constants: the record goes from the exchange to the connection machine to the driver (three
/// copies of six strings per request as a struct; callgrind, bench row 6), and nothing changes it.
public final class ExchangeRecord: Sendable, Equatable {
    public let method: String
    public let origin: String
    public let provider: String
    public let target: String
    /// The status the client got (the origin's, or the proxy's own answer); 0 when none.
    public let status: Int
    public let attempts: Int
    public let keptClientAuthorization: Bool
    public let attached: Bool
    public let refreshed: Bool
    public let nonceRetried: Bool
    public let stepUp: Bool
    public let answeredByProxy: Bool
    public let note: String?
    /// The client connection cannot carry another request (an answer that closes, a response cut short).
    public let close: Bool
    /// A response had begun and will not be complete: the client must see it broken off.
    public let cutShort: Bool
    /// The `Proxy-Status` error type of the proxy's own answer, for the metrics.
    public let proxyError: String?
    /// The client's own credential field was replaced by the origin's (`client_credential = replace`).
    public let clientCredentialReplaced: Bool
    /// The client sent the origin's placeholder where the credential goes.
    public let placeholderUsed: Bool
    /// The credential is a static secret (`provider` names its source), not a provider's token.
    public let staticSecret: Bool

    public init(
        method: String, origin: String, provider: String, target: String, status: Int, attempts: Int,
        keptClientAuthorization: Bool, attached: Bool, refreshed: Bool, nonceRetried: Bool, stepUp: Bool,
        answeredByProxy: Bool, note: String?, close: Bool, cutShort: Bool = false, proxyError: String? = nil,
        clientCredentialReplaced: Bool = false, placeholderUsed: Bool = false, staticSecret: Bool = false
    ) {
        self.clientCredentialReplaced = clientCredentialReplaced
        self.placeholderUsed = placeholderUsed
        self.staticSecret = staticSecret
        self.method = method
        self.origin = origin
        self.provider = provider
        self.target = target
        self.status = status
        self.attempts = attempts
        self.keptClientAuthorization = keptClientAuthorization
        self.attached = attached
        self.refreshed = refreshed
        self.nonceRetried = nonceRetried
        self.stepUp = stepUp
        self.answeredByProxy = answeredByProxy
        self.note = note
        self.close = close
        self.cutShort = cutShort
        self.proxyError = proxyError
    }

    public static func == (lhs: ExchangeRecord, rhs: ExchangeRecord) -> Bool {
        lhs === rhs
            || (lhs.method == rhs.method && lhs.origin == rhs.origin && lhs.provider == rhs.provider
                && lhs.target == rhs.target && lhs.status == rhs.status && lhs.attempts == rhs.attempts
                && lhs.keptClientAuthorization == rhs.keptClientAuthorization && lhs.attached == rhs.attached
                && lhs.refreshed == rhs.refreshed && lhs.nonceRetried == rhs.nonceRetried && lhs.stepUp == rhs.stepUp
                && lhs.answeredByProxy == rhs.answeredByProxy && lhs.note == rhs.note && lhs.close == rhs.close
                && lhs.cutShort == rhs.cutShort && lhs.proxyError == rhs.proxyError)
    }

    /// The access log line (after the `conn= client=` prefix): no token, no query.
    public func logLine(up: Int, down: Int, milliseconds: Int64) -> String {
        logLineBuilder(up: up, down: down, milliseconds: milliseconds).text
    }

    /// `logLine` as the builder holding its bytes, for the log to write (and a driver to extend).
    public func logLineBuilder(up: Int, down: Int, milliseconds: Int64) -> LogLineBuilder {
        var line = LogLineBuilder()
        line.append(string: method)
        line.append(" ")
        line.append(string: origin)
        line.append(target: target)
        line.append(" status=")
        line.append(status)
        line.append(" up=")
        line.append(up)
        line.append(" down=")
        line.append(down)
        line.append(" duration=")
        line.append(duration: milliseconds)
        line.append(" intercepted=")
        line.append(string: provider)
        if keptClientAuthorization { line.append(" token=client") }
        if clientCredentialReplaced { line.append(" client_credential=replaced") }
        if placeholderUsed { line.append(" placeholder=1") }
        if attempts > 1 {
            line.append(" attempts=")
            line.append(attempts)
        }
        if refreshed { line.append(" refreshed=1") }
        if nonceRetried { line.append(" nonce_retry=1") }
        if let note {
            line.append(" note=\"")
            line.append(string: note)
            line.append("\"")
        }
        return line
    }
}
