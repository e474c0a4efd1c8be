import ProxyCore
import ProxyTLS
import TestFixtures
import Testing

@testable import ProxyOAuth

/// The whole fixture key set, in an order where the right key is never first.
private func allKeys() throws -> JWKSet {
    try keySet(JWSFixtures.rsa2, JWSFixtures.ec384, JWSFixtures.ec1, JWSFixtures.rsa1)
}

private func verify(_ compact: String, _ keys: JWKSet) throws -> JWSVerifier.Outcome {
    JWSVerifier.verify(try parsedJWT(compact), keys: keys)
}

private func parts(_ compact: String) -> [String] {
    compact.split(separator: ".", omittingEmptySubsequences: false).map(String.init)
}

/// The token with its header replaced; payload and signature kept.
private func withHeader(_ compact: String, _ header: JSONObject) -> String {
    let pieces = parts(compact)
    return [encodedPart(header), pieces[1], pieces[2]].joined(separator: ".")
}

private func isInvalid(_ outcome: JWSVerifier.Outcome) -> Bool {
    if case .invalid = outcome { return true }
    return false
}

@Suite struct JWTParseTests {
    @Test func parsesHeaderClaimsAndSigningInput() throws {
        let jwt = try parsedJWT(JWSFixtures.rs256)
        #expect(jwt.algorithm == "RS256")
        #expect(jwt.keyID == "rsa-1")
        #expect(jwt.claims["sub"] == "alice")
        #expect(jwt.claims["aud"] == "proxyctl-test")
        #expect(jwt.claims["exp"]?.int == JWSFixtures.expiresAt)
        let pieces = parts(JWSFixtures.rs256)
        #expect(jwt.signingInput == Array("\(pieces[0]).\(pieces[1])".utf8))
        #expect(jwt.signature.count == 256)
    }

    @Test func tokenWithoutKid() throws {
        #expect(try parsedJWT(JWSFixtures.rs256WithoutKid).keyID == nil)
    }

    @Test(arguments: [
        "", "a.b", "a.b.c.d", "..", "eyJhbGciOiJSUzI1NiJ9.e30", "eyJhbGciOiJSUzI1NiJ9.e30.AA==",
        "eyJhbGciOiJSUzI1NiJ9=.e30.AA", "eyJhbGciOiJSUzI1NiJ9.e3+/.AA", "eyJhbGciOiJSUzI1NiJ9.e30.A",
        "eyJhbGciOiJSUzI1NiJ9.e30 .AA",
    ])
    func rejectsMalformedCompactSerialisations(_ compact: String) {
        #expect(throws: JWT.ParseError.self) { try parsedJWT(compact) }
    }

    @Test func rejectsNonCanonicalBase64URL() throws {
        // A 256-byte signature leaves 4 unused bits in its last character; set one of them.
        var pieces = parts(JWSFixtures.rs256)
        let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
        let last = try #require(pieces[2].last)
        let index = try #require(alphabet.firstIndex(of: last))
        pieces[2] = String(pieces[2].dropLast()) + String(alphabet[index | 1])
        #expect(throws: JWT.ParseError.self) { try parsedJWT(pieces.joined(separator: ".")) }
    }

    @Test func rejectsHeadersAndClaimsThatAreNotObjects() {
        let object = encodedPart(JSONObject([("alg", "RS256")]))
        let array = Base64.urlEncode(Array("[1]".utf8))
        let notJSON = Base64.urlEncode(Array("{alg:RS256}".utf8))
        for compact in [
            "\(array).\(object).AA", "\(object).\(array).AA", "\(notJSON).\(object).AA", "\(object).\(notJSON).AA",
        ] {
            #expect(throws: JWT.ParseError.self) { try parsedJWT(compact) }
        }
    }

    @Test func rejectsMissingAlgCriticalExtensionsAndDuplicateClaims() {
        let claims = encodedPart(JSONObject([("sub", "alice")]))
        let noAlg = encodedPart(JSONObject([("kid", "rsa-1")]))
        let crit = encodedPart(JSONObject([("alg", "RS256"), ("crit", ["exp"]), ("exp", 1)]))
        // Two parsers that pick different duplicates would disagree about who this is (RFC 7519 §4).
        let duplicate = Base64.urlEncode(Array(#"{"sub":"alice","sub":"mallory"}"#.utf8))
        let header = encodedPart(JSONObject([("alg", "RS256")]))
        for compact in ["\(noAlg).\(claims).AA", "\(crit).\(claims).AA", "\(header).\(duplicate).AA"] {
            #expect(throws: JWT.ParseError.self) { try parsedJWT(compact) }
        }
    }
}

@Suite struct JWKSetTests {
    @Test func parsesKeysAndSkipsEntriesWithoutKty() throws {
        let document = try jsonObject(
            #"{"keys":[{"kid":"x"},"not a key",{"kty":"RSA","kid":"a","alg":"RS256","use":"sig","n":"AQAB","e":"AQAB"}]}"#
        )
        let set = try JWKSet.parse(document).get()
        #expect(set.keys.map(\.kid) == ["a"])
        #expect(set.keys.first?.alg == "RS256")
        #expect(set.keys.first?.use == "sig")
    }

    @Test func documentWithoutKeysIsAnError() throws {
        #expect(throws: JWT.ParseError.self) { try JWKSet.parse(try jsonObject(#"{"key":[]}"#)).get() }
        #expect(throws: JWT.ParseError.self) { try JWKSet.parse(try jsonObject(#"{"keys":{}}"#)).get() }
    }

    @Test func candidatesFollowKidTypeAlgAndUse() throws {
        let set = try keySet(
            JWSFixtures.rsa1, JWSFixtures.rsa2, JWSFixtures.ec1,
            modifiedJWK(JWSFixtures.rsa1, ["kid": "enc", "use": "enc"]),
            modifiedJWK(JWSFixtures.rsa1, ["kid": "ps-only", "alg": "PS256"]),
            modifiedJWK(JWSFixtures.rsa1, ["kid": "no-use", "use": nil]))
        #expect(set.candidates(algorithm: .rs256, kid: "rsa-1").map(\.kid) == ["rsa-1"])
        #expect(set.candidates(algorithm: .rs256, kid: nil).map(\.kid) == ["rsa-1", "rsa-2", "no-use"])
        #expect(set.candidates(algorithm: .ps256, kid: nil).map(\.kid) == ["rsa-1", "rsa-2", "ps-only", "no-use"])
        #expect(set.candidates(algorithm: .es256, kid: nil).map(\.kid) == ["ec-1"])
        #expect(set.candidates(algorithm: .rs256, kid: "enc").isEmpty)
        #expect(set.candidates(algorithm: .rs256, kid: "ec-1").isEmpty)
        #expect(set.candidates(algorithm: .rs256, kid: "unknown").isEmpty)
    }
}

@Suite struct JWSVerifierTests {
    @Test(arguments: [
        JWSFixtures.rs256, JWSFixtures.rs384, JWSFixtures.ps256, JWSFixtures.es256, JWSFixtures.es384,
        JWSFixtures.es256LeadingZeroR, JWSFixtures.es256LeadingZeroS, JWSFixtures.rs256WithoutKid,
        JWSFixtures.rs256ByRSA2,
    ])
    func tokensSignedByPyJWTVerify(_ compact: String) throws {
        #expect(try verify(compact, allKeys()) == .valid)
    }

    @Test func tamperedPayloadFails() throws {
        var claims = try parsedJWT(JWSFixtures.rs256).claims
        claims["sub"] = "mallory"
        for token in [JWSFixtures.rs256, JWSFixtures.ps256, JWSFixtures.es256, JWSFixtures.es384] {
            let pieces = parts(token)
            let forged = [pieces[0], encodedPart(claims), pieces[2]].joined(separator: ".")
            #expect(try isInvalid(verify(forged, allKeys())))
        }
    }

    @Test func tamperedSignatureFails() throws {
        for token in [JWSFixtures.rs256, JWSFixtures.ps256, JWSFixtures.es256, JWSFixtures.es256LeadingZeroR] {
            let pieces = parts(token)
            var signature = try #require(Base64.decode(pieces[2]))
            signature[signature.count / 2] ^= 0x80
            let forged = [pieces[0], pieces[1], Base64.urlEncode(signature)].joined(separator: ".")
            #expect(try isInvalid(verify(forged, allKeys())))
            // Truncated and emptied signatures fail too.
            let truncated = [pieces[0], pieces[1], Base64.urlEncode(signature.dropLast())].joined(separator: ".")
            #expect(try isInvalid(verify(truncated, allKeys())))
            #expect(try isInvalid(verify("\(pieces[0]).\(pieces[1]).", allKeys())))
        }
    }

    @Test func algNoneIsRefused() throws {
        let claims = parts(JWSFixtures.rs256)[1]
        for alg in ["none", "None", "NONE"] {
            let header = encodedPart(JSONObject([("alg", .string(alg)), ("kid", "rsa-1")]))
            #expect(try isInvalid(verify("\(header).\(claims).", allKeys())))
            // With the original signature kept, still refused.
            #expect(
                try isInvalid(verify(withHeader(JWSFixtures.rs256, JSONObject([("alg", .string(alg))])), allKeys())))
        }
    }

    @Test func hmacKeyedWithThePublicKeyIsRefused() throws {
        // The classic confusion: HS256 with the RSA public key as the shared secret.
        let outcome = try verify(JWSFixtures.hs256KeyedWithRSAPublicKey, allKeys())
        #expect(isInvalid(outcome))
        let header = try parsedJWT(JWSFixtures.hs256KeyedWithRSAPublicKey).header
        #expect(header["alg"] == "HS256")
        for alg in ["HS384", "HS512", "EdDSA", "ES512", "RS1", "rs256", ""] {
            let forged = withHeader(JWSFixtures.rs256, JSONObject([("alg", .string(alg)), ("kid", "rsa-1")]))
            #expect(try isInvalid(verify(forged, allKeys())), "alg \(alg)")
        }
    }

    @Test func rsaTokenIsNotCheckedWithAnECKey() throws {
        // The EC key published under the RSA token's kid: no candidate of the right type, so no verification.
        let ecUnderRSAKid = try keySet(modifiedJWK(JWSFixtures.ec1, ["kid": "rsa-1"]))
        #expect(try verify(JWSFixtures.rs256, ecUnderRSAKid) == .unknownKey)
        // The RSA token relabelled ES256 (signature bytes unchanged) is checked against the EC key and fails.
        let relabelled = withHeader(JWSFixtures.rs256, JSONObject([("alg", "ES256"), ("kid", "ec-1")]))
        #expect(try isInvalid(verify(relabelled, allKeys())))
        // And an ES256 token relabelled RS256 fails against the RSA key.
        let relabelledEC = withHeader(JWSFixtures.es256, JSONObject([("alg", "RS256"), ("kid", "rsa-1")]))
        #expect(try isInvalid(verify(relabelledEC, allKeys())))
    }

    @Test func allowedAlgorithmsAreEnforced() throws {
        let jwt = try parsedJWT(JWSFixtures.rs256)
        #expect(try JWSVerifier.verify(jwt, keys: allKeys(), allowed: [.es256, .ps256]) != .valid)
        #expect(try JWSVerifier.verify(jwt, keys: allKeys(), allowed: [.rs256]) == .valid)
    }

    @Test func kidSelectsTheKey() throws {
        // Only rsa-2 published: the token's rsa-1 is unknown, which asks for a JWKS refetch.
        #expect(try verify(JWSFixtures.rs256, keySet(JWSFixtures.rsa2, JWSFixtures.ec1)) == .unknownKey)
        // rsa-2's modulus under the name rsa-1: the kid picks it, and it does not verify.
        let impostor = try modifiedJWK(JWSFixtures.rsa2, ["kid": "rsa-1"])
        #expect(try isInvalid(verify(JWSFixtures.rs256, keySet(impostor))))
        // The kid picks rsa-1 even when rsa-2 comes first; a token without kid tries each RSA key.
        #expect(try verify(JWSFixtures.rs256, keySet(JWSFixtures.rsa2, JWSFixtures.rsa1)) == .valid)
        #expect(try verify(JWSFixtures.rs256WithoutKid, keySet(JWSFixtures.rsa2, JWSFixtures.rsa1)) == .valid)
        #expect(try isInvalid(verify(JWSFixtures.rs256WithoutKid, keySet(JWSFixtures.rsa2))))
        // A kid names exactly one key: rsa-1's key under another kid is not tried for a token naming rsa-1.
        #expect(
            try verify(JWSFixtures.rs256, keySet(modifiedJWK(JWSFixtures.rsa1, ["kid": "rsa-1-old"]))) == .unknownKey)
    }

    @Test func keysWithAnotherAlgAreNotUsed() throws {
        let psOnly = try modifiedJWK(JWSFixtures.rsa1, ["alg": "PS256"])
        #expect(try verify(JWSFixtures.rs256, keySet(psOnly)) == .unknownKey)
        #expect(try verify(JWSFixtures.ps256, keySet(psOnly)) == .valid)
    }

    @Test func encryptionKeysAreIgnored() throws {
        let encryption = try modifiedJWK(JWSFixtures.rsa1, ["use": "enc"])
        #expect(try verify(JWSFixtures.rs256, keySet(encryption)) == .unknownKey)
        #expect(try isInvalid(verify(JWSFixtures.rs256WithoutKid, keySet(encryption, JWSFixtures.rsa2))))
        let ecEncryption = try modifiedJWK(JWSFixtures.ec1, ["use": "enc"])
        #expect(try verify(JWSFixtures.es256, keySet(ecEncryption)) == .unknownKey)
        // The same key also published for signatures verifies; a key without "use" may sign.
        #expect(try verify(JWSFixtures.rs256, keySet(encryption, JWSFixtures.rsa1)) == .valid)
        #expect(try verify(JWSFixtures.rs256, keySet(modifiedJWK(JWSFixtures.rsa1, ["use": nil]))) == .valid)
    }

    @Test func unusableKeyMaterialDoesNotVerify() throws {
        let broken = try modifiedJWK(JWSFixtures.rsa1, ["n": "not base64!"])
        #expect(try isInvalid(verify(JWSFixtures.rs256, keySet(broken))))
        let offCurve = try modifiedJWK(JWSFixtures.ec1, ["crv": "P-384"])
        #expect(try isInvalid(verify(JWSFixtures.es256, keySet(offCurve))))
    }
}
