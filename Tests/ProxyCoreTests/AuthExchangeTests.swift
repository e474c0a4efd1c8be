import Testing

@testable import ProxyCore

/// The per-request auth exchange, as events in and actions out (mitmproxy playbook style), plus an
/// exhaustive walk over every sequence of origin answers.
@Suite struct AuthExchangeTests {
    static let plain401 = AuthExchange.Event.response(
        status: 401, challenges: [Challenge(scheme: "Bearer", parameters: [("error", "invalid_token")])], dpopNonce: nil
    )
    static let bare401 = AuthExchange.Event.response(status: 401, challenges: [], dpopNonce: nil)
    static let nonce401 = AuthExchange.Event.response(
        status: 401, challenges: [Challenge(scheme: "DPoP", parameters: [("error", "use_dpop_nonce")])],
        dpopNonce: "n-1")
    static let nonce401WithoutNonce = AuthExchange.Event.response(
        status: 401, challenges: [Challenge(scheme: "DPoP", parameters: [("error", "use_dpop_nonce")])], dpopNonce: nil)
    static let stepUp401 = AuthExchange.Event.response(
        status: 401,
        challenges: [
            Challenge(
                scheme: "Bearer",
                parameters: [
                    ("error", "insufficient_user_authentication"), ("acr_values", "urn:mfa"), ("max_age", "300"),
                ])
        ], dpopNonce: nil)
    static let ok200 = AuthExchange.Event.response(status: 200, challenges: [], dpopNonce: "n-2")
    static let metadata401 = AuthExchange.Event.response(
        status: 401,
        challenges: ChallengeParser.parse(
            #"Bearer error="invalid_token", resource_metadata="https://api.test/.well-known/oauth-protected-resource""#
        ), dpopNonce: nil)
    static let scope403 = AuthExchange.Event.response(
        status: 403, challenges: ChallengeParser.parse(#"Bearer error="insufficient_scope", scope="api admin""#),
        dpopNonce: nil)

    func exchange(replayable: Bool = true, nonce: String? = nil, checks: Bool = false) -> AuthExchange {
        AuthExchange(
            origin: "https://api.test", provider: "corp", replayable: replayable, knownNonce: nonce,
            checksResourceMetadata: checks)
    }

    @Test func insufficientScopeIsSurfacedLikeAStepUp() {
        for status in [401, 403] {
            var machine = exchange()
            _ = machine.start()
            _ = machine.handle(.tokens(generation: 1))
            let event = AuthExchange.Event.response(
                status: status, challenges: ChallengeParser.parse(#"Bearer error="insufficient_scope", scope="admin""#),
                dpopNonce: nil)
            #expect(
                machine.handle(event)
                    == .deliver(
                        proxyStatus: ProxyStatus(
                            details: "the origin needs the scope admin: run proxyctl step-up https://api.test",
                            receivedStatus: status)))
            #expect(machine.stepUp?.insufficientScope == ["admin"] && !machine.refreshed)
        }
        // Without a valid scope it is an ordinary 403 (delivered) or 401 (refreshed).
        var machine = exchange()
        _ = machine.start()
        _ = machine.handle(.tokens(generation: 1))
        let bare = AuthExchange.Event.response(
            status: 403, challenges: ChallengeParser.parse(#"Bearer error="insufficient_scope""#), dpopNonce: nil)
        #expect(machine.handle(bare) == .deliver(proxyStatus: nil))
        #expect(machine.stepUp == nil)
    }

    @Test func aNamedMetadataIsCheckedBeforeTheRefreshAndAnotherServerIsSurfaced() {
        var machine = exchange(checks: true)
        _ = machine.start()
        _ = machine.handle(.tokens(generation: 1))
        #expect(
            machine.handle(Self.metadata401)
                == .checkResourceMetadata(url: "https://api.test/.well-known/oauth-protected-resource"))
        let answer = machine.handle(.resourceMetadata(.otherServers(["https://other.example"])))
        guard case .deliver(let status?) = answer else {
            Issue.record("not delivered: \(answer)")
            return
        }
        #expect(status.receivedStatus == 401 && status.error == .proxyConfigurationError)
        #expect(status.details?.contains("names the authorization server https://other.example") == true)
        #expect(status.details?.contains("proxyctl init --origin https://api.test") == true)
        #expect(machine.otherServers == ["https://other.example"] && !machine.refreshed)

        // Its own provider, or nothing learnt: the usual refresh, and the check is made once per exchange.
        for verdict in [ResourceMetadataVerdict.consistent, .unknown("down")] {
            var same = exchange(checks: true)
            _ = same.start()
            _ = same.handle(.tokens(generation: 1))
            _ = same.handle(Self.metadata401)
            #expect(same.handle(.resourceMetadata(verdict)) == .refresh(replacing: 1))
            #expect(same.handle(.refreshed(generation: 2)) == .send(generation: 2, nonce: nil))
            #expect(
                same.handle(Self.metadata401)
                    != .checkResourceMetadata(url: "https://api.test/.well-known/oauth-protected-resource"))
        }
        // Metadata on another origin is never fetched; an exchange that does not check never asks.
        var elsewhere = exchange(checks: true)
        _ = elsewhere.start()
        _ = elsewhere.handle(.tokens(generation: 1))
        let foreign = AuthExchange.Event.response(
            status: 401, challenges: ChallengeParser.parse(#"Bearer resource_metadata="https://evil.example/m""#),
            dpopNonce: nil)
        #expect(elsewhere.handle(foreign) == .refresh(replacing: 1))
        var plain = exchange()
        _ = plain.start()
        _ = plain.handle(.tokens(generation: 1))
        #expect(plain.handle(Self.metadata401) == .refresh(replacing: 1))
    }

    @Test func attachesAndDelivers() {
        var machine = exchange(nonce: "cached")
        #expect(machine.start() == .getTokens)
        #expect(machine.handle(.tokens(generation: 7)) == .send(generation: 7, nonce: "cached"))
        #expect(machine.handle(Self.ok200) == .deliver(proxyStatus: nil))
    }

    @Test func refreshesOnceAndReplaysOnceOn401() {
        var machine = exchange()
        _ = machine.start()
        _ = machine.handle(.tokens(generation: 1))
        #expect(machine.handle(Self.plain401) == .refresh(replacing: 1))
        #expect(machine.handle(.refreshed(generation: 2)) == .send(generation: 2, nonce: nil))
        #expect(machine.handle(Self.ok200) == .deliver(proxyStatus: nil))
    }

    @Test func secondUnauthorizedIsDeliveredWithProxyStatus() throws {
        var machine = exchange()
        _ = machine.start()
        _ = machine.handle(.tokens(generation: 1))
        _ = machine.handle(Self.bare401)
        _ = machine.handle(.refreshed(generation: 2))
        guard case .deliver(let status?) = machine.handle(Self.bare401) else {
            Issue.record("expected a delivery with Proxy-Status")
            return
        }
        #expect(status.receivedStatus == 401)
        #expect(status.details?.contains("refreshed") == true)
    }

    @Test func nonceChallengeIsRetriedOnceWithTheNonce() {
        var machine = exchange()
        _ = machine.start()
        _ = machine.handle(.tokens(generation: 1))
        #expect(machine.handle(Self.nonce401) == .send(generation: 1, nonce: "n-1"))
        #expect(machine.handle(Self.ok200) == .deliver(proxyStatus: nil))
    }

    @Test func nonceThenRefreshThenSuccess() {
        var machine = exchange()
        _ = machine.start()
        _ = machine.handle(.tokens(generation: 1))
        #expect(machine.handle(Self.nonce401) == .send(generation: 1, nonce: "n-1"))
        #expect(machine.handle(Self.plain401) == .refresh(replacing: 1))
        #expect(machine.handle(.refreshed(generation: 2)) == .send(generation: 2, nonce: "n-1"))
        #expect(machine.handle(Self.ok200) == .deliver(proxyStatus: nil))
    }

    @Test func refreshThenNonceThenSuccess() {
        var machine = exchange()
        _ = machine.start()
        _ = machine.handle(.tokens(generation: 1))
        #expect(machine.handle(Self.plain401) == .refresh(replacing: 1))
        #expect(machine.handle(.refreshed(generation: 2)) == .send(generation: 2, nonce: nil))
        #expect(machine.handle(Self.nonce401) == .send(generation: 2, nonce: "n-1"))
        #expect(machine.handle(Self.ok200) == .deliver(proxyStatus: nil))
    }

    @Test func stepUpIsSurfacedNeverRefreshed() throws {
        var machine = exchange()
        _ = machine.start()
        _ = machine.handle(.tokens(generation: 1))
        guard case .deliver(let status?) = machine.handle(Self.stepUp401) else {
            Issue.record("expected a delivery with Proxy-Status")
            return
        }
        let details = try #require(status.details)
        #expect(details.contains("proxyctl step-up https://api.test"))
        #expect(details.contains("urn:mfa"))
        #expect(details.contains("max_age 300"))
    }

    @Test func unreplayableBodyIsNotReplayed() throws {
        var machine = exchange(replayable: false)
        _ = machine.start()
        _ = machine.handle(.tokens(generation: 1))
        guard case .deliver(let status?) = machine.handle(Self.plain401) else {
            Issue.record("expected a delivery with Proxy-Status")
            return
        }
        #expect(status.details?.contains("too large") == true)
    }

    @Test func notSignedInIsAnsweredByTheProxy() {
        var machine = exchange()
        _ = machine.start()
        guard
            case .respond(let answer) = machine.handle(.tokensFailed(.signInNeeded(reason: "not signed in to corp")))
        else {
            Issue.record("expected an answer of our own")
            return
        }
        let response = answer.response
        #expect(response.status == 401)
        #expect(response.proxyStatus?.details?.contains("proxyctl login corp") == true)
    }

    @Test func providerDownIs503WithRetryAfter() {
        var machine = exchange()
        _ = machine.start()
        _ = machine.handle(.tokens(generation: 1))
        _ = machine.handle(Self.plain401)
        guard case .respond(let answer) = machine.handle(.refreshFailed(.unavailable(reason: "down", retryAfter: 30)))
        else {
            Issue.record("expected an answer of our own")
            return
        }
        let response = answer.response
        #expect(response.status == 503)
        #expect(response.extraFields.contains { $0.name == "Retry-After" && $0.value == "30" })
    }

    @Test func pendingRefreshIs503NamingTheWait() {
        var machine = exchange()
        _ = machine.start()
        guard
            case .respond(let answer) = machine.handle(
                .tokensFailed(.pending(reason: "the provider has not answered the token refresh", retryAfter: 5)))
        else {
            Issue.record("expected an answer of our own")
            return
        }
        let response = answer.response
        #expect(response.status == 503)
        #expect(response.extraFields.contains { $0.name == "Retry-After" && $0.value == "5" })
        #expect(response.proxyStatus?.details?.contains("waiting for the identity provider's answer") == true)
        #expect(response.proxyStatus?.details?.contains("unavailable") == false)
    }

    @Test func storageProblemIsNamedAndNotBlamedOnTheProvider() {
        var machine = exchange()
        _ = machine.start()
        let reason = "proxyctl cannot keep tokens: /s/tokens/corp.json cannot be written: No space left on device"
        guard case .respond(let answer) = machine.handle(.tokensFailed(.storage(reason: reason))) else {
            Issue.record("expected an answer of our own")
            return
        }
        let response = answer.response
        #expect(response.status == 503)
        #expect(!response.extraFields.contains { $0.name == "Retry-After" })
        #expect(response.proxyStatus?.error == .proxyInternalError)
        #expect(response.proxyStatus?.details?.contains("state directory") == true)
        #expect(response.message.contains("No space left on device"))
        #expect(!response.message.contains("unavailable"))
    }

    /// Every sequence of origin answers (and refresh outcomes) up to the budget: the machine always ends with
    /// a delivery or an answer of its own, sends at most three times, retries a nonce at most once, refreshes
    /// at most once, and never refreshes or replays on a step-up challenge.
    @Test(arguments: [(true, false), (false, false), (true, true), (false, true)])
    func exhaustiveSequencesNeverLoop(replayable: Bool, checks: Bool) {
        let answers: [AuthExchange.Event] = [
            Self.ok200, Self.plain401, Self.bare401, Self.nonce401, Self.nonce401WithoutNonce, Self.stepUp401,
            Self.metadata401, Self.scope403,
        ]
        let verdicts: [ResourceMetadataVerdict] = [.consistent, .otherServers(["https://b"]), .unknown("x")]
        var checked = 0
        let refreshOutcomes: [AuthExchange.Event] = [
            .refreshed(generation: 9), .refreshFailed(.signInNeeded(reason: "x")),
            .refreshFailed(.unavailable(reason: "x", retryAfter: nil)),
        ]
        var explored = 0
        func walk(_ machine: AuthExchange, _ action: AuthExchange.Action, sends: Int, refreshes: Int, trace: [String]) {
            switch action {
            case .deliver, .respond:
                explored += 1
                #expect(sends <= 3, "too many sends: \(trace)")
                #expect(refreshes <= 1, "too many refreshes: \(trace)")
            case .getTokens:
                for event in [AuthExchange.Event.tokens(generation: 1), .tokensFailed(.signInNeeded(reason: "x"))] {
                    var next = machine
                    let result = next.handle(event)
                    walk(next, result, sends: sends, refreshes: refreshes, trace: trace + ["\(event)"])
                }
            case .send:
                #expect(sends < 3, "a fourth send: \(trace)")
                if sends >= 3 { return }
                for answer in answers {
                    var next = machine
                    let result = next.handle(answer)
                    if answer == Self.stepUp401 || answer == Self.scope403 {
                        if case .deliver = result {} else { Issue.record("step-up not delivered: \(trace)") }
                    }
                    if !replayable, case .send = result { Issue.record("replayed an unreplayable body: \(trace)") }
                    if !replayable, case .refresh = result {
                        Issue.record("refreshed for an unreplayable body: \(trace)")
                    }
                    walk(next, result, sends: sends + 1, refreshes: refreshes, trace: trace + ["\(answer)"])
                }
            case .checkResourceMetadata:
                #expect(checks, "a check by an exchange that does not check: \(trace)")
                checked += 1
                for verdict in verdicts {
                    var next = machine
                    let result = next.handle(.resourceMetadata(verdict))
                    if case .otherServers = verdict, case .deliver = result {
                    } else if case .otherServers = verdict {
                        Issue.record("another server not surfaced: \(trace)")
                    }
                    walk(next, result, sends: sends, refreshes: refreshes, trace: trace + ["\(verdict)"])
                }
            case .refresh:
                #expect(refreshes == 0, "a second refresh: \(trace)")
                for outcome in refreshOutcomes {
                    var next = machine
                    let result = next.handle(outcome)
                    walk(next, result, sends: sends, refreshes: refreshes + 1, trace: trace + ["\(outcome)"])
                }
            }
        }
        var machine = exchange(replayable: replayable, checks: checks)
        let first = machine.start()
        walk(machine, first, sends: 0, refreshes: 0, trace: [])
        #expect(explored >= (replayable ? 20 : 7))
        #expect((checked > 0) == checks)
    }
}

@Suite struct ChallengeParserTests {
    @Test func bearerWithParameters() {
        let parsed = ChallengeParser.parse(
            #"Bearer realm="api", error="invalid_token", error_description="The token expired""#)
        #expect(parsed.count == 1)
        #expect(parsed[0].scheme == "bearer")
        #expect(parsed[0]["realm"] == "api")
        #expect(parsed[0]["ERROR"] == "invalid_token")
        #expect(parsed[0]["error_description"] == "The token expired")
    }

    @Test func severalChallengesInOneLine() {
        let parsed = ChallengeParser.parse(#"DPoP algs="ES256", error="use_dpop_nonce", Bearer realm="x", Basic"#)
        #expect(parsed.map(\.scheme) == ["dpop", "bearer", "basic"])
        #expect(parsed[0]["error"] == "use_dpop_nonce")
        #expect(parsed[1]["realm"] == "x")
    }

    @Test func token68AndEscapes() {
        let parsed = ChallengeParser.parse(#"Negotiate YII=, Bearer error_description="say \"hi\"\\""#)
        #expect(parsed[0].token68 == "YII=")
        #expect(parsed[1]["error_description"] == #"say "hi"\"#)
    }

    @Test func acrValuesAndMaxAgeFromRFC9470() {
        let parsed = ChallengeParser.parse(
            #"Bearer error="insufficient_user_authentication", error_description="A different authentication level is required", acr_values="myACR""#
        )
        #expect(parsed[0]["acr_values"] == "myACR")
        let second = ChallengeParser.parse(#"Bearer error="insufficient_user_authentication", max_age=5"#)
        #expect(second[0]["max_age"] == "5")
    }

    @Test func garbageDoesNotCrash() {
        for input in [
            "", ",,,", "=", "Bearer =", #"Bearer a="unterminated"#, "Bearer a=b c=d", "\u{0}\u{1}",
            "Bearer realm=\"x\" junk",
        ] {
            _ = ChallengeParser.parse(input)
        }
        #expect(ChallengeParser.parse("Bearer").map(\.scheme) == ["bearer"])
    }
}
