import ProxyCore
import ProxyIO
import ProxyOAuth

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

enum LoginCommand {
    static let spec = CommandSpec(
        name: "login",
        abstract: "Sign in to an OpenID provider and keep the tokens.",
        discussion: """
            Opens the browser for Authorization Code + PKCE with a loopback redirect (RFC 8252), or shows a code \
            to enter on another device with --device (RFC 8628). The URL is always printed too, and so is the \
            redirect URI login waits on (http://127.0.0.1:PORT/callback, PORT from redirect_port): it must be \
            registered for the client at the provider. A browser command that fails is reported at once and \
            login keeps waiting for the URL opened by hand; when the browser has not come back after 45s \
            (a third of login_timeout when that is shorter), login names the usual causes (the redirect URI not \
            registered exactly as printed, a wrong client_id) and the key to change. Where no \
            browser can be opened (no display, an SSH session, --no-browser, not a terminal) login says so \
            and offers the device flow. Tokens are stored under state_dir, readable by you alone; a running \
            proxyctl serve uses them without a restart.
            """,
        arguments: [AuthEnvironment.providerArgument],
        options: [
            AuthEnvironment.configOption,
            .flag("device", help: "Use the device flow: enter a code on any device with a browser."),
            .flag("no-browser", help: "Do not open a browser; print the URL (for ssh -L port forwarding)."),
            .flag("create", help: "Ask the provider to create an account (prompt=create)."),
            .option(
                "prompt", value: "login|select_account|consent",
                help: "Ask the provider to sign in again, let you choose the account, or ask for consent again."),
            .option(
                "acr-values", value: "values", help: "Authentication context class references to ask for (acr_values)."),
            .option("max-age", value: "seconds", help: "Require a sign-in no older than this (max_age)."),
            .option("login-hint", value: "hint", help: "Who is signing in (login_hint), e.g. an email address."),
            OptionSpec(
                name: "scope", short: nil, valueName: "scope",
                help: "A scope to ask for instead of the configured ones (repeatable).", repeatable: true),
            .flag(
                "new-key",
                help: "With token_binding = dpop: make a new DPoP key (tokens bound to the old one stop working)."),
        ],
        run: run
    )

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        var options = LoginOptions()
        options.acrValues = arguments.value("acr-values")
        options.loginHint = arguments.value("login-hint")
        options.create = arguments.flag("create")
        if let prompt = arguments.value("prompt") {
            guard LoginOptions.promptValues.contains(prompt) else {
                throw UsageError(
                    message: "--prompt expects one of \(LoginOptions.promptValues.joined(separator: ", "))",
                    command: ["proxyctl", "login"])
            }
            options.prompt = prompt
        }
        if let maxAge = arguments.value("max-age") {
            guard let seconds = Int(maxAge), seconds >= 0 else {
                throw UsageError(message: "--max-age expects a number of seconds", command: ["proxyctl", "login"])
            }
            options.maxAge = seconds
        }
        let scopes = arguments.all("scope").flatMap { $0.split(separator: " ").map(String.init) }
        if !scopes.isEmpty { options.scopes = scopes }
        if arguments.flag("device") && arguments.flag("no-browser") {
            throw UsageError(
                message: "--device already opens no browser; give one of them", command: ["proxyctl", "login"])
        }
        var environment = try AuthEnvironment.load(arguments, context, command: "login")
        defer { environment.loopThread.stop() }
        if !environment.provider.needsSignIn {
            return try machineGrant(environment, context: context)
        }
        options.resourcesOfOrigins(
            environment.configuration, provider: environment.provider.name,
            stateDirectory: environment.store.stateDirectory)
        let provider = environment.provider
        if !arguments.flag("device"), provider.redirectPort > 0,
            !LoopbackReceiver.canListen(port: provider.redirectPort),
            let kept = RegistrationStore(stateDirectory: environment.store.stateDirectory).load(
                issuer: provider.issuer),
            kept.clientID == provider.clientID
        {
            // The client init registered allows its one redirect URI: a taken port is a registration to make again.
            if let registered = try registerAgain(environment, kept: kept, context: context) {
                environment = environment.with(registered)
            } else if let origin = environment.configuration.origins.origins.first(where: {
                $0.provider == provider.name
            }) {
                context.err(
                    "Port \(provider.redirectPort) is taken, and the client proxyctl registered at \(provider.issuer) allows only http://127.0.0.1:\(provider.redirectPort)\(provider.redirectPath): free it, or run proxyctl init --origin \(origin.resource ?? origin.url)\(arguments.value("config").map { " --config \(EnvCommand.quote($0))" } ?? "") --force to register again on a free port."
                )
            }
        }
        _ = try signIn(
            environment, options: options, device: arguments.flag("device"), noBrowser: arguments.flag("no-browser"),
            newKey: arguments.flag("new-key"), context: context)
        return ExitCode.success
    }

    /// Signs in (browser or device flow, DPoP when configured), stores the tokens, reports who signed in, and
    /// clears the pending step-ups this sign-in satisfies.
    static func signIn(
        _ environment: AuthEnvironment, options: LoginOptions, device: Bool, noBrowser: Bool, newKey: Bool,
        context: CommandContext
    ) throws -> TokenSet {
        let console = StderrConsole(context: context, notifyCommand: environment.configuration.proxy.notifyCommand)
        var made = LoginFlow(client: environment.client, store: environment.store, console: console)
        made.configurationFile = environment.configuration.source
        let flow = made
        let launcher = BrowserLauncher(environment: context.environment, interactive: context.isInteractive)
        let provider = environment.provider
        let interactive = context.isInteractive
        let useDeviceFlag = device
        let loginOptions = options
        let stateDirectory = environment.store.stateDirectory

        let tokens: TokenSet
        do {
            tokens = try runBlocking {
                try await prepareDPoP(
                    provider, client: environment.client, stateDirectory: stateDirectory, newKey: newKey,
                    console: console)
                if useDeviceFlag { return try await flow.deviceLogin(options: loginOptions) }
                let browserReason = launcher.unavailableReason(noBrowserFlag: noBrowser)
                if let reason = browserReason {
                    let metadata = try await environment.client.discover()
                    let device =
                        metadata.deviceAuthorizationEndpoint != nil
                        ? "; or sign in with a code instead: proxyctl login --device \(provider.name)" : ""
                    if noBrowser {
                        // Asked for: nothing to offer but the URL, and where it must lead back to.
                        let port = provider.redirectPort == 0 ? "PORT" : String(provider.redirectPort)
                        console.say(
                            "--no-browser: open the URL below in a browser yourself (from another machine, forward the port first: ssh -L \(port):127.0.0.1:\(port) ...)\(device)."
                        )
                    } else {
                        console.say("No browser can be opened here: \(reason).")
                        if !device.isEmpty && interactive
                            && Prompt.yesNo("Sign in with a code on another device instead? [Y/n] ", default: true)
                        {
                            return try await flow.deviceLogin(options: loginOptions)
                        }
                        console.say("Open the URL below in a browser yourself\(device).")
                    }
                }
                let receiver = try await LoopbackReceiver.start(
                    loop: environment.loopThread.loop, port: provider.redirectPort, path: provider.redirectPath)
                defer { receiver.close() }
                let opener: (@Sendable (String) -> String?)? = { url in
                    // A browser command that fails is said at once: the login keeps waiting for the URL opened
                    // by hand.
                    launcher.launch(url) { problem in
                        console.say("The browser did not open the sign-in page: \(problem).")
                        console.say("Open this URL in a browser yourself; the login keeps waiting:")
                        console.say("")
                        console.say("    \(url)")
                        console.say("")
                    }
                }
                return try await flow.browserLogin(
                    options: loginOptions, receiver: receiver, openBrowser: browserReason == nil ? opener : nil)
            }
        } catch let error as AuthError {
            throw error.commandFailure
        } catch let error as StoreError {
            throw CommandFailure(message: error.description)
        }
        let who = tokens.identity.map(StatusCommand.describeIdentity) ?? "(no identity)"
        context.err("Signed in to \(provider.name) as \(who).")
        if let expiresAt = tokens.expiresAt {
            context.err(
                "The access token is valid until \(HumanTime.describe(expiresAt, now: Int64(Date().timeIntervalSince1970)))"
                    + (tokens.refreshToken != nil
                        ? "; proxyctl refreshes it as needed." : "; there is no refresh token, so sign in again then."))
        }
        // A fresh sign-in satisfies max_age; acr_values only when asked for (RFC 9470 §4).
        let steps = StepUpStore(stateDirectory: stateDirectory)
        let origins = Set(environment.configuration.origins.origins.filter { $0.provider == provider.name }.map(\.url))
        let satisfied = steps.load().filter { pending in
            origins.contains(pending.origin)
                && (pending.acrValues == nil || pending.acrValues == (options.acrValues ?? provider.acrValues))
        }
        if !satisfied.isEmpty {
            try? steps.clear(origins: Set(satisfied.map(\.origin)))
            context.err("Step-up satisfied for: \(satisfied.map(\.origin).joined(separator: ", ")); retry the request.")
        }
        return tokens
    }
}

extension LoginCommand {
    /// `proxyctl login` for a provider with a machine grant: nobody signs in; the grant runs once, so that a
    /// mistake in the registration, the key or the subject token shows now rather than at the first request.
    static func machineGrant(_ environment: AuthEnvironment, context: CommandContext) throws -> Int32 {
        let provider = environment.provider
        try environment.prepareClientAuthentication()
        let manager = environment.manager()
        let tokens: TokenSet
        do {
            let generation = (try? environment.store.load(provider.name))?.generation ?? Int64.min
            tokens = try runBlocking { try await manager.refresh(replacing: generation) }
        } catch let error as AuthError {
            throw error.commandFailure
        }
        context.err(
            "[provider \(provider.name)] uses grant = \(provider.grant.rawValue): nobody signs in; proxyctl serve and proxyctl token run the grant when they need a token."
        )
        let expiry =
            tokens.expiresAt.map { " valid until \(HumanTime.describe($0, now: Int64(Date().timeIntervalSince1970)))" }
            ?? ""
        context.err("Obtained an access token with the grant\(expiry).")
        return ExitCode.success
    }
}

/// RFC 9449 for `token_binding = dpop`: when the provider supports ES256 proofs, load (or make) the key and
/// let the client sign with it; otherwise fail (dpop_required) or fall back to Bearer with a warning.
func prepareDPoP(
    _ provider: ProviderConfig, client: ProviderClient, stateDirectory: String, newKey: Bool, console: StderrConsole
) async throws {
    guard provider.tokenBinding == .dpop else {
        if newKey { console.say("Note: --new-key only matters with token_binding = dpop.") }
        return
    }
    let metadata = try await client.discover()
    guard metadata.dpopSigningAlgorithms?.contains("ES256") == true else {
        let offered =
            metadata.dpopSigningAlgorithms.map { $0.isEmpty ? "none" : $0.joined(separator: ", ") } ?? "none advertised"
        if provider.dpopRequired {
            throw AuthError.configuration(
                reason:
                    "[provider \(provider.name)] has token_binding = dpop and dpop_required = true, but the provider does not offer DPoP with ES256 (dpop_signing_alg_values_supported: \(offered))"
            )
        }
        console.say(
            "Warning: the provider does not offer DPoP with ES256 (\(offered)); signing in with Bearer tokens instead.")
        return
    }
    do {
        let key: DPoPKey
        if !newKey, let existing = try DPoPKey.load(stateDirectory: stateDirectory, provider: provider.name) {
            key = existing
        } else {
            key = try DPoPKey.create(stateDirectory: stateDirectory, provider: provider.name)
            console.say("Made a new DPoP key (thumbprint \(key.thumbprint)).")
        }
        await client.setDPoPKey(key)
    } catch let error as AuthError {
        throw error
    } catch {
        throw AuthError.configuration(reason: "cannot prepare the DPoP key: \(error)")
    }
}

enum Prompt {
    /// Asks on the terminal; an empty answer takes the default.
    static func yesNo(_ question: String, default defaultAnswer: Bool) -> Bool {
        OutputFile.standardError.write(question)
        guard let line = readLine() else { return defaultAnswer }
        let answer = line.trimmingOWS().lowercased()
        if answer.isEmpty { return defaultAnswer }
        return answer.hasPrefix("y")
    }
}

extension LoginOptions {
    /// The resources of the provider's origins (RFC 8707), and whether any of them uses the provider's own token.
    /// A wildcard origin's resource names each host's with "*": its hosts are not known before they are used. Those
    /// a serve has met (`SeenHosts`, in the state directory) are asked for, the most recent
    /// `SeenHosts.askedAtLogin`, so that a provider that keeps refreshes to the resources of the sign-in (glewlwyd)
    /// gives each of them its own token; a host met later gets its token from a refresh with its resource, which
    /// such a provider refuses until the next login (which then covers it).
    mutating func resourcesOfOrigins(_ configuration: Configuration, provider: String, stateDirectory: String?) {
        let origins = configuration.origins.origins.filter { $0.provider == provider && $0.secret == nil }
        var resources: [String] = []
        func add(_ resource: String) {
            if !resource.contains("*") && !resources.contains(resource) { resources.append(resource) }
        }
        for resource in origins.compactMap(\.resource) { add(resource) }
        let seen = stateDirectory.map { SeenHosts.load(stateDirectory: $0) } ?? SeenHosts()
        for wildcard in origins where wildcard.isWildcard && wildcard.resource != nil {
            for host in seen.recent(of: wildcard.url, count: SeenHosts.askedAtLogin) {
                // The host's origin as serve makes it, if the configuration still gives it this wildcard.
                guard case .success(let url) = AbsoluteURL.parse(host),
                    let origin = configuration.origins.match(scheme: url.scheme, authority: url.authority),
                    origin.pattern == wildcard.url, let resource = origin.resource
                else { continue }
                add(resource)
            }
        }
        originResources = resources
        providerTokenUsed = origins.contains { $0.tokenKey.isProviderDefault }
    }
}

extension LoginCommand {
    /// The client `proxyctl init` registered allows its one loopback redirect URI, whose port something else holds
    /// now: registers a client again at the provider on a free port, under init's rules (RFC 7591: a native public
    /// client, no secret, the authorization code and refresh token grants and the device grant where offered, the
    /// configured scopes, DPoP-bound with `token_binding = dpop`), keeps the new registration (0600, replaced
    /// atomically) and writes its client id and port into the configuration file (`ConfigEdit`: the rest of the
    /// file as it was), saying so. Nil when the configuration is not a file this can change (the caller says what
    /// to do instead).
    static func registerAgain(
        _ environment: AuthEnvironment, kept: ClientRegistration, context: CommandContext
    ) throws -> ProviderConfig? {
        let provider = environment.provider
        guard let file = environment.configuration.source, FileManager.default.fileExists(atPath: file),
            let text = try? String(contentsOfFile: file, encoding: .utf8)
        else { return nil }
        let taken = "http://127.0.0.1:\(provider.redirectPort)\(provider.redirectPath)"
        context.err(
            "Port \(provider.redirectPort) is taken, and client \(kept.clientID), which proxyctl registered at \(provider.issuer), allows only \(taken): registering a client again on a free port (RFC 7591)."
        )
        let client = environment.client
        let metadata: ProviderMetadata
        do {
            metadata = try runBlocking { try await client.discover() }
        } catch let error as AuthError {
            throw error.commandFailure
        }
        guard let endpoint = metadata.registrationEndpoint else {
            throw CommandFailure(
                message:
                    "\(provider.issuer) has no registration endpoint any more (registration_endpoint, RFC 7591): free port \(provider.redirectPort), or register a public client with a redirect URI http://127.0.0.1:PORT\(provider.redirectPath) there and set client_id and redirect_port in [provider \(provider.name)] of \(file)"
            )
        }
        // Never the port found taken: free again a moment later (another login's listener gone), it would be
        // chosen, registered again for nothing and refused below.
        let chosen = InitCommand.chooseRedirectPort(
            given: nil, replacing: "", provider: provider.name, avoiding: provider.redirectPort, context: context)
        guard chosen.port != provider.redirectPort, LoopbackReceiver.canListen(port: chosen.port) else {
            throw CommandFailure(
                message:
                    "no free port for the sign-in redirect: free port \(provider.redirectPort) and run the login again")
        }
        let device = metadata.deviceAuthorizationEndpoint != nil
        let dpop = provider.tokenBinding == .dpop
        let request = ClientRegistrationRequest(
            redirectURI: chosen.uri, device: device, scopes: provider.scopes, dpopBound: dpop)
        let discovery = OriginDiscovery(
            fetcher: MetadataFetcher(transport: environment.transport, caFile: provider.caFile))
        let issuer = provider.issuer
        context.err("Registering \(request.summary) at \(TargetText.withoutQuery(endpoint)) ...")
        let registration: ClientRegistration
        do {
            registration = try runBlocking {
                try await discovery.registerDroppingRefusedDeviceGrant(request, at: endpoint, issuer: issuer)
            }.registration
        } catch let refused as OriginDiscovery.RegistrationRefused {
            throw CommandFailure(
                message:
                    "\(issuer) refused to register a client again (\(refused.description)): free port \(provider.redirectPort) and run the login again, or register a public client with the redirect URI \(chosen.uri) there and set client_id and redirect_port = \(chosen.port) in [provider \(provider.name)] of \(file)"
            )
        } catch {
            throw CommandFailure(message: "cannot register a client again at \(issuer): \(error)")
        }
        let store = RegistrationStore(stateDirectory: environment.store.stateDirectory)
        do {
            try store.save(registration)
        } catch {
            throw CommandFailure(
                message:
                    "\(issuer) registered client \(registration.clientID), but it cannot be kept in \(store.file(for: issuer)): \(error)"
            )
        }
        let values = [("client_id", registration.clientID), ("redirect_port", String(chosen.port))]
        guard
            let edited = ConfigEdit.setting(values, inSection: "provider", argument: provider.name, of: text),
            case .success(let parsed) = ConfigParser(
                homeDirectory: context.environment["HOME"], baseDirectory: PathText.parent(file)
            ).parse(edited, file: file),
            let updated = parsed.providers.first(where: { $0.name == provider.name }),
            updated.clientID == registration.clientID, updated.redirectPort == chosen.port
        else {
            throw CommandFailure(
                message:
                    "registered client \(registration.clientID) at \(issuer) with the redirect URI \(chosen.uri) (kept in \(store.file(for: issuer))), but \(file) cannot be changed by proxyctl: set client_id = \(registration.clientID) and redirect_port = \(chosen.port) in [provider \(provider.name)] and run the login again"
            )
        }
        _ = try InitCommand.writeChecked(edited, to: file, context)
        context.err(
            "Registered client \(registration.clientID) at \(issuer) with the redirect URI \(chosen.uri) (kept in \(store.file(for: issuer))); \(file) now says client_id = \(registration.clientID) and redirect_port = \(chosen.port)."
        )
        if registration.secretIgnored {
            context.err("The provider sent a client secret nobody asked for; it was not kept.")
        }
        if ServeState.running(stateDirectory: environment.store.stateDirectory) != nil {
            context.err("A running proxyctl serve uses the new client once it reloads its configuration (kill -HUP).")
        }
        return updated
    }
}
