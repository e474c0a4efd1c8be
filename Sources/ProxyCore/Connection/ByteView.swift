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

/// What becomes of the next bytes of a body passed on: moved on unchanged, or dropped (a trailer line that
/// must not travel).
public enum BodySpan: Sendable, Equatable {
    case pass(Int)
    case drop(Int)
}

/// How far a body passed on unchanged has got, following its framing (RFC 9112 §6.3): by count for
/// Content-Length, by `ChunkedScanner` for chunked bodies (chunk data is counted, not looked at), or
/// everything until the sender closes. It decides what the bytes of a view are (body to pass on, a trailer
/// line to drop); moving them is the I/O layer's job. A chunked body's trailer section is held back until it
/// is complete (at most `ChunkedScanner.maxTrailers` bytes), so that forbidden trailer lines can be left out.
public struct BodyProgress: Sendable {
    public private(set) var framing: BodyFraming
    private var remaining: UInt64 = 0
    private var chunks: ChunkedScanner?
    /// A read-until-close body ended (the sender closed).
    private var closed = false
    /// Chunked: body bytes already given out as spans (the scanner's `position` runs ahead while a trailer
    /// section is held back).
    private var released: UInt64 = 0

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
        case .chunked: (chunks?.isFinished ?? true) && released == chunks?.position ?? 0
        case .untilClose: closed
        }
    }

    /// The sender closed: the end of a read-until-close body.
    public mutating func senderClosed() { closed = true }

    /// What the bytes of `view` from `offset` on are: spans appended to `spans`, in order. A framing error
    /// in a chunked body fails.
    public mutating func take(
        from view: some ByteView, at offset: Int, into spans: inout [BodySpan]
    ) -> HTTPParseError? {
        switch framing {
        case .none:
            return nil
        case .untilClose:
            if !closed && view.count > offset { spans.append(.pass(view.count - offset)) }
            return nil
        case .contentLength:
            let count = Int(min(remaining, UInt64(max(0, view.count - offset))))
            remaining -= UInt64(count)
            if count > 0 { spans.append(.pass(count)) }
            return nil
        case .chunked:
            return takeChunked(from: view, at: offset, into: &spans)
        }
    }

    private mutating func takeChunked(
        from view: some ByteView, at offset: Int, into spans: inout [BodySpan]
    ) -> HTTPParseError? {
        var scanner = chunks!
        // Bytes of the view the scanner has seen already (a trailer section held back).
        let held = Int(scanner.position - released)
        var cursor = offset + held
        var failure: HTTPParseError? = nil
        while !scanner.isFinished && cursor < view.count && failure == nil {
            if scanner.pendingData > 0 {
                let count = Int(min(scanner.pendingData, UInt64(view.count - cursor)))
                scanner.skipData(count)
                cursor += count
                continue
            }
            var scanned = 0
            view.forEachSegment(from: cursor) { segment in
                switch scanner.scan(segment) {
                case .needMore:
                    scanned += segment.count
                    return scanner.pendingData == 0
                case .done(let consumed):
                    scanned += consumed
                    return false
                case .failed(let error):
                    failure = error
                    return false
                }
            }
            cursor += scanned
        }
        chunks = scanner
        if let failure { return failure }
        // Release what may go: everything before the trailer section, and the section once it is complete.
        let releasable = scanner.isFinished ? scanner.position : min(scanner.position, scanner.trailerStart ?? .max)
        var next = released
        for line in scanner.droppedTrailers where line.lowerBound >= released && scanner.isFinished {
            if line.lowerBound > next { spans.append(.pass(Int(line.lowerBound - next))) }
            spans.append(.drop(line.count))
            next = line.upperBound
        }
        if releasable > next { spans.append(.pass(Int(releasable - next))) }
        released = max(released, releasable)
        return nil
    }
}
