import Foundation
import ProxyCore
import ProxyIO
import ProxyOAuth
import ProxyTLS

/// `proxyctl init --issuer URL --client-id ID [--origin URL ...] [--dpop]`: a first proxy.conf without
/// reading the example file. The provider's discovery document is checked first, so a mistake shows now and
/// not at the first login.
enum InitCommand {
    static let spec = CommandSpec(
        name: "init",
        abstract: "Write a first proxy.conf for a provider (checked against its discovery document) and its origins.",
        discussion: """
            Example: proxyctl init --issuer https://login.example.com/realms/dev --client-id proxyctl \
            --origin https://api.example.com. The provider's discovery document must name exactly this issuer; \
            PKCE with S256, the device flow and DPoP are checked and reported. The file is written where \
            proxyctl looks for it (--config, else $PROXYCTL_CONFIG, else ~/.config/proxyctl/proxy.conf) and an \
            existing one is never replaced without --force. It writes redirect_port (--redirect-port, else \
            \(RedirectPort.preferred), the same on every machine, or a free port near it when that one is busy; \
            --force keeps the port of the file replaced) and prints the redirect URI to register for the client \
            at the provider, http://127.0.0.1:PORT/callback, exactly as printed: many providers compare it \
            character for character. With origins, the local CA is made too. Then run the command it prints.
            """,
        options: [
            AuthEnvironment.configOption,
            .option("issuer", value: "url", help: "The provider's issuer URL (required)."),
            .option(
                "client-id", value: "id", help: "The client ID registered for proxyctl, a public client (required)."),
            OptionSpec(
                name: "origin", short: nil, valueName: "url",
                help: "A protected origin, https://HOST[:PORT] (repeatable).", repeatable: true),
            .option("name", value: "name", help: "The provider's name in proxy.conf (default: the issuer's host)."),
            .option(
                "scopes", value: "scopes", help: "Scopes to ask for (default: openid profile email offline_access)."),
            .option(
                "redirect-port", value: "port",
                help:
                    "The loopback port the browser comes back to after sign-in (default: \(RedirectPort.preferred), else a free one near it)."
            ),
            .flag("dpop", help: "Bind tokens with DPoP (token_binding = dpop, dpop_required = true)."),
            .flag("force", help: "Replace an existing configuration file."),
            .option("resolve", value: "pairs", help: "HOST=ADDRESS pairs for [proxy] resolve (development set-ups)."),
            .option("ca-file", value: "file", help: "A PEM file of CA certificates to trust for the provider."),
        ],
        run: run
    )

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let path = ["proxyctl", "init"]
        guard let issuer = arguments.value("issuer") else {
            throw UsageError(message: "Missing expected option '--issuer <url>'", command: path)
        }
        guard let clientID = arguments.value("client-id"), !clientID.isEmpty else {
            throw UsageError(message: "Missing expected option '--client-id <id>'", command: path)
        }
        if let problem = ProviderConfig.checkIssuer(issuer) {
            throw UsageError(message: "--issuer: \(problem)", command: path)
        }
        guard case .success(let issuerURL) = AbsoluteURL.parse(issuer) else {
            throw UsageError(message: "--issuer: expected an https:// URL", command: path)
        }
        let name = arguments.value("name") ?? issuerURL.authority.host
        var origins: [String] = []
        for text in arguments.all("origin") {
            switch OriginConfig.parseURL(text) {
            case .success(let origin): origins.append(origin.url)
            case .failure(let error): throw UsageError(message: "--origin \(text): \(error.message)", command: path)
            }
        }
        var redirectPort: Int? = nil
        if let text = arguments.value("redirect-port") {
            guard let port = Int(text), (1...65535).contains(port) else {
                throw UsageError(message: "--redirect-port expects a port from 1 to 65535", command: path)
            }
            redirectPort = port
        }
        let scopes = arguments.value("scopes") ?? "openid profile email offline_access"
        let dpop = arguments.flag("dpop")
        let loader = ConfigLoader(environment: context.environment)
        let location = loader.locate(flag: arguments.value("config"))
        let file: String
        switch location {
        case .explicit(let given), .standard(let given): file = given
        case .text:
            throw CommandFailure(
                message: "the configuration comes from $PROXYCTL_CONFIG_TEXT; unset it or give --config FILE")
        case .none: throw CommandFailure(message: "no home directory to write proxy.conf in: give --config FILE")
        }
        if FileManager.default.fileExists(atPath: file) && !arguments.flag("force") {
            throw CommandFailure(
                message:
                    "\(file) exists already; proxyctl init never replaces it without --force (check it with proxyctl doctor)"
            )
        }
        let redirect = chooseRedirectPort(given: redirectPort, replacing: file, provider: name, context: context)

        // The provider as written, checked against its discovery document before anything is written.
        var provider = ProviderConfig(name: name)
        provider.issuer = issuer
        provider.clientID = clientID
        provider.scopes = scopes.split(separator: " ").map(String.init)
        provider.caFile = arguments.value("ca-file")
        provider.redirectPort = redirect.port
        var proxySettings = ProxySettings()
        if let resolve = arguments.value("resolve") {
            let parser = ConfigParser(homeDirectory: nil, baseDirectory: nil)
            var probe = Configuration()
            let errors = parser.applyOverrides([("--resolve", "resolve", resolve)], to: &probe)
            if let first = errors.first { throw UsageError(message: "--resolve: \(first.message)", command: path) }
            proxySettings.resolve = probe.proxy.resolve
        }
        context.err("Checking \(issuer) ...")
        let loopThread = LoopThread()
        defer { loopThread.stop() }
        let transport = CurlTransport(
            loop: loopThread.loop, upstreamProxy: nil, bypass: BypassList(), resolve: proxySettings.resolve)
        let client = ProviderClient(config: provider, transport: transport)
        let metadata: ProviderMetadata
        do {
            metadata = try runBlocking { try await client.discover() }
        } catch let error as AuthError {
            throw CommandFailure(message: "cannot use \(issuer) as a provider: \(error.description)")
        }
        var report: [String] = []
        guard metadata.issuer == issuer else {
            throw CommandFailure(
                message:
                    "the discovery document names the issuer \(metadata.issuer), not \(issuer): give --issuer exactly as the provider names itself"
            )
        }
        report.append("issuer matches the discovery document")
        guard metadata.supportsS256 else {
            throw CommandFailure(
                message:
                    "the provider does not offer PKCE with S256 (code_challenge_methods_supported), which proxyctl needs"
            )
        }
        report.append(
            metadata.codeChallengeMethods == nil
                ? "PKCE: not advertised (S256 is assumed)" : "PKCE with S256: offered")
        report.append(
            metadata.deviceAuthorizationEndpoint != nil
                ? "device flow: offered (proxyctl login --device)" : "device flow: not offered (browser sign-in only)")
        let dpopAlgorithms = metadata.dpopSigningAlgorithms ?? []
        if dpop {
            guard dpopAlgorithms.contains("ES256") else {
                throw CommandFailure(
                    message:
                        "--dpop: the provider does not offer DPoP with ES256 (dpop_signing_alg_values_supported: \(dpopAlgorithms.isEmpty ? "none" : dpopAlgorithms.joined(separator: ", ")))"
                )
            }
            report.append("DPoP with ES256: offered, tokens will be bound to a key of yours")
        } else if dpopAlgorithms.contains("ES256") {
            report.append("DPoP with ES256: offered (add --dpop to bind tokens to a key)")
        }

        let text = configurationText(
            provider: provider, origins: origins, dpop: dpop, resolve: arguments.value("resolve"), issuer: issuer)
        // Check what is written with the parser that will read it.
        let directory = (file as NSString).deletingLastPathComponent
        let parser = ConfigParser(
            homeDirectory: context.environment["HOME"], baseDirectory: directory.isEmpty ? "." : directory)
        let configuration: Configuration
        switch parser.parse(text, file: file) {
        case .success(let parsed): configuration = parsed
        case .failure(let errors): throw CommandFailure(message: "internal error in the written file:\n\(errors)")
        }
        do {
            if !directory.isEmpty {
                try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
            }
            try SecureFile.write(Array(text.utf8), to: file, mode: 0o600)
        } catch {
            throw CommandFailure(message: "cannot write \(file): \(error)")
        }
        context.err("Wrote \(file):")
        for line in report { context.err("  \(line)") }
        context.err("  sign-in redirect: \(redirect.uri) (redirect_port = \(redirect.port)\(redirect.note))")
        for origin in origins { context.err("  protected origin \(origin)") }
        if !configuration.origins.tlsHosts.isEmpty {
            guard
                let stateDirectory = configuration.proxy.stateDir
                    ?? TokenStore.defaultStateDirectory(environment: context.environment)
            else { throw CommandFailure(message: "no state directory for the local CA: set HOME or XDG_STATE_HOME") }
            // The state directory, and its CA, may serve other configurations too: init never drops a host of
            // theirs nor stops trusting the CA a running serve uses (CACommand.establish).
            _ = try CACommand.establish(
                hosts: configuration.origins.tlsHosts, files: LocalCA.Files(stateDirectory: stateDirectory),
                force: false, context: context, style: .report)
        }
        let configFlag = arguments.value("config").map { " --config \(EnvCommand.quote($0))" } ?? ""
        context.err("")
        context.err(
            "Register this redirect URI for client \(clientID) at the provider, exactly as written (many providers compare it character for character):"
        )
        context.err("    \(redirect.uri)")
        context.err("Next: sign in, then run your tools through the proxy:")
        context.out(
            "proxyctl login\(configFlag)\(metadata.deviceAuthorizationEndpoint != nil ? "    # or --device without a browser" : "")"
        )
        context.out("proxyctl exec\(configFlag) -- curl \(origins.first ?? "https://api.example.com")/")
        return ExitCode.success
    }

    /// The sign-in redirect of the new file: the port given, else the one of the file replaced, else one
    /// `RedirectPort` chooses (a fixed default, free now and below the kernel's ephemeral range).
    static func chooseRedirectPort(
        given: Int?, replacing file: String, provider name: String, context: CommandContext
    ) -> (port: Int, uri: String, note: String) {
        let path = ProviderConfig(name: name).redirectPath
        let uri = { (port: Int) in "http://127.0.0.1:\(port)\(path)" }
        if let given {
            let busy =
                LoopbackReceiver.canListen(port: given)
                ? "" : "; something listens there now, and a login needs it free"
            return (given, uri(given), busy)
        }
        // The port of the file replaced (init --force) is registered at the provider already.
        var existing: Int? = nil
        if let text = try? String(contentsOfFile: file, encoding: .utf8),
            case .success(let old) = ConfigParser(homeDirectory: nil, baseDirectory: nil).parse(text, file: file)
        {
            existing = old.providers.first { $0.name == name }?.redirectPort
        }
        let ephemeral = (try? String(contentsOfFile: "/proc/sys/net/ipv4/ip_local_port_range", encoding: .utf8))
            .flatMap(RedirectPort.ephemeralRange)
        guard
            let (port, reason) = RedirectPort.choose(
                existing: existing, ephemeral: ephemeral, isFree: LoopbackReceiver.canListen(port:))
        else {
            context.err("  no free port below the ephemeral range for the sign-in redirect; give --redirect-port")
            return (RedirectPort.preferred, uri(RedirectPort.preferred), "")
        }
        switch reason {
        case .preferred: return (port, uri(port), "")
        case .kept: return (port, uri(port), ", as in the file replaced")
        case .fallback(let busy):
            let ports = busy.map(String.init).joined(separator: ", ")
            return (port, uri(port), "; \(busy.count == 1 ? "port" : "ports") \(ports) in use here")
        }
    }

    /// A commented proxy.conf for one provider and its origins.
    static func configurationText(
        provider: ProviderConfig, origins: [String], dpop: Bool, resolve: String?, issuer: String
    ) -> String {
        var text = """
            # proxy.conf written by proxyctl init. Every key is explained in proxy.conf.example; check the file
            # with proxyctl serve --check or proxyctl doctor.

            [proxy]
            # Where the proxy listens (loopback: only this machine can use it).
            listen = 127.0.0.1:8080

            """
        if let resolve { text += "# Host names answered without DNS (development set-ups).\nresolve = \(resolve)\n" }
        text += """

            # The OpenID provider proxyctl signs in to, as a public client (no client secret).
            [provider \(provider.name)]
            issuer = \(issuer)
            client_id = \(provider.clientID)
            scopes = \(provider.scopes.joined(separator: " "))
            # After sign-in the browser comes back to http://127.0.0.1:\(provider.redirectPort)\(provider.redirectPath):
            # register exactly this redirect URI for the client at the provider (or change the port here and
            # register that one).
            redirect_port = \(provider.redirectPort)

            """
        if let caFile = provider.caFile { text += "ca_file = \(caFile)\n" }
        if dpop { text += "# Tokens bound to a key of yours (RFC 9449).\ntoken_binding = dpop\ndpop_required = true\n" }
        for origin in origins {
            text += """

                # A protected origin: its requests get the token of [provider \(provider.name)].
                [origin \(origin)]
                provider = \(provider.name)

                """
        }
        if origins.isEmpty {
            text += """

                # Add the APIs that need the token, for example:
                # [origin https://api.example.com]
                # provider = \(provider.name)
                # then run: proxyctl ca init

                """
        }
        return text
    }
}
