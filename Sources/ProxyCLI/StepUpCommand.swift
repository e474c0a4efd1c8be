import ProxyCore
import ProxyOAuth

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// `proxyctl step-up [ORIGIN]`: sign in again the way a protected origin asked (RFC 9470).
enum StepUpCommand {
    static let spec = CommandSpec(
        name: "step-up",
        abstract: "Sign in again as a protected origin demanded (acr_values, max_age), so the next request succeeds.",
        discussion: """
            When an origin answers 401 with error="insufficient_user_authentication", the proxy passes the \
            answer on, records the challenge and names this command. step-up signs in to the origin's \
            provider with the recorded acr_values and max_age; the running proxy picks up the new tokens, so \
            retrying the request succeeds. proxyctl status lists pending step-ups.
            """,
        arguments: [
            ArgumentSpec(
                name: "origin", help: "The origin (https://HOST[:PORT]); may be omitted when one step-up is pending.")
        ],
        options: [
            AuthEnvironment.configOption,
            .flag("device", help: "Use the device flow."),
            .flag("no-browser", help: "Do not open a browser; print the URL."),
        ],
        run: run
    )

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let loader = ConfigLoader(environment: context.environment)
        let location = loader.locate(flag: arguments.value("config"))
        let configuration = try loader.load(location)
        guard
            let stateDirectory = configuration.proxy.stateDir
                ?? TokenStore.defaultStateDirectory(environment: context.environment)
        else { throw CommandFailure(message: "no state directory: set HOME, XDG_STATE_HOME or state_dir in [proxy]") }
        let pending = StepUpStore(stateDirectory: stateDirectory).load()
        let challenge: PendingStepUp
        if let name = arguments.positionals.first {
            guard case .success(let origin) = OriginConfig.parseURL(name) else {
                throw UsageError(
                    message: "expected an origin such as https://api.example.com, got '\(name)'",
                    command: ["proxyctl", "step-up"])
            }
            guard let found = pending.first(where: { $0.origin == origin.url }) else {
                throw CommandFailure(
                    message:
                        "no step-up is pending for \(origin.url)\(pending.isEmpty ? "" : "; pending: \(pending.map(\.origin).joined(separator: ", "))") (proxyctl login --acr-values ... --max-age ... signs in with explicit requirements)"
                )
            }
            challenge = found
        } else {
            switch pending.count {
            case 0:
                context.err("No step-up is pending.")
                return ExitCode.success
            case 1:
                challenge = pending[0]
            default:
                throw UsageError(
                    message:
                        "several step-ups are pending (\(pending.map(\.origin).joined(separator: ", "))); name one",
                    command: ["proxyctl", "step-up"])
            }
        }
        guard let provider = configuration.providers.first(where: { $0.name == challenge.provider }) else {
            throw CommandFailure(
                message: "the provider \(challenge.provider) of \(challenge.origin) is no longer configured")
        }
        let requirement = challenge.requirement
        context.err(
            challenge.scope != nil
                ? "\(challenge.origin) needs \(requirement); signing in to \(provider.name) asking for it too."
                : "\(challenge.origin) asked for a stronger sign-in\(requirement.isEmpty ? "" : " (\(requirement))"); signing in to \(provider.name)."
        )
        var args = arguments
        args.positionals = [provider.name]
        let environment = try AuthEnvironment.load(args, context, command: "step-up")
        defer { environment.loopThread.stop() }
        var options = LoginOptions()
        options.resourcesOfOrigins(
            environment.configuration, provider: provider.name, stateDirectory: environment.store.stateDirectory)
        options.acrValues = challenge.acrValues
        options.maxAge = challenge.maxAge
        if let scope = challenge.scope {
            // The provider's scopes and the one the origin named (RFC 6750 §3.1): a wider grant, for this sign-in.
            var scopes = provider.scopes
            for wanted in scope.split(separator: " ").map(String.init) where !scopes.contains(wanted) {
                scopes.append(wanted)
            }
            options.scopes = scopes
        }
        _ = try LoginCommand.signIn(
            environment, options: options, device: arguments.flag("device"), noBrowser: arguments.flag("no-browser"),
            newKey: false, context: context)
        return ExitCode.success
    }
}
