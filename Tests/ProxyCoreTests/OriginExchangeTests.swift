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
            case .deliverTrailers(let bytes): "trailers(\(String(decoding: bytes, as: UTF8.self)))"
            case .release(let reusable): "release(reusable: \(reusable))"
            case .finish(let failure, let detail):
                failure.map { "finish(\($0), \(detail))" } ?? "finish(complete)"
            case .log(let line): "log(\(line))"
            }
        }
    }

    static func make(_ method: String = "GET") -> OriginExchange {
        OriginExchange(method: method, url: "https://api.test/a", head: head, connectTimeout: 3000, idleTimeout: 9000)
    }

    /// Starts an exchange and plays `steps`; returns the actions of each step (the start's first).
    static func play(_ steps: [Step], method: String = "GET") -> [[String]] {
        var exchange = make(method)
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
                "trailers(grpc-status: 0\r\n\r\n)", "release(reusable: true)", "finish(complete)",
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
    @Test(arguments: ["GET", "POST"]) func everySequenceKeepsTheInvariants(method: String) {
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
            #expect(valid, "\(sequence.map { "\(alphabet[$0])" })")
            if !valid { return }
        }
    }

    @Test func theOwnClientCarriesBodilessGetsAndHeadsStraightToTheOrigin() {
        func request(
            _ method: String, body: UpstreamRequest.Body = .none, target: String? = nil, proxy: Bool = false
        ) -> UpstreamRequest {
            UpstreamRequest(
                method: method, url: "https://api.test/a", requestTarget: target, fields: [], credential: nil,
                body: body, http2: true, connectTimeout: 1, idleTimeout: 1, caFile: nil, resolve: nil,
                upstreamProxy: proxy ? UpstreamProxy(address: HostPort(host: "p.test", port: 3128, kind: .name)) : nil,
                attempt: 1)
        }
        #expect(request("GET").fitsOwnClient(builtinClient: true))
        #expect(request("HEAD").fitsOwnClient(builtinClient: true))
        #expect(!request("GET").fitsOwnClient(builtinClient: false))
        #expect(!request("POST").fitsOwnClient(builtinClient: true))
        #expect(!request("DELETE").fitsOwnClient(builtinClient: true))
        #expect(!request("GET", body: .length(3)).fitsOwnClient(builtinClient: true))
        #expect(!request("GET", body: .streaming).fitsOwnClient(builtinClient: true))
        #expect(!request("OPTIONS", target: "*").fitsOwnClient(builtinClient: true))
        #expect(!request("GET", proxy: true).fitsOwnClient(builtinClient: true))
    }
}
