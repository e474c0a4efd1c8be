#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Exit codes: 0 success, 1 failure, 64 bad usage (sysexits' EX_USAGE).
public enum ExitCode {
    public static let success: Int32 = 0
    public static let failure: Int32 = 1
    public static let usage: Int32 = 64
}

/// A command-line option or flag.
struct OptionSpec: Sendable {
    /// Long name without dashes: `config` for `--config`.
    let name: String
    let short: Character?
    /// The value's placeholder (`file`), or nil for a flag.
    let valueName: String?
    let help: String
    /// May be given more than once.
    var repeatable = false
    /// The values it takes, when they are a fixed few (for shell completion).
    var values: [String] = []

    static func flag(_ name: String, short: Character? = nil, help: String) -> OptionSpec {
        OptionSpec(name: name, short: short, valueName: nil, help: help)
    }

    static func option(
        _ name: String, short: Character? = nil, value: String, values: [String] = [], help: String
    ) -> OptionSpec {
        OptionSpec(
            name: name, short: short, valueName: value, help: help,
            values: values.isEmpty && value.contains("|") ? value.split(separator: "|").map(String.init) : values)
    }

    var usage: String {
        valueName.map { "--\(name) <\($0)>" } ?? "--\(name)"
    }

    var label: String {
        let long = usage
        return short.map { "-\($0), \(long)" } ?? long
    }
}

/// A positional argument.
struct ArgumentSpec: Sendable {
    let name: String
    let help: String
    var optional = true
    /// The values it takes, when they are a fixed few (for shell completion).
    var values: [String] = []
}

/// A subcommand: its help, its arguments and what it does.
struct CommandSpec: Sendable {
    let name: String
    let abstract: String
    var discussion: String? = nil
    var arguments: [ArgumentSpec] = []
    var options: [OptionSpec] = []
    var subcommands: [CommandSpec] = []
    var run: (@Sendable (ParsedArguments, CommandContext) throws -> Int32)? = nil
}

/// What the parser found in argv.
struct ParsedArguments: Sendable {
    var values: [String: [String]] = [:]
    var flags: Set<String> = []
    var positionals: [String] = []

    func value(_ name: String) -> String? { values[name]?.last }
    func all(_ name: String) -> [String] { values[name] ?? [] }
    func flag(_ name: String) -> Bool { flags.contains(name) }
}

/// The process around a command: environment, output streams.
public struct CommandContext: Sendable {
    public var environment: [String: String]
    public var stdout: OutputFile
    public var stderr: OutputFile
    /// Whether stdin is a terminal (interactive use).
    public var isInteractive: Bool

    public init(
        environment: [String: String] = ProcessInfo.processInfo.environment,
        stdout: OutputFile = .standardOutput, stderr: OutputFile = .standardError,
        isInteractive: Bool = isatty(0) != 0
    ) {
        self.environment = environment
        self.stdout = stdout
        self.stderr = stderr
        self.isInteractive = isInteractive
    }

    func out(_ text: String) { stdout.write(text + "\n") }
    func err(_ text: String) { stderr.write(text + "\n") }
}

/// write(2), under a name `OutputFile.write` does not hide.
private func writeToDescriptor(_ fd: Int32, _ bytes: UnsafeRawPointer?, _ count: Int) -> Int { write(fd, bytes, count) }

/// A stream proxyctl writes to, by its descriptor: each write goes out whole, at once (Foundation's
/// `FileHandle` is not in FoundationEssentials, which is all the release links).
public struct OutputFile: Sendable {
    public let descriptor: Int32

    public static let standardOutput = OutputFile(descriptor: 1)
    public static let standardError = OutputFile(descriptor: 2)

    public init(descriptor: Int32) { self.descriptor = descriptor }

    /// Whether the stream is a terminal.
    public var isTerminal: Bool { isatty(descriptor) != 0 }

    public func write(_ text: String) { write(Array(text.utf8)) }

    /// Writes all of `bytes`; a reader that went away (EPIPE) ends the write quietly.
    public func write(_ bytes: some Collection<UInt8>) {
        let all = Array(bytes)
        var offset = 0
        while offset < all.count {
            let count = all[offset...].withUnsafeBytes { writeToDescriptor(descriptor, $0.baseAddress, $0.count) }
            if count < 0 && errno == EINTR { continue }
            guard count > 0 else { return }
            offset += count
        }
    }
}

/// A usage error: printed with the usage line, exit 64.
struct UsageError: Error {
    let message: String
    let command: [String]
}

/// A failure with a message for the user, exit 1.
struct CommandFailure: Error, CustomStringConvertible {
    let message: String
    var exitCode: Int32 = ExitCode.failure
    var description: String { message }
}

enum ArgumentParser {
    static let helpOption = OptionSpec.flag("help", short: "h", help: "Show help information.")

    /// Parses `arguments` (after the subcommand name) against `spec`.
    static func parse(_ arguments: [String], spec: CommandSpec, path: [String]) throws -> ParsedArguments {
        var parsed = ParsedArguments()
        var index = 0
        var onlyPositionals = false
        let options = spec.options + [helpOption]
        while index < arguments.count {
            let argument = arguments[index]
            index += 1
            if onlyPositionals || !argument.hasPrefix("-") || argument == "-" {
                parsed.positionals.append(argument)
                // Once the command of `exec` has begun, everything belongs to it.
                if spec.arguments.last?.name == "arguments" { onlyPositionals = true }
                continue
            }
            if argument == "--" {
                onlyPositionals = true
                continue
            }
            var name: Substring
            var inlineValue: String? = nil
            let option: OptionSpec?
            if argument.hasPrefix("--") {
                name = argument.dropFirst(2)
                if let equals = name.firstIndex(of: "=") {
                    inlineValue = String(name[name.index(after: equals)...])
                    name = name[..<equals]
                }
                option = options.first { $0.name == name }
            } else {
                guard argument.count == 2 else {
                    throw UsageError(message: "Unknown option '\(argument)'", command: path)
                }
                option = options.first { $0.short == argument.last }
            }
            guard let option else { throw UsageError(message: "Unknown option '\(argument)'", command: path) }
            if option.valueName == nil {
                if inlineValue != nil {
                    throw UsageError(message: "The flag '--\(option.name)' does not take a value", command: path)
                }
                parsed.flags.insert(option.name)
                continue
            }
            let value: String
            if let inlineValue {
                value = inlineValue
            } else {
                guard index < arguments.count else {
                    throw UsageError(message: "Missing value for '\(option.usage)'", command: path)
                }
                value = arguments[index]
                index += 1
            }
            if parsed.values[option.name] != nil && !option.repeatable {
                throw UsageError(message: "The option '--\(option.name)' was given more than once", command: path)
            }
            parsed.values[option.name, default: []].append(value)
        }
        if parsed.flag("help") { return parsed }
        // The last argument named "arguments" takes any number of values (`exec`).
        if parsed.positionals.count > spec.arguments.count && spec.arguments.last?.name != "arguments" {
            let extra = parsed.positionals[spec.arguments.count]
            throw UsageError(message: "Unexpected argument '\(extra)'", command: path)
        }
        for (position, argument) in spec.arguments.enumerated() where !argument.optional {
            if position >= parsed.positionals.count {
                throw UsageError(message: "Missing expected argument '<\(argument.name)>'", command: path)
            }
        }
        return parsed
    }

    /// The usage line: `proxyctl serve [--config <file>] [--listen <host:port>]`.
    static func usage(_ spec: CommandSpec, path: [String]) -> String {
        var parts = path
        if !spec.subcommands.isEmpty && spec.run == nil {
            parts.append("<subcommand>")
            return parts.joined(separator: " ")
        }
        for option in spec.options {
            parts.append(option.repeatable ? "[\(option.usage) ...]" : "[\(option.usage)]")
        }
        for argument in spec.arguments {
            let name = argument.name == "arguments" ? "<arguments> ..." : "<\(argument.name)>"
            parts.append(argument.optional ? "[\(name)]" : name)
        }
        return parts.joined(separator: " ")
    }

    /// Help in the shape swift-argument-parser users know.
    static func help(_ spec: CommandSpec, path: [String], extraOptions: [OptionSpec] = []) -> String {
        var text = "OVERVIEW: \(spec.abstract)\n"
        if let discussion = spec.discussion {
            let paragraphs = discussion.split(separator: "\n").map {
                wrap(String($0), width: 100).joined(separator: "\n")
            }
            text += "\n\(paragraphs.joined(separator: "\n"))\n"
        }
        text += "\nUSAGE: \(usage(spec, path: path))\n"
        if !spec.arguments.isEmpty {
            text += "\nARGUMENTS:\n"
            for argument in spec.arguments { text += row("<\(argument.name)>", argument.help) }
        }
        text += "\nOPTIONS:\n"
        for option in spec.options + extraOptions + [helpOption] { text += row(option.label, option.help) }
        if !spec.subcommands.isEmpty {
            text += "\nSUBCOMMANDS:\n"
            for subcommand in spec.subcommands { text += row(subcommand.name, subcommand.abstract) }
            text +=
                "\n  See '\(path.first ?? "proxyctl") help \(path.dropFirst().map { $0 + " " }.joined())<subcommand>' for detailed help.\n"
        }
        return text
    }

    private static func row(_ label: String, _ help: String) -> String {
        let indent = String(repeating: " ", count: 26)
        let lines = wrap(help, width: 94)
        var text = "  " + label
        if label.count + 2 < 26 {
            text += String(repeating: " ", count: 24 - label.count) + lines[0] + "\n"
        } else {
            text += "\n" + indent + lines[0] + "\n"
        }
        for line in lines.dropFirst() { text += indent + line + "\n" }
        return text
    }

    private static func wrap(_ text: String, width: Int) -> [String] {
        var lines: [String] = []
        var current = ""
        for word in text.split(separator: " ") {
            if !current.isEmpty && current.count + 1 + word.count > width {
                lines.append(current)
                current = ""
            }
            current += current.isEmpty ? String(word) : " " + word
        }
        lines.append(current)
        return lines
    }
}
