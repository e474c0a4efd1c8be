import Testing

@testable import ProxyCore

/// The upstream response reader as a playbook: bytes from the origin in (as one read or split anywhere), the
/// heads, body bytes, trailers and ends it reports out.
@Suite struct ResponseReaderTests {
    enum Event: Equatable, CustomStringConvertible {
        case head(String)
        case body(String)
        case trailers(String)
        case end(reusable: Bool)
        case failed(HTTPParseError.Code)
        case switched

        var description: String {
            switch self {
            case .head(let text): "head(\(text.debugDescription))"
            case .body(let text): "body(\(text.debugDescription))"
            case .trailers(let text): "trailers(\(text.debugDescription))"
            case .end(let reusable): "end(reusable: \(reusable))"
            case .failed(let code): "failed(\(code))"
            case .switched: "switched"
            }
        }
    }

    /// Feeds `reads` one after the other (then the origin's close, when asked), and returns the events, body
    /// bytes of consecutive reads merged, and the bytes left untaken in the last read.
    static func play(
        _ reads: [String], method: String = "GET", close: Bool = false, upgrade: Bool = false
    ) -> (
        events: [Event], untaken: Int
    ) {
        var reader = ResponseReader(requestMethod: method, upgradeRequested: upgrade)
        var events: [Event] = []
        var untaken = 0
        func add(_ event: Event) {
            if case .body(let more) = event, case .body(let text)? = events.last {
                events[events.count - 1] = .body(text + more)
            } else {
                events.append(event)
            }
        }
        for read in reads {
            let bytes = Array(read.utf8)
            var outputs: [ResponseReader.Output] = []
            let taken = bytes.withUnsafeBytes { reader.read($0, &outputs) }
            untaken = bytes.count - taken
            for output in outputs {
                switch output {
                case .head(let head): add(.head(String(decoding: head.bytes, as: UTF8.self)))
                case .body(let range): add(.body(String(decoding: bytes[range], as: UTF8.self)))
                case .trailers(let fields):
                    let lines = fields.map { "\($0.nameText): \(String(decoding: $0.value, as: UTF8.self))\r\n" }
                    add(.trailers(lines.joined()))
                case .end(let reusable): add(.end(reusable: reusable))
                case .failed(let error): add(.failed(error.code))
                case .switched: add(.switched)
                }
            }
        }
        if close {
            var outputs: [ResponseReader.Output] = []
            reader.closed(&outputs)
            for output in outputs {
                switch output {
                case .end(let reusable): add(.end(reusable: reusable))
                case .failed(let error): add(.failed(error.code))
                default: Issue.record("\(output) after the close")
                }
            }
        }
        return (events, untaken)
    }

    /// Every split of `text` into two reads gives the events one read gives.
    static func expectSplitInvariant(_ text: String, method: String = "GET", close: Bool = false) {
        let whole = play([text], method: method, close: close).events
        let bytes = Array(text.utf8)
        for cut in 1..<bytes.count {
            let first = String(decoding: bytes[..<cut], as: UTF8.self)
            let second = String(decoding: bytes[cut...], as: UTF8.self)
            #expect(play([first, second], method: method, close: close).events == whole, "cut at \(cut)")
        }
    }

    static let okHead = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n\r\n"

    @Test func contentLengthBodyThenTheConnectionIsReusable() {
        let (events, untaken) = Self.play([Self.okHead + "hello"])
        #expect(events == [.head(Self.okHead), .body("hello"), .end(reusable: true)])
        #expect(untaken == 0)
        Self.expectSplitInvariant(Self.okHead + "hello")
    }

    /// RFC 9110 §15.2.2: after a 101 to an upgrade request the connection speaks the new protocol; its first bytes
    /// (a WebSocket frame in the same read) are not the reader's.
    @Test func a101ToAnUpgradeEndsTheReadingAndLeavesTheNewProtocolsBytes() {
        let interim = "HTTP/1.1 100 Continue\r\n\r\n"
        let head = "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
        let frame = "\u{81}\u{05}hello"
        let (events, untaken) = Self.play([interim + head + frame], upgrade: true)
        #expect(events == [.head(interim), .head(head), .switched])
        #expect(untaken == frame.utf8.count)
        for cut in 1..<(interim + head).utf8.count {
            let bytes = Array((interim + head).utf8)
            let split = Self.play(
                [String(decoding: bytes[..<cut], as: UTF8.self), String(decoding: bytes[cut...], as: UTF8.self)],
                upgrade: true)
            #expect(split.events == events && split.untaken == 0, "cut at \(cut)")
        }
        // Not asked for: the response cannot be read (a tunnel nobody asked for is not opened).
        #expect(Self.play([head]).events == [.head(head), .failed(.malformed)])
    }

    @Test func bytesAfterTheResponseAreNotTaken() {
        let (events, untaken) = Self.play([Self.okHead + "helloHTTP/1.1 200 OK\r\n"])
        #expect(events == [.head(Self.okHead), .body("hello"), .end(reusable: true)])
        #expect(untaken == "HTTP/1.1 200 OK\r\n".utf8.count)
    }

    @Test func chunkedBodyIsDecodedAndItsTrailersReported() {
        let head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        let body = "5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\ngrpc-status: 0\r\nx-sum: 1\r\n\r\n"
        let (events, untaken) = Self.play([head + body])
        #expect(
            events == [
                .head(head), .body("hello world"), .trailers("grpc-status: 0\r\nx-sum: 1\r\n"), .end(reusable: true),
            ])
        #expect(untaken == 0)
        Self.expectSplitInvariant(head + body)
    }

    @Test func chunkedBodyWithoutTrailers() {
        let head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        #expect(
            Self.play([head + "3\r\nabc\r\n0\r\n\r\n"]).events == [.head(head), .body("abc"), .end(reusable: true)])
    }

    @Test func interimResponsesComeBeforeTheFinalOne() {
        let interim = "HTTP/1.1 100 Continue\r\n\r\n"
        let early = "HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
        let (events, _) = Self.play([interim + early + Self.okHead + "hello"])
        #expect(events == [.head(interim), .head(early), .head(Self.okHead), .body("hello"), .end(reusable: true)])
        Self.expectSplitInvariant(interim + early + Self.okHead + "hello")
    }

    @Test func noBodyForHeadRequestsOr204Or304() {
        #expect(Self.play([Self.okHead], method: "HEAD").events == [.head(Self.okHead), .end(reusable: true)])
        let noContent = "HTTP/1.1 204 No Content\r\n\r\n"
        #expect(Self.play([noContent]).events == [.head(noContent), .end(reusable: true)])
        let notModified = "HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n"
        #expect(Self.play([notModified]).events == [.head(notModified), .end(reusable: true)])
        let empty = "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        #expect(Self.play([empty]).events == [.head(empty), .end(reusable: true)])
    }

    @Test func aBodyWithoutLengthEndsWithTheConnection() {
        let head = "HTTP/1.1 200 OK\r\n\r\n"
        let (events, _) = Self.play([head + "all of ", "it"], close: true)
        #expect(events == [.head(head), .body("all of it"), .end(reusable: false)])
        Self.expectSplitInvariant(head + "streamed", close: true)
    }

    @Test func connectionCloseAndHTTP10MakeTheConnectionSingleUse() {
        let close = "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n"
        #expect(Self.play([close + "ok"]).events == [.head(close), .body("ok"), .end(reusable: false)])
        let old = "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n"
        #expect(Self.play([old + "ok"]).events == [.head(old), .body("ok"), .end(reusable: false)])
        let kept = "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n"
        #expect(Self.play([kept + "ok"]).events == [.head(kept), .body("ok"), .end(reusable: true)])
    }

    @Test func aCloseBeforeTheEndIsAFailure() {
        #expect(Self.play([], close: true).events == [.failed(.malformed)])
        #expect(Self.play(["HTTP/1.1 200"], close: true).events == [.failed(.malformed)])
        let (events, _) = Self.play([Self.okHead + "hel"], close: true)
        #expect(events == [.head(Self.okHead), .body("hel"), .failed(.malformed)])
        let chunked = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        #expect(
            Self.play([chunked + "5\r\nhel"], close: true).events == [
                .head(chunked), .body("hel"), .failed(.malformed),
            ])
    }

    /// The head is parsed once: its owner gets it with its semantics (nil when they do not hold, the failure
    /// following), so it need not parse it again.
    @Test func aHeadComesParsedWithItsSemantics() {
        var reader = ResponseReader(requestMethod: "GET")
        var out: [ResponseReader.Output] = []
        _ = Array((Self.okHead + "hello").utf8).withUnsafeBytes { reader.read($0, &out) }
        guard case .head(let received) = out.first else { return #expect(Bool(false), "\(out)") }
        #expect(received.head.status == 200 && received.bytes == Array(Self.okHead.utf8))
        #expect(received.semantics?.framing == .contentLength(5) && received.semantics?.serverCloses == false)

        var twoLengths = ResponseReader(requestMethod: "GET")
        out = []
        _ = Array("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n".utf8).withUnsafeBytes {
            twoLengths.read($0, &out)
        }
        guard case .head(let unusable) = out.first, case .failed = out.last else {
            return #expect(Bool(false), "\(out)")
        }
        #expect(unusable.semantics == nil)
    }

    @Test func unusableResponsesFailAndTakeNothingMore() {
        // Two lengths that disagree (RFC 9112 §6.3): the framing is ambiguous.
        let twoLengthsHead = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n"
        let (events, untaken) = Self.play([twoLengthsHead + "hello!"])
        #expect(events == [.head(twoLengthsHead), .failed(.badFraming)])
        #expect(untaken == "hello!".utf8.count)
        // A 101 to a request that asked for no upgrade.
        #expect(
            Self.play(["HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"]).events.last == .failed(.malformed))
        // A chunk size that is not hexadecimal.
        let chunked = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        #expect(Self.play([chunked + "zz\r\n"]).events == [.head(chunked), .failed(.badChunk)])
        // Not HTTP at all.
        #expect(Self.play(["SSH-2.0-OpenSSH_9.2\r\n"]).events.last == .failed(.malformed))
        // A head beyond the limits.
        var reader = ResponseReader(requestMethod: "GET", limits: HTTPHeadLimits(maxHeadBytes: 64))
        var outputs: [ResponseReader.Output] = []
        let big = Array(("HTTP/1.1 200 OK\r\nX-Long: " + String(repeating: "a", count: 100) + "\r\n\r\n").utf8)
        _ = big.withUnsafeBytes { reader.read($0, &outputs) }
        #expect(
            outputs.count == 1
                && { if case .failed(let error) = outputs[0] { error.code == .headTooLarge } else { false } }())
        #expect(reader.isFinished)
    }

    @Test func nothingIsReportedAfterTheEnd() {
        var reader = ResponseReader(requestMethod: "GET")
        var outputs: [ResponseReader.Output] = []
        let bytes = Array((Self.okHead + "hello").utf8)
        _ = bytes.withUnsafeBytes { reader.read($0, &outputs) }
        outputs.removeAll()
        let more = Array(Self.okHead.utf8)
        #expect(more.withUnsafeBytes { reader.read($0, &outputs) } == 0)
        reader.closed(&outputs)
        #expect(outputs.isEmpty)
    }
}

/// The request head the proxy's own HTTP/1.1 client writes.
@Suite struct UpstreamRequestHeadTests {
    @Test func hostFirstThenTheClientsFieldsInOrderThenTheCredential() throws {
        let head = try #require(
            UpstreamRequest.http1Head(
                method: "GET", url: "https://api.example.com/v1/items?page=2",
                fields: [("Accept", Array("application/json".utf8)), ("X-Trace", Array("a b".utf8))],
                credential: [("Authorization", Array("Bearer t0k3n".utf8))]))
        #expect(
            String(decoding: head, as: UTF8.self)
                == "GET /v1/items?page=2 HTTP/1.1\r\nHost: api.example.com\r\nAccept: application/json\r\n"
                + "X-Trace: a b\r\nAuthorization: Bearer t0k3n\r\n\r\n")
    }

    @Test func theHostFieldCarriesAPortThatIsNotTheDefault() throws {
        let head = try #require(
            UpstreamRequest.http1Head(method: "HEAD", url: "http://127.0.0.1:8080/", fields: [], credential: []))
        #expect(String(decoding: head, as: UTF8.self) == "HEAD / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n")
    }

    @Test func theBodysFramingFollowsTheClientsFieldsAndAsteriskFormIsKept() throws {
        let length = try #require(
            UpstreamRequest.http1Head(
                method: "POST", url: "https://api.test/orders", fields: [("Content-Type", Array("text/plain".utf8))],
                body: .length(5), credential: [("Authorization", Array("Bearer t".utf8))]))
        #expect(
            String(decoding: length, as: UTF8.self)
                == "POST /orders HTTP/1.1\r\nHost: api.test\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n"
                + "Authorization: Bearer t\r\n\r\n")
        let chunked = try #require(
            UpstreamRequest.http1Head(
                method: "PUT", url: "https://api.test/f", fields: [], body: .chunked, credential: []))
        #expect(
            String(decoding: chunked, as: UTF8.self)
                == "PUT /f HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n")
        let options = try #require(
            UpstreamRequest.http1Head(
                method: "OPTIONS", url: "https://api.test:8443/", target: "*", fields: [], credential: []))
        #expect(String(decoding: options, as: UTF8.self) == "OPTIONS * HTTP/1.1\r\nHost: api.test:8443\r\n\r\n")
    }

    @Test func anEmptyPostPutOrPatchSaysContentLengthZero() throws {
        // A client's Content-Length: 0 is framing the machine reads as no body; the origin still gets it.
        for method in ["POST", "PUT", "PATCH"] {
            let head = try #require(
                UpstreamRequest.http1Head(method: method, url: "https://api.test/x", fields: [], credential: []))
            #expect(
                String(decoding: head, as: UTF8.self)
                    == "\(method) /x HTTP/1.1\r\nHost: api.test\r\nContent-Length: 0\r\n\r\n")
        }
        for method in ["GET", "HEAD", "DELETE", "OPTIONS"] {
            let head = try #require(
                UpstreamRequest.http1Head(method: method, url: "https://api.test/x", fields: [], credential: []))
            #expect(!String(decoding: head, as: UTF8.self).contains("Content-Length"), "\(method)")
        }
    }

    @Test func aURLThatDoesNotParseGivesNoHead() {
        #expect(UpstreamRequest.http1Head(method: "GET", url: "not a url", fields: [], credential: []) == nil)
    }
}
