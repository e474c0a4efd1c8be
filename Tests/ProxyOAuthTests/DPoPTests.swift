import Foundation
import ProxyCore
import TestFixtures
import Testing

@testable import ProxyOAuth
@testable import ProxyTLS

@Suite struct DPoPTests {
    /// RFC 7638 §3.1 gives an RSA example; the EC members are hashed the same way. This checks our
    /// thumbprint against one computed independently (Python: sha256 of the canonical JSON, see below).
    @Test func thumbprintMatchesTheRFC7638Construction() throws {
        let key = try PrivateKey.generateP256()
        let jwk = try key.publicJWK()
        let canonical = #"{"crv":"P-256","kty":"EC","x":"\#(jwk["x"]!.string!)","y":"\#(jwk["y"]!.string!)"}"#
        #expect(try key.thumbprint() == Base64.urlEncode(Crypto.sha256(canonical)))
    }

    /// RFC 7638 §3.1's own example (an RSA key): the canonical JSON and its SHA-256 thumbprint.
    @Test func rfc7638ExampleThumbprint() {
        let n =
            "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_BJECPebWKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2QvzqY368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh6WeZu0fM4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDKgw"
        let canonical = #"{"e":"AQAB","kty":"RSA","n":"\#(n)"}"#
        #expect(Base64.urlEncode(Crypto.sha256(canonical)) == "NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9Xs")
    }

    @Test(arguments: [
        ("https://api.example.com/v1/items?page=2#top", "https://api.example.com/v1/items"),
        ("https://API.Example.com:443/x", "https://api.example.com/x"),
        ("http://api.example.com:80/x?y", "http://api.example.com/x"),
        ("https://api.example.com:8443/x", "https://api.example.com:8443/x"),
        ("http://127.0.0.1:5556/api/oidc/token", "http://127.0.0.1:5556/api/oidc/token"),
        ("https://[::1]:8443/a?b", "https://[::1]:8443/a"),
        ("https://api.example.com", "https://api.example.com/"),
        ("https://api.example.com?q=1", "https://api.example.com/"),
        // A combining mark after "?" or "#" makes one Character with it; htu is cut on the bytes.
        ("https://api.example.com/caf\u{e9}/x?\u{301}q", "https://api.example.com/caf\u{e9}/x"),
        ("https://api.example.com/a#\u{301}top", "https://api.example.com/a"),
        ("https://api.example.com/e\u{301}", "https://api.example.com/e\u{301}"),
    ])
    func htuDropsQueryFragmentAndDefaultPort(url: String, expected: String) {
        // Byte for byte: String's == would call "é" and "e\u{301}" equal.
        #expect(Array(DPoPKey.htu(url).utf8) == Array(expected.utf8))
    }

    @Test func proofHasTheRFC9449Shape() throws {
        let key = try DPoPKey(try PrivateKey.generateP256())
        let proof = try key.proof(
            method: "POST", url: "https://api.example.com/v1?x=1", accessToken: "token-value", nonce: "n\"1",
            now: 1_800_000_000)
        let jwt = try JWT.parse(proof).get()
        #expect(jwt.header["typ"]?.string == "dpop+jwt")
        #expect(jwt.header["alg"]?.string == "ES256")
        let jwk = try #require(jwt.header["jwk"]?.object)
        #expect(Set(jwk.keys) == ["crv", "kty", "x", "y"])  // public members only
        #expect(jwt.claims["htm"]?.string == "POST")
        #expect(jwt.claims["htu"]?.string == "https://api.example.com/v1")
        #expect(jwt.claims["iat"]?.int == 1_800_000_000)
        #expect(jwt.claims["nonce"]?.string == "n\"1")
        #expect(jwt.claims["ath"]?.string == Base64.urlEncode(Crypto.sha256("token-value")))
        let jti = try #require(jwt.claims["jti"]?.string)
        #expect(Base64.decode(jti)?.count == 12)  // 96 random bits
        #expect(jwt.signature.count == 64)  // raw r||s
        let verifier = try CryptoKey.publicKey(jwk: jwk)
        #expect(verifier.verify(.es256, signature: jwt.signature, signingInput: jwt.signingInput))
    }

    /// `signAhead`: signatures finish ECDSA nonces made ahead on a background queue. Each must verify, and no
    /// nonce may serve twice (the same r twice with one key gives the key away); past the pool, signing goes on
    /// (the usual way while a refill runs).
    @Test func signaturesFromNoncesMadeAheadVerifyAndNeverRepeatANonce() async throws {
        let key = try PrivateKey.generateP256()
        key.signAhead()
        // The refill runs on a background queue; the deadline is generous for a busy 2-core machine.
        let deadline = ContinuousClock.now + .seconds(60)
        while key.presignedCounts.ready < PrivateKey.presignBatch && ContinuousClock.now < deadline {
            try await Task.sleep(for: .milliseconds(10))
        }
        #expect(key.presignedCounts.ready == PrivateKey.presignBatch)
        let verifier = try CryptoKey.publicKey(jwk: try key.publicJWK())
        var nonces = Set<[UInt8]>()
        let count = PrivateKey.presignBatch * 3
        for index in 0..<count {
            let message = Array("message \(index)".utf8)
            let signature = try key.signES256(message)
            #expect(verifier.verify(.es256, signature: signature, signingInput: message))
            nonces.insert(Array(signature[0..<32]))
        }
        #expect(nonces.count == count)
        #expect(key.presignedCounts.used >= PrivateKey.presignBatch)
        // A key that was not asked to sign ahead signs the usual way.
        let plain = try PrivateKey.generateP256()
        _ = try plain.signES256([1, 2, 3])
        #expect(plain.presignedCounts.used == 0)
    }

    @Test func proofsAreUnique() throws {
        let key = try DPoPKey(try PrivateKey.generateP256())
        let proofs = try (0..<200).map { _ in try key.proof(method: "GET", url: "https://a.test/", now: 1) }
        let jtis = try proofs.map { try JWT.parse($0).get().claims["jti"]!.string! }
        #expect(Set(jtis).count == 200)
    }

    @Test func nonceCacheIsPerOrigin() {
        let nonces = DPoPNonces()
        nonces.remember("a", for: "https://as.test/token")
        nonces.remember("b", for: "https://rs.test:8443/x")
        nonces.remember(nil, for: "https://as.test/other")
        #expect(nonces.nonce(for: "https://as.test/authorize") == "a")
        #expect(nonces.nonce(for: "https://rs.test:8443/y") == "b")
        #expect(nonces.nonce(for: "https://rs.test/y") == nil)
    }

    @Test func nonceCacheStaysRightPastItsMemoOfURLs() {
        // The URL -> origin memo is bounded (64): answers must not change when it is emptied and refilled.
        let nonces = DPoPNonces()
        for index in 0..<200 { nonces.remember("n\(index)", for: "https://rs\(index).test/path/\(index)") }
        for index in 0..<200 {
            #expect(nonces.nonce(for: "https://rs\(index).test/other") == "n\(index)")
            #expect(nonces.nonce(for: "https://rs\(index).test:444/other") == nil)
        }
    }

    @Test func keyFileIsPrivateAndReloads() throws {
        let directory = NSTemporaryDirectory() + "dpop-\(UUID().uuidString)"
        let key = try DPoPKey.create(stateDirectory: directory, provider: "corp")
        var info = stat()
        #expect(stat(DPoPKey.path(stateDirectory: directory, provider: "corp"), &info) == 0)
        #expect(info.st_mode & 0o777 == 0o600)
        let loaded = try #require(try DPoPKey.load(stateDirectory: directory, provider: "corp"))
        #expect(loaded.thumbprint == key.thumbprint)
        #expect(try DPoPKey.load(stateDirectory: directory, provider: "other") == nil)
    }
}
