import Testing

@testable import ProxyCore

/// Base64 and base64url (RFC 4648 §4, §5), checked against the test vectors of RFC 4648 §10.
@Suite struct Base64Tests {
    static let vectors: [(String, String)] = [
        ("", ""),
        ("f", "Zg=="),
        ("fo", "Zm8="),
        ("foo", "Zm9v"),
        ("foob", "Zm9vYg=="),
        ("fooba", "Zm9vYmE="),
        ("foobar", "Zm9vYmFy"),
    ]

    @Test(arguments: vectors)
    func rfc4648Vectors(plain: String, encoded: String) {
        #expect(Base64.encode(plain.utf8) == encoded)
        #expect(Base64.decode(encoded) == plain.bytes)
    }

    @Test(arguments: vectors)
    func urlSafeVariantHasNoPadding(plain: String, encoded: String) {
        let unpadded = String(encoded.prefix(while: { $0 != "=" }))
        #expect(Base64.urlEncode(plain.utf8) == unpadded)
        #expect(Base64.decode(unpadded) == plain.bytes)
    }

    @Test func alphabetsDifferOnlyInTheLastTwoCharacters() {
        // These bytes encode to sextets 62 and 63, the two that differ between the alphabets.
        let bytes: [UInt8] = [0xFB, 0xFF, 0xBF, 0xFE]
        #expect(Base64.encode(bytes) == "+/+//g==")
        #expect(Base64.urlEncode(bytes) == "-_-__g")
        #expect(Base64.decode("+/+//g==") == bytes)
        #expect(Base64.decode("-_-__g") == bytes)
        #expect(Base64.decode("-_-__g==") == bytes)
    }

    @Test func everyByteRoundTrips() {
        let bytes = (0...255).map { UInt8($0) }
        for length in 0...bytes.count where length % 17 == 0 || length < 8 || length == 256 {
            let slice = Array(bytes[..<length])
            #expect(Base64.decode(Base64.encode(slice)) == slice, "length \(length)")
            #expect(Base64.decode(Base64.urlEncode(slice)) == slice, "length \(length)")
        }
        #expect(Base64.encode(bytes).count == 344)
    }

    @Test(arguments: [
        "Zm9v!",  // not in either alphabet
        "Zm9v Zm9v",  // whitespace
        "Zm9v\n",
        "Z",  // a single character cannot encode a byte
        "Zm9vY",
        "Zh==",  // non-zero bits after the last byte: not canonical
        "Zm9=",
        "Zg==Zg==",  // padding in the middle
        "=Zg",
        "Zm9v\u{E9}",
        "Zm.v",
    ])
    func invalidInput(text: String) {
        #expect(Base64.decode(text) == nil)
    }

    @Test func emptyAndPaddingOnly() {
        #expect(Base64.decode("") == [])
        #expect(Base64.decode("==") == [])
    }
}
