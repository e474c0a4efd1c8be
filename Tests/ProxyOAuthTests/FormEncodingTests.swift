import Testing

@testable import ProxyOAuth

@Suite struct FormEncodingTests {
    @Test func encodesReservedCharacters() {
        #expect(
            FormEncoding.encode([("a b", "c&d=e"), ("scope", "openid api")]) == "a%20b=c%26d%3De&scope=openid%20api")
    }

    @Test func decodesPlusAndPercent() throws {
        let pairs = try #require(FormEncoding.decode("code=a%2Bb&state=x+y&empty="))
        #expect(pairs.map(\.0) == ["code", "state", "empty"])
        #expect(pairs.map(\.1) == ["a+b", "x y", ""])
        #expect(FormEncoding.decode("bad=%G1") == nil)
    }

    @Test func unreservedCharactersStayAndEverythingElseIsEscaped() {
        // RFC 3986 §2.3 unreserved: ALPHA DIGIT - . _ ~
        let unreserved = "ABCXYZabcxyz0189-._~"
        #expect(FormEncoding.percentEncode(unreserved) == unreserved)
        #expect(FormEncoding.percentEncode("+") == "%2B")
        #expect(FormEncoding.percentEncode("*'()!") == "%2A%27%28%29%21")
        #expect(FormEncoding.percentEncode("/?#[]@:") == "%2F%3F%23%5B%5D%40%3A")
        #expect(FormEncoding.percentEncode("%") == "%25")
        #expect(FormEncoding.percentEncode("\n\u{0}") == "%0A%00")
        // UTF-8 bytes, upper-case hex.
        #expect(FormEncoding.percentEncode("é€") == "%C3%A9%E2%82%AC")
        #expect(FormEncoding.percentEncode("") == "")
    }

    @Test func encodesEmptyNamesAndValuesAndKeepsOrderAndRepeats() {
        #expect(FormEncoding.encode([]) == "")
        #expect(FormEncoding.encode([("", "")]) == "=")
        #expect(
            FormEncoding.encode([("resource", "https://a"), ("resource", "https://b"), ("x", "")])
                == "resource=https%3A%2F%2Fa&resource=https%3A%2F%2Fb&x=")
    }

    @Test func decodesTheShapesBrowsersSend() throws {
        #expect(FormEncoding.decode("")?.isEmpty == true)
        let pairs = try #require(FormEncoding.decode("a=1&&b=2&flag&c=x=y&=v&d=%2b%2F"))
        #expect(pairs.map(\.0) == ["a", "b", "flag", "c", "", "d"])
        #expect(pairs.map(\.1) == ["1", "2", "", "x=y", "v", "+/"])
        let utf8 = try #require(FormEncoding.decode("name=%C3%A9t%C3%A9&emoji=%F0%9F%98%80"))
        #expect(utf8.map(\.1) == ["été", "😀"])
    }

    @Test(arguments: ["a=%", "a=%4", "a=%4G", "%zz=1", "a=1&b=%", "a=%C3", "a=%FF", "a=%ED%A0%80", "a=%C0%AF"])
    func invalidEscapesOrUTF8MakeTheWholeInputInvalid(_ text: String) {
        #expect(FormEncoding.decode(text) == nil)
    }

    @Test func roundTrip() throws {
        let parameters = [
            ("code", "SplxlOBeZQQYbYS6WxSbIA"), ("state", "af0ifjsldkj"),
            ("redirect_uri", "http://127.0.0.1:5000/cb?x=1"),
            ("text", "a+b c&d=e%f é 😀"), ("empty", ""), ("", "no name"),
        ]
        let decoded = try #require(FormEncoding.decode(FormEncoding.encode(parameters)))
        #expect(decoded.map(\.0) == parameters.map(\.0))
        #expect(decoded.map(\.1) == parameters.map(\.1))
    }
}
