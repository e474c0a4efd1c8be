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
                name: "export", abstract: "Print the CA certificate (PEM), or with --bundle the system roots plus it.",
                options: [
                    AuthEnvironment.configOption,
                    .flag("bundle", help: "Print the merged bundle: the system's roots plus the local CA."),
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
        if arguments.flag("bundle") {
            try ca.save(files, systemRoots: LocalCA.systemRootsPath())
            guard let data = FileManager.default.contents(atPath: files.bundle) else {
                throw CommandFailure(message: "\(files.bundle) cannot be read")
            }
            context.stdout.write(data)
        } else {
            context.stdout.write(Data(try ca.certificate.pem()))
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
            still verify. Java needs the CA in a keystore instead (see proxyctl ca export).
            """,
        options: [
            AuthEnvironment.configOption,
            .option("shell", value: "shell", help: "sh (bash, zsh, dash) or fish. Default: sh."),
        ],
        run: run
    )

    /// Variables that take a whole bundle, for the runtimes that read them.
    static let bundleVariables = [
        "SSL_CERT_FILE",  // OpenSSL, Go, Ruby, Python's ssl
        "CURL_CA_BUNDLE",  // curl
        "REQUESTS_CA_BUNDLE",  // Python requests
        "PIP_CERT",  // pip
        "GIT_SSL_CAINFO",  // git
        "AWS_CA_BUNDLE",  // AWS CLI and SDKs
        "HTTPLIB2_CA_CERTS",  // httplib2 (gcloud)
        "CARGO_HTTP_CAINFO",  // cargo
        "DENO_CERT",  // Deno
    ]

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

    /// The variables that point tools at the proxy and the CA bundle, and notes for the user.
    static func environment(
        _ arguments: ParsedArguments, _ context: CommandContext
    ) throws -> (
        variables: [(String, String)], notes: [String]
    ) {
        let loader = ConfigLoader(environment: context.environment)
        let configuration = try loader.load(loader.locate(flag: arguments.value("config")))
        let listen = configuration.proxy.listen
        if listen.port == 0 {
            context.err(
                "proxyctl: listen in proxy.conf has port 0 (any free port); set a fixed port so tools can find the proxy"
            )
        }
        let host = listen.host == "0.0.0.0" ? "127.0.0.1" : (listen.host == "::" ? "::1" : listen.host)
        let proxyURL = listen.isIPv6 ? "http://[\(host)]:\(listen.port)" : "http://\(host):\(listen.port)"
        var variables: [(String, String)] = [
            ("HTTPS_PROXY", proxyURL), ("https_proxy", proxyURL), ("HTTP_PROXY", proxyURL), ("http_proxy", proxyURL),
        ]
        var notes: [String] = []
        if configuration.proxy.proxyAuthFile != nil {
            notes.append(
                "This proxy requires a user name and password: put them in the URL yourself (http://USER:PASSWORD@\(host):\(listen.port))."
            )
        }
        if let stateDirectory = configuration.proxy.stateDir
            ?? TokenStore.defaultStateDirectory(environment: context.environment)
        {
            let files = LocalCA.Files(stateDirectory: stateDirectory)
            if let ca = try? LocalCA.load(files) {
                // Rewrite the bundle so that it carries the system's current roots.
                try? ca.save(files, systemRoots: LocalCA.systemRootsPath())
                for name in bundleVariables { variables.append((name, files.bundle)) }
                // Node adds these to its own roots rather than replacing them.
                variables.append(("NODE_EXTRA_CA_CERTS", files.certificate))
            } else if !configuration.origins.tlsHosts.isEmpty {
                notes.append("No local CA yet: run proxyctl ca init, then this command again.")
            }
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

/// `proxyctl exec -- COMMAND [ARGS...]`: runs a command with the variables of `proxyctl env` set.
enum ExecCommand {
    static let spec = CommandSpec(
        name: "exec",
        abstract: "Run a command with HTTPS_PROXY and the CA bundle variables set (what proxyctl env prints).",
        discussion: """
            Example: proxyctl exec -- git clone https://git.example.com/team/repo.git. The command replaces \
            proxyctl (its exit code is the command's); nothing else of the environment changes. Put -- before \
            the command so its options are not read as proxyctl's.
            """,
        arguments: [
            ArgumentSpec(name: "command", help: "The program to run, then its arguments.", optional: false),
            ArgumentSpec(name: "arguments", help: "Its arguments (any number)."),
        ],
        options: [AuthEnvironment.configOption],
        run: run
    )

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let words = arguments.positionals
        guard let program = words.first else {
            throw UsageError(message: "Missing expected argument '<command>'", command: ["proxyctl", "exec"])
        }
        let (variables, notes) = try EnvCommand.environment(arguments, context)
        for note in notes { context.err("proxyctl: \(note)") }
        var environment = context.environment
        for (name, value) in variables { environment[name] = value }
        guard let path = BrowserLauncher.which(program, path: environment["PATH"]) else {
            throw CommandFailure(message: "\(program): command not found", exitCode: 127)
        }
        let argv = words.map { strdup($0) } + [nil]
        let envp = environment.map { strdup("\($0.key)=\($0.value)") } + [nil]
        execve(path, argv, envp)
        throw CommandFailure(message: "\(program): cannot run it: \(String(cString: strerror(errno)))", exitCode: 126)
    }
}
