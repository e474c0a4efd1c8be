/// Bytes a connection has received and not yet consumed, as the state machines see them: read in place,
/// segment by segment, never copied. The I/O layer passes a view of a libevent buffer; tests pass arrays.
///
/// A machine reads a view and answers with actions that say what becomes of its bytes (consume a head, move
/// body bytes on, keep them for replay); it never removes bytes itself.
public protocol ByteView {
    /// Bytes in the view.
    var count: Int { get }
    /// Calls `body` with each contiguous segment from `offset` on, in order, until it returns false.
    func forEachSegment(from offset: Int, _ body: (UnsafeRawBufferPointer) -> Bool)
}

extension Array: ByteView where Element == UInt8 {
    public func forEachSegment(from offset: Int, _ body: (UnsafeRawBufferPointer) -> Bool) {
        guard offset < count else { return }
        withUnsafeBytes { raw in _ = body(UnsafeRawBufferPointer(rebasing: raw[offset...])) }
    }
}

extension ByteView {
    /// Feeds the bytes from `offset` to `parser` until it completes, fails or the view ends. Returns the
    /// outcome and the number of bytes the parser took (the head's bytes only; the body's stay).
    public func parseHead(_ parser: inout HTTPHeadParser, from offset: Int) -> (HTTPHeadParser.Outcome, taken: Int) {
        var outcome = HTTPHeadParser.Outcome.needMore
        var taken = 0
        forEachSegment(from: offset) { segment in
            outcome = parser.parse(segment)
            switch outcome {
            case .needMore:
                taken += segment.count
                return true
            case .complete(_, let consumed):
                taken += consumed
                return false
            case .failed:
                return false
            }
        }
        return (outcome, taken)
    }
}

/// How far a body passed on unchanged has got, following its framing (RFC 9112 §6.3): by count for
/// Content-Length, by `ChunkedScanner` for chunked bodies (chunk data is counted, not looked at), or
/// everything until the sender closes. It decides how many bytes of a view belong to the body; moving them
/// is the I/O layer's job.
public struct BodyProgress: Sendable {
    public private(set) var framing: BodyFraming
    private var remaining: UInt64 = 0
    private var chunks: ChunkedScanner?
    /// A read-until-close body ended (the sender closed).
    private var closed = false

    public init(_ framing: BodyFraming) {
        self.framing = framing
        switch framing {
        case .none, .untilClose: break
        case .contentLength(let length): remaining = length
        case .chunked: chunks = ChunkedScanner()
        }
    }

    /// The whole body has been passed on.
    public var isComplete: Bool {
        switch framing {
        case .none: true
        case .contentLength: remaining == 0
        case .chunked: chunks?.isFinished ?? true
        case .untilClose: closed
        }
    }

    /// The sender closed: the end of a read-until-close body.
    public mutating func senderClosed() { closed = true }

    /// How many bytes of `view`, from `offset` on, belong to the body; they count as passed on. A framing
    /// error in a chunked body fails.
    public mutating func take(from view: some ByteView, at offset: Int) -> Result<Int, HTTPParseError> {
        var taken = 0
        while !isComplete {
            let available = view.count - offset - taken
            if available <= 0 { break }
            switch framing {
            case .none:
                return .success(taken)
            case .untilClose:
                taken += available
            case .contentLength:
                let count = Int(min(remaining, UInt64(available)))
                remaining -= UInt64(count)
                taken += count
            case .chunked:
                var scanner = chunks!
                if scanner.pendingData > 0 {
                    let count = Int(min(scanner.pendingData, UInt64(available)))
                    scanner.skipData(count)
                    taken += count
                } else {
                    var failure: HTTPParseError? = nil
                    var count = 0
                    view.forEachSegment(from: offset + taken) { segment in
                        switch scanner.scan(segment) {
                        case .needMore:
                            count += segment.count
                            return scanner.pendingData == 0
                        case .done(let consumed):
                            count += consumed
                            return false
                        case .failed(let error):
                            failure = error
                            return false
                        }
                    }
                    chunks = scanner
                    if let failure { return .failure(failure) }
                    taken += count
                }
                chunks = scanner
            }
        }
        return .success(taken)
    }
}
