import Testing

@testable import ProxyCore

/// The HTTP/1.1 head parser (RFC 9112 §2-§5): accepted forms, every rejection, limits, and the promise that
/// the outcome does not depend on how the bytes are split across reads.
@Suite struct HTTPHeadParserTests {
    // MARK: - Requests that parse

    @Test func originFormRequest() throws {
        let text = crlfHead("GET /index.html?x=1&y=%20 HTTP/1.1", "Host: example.com", "Accept: */*")
        let head = try parseHead(text)
        #expect(head.method == "GET")
        #expect(head.target == "/index.html?x=1&y=%20")
        #expect(head.version == .http1_1)
        #expect(head.status == 0)
        #expect(head.fields.count == 2)
        #expect(head.name(at: 0) == "Host")
        #expect(head.value(at: 0) == "example.com")
        #expect(head.name(at: 1) == "Accept")
        #expect(head.value(at: 1) == "*/*")
    }

    @Test func absoluteFormRequest() throws {
        let head = try parseHead(crlfHead("POST http://example.com:8080/a/b?c HTTP/1.1", "Host: example.com:8080"))
        #expect(head.method == "POST")
        #expect(head.target == "http://example.com:8080/a/b?c")
        #expect(head.version == .http1_1)
    }

    @Test func authorityFormConnect() throws {
        let head = try parseHead(crlfHead("CONNECT example.com:443 HTTP/1.1", "Host: example.com:443"))
        #expect(head.method == "CONNECT")
        #expect(head.target == "example.com:443")
    }

    @Test func asteriskForm() throws {
        let head = try parseHead(crlfHead("OPTIONS * HTTP/1.1", "Host: example.com"))
        #expect(head.method == "OPTIONS")
        #expect(head.target == "*")
    }

    @Test func http10WithoutFields() throws {
        let head = try parseHead("GET / HTTP/1.0\r\n\r\n")
        #expect(head.version == .http1_0)
        #expect(head.fields.isEmpty)
        #expect(head.fieldsStart == head.bytes.count - 2)
    }

    @Test(arguments: ["M-SEARCH", "PROPFIND", "get", "X!#$%&'*+-.^_`|~1"])
    func extensionMethodsAreTokens(method: String) throws {
        // RFC 9110 §9.1: a method is a token and is case-sensitive; "get" is not "GET".
        let head = try parseHead(crlfHead("\(method) / HTTP/1.1", "Host: a"))
        #expect(head.method == method)
    }

    @Test func fieldValuesAreTrimmedOfOptionalWhitespace() throws {
        let head = try parseHead(crlfHead("GET / HTTP/1.1", "A:  spaced  \t", "B:", "C:\tx y\tz", "D:   "))
        #expect(head.value(at: 0) == "spaced")
        #expect(head.value(at: 1) == "")
        #expect(head.value(at: 2) == "x y\tz")
        #expect(head.value(at: 3) == "")
    }

    @Test func obsTextInValueIsAccepted() throws {
        // RFC 9110 §5.5: field-vchar includes obs-text (0x80-0xFF).
        let bytes = "GET / HTTP/1.1\r\nX-Name: caf".bytes + [0xE9, 0xFF, 0x80] + "\r\n\r\n".bytes
        let head = try parseHead(bytes)
        #expect(Array(head.valueBytes(at: 0)) == "caf".bytes + [0xE9, 0xFF, 0x80])
    }

    @Test func fieldLookupIsCaseInsensitive() throws {
        let head = try parseHead(
            crlfHead(
                "GET / HTTP/1.1", "Host: a", "connection: Keep-Alive, X-Foo", "CONNECTION: ,close,,",
                "X-Other: 1"))
        #expect(head.indices(named: "connection") == [1, 2])
        #expect(head.values(named: "connection") == ["Keep-Alive, X-Foo", ",close,,"])
        #expect(head.listElements(named: "connection") == ["keep-alive", "x-foo", "close"])
        #expect(head.field(0, isNamed: "host"))
        #expect(!head.field(0, isNamed: "hos"))
        #expect(head.indices(named: "missing").isEmpty)
    }

    // MARK: - Responses that parse

    @Test func responseWithReasonPhrase() throws {
        let head = try parseHead(crlfHead("HTTP/1.1 404 Not Found", "Content-Length: 0"), kind: .response)
        #expect(head.status == 404)
        #expect(head.version == .http1_1)
        #expect(head.method == "")
        #expect(head.target == "")
        #expect(head.value(at: 0) == "0")
    }

    @Test(arguments: ["HTTP/1.1 204", "HTTP/1.1 204 ", "HTTP/1.0 204 No Content"])
    func responseReasonPhraseIsOptional(statusLine: String) throws {
        let head = try parseHead(crlfHead(statusLine), kind: .response)
        #expect(head.status == 204)
    }

    @Test func responseReasonPhraseMayHoldObsTextAndTabs() throws {
        let bytes = "HTTP/1.1 200 O\tK ".bytes + [0xC3, 0xA9] + "\r\n\r\n".bytes
        let head = try parseHead(bytes, kind: .response)
        #expect(head.status == 200)
    }

    @Test func responseToleratesBareLF() throws {
        // RFC 9112 §2.2: a recipient MAY recognise a single LF as a line terminator; old servers send it.
        let text = "HTTP/1.1 200 OK\nContent-Length: 2\r\nX-A: b\n\nhi"
        var parser = HTTPHeadParser(kind: .response)
        guard case .complete(let head, let consumed) = parser.parse(text.bytes) else {
            Issue.record("bare-LF response did not parse")
            return
        }
        #expect(consumed == text.utf8.count - 2)
        #expect(head.status == 200)
        #expect(head.fields.count == 2)
        #expect(head.value(at: 0) == "2")
        #expect(head.value(at: 1) == "b")
        #expect(head.bytes == Array(text.utf8.dropLast(2)))
    }

    // MARK: - Rejections

    @Test(arguments: [
        "GET  / HTTP/1.1",  // double space before the target
        "GET /  HTTP/1.1",  // double space before the version
        "GET / HTTP/1.1 ",  // trailing space
        " GET / HTTP/1.1",  // leading space
        "GET /",  // no version
        "GET / ",  // empty version
        "GET",  // method only
        "GET /HTTP/1.1",  // no space before the version
        "G(ET / HTTP/1.1",  // "(" is not a tchar
        "G@T / HTTP/1.1",
        "GET\t/ HTTP/1.1",  // HTAB is not the separator
        "GET / http/1.1",  // the version name is case-sensitive
        "GET / HTTP/1.1.1",
        "GET / HTTP/11",
        "GET / HTTP/1",
        "GET / HTTP/a.1",
        "GET / HTTP/1.x",
        "GET / HTTPS/1.1",
    ])
    func malformedRequestLine(line: String) {
        #expect(feedHead([crlfHead(line, "Host: a").bytes]) == .failed(.malformed))
    }

    @Test(arguments: [UInt8(0x00), 0x01, 0x09, 0x0B, 0x0C, 0x1B, 0x1F, 0x7F])
    func controlCharacterInTargetIsRejected(byte: UInt8) {
        let bytes = "GET /a".bytes + [byte] + "b HTTP/1.1\r\nHost: a\r\n\r\n".bytes
        #expect(feedHead([bytes]) == .failed(.malformed))
    }

    /// Raw UTF-8 in a target (curl sends a URL's bytes as given) is kept byte for byte, combining marks
    /// right after a delimiter included.
    @Test func utf8InTargetIsKeptByteForByte() throws {
        let target = "/".bytes + [0xCC, 0x81] + "caf".bytes + [0xC3, 0xA9] + "?".bytes + [0xCC, 0x81] + "q".bytes
        let head = try parseHead("GET ".bytes + target + " HTTP/1.1\r\nHost: a\r\n\r\n".bytes)
        #expect(Array(head.target.utf8) == target)
    }

    /// Bytes above 0x7F that are not UTF-8 could not be forwarded unchanged: refused, never altered.
    @Test(arguments: [[UInt8(0xFF)], [0xE9], [0xC3], [0x80], [0xED, 0xA0, 0x80], [0xC0, 0xAF]])
    func nonUTF8InTargetIsRejected(bytes: [UInt8]) {
        let request = "GET /a".bytes + bytes + "b HTTP/1.1\r\nHost: a\r\n\r\n".bytes
        #expect(feedHead([request]) == .failed(.malformed))
        let absolute = "GET http://example.com/a?".bytes + bytes + " HTTP/1.1\r\nHost: example.com\r\n\r\n".bytes
        #expect(feedHead([absolute]) == .failed(.malformed))
    }

    @Test func nonASCIIMethodIsRejected() {
        let bytes = "G".bytes + [0xC3, 0x89] + "T / HTTP/1.1\r\nHost: a\r\n\r\n".bytes
        #expect(feedHead([bytes]) == .failed(.malformed))
    }

    @Test(arguments: ["HTTP/2.0", "HTTP/3.0", "HTTP/0.9", "HTTP/9.9"])
    func otherVersionsAreNotSupported(version: String) throws {
        #expect(feedHead([crlfHead("GET / \(version)", "Host: a").bytes]) == .failed(.versionNotSupported))
        var parser = HTTPHeadParser(kind: .request)
        guard case .failed(let error) = parser.parse(crlfHead("GET / \(version)").bytes) else {
            Issue.record("expected a failure")
            return
        }
        #expect(error.status == 505)
    }

    @Test(arguments: [
        "GET / HTTP/1.1\nHost: a\r\n\r\n",  // after the request line
        "GET / HTTP/1.1\r\nHost: a\n\r\n",  // after a field line
        "GET / HTTP/1.1\r\nHost: a\r\n\n",  // the final empty line
        "\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",  // a leading empty line
    ])
    func bareLFInRequestIsRejected(text: String) {
        // RFC 9112 §2.2: a server may accept a bare LF; this proxy does not, so that no two parsers disagree.
        #expect(feedHead([text.bytes]) == .failed(.malformed))
    }

    @Test(arguments: [
        "GET / HTTP/1.1\r\nX: a\rb\r\n\r\n",  // inside a value
        "GET / HTTP/1.1\r\r\nHost: a\r\n\r\n",  // doubled before the LF of the request line
        "GET / HTTP/1.1\r\nHost: a\r\r\n\r\n",  // doubled before the LF of a field line
        "GET /\r HTTP/1.1\r\nHost: a\r\n\r\n",  // inside the target
        "GET / HTTP/1.1\rHost: a\r\n\r\n",  // as a line terminator
        "GET / HTTP/1.1\r\nX\r: a\r\n\r\n",  // inside a name
        "GET / HTTP/1.1\r\nHost: a\r\n\r\r\n",  // before the final CRLF
    ])
    func bareCRIsRejected(text: String) {
        // RFC 9112 §2.2: a bare CR outside the line terminator must be rejected or replaced by SP.
        #expect(feedHead([text.bytes]) == .failed(.malformed))
    }

    @Test(arguments: [
        crlfHead("GET / HTTP/1.1", "X: a", " b"),
        crlfHead("GET / HTTP/1.1", "X: a", "\tb"),
        crlfHead("GET / HTTP/1.1", " Host: a"),  // whitespace before the first field line
    ])
    func obsFoldIsRejected(text: String) {
        // RFC 9112 §5.2: obs-fold is rejected in requests.
        #expect(feedHead([text.bytes]) == .failed(.malformed))
    }

    @Test func obsFoldInResponseIsRejectedToo() {
        // A proxy must not forward obs-fold (RFC 9112 §5.2); refusing it is the simple safe choice.
        #expect(feedHead([crlfHead("HTTP/1.1 200 OK", "X: a", " b").bytes], kind: .response) == .failed(.malformed))
    }

    @Test(arguments: ["Host : a", "Host\t: a", "Content-Length  : 5"])
    func whitespaceBeforeColonIsRejected(line: String) {
        // RFC 9112 §5.1: whitespace between the field name and the colon must be rejected with 400.
        #expect(feedHead([crlfHead("GET / HTTP/1.1", line).bytes]) == .failed(.malformed))
        #expect(feedHead([crlfHead("HTTP/1.1 200 OK", line).bytes], kind: .response) == .failed(.malformed))
    }

    @Test(arguments: [UInt8(0x00), 0x01, 0x08, 0x0B, 0x0C, 0x0E, 0x1B, 0x1F, 0x7F])
    func controlCharacterInValueIsRejected(byte: UInt8) {
        let bytes = "GET / HTTP/1.1\r\nX-A: a".bytes + [byte] + "b\r\n\r\n".bytes
        #expect(feedHead([bytes]) == .failed(.malformed))
        let response = "HTTP/1.1 200 OK\r\nX-A: a".bytes + [byte] + "b\r\n\r\n".bytes
        #expect(feedHead([response], kind: .response) == .failed(.malformed))
    }

    @Test(arguments: [UInt8(0x00), 0x01, 0x0B, 0x1F, 0x7F])
    func controlCharacterAnywhereInALongValueIsRejected(byte: UInt8) {
        // Long values are checked eight bytes at a time: a bad byte in every position of the words and the tail.
        let value = [UInt8]("abcdefghijklmnopqrstuvwxyz0".utf8)
        for position in value.indices {
            var bad = value
            bad[position] = byte
            let bytes = "GET / HTTP/1.1\r\nX-Long: ".bytes + bad + "\r\n\r\n".bytes
            #expect(feedHead([bytes]) == .failed(.malformed), "byte \(byte) at \(position)")
        }
    }

    @Test func tabsAndObsTextAnywhereInALongValueAreKept() throws {
        let value = [UInt8]("abcdefghijklmnopqrstuvwxyz0".utf8)
        for position in 1..<value.count - 1 {
            for byte: UInt8 in [0x09, 0x80, 0xFF, 0x20, 0x7E] {
                var kept = value
                kept[position] = byte
                let head = try parseHead("GET / HTTP/1.1\r\nX-Long: ".bytes + kept + "\r\n\r\n".bytes)
                #expect(Array(head.valueBytes(at: 0)) == kept, "byte \(byte) at \(position)")
            }
        }
    }

    @Test func aHeadLargerThanOnePieceEndsWhereItEnds() {
        // The parser copies its input a piece (2 KiB) at a time: a head across pieces, with a body behind it in
        // the same input, is taken up to its empty line and no further, however the input is split.
        let fields = (0..<80).map { "X-Field-\($0): " + String(repeating: "v", count: 50 + $0 % 7) }
        let head = crlfHead(["GET / HTTP/1.1", "Host: a"] + fields)
        #expect(head.utf8.count > 2 * HTTPHeadParser.piece)
        let input = (head + String(repeating: "B", count: 5000)).bytes
        let expected = HeadFeedResult.complete(bytes: head.bytes, consumed: head.utf8.count)
        #expect(feedHead([input]) == expected)
        for split in [1, 2047, 2048, 2049, 4095, 4096, head.utf8.count - 1, head.utf8.count] {
            #expect(feedHead([Array(input[..<split]), Array(input[split...])]) == expected, "split at \(split)")
        }
    }

    @Test(arguments: [
        ": value",  // empty name
        "NoColon",
        "X(a): b",  // "(" is not a tchar
        "X\"a: b",
        "X/a: b",
        "X a: b",
        "Caf\u{E9}: b",
    ])
    func malformedFieldLine(line: String) {
        #expect(feedHead([crlfHead("GET / HTTP/1.1", line).bytes]) == .failed(.malformed))
    }

    @Test(arguments: [
        "HTTP/1.1 20 OK",
        "HTTP/1.1 2000 OK",
        "HTTP/1.1 099 Low",
        "HTTP/1.1 2x0 OK",
        "HTTP/1.1  200 OK",
        "HTTP/2 200 OK",
        "HTTP/1.1",
        "http/1.1 200 OK",
        "HTTP/1.1 200\tOK",
        "ICY 200 OK",
    ])
    func malformedStatusLine(line: String) {
        #expect(feedHead([crlfHead(line).bytes], kind: .response) == .failed(.malformed))
    }

    @Test func responseVersion2IsNotSupported() {
        #expect(feedHead([crlfHead("HTTP/2.0 200 OK").bytes], kind: .response) == .failed(.versionNotSupported))
    }

    @Test func controlCharacterInReasonPhraseIsRejected() {
        let bytes = "HTTP/1.1 200 O".bytes + [0x01] + "K\r\n\r\n".bytes
        #expect(feedHead([bytes], kind: .response) == .failed(.malformed))
    }

    @Test func emptyLineBeforeStatusLineIsRejected() {
        #expect(feedHead(["\r\nHTTP/1.1 200 OK\r\n\r\n".bytes], kind: .response) == .failed(.malformed))
    }

    // MARK: - Leading empty lines

    @Test(arguments: 1...4)
    func leadingEmptyLinesAreSkipped(count: Int) {
        // RFC 9112 §2.2: a server should ignore at least one empty line received before the request line.
        let head = crlfHead("GET / HTTP/1.1", "Host: a")
        let input = String(repeating: "\r\n", count: count) + head + "BODY"
        let expected = HeadFeedResult.complete(bytes: head.bytes, consumed: 2 * count + head.utf8.count)
        #expect(feedHead([input.bytes]) == expected)
        #expect(feedHead(input.bytes.map { [$0] }) == expected)
        // The start line is found where it really starts, not shifted by the skipped lines.
        var parser = HTTPHeadParser(kind: .request)
        guard case .complete(let parsed, _) = parser.parse(input.bytes) else {
            Issue.record("head did not parse")
            return
        }
        #expect(parsed.method == "GET")
        #expect(parsed.target == "/")
        #expect(String(decoding: parsed.bytes[parsed.startLine], as: UTF8.self) == "GET / HTTP/1.1")
        #expect(parsed.value(at: 0) == "a")
    }

    @Test func fiveLeadingEmptyLinesAreRejected() {
        let input = String(repeating: "\r\n", count: 5) + crlfHead("GET / HTTP/1.1", "Host: a")
        #expect(feedHead([input.bytes]) == .failed(.malformed))
    }

    // MARK: - Limits

    @Test func requestLineAtTheLimitIsAccepted() {
        let limits = HTTPHeadLimits(maxStartLine: 32, maxHeadBytes: 1024, maxFields: 10)
        let line = "GET /" + String(repeating: "a", count: 32 - 14) + " HTTP/1.1"
        #expect(line.utf8.count == 32)
        let text = crlfHead(line, "Host: a")
        #expect(feedHead([text.bytes], limits: limits) == .complete(bytes: text.bytes, consumed: text.utf8.count))
    }

    @Test func requestLineOverTheLimitIs414() {
        let limits = HTTPHeadLimits(maxStartLine: 32, maxHeadBytes: 1024, maxFields: 10)
        let line = "GET /" + String(repeating: "a", count: 33 - 14) + " HTTP/1.1"
        #expect(feedHead([crlfHead(line, "Host: a").bytes], limits: limits) == .failed(.startLineTooLong))
        var parser = HTTPHeadParser(kind: .request, limits: limits)
        guard case .failed(let error) = parser.parse(crlfHead(line).bytes) else {
            Issue.record("expected a failure")
            return
        }
        #expect(error.status == 414)
    }

    @Test func longRequestLineFailsBeforeItsEndArrives() {
        // The parser must not buffer an endless request line while waiting for its LF.
        let limits = HTTPHeadLimits(maxStartLine: 32, maxHeadBytes: 1024, maxFields: 10)
        let partial = "GET /" + String(repeating: "a", count: 40)
        #expect(feedHead([partial.bytes], limits: limits) == .failed(.startLineTooLong))
    }

    @Test func statusLineOverTheLimitIs431() {
        let limits = HTTPHeadLimits(maxStartLine: 32, maxHeadBytes: 1024, maxFields: 10)
        let line = "HTTP/1.1 200 " + String(repeating: "k", count: 20)
        #expect(feedHead([crlfHead(line).bytes], kind: .response, limits: limits) == .failed(.headTooLarge))
    }

    @Test func headAtTheByteLimitIsAccepted() {
        let text = crlfHead("GET / HTTP/1.1", "Host: a", "X: " + String(repeating: "v", count: 30))
        let limits = HTTPHeadLimits(maxStartLine: 100, maxHeadBytes: text.utf8.count, maxFields: 10)
        #expect(feedHead([text.bytes], limits: limits) == .complete(bytes: text.bytes, consumed: text.utf8.count))
    }

    @Test func headOverTheByteLimitIs431() {
        let text = crlfHead("GET / HTTP/1.1", "Host: a", "X: " + String(repeating: "v", count: 30))
        let limits = HTTPHeadLimits(maxStartLine: 100, maxHeadBytes: text.utf8.count - 1, maxFields: 10)
        #expect(feedHead([text.bytes], limits: limits) == .failed(.headTooLarge))
        #expect(feedHead(text.bytes.map { [$0] }, limits: limits) == .failed(.headTooLarge))
        var parser = HTTPHeadParser(kind: .request, limits: limits)
        guard case .failed(let error) = parser.parse(text.bytes) else {
            Issue.record("expected a failure")
            return
        }
        #expect(error.status == 431)
    }

    @Test func endlessFieldLineFailsBeforeItsEndArrives() {
        let limits = HTTPHeadLimits(maxStartLine: 100, maxHeadBytes: 200, maxFields: 10)
        let partial = "GET / HTTP/1.1\r\nX: " + String(repeating: "v", count: 300)
        #expect(feedHead([partial.bytes], limits: limits) == .failed(.headTooLarge))
    }

    @Test func fieldCountAtTheLimitIsAccepted() {
        let limits = HTTPHeadLimits(maxStartLine: 100, maxHeadBytes: 4096, maxFields: 5)
        let text = crlfHead(["GET / HTTP/1.1"] + (1...5).map { "X-\($0): v" })
        #expect(feedHead([text.bytes], limits: limits) == .complete(bytes: text.bytes, consumed: text.utf8.count))
    }

    @Test func tooManyFieldsIs431() {
        let limits = HTTPHeadLimits(maxStartLine: 100, maxHeadBytes: 4096, maxFields: 5)
        let text = crlfHead(["GET / HTTP/1.1"] + (1...6).map { "X-\($0): v" })
        #expect(feedHead([text.bytes], limits: limits) == .failed(.headTooLarge))
    }

    @Test func defaultLimits() {
        let limits = HTTPHeadLimits()
        #expect(limits.maxStartLine == 8192)
        #expect(limits.maxHeadBytes == 65536)
        #expect(limits.maxFields == 100)
    }

    @Test func errorStatuses() {
        #expect(HTTPParseError(.malformed, "").status == 400)
        #expect(HTTPParseError(.badFraming, "").status == 400)
        #expect(HTTPParseError(.badChunk, "").status == 400)
        #expect(HTTPParseError(.startLineTooLong, "").status == 414)
        #expect(HTTPParseError(.headTooLarge, "").status == 431)
        #expect(HTTPParseError(.versionNotSupported, "").status == 505)
        // Equality is on the code only.
        #expect(HTTPParseError(.malformed, "a") == HTTPParseError(.malformed, "b"))
        #expect(HTTPParseError(.malformed, "a") != HTTPParseError(.badFraming, "a"))
    }

    @Test func errorReasonNeverContainsAFieldValue() {
        var parser = HTTPHeadParser(kind: .request)
        let bytes = "GET / HTTP/1.1\r\nAuthorization: Bearer sekrit".bytes + [0x01] + "\r\n\r\n".bytes
        guard case .failed(let error) = parser.parse(bytes) else {
            Issue.record("expected a failure")
            return
        }
        #expect(!error.reason.contains("sekrit"))
        #expect(error.reason.contains("Authorization"))
    }

    // MARK: - Split at every byte boundary

    /// Heads that parse, each followed by body bytes that must not be consumed.
    static let validHeads: [(kind: HTTPHeadParser.Kind, head: String, limits: HTTPHeadLimits)] = [
        (.request, crlfHead("GET /index.html HTTP/1.1", "Host: example.com", "Accept: */*"), HTTPHeadLimits()),
        (.request, crlfHead("POST http://example.com/x HTTP/1.1", "Host: example.com", "Content-Length: 4"), .init()),
        (.request, crlfHead("CONNECT example.com:443 HTTP/1.1", "Host: example.com:443"), HTTPHeadLimits()),
        (.request, crlfHead("OPTIONS * HTTP/1.0"), HTTPHeadLimits()),
        (.request, "\r\n\r\n" + crlfHead("GET / HTTP/1.1", "Host: a"), HTTPHeadLimits()),
        (.request, crlfHead("GET / HTTP/1.1", "X:", "Y:  a b  "), HTTPHeadLimits()),
        (.response, crlfHead("HTTP/1.1 200 OK", "Content-Length: 4"), HTTPHeadLimits()),
        (.response, crlfHead("HTTP/1.1 204"), HTTPHeadLimits()),
        (.response, "HTTP/1.0 200 OK\nContent-Length: 4\n\n", HTTPHeadLimits()),
        (.response, "HTTP/1.1 200 OK\r\nA: b\n\r\n", HTTPHeadLimits()),
        // Exactly at each limit: a split must not push a head over it.
        (
            .request, crlfHead("GET /" + String(repeating: "a", count: 18) + " HTTP/1.1", "Host: a"),
            HTTPHeadLimits(maxStartLine: 32, maxHeadBytes: 1024, maxFields: 10)
        ),
        (
            .request, crlfHead("GET / HTTP/1.1", "Host: a", "B: c"),
            HTTPHeadLimits(maxStartLine: 32, maxHeadBytes: 33, maxFields: 2)
        ),
        (
            .response, crlfHead("HTTP/1.1 200 " + String(repeating: "k", count: 19), "A: b"),
            HTTPHeadLimits(maxStartLine: 32, maxHeadBytes: 1024, maxFields: 10)
        ),
    ]

    /// Heads that fail, and how.
    static let invalidHeads: [(kind: HTTPHeadParser.Kind, head: String, code: HTTPParseError.Code)] = [
        (.request, crlfHead("GET  / HTTP/1.1", "Host: a"), .malformed),
        (.request, crlfHead("GET / HTTP/2.0", "Host: a"), .versionNotSupported),
        (.request, "GET / HTTP/1.1\nHost: a\r\n\r\n", .malformed),
        (.request, "GET / HTTP/1.1\r\nHost: a\n\n", .malformed),
        (.request, "GET / HTTP/1.1\r\nX: a\rb\r\n\r\n", .malformed),
        (.request, crlfHead("GET / HTTP/1.1", "X: a", " b"), .malformed),
        (.request, crlfHead("GET / HTTP/1.1", "Host : a"), .malformed),
        (.request, crlfHead("GET / HTTP/1.1", ": a"), .malformed),
        (.request, "GET / HTTP/1.1\r\nX: \u{7F}\r\n\r\n", .malformed),
        (.request, String(repeating: "\r\n", count: 5) + crlfHead("GET / HTTP/1.1"), .malformed),
        (.request, crlfHead("GET /" + String(repeating: "a", count: 9000) + " HTTP/1.1"), .startLineTooLong),
        (.request, crlfHead(["GET / HTTP/1.1"] + (0...100).map { "X-\($0): v" }), .headTooLarge),
        (.request, crlfHead("GET / HTTP/1.1", "X: " + String(repeating: "v", count: 70_000)), .headTooLarge),
        (.response, crlfHead("HTTP/1.1 2000 OK"), .malformed),
        (.response, crlfHead("HTTP/2.0 200 OK"), .versionNotSupported),
        (.response, crlfHead("HTTP/1.1 200 OK", "A : b"), .malformed),
    ]

    @Test(arguments: HTTPHeadParserTests.validHeads.indices)
    func validHeadSplitAtEveryByte(index: Int) {
        let (kind, head, limits) = Self.validHeads[index]
        let input = head.bytes + "BODY".bytes
        // The head as stored excludes leading empty lines.
        var stored = head.bytes[...]
        while stored.starts(with: [ASCII.cr, ASCII.lf]) { stored = stored.dropFirst(2) }
        let expected = HeadFeedResult.complete(bytes: Array(stored), consumed: head.utf8.count)
        #expect(feedHead([input], kind: kind, limits: limits) == expected)
        for split in 0...input.count {
            let pieces = [Array(input[..<split]), Array(input[split...])]
            #expect(feedHead(pieces, kind: kind, limits: limits) == expected, "split at \(split)")
        }
        #expect(feedHead(input.map { [$0] }, kind: kind, limits: limits) == expected, "one byte at a time")
    }

    @Test(arguments: HTTPHeadParserTests.validHeads.indices)
    func consumedIsRelativeToTheLastInput(index: Int) {
        let (kind, head, limits) = Self.validHeads[index]
        let input = head.bytes + "BODY".bytes
        for split in 1..<head.utf8.count {
            var parser = HTTPHeadParser(kind: kind, limits: limits)
            guard case .needMore = parser.parse(Array(input[..<split])) else {
                Issue.record("first piece of a split at \(split) did not ask for more")
                continue
            }
            #expect(parser.hasPartialHead || head.hasPrefix("\r\n"))
            guard case .complete(_, let consumed) = parser.parse(Array(input[split...])) else {
                Issue.record("second piece of a split at \(split) did not complete the head")
                continue
            }
            #expect(consumed == head.utf8.count - split, "split at \(split)")
        }
    }

    @Test(arguments: HTTPHeadParserTests.invalidHeads.indices)
    func invalidHeadSplitAtEveryByte(index: Int) {
        let (kind, head, code) = Self.invalidHeads[index]
        let input = head.bytes + "BODY".bytes
        #expect(feedHead([input], kind: kind) == .failed(code))
        for split in 0...input.count {
            let pieces = [Array(input[..<split]), Array(input[split...])]
            #expect(feedHead(pieces, kind: kind) == .failed(code), "split at \(split)")
        }
        #expect(feedHead(input.map { [$0] }, kind: kind) == .failed(code), "one byte at a time")
    }

    // MARK: - Bytes, reuse, serialisation

    @Test func rawBytesArePreserved() throws {
        let text = crlfHead(
            "GET http://Example.COM/Path HTTP/1.1", "hOsT:   Example.COM  ", "X-Dup: 1", "x-dup:2", "Empty:")
        let head = try parseHead(text)
        #expect(head.bytes == text.bytes)
        #expect(String(decoding: head.bytes[head.startLine], as: UTF8.self) == "GET http://Example.COM/Path HTTP/1.1")
        #expect(head.fieldsStart == "GET http://Example.COM/Path HTTP/1.1\r\n".utf8.count)
        #expect(String(decoding: head.bytes[head.fields[0].line], as: UTF8.self) == "hOsT:   Example.COM  \r\n")
        #expect(head.name(at: 0) == "hOsT")
        #expect(head.value(at: 0) == "Example.COM")
        #expect(head.name(at: 2) == "x-dup")
        #expect(head.value(at: 2) == "2")
        #expect(head.value(at: 3) == "")
        // The lines tile the field section.
        var next = head.fieldsStart
        for field in head.fields {
            #expect(field.line.lowerBound == next)
            next = field.line.upperBound
        }
        #expect(next == head.bytes.count - 2)
    }

    @Test func serializedRoundTrip() throws {
        let text = crlfHead("GET /a HTTP/1.1", "Host: a", "Connection: close", "X-Keep:  as  is ")
        let head = try parseHead(text)
        #expect(head.serialized() == text.bytes)
        #expect(head.serialized(drop: { $0 == 1 }) == crlfHead("GET /a HTTP/1.1", "Host: a", "X-Keep:  as  is ").bytes)
        #expect(
            head.serialized(drop: { _ in true }, extra: [("Host", "b"), ("Via", "1.1 proxyctl")])
                == crlfHead("GET /a HTTP/1.1", "Host: b", "Via: 1.1 proxyctl").bytes)
        #expect(
            head.serialized(startLine: "GET http://a/a HTTP/1.1", drop: { $0 == 0 }, extra: [("Host", "a")])
                == crlfHead("GET http://a/a HTTP/1.1", "Connection: close", "X-Keep:  as  is ", "Host: a").bytes)
        // The serialised head parses back to the same fields.
        let reparsed = try parseHead(head.serialized(extra: [("X-New", "1")]))
        #expect(reparsed.fields.count == 4)
        #expect(reparsed.value(at: 3) == "1")
    }

    @Test func parserIsReusableForPipelinedRequests() {
        let first = crlfHead("GET /1 HTTP/1.1", "Host: a")
        let second = crlfHead("GET /2 HTTP/1.1", "Host: a")
        let input = (first + second).bytes
        var parser = HTTPHeadParser(kind: .request)
        guard case .complete(let one, let consumed) = parser.parse(input) else {
            Issue.record("first head did not parse")
            return
        }
        #expect(one.target == "/1")
        #expect(consumed == first.utf8.count)
        #expect(!parser.hasPartialHead)
        guard case .complete(let two, let consumedTwo) = parser.parse(Array(input[consumed...])) else {
            Issue.record("second head did not parse")
            return
        }
        #expect(two.target == "/2")
        #expect(consumedTwo == second.utf8.count)
        #expect(two.bytes == second.bytes)
    }

    @Test func failureIsSticky() {
        var parser = HTTPHeadParser(kind: .request)
        guard case .failed = parser.parse("GET  / HTTP/1.1\r\n".bytes) else {
            Issue.record("expected a failure")
            return
        }
        guard case .failed = parser.parse(crlfHead("GET / HTTP/1.1", "Host: a").bytes) else {
            Issue.record("a failed parser accepted more bytes")
            return
        }
        parser.reset()
        guard case .complete = parser.parse(crlfHead("GET / HTTP/1.1", "Host: a").bytes) else {
            Issue.record("reset did not clear the failure")
            return
        }
    }

    @Test func emptyInputNeedsMore() {
        var parser = HTTPHeadParser(kind: .request)
        guard case .needMore = parser.parse([]) else {
            Issue.record("empty input should ask for more")
            return
        }
        #expect(!parser.hasPartialHead)
        guard case .needMore = parser.parse("GET".bytes) else {
            Issue.record("partial input should ask for more")
            return
        }
        #expect(parser.hasPartialHead)
    }
}
