import Testing

@testable import ProxyCore

/// What scanning a sequence of pieces came to; `consumed` counts from the start of the first piece.
private enum ScanResult: Equatable, CustomStringConvertible {
    case needMore
    case done(consumed: Int)
    case failed(HTTPParseError.Code)

    var description: String {
        switch self {
        case .needMore: "needMore"
        case .done(let consumed): "done(consumed: \(consumed))"
        case .failed(let code): "failed(\(code))"
        }
    }
}

private func scan(_ pieces: [[UInt8]]) -> ScanResult {
    var scanner = ChunkedScanner()
    var offset = 0
    for piece in pieces {
        switch scanner.scan(piece) {
        case .needMore: offset += piece.count
        case .done(let consumed): return .done(consumed: offset + consumed)
        case .failed(let error): return .failed(error.code)
        }
    }
    return .needMore
}

private func scan(_ text: String) -> ScanResult { scan([text.bytes]) }

/// The chunked transfer coding (RFC 9112 §7.1): where a body ends, and every way it can be malformed.
@Suite struct ChunkedScannerTests {
    static let validBodies: [String] = [
        "0\r\n\r\n",
        "5\r\nhello\r\n0\r\n\r\n",
        "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        "a\r\n0123456789\r\nA\r\n0123456789\r\n0\r\n\r\n",  // hex digits in either case
        "0005\r\nhello\r\n000\r\n\r\n",  // leading zeros
        "5;name=value\r\nhello\r\n0\r\n\r\n",  // chunk extension
        "5;a;b=c;d=\"quoted ; \\\" value\"\r\nhello\r\n0;last\r\n\r\n",
        "5 ; a=b\r\nhello\r\n0\t;x\r\n\r\n",  // BWS before ";"
        "6\r\n\r\n\r\n\r\n\r\n0\r\n\r\n",  // data that looks like framing is data
        "5\r\nhello\r\n0\r\nExpires: never\r\n\r\n",  // a trailer field
        "5\r\nhello\r\n0\r\nA: 1\r\nB-2:\r\nC:  x y \r\n\r\n",  // several trailer fields
        "3\r\n\u{E9}a\r\n0\r\n\r\n",  // data is bytes, not characters
    ]

    @Test(arguments: validBodies)
    func validBodyEndsExactlyAtItsEnd(body: String) {
        let input = body.bytes + "GET /next HTTP/1.1\r\n".bytes
        #expect(scan([input]) == .done(consumed: body.utf8.count))
    }

    @Test(arguments: validBodies)
    func validBodySplitAtEveryByte(body: String) {
        let input = body.bytes + "NEXT".bytes
        let expected = ScanResult.done(consumed: body.utf8.count)
        for split in 0...input.count {
            #expect(scan([Array(input[..<split]), Array(input[split...])]) == expected, "split at \(split)")
        }
        #expect(scan(input.map { [$0] }) == expected, "one byte at a time")
    }

    @Test(arguments: validBodies)
    func incompleteBodyNeedsMore(body: String) {
        let bytes = body.bytes
        for end in 0..<bytes.count {
            #expect(scan([Array(bytes[..<end])]) == .needMore, "truncated at \(end)")
        }
    }

    @Test func doneStopsRightAfterTheBody() {
        var scanner = ChunkedScanner()
        let input = "5\r\nhello\r\n0\r\n\r\n5\r\nworld".bytes
        #expect(scanner.scan(input) == .done(consumed: 15))
        #expect(scanner.isFinished)
        #expect(scanner.dataBytes == 5)
    }

    @Test func consumedIsRelativeToTheLastInput() {
        var scanner = ChunkedScanner()
        #expect(scanner.scan("5\r\nhel".bytes) == .needMore)
        #expect(!scanner.isFinished)
        #expect(scanner.scan("lo\r\n0\r\n\r\nNEXT".bytes) == .done(consumed: 9))
    }

    @Test func dataIsCountedAndCanBeSkipped() {
        var scanner = ChunkedScanner()
        #expect(scanner.scan("1a;x=y\r\n".bytes) == .needMore)
        #expect(scanner.pendingData == 26)
        scanner.skipData(10)
        #expect(scanner.pendingData == 16)
        scanner.skipData(16)
        #expect(scanner.pendingData == 0)
        #expect(scanner.dataBytes == 26)
        #expect(scanner.scan("\r\n3\r\nabc".bytes) == .needMore)
        #expect(scanner.dataBytes == 29)
        #expect(scanner.scan("\r\n0\r\n\r\n".bytes) == .done(consumed: 7))
    }

    @Test func largestChunkSize() {
        // 2^63 - 1: the largest size a next hop with signed 64-bit lengths reads the same way.
        var scanner = ChunkedScanner()
        #expect(scanner.scan("7FFFFFFFFFFFFFFF\r\n".bytes) == .needMore)
        #expect(scanner.pendingData == UInt64(Int64.max))
        #expect(scanner.scan([UInt8](repeating: 0x61, count: 4096)) == .needMore)
        #expect(scanner.pendingData == UInt64(Int64.max) - 4096)
        #expect(scanner.dataBytes == 4096)
        for tooLarge in ["8000000000000000\r\n", "FFFFFFFFFFFFFFFF\r\n", "00000000000000000008000000000000000\r\n"] {
            var refused = ChunkedScanner()
            #expect(
                refused.scan(tooLarge.bytes) == .failed(HTTPParseError(.badChunk, "chunk size too large")),
                "\(tooLarge)")
        }
    }

    @Test func largeChunkPassesWithoutFalseFraming() {
        // One MiB of CRLFs and zeros: data is skipped by count, never read as framing.
        let size = 1 << 20
        let data = [UInt8](repeating: 0, count: size).enumerated().map { $0.offset % 2 == 0 ? ASCII.cr : ASCII.lf }
        let input = "100000\r\n".bytes + data + "\r\n0\r\n\r\n".bytes + "NEXT".bytes
        var scanner = ChunkedScanner()
        #expect(scanner.scan(input) == .done(consumed: input.count - 4))
        #expect(scanner.dataBytes == UInt64(size))
        #expect(scan([Array(input[..<(size / 2)]), Array(input[(size / 2)...])]) == .done(consumed: input.count - 4))
    }

    // MARK: - Rejections

    @Test(arguments: [
        "g\r\nhello\r\n0\r\n\r\n",  // not hexadecimal
        "\r\nhello\r\n0\r\n\r\n",  // empty size
        ";ext\r\n",  // extension without a size
        " 5\r\nhello\r\n0\r\n\r\n",  // whitespace before the size
        "-1\r\n",
        "+5\r\nhello\r\n0\r\n\r\n",
        "0x5\r\nhello\r\n0\r\n\r\n",
        "5x\r\nhello\r\n0\r\n\r\n",
        "10000000000000000\r\n",  // 17 hex digits overflow a UInt64
        "00000000000000001\r\n",  // 17 digits even with leading zeros: no parser may disagree
        "5\nhello\r\n0\r\n\r\n",  // bare LF after the size
        "5;a=b\nhello\r\n0\r\n\r\n",  // bare LF after an extension
        "5\rhello\r\n0\r\n\r\n",  // CR without LF
        "5\r\nhelloX\r\n0\r\n\r\n",  // data longer than its size
        "5\r\nhello\n0\r\n\r\n",  // bare LF after data
        "5\r\nhello\rX0\r\n\r\n",  // CR without LF after data
        "5\r\nhello0\r\n\r\n",  // no CRLF after data
        "3\r\nhello\r\n0\r\n\r\n",  // data longer than the size says
        "5;a\u{01}\r\nhello\r\n0\r\n\r\n",  // control character in an extension
        "5;a\u{7F}\r\nhello\r\n0\r\n\r\n",
        "5;a\u{0}b\r\nhello\r\n0\r\n\r\n",
        "0\r\n\n",  // bare LF ending the body
        "0\r\n\rX",  // CR without LF ending the body
        "0\r\n X: a\r\n\r\n",  // obs-fold-like trailer line
        "0\r\n\tX: a\r\n\r\n",
        "0\r\nX: a\nY: b\r\n\r\n",  // bare LF in the trailer section
        "0\r\nX: a\rY: b\r\n\r\n",  // bare CR in the trailer section
        "0\r\nX: a\u{01}\r\n\r\n",  // control character in a trailer value
        "0\r\n(X): a\r\n\r\n",  // not a token
        "0\r\n: a\r\n\r\n",  // empty trailer name
        "0\r\nNoColon\r\n\r\n",  // a trailer line is a field line: it needs a colon
        "0\r\nX : a\r\n\r\n",  // whitespace before the colon (RFC 9112 §5.1)
        "0\r\nX(y): a\r\n\r\n",
    ])
    func malformedBodyIsRejected(body: String) {
        #expect(scan(body + "NEXT") == .failed(.badChunk))
    }

    @Test(arguments: [
        "10000000000000000\r\n", "5\nhello\r\n0\r\n\r\n", "5;a\u{01}\r\nhello\r\n0\r\n\r\n",
        "5\r\nhelloX\r\n0\r\n\r\n", "0\r\nX: a\u{01}\r\n\r\n", "0\r\nNoColon\r\n\r\n",
    ])
    func rejectionDoesNotDependOnSplits(body: String) {
        let input = body.bytes + "NEXT".bytes
        for split in 0...input.count {
            #expect(scan([Array(input[..<split]), Array(input[split...])]) == .failed(.badChunk), "split at \(split)")
        }
        #expect(scan(input.map { [$0] }) == .failed(.badChunk), "one byte at a time")
    }

    @Test func failureIsSticky() {
        var scanner = ChunkedScanner()
        guard case .failed(let error) = scanner.scan("z\r\n".bytes) else {
            Issue.record("expected a failure")
            return
        }
        #expect(error.code == .badChunk)
        #expect(error.status == 400)
        guard case .failed = scanner.scan("0\r\n\r\n".bytes) else {
            Issue.record("a failed scanner accepted more bytes")
            return
        }
    }

    @Test func overlongExtensionIsRejected() {
        let line = "5;" + String(repeating: "a", count: ChunkedScanner.maxLine) + "\r\n"
        #expect(scan(line) == .failed(.badChunk))
        let fits = "5;" + String(repeating: "a", count: ChunkedScanner.maxLine - 4) + "\r\nhello\r\n0\r\n\r\n"
        #expect(scan(fits) == .done(consumed: fits.utf8.count))
    }

    @Test func oversizedTrailerSectionIsRejected() {
        let body = "0\r\nX: " + String(repeating: "v", count: ChunkedScanner.maxTrailers) + "\r\n\r\n"
        #expect(scan(body) == .failed(.badChunk))
    }
}
