import Testing

@testable import ProxyCore

/// The own HTTP/1.1 client's exchange as a playbook: connection events and origin bytes in, byte-exact actions
/// out (which connection, the head written, what reaches the owner, the connection kept or closed, retries).
@Suite struct OriginExchangeTests {
    static let head = Array("GET /a HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer t\r\n\r\n".utf8)
    static let written = "write(GET /a HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer t\r\n\r\n)"

    enum Step {
        case event(OriginExchange.Event)
        case bytes(String)
    }

    /// The actions as text, body ranges resolved to the bytes they point at.
    static func render(_ actions: [OriginExchange.Action], _ input: [UInt8] = []) -> [String] {
        actions.map { action in
            switch action {
            case .connect(let reuse): "connect(reuse: \(reuse))"
            case .arm(let milliseconds): "arm(\(milliseconds))"
            case .write(let bytes): "write(\(String(decoding: bytes, as: UTF8.self)))"
            case .deliverHead(let bytes): "head(\(String(decoding: bytes.bytes, as: UTF8.self)))"
            case .deliverBody(let range): "body(\(String(decoding: input[range], as: UTF8.self)))"
            case .deliverTrailers(let fields):
                "trailers(\(fields.map { "\($0.nameText): \(String(decoding: $0.value, as: UTF8.self))" }.joined(separator: ", ")))"
            case .release(let reusable): "release(reusable: \(reusable))"
            case .finish(let failure, let detail):
                failure.map { "finish(\($0), \(detail))" } ?? "finish(complete)"
            case .log(let line): "log(\(line))"
            case .readBody(let most): "readBody(\(most))"
            case .writeBody(let count): "writeBody(\(count))"
            case .rewindBody: "rewindBody"
            case .startTLS: "startTLS"
            case .switchProtocols(let headBytes): "switchProtocols(headBytes: \(headBytes))"
            case .submit(let fields, let body): "submit(\(fields.count) fields, body: \(body))"
            }
        }
    }

    static func make(
        _ method: String = "GET", body: OriginExchange.Body = .none, upgrade: Bool = false
    )
        -> OriginExchange
    {
        OriginExchange(
            request: OriginExchange.Request(
                method: method,
                url: AbsoluteURL(
                    scheme: "https", authority: HostPort(host: "api.test", port: 443, kind: .name), pathAndQuery: "/a"),
                fields: upgrade ? [("Connection", Array("Upgrade".utf8)), ("Upgrade", Array("websocket".utf8))] : [],
                body: body, credential: [("Authorization", Array("Bearer t".utf8))], upgrade: upgrade),
            connectTimeout: 3000, idleTimeout: 9000)
    }

    /// Starts an exchange and plays `steps`; returns the actions of each step (the start's first).
    static func play(
        _ steps: [Step], method: String = "GET", body: OriginExchange.Body = .none, upgrade: Bool = false
    ) -> [[String]] {
        var exchange = make(method, body: body, upgrade: upgrade)
        var out: [OriginExchange.Action] = []
        exchange.start(&out)
        var all = [render(out)]
        for step in steps {
            out = []
            switch step {
            case .event(let event):
                exchange.handle(event, &out)
                all.append(render(out))
            case .bytes(let text):
                let bytes = Array(text.utf8)
                let taken = bytes.withUnsafeBytes { exchange.received($0, &out) }
                all.append(render(out, bytes) + (taken == bytes.count ? [] : ["untaken(\(bytes.count - taken))"]))
            }
        }
        return all
    }

    @Test func aResponseOnANewConnectionIsHandedOverAndTheConnectionKept() {
        let actions = Self.play([
            .event(.connected(reused: false)),
            .bytes("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
        ])
        #expect(
            actions == [
                ["arm(3000)", "connect(reuse: true)"],
                [Self.written, "arm(9000)"],
                [
                    "head(HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n)", "body(hello)", "release(reusable: true)",
                    "finish(complete)",
                ],
            ])
    }

    /// An upgrade goes on a new connection (never one the pool keeps for others, nor a shared HTTP/2 one), and the
    /// 101 hands that connection over before its head reaches the owner: the head's bytes dropped, the new
    /// protocol's first bytes left in it, nothing released to the pool.
    @Test func anUpgradeGetsANewConnectionWhichA101HandsOver() {
        let head = "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
        let actions = Self.play([.event(.connected(reused: false)), .bytes(head + "\u{81}\u{00}")], upgrade: true)
        #expect(
            actions == [
                ["arm(3000)", "connect(reuse: false)"],
                [
                    "write(GET /a HTTP/1.1\r\nHost: api.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nAuthorization: Bearer t\r\n\r\n)",
                    "arm(9000)",
                ],
                ["switchProtocols(headBytes: \(head.utf8.count))", "head(\(head))", "finish(complete)", "untaken(3)"],
            ])
        // Any other answer is an ordinary response (the origin declined the upgrade; RFC 9110 §7.8): read whole,
        // and the connection stays HTTP/1.1, kept.
        let refused = Self.play(
            [.event(.connected(reused: false)), .bytes("HTTP/1.1 403 Forbidden\r\nContent-Length: 2\r\n\r\nno")],
            upgrade: true)
        #expect(
            refused.last == [
                "head(HTTP/1.1 403 Forbidden\r\nContent-Length: 2\r\n\r\n)", "body(no)", "release(reusable: true)",
                "finish(complete)",
            ])
        // HTTP/2 is not offered for an upgrade; an origin that chose it anyway is broken.
        #expect(
            Self.play([.event(.connected(reused: false, http2: true))], upgrade: true).last == [
                "release(reusable: false)", "finish(protocolError, the origin chose HTTP/2 for an upgrade request)",
            ])
    }

    @Test func aBodyInPiecesIsHandedOverAsItComes() {
        let actions = Self.play([
            .event(.connected(reused: true)),
            .bytes("HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nab"),
            .bytes("cd"),
            .bytes("ef"),
        ])
        #expect(
            Array(actions.dropFirst(2)) == [
                ["head(HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n)", "body(ab)"],
                ["body(cd)"],
                ["body(ef)", "release(reusable: true)", "finish(complete)"],
            ])
    }

    @Test func anOriginThatClosesOrSendsMoreThanTheResponseIsNotReused() {
        let closing = Self.play([
            .event(.connected(reused: false)),
            .bytes("HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"),
        ])
        #expect(
            closing.last == [
                "head(HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n)", "release(reusable: false)",
                "finish(complete)",
            ])
        let outOfStep = Self.play([
            .event(.connected(reused: false)),
            .bytes("HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\n"),
        ])
        #expect(
            outOfStep.last == [
                "head(HTTP/1.1 204 No Content\r\n\r\n)", "release(reusable: false)", "finish(complete)", "untaken(17)",
            ])
    }

    @Test func aKeptConnectionTheOriginHadClosedIsReplacedOnceForAGet() {
        let actions = Self.play([
            .event(.connected(reused: true)),
            .event(.closed),
            .event(.connected(reused: false)),
            .bytes("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
        ])
        #expect(
            Array(actions.dropFirst(2)) == [
                [
                    "release(reusable: false)",
                    "log(the kept connection to the origin closed before answering; GET sent again on a new connection)",
                    "arm(3000)", "connect(reuse: false)",
                ],
                [Self.written, "arm(9000)"],
                ["head(HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n)", "release(reusable: true)", "finish(complete)"],
            ])
    }

    @Test func theRequestIsSentAgainOnlyOnce() {
        let actions = Self.play([
            .event(.connected(reused: true)),
            .event(.broken(detail: "reset")),
            .event(.connected(reused: true)),
            .event(.closed),
        ])
        #expect(actions[2].last == "connect(reuse: false)")
        #expect(
            actions[4] == [
                "release(reusable: false)",
                "finish(incomplete, the origin closed the connection without a response)",
            ])
    }

    @Test func noResendWhenTheConnectionWasNewOrAnswerBytesCameOrTheMethodIsNotIdempotent() {
        let fresh = Self.play([.event(.connected(reused: false)), .event(.closed)])
        #expect(
            fresh.last == [
                "release(reusable: false)", "finish(incomplete, the origin closed the connection without a response)",
            ])
        let answered = Self.play([.event(.connected(reused: true)), .bytes("HTTP/1.1 200"), .event(.closed)])
        #expect(
            answered.last == [
                "release(reusable: false)",
                "finish(incomplete, the origin closed the connection before the response was complete)",
            ])
        let post = Self.play([.event(.connected(reused: true)), .event(.broken(detail: "reset"))], method: "POST")
        #expect(post.last == ["release(reusable: false)", "finish(incomplete, reset)"])
        let head = Self.play([.event(.connected(reused: true)), .event(.closed)], method: "HEAD")
        #expect(head.last?.last == "connect(reuse: false)")
    }

    @Test func aConnectionThatCannotBeMadeEndsTheExchangeWithItsReason() {
        let actions = Self.play([.event(.connectFailed(.certificate, detail: "self-signed"))])
        #expect(actions.last == ["finish(certificate, self-signed)"])
        // Nothing after the end.
        var exchange = Self.make()
        var out: [OriginExchange.Action] = []
        exchange.start(&out)
        exchange.handle(.connectFailed(.dns, detail: "no such host"), &out)
        out = []
        for event in [OriginExchange.Event.closed, .broken(detail: "x"), .timerFired(idle: 99_999), .cancel] {
            exchange.handle(event, &out)
        }
        #expect(out.isEmpty)
    }

    @Test func timeouts() {
        let connecting = Self.play([.event(.timerFired(idle: 3000))])
        #expect(connecting.last == ["release(reusable: false)", "finish(timeout, no connection within 3000 ms)"])
        let waiting = Self.play([
            .event(.connected(reused: false)),
            .event(.timerFired(idle: 4000)),
            .event(.timerFired(idle: 9000)),
        ])
        #expect(waiting[2] == ["arm(5000)"])
        #expect(
            waiting[3] == ["release(reusable: false)", "finish(timeout, no byte from the origin for 9000 ms)"])
    }

    @Test func aCancelledExchangeClosesItsConnectionUnlessTheResponseHadEnded() {
        let midway = Self.play([
            .event(.connected(reused: false)),
            .bytes("HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nab"),
            .event(.cancel),
            .bytes("cdefghi"),
        ])
        #expect(midway[3] == ["release(reusable: false)"])
        #expect(midway[4] == [])
        let connecting = Self.play([.event(.cancel), .event(.connected(reused: false))])
        #expect(connecting == [["arm(3000)", "connect(reuse: true)"], ["release(reusable: false)"], []])
    }

    @Test func aBodyUntilCloseEndsWithTheClose() {
        let actions = Self.play([
            .event(.connected(reused: false)),
            .bytes("HTTP/1.1 200 OK\r\n\r\nsome"),
            .event(.closed),
        ])
        #expect(actions[2] == ["head(HTTP/1.1 200 OK\r\n\r\n)", "body(some)"])
        #expect(actions[3] == ["release(reusable: false)", "finish(complete)"])
    }

    @Test func interimHeadsChunksAndTrailersReachTheOwnerAsLibcurlGivesThem() {
        let actions = Self.play([
            .event(.connected(reused: false)),
            .bytes(
                "HTTP/1.1 103 Early Hints\r\nLink: </s.css>\r\n\r\n"
                    + "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\ngrpc-status: 0\r\n\r\n"),
        ])
        #expect(
            actions.last == [
                "head(HTTP/1.1 103 Early Hints\r\nLink: </s.css>\r\n\r\n)",
                "head(HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n)", "body(abc)",
                "trailers(grpc-status: 0)", "release(reusable: true)", "finish(complete)",
            ])
    }

    @Test func aResponseThatIsNotHTTPIsAProtocolErrorAndAHugeHeadIsNamedSo() {
        let garbage = Self.play([.event(.connected(reused: false)), .bytes("SSH-2.0-OpenSSH\r\n\r\n")])
        #expect(garbage.last?.first == "release(reusable: false)")
        #expect(garbage.last?[1].hasPrefix("finish(protocolError, ") == true, "\(garbage)")
        let smuggling = Self.play([
            .event(.connected(reused: false)),
            .bytes("HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"),
        ])
        #expect(smuggling.last?.last?.hasPrefix("finish(protocolError, ") == true, "\(smuggling)")
        let huge = Self.play([
            .event(.connected(reused: false)),
            .bytes("HTTP/1.1 200 OK\r\nX: " + String(repeating: "a", count: 70_000) + "\r\n\r\n"),
        ])
        #expect(huge.last?[1].hasPrefix("finish(headTooLarge, ") == true, "\(huge)")
    }

    /// Every sequence of up to five events from every point: one finish at most, nothing after it, a write
    /// only on a connection, one connection at a time, a second connect only for an idempotent method.
    @Test(arguments: ["GET", "POST"]) func everySequenceKeepsTheInvariants(method: String) async {
        let broken = await offThePool { Self.firstBrokenSequence(method: method) }
        #expect(broken == nil, "\(broken ?? "")")
    }

    /// The walk of `everySequenceKeepsTheInvariants`: the first sequence that breaks a rule, or nil.
    static func firstBrokenSequence(method: String) -> String? {
        let alphabet: [Step] = [
            .event(.connected(reused: true)), .event(.connected(reused: false)), .event(.closed),
            .event(.broken(detail: "x")), .event(.timerFired(idle: 1)), .event(.timerFired(idle: 9000)),
            .event(.cancel), .event(.connectFailed(.connect, detail: "x")),
            .bytes("HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n"), .bytes("x"),
        ]
        var sequences: [[Int]] = [[]]
        for _ in 0..<5 { sequences = sequences.flatMap { prefix in alphabet.indices.map { prefix + [$0] } } }
        for sequence in sequences {
            var exchange = Self.make(method)
            var out: [OriginExchange.Action] = []
            exchange.start(&out)
            var connections = 0  // asked for and not released
            var connects = 0
            var connected = false
            var finishes = 0
            var valid = true
            for index in sequence {
                var step: [OriginExchange.Action] = []
                switch alphabet[index] {
                case .event(let event):
                    // The I/O layer reports a connection only when one was asked for.
                    if case .connected = event, connections == 0 || connected { continue }
                    if case .connectFailed = event, connections == 0 || connected { continue }
                    exchange.handle(event, &step)
                    if case .connected = event { connected = true }
                    if case .connectFailed = event { connections = 0 }
                case .bytes(let text):
                    guard connected else { continue }
                    _ = Array(text.utf8).withUnsafeBytes { exchange.received($0, &step) }
                }
                out += step
                for action in step {
                    switch action {
                    case .connect:
                        connects += 1
                        connections += 1
                    case .release:
                        connections = max(0, connections - 1)
                        connected = false
                    case .write: valid = valid && connected
                    case .finish: finishes += 1
                    default: break
                    }
                    if finishes > 1 || connections > 1 { valid = false }
                }
            }
            let after = out.lastIndex { if case .finish = $0 { true } else { false } }
            if let after {
                // After the end, only the connection's release may still come.
                valid =
                    valid
                    && out[(after + 1)...].allSatisfy { if case .release = $0 { true } else { false } }
            }
            valid = valid && connects <= (method == "GET" ? 2 : 1)
            if !valid { return "\(sequence.map { "\(alphabet[$0])" })" }
        }
        return nil
    }

    @Test func theBodysFramingAndWhetherTheRequestMayGoTwice() {
        func request(_ method: String, body: UpstreamRequest.Body = .none) -> UpstreamRequest {
            UpstreamRequest(
                method: method, url: "https://api.test/a", requestTarget: nil, fields: [], credential: nil, body: body,
                http2: true, connectTimeout: 1, idleTimeout: 1, caFile: nil, upstreamProxy: nil, attempt: 1)
        }
        #expect(request("POST", body: .streaming).originBody == .chunked)
        #expect(request("POST", body: .length(7)).originBody == .length(7))
        #expect(request("GET").originBody == OriginExchange.Body.none)
        #expect(!request("POST").mayResend && !request("PUT", body: .length(1)).mayResend)
        #expect(!request("PATCH").mayResend && !request("DELETE", body: .streaming).mayResend)
        #expect(request("PUT").mayResend && request("GET").mayResend && request("OPTIONS").mayResend)
    }

    // MARK: - Request bodies

    @Test func aContentLengthBodyGoesAsTheOwnerHasIt() {
        let actions = Self.play(
            [
                .event(.connected(reused: false)),
                .event(.bodyRead(4)),
                .event(.bodyPaused),
                .event(.bodyResumed),
                .event(.bodyRead(6)),
                .bytes("HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n"),
            ], method: "POST", body: .length(10))
        #expect(
            Array(actions.dropFirst()) == [
                [
                    "write(POST /a HTTP/1.1\r\nHost: api.test\r\nContent-Length: 10\r\nAuthorization: Bearer t\r\n\r\n)",
                    "arm(9000)", "readBody(10)",
                ],
                ["writeBody(4)", "readBody(6)"],
                [],
                ["readBody(6)"],
                ["writeBody(6)"],
                [
                    "head(HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n)", "release(reusable: true)",
                    "finish(complete)",
                ],
            ])
    }

    @Test func aLongBodyIsAskedForAPieceAtATime() {
        let actions = Self.play(
            [.event(.connected(reused: false)), .event(.bodyRead(OriginExchange.bodyPiece))], method: "PUT",
            body: .length(100_000))
        #expect(actions[1].last == "readBody(65536)")
        #expect(actions[2] == ["writeBody(65536)", "readBody(34464)"])
    }

    @Test func aChunkedBodyIsFramedAndEndsWithItsTrailers() {
        let actions = Self.play(
            [
                .event(.connected(reused: false)),
                .event(.bodyRead(26)),
                .event(.bodyEnded(trailers: [H2Field("grpc-timeout", "1S"), H2Field("Content-Length", "9")])),
                .bytes("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
            ], method: "POST", body: .chunked)
        #expect(
            Array(actions.dropFirst(2)) == [
                ["write(1a\r\n)", "writeBody(26)", "write(\r\n)", "readBody(65536)"],
                // A field a trailer must not carry is left out (RFC 9110 §6.5.1).
                ["write(0\r\ngrpc-timeout: 1S\r\n\r\n)"],
                [
                    "head(HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n)", "body(ok)", "release(reusable: true)",
                    "finish(complete)",
                ],
            ])
        let empty = Self.play(
            [.event(.connected(reused: false)), .event(.bodyEnded(trailers: []))], method: "POST", body: .chunked)
        #expect(empty.last == ["write(0\r\n\r\n)"])
    }

    @Test func anAnswerBeforeTheWholeBodyLeavesTheConnectionClosed() {
        let actions = Self.play(
            [
                .event(.connected(reused: true)),
                .event(.bodyRead(4)),
                .bytes("HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n"),
                .event(.bodyRead(6)),
            ], method: "POST", body: .length(10))
        #expect(
            actions[3] == [
                "head(HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n)", "release(reusable: false)",
                "finish(complete)",
            ])
        #expect(actions[4] == [])
    }

    @Test func aBodyThatEndsBeforeItsLengthEndsTheExchange() {
        let actions = Self.play(
            [.event(.connected(reused: false)), .event(.bodyRead(3)), .event(.bodyEnded(trailers: []))],
            method: "POST", body: .length(10))
        #expect(
            actions.last == [
                "release(reusable: false)", "finish(other, the request body ended 7 bytes before its Content-Length)",
            ])
    }

    /// RFC 9110 §9.2.2: a request the origin may have acted on is never sent twice, even on a kept connection that
    /// ended before a byte of answer (the keep-alive race). A bodiless idempotent one is sent once more.
    @Test(arguments: [
        ("POST", OriginExchange.Body.length(5), false), ("PATCH", .none, false), ("POST", .none, false),
        ("PUT", .length(5), false), ("DELETE", .chunked, false), ("PUT", .none, true), ("DELETE", .none, true),
        ("OPTIONS", .none, true),
    ])
    func onlyAnIdempotentRequestWithoutABodyIsSentAgain(method: String, body: OriginExchange.Body, resent: Bool) {
        var steps: [Step] = [.event(.connected(reused: true))]
        if body != .none { steps.append(.event(.bodyRead(5))) }
        steps.append(.event(.closed))
        let actions = Self.play(steps, method: method, body: body)
        if resent {
            #expect(actions.last?.last == "connect(reuse: false)", "\(actions)")
        } else {
            #expect(
                actions.last == [
                    "release(reusable: false)",
                    "finish(incomplete, the origin closed the connection without a response)",
                ], "\(actions)")
        }
    }

    /// Every sequence of up to five events, body answers included, for requests with and without a body: one
    /// finish at most, nothing after it but the release, writes only on a connection, the body written never
    /// beyond its length, and a second connection only for a request that may be sent again.
    @Test(arguments: [
        ("GET", OriginExchange.Body.none), ("POST", .length(3)), ("POST", .chunked), ("PUT", .none),
    ])
    func everySequenceWithABodyKeepsTheInvariants(method: String, body: OriginExchange.Body) async {
        let broken = await offThePool { Self.firstBrokenSequenceWithABody(method: method, body: body) }
        #expect(broken == nil, "\(broken ?? "")")
    }

    /// The walk of `everySequenceWithABodyKeepsTheInvariants`: the first sequence that breaks a rule, or nil.
    static func firstBrokenSequenceWithABody(method: String, body: OriginExchange.Body) -> String? {
        let alphabet: [Step] = [
            .event(.connected(reused: true)), .event(.connected(reused: false)), .event(.closed),
            .event(.broken(detail: "x")), .event(.timerFired(idle: 9000)), .event(.cancel),
            .event(.bodyRead(1)), .event(.bodyPaused), .event(.bodyResumed), .event(.bodyEnded(trailers: [])),
            .bytes("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
        ]
        let mayResend = RetryPolicy.mayResend(method: method, framing: body == .none ? .none : .chunked)
        var sequences: [[Int]] = [[]]
        for _ in 0..<5 { sequences = sequences.flatMap { prefix in alphabet.indices.map { prefix + [$0] } } }
        for sequence in sequences {
            var exchange = Self.make(method, body: body)
            var out: [OriginExchange.Action] = []
            exchange.start(&out)
            var asked: Int?  // an outstanding .readBody's most
            var connected = false
            var connects = 1
            var written = 0
            var finished = false
            var valid = true
            for index in sequence {
                var step: [OriginExchange.Action] = []
                switch alphabet[index] {
                case .event(let event):
                    switch event {
                    case .connected:
                        if connected || finished { continue }
                    case .bodyRead(let count):
                        guard let most = asked, count <= most else { continue }
                        asked = nil
                    case .bodyPaused, .bodyEnded:
                        guard asked != nil else { continue }
                        asked = nil
                    case .closed, .broken:
                        if !connected { continue }
                    default: break
                    }
                    exchange.handle(event, &step)
                    if case .connected = event { connected = true }
                case .bytes(let text):
                    guard connected else { continue }
                    _ = Array(text.utf8).withUnsafeBytes { exchange.received($0, &step) }
                }
                for action in step {
                    switch action {
                    case .connect:
                        connects += 1
                        asked = nil
                    case .release: connected = false
                    case .write: valid = valid && connected && !finished
                    case .writeBody(let count):
                        written += count
                        valid = valid && connected && !finished
                    case .readBody(let most):
                        valid = valid && asked == nil && most > 0
                        asked = most
                    case .finish:
                        valid = valid && !finished
                        finished = true
                    default:
                        valid = valid && !(finished && !step.contains { if case .finish = $0 { true } else { false } })
                    }
                }
                if case .length(let length) = body { valid = valid && written <= length }
                out += step
            }
            valid = valid && connects - 1 <= (mayResend ? 2 : 1)
            if !valid { return "\(sequence.map { "\(alphabet[$0])" })" }
        }
        return nil
    }
}

/// The own client's exchange on a stream of an HTTP/2 connection (the origin chose h2 by ALPN): the same
/// machine, the header block instead of the head's bytes, and RFC 9113 §8.7's proof of a stream not processed.
@Suite struct OriginExchangeHTTP2Tests {
    static func make(_ method: String = "GET", body: OriginExchange.Body = .none) -> OriginExchange {
        OriginExchange(
            request: OriginExchange.Request(
                method: method,
                url: AbsoluteURL(
                    scheme: "https", authority: HostPort(host: "api.test", port: 443, kind: .name),
                    pathAndQuery: "/a?b=1"),
                fields: [("Accept", Array("*/*".utf8))], body: body,
                credential: [("Authorization", Array("Bearer t".utf8))]),
            connectTimeout: 3000, idleTimeout: 9000)
    }

    enum Step {
        case event(OriginExchange.Event)
        case data(String)
    }

    static func play(_ steps: [Step], method: String = "GET", body: OriginExchange.Body = .none) -> [[String]] {
        var exchange = make(method, body: body)
        var out: [OriginExchange.Action] = []
        exchange.start(&out)
        var all = [OriginExchangeTests.render(out)]
        for step in steps {
            out = []
            switch step {
            case .event(let event):
                exchange.handle(event, &out)
                all.append(render(out))
            case .data(let text):
                let bytes = Array(text.utf8)
                _ = bytes.withUnsafeBytes { exchange.received($0, &out) }
                all.append(render(out, bytes))
            }
        }
        return all
    }

    static func render(_ actions: [OriginExchange.Action], _ input: [UInt8] = []) -> [String] {
        actions.map { action in
            if case .submit(let fields, let body) = action {
                return
                    "submit(\(fields.map { "\($0.nameText): \($0.valueText)" }.joined(separator: ", ")), body: \(body))"
            }
            return OriginExchangeTests.render([action], input)[0]
        }
    }

    static let ok = [H2Field(":status", "200"), H2Field("content-type", "text/plain")]

    @Test func aStreamCarriesTheRequestAndDeliversHeadBodyAndTrailers() {
        let actions = Self.play([
            .event(.connected(reused: false, http2: true)),
            .event(.streamHead([H2Field(":status", "103"), H2Field("link", "</s.css>")])),
            .event(.streamHead(Self.ok)),
            .data("hello"),
            .event(.streamTrailers([H2Field("grpc-status", "0")])),
            .event(.streamEnded),
        ])
        #expect(
            Array(actions.dropFirst()) == [
                [
                    "submit(:method: GET, :scheme: https, :authority: api.test, :path: /a?b=1, accept: */*, authorization: Bearer t, body: false)",
                    "arm(9000)",
                ],
                ["head(HTTP/1.1 103 \r\nlink: </s.css>\r\n\r\n)"],
                ["head(HTTP/1.1 200 \r\ncontent-type: text/plain\r\n\r\n)"],
                ["body(hello)"],
                ["trailers(grpc-status: 0)"],
                ["release(reusable: true)", "finish(complete)"],
            ])
    }

    @Test func aStreamThatEndsWithoutAResponseOrWithABadHeadFails() {
        let empty = Self.play([.event(.connected(reused: false, http2: true)), .event(.streamEnded)])
        #expect(empty.last == ["release(reusable: false)", "finish(incomplete, the stream ended without a response)"])
        let noStatus = Self.play([
            .event(.connected(reused: false, http2: true)), .event(.streamHead([H2Field("server", "x")])),
        ])
        #expect(noStatus.last?.last?.hasPrefix("finish(protocolError, ") == true, "\(noStatus)")
        let large = Self.play([
            .event(.connected(reused: false, http2: true)), .event(.streamHeadTooLarge(reason: "over 64 KiB")),
        ])
        #expect(large.last == ["release(reusable: false)", "finish(headTooLarge, over 64 KiB)"])
        let earlyTrailers = Self.play([
            .event(.connected(reused: false, http2: true)), .event(.streamTrailers([H2Field("x", "1")])),
        ])
        #expect(
            earlyTrailers.last == [
                "release(reusable: false)", "finish(protocolError, trailer fields before the response)",
            ])
    }

    /// RFC 9113 §8.7: a refused stream was not processed, so even a POST goes again, once, its body read from
    /// the start (when it was kept).
    @Test func aRefusedStreamGoesAgainOnceWhateverTheMethodItsBodyRewound() {
        let actions = Self.play(
            [
                .event(.connected(reused: true, http2: true)),
                .event(.streamFailed(refused: true, detail: "REFUSED_STREAM")),
                .event(.bodyRewound(true)),
                .event(.connected(reused: true, http2: true)),
                .event(.streamFailed(refused: true, detail: "REFUSED_STREAM")),
            ], method: "POST", body: .length(5))
        #expect(actions[1].first?.hasSuffix("body: true)") == true)
        #expect(
            actions[2] == [
                "release(reusable: false)",
                "log(the origin did not process the stream (REFUSED_STREAM); POST sent again)", "rewindBody",
            ])
        #expect(actions[3] == ["arm(3000)", "connect(reuse: true)"])
        #expect(actions[5] == ["release(reusable: false)", "finish(incomplete, REFUSED_STREAM)"])
        let unkept = Self.play(
            [
                .event(.connected(reused: true, http2: true)),
                .event(.streamFailed(refused: true, detail: "GOAWAY")),
                .event(.bodyRewound(false)),
            ], method: "POST", body: .chunked)
        #expect(unkept.last?.first?.hasPrefix("finish(incomplete, the origin did not process the request") == true)
    }

    @Test func aLostConnectionResendsOnlyWhatRetryPolicyAllows() {
        let get = Self.play([
            .event(.connected(reused: true, http2: true)),
            .event(.streamFailed(refused: false, detail: "the origin closed the connection")),
        ])
        #expect(get.last?.last == "connect(reuse: false)")
        let post = Self.play(
            [
                .event(.connected(reused: true, http2: true)),
                .event(.streamFailed(refused: false, detail: "the origin closed the connection")),
            ], method: "POST", body: .length(3))
        #expect(post.last == ["release(reusable: false)", "finish(incomplete, the origin closed the connection)"])
        let answered = Self.play([
            .event(.connected(reused: true, http2: true)), .event(.streamHead(Self.ok)),
            .event(.streamFailed(refused: false, detail: "reset")),
        ])
        #expect(answered.last == ["release(reusable: false)", "finish(incomplete, reset)"])
        let fresh = Self.play([
            .event(.connected(reused: false, http2: true)), .event(.streamFailed(refused: false, detail: "reset")),
        ])
        #expect(fresh.last == ["release(reusable: false)", "finish(incomplete, reset)"])
    }

    /// Every sequence of up to five stream events: one finish at most, a stream opened only on a connection, at
    /// most two streams, the second only after a refusal or for a request RetryPolicy lets go again.
    @Test(arguments: [("GET", OriginExchange.Body.none), ("POST", .length(3)), ("PATCH", .none)])
    func everySequenceKeepsTheInvariants(method: String, body: OriginExchange.Body) async {
        let broken = await offThePool { Self.firstBrokenSequence(method: method, body: body) }
        #expect(broken == nil, "\(broken ?? "")")
    }

    /// The walk of `everySequenceKeepsTheInvariants`: the first sequence that breaks a rule, or nil.
    static func firstBrokenSequence(method: String, body: OriginExchange.Body) -> String? {
        let alphabet: [Step] = [
            .event(.connected(reused: true, http2: true)), .event(.connected(reused: false, http2: true)),
            .event(.streamHead(Self.ok)), .event(.streamHead([H2Field(":status", "100")])), .data("x"),
            .event(.streamTrailers([])), .event(.streamEnded), .event(.streamFailed(refused: true, detail: "r")),
            .event(.streamFailed(refused: false, detail: "l")), .event(.bodyRewound(true)),
            .event(.bodyRewound(false)), .event(.timerFired(idle: 9000)), .event(.cancel),
        ]
        let mayResend = RetryPolicy.mayResend(method: method, framing: body == .none ? .none : .chunked)
        var sequences: [[Int]] = [[]]
        for _ in 0..<5 { sequences = sequences.flatMap { prefix in alphabet.indices.map { prefix + [$0] } } }
        for sequence in sequences {
            var exchange = Self.make(method, body: body)
            var out: [OriginExchange.Action] = []
            exchange.start(&out)
            var connecting = true
            var onStream = false
            var rewinding = false
            var submits = 0
            var refusals = 0
            var finished = false
            var valid = true
            for index in sequence {
                var step: [OriginExchange.Action] = []
                switch alphabet[index] {
                case .event(let event):
                    switch event {
                    case .connected: if !connecting || finished { continue }
                    case .bodyRewound: if !rewinding { continue }
                    case .streamHead, .streamTrailers, .streamEnded, .streamFailed: if !onStream { continue }
                    default: break
                    }
                    if case .streamFailed(true, _) = event { refusals += 1 }
                    if case .bodyRewound = event { rewinding = false }
                    exchange.handle(event, &step)
                    if case .connected = event { connecting = false }
                case .data(let text):
                    guard onStream else { continue }
                    _ = Array(text.utf8).withUnsafeBytes { exchange.received($0, &step) }
                }
                for action in step {
                    switch action {
                    case .connect: connecting = true
                    case .submit:
                        valid = valid && !connecting && !finished
                        submits += 1
                        onStream = true
                    case .release: onStream = false
                    case .rewindBody: rewinding = true
                    case .write, .writeBody, .readBody: valid = false  // HTTP/1.1 only
                    case .finish:
                        valid = valid && !finished
                        finished = true
                    default: break
                    }
                }
            }
            valid = valid && submits <= 2 && (submits < 2 || mayResend || refusals > 0)
            if !valid { return "\(sequence.map { "\(alphabet[$0])" })" }
        }
        return nil
    }
}

/// The request as an HTTP/2 header block, and the origin's back as the head every exchange decides from.
@Suite struct H2OriginSemanticsTests {
    @Test func theHeaderBlockIsTheRequestsOwnPlusTheCredential() {
        let url = AbsoluteURL(
            scheme: "https", authority: HostPort(host: "api.test", port: 8443, kind: .name), pathAndQuery: "/v1/x?y")
        let block = H2Semantics.originRequest(
            method: "POST", url: url, target: nil,
            fields: [
                ("Content-Type", Array("application/json".utf8)), ("TE", Array("trailers".utf8)),
                ("Host", Array("other".utf8)), ("Connection", Array("close".utf8)),
                ("Keep-Alive", Array("5".utf8)), ("X-Empty", []),
            ],
            body: .length(12), credential: [("Authorization", Array("DPoP t".utf8)), ("DPoP", Array("proof".utf8))])
        #expect(
            block.map { "\($0.nameText): \($0.valueText)" } == [
                ":method: POST", ":scheme: https", ":authority: api.test:8443", ":path: /v1/x?y",
                "content-type: application/json", "te: trailers", "x-empty: ", "content-length: 12",
                "authorization: DPoP t", "dpop: proof",
            ])
        let options = H2Semantics.originRequest(
            method: "OPTIONS", url: url, target: "*", fields: [("te", Array("gzip".utf8))], body: .none,
            credential: [])
        #expect(options.map(\.valueText) == ["OPTIONS", "https", "api.test:8443", "*"])
    }

    @Test func theResponseBlockIsReadByTheOneHeadParser() throws {
        let received = try H2Semantics.originResponseHead(
            [H2Field(":status", "204"), H2Field("x-a", "1"), H2Field("set-cookie", "a=b")], requestMethod: "GET",
            limits: HTTPHeadLimits()
        ).get()
        #expect(String(decoding: received.bytes, as: UTF8.self) == "HTTP/1.1 204 \r\nx-a: 1\r\nset-cookie: a=b\r\n\r\n")
        #expect(received.semantics?.framing == BodyFraming.none)
        for bad in [
            [H2Field(":status", "2000")], [H2Field(":status", "20x")], [H2Field("x", "1")],
            [H2Field(":status", "200"), H2Field(":path", "/")],
        ] {
            guard case .failure = H2Semantics.originResponseHead(bad, requestMethod: "GET", limits: HTTPHeadLimits())
            else {
                Issue.record("accepted \(bad)")
                continue
            }
        }
        let tight = HTTPHeadLimits(maxStartLine: 64, maxHeadBytes: 64, maxFields: 100)
        let huge = H2Semantics.originResponseHead(
            [H2Field(":status", "200"), H2Field("x", String(repeating: "a", count: 100))], requestMethod: "GET",
            limits: tight)
        guard case .failure(let error) = huge else {
            Issue.record("a head over the limit was accepted")
            return
        }
        #expect(error.code == .headTooLarge)
    }

    /// A trailer section is read by the head parser's rule for field lines: what is not a field line is dropped,
    /// and the section stops at the head's limits.
    @Test func aTrailerSectionIsReadAsFieldLines() {
        let fields = HTTPHeadParser.trailerFields(
            Array("grpc-status: 0\r\ngrpc-message:  \r\nbad line\r\n x-folded: 1\r\nx-sum:\tab \nname : v\r\n".utf8),
            limits: HTTPHeadLimits())
        #expect(fields == [H2Field("grpc-status", "0"), H2Field("grpc-message", ""), H2Field("x-sum", "ab")])
        let limited = HTTPHeadParser.trailerFields(
            Array("a: 1\r\nb: 2\r\nc: 3\r\n".utf8),
            limits: HTTPHeadLimits(maxStartLine: 100, maxHeadBytes: 100, maxFields: 2))
        #expect(limited == [H2Field("a", "1"), H2Field("b", "2")])
    }
}

/// The own client through the upstream proxy: a CONNECT tunnel to an https origin (RFC 9110 §9.3.6), read by
/// the one head parser; the proxy's refusals become its answers; an http origin gets the absolute form.
@Suite struct OriginExchangeProxyTests {
    static let proxy = UpstreamProxy(
        address: HostPort(host: "proxy.corp", port: 3128, kind: .name), username: "u", password: "p")

    static func make(scheme: String = "https", method: String = "GET") -> OriginExchange {
        OriginExchange(
            request: OriginExchange.Request(
                method: method,
                url: AbsoluteURL(
                    scheme: scheme, authority: HostPort(host: "api.test", port: 8443, kind: .name), pathAndQuery: "/a"),
                fields: [], credential: [("Authorization", Array("Bearer t".utf8))], proxy: Self.proxy),
            connectTimeout: 3000, idleTimeout: 9000)
    }

    static func feed(_ exchange: inout OriginExchange, _ text: String) -> ([String], Int) {
        var out: [OriginExchange.Action] = []
        let bytes = Array(text.utf8)
        let taken = bytes.withUnsafeBytes { exchange.received($0, &out) }
        return (OriginExchangeTests.render(out, bytes), taken)
    }

    @Test func anHTTPSOriginIsReachedThroughATunnelTheProxyOpens() {
        var exchange = Self.make()
        var out: [OriginExchange.Action] = []
        exchange.start(&out)
        out = []
        exchange.handle(.proxyConnected, &out)
        #expect(
            OriginExchangeTests.render(out) == [
                "write(CONNECT api.test:8443 HTTP/1.1\r\nHost: api.test:8443\r\nProxy-Authorization: Basic dTpw\r\n\r\n)"
            ])
        #expect(Self.feed(&exchange, "HTTP/1.1 200 Connection established\r\n") == ([], 37))
        #expect(Self.feed(&exchange, "\r\n") == (["startTLS"], 2))
        out = []
        exchange.handle(.connected(reused: false), &out)
        #expect(
            OriginExchangeTests.render(out) == [
                "write(GET /a HTTP/1.1\r\nHost: api.test:8443\r\nAuthorization: Bearer t\r\n\r\n)", "arm(9000)",
            ])
    }

    @Test(arguments: [
        (
            "HTTP/1.1 407 Proxy Authentication Required\r\n\r\n",
            "finish(proxyRefused(status: 407), the upstream proxy answered 407 to CONNECT)"
        ),
        (
            "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n",
            "finish(proxyRefused(status: 403), the upstream proxy answered 403 to CONNECT)"
        ),
        (
            "HTTP/1.1 200 OK\r\n\r\n\u{16}\u{3}",
            "finish(proxyMalformed, the upstream proxy sent bytes after its answer to CONNECT)"
        ),
    ])
    func aRefusalOrAMalformedAnswerEndsTheExchange(answer: String, finish: String) {
        var exchange = Self.make()
        var out: [OriginExchange.Action] = []
        exchange.start(&out)
        exchange.handle(.proxyConnected, &out)
        #expect(Self.feed(&exchange, answer).0 == ["release(reusable: false)", finish])
    }

    @Test func aProxyThatClosesOrStaysSilentIsNamed() {
        for (event, finish) in [
            (
                OriginExchange.Event.closed,
                "finish(proxyClosed, the upstream proxy closed the connection during CONNECT)"
            ),
            (.timerFired(idle: 3000), "finish(proxyTimeout, no answer to CONNECT within 3000 ms)"),
        ] {
            var exchange = Self.make()
            var out: [OriginExchange.Action] = []
            exchange.start(&out)
            exchange.handle(.proxyConnected, &out)
            out = []
            exchange.handle(event, &out)
            #expect(OriginExchangeTests.render(out) == ["release(reusable: false)", finish])
        }
    }

    @Test func anHTTPOriginGetsTheAbsoluteFormWithTheProxysCredentials() {
        var exchange = Self.make(scheme: "http")
        var out: [OriginExchange.Action] = []
        exchange.start(&out)
        out = []
        exchange.handle(.connected(reused: false), &out)
        #expect(
            OriginExchangeTests.render(out).first
                == "write(GET http://api.test:8443/a HTTP/1.1\r\nHost: api.test:8443\r\nProxy-Authorization: Basic dTpw\r\nAuthorization: Bearer t\r\n\r\n)"
        )
    }

    @Test func theProxysRefusalsAreTheFrontDoorsAnswers() {
        let hop = HostPort(host: "api.test", port: 443, kind: .name)
        #expect(
            UpstreamFailure.proxyRefused(status: 407).answer(hop: hop, proxy: Self.proxy, detail: "")
                == .upstreamProxyCredentials(Self.proxy.address, credentialsConfigured: true))
        #expect(
            UpstreamFailure.proxyRefused(status: 403).answer(hop: hop, proxy: Self.proxy, detail: "")
                == .upstreamProxyRefused(Self.proxy.address, status: 403))
        #expect(
            UpstreamFailure.proxyClosed.answer(hop: hop, proxy: Self.proxy, detail: "")
                == .upstreamProxyClosed(Self.proxy.address))
        #expect(
            UpstreamFailure.incomplete.answer(hop: hop, proxy: nil, detail: "x")
                == .upstreamFailed(.incomplete, hop: hop, detail: "x"))
    }
}
