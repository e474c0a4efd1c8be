import Foundation
import ProxyCore

/// FUZZ_DEBUG=1 prints every event and its actions (to replay a reproducer by eye).
private let debugging = ProcessInfo.processInfo.environment["FUZZ_DEBUG"] != nil

/// Drives `H2Session` with an event sequence read from the input (one configuration byte, then opcodes: the
/// high nibble is the event, the low nibble its parameters, a following byte picks the stream, and a
/// length-prefixed chunk carries a header block or header lines), delivering events only when `H2Driver`
/// could: client frames while it reads (nghttp2's guarantees: names in lower case, no CR or NUL in values,
/// stream ids rising, nothing on a stream after its end), transfer callbacks while a transfer runs, a
/// credential failure only before a transfer delivered anything. Token answers may come unasked.
///
/// Invariants, after every action:
/// - every action names a stream the client opened; one response per stream (a head or the proxy's own
///   answer), never on a stream the client closed; body and end only after a head that announced a body;
///   `writeBody` only inside that stream's transfer callback; an answer's content-length is its body's;
/// - response heads and trailers carry no pseudo-field but `:status`, no upper case, no connection-specific
///   field; trailers none a trailer must not carry;
/// - a stream is accepted (gets an exchange) only when its request is a GET-like request for the tunnel's
///   origin: not misdirected, no GOAWAY sent before it, :scheme https, an origin-form :path (or OPTIONS *),
///   :authority and every host field naming api.test:443, no CONNECT, no unknown pseudo-field; otherwise it
///   is answered (400, 421 or 501; counted) or refused (REFUSED_STREAM after GOAWAY) at once;
/// - what goes upstream is exactly the client's regular fields in order, minus host, content-length,
///   expect, the connection-specific ones and (when the token is attached) authorization, with `te` as
///   `te: trailers`; to the origin's URL only; with a generation the stream was given; one transfer at a
///   time; never a body that was not kept sent a second time;
/// - an exchange finishes once, its transfer stopped, its record naming the status the client got, cut
///   short only after a head, and complete otherwise when a head went out; no response only when the client
///   closed the stream or went away;
/// - the session's streams in flight are the driver's; the keep-alive timer runs exactly when none is in
///   flight and the idle timer exactly when some are; `closeAfterFlush` only with none in flight; after it
///   nothing but GOAWAY, timers and logs; after `clientGone` nothing but logs and records.
///
/// At the end, everything the streams wait for is answered until nothing changes; then every exchange has
/// finished and every stream got a response, a reset, or was closed by the client (liveness).
public func fuzzH2Session(_ data: UnsafeBufferPointer<UInt8>) {
    let input = Array(data)
    guard let first = input.first else { return }
    var harness = H2Harness(config: first)
    var reader = ByteReader(input.dropFirst())
    var steps = 0
    while let opcode = reader.byte(), steps < 96 {
        steps += 1
        harness.step(opcode, &reader)
    }
    harness.finishEverything()
}

private let tunnelOrigin: OriginConfig = {
    var origin = OriginConfig(scheme: "https", authority: HostPort(host: "api.test", port: 443, kind: .name))
    origin.provider = "corp"
    return origin
}()

/// Connection-specific fields (RFC 9113 §8.2.2) and the proxy's credentials: never sent upstream, never
/// sent to an HTTP/2 client.
private let connectionSpecific: Set<[UInt8]> = Set(
    ["connection", "proxy-connection", "keep-alive", "te", "upgrade", "proxy-authorization", "transfer-encoding"]
        .map(bytes))
private let notUpstream: Set<[UInt8]> = connectionSpecific.union(["host", "content-length", "expect"].map(bytes))
/// Fields a trailer section must not carry (framing, routing, the hop-by-hop ones).
private let notTrailers: Set<[UInt8]> = connectionSpecific.union(
    ["content-length", "host", "trailer"].map(bytes))
private let knownPseudo: Set<[UInt8]> = Set([":method", ":scheme", ":authority", ":path", ":protocol"].map(bytes))

private func pairs(_ list: [(String, String)]) -> [H2Field] { list.map { H2Field($0.0, $0.1) } }

private func get(_ path: String, _ extra: [(String, String)] = [], method: String = "GET") -> [H2Field] {
    pairs([(":method", method), (":scheme", "https"), (":authority", "api.test"), (":path", path)] + extra)
}

/// Request header blocks one opcode can open a stream with (and whether END_STREAM comes with them).
private let requestTemplates: [(fields: [H2Field], endStream: Bool)] = [
    (get("/a?q=1", [("accept", "*/*"), ("te", "trailers"), ("user-agent", "curl/8")]), true),
    (get("/h", method: "HEAD"), true),
    (get("/p", [("content-type", "application/json"), ("content-length", "40")], method: "POST"), false),
    (get("/big", [("content-length", "100000")], method: "POST"), false),
    (get("/pkg.S/M", [("content-type", "application/grpc"), ("te", "trailers")], method: "POST"), false),
    (get("/own", [("authorization", "Basic dTpw"), ("host", "api.test:443")]), true),
    (pairs([(":method", "GET"), (":scheme", "https"), (":authority", "other.test"), (":path", "/")]), true),
    (pairs([(":method", "CONNECT"), (":authority", "api.test:443")]), false),
    (pairs([(":method", "GET"), (":scheme", "https"), (":authority", "api.test")]), true),
    (pairs([(":method", "OPTIONS"), (":scheme", "https"), (":authority", "API.test."), (":path", "*")]), true),
    (pairs([(":method", "GET"), (":scheme", "https"), (":path", "/only-host"), ("host", "api.test")]), true),
    (pairs([(":method", "GET"), (":scheme", "http"), (":authority", "api.test"), (":path", "/")]), true),
    (
        pairs([
            (":method", "CONNECT"), (":protocol", "websocket"), (":scheme", "https"), (":authority", "api.test"),
            (":path", "/ws"),
        ]), false
    ),
    (get("/empty", [("content-length", "0")], method: "PUT"), false),
    (get("/x", [("expect", "100-continue"), ("content-length", "3"), ("connection", "x")], method: "POST"), false),
    (get("/x", [("host", "evil.test")]), true),
]

/// What the HTTP/1.1 side of a WebSocket stream may answer (in pieces, across reads).
private let tunnelTemplates: [String] = [
    "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: x\r\n\r\n\u{81}\u{02}hi",
    "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer\r\nContent-Length: 5\r\n\r\nnope!",
    "HTTP/1.1 100 Continue\r\n\r\n",
    "HTTP/1.1 200 OK\r\n\r\nuntil close",
    "HTTP/1.1 204 No Content\r\n\r\n",
    "HTTP/1.1 403 Forbidden\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n",
    "HTTP/1.1 ",
    "\u{0}garbage\r\n\r\n",
    "frame bytes",
]

private let trailerTemplates: [[H2Field]] = [
    pairs([("x-checksum", "abc")]), pairs([("grpc-status", "0"), ("grpc-message", "ok")]),
    pairs([("host", "evil.test")]), pairs([("content-length", "9")]),
]

/// Response heads as an origin sends them (the own client reads them with `ResponseReader`), and a trailer
/// section's field lines.
private let headTemplates: [String] = [
    "HTTP/1.1 200 \r\ncontent-type: text/plain\r\ncontent-length: 3\r\n\r\n",
    "HTTP/1.1 200 \r\n\r\n",
    "HTTP/1.1 204 \r\n\r\n",
    "HTTP/1.1 304 \r\netag: \"x\"\r\n\r\n",
    "HTTP/1.1 401 \r\nwww-authenticate: Bearer error=\"invalid_token\"\r\n\r\n",
    "HTTP/1.1 200 \r\ncontent-type: application/grpc\r\ngrpc-status: 16\r\ngrpc-message: expired\r\n\r\n",
    "HTTP/1.1 200 \r\ncontent-type: application/grpc\r\ngrpc-status: 0\r\n\r\n",
    "HTTP/1.1 401 \r\nwww-authenticate: DPoP error=\"use_dpop_nonce\"\r\ndpop-nonce: n-1\r\n\r\n",
    "HTTP/1.1 401 \r\nwww-authenticate: Bearer error=\"insufficient_user_authentication\", max_age=5\r\n\r\n",
    "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close, x-a\r\nX-A: 1\r\n\r\n",
    "HTTP/1.1 200 \r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
    "grpc-status: 0\r\nX-Trailer: 1\r\nContent-Length: 5\r\n",
    "HTTP/1.1 401 \r\nwww-authenticate: Bearer\r\ncontent-length: 70000\r\n\r\n",
    "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nKeep-Alive: timeout=5\r\nTrailer: x\r\n\r\n",
    "HTTP/1.1 503 \r\nretry-after: 1\r\n\r\n",
    "HTTP/1.1 401 \r\nwww-authenticate: Bearer resource_metadata=\"https://api.test/.well-known/oauth-protected-resource\"\r\ncontent-length: 2\r\n\r\n",
    "HTTP/1.1 403 \r\nwww-authenticate: Bearer error=\"insufficient_scope\", scope=\"admin\"\r\n\r\n",
]

private let verdicts: [ResourceMetadataVerdict] = [
    .consistent, .otherServers(["https://login.other.test"]), .unknown("unreachable"),
]

private let failures: [UpstreamFailure] = [
    .dns, .connect, .timeout, .certificate, .tls, .incomplete, .proxy, .headTooLarge, .other,
]

private let tokenFailures: [TokenFailure] = [
    .signInNeeded(reason: "not signed in"), .unavailable(reason: "down", retryAfter: 3),
    .unavailable(reason: "down", retryAfter: nil), .pending(reason: "refreshing", retryAfter: 2),
    .storage(reason: "disk full"), .configuration(reason: "no client_id"),
]

private let resetCodes: [UInt32] = [0, 8, 1, 2, 5, 7, 0xb, 0xffff_ffff]

struct H2Harness {
    typealias Stream = H2Session.Stream
    typealias Action = H2Session.Action

    struct StreamLog {
        let fields: [H2Field]
        let headRequest: Bool
        var requestEnded: Bool
        /// A GOAWAY had been sent when the stream opened.
        let afterGoaway: Bool
        var closedByClient = false
        var status: Int?
        var answered = false
        var submitted = false
        var responseEnded = false
        var reset = false
        var inExchange = false
        /// A WebSocket stream (RFC 8441) whose HTTP/1.1 side is open.
        var tunnel = false
        var finished = false
        var transferRunning = false
        var transferFresh = false
        /// The request the stream's exchange last sent (what the own client's reader reads the answer for).
        var lastSent: UpstreamRequest?
        var awaitingTokens = false
        var awaitingRefresh = false
        var awaitingMetadata = false
        var grants: Set<Int64> = []
        var bodyStreamed = false
        var sends = 0
    }

    let misdirected: Bool
    let attachAlways: Bool
    var session: H2Session
    var now: Int64 = 1_000
    var lastActivity: Int64 = 1_000
    var timers: [ConnectionTimer: Int64] = [:]
    var streams: [Stream: StreamLog] = [:]
    var nextStream: Stream = 1
    var goaway = false
    var closing = false
    var gone = false
    var generation: Int64 = 0
    var outcomes = 0
    /// Actions so far (timers and logs aside): what `finishEverything` watches for progress.
    var progress = 0
    private var callback: Stream?
    private var current: H2Session.Event?

    init(config: UInt8) {
        misdirected = config & 1 != 0
        attachAlways = config & 2 != 0
        var origin = tunnelOrigin
        origin.clientAuthorization = attachAlways ? .replace : .keep
        var settings = ProxySettings()
        settings.keepAliveTimeout = 10_000
        settings.idleTimeout = 30_000
        settings.replayMemory = config & 4 != 0 ? 16 : 256
        settings.replaySpool = config & 4 != 0 ? 64 : 1_024
        session = H2Session(
            origin: origin,
            frontDoor: FrontDoor(
                settings: settings, credentials: nil,
                boundAddress: ListenAddress(host: "127.0.0.1", port: 8080, isIPv6: false),
                origins: OriginTable([origin])),
            misdirected: misdirected ? "the TLS server name evil.test does not match the tunnel's api.test" : nil)
        var actions: [Action] = []
        session.start(now: now, &actions)
        apply(actions)
    }

    var reading: Bool { !closing && !gone }

    /// A stream the client may still send frames on.
    func open(_ stream: Stream) -> Bool {
        reading && streams[stream].map { !$0.closedByClient && !$0.reset } == true
    }

    /// The stream a byte picks among the opened ones.
    func pick(_ byte: UInt8?) -> Stream? {
        guard !streams.isEmpty else { return nil }
        let all = streams.keys.sorted()
        return all[Int(byte ?? 0) % all.count]
    }

    // MARK: - Decoding

    mutating func step(_ opcode: UInt8, _ reader: inout ByteReader) {
        let low = opcode & 0x0F
        switch opcode >> 4 {
        case 0:
            let template = requestTemplates[Int(reader.byte() ?? 0) % requestTemplates.count]
            openStream(template.fields, endStream: low & 1 == 0 ? template.endStream : !template.endStream)
        case 1:
            var fields: [H2Field] = []
            if low & 4 != 0 {
                fields = pairs([
                    (":method", low & 8 != 0 ? "POST" : "GET"), (":scheme", "https"), (":authority", "api.test"),
                    (":path", "/f"),
                ])
            }
            openStream(fields + headerBlock(reader.chunk()), endStream: low & 1 != 0)
        case 2:
            guard let stream = pick(reader.byte()), open(stream), streams[stream]?.requestEnded == false else { return }
            let count = Int(reader.byte() ?? 0) * [1, 16, 256, 4_096][Int(low >> 1) & 3]
            event(.requestData(stream, count: count, endStream: low & 1 != 0))
        case 3:
            guard let stream = pick(reader.byte()), open(stream), streams[stream]?.requestEnded == false else { return }
            let fields =
                low & 8 != 0
                ? headerBlock(reader.chunk()).filter { $0.name.first != UInt8(ascii: ":") }
                : trailerTemplates[Int(low) % trailerTemplates.count]
            event(.requestTrailers(stream, fields))
        case 4:
            guard let stream = pick(reader.byte()), open(stream) else { return }
            event(.streamClosed(stream, errorCode: resetCodes[Int(low) % resetCodes.count]))
        case 5, 6:
            guard !gone, let stream = pick(reader.byte()) else { return }
            let result: Result<TokenGrant, TokenFailure>
            if low < 10 {
                generation += 1
                result = .success(TokenGrant(generation: generation, dpopNonce: low & 1 != 0 ? "n-\(low)" : nil))
            } else {
                result = .failure(tokenFailures[Int(low - 10) % tokenFailures.count])
            }
            // The I/O layer answers a stream's `.getTokens` once, and nothing else gets tokens.
            if opcode >> 4 == 5 {
                guard streams[stream]?.awaitingTokens == true else { return }
                event(.tokens(stream, result))
            } else {
                event(.refreshed(stream, result))
            }
        case 7:
            guard let stream = pick(reader.byte()), let log = streams[stream] else { return }
            if low & 1 != 0 {
                // Instead of starting the transfer: no DPoP key, or no proof.
                guard log.transferFresh else { return }
                event(
                    .credentialFailed(
                        stream, low & 2 != 0 ? .dpopKeyMissing(provider: "corp") : .dpopProofFailed(reason: "sign")))
            } else {
                guard open(stream), !log.requestEnded else { return }
                event(low & 2 != 0 ? .bodyBeyondBudget(stream) : .bodyNotKept(stream, directory: "/spool"))
            }
        case 8:
            guard let stream = pick(reader.byte()), streams[stream]?.transferRunning == true else { return }
            transferLines(stream, Array(headTemplates[Int(low) % headTemplates.count].utf8))
        case 9:
            guard let stream = pick(reader.byte()), streams[stream]?.transferRunning == true else { return }
            transferLines(stream, reader.chunk())
        case 10:
            guard let stream = pick(reader.byte()), streams[stream]?.transferRunning == true else { return }
            event(.transferBody(stream, count: (Int(reader.byte() ?? 0) + 1) * [1, 64, 1_024, 65_536][Int(low) & 3]))
        case 11:
            guard let stream = pick(reader.byte()), streams[stream]?.transferRunning == true else { return }
            event(.transferFinished(stream, low == 0 ? nil : failures[Int(low - 1) % failures.count], detail: "d"))
        case 12:
            wait(Int64(low) * 2_500)
        case 13:
            guard !gone else { return }
            event(.shutdown)
        case 14:
            guard !gone else { return }
            switch low {
            case 0xE: event(.clientGone)
            case 0xB:
                // The answer to a metadata check, asked for or not (a late one is ignored).
                guard let stream = pick(reader.byte()) else { return }
                event(.resourceMetadata(stream, verdicts[Int(reader.byte() ?? 0) % verdicts.count]))
            case 0xC, 0xD:
                guard let stream = pick(reader.byte()), streams[stream]?.tunnel == true else { return }
                if low == 0xD {
                    event(.tunnelEnded(stream))
                } else {
                    tunnelAnswer(stream, Array(tunnelTemplates[Int(reader.byte() ?? 0) % tunnelTemplates.count].utf8))
                }
            default: wait(Int64(low) * 100)
            }
        default:
            // A whole response in one opcode: head, body, end.
            guard let stream = pick(reader.byte()), streams[stream]?.transferRunning == true else { return }
            transferLines(stream, Array(headTemplates[Int(low) % headTemplates.count].utf8))
            if streams[stream]?.transferRunning == true { event(.transferBody(stream, count: 3)) }
            if streams[stream]?.transferRunning == true { event(.transferFinished(stream, nil, detail: "")) }
        }
    }

    /// Header lines `name:value` separated by LF, as nghttp2 would hand them over: names in lower case
    /// (upper case is a stream error there), no CR or NUL in values (likewise), regular fields with names
    /// that are not tokens dropped (nghttp2 ignores them).
    func headerBlock(_ chunk: [UInt8]) -> [H2Field] {
        var fields: [H2Field] = []
        for line in chunk.split(separator: 0x0A, omittingEmptySubsequences: true) {
            let colon = line.dropFirst().firstIndex(of: UInt8(ascii: ":")) ?? line.endIndex
            let name = asciiLowercased(line[line.startIndex..<colon])
            let value = colon < line.endIndex ? line[(colon + 1)...].filter { $0 != 0x0D && $0 != 0x00 } : []
            let regular = name.first == UInt8(ascii: ":") ? name.dropFirst() : name[...]
            guard !regular.isEmpty, regular.allSatisfy(isTokenByte) else { continue }
            fields.append(H2Field(name, Array(value)))
        }
        return fields
    }

    private func isTokenByte(_ byte: UInt8) -> Bool {
        switch byte {
        case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "0")...UInt8(ascii: "9"): true
        default: Array("!#$%&'*+-.^_`|~".utf8).contains(byte)
        }
    }

    // MARK: - Events

    mutating func openStream(_ fields: [H2Field], endStream: Bool) {
        guard reading, nextStream < 200 else { return }
        // nghttp2 resets a stream whose header block repeats a pseudo-field; the session never hears of it.
        let pseudo = fields.map(\.name).filter { $0.first == UInt8(ascii: ":") }
        guard Set(pseudo).count == pseudo.count else { return }
        let stream = nextStream
        nextStream += 2
        let method = fields.first { $0.name == bytes(":method") }?.valueText
        streams[stream] = StreamLog(
            fields: fields, headRequest: method == "HEAD", requestEnded: endStream, afterGoaway: goaway)
        let outcomesBefore = outcomes
        event(.requestHeaders(stream, fields, endStream: endStream))
        guard let log = streams[stream] else { return }
        invariant(
            log.inExchange || log.tunnel || log.answered || log.reset, "stream \(stream): neither accepted nor refused")
        if log.inExchange || log.tunnel { checkAccepted(stream, log) }
        if !log.inExchange && log.answered {
            invariant(outcomes == outcomesBefore + 1, "stream \(stream): a refusal not counted")
            // 403: a web page of another origin made the request (W3C Fetch Metadata, `browser_requests`), or a
            // credential field the origin's rules refuse (a placeholder of another origin, `client_credential`).
            let browserOrCredential = log.fields.contains { field in
                ["origin", "referer", "sec-fetch-site", "authorization"].contains(where: { bytes($0) == field.name })
                    || field.valueText.contains("proxyctl-placeholder-")
            }
            invariant(
                [400, 421, 501].contains(log.status ?? 0) || (log.status == 403 && browserOrCredential),
                "stream \(stream): refused with \(log.status ?? 0)")
            invariant(!misdirected || log.status == 421, "stream \(stream): misdirected but \(log.status ?? 0)")
        }
        if log.reset {
            invariant(log.afterGoaway && !misdirected, "stream \(stream): refused without a GOAWAY")
        }
    }

    /// An accepted request names the tunnel's origin and nothing else.
    func checkAccepted(_ stream: Stream, _ log: StreamLog) {
        invariant(!misdirected && !log.afterGoaway, "stream \(stream): accepted on a misdirected or closing connection")
        func values(_ name: String) -> [String] { log.fields.filter { $0.name == bytes(name) }.map(\.valueText) }
        let method = values(":method").last
        let webSocket = method == "CONNECT" && values(":protocol").last == "websocket"
        invariant(log.tunnel == webSocket, "stream \(stream): accepted \(method ?? "no method") tunnel=\(log.tunnel)")
        invariant(method != nil && (method != "CONNECT" || webSocket), "stream \(stream): accepted \(method ?? "-")")
        invariant(values(":scheme").last == "https", "stream \(stream): accepted scheme \(values(":scheme"))")
        let path = values(":path").last ?? ""
        invariant(path.hasPrefix("/") || (path == "*" && method == "OPTIONS"), "stream \(stream): accepted \(path)")
        for field in log.fields where field.name.first == UInt8(ascii: ":") {
            invariant(knownPseudo.contains(field.name), "stream \(stream): accepted with \(field.nameText)")
        }
        let authorities = values(":authority").suffix(1) + values("host")
        invariant(!authorities.isEmpty, "stream \(stream): accepted without an authority")
        for authority in authorities {
            let parsed = try? HostPort.parse(authority[...], defaultPort: 443).get()
            invariant(parsed == tunnelOrigin.authority, "stream \(stream): accepted for \(authority)")
        }
    }

    /// What the origin gets: the client's regular fields in order, minus the ones that never travel.
    func expectedUpstream(_ log: StreamLog) -> [(name: String, value: [UInt8])] {
        let regular = log.fields.filter { $0.name.first != UInt8(ascii: ":") }
        let attach = attachAlways || !regular.contains { $0.name == bytes("authorization") }
        var upstream: [(name: String, value: [UInt8])] = []
        for field in regular {
            if field.name == bytes("te") {
                upstream.append(("te", bytes("trailers")))
            } else if !notUpstream.contains(field.name) && !(attach && field.name == bytes("authorization")) {
                upstream.append((field.nameText, field.value))
            }
        }
        return upstream
    }

    mutating func event(_ event: H2Session.Event) {
        switch event {
        case .requestData(let stream, _, let endStream):
            if endStream { streams[stream]?.requestEnded = true }
            lastActivity = now
        case .requestTrailers(let stream, _):
            streams[stream]?.requestEnded = true
            lastActivity = now
        case .streamClosed(let stream, _):
            streams[stream]?.closedByClient = true
            lastActivity = now
        case .tokens(let stream, let result):
            streams[stream]?.awaitingTokens = false
            if case .success(let grant) = result { streams[stream]?.grants.insert(grant.generation) }
        case .refreshed(let stream, let result):
            streams[stream]?.awaitingRefresh = false
            if case .success(let grant) = result { streams[stream]?.grants.insert(grant.generation) }
        case .credentialFailed(let stream, _):
            streams[stream]?.transferRunning = false
            streams[stream]?.transferFresh = false
        case .resourceMetadata(let stream, _):
            streams[stream]?.awaitingMetadata = false
        case .transferBody(let stream, _):
            streams[stream]?.transferFresh = false
            callback = stream
            lastActivity = now
        case .transferFinished(let stream, _, _):
            streams[stream]?.transferRunning = false
            streams[stream]?.transferFresh = false
            lastActivity = now
        case .requestHeaders:
            lastActivity = now
        case .bodyNotKept, .bodyBeyondBudget, .timerFired, .shutdown, .clientGone, .tunnelEnded, .requestHeadTooLarge:
            break
        }
        current = event
        var actions: [Action] = []
        session.handle(event, now: now, &actions)
        if debugging { FileHandle.standardError.write(Data("\(event)\n  -> \(actions)\n".utf8)) }
        if case .requestTrailers(let stream, let fields) = event, streams[stream]?.inExchange == true {
            invariant(actions.first == .requestTrailers(stream, fields), "trailers not passed on: \(actions)")
        }
        apply(actions)
        callback = nil
        current = nil
        if case .clientGone = event { gone = true }
        afterEvent()
    }

    /// Bytes from the HTTP/1.1 side of a WebSocket stream, as the driver hands them over: what the session
    /// did not consume stays for the next read.
    mutating func tunnelAnswer(_ stream: Stream, _ bytes: [UInt8]) {
        lastActivity = now
        var actions: [Action] = []
        session.tunnelData(stream, bytes, now: now, &actions)
        if debugging { FileHandle.standardError.write(Data("tunnel \(bytes)\n  -> \(actions)\n".utf8)) }
        var taken = 0
        for action in actions {
            switch action {
            case .consumeTunnel(_, let count), .tunnelToStream(_, let count): taken += count
            default: break
            }
        }
        invariant(taken <= bytes.count, "tunnel: \(taken) of \(bytes.count) bytes taken")
        apply(actions)
        afterEvent()
    }

    /// A transfer's response heads as the own client hands them over (`ResponseReader` for the stream's last
    /// request; a head it cannot read ends the transfer with the failure), or, when `bytes` has no status line,
    /// trailer fields (`HTTPHeadParser.trailerFields`).
    mutating func transferLines(_ stream: Stream, _ bytes: [UInt8]) {
        streams[stream]?.transferFresh = false
        lastActivity = now
        guard bytes.starts(with: Array("HTTP/".utf8)) else {
            var actions: [Action] = []
            session.transferTrailers(
                stream, HTTPHeadParser.trailerFields(bytes, limits: HTTPHeadLimits()), now: now, &actions)
            apply(actions)
            afterEvent()
            return
        }
        let sent = streams[stream]?.lastSent
        var reader = ResponseReader(
            requestMethod: sent?.method ?? "GET", limits: sent?.responseHeadLimits ?? HTTPHeadLimits())
        var outputs: [ResponseReader.Output] = []
        _ = bytes.withUnsafeBytes { reader.read($0, &outputs) }
        for output in outputs {
            guard streams[stream]?.transferRunning == true else { return }
            var actions: [Action] = []
            switch output {
            case .head(let received):
                session.transferResponseHead(stream, received, now: now, &actions)
            case .failed(let error):
                event(.transferFinished(stream, OriginExchange.failure(error), detail: "\(error)"))
                return
            default:
                continue
            }
            if debugging { FileHandle.standardError.write(Data("\(output)\n  -> \(actions)\n".utf8)) }
            apply(actions)
            afterEvent()
        }
    }

    /// Advances the clock and fires the timers that are due, in deadline order.
    mutating func wait(_ milliseconds: Int64) {
        guard !gone else { return }
        let until = now + milliseconds
        while !gone, let (timer, deadline) = timers.filter({ $0.value <= until }).min(by: { $0.value < $1.value }) {
            now = deadline
            timers.removeValue(forKey: timer)
            event(.timerFired(timer, lastActivity: lastActivity))
        }
        now = until
    }

    // MARK: - Actions

    mutating func apply(_ actions: [Action]) {
        for action in actions { apply(action) }
    }

    private mutating func apply(_ action: Action) {
        if gone {
            switch action {
            case .log, .exchangeFinished, .requestFinished, .auditRefusal: break
            default: invariant(false, "\(action) after the client went away")
            }
        }
        if closing {
            switch action {
            case .log, .goaway, .closeAfterFlush, .arm, .disarm: break
            default: invariant(false, "\(action) after closeAfterFlush")
            }
        }
        switch action {
        case .log, .arm, .disarm: break
        default: progress += 1
        }
        switch action {
        case .log:
            break
        case .arm(let timer, let milliseconds):
            invariant(milliseconds > 0, "\(timer) armed for \(milliseconds) ms")
            timers[timer] = now + Int64(milliseconds)
        case .disarm(let timer):
            timers.removeValue(forKey: timer)
        case .requestFinished(let outcome):
            invariant(outcome.kind == .intercepted && outcome.proxyError != nil, "counted \(outcome)")
            outcomes += 1
        case .auditRefusal(let use):
            invariant(use.refusal.origin != use.origin, "a placeholder refused at its own origin: \(use)")
        case .goaway(let code):
            invariant(code == .noError, "GOAWAY \(code)")
            goaway = true
        case .closeAfterFlush:
            closing = true
        case .submitResponse(let stream, let fields, let endStream):
            var log = opened(stream, action)
            responseHead(&log, fields, action)
            invariant(log.inExchange || log.tunnel, "\(action): a response head from no exchange or tunnel")
            log.submitted = true
            if endStream { log.responseEnded = true }
            streams[stream] = log
        case .respond(let stream, let fields, let body):
            var log = opened(stream, action)
            responseHead(&log, fields, action)
            log.answered = true
            log.responseEnded = true
            let length = fields.first { $0.name == bytes("content-length") }?.valueText
            invariant(body.isEmpty == log.headRequest, "\(action): a body of \(body.count) bytes")
            invariant(body.isEmpty || length == String(body.count), "\(action): content-length \(length ?? "-")")
            streams[stream] = log
        case .writeBody(let stream):
            let log = opened(stream, action)
            invariant(
                log.submitted && !log.responseEnded && callback == stream && log.transferRunning,
                "\(action) outside a transfer callback of a response with a body in progress")
        case .endStream(let stream, let trailers):
            var log = opened(stream, action)
            invariant(log.submitted && !log.responseEnded, "\(action) without a response in progress")
            for field in trailers {
                invariant(allowedResponseField(field) && !notTrailers.contains(field.name), "\(action): trailer")
            }
            log.responseEnded = true
            streams[stream] = log
        case .resetStream(let stream, let code):
            var log = opened(stream, action)
            invariant(!log.reset, "\(action): a second reset")
            switch code {
            case .refusedStream:
                invariant(!log.inExchange && !log.finished && goaway, "\(action): not a new stream after GOAWAY")
            case .internalError:
                // A response cut short, right after its exchange finished so. (Also on a stream the client
                // already reset: RFC 9113 §5.4.2 forbids it, see H2SessionRFCGaps; tolerated here.)
                invariant(
                    (log.finished || log.tunnel) && log.submitted && !log.responseEnded,
                    "\(action) without a response cut short")
            default:
                invariant(false, "\(action): unexpected code")
            }
            log.reset = true
            log.responseEnded = true
            streams[stream] = log
        case .requestTrailers(let stream, _):
            invariant(opened(stream, action).inExchange, "\(action) for a stream without an exchange")
        case .exchange(let stream, let output, let origin):
            var log = opened(stream, action)
            exchangeOutput(stream, &log, output, origin: origin, action)
            streams[stream] = log
        case .openTunnel(let stream, let head):
            // A WebSocket stream (RFC 8441): its answer comes from the HTTP/1.1 side (`tunnelAnswer`).
            var log = opened(stream, action)
            invariant(!log.tunnel && !log.inExchange && !log.answered, "\(action): a second life for the stream")
            invariant(head.suffix(4) == Array("\r\n\r\n".utf8), "\(action): a head without its end")
            invariant(head.starts(with: Array("GET ".utf8)), "\(action): not an upgrade request")
            log.tunnel = true
            streams[stream] = log
        case .closeTunnel(let stream):
            var log = opened(stream, action)
            invariant(log.tunnel, "\(action) without a tunnel")
            log.tunnel = false
            streams[stream] = log
        case .consumeTunnel(let stream, _), .tunnelToStream(let stream, _), .endTunnelInput(let stream):
            invariant(opened(stream, action).tunnel, "\(action) without a tunnel")
            return
        case .dropRequestBody(let stream):
            _ = opened(stream, action)
            return
        case .exchangeFinished(let stream, let record):
            var log = opened(stream, action)
            invariant(log.inExchange && !log.finished, "\(action): not one finish per exchange")
            invariant(!log.transferRunning, "\(action) with its transfer running")
            invariant(record.status == (log.status ?? 0), "\(action): the client got \(log.status ?? 0)")
            invariant(!record.cutShort || log.submitted, "\(action): cut short without a response head")
            invariant(
                record.cutShort || log.status == nil || log.responseEnded,
                "\(action): a response neither complete nor cut short")
            invariant(
                log.status != nil || log.closedByClient || isClientGone,
                "\(action): no response while the client waits for one")
            invariant(record.attempts == log.sends, "\(action): \(log.sends) sends")
            log.finished = true
            log.inExchange = false
            streams[stream] = log
        }
    }

    private var isClientGone: Bool {
        switch current {
        case .clientGone, .timerFired(.idle, _): true
        default: false
        }
    }

    private func opened(_ stream: Stream, _ action: Action) -> StreamLog {
        guard let log = streams[stream] else { fatalError("invariant violated: \(action) names a stream never opened") }
        return log
    }

    private func allowedResponseField(_ field: H2Field) -> Bool {
        field.name.first != UInt8(ascii: ":") && field.name == asciiLowercased(field.name)
            && !connectionSpecific.contains(field.name) && field.name != bytes("trailer")
    }

    private mutating func responseHead(_ log: inout StreamLog, _ fields: [H2Field], _ action: Action) {
        invariant(!log.answered && !log.submitted, "\(action): a second response")
        invariant(!log.closedByClient && !log.reset, "\(action) on a closed stream")
        let status = fields.first.flatMap { $0.name == bytes(":status") ? Int($0.valueText) : nil }
        invariant(status.map { (200...599).contains($0) } == true, "\(action) without a final :status first")
        log.status = status
        for field in fields.dropFirst() { invariant(allowedResponseField(field), "\(action): \(field.nameText)") }
        invariant(!misdirected || status == 421, "\(action) on a misdirected connection")
    }

    private mutating func exchangeOutput(
        _ stream: Stream, _ log: inout StreamLog, _ output: ProtectedExchange.Output, origin: OriginConfig,
        _ action: Action
    ) {
        invariant(origin == session.origin, "\(action): an exchange with another origin")
        invariant(!misdirected, "\(action) on a misdirected connection")
        invariant(!log.finished, "\(action) after the exchange finished")
        log.inExchange = true
        switch output {
        case .getTokens(let key):
            invariant(key == origin.tokenKey && !log.awaitingTokens, "\(action)")
            log.awaitingTokens = true
        case .refreshTokens(let key, let replacing):
            invariant(key == origin.tokenKey && log.grants.contains(replacing), "\(action): not this stream's token")
            log.awaitingRefresh = true
        case .send(let request):
            invariant(!log.transferRunning, "\(action) while a transfer runs")
            log.transferRunning = true
            log.transferFresh = true
            log.lastSent = request
            invariant(request.url.hasPrefix(origin.url + "/"), "\(action): a request to \(request.url)")
            let expected = expectedUpstream(log)
            invariant(
                request.fields.map(\.name) == expected.map(\.name)
                    && request.fields.map(\.value) == expected.map(\.value),
                "\(action): upstream fields \(request.fields) instead of \(expected)")
            if let credential = request.credential {
                invariant(log.grants.contains(credential.generation), "\(action): a generation never given")
            }
            invariant(request.attempt == log.sends + 1, "\(action): attempt \(request.attempt)")
            invariant(
                !(log.bodyStreamed && log.sends > 0 && request.body != .none),
                "\(action): a body that was not kept is sent again")
            log.sends += 1
        case .cancelTransfer:
            invariant(log.transferRunning, "\(action) without a transfer")
            log.transferRunning = false
            log.transferFresh = false
        case .streamBody:
            log.bodyStreamed = true
        case .deliverHead, .deliverBody, .endBody, .respond, .finished:
            invariant(false, "\(action) reached the driver untranslated")
        case .checkResourceMetadata(let url):
            invariant(!log.transferRunning, "\(action) while a transfer runs")
            invariant(!log.awaitingMetadata, "\(action) twice")
            invariant(MetadataURL.sameOrigin(url, origin.url), "\(action): metadata of another origin")
            log.awaitingMetadata = true
        case .bodyEnded, .rememberNonce, .recordStepUp, .signInNeeded, .wrongAuthorizationServer:
            break
        }
    }

    private mutating func afterEvent() {
        let inFlight = streams.values.filter { $0.inExchange || $0.tunnel }.count
        invariant(session.activeStreams == inFlight, "\(session.activeStreams) streams in flight, \(inFlight) seen")
        guard !gone else { return }
        if closing {
            invariant(session.isIdle, "closeAfterFlush with \(session.activeStreams) streams in flight")
            return
        }
        if session.isIdle {
            invariant(timers[.keepAlive] != nil && timers[.idle] == nil, "idle, timers \(timers)")
        } else {
            invariant(timers[.idle] != nil && timers[.keepAlive] == nil, "streams in flight, timers \(timers)")
        }
    }

    // MARK: - Liveness

    /// Answers everything the streams wait for until nothing changes; then every exchange has finished and
    /// every stream got a response, a reset, or was closed by the client.
    mutating func finishEverything() {
        guard !gone else { return }
        for _ in 0..<16 {
            let before = progress
            for stream in streams.keys.sorted() {
                guard let log = streams[stream] else { continue }
                if log.awaitingTokens {
                    generation += 1
                    event(.tokens(stream, .success(TokenGrant(generation: generation))))
                }
                if streams[stream]?.awaitingRefresh == true {
                    generation += 1
                    event(.refreshed(stream, .success(TokenGrant(generation: generation))))
                }
                if streams[stream]?.awaitingMetadata == true {
                    event(.resourceMetadata(stream, verdicts[Int(stream) % verdicts.count]))
                }
                if let state = streams[stream], state.inExchange, !state.requestEnded, open(stream) {
                    event(.requestData(stream, count: 0, endStream: true))
                }
                if streams[stream]?.transferRunning == true {
                    transferLines(stream, bytes("HTTP/2 204 \r\n\r\n"))
                    if streams[stream]?.transferRunning == true {
                        event(.transferFinished(stream, nil, detail: ""))
                    }
                }
                if streams[stream]?.tunnel == true {
                    event(.tunnelEnded(stream))
                }
                if let state = streams[stream], state.requestEnded, state.responseEnded, open(stream) {
                    event(.streamClosed(stream, errorCode: 0))
                }
            }
            if progress == before { break }
        }
        for (stream, log) in streams {
            invariant(!log.inExchange, "stream \(stream): its exchange never finished")
            invariant(!log.tunnel, "stream \(stream): its tunnel never closed")
            invariant(
                log.responseEnded || log.closedByClient || closing,
                "stream \(stream): no response, no reset, not closed")
        }
    }
}

extension H2Field: @retroactive CustomDebugStringConvertible {
    /// `name: value`, so that FUZZ_DEBUG output reads like the header block.
    public var debugDescription: String { "\(nameText): \(valueText)" }
}
