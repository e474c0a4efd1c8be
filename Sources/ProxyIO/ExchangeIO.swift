import CCurl
import ProxyCore
import ProxyOAuth

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// What an exchange's I/O hands the driver of its client connection (HTTP/1.1 or an HTTP/2 stream). The
/// transfer's calls (head, body, body taken, trailers, end) and the events `later` holds back come at the top of
/// the loop, never inside a call the driver made into the exchange's I/O; an answer a cache has at once (tokens
/// from `TokenBroker`, resource metadata already judged) can come inside `perform`, and the drivers queue it like
/// any event raised while actions run.
protocol ExchangeDriver: AnyObject {
    /// An event for the machine that runs the exchange (`ProtectedExchange`, through the connection's machine).
    func exchange(_ io: ExchangeIO, event: ExchangeIO.Event)
    /// Response body bytes for the client, valid for the call: false when the client's output is full (the
    /// transfer pauses until `io.resumeResponse()`).
    func exchange(_ io: ExchangeIO, responseBody data: UnsafeRawBufferPointer) -> Bool
    /// The transfer took `count` bytes of the request body from the store, or found none waiting (`count` 0):
    /// the client may send more (HTTP/2 flow control, a paused reader).
    func exchange(_ io: ExchangeIO, bodyTaken count: Int)
}

/// One exchange with a protected origin as the I/O layer carries it out, whatever protocol the client speaks:
/// the request body kept for replay (`RequestBody`), the tokens the exchange was given, the credential's fields
/// (the scheme chosen by `ProtectedExchange`; the `Authorization` value and a DPoP proof made here, the one
/// place), the upstream transfer and its callbacks, and the bytes counted each way. `ClientDriver` and
/// `H2Driver` each keep one per exchange in flight and carry the outputs of `ProtectedExchange` to it that are
/// I/O (`perform`); the rest they frame for their client.
///
/// Late callbacks are harmless by construction: every exchange is an object of its own and that identity is its
/// generation. The driver holds its current one (so no other can share its address) and drops what any other
/// sends (`io === exchangeIO`); an exchange that ended (`finish`) has no transfer, no tokens and no driver. Its
/// owner references (the driver, the transfer's owner) are weak.
final class ExchangeIO: TransferOwner {
    /// What the exchange's machine hears.
    enum Event {
        /// The answer to `.getTokens` / `.refreshTokens`.
        case tokens(Result<TokenGrant, TokenFailure>)
        case refreshed(Result<TokenGrant, TokenFailure>)
        /// The token could not be attached (no DPoP key, a proof that cannot be signed): no transfer started.
        case credentialFailed(ProxyAnswer)
        /// The request body could not be kept (the spool file could not be written).
        case bodyNotKept(directory: String)
        /// The connection's or the process's replay budget is spent: the body's rest streams, once.
        case bodyBeyondBudget
        /// The answer to `.checkResourceMetadata`.
        case resourceMetadata(ResourceMetadataVerdict)
        /// The transfer's response head, parsed once.
        case responseHead(ReceivedHead)
        /// The response's trailer fields.
        case responseTrailers([H2Field])
        /// The transfer ended (`failure` nil: the response was complete).
        case transferFinished(UpstreamFailure?, detail: String)
    }

    /// The driver's name for the exchange (an HTTP/2 stream's id; 0 on HTTP/1.1).
    let tag: Int32
    private weak var driver: (any ExchangeDriver)?
    let context: ConnectionContext
    let origin: OriginConfig
    private let connectionID: UInt64
    /// The request body, kept for a replay up to `replay_spool`, then streaming.
    let body: RequestBody
    private var tokens: TokenSet?
    private var transfer: (any UpstreamTransfer)?
    /// The transfer found no request body bytes waiting: more from the client resume it.
    private var uploadPaused = false
    /// Bytes of the request body the transfer took, and of the response the client was given.
    private(set) var up = 0
    var down = 0
    /// When the exchange began (the access log's duration).
    let started = EventLoop.monotonicMilliseconds()
    private var finished = false
    /// Events for the driver raised inside its own call (a proof that cannot be signed), handed over at the top of
    /// the loop.
    private var pending: [Event] = []
    private var pendingTimer: LoopTimer?

    init(
        driver: any ExchangeDriver, context: ConnectionContext, origin: OriginConfig, connectionID: UInt64,
        tag: Int32 = 0, replay: ReplayAccount
    ) {
        self.tag = tag
        self.driver = driver
        self.context = context
        self.origin = origin
        self.connectionID = connectionID
        body = RequestBody(
            memoryLimit: context.settings.replayMemory, spoolDirectory: context.spoolDirectory, account: replay)
        // The audit line names the client's process: found while the client waits (once per connection).
        if context.audit != nil { context.peers.resolve(connection: connectionID) }
    }

    deinit {
        transfer?.cancel()
        if let pendingTimer { context.spareTimer(pendingTimer) }
    }

    /// Whether a transfer runs.
    var hasTransfer: Bool { transfer != nil }

    /// The connection the origin switched protocols on (after a 101 to an upgrade request), for the tunnel.
    func takeSwitched() -> OriginConnection? { transfer?.takeSwitched() }

    // MARK: - The exchange's outputs that are I/O

    /// Carries out an output of `ProtectedExchange` that is I/O; the others (the response, the proxy's answers,
    /// the end) are the driver's to frame.
    func perform(_ output: ProtectedExchange.Output) {
        guard !finished else { return }
        switch output {
        case .streamBody:
            body.startStreaming()
        case .bodyEnded:
            body.finish()
            resumeUpload()
        case .getTokens(let key):
            // Most requests find their token at hand: no closure, and no weak reference to this exchange (whose
            // first costs a side table's allocation: about 1,900 instructions a request with `send`'s, callgrind).
            if let atHand = context.tokens.tokensAtHand(key) {
                return tokensArrived(.success(atHand), refreshed: false)
            }
            context.tokens.tokens(key) { [weak self] result in self?.tokensArrived(result, refreshed: false) }
        case .refreshTokens(let key, let generation):
            context.tokens.refresh(key, replacing: generation) { [weak self] result in
                self?.tokensArrived(result, refreshed: true)
            }
        case .send(let request):
            send(request)
        case .cancelTransfer:
            stopTransfer()
        case .rememberNonce(let nonce):
            context.nonces.remember(nonce, for: origin.url)
        case .recordStepUp(let challenge):
            context.owner.stepUpRequired(origin: origin, challenge: challenge)
        case .signInNeeded(let reason):
            context.owner.signInNeeded(provider: origin.provider, origin: origin.url, reason: reason)
        case .checkResourceMetadata(let url):
            context.resourceMetadata.verdict(
                url: url, origin: origin, issuer: context.tokens.issuer(of: origin.provider)
            ) { [weak self] verdict in
                guard let self, !self.finished else { return }
                driver?.exchange(self, event: .resourceMetadata(verdict))
            }
        case .wrongAuthorizationServer(let servers):
            context.owner.wrongAuthorizationServer(origin: origin, servers: servers)
        case .deliverHead, .deliverBody, .endBody, .respond, .finished:
            break
        }
    }

    private func tokensArrived(_ result: Result<TokenSet, AuthError>, refreshed: Bool) {
        guard !finished else { return }
        let grant: Result<TokenGrant, TokenFailure>
        switch result {
        case .success(let fresh):
            tokens = fresh
            grant = .success(
                TokenGrant(
                    generation: fresh.generation, dpopNonce: context.dpopNonce(for: fresh, origin: origin),
                    boundToKey: fresh.tokenType == "DPoP"))
        case .failure(let error):
            grant = .failure(error.tokenFailure)
        }
        driver?.exchange(self, event: refreshed ? .refreshed(grant) : .tokens(grant))
    }

    /// Starts the transfer `request` describes, the credential's fields attached; later when the key that signs
    /// them must be read first.
    private func send(_ request: UpstreamRequest) {
        guard let fields = credentialFields(for: request) else { return }
        let made = context.makeTransfer(self, request, origin, fields, context, connectionID)
        made.tag = tag
        transfer = made
        uploadPaused = false
        made.start()
    }

    /// The fields of `request`'s credential (none without one): `Authorization` with the scheme the exchange chose,
    /// and for a key-bound token a fresh DPoP proof for its method and URL (RFC 9449 §7: one per request, replays
    /// included, bound to the token by `ath`). Nil when not now: a key that was replaced is read off the loop first
    /// and `request` sent when it is there; a key that is missing or a proof that cannot be signed ends in
    /// `.credentialFailed` (at the top of the loop).
    private func credentialFields(for request: UpstreamRequest) -> [(name: String, value: [UInt8])]? {
        guard let credential = request.credential, let tokens else { return [] }
        var fields: [(name: String, value: [UInt8])] = []
        fields.reserveCapacity(credential.headers.count + 1)
        for header in credential.headers {
            do {
                fields.append((header.name, try context.tokens.headerValue(header, tokens, scheme: credential.scheme)))
            } catch {
                later(
                    .credentialFailed(
                        .providerMisconfigured(
                            origin: origin.url, provider: origin.credentialName, reason: error.description)))
                return nil
            }
        }
        guard credential.boundToKey else { return fields }
        let provider = origin.provider
        guard let key = context.keys.cached(provider: provider, thumbprint: tokens.dpopThumbprint) else {
            // The key was replaced (`proxyctl login --new-key`): read it off the loop, then go on.
            context.keys.load(provider: provider, thumbprint: tokens.dpopThumbprint) { [weak self] key in
                guard let self, !self.finished else { return }
                if key == nil {
                    driver?.exchange(self, event: .credentialFailed(.dpopKeyMissing(provider: provider)))
                } else {
                    send(request)
                }
            }
            return nil
        }
        do {
            let proof = try key.proof(
                method: request.method, url: request.url, accessToken: tokens.accessToken,
                nonce: credential.dpopNonce, now: Int64(time(nil)))
            fields.append(("DPoP", Array(proof.utf8)))
        } catch {
            later(.credentialFailed(.dpopProofFailed(reason: "\(error)")))
            return nil
        }
        return fields
    }

    /// `event` for the driver at the top of the loop (it was raised inside the driver's call).
    private func later(_ event: Event) {
        pending.append(event)
        if pendingTimer == nil {
            pendingTimer = context.takeTimer { [weak self] in
                guard let self else { return }
                let events = pending
                pending = []
                for event in events where !finished { driver?.exchange(self, event: event) }
            }
        }
        pendingTimer?.fireInThisPass()
    }

    // MARK: - The request body

    /// Keeps `bytes` of the request body (in memory, then the spool; queued for the transfer once streaming);
    /// false when the spool cannot be written (`.bodyNotKept` follows).
    @discardableResult
    func keep(_ bytes: UnsafeRawBufferPointer) -> Bool {
        do {
            if try !body.append(bytes) { later(.bodyBeyondBudget) }
        } catch {
            later(.bodyNotKept(directory: context.spoolDirectory))
            return false
        }
        resumeUpload()
        return true
    }

    /// A paused transfer reads the new body bytes (it resumes at the top of the loop).
    private func resumeUpload() {
        guard uploadPaused, let transfer else { return }
        uploadPaused = false
        transfer.resume()
    }

    /// The client's output drained: a transfer paused for it goes on.
    func resumeResponse() {
        guard let transfer, transfer.paused, !transfer.cancelled else { return }
        transfer.paused = false
        transfer.resume()
    }

    // MARK: - The end

    /// The exchange is over: its line in the access log (`suffix` after it: the HTTP/2 stream), its counts, and
    /// its transfer stopped, its tokens dropped. Nothing of it reaches the driver any more.
    func finish(_ record: ExchangeRecord, peer: String, suffix: (inout LogLineBuilder) -> Void = { _ in }) {
        guard !finished else { return }
        finished = true
        Self.report(
            record, up: up, down: down, milliseconds: EventLoop.monotonicMilliseconds() - started, context: context,
            connectionID: connectionID, peer: peer, suffix: suffix)
        stopTransfer()
        tokens = nil
        pending = []
        driver = nil
    }

    /// An exchange's line in the access log and its counts (for an exchange that ended before any I/O too).
    static func report(
        _ record: ExchangeRecord, up: Int, down: Int, milliseconds: Int64, context: ConnectionContext,
        connectionID: UInt64, peer: String, suffix: (inout LogLineBuilder) -> Void = { _ in }
    ) {
        context.owner.record(record, up: up, down: down, milliseconds: milliseconds)
        if record.attached, let audit = context.audit {
            // `protected_users = owner` (the default) admits only the proxy's own user to protected origins.
            audit.record(
                record, connection: connectionID, client: peer, ownerAdmitted: context.settings.protectedUsers == .owner
            )
        }
        guard context.logger.enabled(.info) else { return }
        var line = record.logLineBuilder(up: up, down: down, milliseconds: milliseconds)
        suffix(&line)
        context.logger.connection(connectionID, peer: peer, LogLine(.info, line))
    }

    /// The connection is gone: stop without a record (the machine reports the exchange itself, if it can).
    func cancel() {
        finished = true
        stopTransfer()
        tokens = nil
        pending = []
        driver = nil
    }

    /// Stops the transfer (safe inside its own callbacks).
    private func stopTransfer() {
        guard let transfer else { return }
        transfer.cancel()
        self.transfer = nil
    }

    // MARK: - TransferOwner (the transfer's callbacks, at the top of the loop)

    private func current(_ from: any UpstreamTransfer) -> Bool { !finished && from === transfer }

    func transferResponseTrailers(_ from: any UpstreamTransfer, _ fields: [H2Field]) {
        guard current(from) else { return }
        driver?.exchange(self, event: .responseTrailers(fields))
    }

    func transferResponseHead(_ from: any UpstreamTransfer, _ received: ReceivedHead) {
        guard current(from) else { return }
        driver?.exchange(self, event: .responseHead(received))
    }

    func transferBody(_ from: any UpstreamTransfer, _ data: UnsafeRawBufferPointer) -> Int {
        guard current(from), let driver else { return data.count }
        guard driver.exchange(self, responseBody: data) else {
            // The client is slow: the transfer keeps the bytes and stops reading the origin until resumed.
            from.paused = true
            return proxyctl_writefunc_pause()
        }
        return data.count
    }

    func transferRead(_ from: any UpstreamTransfer, _ buffer: UnsafeMutableRawBufferPointer) -> Int {
        guard current(from) else { return 0 }
        let count = body.read(at: from.uploadOffset, into: buffer)
        if count > 0 {
            from.uploadOffset += count
            up += count
            driver?.exchange(self, bodyTaken: count)
            return count
        }
        if body.complete { return 0 }
        uploadPaused = true
        driver?.exchange(self, bodyTaken: 0)
        return proxyctl_readfunc_pause()
    }

    func transferSeek(_ from: any UpstreamTransfer, _ offset: Int) -> Bool {
        guard current(from), body.replayable, offset <= body.stored else { return false }
        from.uploadOffset = offset
        return true
    }

    /// The client's trailer fields after a body of unknown length (an HTTP/2 client's; an HTTP/1.1 client's end
    /// with its chunked framing).
    var requestTrailers: [H2Field] = []

    func transferRequestTrailers(_ from: any UpstreamTransfer) -> [H2Field] {
        current(from) ? requestTrailers : []
    }

    func transferFinished(_ from: any UpstreamTransfer, _ failure: UpstreamFailure?, detail: String) {
        guard current(from) else { return }
        transfer = nil
        driver?.exchange(self, event: .transferFinished(failure, detail: detail))
    }
}
