import ProxyCore
import ProxyIO
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

/// `proxyctl init --issuer URL --client-id ID [--origin URL ...] [--origin-ca-file FILE] [--dpop]`: a first proxy.conf without
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
            proxyctl looks for it (--config, else $PROXYCTL_CONFIG, else $XDG_CONFIG_HOME/proxyctl/proxy.conf, \
            ~/.config/proxyctl/proxy.conf when XDG_CONFIG_HOME is not set) and an \
            existing one is never replaced without --force. It writes redirect_port (--redirect-port, else \
            \(RedirectPort.preferred), the same on every machine, or a free port near it when that one is busy; \
            --force keeps the port of the file replaced) and prints the redirect URI to register for the client \
            at the provider, http://127.0.0.1:PORT/callback, exactly as printed: many providers compare it \
            character for character. The provider is named after the issuer's domain (login.example.com: \
            example; an IP address or localhost: default) unless --name says otherwise. listen is 127.0.0.1:8080, \
            or a free port near it when something (another proxyctl serve) listens there. With origins, the \
            local CA is made too; --origin-ca-file names the CA of origins whose certificates come from a private \
            CA (written as ca_file in each [origin]). Then run the command it prints. \
            From the origin alone (proxyctl init --origin https://api.example.com, without --issuer or --client-id): \
            the origin's protected resource metadata (RFC 9728) names its authorization server, whose metadata \
            (RFC 8414, OpenID Connect Discovery) must name exactly that issuer; init names it and, on a terminal, \
            asks before talking to it (--yes does not ask; elsewhere --yes or --issuer is needed). The client is \
            --client-id, else --client-metadata-url where the provider accepts Client ID Metadata Documents, else \
            one init registers (RFC 7591) as a native public client with the redirect URI it prints, kept in the \
            state directory. Scopes, the origin's resource (RFC 8707) and DPoP come from the metadata, and \
            proxy.conf says where each value came from. --ca-file is trusted for these fetches and written where a \
            server needed it.
            """,
        options: [
            AuthEnvironment.configOption,
            .option(
                "issuer", value: "url",
                help:
                    "The provider's issuer URL (without it, the one the --origin's protected resource metadata names; among several it names, the one to use)."
            ),
            .option(
                "client-id", value: "id",
                help:
                    "The client ID registered for proxyctl, a public client (without it, init registers one where the provider allows it)."
            ),
            OptionSpec(
                name: "origin", short: nil, valueName: "url",
                help: "A protected origin, https://HOST[:PORT] (repeatable).", repeatable: true),
            .option(
                "name", value: "name",
                help:
                    "The provider's name in proxy.conf and on the command line (default: the issuer's domain, such as example for login.example.com; default for an IP address)."
            ),
            .option(
                "scopes", value: "scopes", help: "Scopes to ask for (default: openid profile email offline_access)."),
            .option(
                "redirect-port", value: "port",
                help:
                    "The loopback port the browser comes back to after sign-in (default: \(RedirectPort.preferred), else a free one near it)."
            ),
            .flag("dpop", help: "Bind tokens with DPoP (token_binding = dpop, dpop_required = true)."),
            .flag("force", help: "Replace an existing configuration file."),
            .flag(
                "yes",
                help:
                    "With --origin alone: use the authorization server the origin names and register there without asking."
            ),
            .option(
                "client-metadata-url", value: "url",
                help:
                    "With --origin alone: the https URL of a Client ID Metadata Document you publish for proxyctl, used as the client ID where the provider accepts them."
            ),
            .option("resolve", value: "pairs", help: "HOST=ADDRESS pairs for [proxy] resolve (development set-ups)."),
            .option("ca-file", value: "file", help: "A PEM file of CA certificates to trust for the provider."),
            .option(
                "origin-ca-file", value: "file",
                help:
                    "A PEM file of CA certificates to trust for the origins (ca_file in each [origin]), for APIs whose certificates come from a private CA."
            ),
        ],
        run: run
    )

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let path = ["proxyctl", "init"]
        if !arguments.all("origin").isEmpty && (arguments.value("issuer") == nil || arguments.value("client-id") == nil)
        {
            return try runFromOrigin(arguments, context)
        }
        for flag in ["yes", "client-metadata-url"] where arguments.flag(flag) || arguments.value(flag) != nil {
            throw UsageError(
                message: "--\(flag) is for init from the origin alone (without --issuer or --client-id)", command: path)
        }
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
        let derivedName = ProviderConfig.defaultName(issuerHost: issuerURL.authority.host)
        let name = arguments.value("name") ?? derivedName.name
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
        let providerCA = try arguments.value("ca-file").map { try absoluteFile($0, flag: "--ca-file", path: path) }
        let originCA = try arguments.value("origin-ca-file").map {
            try absoluteFile($0, flag: "--origin-ca-file", path: path)
        }
        if originCA != nil && origins.isEmpty {
            throw UsageError(message: "--origin-ca-file is for the origins: give --origin too", command: path)
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
        provider.caFile = providerCA
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
        let transport = CurlTransport(
            loop: loopThread.loop, upstreamProxy: nil, bypass: BypassList(), resolve: proxySettings.resolve)
        // As in init from the origin alone: the transport's libcurl handle goes only once the loop has stopped.
        defer {
            loopThread.stop()
            withExtendedLifetime(transport) {}
        }
        let client = ProviderClient(config: provider, transport: transport)
        let (metadata, spelled) = try discover(client, issuer: issuer)
        provider.issuer = metadata.issuer
        var report: [String] = []
        report.append(spelled ?? "issuer matches the discovery document")
        if arguments.value("name") == nil {
            report.append(
                derivedName.isAddress
                    ? "provider name: \(name) (the issuer's host is an address; --name NAME gives it a name of your choice)"
                    : "provider name: \(name), from the issuer's domain (--name NAME for another)")
        }
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

        let listen = chooseListen(replacing: file, context: context)
        let text = configurationText(
            provider: provider, origins: origins, dpop: dpop, resolve: arguments.value("resolve"),
            issuer: metadata.issuer, listen: listen.address, originCAFile: originCA)
        let configuration = try writeChecked(text, to: file, context)
        context.err("Wrote \(file):")
        for line in report { context.err("  \(line)") }
        context.err("  sign-in redirect: \(redirect.uri) (redirect_port = \(redirect.port)\(redirect.note))")
        context.err("  proxyctl serve listens on \(listen.address)\(listen.note)")
        for origin in origins {
            context.err(
                "  protected origin \(origin)" + (originCA.map { ", its certificate checked against \($0)" } ?? ""))
        }
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
    /// `RedirectPort` chooses (a fixed default, free now and below the kernel's ephemeral range; never `taken`).
    static func chooseRedirectPort(
        given: Int?, replacing file: String, provider name: String, avoiding taken: Int? = nil,
        context: CommandContext
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
        let ephemeral = Platform.ephemeralPorts
        guard
            let (port, reason) = RedirectPort.choose(
                existing: existing, ephemeral: ephemeral,
                isFree: { $0 != taken && LoopbackReceiver.canListen(port: $0) })
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

    /// Where values of a file written from the origin alone came from: comment lines written above each key.
    struct Provenance {
        var provider: [String] = []
        var issuer: [String] = []
        var clientID: [String] = []
        var scopes: [String] = []
        var providerCA: [String] = []
        var dpop: [String] = []
        var origin: [String] = []
        var resource: [String] = []
        var originCA: [String] = []
    }

    /// A commented proxy.conf for one provider and its origins.
    /// Writes the configuration `text` to `file` (0600, atomically, its directory made) once the parser that will
    /// read it accepted it; what it parsed to.
    static func writeChecked(_ text: String, to file: String, _ context: CommandContext) throws -> Configuration {
        let directory = PathText.parent(file)
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
        return configuration
    }

    static func configurationText(
        provider: ProviderConfig, origins: [String], dpop: Bool, resolve: String?, issuer: String,
        listen: String = "127.0.0.1:8080", originCAFile: String? = nil, originResource: String? = nil,
        provenance: Provenance? = nil
    ) -> String {
        func comments(_ lines: [String]) -> String { lines.map { "# \($0)\n" }.joined() }
        var text = """
            # proxy.conf written by proxyctl init. Every key is explained in proxy.conf.example; check the file
            # with proxyctl serve --check or proxyctl doctor.

            [proxy]
            # Where proxyctl serve listens (loopback: only this machine can use it). proxyctl exec needs no
            # serve: without one it runs a proxy of its own on a free port.
            listen = \(listen)

            """
        if let resolve { text += "# Host names answered without DNS (development set-ups).\nresolve = \(resolve)\n" }
        text += "\n"
        text += comments(
            provenance?.provider ?? ["The OpenID provider proxyctl signs in to, as a public client (no client secret)."]
        )
        text += "[provider \(provider.name)]\n"
        text += comments(provenance?.issuer ?? [])
        text += "issuer = \(issuer)\n"
        text += comments(provenance?.clientID ?? [])
        text += "client_id = \(provider.clientID)\n"
        text += comments(provenance?.scopes ?? [])
        text += "scopes = \(provider.scopes.joined(separator: " "))\n"
        text += """
            # After sign-in the browser comes back to http://127.0.0.1:\(provider.redirectPort)\(provider.redirectPath):
            # register exactly this redirect URI for the client at the provider (or change the port here and
            # register that one).
            redirect_port = \(provider.redirectPort)

            """
        if let caFile = provider.caFile { text += comments(provenance?.providerCA ?? []) + "ca_file = \(caFile)\n" }
        if dpop {
            text += comments(provenance?.dpop ?? ["Tokens bound to a key of yours (RFC 9449)."])
            text += "token_binding = dpop\ndpop_required = true\n"
        }
        for origin in origins {
            text += "\n"
            text += comments(
                provenance?.origin ?? ["A protected origin: its requests get the token of [provider \(provider.name)]."]
            )
            text += "[origin \(origin)]\nprovider = \(provider.name)\n"
            if let originResource {
                text += comments(provenance?.resource ?? [])
                text += "resource = \(originResource)\n"
            }
            if let originCAFile {
                text += comments(
                    provenance?.originCA
                        ?? [
                            "Its certificate comes from a private CA: trusted from this file instead of the system's roots."
                        ])
                text += "ca_file = \(originCAFile)\n"
            }
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

    /// A file given on the command line, as an absolute path (proxy.conf resolves relative paths against its own
    /// directory, not the one init ran in); it must exist.
    static func absoluteFile(_ given: String, flag: String, path: [String]) throws -> String {
        let absolute =
            given.hasPrefix("/") || given.hasPrefix("~")
            ? given : FileManager.default.currentDirectoryPath + "/" + given
        let home = ProcessInfo.processInfo.environment["HOME"] ?? ""
        let expanded = absolute.hasPrefix("~/") ? home + absolute.dropFirst() : absolute
        guard FileManager.default.isReadableFile(atPath: expanded) else {
            throw UsageError(message: "\(flag) \(given): no such readable file", command: path)
        }
        return absolute
    }

    /// The provider's metadata for `issuer` as given by --issuer, and a report line when the provider spells its
    /// issuer with or without a trailing slash where --issuer did not (the provider's spelling is written: an
    /// issuer must match exactly, and a slash is nobody's intent). A wrong issuer is named with the URLs tried
    /// and, when one of its parents has a discovery document, the issuer meant.
    static func discover(_ client: ProviderClient, issuer: String) throws -> (ProviderMetadata, String?) {
        let cannot = "cannot use \(issuer) as a provider"
        let probe: ProviderClient.DiscoveryProbe
        do {
            probe = try runBlocking { try await client.probe(issuer: issuer) }
        } catch let error as AuthError {
            throw CommandFailure(message: "\(cannot): \(error.description)")
        }
        switch probe {
        case .found(let url, let document):
            guard let named = document["issuer"]?.string else {
                throw CommandFailure(message: "\(cannot): the discovery document at \(url) names no issuer")
            }
            var note: String? = nil
            if named != issuer {
                let trimmed = { (text: String) in text.hasSuffix("/") ? String(text.dropLast()) : text }
                guard trimmed(named) == trimmed(issuer) else {
                    throw CommandFailure(
                        message:
                            "the discovery document at \(url) names the issuer \(named), not \(issuer) (--issuer): give --issuer \(named), exactly as the provider names itself"
                    )
                }
                note =
                    "issuer: \(named), as the provider names itself (--issuer \(issuer.hasSuffix("/") ? "had a trailing slash" : "lacked the trailing slash"); an issuer must match exactly)"
            }
            switch ProviderMetadata.parse(document, expectedIssuer: named) {
            case .success(let metadata): return (metadata, note)
            case .failure(let error): throw CommandFailure(message: "\(cannot): \(error.description)")
            }
        case .missing(let tried):
            var hint =
                "; check --issuer: it is the issuer URL your provider documents (its discovery document's issuer)"
            for candidate in ProviderMetadata.issuerCandidates(for: issuer) {
                guard case .found(_, let document)? = try? runBlocking({ try await client.probe(issuer: candidate) }),
                    let named = document["issuer"]?.string
                else { continue }
                hint = "; \(named) has one: did you mean --issuer \(named)?"
                break
            }
            throw CommandFailure(
                message: "\(cannot): no discovery document (\(ProviderMetadata.describeTried(tried)))\(hint)")
        }
    }

    /// Where the new file's serve listens: 127.0.0.1:8080, the `listen` of the file replaced (init --force), or,
    /// when something listens on 8080 already (typically the serve of another configuration), the next free
    /// port, so that both configurations can be served at once. The note says why.
    static func chooseListen(replacing file: String, context: CommandContext) -> (address: String, note: String) {
        if let text = try? String(contentsOfFile: file, encoding: .utf8),
            case .success(let old) = ConfigParser(homeDirectory: nil, baseDirectory: nil).parse(text, file: file),
            text.contains("\nlisten = ")
        {
            return (old.proxy.listen.description, ", as in the file replaced")
        }
        let preferred = ListenAddress.default.port
        if LoopbackReceiver.canListen(port: preferred) { return ("127.0.0.1:\(preferred)", "") }
        let serves = TokenStore.defaultStateDirectory(environment: context.environment).map {
            ServeState.allRunning(stateDirectory: $0)
        }
        let holder = serves?.first { ListenAddress.parse($0.listen)?.port == preferred }
        let who =
            holder.map { "proxyctl serve (pid \($0.pid)\($0.configuration.map { ", config \($0)" } ?? ""))" }
            ?? "another program"
        for port in (preferred + 1)...(preferred + 99) where LoopbackReceiver.canListen(port: port) {
            return ("127.0.0.1:\(port)", "; \(who) listens on \(preferred)")
        }
        return ("127.0.0.1:\(preferred)", "; \(who) listens there now: change listen before proxyctl serve")
    }
}
