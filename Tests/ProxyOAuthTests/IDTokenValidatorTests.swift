import ProxyCore
import TestFixtures
import Testing

@testable import ProxyOAuth

private let issuer = "https://idp.example.com/realms/dev"
private let clientID = "proxyctl"
private let now: Int64 = 1_750_000_000

/// Claims that pass every check of `validator()`.
private func validClaims() -> JSONObject {
    JSONObject([
        ("iss", .string(issuer)), ("sub", "248289761001"), ("aud", .string(clientID)), ("exp", .int(now + 300)),
        ("iat", .int(now - 10)), ("nonce", "n-0S6_WzA2Mj"), ("auth_time", .int(now - 20)), ("name", "Jane Doe"),
        ("email", "jane@example.com"), ("acr", "urn:mace:incommon:iap:silver"), ("amr", ["pwd", "otp"]),
    ])
}

private func validator(nonce: String? = "n-0S6_WzA2Mj", maxAge: Int? = nil) -> IDTokenValidator {
    IDTokenValidator(issuer: issuer, clientID: clientID, nonce: nonce, maxAge: maxAge, now: now)
}

/// The claims with some members replaced (nil removes).
private func claims(_ changes: [String: JSONValue?]) -> JSONObject {
    var object = validClaims()
    for (name, value) in changes { object[name] = value }
    return object
}

/// The reason `checkClaims` refused the claims; records an issue when it accepted them or threw something else.
private func refusal(
    _ claims: JSONObject, _ validator: IDTokenValidator = validator(), sourceLocation: SourceLocation = #_sourceLocation
) -> String? {
    do {
        let identity = try validator.checkClaims(claims)
        Issue.record("accepted: \(identity)", sourceLocation: sourceLocation)
        return nil
    } catch let error as AuthError {
        // Nothing is stored from a token that fails a check; the user's registration or clock must change.
        guard case .rejected(let reason) = error else {
            Issue.record("unexpected category \(error.category)", sourceLocation: sourceLocation)
            return nil
        }
        return reason
    } catch {
        Issue.record("unexpected error \(error)", sourceLocation: sourceLocation)
        return nil
    }
}

@Suite struct IDTokenClaimTests {
    @Test func validClaimsGiveTheIdentity() throws {
        let identity = try validator().checkClaims(validClaims())
        #expect(identity.subject == "248289761001")
        #expect(identity.name == "Jane Doe")
        #expect(identity.email == "jane@example.com")
        #expect(identity.authTime == now - 20)
        #expect(identity.acr == "urn:mace:incommon:iap:silver")
        #expect(identity.amr == ["pwd", "otp"])
        #expect(identity.expiresAt == now + 300)
    }

    @Test func preferredUsernameStandsInForName() throws {
        let identity = try validator().checkClaims(claims(["name": nil, "preferred_username": "jdoe"]))
        #expect(identity.name == "jdoe")
    }

    @Test func wrongOrMissingIssuer() {
        #expect(refusal(claims(["iss": "https://evil.example.com/realms/dev"]))?.contains("was issued by") == true)
        // Exact comparison: no normalisation of a trailing slash or case (OpenID Connect Core §3.1.3.7 item 2).
        #expect(refusal(claims(["iss": .string(issuer + "/")])) != nil)
        #expect(refusal(claims(["iss": "HTTPS://IDP.EXAMPLE.COM/realms/dev"])) != nil)
        #expect(refusal(claims(["iss": nil]))?.contains("nobody") == true)
        #expect(refusal(claims(["iss": ["https://idp.example.com/realms/dev"]])) != nil)
    }

    @Test func audienceMustContainTheClient() {
        #expect(refusal(claims(["aud": "other-client"]))?.contains("not meant for this client") == true)
        #expect(refusal(claims(["aud": ["other-client", "another"], "azp": "other-client"])) != nil)
        #expect(refusal(claims(["aud": nil])) != nil)
        #expect(refusal(claims(["aud": []])) != nil)
        #expect(refusal(claims(["aud": [1]])) != nil)
        // Audience values are compared exactly.
        #expect(refusal(claims(["aud": "Proxyctl"])) != nil)
        #expect(throws: Never.self) { try validator().checkClaims(claims(["aud": [.string(clientID)]])) }
    }

    @Test func severalAudiencesNeedAnAuthorizedParty() throws {
        let reason = refusal(claims(["aud": [.string(clientID), "https://api.example.com"]]))
        #expect(reason?.contains("several audiences but no azp") == true)
        let identity = try validator().checkClaims(
            claims(["aud": [.string(clientID), "https://api.example.com"], "azp": .string(clientID)]))
        #expect(identity.subject == "248289761001")
    }

    @Test func authorizedPartyMustBeTheClient() {
        #expect(refusal(claims(["azp": "other-client"]))?.contains("another party") == true)
        #expect(
            refusal(claims(["aud": [.string(clientID), "https://api.example.com"], "azp": "https://api.example.com"]))
                != nil)
        #expect(throws: Never.self) { try validator().checkClaims(claims(["azp": .string(clientID)])) }
    }

    @Test func expiryAllowsSixtySecondsOfSkewAndNoMore() {
        #expect(throws: Never.self) { try validator().checkClaims(claims(["exp": .int(now - 59)])) }
        #expect(refusal(claims(["exp": .int(now - 60)]))?.contains("has already expired") == true)
        #expect(refusal(claims(["exp": .int(now - 3600)]))?.contains("has already expired") == true)
        #expect(refusal(claims(["exp": nil]))?.contains("has no exp") == true)
        #expect(refusal(claims(["exp": "2000000000"])) != nil)
    }

    @Test func issuedInTheFutureBeyondSkew() {
        #expect(throws: Never.self) { try validator().checkClaims(claims(["iat": .int(now + 60)])) }
        #expect(refusal(claims(["iat": .int(now + 61)]))?.contains("issued in the future") == true)
        #expect(refusal(claims(["iat": nil]))?.contains("has no iat") == true)
    }

    @Test func nonceMustMatchWhenOneWasSent() throws {
        #expect(refusal(claims(["nonce": "another-sign-in"]))?.contains("nonce") == true)
        #expect(refusal(claims(["nonce": nil]))?.contains("nonce") == true)
        #expect(refusal(claims(["nonce": 1])) != nil)
        // Refresh responses carry no nonce check (OpenID Connect Core §12.2).
        #expect(try validator(nonce: nil).checkClaims(claims(["nonce": nil])).subject == "248289761001")
    }

    @Test func subjectIsRequired() {
        #expect(refusal(claims(["sub": nil]))?.contains("has no sub") == true)
        #expect(refusal(claims(["sub": ""]))?.contains("has no sub") == true)
        #expect(refusal(claims(["sub": 42])) != nil)
    }

    @Test func maxAgeLimitsTheAgeOfTheSignIn() throws {
        // auth_time + max_age must not be older than now, with the same skew allowance.
        let maxAgeValidator = validator(maxAge: 600)
        #expect(throws: Never.self) { try maxAgeValidator.checkClaims(claims(["auth_time": .int(now - 660)])) }
        let reason = refusal(claims(["auth_time": .int(now - 661)]), maxAgeValidator)
        #expect(reason?.contains("older than max_age 600s") == true)
        #expect(refusal(claims(["auth_time": .int(now - 86_400)]), validator(maxAge: 0)) != nil)
        // Without max_age, an old sign-in is fine.
        #expect(try validator().checkClaims(claims(["auth_time": .int(now - 86_400)])).authTime == now - 86_400)
    }

    @Test func checksRunInTheOrderOfTheSpecification() {
        // iss is checked before aud, so the reason names the first failing rule.
        #expect(refusal(claims(["iss": "https://evil.example.com", "aud": "other"]))?.contains("issued by") == true)
    }

    @Test func messagesAreSafeToPrint() throws {
        let reason = try #require(refusal(claims(["iss": "https://evil.example.com/\u{1B}[31m\n"])))
        #expect(!reason.unicodeScalars.contains { $0.value < 0x20 })
    }
}

/// Counts key-set fetches and hands out the sets in order (the last one repeats).
private actor KeySource {
    private(set) var requests: [Bool] = []
    private let sets: [JWKSet]

    init(_ sets: [JWKSet]) { self.sets = sets }

    func fetch(refresh: Bool) -> JWKSet {
        requests.append(refresh)
        return sets[min(requests.count - 1, sets.count - 1)]
    }
}

@Suite struct IDTokenSignatureTests {
    /// Validates the fixtures' claims at a time inside their validity.
    private let validator = IDTokenValidator(
        issuer: JWSFixtures.issuer, clientID: JWSFixtures.clientID, nonce: JWSFixtures.nonce,
        now: JWSFixtures.issuedAt + 100)

    @Test(arguments: [JWSFixtures.rs256, JWSFixtures.ps256, JWSFixtures.es256, JWSFixtures.es384])
    func knownKeyNeedsOneFetch(_ token: String) async throws {
        let source = KeySource([try keySet(JWSFixtures.rsa1, JWSFixtures.ec1, JWSFixtures.ec384)])
        let identity = try await validator.validate(token) { refresh in await source.fetch(refresh: refresh) }
        #expect(identity.subject == JWSFixtures.subject)
        #expect(identity.expiresAt == JWSFixtures.expiresAt)
        #expect(await source.requests == [false])
    }

    @Test func unknownKidRefetchesOnceAndSucceedsWithTheRotatedSet() async throws {
        let source = KeySource([try keySet(JWSFixtures.rsa2), try keySet(JWSFixtures.rsa2, JWSFixtures.rsa1)])
        let identity = try await validator.validate(JWSFixtures.rs256) { refresh in
            await source.fetch(refresh: refresh)
        }
        #expect(identity.subject == JWSFixtures.subject)
        #expect(await source.requests == [false, true])
    }

    @Test func unknownKidRefetchesOnceThenFails() async throws {
        let source = KeySource([try keySet(JWSFixtures.rsa2)])
        do {
            _ = try await validator.validate(JWSFixtures.rs256) { refresh in await source.fetch(refresh: refresh) }
            Issue.record("a token signed with an unpublished key was accepted")
        } catch {
            #expect(authError(error)?.category == "rejected")
            #expect(authError(error)?.message.contains("kid rsa-1") == true)
        }
        #expect(await source.requests == [false, true])
    }

    @Test func badSignatureWithAKnownKidDoesNotRefetch() async throws {
        let pieces = JWSFixtures.rs256.split(separator: ".").map(String.init)
        var signature = try #require(Base64.decode(pieces[2]))
        signature[100] ^= 0x01
        let forged = [pieces[0], pieces[1], Base64.urlEncode(signature)].joined(separator: ".")
        let source = KeySource([try keySet(JWSFixtures.rsa1)])
        await #expect(throws: AuthError.self) {
            try await validator.validate(forged) { refresh in await source.fetch(refresh: refresh) }
        }
        #expect(await source.requests == [false])
    }

    @Test func malformedTokenFetchesNothing() async throws {
        let source = KeySource([try keySet(JWSFixtures.rsa1)])
        await #expect(throws: AuthError.self) {
            try await validator.validate("not.a.jwt!") { refresh in await source.fetch(refresh: refresh) }
        }
        #expect(await source.requests.isEmpty)
    }

    @Test func claimsAreCheckedAfterTheSignature() async throws {
        let source = KeySource([try keySet(JWSFixtures.rsa1)])
        var otherNonce = validator
        otherNonce.nonce = "another-sign-in"
        await #expect(throws: AuthError.self) {
            try await otherNonce.validate(JWSFixtures.rs256) { refresh in await source.fetch(refresh: refresh) }
        }
        var later = validator
        later.now = JWSFixtures.expiresAt + 60
        await #expect(throws: AuthError.self) {
            try await later.validate(JWSFixtures.rs256) { refresh in await source.fetch(refresh: refresh) }
        }
    }

    @Test func fetchErrorsPropagate() async {
        await #expect(throws: AuthError.recoverable(reason: "keys down", retryAfter: nil)) {
            try await validator.validate(JWSFixtures.rs256) { _ in
                throw AuthError.recoverable(reason: "keys down", retryAfter: nil)
            }
        }
    }
}
