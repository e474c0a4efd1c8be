import Foundation
import ProxyCore
import ProxyOAuth
import ProxyTLS

/// `proxyctl ca init|show|export`: the local CA that signs certificates for the protected hosts.
enum CACommand {
    static let spec = CommandSpec(
        name: "ca",
        abstract: "Manage the local CA that signs certificates for protected origins.",
        discussion: """
            The CA's name constraints permit exactly the protected https hosts (no subdomains, no IP \
            addresses), so even its stolen key could not impersonate any other site. When the protected \
            hosts change it must be reissued (ca init) and trusted again.
            """,
        subcommands: [
            CommandSpec(
                name: "init",
                abstract: "Make the local CA for the protected hosts in proxy.conf (reissue it when they changed).",
                options: [
                    AuthEnvironment.configOption,
                    .flag("force", help: "Make a new CA even when the current one is still right."),
                ], run: initialize),
            CommandSpec(
                name: "show", abstract: "Show the local CA: hosts, fingerprint, validity, files.",
                options: [AuthEnvironment.configOption], run: show),
            CommandSpec(
                name: "export",
                abstract:
                    "Print the CA certificate (PEM), or with --bundle the system roots plus it; --format pkcs12 for Java.",
                discussion: """
                    PEM goes to standard output. A PKCS#12 trust store (--format pkcs12) is binary: it goes to \
                    --output FILE, or to standard output when that is not a terminal. Java reads it with \
                    -Djavax.net.ssl.trustStore=FILE -Djavax.net.ssl.trustStoreType=PKCS12 \
                    -Djavax.net.ssl.trustStorePassword=changeit (every certificate is a trusted entry; keytool \
                    -importcert would take only the first certificate of a bundle).
                    """,
                options: [
                    AuthEnvironment.configOption,
                    .flag("bundle", help: "The merged bundle: the system's roots plus the local CA."),
                    .option("format", value: "format", help: "pem (default) or pkcs12 (a trust store for Java)."),
                    .option(
                        "output", short: "o", value: "file", help: "Write to this file instead of standard output."),
                ], run: export),
        ]
    )

    static func files(_ arguments: ParsedArguments, _ context: CommandContext) throws -> (Configuration, LocalCA.Files)
    {
        let loader = ConfigLoader(environment: context.environment)
        let configuration = try loader.load(loader.locate(flag: arguments.value("config")))
        guard
            let stateDirectory = configuration.proxy.stateDir
                ?? TokenStore.defaultStateDirectory(environment: context.environment)
        else { throw CommandFailure(message: "no state directory: set HOME, XDG_STATE_HOME or state_dir in [proxy]") }
        return (configuration, LocalCA.Files(stateDirectory: stateDirectory))
    }

    static func initialize(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let (configuration, files) = try files(arguments, context)
        let hosts = configuration.origins.tlsHosts
        guard !hosts.isEmpty else {
            throw CommandFailure(
                message:
                    "no https origin is configured: add an [origin https://HOST] section first (see proxy.conf.example)"
            )
        }
        let existing = try? LocalCA.load(files)
        if let existing, existing.hosts == hosts, !arguments.flag("force"),
            existing.certificate.notAfter > Int64(time(nil)) + 30 * 86400
        {
            context.err(
                "The local CA already covers exactly \(hosts.joined(separator: ", ")); nothing to do (--force makes a new one)."
            )
            context.err("CA certificate: \(files.certificate)")
            return ExitCode.success
        }
        let user = context.environment["USER"] ?? "user"
        let host = ProcessInfo.processInfo.hostName
        let ca: LocalCA
        do {
            ca = try LocalCA.create(hosts: hosts, label: "\(user)@\(host)")
            try ca.save(files, systemRoots: LocalCA.systemRootsPath())
        } catch {
            throw CommandFailure(message: "cannot make the local CA: \(error)")
        }
        context.err(
            existing == nil
                ? "Made the local CA for: \(hosts.joined(separator: ", "))."
                : "Reissued the local CA for: \(hosts.joined(separator: ", ")). Tools that trusted the old one must trust this one instead."
        )
        context.err("  certificate: \(files.certificate)  (SHA-256 \(ca.certificate.fingerprint))")
        context.err("  key:         \(files.key)  (readable by you alone)")
        context.err("  bundle:      \(files.bundle)  (the system roots plus this CA)")
        context.err("Make your tools trust it and use the proxy:  eval \"$(proxyctl env)\"")
        context.err("Restart a running proxyctl serve to use the new CA.")
        return ExitCode.success
    }

    static func show(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let (configuration, files) = try files(arguments, context)
        guard let ca = try LocalCA.load(files) else {
            context.out("No local CA yet; run: proxyctl ca init")
            return ExitCode.failure
        }
        let now = Int64(time(nil))
        context.out("Local CA: \(ca.certificate.subject)")
        context.out("  hosts:       \(ca.hosts.joined(separator: ", "))")
        context.out("  valid until: \(HumanTime.describe(ca.certificate.notAfter, now: now))")
        context.out("  SHA-256:     \(ca.certificate.fingerprint)")
        context.out("  certificate: \(files.certificate)")
        context.out("  bundle:      \(files.bundle)")
        let wanted = configuration.origins.tlsHosts
        if wanted != ca.hosts {
            context.out(
                "  The protected hosts in proxy.conf are now: \(wanted.joined(separator: ", ")); run proxyctl ca init to reissue."
            )
            return ExitCode.failure
        }
        return ExitCode.success
    }

    static func export(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let (_, files) = try files(arguments, context)
        guard let ca = try LocalCA.load(files) else {
            throw CommandFailure(message: "no local CA yet; run: proxyctl ca init")
        }
        let format = arguments.value("format") ?? "pem"
        guard format == "pem" || format == "pkcs12" else {
            throw UsageError(message: "--format expects pem or pkcs12", command: ["proxyctl", "ca", "export"])
        }
        var pem = try ca.certificate.pem()
        if arguments.flag("bundle") {
            try ca.save(files, systemRoots: LocalCA.systemRootsPath())
            guard let data = FileManager.default.contents(atPath: files.bundle) else {
                throw CommandFailure(message: "\(files.bundle) cannot be read")
            }
            pem = Array(data)
        }
        let bytes: [UInt8]
        if format == "pkcs12" {
            do {
                bytes = try TrustStore.pkcs12(pem: pem)
            } catch {
                throw CommandFailure(message: "\(error)")
            }
        } else {
            bytes = pem
        }
        if let output = arguments.value("output") {
            do {
                try SecureFile.write(bytes, to: output, mode: 0o644)
            } catch {
                throw CommandFailure(message: "\(error)")
            }
            context.err(
                "Wrote \(output)" + (format == "pkcs12" ? " (trust store password: \(TrustStore.password))" : ""))
        } else {
            if format == "pkcs12" && isatty(1) != 0 && context.stdout === FileHandle.standardOutput {
                throw CommandFailure(
                    message: "a PKCS#12 trust store is binary: give --output FILE or redirect standard output")
            }
            context.stdout.write(Data(bytes))
        }
        return ExitCode.success
    }
}

/// `proxyctl env`: lines for a shell to `eval`, pointing tools at the proxy and the merged CA bundle.
enum EnvCommand {
    static let spec = CommandSpec(
        name: "env",
        abstract: "Print shell lines that point your tools at the proxy and make them trust the local CA.",
        discussion: """
            Use: eval "$(proxyctl env)" (fish: proxyctl env --shell fish | source). The trust variables \
            point at a bundle of the system's roots plus the local CA, so hosts that are not intercepted \
            still verify. It also sets what runtimes that ignore those variables need: NODE_USE_ENV_PROXY and a \
            preload in NODE_OPTIONS (Node), WGETRC (wget), JAVA_TOOL_OPTIONS with a PKCS#12 trust store (Java). \
            docs/clients.md lists them per runtime. The address is the running proxyctl serve's, else the \
            configured listen address.
            """,
        options: [
            AuthEnvironment.configOption,
            .option("shell", value: "shell", help: "sh (bash, zsh, dash) or fish. Default: sh."),
        ],
        run: run
    )

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let shell = arguments.value("shell") ?? "sh"
        guard shell == "sh" || shell == "fish" || shell == "bash" || shell == "zsh" else {
            throw UsageError(message: "--shell expects sh or fish", command: ["proxyctl", "env"])
        }
        let (variables, notes) = try environment(arguments, context)
        for note in notes { context.out("# \(note)") }
        for (name, value) in variables {
            context.out(
                shell == "fish" ? "set -gx \(name) \(quote(value, fish: true));" : "export \(name)=\(quote(value));")
        }
        return ExitCode.success
    }

    /// The proxy URL tools should use: the running serve's address (its port may have been 0), else the
    /// configured one.
    static func proxyURL(_ configuration: Configuration, running: ServeState?) -> String {
        var listen = configuration.proxy.listen
        if let running, let address = ListenAddress.parse(running.listen) { listen = address }
        let host = listen.host == "0.0.0.0" ? "127.0.0.1" : (listen.host == "::" ? "::1" : listen.host)
        return listen.isIPv6 ? "http://[\(host)]:\(listen.port)" : "http://\(host):\(listen.port)"
    }

    /// The variables that point tools at the proxy and the CA bundle, and notes for the user.
    static func environment(
        _ arguments: ParsedArguments, _ context: CommandContext
    ) throws -> (
        variables: [(String, String)], notes: [String]
    ) {
        let loader = ConfigLoader(environment: context.environment)
        let configuration = try loader.load(loader.locate(flag: arguments.value("config")))
        let stateDirectory =
            configuration.proxy.stateDir ?? TokenStore.defaultStateDirectory(environment: context.environment)
        let running = stateDirectory.flatMap { ServeState.running(stateDirectory: $0) }
        if running == nil && configuration.proxy.listen.port == 0 {
            context.err(
                "proxyctl: listen in proxy.conf has port 0 (any free port) and no proxyctl serve is running; set a fixed port so tools can find the proxy, or use proxyctl exec"
            )
        }
        let url = proxyURL(configuration, running: running)
        var (variables, notes) = ClientEnvironment.variables(
            configuration, stateDirectory: stateDirectory, proxyURL: url, inherited: context.environment)
        if configuration.proxy.proxyAuthFile != nil || running?.proxyAuthentication == true {
            let hostPort = url.dropFirst("http://".count)
            notes.insert(
                "This proxy requires a user name and password: put them in the URL yourself (http://USER:PASSWORD@\(hostPort)).",
                at: 0)
        }
        return (variables, notes)
    }

    /// Single-quoted: sh ends the quote to escape one ('\''); fish escapes inside quotes (\' and \\).
    static func quote(_ value: String, fish: Bool = false) -> String {
        if fish {
            return "'" + value.replacingOccurrences(of: "\\", with: "\\\\").replacingOccurrences(of: "'", with: "\\'")
                + "'"
        }
        return "'" + value.replacingOccurrences(of: "'", with: #"'\''"#) + "'"
    }
}
