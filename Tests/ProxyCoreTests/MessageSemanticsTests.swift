import Testing

@testable import ProxyCore

private func checkRequest(
    _ lines: String..., sourceLocation: SourceLocation = #_sourceLocation
) throws -> Result<RequestSemantics, HTTPParseError> {
    MessageSemantics.request(try parseHead(crlfHead(lines), sourceLocation: sourceLocation))
}

/// The semantics of a request that must pass; records an issue and throws when it fails.
private func acceptedRequest(
    _ lines: String..., sourceLocation: SourceLocation = #_sourceLocation
) throws -> (RequestSemantics, HTTPHead) {
    let head = try parseHead(crlfHead(lines), sourceLocation: sourceLocation)
    switch MessageSemantics.request(head) {
    case .success(let semantics):
        return (semantics, head)
    case .failure(let error):
        Issue.record("request was refused: \(error)", sourceLocation: sourceLocation)
        throw TestSetupError(description: "\(error)")
    }
}

/// The error code of a request that must fail, or nil when it passed.
private func refusal(
    _ lines: [String], sourceLocation: SourceLocation = #_sourceLocation
) throws -> HTTPParseError.Code? {
    let head = try parseHead(crlfHead(lines), sourceLocation: sourceLocation)
    if case .failure(let error) = MessageSemantics.request(head) { return error.code }
    return nil
}

/// Names of the dropped field lines, in order.
private func droppedNames(_ semantics: RequestSemantics, _ head: HTTPHead) -> [String] {
    semantics.dropped.sorted().map { head.name(at: $0) }
}

/// Request checks of a forward proxy (RFC 9112 §3.2, §6, §9.6; RFC 9110 §7.6.1): framing that two parsers
/// could disagree on, CONNECT targets, Host, hop-by-hop fields.
@Suite struct RequestSemanticsTests {
    // MARK: - Targets

    @Test func absoluteFormTarget() throws {
        let (semantics, _) = try acceptedRequest("GET http://example.com:8080/a?b HTTP/1.1", "Host: example.com:8080")
        guard case .absolute(let url) = semantics.target else {
            Issue.record("expected an absolute target, got \(semantics.target)")
            return
        }
        #expect(url.scheme == "http")
        #expect(url.authority == HostPort(host: "example.com", port: 8080, kind: .name))
        #expect(url.pathAndQuery == "/a?b")
        #expect(semantics.framing == .none)
        #expect(semantics.keepAlive)
        #expect(!semantics.upgrade)
        #expect(semantics.dropped.isEmpty)
        #expect(semantics.replacementHost == nil)
        #expect(semantics.proxyAuthorization == nil)
    }

    @Test func connectTarget() throws {
        let (semantics, _) = try acceptedRequest("CONNECT Example.COM:443 HTTP/1.1", "Host: example.com:443")
        #expect(semantics.target == .connect(HostPort(host: "example.com", port: 443, kind: .name)))
        #expect(semantics.framing == .none)
    }

    @Test func connectWithoutHostIsAccepted() throws {
        let (semantics, _) = try acceptedRequest("CONNECT [::1]:8443 HTTP/1.1")
        #expect(semantics.target == .connect(HostPort(host: "::1", port: 8443, kind: .ipv6)))
    }

    @Test(arguments: ["GET / HTTP/1.1", "OPTIONS * HTTP/1.1", "GET /path?q HTTP/1.1"])
    func originAndAsteriskFormAreNotProxyRequests(line: String) throws {
        let (semantics, _) = try acceptedRequest(line, "Host: a")
        #expect(semantics.target == .notProxyRequest)
    }

    /// "/" or "?" followed by a combining mark is one Character in Swift: targets are classified and cut on
    /// their bytes, and every byte is kept.
    @Test func combiningMarkAfterADelimiterChangesNothing() throws {
        let (origin, _) = try acceptedRequest("GET /\u{301}x HTTP/1.1", "Host: a")
        #expect(origin.target == .notProxyRequest)
        let (absolute, _) = try acceptedRequest("GET http://example.com/\u{301}x?\u{301} HTTP/1.1", "Host: example.com")
        guard case .absolute(let url) = absolute.target else {
            Issue.record("expected an absolute target, got \(absolute.target)")
            return
        }
        #expect(Array(url.pathAndQuery.utf8) == Array("/\u{301}x?\u{301}".utf8))
        let (query, _) = try acceptedRequest("GET http://example.com?\u{301} HTTP/1.1", "Host: example.com")
        guard case .absolute(let queryURL) = query.target else {
            Issue.record("expected an absolute target, got \(query.target)")
            return
        }
        #expect(Array(queryURL.pathAndQuery.utf8) == Array("/?\u{301}".utf8))
        #expect(try refusal(["CONNECT /\u{301}example.com:443 HTTP/1.1", "Host: a"]) == .malformed)
    }

    @Test(arguments: [
        "CONNECT user:pass@example.com:443 HTTP/1.1",  // userinfo
        "CONNECT user@example.com:443 HTTP/1.1",
        "CONNECT example.com HTTP/1.1",  // port missing
        "CONNECT example.com: HTTP/1.1",  // empty port
        "CONNECT example.com:0 HTTP/1.1",
        "CONNECT example.com:65536 HTTP/1.1",
        "CONNECT example.com:99999 HTTP/1.1",
        "CONNECT example.com:-1 HTTP/1.1",
        "CONNECT example.com:44a HTTP/1.1",
        "CONNECT :443 HTTP/1.1",  // host missing
        "CONNECT /example.com:443 HTTP/1.1",  // origin-form
        "CONNECT http://example.com:443 HTTP/1.1",  // absolute-form
        "CONNECT [::1:443 HTTP/1.1",  // unterminated IPv6
        "CONNECT ::1:443 HTTP/1.1",  // IPv6 without brackets
        "CONNECT exa<mple.com:443 HTTP/1.1",
    ])
    func malformedConnectTarget(line: String) throws {
        #expect(try refusal([line, "Host: example.com:443"]) == .malformed)
    }

    @Test func schemeSeparatorIsFoundAnywhere() {
        for target in ["http://example.com:443", "a://", "x:a://b", "::://", "ex:/a://"] {
            #expect(MessageSemantics.hasSchemeSeparator(target), "\(target)")
        }
        for target in ["example.com:443", ":/", "a:/b/", "//a", ":/:/", "[::1]:443", ""] {
            #expect(!MessageSemantics.hasSchemeSeparator(target), "\(target)")
        }
    }

    @Test(arguments: [
        ["CONNECT example.com:443 HTTP/1.1", "Content-Length: 5"],
        ["CONNECT example.com:443 HTTP/1.1", "Transfer-Encoding: chunked"],
    ])
    func connectWithBodyIsRefused(lines: [String]) throws {
        #expect(try refusal(lines) == .badFraming)
    }

    @Test func connectWithZeroContentLengthIsAccepted() throws {
        let (semantics, _) = try acceptedRequest("CONNECT example.com:443 HTTP/1.1", "Content-Length: 0")
        #expect(semantics.framing == .none)
    }

    @Test(arguments: [
        "GET ftp://example.com/ HTTP/1.1",
        "GET http://example.com/#frag HTTP/1.1",
        "GET http://user:pw@example.com/ HTTP/1.1",
        "GET http:/example.com/ HTTP/1.1",
        "GET example.com/ HTTP/1.1",
        "GET http:// HTTP/1.1",
        "GET http://example.com:0/ HTTP/1.1",
    ])
    func malformedAbsoluteTarget(line: String) throws {
        #expect(try refusal([line, "Host: example.com"]) == .malformed)
    }

    // MARK: - Host

    @Test func multipleHostFieldsAreRefused() throws {
        #expect(try refusal(["GET http://a.example/ HTTP/1.1", "Host: a.example", "Host: a.example"]) != nil)
        #expect(try refusal(["GET / HTTP/1.1", "Host: a.example", "host: b.example"]) != nil)
    }

    @Test func missingHostInHTTP11IsRefused() throws {
        #expect(try refusal(["GET http://a.example/ HTTP/1.1"]) == .malformed)
    }

    @Test func missingHostInHTTP10IsAdded() throws {
        let (semantics, _) = try acceptedRequest("GET http://a.example:8080/ HTTP/1.0")
        #expect(semantics.replacementHost == "a.example:8080")
        #expect(semantics.dropped.isEmpty)
    }

    @Test(arguments: [
        ("http://a.example/", "b.example", "a.example"),
        ("http://a.example/", "a.example:8080", "a.example"),
        ("http://a.example:8080/", "a.example", "a.example:8080"),  // no port in Host means port 80
        ("http://a.example:8080/", "a.example:80", "a.example:8080"),
        ("http://a.example/", "user@a.example", "a.example"),
        ("http://a.example/", "", "a.example"),
        ("http://[::1]:8080/", "[::1]", "[::1]:8080"),
        ("http://10.0.0.1/", "10.0.0.2", "10.0.0.1"),
    ])
    func hostThatDisagreesWithTheTargetIsReplaced(target: String, host: String, expected: String) throws {
        // RFC 9112 §3.2.2: the target wins; a proxy generates Host from it.
        let (semantics, head) = try acceptedRequest("GET \(target) HTTP/1.1", "Accept: */*", "Host: \(host)")
        #expect(semantics.dropped == [1])
        #expect(semantics.replacementHost == expected)
        #expect(head.name(at: 1) == "Host")
    }

    @Test(arguments: [
        ("http://a.example/", "a.example"),
        ("http://a.example/", "A.Example"),
        ("http://A.EXAMPLE/", "a.example"),
        ("http://a.example/", "a.example:80"),
        ("http://a.example:80/", "a.example"),
        ("http://a.example/", "a.example."),
        ("http://a.example:8080/", "a.example:8080"),
        ("http://[::1]/", "[::1]:80"),
        ("http://10.0.0.1:81/", "10.0.0.1:81"),
    ])
    func hostThatMatchesTheTargetIsKept(target: String, host: String) throws {
        let (semantics, _) = try acceptedRequest("GET \(target) HTTP/1.1", "Host: \(host)")
        #expect(semantics.dropped.isEmpty)
        #expect(semantics.replacementHost == nil)
    }

    // MARK: - Framing

    @Test func contentLengthFraming() throws {
        let (semantics, _) = try acceptedRequest("POST http://a/ HTTP/1.1", "Host: a", "Content-Length: 42")
        #expect(semantics.framing == .contentLength(42))
        let (zero, _) = try acceptedRequest("POST http://a/ HTTP/1.1", "Host: a", "Content-Length: 0")
        #expect(zero.framing == .none)
        let (big, _) = try acceptedRequest(
            "POST http://a/ HTTP/1.1", "Host: a", "Content-Length: 9223372036854775807")
        #expect(big.framing == .contentLength(UInt64(Int64.max)))
        let head = try parseHead("POST http://a/ HTTP/1.1\r\nHost: a\r\nContent-Length: 9223372036854775808\r\n\r\n")
        guard case .failure(let error) = MessageSemantics.request(head) else {
            Issue.record("a Content-Length beyond 2^63 - 1 was accepted")
            return
        }
        #expect(error.reason == "Content-Length too large")
    }

    @Test(arguments: [
        ["Transfer-Encoding: chunked"],
        ["Transfer-Encoding: Chunked"],
        ["Transfer-Encoding: gzip, chunked"],
        ["Transfer-Encoding: gzip", "Transfer-Encoding: chunked"],
        ["Transfer-Encoding: gzip,, chunked ,"],
    ])
    func chunkedFraming(fields: [String]) throws {
        let head = try parseHead(crlfHead(["POST http://a/ HTTP/1.1", "Host: a"] + fields))
        guard case .success(let semantics) = MessageSemantics.request(head) else {
            Issue.record("request was refused")
            return
        }
        #expect(semantics.framing == .chunked)
    }

    @Test(arguments: [
        // RFC 9112 §6.1: Transfer-Encoding and Content-Length together is a smuggling attempt.
        ["Transfer-Encoding: chunked", "Content-Length: 5"],
        ["Content-Length: 5", "Transfer-Encoding: chunked"],
        ["Content-Length: 0", "Transfer-Encoding: chunked"],
        // RFC 9112 §6.3: chunked must be the final coding of a request.
        ["Transfer-Encoding: gzip"],
        ["Transfer-Encoding: chunked, gzip"],
        ["Transfer-Encoding: chunked", "Transfer-Encoding: gzip"],
        ["Transfer-Encoding: chunked, chunked"],
        ["Transfer-Encoding: "],
        ["Transfer-Encoding: xchunked"],
        ["Transfer-Encoding: chunked;q=1"],
        ["Transfer-Encoding: \"chunked\""],
        // RFC 9110 §8.6: differing Content-Length values.
        ["Content-Length: 5", "Content-Length: 6"],
        ["Content-Length: 5, 6"],
        ["Content-Length: 5,", "Content-Length: 5"],
        ["Content-Length: 5, "],
        // Not 1*DIGIT.
        ["Content-Length: +5"],
        ["Content-Length: -1"],
        ["Content-Length: 0x10"],
        ["Content-Length: 1e3"],
        ["Content-Length: 5 5"],
        ["Content-Length: "],
        ["Content-Length: 12345678901234567890"],  // 20 digits: does not fit
        ["Content-Length: 99999999999999999999999"],
    ])
    func badFramingIsRefused(fields: [String]) throws {
        #expect(try refusal(["POST http://a/ HTTP/1.1", "Host: a"] + fields) == .badFraming)
    }

    @Test func transferEncodingInHTTP10IsRefused() throws {
        // RFC 9112 §6.1: Transfer-Encoding in an HTTP/1.0 message means faulty framing.
        #expect(try refusal(["POST http://a/ HTTP/1.0", "Transfer-Encoding: chunked"]) == .badFraming)
    }

    @Test(arguments: [
        ["Content-Length: 5", "Content-Length: 5"],
        ["Content-Length: 5, 5"],
        ["Content-Length: 5,5", "content-length:  5 "],
    ])
    func identicalContentLengthsAreAccepted(fields: [String]) throws {
        let head = try parseHead(crlfHead(["POST http://a/ HTTP/1.1", "Host: a"] + fields))
        guard case .success(let semantics) = MessageSemantics.request(head) else {
            Issue.record("request was refused")
            return
        }
        #expect(semantics.framing == .contentLength(5))
    }

    // MARK: - Hop-by-hop fields

    @Test func alwaysHopByHopFieldsAreDropped() throws {
        let (semantics, head) = try acceptedRequest(
            "GET http://a/ HTTP/1.1", "Host: a", "Connection: keep-alive", "Proxy-Connection: keep-alive",
            "Keep-Alive: timeout=5", "TE: trailers", "Upgrade: h2c", "Proxy-Authorization: Basic eDp5",
            "Accept: */*")
        #expect(
            droppedNames(semantics, head) == [
                "Connection", "Proxy-Connection", "Keep-Alive", "TE", "Upgrade", "Proxy-Authorization",
            ])
        #expect(semantics.proxyAuthorization == 6)
        #expect(!semantics.upgrade)
    }

    @Test func hopByHopNamesAreCaseInsensitive() throws {
        let (semantics, head) = try acceptedRequest(
            "GET http://a/ HTTP/1.1", "Host: a", "CONNECTION: X-Foo", "x-foo: 1", "KEEP-ALIVE: 1", "X-Bar: 2")
        #expect(droppedNames(semantics, head) == ["CONNECTION", "x-foo", "KEEP-ALIVE"])
    }

    @Test func fieldsNamedInConnectionAreDropped() throws {
        let (semantics, head) = try acceptedRequest(
            "GET http://a/ HTTP/1.1", "Host: a", "Connection: close, X-Hop", "Connection: X-Other", "X-Hop: 1",
            "X-Other: 2", "X-Kept: 3")
        #expect(droppedNames(semantics, head) == ["Connection", "Connection", "X-Hop", "X-Other"])
    }

    @Test func connectionOptionsAreTrimmedListElements() throws {
        // RFC 9110 §5.6.1: empty elements and whitespace around them do not count; names match in any case,
        // a name that merely starts or ends like an option does not.
        let (semantics, head) = try acceptedRequest(
            "GET http://a/ HTTP/1.1", "Host: a", "Connection: ,  X-A ,\t, x-B\t,,", "x-a: 1", "X-b: 2", "X-AB: 3",
            "X: 4", "Y-X-A: 5")
        #expect(droppedNames(semantics, head) == ["Connection", "x-a", "X-b"])
        #expect(head.listElements(named: "connection") == ["x-a", "x-b"])
    }

    @Test func connectionCannotRemoveFramingOrHost() throws {
        // "Connection: Content-Length" is an old smuggling trick: the framing the proxy checked must travel on.
        let (semantics, head) = try acceptedRequest(
            "POST http://a/ HTTP/1.1", "Host: a", "Connection: Content-Length, Host, Transfer-Encoding, X-A",
            "Content-Length: 3", "X-A: 1")
        #expect(droppedNames(semantics, head) == ["Connection", "X-A"])
        #expect(semantics.framing == .contentLength(3))
        let (chunked, chunkedHead) = try acceptedRequest(
            "POST http://a/ HTTP/1.1", "Host: a", "Connection: transfer-encoding", "Transfer-Encoding: chunked")
        #expect(droppedNames(chunked, chunkedHead) == ["Connection"])
    }

    @Test func upgradeRequestKeepsTheUpgradeField() throws {
        let (semantics, head) = try acceptedRequest(
            "GET http://a/chat HTTP/1.1", "Host: a", "Connection: Upgrade", "Upgrade: websocket",
            "Sec-WebSocket-Version: 13")
        #expect(semantics.upgrade)
        #expect(droppedNames(semantics, head) == ["Connection"])
    }

    @Test func upgradeWithoutConnectionOptionIsNotAnUpgrade() throws {
        // RFC 9110 §7.8: Upgrade without the "upgrade" connection option is ignored (and hop-by-hop).
        let (semantics, head) = try acceptedRequest("GET http://a/ HTTP/1.1", "Host: a", "Upgrade: websocket")
        #expect(!semantics.upgrade)
        #expect(droppedNames(semantics, head) == ["Upgrade"])
        let (noField, _) = try acceptedRequest("GET http://a/ HTTP/1.1", "Host: a", "Connection: upgrade")
        #expect(!noField.upgrade)
    }

    @Test func duplicateProxyAuthorizationIsRefused() throws {
        #expect(
            try refusal([
                "GET http://a/ HTTP/1.1", "Host: a", "Proxy-Authorization: Basic eDp5",
                "Proxy-Authorization: Basic eDp6",
            ]) == .malformed)
    }

    // MARK: - Persistence

    @Test func keepAlive() throws {
        #expect(try acceptedRequest("GET http://a/ HTTP/1.1", "Host: a").0.keepAlive)
        #expect(try acceptedRequest("GET http://a/ HTTP/1.1", "Host: a", "Connection: keep-alive").0.keepAlive)
        #expect(!(try acceptedRequest("GET http://a/ HTTP/1.1", "Host: a", "Connection: close").0.keepAlive))
        #expect(!(try acceptedRequest("GET http://a/ HTTP/1.1", "Host: a", "Connection: X, Close").0.keepAlive))
        #expect(!(try acceptedRequest("GET http://a/ HTTP/1.0").0.keepAlive))
        #expect(!(try acceptedRequest("GET http://a/ HTTP/1.0", "Connection: keep-alive").0.keepAlive))
    }

    @Test func checkRequestHelperReportsErrors() throws {
        guard case .failure(let error) = try checkRequest("GET http://a/ HTTP/1.1") else {
            Issue.record("a request without Host passed")
            return
        }
        #expect(error.status == 400)
    }
}

/// The semantics of a response that must pass.
private func acceptedResponse(
    _ lines: [String], method: String = "GET", upgradeRequested: Bool = false,
    sourceLocation: SourceLocation = #_sourceLocation
) throws -> (ResponseSemantics, HTTPHead) {
    let head = try parseHead(crlfHead(lines), kind: .response, sourceLocation: sourceLocation)
    switch MessageSemantics.response(head, requestMethod: method, upgradeRequested: upgradeRequested) {
    case .success(let semantics):
        return (semantics, head)
    case .failure(let error):
        Issue.record("response was refused: \(error)", sourceLocation: sourceLocation)
        throw TestSetupError(description: "\(error)")
    }
}

/// Response framing (RFC 9112 §6.3) and the hop-by-hop fields of responses.
@Suite struct ResponseSemanticsTests {
    @Test(arguments: [100, 102, 103])
    func interimResponses(status: Int) throws {
        let (semantics, _) = try acceptedResponse(["HTTP/1.1 \(status) Interim", "Link: </a>; rel=preload"])
        #expect(semantics.isInterim)
        #expect(!semantics.switchesProtocols)
        #expect(semantics.framing == .none)
        #expect(!semantics.serverCloses)
    }

    @Test func switchingProtocolsAfterAnUpgradeRequest() throws {
        let (semantics, head) = try acceptedResponse(
            ["HTTP/1.1 101 Switching Protocols", "Connection: Upgrade", "Upgrade: websocket", "Keep-Alive: 1"],
            upgradeRequested: true)
        #expect(semantics.switchesProtocols)
        #expect(!semantics.isInterim)
        #expect(semantics.framing == .none)
        #expect(semantics.serverCloses)
        // Connection and Upgrade must reach the client for it to recognise the switch.
        #expect(semantics.dropped.map { head.name(at: $0) } == ["Keep-Alive"])
    }

    @Test func switchingProtocolsWithoutAnUpgradeRequestIsRefused() throws {
        let head = try parseHead(crlfHead("HTTP/1.1 101 Switching Protocols", "Upgrade: websocket"), kind: .response)
        guard case .failure(let error) = MessageSemantics.response(head, requestMethod: "GET", upgradeRequested: false)
        else {
            Issue.record("an unrequested 101 was accepted")
            return
        }
        #expect(error.code == .malformed)
    }

    @Test(arguments: [
        ("HTTP/1.1 204 No Content", "GET"),
        ("HTTP/1.1 304 Not Modified", "GET"),
        ("HTTP/1.1 200 OK", "HEAD"),
        ("HTTP/1.1 404 Not Found", "HEAD"),
    ])
    func responsesWithoutBody(statusLine: String, method: String) throws {
        // RFC 9112 §6.3 item 1: whatever the framing fields say, these responses have no body.
        for framing in ["Content-Length: 10", "Transfer-Encoding: chunked"] {
            let (semantics, _) = try acceptedResponse([statusLine, framing], method: method)
            #expect(semantics.framing == .none, "\(statusLine) to \(method) with \(framing)")
            #expect(!semantics.serverCloses)
        }
    }

    @Test func chunkedResponse() throws {
        let (semantics, _) = try acceptedResponse(["HTTP/1.1 200 OK", "Transfer-Encoding: gzip, chunked"])
        #expect(semantics.framing == .chunked)
        #expect(!semantics.serverCloses)
    }

    @Test func nonChunkedTransferEncodingIsReadUntilClose() throws {
        // RFC 9112 §6.3 item 3: a response whose final coding is not chunked ends when the server closes.
        let (semantics, _) = try acceptedResponse(["HTTP/1.1 200 OK", "Transfer-Encoding: gzip"])
        #expect(semantics.framing == .untilClose)
        #expect(semantics.serverCloses)
        let (reversed, _) = try acceptedResponse(["HTTP/1.1 200 OK", "Transfer-Encoding: chunked, gzip"])
        #expect(reversed.framing == .untilClose)
    }

    @Test func transferEncodingOverridesAndDropsContentLength() throws {
        let (semantics, head) = try acceptedResponse([
            "HTTP/1.1 200 OK", "Content-Length: 10", "Transfer-Encoding: chunked", "Content-Length: 11",
        ])
        #expect(semantics.framing == .chunked)
        #expect(semantics.dropped.sorted().map { head.name(at: $0) } == ["Content-Length", "Content-Length"])
    }

    @Test func contentLengthResponse() throws {
        let (semantics, _) = try acceptedResponse(["HTTP/1.1 200 OK", "Content-Length: 10"])
        #expect(semantics.framing == .contentLength(10))
        #expect(!semantics.serverCloses)
        let (zero, _) = try acceptedResponse(["HTTP/1.1 200 OK", "Content-Length: 0"])
        #expect(zero.framing == .none)
        let (same, _) = try acceptedResponse(["HTTP/1.1 200 OK", "Content-Length: 7, 7", "Content-Length: 7"])
        #expect(same.framing == .contentLength(7))
    }

    @Test(arguments: [
        ["Content-Length: abc"], ["Content-Length: -1"], ["Content-Length: +1"], ["Content-Length: 5, 6"],
        ["Content-Length: 5", "Content-Length: 6"], ["Content-Length: 123456789012345678901"],
    ])
    func badContentLengthIsRefused(fields: [String]) throws {
        let head = try parseHead(crlfHead(["HTTP/1.1 200 OK"] + fields), kind: .response)
        guard case .failure(let error) = MessageSemantics.response(head, requestMethod: "GET", upgradeRequested: false)
        else {
            Issue.record("a bad Content-Length was accepted")
            return
        }
        #expect(error.code == .badFraming)
    }

    @Test func noFramingIsReadUntilClose() throws {
        let (semantics, _) = try acceptedResponse(["HTTP/1.1 200 OK", "Content-Type: text/plain"])
        #expect(semantics.framing == .untilClose)
        #expect(semantics.serverCloses)
    }

    @Test func serverClosesRules() throws {
        #expect(try acceptedResponse(["HTTP/1.1 200 OK", "Content-Length: 1", "Connection: close"]).0.serverCloses)
        #expect(try acceptedResponse(["HTTP/1.1 200 OK", "Content-Length: 1", "Connection: x, CLOSE"]).0.serverCloses)
        #expect(!(try acceptedResponse(["HTTP/1.1 200 OK", "Content-Length: 1"]).0.serverCloses))
        // HTTP/1.0 closes unless it says keep-alive.
        #expect(try acceptedResponse(["HTTP/1.0 200 OK", "Content-Length: 1"]).0.serverCloses)
        #expect(
            !(try acceptedResponse(["HTTP/1.0 200 OK", "Content-Length: 1", "Connection: keep-alive"]).0.serverCloses))
        #expect(
            try acceptedResponse(["HTTP/1.0 200 OK", "Content-Length: 1", "Connection: keep-alive, close"]).0
                .serverCloses)
        // Until-close framing always closes.
        #expect(try acceptedResponse(["HTTP/1.1 200 OK", "Connection: keep-alive"]).0.serverCloses)
    }

    @Test func hopByHopResponseFieldsAreDropped() throws {
        let (semantics, head) = try acceptedResponse([
            "HTTP/1.1 200 OK", "Connection: keep-alive, X-Hop", "Keep-Alive: timeout=5", "X-Hop: 1",
            "Content-Length: 2", "Upgrade: h2c", "Proxy-Connection: close", "Server: test",
        ])
        #expect(
            semantics.dropped.sorted().map { head.name(at: $0) } == [
                "Connection", "Keep-Alive", "X-Hop", "Upgrade", "Proxy-Connection",
            ])
        #expect(semantics.framing == .contentLength(2))
    }

    @Test func connectionCannotRemoveResponseFraming() throws {
        let (semantics, head) = try acceptedResponse([
            "HTTP/1.1 200 OK", "Connection: content-length, transfer-encoding", "Content-Length: 2",
        ])
        #expect(semantics.dropped.sorted().map { head.name(at: $0) } == ["Connection"])
    }
}

/// Intercepted requests and responses keep field values and the reason phrase as bytes: obs-text (RFC 9110
/// §5.5) need not be UTF-8, and decoding it would replace it.
@Suite struct InterceptedObsTextTests {
    @Test func requestFieldValuesKeepTheirBytes() throws {
        let value = "caf".bytes + [0xE9, 0x20, 0xFF, 0x80]
        let head = try parseHead(
            "GET /a HTTP/1.1\r\nHost: api.example.com\r\nX-Latin-1: ".bytes + value + "\r\n\r\n".bytes)
        var origin = OriginConfig(scheme: "https", authority: HostPort(host: "api.example.com", port: 443, kind: .name))
        origin.clientAuthorization = .replace
        let request = try MessageSemantics.interceptedRequest(head, for: origin).get()
        #expect(request.upstreamFields.map(\.name) == ["X-Latin-1"])
        #expect(request.upstreamFields.map(\.value) == [value])
    }

    @Test func responseReasonAndFieldValuesKeepTheirBytes() throws {
        let raw =
            "HTTP/1.1 200 caf".bytes + [0xE9] + "\r\nX-Raw: ".bytes + [0xFF, 0x80]
            + "\r\nContent-Length: 2\r\n\r\n".bytes
        let head = try parseHead(raw, kind: .response)
        let semantics = try MessageSemantics.response(head, requestMethod: "GET", upgradeRequested: false).get()
        let response = UpstreamResponse(head: head, semantics: semantics, proxyStatus: ProxyStatus())
        let (out, framing) = MessageSemantics.interceptedResponseHead(response, requestMethod: "GET", close: true)
        #expect(framing == .contentLength(2))
        let expected =
            "HTTP/1.1 200 caf".bytes + [0xE9] + "\r\nX-Raw: ".bytes + [0xFF, 0x80]
            + "\r\nProxy-Status: proxyctl\r\nContent-Length: 2\r\nConnection: close\r\n\r\n".bytes
        #expect(out == expected)
    }

    @Test func responseFieldLinesGoAsReceivedWithCRLFAndWithoutHopByHopOrFraming() throws {
        // Kept lines keep their bytes (case, whitespace); a bare-LF line gets its CR; the dropped ones
        // (Connection and what it names, Keep-Alive, the origin's framing) leave no trace between the others.
        let raw =
            "HTTP/1.1 200 OK\r\nserver:  nginx \r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\n"
            + "Date: Thu, 03 Dec 2026 06:00:00 GMT\nContent-Length: 5\r\nKeep-Alive: timeout=5\r\n"
            + "X-Last:\tlast\t\r\nTransfer-Encoding: chunked\r\nETag: \"a\"\r\n\r\n"
        let head = try parseHead(raw, kind: .response)
        let semantics = try MessageSemantics.response(head, requestMethod: "GET", upgradeRequested: false).get()
        let response = UpstreamResponse(head: head, semantics: semantics, proxyStatus: nil)
        let (out, framing) = MessageSemantics.interceptedResponseHead(response, requestMethod: "GET", close: false)
        #expect(framing == .chunked)
        let expected =
            "HTTP/1.1 200 OK\r\nserver:  nginx \r\nDate: Thu, 03 Dec 2026 06:00:00 GMT\r\nX-Last:\tlast\t\r\n"
            + "ETag: \"a\"\r\nTransfer-Encoding: chunked\r\n\r\n"
        #expect(String(decoding: out, as: UTF8.self) == expected)
        #expect(
            head.serialized(drop: { semantics.dropped.contains($0) })
                == Array(
                    ("HTTP/1.1 200 OK\r\nserver:  nginx \r\nDate: Thu, 03 Dec 2026 06:00:00 GMT\r\n"
                        + "X-Last:\tlast\t\r\nTransfer-Encoding: chunked\r\nETag: \"a\"\r\n\r\n").utf8))
    }
}

/// The set of field indices not to forward: bits below 64, a list above, always ascending.
struct FieldIndexSetTests {
    @Test func insertsContainsAndIteratesInOrder() {
        var set = FieldIndexSet()
        #expect(set.isEmpty && Array(set).isEmpty)
        for index in [70, 3, 63, 0, 64, 3, 200, 70] { set.insert(index) }
        #expect(Array(set) == [0, 3, 63, 64, 70, 200] && set.count == 6)
        #expect(set.contains(63) && set.contains(64) && set.contains(200) && !set.contains(1) && !set.contains(-1))
        #expect(!set.contains(65) && !set.contains(199))
        #expect(set == [200, 70, 64, 63, 3, 0])
        #expect(set.filter { $0 % 2 == 0 } == [0, 64, 70, 200])
        #expect(set.union([1, 65, 3]) == [0, 1, 3, 63, 64, 65, 70, 200])
        #expect(!set.isEmpty && ([] as FieldIndexSet).isEmpty && FieldIndexSet() == [])
    }

    @Test func aHeadWithManyFieldsDropsTheRightOnesAboveSixtyFour() throws {
        var lines = ["GET http://a/ HTTP/1.1", "Host: a"]
        for number in 0..<80 { lines.append("X-\(number): \(number)") }
        lines.append("Connection: x-70, keep-alive")
        lines.append("Keep-Alive: 5")
        let head = try parseHead(crlfHead(lines))
        guard case .success(let semantics) = MessageSemantics.request(head) else {
            Issue.record("refused")
            return
        }
        #expect(droppedNames(semantics, head) == ["X-70", "Connection", "Keep-Alive"])
    }
}
