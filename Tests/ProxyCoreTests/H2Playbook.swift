import Testing

@testable import ProxyCore

/// Drives an `H2Session` the way `H2Driver` does (nghttp2's callbacks become events, libcurl's header lines
/// go through `transferHeaderLine`, timers fire when due) and checks, after every action, the rules the
/// driver and the client rely on. A test reads like the exchange on the wire: header blocks and DATA counts
/// from the client, what goes to the origin (the exchange's `send`), and what the client gets back.
///
/// The rules, per stream: every action names a stream the client opened; one response per stream (a head,
/// or the proxy's own answer), never after the client closed it; body and end only after a head that said a
/// body follows; a transfer at a time, stopped before its exchange finishes; one finish per exchange, whose
/// record names the status the client got; a body that was not kept is never sent again. Per connection:
/// the exchanges in flight are the session's streams; the keep-alive timer runs exactly when none is in
/// flight, the idle timer exactly when some are; a misdirected connection never asks for a token; after
/// `closeAfterFlush` no stream is in flight; after `clientGone` nothing but logs and records.
struct H2Playbook {
    typealias Stream = H2Session.Stream
    typealias Action = H2Session.Action

    /// What the client and the driver know about one stream.
    /// A transfer that runs; `fresh` while it has delivered nothing (the driver could then still fail to
    /// attach the credential instead of starting it).
    struct Transfer {
        var fresh = true
    }

    struct StreamLog {
        var headRequest: Bool
        var requestEnded: Bool
        /// The error code of the client's close (its RST_STREAM, or NO_ERROR when both sides ended).
        var closedByClient: UInt32?
        /// The `:status` the client got, if any.
        var status: Int?
        var answered = false
        var submitted = false
        var responseEnded = false
        var reset: H2ErrorCode?
        /// The session runs an exchange for the stream (from its first exchange action to its finish).
        var inExchange = false
        var records: [ExchangeRecord] = []
        var transfer: Transfer?
        var awaitingTokens = false
        var awaitingRefresh = false
        var awaitingMetadata = false
        /// Generations handed to the exchange.
        var grants: Set<Int64> = []
        var bodyStreamed = false
        var sends: [UpstreamRequest] = []
    }

    var session: H2Session
    var now: Int64 = 1_000
    var lastActivity: Int64 = 1_000
    /// Armed timers and their deadlines.
    var timers: [ConnectionTimer: Int64] = [:]
    /// Actions since `next()` was last called, timers and logs aside.
    var notable: [Action] = []
    var logs: [LogLine] = []
    var outcomes: [RequestOutcome] = []
    /// Streams refused for a credential they carried, as the audit log gets them.
    var refusals: [RefusedCredentialUse] = []
    var streams: [Stream: StreamLog] = [:]
    var goaways: [H2ErrorCode] = []
    /// `closeAfterFlush` came: the driver reads nothing more from the client.
    var closing = false
    /// `clientGone` was handled.
    var gone = false
    /// The generation the next `tokens`/`refreshed` hands out.
    var generation: Int64 = 0
    /// Rules broken so far (each is also recorded as an issue unless `quiet`).
    var violations: [String] = []
    var quiet = false
    /// RST_STREAMs the session sent on a stream the client had already closed (RFC 9113 §5.4.2 forbids
    /// answering a RST_STREAM with one; see `H2SessionRFCGaps`): tolerated here, counted.
    var resetsAfterClose: [Stream] = []
    /// The stream whose transfer callback runs (the only one `writeBody` may name).
    private var callback: Stream?
    /// The event being handled.
    private var current: H2Session.Event?

    init(
        origin: OriginConfig = H2Playbook.origin, settings: ProxySettings = Playbook.settings,
        misdirected: String? = nil
    ) {
        session = H2Session(
            origin: origin,
            frontDoor: FrontDoor(
                settings: settings, credentials: nil,
                boundAddress: ListenAddress(host: "127.0.0.1", port: 8080, isIPv6: false),
                origins: OriginTable([origin])),
            misdirected: misdirected)
        var actions: [Action] = []
        session.start(now: now, &actions)
        apply(actions)
    }

    static let origin = Origins.https

    // MARK: - Building requests

    /// A header block from name/value pairs, in order.
    static func fields(_ pairs: [(String, String)]) -> [H2Field] { pairs.map { H2Field($0.0, $0.1) } }

    /// The pseudo-fields of a request to the tunnel's origin, then `extra`.
    static func request(_ method: String, _ path: String, _ extra: [(String, String)] = []) -> [H2Field] {
        fields([(":method", method), (":scheme", "https"), (":authority", "api.test"), (":path", path)] + extra)
    }

    // MARK: - Events

    mutating func event(_ event: H2Session.Event) {
        switch event {
        case .requestHeaders(let stream, let fields, let endStream):
            if streams[stream] == nil {
                let method = fields.first { $0.name == Array(":method".utf8) }?.valueText
                streams[stream] = StreamLog(headRequest: method == "HEAD", requestEnded: endStream)
            }
            lastActivity = now
        case .requestData(let stream, _, let endStream):
            if endStream { streams[stream]?.requestEnded = true }
            lastActivity = now
        case .requestTrailers(let stream, _):
            streams[stream]?.requestEnded = true
            lastActivity = now
        case .streamClosed(let stream, let errorCode):
            if streams[stream]?.closedByClient == nil { streams[stream]?.closedByClient = errorCode }
            lastActivity = now
        case .tokens(let stream, let result):
            streams[stream]?.awaitingTokens = false
            if case .success(let grant) = result { streams[stream]?.grants.insert(grant.generation) }
        case .refreshed(let stream, let result):
            streams[stream]?.awaitingRefresh = false
            if case .success(let grant) = result { streams[stream]?.grants.insert(grant.generation) }
        case .credentialFailed(let stream, _):
            streams[stream]?.transfer = nil
        case .resourceMetadata(let stream, _):
            streams[stream]?.awaitingMetadata = false
        case .transferBody(let stream, _):
            streams[stream]?.transfer?.fresh = false
            callback = stream
            lastActivity = now
        case .transferFinished(let stream, _, _):
            streams[stream]?.transfer = nil
            lastActivity = now
        case .bodyNotKept, .bodyBeyondBudget, .timerFired, .shutdown, .clientGone, .tunnelEnded, .requestHeadTooLarge:
            break
        }
        current = event
        var actions: [Action] = []
        session.handle(event, now: now, &actions)
        apply(actions)
        callback = nil
        current = nil
        if case .clientGone = event { gone = true }
        afterEvent()
    }

    /// A new stream's request header block.
    mutating func request(_ stream: Stream, _ fields: [H2Field], endStream: Bool = true) {
        event(.requestHeaders(stream, fields, endStream: endStream))
    }

    /// Usable tokens for the stream's `getTokens` (a new generation each time).
    mutating func tokens(_ stream: Stream, dpopNonce: String? = nil) {
        generation += 1
        event(.tokens(stream, .success(TokenGrant(generation: generation, dpopNonce: dpopNonce))))
    }

    /// The answer to the stream's `refreshTokens` (a new generation).
    mutating func refreshed(_ stream: Stream) {
        generation += 1
        event(.refreshed(stream, .success(TokenGrant(generation: generation))))
    }

    /// A transfer's response heads (interim ones, then the final) as the own client hands them over: read by
    /// `ResponseReader` for the stream's last request; a head it cannot read ends the transfer with the failure,
    /// as `OriginExchange` ends it.
    mutating func transferHead(_ stream: Stream, _ text: String) {
        streams[stream]?.transfer?.fresh = false
        lastActivity = now
        let sent = streams[stream]?.sends.last
        var reader = ResponseReader(
            requestMethod: sent?.method ?? "GET", upgradeRequested: sent?.upgrade ?? false,
            limits: sent?.responseHeadLimits ?? HTTPHeadLimits())
        var outputs: [ResponseReader.Output] = []
        _ = Array(text.utf8).withUnsafeBytes { reader.read($0, &outputs) }
        for output in outputs {
            switch output {
            case .head(let received):
                var actions: [Action] = []
                session.transferResponseHead(stream, received, now: now, &actions)
                apply(actions)
                afterEvent()
            case .failed(let error):
                event(.transferFinished(stream, OriginExchange.failure(error), detail: "\(error)"))
                return
            default:
                break
            }
        }
    }

    /// The trailer fields after a transfer's body (`text`: a trailer section's field lines), as the own client
    /// parses and hands them over.
    mutating func transferTrailers(_ stream: Stream, _ text: String) {
        lastActivity = now
        var actions: [Action] = []
        session.transferTrailers(
            stream, HTTPHeadParser.trailerFields(Array(text.utf8), limits: HTTPHeadLimits()), now: now, &actions)
        apply(actions)
        afterEvent()
    }

    /// Advances the clock by `milliseconds` and fires the timers that are due, in deadline order.
    mutating func wait(_ milliseconds: Int64) {
        let until = now + milliseconds
        while let (timer, deadline) = timers.filter({ $0.value <= until }).min(by: { $0.value < $1.value }) {
            now = deadline
            timers.removeValue(forKey: timer)
            event(.timerFired(timer, lastActivity: lastActivity))
        }
        now = until
    }

    // MARK: - Carrying out actions (and checking the rules)

    mutating func violation(_ message: String, sourceLocation: SourceLocation = #_sourceLocation) {
        violations.append(message)
        if !quiet { Issue.record(Comment(rawValue: message), sourceLocation: sourceLocation) }
    }

    mutating func apply(_ actions: [Action]) {
        for action in actions { apply(action) }
    }

    private mutating func apply(_ action: Action) {
        if gone {
            switch action {
            case .log, .exchangeFinished, .requestFinished: break
            default: violation("\(action) after the client went away")
            }
        }
        if closing {
            switch action {
            case .log, .goaway, .closeAfterFlush, .arm, .disarm: break
            default: violation("\(action) after closeAfterFlush")
            }
        }
        switch action {
        case .log(let line):
            logs.append(line)
            return
        case .arm(let timer, let milliseconds):
            if milliseconds <= 0 { violation("\(timer) armed for \(milliseconds) ms") }
            timers[timer] = now + Int64(milliseconds)
            return
        case .disarm(let timer):
            timers.removeValue(forKey: timer)
            return
        case .requestFinished(let outcome):
            if outcome.kind != .intercepted { violation("a stream counted as \(outcome.kind)") }
            outcomes.append(outcome)
            return
        case .auditRefusal(let use):
            refusals.append(use)
            return
        case .goaway(let code):
            if code != .noError { violation("GOAWAY \(code)") }
            goaways.append(code)
        case .closeAfterFlush:
            closing = true
        case .submitResponse(let stream, let fields, let endStream):
            guard var log = opened(stream, action) else { break }
            responseHead(&log, fields, action)
            if !log.inExchange { violation("\(action): a response head from no exchange") }
            log.submitted = true
            if endStream { log.responseEnded = true }
            streams[stream] = log
        case .respond(let stream, let fields, let body):
            guard var log = opened(stream, action) else { break }
            responseHead(&log, fields, action)
            log.answered = true
            log.responseEnded = true
            let length = fields.first { $0.name == Array("content-length".utf8) }?.valueText
            if body.isEmpty != log.headRequest || (!body.isEmpty && length != String(body.count)) {
                violation("\(action): a body of \(body.count) bytes, content-length \(length ?? "-")")
            }
            streams[stream] = log
        case .writeBody(let stream):
            guard let log = opened(stream, action) else { break }
            if !log.submitted || log.responseEnded || callback != stream || log.transfer == nil {
                violation("\(action) outside a transfer callback of a response with a body in progress")
            }
        case .endStream(let stream, let trailers):
            guard var log = opened(stream, action) else { break }
            if !log.submitted || log.responseEnded { violation("\(action) without a response in progress") }
            for field in trailers where !Self.allowedTrailer(field) {
                violation("\(action): trailer \(field.nameText)")
            }
            log.responseEnded = true
            streams[stream] = log
        case .resetStream(let stream, let code):
            guard var log = streams[stream] else { return violation("\(action) names a stream never opened") }
            if log.reset != nil { violation("\(action): a second reset") }
            switch code {
            case .refusedStream:
                if log.inExchange || !log.records.isEmpty || goaways.isEmpty {
                    violation("\(action): refused, but not a new stream after GOAWAY")
                }
            case .internalError:
                // A response cut short: right after its exchange finished so.
                if log.records.last?.cutShort != true || log.responseEnded || log.inExchange {
                    violation("\(action) without a response cut short")
                }
            default:
                violation("\(action): unexpected code")
            }
            if log.closedByClient != nil { resetsAfterClose.append(stream) }
            log.reset = code
            log.responseEnded = true
            streams[stream] = log
        case .requestTrailers(let stream, _):
            guard let log = opened(stream, action) else { break }
            if !log.inExchange { violation("\(action) for a stream without an exchange") }
        case .exchange(let stream, let output, let origin):
            guard var log = streams[stream] else { return violation("\(action) names a stream never opened") }
            exchangeOutput(&log, output, origin: origin, action)
            streams[stream] = log
        case .openTunnel(let stream, let head):
            // A WebSocket stream (RFC 8441): its answer comes from the HTTP/1.1 side, which this does not drive.
            guard opened(stream, action) != nil else { break }
            if head.suffix(4) != Array("\r\n\r\n".utf8) { violation("\(action): a head without its end") }
            return
        case .consumeTunnel(let stream, _), .tunnelToStream(let stream, _), .endTunnelInput(let stream),
            .closeTunnel(let stream), .dropRequestBody(let stream):
            guard opened(stream, action) != nil else { break }
            return
        case .exchangeFinished(let stream, let record):
            guard var log = streams[stream] else { return violation("\(action) names a stream never opened") }
            if !log.inExchange || !log.records.isEmpty { violation("\(action): not one finish per exchange") }
            if log.transfer != nil { violation("\(action) with its transfer running") }
            if record.status != (log.status ?? 0) {
                violation("\(action): the record says \(record.status), the client got \(log.status ?? 0)")
            }
            if record.cutShort && !log.submitted { violation("\(action): cut short without a response head") }
            if !record.cutShort && log.status != nil && !log.responseEnded {
                violation("\(action): a response neither complete nor cut short")
            }
            if log.status == nil && log.closedByClient == nil && !isClientGone {
                violation("\(action): no response while the client waits for one")
            }
            log.records.append(record)
            log.inExchange = false
            streams[stream] = log
        }
        notable.append(action)
    }

    private var isClientGone: Bool {
        switch current {
        case .clientGone, .timerFired(.idle, _): true
        default: false
        }
    }

    private mutating func opened(_ stream: Stream, _ action: Action) -> StreamLog? {
        guard let log = streams[stream] else {
            violation("\(action) names a stream never opened")
            return nil
        }
        return log
    }

    private mutating func responseHead(_ log: inout StreamLog, _ fields: [H2Field], _ action: Action) {
        if log.answered || log.submitted { violation("\(action): a second response") }
        if log.closedByClient != nil || log.reset != nil { violation("\(action) on a closed stream") }
        guard let first = fields.first, first.name == Array(":status".utf8), let status = Int(first.valueText),
            (200...599).contains(status)
        else { return violation("\(action) does not start with a final :status") }
        log.status = status
        for field in fields.dropFirst() where !Self.allowedResponseField(field) {
            violation("\(action): field \(field.nameText)")
        }
    }

    private mutating func exchangeOutput(
        _ log: inout StreamLog, _ output: ProtectedExchange.Output, origin: OriginConfig, _ action: Action
    ) {
        if origin != session.origin { violation("\(action): an exchange with another origin") }
        if session.misdirected != nil { violation("\(action) on a misdirected connection") }
        if !log.records.isEmpty { violation("\(action) after the exchange finished") }
        log.inExchange = true
        switch output {
        case .getTokens(let key):
            if key != origin.tokenKey { violation("\(action): another origin's token") }
            if log.awaitingTokens { violation("\(action) twice") }
            log.awaitingTokens = true
        case .refreshTokens(let key, let replacing):
            if key != origin.tokenKey || !log.grants.contains(replacing) {
                violation("\(action): not a refresh of this stream's token")
            }
            log.awaitingRefresh = true
        case .send(let request):
            if log.transfer != nil { violation("\(action) while a transfer runs") }
            log.transfer = Transfer()
            if !request.url.hasPrefix(origin.url + "/") { violation("\(action): a request to \(request.url)") }
            for field in request.fields where !Self.allowedUpstreamField(Array(field.name.utf8)) {
                violation("\(action): field \(field.name) goes upstream")
            }
            if let credential = request.credential, !log.grants.contains(credential.generation) {
                violation("\(action): a generation the stream was never given")
            }
            if request.attempt != log.sends.count + 1 { violation("\(action): attempt \(request.attempt)") }
            if log.bodyStreamed && !log.sends.isEmpty && request.body != .none {
                violation("\(action): a body that was not kept is sent again")
            }
            log.sends.append(request)
        case .cancelTransfer:
            if log.transfer == nil { violation("\(action) without a transfer") }
            log.transfer = nil
        case .streamBody:
            log.bodyStreamed = true
        case .deliverHead, .deliverBody, .endBody, .respond, .finished:
            violation("\(action) reached the driver untranslated")
        case .checkResourceMetadata(let url):
            if log.transfer != nil { violation("\(action) while a transfer runs") }
            if !MetadataURL.sameOrigin(url, origin.url) { violation("\(action): metadata of another origin") }
            log.awaitingMetadata = true
        case .bodyEnded, .rememberNonce, .recordStepUp, .signInNeeded, .wrongAuthorizationServer:
            break
        }
    }

    /// Fields a response head may carry to an HTTP/2 client.
    static func allowedResponseField(_ field: H2Field) -> Bool {
        field.name.first != UInt8(ascii: ":") && field.name == field.name.map(ASCII.lower)
            && !H2Semantics.connectionSpecific.contains(field.name) && field.name != Array("te".utf8)
            && field.name != Array("trailer".utf8)
    }

    static func allowedTrailer(_ field: H2Field) -> Bool {
        allowedResponseField(field) && !ChunkedScanner.forbiddenTrailers.contains(field.name)
    }

    /// Fields the origin may get from an HTTP/2 client's request (`te` only as `trailers`, added back).
    static func allowedUpstreamField(_ name: [UInt8]) -> Bool {
        name == Array("te".utf8)
            || !(H2Semantics.connectionSpecific.contains(name) || name == Array("host".utf8)
                || name == Array("content-length".utf8) || name == Array("expect".utf8)
                || name.first == UInt8(ascii: ":"))
    }

    private mutating func afterEvent() {
        let inFlight = streams.values.filter(\.inExchange).count
        if session.activeStreams != inFlight {
            violation("the session has \(session.activeStreams) streams in flight, the driver \(inFlight)")
        }
        guard !gone else { return }
        if closing {
            if !session.isIdle { violation("closeAfterFlush with \(session.activeStreams) streams in flight") }
            return
        }
        if session.isIdle {
            if timers[.keepAlive] == nil || timers[.idle] != nil {
                violation("idle without the keep-alive timer (or with the idle timer): \(timers)")
            }
        } else if timers[.idle] == nil || timers[.keepAlive] != nil {
            violation("streams in flight without the idle timer (or with the keep-alive timer): \(timers)")
        }
    }

    // MARK: - Reading the results

    /// Notable actions since the last call (timers, logs and counts are tracked separately).
    mutating func next() -> [Action] {
        defer { notable = [] }
        return notable
    }

    /// The exchange record of the stream's finish.
    func record(_ stream: Stream) -> ExchangeRecord? { streams[stream]?.records.first }

    var lastLog: String { logs.last?.text ?? "" }

    // MARK: - Ending every stream

    /// Answers everything the streams wait for (tokens, refreshes, the rest of a request body, a response,
    /// the end of a transfer, the client's close once both sides ended) until nothing changes, then checks
    /// that every exchange finished once and every stream got a response, was reset or was closed by the
    /// client. The driver's view of liveness: nothing waits forever for something that will not come.
    mutating func finishEverything() {
        for _ in 0..<12 {
            let before = (notable.count, violations.count, streams.values.map(\.records.count).reduce(0, +))
            for stream in streams.keys.sorted() {
                guard let log = streams[stream], !gone else { continue }
                if log.awaitingTokens { tokens(stream) }
                if streams[stream]?.awaitingRefresh == true { refreshed(stream) }
                if streams[stream]?.awaitingMetadata == true {
                    event(.resourceMetadata(stream, .unknown("the playbook's")))
                }
                if let current = streams[stream], current.inExchange, !current.requestEnded,
                    current.closedByClient == nil
                {
                    event(.requestData(stream, count: 0, endStream: true))
                }
                if streams[stream]?.transfer != nil {
                    transferHead(stream, "HTTP/1.1 204 \r\n\r\n")
                    if streams[stream]?.transfer != nil {
                        event(.transferFinished(stream, nil, detail: ""))
                    }
                }
                if let current = streams[stream], current.requestEnded, current.responseEnded,
                    current.closedByClient == nil, current.reset == nil
                {
                    event(.streamClosed(stream, errorCode: 0))
                }
            }
            let after = (notable.count, violations.count, streams.values.map(\.records.count).reduce(0, +))
            if before == after { break }
        }
        for (stream, log) in streams.sorted(by: { $0.key < $1.key }) {
            if log.inExchange && !gone { violation("stream \(stream): its exchange never finished") }
            if !log.responseEnded && log.closedByClient == nil && !gone && !closing {
                violation("stream \(stream): no response, no reset, not closed")
            }
        }
    }
}

extension H2Field: CustomDebugStringConvertible {
    /// `name: value`, so that a failed expectation reads like the header block.
    public var debugDescription: String { "\(nameText): \(valueText)" }
}
