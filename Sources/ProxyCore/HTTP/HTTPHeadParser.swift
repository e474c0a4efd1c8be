// memchr only: the C library's, where the line-end scan of a head is fastest.
#if canImport(Darwin)
    import Darwin
#elseif canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

/// Size limits for a message head. Exceeding one is an error with its own status (414 or 431).
public struct HTTPHeadLimits: Sendable, Equatable {
    /// Longest start line (request line or status line), without its terminator.
    public var maxStartLine: Int
    /// Longest whole head: start line, field lines and terminators.
    public var maxHeadBytes: Int
    /// Most field lines.
    public var maxFields: Int

    public init(maxStartLine: Int = 8192, maxHeadBytes: Int = 65536, maxFields: Int = 100) {
        self.maxStartLine = maxStartLine
        self.maxHeadBytes = maxHeadBytes
        self.maxFields = maxFields
    }
}

/// Why a message was refused. Equality compares the code only, so tests can ask which error it was.
public struct HTTPParseError: Error, Sendable, Equatable, CustomStringConvertible {
    public enum Code: Sendable, Equatable {
        /// Syntax error in a start line or field line (400).
        case malformed
        /// The request line is longer than allowed (414).
        case startLineTooLong
        /// The head has more bytes or more field lines than allowed (431).
        case headTooLarge
        /// Not HTTP/1.x (505).
        case versionNotSupported
        /// The head is well-formed but its framing is ambiguous or invalid (400): the smuggling guards.
        case badFraming
        /// A chunked body is malformed (400).
        case badChunk
    }

    public let code: Code
    /// One line for the client and the log. Never contains a field value.
    public let reason: String

    public init(_ code: Code, _ reason: String) {
        self.code = code
        self.reason = reason
    }

    /// The status a server answers a request with for this error.
    public var status: Int {
        switch code {
        case .malformed, .badFraming, .badChunk: 400
        case .startLineTooLong: 414
        case .headTooLarge: 431
        case .versionNotSupported: 505
        }
    }

    public var description: String { reason }

    public static func == (lhs: Self, rhs: Self) -> Bool { lhs.code == rhs.code }
}

/// An incremental HTTP/1.1 head parser (RFC 9112 §2-§5).
///
/// Feed it bytes as they arrive; it takes bytes up to the end of the head and no further, so the caller
/// knows exactly where the body starts. Requests are parsed strictly: CRLF only, no obs-fold, no
/// whitespace before the colon, no control characters. Responses accept a bare LF as a line terminator
/// (RFC 9112 §2.2 allows it) because old servers send one and the client decides what it accepts.
public struct HTTPHeadParser: Sendable {
    public enum Kind: Sendable { case request, response }

    public enum Outcome: Sendable {
        /// Every byte given was taken; the head is not complete yet.
        case needMore
        /// The head is complete; `consumed` bytes of the last input belonged to it.
        case complete(HTTPHead, consumed: Int)
        /// The head is invalid; the connection must not be used for anything else.
        case failed(HTTPParseError)
    }

    public let kind: Kind
    public let limits: HTTPHeadLimits

    private var buffer: [UInt8] = []
    /// Offset in `buffer` where the line being read starts.
    private var lineStart = 0
    private var startLine: Range<Int>? = nil
    private var fieldsStart = 0
    private var fields: [HTTPFieldLine] = []
    private var leadingEmptyLines = 0
    private var version = HTTPVersion.http1_1
    private var method = ""
    private var target = ""
    private var status = 0
    private var failure: HTTPParseError? = nil

    public init(kind: Kind, limits: HTTPHeadLimits = HTTPHeadLimits()) {
        self.kind = kind
        self.limits = limits
    }

    /// Whether some bytes of a head have been taken.
    public var hasPartialHead: Bool { !buffer.isEmpty }

    /// Starts over for the next message on the same connection.
    public mutating func reset() {
        buffer.removeAll(keepingCapacity: true)
        lineStart = 0
        startLine = nil
        fieldsStart = 0
        fields.removeAll(keepingCapacity: true)
        leadingEmptyLines = 0
        method = ""
        target = ""
        status = 0
        failure = nil
    }

    /// Parses `input`. Call again with more bytes after `.needMore`.
    public mutating func parse(_ input: UnsafeRawBufferPointer) -> Outcome {
        if let failure { return .failed(failure) }
        if buffer.capacity == 0 {
            // A head arrives line by line: room for a typical one at once instead of growing five times.
            buffer.reserveCapacity(min(limits.maxHeadBytes, 2048))
            fields.reserveCapacity(16)
        }
        var offset = 0
        while offset < input.count {
            // A piece at a time into the buffer, its lines read there: one copy for a whole head (not one per
            // line), and of what follows the head at most the rest of the piece, dropped again below.
            let take = min(input.count - offset, Self.piece)
            var base = buffer.count
            buffer.append(contentsOf: UnsafeRawBufferPointer(rebasing: input[offset..<offset + take]))
            // The line being read began before `base` at the earliest, and had no LF there.
            var scan = base
            while let lineEnd = nextLineEnd(from: scan) {
                if let error = checkLimits(end: lineEnd, lineComplete: true) { return fail(error) }
                let before = buffer.count
                switch endLine(end: lineEnd) {
                case .failure(let error):
                    return fail(error)
                case .success(false):
                    // An empty line before the request line is dropped from the buffer.
                    base -= before - buffer.count
                    scan = lineStart
                case .success(true):
                    buffer.removeSubrange(lineEnd...)
                    let head = HTTPHead(
                        bytes: buffer,
                        startLine: startLine!,
                        fieldsStart: fieldsStart,
                        fields: fields,
                        version: version,
                        method: method,
                        target: target,
                        status: status
                    )
                    // The head owns these now: given up rather than emptied in place, which would allocate a
                    // second buffer of the same size for a next head that may never come (the next parse reserves).
                    buffer = []
                    fields = []
                    reset()
                    return .complete(head, consumed: offset + lineEnd - base)
                }
            }
            if let error = checkLimits(end: buffer.count, lineComplete: false) { return fail(error) }
            offset += take
        }
        return .needMore
    }

    /// How much of the input goes into the buffer at a time: a typical head, so that a body behind it costs
    /// little copying.
    static let piece = 2048

    /// Just past the next LF in `buffer` at or after `from`, if there is one.
    private func nextLineEnd(from: Int) -> Int? {
        guard from < buffer.count else { return nil }
        return buffer.withUnsafeBytes { bytes in
            guard let found = memchr(bytes.baseAddress! + from, Int32(ASCII.lf), bytes.count - from) else {
                return nil
            }
            return bytes.baseAddress!.distance(to: UnsafeRawPointer(found)) + 1
        }
    }

    /// Convenience for tests and the fuzzer.
    public mutating func parse(_ bytes: [UInt8]) -> Outcome {
        bytes.withUnsafeBytes { parse($0) }
    }

    private mutating func fail(_ error: HTTPParseError) -> Outcome {
        failure = error
        return .failed(error)
    }

    /// The limits, for the head up to `end` of the buffer: just past a line's LF, or (`lineComplete` false) the
    /// end of what has arrived.
    private func checkLimits(end: Int, lineComplete: Bool) -> HTTPParseError? {
        if startLine == nil {
            // The line terminator (CRLF, a bare LF in a response, or a CR whose LF has not arrived yet) does
            // not count toward the start line's length, so the outcome does not depend on where reads split.
            let possibleCR = end - (lineComplete ? 2 : 1)
            var terminator = lineComplete ? 1 : 0
            if possibleCR >= lineStart && buffer[possibleCR] == ASCII.cr { terminator += 1 }
            let length = end - lineStart - terminator
            if length > limits.maxStartLine {
                return kind == .request
                    ? HTTPParseError(.startLineTooLong, "request line longer than \(limits.maxStartLine) bytes")
                    : HTTPParseError(.headTooLarge, "status line longer than \(limits.maxStartLine) bytes")
            }
        }
        if end > limits.maxHeadBytes {
            return HTTPParseError(.headTooLarge, "header section larger than \(limits.maxHeadBytes) bytes")
        }
        return nil
    }

    /// Handles the line that ends at `lineEnd` (just past its LF). Returns true at the empty line.
    private mutating func endLine(end lineEnd: Int) -> Result<Bool, HTTPParseError> {
        var contentEnd = lineEnd - 1
        if contentEnd > lineStart && buffer[contentEnd - 1] == ASCII.cr {
            contentEnd -= 1
        } else if kind == .request {
            return .failure(HTTPParseError(.malformed, "line ends in a bare LF; HTTP requires CRLF"))
        }
        let content = lineStart..<contentEnd

        if startLine == nil && content.isEmpty {
            // RFC 9112 §2.2: ignore at least one empty line before the request line.
            leadingEmptyLines += 1
            if leadingEmptyLines > 4 || kind == .response {
                return .failure(HTTPParseError(.malformed, "empty line where a start line was expected"))
            }
            // The line is dropped, so the next one starts at 0 (not at `lineEnd`: no `defer` on this path).
            buffer.removeSubrange(..<lineEnd)
            lineStart = 0
            return .success(false)
        }
        defer { lineStart = lineEnd }

        if startLine == nil {
            let result = kind == .request ? parseRequestLine(content) : parseStatusLine(content)
            if case .failure(let error) = result { return .failure(error) }
            startLine = content
            fieldsStart = lineEnd
            return .success(false)
        }
        if content.isEmpty { return .success(true) }
        if fields.count >= limits.maxFields {
            return .failure(HTTPParseError(.headTooLarge, "more than \(limits.maxFields) header fields"))
        }
        switch parseFieldLine(content, line: lineStart..<lineEnd) {
        case .failure(let error): return .failure(error)
        case .success(let field):
            fields.append(field)
            return .success(false)
        }
    }

    // request-line = method SP request-target SP HTTP-version   (RFC 9112 §3)
    private mutating func parseRequestLine(_ range: Range<Int>) -> Result<Void, HTTPParseError> {
        let line = buffer[range]
        guard let firstSpace = line.firstIndex(of: ASCII.space), firstSpace > range.lowerBound else {
            return .failure(HTTPParseError(.malformed, "malformed request line"))
        }
        for byte in buffer[range.lowerBound..<firstSpace] where !ASCII.isTchar(byte) {
            return .failure(HTTPParseError(.malformed, "malformed request line: invalid character in method"))
        }
        let targetStart = firstSpace + 1
        guard let secondSpace = buffer[targetStart..<range.upperBound].firstIndex(of: ASCII.space),
            secondSpace > targetStart
        else {
            return .failure(HTTPParseError(.malformed, "malformed request line"))
        }
        var nonASCII = false
        for byte in buffer[targetStart..<secondSpace] {
            guard ASCII.isTargetByte(byte) else {
                return .failure(
                    HTTPParseError(.malformed, "malformed request line: invalid character in request target"))
            }
            nonASCII = nonASCII || byte >= 0x80
        }
        // Raw UTF-8 in a target (curl sends a URL's bytes as given) passes through unchanged; other bytes
        // above 0x7F could not be forwarded as they came, so they are refused rather than altered.
        if nonASCII && String(validating: buffer[targetStart..<secondSpace], as: UTF8.self) == nil {
            return .failure(
                HTTPParseError(
                    .malformed, "the request target is not valid UTF-8: percent-encode bytes above 0x7F (RFC 3986)"))
        }
        switch parseVersion(secondSpace + 1..<range.upperBound) {
        case .failure(let error): return .failure(error)
        case .success(let parsed): version = parsed
        }
        method = String(decoding: buffer[range.lowerBound..<firstSpace], as: UTF8.self)
        target = String(decoding: buffer[targetStart..<secondSpace], as: UTF8.self)
        return .success(())
    }

    // status-line = HTTP-version SP status-code SP [ reason-phrase ]   (RFC 9112 §4)
    private mutating func parseStatusLine(_ range: Range<Int>) -> Result<Void, HTTPParseError> {
        guard range.count >= 12, buffer[range.lowerBound + 8] == ASCII.space else {
            return .failure(HTTPParseError(.malformed, "malformed status line"))
        }
        switch parseVersion(range.lowerBound..<range.lowerBound + 8) {
        case .failure(let error): return .failure(error)
        case .success(let parsed): version = parsed
        }
        var code = 0
        for index in range.lowerBound + 9..<range.lowerBound + 12 {
            let byte = buffer[index]
            guard ASCII.isDigit(byte) else { return .failure(HTTPParseError(.malformed, "malformed status code")) }
            code = code * 10 + Int(byte - 0x30)
        }
        guard code >= 100 else { return .failure(HTTPParseError(.malformed, "malformed status code")) }
        let rest = range.lowerBound + 12..<range.upperBound
        if !rest.isEmpty {
            // Some servers omit the reason phrase and its space; tolerate that, nothing else.
            guard buffer[rest.lowerBound] == ASCII.space else {
                return .failure(HTTPParseError(.malformed, "malformed status line"))
            }
            for byte in buffer[rest] where !ASCII.isFieldValue(byte) {
                return .failure(HTTPParseError(.malformed, "control character in reason phrase"))
            }
        }
        status = code
        return .success(())
    }

    // HTTP-version = "HTTP" "/" DIGIT "." DIGIT   (RFC 9112 §2.3)
    private func parseVersion(_ range: Range<Int>) -> Result<HTTPVersion, HTTPParseError> {
        let bytes = buffer[range]
        let start = range.lowerBound
        guard bytes.count == 8, bytes[start] == UInt8(ascii: "H"), bytes[start + 1] == UInt8(ascii: "T"),
            bytes[start + 2] == UInt8(ascii: "T"), bytes[start + 3] == UInt8(ascii: "P"),
            bytes[start + 4] == UInt8(ascii: "/"), ASCII.isDigit(bytes[start + 5]),
            bytes[start + 6] == UInt8(ascii: "."), ASCII.isDigit(bytes[start + 7])
        else {
            return .failure(HTTPParseError(.malformed, "malformed HTTP version"))
        }
        let parsed = HTTPVersion(major: Int(bytes[start + 5] - 0x30), minor: Int(bytes[start + 7] - 0x30))
        guard parsed.major == 1 else {
            return .failure(HTTPParseError(.versionNotSupported, "\(parsed) is not supported; use HTTP/1.1"))
        }
        return .success(parsed)
    }

    // field-line = field-name ":" OWS field-value OWS   (RFC 9112 §5)
    private func parseFieldLine(_ range: Range<Int>, line: Range<Int>) -> Result<HTTPFieldLine, HTTPParseError> {
        // The scans read the buffer's memory directly: an Array's bounds check per byte cost more than the
        // byte classes themselves (callgrind, bench row 6: 450 instructions per field line before, 330 after).
        let scan = buffer.withUnsafeBufferPointer { bytes in Self.scanFieldLine(bytes, range) }
        switch scan {
        case .field(let nameEnd, let value):
            return .success(HTTPFieldLine(line: line, name: range.lowerBound..<nameEnd, value: value))
        case .obsFold:
            // RFC 9112 §5.2: obs-fold is rejected in requests; a proxy must not forward it either.
            return .failure(HTTPParseError(.malformed, "obsolete line folding in header section"))
        case .badName:
            return .failure(HTTPParseError(.malformed, "malformed header field name"))
        case .spaceBeforeColon(let nameEnd):
            // RFC 9112 §5.1: whitespace between name and colon must be rejected with 400.
            return .failure(
                HTTPParseError(
                    .malformed,
                    "whitespace between header field name \"\(ASCII.printable(buffer[range.lowerBound..<nameEnd]))\" and colon"
                ))
        case .controlInValue(let nameEnd):
            return .failure(
                HTTPParseError(
                    .malformed,
                    "control character in the value of header field \"\(ASCII.printable(buffer[range.lowerBound..<nameEnd]))\""
                ))
        }
    }

    /// The field lines of a chunked body's trailer section (RFC 9112 §7.1.2: each ending in CRLF or a bare LF,
    /// the blank line that ends the section left out), read as a head's field lines are. A line that is not a
    /// field line is dropped (RFC 9110 §6.5: a recipient may discard trailers), and the section stops at the
    /// head's limits (`maxHeadBytes`, `maxFields`).
    public static func trailerFields(_ section: [UInt8], limits: HTTPHeadLimits) -> [H2Field] {
        var fields: [H2Field] = []
        section.withUnsafeBufferPointer { bytes in
            var start = 0
            while start < bytes.count, fields.count < limits.maxFields {
                var end = start
                while end < bytes.count && bytes[end] != ASCII.lf { end += 1 }
                guard end <= limits.maxHeadBytes else { return }
                let next = end + 1
                if end > start && bytes[end - 1] == ASCII.cr { end -= 1 }
                if end > start, case .field(let nameEnd, let value) = scanFieldLine(bytes, start..<end) {
                    fields.append(H2Field(Array(bytes[start..<nameEnd]), Array(bytes[value])))
                }
                start = next
            }
        }
        return fields
    }

    private enum FieldScan {
        case field(nameEnd: Int, value: Range<Int>)
        case obsFold, badName
        case spaceBeforeColon(nameEnd: Int)
        case controlInValue(nameEnd: Int)
    }

    /// field-line = field-name ":" OWS field-value OWS, over `range` (not empty) of `bytes`.
    private static func scanFieldLine(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>) -> FieldScan {
        precondition(range.lowerBound >= 0 && range.upperBound <= bytes.count && !range.isEmpty)
        let first = bytes[range.lowerBound]
        if first == ASCII.space || first == ASCII.tab { return .obsFold }
        var index = range.lowerBound
        while index < range.upperBound && ASCII.isTchar(bytes[index]) { index += 1 }
        let nameEnd = index
        guard nameEnd > range.lowerBound else { return .badName }
        guard index < range.upperBound, bytes[index] == ASCII.colon else {
            if index < range.upperBound && (bytes[index] == ASCII.space || bytes[index] == ASCII.tab) {
                return .spaceBeforeColon(nameEnd: nameEnd)
            }
            return .badName
        }
        var valueStart = index + 1
        while valueStart < range.upperBound && (bytes[valueStart] == ASCII.space || bytes[valueStart] == ASCII.tab) {
            valueStart += 1
        }
        var valueEnd = range.upperBound
        while valueEnd > valueStart && (bytes[valueEnd - 1] == ASCII.space || bytes[valueEnd - 1] == ASCII.tab) {
            valueEnd -= 1
        }
        var position = valueStart
        // Eight bytes at a time while none is a control byte or DEL (a value's usual bytes); from the first
        // word that has one (an HTAB, which is allowed, or a byte that is not), byte by byte.
        while valueEnd - position >= 8,
            !ASCII.hasControlOrDEL(UnsafeRawPointer(bytes.baseAddress! + position).loadUnaligned(as: UInt64.self))
        {
            position += 8
        }
        while position < valueEnd {
            guard ASCII.isFieldValue(bytes[position]) else { return .controlInValue(nameEnd: nameEnd) }
            position += 1
        }
        return .field(nameEnd: nameEnd, value: valueStart..<valueEnd)
    }
}
