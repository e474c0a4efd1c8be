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

enum ServeCommand {
    static let spec = CommandSpec(
        name: "serve",
        abstract: "Run the forward proxy.",
        discussion: """
            Set it as HTTPS_PROXY and HTTP_PROXY for your tools. Traffic that is not for a protected origin \
            passes through untouched: CONNECT becomes a blind tunnel, plain http:// requests are forwarded.
            The configuration comes from --config, else $PROXYCTL_CONFIG, else \
            $XDG_CONFIG_HOME/proxyctl/proxy.conf; with no file at all proxyctl is a pure passthrough proxy \
            on 127.0.0.1:8080. SIGHUP reloads the configuration; SIGTERM and SIGINT let open transfers \
            finish and a token refresh in flight store its answer (within shutdown_grace), then exit.
            Under systemd (proxyctl.socket and proxyctl.service, systemctl --user enable --now proxyctl.socket) \
            it accepts on the socket systemd passes (LISTEN_FDS) instead of listen, and reports readiness, \
            reloads and the shutdown to $NOTIFY_SOCKET.
            """,
        options: [
            .option("config", short: "c", value: "file", help: "The configuration file (proxy.conf)."),
            .option(
                "listen", value: "host:port",
                help: "Listen here instead of the configured address; port 0 picks a free port."),
            .option(
                "log-level", value: "level", values: LogLevel.allCases.map(\.description),
                help: "error, warn, info or debug (overrides log_level)."),
            .flag("check", help: "Check the configuration and exit: 0 when it is valid, 1 with every error otherwise."),
        ],
        run: run
    )

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let loader = ConfigLoader(environment: context.environment)
        let location = loader.locate(flag: arguments.value("config"))
        var configuration = try loader.load(location)
        if let level = arguments.value("log-level") {
            guard let parsed = LogLevel(name: level) else {
                throw UsageError(
                    message: "--log-level expects error, warn, info or debug", command: ["proxyctl", "serve"])
            }
            configuration.proxy.logLevel = parsed
        }
        try loader.finish(&configuration, listen: arguments.value("listen"))
        let credentials = try loader.loadCredentials(configuration.proxy)
        let stateDirectory =
            configuration.proxy.stateDir ?? TokenStore.defaultStateDirectory(environment: context.environment)
        let ca = try loadLocalCA(configuration, stateDirectory: stateDirectory)
        if arguments.flag("check") {
            context.out("\(configuration.source ?? "built-in defaults"): configuration is valid")
            return ExitCode.success
        }
        // Socket activation (proxyctl.socket): the socket systemd listens on for us, taken before anything else
        // runs so that no command started later inherits it.
        let sockets = Platform.takeListenSockets()

        let logger = Logger(level: configuration.proxy.logLevel, format: configuration.proxy.logFormat)
        if Platform.portable { logger.always(Platform.portableSummary) }
        let ownerCredential = Self.ownerCredential(
            configuration, credentials: credentials, stateDirectory: stateDirectory, logger: logger)
        switch location {
        case .standard(let path) where configuration.source == nil:
            logger.info("no configuration file at \(path); running as a passthrough proxy with defaults")
        default:
            break
        }
        if let ca, ca.isLegacy {
            logger.warn(
                "the local CA's name constraints are on its root, which Java ignores (for Java programs it could vouch for any name): run proxyctl ca init to replace it with one whose intermediate carries them, then restart this serve (until then it keeps signing with this CA, which the bundle keeps trusting)"
            )
        }
        let fileLimit = raiseFileLimit(logger: logger, settings: configuration.proxy)

        EventLoop.initializeLibraries()
        let loop = EventLoop()
        let interception = try ProxyRuntime.interception(
            configuration, stateDirectory: stateDirectory, loop: loop, ca: ca)
        let runtimeOrigins = RuntimeOrigins(
            origins: configuration.origins.origins, managers: interception?.managers ?? [:])
        let overrides = (listen: arguments.value("listen"), level: arguments.value("log-level"))
        // What the running proxy was built from; a SIGHUP compares the new file with it.
        let current = Box(configuration)
        // The CA the proxy signs with: a reload keeps it while it covers the protected hosts and is trusted.
        let signing = Box(ca)
        let reload: () -> Result<Reloaded, any Error> = {
            do {
                var fresh = try loader.load(location)
                if let level = overrides.level, let parsed = LogLevel(name: level) { fresh.proxy.logLevel = parsed }
                try loader.finish(&fresh, listen: overrides.listen)
                let credentials = try loader.loadCredentials(fresh.proxy)
                let before = current.value
                var reloaded = Reloaded(
                    settings: fresh.proxy, credentials: credentials, origins: before.origins, interception: nil)
                let restart = ServeCommand.restartNeeded(before: before.proxy, after: fresh.proxy)
                for key in restart {
                    reloaded.notes.append("\(key) changed; restart proxyctl serve to apply it")
                    reloaded.notApplied.append("\(key) (needs a restart)")
                }
                // Keys that need a restart keep their old values meanwhile.
                reloaded.settings.stateDir = before.proxy.stateDir
                reloaded.settings.adminListen = before.proxy.adminListen
                reloaded.settings.adminHosts = before.proxy.adminHosts
                let originsChanged = fresh.origins != before.origins || fresh.providers != before.providers
                let transportChanged =
                    fresh.proxy.upstreamProxy != before.proxy.upstreamProxy
                    || fresh.proxy.noUpstreamProxy != before.proxy.noUpstreamProxy
                    || fresh.proxy.resolve != before.proxy.resolve
                if originsChanged || transportChanged || !fresh.origins.isEmpty {
                    do {
                        // The CA is read again: `proxyctl ca init` may have reissued it for new hosts.
                        let freshCA = try loadLocalCA(fresh, stateDirectory: stateDirectory, inUse: signing.value)
                        let reuse = transportChanged ? [:] : runtimeOrigins.managers
                        if let made = try ProxyRuntime.interception(
                            fresh, stateDirectory: stateDirectory, loop: loop, ca: freshCA, reuse: reuse)
                        {
                            reloaded.interception = made
                        } else {
                            reloaded.interception = Interception(
                                ca: nil, managers: [:],
                                spoolDirectory: (stateDirectory ?? Platform.temporaryDirectory) + "/spool")
                        }
                        reloaded.origins = fresh.origins
                        if freshCA != nil { signing.value = freshCA }
                        runtimeOrigins.replace(
                            origins: fresh.origins.origins, managers: reloaded.interception?.managers ?? [:])
                        current.value.origins = fresh.origins
                        current.value.providers = fresh.providers
                        current.value.proxy = reloaded.settings
                    } catch let failure as CommandFailure {
                        reloaded.notes.append(
                            "[origin] and [provider] changes not applied: \(failure.message); then send SIGHUP again (kill -HUP \(getpid()))"
                        )
                        reloaded.notApplied.append("[origin] and [provider] changes")
                        current.value.proxy = reloaded.settings
                    }
                } else {
                    current.value.proxy = reloaded.settings
                }
                return .success(reloaded)
            } catch {
                return .failure(error)
            }
        }
        let server: ProxyServer
        do {
            server = try ProxyServer(
                loop: loop, logger: logger, settings: configuration.proxy, credentials: credentials,
                origins: configuration.origins, interception: interception, reload: reload,
                fileLimit: fileLimit, stateDirectory: stateDirectory)
        } catch {
            throw CommandFailure(message: "cannot set up interception: \(error)")
        }
        // The file as one name, so that `proxyctl exec --config` from another directory recognises this serve.
        server.configurationSource = ConfigLoader.canonical(configuration.source)
        server.ownerCredential = ownerCredential
        server.inheritedListener = sockets.first
        server.notifiesServiceManager = !(context.environment["NOTIFY_SOCKET"] ?? "").isEmpty
        for extra in sockets.dropFirst() {
            logger.warn("the service manager passed \(sockets.count) sockets; accepting on the first only")
            close(extra)
        }
        let admin = try ProxyRuntime.startAdmin(
            configuration.proxy, server: server, origins: runtimeOrigins, stateDirectory: stateDirectory)
        server.adminAddress = admin.map { "\($0.boundAddress)" }
        let bound: ListenAddress
        do {
            bound = try server.start()
        } catch let error as ServerError where error.addressInUse {
            admin?.stop()
            throw CommandFailure(
                message: addressInUse(
                    configuration.proxy.listen, source: configuration.source, stateDirectory: stateDirectory,
                    flag: arguments.value("listen") != nil,
                    variable: !(context.environment["PROXYCTL_LISTEN"] ?? "").isEmpty))
        } catch {
            admin?.stop()
            throw CommandFailure(message: "\(error)")
        }
        if server.inheritedListener != nil && !bound.isLoopback && credentials == nil {
            admin?.stop()
            throw CommandFailure(
                message:
                    "the socket from the service manager, \(bound), is reachable from other machines; set proxy_auth_file so that clients must authenticate, or ListenStream=127.0.0.1:\(bound.port) in proxyctl.socket"
            )
        }
        let via = configuration.proxy.upstreamProxy.map { " via upstream proxy \($0)" } ?? ""
        let auth = credentials.map { " (proxy authentication: \($0.count) user(s))" } ?? ""
        let activated = server.inheritedListener != nil ? " (the socket from the service manager)" : ""
        logger.always("proxyctl \(Version.string) listening on http://\(bound)\(activated)\(via)\(auth)")
        if let admin {
            logger.always(
                "health and metrics on http://\(admin.boundAddress) (/healthz, /readyz, /metrics)")
        }
        for line in ProxyRuntime.originSummary(configuration, stateDirectory: stateDirectory) {
            logger.always(line)
        }
        logger.always("use it: eval \"$(proxyctl env)\", or proxyctl exec -- COMMAND")
        // A CA `proxyctl ca init` makes meanwhile is picked up by itself, as a SIGHUP would pick it up.
        let caWatch = stateDirectory.map { directory in
            LocalCAWatch(
                loop: loop, files: LocalCA.Files(stateDirectory: directory), logger: logger,
                check: {
                    guard signing.value != nil else { return .success(nil) }
                    do {
                        let fresh = try loadLocalCA(current.value, stateDirectory: directory, inUse: signing.value)
                        guard let fresh, fresh !== signing.value else { return .success(nil) }
                        return .success(fresh)
                    } catch {
                        return .failure(error)
                    }
                },
                apply: { ca in
                    guard server.signWith(ca) else { return false }
                    signing.value = ca
                    return true
                })
        }
        if server.notifiesServiceManager {
            Platform.notifyServiceManager("READY=1\nSTATUS=listening on http://\(bound)")
        }
        logger.holdAccessLines(on: loop)
        loop.run()
        caWatch?.stop()
        logger.flush()
        server.removeServeState()
        admin?.stop()
        return ExitCode.success
    }

    /// Why `address` cannot be listened on, and the fix: the proxyctl serve that listens there (its record in the
    /// state directory says its pid and configuration), else another program; then a free port to use instead,
    /// in the file's `listen` or with --listen.
    static func addressInUse(
        _ address: ListenAddress, source: String?, stateDirectory: String?, flag: Bool, variable: Bool
    ) -> String {
        let serve = stateDirectory.flatMap { directory in
            ServeState.allRunning(stateDirectory: directory).first { ListenAddress.parse($0.listen) == address }
        }
        let holder: String
        if let serve {
            let config = serve.configuration.map { ", config \($0)" } ?? ""
            holder =
                "proxyctl serve (pid \(serve.pid)\(config)) already listens on \(address); stop it (kill \(serve.pid))"
        } else {
            holder =
                "another program already listens on \(address) (ss -ltnp 'sport = :\(address.port)' shows which); stop it"
        }
        let free = (address.port + 1...min(address.port + 100, 65535)).first { LoopbackReceiver.canListen(port: $0) }
        let port = free.map(String.init) ?? "PORT"
        let host = address.isIPv6 ? "[\(address.host)]" : address.host
        let fix: String
        if flag {
            fix = "give another port: --listen \(host):\(port)"
        } else if variable {
            fix = "set PROXYCTL_LISTEN=\(host):\(port)"
        } else if let source, !source.hasPrefix("$") {
            fix = "set listen = \(host):\(port) in [proxy] of \(source) (or give --listen \(host):\(port))"
        } else {
            fix = "give another port: --listen \(host):\(port) (or a [proxy] listen in proxy.conf)"
        }
        return "\(holder), or \(fix)"
    }

    /// Where the kernel cannot name a client's user (`Platform.namesSocketOwner`), the owner credential that
    /// stands in for it (`OwnerCredential`: made at the first need, kept in the state directory, handed out by
    /// `proxyctl env` and `exec`); nil where the kernel can, or where `proxy_auth_file` makes every client
    /// authenticate anyway. It is made even when no rule needs it yet (a reload may add protected origins), and
    /// said when one does.
    static func ownerCredential(
        _ configuration: Configuration, credentials: ProxyCredentials?, stateDirectory: String?, logger: Logger
    ) -> ProxyCredentials? {
        guard !Platform.namesSocketOwner, credentials == nil else { return nil }
        let settings = configuration.proxy
        let kept = [
            !configuration.origins.isEmpty && settings.protectedUsers == .owner ? "protected origins" : nil,
            settings.passthroughUsers == .owner ? "passthrough" : nil,
        ].compactMap { $0 }.joined(separator: " and ")
        guard let stateDirectory else {
            logger.warn(
                "this system cannot tell which user a connection comes from, and there is no state directory for the credential that stands in (set HOME or state_dir)"
                    + (kept.isEmpty ? "" : ": \(kept) are refused to every client"))
            return nil
        }
        do {
            let secret = try OwnerCredential.secret(stateDirectory: stateDirectory)
            if !kept.isEmpty {
                logger.always(
                    "this system cannot tell which user a connection comes from: \(kept) need the credential in \(OwnerCredential.path(stateDirectory: stateDirectory)), which eval \"$(proxyctl env)\" and proxyctl exec put in HTTPS_PROXY"
                )
            }
            return OwnerCredential.credentials(secret: secret)
        } catch {
            logger.warn(
                "this system cannot tell which user a connection comes from, and the credential that stands in cannot be had: \(error)"
                    + (kept.isEmpty ? "" : "; \(kept) are refused to every client"))
            return nil
        }
    }

    /// `[proxy]` keys whose change a running serve cannot apply.
    static func restartNeeded(before: ProxySettings, after: ProxySettings) -> [String] {
        var keys: [String] = []
        if before.stateDir != after.stateDir { keys.append("state_dir") }
        if before.adminListen != after.adminListen { keys.append("admin_listen") }
        if before.adminHosts != after.adminHosts { keys.append("admin_hosts") }
        return keys
    }

    /// The local CA for the protected https hosts; an error naming the fix when it is missing or does not cover
    /// them. The CA may cover more hosts (those of other configurations sharing the state directory): the proxy
    /// still intercepts only its own origins and mints leaves for them alone. `inUse` is the CA a running proxy
    /// signs with: it is kept while it covers the hosts and the bundle still trusts it (a CA replaced by a wider
    /// one stays trusted until it expires), so that a reload never breaks the clients that trust it.
    static func loadLocalCA(
        _ configuration: Configuration, stateDirectory: String?, inUse: LocalCA? = nil
    ) throws -> LocalCA? {
        let hosts = configuration.origins.tlsHosts
        guard !hosts.isEmpty else { return nil }
        guard let stateDirectory else {
            throw CommandFailure(message: "no state directory for the local CA: set HOME, XDG_STATE_HOME or state_dir")
        }
        let files = LocalCA.Files(stateDirectory: stateDirectory)
        if let inUse, inUse.keepsSigning(hosts: hosts, trusted: inUse.isTrusted(files), now: Int64(time(nil))) {
            return inUse
        }
        let ca: LocalCA
        do {
            guard let loaded = try LocalCA.load(files) else {
                throw CommandFailure(
                    message:
                        "protected origins need the local CA, and there is none yet: run proxyctl ca init, then make your tools trust it with eval \"$(proxyctl env)\""
                )
            }
            ca = loaded
        } catch let failure as CommandFailure {
            throw failure
        } catch {
            throw CommandFailure(message: "cannot read the local CA: \(error)")
        }
        if !ca.covers(hosts) {
            let added = Set(hosts).subtracting(ca.hosts).sorted()
            throw CommandFailure(
                message:
                    "the protected hosts changed since the local CA was made (added \(added.joined(separator: ", "))); its name constraints must name every protected host: run proxyctl ca init to reissue it (the CA before it stays trusted until it expires)"
            )
        }
        if ca.certificate.notAfter < Int64(time(nil)) + 7 * 86400 {
            throw CommandFailure(message: "the local CA expires within a week: run proxyctl ca init to reissue it")
        }
        return ca
    }

    /// Each connection may hold two descriptors: raise the soft open-file limit to the hard one, derive the
    /// connection limits from it, and say what they are (and when an explicit max_connections cannot fit).
    static func raiseFileLimit(logger: Logger, settings: ProxySettings) -> Int {
        Platform.raiseOpenFileLimit()
        let fileLimit = Platform.openFileLimit()
        let admission = Admission(settings: settings, fileLimit: fileLimit)
        logger.info(
            "max_connections \(admission.maxConnections), \(admission.maxPerClient) per client address (open-file limit \(fileLimit))"
        )
        let needed = admission.maxConnections * 2 + Admission.reservedFiles
        if fileLimit < needed {
            logger.warn(
                "the open-file limit (\(fileLimit)) is below what max_connections = \(admission.maxConnections) needs (\(needed)); raise it with ulimit -n or lower max_connections"
            )
        }
        return fileLimit
    }
}

/// A value a closure changes in place (on the thread that runs it).
final class Box<Value> {
    var value: Value
    init(_ value: Value) { self.value = value }
}
