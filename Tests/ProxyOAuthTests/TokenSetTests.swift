import ProxyCore
import Testing

@testable import ProxyOAuth

@Suite struct TokenSetTests {
    private func full() -> TokenSet {
        var identity = Identity(subject: "248289761001")
        identity.name = "Jane \"JD\" Doe"
        identity.email = "jane@example.com"
        identity.authTime = 1_700_000_000
        identity.acr = "gold"
        identity.amr = ["pwd", "hwk"]
        var tokens = TokenSet(
            provider: "corp", issuer: "https://idp.example.com", clientID: "proxyctl", accessToken: "at\u{1}\n/é",
            tokenType: "DPoP", issuedAt: 1_700_000_000, expiresAt: 1_700_003_600, refreshToken: "rt", idToken: "h.p.s",
            scope: "openid email", identity: identity, generation: 42)
        tokens.lastRefresh = TokenSet.RefreshRecord(at: 1_700_000_100, outcome: "recoverable", reason: "HTTP 503")
        return tokens
    }

    @Test func jsonRoundTripWithEveryField() throws {
        let tokens = full()
        let text = JSON.serialize(tokens.json)
        let back = try #require(TokenSet(json: try JSON.parse(text).get()))
        #expect(back == tokens)
        #expect(back.identity?.amr == ["pwd", "hwk"])
        #expect(back.lastRefresh?.reason == "HTTP 503")
    }

    @Test func jsonRoundTripWithOnlyRequiredFields() throws {
        let tokens = TokenSet(
            provider: "p", issuer: "https://i", clientID: "c", accessToken: "a", tokenType: "Bearer", issuedAt: 0,
            expiresAt: nil, refreshToken: nil, idToken: nil, scope: nil, identity: nil, generation: 1)
        let object = try #require(tokens.json.object)
        #expect(
            object.keys == [
                "version", "provider", "issuer", "client_id", "token_type", "access_token", "issued_at", "generation",
            ])
        #expect(TokenSet(json: tokens.json) == tokens)
    }

    @Test func unknownVersionOrMissingFieldsAreRefused() throws {
        var object = try #require(full().json.object)
        object["version"] = 2
        #expect(TokenSet(json: .object(object)) == nil)
        for name in [
            "version", "provider", "issuer", "client_id", "access_token", "token_type", "issued_at", "generation",
        ] {
            var missing = try #require(full().json.object)
            missing[name] = nil
            #expect(TokenSet(json: .object(missing)) == nil, "without \(name)")
        }
        #expect(TokenSet(json: .array([])) == nil)
    }

    @Test func refreshAtIsAMinuteBeforeExpiryForLongLivedTokens() {
        let tokens = storedTokens(issuedAt: 1000, expiresAt: 4600)
        #expect(tokens.refreshAt == 4540)
        #expect(tokens.isFresh(at: 4539))
        #expect(!tokens.isFresh(at: 4540))
        #expect(!tokens.isExpired(at: 4599))
        #expect(tokens.isExpired(at: 4600))
    }

    @Test func refreshAtIsAtEightyPercentForShortLivedTokens() {
        // 100 s lifetime: refresh after 80 s, not 60 s before expiry (which would be after 40 s).
        let tokens = storedTokens(issuedAt: 1000, expiresAt: 1100)
        #expect(tokens.refreshAt == 1080)
        #expect(tokens.isFresh(at: 1079))
        #expect(!tokens.isFresh(at: 1080))
        // A token that was already expired when issued is never fresh.
        let expired = storedTokens(issuedAt: 1000, expiresAt: 900)
        #expect(expired.refreshAt == 900)
        #expect(!expired.isFresh(at: 950))
    }

    @Test func aTokenOfAFewSecondsKeepsASecondOfMargin() {
        // 3 s: 80 % is 2.4 s; refreshed after 2 s, not in its last second (where the origin, whose clock may
        // already be a second on, refuses it).
        let tokens = storedTokens(issuedAt: 1000, expiresAt: 1003)
        #expect(tokens.refreshAt == 1002)
        #expect(tokens.isFresh(at: 1001))
        #expect(!tokens.isFresh(at: 1002))
        #expect(storedTokens(issuedAt: 1000, expiresAt: 1001).refreshAt == 1000)
    }

    @Test func tokensWithoutExpiryAreAlwaysFresh() {
        let tokens = storedTokens(issuedAt: 1000, expiresAt: nil)
        #expect(tokens.refreshAt == nil)
        #expect(tokens.isFresh(at: Int64.max))
        #expect(!tokens.isExpired(at: Int64.max))
    }
}
