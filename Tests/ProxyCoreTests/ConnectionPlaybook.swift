import Testing

@testable import ProxyCore

/// Drives a `ConnectionMachine` the way the I/O layer does, with byte arrays for the four buffers, and
/// checks the rules the I/O layer relies on after every event. A test reads like the exchange on the wire
/// (mitmproxy's playbook tests are the model): bytes from the client, what reaches the next hop, the bytes
/// the client gets back, and the notable actions in between.
struct Playbook {
    typealias Action = ConnectionMachine.Action

    var machine: ConnectionMachine
    /// Bytes the client sent that the machine has not consumed.
    var clientIn: [UInt8] = []
    /// Bytes from the next hop that the machine has not consumed.
    var upstreamIn: [UInt8] = []
    /// Bytes written to the client since `clientGot()` was last called.
    var clientOut: [UInt8] = []
    /// Bytes written to the next hop since `upstreamGot()` was last called.
    var upstreamOut: [UInt8] = []
    /// The request body kept for replay.
    var keptBody: [UInt8] = []
    var upstreamOpen = false
    /// A `.getTokens` is out and unanswered (the I/O layer answers each ask once, and only an ask).
    var tokensAsked = false
    var reading = false
    var clientClosed: Action?
    var now: Int64 = 1_000
    var lastActivity: Int64 = 1_000
    /// Armed timers and their deadlines.
    var timers: [ConnectionTimer: Int64] = [:]
    /// Notable actions since `next()` was last called.
    var notable: [Action] = []
    var logs: [LogLine] = []
    /// What each finished request counted as (the metrics).
    var outcomes: [RequestOutcome] = []
    /// Requests refused for a credential they carried, as the audit log gets them.
    var refusals: [RefusedCredentialUse] = []
    /// Every upstream connection opened, in order (the index of the address each used).
    var connects: [Int] = []
    /// The request the exchange last sent (`.send`): what the own client's reader reads the response for.
    var sent: UpstreamRequest?

    init(_ machine: ConnectionMachine, start: Bool = true) {
        self.machine = machine
        if start { event(.start) }
    }

    static func frontDoor(
        _ settings: ProxySettings = Playbook.settings, origins: [OriginConfig] = []
    )
        -> Playbook
    {
        Playbook(
            ConnectionMachine(
                role: .frontDoor,
                frontDoor: FrontDoor(
                    settings: settings, credentials: nil,
                    boundAddress: ListenAddress(host: "127.0.0.1", port: 8080, isIPv6: false),
                    origins: OriginTable(origins)),
                hasLocalCA: true))
    }

    static func intercepted(_ origin: OriginConfig, settings: ProxySettings = Playbook.settings) -> Playbook {
        Playbook(
            ConnectionMachine(
                role: .intercepted(origin),
                frontDoor: FrontDoor(
                    settings: settings, credentials: nil,
                    boundAddress: ListenAddress(host: "127.0.0.1", port: 8080, isIPv6: false),
                    origins: OriginTable([origin])),
                hasLocalCA: true))
    }

    static var settings: ProxySettings {
        var settings = ProxySettings()
        settings.connectTimeout = 5_000
        settings.idleTimeout = 30_000
        settings.keepAliveTimeout = 10_000
        settings.headerTimeout = 20_000
        settings.replayMemory = 64
        settings.replaySpool = 1_024
        return settings
    }

    // MARK: - Events

    mutating func event(_ event: ConnectionMachine.Event) {
        if case .tokens = event { tokensAsked = false }
        // An attempt that never had a socket leaves no upstream connection for the machine to close.
        if case .upstreamConnectFailed(.noSocket) = event { upstreamOpen = false }
        var actions: [Action] = []
        machine.handle(event, client: clientIn, upstream: upstreamIn, now: now, &actions)
        apply(actions)
    }

    mutating func client(_ text: String) { client(Array(text.utf8)) }

    mutating func client(_ bytes: [UInt8]) {
        #expect(clientClosed == nil, "bytes from a client whose connection is closed")
        clientIn += bytes
        lastActivity = now
        event(.clientData)
    }

    mutating func upstream(_ text: String) { upstream(Array(text.utf8)) }

    mutating func upstream(_ bytes: [UInt8]) {
        #expect(upstreamOpen, "bytes from an upstream connection that is not open")
        upstreamIn += bytes
        lastActivity = now
        event(.upstreamData)
    }

    /// `count` addresses of the next hop (none of them the proxy's own).
    static func addresses(_ count: Int) -> [String] { (0..<count).map { "192.0.2.\($0 + 1)" } }

    /// The next hop resolves to `count` addresses and the first connect succeeds.
    mutating func connectUpstream(addresses count: Int = 1) {
        event(.resolved(.addresses(Self.addresses(count))))
        event(.upstreamConnected)
    }

    mutating func upstreamEnds(reset: Bool = false) {
        event(.upstreamEnded(reset: reset))
    }

    /// Advances the clock by `milliseconds` and fires the timers that are due, in deadline order.
    mutating func wait(_ milliseconds: Int64) {
        let until = now + milliseconds
        while let (timer, deadline) = timers.filter({ $0.value <= until }).min(by: { $0.value < $1.value }) {
            now = deadline
            timers.removeValue(forKey: timer)
            event(.timerFired(timer, lastActivity: lastActivity))
        }
        now = until
    }

    /// A transfer's response heads (interim ones, then the final) as the own client hands them over: read by
    /// `ResponseReader` for the request last sent (its method, whether it asked to upgrade), each head parsed once.
    /// A head the reader cannot read ends the transfer as `OriginExchange` ends it (`.transferFinished` with
    /// the failure).
    mutating func transferHead(_ text: String) {
        var reader = ResponseReader(
            requestMethod: sent?.method ?? "GET", upgradeRequested: sent?.upgrade ?? false,
            limits: sent?.responseHeadLimits ?? HTTPHeadLimits())
        var outputs: [ResponseReader.Output] = []
        _ = Array(text.utf8).withUnsafeBytes { reader.read($0, &outputs) }
        for output in outputs {
            var actions: [Action] = []
            switch output {
            case .head(let received):
                machine.transferResponseHead(received, now: now, &actions)
            case .failed(let error):
                event(.transferFinished(OriginExchange.failure(error), detail: "\(error)"))
                continue
            default:
                continue
            }
            apply(actions)
        }
    }

    // MARK: - Carrying out actions (and checking the rules the driver relies on)

    mutating func apply(_ actions: [Action]) {
        for action in actions {
            if clientClosed != nil {
                switch action {
                case .disarm, .log, .exchangeFinished, .requestFinished: break
                case .exchange(.cancelTransfer, _): break
                // Bytes the client sent after the request that ends the connection are dropped.
                case .consumeClient where clientClosed == .closeAfterFlush: break
                default: Issue.record("\(action) after the client connection was closed (\(clientClosed!))")
                }
            }
            switch action {
            case .consumeClient(let count):
                #expect(count > 0 && count <= clientIn.count, "consume \(count) of \(clientIn.count)")
                clientIn.removeFirst(min(count, clientIn.count))
            case .writeClient(let bytes):
                clientOut += bytes
            case .moveClientToUpstream(let count):
                #expect(upstreamOpen, "moving bytes to an upstream that is not open")
                #expect(count > 0 && count <= clientIn.count)
                upstreamOut += clientIn.prefix(count)
                clientIn.removeFirst(min(count, clientIn.count))
            case .moveUpstreamToClient(let count):
                #expect(count > 0 && count <= upstreamIn.count)
                clientOut += upstreamIn.prefix(count)
                upstreamIn.removeFirst(min(count, upstreamIn.count))
            case .consumeUpstream(let count):
                #expect(count > 0 && count <= upstreamIn.count)
                upstreamIn.removeFirst(min(count, upstreamIn.count))
            case .writeUpstream(let bytes):
                #expect(upstreamOpen, "writing to an upstream that is not open")
                upstreamOut += bytes
            case .keepBody(let count):
                #expect(count > 0 && count <= clientIn.count)
                keptBody += clientIn.prefix(count)
                clientIn.removeFirst(min(count, clientIn.count))
            case .connect(let address):
                // The rule that makes the use-after-free class impossible: never a second upstream connection.
                #expect(!upstreamOpen, "connect while an upstream connection is open")
                upstreamOpen = true
                connects.append(address)
                notable.append(action)
            case .closeUpstream:
                #expect(upstreamOpen, "closeUpstream without an upstream connection")
                upstreamOpen = false
                upstreamIn = []
                notable.append(action)
            case .arm(let timer, let milliseconds):
                #expect(milliseconds > 0)
                timers[timer] = now + Int64(milliseconds)
            case .disarm(let timer):
                timers.removeValue(forKey: timer)
            case .readClient(let on):
                reading = on
            case .log(let line):
                logs.append(line)
            case .requestFinished(let outcome):
                outcomes.append(outcome)
            case .auditRefusal(let use):
                refusals.append(use)
            case .closeAfterFlush, .closeNow, .resetClient:
                clientClosed = action
                notable.append(action)
            case .startTunnel, .startInterception, .startHTTP2:
                #expect(!upstreamOpen || { if case .startTunnel = action { true } else { false } }())
                clientClosed = action
                notable.append(action)
            case .exchange(.getTokens, _):
                tokensAsked = true
                notable.append(action)
            case .exchange(.send(let request), _):
                sent = request
                notable.append(action)
            case .resolve, .exchange, .writeResponseBody, .exchangeFinished, .requestTrailers:
                notable.append(action)
            }
        }
    }

    // MARK: - Reading the results

    /// Notable actions since the last call (bytes, timers, reads and logs are tracked separately).
    mutating func next() -> [Action] {
        defer { notable = [] }
        return notable
    }

    /// What the client received since the last call, as text.
    mutating func clientGot() -> String {
        defer { clientOut = [] }
        return String(decoding: clientOut, as: UTF8.self)
    }

    /// What the next hop received since the last call, as text.
    mutating func upstreamGot() -> String {
        defer { upstreamOut = [] }
        return String(decoding: upstreamOut, as: UTF8.self)
    }

    var lastLog: String { logs.last?.text ?? "" }
}

func hop(_ text: String) -> HostPort {
    try! HostPort.parse(text[...], defaultPort: 80).get()
}

extension String {
    var crlf: String { replacingOccurrences(of: "\n", with: "\r\n") }
}
