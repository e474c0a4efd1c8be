/// One authentication challenge from `WWW-Authenticate` (RFC 9110 §11.6.1).
public struct Challenge: Sendable, Equatable {
    /// The scheme, lower-cased (schemes are case-insensitive): "bearer", "dpop", "basic".
    public let scheme: String
    /// token68, when the challenge carries one instead of parameters.
    public let token68: String?
    /// Parameters with lower-cased names (names are case-insensitive), values unquoted and unescaped.
    public let parameters: [(name: String, value: String)]

    public init(scheme: String, token68: String? = nil, parameters: [(name: String, value: String)] = []) {
        self.scheme = scheme.lowercased()
        self.token68 = token68
        self.parameters = parameters.map { ($0.name.lowercased(), $0.value) }
    }

    /// The first value of a parameter.
    public subscript(name: String) -> String? {
        let lowered = name.lowercased()
        return parameters.first { $0.name == lowered }?.value
    }

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.scheme == rhs.scheme && lhs.token68 == rhs.token68
            && lhs.parameters.map(\.name) == rhs.parameters.map(\.name)
            && lhs.parameters.map(\.value) == rhs.parameters.map(\.value)
    }
}

/// Parses `WWW-Authenticate` field values into challenges.
///
/// ```
/// challenge   = auth-scheme [ 1*SP ( token68 / #auth-param ) ]
/// auth-param  = token BWS "=" BWS ( token / quoted-string )
/// ```
/// Several challenges may share one field line and several lines may be sent; the list syntax makes a comma
/// ambiguous (another parameter, or a new challenge), which is resolved by looking ahead for "=". Garbage
/// ends the current field line's parsing without crashing; what was understood so far is kept.
public enum ChallengeParser {
    /// Parses every field value, in order.
    public static func parse(_ fieldValues: [String]) -> [Challenge] {
        fieldValues.flatMap { parse($0) }
    }

    public static func parse(_ fieldValue: String) -> [Challenge] {
        var scanner = Scanner(Array(fieldValue.utf8))
        var challenges: [Challenge] = []
        while true {
            scanner.skipListSeparators()
            if scanner.atEnd { break }
            guard let scheme = scanner.token() else { break }
            // After the scheme: end, a comma (next challenge), or spaces then token68 / parameters.
            let hadSpace = scanner.skipSpaces()
            if scanner.atEnd || scanner.peek == UInt8(ascii: ",") || !hadSpace {
                challenges.append(Challenge(scheme: scheme))
                if !hadSpace && !scanner.atEnd && scanner.peek != UInt8(ascii: ",") { break }
                continue
            }
            if let token68 = scanner.token68() {
                challenges.append(Challenge(scheme: scheme, token68: token68))
                continue
            }
            var parameters: [(name: String, value: String)] = []
            var malformed = false
            while true {
                let mark = scanner.index
                guard let name = scanner.token() else {
                    malformed = !scanner.atEnd && scanner.peek != UInt8(ascii: ",")
                    break
                }
                scanner.skipSpaces()
                guard scanner.consume(UInt8(ascii: "=")) else {
                    // A token without "=": the next challenge's scheme.
                    scanner.index = mark
                    break
                }
                scanner.skipSpaces()
                let value: String
                if scanner.peek == UInt8(ascii: "\"") {
                    guard let quoted = scanner.quotedString() else {
                        malformed = true
                        break
                    }
                    value = quoted
                } else if let token = scanner.token() {
                    value = token
                } else {
                    malformed = true
                    break
                }
                parameters.append((name, value))
                // Between parameters: OWS "," OWS; stop at the next challenge or the end.
                let beforeSeparator = scanner.index
                scanner.skipSpaces()
                if scanner.atEnd { break }
                guard scanner.consume(UInt8(ascii: ",")) else {
                    scanner.index = beforeSeparator
                    malformed = true
                    break
                }
                scanner.skipListSeparators()
                if scanner.atEnd { break }
            }
            challenges.append(Challenge(scheme: scheme, parameters: parameters))
            if malformed { break }
        }
        return challenges
    }

    private struct Scanner {
        let bytes: [UInt8]
        var index = 0

        init(_ bytes: [UInt8]) { self.bytes = bytes }

        var atEnd: Bool { index >= bytes.count }
        var peek: UInt8? { atEnd ? nil : bytes[index] }

        mutating func consume(_ byte: UInt8) -> Bool {
            guard peek == byte else { return false }
            index += 1
            return true
        }

        @discardableResult
        mutating func skipSpaces() -> Bool {
            let start = index
            while let byte = peek, byte == 0x20 || byte == 0x09 { index += 1 }
            return index > start
        }

        mutating func skipListSeparators() {
            while let byte = peek, byte == 0x20 || byte == 0x09 || byte == UInt8(ascii: ",") { index += 1 }
        }

        mutating func token() -> String? {
            let start = index
            while let byte = peek, ASCII.isTchar(byte) { index += 1 }
            guard index > start else { return nil }
            return String(decoding: bytes[start..<index], as: UTF8.self)
        }

        /// token68 = 1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"=", only when followed by the
        /// end or a comma (otherwise it is the name of a parameter).
        mutating func token68() -> String? {
            let start = index
            var cursor = index
            func isToken68(_ byte: UInt8) -> Bool {
                ASCII.isDigit(byte) || (byte | 0x20 >= 0x61 && byte | 0x20 <= 0x7A) || byte == UInt8(ascii: "-")
                    || byte == UInt8(ascii: ".") || byte == UInt8(ascii: "_") || byte == UInt8(ascii: "~")
                    || byte == UInt8(ascii: "+") || byte == UInt8(ascii: "/")
            }
            while cursor < bytes.count && isToken68(bytes[cursor]) { cursor += 1 }
            guard cursor > start else { return nil }
            while cursor < bytes.count && bytes[cursor] == UInt8(ascii: "=") { cursor += 1 }
            var after = cursor
            while after < bytes.count && (bytes[after] == 0x20 || bytes[after] == 0x09) { after += 1 }
            guard after == bytes.count || bytes[after] == UInt8(ascii: ",") else { return nil }
            // "name=" followed by the end is a parameter with an empty token value in broken senders; a real
            // token68 either has no "=" or ends with padding. Both read the same; prefer token68.
            index = cursor
            return String(decoding: bytes[start..<cursor], as: UTF8.self)
        }

        /// quoted-string = DQUOTE *( qdtext / quoted-pair ) DQUOTE   (RFC 9110 §5.6.4)
        mutating func quotedString() -> String? {
            guard consume(UInt8(ascii: "\"")) else { return nil }
            var value: [UInt8] = []
            while let byte = peek {
                index += 1
                switch byte {
                case UInt8(ascii: "\""):
                    return String(decoding: value, as: UTF8.self)
                case UInt8(ascii: "\\"):
                    guard let escaped = peek, escaped == 0x09 || escaped >= 0x20, escaped != 0x7F else { return nil }
                    value.append(escaped)
                    index += 1
                case 0x09, 0x20...0x7E, 0x80...0xFF:
                    value.append(byte)
                default:
                    return nil
                }
            }
            return nil
        }
    }
}
