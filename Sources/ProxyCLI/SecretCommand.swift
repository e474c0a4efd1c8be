import ProxyCore
import ProxyOAuth
import ProxyTLS

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

/// `proxyctl secret set|rm NAME`: the static secrets `secret = NAME` in an `[origin]` names, kept in the Secret
/// Service with `token_store = secret-service` (and one answering), else in `state_dir/secrets/NAME` (0600 in a 0700
/// directory, replaced atomically). The value is read from standard input, never from argv.
enum SecretCommand {
    static let nameArgument = ArgumentSpec(
        name: "name", help: "The secret's name, as `secret = NAME` in an [origin] names it.", optional: false)

    static let spec = CommandSpec(
        name: "secret",
        abstract: "Store or remove a static secret for origins without a provider (an API key).",
        discussion: """
            An [origin] with secret = NAME gets the secret stored under NAME in its header (Authorization: \
            Bearer by default; header = NAME: TEMPLATE for others). `set` reads the value from standard input \
            (its first line), never from the command line, so that it stays out of the shell's history and the \
            process list: `proxyctl secret set openai < key.txt`, or type it and press Ctrl-D. With token_store = \
            secret-service it goes to the desktop's Secret Service, else to a file readable by you alone in \
            state_dir/secrets. A running proxy uses the new value from the next request on.
            """,
        subcommands: [
            CommandSpec(
                name: "set", abstract: "Store the secret NAME, read from standard input.",
                arguments: [nameArgument], options: [AuthEnvironment.configOption], run: set),
            CommandSpec(
                name: "rm", abstract: "Remove the secret NAME.",
                arguments: [nameArgument], options: [AuthEnvironment.configOption], run: remove),
        ]
    )

    static func locate(_ arguments: ParsedArguments, _ context: CommandContext) throws -> (name: String, state: String)
    {
        guard let name = arguments.positionals.first, !name.isEmpty,
            name.utf8.allSatisfy({ byte in
                (byte >= 0x30 && byte <= 0x39) || (byte | 0x20 >= 0x61 && byte | 0x20 <= 0x7A) || byte == 0x2D
                    || byte == 0x5F || byte == 0x2E
            }), !name.hasPrefix(".")
        else {
            throw CommandFailure(
                message: "a secret's name is letters, digits, -, _ and ., such as openai", exitCode: 64)
        }
        let loader = ConfigLoader(environment: context.environment)
        let configuration = try loader.load(loader.locate(flag: arguments.value("config")))
        guard
            let state = configuration.proxy.stateDir
                ?? TokenStore.defaultStateDirectory(environment: context.environment)
        else { throw CommandFailure(message: "no state directory: set HOME, XDG_STATE_HOME or state_dir in [proxy]") }
        return (name, state)
    }

    static func set(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let (name, state) = try locate(arguments, context)
        if context.isInteractive { context.err("Type the secret for \(name), then Enter and Ctrl-D:") }
        var input: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 4096)
        while input.count <= 64 << 10 {
            let count = buffer.withUnsafeMutableBytes { read(0, $0.baseAddress, $0.count) }
            if count < 0 && errno == EINTR { continue }
            if count <= 0 { break }
            input += buffer[..<count]
        }
        var value = Array(input.prefix { $0 != 0x0A && $0 != 0x0D })
        while value.last == 0x20 || value.last == 0x09 { value.removeLast() }
        guard !value.isEmpty else { throw CommandFailure(message: "no secret on standard input") }
        guard value.count <= 16 << 10, value.allSatisfy({ $0 == 0x20 || $0 == 0x09 || ($0 > 0x20 && $0 < 0x7F) })
        else {
            throw CommandFailure(
                message: "the secret must be visible ASCII on one line (it goes into a header), at most 16 KiB")
        }
        if let service = SecretService.configured {
            do {
                try service.store(value, provider: name, kind: .staticSecret)
            } catch {
                throw CommandFailure(message: "\(error)")
            }
            context.err("Stored the secret \(name) in the Secret Service.")
            return ExitCode.success
        }
        if let fallback = ConfigLoader.secretStoreFallback {
            context.err("proxyctl: the Secret Service cannot be used (\(fallback)); keeping the secret in a file")
        }
        let path = StaticSecret.storedPath(stateDirectory: state, name: name)
        do {
            try SecureFile.makePrivateDirectory(state)
            try SecureFile.makePrivateDirectory(state + "/secrets")
            try SecureFile.write(value + [0x0A], to: path, mode: 0o600)
        } catch {
            throw CommandFailure(message: "cannot store the secret: \(error)")
        }
        context.err("Stored the secret \(name) in \(path), readable by you alone.")
        return ExitCode.success
    }

    static func remove(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let (name, state) = try locate(arguments, context)
        var removed = false
        if let service = SecretService.configured {
            removed = (try? service.lookup(provider: name, kind: .staticSecret)) != nil
            service.clear(provider: name, kind: .staticSecret)
        }
        let path = StaticSecret.storedPath(stateDirectory: state, name: name)
        if unlink(path) == 0 { removed = true }
        guard removed else { throw CommandFailure(message: "no secret is stored as \(name)") }
        context.err("Removed the secret \(name).")
        return ExitCode.success
    }
}

/// `proxyctl audit`: the audit log of the state directory (every use of a credential: when, which origin, which
/// credential, the status), oldest first.
enum AuditCommand {
    static let spec = CommandSpec(
        name: "audit",
        abstract: "Show which credentials went where: the audit log of every token and secret attached.",
        discussion: """
            Every request to which the proxy attached a credential (a provider's token or a static secret) is a \
            line in state_dir/audit.log: the time, the origin, the method, the path without its query, the \
            credential's name, the status, the client's user where the kernel said. Never a secret, a token, a \
            proof, a query string or a body. The log is moved to audit.log.1 past audit_max_size (16MiB); both \
            are read.
            """,
        options: [
            AuthEnvironment.configOption,
            .option("since", value: "duration", help: "Only the last DURATION (such as 10m, 2h, 7d)."),
            .option("origin", value: "url", help: "Only requests to this origin (https://api.example.com)."),
            .flag("json", help: "Print the JSON lines as they are stored."),
        ], run: run)

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let loader = ConfigLoader(environment: context.environment)
        let configuration = try loader.load(loader.locate(flag: arguments.value("config")))
        guard
            let state = configuration.proxy.stateDir
                ?? TokenStore.defaultStateDirectory(environment: context.environment)
        else { throw CommandFailure(message: "no state directory: set HOME, XDG_STATE_HOME or state_dir in [proxy]") }
        var since: Int64? = nil
        if let text = arguments.value("since") {
            var milliseconds: Int?
            if text.hasSuffix("d"), let days = Int(text.dropLast()) { milliseconds = days * 86_400_000 }
            if milliseconds == nil { milliseconds = ConfigValue.duration(text) }
            guard let milliseconds else {
                throw UsageError(
                    message: "--since takes a duration such as 10m, 2h or 7d", command: ["proxyctl", "audit"])
            }
            since = Int64(time(nil)) - Int64(milliseconds / 1000)
        }
        var origin: String? = nil
        if let text = arguments.value("origin") {
            guard case .success(let parsed) = OriginConfig.parseURL(text) else {
                throw UsageError(
                    message: "--origin takes an origin such as https://api.example.com", command: ["proxyctl", "audit"])
            }
            origin = parsed.url
        }
        let path = state + "/audit.log"
        var lines: [String] = []
        for file in [path + ".1", path] {
            guard let data = FileManager.default.contents(atPath: file) else { continue }
            lines += String(decoding: data, as: UTF8.self).split(separator: "\n").map(String.init)
        }
        for line in lines {
            guard let entry = AuditEntry.parse(line) else { continue }
            if let since, entry.time < since { continue }
            if let origin, entry.origin != origin { continue }
            context.out(arguments.flag("json") ? entry.json : entry.text)
        }
        return ExitCode.success
    }
}
