import Testing

@testable import ProxyCore

/// Every sequence of a small alphabet of events over two streams up to a depth, and long random sequences
/// over three: the rules `H2Playbook` checks hold after every step, and once everything the streams wait
/// for has come (`finishEverything`), every exchange finished exactly once and every stream got a response,
/// a reset, or was closed by the client. Events come only when the driver could deliver them: client frames
/// while it reads, transfer callbacks while a transfer runs, token answers to a stream that asked. The fuzz
/// target `FuzzH2Session` goes deeper and wider at random.
@Suite struct H2SessionWalk {
    struct Event: Sendable {
        let name: String
        let applies: @Sendable (H2Playbook) -> Bool
        let run: @Sendable (inout H2Playbook) -> Void
    }

    /// The driver reads the client's frames.
    static func reading(_ p: H2Playbook) -> Bool { !p.closing && !p.gone }

    static func open(_ p: H2Playbook, _ stream: Int32) -> Bool {
        reading(p) && p.streams[stream].map { $0.closedByClient == nil && $0.reset == nil } == true
    }

    static func sending(_ p: H2Playbook, _ stream: Int32) -> Bool { p.streams[stream]?.transfer != nil }

    static let unauthorized = "HTTP/1.1 401 \r\nwww-authenticate: Bearer error=\"invalid_token\"\r\n\r\n"
    static let unauthenticated = "HTTP/1.1 200 \r\ncontent-type: application/grpc\r\ngrpc-status: 16\r\n\r\n"

    /// The events of one stream.
    static func events(_ stream: Int32) -> [Event] {
        [
            Event(
                name: "tokens\(stream)", applies: { $0.streams[stream]?.awaitingTokens == true },
                run: { $0.tokens(stream) }),
            Event(
                name: "refreshed\(stream)", applies: { $0.streams[stream]?.awaitingRefresh == true },
                run: { $0.refreshed(stream) }),
            Event(
                name: "ok\(stream)", applies: { sending($0, stream) },
                run: { $0.transferHead(stream, "HTTP/1.1 200 \r\ncontent-length: 2\r\n\r\n") }),
            Event(
                name: "401-\(stream)", applies: { sending($0, stream) },
                run: { $0.transferHead(stream, unauthorized) }),
            Event(
                name: "grpc16-\(stream)", applies: { sending($0, stream) },
                run: { $0.transferHead(stream, unauthenticated) }),
            Event(
                name: "body\(stream)", applies: { sending($0, stream) },
                run: { $0.event(.transferBody(stream, count: 2)) }),
            Event(
                name: "done\(stream)", applies: { sending($0, stream) },
                run: { $0.event(.transferFinished(stream, nil, detail: "")) }),
            Event(
                name: "failed\(stream)", applies: { sending($0, stream) },
                run: { $0.event(.transferFinished(stream, .incomplete, detail: "reset")) }),
            Event(
                name: "reset\(stream)", applies: { open($0, stream) },
                run: { $0.event(.streamClosed(stream, errorCode: H2ErrorCode.cancel.rawValue)) }),
            Event(
                name: "closed\(stream)",
                applies: { p in
                    open(p, stream) && p.streams[stream].map { $0.requestEnded && $0.responseEnded } == true
                }, run: { $0.event(.streamClosed(stream, errorCode: 0)) }),
        ]
    }

    static let connection: [Event] = [
        Event(
            name: "get1", applies: { reading($0) && $0.streams[1] == nil },
            run: { $0.request(1, H2Playbook.request("GET", "/a")) }),
        Event(
            name: "put3", applies: { reading($0) && $0.streams[3] == nil },
            run: { $0.request(3, H2Playbook.request("PUT", "/b"), endStream: false) }),
        Event(
            name: "data3", applies: { open($0, 3) && $0.streams[3]?.requestEnded == false },
            run: { $0.event(.requestData(3, count: 600, endStream: false)) }),
        Event(
            name: "end3", applies: { open($0, 3) && $0.streams[3]?.requestEnded == false },
            run: { $0.event(.requestData(3, count: 0, endStream: true)) }),
        Event(name: "shutdown", applies: { !$0.gone }, run: { $0.event(.shutdown) }),
        Event(name: "time", applies: { !$0.gone }, run: { $0.wait(15_000) }),
        Event(name: "gone", applies: { !$0.gone && !$0.closing }, run: { $0.event(.clientGone) }),
    ]

    static let alphabet = connection + events(1) + events(3)

    /// Walks every applicable sequence up to `depth` from `start`; returns the sequences walked and the first
    /// one that broke a rule.
    static func walk(_ start: H2Playbook, depth: Int, path: [String] = []) -> (count: Int, failure: String?) {
        var leaf = start
        leaf.finishEverything()
        if !leaf.violations.isEmpty {
            return (1, (path + ["finish"]).joined(separator: " ") + ": " + leaf.violations.joined(separator: "; "))
        }
        guard depth > 0 else { return (1, nil) }
        var count = 1
        for event in alphabet where event.applies(start) {
            var p = start
            event.run(&p)
            if !p.violations.isEmpty {
                return (
                    count, (path + [event.name]).joined(separator: " ") + ": " + p.violations.joined(separator: "; ")
                )
            }
            let (walked, failure) = walk(p, depth: depth - 1, path: path + [event.name])
            count += walked
            if let failure { return (count, failure) }
        }
        return (count, nil)
    }

    static func quiet(_ p: H2Playbook) -> H2Playbook {
        var quiet = p
        quiet.quiet = true
        return quiet
    }

    @Test func everySequenceFromAFreshConnectionKeepsTheRules() async {
        let (count, failure) = await offThePool { Self.walk(Self.quiet(H2Playbook()), depth: 6) }
        #expect(failure == nil)
        #expect(count > 50_000, "\(count) sequences")
    }

    @Test func everySequenceWithTwoStreamsInFlightKeepsTheRules() async {
        let (count, failure) = await offThePool {
            var p = Self.quiet(H2Playbook())
            p.request(1, H2Playbook.request("GET", "/a"))
            p.request(3, H2Playbook.request("PUT", "/b"), endStream: false)
            p.tokens(1)
            p.tokens(3)
            return Self.walk(p, depth: 4)
        }
        #expect(failure == nil)
        #expect(count > 50_000, "\(count) sequences")
    }

    @Test func aMisdirectedConnectionNeverAsksForATokenWhateverHappens() async {
        let (count, failure) = await offThePool {
            Self.walk(Self.quiet(H2Playbook(misdirected: H2SessionPlaybooks.misdirected)), depth: 6)
        }
        #expect(failure == nil)
        #expect(count > 100)
    }

    // MARK: - Random walks

    /// SplitMix64, seeded: the same sequences on every run.
    struct Random {
        var state: UInt64

        mutating func next() -> UInt64 {
            state &+= 0x9e37_79b9_7f4a_7c15
            var z = state
            z = (z ^ (z >> 30)) &* 0xbf58_476d_1ce4_e5b9
            z = (z ^ (z >> 27)) &* 0x94d0_49bb_1331_11eb
            return z ^ (z >> 31)
        }

        mutating func pick<T>(_ items: [T]) -> T { items[Int(next() % UInt64(items.count))] }
    }

    static let requests: [(fields: [H2Field], endStream: Bool)] = [
        (H2Playbook.request("GET", "/a", [("te", "trailers")]), true),
        (H2Playbook.request("HEAD", "/h"), true),
        (H2Playbook.request("POST", "/p", [("content-length", "40")]), false),
        (H2Playbook.request("POST", "/big", [("content-length", "5000")]), false),
        (H2Playbook.request("PUT", "/grpc", [("content-type", "application/grpc"), ("te", "trailers")]), false),
        (H2Playbook.request("GET", "/own", [("authorization", "Basic dTpw")]), true),
        (
            H2Playbook.fields([(":method", "GET"), (":scheme", "https"), (":authority", "other.test"), (":path", "/")]),
            true
        ),
        (H2Playbook.fields([(":method", "CONNECT"), (":authority", "api.test:443")]), false),
        (H2Playbook.fields([(":method", "GET"), (":scheme", "https"), (":authority", "api.test")]), true),
    ]

    static let heads: [String] = [
        "HTTP/1.1 200 \r\ncontent-length: 3\r\n\r\n",
        "HTTP/1.1 200 \r\n\r\n",
        "HTTP/1.1 204 \r\n\r\n",
        unauthorized,
        unauthenticated,
        "HTTP/1.1 200 \r\ncontent-type: application/grpc\r\ngrpc-status: 0\r\n\r\n",
        "HTTP/1.1 401 \r\nwww-authenticate: DPoP error=\"use_dpop_nonce\"\r\ndpop-nonce: n\r\n\r\n",
        "HTTP/1.1 401 \r\nwww-authenticate: Bearer error=\"insufficient_user_authentication\"\r\n\r\n",
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        "HTTP/1.1 200 \r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        "grpc-status: 0\r\nx-trailer: 1\r\n\r\n",
        "HTTP/1.1 401 \r\nwww-authenticate: Bearer\r\ncontent-length: 70000\r\n\r\n",
    ]

    /// One random step: any event the driver could deliver, unsolicited token answers and stray callbacks
    /// included (the session must ignore what does not fit).
    static func randomStep(_ p: inout H2Playbook, _ random: inout Random, nextStream: inout Int32) {
        let streams = Array(p.streams.keys).sorted()
        let stream = streams.isEmpty ? 1 : random.pick(streams)
        let log = p.streams[stream]
        let open = Self.open(p, stream)
        switch random.next() % 20 {
        case 0, 1:
            guard reading(p), nextStream < 40 else { return }
            let request = random.pick(requests)
            p.request(nextStream, request.fields, endStream: request.endStream)
            nextStream += 2
        case 2, 3:
            guard open, log?.requestEnded == false else { return }
            p.event(
                .requestData(stream, count: random.pick([0, 1, 40, 700, 3000]), endStream: random.next() % 3 == 0))
        case 4:
            guard open, log?.requestEnded == false else { return }
            p.event(.requestTrailers(stream, H2Playbook.fields([("x-sum", "1")])))
        case 5:
            guard open else { return }
            let closedOK = log.map { $0.requestEnded && $0.responseEnded } == true && random.next() % 2 == 0
            p.event(.streamClosed(stream, errorCode: closedOK ? 0 : random.pick([0, 1, 8])))
        case 6, 7:
            // The I/O layer answers a stream's `.getTokens` once, and nothing else gets tokens (ExchangeIO).
            guard !p.gone, log?.awaitingTokens == true else { return }
            if random.next() % 4 == 0 {
                p.event(
                    .tokens(
                        stream,
                        .failure(random.pick([.signInNeeded(reason: "x"), .pending(reason: "p", retryAfter: 2)]))))
            } else {
                p.tokens(stream, dpopNonce: random.next() % 3 == 0 ? "n" : nil)
            }
        case 8:
            guard !p.gone else { return }
            if random.next() % 4 == 0 {
                p.event(.refreshed(stream, .failure(.unavailable(reason: "down", retryAfter: nil))))
            } else {
                p.refreshed(stream)
            }
        case 9, 10, 11:
            guard log?.transfer != nil else { return }
            p.transferHead(stream, random.pick(heads))
        case 12, 13:
            guard log?.transfer != nil else { return }
            p.event(.transferBody(stream, count: random.pick([1, 3, 40_000])))
        case 14, 15:
            guard log?.transfer != nil else { return }
            p.event(.transferFinished(stream, random.next() % 3 == 0 ? .incomplete : nil, detail: "x"))
        case 16:
            if log?.transfer?.fresh == true {
                p.event(.credentialFailed(stream, .dpopKeyMissing(provider: "corp")))
            } else if open, log?.requestEnded == false {
                p.event(.bodyNotKept(stream, directory: "/spool"))
            }
        case 17:
            guard !p.gone else { return }
            p.wait(Int64(random.pick([1_000, 9_000, 12_000, 31_000])))
        case 18:
            guard !p.gone, random.next() % 4 == 0 else { return }
            p.event(.shutdown)
        default:
            guard !p.gone, random.next() % 8 == 0 else { return }
            p.event(.clientGone)
        }
    }

    @Test(arguments: [false, true])
    func randomSequencesKeepTheRules(replaceAuthorization: Bool) async {
        let (streamsSeen, failure) = await offThePool { () -> (Int, String?) in
            var origin = H2Playbook.origin
            origin.clientAuthorization = replaceAuthorization ? .replace : .keep
            var random = Random(state: replaceAuthorization ? 7 : 11)
            var streamsSeen = 0
            for sequence in 0..<1_500 {
                var p = Self.quiet(H2Playbook(origin: origin))
                var nextStream: Int32 = 1
                for _ in 0..<40 {
                    Self.randomStep(&p, &random, nextStream: &nextStream)
                    if !p.violations.isEmpty { break }
                }
                p.finishEverything()
                streamsSeen += p.streams.count
                if !p.violations.isEmpty { return (streamsSeen, "sequence \(sequence): \(p.violations)") }
            }
            return (streamsSeen, nil)
        }
        if let failure {
            Issue.record(Comment(rawValue: failure))
            return
        }
        #expect(streamsSeen > 2_500, "\(streamsSeen) streams")
    }
}
