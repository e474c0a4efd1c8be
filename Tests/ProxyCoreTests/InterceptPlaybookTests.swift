import Foundation
import Testing

@testable import ProxyCore

/// Requests to protected origins as playbooks: inside an intercepted TLS connection and on the front door
/// (a protected http:// origin). What the origin gets is the `send` output (no token in it, only its
/// generation); what the client gets is bytes.
@Suite struct InterceptPlaybooks {
    typealias Output = ProtectedExchange.Output

    static let origin = Origins.https

    /// An intercepted connection after its TLS handshake with the right SNI.
    static func tunnel(_ settings: ProxySettings = Playbook.settings) -> Playbook {
        var p = Playbook.intercepted(origin, settings: settings)
        p.event(.tlsEstablished(serverName: "API.test.", protocol: "http/1.1"))
        return p
    }

    static func sends(_ actions: [ConnectionMachine.Action]) -> [UpstreamRequest] {
        actions.compactMap { if case .exchange(.send(let request), _) = $0 { request } else { nil } }
    }

    static func outputs(_ actions: [ConnectionMachine.Action]) -> [Output] {
        actions.compactMap { if case .exchange(let output, _) = $0 { output } else { nil } }
    }

    @Test func attachesTheTokenAndDeliversTheResponse() {
        var p = Self.tunnel()
        p.client("GET /me?x=1 HTTP/1.1\r\nHost: api.test\r\nAccept: */*\r\n\r\n")
        #expect(Self.outputs(p.next()) == [.bodyEnded, .getTokens(key: TokenKey(provider: "corp"))])
        p.event(.tokens(.success(TokenGrant(generation: 7, dpopNonce: "n-cached"))))
        let sent = Self.sends(p.next())
        #expect(sent.count == 1)
        #expect(sent.first?.url == "https://api.test/me?x=1")
        #expect(sent.first?.credential == UpstreamRequest.Credential(generation: 7, dpopNonce: "n-cached"))
        #expect(sent.first?.fields.map(\.name) == ["Accept"])
        #expect(sent.first?.body == UpstreamRequest.Body.none)
        p.transferHead("HTTP/1.1 200 \r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\n")
        #expect(p.clientGot() == "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nContent-Length: 5\r\n\r\n")
        p.event(.transferBody(count: 5))
        #expect(p.next() == [.writeResponseBody])
        p.event(.transferFinished(nil, detail: ""))
        guard case .exchangeFinished(let record) = p.next().first else {
            Issue.record("the exchange did not finish")
            return
        }
        #expect(
            record.logLine(up: 0, down: 73, milliseconds: 12)
                == "GET https://api.test/me?... status=200 up=0 down=73 duration=12ms intercepted=corp")
        #expect(p.machine.isIdle && p.timers[.keepAlive] != nil)
    }

    /// Issue 31: a request carrying another origin's placeholder is answered 403 and nothing is sent; the machine
    /// hands the audit log a refused use naming whose placeholder it was, without the placeholder.
    @Test func anotherOriginsPlaceholderIsRefusedAndAudited() {
        let placeholder = "proxyctl-placeholder-ffeeddccbbaa99887766554433221100"
        var origin = Self.origin
        origin.placeholders = Placeholders([
            Placeholders.Entry(
                value: Array(placeholder.utf8), origin: "https://b.test", variable: "B_KEY", credential: "secret:b")
        ])
        var p = Playbook.intercepted(origin)
        p.event(.tlsEstablished(serverName: "api.test", protocol: "http/1.1"))
        p.client("GET /steal?q=1 HTTP/1.1\r\nHost: api.test\r\nX-Key: \(placeholder)\r\n\r\n")
        let actions = p.next()
        #expect(Self.outputs(actions).isEmpty)
        #expect(p.clientGot().hasPrefix("HTTP/1.1 403 "))
        #expect(p.refusals.count == 1)
        let use = p.refusals.first
        #expect(use?.origin == "https://api.test" && use?.method == "GET" && use?.target == "/steal?q=1")
        #expect(use?.refusal.origin == "https://b.test" && use?.refusal.variable == "B_KEY")
        #expect(use?.refusal.credential == "secret:b")
    }

    /// An origin with its own audience and scopes asks for the token of its key, for the first request and
    /// for the refresh after a 401 alike: never the provider's default token, never another origin's.
    @Test func anOriginWithItsOwnAudienceAsksForItsOwnToken() {
        var origin = Self.origin
        origin.resource = "https://api.test/"
        origin.scopes = ["api.read"]
        let key = TokenKey(provider: "corp", resource: "https://api.test/", scopes: ["api.read"])
        #expect(
            origin.tokenKey == key && !key.isProviderDefault && key.id == "resource=https://api.test/;scope=api.read")
        var p = Playbook.intercepted(origin)
        p.event(.tlsEstablished(serverName: "api.test", protocol: "http/1.1"))
        p.client("GET /me HTTP/1.1\r\nHost: api.test\r\n\r\n")
        #expect(Self.outputs(p.next()) == [.bodyEnded, .getTokens(key: key)])
        p.event(.tokens(.success(TokenGrant(generation: 3))))
        #expect(Self.sends(p.next()).first?.credential?.generation == 3)
        p.transferHead("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\"\r\n\r\n")
        p.event(.transferFinished(nil, detail: ""))
        #expect(Self.outputs(p.next()) == [.refreshTokens(key: key, replacing: 3)])
    }

    @Test func anIDTokenOriginAsksForTheIDToken() {
        var origin = Self.origin
        origin.tokenType = .idToken
        var p = Playbook.intercepted(origin)
        p.event(.tlsEstablished(serverName: "api.test", protocol: "http/1.1"))
        p.client("GET / HTTP/1.1\r\nHost: api.test\r\n\r\n")
        #expect(Self.outputs(p.next()) == [.bodyEnded, .getTokens(key: TokenKey(provider: "corp", kind: .idToken))])
    }

    @Test func refreshesOnceAndReplaysOnceOnA401() {
        var p = Self.tunnel()
        p.client("POST /items HTTP/1.1\r\nHost: api.test\r\nContent-Length: 4\r\n\r\nbody")
        #expect(p.keptBody == Array("body".utf8))
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        _ = p.next()
        p.transferHead("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\"\r\n\r\n")
        #expect(p.clientGot() == "", "the 401 is not the client's business")
        p.event(.transferFinished(nil, detail: ""))
        #expect(Self.outputs(p.next()) == [.refreshTokens(key: TokenKey(provider: "corp"), replacing: 1)])
        p.event(.refreshed(.success(TokenGrant(generation: 2))))
        let replay = Self.sends(p.next())
        #expect(replay.map(\.attempt) == [2] && replay.first?.credential?.generation == 2)
        #expect(replay.first?.body == .length(4))
        p.transferHead("HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
        p.event(.transferFinished(nil, detail: ""))
        #expect(p.clientGot() == "HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
        guard case .exchangeFinished(let record) = p.next().last else {
            Issue.record("not finished")
            return
        }
        #expect(record.refreshed && record.attempts == 2)
        #expect(record.logLine(up: 8, down: 40, milliseconds: 5).hasSuffix("attempts=2 refreshed=1"))
    }

    @Test func retriesOnceWithTheDPoPNonceItAskedFor() {
        var p = Self.tunnel()
        p.client("GET /d HTTP/1.1\r\nHost: api.test\r\n\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 3))))
        _ = p.next()
        p.transferHead(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: DPoP error=\"use_dpop_nonce\"\r\nDPoP-Nonce: fresh-1\r\n\r\n"
        )
        #expect(Self.outputs(p.next()) == [.rememberNonce("fresh-1")])
        p.event(.transferFinished(nil, detail: ""))
        #expect(Self.sends(p.next()).first?.credential == .init(generation: 3, dpopNonce: "fresh-1"))
        // Asked again: not retried twice, passed on with Proxy-Status.
        p.transferHead(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: DPoP error=\"use_dpop_nonce\"\r\nDPoP-Nonce: fresh-2\r\nContent-Length: 0\r\n\r\n"
        )
        let head = p.clientGot()
        #expect(head.hasPrefix("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: DPoP error=\"use_dpop_nonce\"\r\n"))
        #expect(
            head.contains(
                "Proxy-Status: proxyctl; received-status=401; details=\"the origin asked for a DPoP nonce again"))
    }

    /// A 401 naming the origin's resource metadata: the metadata is asked about once the 401 ended, and when it
    /// names another authorization server the client gets that 401 (its fields, no body) with Proxy-Status and
    /// no refresh happens; when it names the provider's, the usual refresh and replay follow.
    @Test(arguments: [true, false])
    func aNamedMetadataThatNamesAnotherServerEndsInThe401WithProxyStatus(other: Bool) {
        var p = Self.tunnel()
        p.client("GET /me HTTP/1.1\r\nHost: api.test\r\n\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        _ = p.next()
        p.transferHead(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer resource_metadata=\"https://api.test/.well-known/oauth-protected-resource\"\r\nContent-Length: 7\r\n\r\n"
        )
        p.event(.transferBody(count: 7))
        #expect(p.clientGot() == "")
        p.event(.transferFinished(nil, detail: ""))
        #expect(
            Self.outputs(p.next()) == [
                .checkResourceMetadata(url: "https://api.test/.well-known/oauth-protected-resource")
            ])
        guard other else {
            p.event(.resourceMetadata(.consistent))
            #expect(Self.outputs(p.next()) == [.refreshTokens(key: TokenKey(provider: "corp"), replacing: 1)])
            return
        }
        p.event(.resourceMetadata(.otherServers(["https://login.other.example"])))
        let actions = p.next()
        #expect(Self.outputs(actions).contains(.wrongAuthorizationServer(["https://login.other.example"])))
        let head = p.clientGot()
        #expect(head.hasPrefix("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer resource_metadata="))
        #expect(head.contains("Content-Length: 0\r\n") && !head.contains("Content-Length: 7"))
        #expect(
            head.contains(
                "Proxy-Status: proxyctl; error=proxy_configuration_error; received-status=401; details=\"the origin's resource metadata names the authorization server https://login.other.example, not the issuer of [provider corp]; set it up with: proxyctl init --origin https://api.test\""
            ), "\(head)")
        guard case .exchangeFinished(let record) = actions.last else {
            Issue.record("not finished")
            return
        }
        #expect(!record.refreshed && record.attempts == 1 && record.status == 401)
    }

    @Test func anInsufficientScopeIsPassedOnAndRecordedForStepUp() {
        var p = Self.tunnel()
        p.client("GET /admin HTTP/1.1\r\nHost: api.test\r\n\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        _ = p.next()
        p.transferHead(
            "HTTP/1.1 403 Forbidden\r\nWWW-Authenticate: Bearer error=\"insufficient_scope\", scope=\"admin\"\r\nContent-Length: 0\r\n\r\n"
        )
        let outputs = Self.outputs(p.next())
        guard case .recordStepUp(let challenge) = outputs.first else {
            Issue.record("not recorded: \(outputs)")
            return
        }
        #expect(challenge.insufficientScope == ["admin"])
        #expect(
            p.clientGot().contains(
                "Proxy-Status: proxyctl; received-status=403; details=\"the origin needs the scope admin: run proxyctl step-up https://api.test\""
            ))
    }

    @Test func aStepUpChallengeIsPassedOnAndRecorded() {
        var p = Self.tunnel()
        p.client("GET /admin HTTP/1.1\r\nHost: api.test\r\n\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        _ = p.next()
        p.transferHead(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"insufficient_user_authentication\", acr_values=\"urn:mfa\"\r\nContent-Length: 0\r\n\r\n"
        )
        let outputs = Self.outputs(p.next())
        #expect(outputs.count == 1)
        if case .recordStepUp(let challenge) = outputs.first { #expect(challenge["acr_values"] == "urn:mfa") }
        let head = p.clientGot()
        #expect(
            head.contains("details=\"step-up required (acr_values urn:mfa): run proxyctl step-up https://api.test\""))
    }

    @Test(arguments: [
        (TokenFailure.signInNeeded(reason: "not signed in to corp"), "HTTP/1.1 401 Unauthorized", false),
        (.unavailable(reason: "timed out", retryAfter: 30), "HTTP/1.1 503 Service Unavailable", false),
        (.configuration(reason: "unknown client"), "HTTP/1.1 500 Internal Server Error", false),
    ])
    func noTokenIsAnsweredByTheProxy(failure: TokenFailure, status: String, closes: Bool) {
        var p = Self.tunnel()
        p.client("GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n")
        _ = p.next()
        p.event(.tokens(.failure(failure)))
        let answer = p.clientGot()
        #expect(answer.hasPrefix(status))
        if case .unavailable = failure { #expect(answer.contains("Retry-After: 30\r\n")) }
        let notable = p.next()
        if case .signInNeeded = failure {
            #expect(Self.outputs(notable) == [.signInNeeded(reason: "not signed in to corp")])
        }
        #expect((p.clientClosed != nil) == closes, "a keep-alive connection outlives an answer about tokens")
    }

    @Test func theClientsOwnAuthorizationIsKeptAndNothingAttachedUnderKeep() {
        var origin = Self.origin
        origin.clientAuthorization = .keep
        var p = Playbook.intercepted(origin)
        p.event(.tlsEstablished(serverName: "api.test", protocol: "http/1.1"))
        p.client("GET /x HTTP/1.1\r\nHost: api.test\r\nAuthorization: Basic dTpw\r\n\r\n")
        let sent = Self.sends(p.next())
        #expect(sent.first?.credential == nil)
        #expect(sent.first?.fields.map(\.name) == ["Authorization"])
    }

    /// Issue 31: by default (`client_credential = replace`) the token replaces the client's own Authorization, and
    /// the record says so (the log's `client_credential=replaced`, the audit line's `client_credential_replaced`).
    @Test func theClientsOwnAuthorizationIsReplacedByDefault() {
        var p = Self.tunnel()
        p.client("GET /x HTTP/1.1\r\nHost: api.test\r\nAuthorization: Basic dTpw\r\nAccept: */*\r\n\r\n")
        #expect(Self.outputs(p.next()) == [.bodyEnded, .getTokens(key: TokenKey(provider: "corp"))])
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        let sent = Self.sends(p.next())
        #expect(sent.first?.credential?.generation == 7)
        #expect(sent.first?.fields.map(\.name) == ["Accept"])
        p.transferHead("HTTP/1.1 204 No Content\r\n\r\n")
        p.event(.transferFinished(nil, detail: ""))
        guard case .exchangeFinished(let record) = p.next().last else {
            Issue.record("the exchange did not finish")
            return
        }
        #expect(record.clientCredentialReplaced && !record.keptClientAuthorization)
    }

    @Test func aChunkedBodyStreamsAsItArrivesAndIsKept() {
        var p = Self.tunnel()
        p.client("PUT /u HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n")
        // The request goes as soon as there is a token, not when the body is complete.
        #expect(Self.outputs(p.next()) == [.getTokens(key: TokenKey(provider: "corp"))])
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        #expect(Self.sends(p.next()).first?.body == .streaming, "chunked stays chunked")
        #expect(p.keptBody == Array("abc".utf8))
        p.client("2\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n")
        let actions = p.next()
        #expect(Self.outputs(actions) == [.bodyEnded])
        #expect(actions.first == .requestTrailers([H2Field("X-Trailer", "1")]), "the trailers go before the end")
        #expect(p.keptBody == Array("abcde".utf8))
        #expect(p.clientIn.isEmpty)
    }

    /// RFC 9112 §7.1.2: a chunked request's trailer fields reach the origin with the last chunk (once dropped on the
    /// way to a protected origin); arriving a byte at a time changes nothing, and those a trailer must not carry
    /// are left out where the last chunk is written (`ChunkedFraming.last`).
    @Test func aChunkedRequestsTrailersGoOnToTheOrigin() {
        let body = "3\r\nabc\r\n0\r\nx-checksum: sha256=1\r\nHost: evil.test\r\ngrpc-timeout: 1S\r\n\r\n"
        for split in [false, true] {
            var p = Self.tunnel()
            p.client("POST /t HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n")
            var actions: [Playbook.Action] = []
            if split {
                for byte in body.utf8 {
                    p.client([byte])
                    actions += p.next()
                }
            } else {
                p.client(body)
                actions = p.next()
            }
            let trailers = actions.compactMap { if case .requestTrailers(let fields) = $0 { fields } else { nil } }
            let read = [H2Field("x-checksum", "sha256=1"), H2Field("Host", "evil.test"), H2Field("grpc-timeout", "1S")]
            #expect(trailers == [read], "split: \(split)")
            #expect(
                String(decoding: ChunkedFraming.last(trailers: read), as: UTF8.self)
                    == "0\r\nx-checksum: sha256=1\r\ngrpc-timeout: 1S\r\n\r\n")
        }
    }

    @Test func aContentLengthStaysAContentLength() {
        var p = Self.tunnel()
        p.client("PUT /u HTTP/1.1\r\nHost: api.test\r\nContent-Length: 10\r\n\r\nabc")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        #expect(Self.sends(p.next()).first?.body == .length(10))
    }

    @Test func aRefusalBeforeTheBodyIsCompleteIsReplayedOnceTheRestIsKept() {
        var p = Self.tunnel()
        p.client("POST /p HTTP/1.1\r\nHost: api.test\r\nContent-Length: 6\r\n\r\nabc")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        _ = p.next()
        p.transferHead("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\"\r\n\r\n")
        p.event(.transferFinished(nil, detail: ""))
        #expect(Self.outputs(p.next()) == [], "the rest of the body comes first")
        p.client("def")
        #expect(Self.outputs(p.next()) == [.bodyEnded, .refreshTokens(key: TokenKey(provider: "corp"), replacing: 1)])
        p.event(.refreshed(.success(TokenGrant(generation: 2))))
        let replay = Self.sends(p.next())
        #expect(replay.first?.attempt == 2 && replay.first?.body == .length(6))
        #expect(p.keptBody == Array("abcdef".utf8))
    }

    @Test func aBodyThatOutgrowsTheStoreAfterARefusalGetsTheRefusal() {
        var p = Self.tunnel()
        p.client("POST /p HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        _ = p.next()
        p.transferHead("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer\r\nContent-Length: 12\r\n\r\n")
        p.event(.transferFinished(nil, detail: ""))
        #expect(p.clientGot() == "")
        // replay_spool is 1 KiB in these playbooks: 2 KiB more cannot be kept.
        p.client("800\r\n" + String(repeating: "x", count: 2048) + "\r\n")
        let answer = p.clientGot()
        #expect(answer.hasPrefix("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer\r\n"))
        #expect(answer.contains("Content-Length: 0\r\n"), "the discarded body is not announced")
        #expect(answer.contains("the request body was too large to keep, so the request was not sent again"))
    }

    /// The refusal that goes to the client instead of a replay ends the exchange: its transfer is over. The
    /// rest of the body is not read as a request; the connection closes.
    @Test func aRefusalForABodyThatOutgrewTheStoreEndsTheExchange() {
        var p = Self.tunnel()
        p.client("POST /p HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        p.transferHead("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer\r\nContent-Length: 0\r\n\r\n")
        p.event(.transferFinished(nil, detail: ""))
        _ = p.next()
        p.client("800\r\n" + String(repeating: "x", count: 2048) + "\r\n")
        let notable = p.next()
        #expect(notable.first == .exchange(.streamBody, Self.origin))
        guard case .exchangeFinished(let record) = notable.dropFirst().first else {
            Issue.record("the exchange did not finish: \(notable)")
            return
        }
        #expect(record.status == 401 && record.attempts == 1 && !record.cutShort)
        #expect(notable.last == .closeAfterFlush && notable.count == 3)
    }

    /// The body outgrows the store while the origin's 401 is still arriving: the refusal was headed for a
    /// refresh and a replay, but a replay would send a body with its middle missing. The client gets the 401.
    @Test func aBodyThatOutgrowsTheStoreWhileARefusalArrivesIsNotSentAgain() {
        var p = Self.tunnel()
        p.client("POST /p HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        p.transferHead("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\"\r\n\r\n")
        _ = p.next()
        p.client("800\r\n" + String(repeating: "x", count: 2048) + "\r\n")
        #expect(Self.outputs(p.next()) == [.streamBody])
        p.event(.transferFinished(nil, detail: ""))
        let answer = p.clientGot()
        #expect(answer.hasPrefix("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\"\r\n"))
        #expect(answer.contains("the request body was too large to keep, so the request was not sent again"))
        let notable = p.next()
        #expect(Self.outputs(notable) == [], "no refresh, no second send")
        #expect(notable.count == 2 && notable.last == .closeAfterFlush, "\(notable)")
    }

    @Test func aBodyTooLargeToKeepStreamsAndIsNotReplayed() {
        var p = Self.tunnel()
        p.client(
            "POST /big HTTP/1.1\r\nHost: api.test\r\nContent-Length: 2000\r\n\r\n" + String(repeating: "x", count: 100))
        #expect(Self.outputs(p.next()) == [.streamBody, .getTokens(key: TokenKey(provider: "corp"))])
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        #expect(Self.sends(p.next()).first?.body == .length(2000), "sent before the body is complete")
        p.transferHead("HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
        #expect(p.clientGot().contains("the request body was too large to keep"))
    }

    @Test func expectContinueIsAnsweredByTheProxy() {
        var p = Self.tunnel()
        p.client("POST /c HTTP/1.1\r\nHost: api.test\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        #expect(p.clientGot() == "HTTP/1.1 100 Continue\r\n\r\n")
        #expect(Self.outputs(p.next()) == [.getTokens(key: TokenKey(provider: "corp"))])
        p.client("ok")
        #expect(Self.outputs(p.next()) == [.bodyEnded])
    }

    @Test func pipelinedRequestsInsideTheTunnelWaitTheirTurn() {
        var p = Self.tunnel()
        p.client("GET /1 HTTP/1.1\r\nHost: api.test\r\n\r\nGET /2 HTTP/1.1\r\nHost: api.test\r\n\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        #expect(Self.sends(p.next()).map(\.url) == ["https://api.test/1"])
        p.transferHead("HTTP/1.1 204 No Content\r\n\r\n")
        p.event(.transferFinished(nil, detail: ""))
        #expect(
            Self.outputs(p.next()) == [.bodyEnded, .getTokens(key: TokenKey(provider: "corp"))], "the second one starts"
        )
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        #expect(Self.sends(p.next()).map(\.url) == ["https://api.test/2"])
    }

    @Test func aServerNameForAnotherHostMakesEveryRequest421() {
        var p = Playbook.intercepted(Self.origin)
        p.event(.tlsEstablished(serverName: "evil.test", protocol: nil))
        p.client("GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n")
        let answer = p.clientGot()
        #expect(answer.hasPrefix("HTTP/1.1 421 Misdirected Request"))
        #expect(answer.contains("the TLS server name evil.test does not match the tunnel's api.test"))
        #expect(Self.outputs(p.next()).isEmpty, "no token asked for")
    }

    @Test(arguments: [
        "GET /x HTTP/1.1\r\nHost: other.test\r\n\r\n", "GET /x HTTP/1.1\r\nHost: api.test:8443\r\n\r\n",
        "GET https://other.test/x HTTP/1.1\r\nHost: api.test\r\n\r\n",
    ])
    func aHostForAnotherOriginIs421WithoutAToken(request: String) {
        var p = Self.tunnel()
        p.client(request)
        #expect(p.clientGot().hasPrefix("HTTP/1.1 421 Misdirected Request"))
        #expect(Self.outputs(p.next()).isEmpty)
    }

    /// A head whose fields cannot be used is refused by the exchange, which stops the transfer (its body could be
    /// endless); one the reader cannot parse at all ends the transfer itself (`stops` false).
    @Test(arguments: [
        ("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 8\r\n\r\n", "error=http_protocol_error", true),
        ("HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\n", "error=http_protocol_error", true),
        ("HTTP/1.1 2xx OK\r\n\r\n", "error=http_protocol_error", false),
    ])
    func anUnusableResponseHeadIs502(head: String, error: String, stops: Bool) {
        var p = Self.tunnel()
        p.client("GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        _ = p.next()
        p.transferHead(head)
        // At once: the transfer is stopped (its body could be endless) and the client answered.
        let answer = p.clientGot()
        #expect(answer.hasPrefix("HTTP/1.1 502 Bad Gateway") && answer.contains(error), "\(answer)")
        #expect((p.next().first == .exchange(.cancelTransfer, Self.origin)) == stops)
    }

    @Test func aDiscardedRefusalIsReadToItsEndOnlyWhileSmall() {
        var p = Self.tunnel()
        p.client("GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        _ = p.next()
        p.transferHead("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer\r\nContent-Length: 99999999\r\n\r\n")
        p.event(.transferBody(count: 60_000))
        #expect(p.next() == [], "a small body is read to keep the connection")
        p.event(.transferBody(count: 60_000))
        #expect(
            Self.outputs(p.next()) == [.cancelTransfer, .refreshTokens(key: TokenKey(provider: "corp"), replacing: 1)])
        // The stopped transfer's own end, if it comes, changes nothing.
        p.event(.transferFinished(.other, detail: "aborted"))
        #expect(p.next() == [] && p.clientGot() == "")
    }

    @Test func aTooLargeResponseHeadIsNamed() {
        var settings = Playbook.settings
        settings.headLimits = HTTPHeadLimits(maxStartLine: 8192, maxHeadBytes: 200, maxFields: 100)
        var p = Self.tunnel(settings)
        p.client("GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        p.transferHead("HTTP/1.1 200 OK\r\nX-Big: \(String(repeating: "b", count: 300))\r\n\r\n")
        p.event(.transferFinished(nil, detail: ""))
        #expect(p.clientGot().contains("error=http_response_header_section_size"))
    }

    @Test(arguments: [
        (UpstreamFailure.connect, "HTTP/1.1 502", "error=connection_refused"),
        (.timeout, "HTTP/1.1 504", "error=connection_timeout"),
        (.certificate, "HTTP/1.1 502", "error=tls_certificate_error"),
        (.headTooLarge, "HTTP/1.1 502", "error=http_response_header_section_size"),
    ])
    func aFailedTransferIsAnsweredWithItsCause(failure: UpstreamFailure, status: String, error: String) {
        var p = Self.tunnel()
        p.client("GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        p.event(.transferFinished(failure, detail: "curl says why"))
        let answer = p.clientGot()
        #expect(answer.hasPrefix(status) && answer.contains(error) && answer.contains("curl says why"), "\(answer)")
        #expect(p.clientClosed == .closeAfterFlush)
    }

    @Test func aResponseCutShortClosesTheConnection() {
        var p = Self.tunnel()
        p.client("GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        p.transferHead("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
        p.event(.transferFinished(.incomplete, detail: "recv failure"))
        #expect(p.clientClosed == .closeAfterFlush)
    }

    @Test func aClientThatGoesAwayMidBodyStopsTheTransfer() {
        var p = Self.tunnel()
        p.client("POST /big HTTP/1.1\r\nHost: api.test\r\nContent-Length: 2000\r\n\r\nxx")
        p.event(.tokens(.success(TokenGrant(generation: 1))))
        _ = p.next()
        p.event(.clientEnded(reset: false))
        let notable = p.next()
        #expect(notable.contains(.exchange(.cancelTransfer, Self.origin)))
        #expect(notable.last == .closeNow)
    }

    @Test func connectInsideTheTunnelIs501() {
        var p = Self.tunnel()
        p.client("CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n")
        #expect(p.clientGot().hasPrefix("HTTP/1.1 501 Not Implemented"))
    }

    @Test func aHandshakeThatFailsOrStallsEndsTheConnection() {
        var failed = Playbook.intercepted(Self.origin)
        failed.event(.tlsFailed(reason: "unknown ca"))
        #expect(failed.next() == [.closeNow])
        #expect(failed.lastLog.contains("does the client trust the local CA? see proxyctl env"))
        var stalled = Playbook.intercepted(Self.origin)
        stalled.wait(20_000)
        #expect(stalled.next() == [.closeNow])
    }
}

/// Every sequence of a small alphabet of events up to a depth, from a few starting points: the driver's rules
/// hold after each (checked by `Playbook`), nothing follows a close, and the machine never stops answering
/// events with a crash. The fuzz target `FuzzConnection` goes deeper at random.
@Suite struct ConnectionMachineWalk {
    static let events: [(String, @Sendable (inout Playbook) -> Void)] = [
        ("get", { $0.client(ForwardingPlaybooks.get) }),
        ("post", { $0.client("POST http://o.test/p HTTP/1.1\r\nHost: o.test\r\nContent-Length: 1\r\n\r\nx") }),
        ("connect", { $0.client("CONNECT b.test:443 HTTP/1.1\r\n\r\n") }),
        ("protected", { $0.client("GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n") }),
        ("resolved", { $0.event(.resolved(.addresses(Playbook.addresses(2)))) }),
        ("connected", { if $0.upstreamOpen { $0.event(.upstreamConnected) } }),
        ("refused", { if $0.upstreamOpen { $0.event(.upstreamConnectFailed(.refused)) } }),
        ("response", { if $0.upstreamOpen { $0.upstream(ForwardingPlaybooks.ok) } }),
        ("upstreamEnds", { if $0.upstreamOpen { $0.upstreamEnds() } }),
        ("clientEnds", { $0.event(.clientEnded(reset: false)) }),
        ("tokens", { if $0.tokensAsked { $0.event(.tokens(.success(TokenGrant(generation: 1)))) } }),
        (
            "transfer",
            {
                $0.transferHead("HTTP/1.1 401 Unauthorized\r\n\r\n"); $0.event(.transferFinished(nil, detail: ""))
            }
        ),
        ("time", { $0.wait(12_000) }),
    ]

    static func walk(_ start: Playbook, depth: Int, path: [String] = []) -> Int {
        guard depth > 0, start.clientClosed == nil else { return 1 }
        var count = 0
        for (name, event) in events {
            var p = start
            event(&p)
            count += walk(p, depth: depth - 1, path: path + [name])
        }
        return count
    }

    @Test(arguments: [false, true])
    func everySequenceKeepsTheRules(intercepted: Bool) {
        var start: Playbook
        if intercepted {
            start = InterceptPlaybooks.tunnel()
        } else {
            start = Playbook.frontDoor(origins: [Origins.http])
        }
        let sequences = Self.walk(start, depth: 4)
        #expect(sequences > 1_000)
    }
}
