/// Byte classes from RFC 9110 §5.6 and RFC 3986, as lookup tables so that parsing a head costs one load
/// per byte.
public enum ASCII {
    static let cr: UInt8 = 0x0D
    static let lf: UInt8 = 0x0A
    static let space: UInt8 = 0x20
    static let tab: UInt8 = 0x09
    static let colon: UInt8 = 0x3A

    /// tchar = "!" / "#" / "$" / "%" / "&" / "'" / "*" / "+" / "-" / "." / "^" / "_" / "`" / "|" / "~"
    ///       / DIGIT / ALPHA   (RFC 9110 §5.6.2)
    static let tchar: [Bool] = {
        var table = [Bool](repeating: false, count: 256)
        for byte in UInt8(ascii: "0")...UInt8(ascii: "9") { table[Int(byte)] = true }
        for byte in UInt8(ascii: "a")...UInt8(ascii: "z") { table[Int(byte)] = true }
        for byte in UInt8(ascii: "A")...UInt8(ascii: "Z") { table[Int(byte)] = true }
        for char in "!#$%&'*+-.^_`|~".utf8 { table[Int(char)] = true }
        return table
    }()

    /// field-vchar = VCHAR / obs-text, plus SP and HTAB inside a value (RFC 9110 §5.5).
    static let fieldValue: [Bool] = {
        var table = [Bool](repeating: false, count: 256)
        for byte in 0x21...0x7E { table[byte] = true }
        for byte in 0x80...0xFF { table[byte] = true }
        table[0x20] = true
        table[0x09] = true
        return table
    }()

    /// Bytes allowed in a request-target: visible ASCII and obs-text; never whitespace or controls.
    static let targetByte: [Bool] = {
        var table = [Bool](repeating: false, count: 256)
        for byte in 0x21...0x7E { table[byte] = true }
        for byte in 0x80...0xFF { table[byte] = true }
        return table
    }()

    /// reg-name = *( unreserved / pct-encoded / sub-delims )   (RFC 3986 §3.2.2)
    static let regName: [Bool] = {
        var table = [Bool](repeating: false, count: 256)
        for byte in UInt8(ascii: "0")...UInt8(ascii: "9") { table[Int(byte)] = true }
        for byte in UInt8(ascii: "a")...UInt8(ascii: "z") { table[Int(byte)] = true }
        for byte in UInt8(ascii: "A")...UInt8(ascii: "Z") { table[Int(byte)] = true }
        for char in "-._~%!$&'()*+,;=".utf8 { table[Int(char)] = true }
        return table
    }()

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

    /// Case-insensitive comparison of a byte slice with a lower-case ASCII literal.
    @inline(__always)
    static func equalsLowercase(_ bytes: ArraySlice<UInt8>, _ lowercase: StaticString) -> Bool {
        guard bytes.count == lowercase.utf8CodeUnitCount else { return false }
        return lowercase.withUTF8Buffer { literal in
            var index = bytes.startIndex
            for expected in literal {
                if lower(bytes[index]) != expected { return false }
                index += 1
            }
            return true
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
