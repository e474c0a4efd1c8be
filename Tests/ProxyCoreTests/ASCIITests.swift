import Testing

@testable import ProxyCore

/// The byte classes are constants written as bit sets: each is checked here, for all 256 bytes, against
/// the grammar's own wording.
@Suite struct ASCIITests {
    static let alphaDigit = Set(Array("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ".utf8))

    @Test func tokenCharactersAreRFC9110s() {
        let tchar = Self.alphaDigit.union("!#$%&'*+-.^_`|~".utf8)
        for byte in UInt8.min...UInt8.max {
            #expect(ASCII.isTchar(byte) == tchar.contains(byte), "byte \(byte)")
        }
    }

    @Test func regNameCharactersAreRFC3986s() {
        let regName = Self.alphaDigit.union("-._~".utf8).union("%".utf8).union("!$&'()*+,;=".utf8)
        for byte in UInt8.min...UInt8.max {
            #expect(ASCII.isRegName(byte) == regName.contains(byte), "byte \(byte)")
        }
    }

    @Test func fieldValueBytesAreVisibleObsTextSpaceAndTab() {
        for byte in UInt8.min...UInt8.max {
            let expected = (0x21...0x7E).contains(byte) || byte >= 0x80 || byte == 0x20 || byte == 0x09
            #expect(ASCII.isFieldValue(byte) == expected, "byte \(byte)")
        }
    }

    @Test func targetBytesAreVisibleAndObsText() {
        for byte in UInt8.min...UInt8.max {
            let expected = (0x21...0x7E).contains(byte) || byte >= 0x80
            #expect(ASCII.isTargetByte(byte) == expected, "byte \(byte)")
        }
    }

    @Test func linesAreSplitAfterEachLineFeed() {
        var lines: [[UInt8]] = []
        Array("HTTP/1.1 200 OK\r\nA: b\nC: d\r\n\r\ntail".utf8).withUnsafeBytes { buffer in
            ASCII.forEachLine(buffer) { lines.append(Array($0)) }
        }
        #expect(
            lines.map { String(decoding: $0, as: UTF8.self) } == [
                "HTTP/1.1 200 OK\r\n", "A: b\n", "C: d\r\n", "\r\n", "tail",
            ])
        var none = 0
        [UInt8]().withUnsafeBytes { ASCII.forEachLine($0) { _ in none += 1 } }
        #expect(none == 0)
    }

    @Test func namesCompareIgnoringASCIICaseOnly() {
        #expect(ASCII.equalsLowercase("Content-Type".utf8, "content-type"))
        #expect(ASCII.equalsLowercase("ACCEPT".utf8, "accept"))
        #expect(!ASCII.equalsLowercase("Accept-Encoding".utf8, "accept"))
        #expect(!ASCII.equalsLowercase("Accep".utf8, "accept"))
        // Only ASCII letters fold: the Kelvin sign is not a "k".
        #expect(!ASCII.equalsLowercase("\u{212A}eep".utf8, "keep"))
    }
}
