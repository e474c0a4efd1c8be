import Testing

@testable import ProxyCore

/// Issue 32 item 1: a web page of another origin must not get the user's token attached by the proxy (cross-site
/// request forgery against every protected API). The rule as a table, then the shapes the issue found, as
/// playbooks on each way in: an intercepted HTTP/1.1 connection, an HTTP/2 stream, a protected http:// origin.
@Suite struct BrowserRequestRuleTests {
    static let own = WebOrigin(scheme: "https", authority: hop("api.test:443"))
    static let app = WebOrigin(scheme: "http", authority: hop("localhost:3000"))

    /// One request's fields: Sec-Fetch-Site, Origin and Referer values (nil: the field is absent).
    struct Case: Sendable, CustomTestStringConvertible {
        let site: String?
        let origin: String?
        let referer: String?
        /// The rule that refuses it, or nil when the token is attached.
        let refused: BrowserRefusal.Rule?
        var testDescription: String { "site=\(site ?? "-") origin=\(origin ?? "-") referer=\(referer ?? "-")" }

        init(_ site: String?, _ origin: String?, referer: String? = nil, _ refused: BrowserRefusal.Rule?) {
            (self.site, self.origin, self.referer, self.refused) = (site, origin, referer, refused)
        }
    }

    static let cases: [Case] = [
        // Tools: no Fetch Metadata, no Origin (a Referer alone, curl -e, says nothing).
        Case(nil, nil, nil),
        Case(nil, nil, referer: "https://evil.example/", nil),
        // The origin's own pages, and the user's own navigation.
        Case("same-origin", nil, nil),
        Case("same-origin", "https://api.test", nil),
        Case("none", nil, nil),
        Case(nil, "https://API.test:443", nil),
        Case(" Same-Origin ", nil, nil),
        // Other sites: the shapes of the issue and their relatives.
        Case("cross-site", "https://evil.example", .foreignOrigin),
        Case("cross-site", nil, .fetchSite("cross-site")),
        Case("cross-site", nil, referer: "https://evil.example/page", .fetchSite("cross-site")),
        Case("same-site", nil, .fetchSite("same-site")),
        Case("Cross-Site", nil, .fetchSite("cross-site")),
        Case("cross-origin", nil, .fetchSite("cross-origin")),
        Case(nil, "https://evil.example", .foreignOrigin),
        Case(nil, "http://api.test", .foreignOrigin),
        Case(nil, "https://api.test:8443", .foreignOrigin),
        Case(nil, "https://sub.api.test", .foreignOrigin),
        Case("same-origin", "https://evil.example", .foreignOrigin),
        Case(nil, "null", .opaqueOrigin),
        Case("cross-site", "null", .opaqueOrigin),
        Case(nil, "https://api.test/", .opaqueOrigin),
        Case(nil, "chrome-extension://abcdef", .opaqueOrigin),
        Case(nil, "https://api.test, https://evil.example", .opaqueOrigin),
        // A web app the user allowed: by its Origin, or (a no-cors GET has none) by its Referer.
        Case("cross-site", "http://localhost:3000", nil),
        Case(nil, "http://localhost:3000", nil),
        Case("cross-site", nil, referer: "http://localhost:3000/dashboard?tab=1", nil),
        Case("same-site", nil, referer: "http://localhost:3000/", nil),
        Case("cross-site", nil, referer: "http://localhost:3001/", .fetchSite("cross-site")),
        Case("cross-site", "https://evil.example", referer: "http://localhost:3000/", .foreignOrigin),
    ]

    @Test(arguments: cases)
    func theRule(_ test: Case) {
        var origin = OriginConfig(scheme: "https", authority: hop("api.test:443"))
        origin.allowedRequestOrigins = [Self.app]
        origin.file = "/etc/proxyctl/proxy.conf"
        let values = { (value: String?) in value.map { [Array($0.utf8)[...]] } ?? [] }
        let refusal = origin.browserRefusal(
            fetchSite: values(test.site), origin: values(test.origin), referer: values(test.referer))
        #expect(refusal?.rule == test.refused)
        // browser_requests = allow admits every one of them.
        origin.browserRequests = .allow
        #expect(
            origin.browserRefusal(
                fetchSite: values(test.site), origin: values(test.origin), referer: values(test.referer)) == nil)
    }

    @Test func aRepeatedFieldIsRefused() {
        let origin = OriginConfig(scheme: "https", authority: hop("api.test:443"))
        let same = Array("same-origin".utf8)[...]
        #expect(origin.browserRefusal(fetchSite: [same, same], origin: [], referer: [])?.rule == .repeated)
        let own = Array("https://api.test".utf8)[...]
        #expect(origin.browserRefusal(fetchSite: [], origin: [own, own], referer: [])?.rule == .repeated)
    }

    @Test func theAnswerNamesTheRuleAndTheFix() {
        var origin = OriginConfig(scheme: "https", authority: hop("api.test:443"))
        origin.file = "/home/ada/.config/proxyctl/proxy.conf"
        let refusal = origin.browserRefusal(
            fetchSite: [Array("cross-site".utf8)[...]], origin: [Array("https://evil.example".utf8)[...]],
            referer: [])
        let response = ProxyAnswer.browserRequestRefused(try! #require(refusal), close: false).response
        #expect(response.status == 403 && !response.close)
        #expect(
            response.proxyStatus?.fieldValue
                == "proxyctl; error=http_request_denied; details=\"request from a web page of another origin (Origin is another origin); no token attached (browser_requests = refuse)\""
        )
        #expect(
            response.message
                == "proxyctl: a web page on https://evil.example asked for https://api.test through this proxy, and the proxy attaches your token only to requests from tools and from https://api.test's own pages (request from a web page of another origin (Origin is another origin); no token attached (browser_requests = refuse)); if that page is a web app you run and trust, add allowed_request_origins = https://evil.example to [origin https://api.test] of /home/ada/.config/proxyctl/proxy.conf, or set browser_requests = allow there"
        )
        #expect(response.extraFields.allSatisfy { !$0.0.lowercased().hasPrefix("access-control") })
    }

    @Test func webOriginsParseAsBrowsersSendThem() {
        #expect(WebOrigin.parse(Array("https://API.Test:443".utf8)) == Self.own)
        #expect(WebOrigin.parse(Array("https://api.test".utf8))?.description == "https://api.test")
        #expect(WebOrigin.parse(Array("http://[::1]:8080".utf8))?.description == "http://[::1]:8080")
        for bad in ["null", "https://api.test/", "https://api.test/x", "https://api.test?q", "ftp://api.test", "", "*"]
        {
            #expect(WebOrigin.parse(Array(bad.utf8)) == nil, "\(bad)")
        }
        #expect(WebOrigin.parse(Array("http://localhost:3000/".utf8), allowTrailingSlash: true) == Self.app)
        #expect(WebOrigin.ofURL(Array("http://localhost:3000/a/b?c#".utf8)) == nil, "a fragment is not a URL we read")
        #expect(WebOrigin.ofURL(Array("http://localhost:3000/a/b?c".utf8)) == Self.app)
    }
}

@Suite struct BrowserRequestConfigTests {
    let parser = ConfigParser(homeDirectory: "/home/ada", baseDirectory: "/etc/proxyctl")

    static let provider = "[provider corp]\nissuer = https://login.example.com\nclient_id = c\n"

    @Test func theProxyDefaultAppliesToOriginsWithoutTheirOwn() throws {
        let text =
            Self.provider
                + """
                [origin https://a.example.com]
                provider = corp
                [origin https://b.example.com]
                provider = corp
                browser_requests = refuse
                allowed_request_origins = http://localhost:3000/, https://app.example.com
                [proxy]
                browser_requests = allow
                """
        let config = try parser.parse(text, file: "proxy.conf").get()
        #expect(config.proxy.browserRequests == .allow)
        let a = try #require(config.origins.match(scheme: "https", authority: hop("a.example.com:443")))
        let b = try #require(config.origins.match(scheme: "https", authority: hop("b.example.com:443")))
        #expect(a.browserRequests == .allow && b.browserRequests == .refuse)
        #expect(b.allowedRequestOrigins.map(\.description) == ["http://localhost:3000", "https://app.example.com"])
        // Without any key: refuse.
        let plain = try parser.parse(Self.provider + "[origin https://a.example.com]\nprovider = corp\n", file: "p")
            .get()
        #expect(plain.origins.origins[0].browserRequests == .refuse && plain.proxy.browserRequests == .refuse)
    }

    @Test(arguments: [
        ("[proxy]\nbrowser_requests = maybe\n", "browser_requests"),
        (provider + "[origin https://a.example.com]\nprovider = corp\nbrowser_requests = yes\n", "browser_requests"),
        (
            provider + "[origin https://a.example.com]\nprovider = corp\nallowed_request_origins = localhost:3000\n",
            "allowed_request_origins"
        ),
        (
            provider
                + "[origin https://a.example.com]\nprovider = corp\nallowed_request_origins = https://x.test/app\n",
            "allowed_request_origins"
        ),
        (
            provider + "[origin https://a.example.com]\nprovider = corp\nallowed_request_origins = *\n",
            "allowed_request_origins"
        ),
    ])
    func badValuesAreNamed(text: String, key: String) {
        guard case .failure(let errors) = parser.parse(text, file: "proxy.conf") else {
            Issue.record("accepted \(text)")
            return
        }
        #expect(errors.errors.contains { $0.key == key }, "\(errors)")
    }
}

/// The shapes of the issue on each way in: the origin never sees the request, the client gets 403.
@Suite struct BrowserRequestPlaybooks {
    typealias Output = ProtectedExchange.Output

    static let crossSite = "Origin: https://evil.example\r\nSec-Fetch-Site: cross-site\r\n"

    static func tunnel() -> Playbook {
        var p = Playbook.intercepted(Origins.https)
        p.event(.tlsEstablished(serverName: "api.test", protocol: "http/1.1"))
        return p
    }

    static func outputs(_ actions: [ConnectionMachine.Action]) -> [Output] {
        actions.compactMap { if case .exchange(let output, _) = $0 { output } else { nil } }
    }

    @Test func aNoCorsGetFromAnotherSiteIs403AndTheConnectionGoesOn() {
        var p = Self.tunnel()
        p.client(
            "GET /me HTTP/1.1\r\nHost: api.test\r\nSec-Fetch-Mode: no-cors\r\nSec-Fetch-Dest: image\r\n\(Self.crossSite)\r\n"
        )
        let answer = p.clientGot()
        #expect(answer.hasPrefix("HTTP/1.1 403 Forbidden\r\n"), "\(answer)")
        #expect(answer.contains("Proxy-Status: proxyctl; error=http_request_denied; details=\"request from a web page"))
        #expect(Self.outputs(p.next()).isEmpty, "no token asked for, nothing sent")
        #expect(p.outcomes.last == RequestOutcome(kind: .intercepted, status: 403, proxyError: "http_request_denied"))
        #expect(
            p.logs.last.map { String(decoding: $0.bytes, as: UTF8.self) }?.contains("status=403 answered-by=proxyctl")
                == true)
        // The same connection serves the app's own request (nothing was left unread).
        p.client("GET /me HTTP/1.1\r\nHost: api.test\r\nSec-Fetch-Site: same-origin\r\n\r\n")
        #expect(Self.outputs(p.next()) == [.bodyEnded, .getTokens(key: TokenKey(provider: "corp"))])
    }

    @Test func aFormPostFromAnotherSiteIs403AndTheBodyIsNeverRead() {
        var p = Self.tunnel()
        p.client(
            "POST /transfer HTTP/1.1\r\nHost: api.test\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                + "Content-Length: 9\r\nSec-Fetch-Mode: navigate\r\n\(Self.crossSite)\r\namount=99")
        #expect(p.clientGot().hasPrefix("HTTP/1.1 403 Forbidden\r\n"))
        #expect(p.keptBody.isEmpty)
        let actions = p.next()
        #expect(Self.outputs(actions).isEmpty)
        #expect(p.clientClosed == .closeAfterFlush, "the unread body ends the connection")
    }

    @Test func aToolsRequestGetsTheTokenAsBefore() {
        var p = Self.tunnel()
        p.client("GET /me HTTP/1.1\r\nHost: api.test\r\nUser-Agent: curl/8\r\nReferer: https://evil.example/\r\n\r\n")
        #expect(Self.outputs(p.next()) == [.bodyEnded, .getTokens(key: TokenKey(provider: "corp"))])
    }

    @Test func aPlainHTTPProtectedOriginThroughTheFrontDoor() {
        var p = Playbook.frontDoor(origins: [Origins.http])
        p.client("GET http://127.0.0.1:9000/me HTTP/1.1\r\nHost: 127.0.0.1:9000\r\n\(Self.crossSite)\r\n")
        #expect(p.clientGot().hasPrefix("HTTP/1.1 403 Forbidden\r\n"))
        #expect(Self.outputs(p.next()).isEmpty)
        var own = Playbook.frontDoor(origins: [Origins.http])
        own.client(
            "GET http://127.0.0.1:9000/me HTTP/1.1\r\nHost: 127.0.0.1:9000\r\nOrigin: http://127.0.0.1:9000\r\n\r\n")
        #expect(Self.outputs(own.next()) == [.bodyEnded, .getTokens(key: TokenKey(provider: "corp"))])
    }

    @Test func aWebSocketUpgradeFromAnotherSiteIs403() {
        var p = Self.tunnel()
        p.client(
            "GET /ws HTTP/1.1\r\nHost: api.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                + "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                + "Origin: https://evil.example\r\n\r\n")
        #expect(p.clientGot().hasPrefix("HTTP/1.1 403 Forbidden\r\n"))
        #expect(!p.next().contains { if case .connect = $0 { true } else { false } })
    }

    @Test func anHTTP2StreamFromAnotherSiteIs403AndTheOthersGoOn() {
        var p = H2Playbook()
        p.request(
            1,
            H2Playbook.request(
                "GET", "/me",
                [("sec-fetch-mode", "no-cors"), ("origin", "https://evil.example"), ("sec-fetch-site", "cross-site")]))
        guard case .respond(1, let fields, _) = p.next().first else {
            Issue.record("no answer of the proxy's own")
            return
        }
        #expect(fields.first == H2Field(":status", "403"))
        #expect(p.outcomes == [RequestOutcome(kind: .intercepted, status: 403, proxyError: "http_request_denied")])
        p.request(3, H2Playbook.request("GET", "/me", [("sec-fetch-site", "same-origin")]))
        #expect(
            p.next() == [
                .exchange(3, .bodyEnded, Origins.https),
                .exchange(3, .getTokens(key: TokenKey(provider: "corp")), Origins.https),
            ])
    }
}
