import Testing

@testable import ProxyCore

/// WebSocket (HTTP/1.1 Upgrade) to protected origins, as playbooks: the token on the upgrade request, the
/// origin's connection of the proxy's own (TLS for an https origin), a 401 refreshed and replayed once on a
/// new connection, and the tunnel after 101; the same inside an intercepted tunnel and on the front door.
@Suite struct UpgradePlaybooks {
    static let request =
        "GET /ws?room=1 HTTP/1.1\r\nHost: api.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    static let switched =
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"

    /// The upgrade request as the origin gets it (the I/O layer's credential shown as the playbook's marker).
    static func upstreamHead(token generation: Int64?) -> String {
        "GET /ws?room=1 HTTP/1.1\r\nHost: api.test\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            + (generation.map { "Authorization: <token \($0)>\r\n" } ?? "") + "\r\n"
    }

    static func tunnel() -> Playbook {
        var p = Playbook.intercepted(Origins.https)
        p.event(.tlsEstablished(serverName: "api.test", protocol: "http/1.1"))
        return p
    }

    static func outputs(_ actions: [ConnectionMachine.Action]) -> [ProtectedExchange.Output] {
        actions.compactMap { if case .exchange(let output, _) = $0 { output } else { nil } }
    }

    static func record(_ actions: [ConnectionMachine.Action]) -> ExchangeRecord? {
        actions.lazy.compactMap { if case .exchangeFinished(let record) = $0 { record } else { nil } }.first
    }

    /// Tokens, then the proxy's own connection to the origin with TLS, then the head with the token.
    static func connectsWithTLS(_ p: inout Playbook, token generation: Int64) {
        p.connectUpstream()
        #expect(p.next() == [.connect(address: 0), .startUpstreamTLS(serverName: "api.test", caFile: nil)])
        #expect(p.timers[.connect] != nil, "the TLS handshake has a deadline")
        p.event(.upstreamTLSEstablished)
        #expect(p.upstreamGot() == Self.upstreamHead(token: generation))
        #expect(
            p.next() == [
                .writeUpstreamHead(
                    Array(Self.upstreamHead(token: nil).utf8),
                    credential: UpstreamRequest.Credential(generation: generation, dpopNonce: nil), method: "GET",
                    url: "https://api.test/ws?room=1")
            ])
    }

    @Test func theTokenRidesOnTheUpgradeAndThe101BecomesATunnel() {
        var p = Self.tunnel()
        p.client(Self.request)
        #expect(Self.outputs(p.next()) == [.getTokens(key: TokenKey(provider: "corp"))])
        #expect(!p.reading, "nothing is read from the client until the origin switched protocols")
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        #expect(p.next() == [.resolve(hop("api.test:443"))])
        Self.connectsWithTLS(&p, token: 7)
        p.upstream(Self.switched)
        #expect(p.clientGot() == Self.switched)
        let actions = p.next()
        let record = Self.record(actions)
        #expect(record?.status == 101 && record?.attached == true && record?.attempts == 1)
        #expect(
            record?.logLine(up: 0, down: 0, milliseconds: 3)
                == "GET https://api.test/ws?... status=101 up=0 down=0 duration=3ms intercepted=corp note=\"switched protocols\""
        )
        #expect(actions.last == .startTunnel(label: "GET https://api.test/ws?...", status: 101))
    }

    @Test func a401ToTheUpgradeIsRefreshedAndReplayedOnceOnANewConnection() {
        var p = Self.tunnel()
        p.client(Self.request)
        _ = p.next()
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        Self.connectsWithTLS(&p, token: 7)
        p.upstream(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\"\r\nContent-Length: 5\r\n\r\nnope!"
        )
        #expect(p.clientGot() == "", "the refusal is not the client's")
        let refreshed = p.next()
        #expect(refreshed.first == .closeUpstream)
        #expect(Self.outputs(refreshed) == [.refreshTokens(key: TokenKey(provider: "corp"), replacing: 7)])
        p.event(.refreshed(.success(TokenGrant(generation: 8))))
        #expect(p.next() == [.resolve(hop("api.test:443"))])
        Self.connectsWithTLS(&p, token: 8)
        p.upstream(Self.switched)
        #expect(p.clientGot() == Self.switched)
        let record = Self.record(p.next())
        #expect(record?.attempts == 2 && record?.refreshed == true)
    }

    @Test func a401AfterTheRefreshGoesToTheClientWithProxyStatus() {
        var p = Self.tunnel()
        p.client(Self.request)
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        Self.connectsWithTLS(&p, token: 7)
        let refusal =
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\"\r\nContent-Length: 5\r\n\r\nnope!"
        p.upstream(refusal)
        p.event(.refreshed(.success(TokenGrant(generation: 8))))
        _ = p.next()
        Self.connectsWithTLS(&p, token: 8)
        p.upstream(refusal)
        let got = p.clientGot()
        #expect(got.hasPrefix("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\"\r\n"))
        #expect(got.contains("\r\nConnection: close\r\nProxy-Status: proxyctl; received-status=401; details="))
        #expect(got.hasSuffix("\r\n\r\nnope!"))
        let actions = p.next()
        #expect(Self.record(actions)?.status == 401)
        #expect(actions.contains(.closeAfterFlush))
        #expect(!actions.contains { if case .startTunnel = $0 { true } else { false } })
    }

    /// A 401 to the upgrade naming the origin's resource metadata: checked as a plain request's 401 is (issue 30),
    /// before any refresh. Another authorization server: the client gets the 401's head (no body) with Proxy-Status
    /// naming the mismatch, the user is told which init to run, nothing is refreshed and no tunnel starts. The
    /// provider's own: the usual refresh and replay on a new connection.
    @Test(arguments: [true, false])
    func a401NamingMetadataOfAnotherServerIsCheckedAsAPlainRequestsIs(other: Bool) {
        var p = Self.tunnel()
        p.client(Self.request)
        _ = p.next()
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        Self.connectsWithTLS(&p, token: 7)
        p.upstream(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer resource_metadata=\"https://api.test/.well-known/oauth-protected-resource\"\r\nContent-Length: 5\r\n\r\nnope!"
        )
        #expect(p.clientGot() == "", "the refusal is not the client's before the check")
        let checking = p.next()
        #expect(checking.first == .closeUpstream)
        #expect(
            Self.outputs(checking) == [
                .checkResourceMetadata(url: "https://api.test/.well-known/oauth-protected-resource")
            ])
        guard other else {
            p.event(.resourceMetadata(.consistent))
            #expect(Self.outputs(p.next()) == [.refreshTokens(key: TokenKey(provider: "corp"), replacing: 7)])
            p.event(.refreshed(.success(TokenGrant(generation: 8))))
            #expect(p.next() == [.resolve(hop("api.test:443"))])
            Self.connectsWithTLS(&p, token: 8)
            p.upstream(Self.switched)
            #expect(p.clientGot() == Self.switched)
            #expect(Self.record(p.next())?.refreshed == true)
            return
        }
        p.event(.resourceMetadata(.otherServers(["https://login.other.example"])))
        let actions = p.next()
        #expect(Self.outputs(actions).contains(.wrongAuthorizationServer(["https://login.other.example"])))
        #expect(!Self.outputs(actions).contains { if case .refreshTokens = $0 { true } else { false } })
        let head = p.clientGot()
        #expect(head.hasPrefix("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer resource_metadata="), "\(head)")
        #expect(head.contains("Content-Length: 0\r\n") && !head.contains("Content-Length: 5"), "\(head)")
        #expect(head.hasSuffix("\r\n\r\n"), "no body: it was not kept while the check ran")
        #expect(
            head.contains(
                "Proxy-Status: proxyctl; error=proxy_configuration_error; received-status=401; details=\"the origin's resource metadata names the authorization server https://login.other.example, not the issuer of [provider corp]; set it up with: proxyctl init --origin https://api.test\""
            ), "\(head)")
        let record = Self.record(actions)
        #expect(record?.status == 401 && record?.refreshed == false && record?.attempts == 1)
        #expect(actions.contains(.closeAfterFlush))
        #expect(!actions.contains { if case .startTunnel = $0 { true } else { false } })
    }

    /// A static secret has no authorization server for the metadata to contradict: its upgrade's 401 is handled
    /// as any other (the secret fetched again), with no metadata check.
    @Test func aStaticSecretsUpgradeChecksNoMetadata() {
        var origin = Origins.https
        origin.secret = .file("/nonexistent/secret")
        var p = Playbook.intercepted(origin)
        p.event(.tlsEstablished(serverName: "api.test", protocol: "http/1.1"))
        p.client(Self.request)
        _ = p.next()
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        p.connectUpstream()
        p.event(.upstreamTLSEstablished)
        _ = p.next()
        p.upstream(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer resource_metadata=\"https://api.test/.well-known/oauth-protected-resource\"\r\nContent-Length: 0\r\n\r\n"
        )
        let outputs = Self.outputs(p.next())
        #expect(!outputs.contains { if case .checkResourceMetadata = $0 { true } else { false } })
        #expect(outputs.contains { if case .refreshTokens = $0 { true } else { false } })
    }

    @Test func aStepUpChallengeIsPassedOnAndRecorded() {
        var p = Self.tunnel()
        p.client(Self.request)
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        Self.connectsWithTLS(&p, token: 7)
        p.upstream(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"insufficient_user_authentication\", acr_values=\"mfa\"\r\nContent-Length: 0\r\n\r\n"
        )
        #expect(p.clientGot().contains("Proxy-Status: proxyctl; received-status=401; details="))
        let outputs = Self.outputs(p.next())
        #expect(outputs.contains { if case .recordStepUp = $0 { true } else { false } })
        #expect(!outputs.contains { if case .refreshTokens = $0 { true } else { false } }, "no refresh for a step-up")
    }

    @Test func withoutTokensTheProxyAnswersAndConnectsNowhere() {
        var p = Self.tunnel()
        p.client(Self.request)
        _ = p.next()
        p.event(.tokens(.failure(.signInNeeded(reason: "no tokens"))))
        #expect(p.clientGot().hasPrefix("HTTP/1.1 401 Unauthorized\r\nProxy-Status: proxyctl;"))
        let actions = p.next()
        #expect(Self.outputs(actions) == [.signInNeeded(reason: "no tokens")])
        #expect(Self.record(actions)?.answeredByProxy == true)
        #expect(actions.last == .closeAfterFlush && p.connects.isEmpty)
    }

    @Test func aCertificateThatDoesNotVerifyIs502() {
        var p = Self.tunnel()
        p.client(Self.request)
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        p.connectUpstream()
        _ = p.next()
        p.event(.upstreamTLSFailed(.certificate, detail: "the certificate does not verify: self-signed certificate"))
        let got = p.clientGot()
        #expect(got.hasPrefix("HTTP/1.1 502 Bad Gateway\r\nProxy-Status: proxyctl; error=tls_certificate_error"))
        #expect(got.contains("self-signed certificate"))
        #expect(p.next().contains(.closeUpstream) && !p.upstreamOpen)
    }

    @Test func aTLSHandshakeThatHangsEndsAtTheConnectTimeout() {
        var p = Self.tunnel()
        p.client(Self.request)
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        p.connectUpstream()
        p.wait(5_000)
        #expect(p.clientGot().hasPrefix("HTTP/1.1 504 Gateway Timeout"))
        #expect(!p.upstreamOpen)
    }

    @Test func theClientsOwnAuthorizationTravelsWhenTheOriginKeepsIt() {
        var origin = Origins.https
        origin.clientAuthorization = .keep
        var p = Playbook.intercepted(origin)
        p.event(.tlsEstablished(serverName: "api.test", protocol: "http/1.1"))
        p.client(
            Self.request.replacingOccurrences(
                of: "Host: api.test\r\n", with: "Host: api.test\r\nAuthorization: Basic eDp5\r\n"))
        #expect(Self.outputs(p.next()).isEmpty, "no token is asked for")
        p.connectUpstream()
        p.event(.upstreamTLSEstablished)
        #expect(p.upstreamGot().contains("\r\nAuthorization: Basic eDp5\r\n"))
    }

    @Test func onTheFrontDoorAPlainOriginGetsNoTLS() {
        var p = Playbook.frontDoor(origins: [Origins.http])
        p.client(
            "GET http://127.0.0.1:9000/ws HTTP/1.1\r\nHost: 127.0.0.1:9000\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        )
        #expect(Self.outputs(p.next()) == [.getTokens(key: TokenKey(provider: "corp"))])
        p.event(.tokens(.success(TokenGrant(generation: 2))))
        #expect(p.next() == [.resolve(hop("127.0.0.1:9000"))])
        p.connectUpstream()
        #expect(
            p.upstreamGot()
                == "GET /ws HTTP/1.1\r\nHost: 127.0.0.1:9000\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nAuthorization: <token 2>\r\n\r\n"
        )
        p.upstream(Self.switched)
        #expect(p.clientGot() == Self.switched)
        #expect(p.next().last == .startTunnel(label: "GET http://127.0.0.1:9000/ws", status: 101))
    }

    @Test func anUpgradeWithABodyIsRefused() {
        var p = Self.tunnel()
        p.client(Self.request.replacingOccurrences(of: "\r\n\r\n", with: "\r\nContent-Length: 2\r\n\r\nhi"))
        #expect(p.clientGot().hasPrefix("HTTP/1.1 501 Not Implemented"))
        #expect(Self.outputs(p.next()).isEmpty)
    }
}
