/// One request on the proxy's own HTTP/1.1 client to an origin: which connection it goes on, its body sent as
/// the owner has it, when it is sent again, when it has timed out, what of the response reaches the owner and
/// whether the connection goes back to the pool. Events in, actions out; ProxyIO's `OriginTransfer` carries them
/// out on an `OriginConnection`.
///
/// The response is read by `ResponseReader` (so by the one head parser and `MessageSemantics.response`). A
/// request goes on a kept connection when there is one; when such a connection closes or breaks before a
/// byte of the response arrived (the origin had closed it while it was idle, the usual race of keep-alive),
/// the request is sent once more on a new connection, only if `RetryPolicy` allows it (RFC 9110 §9.2.2): a
/// request with a body, or one that is not idempotent, reaches the origin at most once.
///
/// The request body is the owner's (kept for a replay, or streaming): the exchange asks for it a piece at a time
/// (`.readBody`), and frames each piece it is given as the head announced: as it is for a Content-Length, in a
/// chunk for a chunked body, whose end is the last chunk with the trailer fields the owner has.
public struct OriginExchange: Sendable {
    public enum Event: Sendable, Equatable {
        /// A connection is ready: one kept from an earlier request (`reused`), or a new one (TCP, then TLS to
        /// an https origin, done).
        case connected(reused: Bool)
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
    }

    public enum Action: Sendable, Equatable {
        /// Get a connection to the origin: a kept one if `reuse` and there is one, else a new one. `.connected`
        /// or `.connectFailed` follows.
        case connect(reuse: Bool)
        /// (Re)arm the exchange's one timer.
        case arm(milliseconds: Int)
        /// Write these bytes to the connection.
        case write([UInt8])
        /// Read up to this many bytes of the request body from the owner (once the connection has room for
        /// them): `.bodyRead`, `.bodyPaused` or `.bodyEnded` follows.
        case readBody(max: Int)
        /// Write the bytes of the request body the last `.bodyRead` counted.
        case writeBody(Int)
        /// A response head (an interim one or the final), parsed, for the owner.
        case deliverHead(ReceivedHead)
        /// Body bytes at this range of the input just received, for the owner.
        case deliverBody(Range<Int>)
        /// The trailer section of a chunked body (its field lines and the blank line), for the owner.
        case deliverTrailers([UInt8])
        /// Done with the connection (or the attempt to make one): back to the pool if `reusable`, else closed.
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
        /// `Transfer-Encoding: chunked`, of a length nobody knows in advance.
        case chunked
    }

    private enum Phase: Sendable, Equatable {
        /// Waiting for a connection; `resent`: this is the one retry.
        case connecting(resent: Bool)
        /// The head was written on a connection; `reused`: a kept one; `answered`: a byte of the response came.
        case exchanging(reused: Bool, answered: Bool, resent: Bool)
        case done
    }

    /// Where sending the request body is.
    private enum Sending: Sendable, Equatable {
        /// Not begun (no connection yet).
        case idle
        /// A `.readBody` is out.
        case reading
        /// The owner had nothing more: `.bodyResumed` asks again.
        case waiting
        /// The whole body (and a chunked body's last chunk) is written.
        case sent
    }

    public let method: String
    public let url: String
    private let head: [UInt8]
    private let body: Body
    private let connectTimeout: Int
    private let idleTimeout: Int
    private let limits: HTTPHeadLimits
    private var reader: ResponseReader
    private var phase = Phase.connecting(resent: false)
    private var sending = Sending.idle
    /// Bytes of the request body written so far (chunk framing left out).
    private var bodySent = 0
    private var outputs: [ResponseReader.Output] = []

    /// The most a `.readBody` asks for.
    public static let bodyPiece = 64 * 1024

    /// `head`: the request's bytes (`UpstreamRequest.http1Head`), its framing fields those of `body`.
    /// `limits`: those of the response head (the owner reads the head as parsed here, not again).
    public init(
        method: String, url: String, head: [UInt8], body: Body = .none, connectTimeout: Int, idleTimeout: Int,
        limits: HTTPHeadLimits = HTTPHeadLimits()
    ) {
        self.method = method
        self.url = url
        self.head = head
        self.body = body
        self.connectTimeout = connectTimeout
        self.idleTimeout = idleTimeout
        self.limits = limits
        reader = ResponseReader(requestMethod: method, limits: limits)
    }

    public var isFinished: Bool { phase == .done }
    /// Whether the exchange waits for the owner to have more of the request body (`.bodyResumed`).
    public var isWaitingForBody: Bool { phase != .done && sending == .waiting }

    public mutating func start(_ out: inout [Action]) {
        out.append(.arm(milliseconds: connectTimeout))
        out.append(.connect(reuse: true))
    }

    public mutating func handle(_ event: Event, _ out: inout [Action]) {
        switch (event, phase) {
        case (_, .done):
            break
        case (.connected(let reused), .connecting(let resent)):
            phase = .exchanging(reused: reused, answered: false, resent: resent)
            out.append(.write(head))
            out.append(.arm(milliseconds: idleTimeout))
            beginBody(&out)
        case (.connected, .exchanging):
            preconditionFailure("a second connection for one exchange")
        case (.connectFailed(let failure, let detail), .connecting):
            finish(failure, detail, &out)
        case (.connectFailed, .exchanging):
            preconditionFailure("a connection failed after it was made")
        case (.closed, .exchanging(let reused, let answered, let resent)):
            if resendIfStale(reused: reused, answered: answered, resent: resent, "closed", &out) { return }
            reader.closed(&outputs)
            translate(consumed: 0, of: 0, closing: true, &out)
        case (.broken(let detail), .exchanging(let reused, let answered, let resent)):
            if resendIfStale(reused: reused, answered: answered, resent: resent, "broke", &out) { return }
            out.append(.release(reusable: false))
            finish(.incomplete, detail, &out)
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
        case (.bodyRead(let count), .exchanging):
            bodyRead(count, &out)
        case (.bodyPaused, .exchanging):
            precondition(sending == .reading, "a body answer without a .readBody")
            sending = .waiting
        case (.bodyResumed, .exchanging):
            guard sending == .waiting else { return }
            askForBody(&out)
        case (.bodyEnded(let trailers), .exchanging):
            bodyEnded(trailers, &out)
        case (.bodyRead, .connecting), (.bodyPaused, .connecting), (.bodyEnded, .connecting):
            preconditionFailure("a body answer before the request was sent")
        case (.bodyResumed, .connecting):
            // The connection is not there yet: the body is asked for once the head is written.
            break
        }
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
        guard case .exchanging(let reused, _, let resent) = phase else { return input.count }
        phase = .exchanging(reused: reused, answered: true, resent: resent)
        // A response is a head, body pieces and its end: room for them at once, not grown three times.
        if outputs.capacity == 0 { outputs.reserveCapacity(4) }
        let consumed = reader.read(input, &outputs)
        translate(consumed: consumed, of: input.count, closing: false, &out)
        return consumed
    }

    /// `closing`: the outputs of the origin's close (a failure then means the response was cut short).
    private mutating func translate(consumed: Int, of count: Int, closing: Bool, _ out: inout [Action]) {
        for output in outputs {
            switch output {
            case .head(let received):
                out.append(.deliverHead(received))
            case .body(let range):
                out.append(.deliverBody(range))
            case .trailers(let lines):
                out.append(.deliverTrailers(lines + [ASCII.cr, ASCII.lf]))
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
        outputs.removeAll(keepingCapacity: true)
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
    static func failure(_ error: HTTPParseError) -> UpstreamFailure {
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

    /// Whether the proxy's own HTTP/1.1 client carries this request: every method, body and target, straight to
    /// the origin. libcurl carries requests through an upstream proxy, every request when `builtinClient` is off
    /// (`upstream_client = libcurl`), and, until the own client speaks HTTP/2, a request to an https origin that
    /// says `te: trailers` (a gRPC call, which needs HTTP/2 to the origin).
    public func fitsOwnClient(builtinClient: Bool) -> Bool {
        builtinClient && upstreamProxy == nil && !(http2 && fields.contains { $0.name == "te" })
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
