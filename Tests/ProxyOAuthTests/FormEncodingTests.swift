import Testing

@testable import ProxyOAuth

@Suite struct FormEncodingTests {
    @Test func encodesReservedCharacters() {
        #expect(FormEncoding.encode([("a b", "c&d=e"), ("scope", "openid api")]) == "a%20b=c%26d%3De&scope=openid%20api")
    }

    @Test func decodesPlusAndPercent() throws {
        let pairs = try #require(FormEncoding.decode("code=a%2Bb&state=x+y&empty="))
        #expect(pairs.map(\.0) == ["code", "state", "empty"])
        #expect(pairs.map(\.1) == ["a+b", "x y", ""])
        #expect(FormEncoding.decode("bad=%G1") == nil)
    }
}
