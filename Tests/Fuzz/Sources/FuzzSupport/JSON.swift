import ProxyCore

/// Nesting far past `JSON.maxDepth`, parsed once per process: an error, not a stack overflow.
private let deepNestingChecked: Bool = {
    for opener in ["[", "{\"a\":", "[{\"a\":"] {
        let deep = String(repeating: opener, count: 100_000)
        guard case .failure = JSON.parse(deep) else {
            invariant(false, "\(opener) nested 100000 times parses")
            return false
        }
    }
    return true
}()

/// `JSON.parse` on the input, on its base64url-decoded parts when it looks like a compact JWS (which is all
/// `JWT.parse` in ProxyOAuth does before looking at claims), and `Base64` round trips.
public func fuzzJSON(_ data: UnsafeBufferPointer<UInt8>) {
    precondition(deepNestingChecked)
    let input = Array(data)
    checkJSON(input)
    checkBase64URL(input)
}

private func checkJSON(_ input: [UInt8]) {
    let parsed = JSON.parse(input)
    let reference = ReferenceJSON.parse(input)
    switch parsed {
    case .success(let value):
        guard case .valid(let expected, let deepest, let longestNumber, let duplicate) = reference else {
            return invariant(false, "accepted what RFC 8259 does not: \(reference)")
        }
        invariant(deepest < JSON.maxDepth, "accepted nesting of depth \(deepest)")
        invariant(longestNumber <= 64, "accepted a number of \(longestNumber) characters")
        invariant(!duplicate, "accepted duplicate member names")
        invariant(value == expected, "parsed to \(value), the grammar says \(expected)")
        checkValue(value)
        checkRoundTrip(value)
        checkNesting(input, value: value)
    case .failure(let error):
        invariant((0...input.count).contains(error.offset), "error offset \(error.offset) of \(input.count)")
        invariant(!error.reason.isEmpty, "error without a reason")
        if case .valid(_, let deepest, let longestNumber, let duplicate) = reference {
            invariant(
                deepest >= JSON.maxDepth || longestNumber > 64 || duplicate,
                "rejected valid JSON (depth \(deepest), longest number \(longestNumber)): \(error)")
            if duplicate && deepest < JSON.maxDepth && longestNumber <= 64 {
                invariant(error.reason.hasPrefix("duplicate member"), "rejected with \(error) instead of a duplicate")
            }
        }
    }
    // The same text handed over as a String means the same.
    if let string = String(validating: input, as: UTF8.self) {
        let again = JSON.parse(string)
        switch (parsed, again) {
        case (.success(let a), .success(let b)): invariant(a == b, "the String parse differs")
        case (.failure(let a), .failure(let b)): invariant(a == b, "the String parse fails differently")
        default: invariant(false, "the String parse disagrees")
        }
    }
}

/// Accessors never trap and agree with the number's text.
private func checkValue(_ value: JSONValue) {
    switch value {
    case .number(let text):
        let int = value.int
        _ = value.double
        if let exact = Int64(text) { invariant(int == exact, "int of \(text) is \(String(describing: int))") }
        if let int, !text.contains(where: { $0 == "." || $0 == "e" || $0 == "E" }) {
            invariant(Int64(text) == int, "int of \(text) is \(int)")
        }
    case .array(let values):
        if let strings = value.stringList { invariant(strings.count == values.count, "stringList lost elements") }
        values.forEach(checkValue)
    case .object(let object):
        invariant(Set(object.keys).count == object.keys.count, "an object with duplicate keys")
        for member in object.members {
            invariant(
                object[member.key] == member.value, "lookup of \(member.key.debugDescription) finds another value")
            checkValue(member.value)
        }
    case .string(let string):
        invariant(value.stringList == [string], "stringList of a string")
    case .null, .bool:
        break
    }
}

/// serialize(parse(x)) parses to the same value and serialises to the same text.
private func checkRoundTrip(_ value: JSONValue) {
    let text = JSON.serialize(value)
    switch JSON.parse(text) {
    case .success(let again):
        invariant(again == value, "serialize then parse changes the value: \(text.prefix(200).debugDescription)")
        invariant(JSON.serialize(again) == text, "serialize is not stable")
    case .failure(let error):
        invariant(false, "serialize gives invalid JSON (\(error)): \(text.prefix(200).debugDescription)")
    }
}

/// Wrapped in more arrays and objects, the value parses until the nesting limit and not beyond.
private func checkNesting(_ input: [UInt8], value: JSONValue) {
    var random = InputRandom(input, salt: 0x41)
    let levels = random.next(in: 1...(JSON.maxDepth + 4))
    var wrapped: [UInt8] = []
    var closers: [UInt8] = []
    for _ in 0..<levels {
        if random.nextBool() {
            wrapped += bytes("[")
            closers.append(UInt8(ascii: "]"))
        } else {
            wrapped += bytes("{\"k\":")
            closers.append(UInt8(ascii: "}"))
        }
    }
    wrapped += input
    wrapped += closers.reversed()
    let depth = levels + nesting(value)
    switch JSON.parse(wrapped) {
    case .success:
        invariant(depth < JSON.maxDepth, "nesting of depth \(depth) accepted")
    case .failure(let error):
        invariant(depth >= JSON.maxDepth, "nesting of depth \(depth) rejected: \(error)")
    }
}

/// Depth of the deepest value inside, the value itself being at depth 0.
private func nesting(_ value: JSONValue) -> Int {
    switch value {
    case .array(let values): return values.map { 1 + nesting($0) }.max() ?? 0
    case .object(let object): return object.members.map { 1 + nesting($0.value) }.max() ?? 0
    default: return 0
    }
}

/// Base64url as JWS uses it: canonical unpadded encodings decode and re-encode to themselves; anything
/// encodes and decodes back. A compact JWS's header and payload go through `checkJSON`.
private func checkBase64URL(_ input: [UInt8]) {
    let encoded = Base64.urlEncode(input)
    invariant(Base64.decode(encoded) == input, "base64url does not decode back")
    invariant(!encoded.contains("=") && !encoded.contains("+") && !encoded.contains("/"), "base64url alphabet")

    let parts = input.split(separator: UInt8(ascii: "."), omittingEmptySubsequences: false)
    guard parts.count == 3 else { return }
    for (index, part) in parts.enumerated() {
        let text = String(decoding: part, as: UTF8.self)
        let urlSafe = part.allSatisfy { isAlphanumeric($0) || $0 == UInt8(ascii: "-") || $0 == UInt8(ascii: "_") }
        guard let decoded = Base64.decode(text) else { continue }
        if urlSafe {
            invariant(Base64.urlEncode(decoded) == text, "\(text.debugDescription) decodes but is not canonical")
            if index < 2 { checkJSON(decoded) }
        }
    }
}

private func isAlphanumeric(_ byte: UInt8) -> Bool {
    (byte >= 0x30 && byte <= 0x39) || (byte >= 0x41 && byte <= 0x5A) || (byte >= 0x61 && byte <= 0x7A)
}

/// An independent reading of RFC 8259 (and RFC 3629 for the UTF-8 in strings), with no limits: it reports
/// the deepest nesting, the longest number and duplicate names for the caller to compare with the limits.
private struct ReferenceJSON {
    enum Outcome: CustomStringConvertible {
        case invalid(offset: Int)
        case valid(JSONValue, deepest: Int, longestNumber: Int, duplicate: Bool)

        var description: String {
            switch self {
            case .invalid(let offset): "invalid at \(offset)"
            case .valid(_, let deepest, let longest, let duplicate):
                "valid (depth \(deepest), longest number \(longest), duplicate \(duplicate))"
            }
        }
    }

    private struct Invalid: Error {}

    private let text: [UInt8]
    private var at = 0
    private var deepest = 0
    private var longestNumber = 0
    private var duplicate = false

    static func parse(_ text: [UInt8]) -> Outcome {
        var reader = ReferenceJSON(text: text)
        do {
            reader.space()
            let value = try reader.element(depth: 0)
            reader.space()
            guard reader.at == text.count else { throw Invalid() }
            return .valid(
                value, deepest: reader.deepest, longestNumber: reader.longestNumber, duplicate: reader.duplicate)
        } catch {
            return .invalid(offset: reader.at)
        }
    }

    private init(text: [UInt8]) { self.text = text }

    private var current: UInt8? { at < text.count ? text[at] : nil }

    private mutating func expect(_ byte: UInt8) throws {
        guard current == byte else { throw Invalid() }
        at += 1
    }

    private mutating func space() {
        while let byte = current, byte == 0x20 || byte == 0x0A || byte == 0x0D || byte == 0x09 { at += 1 }
    }

    private mutating func element(depth: Int) throws -> JSONValue {
        deepest = max(deepest, depth)
        // Far past the limit the answer is known; stop before the stack is at risk.
        guard depth <= 4 * JSON.maxDepth else { throw Invalid() }
        guard let byte = current else { throw Invalid() }
        switch byte {
        case UInt8(ascii: "["):
            at += 1
            space()
            var values: [JSONValue] = []
            if current == UInt8(ascii: "]") {
                at += 1
                return .array(values)
            }
            while true {
                space()
                values.append(try element(depth: depth + 1))
                space()
                if current == UInt8(ascii: ",") {
                    at += 1
                } else {
                    try expect(UInt8(ascii: "]"))
                    return .array(values)
                }
            }
        case UInt8(ascii: "{"):
            at += 1
            space()
            var members: [(String, JSONValue)] = []
            var names = Set<String>()
            if current == UInt8(ascii: "}") {
                at += 1
                return .object(JSONObject(members))
            }
            while true {
                space()
                guard current == UInt8(ascii: "\"") else { throw Invalid() }
                let name = try string()
                if !names.insert(name).inserted { duplicate = true }
                space()
                try expect(UInt8(ascii: ":"))
                space()
                members.append((name, try element(depth: depth + 1)))
                space()
                if current == UInt8(ascii: ",") {
                    at += 1
                } else {
                    try expect(UInt8(ascii: "}"))
                    return .object(JSONObject(members))
                }
            }
        case UInt8(ascii: "\""):
            return .string(try string())
        case UInt8(ascii: "t"):
            try word("true")
            return .bool(true)
        case UInt8(ascii: "f"):
            try word("false")
            return .bool(false)
        case UInt8(ascii: "n"):
            try word("null")
            return .null
        default:
            return .number(try number())
        }
    }

    private mutating func word(_ literal: String) throws {
        for byte in literal.utf8 { try expect(byte) }
    }

    private func isDigit(_ byte: UInt8?) -> Bool { byte.map { $0 >= 0x30 && $0 <= 0x39 } ?? false }

    private mutating func digits() throws {
        guard isDigit(current) else { throw Invalid() }
        while isDigit(current) { at += 1 }
    }

    private mutating func number() throws -> String {
        let start = at
        if current == UInt8(ascii: "-") { at += 1 }
        if current == UInt8(ascii: "0") {
            at += 1
        } else {
            guard let byte = current, byte >= UInt8(ascii: "1") && byte <= UInt8(ascii: "9") else { throw Invalid() }
            try digits()
        }
        if current == UInt8(ascii: ".") {
            at += 1
            try digits()
        }
        if current == UInt8(ascii: "e") || current == UInt8(ascii: "E") {
            at += 1
            if current == UInt8(ascii: "+") || current == UInt8(ascii: "-") { at += 1 }
            try digits()
        }
        longestNumber = max(longestNumber, at - start)
        return String(decoding: text[start..<at], as: UTF8.self)
    }

    private mutating func hexQuad() throws -> UInt32 {
        var value: UInt32 = 0
        for _ in 0..<4 {
            guard let byte = current else { throw Invalid() }
            let digit: UInt8
            switch byte {
            case UInt8(ascii: "0")...UInt8(ascii: "9"): digit = byte - UInt8(ascii: "0")
            case UInt8(ascii: "a")...UInt8(ascii: "f"): digit = byte - UInt8(ascii: "a") + 10
            case UInt8(ascii: "A")...UInt8(ascii: "F"): digit = byte - UInt8(ascii: "A") + 10
            default: throw Invalid()
            }
            value = value * 16 + UInt32(digit)
            at += 1
        }
        return value
    }

    private mutating func string() throws -> String {
        try expect(UInt8(ascii: "\""))
        var scalars = String.UnicodeScalarView()
        while true {
            guard let byte = current else { throw Invalid() }
            at += 1
            switch byte {
            case UInt8(ascii: "\""):
                return String(scalars)
            case UInt8(ascii: "\\"):
                guard let escape = current else { throw Invalid() }
                at += 1
                switch escape {
                case UInt8(ascii: "\""), UInt8(ascii: "\\"), UInt8(ascii: "/"): scalars.append(Unicode.Scalar(escape))
                case UInt8(ascii: "b"): scalars.append(Unicode.Scalar(UInt8(0x08)))
                case UInt8(ascii: "f"): scalars.append(Unicode.Scalar(UInt8(0x0C)))
                case UInt8(ascii: "n"): scalars.append(Unicode.Scalar(UInt8(0x0A)))
                case UInt8(ascii: "r"): scalars.append(Unicode.Scalar(UInt8(0x0D)))
                case UInt8(ascii: "t"): scalars.append(Unicode.Scalar(UInt8(0x09)))
                case UInt8(ascii: "u"):
                    var code = try hexQuad()
                    if code >= 0xD800 && code <= 0xDBFF {
                        try expect(UInt8(ascii: "\\"))
                        try expect(UInt8(ascii: "u"))
                        let low = try hexQuad()
                        guard low >= 0xDC00 && low <= 0xDFFF else { throw Invalid() }
                        code = 0x10000 + (code - 0xD800) * 0x400 + (low - 0xDC00)
                    }
                    guard let scalar = Unicode.Scalar(code) else { throw Invalid() }
                    scalars.append(scalar)
                default:
                    throw Invalid()
                }
            case 0x00..<0x20:
                throw Invalid()
            case 0x20..<0x80:
                scalars.append(Unicode.Scalar(byte))
            default:
                scalars.append(try utf8Sequence(lead: byte))
            }
        }
    }

    /// RFC 3629 §4: no overlong forms, no surrogates, nothing past U+10FFFF.
    private mutating func utf8Sequence(lead: UInt8) throws -> Unicode.Scalar {
        let count: Int
        var value: UInt32
        var low: UInt8 = 0x80
        var high: UInt8 = 0xBF
        switch lead {
        case 0xC2...0xDF: (count, value) = (1, UInt32(lead & 0x1F))
        case 0xE0: (count, value, low) = (2, 0, 0xA0)
        case 0xE1...0xEC, 0xEE...0xEF: (count, value) = (2, UInt32(lead & 0x0F))
        case 0xED: (count, value, high) = (2, 0x0D, 0x9F)
        case 0xF0: (count, value, low) = (3, 0, 0x90)
        case 0xF1...0xF3: (count, value) = (3, UInt32(lead & 0x07))
        case 0xF4: (count, value, high) = (3, 4, 0x8F)
        default: throw Invalid()
        }
        for index in 0..<count {
            guard let byte = current else { throw Invalid() }
            let (from, to) = index == 0 ? (low, high) : (UInt8(0x80), UInt8(0xBF))
            guard byte >= from && byte <= to else { throw Invalid() }
            value = value << 6 | UInt32(byte & 0x3F)
            at += 1
        }
        guard let scalar = Unicode.Scalar(value) else { throw Invalid() }
        return scalar
    }
}
