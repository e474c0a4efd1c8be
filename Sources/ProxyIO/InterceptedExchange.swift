import CCurl
import CLibevent
import Foundation
import ProxyCore
import ProxyOAuth

/// The connection an intercepted exchange answers on.
protocol InterceptOwner: AnyObject {
    /// The client's bufferevent (TLS or plain).
    var clientBufferevent: OpaquePointer? { get }
    var connectionID: UInt64 { get }
    var peer: String { get }
    /// The exchange is over; the connection reads the next request, or closes when `close`.
    func exchangeFinished(close: Bool)
}

/// One request to a protected origin: read (and keep) the body, attach the token, send it upstream through
/// libcurl, and stream the response back, following `AuthExchange` (refresh once and replay once on a 401,
/// one DPoP nonce retry, step-up surfaced).
final class InterceptedExchange {
    unowned let owner: any InterceptOwner
    unowned let server: ProxyServer
    let request: InterceptedRequest
    let origin: OriginConfig
    let body: RequestBody
    let started = EventLoop.monotonicMilliseconds()
    /// nil when the client's own Authorization is kept and nothing is attached.
    private var machine: AuthExchange?
    private var tokens: TokenSet?
    private var transfer: UpstreamTransfer?
    private var bodyRemaining: UInt64 = 0
    private var chunks: ChunkedScanner?
    private var begun = false
    private(set) var finished = false

    // The upstream response being received.
    private var status = 0
    private var reason: [UInt8]?
    private var fields: [(name: String, value: [UInt8])] = []
    private var headDone = false
    private var delivering = false
    private var discarding = false
    private var clientFraming = ResponseFramingToClient.none
    private var pendingAction: AuthExchange.Action?
    private var deliveredStatus = 0
    private var uploadOffset = 0
    var upstreamPaused = false
    private var uploadPaused = false

    // For the log line.
    private var bytesUp = 0
    private var bytesDown = 0
    private var attempts = 0
    private var refreshed = false
    private var nonceRetried = false

    init(owner: any InterceptOwner, server: ProxyServer, request: InterceptedRequest, origin: OriginConfig) {
        self.owner = owner
        self.server = server
        self.request = request
        self.origin = origin
        self.body = RequestBody(
            memoryLimit: server.settings.replayMemory, spoolLimit: server.settings.replaySpool,
            spoolDirectory: server.spoolDirectory)
        switch request.framing {
        case .none, .untilClose:
            body.finish()
        case .contentLength(let length):
            bodyRemaining = length
            if length > UInt64(body.spoolLimit) { body.streamFromTheStart() }
        case .chunked:
            chunks = ChunkedScanner()
        }
    }

    private var client: OpaquePointer? { owner.clientBufferevent }
    private static let continueResponse = Array("HTTP/1.1 100 Continue\r\n\r\n".utf8)

    /// Starts the exchange: reads what body bytes are already there, and sends when it may.
    func start() {
        if request.expectsContinue && !body.complete, let client {
            // RFC 9110 §10.1.1: this proxy reads the body before going upstream, so it answers the
            // expectation itself instead of leaving the client waiting.
            Buffers.append(Self.continueResponse, to: bufferevent_get_output(client))
        }
        pumpBody()
        beginIfReady()
    }

    // MARK: - Request body

    /// Moves body bytes from the client into `body`, decoding chunked framing. Called on client reads.
    func pumpBody() {
        guard !body.complete, let client else { return }
        let input = bufferevent_get_input(client)
        while !body.complete && Buffers.length(input) > 0 {
            if var scanner = chunks {
                if scanner.pendingData == 0 {
                    var consumed = 0
                    var failure: HTTPParseError? = nil
                    Buffers.forEachSegment(input) { segment in
                        let (taken, outcome) = scanner.scanFraming(segment)
                        consumed += taken
                        if case .failed(let error) = outcome {
                            failure = error
                            return false
                        }
                        return taken == segment.count && scanner.pendingData == 0 && !scanner.isFinished
                    }
                    evbuffer_drain(input, consumed)
                    chunks = scanner
                    if let failure { return fail(InterceptRefusal.badRequest(failure).response) }
                    if scanner.isFinished { body.finish() }
                    continue
                }
                let count = Int(min(scanner.pendingData, UInt64(Buffers.length(input))))
                if !take(count, from: input) { return }
                scanner.skipData(count)
                chunks = scanner
            } else {
                let count = Int(min(bodyRemaining, UInt64(Buffers.length(input))))
                if !take(count, from: input) { return }
                bodyRemaining -= UInt64(count)
                if bodyRemaining == 0 { body.finish() }
            }
        }
        if body.streaming && body.queued >= server.highWater {
            // The upstream is slower than the client: stop reading until the transfer drains the queue.
            bufferevent_disable(client, Int16(EV_READ))
        }
        beginIfReady()
        if uploadPaused && (body.queued > 0 || body.complete), let transfer {
            uploadPaused = false
            server.curl.resume(transfer)
        }
    }

    /// Copies `count` bytes from the client's input into the body.
    private func take(_ count: Int, from input: OpaquePointer?) -> Bool {
        var remaining = count
        var failed = false
        Buffers.forEachSegment(input) { segment in
            let piece = UnsafeRawBufferPointer(rebasing: segment.prefix(remaining))
            do { try body.append(piece) } catch {
                failed = true
                return false
            }
            remaining -= piece.count
            return remaining > 0
        }
        evbuffer_drain(input, count)
        if failed {
            fail(
                ProxyResponse(
                    status: 500,
                    proxyStatus: ProxyStatus(error: .proxyInternalError, details: "cannot keep the request body"),
                    message: "proxyctl: cannot write the request body to \(server.spoolDirectory)", close: true))
            return false
        }
        return true
    }

    private func beginIfReady() {
        guard !begun, body.complete || body.streaming else { return }
        begun = true
        let attach = origin.clientAuthorization == .replace || !request.clientAuthorization
        guard attach else {
            send(tokens: nil)
            return
        }
        var exchange = AuthExchange(
            origin: origin.url, provider: origin.provider, replayable: body.replayable,
            knownNonce: server.resourceNonces.nonce(for: origin.url))
        let first = exchange.start()
        machine = exchange
        perform(first)
    }

    // MARK: - The auth exchange

    private func perform(_ action: AuthExchange.Action) {
        switch action {
        case .getTokens:
            server.tokens.tokens(origin.provider) { [self] result in
                switch result {
                case .success(let fresh):
                    tokens = fresh
                    handle(.tokens(generation: fresh.generation))
                case .failure(let error):
                    handle(.tokensFailed(error.tokenFailure))
                }
            }
        case .send(_, let nonce):
            send(tokens: tokens, nonce: nonce)
        case .refresh(let generation):
            refreshed = true
            server.tokens.refresh(origin.provider, replacing: generation) { [self] result in
                switch result {
                case .success(let fresh):
                    tokens = fresh
                    handle(.refreshed(generation: fresh.generation))
                case .failure(let error):
                    handle(.refreshFailed(error.tokenFailure))
                }
            }
        case .deliver(let proxyStatus):
            deliverHead(proxyStatus: proxyStatus)
        case .respond(let response):
            if response.status == 401 {
                server.signInNeeded(provider: origin.provider, origin: origin.url, reason: response.message)
            }
            fail(response)
        }
    }

    private func handle(_ event: AuthExchange.Event) {
        guard !finished, var exchange = machine else { return }
        let action = exchange.handle(event)
        machine = exchange
        perform(action)
    }

    // MARK: - Upstream

    private func send(tokens: TokenSet?, nonce: String? = nil) {
        guard !finished else { return }
        attempts += 1
        status = 0
        reason = nil
        fields = []
        headDone = false
        discarding = false
        uploadOffset = 0
        let transfer = UpstreamTransfer(exchange: self)
        self.transfer = transfer
        transfer.setURL(origin.url + request.target)
        var headers = request.upstreamFields
        if let tokens {
            headers.append(("Authorization", Array("\(tokens.tokenType) \(tokens.accessToken)".utf8)))
            if tokens.tokenType == "DPoP" {
                // RFC 9449 §7: a fresh proof for every request, replays included, bound to the token (ath).
                guard let key = server.dpopKey(for: origin.provider, thumbprint: tokens.dpopThumbprint) else {
                    return fail(
                        ProxyResponse(
                            status: 401,
                            proxyStatus: ProxyStatus(
                                error: .httpRequestDenied,
                                details: "sign-in needed: run proxyctl login \(origin.provider)"),
                            message:
                                "proxyctl: the DPoP key for \(origin.provider) is missing; run: proxyctl login \(origin.provider)"
                        ))
                }
                do {
                    let proof = try key.proof(
                        method: request.method, url: origin.url + request.target, accessToken: tokens.accessToken,
                        nonce: nonce, now: Int64(time(nil)))
                    headers.append(("DPoP", Array(proof.utf8)))
                } catch {
                    return fail(
                        ProxyResponse(
                            status: 500,
                            proxyStatus: ProxyStatus(error: .proxyInternalError, details: "cannot sign a DPoP proof"),
                            message: "proxyctl: cannot sign a DPoP proof: \(error)", close: true))
                }
            }
        }
        // libcurl adds fields of its own unless told not to: keep the request as the client made it.
        headers.append(("Expect", []))
        if !headers.contains(where: { $0.name.lowercased() == "accept" }) { headers.append(("Accept", [])) }
        let hasBody = request.framing != .none
        if hasBody && !headers.contains(where: { $0.name.lowercased() == "content-type" }) {
            headers.append(("Content-Type", []))
        }
        transfer.setHeaders(headers)
        let easy = transfer.easy
        switch request.method {
        case "GET" where !hasBody:
            _ = proxyctl_easy_setopt_long(easy, CURLOPT_HTTPGET, 1)
        case "HEAD" where !hasBody:
            _ = proxyctl_easy_setopt_long(easy, CURLOPT_NOBODY, 1)
        default:
            if hasBody {
                _ = proxyctl_easy_setopt_long(easy, CURLOPT_POST, 1)
                let size: curl_off_t = body.complete && !body.streaming ? curl_off_t(body.stored) : -1
                _ = proxyctl_easy_setopt_off(easy, CURLOPT_POSTFIELDSIZE_LARGE, size)
                transfer.enableUpload()
            }
            if request.method != "POST" || !hasBody {
                _ = proxyctl_easy_setopt_string(easy, CURLOPT_CUSTOMREQUEST, request.method)
            }
        }
        _ = proxyctl_easy_setopt_long(
            easy, CURLOPT_HTTP_VERSION,
            origin.scheme == "https" ? CURL_HTTP_VERSION_2TLS : CURL_HTTP_VERSION_1_1)
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_PIPEWAIT, 1)
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_BUFFERSIZE, 256 * 1024)
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_CONNECTTIMEOUT_MS, server.settings.connectTimeout)
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_LOW_SPEED_LIMIT, 1)
        _ = proxyctl_easy_setopt_long(easy, CURLOPT_LOW_SPEED_TIME, max(1, server.settings.idleTimeout / 1000))
        if let caFile = origin.caFile { _ = proxyctl_easy_setopt_string(easy, CURLOPT_CAINFO, caFile) }
        if let fixed = server.settings.resolve[origin.authority.host] {
            transfer.setResolve(["\(origin.authority.host):\(origin.authority.port):\(fixed)"])
        }
        if let proxy = server.frontDoor.upstream(for: origin.authority) {
            _ = proxyctl_easy_setopt_string(easy, CURLOPT_PROXY, "http://\(proxy.address)")
            if let user = proxy.username {
                _ = proxyctl_easy_setopt_string(easy, CURLOPT_PROXYUSERNAME, user)
                _ = proxyctl_easy_setopt_string(easy, CURLOPT_PROXYPASSWORD, proxy.password ?? "")
            }
        } else {
            _ = proxyctl_easy_setopt_string(easy, CURLOPT_PROXY, "")
        }
        server.curl.add(transfer)
    }

    /// CURLOPT_HEADERFUNCTION: the status line, field lines and the blank line of each response.
    func upstreamHeader(_ line: UnsafeRawBufferPointer) -> Bool {
        if headDone { return true }  // trailers after the body are dropped
        // Bytes, not Characters ("\r\n" is one Character in Swift), and no intermediate strings: this runs
        // for every header line of every response.
        var end = line.count
        while end > 0 && (line[end - 1] == 0x0A || line[end - 1] == 0x0D) { end -= 1 }
        if end == 0 {
            // 1xx answers are libcurl's business (it sent the body without Expect anyway).
            if status >= 200 || status == 0 {
                headDone = true
                responseHead()
            }
            return true
        }
        if end > 5 && line[0] == UInt8(ascii: "H") && line[1] == UInt8(ascii: "T") && line[2] == UInt8(ascii: "T")
            && line[3] == UInt8(ascii: "P") && line[4] == UInt8(ascii: "/")
        {
            // "HTTP/1.1 200 OK" or "HTTP/2 200": the code after the first space, the reason (HTTP/1) after it.
            var index = 5
            while index < end && line[index] != 0x20 { index += 1 }
            var code = 0
            var cursor = index + 1
            while cursor < end, line[cursor] >= 0x30, line[cursor] <= 0x39, cursor < index + 4 {
                code = code * 10 + Int(line[cursor] - 0x30)
                cursor += 1
            }
            status = cursor == index + 4 ? code : 0
            reason =
                line[5] == UInt8(ascii: "1") && cursor < end
                ? Array(UnsafeRawBufferPointer(rebasing: line[(cursor + 1)..<end])) : nil
            fields.removeAll(keepingCapacity: true)
            return true
        }
        var colon = 0
        while colon < end && line[colon] != UInt8(ascii: ":") { colon += 1 }
        guard colon < end else { return true }
        var valueStart = colon + 1
        while valueStart < end && (line[valueStart] == 0x20 || line[valueStart] == 0x09) { valueStart += 1 }
        var valueEnd = end
        while valueEnd > valueStart && (line[valueEnd - 1] == 0x20 || line[valueEnd - 1] == 0x09) { valueEnd -= 1 }
        fields.append(
            (
                String(decoding: UnsafeRawBufferPointer(rebasing: line[0..<colon]), as: UTF8.self),
                Array(UnsafeRawBufferPointer(rebasing: line[valueStart..<valueEnd]))
            ))
        return true
    }

    private func responseHead() {
        guard status >= 100 && status <= 999 else {
            discarding = true
            pendingAction = nil
            failAfterTransfer = ProxyResponse(
                status: 502,
                proxyStatus: ProxyStatus(
                    error: .httpProtocolError, details: "the origin's status line could not be read",
                    nextHop: origin.authority.description),
                message: "proxyctl: \(origin.url) sent an unreadable status line", close: true)
            return
        }
        guard var exchange = machine else {
            deliverHead(proxyStatus: nil)
            return
        }
        let challenges = ChallengeParser.parse(
            fields.filter { $0.name.lowercased() == "www-authenticate" }.map {
                String(decoding: $0.value, as: UTF8.self)
            })
        let nonce = fields.last { $0.name.lowercased() == "dpop-nonce" }.map {
            String(decoding: $0.value, as: UTF8.self)
        }
        server.resourceNonces.remember(nonce, for: origin.url)
        let action = exchange.handle(.response(status: status, challenges: challenges, dpopNonce: nonce))
        machine = exchange
        switch action {
        case .deliver(let proxyStatus):
            if let challenge = exchange.stepUp { server.stepUpRequired(origin: origin, challenge: challenge) }
            deliverHead(proxyStatus: proxyStatus)
        case .send, .refresh:
            // Retried once this transfer has ended; its body is not the client's business.
            if case .refresh = action { refreshed = true } else { nonceRetried = true }
            discarding = true
            pendingAction = action
        case .getTokens, .respond:
            perform(action)
        }
    }

    private func deliverHead(proxyStatus: ProxyStatus?) {
        guard let client else { return }
        delivering = true
        deliveredStatus = status
        let close = !request.keepAlive || server.draining
        var extra: [(name: String, value: String)] = []
        if let proxyStatus { extra.append(("Proxy-Status", proxyStatus.fieldValue)) }
        let (head, framing) = MessageSemantics.interceptedResponseHead(
            status: status, reason: reason, fields: fields, requestMethod: request.method, close: close, extra: extra)
        clientFraming = framing
        Buffers.append(head, to: bufferevent_get_output(client))
        bytesDown += head.count
    }

    /// CURLOPT_WRITEFUNCTION: response body bytes.
    func upstreamBody(_ data: UnsafeRawBufferPointer) -> Int {
        if discarding || !delivering { return data.count }
        guard let client else { return 0 }
        let output = bufferevent_get_output(client)
        if Buffers.length(output) >= server.highWater {
            // A slow client pauses the upstream transfer; the client's write callback resumes it.
            upstreamPaused = true
            bufferevent_setwatermark(client, Int16(EV_WRITE), server.highWater / 2, 0)
            return proxyctl_writefunc_pause()
        }
        if data.isEmpty { return 0 }
        switch clientFraming {
        case .none:
            break
        case .contentLength:
            evbuffer_add(output, data.baseAddress, data.count)
        case .chunked:
            let size = String(data.count, radix: 16) + "\r\n"
            Buffers.append(Array(size.utf8), to: output)
            evbuffer_add(output, data.baseAddress, data.count)
            evbuffer_add(output, "\r\n", 2)
        }
        bytesDown += data.count
        return data.count
    }

    /// The client caught up: let the transfer continue.
    func clientDrained() {
        if upstreamPaused, let transfer {
            upstreamPaused = false
            server.curl.resume(transfer)
        }
    }

    /// CURLOPT_READFUNCTION: request body bytes for the transfer.
    func upstreamRead(_ buffer: UnsafeMutableRawBufferPointer) -> Int {
        let count = body.read(at: uploadOffset, into: buffer)
        if count > 0 {
            uploadOffset += count
            bytesUp += count
            if body.streaming && body.queued < server.highWater / 2, let client {
                bufferevent_enable(client, Int16(EV_READ))
            }
            return count
        }
        if body.complete { return 0 }
        uploadPaused = true
        if let client { bufferevent_enable(client, Int16(EV_READ)) }
        return proxyctl_readfunc_pause()
    }

    /// CURLOPT_SEEKFUNCTION: libcurl rewinds to send the body again (HTTP/2 retry, say).
    func upstreamSeek(_ offset: Int) -> Bool {
        guard body.replayable, offset <= body.stored else { return false }
        uploadOffset = offset
        return true
    }

    /// An answer of our own to give once the transfer has ended (the response could not be used).
    private var failAfterTransfer: ProxyResponse?

    func upstreamFinished(_ code: CURLcode, errorText: String) {
        transfer = nil
        if let response = failAfterTransfer {
            failAfterTransfer = nil
            return fail(response)
        }
        server.logger.debug(
            "conn=\(owner.connectionID) upstream transfer ended: code=\(code.rawValue) status=\(status) headDone=\(headDone) delivering=\(delivering) discarding=\(discarding)"
        )
        if discarding, let action = pendingAction {
            pendingAction = nil
            perform(action)
            return
        }
        if delivering {
            if code == CURLE_OK {
                if clientFraming == .chunked, let client {
                    evbuffer_add(bufferevent_get_output(client), "0\r\n\r\n", 5)
                }
                complete(close: !request.keepAlive || server.draining, note: nil)
            } else {
                // The response is cut short: the client sees the connection close before its end.
                complete(close: true, note: "upstream failed mid-response: \(errorText)")
            }
            return
        }
        fail(Self.upstreamFailure(code, errorText: errorText, origin: origin))
    }

    /// The answer for a transfer that failed before any response arrived.
    static func upstreamFailure(_ code: CURLcode, errorText: String, origin: OriginConfig) -> ProxyResponse {
        let hop = origin.authority.description
        let (status, type, what): (Int, ProxyStatus.ErrorType, String)
        switch code {
        case CURLE_COULDNT_RESOLVE_HOST:
            (status, type, what) = (502, .dnsError, "cannot resolve \(origin.authority.host)")
        case CURLE_COULDNT_CONNECT: (status, type, what) = (502, .connectionRefused, "cannot connect to \(hop)")
        case CURLE_OPERATION_TIMEDOUT: (status, type, what) = (504, .connectionTimeout, "\(hop) did not answer in time")
        case CURLE_PEER_FAILED_VERIFICATION, CURLE_SSL_CACERT_BADFILE:
            (status, type, what) = (502, .tlsCertificateError, "the certificate of \(hop) does not verify")
        case CURLE_SSL_CONNECT_ERROR: (status, type, what) = (502, .tlsProtocolError, "TLS with \(hop) failed")
        case CURLE_GOT_NOTHING, CURLE_RECV_ERROR, CURLE_SEND_ERROR, CURLE_PARTIAL_FILE:
            (status, type, what) = (
                502, .httpResponseIncomplete, "\(hop) closed the connection without a complete response"
            )
        case CURLE_COULDNT_RESOLVE_PROXY, CURLE_PROXY:
            (status, type, what) = (502, .proxyConfigurationError, "the upstream proxy failed")
        default:
            (status, type, what) = (502, .proxyInternalError, "the request to \(hop) failed")
        }
        let detail = errorText.isEmpty ? what : "\(what): \(errorText)"
        return ProxyResponse(
            status: status, proxyStatus: ProxyStatus(error: type, details: detail, nextHop: hop),
            message: "proxyctl: \(detail)", close: true)
    }

    /// Answers the client ourselves (nothing of a response was sent yet) and ends the exchange.
    private func fail(_ response: ProxyResponse) {
        guard !finished else { return }
        if let transfer {
            server.curl.cancel(transfer)
            self.transfer = nil
        }
        if !delivering, let client {
            let bytes = response.serialized(headRequest: request.method == "HEAD")
            Buffers.append(bytes, to: bufferevent_get_output(client))
            bytesDown += bytes.count
            deliveredStatus = response.status
            let answeredBody = body.complete && request.keepAlive && !response.close && !server.draining
            complete(close: !answeredBody, note: response.proxyStatus?.details)
        } else {
            complete(close: true, note: response.proxyStatus?.details)
        }
    }

    private func complete(close: Bool, note: String?) {
        guard !finished else { return }
        finished = true
        log(note: note)
        // A body the client is still sending would be read as the next request: close instead.
        owner.exchangeFinished(close: close || !body.complete)
    }

    /// Stops the upstream transfer (the client went away or the proxy shuts down).
    func abort() {
        guard !finished else { return }
        finished = true
        if let transfer {
            server.curl.cancel(transfer)
            self.transfer = nil
        }
        log(note: "aborted")
    }

    private func log(note: String?) {
        let keptClient = begun && machine == nil
        let attached = tokens != nil && machine != nil
        let answered = !delivering && deliveredStatus != 0
        let (refreshed, nonceRetried, stepUp) = (self.refreshed, self.nonceRetried, machine?.stepUp != nil)
        server.count(origin: origin.url) { counts in
            counts.requests += 1
            if keptClient { counts.clientAuthorizationKept += 1 }
            if attached { counts.tokenAttached += 1 }
            if refreshed { counts.refreshed += 1 }
            if nonceRetried { counts.nonceRetried += 1 }
            if stepUp { counts.stepUps += 1 }
            if answered { counts.answeredByProxy += 1 }
        }
        guard server.logger.enabled(.info) else { return }
        let duration = EventLoop.monotonicMilliseconds() - started
        var line =
            "conn=\(owner.connectionID) client=\(owner.peer) \(request.method) \(origin.url)\(LogText.target(request.target)) status=\(deliveredStatus) up=\(bytesUp) down=\(bytesDown) duration=\(LogText.duration(duration)) intercepted=\(origin.provider)"
        if begun && machine == nil { line += " token=client" }
        if attempts > 1 { line += " attempts=\(attempts)" }
        if refreshed { line += " refreshed=1" }
        if nonceRetried { line += " nonce_retry=1" }
        if let note { line += " note=\"\(note)\"" }
        server.logger.info(line)
    }
}

/// The libcurl transfer of an intercepted request; forwards every callback to its exchange.
final class UpstreamTransfer: CurlTransfer {
    unowned let exchange: InterceptedExchange

    init(exchange: InterceptedExchange) {
        self.exchange = exchange
        super.init()
    }

    func enableUpload() {
        let context = Unmanaged.passUnretained(self).toOpaque()
        _ = proxyctl_easy_setopt_read_cb(easy, upstreamReadCallback)
        _ = proxyctl_easy_setopt_ptr(easy, CURLOPT_READDATA, context)
        _ = proxyctl_easy_setopt_seek_cb(easy, upstreamSeekCallback)
        _ = proxyctl_easy_setopt_ptr(easy, CURLOPT_SEEKDATA, context)
    }

    override func header(_ line: UnsafeRawBufferPointer) -> Bool { exchange.upstreamHeader(line) }
    override func body(_ data: UnsafeRawBufferPointer) -> Int { exchange.upstreamBody(data) }
    override func finish(_ code: CURLcode) {
        exchange.upstreamFinished(code, errorText: code == CURLE_OK ? "" : errorText(code))
    }
}

// CURLOPT_READFUNCTION: fill the buffer with request body bytes; CURL_READFUNC_PAUSE when none are there yet.
private let upstreamReadCallback:
    @convention(c) (UnsafeMutablePointer<CChar>?, Int, Int, UnsafeMutableRawPointer?) -> Int = {
        buffer, size, count, context in
        let transfer = Unmanaged<UpstreamTransfer>.fromOpaque(context!).takeUnretainedValue()
        return transfer.exchange.upstreamRead(UnsafeMutableRawBufferPointer(start: buffer, count: size * count))
    }

// CURLOPT_SEEKFUNCTION: 0 = done, 2 = cannot seek (the body streamed and is gone).
private let upstreamSeekCallback: @convention(c) (UnsafeMutableRawPointer?, curl_off_t, Int32) -> Int32 = {
    context, offset, origin in
    let transfer = Unmanaged<UpstreamTransfer>.fromOpaque(context!).takeUnretainedValue()
    guard origin == SEEK_SET else { return 2 }
    return transfer.exchange.upstreamSeek(Int(offset)) ? 0 : 2
}
