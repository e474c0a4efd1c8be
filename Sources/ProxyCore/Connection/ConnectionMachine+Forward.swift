/// The next hop: resolving, connecting, an upstream proxy's CONNECT, tunnels, and forwarded exchanges.
extension ConnectionMachine {
    // MARK: - Connecting

    mutating func startConnect(_ purpose: Purpose, hop: HostPort, _ out: inout [Action]) {
        state = .connecting(Connecting(purpose: purpose, hop: hop))
        out.append(.readClient(false))
        out.append(.arm(.connect, milliseconds: settings.connectTimeout))
        out.append(.resolve(hop))
    }

    mutating func resolved(_ outcome: ResolveOutcome, _ out: inout [Action]) {
        guard case .connecting(var connecting) = state, connecting.addresses == nil else { return }
        switch outcome {
        case .addresses(let found) where !found.isEmpty:
            // A name (or an alias of an address) that leads back to this proxy would loop.
            if found.contains(where: { frontDoor.isLoop(HostPort(host: $0, port: connecting.hop.port, kind: .name)) }) {
                out.append(
                    .log(
                        LogLine(
                            .info,
                            "\(connecting.logTarget) status=508 error=proxy_loop_detected reason=\"\(connecting.hop) resolves to this proxy\""
                        )))
                leaveUpstream(&out)
                respond(.loopDetected(connecting.hop), headRequest: false, &out)
                return
            }
            connecting.addresses = found.count
            state = .connecting(connecting)
            tryNextAddress(&out)
        case .addresses, .notFound:
            answerConnectFailure(
                .dnsError(connecting.hop, reason: "no such host", viaProxy: connecting.viaProxy),
                log: connecting.logTarget, &out)
        case .failed(let reason):
            answerConnectFailure(
                .dnsError(connecting.hop, reason: reason, viaProxy: connecting.viaProxy), log: connecting.logTarget,
                &out)
        }
    }

    /// Connects to the next resolved address, or answers with the last attempt's failure.
    private mutating func tryNextAddress(_ out: inout [Action]) {
        guard case .connecting(var connecting) = state, let count = connecting.addresses else { return }
        if connecting.next < count {
            out.append(.connect(address: connecting.next))
            connecting.next += 1
            connecting.attempting = true
            state = .connecting(connecting)
            return
        }
        let hop = connecting.hop
        let answer: ProxyAnswer
        switch connecting.lastFailure {
        case .timedOut:
            answer = .connectTimeout(hop, milliseconds: settings.connectTimeout, viaProxy: connecting.viaProxy)
        case .refused: answer = .connectRefused(hop, viaProxy: connecting.viaProxy)
        case .other(let reason), .noSocket(let reason):
            answer = .connectFailed(hop, reason: reason, viaProxy: connecting.viaProxy)
        case nil: answer = .connectFailed(hop, reason: "unreachable", viaProxy: connecting.viaProxy)
        }
        answerConnectFailure(answer, log: connecting.logTarget, &out)
    }

    mutating func connectFailed(_ failure: ConnectFailure, _ out: inout [Action]) {
        guard case .connecting(var connecting) = state, connecting.attempting else { return }
        if case .noSocket = failure {} else { out.append(.closeUpstream) }
        connecting.attempting = false
        connecting.lastFailure = failure
        state = .connecting(connecting)
        tryNextAddress(&out)
    }

    mutating func connectTimedOut(_ connecting: Connecting, _ out: inout [Action]) {
        let answer: ProxyAnswer =
            connecting.addresses == nil
            ? .dnsTimeout(connecting.hop, milliseconds: settings.connectTimeout, viaProxy: connecting.viaProxy)
            : .connectTimeout(connecting.hop, milliseconds: settings.connectTimeout, viaProxy: connecting.viaProxy)
        answerConnectFailure(answer, log: connecting.logTarget, &out)
    }

    /// The next hop cannot be reached: log, drop whatever upstream connection exists, answer, close.
    mutating func answerConnectFailure(_ answer: ProxyAnswer, log target: String, _ out: inout [Action]) {
        let response = answer.response
        let type = response.proxyStatus?.error?.rawValue ?? "-"
        out.append(
            .log(
                LogLine(
                    .info,
                    "\(target) status=\(response.status) error=\(type) reason=\"\(response.proxyStatus?.details ?? "")\""
                )))
        leaveUpstream(&out)
        respond(answer, headRequest: false, &out)
    }

    /// Closes the upstream connection of the current state and goes back to an upstream-less reading state,
    /// so that what follows (an answer, a close) starts from a state that holds none.
    mutating func leaveUpstream(_ out: inout [Action]) {
        if hasUpstream { out.append(.closeUpstream) }
        out.append(.disarm(.connect))
        state = .readingHead(ReadingHead(parser: Self.requestParser(frontDoor), deadlineArmed: false, kept: nil))
    }

    mutating func upstreamConnected(_ out: inout [Action]) {
        guard case .connecting(let connecting) = state, connecting.attempting else { return }
        out.append(.disarm(.connect))
        switch connecting.purpose {
        case .tunnel(let target, let proxy?):
            state = .proxyHandshake(
                ProxyHandshake(
                    target: target, proxy: proxy,
                    parser: HTTPHeadParser(kind: .response, limits: settings.headLimits)))
            out.append(.writeUpstream(proxy.connectRequest(to: target)))
            out.append(.arm(.connect, milliseconds: settings.connectTimeout))
        case .tunnel(let target, nil):
            out.append(.writeClient(Self.connectEstablished))
            startTunnel(label: .connect(target), status: 200, &out)
        case .forward(let forward, let retried):
            beginForwarding(forward, hop: connecting.hop, reused: false, retried: retried, &out)
        }
    }

    static let connectEstablished = Array("HTTP/1.1 200 Connection established\r\n\r\n".utf8)

    /// Both sides are ready: hand them to a tunnel, with what their buffers still hold.
    mutating func startTunnel(label: TunnelLabel, status: Int, _ out: inout [Action]) {
        state = .handedOff
        for timer in ConnectionTimer.allCases { out.append(.disarm(timer)) }
        out.append(.startTunnel(label: label, status: status))
    }

    /// The upstream proxy's answer to our CONNECT.
    mutating func readProxyAnswer(_ upstream: some ByteView, _ out: inout [Action]) {
        guard case .proxyHandshake(var handshake) = state, upstream.count > upstreamOffset else { return }
        let (outcome, taken) = upstream.parseHead(&handshake.parser, from: upstreamOffset)
        if taken > 0 {
            out.append(.consumeUpstream(taken))
            upstreamOffset += taken
        }
        let hop = handshake.proxy.address
        let target = "CONNECT \(handshake.target)"
        switch outcome {
        case .needMore:
            state = .proxyHandshake(handshake)
        case .failed:
            answerConnectFailure(.upstreamProxyMalformedAnswer(hop), log: target, &out)
        case .complete(let head, _):
            if let refusal = handshake.proxy.connectRefusal(status: head.status) {
                answerConnectFailure(refusal, log: target, &out)
            } else {
                out.append(.writeClient(Self.connectEstablished))
                startTunnel(label: .connect(handshake.target), status: 200, &out)
            }
        }
    }

    // MARK: - Forwarding

    mutating func beginForwarding(
        _ forward: FrontDoorDecision.Forward, hop: HostPort, reused: Bool, retried: Bool,
        _ out: inout [Action]
    ) {
        var forwarding = Forwarding(
            forward: forward, hop: hop, started: now,
            request: BodyProgress(forward.framing == .untilClose ? .none : forward.framing),
            parser: HTTPHeadParser(kind: .response, limits: settings.headLimits), reused: reused, retried: retried)
        forwarding.bytesUp = forward.head.count
        state = .forwarding(forwarding)
        out.append(.writeUpstream(forward.head))
        out.append(.arm(.idle, milliseconds: settings.idleTimeout))
        out.append(.readClient(true))
    }

    /// Client body bytes to the upstream, following the request's framing.
    mutating func pumpRequestBody(_ client: some ByteView, _ out: inout [Action]) {
        guard case .forwarding(var forwarding) = state else { return }
        if forwarding.request.isComplete {
            // Pipelined requests wait in the buffer until this response is done; not without bound.
            if client.count - clientOffset > settings.headLimits.maxHeadBytes { out.append(.readClient(false)) }
            return
        }
        // The payload is moved out (see `changeIntercepting`): its boxes are changed in place, not copied, and
        // it is put back on every way out.
        state = .modifying
        spans.removeAll(keepingCapacity: true)
        if let error = forwarding.request.take(from: client, at: clientOffset, into: &spans) {
            state = .forwarding(forwarding)
            out.append(.log(LogLine(.info, "bad request body reason=\"\(error.reason)\"")))
            if forwarding.clientSawResponse {
                abort(reason: "malformed request body", &out)
            } else {
                leaveUpstream(&out)
                respond(.badRequest(error), headRequest: false, &out)
            }
            return
        }
        for span in spans {
            switch span {
            case .pass(let count):
                out.append(.moveClientToUpstream(count))
                forwarding.bytesUp += count
                clientOffset += count
            case .drop(let count):
                out.append(.consumeClient(count))
                clientOffset += count
            }
        }
        state = .forwarding(forwarding)
    }

    /// Reads the response head, then passes the body on.
    mutating func pumpResponse(_ upstream: some ByteView, _ out: inout [Action]) {
        guard case .forwarding(var forwarding) = state else { return }
        // Moved out so that its boxes (the head parser, the body's progress) change in place; every way out
        // puts it back (or leaves the state).
        state = .modifying
        while forwarding.response == nil {
            guard upstream.count > upstreamOffset else {
                state = .forwarding(forwarding)
                return
            }
            let (outcome, taken) = upstream.parseHead(&forwarding.parser, from: upstreamOffset)
            if taken > 0 {
                out.append(.consumeUpstream(taken))
                upstreamOffset += taken
                forwarding.headBytesRead += taken
            }
            switch outcome {
            case .needMore:
                state = .forwarding(forwarding)
                return
            case .failed(let error):
                state = .forwarding(forwarding)
                return badResponse(
                    error.code == .headTooLarge
                        ? .responseHeadTooLarge(forwarding.hop)
                        : .invalidResponse(forwarding.hop, reason: error.reason), &out)
            case .complete(let head, _):
                forwarding.parser.reset()
                let semantics: ResponseSemantics
                switch MessageSemantics.response(
                    head, requestMethod: forwarding.forward.method, upgradeRequested: forwarding.forward.upgrade)
                {
                case .failure(let error):
                    state = .forwarding(forwarding)
                    return badResponse(.invalidResponse(forwarding.hop, reason: error.reason), &out)
                case .success(let checked): semantics = checked
                }
                forwarding.status = head.status
                if head.status == 407, let proxy = forwarding.forward.upstream {
                    // The upstream proxy wants credentials: that is our configuration's problem, and passing its
                    // Proxy-Authenticate on would make the client think we asked.
                    state = .forwarding(forwarding)
                    let answer = ProxyAnswer.upstreamProxyCredentials(
                        proxy.address, credentialsConfigured: proxy.username != nil)
                    out.append(
                        .log(
                            LogLine(
                                .info,
                                "\(forwarding.forward.method) \(LogText.url(forwarding.forward.url)) status=502 error=proxy_configuration_error reason=\"\(answer.response.proxyStatus?.details ?? "")\""
                            )))
                    leaveUpstream(&out)
                    return respond(answer, headRequest: false, &out)
                }
                if semantics.isInterim {
                    // 1xx (100 Continue, 103 Early Hints): pass on, then read the final response.
                    let interim = head.serialized(drop: { semantics.dropped.contains($0) })
                    out.append(.writeClient(interim))
                    forwarding.bytesDown += interim.count
                    forwarding.clientSawResponse = true
                    continue
                }
                forwarding.serverCloses = semantics.serverCloses
                forwarding.closeAfter =
                    !forwarding.forward.keepAlive || semantics.framing == .untilClose || clientEOF || draining
                    || semantics.switchesProtocols || !forwarding.request.isComplete
                var extra: [(name: String, value: String)] = []
                if forwarding.closeAfter && !semantics.switchesProtocols && head.version == .http1_1 {
                    extra.append(("Connection", "close"))
                }
                let outgoing = head.serialized(drop: { semantics.dropped.contains($0) }, extra: extra)
                out.append(.writeClient(outgoing))
                forwarding.bytesDown += outgoing.count
                forwarding.clientSawResponse = true
                if semantics.switchesProtocols {
                    state = .forwarding(forwarding)
                    logForwarded(forwarding, note: "switched protocols", &out)
                    return startTunnel(
                        label: .request("\(forwarding.forward.method) \(LogText.url(forwarding.forward.url))"),
                        status: 101,
                        &out)
                }
                forwarding.response = BodyProgress(semantics.framing)
            }
        }
        var body = forwarding.response!
        spans.removeAll(keepingCapacity: true)
        if let error = body.take(from: upstream, at: upstreamOffset, into: &spans) {
            forwarding.response = body
            state = .forwarding(forwarding)
            return badResponse(.invalidResponse(forwarding.hop, reason: error.reason), &out)
        }
        for span in spans {
            switch span {
            case .pass(let count):
                out.append(.moveUpstreamToClient(count))
                forwarding.bytesDown += count
                upstreamOffset += count
            case .drop(let count):
                out.append(.consumeUpstream(count))
                upstreamOffset += count
            }
        }
        forwarding.response = body
        if body.isComplete {
            // Bytes after the end of the response: the upstream connection is out of step.
            if upstream.count > upstreamOffset { forwarding.serverCloses = true }
            state = .forwarding(forwarding)
            finishResponse(&out)
        } else {
            state = .forwarding(forwarding)
        }
    }

    /// A response that cannot be passed on: 502 when nothing of it reached the client, else the end.
    private mutating func badResponse(_ answer: ProxyAnswer, _ out: inout [Action]) {
        guard case .forwarding(let forwarding) = state else { return }
        let details = answer.response.proxyStatus?.details ?? ""
        out.append(
            .log(
                LogLine(
                    .info,
                    "\(forwarding.forward.method) \(LogText.url(forwarding.forward.url)) status=502 error=\(answer.response.proxyStatus?.error?.rawValue ?? "http_protocol_error") reason=\"\(details)\""
                )))
        leaveUpstream(&out)
        if forwarding.clientSawResponse {
            closeAfterFlush(&out)
        } else {
            respond(answer, headRequest: false, &out)
        }
    }

    /// The response is complete. The connection goes on when the request body is complete too.
    mutating func finishResponse(_ out: inout [Action]) {
        guard case .forwarding(var forwarding) = state else { return }
        if !forwarding.request.isComplete {
            // The origin answered before the whole body arrived (an early 413, say): the rest of the request
            // cannot be told apart from a next request, so the connection ends here.
            forwarding.closeAfter = true
            forwarding.serverCloses = true
        }
        logForwarded(forwarding, note: nil, &out)
        // Shutting down: a connection that finished its exchange is not kept for another one.
        if forwarding.closeAfter || draining {
            closeAfterFlush(&out)
            return
        }
        if forwarding.serverCloses {
            out.append(.closeUpstream)
            nextRequest(kept: nil, &out)
        } else {
            // Keep the upstream connection for the next request to the same next hop; watch it for a close.
            out.append(.arm(.upstreamKeepAlive, milliseconds: settings.keepAliveTimeout))
            nextRequest(kept: forwarding.hop, &out)
        }
    }

    func logForwarded(_ forwarding: Forwarding, note: String?, _ out: inout [Action]) {
        var line = LogLineBuilder()
        line.append(string: forwarding.forward.method)
        line.append(" ")
        line.append(url: forwarding.forward.url)
        line.append(" status=")
        line.append(forwarding.status)
        line.append(" up=")
        line.append(forwarding.bytesUp)
        line.append(" down=")
        line.append(forwarding.bytesDown)
        line.append(" duration=")
        line.append(duration: now - forwarding.started)
        if let note {
            line.append(" note=\"")
            line.append(string: note)
            line.append("\"")
        }
        out.append(.log(LogLine(.info, line)))
        out.append(
            .requestFinished(
                RequestOutcome(
                    kind: .passthrough, status: forwarding.status, up: forwarding.bytesUp, down: forwarding.bytesDown,
                    milliseconds: now - forwarding.started)))
    }

    // MARK: - Upstream events

    mutating func upstreamData(_ out: inout [Action]) {
        switch state {
        case .readingHead(var reading) where reading.kept != nil:
            // Bytes from an idle upstream connection: it is out of step and not reusable.
            reading.kept = nil
            state = .readingHead(reading)
            out.append(.disarm(.upstreamKeepAlive))
            out.append(.closeUpstream)
        case .intercepting(var intercepting) where intercepting.kept != nil:
            intercepting.kept = nil
            state = .intercepting(intercepting)
            out.append(.disarm(.upstreamKeepAlive))
            out.append(.closeUpstream)
        default:
            // The pump reads it.
            break
        }
    }

    mutating func upstreamEnded(
        reset: Bool, client: some ByteView, upstream: some ByteView, _ out: inout [Action]
    ) {
        switch state {
        case .readingHead(var reading) where reading.kept != nil:
            // An idle kept-alive connection went away.
            reading.kept = nil
            state = .readingHead(reading)
            out.append(.disarm(.upstreamKeepAlive))
            out.append(.closeUpstream)
        case .intercepting(var intercepting) where intercepting.kept != nil:
            intercepting.kept = nil
            state = .intercepting(intercepting)
            out.append(.disarm(.upstreamKeepAlive))
            out.append(.closeUpstream)
        case .proxyHandshake(let handshake):
            answerConnectFailure(
                .upstreamProxyClosed(handshake.proxy.address), log: "CONNECT \(handshake.target)", &out)
        case .forwarding:
            // What is still in the buffer belongs to the response: read it first.
            pump(client: client, upstream: upstream, &out)
            guard case .forwarding(var forwarding) = state else { return }
            if !reset, var body = forwarding.response, body.framing == .untilClose {
                // The end of a read-until-close body.
                body.senderClosed()
                forwarding.response = body
                forwarding.serverCloses = true
                state = .forwarding(forwarding)
                finishResponse(&out)
            } else if forwarding.response == nil && forwarding.headBytesRead == 0 && forwarding.reused
                && !forwarding.retried
                && RetryPolicy.mayResend(method: forwarding.forward.method, framing: forwarding.forward.framing)
            {
                // A kept-alive connection the origin had closed before this request reached it: an idempotent
                // request without a body is sent again on a new connection (RFC 9110 §9.2.2).
                out.append(
                    .log(
                        LogLine(
                            .info,
                            "\(forwarding.forward.method) \(LogText.url(forwarding.forward.url)) note=\"the kept-alive connection to \(forwarding.hop) closed unanswered; sent again on a new one\""
                        )))
                out.append(.closeUpstream)
                startConnect(.forward(forwarding.forward, retried: true), hop: forwarding.hop, &out)
            } else if !forwarding.clientSawResponse {
                var reason = "\(forwarding.hop) closed the connection before sending a complete response"
                if forwarding.reused
                    && !RetryPolicy.mayResend(method: forwarding.forward.method, framing: forwarding.forward.framing)
                {
                    reason += "; a \(forwarding.forward.method) is not sent twice"
                }
                out.append(
                    .log(
                        LogLine(
                            .info,
                            "\(forwarding.forward.method) \(LogText.url(forwarding.forward.url)) status=502 error=http_response_incomplete reason=\"\(reason)\""
                        )))
                leaveUpstream(&out)
                respond(.responseIncomplete(forwarding.hop), headRequest: false, &out)
            } else {
                logForwarded(forwarding, note: reset ? "upstream reset the connection" : "response incomplete", &out)
                leaveUpstream(&out)
                if reset {
                    // The client must not take what it got for the whole response.
                    for timer in ConnectionTimer.allCases { out.append(.disarm(timer)) }
                    state = .closed
                    out.append(.resetClient)
                } else {
                    closeAfterFlush(&out)
                }
            }
        default:
            break
        }
    }

    mutating func interceptionFailed(_ origin: OriginConfig, reason: String, _ out: inout [Action]) {
        guard case .handedOff = state, case .frontDoor = role else { return }
        out.append(.log(LogLine(.warn, "cannot set up TLS for \(origin.url): \(reason)")))
        state = .readingHead(ReadingHead(parser: Self.requestParser(frontDoor), deadlineArmed: false, kept: nil))
        respond(.tlsSetupFailed(origin: origin.url, reason: reason), headRequest: false, &out)
    }
}

extension ConnectionMachine.Connecting {
    var viaProxy: Bool {
        switch purpose {
        case .tunnel(_, let proxy): proxy != nil
        case .forward(let forward, _): forward.upstream != nil
        }
    }

    /// How the request appears in the log line of a failure.
    var logTarget: String {
        switch purpose {
        case .tunnel(let target, _): "CONNECT \(target)"
        case .forward(let forward, _): "\(forward.method) \(LogText.url(forward.url))"
        }
    }
}
