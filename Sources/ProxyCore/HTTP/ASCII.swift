/// Byte classes from RFC 9110 §5.6 and RFC 3986, as predicates on constants so that parsing a head costs a
/// few instructions per byte.
public enum ASCII {
    static let cr: UInt8 = 0x0D
    static let lf: UInt8 = 0x0A
    static let space: UInt8 = 0x20
    static let tab: UInt8 = 0x09
    static let colon: UInt8 = 0x3A

    /// tchar = "!" / "#" / "$" / "%" / "&" / "'" / "*" / "+" / "-" / "." / "^" / "_" / "`" / "|" / "~"
    ///       / DIGIT / ALPHA   (RFC 9110 §5.6.2), as a bit set: bytes 0-63 and 64-127.
    private static let tcharBits: (UInt64, UInt64) = (0x03FF_6CFA_0000_0000, 0x57FF_FFFF_C7FF_FFFE)
    /// reg-name = *( unreserved / pct-encoded / sub-delims )   (RFC 3986 §3.2.2), as a bit set.
    private static let regNameBits: (UInt64, UInt64) = (0x2BFF_7FF2_0000_0000, 0x47FF_FFFE_87FF_FFFE)

    @inline(__always)
    private static func member(_ byte: UInt8, _ bits: (UInt64, UInt64)) -> Bool {
        let word = byte < 64 ? bits.0 : byte < 128 ? bits.1 : 0
        return (word >> UInt64(byte & 63)) & 1 == 1
    }

    /// A token character (RFC 9110 §5.6.2). Constant bit sets, not tables: a table behind a lazily
    /// initialised global costs an initialisation check per byte on the hot path.
    @inline(__always)
    static func isTchar(_ byte: UInt8) -> Bool { member(byte, tcharBits) }

    /// field-vchar = VCHAR / obs-text, plus SP and HTAB inside a value (RFC 9110 §5.5).
    @inline(__always)
    static func isFieldValue(_ byte: UInt8) -> Bool { (byte >= 0x20 && byte != 0x7F) || byte == 0x09 }

    /// Whether any of the eight bytes in `word` is below 0x20 (HTAB included) or DEL (0x7F): the bytes
    /// `isFieldValue` looks at one by one. Bytes of 0x80 and above (obs-text) never count. The "has a byte less
    /// than n" and "has a zero byte" word tests (exact for the word as a whole, whatever the byte order).
    @inline(__always)
    static func hasControlOrDEL(_ word: UInt64) -> Bool {
        let ones: UInt64 = 0x0101_0101_0101_0101
        let highs: UInt64 = 0x8080_8080_8080_8080
        let below20 = (word &- ones &* 0x20) & ~word & highs
        let xorDEL = word ^ (ones &* 0x7F)
        let isDEL = (xorDEL &- ones) & ~xorDEL & highs
        return below20 | isDEL != 0
    }

    /// Bytes allowed in a request-target: visible ASCII and obs-text; never whitespace or controls.
    @inline(__always)
    static func isTargetByte(_ byte: UInt8) -> Bool { byte > 0x20 && byte != 0x7F }

    /// reg-name = *( unreserved / pct-encoded / sub-delims )   (RFC 3986 §3.2.2)
    @inline(__always)
    static func isRegName(_ byte: UInt8) -> Bool { member(byte, regNameBits) }

    @inline(__always)
    static func lower(_ byte: UInt8) -> UInt8 {
        byte >= 0x41 && byte <= 0x5A ? byte | 0x20 : byte
    }

    @inline(__always)
    static func isDigit(_ byte: UInt8) -> Bool { byte >= 0x30 && byte <= 0x39 }

    @inline(__always)
    static func hexValue(_ byte: UInt8) -> UInt8? {
        switch byte {
        case 0x30...0x39: return byte - 0x30
        case 0x41...0x46: return byte - 0x41 + 10
        case 0x61...0x66: return byte - 0x61 + 10
        default: return nil
        }
    }

    /// Case-insensitive comparison of bytes (a field name in a head, or a `String`'s `utf8`) with a lower-case
    /// ASCII literal, without a lowercased copy.
    @inline(__always)
    public static func equalsLowercase(_ bytes: some Collection<UInt8>, _ lowercase: StaticString) -> Bool {
        guard bytes.count == lowercase.utf8CodeUnitCount else { return false }
        return lowercase.withUTF8Buffer { literal in
            var index = bytes.startIndex
            for expected in literal {
                if lower(bytes[index]) != expected { return false }
                bytes.formIndex(after: &index)
            }
            return true
        }
    }

    /// Whether `bytes` equal `lowercase` (lower-case bytes), ASCII letters compared case-insensitively.
    public static func equalsLowercase(_ bytes: some Collection<UInt8>, bytes lowercase: some Collection<UInt8>) -> Bool
    {
        guard bytes.count == lowercase.count else { return false }
        return zip(bytes, lowercase).allSatisfy { lower($0) == $1 }
    }

    /// Calls `body` with each line of `buffer`, its LF (and any CR) included; a last line without LF too.
    /// libcurl's header callback gives one line per call; the drivers hand a head's lines over in one block.
    public static func forEachLine(_ buffer: UnsafeRawBufferPointer, _ body: (UnsafeRawBufferPointer) -> Void) {
        var start = 0
        while start < buffer.count {
            var end = start
            while end < buffer.count && buffer[end] != lf { end += 1 }
            if end < buffer.count { end += 1 }
            body(UnsafeRawBufferPointer(rebasing: buffer[start..<end]))
            start = end
        }
    }

    /// Text from outside (the wire, a provider, a file) for a message or a log line: printable ASCII kept,
    /// anything else shown as "?", at most `limit` characters and "..." when cut. The one clipping rule.
    public static func clip(_ text: some StringProtocol, limit: Int = 80) -> String {
        var out = ""
        var count = 0
        for scalar in text.unicodeScalars {
            if count == limit { return out + "..." }
            out.unicodeScalars.append(scalar.value >= 0x20 && scalar.value < 0x7F ? scalar : "?")
            count += 1
        }
        return out
    }

    /// Bytes for an error message about exactly those bytes (a field name, a JSON member): printable ASCII
    /// kept, others and the quote characters escaped as \xNN, at most `limit` bytes.
    static func printable(_ bytes: some Sequence<UInt8>, limit: Int = 40) -> String {
        var out = ""
        for (count, byte) in bytes.enumerated() {
            if count == limit {
                out += "..."
                break
            }
            if byte >= 0x20 && byte < 0x7F && byte != UInt8(ascii: "\"") && byte != UInt8(ascii: "\\") {
                out.unicodeScalars.append(Unicode.Scalar(byte))
            } else {
                out += "\\x" + String(byte, radix: 16, uppercase: true).leftPadding(to: 2)
            }
        }
        return out
    }
}
