/// One request on the proxy's own HTTP/1.1 client to an origin (issue 14: libcurl formats every request field
/// byte by byte, docs/performance.md): which connection it goes on, when it is sent again, when it has timed
/// out, what of the response reaches the owner and whether the connection goes back to the pool. Events in,
/// actions out; ProxyIO's `OriginTransfer` carries them out on a bufferevent.
///
/// The response is read by `ResponseReader` (so by the one head parser and `MessageSemantics.response`). A
/// request goes on a kept connection when there is one; when such a connection closes or breaks before a
/// byte of the response arrived (the origin had closed it while it was idle, the usual race of keep-alive),
/// the request is sent once more on a new connection, only if `RetryPolicy` allows it (RFC 9110 §9.2.2).
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
    }

    public enum Action: Sendable, Equatable {
        /// Get a connection to the origin: a kept one if `reuse` and there is one, else a new one. `.connected`
        /// or `.connectFailed` follows.
        case connect(reuse: Bool)
        /// (Re)arm the exchange's one timer.
        case arm(milliseconds: Int)
        /// Write these bytes to the connection.
        case write([UInt8])
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

    private enum Phase: Sendable, Equatable {
        /// Waiting for a connection; `resent`: this is the one retry.
        case connecting(resent: Bool)
        /// The head was written on a connection; `reused`: a kept one; `answered`: a byte of the response came.
        case exchanging(reused: Bool, answered: Bool, resent: Bool)
        case done
    }

    public let method: String
    public let url: String
    private let head: [UInt8]
    private let connectTimeout: Int
    private let idleTimeout: Int
    private let limits: HTTPHeadLimits
    private var reader: ResponseReader
    private var phase = Phase.connecting(resent: false)
    private var outputs: [ResponseReader.Output] = []

    /// `head`: the request's bytes (`UpstreamRequest.http1Head`); the request has no body.
    /// `limits`: those of the response head (the owner reads the head as parsed here, not again).
    public init(
        method: String, url: String, head: [UInt8], connectTimeout: Int, idleTimeout: Int,
        limits: HTTPHeadLimits = HTTPHeadLimits()
    ) {
        self.method = method
        self.url = url
        self.head = head
        self.connectTimeout = connectTimeout
        self.idleTimeout = idleTimeout
        self.limits = limits
        reader = ResponseReader(requestMethod: method, limits: limits)
    }

    public var isFinished: Bool { phase == .done }

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
        }
    }

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
                out.append(.release(reusable: reusable && consumed == count))
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
        guard reused, !answered, !resent, RetryPolicy.mayResend(method: method, framing: .none) else { return false }
        phase = .connecting(resent: true)
        out.append(.release(reusable: false))
        out.append(
            .log("the kept connection to the origin \(how) before answering; \(method) sent again on a new connection"))
        out.append(.arm(milliseconds: connectTimeout))
        out.append(.connect(reuse: false))
        return true
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

    /// Whether the proxy's own HTTP/1.1 client carries this request (the hot path: a GET or HEAD without a
    /// body, straight to the origin, its target the URL's path). libcurl carries the rest: request bodies
    /// (streamed, replayed from the spool), upstream proxies, `*` targets, and every request when
    /// `builtinClient` is off. An https origin is then spoken to in HTTP/1.1 even when it offers HTTP/2.
    public func fitsOwnClient(builtinClient: Bool) -> Bool {
        builtinClient && body == .none && upstreamProxy == nil && requestTarget == nil
            && (method == "GET" || method == "HEAD")
    }
}
