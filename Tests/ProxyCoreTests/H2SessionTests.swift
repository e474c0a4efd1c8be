import Testing

@testable import ProxyCore

/// HTTP/2 streams of a client inside an intercepted tunnel, as playbooks: header blocks and DATA counts in,
/// the exchange's outputs (what goes to the origin: `send`, with no token in it, only its generation) and the
/// client's header blocks out. `H2Playbook` checks the per-stream and per-connection rules after every step.
@Suite struct H2SessionPlaybooks {
    typealias Action = H2Session.Action

    static let origin = H2Playbook.origin
    static let key = TokenKey(provider: "corp")
    static let misdirected = ServerName.mismatch("evil.test", tunnel: origin.authority)!

    static func fields(_ pairs: (String, String)...) -> [H2Field] { H2Playbook.fields(pairs) }

    static func exchange(
        _ stream: Int32, _ output: ProtectedExchange.Output, _ origin: OriginConfig = Self.origin
    ) -> Action {
        .exchange(stream, output, origin)
    }

    /// The request the origin gets, with the playbook settings' timeouts.
    static func upstream(
        _ method: String, _ target: String, _ fields: [(String, String)], generation: Int64?,
        nonce: String? = nil, body: UpstreamRequest.Body = .none, attempt: Int = 1
    ) -> UpstreamRequest {
        UpstreamRequest(
            method: method, url: "https://api.test" + (target == "*" ? "/" : target),
            requestTarget: target == "*" ? "*" : nil, fields: fields.map { ($0.0, Array($0.1.utf8)) },
            credential: generation.map { UpstreamRequest.Credential(generation: $0, dpopNonce: nonce) }, body: body,
            http2: true, connectTimeout: 5_000, idleTimeout: 30_000, caFile: nil, upstreamProxy: nil,
            attempt: attempt)
    }

    static func record(
        _ method: String, _ target: String, status: Int, attempts: Int = 1, attached: Bool = true,
        refreshed: Bool = false, nonceRetried: Bool = false, stepUp: Bool = false, answeredByProxy: Bool = false,
        note: String? = nil, close: Bool = false, cutShort: Bool = false, proxyError: String? = nil
    ) -> ExchangeRecord {
        ExchangeRecord(
            method: method, origin: "https://api.test", provider: "corp", target: target, status: status,
            attempts: attempts, keptClientAuthorization: false, attached: attached, refreshed: refreshed,
            nonceRetried: nonceRetried, stepUp: stepUp, answeredByProxy: answeredByProxy, note: note, close: close,
            cutShort: cutShort, proxyError: proxyError)
    }

    /// The proxy's own answer as the client gets it: the fields `H2Semantics.answer` makes and the one-line body.
    static func answer(
        _ status: Int, proxyStatus: String, extra: [(String, String)] = [], message: String, headRequest: Bool = false
    ) -> (
        [H2Field], [UInt8]
    ) {
        let body = Array((message + "\n").utf8)
        let pairs =
            [(":status", String(status)), ("proxy-status", proxyStatus)] + extra + [
                ("content-type", "text/plain; charset=utf-8"), ("content-length", String(body.count)),
                ("cache-control", "no-store"),
            ]
        return (H2Playbook.fields(pairs), headRequest ? [] : body)
    }

    /// A GET that has its token and its transfer running.
    static func sending(_ path: String = "/x", stream: Int32 = 1) -> H2Playbook {
        var p = H2Playbook()
        p.request(stream, H2Playbook.request("GET", path))
        p.tokens(stream)
        _ = p.next()
        return p
    }

    /// Issue 31: a stream carrying another origin's placeholder is answered 403 without a transfer, and the audit
    /// log gets a refused use naming whose placeholder it was.
    @Test func anotherOriginsPlaceholderIsRefusedAndAudited() {
        let placeholder = "proxyctl-placeholder-ffeeddccbbaa99887766554433221100"
        var origin = H2Playbook.origin
        origin.placeholders = Placeholders([
            Placeholders.Entry(
                value: Array(placeholder.utf8), origin: "https://b.test", variable: "B_KEY", credential: "secret:b")
        ])
        var p = H2Playbook(origin: origin)
        p.request(1, H2Playbook.request("GET", "/steal", [("authorization", "Bearer \(placeholder)")]))
        _ = p.next()
        #expect(p.streams[1]?.status == 403 && p.streams[1]?.transfer == nil)
        #expect(p.refusals.map(\.refusal.origin) == ["https://b.test"])
        #expect(p.refusals.first?.origin == "https://api.test" && p.refusals.first?.target == "/steal")
    }

    // MARK: - One stream, start to end

    @Test func aGetStreamAttachesTheTokenAndDeliversTheResponseWithTrailers() {
        var p = H2Playbook()
        #expect(p.timers == [.keepAlive: 11_000])
        p.now = 1_500
        p.request(
            1,
            H2Playbook.request(
                "GET", "/me?x=1",
                [("host", "api.test"), ("accept", "*/*"), ("te", "trailers"), ("user-agent", "grpc-swift/1.0")]))
        #expect(p.next() == [Self.exchange(1, .bodyEnded), Self.exchange(1, .getTokens(key: Self.key))])
        #expect(p.timers == [.idle: 31_500], "the keep-alive timer gives way to the idle timer")
        #expect(p.session.activeStreams == 1 && p.session.requests == 1)

        p.tokens(1)
        #expect(
            p.next() == [
                Self.exchange(
                    1,
                    .send(
                        Self.upstream(
                            "GET", "/me?x=1",
                            [("accept", "*/*"), ("te", "trailers"), ("user-agent", "grpc-swift/1.0")],
                            generation: 1)))
            ])

        p.transferHead(
            1, "HTTP/1.1 200 \r\ncontent-type: application/json\r\ncontent-length: 5\r\nx-request-id: r-1\r\n\r\n")
        #expect(
            p.next() == [
                .submitResponse(
                    1,
                    Self.fields(
                        (":status", "200"), ("content-type", "application/json"), ("content-length", "5"),
                        ("x-request-id", "r-1")), endStream: false)
            ])
        p.event(.transferBody(1, count: 3))
        p.event(.transferBody(1, count: 2))
        #expect(p.next() == [.writeBody(1), .writeBody(1)])
        // The own client hands the trailer fields over after the body.
        p.transferTrailers(1, "x-checksum: abc\r\nGrpc-Status: 0\r\n")
        #expect(p.next() == [])
        p.now = 1_700
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(
            p.next() == [
                .endStream(1, trailers: Self.fields(("x-checksum", "abc"), ("grpc-status", "0"))),
                .exchangeFinished(1, Self.record("GET", "/me?x=1", status: 200)),
            ])
        #expect(p.timers == [.keepAlive: 11_700])
        #expect(p.session.isIdle && p.logs.isEmpty && p.outcomes.isEmpty)
        // nghttp2 closes the stream once the trailers went out: nothing is left to do.
        p.event(.streamClosed(1, errorCode: 0))
        #expect(p.next() == [])
    }

    @Test func aHeadRequestGetsAHeadThatEndsTheStream() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("HEAD", "/file"))
        p.tokens(1)
        _ = p.next()
        p.transferHead(1, "HTTP/1.1 200 \r\ncontent-length: 1234\r\n\r\n")
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(
            p.next() == [
                .submitResponse(1, Self.fields((":status", "200"), ("content-length", "1234")), endStream: true),
                .exchangeFinished(1, Self.record("HEAD", "/file", status: 200)),
            ])
    }

    @Test func anInterimHeadIsSkippedAndHopByHopFieldsOfAnHTTP11OriginAreDropped() {
        var p = Self.sending()
        p.transferHead(
            1,
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nConnection: keep-alive, X-Hop\r\nKeep-Alive: timeout=5\r\nX-Hop: 1\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\nX-End: 2\r\n\r\n"
        )
        #expect(p.next() == [.submitResponse(1, Self.fields((":status", "200"), ("x-end", "2")), endStream: false)])
    }

    @Test func everyConnectionSpecificFieldIsDroppedInAnyCaseAndNamesThatOnlyResembleThemTravel() {
        var p = Self.sending()
        p.transferHead(
            1,
            "HTTP/1.1 200 OK\r\nPROXY-CONNECTION: x\r\nTe: trailers\r\nuPgrade: h2c\r\nProxy-Authorization: Basic x\r\nTransfer-encoding: chunked\r\nKEEP-alive: 1\r\nTE-X: 1\r\nUpgrades: 2\r\nConnections: 3\r\nX-Transfer-Encoding: 4\r\n\r\n"
        )
        #expect(
            p.next() == [
                .submitResponse(
                    1,
                    Self.fields(
                        (":status", "200"), ("te-x", "1"), ("upgrades", "2"), ("connections", "3"),
                        ("x-transfer-encoding", "4")), endStream: false)
            ])
        for name in H2Semantics.connectionSpecific {
            #expect(
                H2Semantics.isConnectionSpecific(ArraySlice(name.map { $0 >= 0x61 && $0 <= 0x7A ? $0 - 0x20 : $0 })))
        }
    }

    @Test func aClientWithItsOwnAuthorizationKeepsItUnderKeep() {
        var origin = H2Playbook.origin
        origin.clientAuthorization = .keep
        var p = H2Playbook(origin: origin)
        p.request(1, H2Playbook.request("GET", "/x", [("authorization", "Basic dTpw")]))
        #expect(
            p.next() == [
                Self.exchange(1, .bodyEnded, origin),
                Self.exchange(
                    1, .send(Self.upstream("GET", "/x", [("authorization", "Basic dTpw")], generation: nil)), origin),
            ])
    }

    /// Issue 31: by default (`client_credential = replace`) the client's own Authorization gives way to the token.
    @Test func aClientsOwnAuthorizationIsReplacedByDefault() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("GET", "/x", [("authorization", "Basic dTpw")]))
        #expect(
            p.next() == [Self.exchange(1, .bodyEnded), Self.exchange(1, .getTokens(key: TokenKey(provider: "corp")))])
    }

    @Test func optionsAsteriskGoesToTheOriginAsTheAsteriskForm() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("OPTIONS", "*"))
        _ = p.next()
        p.tokens(1)
        #expect(p.next() == [Self.exchange(1, .send(Self.upstream("OPTIONS", "*", [], generation: 1)))])
    }

    // MARK: - Tokens

    @Test func a401IsRefreshedOnceAndReplayedWithTheKeptBody() {
        var p = H2Playbook()
        p.request(
            1, H2Playbook.request("POST", "/items", [("content-type", "application/json"), ("content-length", "4")]),
            endStream: false)
        #expect(p.next() == [Self.exchange(1, .getTokens(key: Self.key))])
        p.event(.requestData(1, count: 4, endStream: true))
        #expect(p.next() == [Self.exchange(1, .bodyEnded)])
        p.tokens(1)
        let first = Self.upstream(
            "POST", "/items", [("content-type", "application/json")], generation: 1, body: .length(4))
        #expect(p.next() == [Self.exchange(1, .send(first))])
        p.transferHead(
            1, "HTTP/1.1 401 \r\nwww-authenticate: Bearer error=\"invalid_token\"\r\ncontent-length: 12\r\n\r\n")
        p.event(.transferBody(1, count: 12))
        #expect(p.next() == [], "the 401 is not the client's business")
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(p.next() == [Self.exchange(1, .refreshTokens(key: Self.key, replacing: 1))])
        p.refreshed(1)
        let replay = Self.upstream(
            "POST", "/items", [("content-type", "application/json")], generation: 2, body: .length(4), attempt: 2)
        #expect(p.next() == [Self.exchange(1, .send(replay))])
        p.transferHead(1, "HTTP/1.1 200 \r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n")
        p.event(.transferBody(1, count: 2))
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(
            p.next() == [
                .submitResponse(
                    1, Self.fields((":status", "200"), ("content-type", "application/json"), ("content-length", "2")),
                    endStream: false),
                .writeBody(1), .endStream(1, trailers: []),
                .exchangeFinished(1, Self.record("POST", "/items", status: 200, attempts: 2, refreshed: true)),
            ])
    }

    @Test func grpcUnauthenticatedIsA401AndTheSecondOneIsDeliveredTrailersOnly() {
        var p = H2Playbook()
        let grpc: [(String, String)] = [("content-type", "application/grpc"), ("te", "trailers")]
        p.request(1, H2Playbook.request("POST", "/pkg.Greeter/Hello", grpc), endStream: false)
        p.event(.requestData(1, count: 17, endStream: true))
        #expect(p.next() == [Self.exchange(1, .getTokens(key: Self.key)), Self.exchange(1, .bodyEnded)])
        p.tokens(1)
        #expect(
            p.next() == [
                Self.exchange(
                    1, .send(Self.upstream("POST", "/pkg.Greeter/Hello", grpc, generation: 1, body: .streaming)))
            ])
        let unauthenticated =
            "HTTP/1.1 200 \r\ncontent-type: application/grpc\r\ngrpc-status: 16\r\ngrpc-message: token expired\r\n\r\n"
        p.transferHead(1, unauthenticated)
        #expect(p.next() == [])
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(p.next() == [Self.exchange(1, .refreshTokens(key: Self.key, replacing: 1))])
        p.refreshed(1)
        #expect(
            p.next() == [
                Self.exchange(
                    1,
                    .send(
                        Self.upstream(
                            "POST", "/pkg.Greeter/Hello", grpc, generation: 2, body: .streaming, attempt: 2)))
            ])
        p.transferHead(1, unauthenticated)
        #expect(
            p.next() == [
                .submitResponse(
                    1,
                    Self.fields(
                        (":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "16"),
                        ("grpc-message", "token expired"),
                        (
                            "proxy-status",
                            "proxyctl; received-status=200; details=\"the origin refused a freshly refreshed token; not retried again (check the token's scopes or audience)\""
                        )), endStream: true)
            ])
        // The Trailers-Only head ended the stream: nghttp2 closes it while the transfer still runs.
        p.event(.streamClosed(1, errorCode: 0))
        p.event(.transferBody(1, count: 5))
        #expect(p.next() == [])
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(
            p.next() == [
                .exchangeFinished(
                    1, Self.record("POST", "/pkg.Greeter/Hello", status: 200, attempts: 2, refreshed: true))
            ])
        #expect(p.session.isIdle && p.timers[.keepAlive] != nil)
    }

    @Test func grpcUnauthenticatedOnAnOpenRequestStreamIsDeliveredAtOnceAndTheTokenRefreshed() {
        // A bidirectional call: the client keeps its request stream open until it has the answer, so a
        // replay that waits for the stream's end would wait forever.
        var p = H2Playbook()
        let grpc: [(String, String)] = [("content-type", "application/grpc"), ("te", "trailers")]
        p.request(1, H2Playbook.request("POST", "/pkg.Chat/Talk", grpc), endStream: false)
        p.event(.requestData(1, count: 12, endStream: false))
        p.tokens(1)
        #expect(
            p.next().last
                == Self.exchange(
                    1, .send(Self.upstream("POST", "/pkg.Chat/Talk", grpc, generation: 1, body: .streaming))))
        p.transferHead(1, "HTTP/1.1 200 \r\ncontent-type: application/grpc\r\ngrpc-status: 16\r\n\r\n")
        #expect(
            p.next() == [
                Self.exchange(1, .refreshTokens(key: Self.key, replacing: 1)),
                .submitResponse(
                    1,
                    Self.fields(
                        (":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "16"),
                        (
                            "proxy-status",
                            "proxyctl; received-status=200; details=\"the call was refused UNAUTHENTICATED while its request stream was still open, so it was not sent again; call again\""
                        )), endStream: true),
            ])
        // The refreshed token is for the next call; this one is over.
        p.refreshed(1)
        #expect(p.next() == [])
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(
            p.next() == [
                .exchangeFinished(1, Self.record("POST", "/pkg.Chat/Talk", status: 200, refreshed: true))
            ])
        #expect(p.session.isIdle)
    }

    @Test func aDPoPNonceChallengeOnAnOpenRequestStreamIsDeliveredAtOnceWithTheNonceKept() {
        var p = H2Playbook()
        let grpc: [(String, String)] = [("content-type", "application/grpc"), ("te", "trailers")]
        p.request(1, H2Playbook.request("POST", "/pkg.Chat/Talk", grpc), endStream: false)
        p.tokens(1, dpopNonce: "n-0")
        _ = p.next()
        p.transferHead(
            1,
            "HTTP/1.1 200 \r\ncontent-type: application/grpc\r\ngrpc-status: 16\r\nwww-authenticate: DPoP error=\"use_dpop_nonce\"\r\ndpop-nonce: n-1\r\n\r\n"
        )
        let out = p.next()
        #expect(out.first == Self.exchange(1, .rememberNonce("n-1")), "the next call carries the new nonce")
        #expect(!out.contains { if case .exchange(_, .send, _) = $0 { true } else { false } })
        #expect(!out.contains { if case .exchange(_, .refreshTokens, _) = $0 { true } else { false } })
        guard case .submitResponse(1, let fields, endStream: true) = out.last else {
            Issue.record("no answer: \(out)")
            return
        }
        #expect(fields.contains { $0.name == Array("proxy-status".utf8) && $0.valueText.contains("call again") })
    }

    @Test func aTrailersOnlyResponseOutlivesItsStreamUntilTheTransferEnds() {
        var p = Self.sending("/pkg.Greeter/Hello")
        p.transferHead(1, "HTTP/1.1 200 \r\ncontent-type: application/grpc\r\ngrpc-status: 5\r\n\r\n")
        #expect(
            p.next() == [
                .submitResponse(
                    1, Self.fields((":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "5")),
                    endStream: true)
            ])
        p.event(.streamClosed(1, errorCode: 0))
        #expect(p.next() == [] && p.session.activeStreams == 1, "the exchange ends with its transfer")
        p.now += 200
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(p.next() == [.exchangeFinished(1, Self.record("GET", "/pkg.Greeter/Hello", status: 200))])
        #expect(p.session.isIdle && p.timers == [.keepAlive: p.now + 10_000])
    }

    @Test func theDPoPNonceRetryGoesOnceWithTheNonce() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("GET", "/d"))
        p.tokens(1, dpopNonce: "n-0")
        #expect(p.next().last == Self.exchange(1, .send(Self.upstream("GET", "/d", [], generation: 1, nonce: "n-0"))))
        p.transferHead(
            1, "HTTP/1.1 401 \r\nwww-authenticate: DPoP error=\"use_dpop_nonce\"\r\ndpop-nonce: n-1\r\n\r\n")
        #expect(p.next() == [Self.exchange(1, .rememberNonce("n-1"))])
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(
            p.next() == [
                Self.exchange(1, .send(Self.upstream("GET", "/d", [], generation: 1, nonce: "n-1", attempt: 2)))
            ])
        p.transferHead(1, "HTTP/1.1 204 \r\ndpop-nonce: n-2\r\n\r\n")
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(
            p.next() == [
                Self.exchange(1, .rememberNonce("n-2")),
                .submitResponse(1, Self.fields((":status", "204"), ("dpop-nonce", "n-2")), endStream: true),
                .exchangeFinished(1, Self.record("GET", "/d", status: 204, attempts: 2, nonceRetried: true)),
            ])
    }

    @Test func aStepUpChallengeIsPassedOnWithProxyStatusAndRecorded() {
        var p = Self.sending("/admin")
        p.transferHead(
            1,
            "HTTP/1.1 401 \r\nwww-authenticate: Bearer error=\"insufficient_user_authentication\", acr_values=\"urn:mfa\"\r\ncontent-length: 0\r\n\r\n"
        )
        let challenge = Challenge(
            scheme: "bearer", parameters: [("error", "insufficient_user_authentication"), ("acr_values", "urn:mfa")])
        #expect(
            p.next() == [
                Self.exchange(1, .recordStepUp(challenge)),
                .submitResponse(
                    1,
                    Self.fields(
                        (":status", "401"),
                        (
                            "www-authenticate",
                            "Bearer error=\"insufficient_user_authentication\", acr_values=\"urn:mfa\""
                        ),
                        (
                            "proxy-status",
                            "proxyctl; received-status=401; details=\"step-up required (acr_values urn:mfa): run proxyctl step-up https://api.test\""
                        ),
                        // A length of 0 is the framing "no body": the field that says so comes last.
                        ("content-length", "0")), endStream: true),
            ])
    }

    @Test func noTokenIsAnsweredByTheProxyOnThatStreamAlone() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("GET", "/x"))
        p.request(3, H2Playbook.request("HEAD", "/y"))
        _ = p.next()
        p.event(.tokens(1, .failure(.signInNeeded(reason: "not signed in to corp"))))
        let (fields, body) = Self.answer(
            401,
            proxyStatus: "proxyctl; error=http_request_denied; details=\"sign-in needed: run proxyctl login corp\"",
            message: "proxyctl: not signed in to corp")
        #expect(
            p.next() == [
                Self.exchange(1, .signInNeeded(reason: "not signed in to corp")),
                .respond(1, fields, body: body),
                .exchangeFinished(
                    1,
                    Self.record(
                        "GET", "/x", status: 401, attempts: 0, attached: false, answeredByProxy: true,
                        note: "sign-in needed: run proxyctl login corp", proxyError: "http_request_denied")),
            ])
        p.event(.tokens(3, .failure(.unavailable(reason: "timed out", retryAfter: 30))))
        let (headFields, headBody) = Self.answer(
            503,
            proxyStatus:
                "proxyctl; error=proxy_internal_response; details=\"the identity provider is unavailable; retry in 30s\"",
            extra: [("retry-after", "30")],
            message: "proxyctl: cannot get a token for https://api.test: timed out; retry in 30s", headRequest: true)
        #expect(headBody == [] && headFields[4] == H2Field("content-length", "75"), "a HEAD gets the length, no body")
        #expect(
            p.next() == [
                .respond(3, headFields, body: headBody),
                .exchangeFinished(
                    3,
                    Self.record(
                        "HEAD", "/y", status: 503, attempts: 0, attached: false, answeredByProxy: true,
                        note: "the identity provider is unavailable; retry in 30s",
                        proxyError: "proxy_internal_response")),
            ])
        #expect(p.session.isIdle)
    }

    @Test func aMissingDPoPKeyAnswersInsteadOfStartingTheTransfer() {
        var p = Self.sending()
        p.event(.credentialFailed(1, .dpopKeyMissing(provider: "corp")))
        let (fields, body) = Self.answer(
            401,
            proxyStatus: "proxyctl; error=http_request_denied; details=\"sign-in needed: run proxyctl login corp\"",
            message: "proxyctl: the DPoP key for corp is missing; run: proxyctl login corp")
        #expect(
            p.next() == [
                .respond(1, fields, body: body),
                .exchangeFinished(
                    1,
                    Self.record(
                        "GET", "/x", status: 401, answeredByProxy: true,
                        note: "sign-in needed: run proxyctl login corp", proxyError: "http_request_denied")),
            ])
    }

    // MARK: - Upstream failures

    @Test func aTransferThatFailsBeforeItsHeadIsAnswered502() {
        var p = Self.sending()
        p.event(.transferFinished(1, .connect, detail: "Connection refused"))
        let (fields, body) = Self.answer(
            502,
            proxyStatus:
                "proxyctl; error=connection_refused; next-hop=\"api.test:443\"; details=\"cannot connect to api.test:443: Connection refused\"",
            message: "proxyctl: cannot connect to api.test:443: Connection refused")
        #expect(
            p.next() == [
                .respond(1, fields, body: body),
                .exchangeFinished(
                    1,
                    Self.record(
                        "GET", "/x", status: 502, answeredByProxy: true,
                        note: "cannot connect to api.test:443: Connection refused", close: true,
                        proxyError: "connection_refused")),
            ])
    }

    @Test func anUnusableHeadStopsTheTransferAndIsAnswered502() {
        var p = Self.sending()
        p.transferHead(1, "HTTP/1.1 200 \r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n")
        let (fields, body) = Self.answer(
            502,
            proxyStatus:
                "proxyctl; error=http_protocol_error; next-hop=\"api.test:443\"; details=\"invalid response: conflicting Content-Length values\"",
            message: "proxyctl: api.test:443 sent an invalid response (conflicting Content-Length values)")
        // At once: the transfer is stopped (its body could be endless) and the client answered.
        #expect(
            p.next() == [
                Self.exchange(1, .cancelTransfer), .respond(1, fields, body: body),
                .exchangeFinished(
                    1,
                    Self.record(
                        "GET", "/x", status: 502, answeredByProxy: true,
                        note: "invalid response: conflicting Content-Length values", close: true,
                        proxyError: "http_protocol_error")),
            ])
    }

    @Test func aResponseCutShortByTheOriginResetsTheStream() {
        var p = Self.sending()
        p.transferHead(1, "HTTP/1.1 200 \r\ncontent-length: 10\r\n\r\n")
        p.event(.transferBody(1, count: 4))
        _ = p.next()
        p.event(.transferFinished(1, .incomplete, detail: "HTTP/2 stream 1 was reset"))
        #expect(
            p.next() == [
                .exchangeFinished(
                    1,
                    Self.record(
                        "GET", "/x", status: 200,
                        note: "upstream failed mid-response: HTTP/2 stream 1 was reset", close: true,
                        cutShort: true)),
                .resetStream(1, .internalError),
            ])
    }

    // MARK: - Request bodies

    @Test func aBodyOfUnknownLengthStreamsAsItArrives() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("PUT", "/u", [("content-type", "text/plain")]), endStream: false)
        #expect(p.next() == [Self.exchange(1, .getTokens(key: Self.key))])
        p.event(.requestData(1, count: 100, endStream: false))
        #expect(p.next() == [], "kept")
        p.tokens(1)
        #expect(
            p.next() == [
                Self.exchange(
                    1,
                    .send(Self.upstream("PUT", "/u", [("content-type", "text/plain")], generation: 1, body: .streaming))
                )
            ], "sent before the body is complete")
        p.event(.requestData(1, count: 924, endStream: false))
        #expect(p.next() == [], "1024 bytes: still kept (replay_spool)")
        p.event(.requestData(1, count: 1, endStream: false))
        #expect(p.next() == [Self.exchange(1, .streamBody)], "one byte more: it streams on, not kept")
        p.event(.requestData(1, count: 0, endStream: true))
        #expect(p.next() == [Self.exchange(1, .bodyEnded)])
        // A 401 now cannot be replayed: it is passed on, saying why.
        p.transferHead(1, "HTTP/1.1 401 \r\nwww-authenticate: Bearer\r\ncontent-length: 0\r\n\r\n")
        #expect(
            p.next() == [
                .submitResponse(
                    1,
                    Self.fields(
                        (":status", "401"), ("www-authenticate", "Bearer"),
                        (
                            "proxy-status",
                            "proxyctl; received-status=401; details=\"the request body was too large to keep, so the request was not sent again after a token refresh; retry it\""
                        ), ("content-length", "0")), endStream: true)
            ])
    }

    @Test func aBodyPastTheReplayBudgetStreamsOnAndIsNotReplayed() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("PUT", "/u", [("content-type", "text/plain")]), endStream: false)
        #expect(p.next() == [Self.exchange(1, .getTokens(key: Self.key))])
        p.event(.requestData(1, count: 100, endStream: false))
        #expect(p.next() == [], "kept: well within replay_spool")
        p.event(.bodyBeyondBudget(1))
        #expect(p.next() == [Self.exchange(1, .streamBody)], "the I/O layer could keep no more: it streams on")
        p.event(.bodyBeyondBudget(1))
        #expect(p.next() == [], "said once")
        p.tokens(1)
        _ = p.next()
        p.event(.requestData(1, count: 0, endStream: true))
        #expect(p.next() == [Self.exchange(1, .bodyEnded)])
        p.transferHead(1, "HTTP/1.1 401 \r\nwww-authenticate: Bearer\r\ncontent-length: 0\r\n\r\n")
        let answer = p.next()
        #expect(!answer.contains { if case .exchange(_, .refreshTokens, _) = $0 { true } else { false } })
        #expect(
            answer.first.map { "\($0)" }?.contains("so the request was not sent again after a token refresh") == true,
            "\(answer)")
    }

    @Test func aContentLengthTooLargeToKeepStreamsFromTheStart() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("POST", "/big", [("content-length", "4096")]), endStream: false)
        #expect(p.next() == [Self.exchange(1, .streamBody), Self.exchange(1, .getTokens(key: Self.key))])
        p.tokens(1)
        #expect(
            p.next() == [Self.exchange(1, .send(Self.upstream("POST", "/big", [], generation: 1, body: .length(4096))))]
        )
        p.event(.requestData(1, count: 4096, endStream: true))
        #expect(p.next() == [Self.exchange(1, .bodyEnded)])
    }

    @Test func requestTrailersGoToTheTransferAndEndTheBody() {
        var p = H2Playbook()
        let grpc: [(String, String)] = [("content-type", "application/grpc"), ("te", "trailers")]
        p.request(1, H2Playbook.request("POST", "/pkg.Upload/Put", grpc), endStream: false)
        p.tokens(1)
        p.event(.requestData(1, count: 10, endStream: false))
        _ = p.next()
        let trailers = Self.fields(("x-checksum", "abc"), ("grpc-timeout", "1S"))
        p.event(.requestTrailers(1, trailers))
        #expect(p.next() == [.requestTrailers(1, trailers), Self.exchange(1, .bodyEnded)])
        p.event(.requestTrailers(9, trailers))
        #expect(p.next() == [], "trailers of a stream without an exchange go nowhere")
    }

    @Test func aBodyNotKeptIsAnswered500() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("POST", "/p", [("content-length", "100")]), endStream: false)
        p.tokens(1)
        _ = p.next()
        p.event(.bodyNotKept(1, directory: "/spool"))
        let (fields, body) = Self.answer(
            500, proxyStatus: "proxyctl; error=proxy_internal_error; details=\"cannot keep the request body\"",
            message: "proxyctl: cannot write the request body to /spool")
        #expect(
            p.next() == [
                Self.exchange(1, .cancelTransfer), .respond(1, fields, body: body),
                .exchangeFinished(
                    1,
                    Self.record(
                        "POST", "/p", status: 500, answeredByProxy: true, note: "cannot keep the request body",
                        close: true, proxyError: "proxy_internal_error")),
            ])
    }

    // MARK: - Streams closed by the client

    @Test func aClientResetMidResponseAbortsTheExchange() {
        var p = Self.sending()
        p.transferHead(1, "HTTP/1.1 200 \r\ncontent-length: 10\r\n\r\n")
        p.event(.transferBody(1, count: 4))
        _ = p.next()
        p.now += 50
        p.event(.streamClosed(1, errorCode: H2ErrorCode.cancel.rawValue))
        // Whether a RST_STREAM follows is H2SessionRFCGaps' business; everything else is exact.
        #expect(
            p.next().filter { if case .resetStream = $0 { false } else { true } } == [
                Self.exchange(1, .cancelTransfer),
                .exchangeFinished(
                    1, Self.record("GET", "/x", status: 200, note: "aborted", close: true, cutShort: true)),
            ])
        #expect(p.session.isIdle && p.timers == [.keepAlive: p.now + 10_000])
        // The stopped transfer's callbacks, if any still come, find nothing.
        p.event(.transferBody(1, count: 6))
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(p.next() == [])
    }

    @Test func aClientResetWhileWaitingForTheTokenEndsTheExchangeWithoutAResponse() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("GET", "/x"))
        _ = p.next()
        p.event(.streamClosed(1, errorCode: H2ErrorCode.cancel.rawValue))
        #expect(
            p.next() == [
                .exchangeFinished(
                    1, Self.record("GET", "/x", status: 0, attempts: 0, attached: false, note: "aborted", close: true))
            ])
        p.tokens(1)
        #expect(p.next() == [], "the late token finds no stream")
    }

    // MARK: - Misdirected requests and refusals

    @Test func aServerNameForAnotherHostMakesEveryStream421WithoutAToken() {
        var p = H2Playbook(misdirected: Self.misdirected)
        let (fields, body) = Self.answer(
            421,
            proxyStatus:
                "proxyctl; error=http_request_denied; details=\"the TLS server name evil.test does not match the tunnel's api.test\"",
            message:
                "proxyctl: misdirected request: the TLS server name evil.test does not match the tunnel's api.test; no token was sent"
        )
        for stream: Int32 in [1, 3] {
            p.request(stream, H2Playbook.request("GET", "/x?secret=1"))
            #expect(p.next() == [.respond(stream, fields, body: body)])
        }
        #expect(
            p.logs
                == [1, 3].map {
                    LogLine(
                        .info,
                        "GET https://api.test/x?... status=421 answered-by=proxyctl reason=\"the TLS server name evil.test does not match the tunnel's api.test\" h2=\($0)"
                    )
                })
        #expect(
            p.outcomes
                == Array(
                    repeating: RequestOutcome(kind: .intercepted, status: 421, proxyError: "http_request_denied"),
                    count: 2))
        #expect(p.session.requests == 2 && p.session.isIdle && p.timers[.keepAlive] != nil)
    }

    @Test(arguments: [
        ("other.test", ":authority other.test:443 does not match the tunnel's api.test:443"),
        ("api.test:8443", ":authority api.test:8443 does not match the tunnel's api.test:443"),
        ("api.test:x", "the :authority is not a valid authority"),
    ])
    func anAuthorityForAnotherOriginIs421WithoutAToken(authority: String, reason: String) {
        var p = H2Playbook()
        p.request(
            1, Self.fields((":method", "GET"), (":scheme", "https"), (":authority", authority), (":path", "/x")))
        let (fields, body) = Self.answer(
            421, proxyStatus: "proxyctl; error=http_request_denied; details=\"\(reason)\"",
            message: "proxyctl: misdirected request: \(reason); no token was sent")
        #expect(p.next() == [.respond(1, fields, body: body)])
        #expect(p.outcomes == [RequestOutcome(kind: .intercepted, status: 421, proxyError: "http_request_denied")])
    }

    @Test func aHostFieldMustNameTheOriginToo() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("GET", "/x", [("host", "other.test")]))
        // The Host field is checked as an authority; the reason names it so.
        let reason = ":authority other.test:443 does not match the tunnel's api.test:443"
        let (fields, body) = Self.answer(
            421, proxyStatus: "proxyctl; error=http_request_denied; details=\"\(reason)\"",
            message: "proxyctl: misdirected request: \(reason); no token was sent")
        #expect(p.next() == [.respond(1, fields, body: body)])
        // Without :authority, a Host naming the origin is the authority (RFC 9113 §8.3.1).
        p.request(3, Self.fields((":method", "GET"), (":scheme", "https"), (":path", "/y"), ("host", "API.test.")))
        #expect(p.next() == [Self.exchange(3, .bodyEnded), Self.exchange(3, .getTokens(key: Self.key))])
        p.tokens(3)
        #expect(p.next() == [Self.exchange(3, .send(Self.upstream("GET", "/y", [], generation: 1)))])
    }

    @Test(
        arguments: [
            (
                [(":method", "GET"), (":scheme", "https"), (":authority", "api.test"), (":path", "/"), (":foo", "1")],
                400, "proxyctl; error=http_request_error; details=\"unknown pseudo-header field\""
            ),
            (
                [(":scheme", "https"), (":authority", "api.test"), (":path", "/")], 400,
                "proxyctl; error=http_request_error; details=\"request without :method\""
            ),
            (
                [(":method", "GET"), (":scheme", "https"), (":authority", "api.test")], 400,
                "proxyctl; error=http_request_error; details=\"request without an origin-form :path\""
            ),
            (
                [(":method", "GET"), (":scheme", "https"), (":authority", "api.test"), (":path", "")], 400,
                "proxyctl; error=http_request_error; details=\"request without an origin-form :path\""
            ),
            (
                [(":method", "GET"), (":scheme", "https"), (":authority", "api.test"), (":path", "https://api.test/")],
                400, "proxyctl; error=http_request_error; details=\"request without an origin-form :path\""
            ),
            (
                [(":method", "GET"), (":scheme", "https"), (":authority", "api.test"), (":path", "*")], 400,
                "proxyctl; error=http_request_error; details=\"request without an origin-form :path\""
            ),
            (
                [(":method", "GET"), (":scheme", "https"), (":path", "/")], 400,
                "proxyctl; error=http_request_error; details=\"request without :authority\""
            ),
            (
                [(":method", "GET"), (":scheme", "http"), (":authority", "api.test"), (":path", "/")], 421,
                "proxyctl; error=http_request_denied; details=\"the request names the scheme http, not https\""
            ),
            (
                [(":method", "CONNECT"), (":authority", "other.test:443")], 501,
                "proxyctl; error=http_request_error; details=\"CONNECT inside a tunnel to a protected origin is not supported\""
            ),
            (
                [
                    (":method", "CONNECT"), (":protocol", "connect-udp"), (":scheme", "https"),
                    (":authority", "api.test"),
                    (":path", "/chat"),
                ], 501,
                "proxyctl; error=http_request_error; details=\"the protocol connect-udp cannot be tunnelled to a protected origin; only websocket\""
            ),
            (
                [
                    (":method", "GET"), (":scheme", "https"), (":authority", "api.test"), (":path", "/"),
                    ("content-length", "+5"),
                ], 400, "proxyctl; error=http_request_error; details=\"invalid content-length\""
            ),
            (
                [
                    (":method", "POST"), (":scheme", "https"), (":authority", "api.test"), (":path", "/"),
                    ("content-length", "5"), ("content-length", "6"),
                ], 400, "proxyctl; error=http_request_error; details=\"invalid content-length\""
            ),
        ] as [([(String, String)], Int, String)])
    func aRequestThatCannotGoIsAnsweredAndGetsNoToken(fields: [(String, String)], status: Int, proxyStatus: String) {
        var p = H2Playbook()
        p.request(1, H2Playbook.fields(fields))
        let notable = p.next()
        guard case .respond(1, let answer, let body) = notable.first, notable.count == 1 else {
            Issue.record("not one answer: \(notable)")
            return
        }
        #expect(Array(answer.prefix(2)) == Self.fields((":status", String(status)), ("proxy-status", proxyStatus)))
        #expect(answer.dropFirst(2).map(\.nameText) == ["content-type", "content-length", "cache-control"])
        #expect(body.count == Int(answer[3].valueText) && !body.isEmpty)
        #expect(p.outcomes.map(\.status) == [status] && p.session.isIdle)
        #expect(p.logs.count == 1 && p.lastLog.hasSuffix(" h2=1"))
    }

    @Test func aHeadRequestThatIsRefusedGetsTheLengthButNoBody() {
        var p = H2Playbook(misdirected: Self.misdirected)
        p.request(1, H2Playbook.request("HEAD", "/x"))
        let (fields, body) = Self.answer(
            421,
            proxyStatus:
                "proxyctl; error=http_request_denied; details=\"the TLS server name evil.test does not match the tunnel's api.test\"",
            message:
                "proxyctl: misdirected request: the TLS server name evil.test does not match the tunnel's api.test; no token was sent",
            headRequest: true)
        #expect(body == [] && fields[3] == H2Field("content-length", "117"), "the length of the GET's body")
        #expect(p.next() == [.respond(1, fields, body: body)])
    }

    // MARK: - Many streams

    @Test func interleavedStreamsEachGetTheirOwnOutputs() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("GET", "/a"))
        p.request(3, H2Playbook.request("GET", "/b"))
        p.request(5, H2Playbook.request("POST", "/c", [("content-length", "2")]), endStream: false)
        #expect(
            p.next() == [
                Self.exchange(1, .bodyEnded), Self.exchange(1, .getTokens(key: Self.key)),
                Self.exchange(3, .bodyEnded), Self.exchange(3, .getTokens(key: Self.key)),
                Self.exchange(5, .getTokens(key: Self.key)),
            ])
        #expect(p.session.activeStreams == 3 && p.session.requests == 3)
        p.tokens(3)  // generation 1
        p.tokens(5)  // generation 2
        p.tokens(1)  // generation 3
        #expect(
            p.next() == [
                Self.exchange(3, .send(Self.upstream("GET", "/b", [], generation: 1))),
                Self.exchange(5, .send(Self.upstream("POST", "/c", [], generation: 2, body: .length(2)))),
                Self.exchange(1, .send(Self.upstream("GET", "/a", [], generation: 3))),
            ])
        p.transferHead(1, "HTTP/1.1 200 \r\ncontent-length: 1\r\n\r\n")
        p.event(.requestData(5, count: 2, endStream: true))
        p.transferHead(3, "HTTP/1.1 401 \r\nwww-authenticate: Bearer error=\"invalid_token\"\r\n\r\n")
        p.event(.transferBody(1, count: 1))
        p.transferHead(5, "HTTP/1.1 202 \r\ncontent-length: 0\r\n\r\n")
        p.event(.transferFinished(3, nil, detail: ""))
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(
            p.next() == [
                .submitResponse(1, Self.fields((":status", "200"), ("content-length", "1")), endStream: false),
                Self.exchange(5, .bodyEnded),
                .writeBody(1),
                .submitResponse(5, Self.fields((":status", "202"), ("content-length", "0")), endStream: true),
                Self.exchange(3, .refreshTokens(key: Self.key, replacing: 1)),
                .endStream(1, trailers: []),
                .exchangeFinished(1, Self.record("GET", "/a", status: 200)),
            ])
        #expect(p.session.activeStreams == 2)
        p.event(.streamClosed(5, errorCode: 0))
        p.refreshed(3)
        p.event(.transferFinished(5, nil, detail: ""))
        #expect(
            p.next() == [
                Self.exchange(3, .send(Self.upstream("GET", "/b", [], generation: 4, attempt: 2))),
                .exchangeFinished(5, Self.record("POST", "/c", status: 202)),
            ])
        p.event(.streamClosed(3, errorCode: H2ErrorCode.cancel.rawValue))
        #expect(
            p.next() == [
                Self.exchange(3, .cancelTransfer),
                .exchangeFinished(
                    3, Self.record("GET", "/b", status: 0, attempts: 2, refreshed: true, note: "aborted", close: true)),
            ])
        #expect(p.session.isIdle && p.outcomes.isEmpty)
    }

    // MARK: - The connection's end

    @Test func shutdownDrainsTheStreamsInFlightAndRefusesNewOnes() {
        var p = Self.sending("/a")
        p.request(3, H2Playbook.request("GET", "/b"))
        _ = p.next()
        p.event(.shutdown)
        #expect(p.next() == [.goaway(.noError)])
        p.event(.shutdown)
        #expect(p.next() == [], "one GOAWAY")
        p.request(5, H2Playbook.request("GET", "/c"))
        #expect(p.next() == [.resetStream(5, .refusedStream)])
        #expect(p.session.activeStreams == 2 && p.session.requests == 3)
        p.transferHead(1, "HTTP/1.1 204 \r\n\r\n")
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(
            p.next() == [
                .submitResponse(1, Self.fields((":status", "204")), endStream: true),
                .exchangeFinished(1, Self.record("GET", "/a", status: 204)),
            ], "no close while stream 3 is in flight")
        p.event(.tokens(3, .failure(.configuration(reason: "no client_id"))))
        let (fields, body) = Self.answer(
            500, proxyStatus: "proxyctl; error=proxy_configuration_error; details=\"provider corp is misconfigured\"",
            message: "proxyctl: cannot get a token for https://api.test: no client_id")
        #expect(
            p.next() == [
                .respond(3, fields, body: body),
                .exchangeFinished(
                    3,
                    Self.record(
                        "GET", "/b", status: 500, attempts: 0, attached: false, answeredByProxy: true,
                        note: "provider corp is misconfigured", proxyError: "proxy_configuration_error")),
                .closeAfterFlush,
            ])
        #expect(p.timers.isEmpty, "neither timer: the connection closes once flushed")
    }

    @Test func shutdownOfAnIdleConnectionClosesItAtOnce() {
        var p = H2Playbook()
        p.event(.shutdown)
        #expect(p.next() == [.goaway(.noError), .closeAfterFlush])
    }

    @Test func theKeepAliveTimerClosesAnIdleConnection() {
        var p = H2Playbook()
        p.wait(9_999)
        #expect(p.next() == [])
        p.wait(1)
        #expect(p.next() == [.goaway(.noError), .closeAfterFlush])
        #expect(p.timers.isEmpty)
    }

    @Test func theKeepAliveTimerStartsOverWhenTheLastStreamEnds() {
        var p = Self.sending()
        p.wait(20_000)
        #expect(p.next() == [], "no keep-alive timeout while a stream is in flight")
        p.transferHead(1, "HTTP/1.1 204 \r\n\r\n")
        p.event(.transferFinished(1, nil, detail: ""))
        _ = p.next()
        #expect(p.timers == [.keepAlive: 31_000])
        p.wait(10_000)
        #expect(p.next() == [.goaway(.noError), .closeAfterFlush])
    }

    @Test func theIdleTimerWaitsForSilenceThenEndsEveryStream() {
        var p = Self.sending("/slow")
        p.request(3, H2Playbook.request("GET", "/waiting"))
        _ = p.next()
        p.wait(20_000)
        p.transferHead(1, "HTTP/1.1 200 \r\ncontent-length: 9\r\n\r\n")
        _ = p.next()
        #expect(p.lastActivity == 21_000)
        p.wait(10_000)
        #expect(p.next() == [] && p.timers == [.idle: 51_000], "re-armed for what is left since the last byte")
        p.wait(20_000)
        #expect(
            p.next() == [
                Self.exchange(1, .cancelTransfer),
                .exchangeFinished(
                    1, Self.record("GET", "/slow", status: 200, note: "aborted", close: true, cutShort: true)),
                .resetStream(1, .internalError),
                .exchangeFinished(
                    3,
                    Self.record(
                        "GET", "/waiting", status: 0, attempts: 0, attached: false, note: "aborted", close: true)),
                .goaway(.noError), .closeAfterFlush,
            ])
        #expect(p.lastLog == "h2 connection idle for 30.00s; closing")
    }

    @Test func clientGoneAbortsEveryStream() {
        var p = Self.sending("/a")
        p.request(3, H2Playbook.request("POST", "/b", [("content-length", "10")]), endStream: false)
        p.transferHead(1, "HTTP/1.1 200 \r\n\r\n")
        _ = p.next()
        p.event(.clientGone)
        #expect(
            p.next() == [
                Self.exchange(1, .cancelTransfer),
                .exchangeFinished(
                    1, Self.record("GET", "/a", status: 200, note: "aborted", close: true, cutShort: true)),
                .resetStream(1, .internalError),
                .exchangeFinished(
                    3,
                    Self.record("POST", "/b", status: 0, attempts: 0, attached: false, note: "aborted", close: true)),
            ])
        #expect(p.session.isIdle)
        // What the driver's callbacks may still bring changes nothing.
        p.tokens(3)
        p.event(.transferBody(1, count: 3))
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(p.next() == [])
    }
}

/// A request body that outgrows the replay store while the origin's refusal is on its way: the request
/// cannot go again, so the client gets the refusal, and the exchange ends with it.
@Suite struct H2UnkeptBodyPlaybooks {
    typealias P = H2SessionPlaybooks

    static let refused = P.fields(
        (":status", "401"), ("www-authenticate", "Bearer error=\"invalid_token\""),
        (
            "proxy-status",
            "proxyctl; received-status=401; details=\"the request body was too large to keep, so the request was not sent again; retry it\""
        ), ("content-length", "0"))

    /// A PUT of unknown length, 100 bytes kept, its transfer answered 401.
    static func refusedMidBody() -> H2Playbook {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("PUT", "/u"), endStream: false)
        p.tokens(1)
        p.event(.requestData(1, count: 100, endStream: false))
        p.transferHead(
            1, "HTTP/1.1 401 \r\nwww-authenticate: Bearer error=\"invalid_token\"\r\ncontent-length: 0\r\n\r\n")
        _ = p.next()
        return p
    }

    @Test func aBodyThatOutgrowsTheStoreAfterTheRefusalEndedGetsTheRefusal() {
        var p = Self.refusedMidBody()
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(p.next() == [], "the rest of the body comes first")
        p.event(.requestData(1, count: 2_000, endStream: false))
        #expect(
            p.next() == [
                P.exchange(1, .streamBody), .submitResponse(1, Self.refused, endStream: true),
                // `refreshed`: the refresh was decided (it is what the 401 called for), not carried out.
                .exchangeFinished(1, P.record("PUT", "/u", status: 401, refreshed: true)),
            ])
        p.event(.requestData(1, count: 10, endStream: true))
        #expect(p.next() == [] && p.session.isIdle)
        p.finishEverything()
        #expect(p.violations == [])
    }

    @Test func aBodyThatOutgrowsTheStoreWhileTheRefusalArrivesIsNotSentAgain() {
        var p = Self.refusedMidBody()
        p.event(.requestData(1, count: 2_000, endStream: false))
        #expect(p.next() == [P.exchange(1, .streamBody)])
        p.event(.transferFinished(1, nil, detail: ""))
        #expect(
            p.next() == [
                .submitResponse(1, Self.refused, endStream: true),
                // `refreshed`: the refresh was decided (it is what the 401 called for), not carried out.
                .exchangeFinished(1, P.record("PUT", "/u", status: 401, refreshed: true)),
            ], "no refresh: the body is gone")
        p.event(.requestData(1, count: 0, endStream: true))
        #expect(p.next() == [])
        p.finishEverything()
        #expect(p.violations == [] && p.streams[1]?.sends.count == 1)
    }
}
/// Where `H2Session` and `H2Semantics` are laxer than RFC 9113 and RFC 8441. nghttp2 (1.52 here) refuses
/// every one of these requests before the session sees them, so the driver never hands them over; the
/// session's own checks are the second line. Disabled: they describe the behaviour the RFCs ask for, which
/// the code does not have yet.
@Suite struct H2SessionRFCGaps {
    typealias P = H2SessionPlaybooks

    @Test(
        .disabled(
            "RFC 9113 §5.4.2: an endpoint MUST NOT send a RST_STREAM in response to a RST_STREAM frame (and §5.1: no frame but PRIORITY on a closed stream); H2Session resets a stream the client already reset when its response was under way"
        ))
    func aStreamTheClientResetIsNotResetAgain() {
        var p = P.sending()
        p.transferHead(1, "HTTP/1.1 200 \r\ncontent-length: 10\r\n\r\n")
        _ = p.next()
        p.event(.streamClosed(1, errorCode: H2ErrorCode.cancel.rawValue))
        #expect(
            p.next() == [
                P.exchange(1, .cancelTransfer),
                .exchangeFinished(
                    1, P.record("GET", "/x", status: 200, note: "aborted", close: true, cutShort: true)),
            ])
        #expect(p.resetsAfterClose == [])
    }

    /// The tunnel's request with one field replaced or added.
    static let get: [(String, String)] = [
        (":method", "GET"), (":scheme", "https"), (":authority", "api.test"), (":path", "/x"),
    ]

    @Test(
        .disabled(
            "RFC 9113 §8.1.1: a malformed request MUST NOT be forwarded (a stream error, optionally after a response); H2Semantics drops or rewrites these fields and sends the request on"
        ),
        arguments: [
            // §8.2.2: TE with anything but "trailers" (sent on as "te: trailers").
            get + [("te", "gzip")],
            // §8.2.2: connection-specific fields (dropped).
            get + [("connection", "keep-alive")], get + [("keep-alive", "timeout=5")],
            get + [("proxy-connection", "keep-alive")], get + [("transfer-encoding", "chunked")],
            get + [("upgrade", "h2c")],
            // §8.2.1: upper-case field names (sent on as they are: "Host" would reach libcurl).
            get + [("Host", "evil.test")],
            // §8.3: a pseudo-field twice (the last wins), or after a regular field.
            get + [(":path", "/y")],
            [(":method", "GET"), ("accept", "*/*"), (":scheme", "https"), (":authority", "api.test"), (":path", "/x")],
            // RFC 8441 §4 with RFC 9113 §8.3: :protocol belongs to CONNECT alone (ignored on a GET).
            get + [(":protocol", "websocket")],
            // §8.1.1: a content-length that the DATA frames (none: END_STREAM on HEADERS) do not match.
            get + [("content-length", "5")],
        ])
    func aMalformedRequestIsAnsweredNotForwarded(fields: [(String, String)]) {
        var p = H2Playbook()
        p.request(1, H2Playbook.fields(fields))
        let notable = p.next()
        guard case .respond(1, let answer, _) = notable.first, notable.count == 1 else {
            Issue.record("forwarded: \(notable)")
            return
        }
        #expect(answer.first == H2Field(":status", "400"))
    }
}

extension H2SessionRFCGaps {
    @Test(
        .disabled(
            "RFC 9113 §8.1/§8.2.2 and RFC 9110 §6.5.1: trailers carry no pseudo-field, no connection-specific field and none that framing or routing needs; H2Session hands the client's request trailers to the transfer unfiltered (the response direction filters them with H2Semantics.trailers)"
        ))
    func requestTrailersAreFilteredLikeResponseTrailers() {
        var p = H2Playbook()
        p.request(1, H2Playbook.request("POST", "/upload"), endStream: false)
        p.tokens(1)
        _ = p.next()
        p.event(
            .requestTrailers(
                1,
                H2Playbook.fields([
                    ("x-checksum", "abc"), ("host", "evil.test"), ("content-length", "9"), ("connection", "close"),
                    ("trailer", "x-checksum"), (":path", "/other"),
                ])))
        #expect(
            p.next() == [
                .requestTrailers(1, H2Playbook.fields([("x-checksum", "abc")])), P.exchange(1, .bodyEnded),
            ])
    }
}

/// WebSocket over HTTP/2 (RFC 8441) as playbooks: the extended CONNECT becomes an HTTP/1.1 upgrade request
/// for the pair's connection machine, and that side's answer becomes the stream's.
@Suite struct H2WebSocketPlaybooks {
    typealias Action = H2Session.Action

    static var session: H2Session {
        var origin = OriginConfig(scheme: "https", authority: hop("api.test:443"))
        origin.provider = "corp"
        var settings = ProxySettings()
        settings.keepAliveTimeout = 10_000
        settings.idleTimeout = 30_000
        return H2Session(
            origin: origin,
            frontDoor: FrontDoor(
                settings: settings, credentials: nil,
                boundAddress: ListenAddress(host: "127.0.0.1", port: 8080, isIPv6: false),
                origins: OriginTable([origin])),
            misdirected: nil, keySeed: 42)
    }

    static let connect = [
        H2Field(":method", "CONNECT"), H2Field(":protocol", "websocket"), H2Field(":scheme", "https"),
        H2Field(":authority", "api.test"), H2Field(":path", "/chat?room=1"), H2Field("sec-websocket-version", "13"),
        H2Field("sec-websocket-protocol", "chat"), H2Field("origin", "https://app.test"),
    ]

    static func open(_ session: inout H2Session) -> [UInt8] {
        var out: [Action] = []
        session.start(now: 0, &out)
        out.removeAll()
        session.handle(.requestHeaders(1, connect, endStream: false), now: 1, &out)
        let heads = out.compactMap { if case .openTunnel(1, let head) = $0 { head } else { nil } }
        #expect(heads.count == 1)
        return heads.first ?? []
    }

    @Test func theExtendedConnectBecomesAnUpgradeRequestAndThe101AStream() {
        var session = Self.session
        let head = String(decoding: Self.open(&session), as: UTF8.self)
        let key = head.split(separator: "\r\n").first { $0.hasPrefix("Sec-WebSocket-Key: ") }?.dropFirst(19) ?? ""
        #expect(Base64.decode(key)?.count == 16, "a 16-byte random key (RFC 6455 §4.1)")
        #expect(
            head
                == "GET /chat?room=1 HTTP/1.1\r\nHost: api.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: \(key)\r\nsec-websocket-version: 13\r\nsec-websocket-protocol: chat\r\norigin: https://app.test\r\n\r\n"
        )
        var out: [Action] = []
        let answer =
            Array(
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: x\r\nSec-WebSocket-Protocol: chat\r\n\r\n"
                    .utf8) + [0x81, 0x02, 0x68, 0x69]
        session.tunnelData(1, answer, now: 2, &out)
        let headLength = answer.count - 4
        #expect(
            out.filter { if case .log = $0 { false } else { true } } == [
                .consumeTunnel(1, headLength),
                .submitResponse(
                    1, [H2Field(":status", "200"), H2Field("sec-websocket-protocol", "chat")], endStream: false),
                .tunnelToStream(1, 4),
            ])
        out.removeAll()
        session.handle(.requestData(1, count: 6, endStream: true), now: 3, &out)
        #expect(out == [.endTunnelInput(1)], "the client's end of the stream is the pair's end of input")
        out.removeAll()
        session.handle(.tunnelEnded(1), now: 4, &out)
        #expect(out.prefix(2) == [.closeTunnel(1), .endStream(1, trailers: [])])
        #expect(session.isIdle)
    }

    @Test func interimAnswersBeforeThe101AreSkippedInTheSameRead() {
        // Found by FuzzH2Session: the interim head was parsed again from the start of the read, for ever.
        var session = Self.session
        _ = Self.open(&session)
        var out: [Action] = []
        let interim = Array("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n".utf8)
        let final = Array("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n".utf8)
        session.tunnelData(1, interim + final + [0x81, 0x00], now: 2, &out)
        #expect(
            out.filter { if case .log = $0 { false } else { true } } == [
                .consumeTunnel(1, 25), .consumeTunnel(1, 27), .consumeTunnel(1, final.count),
                .submitResponse(1, [H2Field(":status", "200")], endStream: false), .tunnelToStream(1, 2),
            ])
        out.removeAll()
        // A lone interim answer waits for the final one in a later read.
        var other = Self.session
        _ = Self.open(&other)
        other.tunnelData(1, Array("HTTP/1.1 100 Continue\r\n\r\n".utf8), now: 2, &out)
        #expect(out == [.consumeTunnel(1, 25)])
        out.removeAll()
        other.tunnelData(1, final, now: 3, &out)
        #expect(out.contains(.submitResponse(1, [H2Field(":status", "200")], endStream: false)))
    }

    @Test func aRefusalComesOnTheStreamWithItsBody() {
        var session = Self.session
        _ = Self.open(&session)
        var out: [Action] = []
        session.tunnelData(
            1,
            Array(
                "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\"\r\nContent-Length: 5\r\nConnection: close\r\nProxy-Status: proxyctl; received-status=401\r\n\r\nnope!"
                    .utf8), now: 2, &out)
        let notable = out.filter {
            switch $0 {
            case .log, .arm, .disarm: false
            default: true
            }
        }
        guard case .submitResponse(1, let fields, endStream: false) = notable.dropFirst().first else {
            Issue.record("no response head: \(out)")
            return
        }
        #expect(fields.first == H2Field(":status", "401"))
        #expect(fields.contains(H2Field("www-authenticate", "Bearer error=\"invalid_token\"")))
        #expect(fields.contains(H2Field("proxy-status", "proxyctl; received-status=401")))
        #expect(!fields.contains { $0.name == Array("connection".utf8) })
        #expect(
            Array(notable.suffix(3)) == [
                .tunnelToStream(1, 5), .endStream(1, trailers: []), .closeTunnel(1),
            ])
    }

    @Test func theClientResettingTheStreamClosesThePair() {
        var session = Self.session
        _ = Self.open(&session)
        var out: [Action] = []
        session.handle(.streamClosed(1, errorCode: H2ErrorCode.cancel.rawValue), now: 2, &out)
        #expect(out.first == .closeTunnel(1))
        #expect(session.isIdle)
    }

    @Test func theOtherSideEndingBeforeAnAnswerIs502() {
        var session = Self.session
        _ = Self.open(&session)
        var out: [Action] = []
        session.handle(.tunnelEnded(1), now: 2, &out)
        #expect(out.first == .closeTunnel(1))
        guard case .respond(1, let fields, _) = out.dropFirst().first else {
            Issue.record("no answer: \(out)")
            return
        }
        #expect(fields.first == H2Field(":status", "502"))
    }
}
