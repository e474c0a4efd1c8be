import Testing

@testable import ProxyCore

/// The parsed value, or nil when the parser refused the input.
private func parsed(_ text: String) -> JSONValue? {
    try? JSON.parse(text).get()
}

/// The parser's error for input it must refuse; records an issue when it accepts it.
private func rejection(_ bytes: [UInt8], sourceLocation: SourceLocation = #_sourceLocation) -> JSONError? {
    switch JSON.parse(bytes) {
    case .success(let value):
        Issue.record("accepted \(bytes) as \(value)", sourceLocation: sourceLocation)
        return nil
    case .failure(let error):
        return error
    }
}

private func rejection(_ text: String, sourceLocation: SourceLocation = #_sourceLocation) -> JSONError? {
    rejection(Array(text.utf8), sourceLocation: sourceLocation)
}

@Suite struct JSONParserAcceptsTests {
    @Test func literalsAndTopLevelScalars() {
        // RFC 8259 §2: any value may be the top-level value.
        #expect(parsed("null") == .null)
        #expect(parsed("true") == .bool(true))
        #expect(parsed("false") == .bool(false))
        #expect(parsed("\"x\"") == .string("x"))
        #expect(parsed("42") == .number("42"))
        #expect(parsed(" \t\r\n[ ]\n") == .array([]))
        #expect(parsed("{}") == .object(JSONObject()))
    }

    @Test(arguments: [
        "0", "-0", "7", "-12", "1.5", "0.25", "1e10", "1E+2", "-1.0e-3", "123456789012345678901234567890",
    ])
    func numbersKeepTheirText(_ text: String) {
        #expect(parsed(text) == .number(text))
        #expect(parsed("[\(text)]") == .array([.number(text)]))
    }

    @Test func nestedStructuresKeepMemberOrder() throws {
        let value = try #require(parsed(#"{"z":1,"a":[true,null,{"k":"v"}],"m":{}}"#))
        let object = try #require(value.object)
        #expect(object.keys == ["z", "a", "m"])
        #expect(value["a"] == .array([.bool(true), .null, .object(JSONObject([("k", "v")]))]))
        #expect(value["m"]?.object?.keys == [])
    }

    @Test func escapes() {
        #expect(parsed(#""\" \\ \/ \b \f \n \r \t""#) == .string("\" \\ / \u{08} \u{0C} \n \r \t"))
        #expect(parsed(#""\u0041\u00e9\u20AC""#) == .string("Aé€"))
        #expect(parsed(#""\u0000""#) == .string("\u{0}"))
        // A surrogate pair is one scalar (RFC 8259 §7).
        #expect(parsed(#""\uD83D\uDE00""#) == .string("😀"))
        #expect(parsed(#""\ud83d\ude00""#) == .string("😀"))
    }

    @Test func rawUTF8PassesThrough() {
        #expect(parsed("\"héllo 😀 日本\"") == .string("héllo 😀 日本"))
        #expect(JSON.parse([0x22, 0xC3, 0xA9, 0x22]) == .success(.string("é")))
    }

    @Test func nestingUpToTheLimit() {
        // The outermost value is at depth 0, so maxDepth brackets are the most that are accepted.
        let deepest = String(repeating: "[", count: JSON.maxDepth) + String(repeating: "]", count: JSON.maxDepth)
        #expect(parsed(deepest) != nil)
        let objects =
            String(repeating: #"{"a":"#, count: JSON.maxDepth - 1) + "1"
            + String(repeating: "}", count: JSON.maxDepth - 1)
        #expect(parsed(objects) != nil)
    }
}

@Suite struct JSONParserRejectsTests {
    @Test(arguments: ["01", "-01", "00", "-", "1.", ".5", "+1", "1e", "1e+", "1E-", "0x10", "1.e3", "--1", "-.5"])
    func malformedNumbers(_ text: String) {
        #expect(rejection(text) != nil)
        #expect(rejection("[\(text)]") != nil)
    }

    @Test func leadingZeroIsNamed() {
        #expect(rejection("[01]")?.reason == "leading zero in number")
    }

    @Test func overlongNumber() {
        #expect(rejection(String(repeating: "1", count: 65))?.reason == "number too long")
        #expect(parsed(String(repeating: "1", count: 64)) != nil)
    }

    @Test(arguments: ["[1,]", "{\"a\":1,}", "[,1]", "[1,,2]", "{,}", "{\"a\" 1}", "{\"a\":}", "{1:2}", "{a:1}"])
    func trailingCommasAndBrokenStructure(_ text: String) {
        #expect(rejection(text) != nil)
    }

    @Test func trailingCommaOffset() {
        // The error points at the "]" that follows the comma.
        #expect(rejection("[1,]")?.offset == 3)
    }

    @Test(arguments: [
        #""\uD800""#, #""\uDC00""#, #""\uD800\u0041""#, #""\uD800\uD800""#, #""\uDFFF\uD800""#, #""\uD800x""#,
        #""\uD800\""#,
    ])
    func loneSurrogates(_ text: String) {
        #expect(rejection(text) != nil)
    }

    @Test func loneSurrogateIsNamed() {
        #expect(rejection(#"["\uDC00"]"#)?.reason == "lone surrogate")
    }

    @Test func controlCharactersInStrings() {
        for byte: UInt8 in [0x00, 0x01, 0x09, 0x0A, 0x0D, 0x1F] {
            #expect(rejection([0x22, 0x61, byte, 0x62, 0x22])?.reason == "control character in string")
        }
        // DEL is not a control character for JSON.
        #expect(JSON.parse([0x22, 0x7F, 0x22]) == .success(.string("\u{7F}")))
    }

    @Test func duplicateMembers() {
        #expect(rejection(#"{"a":1,"a":2}"#)?.reason.hasPrefix("duplicate member") == true)
        // Duplicates are found after unescaping, and in nested objects.
        #expect(rejection(#"{"a":1,"\u0061":2}"#) != nil)
        #expect(rejection(#"{"x":{"sub":"alice","sub":"mallory"}}"#) != nil)
        // The same name in sibling objects is fine.
        #expect(parsed(#"[{"a":1},{"a":2}]"#) != nil)
    }

    @Test func nestingBeyondTheLimit() {
        let tooDeep =
            String(repeating: "[", count: JSON.maxDepth + 1) + String(repeating: "]", count: JSON.maxDepth + 1)
        #expect(rejection(tooDeep)?.reason == "nested too deeply")
        let objects =
            String(repeating: #"{"a":"#, count: JSON.maxDepth) + "1" + String(repeating: "}", count: JSON.maxDepth)
        #expect(rejection(objects)?.reason == "nested too deeply")
        // Far deeper input fails the same way instead of exhausting the stack.
        #expect(rejection(String(repeating: "[", count: 100_000)) != nil)
    }

    @Test(
        arguments: [
            [0x22, 0xFF, 0x22],  // never valid in UTF-8
            [0x22, 0xC0, 0xAF, 0x22],  // overlong "/"
            [0x22, 0xED, 0xA0, 0x80, 0x22],  // an encoded surrogate
            [0x22, 0xE2, 0x82, 0x22],  // truncated sequence
            [0x22, 0x80, 0x22],  // lone continuation byte
            [0x22, 0xF4, 0x90, 0x80, 0x80, 0x22],  // beyond U+10FFFF
            [0x22, 0x5C, 0x6E, 0xFF, 0x22],  // after an escape
        ] as [[UInt8]])
    func invalidUTF8(_ bytes: [UInt8]) {
        #expect(rejection(bytes)?.reason == "invalid UTF-8 in string")
    }

    @Test(arguments: [#""\x""#, #""\u12""#, #""\u12G4""#, #""\U0041""#, #""\'""#, #""\"#, #""abc"#])
    func badEscapesAndUnterminatedStrings(_ text: String) {
        #expect(rejection(text) != nil)
    }

    @Test(arguments: [
        "", " ", "NaN", "Infinity", "-Infinity", "nul", "tru", "True", "nulls", "'a'", "[1] 2", "1 2", "{} {}",
        "/* c */ 1", "[1] // c", "\u{0C}1", "\u{A0}1", "[1]\u{0}",
    ])
    func notJSON(_ text: String) {
        #expect(rejection(text) != nil)
    }
}

@Suite struct JSONSerializerTests {
    @Test func compactMembersInOrder() {
        let value: JSONValue = ["b": 1, "a": [true, false, .null], "c": "d"]
        #expect(JSON.serialize(value) == #"{"b":1,"a":[true,false,null],"c":"d"}"#)
    }

    @Test func escapesPerRFC8259() {
        let text = "quote\" backslash\\ slash/ nl\n cr\r tab\t bs\u{08} ff\u{0C} nul\u{0} us\u{1F} é 😀"
        #expect(
            JSON.serialize(.string(text))
                == #""quote\" backslash\\ slash/ nl\n cr\r tab\t bs\u0008 ff\u000c nul\u0000 us\u001f é 😀""#)
    }

    /// The bytes form (DPoP proofs, audit lines) and the String form agree, for strings with and without escapes.
    @Test(arguments: [
        "", "plain", "https://api.test/orders?id=7", "é 😀", "a\"b", "back\\slash", "nl\n", "\u{1F}",
        "https://api.test/a-long-path/with\"a-quote-late", "\u{7F}del is not escaped",
    ])
    func bothFormsWriteTheSameString(_ text: String) throws {
        var string = "["
        JSON.writeString(text, to: &string)
        var bytes = Array("[".utf8)
        JSON.writeString(text, to: &bytes)
        #expect(String(decoding: bytes, as: UTF8.self) == string)
        #expect(parsed(string + "]") == .array([.string(text)]))
    }

    /// `ByteWriter.write(decimal:width:)` (audit lines, timestamps) writes what `String(_:)` does, zeros first up to
    /// the width, at every digit count and at both ends of the range.
    @Test(arguments: [
        0, 1, 9, 10, 99, 100, 1_000_000_007, 1_780_000_000, -1, -10, -2026, Int64.max, Int64.min,
        999_999_999_999_999_999, 1_000_000_000_000_000_000,
    ])
    func decimalsAreWrittenAsStringWritesThem(_ value: Int64) {
        for width in [1, 2, 4, 25] {
            let written = ByteWriter.bytes(atMost: 64) { $0.write(decimal: value, width: width) }
            let digits = String(value.magnitude)
            let expected = (value < 0 ? "-" : "") + String(repeating: "0", count: max(0, width - digits.count)) + digits
            #expect(String(decoding: written, as: UTF8.self) == expected, "width \(width)")
        }
        let unsigned = ByteWriter.bytes(atMost: 32) { $0.write(decimal: UInt64.max) }
        #expect(String(decoding: unsigned, as: UTF8.self) == "18446744073709551615")
    }

    @Test func numbersAreWrittenAsReceived() {
        #expect(JSON.serialize(.number("1E+2")) == "1E+2")
        #expect(JSON.serialize(.int(-9_223_372_036_854_775_808)) == "-9223372036854775808")
    }

    @Test(arguments: [
        #"{"a":[1,2.5,-0,1e3],"b":{"c":null,"d":true},"e":"x\"y\\z\u0001","f":[]}"#,
        #"["é","😀","\u001f","/"]"#,
        #"{"iss":"https://idp.example.com","aud":["a","b"],"exp":2000000000}"#,
    ])
    func roundTripIsExact(_ text: String) throws {
        let value = try #require(parsed(text))
        #expect(JSON.serialize(value) == text)
        #expect(parsed(JSON.serialize(value)) == value)
    }

    @Test func everyScalarRoundTrips() throws {
        var scalars = String.UnicodeScalarView()
        for value in Array(0..<0x300) + [0xD7FF, 0xE000, 0xFFFD, 0xFFFF, 0x10000, 0x1F600, 0x10FFFF] {
            scalars.append(Unicode.Scalar(UInt32(value))!)
        }
        let text = String(scalars)
        let serialized = JSON.serialize(.string(text))
        #expect(parsed(serialized) == .string(text))
    }
}

@Suite struct JSONValueAccessorTests {
    @Test func integers() {
        #expect(JSONValue.number("42").int == 42)
        #expect(JSONValue.number("-7").int == -7)
        #expect(JSONValue.number("1.0").int == 1)
        #expect(JSONValue.number("1e3").int == 1000)
        #expect(JSONValue.number("1.5").int == nil)
        #expect(JSONValue.number("9223372036854775807").int == Int64.max)
        #expect(JSONValue.number("12345678901234567890").int == nil)
        #expect(JSONValue.number("1e300").int == nil)
        #expect(JSONValue.string("42").int == nil)
        #expect(JSONValue.number("2.5").double == 2.5)
    }

    @Test func typedAccessorsAreNilForOtherKinds() {
        let value: JSONValue = "text"
        #expect(value.string == "text")
        #expect(value.bool == nil)
        #expect(value.array == nil)
        #expect(value.object == nil)
        #expect(value["key"] == nil)
        #expect(JSONValue.bool(true).string == nil)
    }

    @Test func stringListAcceptsBothAudienceShapes() {
        #expect(JSONValue.string("a").stringList == ["a"])
        #expect(JSONValue.array(["a", "b"]).stringList == ["a", "b"])
        #expect(JSONValue.array([]).stringList == [])
        #expect(JSONValue.array(["a", 1]).stringList == nil)
        #expect(JSONValue.number("1").stringList == nil)
    }

    @Test func objectSubscriptReplacesAndRemoves() {
        var object = JSONObject([("a", 1), ("b", 2)])
        object["a"] = 3
        object["c"] = 4
        #expect(object.keys == ["a", "b", "c"])
        #expect(object["a"] == 3)
        object["b"] = nil
        #expect(object.keys == ["a", "c"])
        object["missing"] = nil
        #expect(object.keys == ["a", "c"])
    }

    @Test func objectEqualityIsOrderSensitive() {
        #expect(JSONObject([("a", 1), ("b", 2)]) == JSONObject([("a", 1), ("b", 2)]))
        #expect(JSONObject([("a", 1), ("b", 2)]) != JSONObject([("b", 2), ("a", 1)]))
        #expect(JSONObject([("a", 1)]) != JSONObject([("a", 2)]))
    }
}
