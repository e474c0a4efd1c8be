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
                discussion: """
                    One CA serves every configuration that shares the state directory. A CA that covers the \
                    protected hosts is kept, whatever else it covers. For a host it lacks, a new CA is made for \
                    it and every host of the old one, and the old one stays trusted (in the bundle) until it \
                    expires, so that a running proxyctl serve and the tools that trust it keep working. --force \
                    makes a CA for exactly the hosts of this proxy.conf and stops trusting the older ones: it \
                    names the hosts it drops and the running serves that must be sent SIGHUP.
                    """,
                options: [
                    AuthEnvironment.configOption,
                    .flag(
                        "force",
                        help:
                            "Make a new CA for exactly these hosts, even when the current one is right; older CAs are trusted no more."
                    ),
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
                    .option(
                        "format", value: "format", values: ["pem", "pkcs12"],
                        help: "pem (default) or pkcs12 (a trust store for Java)."),
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
        let (plan, ca) = try establish(
            hosts: hosts, files: files, force: arguments.flag("force"), context: context, style: .command)
        if case .keep = plan {
            context.err("CA certificate: \(files.certificate)")
            return ExitCode.success
        }
        context.err(
            "  certificate: \(files.certificate)  (SHA-256 \(ca.certificate.fingerprint); the root clients trust)")
        context.err(
            "  signs:       \(files.intermediate)  (the name-constrained intermediate; the root's key is not kept)")
        context.err("  key:         \(files.intermediateKey)  (readable by you alone)")
        context.err("  bundle:      \(files.bundle)  (the system roots plus the local CA)")
        context.err("Make your tools trust it and use the proxy:  eval \"$(proxyctl env)\"")
        return ExitCode.success
    }

    /// How `establish` speaks: as `ca init` (sentences), or inside `init`'s report (indented lines).
    enum Style { case command, report }

    /// Makes sure the local CA of `files` covers `hosts`, never dropping a host another configuration sharing
    /// the state directory may protect unless `force`: the CA is kept when it covers them, else a new one is
    /// made for them and the old CA's hosts, and the old one stays trusted until it expires (`LocalCA.Plan`).
    /// Says what it did, and what a running proxyctl serve needs.
    static func establish(
        hosts: [String], files: LocalCA.Files, force: Bool, context: CommandContext, style: Style
    ) throws -> (LocalCA.Plan, LocalCA) {
        let stateDirectory = PathText.parent(files.directory)
        let now = Int64(time(nil))
        let existing: LocalCA?
        do {
            existing = try LocalCA.load(files)
        } catch {
            guard force else {
                throw CommandFailure(
                    message:
                        "cannot read the local CA in \(files.directory): \(error); proxyctl ca init --force replaces it"
                )
            }
            existing = nil
        }
        let plan = LocalCA.Plan.decide(
            existing: existing.map { ($0.hosts, $0.certificate.notAfter, $0.isLegacy) }, wanted: hosts, force: force,
            now: now)
        // ca init speaks in sentences, init's report in indented lines that start in lower case.
        let say = { (line: String) in
            context.err(style == .report ? "  \(line)" : line.prefix(1).uppercased() + line.dropFirst())
        }
        let list = { (hosts: [String]) in hosts.map(NameConstraints.display).joined(separator: ", ") }
        if case .keep(let extra) = plan, let existing {
            var line =
                style == .report
                ? "the local CA already covers \(list(hosts))"
                : "The local CA already covers \(extra.isEmpty ? "exactly " : "")\(list(hosts)); nothing to do (--force makes a new one)."
            if !extra.isEmpty {
                line +=
                    "\(style == .report ? "; it" : " It") also covers \(list(extra)), kept for the other configurations that share \(stateDirectory) (proxyctl ca init --force makes one for exactly \(list(hosts)) and drops \(list(extra)))"
                    + (style == .report ? "" : ".")
            }
            say(line)
            return (plan, existing)
        }
        let newHosts: [String]
        switch plan {
        case .keep: newHosts = hosts
        case .create(let made), .widen(let made, _), .renew(let made, _), .upgrade(let made, _), .replace(let made, _):
            newHosts = made
        }
        let user = context.environment["USER"] ?? "user"
        let ca: LocalCA
        do {
            ca = try LocalCA.create(hosts: newHosts, label: "\(user)@\(ProcessInfo.processInfo.hostName)")
            let retain: Bool
            if case .replace = plan { retain = false } else { retain = true }
            try ca.save(files, systemRoots: LocalCA.systemRootsPath(), retainPrevious: retain)
        } catch {
            throw CommandFailure(message: "cannot make the local CA: \(error)")
        }
        let pids = ServeState.allRunning(stateDirectory: stateDirectory).map { String($0.pid) }
        let serves = pids.map { "pid \($0)" }
        let running = serves.isEmpty ? "" : " (running: \(serves.joined(separator: ", ")))"
        let hup = "kill -HUP \(pids.isEmpty ? "PID" : pids.joined(separator: " "))"
        let until = existing.map { HumanTime.describe($0.certificate.notAfter, now: now) } ?? ""
        let kept =
            "the CA before it stays trusted (in \(files.bundle)) until it expires, \(until), so a proxyctl serve running with it\(running) and the tools that trust it keep working"
        switch plan {
        case .keep:
            break
        case .create:
            say(
                style == .report
                    ? "made the local CA for \(list(newHosts)) (\(files.certificate))"
                    : "Made the local CA for: \(list(newHosts)).")
        case .widen(_, let added):
            let others = Set(newHosts).subtracting(hosts).sorted()
            say(
                (style == .report
                    ? "made a new local CA for \(list(newHosts)) (\(files.certificate)): it adds \(list(added))"
                    : "Reissued the local CA for: \(list(newHosts)). It adds \(list(added))")
                    + (others.isEmpty
                        ? ""
                        : "; \(list(others)) \(others.count == 1 ? "stays" : "stay") covered for the other configurations that share \(stateDirectory)")
                    + (style == .report ? "" : "."))
            say(style == .report ? kept : kept + ".")
            if !serves.isEmpty {
                say(
                    "a running proxyctl serve\(running) keeps the CA it started with; one whose proxy.conf protects \(list(added)) moves to the new one at its next SIGHUP (\(hup)); no restart is needed"
                        + (style == .report ? "" : "."))
            }
        case .renew(_, let added):
            say(
                (style == .report ? "renewed the local CA" : "Renewed the local CA")
                    + " for \(list(newHosts)) (the old one expires \(until))"
                    + (added.isEmpty ? "" : ", adding \(list(added))") + (style == .report ? "" : "."))
            say(style == .report ? kept : kept + ".")
        case .upgrade(_, let added):
            say(
                (style == .report ? "made a new local CA" : "Made a new local CA")
                    + " for \(list(newHosts))" + (added.isEmpty ? "" : ", adding \(list(added))")
                    + ": its name constraints are on an intermediate, which every client enforces (Java ignores them on the root of the CA before it), and its root's key was never stored"
                    + (style == .report ? "" : "."))
            say(
                "the key of the CA before it is deleted; "
                    + (style == .report ? kept : kept + "."))
        case .replace(_, let dropped):
            say(
                "Made a new local CA for exactly: \(list(newHosts)) (--force); the CAs before it are trusted no more."
                    + (dropped.isEmpty
                        ? ""
                        : " It drops \(list(dropped)): a proxyctl serve or exec of another configuration sharing \(stateDirectory) that protects \(dropped.count == 1 ? "it" : "them") fails until proxyctl ca init --config ITS_FILE makes a CA that covers \(dropped.count == 1 ? "it" : "them") again.")
            )
            if !serves.isEmpty {
                say(
                    "A running proxyctl serve\(running) moves to it by itself within a few seconds (no restart or SIGHUP is needed); connections it opened before keep the CA they started with."
                )
            }
        }
        return (plan, ca)
    }

    static func show(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let (configuration, files) = try files(arguments, context)
        guard let ca = try LocalCA.load(files) else {
            context.out("No local CA yet; run: proxyctl ca init")
            return ExitCode.failure
        }
        let now = Int64(time(nil))
        context.out("Local CA: \(ca.certificate.subject)")
        context.out("  hosts:       \(ca.hosts.map(NameConstraints.display).joined(separator: ", "))")
        context.out("  valid until: \(HumanTime.describe(ca.certificate.notAfter, now: now))")
        context.out("  SHA-256:     \(ca.certificate.fingerprint)")
        context.out("  certificate: \(files.certificate)")
        if ca.isLegacy {
            context.out(
                "  signs with:  the root itself (\(files.key)): Java ignores name constraints on a root, so for Java programs this CA could vouch for any name; run proxyctl ca init to replace it with one whose constraints sit on an intermediate"
            )
        } else {
            context.out("  signs with:  \(files.intermediate) (name-constrained; the root's key was never stored)")
        }
        context.out("  bundle:      \(files.bundle)")
        for retired in LocalCA.retired(files, now: now) {
            context.out(
                "  also trusted: the CA it replaced, for \(retired.hosts.joined(separator: ", ")), until \(HumanTime.describe(retired.certificate.notAfter, now: now)) (a proxyctl serve started before may still use it)"
            )
        }
        let wanted = configuration.origins.tlsHosts
        if !ca.covers(wanted) {
            context.out(
                "  The protected hosts in proxy.conf are now: \(wanted.joined(separator: ", ")); run proxyctl ca init to reissue."
            )
            return ExitCode.failure
        }
        let extra = Set(ca.hosts).subtracting(wanted).sorted()
        if !extra.isEmpty {
            context.out(
                "  \(extra.joined(separator: ", ")): not in this proxy.conf; kept for the other configurations that share the state directory (proxyctl ca init --force drops them)"
            )
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
            try LocalCA.refreshBundle(files, systemRoots: LocalCA.systemRootsPath())
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
            if format == "pkcs12" && context.stdout.isTerminal {
                throw CommandFailure(
                    message: "a PKCS#12 trust store is binary: give --output FILE or redirect standard output")
            }
            context.stdout.write(bytes)
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
            .option(
                "shell", value: "shell", values: ["sh", "fish"], help: "sh (bash, zsh, dash) or fish. Default: sh."),
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

    /// The proxy URL tools should use: the running serve's address (its port may have been 0), else the socket
    /// systemd listens on for it (proxyctl.socket), else the configured one.
    static func proxyURL(_ configuration: Configuration, running: ServeState?, socket: ListenAddress? = nil) -> String {
        var listen = socket ?? configuration.proxy.listen
        if let running, let address = ListenAddress.parse(running.listen) { listen = address }
        let host = listen.host == "0.0.0.0" ? "127.0.0.1" : (listen.host == "::" ? "::1" : listen.host)
        return listen.isIPv6 ? "http://[\(host)]:\(listen.port)" : "http://\(host):\(listen.port)"
    }

    /// `url` with the owner credential in it where the proxy needs one (`OwnerCredential`): the running serve says
    /// so in its record; with none running, this system decides (`Platform.namesSocketOwner`), unless
    /// `proxy_auth_file` makes the user put a user name and password in the URL. Else `url` as it is. The note says
    /// why the credential could not be added.
    static func withOwnerCredential(
        _ url: String, _ configuration: Configuration, running: ServeState?, stateDirectory: String?
    ) -> (url: String, problem: String?) {
        let needed =
            running.map(\.ownerCredential)
            ?? (!Platform.namesSocketOwner && configuration.proxy.proxyAuthFile == nil)
        guard needed, let stateDirectory else { return (url, nil) }
        do {
            return (
                OwnerCredential.proxyURL(url, secret: try OwnerCredential.secret(stateDirectory: stateDirectory)), nil
            )
        } catch {
            return (url, "Protected origins need the proxy's credential, which cannot be had: \(error).")
        }
    }

    /// The variables that point tools at the proxy and the CA bundle, and notes for the user.
    static func environment(
        _ arguments: ParsedArguments, _ context: CommandContext
    ) throws -> (
        variables: [(String, String)], notes: [String]
    ) {
        let loader = ConfigLoader(environment: context.environment)
        let location = loader.locate(flag: arguments.value("config"))
        let configuration = try loader.load(location)
        let stateDirectory =
            configuration.proxy.stateDir ?? TokenStore.defaultStateDirectory(environment: context.environment)
        let running = stateDirectory.flatMap { ServeState.running(stateDirectory: $0) }
        // proxyctl.service serves the standard configuration: its socket is the address until a serve runs.
        var socket: ListenAddress?
        switch location {
        case .standard, .none:
            if running == nil { socket = ServiceUnits.socketAddress(environment: context.environment) }
        default:
            break
        }
        if running == nil && socket == nil && configuration.proxy.listen.port == 0 {
            context.err(
                "proxyctl: listen in proxy.conf has port 0 (any free port) and no proxyctl serve is running; set a fixed port so tools can find the proxy, or use proxyctl exec"
            )
        }
        let (url, problem) = withOwnerCredential(
            proxyURL(configuration, running: running, socket: socket), configuration, running: running,
            stateDirectory: stateDirectory)
        var (variables, notes) = ClientEnvironment.variables(
            configuration, stateDirectory: stateDirectory, proxyURL: url, inherited: context.environment)
        if let problem { notes.insert(problem, at: 0) }
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
            return "'" + value.replacing("\\", with: "\\\\").replacing("'", with: "\\'")
                + "'"
        }
        return "'" + value.replacing("'", with: #"'\''"#) + "'"
    }
}
