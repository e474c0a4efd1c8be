/// Requests to protected origins on an HTTP/1.1 connection: the body read into the replay store, the
/// `ProtectedExchange` run, its response framed for an HTTP/1.1 client.
///
/// An upgrade (WebSocket, RFC 6455) is such a request too, on either way in (inside an intercepted TLS tunnel, or
/// a plain request to a protected `http://` origin; an HTTP/2 client's RFC 8441 stream reaches it as one): the
/// exchange attaches the credential and reads the answer like any other (a 401 refreshed once and replayed once,
/// a DPoP nonce retried once, the origin's resource metadata checked, a step-up passed on), on a new connection of
/// the proxy's own client; after the origin's 101 that connection and the client's become a tunnel.
extension ConnectionMachine {
    static let continueResponse = Array("HTTP/1.1 100 Continue\r\n\r\n".utf8)

    mutating func beginProtected(
        _ request: InterceptedRequest, origin: OriginConfig, kept: HostPort?, head: HTTPHead, _ out: inout [Action]
    ) {
        var kept = kept
        if request.upgrade {
            if kept != nil {
                // The tunnel's upstream is the exchange's connection: a kept one of a forwarded request goes.
                out.append(.disarm(.upstreamKeepAlive))
                out.append(.closeUpstream)
                kept = nil
            }
            if request.framing != .none {
                return refuse(
                    head, origin: origin, .unsupported(reason: "an upgrade request with a body is not supported"),
                    &out)
            }
        }
        state = .intercepting(
            Intercepting(
                exchange: ProtectedExchange(
                    request: request, origin: origin, settings: frontDoor.exchangeSettings(for: origin),
                    knownNonce: nil),
                body: BodyReader(request.framing), started: now, headRequest: request.method == "HEAD", framing: nil,
                kept: kept))
        out.append(.arm(.idle, milliseconds: settings.idleTimeout))
        out.append(.readClient(true))
        if request.expectsContinue {
            // RFC 9110 §10.1.1: this proxy reads the body before going upstream, so it answers the
            // expectation itself instead of leaving the client waiting.
            out.append(.writeClient(Self.continueResponse))
        }
        // Started in place: the exchange is not copied out of its box and back.
        exchangeEvent(&out) { exchange, outputs in exchange.start(&outputs) }
    }

    /// Body bytes from the client into the replay store (chunk framing consumed, data kept).
    mutating func pumpInterceptedBody(_ client: some ByteView, _ out: inout [Action]) {
        // Read in place: binding the payload to change it would copy it (a retain of each reference in it), on
        // every pump of a request whose body is all read (every GET).
        guard case .intercepting(let peek) = state else { return }
        if peek.body.done {
            if client.count - clientOffset > settings.headLimits.maxHeadBytes { out.append(.readClient(false)) }
            return
        }
        // Moved out while it changes (see `changeIntercepting`); put back below.
        var taken = State.modifying
        swap(&taken, &state)
        guard case .intercepting(var intercepting) = consume taken else { preconditionFailure("checked above") }
        var kept = 0
        var failure: HTTPParseError?
        while !intercepting.body.done && client.count > clientOffset {
            let available = client.count - clientOffset
            if var scanner = intercepting.body.chunks {
                if scanner.pendingData == 0 {
                    var consumed = 0
                    client.forEachSegment(from: clientOffset) { segment in
                        let before = scanner.position
                        let (taken, outcome) = scanner.scanFraming(segment)
                        if let start = scanner.trailerStart, start < before + UInt64(taken) {
                            // Bytes of the trailer section (its lines, then the blank line that ends the body).
                            let from = start > before ? Int(start - before) : 0
                            intercepting.body.trailerSection += UnsafeRawBufferPointer(rebasing: segment[from..<taken])
                        }
                        consumed += taken
                        if case .failed(let error) = outcome {
                            failure = error
                            return false
                        }
                        return taken == segment.count && scanner.pendingData == 0 && !scanner.isFinished
                    }
                    if consumed > 0 {
                        out.append(.consumeClient(consumed))
                        clientOffset += consumed
                    }
                    intercepting.body.chunks = scanner
                    if failure != nil { break }
                    if scanner.isFinished {
                        intercepting.body.done = true
                        // The fields, read as a head's are: what goes on with the last chunk to the origin
                        // (`ChunkedFraming.last` leaves out those a trailer must not carry).
                        let section = intercepting.body.trailerSection
                        if section.count > 2 {
                            let fields = HTTPHeadParser.trailerFields(
                                Array(section.dropLast(2)), limits: settings.headLimits)
                            if !fields.isEmpty { out.append(.requestTrailers(fields)) }
                        }
                        intercepting.body.trailerSection = []
                    }
                    continue
                }
                let count = Int(min(scanner.pendingData, UInt64(available)))
                scanner.skipData(count)
                intercepting.body.chunks = scanner
                out.append(.keepBody(count))
                clientOffset += count
                kept += count
            } else {
                let count = Int(min(intercepting.body.remaining, UInt64(available)))
                intercepting.body.remaining -= UInt64(count)
                if intercepting.body.remaining == 0 { intercepting.body.done = true }
                out.append(.keepBody(count))
                clientOffset += count
                kept += count
            }
        }
        var outputs: [ProtectedExchange.Output] = []
        if kept > 0 { intercepting.exchange.bodyReceived(kept, &outputs) }
        if let failure {
            out.append(.log(LogLine(.info, "bad request body reason=\"\(failure.reason)\"")))
            intercepting.exchange.refuse(.badRequest(failure), &outputs)
        } else if intercepting.body.done {
            intercepting.exchange.bodyEnded(&outputs)
        }
        let finished = Self.apply(outputs, to: &intercepting, draining: draining, &out)
        state = .intercepting(intercepting)
        if let finished { exchangeDone(finished, &out) }
    }

    /// Runs an event of the exchange in flight, if there is one.
    mutating func exchangeEvent(
        _ out: inout [Action], _ body: (inout ProtectedExchange, inout [ProtectedExchange.Output]) -> Void
    ) {
        var outputs = Array.takeScratch(from: &exchangeOutputs, minimumCapacity: 4)
        let draining = draining
        var finished: ExchangeRecord?
        // The event and its outputs in one move of the payload (see `changeIntercepting`), not one per output.
        changeIntercepting { intercepting in
            body(&intercepting.exchange, &outputs)
            finished = Self.apply(outputs, to: &intercepting, draining: draining, &out)
        }
        if let finished { exchangeDone(finished, &out) }
        outputs.returnScratch(to: &exchangeOutputs)
    }

    /// Changes the data of the `.intercepting` state in place. The payload is moved out of `state` first
    /// (the placeholder is never seen: nothing else runs meanwhile), so the arrays inside it (the response
    /// head parser's buffer, the request's fields) stay uniquely referenced and a change does not copy them;
    /// `guard case .intercepting(var x) = state` followed by `state = .intercepting(x)` copies them on every
    /// event (copy on write), the hot path's largest cost after libcurl.
    mutating func changeIntercepting(_ change: (inout Intercepting) -> Void) {
        guard case .intercepting = state else { return }
        // Swapped out, then taken apart: a move, where binding the payload of `state` would copy it (a retain
        // of each reference in it) and the placeholder's assignment would then release them all again.
        var taken = State.modifying
        swap(&taken, &state)
        guard case .intercepting(var intercepting) = consume taken else { preconditionFailure("checked above") }
        change(&intercepting)
        state = .intercepting(intercepting)
    }

    /// Body bytes of the transfer's response (the hot path: one call per libcurl write callback).
    mutating func transferBody(_ count: Int, _ out: inout [Action]) {
        // Two fields read in place (a binding kept across the event below would be a copy of the payload).
        guard case .intercepting(let intercepting) = state else { return }
        let delivering = intercepting.exchange.isDelivering
        let framing = intercepting.framing
        guard delivering else {
            // Not the client's: the exchange counts what it discards.
            exchangeEvent(&out) { exchange, outputs in exchange.upstreamBody(count, &outputs) }
            return
        }
        guard let framing, framing != .none else { return }
        Self.writeResponseBody(count, chunked: framing == .chunked, &out)
    }

    /// `count` bytes of the transfer's response for the client, in a chunk when the response is chunked.
    static func writeResponseBody(_ count: Int, chunked: Bool, _ out: inout [Action]) {
        guard chunked else { return out.append(.writeResponseBody) }
        // RFC 9112 §7.1: the chunk-size line, the data, CRLF.
        out.append(.writeClient(ChunkedFraming.header(count)))
        out.append(.writeResponseBody)
        out.append(.writeClient(ChunkedFraming.dataEnd))
    }

    /// The exchange's outputs as actions for this HTTP/1.1 connection's client, up to the one that finished it
    /// (its record returned: what follows a finished exchange is not its client's any more).
    private static func apply(
        _ outputs: [ProtectedExchange.Output], to intercepting: inout Intercepting, draining: Bool,
        _ out: inout [Action]
    ) -> ExchangeRecord? {
        for output in outputs {
            if let record = apply(output, to: &intercepting, draining: draining, &out) { return record }
        }
        return nil
    }

    /// One output of the exchange as actions for the client; the exchange's record when it finished.
    private static func apply(
        _ output: ProtectedExchange.Output, to intercepting: inout Intercepting, draining: Bool, _ out: inout [Action]
    ) -> ExchangeRecord? {
        switch output {
        case .deliverHead(let response):
            // A 101 keeps the connection: it becomes the tunnel.
            let close =
                !response.semantics.switchesProtocols && (!intercepting.exchange.request.keepAlive || draining)
            let (head, framing) = MessageSemantics.interceptedResponseHead(
                response, requestMethod: intercepting.exchange.request.method, close: close)
            intercepting.framing = framing
            out.append(.writeClient(head))
        case .deliverBody(let count):
            if let framing = intercepting.framing, framing != .none, count > 0 {
                writeResponseBody(count, chunked: framing == .chunked, &out)
            }
        case .endBody(let trailers):
            guard intercepting.framing == .chunked else { break }
            // RFC 9112 §7.1.2: the trailer section of the last chunk, for a client that said TE: trailers.
            let sent = intercepting.exchange.request.acceptsTrailers ? trailers : []
            out.append(.writeClient(ChunkedFraming.last(trailers: sent)))
        case .respond(let answer):
            out.append(.writeClient(answer.response.serialized(headRequest: intercepting.headRequest)))
        case .finished(let record):
            out.append(.exchangeFinished(record))
            return record
        default:
            out.append(.exchange(output, intercepting.exchange.origin))
        }
        return nil
    }

    /// The exchange ended: read the next request, or close.
    private mutating func exchangeDone(_ record: ExchangeRecord, _ out: inout [Action]) {
        guard case .intercepting(let intercepting) = state else { return }
        // A body the client is still sending would be read as the next request: close instead.
        let close =
            record.close || !intercepting.exchange.isBodyComplete || !intercepting.exchange.request.keepAlive
            || clientEOF || draining
        let kept = intercepting.kept
        if record.status == 101 && intercepting.exchange.request.upgrade {
            // The driver takes the exchange's connection to the origin (`OriginExchange`'s `.switchProtocols`).
            let url = AbsoluteURL.parse(record.origin + record.target).map(LogText.url)
            return startTunnel(
                label: .request("\(record.method) \((try? url.get()) ?? record.origin)"), status: 101, &out)
        }
        if close {
            closeAfterFlush(&out)
        } else {
            nextRequest(kept: kept, &out)
        }
    }
}
