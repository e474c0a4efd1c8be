/// Changes to a configuration file proxyctl makes itself (`proxyctl login` registering its client again on a free
/// port): values set in one section, every other line (comments, order, line ends) as it was.
public enum ConfigEdit {
    /// `text` with each of `values` set in the section `[name argument]`: a key the section has gets its line
    /// replaced (`key = value`, the line's indentation kept); one it lacks is added after the section's last
    /// entry. Nil when the text has syntax errors, the section is not there exactly once, or a value would not
    /// stay one line.
    public static func setting(
        _ values: [(key: String, value: String)], inSection name: String, argument: String?, of text: String
    ) -> String? {
        guard values.allSatisfy({ !$0.value.contains(where: \.isNewline) && $0.value == $0.value.trimmingOWS() })
        else { return nil }
        let (document, errors) = INIDocument.parse(text, file: "")
        guard errors.isEmpty else { return nil }
        let matching = document.sections.filter { $0.name == name && $0.argument == argument }
        guard matching.count == 1, let section = matching.first else { return nil }
        // Lines as the parser numbers them ("\r\n" is one Character), each with its own ending kept.
        var lines: [String] = []
        var current = ""
        for character in text {
            if character == "\n" || character == "\r\n" {
                lines.append(current + String(character))
                current = ""
            } else {
                current.append(character)
            }
        }
        lines.append(current)
        let ending = text.contains("\r\n") ? "\r\n" : "\n"
        var added: [String] = []
        for (key, value) in values {
            if let entry = section.entries.last(where: { $0.key == key }) {
                let index = entry.line - 1
                let old = lines[index]
                let indentation = old.prefix { $0 == " " || $0 == "\t" }
                // "\r\n" is one Character: the line's last one is its ending, if it has one.
                let lineEnding = old.last.map { $0.isNewline ? String($0) : "" } ?? ""
                lines[index] = "\(indentation)\(key) = \(value)\(lineEnding)"
            } else {
                added.append("\(key) = \(value)")
            }
        }
        if !added.isEmpty {
            let after = (section.entries.map(\.line).max() ?? section.line) - 1
            if lines[after].last?.isNewline != true { lines[after] += ending }
            lines.insert(contentsOf: added.map { $0 + ending }, at: after + 1)
        }
        return lines.joined()
    }
}
