import ProxyCore
import ProxyOAuth
import ProxyTLS

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// `proxyctl key init|show NAME`: the client key for `private_key_jwt` (RFC 7523 §2.2).
enum KeyCommand {
    static let spec = CommandSpec(
        name: "key",
        abstract: "Manage the client key that signs client assertions (private_key_jwt).",
        discussion: """
            For a [provider] with grant = client_credentials (or token_endpoint_auth_method = private_key_jwt): \
            proxyctl signs a short-lived JWT with this key for every token request instead of sending a \
            secret. The private key stays in state_dir (0600, or client_key_file); register the public JWK \
            that init and show print with the provider (as the client's jwks, wrapped as {"keys":[...]}, or \
            with --pem as a PEM public key).
            """,
        subcommands: [
            CommandSpec(
                name: "init", abstract: "Make the provider's client key (0600) and print its public JWK.",
                arguments: [AuthEnvironment.providerArgument],
                options: [
                    AuthEnvironment.configOption,
                    .flag("force", help: "Replace an existing key (the provider must be given the new public key)."),
                    .flag("pem", help: "Print the public key as PEM instead of a JWK."),
                ], run: initialize),
            CommandSpec(
                name: "show", abstract: "Print the public JWK of the provider's client key.",
                arguments: [AuthEnvironment.providerArgument],
                options: [
                    AuthEnvironment.configOption, .flag("pem", help: "Print the public key as PEM instead of a JWK."),
                ], run: show),
        ]
    )

    static func locate(
        _ arguments: ParsedArguments, _ context: CommandContext, command: String
    ) throws -> (
        ProviderConfig, String
    ) {
        let loader = ConfigLoader(environment: context.environment)
        let location = loader.locate(flag: arguments.value("config"))
        let configuration = try loader.load(location)
        let provider = try AuthEnvironment.pick(
            configuration, name: arguments.positionals.first, location: location, command: command)
        guard
            let stateDirectory = configuration.proxy.stateDir
                ?? TokenStore.defaultStateDirectory(environment: context.environment)
        else { throw CommandFailure(message: "no state directory: set HOME, XDG_STATE_HOME or state_dir in [proxy]") }
        return (provider, ClientKey.path(stateDirectory: stateDirectory, provider: provider))
    }

    static func initialize(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let (provider, path) = try locate(arguments, context, command: "key init")
        if FileManager.default.fileExists(atPath: path) && !arguments.flag("force") {
            context.err("proxyctl: \(path) already exists; printing its public key (--force makes a new one)")
            return try print(path: path, pem: arguments.flag("pem"), context: context)
        }
        let key: ClientKey
        do {
            key = try ClientKey.create(path: path)
        } catch {
            throw CommandFailure(message: "cannot make the client key \(path): \(error)")
        }
        context.err("Made the client key of \(provider.name) (ES256) in \(path), readable by you alone.")
        if provider.effectiveClientAuth != .privateKeyJWT {
            context.err(
                "Note: [provider \(provider.name)] does not use it yet: set token_endpoint_auth_method = private_key_jwt"
            )
        }
        context.err("Register this public key with the provider for client \(provider.clientID):")
        return try output(key, pem: arguments.flag("pem"), context: context)
    }

    static func show(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let (provider, path) = try locate(arguments, context, command: "key show")
        guard FileManager.default.fileExists(atPath: path) else {
            throw CommandFailure(message: "no client key at \(path); run: proxyctl key init \(provider.name)")
        }
        return try print(path: path, pem: arguments.flag("pem"), context: context)
    }

    static func print(path: String, pem: Bool, context: CommandContext) throws -> Int32 {
        do {
            guard let key = try ClientKey.load(path: path) else { throw CommandFailure(message: "\(path) is gone") }
            return try output(key, pem: pem, context: context)
        } catch let error as AuthError {
            throw error.commandFailure
        }
    }

    static func output(_ key: ClientKey, pem: Bool, context: CommandContext) throws -> Int32 {
        do {
            if pem {
                context.out(String(decoding: try key.key.publicPEM(), as: UTF8.self).trimmingWhitespace())
            } else {
                context.out(JSON.serialize(.object(try key.publicJWK())))
            }
        } catch {
            throw CommandFailure(message: "cannot export the public key: \(error)")
        }
        return ExitCode.success
    }
}
