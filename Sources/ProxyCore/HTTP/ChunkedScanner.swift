/// Follows the framing of a chunked body (RFC 9112 §7.1) without changing or copying it.
///
/// A forwarder hands it the bytes it is about to pass on; the scanner says how many belong to this message
/// and when the message ends. Chunk data is skipped by arithmetic, so large chunks cost nothing per byte.
/// Anything that could make two parsers disagree about where the body ends is an error: a size that is not
/// hexadecimal or overflows, a bare LF, control characters in an extension, data not followed by CRLF.
public struct ChunkedScanner: Sendable {
    public enum Outcome: Sendable, Equatable {
        /// All bytes given belong to the body; more are needed.
        case needMore
        /// The body ended after `consumed` bytes of the input; later bytes belong to the next message.
        case done(consumed: Int)
        case failed(HTTPParseError)
    }

    /// Longest chunk-size line (size plus extensions) accepted.
    public static let maxLine = 4096
    /// Largest trailer section accepted.
    public static let maxTrailers = 65536

    private enum State: Sendable, Equatable {
        /// Reading hex digits; goes to `.extensions` on ";", SP or HTAB, to `.sizeLF` on CR.
        case size(digits: Int, value: UInt64)
        /// Whitespace after the size; goes to `.extensions` on ";", to `.sizeLF` on CR.
        case sizeSpace(value: UInt64)
        /// Reading chunk extensions up to CR.
        case extensions(value: UInt64)
        /// Saw CR after the size line; LF goes to `.data` (or `.trailerLineStart` for the last chunk).
        case sizeLF(value: UInt64)
        /// Inside chunk data; `remaining` bytes to go, then `.dataCR`.
        case data(remaining: UInt64)
        case dataCR
        case dataLF
        /// At the start of a trailer line or the final CRLF.
        case trailerLineStart
        /// Inside a trailer field name, up to ":".
        case trailerName
        /// Inside a trailer field value, up to CR.
        case trailerLine
        /// Saw CR ending a trailer line (or the final line when `final`).
        case trailerLF(final: Bool)
        case finished
        case failed(HTTPParseError.Code)
    }

    private var state: State = .size(digits: 0, value: 0)
    private var lineLength = 0
    private var trailerBytes = 0
    /// Total chunk data bytes seen, for logs and limits.
    public private(set) var dataBytes: UInt64 = 0
    /// Bytes of the body scanned or skipped so far.
    public private(set) var position: UInt64 = 0
    /// Where the trailer section starts (just after the last chunk's size line), once it has.
    public private(set) var trailerStart: UInt64?
    /// Trailer lines a forwarder must drop, as ranges of body positions (line terminator included).
    public private(set) var droppedTrailers: [Range<UInt64>] = []
    private var trailerLineStart: UInt64 = 0
    private var trailerName: [UInt8] = []

    /// Fields that must not come in a trailer (RFC 9110 §6.5.1): framing, routing and hop-by-hop fields, and
    /// the proxy's own credentials. A later hop that merged them into the head could read another framing
    /// or target than this proxy checked, so they are not passed on.
    static let forbiddenTrailers: Set<[UInt8]> = MessageSemantics.hopByHopNames.union(
        ["content-length", "transfer-encoding", "host", "trailer"].map { Array($0.utf8) })

    public init() {}

    /// Bytes of chunk data that can be passed on without being looked at.
    public var pendingData: UInt64 {
        if case .data(let remaining) = state { return remaining }
        return 0
    }

    public var isFinished: Bool { state == .finished }

    /// Takes `count` bytes of chunk data without looking at them. `count` must not exceed `pendingData`.
    public mutating func skipData(_ count: Int) {
        guard case .data(let remaining) = state, UInt64(count) <= remaining else {
            preconditionFailure("skipData beyond the current chunk")
        }
        dataBytes += UInt64(count)
        position += UInt64(count)
        state = remaining == UInt64(count) ? .dataCR : .data(remaining: remaining - UInt64(count))
    }

    /// Scans `input`, which continues where the last call stopped, and stops right after the last byte of
    /// the body.
    public mutating func scan(_ input: UnsafeRawBufferPointer) -> Outcome {
        var index = 0
        while index < input.count && state != .finished {
            if case .data(let remaining) = state {
                let take = Int(min(remaining, UInt64(input.count - index)))
                skipData(take)
                index += take
                continue
            }
            let byte = input[index]
            index += 1
            if let error = step(byte) { return .failed(error) }
        }
        if state == .finished { return .done(consumed: index) }
        return .needMore
    }

    /// Scans framing bytes only, for a reader that decodes the body: stops as soon as chunk data starts
    /// (`pendingData > 0`) or the body ends. Returns the framing bytes taken.
    public mutating func scanFraming(_ input: UnsafeRawBufferPointer) -> (consumed: Int, outcome: Outcome) {
        var index = 0
        while index < input.count && state != .finished && pendingData == 0 {
            let byte = input[index]
            index += 1
            if let error = step(byte) { return (index, .failed(error)) }
        }
        return (index, state == .finished ? .done(consumed: index) : .needMore)
    }

    public mutating func scan(_ bytes: [UInt8]) -> Outcome {
        bytes.withUnsafeBytes { scan($0) }
    }

    /// One framing byte. Returns an error, or nil to go on.
    private mutating func step(_ byte: UInt8) -> HTTPParseError? {
        position += 1
        switch state {
        case .size(let digits, let value):
            lineLength += 1
            if let hex = ASCII.hexValue(byte) {
                // Sizes beyond 2^63 - 1 are refused: a next hop with signed 64-bit lengths would read another one.
                guard digits < 16, value <= UInt64(Int64.max) >> 4 else { return fail("chunk size too large") }
                state = .size(digits: digits + 1, value: value << 4 | UInt64(hex))
            } else if digits == 0 {
                return fail("chunk size is not hexadecimal")
            } else if byte == UInt8(ascii: ";") {
                state = .extensions(value: value)
            } else if byte == ASCII.space || byte == ASCII.tab {
                state = .sizeSpace(value: value)
            } else if byte == ASCII.cr {
                state = .sizeLF(value: value)
            } else {
                return fail("chunk size is not hexadecimal")
            }
        case .sizeSpace(let value):
            // chunk-ext = *( BWS ";" BWS ... ): whitespace after the size must lead to ";" or the line end.
            lineLength += 1
            guard lineLength <= Self.maxLine else { return fail("chunk size line too long") }
            if byte == UInt8(ascii: ";") {
                state = .extensions(value: value)
            } else if byte == ASCII.cr {
                state = .sizeLF(value: value)
            } else if byte != ASCII.space && byte != ASCII.tab {
                return fail("chunk size is not hexadecimal")
            }
        case .extensions(let value):
            lineLength += 1
            guard lineLength <= Self.maxLine else { return fail("chunk extensions too long") }
            if byte == ASCII.cr {
                state = .sizeLF(value: value)
            } else if !ASCII.isFieldValue(byte) {
                return fail("control character in chunk extension")
            }
        case .sizeLF(let value):
            guard byte == ASCII.lf else { return fail("chunk size line not ended by CRLF") }
            lineLength = 0
            if value == 0 {
                state = .trailerLineStart
                trailerStart = position
                trailerLineStart = position
            } else {
                state = .data(remaining: value)
            }
        case .data:
            preconditionFailure("data is skipped, not stepped")
        case .dataCR:
            guard byte == ASCII.cr else { return fail("chunk data not followed by CRLF") }
            state = .dataLF
        case .dataLF:
            guard byte == ASCII.lf else { return fail("chunk data not followed by CRLF") }
            state = .size(digits: 0, value: 0)
        case .trailerLineStart:
            trailerBytes += 1
            if byte == ASCII.cr {
                state = .trailerLF(final: true)
            } else if byte == ASCII.space || byte == ASCII.tab || !ASCII.isTchar(byte) {
                return fail("malformed trailer field")
            } else {
                trailerName = [ASCII.lower(byte)]
                state = .trailerName
            }
        case .trailerName:
            // RFC 9112 §7.1.2, §5: a trailer line is a field line, `token ":"`; no whitespace before the colon.
            trailerBytes += 1
            guard trailerBytes <= Self.maxTrailers else { return fail("trailer section too large") }
            if byte == ASCII.colon {
                state = .trailerLine
            } else if !ASCII.isTchar(byte) {
                return fail("malformed trailer field name")
            } else if trailerName.count < 32 {
                trailerName.append(ASCII.lower(byte))
            }
        case .trailerLine:
            trailerBytes += 1
            guard trailerBytes <= Self.maxTrailers else { return fail("trailer section too large") }
            if byte == ASCII.cr {
                state = .trailerLF(final: false)
            } else if !ASCII.isFieldValue(byte) {
                return fail("control character in trailer field")
            }
        case .trailerLF(let final):
            trailerBytes += 1
            guard byte == ASCII.lf else { return fail("trailer line not ended by CRLF") }
            if !final && Self.forbiddenTrailers.contains(trailerName) {
                droppedTrailers.append(trailerLineStart..<position)
            }
            trailerLineStart = position
            state = final ? .finished : .trailerLineStart
        case .finished:
            preconditionFailure("scanning past the end of a chunked body")
        case .failed(let code):
            return HTTPParseError(code, "malformed chunked body")
        }
        return nil
    }

    private mutating func fail(_ reason: String) -> HTTPParseError {
        state = .failed(.badChunk)
        return HTTPParseError(.badChunk, reason)
    }
}

/// Writes chunked framing (RFC 9112 §7.1): the one place its bytes are made, for a response to an HTTP/1.1
/// client and a request body to an origin alike.
public enum ChunkedFraming {
    /// The chunk-size line before `count` bytes of data (hexadecimal, no extensions).
    public static func header(_ count: Int) -> [UInt8] {
        Array(String(count, radix: 16).utf8) + [ASCII.cr, ASCII.lf]
    }

    /// What follows a chunk's data.
    public static let dataEnd: [UInt8] = [ASCII.cr, ASCII.lf]

    /// The last chunk without trailers.
    public static let last = Array("0\r\n\r\n".utf8)

    /// The last chunk, the trailer section (RFC 9112 §7.1.2: none of the fields a trailer must not carry, names
    /// in lower case) and the empty line.
    public static func last(trailers: [H2Field]) -> [UInt8] {
        guard !trailers.isEmpty else { return last }
        var bytes = Array("0\r\n".utf8)
        for field in H2Semantics.trailers(trailers.map { ($0.nameText, $0.value) }) {
            bytes += field.name + Array(": ".utf8) + field.value + [ASCII.cr, ASCII.lf]
        }
        bytes += [ASCII.cr, ASCII.lf]
        return bytes
    }
}
