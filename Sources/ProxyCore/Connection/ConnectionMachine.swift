/// One HTTP/1.1 client connection, as a state machine: events in, actions out, no sockets, no clocks.
///
/// The same machine runs the proxy's own listener (the front door: absolute-form requests and CONNECT)
/// and the inside of a TLS tunnel the proxy terminated for a protected origin; only the role differs. Every
/// decision of the connection is made here: framing, keep-alive and pipelining, the next hop (resolve,
/// connect, an upstream proxy's CONNECT), stale kept-alive connections and the retry rule, 1xx and 101,
/// timeouts, SNI and Host checks, the proxy's own answers, and the exchange with a protected origin
/// (`ProtectedExchange`). The I/O layer (`ClientDriver` in ProxyIO) carries the actions out on libevent and
/// the proxy's own client to origins, and reports back what happened.
///
/// Every event handler also gets the bytes waiting in the client's and the next hop's input buffers
/// (`ByteView`s): the machine looks at them in place and answers with actions that consume, move or keep
/// them, so body bytes pass from one buffer to the other without being copied.
///
/// Each state carries the data valid in it: no field means something "only in phase X". An upstream
/// connection exists exactly in the states that hold one (`.readingHead` and `.intercepting` with a kept
/// one, `.connecting` with an attempt in flight, `.proxyHandshake`, `.forwarding`), and `.connect` is only
/// issued when none is open, so an old connection can never be overwritten while it still points here.
public struct ConnectionMachine: Sendable {
    /// Which side of the proxy the connection is.
    public enum Role: Sendable, Equatable {
        /// The listener: the front door decides what each request head asks for.
        case frontDoor
        /// Inside a TLS tunnel to this protected origin (after `200 Connection established`).
        case intercepted(OriginConfig)
    }

    public enum Event: Sendable, Equatable {
        /// The connection was accepted (or its TLS session begins).
        case start
        /// New bytes in the client's input.
        case clientData
        /// The client closed its sending side (`reset`: the connection broke).
        case clientEnded(reset: Bool)
        /// The TLS handshake on an intercepted connection finished with this server name (SNI) and this
        /// application protocol (ALPN: "h2", "http/1.1", or none).
        case tlsEstablished(serverName: String?, protocol: String?)
        case tlsFailed(reason: String)
        /// `.startInterception` could not set up TLS for the origin.
        case interceptionFailed(OriginConfig, reason: String)
        case resolved(ResolveOutcome)
        case upstreamConnected
        case upstreamConnectFailed(ConnectFailure)
        /// New bytes in the next hop's input.
        case upstreamData
        case upstreamEnded(reset: Bool)
        /// A timer fired; `lastActivity` is when a byte last moved on this connection (either side).
        case timerFired(ConnectionTimer, lastActivity: Int64)
        /// The proxy is shutting down: finish what is in flight, take no more requests.
        case shutdown
        /// End the connection now (the shutdown grace ran out).
        case abort(reason: String?)
        // The exchange with a protected origin:
        case tokens(Result<TokenGrant, TokenFailure>)
        case refreshed(Result<TokenGrant, TokenFailure>)
        /// The token could not be attached (no DPoP key, the proof could not be signed).
        case credentialFailed(ProxyAnswer)
        /// The answer to the exchange's `.checkResourceMetadata`.
        case resourceMetadata(ResourceMetadataVerdict)
        /// The body could not be kept for replay.
        case bodyNotKept(directory: String)
        /// The request body outgrew what the I/O layer may keep for replays: the rest streams, once.
        case bodyBeyondBudget
        /// `count` body bytes of the upstream transfer's response are there (one piece the transfer read).
        case transferBody(count: Int)
        /// The upstream transfer ended (`failure` nil: complete).
        case transferFinished(UpstreamFailure?, detail: String)
    }

    public enum Action: Sendable, Equatable {
        // The client
        /// Remove this many bytes from the client's input (a head, chunk framing, bytes after a close).
        case consumeClient(Int)
        case writeClient([UInt8])
        /// Read from the client (true) or leave its bytes in the kernel (false).
        case readClient(Bool)
        /// Close the client connection once its output is written.
        case closeAfterFlush
        /// Close the client connection now: nothing more is to be written.
        case closeNow
        /// Close the client connection at once with a reset (RST), so an incomplete response is not taken for
        /// a complete one.
        case resetClient

        // The next hop
        case resolve(HostPort)
        /// Connect to the resolved address with this index (no upstream connection is open).
        case connect(address: Int)
        /// Close the upstream connection (a kept one, a failed attempt, or one that is done).
        case closeUpstream
        case writeUpstream([UInt8])
        case consumeUpstream(Int)
        /// Move body bytes from the client's input to the upstream's output, unchanged.
        case moveClientToUpstream(Int)
        /// Move body bytes from the upstream's input to the client's output, unchanged.
        case moveUpstreamToClient(Int)
        /// Hand both connections to a blind tunnel, with what their buffers hold; `label` and `status` name it
        /// in the log line written when it ends. After a protected origin's 101 the upstream is the connection the
        /// exchange's transfer handed over (`OriginExchange`'s `.switchProtocols`).
        case startTunnel(label: TunnelLabel, status: Int)
        /// Answer `200 Connection established`, then terminate TLS for the protected origin on the socket.
        case startInterception(OriginConfig, answer: [UInt8])
        /// The client chose HTTP/2 (ALPN h2): an `H2Session` runs the connection from here (`misdirected`:
        /// the SNI named another host).
        case startHTTP2(OriginConfig, misdirected: String?)

        // Timers
        case arm(ConnectionTimer, milliseconds: Int)
        case disarm(ConnectionTimer)

        // The exchange with a protected origin
        /// Copy this many bytes from the client's input into the request body kept for replay.
        case keepBody(Int)
        /// The trailer fields of the request's chunked body (RFC 9112 §7.1.2), for the last chunk to the origin.
        case requestTrailers([H2Field])
        /// An action of the exchange with `origin` the I/O layer carries out as it is (tokens, the transfer,
        /// notices).
        indirect case exchange(ProtectedExchange.Output, OriginConfig)
        /// Write the body bytes of the current transfer callback to the client, as they are (a chunk's framing,
        /// when the response is chunked, comes as `.writeClient` around it).
        case writeResponseBody
        /// The exchange ended: log it and count it.
        case exchangeFinished(ExchangeRecord)

        case log(LogLine)
        /// A request ended (an answer of the proxy's own, or a forwarded exchange): for the metrics.
        indirect case requestFinished(RequestOutcome)
        /// A request was refused for a credential it carried (another origin's placeholder): its audit line.
        indirect case auditRefusal(RefusedCredentialUse)
    }

    // MARK: - State

    enum State: Sendable {
        /// TLS handshake on an intercepted connection. -> `.readingHead`, `.closed`
        case handshaking
        /// Waiting for or reading a request head; `kept` is an idle upstream connection from the last
        /// exchange. -> every other state
        case readingHead(ReadingHead)
        /// Resolving and connecting to the next hop. -> `.proxyHandshake`, `.forwarding`, `.handedOff`,
        /// `.closing` (an answer of ours)
        indirect case connecting(Connecting)
        /// CONNECT sent to the upstream proxy, reading its answer. -> `.handedOff`, `.closing`
        indirect case proxyHandshake(ProxyHandshake)
        /// A forwarded request and its response in flight. -> `.readingHead` (keep-alive), `.connecting`
        /// (a resend), `.handedOff` (101), `.closing`
        case forwarding(Forwarding)
        /// A request to a protected origin in flight. -> `.readingHead`, `.closing`, `.handedOff` (101)
        case intercepting(Intercepting)
        /// The last bytes go to the client, then the connection closes. -> `.closed`
        case closing
        /// A tunnel or a TLS session took the connection over. Terminal.
        case handedOff
        case closed
        /// The placeholder while a state's payload is moved out to change in place (`changeIntercepting`): never
        /// seen by an event (every entry traps on it), so a way out that forgot to put the state back is a crash
        /// in the tests, not a connection hung in a terminal state (async-http-client's `.modifying`).
        case modifying
    }

    struct ReadingHead: Sendable {
        var parser: HTTPHeadParser
        /// The `.head` deadline is armed for the head being read.
        var deadlineArmed: Bool
        var kept: HostPort?
    }

    /// What a connection to the next hop is for.
    enum Purpose: Sendable {
        case tunnel(target: HostPort, proxy: UpstreamProxy?)
        case forward(FrontDoorDecision.Forward, retried: Bool)
    }

    struct Connecting: Sendable {
        let purpose: Purpose
        let hop: HostPort
        /// nil until the resolver answered.
        var addresses: Int?
        /// The address being tried (an upstream connection is open while `attempting`).
        var next = 0
        var attempting = false
        var lastFailure: ConnectFailure?
    }

    struct ProxyHandshake: Sendable {
        let target: HostPort
        let proxy: UpstreamProxy
        var parser: HTTPHeadParser
    }

    struct Forwarding: Sendable {
        @Boxed var forward: FrontDoorDecision.Forward
        let hop: HostPort
        let started: Int64
        // Boxed (see `Boxed`): the payload moves in and out of `State` several times per event; inline, these
        // made `State` 552 bytes, memmoved and retained field by field each time.
        @Boxed var request: BodyProgress
        @Boxed var parser: HTTPHeadParser
        @Boxed var response: BodyProgress?
        var status = 0
        var reused: Bool
        var retried: Bool
        var closeAfter = false
        var serverCloses = false
        var bytesUp = 0
        var bytesDown = 0
        /// Bytes of response heads read from the next hop (interim ones included).
        var headBytesRead = 0
        /// A byte of a response reached the client: no answer of ours can follow.
        var clientSawResponse = false
    }

    struct Intercepting: Sendable {
        @Boxed var exchange: ProtectedExchange
        var body: BodyReader
        let started: Int64
        let headRequest: Bool
        /// How the response body goes to the client, once the head went.
        var framing: ResponseFramingToClient?
        var kept: HostPort?
    }

    /// Decodes a request body on its way into the replay store: Content-Length by count, chunked by
    /// `ChunkedScanner` (the framing bytes are consumed, the data kept).
    struct BodyReader: Sendable {
        var remaining: UInt64
        var chunks: ChunkedScanner?
        var done: Bool
        /// A chunked body's trailer section as it came (bounded by `ChunkedScanner.maxTrailers`).
        var trailerSection: [UInt8] = []

        init(_ framing: BodyFraming) {
            switch framing {
            case .none, .untilClose: (remaining, chunks, done) = (0, nil, true)
            case .contentLength(let length): (remaining, chunks, done) = (length, nil, length == 0)
            case .chunked: (remaining, chunks, done) = (0, ChunkedScanner(), false)
            }
        }
    }

    public let role: Role
    public let frontDoor: FrontDoor
    let hasLocalCA: Bool
    /// Who is on the other end (for the front door's user rules).
    let peer: PeerIdentity
    var state: State
    /// The client closed its sending side; the answer in flight can still go back.
    var clientEOF = false
    var draining = false
    /// Set on an intercepted connection whose SNI names another host: every request gets 421.
    var misdirected: String?
    /// Request heads begun on this connection: read whole, refused as malformed, or cut by the head deadline.
    public private(set) var requests = 0
    var now: Int64 = 0
    /// Bytes of the client's and the upstream's input views already accounted for by actions of the event
    /// being handled (the views do not change until the actions run).
    var clientOffset = 0
    var upstreamOffset = 0
    /// Scratch space for `BodyProgress.take` (kept to avoid an allocation per read).
    var spans: [BodySpan] = []
    /// Scratch space for the outputs of an event of the exchange in flight (`exchangeEvent`), kept for the
    /// same reason.
    var exchangeOutputs: [ProtectedExchange.Output] = []
    /// What the request being handled was routed to, for the outcome of an answer of the proxy's own.
    var outcomeKind = RequestOutcome.Kind.proxy

    /// - Parameters:
    ///   - frontDoor: the decisions and settings snapshot taken when the connection was accepted.
    ///   - hasLocalCA: whether protected https origins can be intercepted (else they get 502).
    ///   - peer: who is on the other end, when the I/O layer could tell.
    public init(role: Role, frontDoor: FrontDoor, hasLocalCA: Bool, peer: PeerIdentity = .owner) {
        self.role = role
        self.frontDoor = frontDoor
        self.hasLocalCA = hasLocalCA
        self.peer = peer
        switch role {
        case .frontDoor:
            state = .readingHead(ReadingHead(parser: Self.requestParser(frontDoor), deadlineArmed: true, kept: nil))
        case .intercepted:
            state = .handshaking
        }
    }

    static func requestParser(_ frontDoor: FrontDoor) -> HTTPHeadParser {
        HTTPHeadParser(kind: .request, limits: frontDoor.settings.headLimits)
    }

    var settings: ProxySettings { frontDoor.settings }

    /// Nothing in flight: a connection waiting for its next request (closed at once on shutdown).
    public var isIdle: Bool {
        switch state {
        case .readingHead(let reading): !reading.parser.hasPartialHead
        case .handshaking, .closed: true
        default: false
        }
    }

    /// Whether the connection is over (closed, or handed to a tunnel or TLS session).
    public var isFinished: Bool {
        switch state {
        case .closed, .handedOff: true
        default: false
        }
    }

    // MARK: - Events

    /// Traps on the placeholder of a state being changed: a way out of a change that did not put the state back.
    private func checkNotModifying() {
        if case .modifying = state { preconditionFailure("ConnectionMachine: a state was not put back after a change") }
    }

    /// Handles `event` at monotonic time `now` (milliseconds). `client` and `upstream` are the bytes waiting
    /// in the two input buffers (an empty view where there is no upstream).
    public mutating func handle(
        _ event: Event, client: some ByteView, upstream: some ByteView, now: Int64, _ out: inout [Action]
    ) {
        checkNotModifying()
        self.now = now
        clientOffset = 0
        upstreamOffset = 0
        switch event {
        case .start:
            start(&out)
        case .clientData:
            break
        case .clientEnded(let reset):
            clientEnded(reset: reset, &out)
        case .tlsEstablished(let serverName, let negotiated):
            tlsEstablished(serverName, protocol: negotiated, &out)
        case .tlsFailed(let reason):
            guard case .handshaking = state, case .intercepted(let origin) = role else { break }
            out.append(
                .log(
                    LogLine(
                        .info,
                        "CONNECT \(origin.authority) TLS handshake failed: \(reason) (does the client trust the local CA? see proxyctl env)"
                    )))
            close(&out)
        case .interceptionFailed(let origin, let reason):
            interceptionFailed(origin, reason: reason, &out)
        case .resolved(let outcome):
            resolved(outcome, &out)
        case .upstreamConnected:
            upstreamConnected(&out)
        case .upstreamConnectFailed(let failure):
            connectFailed(failure, &out)
        case .upstreamData:
            upstreamData(&out)
        case .upstreamEnded(let reset):
            upstreamEnded(reset: reset, client: client, upstream: upstream, &out)
        case .timerFired(let timer, let lastActivity):
            timerFired(timer, lastActivity: lastActivity, &out)
        case .shutdown:
            shutdown(&out)
        case .abort(let reason):
            abort(reason: reason, &out)
        case .tokens(let result):
            exchangeEvent(&out) { exchange, outputs in exchange.tokens(result, &outputs) }
        case .refreshed(let result):
            exchangeEvent(&out) { exchange, outputs in exchange.refreshed(result, &outputs) }
        case .resourceMetadata(let verdict):
            exchangeEvent(&out) { exchange, outputs in exchange.resourceMetadata(verdict, &outputs) }
        case .credentialFailed(let answer):
            exchangeEvent(&out) { exchange, outputs in exchange.credentialFailed(answer, &outputs) }
        case .bodyNotKept(let directory):
            exchangeEvent(&out) { exchange, outputs in exchange.bodyNotKept(directory: directory, &outputs) }
        case .bodyBeyondBudget:
            exchangeEvent(&out) { exchange, outputs in exchange.bodyBeyondBudget(&outputs) }
        case .transferBody(let count):
            transferBody(count, &out)
        case .transferFinished(let failure, let detail):
            exchangeEvent(&out) { exchange, outputs in
                exchange.transferFinished(failure.map { ($0, detail) }, &outputs)
            }
        }
        pump(client: client, upstream: upstream, &out)
    }

    /// The trailer fields of the upstream transfer's response (after its body).
    public mutating func transferTrailers(_ fields: [H2Field], now: Int64, _ out: inout [Action]) {
        checkNotModifying()
        self.now = now
        exchangeEvent(&out) { exchange, _ in exchange.upstreamTrailers(fields) }
    }

    /// A response head the proxy's own client read and parsed (`OriginExchange`): not parsed again.
    public mutating func transferResponseHead(_ received: ReceivedHead, now: Int64, _ out: inout [Action]) {
        checkNotModifying()
        self.now = now
        exchangeEvent(&out) { exchange, outputs in exchange.upstreamResponseHead(received, &outputs) }
    }

    private mutating func start(_ out: inout [Action]) {
        // RFC 9112 §9.5's spirit: a client that connects and says nothing is not kept forever. The deadline
        // runs from the accept for the first request (and for the TLS handshake).
        out.append(.arm(.head, milliseconds: settings.headerTimeout))
        out.append(.readClient(true))
    }

    private mutating func tlsEstablished(_ serverName: String?, protocol negotiated: String?, _ out: inout [Action]) {
        guard case .handshaking = state, case .intercepted(let origin) = role else { return }
        misdirected = ServerName.mismatch(serverName, tunnel: origin.authority)
        if negotiated == "h2" {
            // HTTP/2: an `H2Session` takes the connection over.
            state = .handedOff
            out.append(.disarm(.head))
            out.append(.startHTTP2(origin, misdirected: misdirected))
            return
        }
        state = .readingHead(ReadingHead(parser: Self.requestParser(frontDoor), deadlineArmed: false, kept: nil))
        out.append(.disarm(.head))
        out.append(.arm(.keepAlive, milliseconds: settings.keepAliveTimeout))
    }

    private mutating func clientEnded(reset: Bool, _ out: inout [Action]) {
        if reset {
            // Nothing more can be delivered.
            abort(reason: isIdle ? nil : "client connection error", &out)
            return
        }
        clientEOF = true
        switch state {
        case .readingHead, .handshaking:
            close(&out)
        case .forwarding(let forwarding):
            // A client may shut down its sending side after the request; the response still goes back.
            if !forwarding.request.isComplete { abort(reason: "client closed during the request body", &out) }
        case .intercepting(let intercepting):
            if !intercepting.exchange.isBodyComplete { abort(reason: "client closed during the request body", &out) }
        case .modifying:
            preconditionFailure("ConnectionMachine: a state was not put back after a change")
        case .connecting, .proxyHandshake, .closing, .handedOff, .closed:
            // The answer can still be delivered when the client only half-closed.
            break
        }
    }

    private mutating func shutdown(_ out: inout [Action]) {
        draining = true
        if isIdle && !isFinished { close(&out) }
    }

    // MARK: - Reading request heads

    /// Looks at whatever bytes the current state wants, from the offsets already accounted for.
    mutating func pump(client: some ByteView, upstream: some ByteView, _ out: inout [Action]) {
        // A state change can make other bytes relevant (a response ends, the next pipelined head follows).
        var rounds = 0
        while rounds < 1_000 {
            rounds += 1
            let before = (clientOffset, upstreamOffset, stateTag)
            switch state {
            case .readingHead:
                readHead(client, &out)
            case .forwarding:
                pumpRequestBody(client, &out)
                pumpResponse(upstream, &out)
            case .proxyHandshake:
                readProxyAnswer(upstream, &out)
            case .intercepting:
                pumpInterceptedBody(client, &out)
            case .closing:
                if client.count > clientOffset {
                    out.append(.consumeClient(client.count - clientOffset))
                    clientOffset = client.count
                }
            case .modifying:
                preconditionFailure("ConnectionMachine: a state was not put back after a change")
            case .handshaking, .connecting, .handedOff, .closed:
                break
            }
            if (clientOffset, upstreamOffset, stateTag) == before { return }
        }
    }

    /// A number per state case, to see whether a pump round changed anything.
    var stateTag: Int {
        switch state {
        case .handshaking: 0
        case .readingHead: 1
        case .connecting: 2
        case .proxyHandshake: 3
        case .forwarding: 4
        case .intercepting: 5
        case .closing: 6
        case .handedOff: 7
        case .closed: 8
        case .modifying: preconditionFailure("ConnectionMachine: a state was not put back after a change")
        }
    }

    private mutating func readHead(_ client: some ByteView, _ out: inout [Action]) {
        guard case .readingHead = state, client.count > clientOffset else { return }
        // Moved out while the parser changes (no copy on write), as `changeIntercepting` does: swapped out and
        // taken apart, where binding the payload of `state` copied it (a retain of each reference in the
        // parser). Every branch puts it back.
        var moved = State.modifying
        swap(&moved, &state)
        guard case .readingHead(var reading) = consume moved else { preconditionFailure("checked above") }
        let (outcome, taken) = client.parseHead(&reading.parser, from: clientOffset)
        if taken > 0 {
            out.append(.consumeClient(taken))
            clientOffset += taken
        }
        switch outcome {
        case .needMore:
            if !reading.deadlineArmed {
                // The head's deadline runs from its first byte and is not moved by later ones (slowloris).
                reading.deadlineArmed = true
                out.append(.disarm(.keepAlive))
                out.append(.arm(.head, milliseconds: settings.headerTimeout))
            }
            state = .readingHead(reading)
        case .failed(let error):
            requests += 1
            outcomeKind = role == .frontDoor ? .proxy : .intercepted
            state = .readingHead(reading)
            out.append(.log(LogLine(.info, "rejected status=\(error.status) reason=\"\(error.reason)\"")))
            respond(.badRequest(error), headRequest: false, &out)
        case .complete(let head, _):
            requests += 1
            out.append(.disarm(reading.deadlineArmed ? .head : .keepAlive))
            reading.deadlineArmed = false
            reading.parser.reset()
            state = .readingHead(reading)
            switch role {
            case .frontDoor: decide(head, kept: reading.kept, &out)
            case .intercepted(let origin): interceptedHead(head, origin: origin, kept: reading.kept, &out)
            }
        }
    }

    private mutating func decide(_ head: HTTPHead, kept: HostPort?, _ out: inout [Action]) {
        let decision = frontDoor.decide(head, peer: peer)
        outcomeKind = decision.outcomeKind
        switch decision {
        case .respond(let answer):
            var line = "\(head.method) \(LogText.target(head.target)) status=\(answer.status) answered-by=proxyctl"
            if let details = answer.response.proxyStatus?.details { line += " reason=\"\(details)\"" }
            out.append(.log(LogLine(.info, line)))
            respond(answer, headRequest: head.method == "HEAD", &out)
        case .tunnel(let target, let proxy):
            // A connection kept alive from an earlier forwarded request is of no use to a tunnel.
            if kept != nil { out.append(.closeUpstream) }
            startConnect(.tunnel(target: target, proxy: proxy), hop: proxy?.address ?? target, &out)
        case .interceptTunnel(let origin):
            if kept != nil { out.append(.closeUpstream) }
            guard hasLocalCA else {
                out.append(
                    .log(
                        LogLine(
                            .info, "CONNECT \(origin.authority) status=502 answered-by=proxyctl reason=\"no local CA\"")
                    ))
                state = .readingHead(
                    ReadingHead(parser: Self.requestParser(frontDoor), deadlineArmed: false, kept: nil))
                respond(.noLocalCA(origin: origin.url), headRequest: false, &out)
                return
            }
            state = .handedOff
            out.append(.disarm(.head))
            out.append(.disarm(.keepAlive))
            out.append(.startInterception(origin, answer: Self.connectEstablished))
        case .interceptRequest(let origin, let request):
            beginProtected(request, origin: origin, kept: kept, head: head, &out)
        case .forward(let forward):
            let hop = forward.upstream?.address ?? forward.url.authority
            if kept == hop {
                // Reuse the idle connection to the same next hop.
                out.append(.disarm(.upstreamKeepAlive))
                beginForwarding(forward, hop: hop, reused: true, retried: false, &out)
            } else {
                if kept != nil { out.append(.closeUpstream) }
                startConnect(.forward(forward, retried: false), hop: hop, &out)
            }
        }
    }

    private mutating func interceptedHead(
        _ head: HTTPHead, origin: OriginConfig, kept: HostPort?, _ out: inout [Action]
    ) {
        outcomeKind = .intercepted
        if let misdirected {
            return refuse(head, origin: origin, .misdirected(reason: misdirected), &out)
        }
        switch MessageSemantics.interceptedRequest(head, for: origin) {
        case .failure(let refusal):
            if let use = refusal.refusedUse(origin: origin, method: head.method, target: head.target) {
                out.append(.auditRefusal(use))
            }
            refuse(head, origin: origin, refusal.answer, &out)
        case .success(let request):
            beginProtected(request, origin: origin, kept: kept, head: head, &out)
        }
    }

    mutating func refuse(_ head: HTTPHead, origin: OriginConfig, _ answer: ProxyAnswer, _ out: inout [Action]) {
        out.append(
            .log(
                LogLine(
                    .info,
                    "\(head.method) \(origin.url)\(LogText.target(head.target)) status=\(answer.status) answered-by=proxyctl reason=\"\(answer.response.proxyStatus?.details ?? "")\""
                )))
        respond(answer, headRequest: false, &out)
    }

    // MARK: - Answers of our own

    /// Sends an answer of ours; the connection keeps reading heads unless the answer (or the state) closes it.
    mutating func respond(_ answer: ProxyAnswer, headRequest: Bool, _ out: inout [Action]) {
        let response = answer.response
        out.append(.writeClient(response.serialized(headRequest: headRequest)))
        out.append(
            .requestFinished(
                RequestOutcome(
                    kind: outcomeKind, status: answer.status, proxyError: response.proxyStatus?.error?.rawValue)))
        if response.close || clientEOF || draining {
            closeAfterFlush(&out)
        } else {
            nextRequest(kept: keptUpstream, &out)
        }
    }

    /// The idle upstream connection the current state holds, if any.
    var keptUpstream: HostPort? {
        switch state {
        case .readingHead(let reading): reading.kept
        case .intercepting(let intercepting): intercepting.kept
        default: nil
        }
    }

    /// Back to reading heads (keep-alive); pipelined bytes are read by the next pump round.
    mutating func nextRequest(kept: HostPort?, _ out: inout [Action]) {
        state = .readingHead(ReadingHead(parser: Self.requestParser(frontDoor), deadlineArmed: false, kept: kept))
        out.append(.disarm(.idle))
        out.append(.arm(.keepAlive, milliseconds: settings.keepAliveTimeout))
        out.append(.readClient(true))
    }

    mutating func closeAfterFlush(_ out: inout [Action]) {
        if hasUpstream { out.append(.closeUpstream) }
        state = .closing
        for timer in [ConnectionTimer.head, .keepAlive, .connect, .upstreamKeepAlive] { out.append(.disarm(timer)) }
        // A client that does not read our last bytes is not waited for forever.
        out.append(.arm(.idle, milliseconds: settings.idleTimeout))
        out.append(.readClient(false))
        out.append(.closeAfterFlush)
    }

    /// Ends the connection at once; `reason` is logged when an exchange was in flight.
    mutating func abort(reason: String?, _ out: inout [Action]) {
        switch state {
        case .forwarding(let forwarding):
            logForwarded(forwarding, note: reason ?? "aborted", &out)
        case .intercepting(var intercepting):
            var outputs: [ProtectedExchange.Output] = []
            intercepting.exchange.abort(&outputs)
            for output in outputs {
                switch output {
                case .cancelTransfer: out.append(.exchange(.cancelTransfer, intercepting.exchange.origin))
                case .finished(let record): out.append(.exchangeFinished(record))
                default: break
                }
            }
        default:
            break
        }
        close(&out)
    }

    /// Closes now: frees the upstream and the client connection.
    mutating func close(_ out: inout [Action]) {
        if isFinished { return }
        if hasUpstream { out.append(.closeUpstream) }
        for timer in ConnectionTimer.allCases { out.append(.disarm(timer)) }
        state = .closed
        out.append(.closeNow)
    }

    /// Whether an upstream connection is open in the current state.
    var hasUpstream: Bool {
        switch state {
        case .readingHead(let reading): reading.kept != nil
        case .intercepting(let intercepting): intercepting.kept != nil
        case .connecting(let connecting): connecting.attempting
        case .proxyHandshake, .forwarding: true
        case .handshaking, .closing, .handedOff, .closed: false
        case .modifying: preconditionFailure("ConnectionMachine: a state was not put back after a change")
        }
    }

    // MARK: - Timers

    private mutating func timerFired(_ timer: ConnectionTimer, lastActivity: Int64, _ out: inout [Action]) {
        switch (timer, state) {
        case (.head, .handshaking):
            if case .intercepted(let origin) = role {
                out.append(
                    .log(LogLine(.info, "CONNECT \(origin.authority) TLS handshake did not finish in time")))
            }
            close(&out)
        case (.head, .readingHead(let reading)):
            if reading.parser.hasPartialHead {
                requests += 1
                outcomeKind = role == .frontDoor ? .proxy : .intercepted
                out.append(.log(LogLine(.info, "status=408 answered-by=proxyctl reason=\"request head incomplete\"")))
                respond(.requestHeadTimeout(milliseconds: settings.headerTimeout), headRequest: false, &out)
            } else {
                close(&out)
            }
        case (.keepAlive, .readingHead):
            close(&out)
        case (.upstreamKeepAlive, .readingHead(var reading)) where reading.kept != nil:
            reading.kept = nil
            state = .readingHead(reading)
            out.append(.closeUpstream)
        case (.upstreamKeepAlive, .intercepting(var intercepting)) where intercepting.kept != nil:
            intercepting.kept = nil
            state = .intercepting(intercepting)
            out.append(.closeUpstream)
        case (.connect, .connecting(let connecting)):
            connectTimedOut(connecting, &out)
        case (.connect, .proxyHandshake(let handshake)):
            answerConnectFailure(
                .upstreamProxyTimeout(handshake.proxy.address), log: "CONNECT \(handshake.target)", &out)
        case (.idle, .forwarding(let forwarding)):
            if let remaining = idleRemaining(lastActivity) {
                out.append(.arm(.idle, milliseconds: remaining))
            } else if !forwarding.clientSawResponse {
                out.append(
                    .log(
                        LogLine(
                            .info,
                            "\(forwarding.forward.method) \(LogText.url(forwarding.forward.url)) status=504 error=http_response_timeout"
                        )))
                out.append(.closeUpstream)
                state = .readingHead(
                    ReadingHead(parser: Self.requestParser(frontDoor), deadlineArmed: false, kept: nil))
                respond(.responseTimeout(forwarding.hop, milliseconds: settings.idleTimeout), headRequest: false, &out)
            } else {
                abort(reason: "idle timeout", &out)
            }
        case (.idle, .intercepting):
            // The transfer has its own idle limit (`OriginExchange`'s idle timer); a silent client is the other case.
            if let remaining = idleRemaining(lastActivity) {
                out.append(.arm(.idle, milliseconds: remaining))
            } else {
                abort(reason: "idle timeout", &out)
            }
        case (.idle, .closing):
            if let remaining = idleRemaining(lastActivity) {
                out.append(.arm(.idle, milliseconds: remaining))
            } else {
                close(&out)
            }
        default:
            // A timer of a state that has passed: nothing to do.
            break
        }
    }

    /// Milliseconds left of idle_timeout since `lastActivity`, or nil when it has run out.
    private func idleRemaining(_ lastActivity: Int64) -> Int? {
        let remaining = Int64(settings.idleTimeout) - (now - lastActivity)
        return remaining > 0 ? Int(remaining) : nil
    }
}
