/// The version in a start line. Only HTTP/1.x reaches the rest of the proxy.
public struct HTTPVersion: Sendable, Equatable, CustomStringConvertible {
    public var major: Int
    public var minor: Int

    public static let http1_0 = HTTPVersion(major: 1, minor: 0)
    public static let http1_1 = HTTPVersion(major: 1, minor: 1)

    public init(major: Int, minor: Int) {
        self.major = major
        self.minor = minor
    }

    public var description: String { "HTTP/\(major).\(minor)" }

    /// `description`'s bytes.
    func append(to out: inout [UInt8]) {
        guard (0...9).contains(major), (0...9).contains(minor) else { return out.append(contentsOf: description.utf8) }
        out.append(contentsOf: "HTTP/".utf8)
        out.append(UInt8(ascii: "0") + UInt8(major))
        out.append(UInt8(ascii: "."))
        out.append(UInt8(ascii: "0") + UInt8(minor))
    }
}

/// Where one field line sits inside `HTTPHead.bytes`.
public struct HTTPFieldLine: Sendable, Equatable {
    /// The whole line, including its line terminator.
    public let line: Range<Int>
    /// The field name.
    public let name: Range<Int>
    /// The field value without leading and trailing whitespace.
    public let value: Range<Int>
}

/// A parsed HTTP/1.1 request or response head (RFC 9112 §2.1).
///
/// The head keeps the bytes exactly as received, so that a forwarder can send every field line it does not
/// have to change byte for byte: order, case and value untouched.
///
/// A class of constants, so a value all the same: a head goes from the parser through the exchange's events,
/// outputs and actions to the client, and each copy of a struct was a retain and a release of each of its
/// arrays and strings (callgrind, bench row 6), where a reference is one.
public final class HTTPHead: Sendable {
    /// The head as received: the start line, every field line and the final empty line.
    public let bytes: [UInt8]
    /// The start line without its line terminator.
    public let startLine: Range<Int>
    /// Offset of the first field line (just after the start line's terminator).
    public let fieldsStart: Int
    /// The field lines in the order received.
    public let fields: [HTTPFieldLine]
    public let version: HTTPVersion
    /// Requests: the method, exactly as sent (methods are case-sensitive). Empty for responses.
    public let method: String
    /// Requests: the request-target, exactly as sent. Empty for responses.
    public let target: String
    /// Responses: the status code. Zero for requests.
    public let status: Int

    init(
        bytes: [UInt8], startLine: Range<Int>, fieldsStart: Int, fields: [HTTPFieldLine], version: HTTPVersion,
        method: String, target: String, status: Int
    ) {
        self.bytes = bytes
        self.startLine = startLine
        self.fieldsStart = fieldsStart
        self.fields = fields
        self.version = version
        self.method = method
        self.target = target
        self.status = status
    }

    /// The field name at `index`, as sent.
    public func name(at index: Int) -> String {
        String(decoding: bytes[fields[index].name], as: UTF8.self)
    }

    /// Raw bytes of the name at `index`.
    public func nameBytes(at index: Int) -> ArraySlice<UInt8> {
        bytes[fields[index].name]
    }

    /// The field value at `index`, without surrounding whitespace.
    public func value(at index: Int) -> String {
        String(decoding: bytes[fields[index].value], as: UTF8.self)
    }

    /// Raw bytes of the value at `index`.
    public func valueBytes(at index: Int) -> ArraySlice<UInt8> {
        bytes[fields[index].value]
    }

    /// Whether the field at `index` has the given name, compared case-insensitively. The lengths are compared
    /// first and the bytes read in place: most names differ in length, and an ArraySlice of `bytes` per
    /// comparison was a retain and a release of the head's buffer, dozens of each per request (callgrind, bench
    /// row 6).
    /// - Parameter lowercaseName: the name, in lower case.
    @inline(__always)
    public func field(_ index: Int, isNamed lowercaseName: StaticString) -> Bool {
        let name = fields[index].name
        guard name.count == lowercaseName.utf8CodeUnitCount else { return false }
        return bytes.withUnsafeBufferPointer {
            ASCII.equalsLowercase(UnsafeBufferPointer(rebasing: $0[name]), lowercaseName)
        }
    }

    /// Indices of every field line with the given name (compared case-insensitively).
    public func indices(named lowercaseName: StaticString) -> [Int] {
        var found: [Int] = []
        for index in fields.indices where field(index, isNamed: lowercaseName) { found.append(index) }
        return found
    }

    /// The first field line with the given name (compared case-insensitively), and how many there are: what
    /// `indices(named:)` tells when the list itself is not needed, without making one.
    public func firstIndex(named lowercaseName: StaticString) -> (index: Int?, count: Int) {
        var first: Int? = nil
        var count = 0
        for index in fields.indices where field(index, isNamed: lowercaseName) {
            if first == nil { first = index }
            count += 1
        }
        return (first, count)
    }

    /// Every value of the fields with the given name, in order.
    public func values(named lowercaseName: StaticString) -> [String] {
        indices(named: lowercaseName).map { value(at: $0) }
    }

    /// Every comma-separated element of the fields with the given name, lower-cased and trimmed; empty
    /// elements are skipped (RFC 9110 §5.6.1).
    public func listElements(named lowercaseName: StaticString) -> [String] {
        var elements: [String] = []
        for index in fields.indices where field(index, isNamed: lowercaseName) {
            // Bytes, not Characters, and ASCII case folding only, as the next hop reads them: "," followed by a
            // combining mark is one Character, and Unicode lower-cases "chun\u{212A}ed" (KELVIN SIGN) to "chunked".
            let value = fields[index].value
            var start = value.lowerBound
            while start < value.upperBound {
                var end = start
                while end < value.upperBound && bytes[end] != UInt8(ascii: ",") { end += 1 }
                var low = start
                var high = end
                while low < high && (bytes[low] == ASCII.space || bytes[low] == ASCII.tab) { low += 1 }
                while high > low && (bytes[high - 1] == ASCII.space || bytes[high - 1] == ASCII.tab) { high -= 1 }
                if low < high {
                    elements.append(
                        String(unsafeUninitializedCapacity: high - low) { buffer in
                            for offset in 0..<(high - low) { buffer[offset] = ASCII.lower(bytes[low + offset]) }
                            return high - low
                        })
                }
                start = end + 1
            }
        }
        return elements
    }

    /// Appends the field lines for which `drop` answers false, byte for byte, each ending in CRLF (a line that
    /// ended in a bare LF gets its CR). Consecutive lines that already end in CRLF are copied at once: a
    /// response's fields are mostly kept, so a head is a few copies, not a dozen appends per line (callgrind,
    /// bench row 6).
    public func appendFieldLines(to out: inout [UInt8], drop: (Int) -> Bool) {
        bytes.withUnsafeBufferPointer { bytes in
            var run = 0..<0
            for index in fields.indices {
                let line = fields[index].line
                if drop(index) { continue }
                if line.count >= 2 && bytes[line.upperBound - 2] == ASCII.cr {
                    if run.upperBound == line.lowerBound && !run.isEmpty {
                        run = run.lowerBound..<line.upperBound
                    } else {
                        out.append(contentsOf: UnsafeBufferPointer(rebasing: bytes[run]))
                        run = line
                    }
                    continue
                }
                out.append(contentsOf: UnsafeBufferPointer(rebasing: bytes[run]))
                run = 0..<0
                out.append(contentsOf: UnsafeBufferPointer(rebasing: bytes[line.lowerBound..<line.upperBound - 1]))
                out.append(ASCII.cr)
                out.append(ASCII.lf)
            }
            out.append(contentsOf: UnsafeBufferPointer(rebasing: bytes[run]))
        }
    }

    /// Serialises the head for forwarding: `startLine` replaces the start line (when given), the field lines
    /// for which `drop` answers true are left out, `extra` lines are appended, everything else is copied
    /// byte for byte, except line ends: every line ends in CRLF (a response may use bare LF, RFC 9112 §2.2,
    /// and the next recipient must not see two conventions in one head).
    /// `requestLine`, when given, is the start line from its three parts (no String made of them first).
    public func serialized(
        startLine newStartLine: String? = nil,
        requestLine: (method: String, target: String, version: HTTPVersion)? = nil,
        drop: (Int) -> Bool = { _ in false },
        extra: [(name: String, value: String)] = []
    ) -> [UInt8] {
        var out: [UInt8] = []
        out.reserveCapacity(bytes.count + 64)
        if let requestLine {
            out.append(contentsOf: requestLine.method.utf8)
            out.append(ASCII.space)
            out.append(contentsOf: requestLine.target.utf8)
            out.append(ASCII.space)
            requestLine.version.append(to: &out)
        } else if let newStartLine {
            out.append(contentsOf: newStartLine.utf8)
        } else {
            out.append(contentsOf: bytes[startLine])
        }
        out.append(ASCII.cr)
        out.append(ASCII.lf)
        appendFieldLines(to: &out, drop: drop)
        for (name, value) in extra {
            out.append(contentsOf: name.utf8)
            out.append(ASCII.colon)
            out.append(ASCII.space)
            out.append(contentsOf: value.utf8)
            out.append(ASCII.cr)
            out.append(ASCII.lf)
        }
        out.append(ASCII.cr)
        out.append(ASCII.lf)
        return out
    }
}

extension StringProtocol {
    /// The string without leading and trailing optional whitespace (SP and HTAB, RFC 9110 §5.6.3).
    public func trimmingOWS() -> String {
        let text = Substring(self)
        let bytes = text.utf8
        var start = bytes.startIndex
        var end = bytes.endIndex
        while start < end, bytes[start] == 0x20 || bytes[start] == 0x09 { start = bytes.index(after: start) }
        while start < end {
            let last = bytes.index(before: end)
            guard bytes[last] == 0x20 || bytes[last] == 0x09 else { break }
            end = last
        }
        return String(text[start..<end])
    }

    /// The string without leading and trailing white space, line ends included (what a command prints, a PEM
    /// file's last newline): `trimmingCharacters(in: .whitespacesAndNewlines)` without Foundation.
    public func trimmingWhitespace() -> String {
        let text = Substring(self)
        guard let first = text.firstIndex(where: { !$0.isWhitespace }),
            let last = text.lastIndex(where: { !$0.isWhitespace })
        else { return "" }
        return String(text[first...last])
    }
}

extension HTTPHead {
    /// `head` (the bytes of a head, ending with its empty line) with `fields` added before that end: the one place
    /// field lines are added to a head the proxy forwards as it is (an upgrade request's credential).
    public static func withFields(_ head: [UInt8], _ fields: [(name: String, value: [UInt8])]) -> [UInt8] {
        guard !fields.isEmpty else { return head }
        precondition(head.count >= 2 && head.suffix(2) == [ASCII.cr, ASCII.lf], "a head without its end")
        var size = head.count
        for field in fields { size += ByteWriter.fieldSize(field.name, field.value) }
        return ByteWriter.bytes(count: size) { bytes in
            head.withUnsafeBufferPointer { bytes.write(UnsafeBufferPointer(rebasing: $0[..<(head.count - 2)])) }
            for field in fields { bytes.writeField(field.name, field.value) }
            bytes.write(ASCII.cr)
            bytes.write(ASCII.lf)
        }
    }
}
