import ProxyCore

/// Everything an `HTTPHead` holds, comparable.
struct HeadSnapshot: Equatable, CustomStringConvertible {
    let bytes: [UInt8]
    let startLine: Range<Int>
    let fieldsStart: Int
    let fields: [HTTPFieldLine]
    let version: HTTPVersion
    let method: String
    let target: String
    let status: Int

    init(_ head: HTTPHead) {
        bytes = head.bytes
        startLine = head.startLine
        fieldsStart = head.fieldsStart
        fields = head.fields
        version = head.version
        method = head.method
        target = head.target
        status = head.status
    }

    var description: String {
        "head(\(bytes.count) bytes, start line \(startLine), \(fields.count) fields, method \(method.debugDescription), target \(target.debugDescription), status \(status))"
    }
}

/// What a parser reported while reading a whole input.
enum HeadEvent: Equatable {
    /// A head ended `end` bytes into the input.
    case complete(HeadSnapshot, end: Int)
    case failed(HTTPParseError.Code)
    /// The input ended inside a head (or between heads).
    case incomplete(partial: Bool)
    /// Enough heads were read from this input.
    case stopped
}

/// A head found in the input, with where its message started (before any leading empty lines) and ended.
struct FoundHead {
    let head: HTTPHead
    let start: Int
    let end: Int
}

struct HeadRun {
    var events: [HeadEvent] = []
    var heads: [FoundHead] = []
}

/// Feeds `bytes` to one parser in the pieces `split` gives, reading pipelined heads one after the other.
func feedHeads(
    _ bytes: [UInt8], kind: HTTPHeadParser.Kind, limits: HTTPHeadLimits, split: Split, maxMessages: Int = 6
) -> HeadRun {
    var parser = HTTPHeadParser(kind: kind, limits: limits)
    var run = HeadRun()
    var messageStart = 0
    for piece in split.pieces(of: bytes) {
        var offset = piece.lowerBound
        while offset < piece.upperBound {
            let given = piece.upperBound - offset
            let outcome = bytes.withRawBytes(offset..<piece.upperBound) { parser.parse($0) }
            switch outcome {
            case .needMore:
                offset = piece.upperBound
            case .complete(let head, let consumed):
                invariant(consumed >= 1 && consumed <= given, "consumed \(consumed) of the \(given) bytes given")
                invariant(!parser.hasPartialHead, "the parser kept bytes after a complete head")
                let end = offset + consumed
                run.events.append(.complete(HeadSnapshot(head), end: end))
                run.heads.append(FoundHead(head: head, start: messageStart, end: end))
                messageStart = end
                offset = end
                if run.heads.count == maxMessages {
                    run.events.append(.stopped)
                    return run
                }
            case .failed(let error):
                run.events.append(.failed(error.code))
                // A failed parser stays failed.
                guard case .failed(let again) = parser.parse(Array("GET / HTTP/1.1\r\n\r\n".utf8)), again == error
                else {
                    invariant(false, "the parser recovered from \(error.code)")
                    return run
                }
                return run
            }
        }
    }
    run.events.append(.incomplete(partial: parser.hasPartialHead))
    return run
}

/// Parses `bytes` in every way the harness knows and insists the results agree; returns the one-shot run.
func parseAllWays(_ bytes: [UInt8], kind: HTTPHeadParser.Kind, limits: HTTPHeadLimits, splits: [Split]) -> HeadRun {
    let whole = feedHeads(bytes, kind: kind, limits: limits, split: .whole)
    for split in splits {
        let other = feedHeads(bytes, kind: kind, limits: limits, split: split)
        invariant(
            other.events == whole.events,
            "\(kind) parse depends on how the input is split (\(split), limits \(limits)):\n  whole: \(whole.events)\n  split: \(other.events)"
        )
    }
    return whole
}

/// Limits small enough for short inputs to hit every limit, derived from the input.
func tightLimits(_ bytes: [UInt8]) -> HTTPHeadLimits {
    var random = InputRandom(bytes, salt: 0x11)
    // The head limit stays above the start line's (plus its CRLF), as with the defaults and any sensible
    // configuration: otherwise a long request line is reported as 414 or as 431 depending on where reads split.
    let maxStartLine = random.next(in: 4...160)
    return HTTPHeadLimits(
        maxStartLine: maxStartLine, maxHeadBytes: maxStartLine + random.next(in: 2...1024),
        maxFields: random.next(in: 0...12))
}

private let crlf: [UInt8] = [0x0D, 0x0A]

/// Structural invariants of a head read from `input[found.start..<found.end]`.
func checkHeadStructure(_ found: FoundHead, kind: HTTPHeadParser.Kind, limits: HTTPHeadLimits, input: [UInt8]) {
    let head = found.head
    let bytes = head.bytes
    // The head is the tail of what was consumed; before it only ignored empty lines (requests only).
    invariant(bytes.count <= found.end - found.start, "head longer than the bytes consumed")
    invariant(
        input[(found.end - bytes.count)..<found.end].elementsEqual(bytes),
        "head.bytes is not the input it was read from")
    let skipped = input[found.start..<(found.end - bytes.count)]
    if kind == .response {
        invariant(skipped.isEmpty, "response head skipped \(skipped.count) bytes")
    } else {
        invariant(
            skipped.count % 2 == 0 && skipped.count <= 8, "skipped \(skipped.count) bytes before the request line")
        invariant(
            stride(from: skipped.startIndex, to: skipped.endIndex, by: 2).allSatisfy {
                input[$0] == 0x0D && input[$0 + 1] == 0x0A
            }, "skipped bytes before the request line are not empty lines")
    }
    invariant(bytes.count <= limits.maxHeadBytes, "head of \(bytes.count) bytes over the limit \(limits.maxHeadBytes)")
    invariant(head.fields.count <= limits.maxFields, "\(head.fields.count) fields over the limit \(limits.maxFields)")
    invariant(head.startLine.count <= limits.maxStartLine, "start line over its limit")

    // Start line, then field lines back to back, then the empty line.
    invariant(head.startLine.lowerBound == 0 && !head.startLine.isEmpty, "start line \(head.startLine)")
    let startTerminator = bytes[head.startLine.upperBound..<head.fieldsStart]
    invariant(
        startTerminator.elementsEqual(crlf) || (kind == .response && startTerminator.elementsEqual([0x0A])),
        "start line terminator \(Array(startTerminator))")
    var lineStart = head.fieldsStart
    for field in head.fields {
        invariant(field.line.lowerBound == lineStart, "field lines are not contiguous")
        invariant(field.name.lowerBound == field.line.lowerBound && !field.name.isEmpty, "field name range")
        invariant(bytes[field.name.upperBound] == UInt8(ascii: ":"), "field name not followed by a colon")
        invariant(
            field.value.lowerBound > field.name.upperBound && field.value.upperBound <= field.line.upperBound,
            "field value range")
        invariant(bytes[field.line.upperBound - 1] == 0x0A, "field line does not end in LF")
        if kind == .request {
            invariant(bytes[field.line.upperBound - 2] == 0x0D, "request field line does not end in CRLF")
        }
        for byte in bytes[field.value] {
            invariant(byte == 0x09 || byte >= 0x20 && byte != 0x7F, "control character \(byte) in a field value")
        }
        if let first = bytes[field.value].first, let last = bytes[field.value].last {
            invariant(first != 0x20 && first != 0x09 && last != 0x20 && last != 0x09, "value not trimmed")
        }
        lineStart = field.line.upperBound
    }
    let rest = bytes[lineStart...]
    invariant(
        rest.elementsEqual(crlf) || (kind == .response && rest.elementsEqual([0x0A])),
        "head does not end with an empty line: \(Array(rest))")

    // The start line says what the head says.
    let startLine = Array(bytes[head.startLine])
    invariant(head.version.major == 1 && (0...9).contains(head.version.minor), "version \(head.version)")
    switch kind {
    case .request:
        let parts = startLine.split(separator: 0x20, omittingEmptySubsequences: false)
        invariant(parts.count == 3, "request line with \(parts.count) parts")
        invariant(
            text(Array(parts[0])) == head.method, "method \(head.method.debugDescription) is not the request line's")
        invariant(
            text(Array(parts[1])) == head.target, "target \(head.target.debugDescription) is not the request line's")
        invariant(text(Array(parts[2])) == "\(head.version)", "version is not the request line's")
        invariant(head.status == 0, "request with a status")
    case .response:
        invariant(text(Array(startLine[0..<8])) == "\(head.version)", "version is not the status line's")
        invariant(Int(text(Array(startLine[9..<12]))) == head.status, "status is not the status line's")
        invariant((100...999).contains(head.status), "status \(head.status)")
        invariant(head.method.isEmpty && head.target.isEmpty, "response with a method or target")
    }

    // Re-parsing the head's own bytes gives the same head.
    var parser = HTTPHeadParser(kind: kind, limits: limits)
    guard case .complete(let again, let consumed) = parser.parse(bytes) else {
        return invariant(false, "head.bytes does not parse again")
    }
    invariant(consumed == bytes.count, "re-parse consumed \(consumed) of \(bytes.count)")
    invariant(
        HeadSnapshot(again) == HeadSnapshot(head),
        "re-parse of head.bytes differs:\n  \(HeadSnapshot(head))\n  \(HeadSnapshot(again))")

    // serialized() with no changes re-parses to the same fields; for a request (CRLF only) it is the input.
    let serialized = head.serialized()
    if kind == .request {
        invariant(serialized == bytes, "serialized() of an unchanged request head is not its bytes")
    }
    var reparser = HTTPHeadParser(kind: kind, limits: generousLimits)
    guard case .complete(let reparsed, let reconsumed) = reparser.parse(serialized) else {
        return invariant(false, "serialized() does not parse")
    }
    invariant(reconsumed == serialized.count, "serialized() parses short")
    invariant(
        reparsed.method == head.method && reparsed.target == head.target && reparsed.status == head.status
            && reparsed.version == head.version && reparsed.fields.count == head.fields.count,
        "serialized() parses to a different head")
    for index in head.fields.indices {
        invariant(
            reparsed.name(at: index) == head.name(at: index)
                && reparsed.valueBytes(at: index).elementsEqual(head.valueBytes(at: index)),
            "serialized() changed field \(index)")
    }

    // Dropping every field and adding one still gives a head.
    let rebuilt = head.serialized(drop: { _ in true }, extra: [("X-Fuzz", "1")])
    reparser = HTTPHeadParser(kind: kind, limits: generousLimits)
    guard case .complete(let minimal, _) = reparser.parse(rebuilt) else {
        return invariant(false, "serialized(drop: all) does not parse")
    }
    invariant(
        minimal.fields.count == 1 && minimal.value(at: 0) == "1", "serialized(drop: all, extra:) has other fields")
}

/// The comma-separated elements of every field named `lowercaseName`, computed from the raw bytes with
/// ASCII-only case folding: what a server downstream compares against.
func rawListElements(_ head: HTTPHead, _ lowercaseName: StaticString) -> [[UInt8]] {
    var elements: [[UInt8]] = []
    for index in head.indices(named: lowercaseName) {
        for element in head.valueBytes(at: index).split(separator: UInt8(ascii: ","), omittingEmptySubsequences: true) {
            var trimmed = element[...]
            while let first = trimmed.first, first == 0x20 || first == 0x09 { trimmed.removeFirst() }
            while let last = trimmed.last, last == 0x20 || last == 0x09 { trimmed.removeLast() }
            if !trimmed.isEmpty { elements.append(asciiLowercased(trimmed)) }
        }
    }
    return elements
}

func bytes(_ string: String) -> [UInt8] { Array(string.utf8) }
