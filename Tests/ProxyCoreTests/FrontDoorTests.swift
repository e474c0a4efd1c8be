import Testing

@testable import ProxyCore

private let loopbackListener = ListenAddress(host: "127.0.0.1", port: 8080, isIPv6: false)

private func frontDoor(
    upstream: String? = nil, bypass: String = "", users: String? = nil, bound: ListenAddress = loopbackListener
) throws -> FrontDoor {
    var settings = ProxySettings()
    settings.listen = bound
    if let upstream { settings.upstreamProxy = try UpstreamProxy.parse(upstream).get() }
    settings.noUpstreamProxy = try BypassList.parse(bypass).get()
    let credentials = try users.map { try ProxyCredentials.parse($0, file: "users").get() }
    return FrontDoor(settings: settings, credentials: credentials, boundAddress: bound)
}

private func decide(
    _ door: FrontDoor, _ lines: String..., sourceLocation: SourceLocation = #_sourceLocation
) throws -> FrontDoorDecision {
    door.decide(try parseHead(crlfHead(lines), sourceLocation: sourceLocation))
}

/// The forward of a decision that must be one.
private func expectForward(
    _ decision: FrontDoorDecision, sourceLocation: SourceLocation = #_sourceLocation
) throws -> FrontDoorDecision.Forward {
    guard case .forward(let forward) = decision else {
        Issue.record("expected a forward, got \(decision)", sourceLocation: sourceLocation)
        throw TestSetupError(description: "not a forward")
    }
    return forward
}

/// The response of a decision that must be one.
private func expectResponse(
    _ decision: FrontDoorDecision, sourceLocation: SourceLocation = #_sourceLocation
) throws -> ProxyResponse {
    guard case .respond(let answer) = decision else {
        Issue.record("expected a response, got \(decision)", sourceLocation: sourceLocation)
        throw TestSetupError(description: "not a response")
    }
    return answer.response
}

private func text(_ bytes: [UInt8]) -> String { String(decoding: bytes, as: UTF8.self) }

private func basic(_ userPass: String) -> String { "Basic " + Base64.encode(userPass.utf8) }

/// The front door: a request head in, a decision out (respond, tunnel or forward), with the exact bytes
/// that go to the next hop.
@Suite struct FrontDoorTests {
    // MARK: - Tunnels

    @Test func connectOpensATunnel() throws {
        let decision = try decide(try frontDoor(), "CONNECT Example.com:443 HTTP/1.1", "Host: example.com:443")
        #expect(decision == .tunnel(target: HostPort(host: "example.com", port: 443, kind: .name), upstream: nil))
    }

    @Test func connectThroughUpstreamUnlessBypassed() throws {
        let door = try frontDoor(upstream: "http://user:pass@proxy.corp:3128", bypass: "internal.example, 10.0.0.0/8")
        let upstream = try UpstreamProxy.parse("http://user:pass@proxy.corp:3128").get()
        #expect(
            try decide(door, "CONNECT example.com:443 HTTP/1.1")
                == .tunnel(target: HostPort(host: "example.com", port: 443, kind: .name), upstream: upstream))
        #expect(
            try decide(door, "CONNECT git.internal.example:443 HTTP/1.1")
                == .tunnel(target: HostPort(host: "git.internal.example", port: 443, kind: .name), upstream: nil))
        #expect(
            try decide(door, "CONNECT 10.1.2.3:22 HTTP/1.1")
                == .tunnel(target: HostPort(host: "10.1.2.3", port: 22, kind: .ipv4), upstream: nil))
    }

    // MARK: - Forwarding

    @Test func absoluteHTTPIsForwardedInOriginForm() throws {
        let head = crlfHead(
            "GET http://example.com/path?q=1 HTTP/1.1",
            "Host: example.com",
            "User-Agent: curl/8.0",
            "Proxy-Connection: keep-alive",
            "Accept: */*",
            "Connection: keep-alive, X-Hop",
            "X-Hop: 1",
            "Keep-Alive: timeout=5",
            "TE: trailers",
            "x-custom:   spaced\tvalue  ",
            "Cookie: a=1; b=2",
            "cookie: c=3"
        )
        let forward = try expectForward(try frontDoor().decide(try parseHead(head)))
        let expected = crlfHead(
            "GET /path?q=1 HTTP/1.1",
            "Host: example.com",
            "User-Agent: curl/8.0",
            "Accept: */*",
            "x-custom:   spaced\tvalue  ",
            "Cookie: a=1; b=2",
            "cookie: c=3"
        )
        #expect(text(forward.head) == expected)
        #expect(forward.head == expected.bytes)
        #expect(forward.url == (try AbsoluteURL.parse("http://example.com/path?q=1").get()))
        #expect(forward.upstream == nil)
        #expect(forward.framing == .none)
        #expect(forward.keepAlive)
        #expect(!forward.upgrade)
        #expect(forward.method == "GET")
    }

    @Test func bodyFramingTravelsUnchanged() throws {
        let forward = try expectForward(
            try decide(
                try frontDoor(), "POST http://example.com:8080/upload HTTP/1.1", "Host: example.com:8080",
                "Transfer-Encoding: chunked", "Content-Type: application/json"))
        #expect(
            text(forward.head)
                == crlfHead(
                    "POST /upload HTTP/1.1", "Host: example.com:8080", "Transfer-Encoding: chunked",
                    "Content-Type: application/json"))
        #expect(forward.framing == .chunked)
        #expect(forward.method == "POST")
        let sized = try expectForward(
            try decide(try frontDoor(), "PUT http://example.com/x HTTP/1.1", "Host: example.com", "Content-Length: 5"))
        #expect(sized.framing == .contentLength(5))
    }

    @Test func disagreeingHostIsReplacedAtTheEnd() throws {
        let forward = try expectForward(
            try decide(
                try frontDoor(), "GET http://example.com/ HTTP/1.1", "Host: evil.example", "Accept: */*"))
        #expect(text(forward.head) == crlfHead("GET / HTTP/1.1", "Accept: */*", "Host: example.com"))
    }

    @Test func http10WithoutHostGetsOne() throws {
        let forward = try expectForward(
            try decide(try frontDoor(), "GET http://example.com:81 HTTP/1.0", "Accept: */*"))
        #expect(text(forward.head) == crlfHead("GET / HTTP/1.0", "Accept: */*", "Host: example.com:81"))
        #expect(!forward.keepAlive)
    }

    @Test func clientConnectionCloseIsHonouredButNotForwarded() throws {
        let forward = try expectForward(
            try decide(try frontDoor(), "GET http://example.com/ HTTP/1.1", "Host: example.com", "Connection: close"))
        #expect(text(forward.head) == crlfHead("GET / HTTP/1.1", "Host: example.com"))
        #expect(!forward.keepAlive)
    }

    @Test func upgradeKeepsUpgradeAndRestatesConnection() throws {
        let forward = try expectForward(
            try decide(
                try frontDoor(), "GET http://example.com/chat HTTP/1.1", "Host: example.com", "Connection: Upgrade",
                "Upgrade: websocket", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="))
        #expect(
            text(forward.head)
                == crlfHead(
                    "GET /chat HTTP/1.1", "Host: example.com", "Upgrade: websocket",
                    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Connection: upgrade"))
        #expect(forward.upgrade)
    }

    @Test func throughUpstreamTheAbsoluteFormIsKeptAndCredentialsAdded() throws {
        let door = try frontDoor(upstream: "http://user:pass@proxy.corp:3128")
        let forward = try expectForward(
            try decide(
                door, "GET http://Example.com/path?q=1 HTTP/1.1", "Host: example.com",
                "Proxy-Authorization: Basic Y2xpZW50OnNlY3JldA==", "Accept: */*"))
        #expect(
            text(forward.head)
                == crlfHead(
                    "GET http://Example.com/path?q=1 HTTP/1.1", "Host: example.com", "Accept: */*",
                    "Proxy-Authorization: Basic dXNlcjpwYXNz"))
        #expect(forward.upstream == (try UpstreamProxy.parse("http://user:pass@proxy.corp:3128").get()))
    }

    @Test func upstreamWithoutCredentialsAddsNoProxyAuthorization() throws {
        let forward = try expectForward(
            try decide(try frontDoor(upstream: "http://proxy.corp:3128"), "GET http://a.test/ HTTP/1.1", "Host: a.test")
        )
        #expect(text(forward.head) == crlfHead("GET http://a.test/ HTTP/1.1", "Host: a.test"))
        #expect(forward.upstream?.address == HostPort(host: "proxy.corp", port: 3128, kind: .name))
    }

    @Test func bypassedHostGoesDirect() throws {
        let door = try frontDoor(upstream: "http://user:pass@proxy.corp:3128", bypass: ".internal.example")
        let forward = try expectForward(
            try decide(door, "GET http://svc.internal.example/x HTTP/1.1", "Host: svc.internal.example"))
        #expect(forward.upstream == nil)
        #expect(text(forward.head) == crlfHead("GET /x HTTP/1.1", "Host: svc.internal.example"))
    }

    // MARK: - Answered by the proxy

    @Test(arguments: ["GET / HTTP/1.1", "GET /index.html HTTP/1.1", "OPTIONS * HTTP/1.1"])
    func originFormIsNotAProxyRequest(line: String) throws {
        let answer = try expectResponse(try decide(try frontDoor(), line, "Host: localhost:8080"))
        #expect(answer.status == 400)
        #expect(answer.message.contains("HTTPS_PROXY=http://127.0.0.1:8080"))
        #expect(answer.proxyStatus?.error == .httpRequestError)
        #expect(!answer.close)
    }

    @Test func httpsAbsoluteFormIsRefused() throws {
        let answer = try expectResponse(
            try decide(try frontDoor(), "GET https://example.com/ HTTP/1.1", "Host: example.com"))
        #expect(answer.status == 400)
        #expect(answer.message.contains("CONNECT"))
        #expect(answer.message.contains("HTTPS_PROXY"))
    }

    @Test func badFramingIsRefusedAndCloses() throws {
        let answer = try expectResponse(
            try decide(
                try frontDoor(), "POST http://example.com/ HTTP/1.1", "Host: example.com", "Content-Length: 5",
                "Transfer-Encoding: chunked"))
        #expect(answer.status == 400)
        #expect(answer.close)
        #expect(answer.proxyStatus?.error == .httpRequestError)
    }

    @Test func rejectCarriesTheStatusOfTheParseError() {
        let answer = ProxyAnswer.badRequest(HTTPParseError(.startLineTooLong, "request line longer than 8192 bytes"))
            .response
        #expect(answer.status == 414)
        #expect(answer.close)
        #expect(
            answer.proxyStatus == ProxyStatus(error: .httpRequestError, details: "request line longer than 8192 bytes"))
        #expect(text(answer.serialized()).hasPrefix("HTTP/1.1 414 URI Too Long\r\n"))
        #expect(ProxyAnswer.badRequest(HTTPParseError(.versionNotSupported, "x")).status == 505)
        #expect(ProxyAnswer.badRequest(HTTPParseError(.headTooLarge, "x")).status == 431)
    }

    // MARK: - Loops

    @Test(arguments: [
        "GET http://127.0.0.1:8080/ HTTP/1.1",
        "GET http://localhost:8080/x HTTP/1.1",
        "CONNECT 127.0.0.1:8080 HTTP/1.1",
        "CONNECT localhost:8080 HTTP/1.1",
    ])
    func requestToItselfIsALoop(line: String) throws {
        let answer = try expectResponse(try decide(try frontDoor(), line, "Host: 127.0.0.1:8080"))
        #expect(answer.status == 508)
        #expect(answer.close)
        #expect(answer.proxyStatus?.error == .proxyLoopDetected)
        let bytes = text(answer.serialized())
        #expect(bytes.hasPrefix("HTTP/1.1 508 Loop Detected\r\n"))
        #expect(
            bytes.contains(
                "\r\nProxy-Status: proxyctl; error=proxy_loop_detected; details=\"the target is this proxy\"\r\n"))
    }

    @Test func otherPortIsNotALoop() throws {
        let forward = try expectForward(
            try decide(try frontDoor(), "GET http://127.0.0.1:8081/ HTTP/1.1", "Host: 127.0.0.1:8081"))
        #expect(forward.url.authority.port == 8081)
    }

    @Test func listenerOnAllAddressesSeesLoopbackAsItself() throws {
        let door = try frontDoor(bound: ListenAddress(host: "0.0.0.0", port: 3128, isIPv6: false))
        #expect(try expectResponse(try decide(door, "CONNECT 127.0.0.1:3128 HTTP/1.1")).status == 508)
        #expect(try expectResponse(try decide(door, "CONNECT 0.0.0.0:3128 HTTP/1.1")).status == 508)
        let v6 = try frontDoor(bound: ListenAddress(host: "::", port: 3128, isIPv6: true))
        #expect(try expectResponse(try decide(v6, "CONNECT [::1]:3128 HTTP/1.1")).status == 508)
    }

    @Test func listenerOnOneAddress() throws {
        let door = try frontDoor(bound: ListenAddress(host: "192.168.1.10", port: 3128, isIPv6: false))
        #expect(try expectResponse(try decide(door, "CONNECT 192.168.1.10:3128 HTTP/1.1")).status == 508)
        #expect(
            try decide(door, "CONNECT 127.0.0.1:3128 HTTP/1.1")
                == .tunnel(target: HostPort(host: "127.0.0.1", port: 3128, kind: .ipv4), upstream: nil))
    }

    // MARK: - Proxy authentication

    private static let users = "alice:wonderland\n"

    @Test func missingCredentialsAre407() throws {
        let door = try frontDoor(users: Self.users)
        let answer = try expectResponse(try decide(door, "GET http://example.com/ HTTP/1.1", "Host: example.com"))
        #expect(answer.status == 407)
        #expect(answer.extraFields.map(\.name) == ["Proxy-Authenticate"])
        #expect(answer.extraFields.first?.value.hasPrefix("Basic realm=") == true)
        #expect(answer.proxyStatus?.error == .httpRequestDenied)
        #expect(!answer.close)
        let bytes = text(answer.serialized())
        #expect(bytes.hasPrefix("HTTP/1.1 407 Proxy Authentication Required\r\n"))
        #expect(bytes.contains("\r\nProxy-Authenticate: Basic realm=\"proxyctl\", charset=\"UTF-8\"\r\n"))
        #expect(try expectResponse(try decide(door, "CONNECT example.com:443 HTTP/1.1")).status == 407)
    }

    @Test func wrongCredentialsAre407() throws {
        let door = try frontDoor(users: Self.users)
        for value in [basic("alice:wonder"), basic("bob:wonderland"), "Bearer abc", "Basic !!"] {
            let answer = try expectResponse(
                try decide(
                    door, "GET http://example.com/ HTTP/1.1", "Host: example.com", "Proxy-Authorization: \(value)"))
            #expect(answer.status == 407, "\(value)")
            #expect(answer.message.contains("wrong"), "\(value)")
        }
    }

    @Test func unreadBodyCloses407() throws {
        let door = try frontDoor(users: Self.users)
        let withBody = try expectResponse(
            try decide(door, "POST http://example.com/ HTTP/1.1", "Host: example.com", "Content-Length: 3"))
        #expect(withBody.status == 407)
        #expect(withBody.close)
        #expect(text(withBody.serialized()).contains("\r\nConnection: close\r\n"))
        let http10 = try expectResponse(try decide(door, "GET http://example.com/ HTTP/1.0"))
        #expect(http10.close)
    }

    @Test func rightCredentialsAreAllowedAndNotForwarded() throws {
        let door = try frontDoor(users: Self.users)
        let forward = try expectForward(
            try decide(
                door, "GET http://example.com/ HTTP/1.1", "Proxy-Authorization: " + basic("alice:wonderland"),
                "Host: example.com"))
        #expect(text(forward.head) == crlfHead("GET / HTTP/1.1", "Host: example.com"))
        #expect(!text(forward.head).lowercased().contains("proxy-authorization"))
        #expect(
            try decide(door, "CONNECT example.com:443 HTTP/1.1", "Proxy-Authorization: " + basic("alice:wonderland"))
                == .tunnel(target: HostPort(host: "example.com", port: 443, kind: .name), upstream: nil))
    }

    @Test func clientCredentialsAreReplacedByUpstreamCredentials() throws {
        let door = try frontDoor(upstream: "http://corp:hunter2@proxy.corp:3128", users: Self.users)
        let forward = try expectForward(
            try decide(
                door, "GET http://example.com/ HTTP/1.1", "Host: example.com",
                "Proxy-Authorization: " + basic("alice:wonderland")))
        #expect(
            text(forward.head)
                == crlfHead(
                    "GET http://example.com/ HTTP/1.1", "Host: example.com",
                    "Proxy-Authorization: " + basic("corp:hunter2")))
    }
}

/// Responses made by the proxy itself and their `Proxy-Status` field (RFC 9209).
@Suite struct ProxyResponseTests {
    @Test func serializedBytes() {
        let answer = ProxyResponse(
            status: 502,
            proxyStatus: ProxyStatus(error: .dnsError, details: "could not resolve \"x.test\""),
            message: "proxyctl: x.test not found",
            close: true
        )
        let expected =
            "HTTP/1.1 502 Bad Gateway\r\n"
            + "Proxy-Status: proxyctl; error=dns_error; details=\"could not resolve \\\"x.test\\\"\"\r\n"
            + "Content-Type: text/plain; charset=utf-8\r\n"
            + "Content-Length: 27\r\n"
            + "Cache-Control: no-store\r\n"
            + "Connection: close\r\n"
            + "\r\n"
            + "proxyctl: x.test not found\n"
        #expect(text(answer.serialized()) == expected)
    }

    @Test func headResponseHasNoBody() {
        let answer = ProxyResponse(status: 403, message: "no", extraFields: [("X-A", "1"), ("X-B", "2")])
        let expected =
            "HTTP/1.1 403 Forbidden\r\nX-A: 1\r\nX-B: 2\r\nContent-Type: text/plain; charset=utf-8\r\n"
            + "Content-Length: 3\r\nCache-Control: no-store\r\n\r\n"
        #expect(text(answer.serialized(headRequest: true)) == expected)
        #expect(text(answer.serialized()) == expected + "no\n")
    }

    @Test(arguments: [
        "plain", "", "caf\u{E9} \u{1F600} non-ASCII", String(repeating: "long line ", count: 500),
    ])
    func contentLengthMatchesTheBody(message: String) throws {
        let answer = ProxyResponse(
            status: 503, proxyStatus: ProxyStatus(error: .connectionRefused), message: message, close: false)
        let bytes = answer.serialized()
        // Read it back the way a client would.
        var parser = HTTPHeadParser(kind: .response)
        guard case .complete(let head, let consumed) = parser.parse(bytes) else {
            Issue.record("the response does not parse")
            return
        }
        #expect(head.status == 503)
        let semantics = try MessageSemantics.response(head, requestMethod: "GET", upgradeRequested: false).get()
        #expect(semantics.framing == .contentLength(UInt64(bytes.count - consumed)))
        #expect(Array(bytes[consumed...]) == (message + "\n").bytes)
        #expect(head.values(named: "proxy-status") == ["proxyctl; error=connection_refused"])
        #expect(!semantics.serverCloses)
    }

    @Test func proxyStatusFieldValue() {
        #expect(ProxyStatus().fieldValue == "proxyctl")
        #expect(ProxyStatus(error: .dnsTimeout).fieldValue == "proxyctl; error=dns_timeout")
        #expect(
            ProxyStatus(error: .connectionRefused, details: "d", receivedStatus: 503, nextHop: "origin.test:443")
                .fieldValue
                == "proxyctl; error=connection_refused; next-hop=\"origin.test:443\"; received-status=503; details=\"d\""
        )
        #expect(ProxyStatus(details: "only details").fieldValue == "proxyctl; details=\"only details\"")
    }

    @Test func detailsAreAValidStructuredFieldString() {
        // RFC 8941 §3.3.3: printable ASCII only, with DQUOTE and backslash escaped.
        #expect(ProxyStatus.sfString("a\"b\\c") == "\"a\\\"b\\\\c\"")
        #expect(ProxyStatus.sfString("caf\u{E9}\t\r\n\u{7F}") == "\"caf?????\"")
        #expect(ProxyStatus.sfString(" ~") == "\" ~\"")
        let value = ProxyStatus(error: .httpRequestError, details: "bad \u{0}\r\nInjected: yes").fieldValue
        #expect(!value.contains("\r"))
        #expect(!value.contains("\n"))
    }

    @Test func everyErrorTypeIsARegisteredToken() {
        // RFC 9209 §2.3 registry names: lower case, digits and underscores.
        let all: [ProxyStatus.ErrorType] = [
            .dnsTimeout, .dnsError, .destinationNotFound, .destinationUnavailable, .destinationIPUnroutable,
            .connectionRefused, .connectionTerminated, .connectionTimeout, .connectionReadTimeout,
            .connectionLimitReached, .tlsProtocolError, .tlsCertificateError, .httpRequestError, .httpRequestDenied,
            .httpResponseIncomplete, .httpResponseHeaderSectionSize, .httpResponseTimeout, .httpProtocolError,
            .httpUpgradeFailed, .proxyInternalResponse, .proxyInternalError, .proxyConfigurationError,
            .proxyLoopDetected,
        ]
        for error in all {
            #expect(error.rawValue.utf8.allSatisfy { ($0 >= 0x61 && $0 <= 0x7A) || $0 == 0x5F }, "\(error)")
        }
        #expect(ProxyStatus.ErrorType.destinationIPUnroutable.rawValue == "destination_ip_unroutable")
        #expect(ProxyStatus.ErrorType.httpResponseHeaderSectionSize.rawValue == "http_response_header_section_size")
    }

    @Test(arguments: [
        (400, "Bad Request"), (407, "Proxy Authentication Required"), (414, "URI Too Long"),
        (431, "Request Header Fields Too Large"), (502, "Bad Gateway"), (504, "Gateway Timeout"),
        (505, "HTTP Version Not Supported"), (508, "Loop Detected"),
    ])
    func reasonPhrases(status: Int, phrase: String) {
        #expect(ProxyResponse.reasonPhrase(status) == phrase)
    }

    @Test func unknownStatusStillGetsAReasonPhrase() throws {
        let bytes = ProxyResponse(status: 599, message: "x").serialized()
        #expect(try parseHead(bytes, kind: .response).status == 599)
    }
}

/// `protected_users` and `passthrough_users`: the tokens are the proxy's user's, and loopback is no access
/// control on a shared machine.
@Suite struct LocalUserTests {
    static func door(
        protected: UserScope = .owner, passthrough: UserScope = .any, credentials: Bool = false
    )
        -> FrontDoor
    {
        var settings = ProxySettings()
        settings.protectedUsers = protected
        settings.passthroughUsers = passthrough
        var origin = OriginConfig(scheme: "https", authority: HostPort(host: "api.test", port: 443, kind: .name))
        origin.provider = "corp"
        return FrontDoor(
            settings: settings,
            credentials: credentials ? try! ProxyCredentials.parse("ada:secret\n", file: "users").get() : nil,
            boundAddress: ListenAddress(host: "127.0.0.1", port: 8080, isIPv6: false), origins: OriginTable([origin]))
    }

    static let protectedHead = try! parseHead("CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
    static let passthroughHead = try! parseHead("CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n")

    @Test func theOwnerGetsEverything() {
        #expect(
            Self.door().decide(Self.protectedHead, peer: .owner) == .interceptTunnel(Self.door().origins.origins[0]))
        if case .tunnel = Self.door().decide(Self.passthroughHead, peer: .owner) {} else { Issue.record("no tunnel") }
    }

    @Test func anotherUserGets403ForProtectedOriginsAndPassthroughByDefault() throws {
        let answer = try #require(
            {
                if case .respond(let a) = Self.door().decide(Self.protectedHead, peer: .otherUser(uid: 1001)) {
                    a
                } else {
                    nil
                }
            }())
        let response = answer.response
        #expect(response.status == 403 && response.close)
        #expect(response.proxyStatus?.error == .httpRequestDenied)
        #expect(
            response.message.contains("not another user (uid 1001)")
                && response.message.contains("protected_users = any"))
        if case .tunnel = Self.door().decide(Self.passthroughHead, peer: .otherUser(uid: 1001)) {
        } else {
            Issue.record("passthrough stays open to other users by default")
        }
        guard
            case .respond(let denied) = Self.door(passthrough: .owner).decide(
                Self.passthroughHead, peer: .otherUser(uid: 7))
        else {
            Issue.record("passthrough_users = owner lets another user through")
            return
        }
        #expect(denied.response.message.contains("passthrough_users = any"))
    }

    @Test func anUnknownPeerNeedsTheProxyCredential() {
        guard case .respond(let answer) = Self.door().decide(Self.protectedHead, peer: .unknown) else {
            Issue.record("an unidentified peer got the tokens")
            return
        }
        #expect(answer.response.message.contains("a client whose user cannot be told"))
        let withCredentials = Self.door(credentials: true)
        let head = try! parseHead(
            "CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\nProxy-Authorization: Basic YWRhOnNlY3JldA==\r\n\r\n"
        )
        #expect(withCredentials.decide(head, peer: .unknown) == .interceptTunnel(withCredentials.origins.origins[0]))
    }

    @Test func anyLetsEveryoneIn() {
        let door = Self.door(protected: .any)
        #expect(door.decide(Self.protectedHead, peer: .otherUser(uid: 5)) == .interceptTunnel(door.origins.origins[0]))
    }

    // MARK: The owner credential: where the kernel cannot name the peer's user (docs/porting.md)

    static func portableDoor(passthrough: UserScope = .any) -> FrontDoor {
        var door = Self.door(passthrough: passthrough)
        door.ownerCredential = try! ProxyCredentials.parse("proxyctl:0wner-secret\n", file: "proxy-credential").get()
        return door
    }

    static func connect(_ target: String, authorization: String? = nil, body: Bool = false) -> HTTPHead {
        let field = authorization.map { "Proxy-Authorization: Basic \(Base64.encode(Array($0.utf8)))\r\n" } ?? ""
        return try! parseHead("CONNECT \(target) HTTP/1.1\r\nHost: \(target)\r\n\(field)\r\n")
    }

    @Test func theOwnerCredentialMakesAnUnknownPeerTheOwner() {
        let door = Self.portableDoor()
        let head = Self.connect("api.test:443", authorization: "proxyctl:0wner-secret")
        #expect(door.decide(head, peer: .unknown) == .interceptTunnel(door.origins.origins[0]))
    }

    @Test func withoutTheOwnerCredentialProtectedOriginsAre407NamingHowToGetIt() throws {
        let door = Self.portableDoor()
        for (authorization, sent) in [(nil, false), ("proxyctl:guess", true), ("ada:0wner-secret", true)] {
            guard
                case .respond(let answer) = door.decide(
                    Self.connect("api.test:443", authorization: authorization), peer: .unknown)
            else {
                Issue.record("\(authorization ?? "no credential") got the tokens")
                continue
            }
            #expect(answer == .ownerCredentialRequired(credentialSent: sent, protected: true, close: false))
            let response = answer.response
            #expect(response.status == 407 && response.proxyStatus?.error == .httpRequestDenied)
            #expect(response.extraFields.contains { $0.name == "Proxy-Authenticate" && $0.value.hasPrefix("Basic ") })
            #expect(response.message.contains("eval \"$(proxyctl env)\"") && response.message.contains("proxyctl exec"))
        }
    }

    @Test func theOwnerCredentialLeavesOpenPassthroughAndTheKernelsAnswerAlone() {
        let door = Self.portableDoor()
        if case .tunnel = door.decide(Self.connect("other.test:443"), peer: .unknown) {
        } else {
            Issue.record("passthrough_users = any wants no credential")
        }
        // passthrough_users = owner: the credential is wanted there too.
        guard
            case .respond(.ownerCredentialRequired(false, false, _)) = Self.portableDoor(passthrough: .owner).decide(
                Self.connect("other.test:443"), peer: .unknown)
        else {
            Issue.record("passthrough_users = owner let an unidentified peer through")
            return
        }
        // A peer the kernel named keeps its answer: the credential does not make another user the owner.
        let head = Self.connect("api.test:443", authorization: "proxyctl:0wner-secret")
        #expect(
            door.decide(head, peer: .otherUser(uid: 7))
                == .respond(.notForThisUser(.otherUser(uid: 7), protected: true)))
        #expect(door.decide(Self.protectedHead, peer: .owner) == .interceptTunnel(door.origins.origins[0]))
    }
}
