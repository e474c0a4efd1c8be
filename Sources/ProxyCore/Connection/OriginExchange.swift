/// One request on the proxy's own client to an origin, in HTTP/1.1 or HTTP/2 (whichever the origin chose by
/// ALPN on the connection it goes on): which connection it goes on, its body sent as the owner has it, when it is
/// sent again, when it has timed out, what of the response reaches the owner and whether the connection goes back
/// to the pool. Events in, actions out; ProxyIO's `OriginTransfer` carries them out on an `OriginConnection` (or a
/// stream of an `OriginH2Session` on one).
///
/// An HTTP/1.1 response is read by `ResponseReader`, an HTTP/2 response head by `H2Semantics.originResponseHead`:
/// both by the one head parser and `MessageSemantics.response`. A request goes on a kept connection when there is
/// one; when such a connection closes or breaks before a byte of the response arrived (the origin had closed it
/// while it was idle, the usual race of keep-alive), the request is sent once more on a new connection, only if
/// `RetryPolicy` allows it (RFC 9110 §9.2.2): a request with a body, or one that is not idempotent, reaches the
/// origin at most once. A stream the origin proved it did not process (RST_STREAM with REFUSED_STREAM, or a
/// GOAWAY whose last stream id is below it: RFC 9113 §8.7) is sent once more whatever its method.
///
/// The request body is the owner's (kept for a replay, or streaming). In HTTP/1.1 the exchange asks for it a
/// piece at a time (`.readBody`) and frames each piece as the head announced: as it is for a Content-Length, in
/// a chunk for a chunked body, whose end is the last chunk with the trailer fields the owner has. In HTTP/2
/// nghttp2 asks for it as the flow-control windows open, and DATA frames carry it.
public struct OriginExchange: Sendable {
    public enum Event: Sendable, Equatable {
        /// A connection is ready: one kept from an earlier request (`reused`), or a new one (TCP, then TLS to
        /// an https origin, done); `http2`: the origin chose HTTP/2, and the request goes on a stream of it.
        case connected(reused: Bool, http2: Bool = false)
        /// No connection could be made.
        case connectFailed(UpstreamFailure, detail: String)
        /// The origin closed its sending side.
        case closed
        /// The connection broke (a read or write error).
        case broken(detail: String)
        /// The timer fired; `idle`: milliseconds since a byte last moved on the connection.
        case timerFired(idle: Int)
        /// The owner no longer wants the response.
        case cancel
        /// The answer to `.readBody`: this many bytes of the request body were read (more than 0).
        case bodyRead(Int)
        /// The answer to `.readBody`: the owner has no more bytes yet (`.bodyResumed` when it has).
        case bodyPaused
        /// The owner has more of the request body after `.bodyPaused`.
        case bodyResumed
        /// The answer to `.readBody`: the request body is complete; `trailers` are its trailer fields.
        case bodyEnded(trailers: [H2Field])
        /// HTTP/2: a header block of the response (an interim one, or the final).
        case streamHead([H2Field])
        /// HTTP/2: the response's header block was larger than the limits of a head (`reason` says which).
        case streamHeadTooLarge(reason: String)
        /// HTTP/2: the trailer fields after the response's body.
        case streamTrailers([H2Field])
        /// HTTP/2: the stream ended (END_STREAM from the origin).
        case streamEnded
        /// HTTP/2: the stream ended without its response: `refused` when the origin proved it did not process
        /// it (REFUSED_STREAM, or beyond a GOAWAY's last stream id), else reset or the connection lost.
        case streamFailed(refused: Bool, detail: String)
        /// The answer to `.rewindBody`: whether the request body can be read again from its start.
        case bodyRewound(Bool)
        /// A new connection to the upstream proxy is up (TCP) for a tunnel to an https origin: the exchange
        /// asks the proxy for it.
        case proxyConnected
    }

    public enum Action: Sendable, Equatable {
        /// Get a connection to the origin: a kept one if `reuse` and there is one, else a new one. `.connected`
        /// or `.connectFailed` follows.
        case connect(reuse: Bool)
        /// (Re)arm the exchange's one timer.
        case arm(milliseconds: Int)
        /// HTTP/1.1: write these bytes to the connection.
        case write([UInt8])
        /// HTTP/1.1: read up to this many bytes of the request body from the owner (once the connection has room
        /// for them): `.bodyRead`, `.bodyPaused` or `.bodyEnded` follows.
        case readBody(max: Int)
        /// HTTP/1.1: write the bytes of the request body the last `.bodyRead` counted.
        case writeBody(Int)
        /// Read the request body from its start again, for a resend: `.bodyRewound` follows.
        case rewindBody
        /// The upstream proxy opened the tunnel: TLS to the origin over it. `.connected` (or `.connectFailed`)
        /// follows.
        case startTLS
        /// HTTP/2: open a stream with this request header block; `body`: DATA follows, read from the owner as
        /// the windows open, then the owner's trailer fields, if any.
        case submit([H2Field], body: Bool)
        /// A response head (an interim one or the final), parsed, for the owner.
        case deliverHead(ReceivedHead)
        /// Body bytes at this range of the input just received, for the owner.
        case deliverBody(Range<Int>)
        /// The response's trailer fields (a chunked body's trailer section, parsed; HTTP/2 trailers), for the owner.
        case deliverTrailers([H2Field])
        /// The origin switched protocols (a 101 to an upgrade request; its `.deliverHead` follows): the connection
        /// becomes the owner's, for a tunnel, after the first `headBytes` bytes of the input just received (the end
        /// of the 101's head) are dropped; what follows them is the new protocol's. Nothing goes back to the pool.
        case switchProtocols(headBytes: Int)
        /// Done with the connection (or the attempt to make one, or the stream): back to the pool if `reusable`,
        /// else closed (a stream still open is reset).
        case release(reusable: Bool)
        /// The exchange is over: the response was complete (nil), or why not.
        case finish(UpstreamFailure?, detail: String)
        /// A line for the log (a request sent again).
        case log(String)
    }

    /// How the request body is framed on the wire (as the head announced it).
    public enum Body: Sendable, Equatable {
        case none
        /// `Content-Length: n`.
        case length(Int)
        /// `Transfer-Encoding: chunked` (DATA frames in HTTP/2), of a length nobody knows in advance.
        case chunked
    }

    /// The request as it goes out, whichever protocol carries it.
    public struct Request: Sendable {
        public let method: String
        public let url: AbsoluteURL
        /// A request target other than the URL's path and query (only `*`).
        public let target: String?
        public let fields: [(name: String, value: [UInt8])]
        public let body: Body
        /// The credential's fields (`Authorization`, `DPoP`), added last.
        public let credential: [(name: String, value: [UInt8])]
        /// The upstream proxy the request goes through: a CONNECT tunnel to an https origin, the absolute-form
        /// request (with its `Proxy-Authorization`) to an http one.
        public let proxy: UpstreamProxy?
        /// An upgrade request (its `Connection: Upgrade` and `Upgrade` among `fields`): it goes on a new
        /// HTTP/1.1 connection, and a 101 hands that connection over (`.switchProtocols`).
        public let upgrade: Bool

        public init(
            method: String, url: AbsoluteURL, target: String? = nil, fields: [(name: String, value: [UInt8])],
            body: Body = .none, credential: [(name: String, value: [UInt8])], proxy: UpstreamProxy? = nil,
            upgrade: Bool = false
        ) {
            self.upgrade = upgrade
            self.method = method
            self.url = url
            self.target = target
            self.fields = fields
            self.body = body
            self.credential = credential
            self.proxy = proxy
        }

        /// Whether the request goes through a tunnel the upstream proxy opens (an https origin through a proxy).
        public var tunnelled: Bool { proxy != nil && url.scheme == "https" }

        /// The HTTP/1.1 head: to an http origin through a proxy, in absolute form with the proxy's credentials
        /// (RFC 9112 §3.2.2).
        var http1Head: [UInt8] {
            guard let proxy, url.scheme == "http" else {
                return UpstreamRequest.http1Head(
                    method: method, url: url, target: target, fields: fields, body: body, credential: credential)
            }
            var sent = fields
            if let authorization = proxy.authorization {
                sent.append(("Proxy-Authorization", Array(authorization.utf8)))
            }
            return UpstreamRequest.http1Head(
                method: method, url: url,
                target: "http://\(url.hostFieldValue)\(target == "*" ? "" : url.pathAndQuery)",
                fields: sent, body: body, credential: credential)
        }

        /// The HTTP/2 header block.
        var http2Fields: [H2Field] {
            H2Semantics.originRequest(
                method: method, url: url, target: target, fields: fields, body: body, credential: credential)
        }
    }

    private enum Phase: Sendable {
        /// Waiting for a connection; `resent`: this is the one retry.
        case connecting(resent: Bool)
        /// Our CONNECT went to the upstream proxy: reading its answer. -> `.connecting` (TLS to the origin),
        /// `.done`
        case tunnelling(HTTPHeadParser, resent: Bool)
        /// A request with a body is to be sent again: waiting for the owner to rewind it (`.bodyRewound`), then a
        /// connection (`reuse`: a kept one may do). -> `.connecting(resent: true)`, `.done`
        case rewinding(reuse: Bool)
        /// The request went out on a connection; `reused`: a kept one; `answered`: a byte of the response came
        /// (HTTP/2: its first header block); `http2`: on a stream.
        case exchanging(reused: Bool, answered: Bool, resent: Bool, http2: Bool)
        case done
    }

    /// Where sending the request body is (HTTP/1.1).
    private enum Sending: Sendable, Equatable {
        /// Not begun (no connection yet).
        case idle
        /// A `.readBody` is out.
        case reading
        /// The owner had nothing more: `.bodyResumed` asks again.
        case waiting
        /// The whole body (and a chunked body's last chunk) is written, or nghttp2 sends it.
        case sent
    }

    public var method: String { request.method }
    private let request: Request
    private var body: Body { request.body }
    private let connectTimeout: Int
    private let idleTimeout: Int
    private let limits: HTTPHeadLimits
    private var reader: ResponseReader
    private var phase = Phase.connecting(resent: false)
    private var sending = Sending.idle
    /// Bytes of the request body written so far (chunk framing left out).
    private var bodySent = 0
    /// HTTP/2: the final response head came.
    private var finalHead = false
    private var outputs: [ResponseReader.Output] = []

    /// The most a `.readBody` asks for.
    public static let bodyPiece = 64 * 1024

    /// `limits`: those of the response head (the owner reads the head as parsed here, not again).
    public init(request: Request, connectTimeout: Int, idleTimeout: Int, limits: HTTPHeadLimits = HTTPHeadLimits()) {
        self.request = request
        self.connectTimeout = connectTimeout
        self.idleTimeout = idleTimeout
        self.limits = limits
        reader = ResponseReader(requestMethod: request.method, upgradeRequested: request.upgrade, limits: limits)
    }

    public var isFinished: Bool {
        if case .done = phase { true } else { false }
    }
    /// Whether the exchange waits for the owner to have more of the request body (`.bodyResumed`).
    public var isWaitingForBody: Bool { !isFinished && sending == .waiting }

    public mutating func start(_ out: inout [Action]) {
        out.append(.arm(milliseconds: connectTimeout))
        // An upgrade takes its connection away for good: a new one, never one the pool keeps for others.
        out.append(.connect(reuse: !request.upgrade))
    }

    public mutating func handle(_ event: Event, _ out: inout [Action]) {
        switch (event, phase) {
        case (_, .done):
            break
        case (.connected(_, true), .connecting) where request.upgrade:
            // HTTP/2 is not offered for an upgrade (RFC 8441's extended CONNECT is not spoken to origins).
            out.append(.release(reusable: false))
            finish(.protocolError, "the origin chose HTTP/2 for an upgrade request", &out)
        case (.connected(let reused, let http2), .connecting(let resent)):
            phase = .exchanging(reused: reused, answered: false, resent: resent, http2: http2)
            if http2 {
                sending = .sent
                finalHead = false
                out.append(.submit(request.http2Fields, body: body != .none && body != .length(0)))
                out.append(.arm(milliseconds: idleTimeout))
            } else {
                out.append(.write(request.http1Head))
                out.append(.arm(milliseconds: idleTimeout))
                beginBody(&out)
            }
        case (.connected, .exchanging), (.connected, .tunnelling):
            preconditionFailure("a second connection for one exchange")
        case (.proxyConnected, .connecting(let resent)):
            guard let proxy = request.proxy else { preconditionFailure("a tunnel without an upstream proxy") }
            phase = .tunnelling(HTTPHeadParser(kind: .response, limits: limits), resent: resent)
            out.append(.write(proxy.connectRequest(to: request.url.authority)))
        case (.proxyConnected, _):
            preconditionFailure("a proxy connection for an exchange not connecting")
        case (.closed, .tunnelling), (.broken, .tunnelling):
            out.append(.release(reusable: false))
            finish(.proxyClosed, "the upstream proxy closed the connection during CONNECT", &out)
        case (.timerFired, .tunnelling):
            out.append(.release(reusable: false))
            finish(.proxyTimeout, "no answer to CONNECT within \(connectTimeout) ms", &out)
        case (.connectFailed(let failure, let detail), .tunnelling):
            finish(failure, detail, &out)
        case (.connectFailed(let failure, let detail), .connecting):
            finish(failure, detail, &out)
        case (.connectFailed, .exchanging):
            preconditionFailure("a connection failed after it was made")
        case (.closed, .exchanging(let reused, let answered, let resent, false)):
            if resendIfStale(reused: reused, answered: answered, resent: resent, "closed", &out) { return }
            reader.closed(&outputs)
            translate(consumed: 0, of: 0, closing: true, &out)
        case (.broken(let detail), .exchanging(let reused, let answered, let resent, false)):
            if resendIfStale(reused: reused, answered: answered, resent: resent, "broke", &out) { return }
            out.append(.release(reusable: false))
            finish(.incomplete, detail, &out)
        case (.closed, .exchanging(_, _, _, true)):
            streamFailed(refused: false, detail: "the origin closed the connection", &out)
        case (.broken(let detail), .exchanging(_, _, _, true)):
            streamFailed(refused: false, detail: detail, &out)
        case (.closed, .connecting), (.broken, .connecting):
            // Nothing of a connection being made is read yet: its failure comes as `.connectFailed`.
            break
        case (.timerFired, .connecting):
            out.append(.release(reusable: false))
            finish(.timeout, "no connection within \(connectTimeout) ms", &out)
        case (.timerFired(let idle), .exchanging):
            if idle >= idleTimeout {
                out.append(.release(reusable: false))
                finish(.timeout, "no byte from the origin for \(idleTimeout) ms", &out)
            } else {
                out.append(.arm(milliseconds: idleTimeout - idle))
            }
        case (.cancel, _):
            phase = .done
            out.append(.release(reusable: false))
        case (.bodyRead(let count), .exchanging(_, _, _, false)):
            bodyRead(count, &out)
        case (.bodyPaused, .exchanging(_, _, _, false)):
            precondition(sending == .reading, "a body answer without a .readBody")
            sending = .waiting
        case (.bodyResumed, .exchanging(_, _, _, false)):
            guard sending == .waiting else { return }
            askForBody(&out)
        case (.bodyEnded(let trailers), .exchanging(_, _, _, false)):
            bodyEnded(trailers, &out)
        case (.bodyRead, _), (.bodyPaused, _), (.bodyEnded, _):
            preconditionFailure("a body answer without a .readBody")
        case (.bodyResumed, _):
            // Not waiting (no connection yet, or nghttp2 reads the body): nothing to ask for.
            break
        case (.bodyRewound(true), .rewinding(let reuse)):
            phase = .connecting(resent: true)
            out.append(.arm(milliseconds: connectTimeout))
            out.append(.connect(reuse: reuse))
        case (.bodyRewound(false), .rewinding):
            finish(
                .incomplete,
                "the origin did not process the request, but its body was too large to keep, so it was not sent again",
                &out)
        case (.bodyRewound, _):
            preconditionFailure("a rewind answer without a .rewindBody")
        case (.timerFired, .rewinding), (.closed, .rewinding), (.broken, .rewinding):
            // The rewind is answered at once (no connection, no timer).
            break
        case (.connected, .rewinding), (.connectFailed, .rewinding):
            preconditionFailure("a connection while rewinding the body")
        case (.streamHead(let fields), .exchanging(let reused, _, let resent, true)):
            phase = .exchanging(reused: reused, answered: true, resent: resent, http2: true)
            streamHead(fields, &out)
        case (.streamHeadTooLarge(let reason), .exchanging(_, _, _, true)):
            out.append(.release(reusable: false))
            finish(.headTooLarge, reason, &out)
        case (.streamTrailers(let fields), .exchanging(_, _, _, true)):
            guard finalHead else {
                out.append(.release(reusable: false))
                return finish(.protocolError, "trailer fields before the response", &out)
            }
            // Pseudo-fields have no place in trailers (RFC 9113 §8.1): nghttp2 refuses them; none reaches the owner.
            out.append(.deliverTrailers(fields.filter { $0.name.first != UInt8(ascii: ":") }))
        case (.streamEnded, .exchanging(_, _, _, true)):
            guard finalHead else {
                out.append(.release(reusable: false))
                return finish(.incomplete, "the stream ended without a response", &out)
            }
            out.append(.release(reusable: true))
            finish(nil, "", &out)
        case (.streamFailed(let refused, let detail), .exchanging(_, _, _, true)):
            streamFailed(refused: refused, detail: detail, &out)
        case (.streamHead, _), (.streamHeadTooLarge, _), (.streamTrailers, _), (.streamEnded, _),
            (.streamFailed, _):
            preconditionFailure("a stream event without a stream")
        }
    }

    // MARK: - HTTP/2

    private mutating func streamHead(_ fields: [H2Field], _ out: inout [Action]) {
        guard !finalHead else {
            // nghttp2 hands a header block after the final head over as trailers.
            out.append(.release(reusable: false))
            return finish(.protocolError, "a second response head", &out)
        }
        switch H2Semantics.originResponseHead(fields, requestMethod: request.method, limits: limits) {
        case .failure(let error):
            out.append(.release(reusable: false))
            finish(Self.failure(error), "\(error)", &out)
        case .success(let received):
            if received.head.status >= 200 { finalHead = true }
            out.append(.deliverHead(received))
        }
    }

    /// A stream that ended without its response: sent once more when the origin proved it untouched, or (as a
    /// kept HTTP/1.1 connection that ended) when it went on a reused connection, had no answer and may be resent.
    private mutating func streamFailed(refused: Bool, detail: String, _ out: inout [Action]) {
        guard case .exchanging(let reused, let answered, let resent, _) = phase else { return }
        if !answered && !resent && (refused || (reused && RetryPolicy.mayResend(method: method, framing: framing))) {
            phase = .connecting(resent: true)
            sending = .idle
            out.append(.release(reusable: false))
            out.append(
                .log(
                    refused
                        ? "the origin did not process the stream (\(detail)); \(method) sent again"
                        : "the kept connection to the origin ended before answering; \(method) sent again on a new connection"
                ))
            // A refusal of the stream alone (too many at once) leaves the connection usable.
            if body == .none || body == .length(0) {
                out.append(.arm(milliseconds: connectTimeout))
                out.append(.connect(reuse: refused))
            } else {
                // The body was read (some of it) for the first stream: from its start again, if it was kept.
                phase = .rewinding(reuse: refused)
                out.append(.rewindBody)
            }
            return
        }
        out.append(.release(reusable: false))
        finish(.incomplete, detail, &out)
    }

    // MARK: - The request body

    /// The head is written: the body follows, as the owner has it.
    private mutating func beginBody(_ out: inout [Action]) {
        bodySent = 0
        switch body {
        case .none, .length(0): sending = .sent
        case .length, .chunked: askForBody(&out)
        }
    }

    private mutating func askForBody(_ out: inout [Action]) {
        var most = Self.bodyPiece
        if case .length(let length) = body { most = min(most, length - bodySent) }
        sending = .reading
        out.append(.readBody(max: most))
    }

    private mutating func bodyRead(_ count: Int, _ out: inout [Action]) {
        precondition(sending == .reading && count > 0, "body bytes without a .readBody")
        bodySent += count
        switch body {
        case .none:
            preconditionFailure("body bytes for a request without a body")
        case .length(let length):
            precondition(bodySent <= length, "more body bytes than were asked for")
            out.append(.writeBody(count))
            if bodySent == length {
                sending = .sent
            } else {
                askForBody(&out)
            }
        case .chunked:
            out.append(.write(ChunkedFraming.header(count)))
            out.append(.writeBody(count))
            out.append(.write(ChunkedFraming.dataEnd))
            askForBody(&out)
        }
    }

    private mutating func bodyEnded(_ trailers: [H2Field], _ out: inout [Action]) {
        precondition(sending == .reading, "a body answer without a .readBody")
        switch body {
        case .none:
            preconditionFailure("a body end for a request without a body")
        case .length(let length):
            // The client's framing ended the body before its length: the request cannot be whole.
            out.append(.release(reusable: false))
            finish(.other, "the request body ended \(length - bodySent) bytes before its Content-Length", &out)
        case .chunked:
            sending = .sent
            out.append(.write(ChunkedFraming.last(trailers: trailers)))
        }
    }

    // MARK: - The response

    /// Response bytes arrived; returns how many were read (all of them, unless the response ended before them:
    /// then the connection is not reused, its peer being out of step).
    public mutating func received(_ input: UnsafeRawBufferPointer, _ out: inout [Action]) -> Int {
        if case .tunnelling(var parser, let resent) = phase { return proxyAnswer(input, &parser, resent: resent, &out) }
        guard case .exchanging(let reused, _, let resent, let http2) = phase else { return input.count }
        phase = .exchanging(reused: reused, answered: true, resent: resent, http2: http2)
        if http2 {
            // DATA of the stream: the body as it is (HTTP/2 frames it; nghttp2 checks it against content-length).
            out.append(.deliverBody(0..<input.count))
            return input.count
        }
        // A response is a head, body pieces and its end: room for them at once, not grown three times.
        if outputs.capacity == 0 { outputs.reserveCapacity(4) }
        let consumed = reader.read(input, &outputs)
        translate(consumed: consumed, of: input.count, closing: false, &out)
        return consumed
    }

    /// The upstream proxy's answer to our CONNECT: the tunnel is open (TLS to the origin next), or the exchange
    /// ends with the proxy's refusal. Nothing may follow the answer before our TLS begins.
    private mutating func proxyAnswer(
        _ input: UnsafeRawBufferPointer, _ parser: inout HTTPHeadParser, resent: Bool, _ out: inout [Action]
    ) -> Int {
        switch parser.parse(input) {
        case .needMore:
            phase = .tunnelling(parser, resent: resent)
            return input.count
        case .failed(let error):
            out.append(.release(reusable: false))
            finish(.proxyMalformed, "the upstream proxy's answer to CONNECT: \(error)", &out)
            return input.count
        case .complete(let head, let consumed):
            if (200..<300).contains(head.status), consumed == input.count {
                phase = .connecting(resent: resent)
                out.append(.startTLS)
            } else if (200..<300).contains(head.status) {
                out.append(.release(reusable: false))
                finish(.proxyMalformed, "the upstream proxy sent bytes after its answer to CONNECT", &out)
            } else {
                out.append(.release(reusable: false))
                finish(
                    .proxyRefused(status: head.status), "the upstream proxy answered \(head.status) to CONNECT", &out)
            }
            return consumed
        }
    }

    /// `closing`: the outputs of the origin's close (a failure then means the response was cut short).
    private mutating func translate(consumed: Int, of count: Int, closing: Bool, _ out: inout [Action]) {
        for output in outputs {
            switch output {
            case .head(let received):
                if received.semantics?.switchesProtocols == true { out.append(.switchProtocols(headBytes: consumed)) }
                out.append(.deliverHead(received))
            case .switched:
                finish(nil, "", &out)
            case .body(let range):
                out.append(.deliverBody(range))
            case .trailers(let fields):
                out.append(.deliverTrailers(fields))
            case .end(let reusable):
                // A response that came before the whole request body went out (a 401, a 413) leaves the
                // connection in the middle of a request: it is closed.
                out.append(.release(reusable: reusable && consumed == count && sending == .sent))
                finish(nil, "", &out)
            case .failed(let error):
                out.append(.release(reusable: false))
                finish(closing ? .incomplete : Self.failure(error), "\(error)", &out)
            }
        }
        outputs.emptyKeepingStorage()
    }

    /// A kept connection that ended before a byte of the response: the request is sent again on a new one
    /// when its method allows (once).
    private mutating func resendIfStale(
        reused: Bool, answered: Bool, resent: Bool, _ how: String, _ out: inout [Action]
    ) -> Bool {
        guard reused, !answered, !resent, RetryPolicy.mayResend(method: method, framing: framing) else {
            return false
        }
        phase = .connecting(resent: true)
        sending = .idle
        out.append(.release(reusable: false))
        out.append(
            .log("the kept connection to the origin \(how) before answering; \(method) sent again on a new connection"))
        out.append(.arm(milliseconds: connectTimeout))
        out.append(.connect(reuse: false))
        return true
    }

    /// The body's framing in `RetryPolicy`'s terms.
    private var framing: BodyFraming {
        switch body {
        case .none: .none
        case .length(let length): .contentLength(UInt64(length))
        case .chunked: .chunked
        }
    }

    private mutating func finish(_ failure: UpstreamFailure?, _ detail: String, _ out: inout [Action]) {
        phase = .done
        out.append(.finish(failure, detail: detail))
    }

    /// What a response that cannot be read means to the proxy's answer.
    public static func failure(_ error: HTTPParseError) -> UpstreamFailure {
        switch error.code {
        case .headTooLarge, .startLineTooLong: .headTooLarge
        case .malformed, .versionNotSupported, .badFraming, .badChunk: .protocolError
        }
    }
}

extension UpstreamRequest {
    /// Whether the request may be sent again when a reused connection ends before a byte of the answer came
    /// (RFC 9110 §9.2.2, `RetryPolicy`): idempotent and without a body.
    public var mayResend: Bool {
        RetryPolicy.mayResend(method: method, framing: body == .none ? .none : .chunked)
    }

    /// How the own client frames the request body.
    public var originBody: OriginExchange.Body {
        switch body {
        case .none: .none
        case .length(let length): .length(length)
        case .streaming: .chunked
        }
    }
}
