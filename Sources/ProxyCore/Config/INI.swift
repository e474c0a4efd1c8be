/// A configuration error: the file, the line, the key and what was expected. Equality compares the
/// location and key, so tests can ask where an error was found.
public struct ConfigError: Error, Sendable, Equatable, CustomStringConvertible {
    public let file: String
    public let line: Int?
    public let section: String?
    public let key: String?
    public let message: String

    public init(file: String, line: Int?, section: String? = nil, key: String? = nil, _ message: String) {
        self.file = file
        self.line = line
        self.section = section
        self.key = key
        self.message = message
    }

    /// `proxy.conf:12: [proxy] listen: expected HOST:PORT such as 127.0.0.1:8080, got "x"`
    public var description: String {
        var text = file
        if let line { text += ":\(line)" }
        text += ": "
        if let section { text += "[\(section)] " }
        if let key { text += "\(key): " }
        return text + message
    }

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.file == rhs.file && lhs.line == rhs.line && lhs.section == rhs.section && lhs.key == rhs.key
    }
}

/// Every error found in one configuration file, in line order.
public struct ConfigErrors: Error, Sendable, CustomStringConvertible {
    public let errors: [ConfigError]

    public init(_ errors: [ConfigError]) { self.errors = errors }

    public var description: String { errors.map(\.description).joined(separator: "\n") }
}

/// The syntax layer of proxy.conf: sections, keys and values with their line numbers.
///
/// ```
/// # a comment
/// [proxy]
/// listen = 127.0.0.1:8080
///
/// [origin https://api.example.com]
/// provider = corp
/// ```
/// Full-line comments start with `#` or `;`. There are no inline comments, because `#` and `;` occur in
/// URLs and values. Keys are lower-case; values are trimmed.
public struct INIDocument: Sendable {
    public struct Entry: Sendable {
        public let key: String
        public let value: String
        public let line: Int
    }

    public struct Section: Sendable {
        /// The section kind, lower-case: `proxy`, `provider`, `origin`.
        public let name: String
        /// The text after the name (`NAME` in `[provider NAME]`), trimmed; nil when absent.
        public let argument: String?
        public let line: Int
        public var entries: [Entry]

        /// How the section is written in messages: `proxy` or `provider corp`.
        public var label: String { argument.map { "\(name) \($0)" } ?? name }
    }

    public let file: String
    public private(set) var sections: [Section] = []

    /// Parses `text`; syntax errors are collected, not thrown one at a time.
    public static func parse(_ text: String, file: String) -> (INIDocument, [ConfigError]) {
        var document = INIDocument(file: file)
        var errors: [ConfigError] = []
        var seenKeys: [String: Int] = [:]
        var insideBrokenSection = false
        // "\r\n" is one Character in Swift, so splitting on "\n" alone would leave a CRLF file as one line.
        let lines = text.split(omittingEmptySubsequences: false, whereSeparator: { $0 == "\n" || $0 == "\r\n" })
        for (offset, rawLine) in lines.enumerated() {
            let number = offset + 1
            var line = Substring(rawLine)
            if line.last == "\r" { line = line.dropLast() }
            let trimmed = line.trimmingOWS()
            if trimmed.isEmpty || trimmed.hasPrefix("#") || trimmed.hasPrefix(";") { continue }
            if trimmed.hasPrefix("[") {
                guard trimmed.hasSuffix("]") else {
                    errors.append(ConfigError(file: file, line: number, "section header must end with \"]\""))
                    insideBrokenSection = true
                    continue
                }
                let inner = trimmed.dropFirst().dropLast().trimmingOWS()
                let parts = inner.split(separator: " ", maxSplits: 1)
                guard let name = parts.first, !name.isEmpty else {
                    errors.append(ConfigError(file: file, line: number, "empty section name"))
                    insideBrokenSection = true
                    continue
                }
                let argument = parts.count > 1 ? parts[1].trimmingOWS() : nil
                document.sections.append(
                    Section(name: name.lowercased(), argument: argument, line: number, entries: []))
                seenKeys = [:]
                insideBrokenSection = false
                continue
            }
            guard let equals = trimmed.firstIndex(of: "=") else {
                // Only the first word: the line may be a mistyped `upstream_proxy: http://user:password@host`.
                let word = String(trimmed.prefix { !$0.isWhitespace && $0 != ":" })
                let shown = clip(word) + (word.count < trimmed.count ? "..." : "")
                errors.append(
                    ConfigError(
                        file: file, line: number, "expected \"key = value\" or \"[section]\", got \"\(shown)\""))
                continue
            }
            let key = trimmed[..<equals].trimmingOWS()
            let value = trimmed[trimmed.index(after: equals)...].trimmingOWS()
            guard !key.isEmpty,
                key.allSatisfy({ $0.isASCII && ($0.isLetter || $0.isNumber || $0 == "_" || $0 == "." || $0 == "-") })
            else {
                errors.append(ConfigError(file: file, line: number, "invalid key \"\(clip(key))\""))
                continue
            }
            // Keys under a broken header belong to no section; the header's error covers them.
            if insideBrokenSection { continue }
            guard var section = document.sections.popLast() else {
                errors.append(
                    ConfigError(file: file, line: number, key: key, "key outside a section; put it under [proxy]"))
                continue
            }
            // `header` is the one key a section may repeat: a credential may go in a pair of fields.
            if key != "header", let first = seenKeys[key] {
                errors.append(
                    ConfigError(
                        file: file, line: number, section: section.label, key: key,
                        "set twice (first on line \(first))"))
            } else {
                seenKeys[key] = number
                section.entries.append(Entry(key: key, value: value, line: number))
            }
            document.sections.append(section)
        }
        return (document, errors)
    }

    static func clip(_ text: String) -> String {
        ASCII.clip(text, limit: 60)
    }
}
