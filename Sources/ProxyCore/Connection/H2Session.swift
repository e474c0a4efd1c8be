/// An HTTP/2 connection from a client inside a TLS tunnel the proxy terminated for a protected origin (ALPN
/// `h2`): each stream is one `ProtectedExchange`, with exactly the semantics of an HTTP/1.1 request (token
/// attached, refresh once and replay once on a 401, DPoP nonce retry, step-up passed on with
/// `proxy-status`).
///
/// Pure: nghttp2, driven by `H2Driver` in ProxyIO, does the frames, HPACK and flow-control bookkeeping and
/// reports complete header blocks, body bytes (already kept by the driver) and stream ends; this machine
/// decides what each stream's request means, what the client gets and when the connection ends.
public struct H2Session: Sendable {
    public typealias Stream = Int32

    public enum Event: Sendable, Equatable {
        /// A request header block (`endStream`: no body follows).
        case requestHeaders(Stream, [H2Field], endStream: Bool)
        /// A request header block beyond max_header_bytes or max_headers (`reason` says which); `fields` are
        /// the ones the driver kept before the limit.
        case requestHeadTooLarge(Stream, [H2Field], reason: String)
        /// The driver kept `count` more body bytes of the stream (`endStream`: the last).
        case requestData(Stream, count: Int, endStream: Bool)
        /// Trailer fields after the request body (the body ends with them).
        case requestTrailers(Stream, [H2Field])
        /// The stream closed: both sides ended it, or one reset it (`errorCode` other than NO_ERROR).
        case streamClosed(Stream, errorCode: UInt32)
        case tokens(Stream, Result<TokenGrant, TokenFailure>)
        case refreshed(Stream, Result<TokenGrant, TokenFailure>)
        case credentialFailed(Stream, ProxyAnswer)
        /// The answer to the stream's `.checkResourceMetadata`.
        case resourceMetadata(Stream, ResourceMetadataVerdict)
        case bodyNotKept(Stream, directory: String)
        /// The stream's request body outgrew what the I/O layer may keep for replays: the rest streams, once.
        case bodyBeyondBudget(Stream)
        case transferBody(Stream, count: Int)
        case transferFinished(Stream, UpstreamFailure?, detail: String)
        case timerFired(ConnectionTimer, lastActivity: Int64)
        /// The HTTP/1.1 side of a WebSocket stream ended (its connection closed).
        case tunnelEnded(Stream)
        /// The proxy is shutting down (or reloading): GOAWAY, finish the streams in flight, close.
        case shutdown
        /// The client's connection ended.
        case clientGone
    }

    public enum Action: Sendable, Equatable {
        /// Send the response head of the stream; `endStream` when no body follows.
        case submitResponse(Stream, [H2Field], endStream: Bool)
        /// Send a whole response (the proxy's own answer): head, body, end.
        case respond(Stream, [H2Field], body: [UInt8])
        /// Pass the body bytes of the current transfer callback to the stream.
        case writeBody(Stream)
        /// The response body is complete; trailer fields end the stream when there are any.
        case endStream(Stream, trailers: [H2Field])
        /// Reset the stream (a response cut short, a refused stream).
        case resetStream(Stream, H2ErrorCode)
        /// The stream's request body is not wanted any more (the proxy answered the stream itself, or its
        /// exchange ended): bytes still coming are dropped and their flow-control window given back, so the
        /// client can finish its request (no RST_STREAM(NO_ERROR): clients such as httpx fail the response
        /// they were given when their last DATA finds the stream reset).
        case dropRequestBody(Stream)
        /// The client's trailer fields, for the transfer to send after the request body.
        case requestTrailers(Stream, [H2Field])
        /// An action of the stream's exchange with `origin`, carried out as on an HTTP/1.1 connection.
        case exchange(Stream, ProtectedExchange.Output, OriginConfig)
        case exchangeFinished(Stream, ExchangeRecord)
        /// A stream the proxy answered itself, for the metrics.
        case requestFinished(RequestOutcome)
        /// A stream was refused for a credential it carried (another origin's placeholder): its audit line.
        case auditRefusal(RefusedCredentialUse)
        /// GOAWAY with this code; no new stream is accepted.
        case goaway(H2ErrorCode)
        /// Close the connection once what was submitted is written.
        case closeAfterFlush
        case arm(ConnectionTimer, milliseconds: Int)
        case disarm(ConnectionTimer)
        case log(LogLine)

        // WebSocket streams (RFC 8441): an HTTP/1.1 connection machine carries out the upgrade behind a pair of
        // connected buffers; the stream's DATA goes into it as it comes.
        /// Open the pair for the stream and write this HTTP/1.1 upgrade request into it.
        case openTunnel(Stream, head: [UInt8])
        /// Drop this many bytes of the pair's output (framing of a response body).
        case consumeTunnel(Stream, Int)
        /// Move this many bytes of the pair's output to the stream's DATA.
        case tunnelToStream(Stream, Int)
        /// The client ended its side of the stream: the pair's input ends too (half-close).
        case endTunnelInput(Stream)
        /// Close the pair (the stream is gone, or the answer was whole).
        case closeTunnel(Stream)
    }

    struct StreamState: Sendable {
        /// Boxed: a stream's state is read out of `streams` for every output of its exchange (see `Boxed`).
        @Boxed var exchange: ProtectedExchange
        let headRequest: Bool
        /// The client has the whole response (its stream ended on our side).
        var responseEnded = false
    }

    /// A WebSocket stream: the HTTP/1.1 answer to its upgrade request, read from the pair.
    struct TunnelState: Sendable {
        var parser: HTTPHeadParser
        /// The body (or, once opened, the tunnel's bytes) after the head.
        var body: BodyProgress?
        var opened = false
        var method: String
        var path: String
    }

    public let origin: OriginConfig
    public let frontDoor: FrontDoor
    /// Every stream's exchange is with `origin`: its settings are made once.
    let exchangeSettings: ProtectedExchange.Settings
    /// Set when the SNI named another host: every request gets 421 and no token.
    let misdirected: String?
    var streams: [Stream: StreamState] = [:]
    var tunnels: [Stream: TunnelState] = [:]
    /// Makes each WebSocket key (RFC 6455 §4.1: random per handshake); seeded by the I/O layer.
    var keyState: UInt64
    var draining = false
    var closing = false
    var now: Int64 = 0
    /// Streams opened on this connection, for the log.
    public private(set) var requests = 0

    public init(origin: OriginConfig, frontDoor: FrontDoor, misdirected: String?, keySeed: UInt64 = 0) {
        self.origin = origin
        self.frontDoor = frontDoor
        self.misdirected = misdirected
        self.keyState = keySeed
        exchangeSettings = frontDoor.exchangeSettings(for: origin)
    }

    var settings: ProxySettings { frontDoor.settings }

    /// Streams in flight.
    public var activeStreams: Int { streams.count + tunnels.count }
    public var isIdle: Bool { streams.isEmpty && tunnels.isEmpty }

    /// The connection begins (after the TLS handshake chose h2).
    public mutating func start(now: Int64, _ out: inout [Action]) {
        self.now = now
        out.append(.arm(.keepAlive, milliseconds: settings.keepAliveTimeout))
    }

    public mutating func handle(_ event: Event, now: Int64, _ out: inout [Action]) {
        self.now = now
        switch event {
        case .requestHeaders(let stream, let fields, let endStream):
            requestHeaders(stream, fields, endStream: endStream, &out)
        case .requestHeadTooLarge(let stream, let fields, let reason):
            // 431 with Proxy-Status, as an HTTP/1.1 head over the limits gets (RFC 9113 §10.5.1).
            requests += 1
            let (method, path) = Self.target(fields)
            refuse(stream, method: method, path: path, .badRequest(HTTPParseError(.headTooLarge, reason)), &out)
        case .requestData(let stream, _, let endStream) where tunnels[stream] != nil:
            if endStream { out.append(.endTunnelInput(stream)) }
        case .requestData(let stream, let count, let endStream):
            exchange(stream, &out) { exchange, outputs in
                if count > 0 { exchange.bodyReceived(count, &outputs) }
                if endStream { exchange.bodyEnded(&outputs) }
            }
        case .requestTrailers(let stream, let fields):
            guard streams[stream] != nil else { return }
            out.append(.requestTrailers(stream, fields))
            exchange(stream, &out) { exchange, outputs in exchange.bodyEnded(&outputs) }
        case .streamClosed(let stream, _) where tunnels[stream] != nil:
            tunnels.removeValue(forKey: stream)
            out.append(.closeTunnel(stream))
            streamsChanged(&out)
        case .tunnelEnded(let stream):
            tunnelEnded(stream, &out)
        case .streamClosed(let stream, let errorCode):
            guard let state = streams[stream] else { return }
            if state.responseEnded && errorCode == H2ErrorCode.noError.rawValue {
                // The whole response went out (a Trailers-Only answer, say) while the transfer still runs:
                // the exchange ends, and is recorded, when the transfer does.
                return
            }
            exchange(stream, &out) { exchange, outputs in exchange.abort(&outputs) }
            streams.removeValue(forKey: stream)
            streamsChanged(&out)
        case .tokens(let stream, let result):
            exchange(stream, &out) { exchange, outputs in exchange.tokens(result, &outputs) }
        case .refreshed(let stream, let result):
            exchange(stream, &out) { exchange, outputs in exchange.refreshed(result, &outputs) }
        case .credentialFailed(let stream, let answer):
            exchange(stream, &out) { exchange, outputs in exchange.credentialFailed(answer, &outputs) }
        case .resourceMetadata(let stream, let verdict):
            exchange(stream, &out) { exchange, outputs in exchange.resourceMetadata(verdict, &outputs) }
        case .bodyNotKept(let stream, let directory):
            exchange(stream, &out) { exchange, outputs in exchange.bodyNotKept(directory: directory, &outputs) }
        case .bodyBeyondBudget(let stream):
            exchange(stream, &out) { exchange, outputs in exchange.bodyBeyondBudget(&outputs) }
        case .transferBody(let stream, let count):
            guard let state = streams[stream] else { return }
            if state.exchange.isDelivering {
                // After a head that ended the stream, bytes have nowhere to go.
                if !state.responseEnded { out.append(.writeBody(stream)) }
            } else {
                exchange(stream, &out) { exchange, outputs in exchange.upstreamBody(count, &outputs) }
            }
        case .transferFinished(let stream, let failure, let detail):
            exchange(stream, &out) { exchange, outputs in
                exchange.transferFinished(failure.map { ($0, detail) }, &outputs)
            }
        case .timerFired(let timer, let lastActivity):
            timerFired(timer, lastActivity: lastActivity, &out)
        case .shutdown:
            guard !draining else { return }
            draining = true
            out.append(.goaway(.noError))
            streamsChanged(&out)
        case .clientGone:
            for stream in Array(streams.keys).sorted() {
                exchange(stream, &out) { exchange, outputs in exchange.abort(&outputs) }
            }
            streams.removeAll()
            for stream in tunnels.keys.sorted() { out.append(.closeTunnel(stream)) }
            tunnels.removeAll()
            closing = true
        }
    }

    /// The trailer fields of a stream's transfer response (after its body; gRPC's status).
    public mutating func transferTrailers(_ stream: Stream, _ fields: [H2Field], now: Int64, _ out: inout [Action]) {
        self.now = now
        exchange(stream, &out) { exchange, _ in exchange.upstreamTrailers(fields) }
    }

    /// A stream's response head as the proxy's own client read and parsed it (`OriginExchange`).
    public mutating func transferResponseHead(
        _ stream: Stream, _ received: ReceivedHead, now: Int64, _ out: inout [Action]
    ) {
        self.now = now
        exchange(stream, &out) { exchange, outputs in exchange.upstreamResponseHead(received, &outputs) }
    }

    // MARK: - Requests

    private mutating func requestHeaders(_ stream: Stream, _ fields: [H2Field], endStream: Bool, _ out: inout [Action])
    {
        if streams[stream] != nil {
            // A second header block on a stream is its trailers (nghttp2 tells them apart; this is a guard).
            out.append(.requestTrailers(stream, fields))
            exchange(stream, &out) { exchange, outputs in exchange.bodyEnded(&outputs) }
            return
        }
        requests += 1
        out.append(.disarm(.keepAlive))
        out.append(.arm(.idle, milliseconds: settings.idleTimeout))
        let (method, path) = Self.target(fields)
        if let misdirected {
            return refuse(stream, method: method, path: path, .misdirected(reason: misdirected), &out)
        }
        if draining {
            return out.append(.resetStream(stream, .refusedStream))
        }
        if H2Semantics.isWebSocketConnect(fields) {
            return openWebSocket(stream, fields, method: method, path: path, &out)
        }
        switch H2Semantics.interceptedRequest(fields, endStream: endStream, for: origin) {
        case .failure(let refusal):
            if let use = refusal.refusedUse(origin: origin, method: method, target: path) {
                out.append(.auditRefusal(use))
            }
            refuse(stream, method: method, path: path, refusal.answer, &out)
        case .success(let request):
            var exchange = ProtectedExchange(
                request: request, origin: origin, settings: exchangeSettings, knownNonce: nil)
            var outputs: [ProtectedExchange.Output] = []
            exchange.start(&outputs)
            streams[stream] = StreamState(exchange: exchange, headRequest: request.method == "HEAD")
            apply(stream, outputs, &out)
        }
    }

    /// The request's :method and :path, for the log ("-" when missing).
    static func target(_ fields: [H2Field]) -> (method: String, path: String) {
        let method = fields.first { $0.name == H2Names.method }.map(\.valueText) ?? "-"
        let path = fields.first { $0.name == H2Names.path }.map(\.valueText) ?? "-"
        return (method, path)
    }

    private mutating func refuse(
        _ stream: Stream, method: String, path: String, _ answer: ProxyAnswer, _ out: inout [Action]
    ) {
        out.append(
            .log(
                LogLine(
                    .info,
                    "\(method) \(origin.url)\(LogText.target(path)) status=\(answer.status) answered-by=proxyctl reason=\"\(answer.response.proxyStatus?.details ?? "")\" h2=\(stream)"
                )))
        let (fields, body) = H2Semantics.answer(answer, headRequest: method == "HEAD")
        out.append(.respond(stream, fields, body: body))
        out.append(.dropRequestBody(stream))
        out.append(
            .requestFinished(
                RequestOutcome(
                    kind: .intercepted, status: answer.status,
                    proxyError: answer.response.proxyStatus?.error?.rawValue)))
        streamsChanged(&out)
    }

    // MARK: - WebSocket streams (RFC 8441)

    private mutating func openWebSocket(
        _ stream: Stream, _ fields: [H2Field], method: String, path: String, _ out: inout [Action]
    ) {
        switch H2Semantics.webSocketRequest(fields, origin: origin.authority, key: nextKey()) {
        case .failure(let refusal):
            refuse(stream, method: method, path: path, refusal.answer, &out)
        case .success(let head):
            tunnels[stream] = TunnelState(
                parser: HTTPHeadParser(kind: .response, limits: settings.headLimits), method: method, path: path)
            out.append(.openTunnel(stream, head: head))
        }
    }

    /// A Sec-WebSocket-Key: 16 bytes from the seeded generator, base64.
    private mutating func nextKey() -> String {
        var bytes: [UInt8] = []
        for _ in 0..<2 {
            // SplitMix64.
            keyState &+= 0x9E37_79B9_7F4A_7C15
            var z = keyState
            z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
            z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
            z ^= z >> 31
            bytes += withUnsafeBytes(of: z.bigEndian) { Array($0) }
        }
        return Base64.encode(bytes)
    }

    /// Bytes from the HTTP/1.1 side of a WebSocket stream: the answer's head, then its body, or once the
    /// stream is open, the tunnel's bytes as they come.
    public mutating func tunnelData(_ stream: Stream, _ view: some ByteView, now: Int64, _ out: inout [Action]) {
        self.now = now
        guard var tunnel = tunnels[stream] else { return }
        var offset = 0
        while tunnel.body == nil {
            let (outcome, taken) = view.parseHead(&tunnel.parser, from: offset)
            if taken > 0 { out.append(.consumeTunnel(stream, taken)) }
            offset += taken
            switch outcome {
            case .needMore:
                tunnels[stream] = tunnel
                return
            case .failed(let error):
                tunnels.removeValue(forKey: stream)
                out.append(.closeTunnel(stream))
                let answer = ProxyAnswer.invalidResponse(origin.authority, reason: error.reason)
                let (fields, body) = H2Semantics.answer(answer, headRequest: false)
                out.append(.respond(stream, fields, body: body))
                streamsChanged(&out)
                return
            case .complete(let head, _):
                if head.status < 200 && head.status != 101 {
                    // An interim answer: the final one follows in these bytes or later ones.
                    tunnel.parser = HTTPHeadParser(kind: .response, limits: settings.headLimits)
                    continue
                }
                let (fields, opened, framing) = H2Semantics.webSocketResponse(head)
                tunnel.opened = opened
                tunnel.body = BodyProgress(framing)
                out.append(.submitResponse(stream, fields, endStream: framing == .none))
                out.append(
                    .log(
                        LogLine(
                            .debug,
                            "\(origin.url)\(LogText.target(tunnel.path)) extended CONNECT answered \(head.status)\(opened ? "; WebSocket open" : "") h2=\(stream)"
                        )))
                if framing == .none {
                    tunnels.removeValue(forKey: stream)
                    out.append(.closeTunnel(stream))
                    streamsChanged(&out)
                    return
                }
            }
        }
        guard var body = tunnel.body else { return }
        var spans: [BodySpan] = []
        if body.take(from: view, at: offset, into: &spans) != nil {
            tunnels.removeValue(forKey: stream)
            out.append(.closeTunnel(stream))
            out.append(.resetStream(stream, .internalError))
            streamsChanged(&out)
            return
        }
        for span in spans {
            switch span {
            case .pass(let count): out.append(.tunnelToStream(stream, count))
            case .drop(let count): out.append(.consumeTunnel(stream, count))
            }
        }
        tunnel.body = body
        tunnels[stream] = tunnel
        if body.isComplete {
            tunnels.removeValue(forKey: stream)
            out.append(.endStream(stream, trailers: []))
            out.append(.closeTunnel(stream))
            streamsChanged(&out)
        }
    }

    private mutating func tunnelEnded(_ stream: Stream, _ out: inout [Action]) {
        guard let tunnel = tunnels.removeValue(forKey: stream) else { return }
        out.append(.closeTunnel(stream))
        if tunnel.body == nil {
            let answer = ProxyAnswer.responseIncomplete(origin.authority)
            let (fields, body) = H2Semantics.answer(answer, headRequest: false)
            out.append(.respond(stream, fields, body: body))
        } else if tunnel.opened || tunnel.body?.framing == .untilClose {
            // The WebSocket (or a body read until the close) ended: the stream ends cleanly.
            out.append(.endStream(stream, trailers: []))
        } else {
            out.append(.resetStream(stream, .internalError))
        }
        streamsChanged(&out)
    }

    // MARK: - Exchanges

    /// Runs an event of a stream's exchange, if the stream is in flight.
    private mutating func exchange(
        _ stream: Stream, _ out: inout [Action],
        _ body: (inout ProtectedExchange, inout [ProtectedExchange.Output]) -> Void
    ) {
        guard streams[stream] != nil else { return }
        var outputs: [ProtectedExchange.Output] = []
        // In place (the dictionary's storage and the box stay uniquely referenced): no copy of the exchange.
        body(&streams[stream]!.exchange, &outputs)
        apply(stream, outputs, &out)
    }

    /// Carries a stream's exchange outputs over to HTTP/2. The stream's state is looked up once (its exchange
    /// is only read here) and its `responseEnded` written back at the end.
    private mutating func apply(_ stream: Stream, _ outputs: [ProtectedExchange.Output], _ out: inout [Action]) {
        guard let state = streams[stream] else { return }
        var responseEnded = state.responseEnded
        defer { if responseEnded != state.responseEnded { streams[stream]?.responseEnded = responseEnded } }
        for output in outputs {
            switch output {
            case .deliverHead(let response):
                let (fields, hasBody) = H2Semantics.responseHead(response, requestMethod: state.exchange.request.method)
                out.append(.submitResponse(stream, fields, endStream: !hasBody))
                if !hasBody { responseEnded = true }
            case .deliverBody:
                if !responseEnded { out.append(.writeBody(stream)) }
            case .endBody(let trailers):
                guard !responseEnded else { break }
                responseEnded = true
                out.append(.endStream(stream, trailers: H2Semantics.trailers(trailers.map { ($0.nameText, $0.value) })))
            case .respond(let answer):
                let (fields, body) = H2Semantics.answer(answer, headRequest: state.headRequest)
                out.append(.respond(stream, fields, body: body))
                responseEnded = true
            case .finished(let record):
                out.append(.dropRequestBody(stream))
                out.append(.exchangeFinished(stream, record))
                if record.cutShort && !responseEnded {
                    // A response cut short: the client must not take it for complete.
                    out.append(.resetStream(stream, .internalError))
                }
                streams.removeValue(forKey: stream)
                streamsChanged(&out)
                return
            default:
                out.append(.exchange(stream, output, origin))
            }
        }
    }

    /// After a stream ended: the keep-alive timer when none is left, and the end of a draining connection.
    private mutating func streamsChanged(_ out: inout [Action]) {
        guard streams.isEmpty && tunnels.isEmpty else { return }
        out.append(.disarm(.idle))
        if draining {
            closing = true
            out.append(.closeAfterFlush)
        } else {
            out.append(.arm(.keepAlive, milliseconds: settings.keepAliveTimeout))
        }
    }

    private mutating func timerFired(_ timer: ConnectionTimer, lastActivity: Int64, _ out: inout [Action]) {
        switch timer {
        case .keepAlive where isIdle:
            draining = true
            out.append(.goaway(.noError))
            out.append(.closeAfterFlush)
        case .idle where !isIdle:
            let remaining = Int64(settings.idleTimeout) - (now - lastActivity)
            if remaining > 0 {
                out.append(.arm(.idle, milliseconds: Int(remaining)))
            } else {
                out.append(
                    .log(LogLine(.info, "h2 connection idle for \(LogText.duration(now - lastActivity)); closing")))
                handle(.clientGone, now: now, &out)
                out.append(.goaway(.noError))
                out.append(.closeAfterFlush)
            }
        default:
            break
        }
    }
}

/// HTTP/2 error codes the proxy sends (RFC 9113 §7).
public enum H2ErrorCode: UInt32, Sendable, Equatable {
    case noError = 0x0
    case protocolError = 0x1
    case internalError = 0x2
    case refusedStream = 0x7
    case cancel = 0x8
    case enhanceYourCalm = 0xb
}
