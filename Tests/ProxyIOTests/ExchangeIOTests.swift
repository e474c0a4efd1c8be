import CCurl
import CLibevent
import Foundation
import ProxyOAuth
import ProxyTLS
import Testing

@testable import ProxyCore
@testable import ProxyIO

// Issue 28: the exchange's I/O (`ExchangeIO`) with a fake transfer and scripted tokens, no sockets. The context's
// seams (`ConnectionContext.makeTransfer`, `ConnectionContext.tokens`) take the fakes; the rest of the context is
// the real thing (the DPoP keyring and nonces, the replay budget, the loop and its timers). Events the exchange
// promises "at the top of the loop" must not reach the driver inside the call that raised them: the recording
// driver notes whether a test's call into the exchange was under way when each one came.

/// The transfer `ExchangeIO` makes through `ConnectionContext.makeTransfer`: what it was asked to send, and what
/// the exchange did to it. The test plays its callbacks.
final class FakeTransfer: UpstreamTransfer {
    let request: UpstreamRequest
    let authorization: [(name: String, value: [UInt8])]
    var paused = false
    private(set) var cancelled = false
    var tag: Int32 = 0
    var uploadOffset = 0
    private(set) var starts = 0
    private(set) var resumes = 0

    init(request: UpstreamRequest, authorization: [(name: String, value: [UInt8])]) {
        self.request = request
        self.authorization = authorization
    }

    func start() { starts += 1 }
    func resume() { resumes += 1 }
    func cancel() { cancelled = true }
    func takeSwitched() -> OriginConnection? { nil }

    /// The value of the field `name` the exchange attached (the last one of that name), as text.
    func field(_ name: String) -> String? {
        authorization.last { $0.name.lowercased() == name.lowercased() }
            .map { String(decoding: $0.value, as: UTF8.self) }
    }
}

/// Every transfer the context made, in order.
final class TransferLog {
    var made: [FakeTransfer] = []
}

/// The driver of the client connection, as the exchange sees it: what reached it, and whether a call of the
/// test into the exchange was under way at the time.
final class RecordingDriver: ExchangeDriver {
    struct Heard {
        /// The exchange that sent it: the driver listens to its current one only.
        let from: ObjectIdentifier
        let event: ExchangeIO.Event
        /// It came inside the test's call into the exchange, not at the top of the loop.
        let insideCall: Bool
    }
    var heard: [Heard] = []
    var body: [UInt8] = []
    var bodyTaken: [Int] = []
    /// The client's output is full: response bytes are refused.
    var clientFull = false
    /// A test's call into the exchange is under way (`ExchangeHarness.call`).
    var inCall = false

    var events: [ExchangeIO.Event] { heard.map(\.event) }

    func exchange(_ io: ExchangeIO, event: ExchangeIO.Event) {
        heard.append(Heard(from: ObjectIdentifier(io), event: event, insideCall: inCall))
    }

    func exchange(_ io: ExchangeIO, responseBody data: UnsafeRawBufferPointer) -> Bool {
        if clientFull { return false }
        body += data
        return true
    }

    func exchange(_ io: ExchangeIO, bodyTaken count: Int) { bodyTaken.append(count) }
}

/// Tokens as the test scripts them: each request waits for `answer`. Field values are rendered by a real
/// `TokenBroker` (without providers): the production rendering, not the fake's own.
final class ScriptedTokens: ExchangeTokens {
    struct Asked: Equatable {
        let key: TokenKey
        /// The generation a refresh replaces; nil for `tokens`.
        let replacing: Int64?
    }
    private let rendering: TokenBroker
    private(set) var asked: [Asked] = []
    private var waiting: [(Result<TokenSet, AuthError>) -> Void] = []

    init(loop: EventLoop) { rendering = TokenBroker(loop: loop, managers: [:]) }

    /// Tokens `tokensAtHand` gives without being asked (the broker's cache); nil: every request is asked.
    var atHand: TokenSet?

    func tokensAtHand(_ key: TokenKey) -> TokenSet? { atHand }

    func tokens(_ key: TokenKey, completion: @escaping (Result<TokenSet, AuthError>) -> Void) {
        asked.append(Asked(key: key, replacing: nil))
        waiting.append(completion)
    }

    func refresh(
        _ key: TokenKey, replacing generation: Int64, completion: @escaping (Result<TokenSet, AuthError>) -> Void
    ) {
        asked.append(Asked(key: key, replacing: generation))
        waiting.append(completion)
    }

    func headerValue(_ header: CredentialHeader, _ tokens: TokenSet, scheme: String) throws(AuthError) -> [UInt8] {
        try rendering.headerValue(header, tokens, scheme: scheme)
    }

    func issuer(of provider: String) -> String? { "https://idp.test" }

    /// Answers the oldest request.
    func answer(_ result: Result<TokenSet, AuthError>) {
        waiting.removeFirst()(result)
    }
}

/// The server, as the context reports to it: the exchanges recorded.
final class RecordingOwner: ConnectionOwner {
    var records: [(record: ExchangeRecord, up: Int, down: Int)] = []

    func adopt(_ connection: any ServerConnection) {}
    func connectionClosed(_ connection: any ServerConnection) {}
    func record(_ record: ExchangeRecord, up: Int, down: Int, milliseconds: Int64) {
        records.append((record, up, down))
    }
    func count(_ outcome: RequestOutcome) {}
    func tunnelEnded(upgrade: Bool, status: Int, up: Int, down: Int) {}
    func interceptionStarted() {}
    func stepUpRequired(origin: OriginConfig, challenge: Challenge) {}
    func signInNeeded(provider: String, origin: String, reason: String) {}
    func wrongAuthorizationServer(origin: OriginConfig, servers: [String]) {}
}

/// One connection's context with the fakes in its seams, a loop that only runs when the test pumps it, and a
/// protected origin `https://api.test` of the provider `idp`.
final class ExchangeHarness {
    let loop: EventLoop
    let tokens: ScriptedTokens
    let owner = RecordingOwner()
    let driver = RecordingDriver()
    let transfers = TransferLog()
    let nonces = DPoPNonces()
    let context: ConnectionContext
    let replay: ReplayAccount
    let origin: OriginConfig
    let key = TokenKey(provider: "idp")

    /// - Parameters:
    ///   - keys: the DPoP keys at hand, by provider.
    ///   - stateDirectory: where a key not at hand is looked for (off the loop).
    ///   - replayBudget: the process's budget for kept request bodies (a connection may take a quarter).
    init(
        keys: [String: DPoPKey] = [:], stateDirectory: String? = nil,
        replayBudget: ReplayBudget.Limits = .init(memory: 1 << 20, spool: 1 << 20)
    ) {
        EventLoop.initializeLibraries()
        loop = EventLoop()
        tokens = ScriptedTokens(loop: loop)
        var origin = OriginConfig(scheme: "https", authority: HostPort(host: "api.test", port: 443, kind: .name))
        origin.provider = "idp"
        self.origin = origin
        let budget = ReplayBudget(replayBudget)
        replay = ReplayAccount(budget)
        let transfers = self.transfers
        context = ConnectionContext(
            loop: loop, logger: Logger(level: .error),
            frontDoor: FrontDoor(settings: ProxySettings(), credentials: nil, boundAddress: .default),
            resolver: Resolver(), tokens: tokens, tlsContexts: nil, tlsClients: TLSClientContexts(),
            spoolDirectory: NSTemporaryDirectory() + "exchange-io-\(getpid())", replayBudget: budget, nonces: nonces,
            keys: DPoPKeyring(loop: loop, keys: keys, stateDirectory: stateDirectory), pipes: PipePool(),
            tunnelBuffer: TunnelBuffer(), peers: PeerLookup(), owner: owner,
            makeTransfer: { _, request, _, authorization, _, _ in
                let made = FakeTransfer(request: request, authorization: authorization)
                transfers.made.append(made)
                return made
            })
    }

    func exchange(tag: Int32 = 0) -> ExchangeIO {
        ExchangeIO(driver: driver, context: context, origin: origin, connectionID: 9, tag: tag, replay: replay)
    }

    /// A call into the exchange as its driver makes it: what reaches the driver meanwhile is marked inside it.
    @discardableResult
    func call<T>(_ work: () -> T) -> T {
        driver.inCall = true
        defer { driver.inCall = false }
        return work()
    }

    /// Runs what is due on the loop (timers fired in this pass, jobs posted to it) until `done` or `seconds`.
    func pump(until done: () -> Bool = { false }, seconds: Int = 60) {
        let deadline = ContinuousClock.now + .seconds(seconds)
        repeat {
            event_base_loop(loop.base, EVLOOP_NONBLOCK)
            if done() { return }
            usleep(1_000)
        } while ContinuousClock.now < deadline
    }

    static func tokenSet(
        _ accessToken: String = "tok-1", generation: Int64 = 7, boundTo thumbprint: String? = nil
    ) -> TokenSet {
        let now = Int64(time(nil))
        var tokens = TokenSet(
            provider: "idp", issuer: "https://idp.test", clientID: "proxyctl", accessToken: accessToken,
            tokenType: thumbprint == nil ? "Bearer" : "DPoP", issuedAt: now, expiresAt: now + 3600, refreshToken: nil,
            idToken: nil, scope: nil, identity: nil, generation: generation)
        tokens.dpopThumbprint = thumbprint
        return tokens
    }

    static func request(
        _ method: String = "GET", _ url: String = "https://api.test/v1/items", credential: UpstreamRequest.Credential?,
        body: UpstreamRequest.Body = .none
    ) -> UpstreamRequest {
        UpstreamRequest(
            method: method, url: url, requestTarget: nil, fields: [("Accept", Array("*/*".utf8))],
            credential: credential, body: body, http2: true, connectTimeout: 10_000, idleTimeout: 30_000, caFile: nil,
            upstreamProxy: nil, attempt: 1)
    }

    /// An exchange whose tokens (Bearer, generation 7) have arrived.
    func exchangeWithTokens(_ tokens: TokenSet = ExchangeHarness.tokenSet(), tag: Int32 = 0) -> ExchangeIO {
        let io = exchange(tag: tag)
        call { io.perform(.getTokens(key: key)) }
        self.tokens.answer(.success(tokens))
        driver.heard.removeAll()
        return io
    }

    static let bearer = UpstreamRequest.Credential(generation: 7, dpopNonce: nil)

    static let record = ExchangeRecord(
        method: "GET", origin: "https://api.test", provider: "idp", target: "/v1/items", status: 200, attempts: 1,
        keptClientAuthorization: false, attached: true, refreshed: false, nonceRetried: false, stepUp: false,
        answeredByProxy: false, note: nil, close: false)
}

/// The bytes a transfer's read callback gets with a buffer of `size`, and what it returned.
private func read(_ io: ExchangeIO, from transfer: FakeTransfer, size: Int) -> (returned: Int, bytes: [UInt8]) {
    var buffer = [UInt8](repeating: 0, count: size)
    let returned = buffer.withUnsafeMutableBytes { io.transferRead(transfer, $0) }
    return (returned, returned > 0 && returned <= size ? Array(buffer.prefix(returned)) : [])
}

/// `text` as request body bytes from the client.
private func keep(_ io: ExchangeIO, _ text: String) -> Bool {
    Array(text.utf8).withUnsafeBytes { io.keep($0) }
}

/// A response head as the own client parses it.
private func responseHead(_ text: String) throws -> ReceivedHead {
    var parser = HTTPHeadParser(kind: .response)
    let bytes = Array(text.utf8)
    guard case .complete(let head, _) = bytes.withUnsafeBytes({ parser.parse($0) }) else {
        throw ExchangeIOTestError("not a response head: \(text)")
    }
    return ReceivedHead(head: head, semantics: nil)
}

private struct ExchangeIOTestError: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
}

/// base64url without padding, decoded (RFC 7515 §2), by Foundation rather than the project's `Base64`.
private func base64URLDecoded(_ text: Substring) -> Data? {
    var standard = text.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
    standard += String(repeating: "=", count: (4 - standard.count % 4) % 4)
    return Data(base64Encoded: standard)
}

/// A JWS part's JSON object.
private func jsonObject(_ part: Substring) throws -> [String: Any] {
    let data = try #require(base64URLDecoded(part))
    return try #require(try JSONSerialization.jsonObject(with: data) as? [String: Any])
}

@Suite struct ExchangeIOTests {
    // MARK: - Tokens

    @Test func tokensReachTheDriverAsAGrantWithTheirGeneration() throws {
        let harness = ExchangeHarness()
        let io = harness.exchange()
        harness.call { io.perform(.getTokens(key: harness.key)) }
        #expect(harness.tokens.asked == [.init(key: harness.key, replacing: nil)])
        #expect(harness.driver.heard.isEmpty, "nothing before the tokens come")

        harness.tokens.answer(.success(ExchangeHarness.tokenSet(generation: 7)))
        let heard = try #require(harness.driver.heard.first)
        #expect(harness.driver.heard.count == 1)
        #expect(heard.from == ObjectIdentifier(io), "the exchange itself, for the driver to tell it from older ones")
        guard case .tokens(.success(let grant)) = heard.event else {
            Issue.record("expected .tokens(.success), got \(heard.event)")
            return
        }
        #expect(grant == TokenGrant(generation: 7, dpopNonce: nil, boundToKey: false))
    }

    /// A token at hand (the broker's cache) is the grant at once, with nothing asked and nothing left waiting; a
    /// refresh is always asked.
    @Test func aTokenAtHandIsTheGrantAtOnce() throws {
        let harness = ExchangeHarness()
        harness.tokens.atHand = ExchangeHarness.tokenSet(generation: 3)
        let io = harness.exchange()
        harness.call { io.perform(.getTokens(key: harness.key)) }
        #expect(harness.tokens.asked.isEmpty)
        let heard = try #require(harness.driver.heard.first)
        #expect(harness.driver.heard.count == 1 && heard.from == ObjectIdentifier(io))
        guard case .tokens(.success(let grant)) = heard.event else {
            Issue.record("expected .tokens(.success), got \(heard.event)")
            return
        }
        #expect(grant == TokenGrant(generation: 3, dpopNonce: nil, boundToKey: false))
        harness.call { io.perform(.refreshTokens(key: harness.key, replacing: 3)) }
        #expect(harness.tokens.asked == [.init(key: harness.key, replacing: 3)])
    }

    @Test func aRefreshReachesTheDriverAsRefreshedWithTheOriginsNonce() throws {
        let harness = ExchangeHarness()
        harness.nonces.remember("nonce-9", for: "https://api.test")
        let io = harness.exchangeWithTokens()
        harness.call { io.perform(.refreshTokens(key: harness.key, replacing: 7)) }
        #expect(harness.tokens.asked.last == .init(key: harness.key, replacing: 7))

        harness.tokens.answer(.success(ExchangeHarness.tokenSet("tok-2", generation: 8, boundTo: "jkt")))
        let heard = try #require(harness.driver.heard.first)
        guard case .refreshed(.success(let grant)) = heard.event else {
            Issue.record("expected .refreshed(.success), got \(heard.event)")
            return
        }
        #expect(grant == TokenGrant(generation: 8, dpopNonce: "nonce-9", boundToKey: true))
    }

    @Test func aTokenFailureReachesTheDriverAsTheExchangesFailure() throws {
        let harness = ExchangeHarness()
        let io = harness.exchange()
        harness.call { io.perform(.getTokens(key: harness.key)) }
        harness.tokens.answer(.failure(.reauthenticate(reason: "no tokens for idp")))
        harness.call { io.perform(.refreshTokens(key: harness.key, replacing: 7)) }
        harness.tokens.answer(.failure(.recoverable(reason: "idp is down", retryAfter: 30)))
        let events = harness.driver.events
        #expect(events.count == 2)
        guard case .tokens(.failure(let failure)) = events.first else {
            Issue.record("expected .tokens(.failure), got \(events)")
            return
        }
        #expect(failure == .signInNeeded(reason: "no tokens for idp"))
        guard case .refreshed(.failure(let refreshFailure)) = events.last else {
            Issue.record("expected .refreshed(.failure), got \(events)")
            return
        }
        #expect(refreshFailure == .unavailable(reason: "idp is down", retryAfter: 30))
    }

    // MARK: - The transfer and its credential

    @Test func sendStartsOneTransferWithTheBearerField() throws {
        let harness = ExchangeHarness()
        let io = harness.exchangeWithTokens(tag: 5)
        harness.call { io.perform(.send(ExchangeHarness.request(credential: ExchangeHarness.bearer))) }

        #expect(harness.transfers.made.count == 1)
        let transfer = try #require(harness.transfers.made.first)
        #expect(transfer.request == ExchangeHarness.request(credential: ExchangeHarness.bearer))
        #expect(transfer.authorization.map(\.name) == ["Authorization"])
        #expect(transfer.field("Authorization") == "Bearer tok-1")
        #expect(transfer.starts == 1)
        #expect(transfer.tag == 5, "the driver's name for the exchange (an HTTP/2 stream's id)")
        #expect(io.hasTransfer)
        #expect(harness.driver.heard.isEmpty)
    }

    @Test func anOriginsOwnHeaderTemplateIsFilledWithTheToken() throws {
        let harness = ExchangeHarness()
        let io = harness.exchangeWithTokens()
        let header = CredentialHeader(name: "X-Api-Key", parts: [.literal(Array("key=".utf8)), .credential])
        let credential = UpstreamRequest.Credential(generation: 7, dpopNonce: nil, headers: [header])
        harness.call { io.perform(.send(ExchangeHarness.request(credential: credential))) }
        let transfer = try #require(harness.transfers.made.first)
        #expect(transfer.authorization.map(\.name) == ["X-Api-Key"])
        #expect(transfer.field("X-Api-Key") == "key=tok-1")
    }

    @Test func withoutACredentialNoFieldIsAttached() throws {
        let harness = ExchangeHarness()
        let io = harness.exchangeWithTokens()
        harness.call { io.perform(.send(ExchangeHarness.request(credential: nil))) }
        let transfer = try #require(harness.transfers.made.first)
        #expect(transfer.authorization.isEmpty)
        #expect(transfer.starts == 1)
    }

    /// RFC 9449 §4.2-§4.3 and §7.1: a key-bound token goes as `Authorization: DPoP <token>` with a proof of the
    /// method, the URL without query, the token's hash and the origin's nonce, signed by the key the token is
    /// bound to. The proof is decoded here with Foundation (not the project's JWT parser), its key's thumbprint
    /// computed from the RFC 7638 members, and its signature checked by `CryptoKey` (whose ES256 check
    /// `JWSVerifierTests` holds to PyJWT's signatures).
    @Test func aKeyBoundTokenGoesWithAProofOfTheRequest() throws {
        let dpopKey = try DPoPKey(try PrivateKey.generateP256())
        let harness = ExchangeHarness(keys: ["idp": dpopKey])
        let io = harness.exchangeWithTokens(ExchangeHarness.tokenSet("tok-dpop", boundTo: dpopKey.thumbprint))
        let credential = UpstreamRequest.Credential(generation: 7, dpopNonce: "nonce-1", boundToKey: true)
        let before = Int64(time(nil))
        harness.call {
            io.perform(
                .send(ExchangeHarness.request("POST", "https://api.test/v1/items?page=2", credential: credential)))
        }
        let after = Int64(time(nil))

        #expect(harness.transfers.made.count == 1)
        let transfer = try #require(harness.transfers.made.first)
        #expect(transfer.starts == 1)
        #expect(transfer.authorization.map(\.name) == ["Authorization", "DPoP"])
        #expect(transfer.field("Authorization") == "DPoP tok-dpop")
        let proof = try #require(transfer.field("DPoP"))
        let parts = proof.split(separator: ".", omittingEmptySubsequences: false)
        try #require(parts.count == 3)

        let header = try jsonObject(parts[0])
        #expect(header["typ"] as? String == "dpop+jwt")
        #expect(header["alg"] as? String == "ES256")
        let jwk = try #require(header["jwk"] as? [String: String])
        #expect(Set(jwk.keys) == ["kty", "crv", "x", "y"], "the public members only")
        let crv = try #require(jwk["crv"]), x = try #require(jwk["x"]), y = try #require(jwk["y"])
        let members = #"{"crv":"\#(crv)","kty":"\#(jwk["kty"] ?? "")","x":"\#(x)","y":"\#(y)"}"#
        #expect(
            Base64.urlEncode(Crypto.sha256(members)) == dpopKey.thumbprint,
            "the proof's key is the one the token is bound to (RFC 7638 thumbprint)")

        let claims = try jsonObject(parts[1])
        #expect(claims["htm"] as? String == "POST")
        #expect(claims["htu"] as? String == "https://api.test/v1/items", "RFC 9449 §4.2: without query")
        #expect(claims["ath"] as? String == Base64.urlEncode(Crypto.sha256("tok-dpop")))
        #expect(claims["nonce"] as? String == "nonce-1")
        let iat = try #require(claims["iat"] as? Int)
        #expect(Int64(iat) >= before && Int64(iat) <= after)
        let jti = try #require(claims["jti"] as? String)
        #expect(!jti.isEmpty)

        let signature = try #require(base64URLDecoded(parts[2]))
        #expect(signature.count == 64, "ES256: r||s (RFC 7518 §3.4)")
        let headerBytes = try #require(base64URLDecoded(parts[0]))
        let publicKey = try #require(try JSON.parse(Array(headerBytes)).get()["jwk"]?.object)
        let verifier = try CryptoKey.publicKey(jwk: publicKey)
        #expect(
            verifier.verify(
                .es256, signature: Array(signature), signingInput: Array("\(parts[0]).\(parts[1])".utf8)))
    }

    @Test func aReplacedKeyIsReadOffTheLoopThenTheTransferStarts() throws {
        // `proxyctl login --new-key` wrote a new key: the one at hand is not the tokens'.
        let state = NSTemporaryDirectory() + "exchange-io-state-\(getpid())-\(UInt64.random(in: 0...UInt64.max))"
        defer { try? FileManager.default.removeItem(atPath: state) }
        let replaced = try DPoPKey.create(stateDirectory: state, provider: "idp")
        let old = try DPoPKey(try PrivateKey.generateP256())
        let harness = ExchangeHarness(keys: ["idp": old], stateDirectory: state)
        let io = harness.exchangeWithTokens(ExchangeHarness.tokenSet("tok-new", boundTo: replaced.thumbprint))
        let credential = UpstreamRequest.Credential(generation: 7, dpopNonce: nil, boundToKey: true)
        harness.call { io.perform(.send(ExchangeHarness.request(credential: credential))) }
        #expect(harness.transfers.made.isEmpty, "the key file is read off the loop first")

        harness.pump(until: { !harness.transfers.made.isEmpty })
        let transfer = try #require(harness.transfers.made.first)
        #expect(transfer.starts == 1)
        #expect(transfer.field("Authorization") == "DPoP tok-new")
        let proof = try #require(transfer.field("DPoP")).split(separator: ".", omittingEmptySubsequences: false)
        try #require(proof.count == 3)
        let jwk = try #require(try jsonObject(proof[0])["jwk"] as? [String: String])
        #expect(jwk["x"] == (try replaced.key.publicJWK())["x"]?.string, "signed by the new key, not the old")
        #expect(harness.driver.heard.isEmpty)
    }

    @Test func aMissingKeyFailsTheCredentialAtTheTopOfTheLoopAndStartsNothing() throws {
        // The tokens are bound to a key that is not at hand and not in the state directory either.
        let state = NSTemporaryDirectory() + "exchange-io-state-\(getpid())-\(UInt64.random(in: 0...UInt64.max))"
        try FileManager.default.createDirectory(atPath: state, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: state) }
        let harness = ExchangeHarness(stateDirectory: state)
        let io = harness.exchangeWithTokens(ExchangeHarness.tokenSet(boundTo: "gone"))
        let credential = UpstreamRequest.Credential(generation: 7, dpopNonce: nil, boundToKey: true)
        harness.call { io.perform(.send(ExchangeHarness.request(credential: credential))) }
        #expect(harness.driver.heard.isEmpty, "the key is looked for off the loop")

        harness.pump(until: { !harness.driver.heard.isEmpty })
        let heard = try #require(harness.driver.heard.first)
        #expect(harness.driver.heard.count == 1)
        #expect(!heard.insideCall)
        guard case .credentialFailed(let answer) = heard.event else {
            Issue.record("expected .credentialFailed, got \(heard.event)")
            return
        }
        #expect(answer == .dpopKeyMissing(provider: "idp"))
        #expect(harness.transfers.made.isEmpty)
        #expect(!io.hasTransfer)
    }

    @Test func aFieldThatCannotBeMadeFailsTheCredentialAtTheTopOfTheLoop() throws {
        let harness = ExchangeHarness()
        let io = harness.exchangeWithTokens()
        let missing = NSTemporaryDirectory() + "exchange-io-no-such-file-\(getpid())"
        let header = CredentialHeader(name: "X-Api-Key", parts: [.secretFile(missing)])
        let credential = UpstreamRequest.Credential(generation: 7, dpopNonce: nil, headers: [header])
        harness.call { io.perform(.send(ExchangeHarness.request(credential: credential))) }
        #expect(harness.driver.heard.isEmpty, "not inside the driver's call")

        harness.pump(until: { !harness.driver.heard.isEmpty })
        let heard = try #require(harness.driver.heard.first)
        #expect(!heard.insideCall)
        guard case .credentialFailed(.providerMisconfigured(let origin, let provider, _)) = heard.event else {
            Issue.record("expected .credentialFailed(.providerMisconfigured), got \(heard.event)")
            return
        }
        #expect(origin == "https://api.test" && provider == "idp")
        #expect(harness.transfers.made.isEmpty)
    }

    // MARK: - The request body

    @Test func theBodyIsReadAsItArrivesAndAPausedReadResumesWithMore() throws {
        let harness = ExchangeHarness()
        let io = harness.exchangeWithTokens()
        #expect(keep(io, "hello"))
        harness.call {
            io.perform(.send(ExchangeHarness.request("POST", credential: ExchangeHarness.bearer, body: .streaming)))
        }
        let transfer = try #require(harness.transfers.made.first)

        #expect(read(io, from: transfer, size: 3) == (3, Array("hel".utf8)))
        #expect(transfer.uploadOffset == 3 && io.up == 3)
        #expect(read(io, from: transfer, size: 16) == (2, Array("lo".utf8)))
        #expect(io.up == 5 && harness.driver.bodyTaken == [3, 2])

        // Nothing waiting and the body not ended: the transfer pauses, and the client may send more.
        #expect(read(io, from: transfer, size: 16).returned == Int(proxyctl_readfunc_pause()))
        #expect(harness.driver.bodyTaken == [3, 2, 0])
        #expect(transfer.resumes == 0)
        #expect(keep(io, " world"))
        #expect(transfer.resumes == 1, "more bytes resume the paused transfer")
        #expect(keep(io, "!"))
        #expect(transfer.resumes == 1, "a transfer that is not paused is not resumed")
        #expect(read(io, from: transfer, size: 16) == (7, Array(" world!".utf8)))

        harness.call { io.perform(.bodyEnded) }
        #expect(read(io, from: transfer, size: 16).returned == 0, "the end of the body")
        #expect(io.up == 12)
        #expect(harness.driver.heard.isEmpty)
    }

    @Test func theBodyEndingResumesAPausedRead() throws {
        let harness = ExchangeHarness()
        let io = harness.exchangeWithTokens()
        harness.call {
            io.perform(.send(ExchangeHarness.request("POST", credential: ExchangeHarness.bearer, body: .streaming)))
        }
        let transfer = try #require(harness.transfers.made.first)
        #expect(read(io, from: transfer, size: 16).returned == Int(proxyctl_readfunc_pause()))
        harness.call { io.perform(.bodyEnded) }
        #expect(transfer.resumes == 1)
        #expect(read(io, from: transfer, size: 16).returned == 0)
    }

    @Test func aSeekStaysWithinTheStoredReplayableBytes() throws {
        let harness = ExchangeHarness()
        let io = harness.exchangeWithTokens()
        #expect(keep(io, "0123456789"))
        harness.call {
            io.perform(.send(ExchangeHarness.request("POST", credential: ExchangeHarness.bearer, body: .length(10))))
        }
        let transfer = try #require(harness.transfers.made.first)
        #expect(read(io, from: transfer, size: 16).returned == 10)

        #expect(io.transferSeek(transfer, 0), "back to the start, for a resend")
        #expect(transfer.uploadOffset == 0)
        #expect(read(io, from: transfer, size: 4) == (4, Array("0123".utf8)))
        #expect(io.transferSeek(transfer, 10))
        #expect(!io.transferSeek(transfer, 11), "past what is stored")
        #expect(transfer.uploadOffset == 10)

        harness.call { io.perform(.streamBody) }
        #expect(!io.transferSeek(transfer, 0), "a streaming body was not kept")
        #expect(transfer.uploadOffset == 10)
    }

    @Test func aBodyBeyondTheReplayBudgetIsReportedOnceAtTheTopOfTheLoop() throws {
        // A connection's share: 10 bytes of memory, no spool.
        let harness = ExchangeHarness(replayBudget: .init(memory: 40, spool: 0))
        let io = harness.exchangeWithTokens()
        #expect(harness.call { keep(io, "0123456789abcdef") }, "the bytes are taken (and stream)")
        #expect(harness.call { keep(io, "ghij") })
        #expect(harness.driver.heard.isEmpty, "not inside the driver's call")
        #expect(io.body.streaming)

        harness.pump(until: { !harness.driver.heard.isEmpty }, seconds: 5)
        harness.pump(seconds: 0)
        #expect(harness.driver.heard.count == 1)
        let heard = try #require(harness.driver.heard.first)
        #expect(!heard.insideCall)
        guard case .bodyBeyondBudget = heard.event else {
            Issue.record("expected .bodyBeyondBudget, got \(heard.event)")
            return
        }
        // What did not fit is not lost: it streams to the transfer after what was kept.
        harness.call {
            io.perform(.send(ExchangeHarness.request("POST", credential: ExchangeHarness.bearer, body: .streaming)))
        }
        let transfer = try #require(harness.transfers.made.first)
        #expect(read(io, from: transfer, size: 64) == (10, Array("0123456789".utf8)))
        #expect(read(io, from: transfer, size: 64) == (10, Array("abcdefghij".utf8)))
    }

    // MARK: - The response

    @Test func theResponseReachesTheDriverAndAFullClientPausesIt() throws {
        let harness = ExchangeHarness()
        let io = harness.exchangeWithTokens()
        harness.call { io.perform(.send(ExchangeHarness.request(credential: ExchangeHarness.bearer))) }
        let transfer = try #require(harness.transfers.made.first)

        let head = try responseHead("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
        io.transferResponseHead(transfer, head)
        guard case .responseHead(let received) = harness.driver.events.last else {
            Issue.record("expected .responseHead, got \(harness.driver.events)")
            return
        }
        #expect(received == head)

        let first = Array("01234".utf8)
        #expect(first.withUnsafeBytes { io.transferBody(transfer, $0) } == 5)
        #expect(harness.driver.body == first)

        harness.driver.clientFull = true
        let second = Array("56789".utf8)
        #expect(second.withUnsafeBytes { io.transferBody(transfer, $0) } == Int(proxyctl_writefunc_pause()))
        #expect(transfer.paused, "the transfer keeps the bytes and stops reading the origin")
        #expect(harness.driver.body == first)

        harness.driver.clientFull = false
        io.resumeResponse()
        #expect(!transfer.paused && transfer.resumes == 1)
        io.resumeResponse()
        #expect(transfer.resumes == 1, "a transfer that is not paused is not resumed")
        #expect(second.withUnsafeBytes { io.transferBody(transfer, $0) } == 5)
        #expect(harness.driver.body == first + second)

        io.transferFinished(transfer, nil, detail: "")
        guard case .transferFinished(let failure, _) = harness.driver.events.last else {
            Issue.record("expected .transferFinished, got \(harness.driver.events)")
            return
        }
        #expect(failure == nil)
        #expect(!io.hasTransfer)
    }

    // MARK: - Late callbacks

    @Test func finishStopsTheTransferDropsTheTokensAndReportsOnce() throws {
        let harness = ExchangeHarness()
        let io = harness.exchangeWithTokens()
        #expect(keep(io, "abc"))
        harness.call {
            io.perform(.send(ExchangeHarness.request("POST", credential: ExchangeHarness.bearer, body: .length(3))))
        }
        let transfer = try #require(harness.transfers.made.first)
        #expect(read(io, from: transfer, size: 16).returned == 3)
        io.down = 42
        harness.call { io.perform(.refreshTokens(key: harness.key, replacing: 7)) }

        io.finish(ExchangeHarness.record, peer: "127.0.0.1")
        #expect(transfer.cancelled)
        #expect(!io.hasTransfer)
        #expect(harness.owner.records.count == 1)
        #expect(harness.owner.records.first?.record == ExchangeHarness.record)
        #expect(harness.owner.records.first?.up == 3 && harness.owner.records.first?.down == 42)

        try expectNothingReachesTheDriver(harness, io, transfer)
        // The token answer in flight when it finished.
        harness.tokens.answer(.success(ExchangeHarness.tokenSet(generation: 8)))
        #expect(harness.driver.heard.isEmpty)
        // A late output of its driver starts nothing.
        io.perform(.send(ExchangeHarness.request(credential: ExchangeHarness.bearer)))
        #expect(harness.transfers.made.count == 1)

        io.finish(ExchangeHarness.record, peer: "127.0.0.1")
        #expect(harness.owner.records.count == 1, "a second finish reports nothing")
    }

    @Test func aCancelledExchangeHearsNothingAndReportsNothing() throws {
        let harness = ExchangeHarness()
        let io = harness.exchangeWithTokens()
        harness.call { io.perform(.send(ExchangeHarness.request(credential: ExchangeHarness.bearer))) }
        let transfer = try #require(harness.transfers.made.first)
        harness.call { io.perform(.getTokens(key: harness.key)) }

        io.cancel()
        #expect(transfer.cancelled)
        try expectNothingReachesTheDriver(harness, io, transfer)
        harness.tokens.answer(.success(ExchangeHarness.tokenSet(generation: 8)))
        #expect(harness.driver.heard.isEmpty)
        #expect(harness.owner.records.isEmpty)
        io.finish(ExchangeHarness.record, peer: "127.0.0.1")
        #expect(harness.owner.records.isEmpty, "a cancelled exchange is not reported by its finish")
    }

    @Test func callbacksOfAReplacedTransferReachNoDriver() throws {
        let harness = ExchangeHarness()
        let io = harness.exchangeWithTokens()
        #expect(keep(io, "abc"))
        harness.call {
            io.perform(.send(ExchangeHarness.request("POST", credential: ExchangeHarness.bearer, body: .length(3))))
        }
        harness.call { io.perform(.cancelTransfer) }
        let first = try #require(harness.transfers.made.first)
        #expect(first.cancelled)
        #expect(!io.hasTransfer)
        harness.call {
            io.perform(.send(ExchangeHarness.request("POST", credential: ExchangeHarness.bearer, body: .length(3))))
        }
        #expect(harness.transfers.made.count == 2)
        let second = harness.transfers.made[1]
        #expect(second.starts == 1 && !second.cancelled)

        try expectNothingReachesTheDriver(harness, io, first)
        #expect(io.up == 0, "the old transfer's read took nothing")

        // The current one is heard.
        io.transferResponseHead(second, try responseHead("HTTP/1.1 204 No Content\r\n\r\n"))
        #expect(harness.driver.events.count == 1)
        #expect(read(io, from: second, size: 16) == (3, Array("abc".utf8)))
    }

    /// Every callback of `transfer` is dropped: the driver hears nothing, the body is neither read nor moved.
    func expectNothingReachesTheDriver(_ harness: ExchangeHarness, _ io: ExchangeIO, _ transfer: FakeTransfer) throws {
        let heard = harness.driver.heard.count
        let taken = harness.driver.bodyTaken
        io.transferResponseHead(transfer, try responseHead("HTTP/1.1 200 OK\r\n\r\n"))
        io.transferResponseTrailers(transfer, [])
        let bytes = Array("late".utf8)
        #expect(bytes.withUnsafeBytes { io.transferBody(transfer, $0) } == 4, "taken and dropped, never paused")
        #expect(harness.driver.body.isEmpty)
        #expect(read(io, from: transfer, size: 16).returned == 0)
        #expect(!io.transferSeek(transfer, 0))
        io.requestTrailers = [H2Field("grpc-status", "0")]
        #expect(io.transferRequestTrailers(transfer).isEmpty)
        io.transferFinished(transfer, nil, detail: "late")
        harness.pump(seconds: 0)
        #expect(harness.driver.heard.count == heard)
        #expect(harness.driver.bodyTaken == taken)
    }
}
