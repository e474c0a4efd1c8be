/// A JSON value (RFC 8259). Objects keep their members in order; duplicate names are a parse error,
/// because two parsers that pick different duplicates disagree about a token's claims (RFC 7519 §4).
public enum JSONValue: Sendable, Equatable {
    case null
    case bool(Bool)
    /// The number's text as received, so that integers of any size survive; see `int` and `double`.
    case number(String)
    case string(String)
    case array([JSONValue])
    case object(JSONObject)

    public subscript(key: String) -> JSONValue? {
        if case .object(let object) = self { return object[key] }
        return nil
    }

    public var string: String? {
        if case .string(let value) = self { return value }
        return nil
    }

    public var bool: Bool? {
        if case .bool(let value) = self { return value }
        return nil
    }

    /// An integer value; nil for fractions, exponents out of range, or non-numbers.
    public var int: Int64? {
        guard case .number(let text) = self else { return nil }
        if let value = Int64(text) { return value }
        // 1.0 or 1e3 are integers too when they are whole.
        if let double = Double(text), double.rounded() == double, abs(double) < 9.2e18 { return Int64(double) }
        return nil
    }

    public var double: Double? {
        if case .number(let text) = self { return Double(text) }
        return nil
    }

    public var array: [JSONValue]? {
        if case .array(let value) = self { return value }
        return nil
    }

    public var object: JSONObject? {
        if case .object(let value) = self { return value }
        return nil
    }

    /// An array of strings, or a single string as a one-element array (the `aud` claim's two shapes).
    public var stringList: [String]? {
        switch self {
        case .string(let value): return [value]
        case .array(let values):
            var strings: [String] = []
            for value in values {
                guard let string = value.string else { return nil }
                strings.append(string)
            }
            return strings
        default: return nil
        }
    }
}

/// A JSON object with members in their original order.
public struct JSONObject: Sendable, Equatable {
    public private(set) var members: [(key: String, value: JSONValue)] = []

    public init() {}

    public init(_ members: [(String, JSONValue)]) {
        for (key, value) in members { self[key] = value }
    }

    public subscript(key: String) -> JSONValue? {
        get { members.first { $0.key == key }?.value }
        set {
            if let index = members.firstIndex(where: { $0.key == key }) {
                if let newValue { members[index].value = newValue } else { members.remove(at: index) }
            } else if let newValue {
                members.append((key, newValue))
            }
        }
    }

    public var keys: [String] { members.map(\.key) }

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.members.count == rhs.members.count
            && zip(lhs.members, rhs.members).allSatisfy { $0.key == $1.key && $0.value == $1.value }
    }
}

public struct JSONError: Error, Sendable, Equatable, CustomStringConvertible {
    public let offset: Int
    public let reason: String
    public var description: String { "invalid JSON at byte \(offset): \(reason)" }
}

/// A strict RFC 8259 parser: no comments, no trailing commas, no NaN, no leading zeros, no lone surrogates,
/// valid UTF-8 only, nesting limited.
public enum JSON {
    public static let maxDepth = 64

    public static func parse(_ text: String) -> Result<JSONValue, JSONError> {
        parse(Array(text.utf8))
    }

    public static func parse(_ bytes: [UInt8]) -> Result<JSONValue, JSONError> {
        var parser = Parser(bytes: bytes)
        do {
            parser.skipWhitespace()
            let value = try parser.value(depth: 0)
            parser.skipWhitespace()
            guard parser.index == bytes.count else { throw parser.error("unexpected data after the value") }
            return .success(value)
        } catch let error as JSONError {
            return .failure(error)
        } catch {
            return .failure(JSONError(offset: 0, reason: "\(error)"))
        }
    }

    /// Serialises compactly, members in order. Strings are escaped per RFC 8259 §7; "/" is not escaped.
    public static func serialize(_ value: JSONValue) -> String {
        var out = ""
        write(value, to: &out)
        return out
    }

    static func write(_ value: JSONValue, to out: inout String) {
        switch value {
        case .null: out += "null"
        case .bool(let flag): out += flag ? "true" : "false"
        case .number(let text): out += text
        case .string(let string): writeString(string, to: &out)
        case .array(let values):
            out += "["
            for (index, element) in values.enumerated() {
                if index > 0 { out += "," }
                write(element, to: &out)
            }
            out += "]"
        case .object(let object):
            out += "{"
            for (index, member) in object.members.enumerated() {
                if index > 0 { out += "," }
                writeString(member.key, to: &out)
                out += ":"
                write(member.value, to: &out)
            }
            out += "}"
        }
    }

    public static func writeString(_ string: String, to out: inout String) {
        if !string.utf8.contains(where: ByteWriter.needsJSONEscape) {
            out += "\""
            out += string
            out += "\""
            return
        }
        var bytes: [UInt8] = []
        writeString(string, to: &bytes)
        out += String(decoding: bytes, as: UTF8.self)
    }

    /// `string` as a JSON string (RFC 8259 §7) in UTF-8 (`ByteWriter.jsonString`).
    public static func writeString(_ string: String, to out: inout [UInt8]) {
        // Most strings need no escape (a DPoP proof's members, three per request): their bytes appended at once,
        // without the bounded scratch array the escaper writes into.
        let plain = string.utf8.withContiguousStorageIfAvailable { utf8 in
            guard !utf8.contains(where: ByteWriter.needsJSONEscape) else { return false }
            out.append(UInt8(ascii: "\""))
            out.append(contentsOf: utf8)
            out.append(UInt8(ascii: "\""))
            return true
        }
        if plain == true { return }
        out.append(contentsOf: ByteWriter.bytes(atMost: ByteWriter.jsonStringBound(string)) { $0.jsonString(string) })
    }

    private struct Parser {
        let bytes: [UInt8]
        var index = 0

        func error(_ reason: String) -> JSONError { JSONError(offset: index, reason: reason) }

        mutating func skipWhitespace() {
            while index < bytes.count {
                switch bytes[index] {
                case 0x20, 0x09, 0x0A, 0x0D: index += 1
                default: return
                }
            }
        }

        mutating func value(depth: Int) throws -> JSONValue {
            guard depth < JSON.maxDepth else { throw error("nested too deeply") }
            guard index < bytes.count else { throw error("unexpected end") }
            switch bytes[index] {
            case UInt8(ascii: "{"): return .object(try object(depth: depth))
            case UInt8(ascii: "["): return .array(try array(depth: depth))
            case UInt8(ascii: "\""): return .string(try string())
            case UInt8(ascii: "t"): try literal("true"); return .bool(true)
            case UInt8(ascii: "f"): try literal("false"); return .bool(false)
            case UInt8(ascii: "n"): try literal("null"); return .null
            case UInt8(ascii: "-"), UInt8(ascii: "0")...UInt8(ascii: "9"): return .number(try number())
            default: throw error("unexpected character")
            }
        }

        mutating func literal(_ word: StaticString) throws {
            let count = word.utf8CodeUnitCount
            guard index + count <= bytes.count else { throw error("unexpected end") }
            let matches = word.withUTF8Buffer { Array(bytes[index..<index + count]) == Array($0) }
            guard matches else { throw error("invalid literal") }
            index += count
        }

        mutating func object(depth: Int) throws -> JSONObject {
            index += 1
            var object = JSONObject()
            var seen = Set<String>()
            skipWhitespace()
            if index < bytes.count && bytes[index] == UInt8(ascii: "}") {
                index += 1
                return object
            }
            while true {
                skipWhitespace()
                guard index < bytes.count, bytes[index] == UInt8(ascii: "\"") else {
                    throw error("expected a member name")
                }
                let key = try string()
                guard seen.insert(key).inserted else {
                    throw error("duplicate member \"\(ASCII.printable(key.utf8))\"")
                }
                skipWhitespace()
                guard index < bytes.count, bytes[index] == UInt8(ascii: ":") else { throw error("expected \":\"") }
                index += 1
                skipWhitespace()
                let member = try value(depth: depth + 1)
                object.appendUnchecked(key, member)
                skipWhitespace()
                guard index < bytes.count else { throw error("unexpected end") }
                if bytes[index] == UInt8(ascii: ",") {
                    index += 1
                    continue
                }
                guard bytes[index] == UInt8(ascii: "}") else { throw error("expected \",\" or \"}\"") }
                index += 1
                return object
            }
        }

        mutating func array(depth: Int) throws -> [JSONValue] {
            index += 1
            var values: [JSONValue] = []
            skipWhitespace()
            if index < bytes.count && bytes[index] == UInt8(ascii: "]") {
                index += 1
                return values
            }
            while true {
                skipWhitespace()
                values.append(try value(depth: depth + 1))
                skipWhitespace()
                guard index < bytes.count else { throw error("unexpected end") }
                if bytes[index] == UInt8(ascii: ",") {
                    index += 1
                    continue
                }
                guard bytes[index] == UInt8(ascii: "]") else { throw error("expected \",\" or \"]\"") }
                index += 1
                return values
            }
        }

        // number = [ "-" ] int [ frac ] [ exp ]   (RFC 8259 §6)
        mutating func number() throws -> String {
            let start = index
            if bytes[index] == UInt8(ascii: "-") { index += 1 }
            guard index < bytes.count, ASCII.isDigit(bytes[index]) else { throw error("invalid number") }
            if bytes[index] == UInt8(ascii: "0") {
                index += 1
                if index < bytes.count && ASCII.isDigit(bytes[index]) { throw error("leading zero in number") }
            } else {
                while index < bytes.count && ASCII.isDigit(bytes[index]) { index += 1 }
            }
            if index < bytes.count && bytes[index] == UInt8(ascii: ".") {
                index += 1
                guard index < bytes.count, ASCII.isDigit(bytes[index]) else { throw error("invalid fraction") }
                while index < bytes.count && ASCII.isDigit(bytes[index]) { index += 1 }
            }
            if index < bytes.count && (bytes[index] == UInt8(ascii: "e") || bytes[index] == UInt8(ascii: "E")) {
                index += 1
                if index < bytes.count && (bytes[index] == UInt8(ascii: "+") || bytes[index] == UInt8(ascii: "-")) {
                    index += 1
                }
                guard index < bytes.count, ASCII.isDigit(bytes[index]) else { throw error("invalid exponent") }
                while index < bytes.count && ASCII.isDigit(bytes[index]) { index += 1 }
            }
            guard index - start <= 64 else { throw error("number too long") }
            return String(decoding: bytes[start..<index], as: UTF8.self)
        }

        mutating func string() throws -> String {
            index += 1
            var scalars = String.UnicodeScalarView()
            var runStart = index
            func flushRun(_ end: Int) throws {
                guard runStart < end else { return }
                guard let text = String(validating: bytes[runStart..<end], as: UTF8.self) else {
                    throw error("invalid UTF-8 in string")
                }
                scalars.append(contentsOf: text.unicodeScalars)
            }
            while true {
                guard index < bytes.count else { throw error("unterminated string") }
                let byte = bytes[index]
                if byte == UInt8(ascii: "\"") {
                    try flushRun(index)
                    index += 1
                    return String(scalars)
                }
                if byte < 0x20 { throw error("control character in string") }
                if byte != UInt8(ascii: "\\") {
                    index += 1
                    continue
                }
                try flushRun(index)
                index += 1
                guard index < bytes.count else { throw error("unterminated escape") }
                let escape = bytes[index]
                index += 1
                switch escape {
                case UInt8(ascii: "\""): scalars.append("\"")
                case UInt8(ascii: "\\"): scalars.append("\\")
                case UInt8(ascii: "/"): scalars.append("/")
                case UInt8(ascii: "b"): scalars.append("\u{08}")
                case UInt8(ascii: "f"): scalars.append("\u{0C}")
                case UInt8(ascii: "n"): scalars.append("\n")
                case UInt8(ascii: "r"): scalars.append("\r")
                case UInt8(ascii: "t"): scalars.append("\t")
                case UInt8(ascii: "u"):
                    let unit = try hex4()
                    if (0xD800..<0xDC00).contains(unit) {
                        guard index + 1 < bytes.count, bytes[index] == UInt8(ascii: "\\"),
                            bytes[index + 1] == UInt8(ascii: "u")
                        else { throw error("lone surrogate") }
                        index += 2
                        let low = try hex4()
                        guard (0xDC00..<0xE000).contains(low) else { throw error("lone surrogate") }
                        let value = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                        scalars.append(Unicode.Scalar(value)!)
                    } else if (0xDC00..<0xE000).contains(unit) {
                        throw error("lone surrogate")
                    } else {
                        scalars.append(Unicode.Scalar(unit)!)
                    }
                default:
                    throw error("invalid escape")
                }
                runStart = index
            }
        }

        mutating func hex4() throws -> UInt32 {
            guard index + 4 <= bytes.count else { throw error("short \\u escape") }
            var value: UInt32 = 0
            for _ in 0..<4 {
                guard let digit = ASCII.hexValue(bytes[index]) else { throw error("invalid \\u escape") }
                value = value << 4 | UInt32(digit)
                index += 1
            }
            return value
        }
    }
}

extension JSONObject {
    /// Appends without the duplicate search (the parser checks duplicates with a set).
    mutating func appendUnchecked(_ key: String, _ value: JSONValue) {
        members.append((key, value))
    }
}

extension JSONValue: ExpressibleByStringLiteral, ExpressibleByBooleanLiteral, ExpressibleByIntegerLiteral,
    ExpressibleByArrayLiteral, ExpressibleByDictionaryLiteral
{
    public init(stringLiteral value: String) { self = .string(value) }
    public init(booleanLiteral value: Bool) { self = .bool(value) }
    public init(integerLiteral value: Int64) { self = .number(String(value)) }
    public init(arrayLiteral elements: JSONValue...) { self = .array(elements) }
    public init(dictionaryLiteral elements: (String, JSONValue)...) { self = .object(JSONObject(elements)) }

    public static func int(_ value: Int64) -> JSONValue { .number(String(value)) }
}

extension ByteWriter {
    /// The most bytes `jsonString(string)` writes: its quotes, and every byte escaped at the longest (`\u00XX`).
    static func jsonStringBound(_ string: String) -> Int { 2 + 6 * string.utf8.count }

    /// `string` as a JSON string (RFC 8259 §7) in UTF-8: the quotation mark, the reverse solidus and the control
    /// characters escaped, every other byte (UTF-8 sequences included) as it is. At most `jsonStringBound` bytes.
    mutating func jsonString(_ string: String) {
        var string = string
        string.withUTF8 { jsonString($0) }
    }

    /// `jsonString` of a string's UTF-8 bytes (a part of one: a target's path).
    mutating func jsonString(_ utf8: UnsafeBufferPointer<UInt8>) {
        write(UInt8(ascii: "\""))
        // Most strings need no escape: their bytes at once.
        guard utf8.contains(where: Self.needsJSONEscape) else {
            write(utf8)
            return write(UInt8(ascii: "\""))
        }
        for value in utf8 {
            switch value {
            case UInt8(ascii: "\""), UInt8(ascii: "\\"):
                write(UInt8(ascii: "\\"))
                write(value)
            case UInt8(ascii: "\n"): write(#"\n"#)
            case UInt8(ascii: "\r"): write(#"\r"#)
            case UInt8(ascii: "\t"): write(#"\t"#)
            case 0..<0x20:
                write(#"\u00"#)
                write(Self.hexDigits[Int(value >> 4)])
                write(Self.hexDigits[Int(value & 0xF)])
            default: write(value)
            }
        }
        write(UInt8(ascii: "\""))
    }

    /// Whether a UTF-8 byte is escaped in a JSON string: the quotation mark, the reverse solidus, a control.
    static func needsJSONEscape(_ byte: UInt8) -> Bool {
        byte < 0x20 || byte == UInt8(ascii: "\"") || byte == UInt8(ascii: "\\")
    }

    private static let hexDigits: [UInt8] = Array("0123456789abcdef".utf8)
}
