import Foundation
import ProxyCore

/// FUZZ_DEBUG=1 prints every event and its actions (to replay a reproducer by eye).
private let debugging = ProcessInfo.processInfo.environment["FUZZ_DEBUG"] != nil

/// Drives `ConnectionMachine` with an event sequence read from the input (a little bytecode: one opcode
/// byte, then a length-prefixed chunk where the event carries bytes) and carries its actions out on byte
/// arrays, the way ProxyIO's driver does. Invariants, checked after every event:
/// - the driver's rules: never a second upstream connection (`connect` only when none is open),
///   `closeUpstream` only on an open one, no bytes to a closed side, consumes within the buffer;
/// - never two final responses for one request (the client's byte stream, read back with HTTPHeadParser,
///   holds at most as many final responses as requests were read);
/// - never a token to anything but the protected origin: every `send` with a credential goes to the
///   exchange's own origin, with an origin-form path;
/// - never a resend of a non-idempotent request, nor of a request with a body;
/// - the machine ends (closed or handed off) when it says so, and a closed machine does nothing more.
public func fuzzConnection(_ data: UnsafeBufferPointer<UInt8>) {
    let input = Array(data)
    guard let first = input.first else { return }
    var harness = ConnectionHarness(role: first)
    var reader = ByteReader(input.dropFirst())
    var steps = 0
    while let opcode = reader.byte(), steps < 64 {
        steps += 1
        harness.step(opcode, &reader)
        if harness.finished { break }
    }
    harness.checkClientStream()
}

/// Reads opcodes and chunks from the input.
struct ByteReader {
    private var bytes: ArraySlice<UInt8>

    init(_ bytes: ArraySlice<UInt8>) { self.bytes = bytes }

    mutating func byte() -> UInt8? { bytes.popFirst() }

    /// A chunk: a length byte, then that many bytes (fewer at the end of the input).
    mutating func chunk() -> [UInt8] {
        guard let length = bytes.popFirst() else { return [] }
        let taken = bytes.prefix(Int(length))
        bytes = bytes.dropFirst(taken.count)
        return Array(taken)
    }
}

private let protectedHTTPS: OriginConfig = {
    var origin = OriginConfig(scheme: "https", authority: HostPort(host: "api.test", port: 443, kind: .name))
    origin.provider = "corp"
    return origin
}()

private let protectedHTTP: OriginConfig = {
    var origin = OriginConfig(scheme: "http", authority: HostPort(host: "127.0.0.1", port: 9000, kind: .ipv4))
    origin.provider = "corp"
    origin.clientAuthorization = .replace
    return origin
}()

/// Templates the fuzzer can splice in with one opcode, so that deep states are reached without the dictionary
/// having to find whole heads.
private let clientTemplates: [String] = [
    "GET http://o.test/a HTTP/1.1\r\nHost: o.test\r\n\r\n",
    "POST http://o.test/b HTTP/1.1\r\nHost: o.test\r\nContent-Length: 5\r\n\r\nhello",
    "PUT http://o.test/c HTTP/1.1\r\nHost: o.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "CONNECT b.test:443 HTTP/1.1\r\nHost: b.test:443\r\n\r\n",
    "CONNECT api.test:443 HTTP/1.1\r\n\r\n",
    "GET http://127.0.0.1:9000/p?q=1 HTTP/1.1\r\nHost: 127.0.0.1:9000\r\nAuthorization: Basic x\r\n\r\n",
    "POST http://127.0.0.1:9000/p HTTP/1.1\r\nHost: 127.0.0.1:9000\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\nabc",
    "GET /inside HTTP/1.1\r\nHost: api.test\r\n\r\n",
    "POST /inside HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "GET /x HTTP/1.1\r\nHost: other.test\r\n\r\n",
    "GET http://o.test/ws HTTP/1.1\r\nHost: o.test\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
    "HEAD http://o.test/h HTTP/1.1\r\nHost: o.test\r\n\r\n",
    "DELETE http://o.test/d HTTP/1.1\r\nHost: o.test\r\nConnection: close\r\n\r\n",
]

private let upstreamTemplates: [String] = [
    "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
    "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    "HTTP/1.1 200 OK\r\n\r\nuntil close",
    "HTTP/1.1 100 Continue\r\n\r\n",
    "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
    "HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n",
    "HTTP/1.1 204 No Content\r\n\r\n",
    "HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx",
]

private let transferTemplates: [String] = [
    "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n",
    "HTTP/1.1 401 \r\nwww-authenticate: Bearer error=\"invalid_token\"\r\n\r\n",
    "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: DPoP error=\"use_dpop_nonce\"\r\nDPoP-Nonce: n1\r\n\r\n",
    "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"insufficient_user_authentication\", acr_values=\"mfa\"\r\n\r\n",
    "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
    "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
    "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer resource_metadata=\"https://api.test/.well-known/oauth-protected-resource\"\r\nContent-Length: 2\r\n\r\n",
    "HTTP/1.1 403 Forbidden\r\nWWW-Authenticate: Bearer error=\"insufficient_scope\", scope=\"admin\"\r\n\r\n",
    "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
]

struct ConnectionHarness {
    typealias Action = ConnectionMachine.Action

    var machine: ConnectionMachine
    var clientIn: [UInt8] = []
    var upstreamIn: [UInt8] = []
    var clientOut: [UInt8] = []
    var upstreamOpen = false
    var clientClosed = false
    var now: Int64 = 1_000
    var transferRunning = false
    /// `.send` was issued and the transfer has delivered nothing yet (when the driver could still fail to
    /// attach the credential instead of starting it).
    var transferFresh = false
    /// The request the exchange last sent: what the own client's reader reads the response for.
    var lastSent: UpstreamRequest?
    /// `.getTokens` was issued and not answered (the I/O layer answers each ask once, and only an ask).
    var tokensAsked = false
    /// Request heads written upstream since the last response head came back, to spot resends.
    var lastHeadWritten: [UInt8]?
    var responseSinceLastHead = false
    var finished: Bool { clientClosed || machine.isFinished }

    init(role: UInt8) {
        var settings = ProxySettings()
        settings.replayMemory = 16
        settings.replaySpool = 64
        settings.upstreamProxy = role & 2 != 0 ? try? UpstreamProxy.parse("http://u:p@corp.test:3128").get() : nil
        let frontDoor = FrontDoor(
            settings: settings, credentials: nil,
            boundAddress: ListenAddress(host: "127.0.0.1", port: 8080, isIPv6: false),
            origins: OriginTable([protectedHTTPS, protectedHTTP]))
        machine = ConnectionMachine(
            role: role & 1 == 0 ? .frontDoor : .intercepted(protectedHTTPS), frontDoor: frontDoor,
            hasLocalCA: role & 4 == 0)
        event(.start)
        if role & 1 != 0 {
            event(
                .tlsEstablished(
                    serverName: role & 8 == 0 ? "api.test" : "evil.test", protocol: role & 16 == 0 ? "http/1.1" : "h2"))
        }
    }

    mutating func step(_ opcode: UInt8, _ reader: inout ByteReader) {
        now += Int64(opcode & 0x0F) * 500
        switch opcode >> 4 {
        case 0: client(reader.chunk())
        case 1: client(Array(clientTemplates[Int(reader.byte() ?? 0) % clientTemplates.count].utf8))
        case 2 where upstreamOpen: upstream(reader.chunk())
        case 3 where upstreamOpen:
            upstream(Array(upstreamTemplates[Int(reader.byte() ?? 0) % upstreamTemplates.count].utf8))
        case 4:
            // Addresses of the next hop; with bit 3, one of them is the proxy's own listener (a loop).
            var found = (0..<Int(opcode & 3)).map { "192.0.2.\($0 + 1)" }
            if opcode & 8 != 0 { found.append("::ffff:127.0.0.1") }
            event(.resolved(opcode & 1 == 0 ? .addresses(found) : .notFound))
        case 5 where upstreamOpen: event(opcode & 1 == 0 ? .upstreamConnected : .upstreamConnectFailed(.refused))
        case 6 where upstreamOpen: event(.upstreamEnded(reset: opcode & 1 == 1))
        case 7: event(.clientEnded(reset: opcode & 1 == 1))
        case 8:
            let timer = ConnectionTimer.allCases[Int(opcode & 0x0F) % ConnectionTimer.allCases.count]
            event(.timerFired(timer, lastActivity: now - Int64(opcode & 0x0F) * 4_000))
        case 9:
            let grant: Result<TokenGrant, TokenFailure> =
                opcode & 1 == 0
                ? .success(TokenGrant(generation: Int64(opcode & 0x0F) + 1, dpopNonce: opcode & 2 == 0 ? nil : "n"))
                : .failure(opcode & 2 == 0 ? .signInNeeded(reason: "x") : .unavailable(reason: "y", retryAfter: 3))
            if opcode & 8 != 0 {
                // The answer to a metadata check, asked for or not (a late one is ignored).
                let verdicts: [ResourceMetadataVerdict] = [
                    .consistent, .otherServers(["https://b.test"]), .unknown("x"),
                ]
                event(.resourceMetadata(verdicts[Int(opcode & 3) % verdicts.count]))
            } else if opcode & 4 == 0 {
                guard tokensAsked else { return }
                tokensAsked = false
                event(.tokens(grant))
            } else {
                event(.refreshed(grant))
            }
        case 10 where transferRunning:
            let text = transferTemplates[Int(reader.byte() ?? 0) % transferTemplates.count]
            transferHead(Array(text.utf8))
        case 11 where transferRunning:
            transferHead(reader.chunk())
        case 12 where transferRunning:
            transferFresh = false
            event(.transferBody(count: 5))
        case 13 where transferRunning:
            // The transfer is over; a retry may start another.
            transferRunning = false
            transferFresh = false
            event(.transferFinished(opcode & 1 == 0 ? nil : .incomplete, detail: "x"))
        case 14:
            event(opcode & 1 == 0 ? .shutdown : .abort(reason: "grace"))
        case 15 where opcode & 1 == 0 && transferFresh:
            // Instead of starting the transfer (the machine ignores it at any other time).
            transferRunning = false
            transferFresh = false
            event(.credentialFailed(.dpopKeyMissing(provider: "corp")))
        case 15 where opcode & 2 == 0:
            event(.bodyNotKept(directory: "/x"))
        case 15:
            // The I/O layer's replay budget ran out: the body streams on, unkept.
            event(.bodyBeyondBudget)
        default:
            break
        }
    }

    mutating func client(_ bytes: [UInt8]) {
        guard !clientClosed else { return }
        clientIn += bytes
        event(.clientData)
    }

    mutating func upstream(_ bytes: [UInt8]) {
        upstreamIn += bytes
        event(.upstreamData)
    }

    /// The transfer's response heads as the own client hands them over: read by `ResponseReader` for the request
    /// last sent; a head it cannot read ends the transfer with the failure, as `OriginExchange` ends it.
    mutating func transferHead(_ bytes: [UInt8]) {
        transferFresh = false
        var reader = ResponseReader(
            requestMethod: lastSent?.method ?? "GET", upgradeRequested: lastSent?.upgrade ?? false,
            limits: lastSent?.responseHeadLimits ?? HTTPHeadLimits())
        var outputs: [ResponseReader.Output] = []
        _ = bytes.withUnsafeBytes { reader.read($0, &outputs) }
        for output in outputs {
            switch output {
            case .head(let received):
                var actions: [Action] = []
                machine.transferResponseHead(received, now: now, &actions)
                apply(actions)
            case .failed(let error):
                guard transferRunning else { return }
                transferRunning = false
                event(.transferFinished(OriginExchange.failure(error), detail: "\(error)"))
                return
            default:
                break
            }
        }
    }

    mutating func event(_ event: ConnectionMachine.Event) {
        var actions: [Action] = []
        machine.handle(event, client: clientIn, upstream: upstreamIn, now: now, &actions)
        if debugging { FileHandle.standardError.write(Data("\(event)\n  -> \(actions)\n".utf8)) }
        apply(actions)
    }

    mutating func apply(_ actions: [Action]) {
        for action in actions {
            if clientClosed {
                switch action {
                case .disarm, .log, .exchangeFinished, .consumeClient, .exchange(.cancelTransfer, _): break
                case .arm, .readClient: break
                default: invariant(false, "\(action) after the client connection closed")
                }
            }
            switch action {
            case .consumeClient(let count):
                invariant(count > 0 && count <= clientIn.count, "consume \(count) of \(clientIn.count) client bytes")
                clientIn.removeFirst(count)
            case .writeClient(let bytes):
                clientOut += bytes
            case .moveClientToUpstream(let count):
                invariant(upstreamOpen, "body bytes to a closed upstream")
                invariant(count > 0 && count <= clientIn.count, "move \(count) of \(clientIn.count)")
                clientIn.removeFirst(count)
            case .moveUpstreamToClient(let count):
                invariant(count > 0 && count <= upstreamIn.count, "move \(count) of \(upstreamIn.count)")
                clientOut += upstreamIn.prefix(count)
                upstreamIn.removeFirst(count)
                responseSinceLastHead = true
            case .consumeUpstream(let count):
                invariant(count > 0 && count <= upstreamIn.count, "consume \(count) of \(upstreamIn.count)")
                upstreamIn.removeFirst(count)
                responseSinceLastHead = true
            case .writeUpstream(let bytes):
                invariant(upstreamOpen, "writing to a closed upstream")
                checkResend(bytes)
            case .connect:
                invariant(!upstreamOpen, "connect while an upstream connection is open")
                upstreamOpen = true
            case .closeUpstream:
                invariant(upstreamOpen, "closeUpstream without an upstream connection")
                upstreamOpen = false
                upstreamIn = []
            case .keepBody(let count):
                invariant(count > 0 && count <= clientIn.count, "keep \(count) of \(clientIn.count)")
                clientIn.removeFirst(count)
            case .closeAfterFlush, .closeNow, .resetClient, .startInterception, .startHTTP2:
                clientClosed = true
            case .startTunnel:
                clientClosed = true
                upstreamOpen = false
            case .exchange(let output, let origin):
                exchangeOutput(output, origin: origin)
            case .arm(_, let milliseconds):
                invariant(milliseconds > 0, "a timer armed for \(milliseconds) ms")
            case .exchangeFinished(let record):
                // After a 101 the transfer ends by itself: its connection is the tunnel's.
                if record.status == 101 { transferRunning = false }
                invariant(!transferRunning, "an exchange finished with its transfer running")
            case .requestTrailers(let fields):
                invariant(!fields.isEmpty, "empty request trailers")
            case .disarm, .readClient, .resolve, .writeResponseBody, .log, .requestFinished, .auditRefusal:
                break
            }
        }
    }

    mutating func exchangeOutput(_ output: ProtectedExchange.Output, origin: OriginConfig) {
        invariant(origin == protectedHTTPS || origin == protectedHTTP, "an exchange with \(origin.url)")
        if case .intercepted(let tunnel) = machine.role {
            invariant(origin == tunnel, "an exchange with \(origin.url) inside the tunnel to \(tunnel.url)")
        }
        switch output {
        case .getTokens:
            tokensAsked = true
        case .send(let request):
            lastSent = request
            invariant(!transferRunning, "a second transfer while one runs")
            transferRunning = true
            transferFresh = true
            if request.credential != nil {
                // The token goes to the protected origin only, in origin form.
                invariant(request.url.hasPrefix(origin.url + "/"), "a token sent to \(request.url) for \(origin.url)")
            }
        case .cancelTransfer:
            invariant(transferRunning, "cancelTransfer without a transfer")
            transferRunning = false
            transferFresh = false
        default:
            break
        }
    }

    /// A request head written again with no response in between is a resend: idempotent and bodyless only.
    mutating func checkResend(_ bytes: [UInt8]) {
        var parser = HTTPHeadParser(kind: .request)
        guard case .complete(let head, let consumed) = parser.parse(bytes), consumed == bytes.count else { return }
        if let last = lastHeadWritten, last == bytes, !responseSinceLastHead {
            invariant(
                ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"].contains(head.method),
                "\(head.method) was sent twice")
            invariant(
                head.indices(named: "content-length").isEmpty && head.indices(named: "transfer-encoding").isEmpty,
                "a request with a body was sent twice")
        }
        lastHeadWritten = bytes
        responseSinceLastHead = false
    }

    /// The client's byte stream holds at most one final response per request read.
    func checkClientStream() {
        var offset = 0
        var finals = 0
        while offset < clientOut.count {
            var parser = HTTPHeadParser(kind: .response, limits: generousLimits)
            let rest = Array(clientOut[offset...])
            guard case .complete(let head, let consumed) = parser.parse(rest) else { return }
            offset += consumed
            if head.status >= 200 { finals += 1 }
            // Bodies: skip by the framing the client would use (HEAD requests aside, which templates rarely
            // hit; a mismatch only ends the check early).
            guard
                case .success(let semantics) = MessageSemantics.response(
                    head, requestMethod: "GET", upgradeRequested: head.status == 101)
            else { return }
            switch semantics.framing {
            case .none: break
            case .contentLength(let length): offset += Int(clamping: length)
            case .chunked, .untilClose: return
            }
            if head.status == 101 { return }
        }
        invariant(
            finals <= machine.requests, "\(finals) final responses for \(machine.requests) requests")
    }
}
