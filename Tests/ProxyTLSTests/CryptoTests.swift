import ProxyCore
import TestFixtures
import Testing

@testable import ProxyTLS

private func hex(_ bytes: [UInt8]) -> String {
    bytes.map { ($0 < 16 ? "0" : "") + String($0, radix: 16) }.joined()
}

private func bytes(hex text: String) -> [UInt8] {
    var result: [UInt8] = []
    var index = text.startIndex
    while index < text.endIndex {
        let next = text.index(index, offsetBy: 2)
        result.append(UInt8(text[index..<next], radix: 16)!)
        index = next
    }
    return result
}

private func key(_ jwk: String) throws -> CryptoKey {
    let object = try #require(try JSON.parse(jwk).get().object)
    return try CryptoKey.publicKey(jwk: object)
}

/// A compact JWS split into what the signature covers and the signature bytes.
private struct SignedParts {
    var signingInput: [UInt8]
    var signature: [UInt8]

    init(_ compact: String) throws {
        let parts = compact.split(separator: ".", omittingEmptySubsequences: false)
        try #require(parts.count == 3)
        signingInput = Array("\(parts[0]).\(parts[1])".utf8)
        signature = try #require(Base64.decode(parts[2]))
    }
}

@Suite struct HashAndRandomTests {
    @Test func sha256KnownAnswers() {
        // FIPS 180-2 Appendix B.1 and the empty message.
        #expect(hex(Crypto.sha256("abc")) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
        #expect(hex(Crypto.sha256("")) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
        #expect(
            hex(Crypto.sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"))
                == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1")
        #expect(Crypto.sha256([UInt8](repeating: 0x61, count: 3)) == Crypto.sha256("aaa"))
        // FIPS 180-2's long message: a million "a"s (many blocks).
        #expect(
            hex(Crypto.sha256([UInt8](repeating: 0x61, count: 1_000_000)))
                == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0")
    }

    @Test func randomBytesAndTokens() {
        #expect(Crypto.randomBytes(0).isEmpty)
        #expect(Crypto.randomBytes(48).count == 48)
        // 32 bytes of base64url without padding: 43 characters.
        let tokens = (0..<100).map { _ in Crypto.randomToken() }
        #expect(Set(tokens).count == 100)
        for token in tokens {
            #expect(token.count == 43)
            #expect(
                token.utf8.allSatisfy {
                    $0 == 0x2D || $0 == 0x5F || (0x30...0x39).contains($0) || ($0 | 0x20 >= 0x61 && $0 | 0x20 <= 0x7A)
                })
        }
        #expect(Crypto.randomToken(bytes: 16).count == 22)
    }
}

@Suite struct JWKImportTests {
    @Test func importsEachFixtureKey() throws {
        for jwk in [JWSFixtures.rsa1, JWSFixtures.rsa2, JWSFixtures.ec1, JWSFixtures.ec384] {
            _ = try key(jwk)
        }
    }

    @Test(arguments: [
        #"{"kty":"oct","k":"c2VjcmV0"}"#,
        #"{"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}"#,
        #"{"n":"AQAB","e":"AQAB"}"#,
        #"{"kty":"RSA","e":"AQAB"}"#,
        #"{"kty":"RSA","n":"","e":"AQAB"}"#,
        #"{"kty":"RSA","n":"not base64!","e":"AQAB"}"#,
        #"{"kty":"EC","crv":"P-521","x":"AA","y":"AA"}"#,
        #"{"kty":"EC","x":"yimTDhJ4SHUv8dyipRkywZWuMV5fsPHg7HF-8F8GcZI","y":"vG799Lk1HsJ3-5rbK8SznaI3_yUpqef27xcZzKjB3-k"}"#,
        // x one byte short.
        #"{"kty":"EC","crv":"P-256","x":"yimTDhJ4SHUv8dyipRkywZWuMV5fsPHg7HF-8F8GcQ","y":"vG799Lk1HsJ3-5rbK8SznaI3_yUpqef27xcZzKjB3-k"}"#,
        // A P-256 point given as P-384.
        #"{"kty":"EC","crv":"P-384","x":"yimTDhJ4SHUv8dyipRkywZWuMV5fsPHg7HF-8F8GcZI","y":"vG799Lk1HsJ3-5rbK8SznaI3_yUpqef27xcZzKjB3-k"}"#,
        // A point that is not on the curve (y changed).
        #"{"kty":"EC","crv":"P-256","x":"yimTDhJ4SHUv8dyipRkywZWuMV5fsPHg7HF-8F8GcZI","y":"vG799Lk1HsJ3-5rbK8SznaI3_yUpqef27xcZzKjB3-g"}"#,
    ])
    func rejectsUnusableKeys(_ jwk: String) {
        #expect(throws: CryptoError.self) { try key(jwk) }
    }
}

@Suite struct SignatureVerificationTests {
    @Test(arguments: [
        (JWSFixtures.rs256, JWSAlgorithm.rs256), (JWSFixtures.rs384, .rs384),
        (JWSFixtures.ps256, .ps256),
    ])
    func rsaSignaturesFromPyJWTVerify(_ token: String, _ algorithm: JWSAlgorithm) throws {
        let parts = try SignedParts(token)
        let rsa1 = try key(JWSFixtures.rsa1)
        #expect(rsa1.verify(algorithm, signature: parts.signature, signingInput: parts.signingInput))
        // The same bytes under any other algorithm, or with another key, do not verify.
        for other in JWSAlgorithm.allCases where other != algorithm {
            #expect(!rsa1.verify(other, signature: parts.signature, signingInput: parts.signingInput))
        }
        for jwk in [JWSFixtures.rsa2, JWSFixtures.ec1] {
            let otherKey = try key(jwk)
            #expect(!otherKey.verify(algorithm, signature: parts.signature, signingInput: parts.signingInput))
        }
    }

    @Test(arguments: [
        (JWSFixtures.es256, JWSFixtures.ec1, JWSAlgorithm.es256),
        (JWSFixtures.es256LeadingZeroR, JWSFixtures.ec1, .es256),
        (JWSFixtures.es256LeadingZeroS, JWSFixtures.ec1, .es256),
        (JWSFixtures.es384, JWSFixtures.ec384, .es384),
    ])
    func ecdsaSignaturesFromPyJWTVerify(_ token: String, _ jwk: String, _ algorithm: JWSAlgorithm) throws {
        let parts = try SignedParts(token)
        let ecKey = try key(jwk)
        #expect(ecKey.verify(algorithm, signature: parts.signature, signingInput: parts.signingInput))
        for other in JWSAlgorithm.allCases where other != algorithm {
            #expect(!ecKey.verify(other, signature: parts.signature, signingInput: parts.signingInput))
        }
        let rsaKey = try key(JWSFixtures.rsa1)
        #expect(!rsaKey.verify(algorithm, signature: parts.signature, signingInput: parts.signingInput))
    }

    @Test(arguments: [
        (JWSFixtures.rs256, JWSFixtures.rsa1, JWSAlgorithm.rs256),
        (JWSFixtures.ps256, JWSFixtures.rsa1, .ps256),
        (JWSFixtures.es256, JWSFixtures.ec1, .es256),
        (JWSFixtures.es384, JWSFixtures.ec384, .es384),
    ])
    func tamperingIsDetected(_ token: String, _ jwk: String, _ algorithm: JWSAlgorithm) throws {
        let parts = try SignedParts(token)
        let verifier = try key(jwk)
        for position in [0, parts.signature.count / 2, parts.signature.count - 1] {
            var signature = parts.signature
            signature[position] ^= 0x01
            #expect(!verifier.verify(algorithm, signature: signature, signingInput: parts.signingInput))
        }
        var input = parts.signingInput
        input[input.count - 1] ^= 0x01
        #expect(!verifier.verify(algorithm, signature: parts.signature, signingInput: input))
        #expect(!verifier.verify(algorithm, signature: parts.signature, signingInput: parts.signingInput + [0x41]))
        #expect(
            !verifier.verify(algorithm, signature: Array(parts.signature.dropLast()), signingInput: parts.signingInput))
        #expect(!verifier.verify(algorithm, signature: parts.signature + [0], signingInput: parts.signingInput))
        #expect(!verifier.verify(algorithm, signature: [], signingInput: parts.signingInput))
    }

    @Test func ecdsaSignatureOfZerosIsRejected() throws {
        let parts = try SignedParts(JWSFixtures.es256)
        let ecKey = try key(JWSFixtures.ec1)
        #expect(!ecKey.verify(.es256, signature: [UInt8](repeating: 0, count: 64), signingInput: parts.signingInput))
    }

    @Test func ecdsaDERSignatureIsNotAcceptedInPlaceOfRaw() throws {
        // JWS carries r||s (RFC 7518 §3.4); a DER signature of the same value must not be accepted too.
        let parts = try SignedParts(JWSFixtures.es256LeadingZeroR)
        let der = bytes(hex: JWSFixtures.es256LeadingZeroRDER)
        let ecKey = try key(JWSFixtures.ec1)
        #expect(!ecKey.verify(.es256, signature: der, signingInput: parts.signingInput))
    }
}

@Suite struct ECDSALeadingZeroTests {
    @Test(arguments: [
        (
            JWSFixtures.es256LeadingZeroR, JWSFixtures.es256LeadingZeroRRaw,
            JWSFixtures.es256LeadingZeroRDER
        ),
        (
            JWSFixtures.es256LeadingZeroS, JWSFixtures.es256LeadingZeroSRaw,
            JWSFixtures.es256LeadingZeroSDER
        ),
    ])
    func derAndRawMatchTheIndependentEncoding(_ token: String, _ rawHex: String, _ derHex: String) throws {
        let raw = bytes(hex: rawHex)
        let der = bytes(hex: derHex)
        #expect(try SignedParts(token).signature == raw)
        // One of r and s is 31 bytes in DER: the leading zero of the raw form is dropped, not kept.
        #expect(raw[0] == 0 || raw[32] == 0)
        #expect(ECDSASignature.rawToDER(raw, coordinateSize: 32) == der)
        #expect(ECDSASignature.derToRaw(der, coordinateSize: 32) == raw)
        let back = try #require(ECDSASignature.rawToDER(raw, coordinateSize: 32))
        #expect(ECDSASignature.derToRaw(back, coordinateSize: 32) == raw)
    }

    @Test func leadingZeroRIsEncodedAsA31ByteInteger() {
        let der = bytes(hex: JWSFixtures.es256LeadingZeroRDER)
        // SEQUENCE, length, INTEGER r (31 bytes, no padding: the top bit of its first byte is clear).
        #expect(der[0] == 0x30)
        #expect(Int(der[1]) == der.count - 2)
        #expect(der[2] == 0x02)
        #expect(der[3] == 31)
    }

    @Test func derWithTrailingBytesOrOversizedIntegersIsRefused() throws {
        let der = bytes(hex: JWSFixtures.es256LeadingZeroRDER)
        #expect(ECDSASignature.derToRaw(der + [0], coordinateSize: 32) == nil)
        #expect(ECDSASignature.derToRaw(Array(der.dropLast()), coordinateSize: 32) == nil)
        #expect(ECDSASignature.derToRaw([], coordinateSize: 32) == nil)
        // A P-384 signature does not fit 32-byte coordinates.
        let p384 = try SignedParts(JWSFixtures.es384).signature
        let p384DER = try #require(ECDSASignature.rawToDER(p384, coordinateSize: 48))
        #expect(ECDSASignature.derToRaw(p384DER, coordinateSize: 48) == p384)
        #expect(ECDSASignature.derToRaw(p384DER, coordinateSize: 32) == nil)
        #expect(ECDSASignature.rawToDER(p384, coordinateSize: 32) == nil)
    }

    @Test func smallAndEdgeValuesRoundTrip() throws {
        for (r, s) in [
            ([UInt8](repeating: 0, count: 31) + [1], [UInt8](repeating: 0xFF, count: 32)),
            ([0x80] + [UInt8](repeating: 0, count: 31), [0, 0, 0x7F] + [UInt8](repeating: 0x01, count: 29)),
        ] {
            let raw = r + s
            let der = try #require(ECDSASignature.rawToDER(raw, coordinateSize: 32))
            #expect(ECDSASignature.derToRaw(der, coordinateSize: 32) == raw)
        }
    }
}
