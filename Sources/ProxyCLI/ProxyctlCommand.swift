import ProxyCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// The version printed by `--version`, with the commit the binary was built from.
public enum Version {
    public static let string = "0.1.0"
    /// `0.1.0 (commit 23e4293ab1c2)`.
    public static var full: String { "\(string) (commit \(BuildInfo.commit))" }
}

/// `proxyctl`: parses argv, runs a subcommand, returns the exit code.
public enum ProxyctlCommand {
    static let root = CommandSpec(
        name: "proxyctl",
        abstract: "An authenticating HTTP forward proxy for APIs behind OAuth 2.0 and OpenID Connect.",
        discussion: """
            Start with `proxyctl init --issuer URL --client-id ID --origin URL`: it checks the provider, writes \
            proxy.conf and prints the next commands. Sign in once with `proxyctl login`, then run a command \
            through the proxy with `proxyctl exec -- COMMAND`, or run `proxyctl serve` and point your tools at it \
            with `eval "$(proxyctl env)"`. Everything that is not a protected origin passes through untouched; \
            `proxyctl doctor` checks the set-up.
            """,
        subcommands: [
            InitCommand.spec,
            ServeCommand.spec,
            LoginCommand.spec,
            LogoutCommand.spec,
            StatusCommand.spec,
            TokenCommand.spec,
            StepUpCommand.spec,
            CACommand.spec,
            KeyCommand.spec,
            SecretCommand.spec,
            AuditCommand.spec,
            EnvCommand.spec,
            ExecCommand.spec,
            DoctorCommand.spec,
            CompletionCommand.spec,
            CommandSpec(
                name: "help", abstract: "Show subcommand help information.",
                arguments: [
                    ArgumentSpec(name: "subcommand", help: "The subcommand to describe.")
                ],
                options: [
                    .flag("man", help: "Print the manual page, proxyctl(1), in roff: every subcommand's help in one.")
                ]),
        ]
    )

    static let versionOption = OptionSpec.flag("version", help: "Show the version.")

    /// Runs `proxyctl` with `arguments` (without the program name).
    public static func main(_ arguments: [String], context: CommandContext = CommandContext()) -> Int32 {
        do {
            return try dispatch(arguments, context: context)
        } catch let error as UsageError {
            context.err("Error: \(error.message)")
            let spec = find(error.command.dropFirst()) ?? root
            context.err("Usage: \(ArgumentParser.usage(spec, path: error.command))")
            context.err("  See '\(error.command.joined(separator: " ")) --help' for more information.")
            return ExitCode.usage
        } catch let failure as CommandFailure {
            context.err("proxyctl: \(failure.message)")
            return failure.exitCode
        } catch {
            context.err("proxyctl: \(error)")
            return ExitCode.failure
        }
    }

    static func find(_ path: ArraySlice<String>) -> CommandSpec? {
        var spec = root
        for name in path {
            guard let next = spec.subcommands.first(where: { $0.name == name }) else { return nil }
            spec = next
        }
        return spec
    }

    static func dispatch(_ arguments: [String], context: CommandContext) throws -> Int32 {
        guard let first = arguments.first else {
            context.out(ArgumentParser.help(root, path: ["proxyctl"], extraOptions: [versionOption]))
            return ExitCode.success
        }
        switch first {
        case "--version":
            context.out("proxyctl \(Version.full)")
            return ExitCode.success
        case "-h", "--help":
            context.out(ArgumentParser.help(root, path: ["proxyctl"], extraOptions: [versionOption]))
            return ExitCode.success
        case "help":
            let topic = Array(arguments.dropFirst())
            if topic == ["--man"] {
                context.out(ManualPage.render(root, version: Version.string))
                return ExitCode.success
            }
            guard !topic.isEmpty else {
                context.out(ArgumentParser.help(root, path: ["proxyctl"], extraOptions: [versionOption]))
                return ExitCode.success
            }
            guard let spec = find(topic[...]) else {
                throw UsageError(message: "Unknown subcommand '\(topic.joined(separator: " "))'", command: ["proxyctl"])
            }
            context.out(ArgumentParser.help(spec, path: ["proxyctl"] + topic))
            return ExitCode.success
        default:
            break
        }
        var spec = root
        var path = ["proxyctl"]
        var rest = arguments[...]
        while let name = rest.first, !spec.subcommands.isEmpty, !name.hasPrefix("-") {
            guard let next = spec.subcommands.first(where: { $0.name == name }), next.name != "help" || path.count > 1
            else {
                throw UsageError(message: "Unknown subcommand '\(name)'", command: path)
            }
            spec = next
            path.append(name)
            rest = rest.dropFirst()
        }
        guard let run = spec.run else {
            if rest.contains("--help") || rest.contains("-h") || rest.isEmpty {
                context.out(ArgumentParser.help(spec, path: path))
                return rest.isEmpty && path.count > 1 ? ExitCode.usage : ExitCode.success
            }
            throw UsageError(message: "Unknown option '\(rest.first!)'", command: path)
        }
        let parsed = try ArgumentParser.parse(Array(rest), spec: spec, path: path)
        if parsed.flag("help") {
            context.out(ArgumentParser.help(spec, path: path))
            return ExitCode.success
        }
        return try run(parsed, context)
    }
}
