import Testing

@testable import ProxyCore

/// WebSocket (HTTP/1.1 Upgrade) to protected origins, as playbooks. An upgrade is a protected exchange like any
/// other, on the own client: the credential on the upgrade request, a 401 refreshed and replayed once, the
/// origin's resource metadata checked, a step-up passed on; after the origin's 101 the client connection and the
/// exchange's connection become a tunnel. The same inside an intercepted tunnel and on the front door.
@Suite struct UpgradePlaybooks {
    static let request =
        "GET /ws?room=1 HTTP/1.1\r\nHost: api.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    static let switched =
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
    static let refusal =
        "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\"\r\nContent-Length: 5\r\n\r\n"

    static func tunnel(_ origin: OriginConfig = Origins.https) -> Playbook {
        var p = Playbook.intercepted(origin)
        p.event(.tlsEstablished(serverName: "api.test", protocol: "http/1.1"))
        return p
    }

    static func outputs(_ actions: [ConnectionMachine.Action]) -> [ProtectedExchange.Output] {
        actions.compactMap { if case .exchange(let output, _) = $0 { output } else { nil } }
    }

    static func sends(_ actions: [ConnectionMachine.Action]) -> [UpstreamRequest] {
        outputs(actions).compactMap { if case .send(let request) = $0 { request } else { nil } }
    }

    static func record(_ actions: [ConnectionMachine.Action]) -> ExchangeRecord? {
        actions.lazy.compactMap { if case .exchangeFinished(let record) = $0 { record } else { nil } }.first
    }

    /// The upgrade request on the wire, as the own client writes it (`OriginExchange`'s HTTP/1.1 head) with the
    /// credential's fields the I/O layer made.
    static func wire(_ request: UpstreamRequest?, credential: [(name: String, value: [UInt8])] = []) -> String {
        guard let request,
            let head = UpstreamRequest.http1Head(
                method: request.method, url: request.url, target: request.requestTarget, fields: request.fields,
                body: request.originBody, credential: credential)
        else { return "" }
        return String(decoding: head, as: UTF8.self)
    }

    @Test func theTokenRidesOnTheUpgradeAndThe101BecomesATunnel() {
        var p = Self.tunnel()
        p.client(Self.request)
        #expect(Self.outputs(p.next()) == [.bodyEnded, .getTokens(key: TokenKey(provider: "corp"))])
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        let sent = Self.sends(p.next())
        #expect(sent.count == 1)
        #expect(sent.first?.upgrade == true && sent.first?.credential?.generation == 7)
        #expect(sent.first?.http2 == false, "an upgrade goes on HTTP/1.1: nothing of RFC 8441 is offered to origins")
        #expect(
            Self.wire(sent.first, credential: [("Authorization", Array("Bearer t".utf8))])
                == "GET /ws?room=1 HTTP/1.1\r\nHost: api.test\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nAuthorization: Bearer t\r\n\r\n"
        )
        p.transferHead(Self.switched)
        #expect(p.clientGot() == Self.switched, "the 101 as it came: no Connection: close, no framing")
        let actions = p.next()
        let record = Self.record(actions)
        #expect(record?.status == 101 && record?.attached == true && record?.attempts == 1)
        #expect(
            record?.logLine(up: 0, down: 0, milliseconds: 3)
                == "GET https://api.test/ws?... status=101 up=0 down=0 duration=3ms intercepted=corp note=\"switched protocols\""
        )
        #expect(actions.last == .startTunnel(label: "GET https://api.test/ws?...", status: 101))
        #expect(!actions.contains { if case .exchange(.cancelTransfer, _) = $0 { true } else { false } })
        #expect(p.connects.isEmpty, "the machine connects nowhere: the exchange's connection is the tunnel's")
    }

    @Test func a401ToTheUpgradeIsRefreshedAndReplayedOnce() {
        var p = Self.tunnel()
        p.client(Self.request)
        _ = p.next()
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        p.transferHead(Self.refusal)
        #expect(p.clientGot() == "", "the refusal is not the client's")
        p.event(.transferFinished(nil, detail: ""))
        #expect(Self.outputs(p.next()) == [.refreshTokens(key: TokenKey(provider: "corp"), replacing: 7)])
        p.event(.refreshed(.success(TokenGrant(generation: 8))))
        let replay = Self.sends(p.next())
        #expect(replay.map(\.attempt) == [2] && replay.first?.credential?.generation == 8)
        #expect(replay.first?.upgrade == true)
        p.transferHead(Self.switched)
        #expect(p.clientGot() == Self.switched)
        let record = Self.record(p.next())
        #expect(record?.attempts == 2 && record?.refreshed == true)
    }

    @Test func a401AfterTheRefreshGoesToTheClientWithProxyStatus() {
        var p = Self.tunnel()
        p.client(Self.request)
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        p.transferHead(Self.refusal)
        p.event(.transferFinished(nil, detail: ""))
        p.event(.refreshed(.success(TokenGrant(generation: 8))))
        _ = p.next()
        p.transferHead(Self.refusal)
        let got = p.clientGot()
        #expect(got.hasPrefix("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\"\r\n"))
        #expect(got.contains("\r\nProxy-Status: proxyctl; received-status=401; details="))
        p.event(.transferBody(count: 5))
        p.event(.transferFinished(nil, detail: ""))
        let actions = p.next()
        #expect(Self.record(actions)?.status == 401)
        #expect(!actions.contains { if case .startTunnel = $0 { true } else { false } })
    }

    /// The metadata naming the provider's own server: the usual refresh and replay follow.
    @Test func consistentMetadataLeadsToTheRefresh() {
        var p = Self.tunnel()
        p.client(Self.request)
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        p.transferHead(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer resource_metadata=\"https://api.test/.well-known/oauth-protected-resource\"\r\nContent-Length: 0\r\n\r\n"
        )
        p.event(.transferFinished(nil, detail: ""))
        _ = p.next()
        p.event(.resourceMetadata(.consistent))
        #expect(Self.outputs(p.next()) == [.refreshTokens(key: TokenKey(provider: "corp"), replacing: 7)])
        p.event(.refreshed(.success(TokenGrant(generation: 8))))
        #expect(Self.sends(p.next()).first?.credential?.generation == 8)
        p.transferHead(Self.switched)
        #expect(p.clientGot() == Self.switched)
        #expect(Self.record(p.next())?.refreshed == true)
    }

    /// A static secret has no authorization server for the metadata to contradict: its upgrade's 401 is handled
    /// as any other (the secret fetched again), with no metadata check.
    @Test func aStaticSecretsUpgradeChecksNoMetadata() {
        var origin = Origins.https
        origin.secret = .file("/nonexistent/secret")
        var p = Self.tunnel(origin)
        p.client(Self.request)
        _ = p.next()
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        p.transferHead(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer resource_metadata=\"https://api.test/.well-known/oauth-protected-resource\"\r\nContent-Length: 0\r\n\r\n"
        )
        p.event(.transferFinished(nil, detail: ""))
        let outputs = Self.outputs(p.next())
        #expect(!outputs.contains { if case .checkResourceMetadata = $0 { true } else { false } })
        #expect(outputs.contains { if case .refreshTokens = $0 { true } else { false } })
    }

    @Test func aStepUpChallengeIsPassedOnAndRecorded() {
        var p = Self.tunnel()
        p.client(Self.request)
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        p.transferHead(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"insufficient_user_authentication\", acr_values=\"mfa\"\r\nContent-Length: 0\r\n\r\n"
        )
        #expect(p.clientGot().contains("Proxy-Status: proxyctl; received-status=401; details="))
        let outputs = Self.outputs(p.next())
        #expect(outputs.contains { if case .recordStepUp = $0 { true } else { false } })
        #expect(!outputs.contains { if case .refreshTokens = $0 { true } else { false } }, "no refresh for a step-up")
    }

    /// RFC 9728 §5.1: a 401 naming the origin's metadata is checked before the refresh, for an upgrade as for any
    /// request (the upgrade path once skipped it).
    @Test func theOriginsResourceMetadataIsCheckedForAnUpgradeToo() {
        var p = Self.tunnel()
        p.client(Self.request)
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        p.transferHead(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer error=\"invalid_token\", resource_metadata=\"https://api.test/.well-known/oauth-protected-resource\"\r\nContent-Length: 0\r\n\r\n"
        )
        p.event(.transferFinished(nil, detail: ""))
        #expect(
            Self.outputs(p.next()) == [
                .checkResourceMetadata(url: "https://api.test/.well-known/oauth-protected-resource")
            ])
        p.event(.resourceMetadata(.otherServers(["https://elsewhere.test"])))
        let got = p.clientGot()
        #expect(got.hasPrefix("HTTP/1.1 401 Unauthorized\r\n"))
        #expect(
            got.contains(
                "Proxy-Status: proxyctl; error=proxy_configuration_error; received-status=401; details=\"the origin's resource metadata names the authorization server https://elsewhere.test, not the issuer of [provider corp]; set it up with: proxyctl init --origin https://api.test\""
            ))
        let actions = p.next()
        #expect(Self.outputs(actions).contains(.wrongAuthorizationServer(["https://elsewhere.test"])))
        #expect(!Self.outputs(actions).contains { if case .refreshTokens = $0 { true } else { false } })
    }

    @Test func withoutTokensTheProxyAnswersAndSendsNothing() {
        var p = Self.tunnel()
        p.client(Self.request)
        _ = p.next()
        p.event(.tokens(.failure(.signInNeeded(reason: "no tokens"))))
        #expect(p.clientGot().hasPrefix("HTTP/1.1 401 Unauthorized\r\nProxy-Status: proxyctl;"))
        let actions = p.next()
        #expect(Self.outputs(actions) == [.signInNeeded(reason: "no tokens")])
        #expect(Self.record(actions)?.answeredByProxy == true)
        #expect(Self.sends(actions).isEmpty && p.connects.isEmpty)
    }

    @Test func aCertificateThatDoesNotVerifyIs502() {
        var p = Self.tunnel()
        p.client(Self.request)
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        p.event(.transferFinished(.certificate, detail: "the certificate does not verify: self-signed certificate"))
        let got = p.clientGot()
        #expect(got.hasPrefix("HTTP/1.1 502 Bad Gateway\r\nProxy-Status: proxyctl; error=tls_certificate_error"))
        #expect(got.contains("self-signed certificate"))
        #expect(!p.next().contains { if case .startTunnel = $0 { true } else { false } })
    }

    @Test func anOriginThatDoesNotAnswerInTimeIs504() {
        var p = Self.tunnel()
        p.client(Self.request)
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        _ = p.next()
        p.event(.transferFinished(.timeout, detail: "no connection within 5000 ms"))
        #expect(p.clientGot().hasPrefix("HTTP/1.1 504 Gateway Timeout"))
    }

    @Test func theClientsOwnAuthorizationTravelsWhenTheOriginKeepsIt() {
        var origin = Origins.https
        origin.clientAuthorization = .keep
        var p = Self.tunnel(origin)
        p.client(
            Self.request.replacing("Host: api.test\r\n", with: "Host: api.test\r\nAuthorization: Basic eDp5\r\n"))
        let actions = p.next()
        #expect(!Self.outputs(actions).contains { if case .getTokens = $0 { true } else { false } })
        let sent = Self.sends(actions)
        #expect(sent.first?.credential == nil)
        #expect(Self.wire(sent.first).contains("\r\nAuthorization: Basic eDp5\r\n"))
    }

    @Test func onTheFrontDoorAPlainOriginUpgradesToo() {
        var p = Playbook.frontDoor(origins: [Origins.http])
        p.client(
            "GET http://127.0.0.1:9000/ws HTTP/1.1\r\nHost: 127.0.0.1:9000\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        )
        #expect(Self.outputs(p.next()) == [.bodyEnded, .getTokens(key: TokenKey(provider: "corp"))])
        p.event(.tokens(.success(TokenGrant(generation: 2))))
        let sent = Self.sends(p.next())
        #expect(
            Self.wire(sent.first, credential: [("Authorization", Array("Bearer t".utf8))])
                == "GET /ws HTTP/1.1\r\nHost: 127.0.0.1:9000\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nAuthorization: Bearer t\r\n\r\n"
        )
        p.transferHead(Self.switched)
        #expect(p.clientGot() == Self.switched)
        #expect(p.next().last == .startTunnel(label: "GET http://127.0.0.1:9000/ws", status: 101))
    }

    @Test func anUpgradeWithABodyIsRefused() {
        var p = Self.tunnel()
        p.client(Self.request.replacing("\r\n\r\n", with: "\r\nContent-Length: 2\r\n\r\nhi"))
        #expect(p.clientGot().hasPrefix("HTTP/1.1 501 Not Implemented"))
        #expect(Self.outputs(p.next()).isEmpty)
    }

    /// A 101 the client did not ask for is a broken origin, not a tunnel.
    @Test func a101ToARequestWithoutUpgradeIsRefused() {
        var p = Self.tunnel()
        p.client("GET /plain HTTP/1.1\r\nHost: api.test\r\n\r\n")
        p.event(.tokens(.success(TokenGrant(generation: 7))))
        #expect(Self.sends(p.next()).first?.upgrade == false)
        // The own client's reader fails the response (`ResponseReader`), and the transfer ends so.
        p.transferHead(Self.switched)
        let got = p.clientGot()
        #expect(got.hasPrefix("HTTP/1.1 502 Bad Gateway\r\n"))
        #expect(got.contains("101 Switching Protocols without an upgrade request"))
        #expect(!p.next().contains { if case .startTunnel = $0 { true } else { false } })
    }
}
