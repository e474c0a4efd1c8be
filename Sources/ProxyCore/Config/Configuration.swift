/// Log verbosity, from quietest to loudest.
public enum LogLevel: Int, Sendable, Comparable, CaseIterable, CustomStringConvertible {
    case error = 0
    case warn = 1
    case info = 2
    case debug = 3

    public init?(name: String) {
        switch name.lowercased() {
        case "error": self = .error
        case "warn", "warning": self = .warn
        case "info": self = .info
        case "debug": self = .debug
        default: return nil
        }
    }

    public var description: String {
        switch self {
        case .error: "error"
        case .warn: "warn"
        case .info: "info"
        case .debug: "debug"
        }
    }

    public static func < (lhs: Self, rhs: Self) -> Bool { lhs.rawValue < rhs.rawValue }
}

/// How log lines are written: `text` for people, `json` (one object per line) for log collectors.
public enum LogFormat: String, Sendable, Equatable {
    case text
    case json
}

/// Which local users a part of the proxy serves.
public enum UserScope: String, Sendable, Equatable {
    /// Only the user the proxy runs as (the one whose tokens it holds).
    case owner
    /// Anyone who can reach the listener.
    case any
}

/// Where refresh tokens and DPoP keys are kept (`token_store`).
public enum TokenStoreKind: String, Sendable, Equatable {
    /// 0600 files under state_dir.
    case file
    /// The freedesktop Secret Service (GNOME Keyring, KeePassXC...), with the files as the fallback.
    case secretService = "secret-service"
}

/// The `[proxy]` section: the listener, the way out, timeouts and limits.
public struct ProxySettings: Sendable, Equatable {
    public var listen = ListenAddress.default
    public var upstreamProxy: UpstreamProxy? = nil
    public var noUpstreamProxy = BypassList()
    /// File of `user:password` lines; when set, clients must authenticate with Basic.
    public var proxyAuthFile: String? = nil
    /// Who may use the protected origins (and so the signed-in user's tokens): by default only processes of
    /// the user the proxy runs as (loopback is no access control on a shared machine).
    public var protectedUsers = UserScope.owner
    /// Who may use passthrough (blind tunnels, forwarded plain HTTP).
    public var passthroughUsers = UserScope.any
    /// DNS resolution plus TCP connect, milliseconds.
    public var connectTimeout = 10_000
    /// A tunnel or a body transfer with no bytes either way for this long is closed.
    public var idleTimeout = 300_000
    /// An idle keep-alive client connection is closed after this long.
    public var keepAliveTimeout = 60_000
    /// A request head must arrive completely within this time.
    public var headerTimeout = 30_000
    /// On SIGTERM or SIGINT, open transfers may finish for this long.
    public var shutdownGrace = 10_000
    public var headLimits = HTTPHeadLimits()
    /// Most client connections (tunnels included) open at once; nil derives it from the open-file limit
    /// (`Admission.connections(fileLimit:)`). Beyond it, new clients get 503 at once.
    public var maxConnections: Int? = nil
    /// Most connections open at once from one client address; nil is a quarter of `maxConnections`.
    public var maxConnectionsPerClient: Int? = nil
    public var logLevel = LogLevel.info
    public var logFormat = LogFormat.text
    /// Where `/healthz`, `/readyz` and `/metrics` are served; nil: nowhere.
    public var adminListen: ListenAddress? = nil
    /// Host names the admin listener answers besides its own address and `localhost` (a scraper that names it,
    /// such as a Compose service name): lower case, no port (`AdminDoor`).
    public var adminHosts: [String] = []
    /// Not a configuration key: `proxyctl exec`'s own proxy admits processes of its user without the run's
    /// credential (which it still hands to the command).
    public var ownerNeedsNoCredentials = false
    /// Request bodies to protected origins are kept in memory up to this size so they can be replayed.
    public var replayMemory = 1 << 20
    /// Beyond `replayMemory`, bodies are spooled to a 0600 file up to this size; larger ones are forwarded
    /// without the possibility of a replay.
    public var replaySpool = 64 << 20
    /// What all bodies kept for replays may hold in memory at once, in the whole process; past it they go to the
    /// spool. A connection may take a quarter of it.
    public var replayMemoryTotal = 64 << 20
    /// What all spooled bodies may hold at once; past it (or a connection's quarter of it) a body streams on
    /// without being kept, and cannot be replayed.
    public var replaySpoolTotal = 1 << 30
    /// The audit log (`state_dir/audit.log`) is moved to `audit.log.1` past this size; 0 turns it off.
    public var auditMaxSize = 16 << 20
    /// Offer HTTP/2 (ALPN h2) to clients of protected origins; off keeps them on HTTP/1.1.
    public var http2 = true
    /// What a request made by a web page of another origin gets at a protected origin, unless its section says
    /// otherwise (`browser_requests`; `BrowserRequests`).
    public var browserRequests = BrowserRequestsPolicy.refuse
    /// Host names answered without DNS (`resolve = api.test=127.0.0.1`), like curl's --resolve: for
    /// development setups and sidecars.
    public var resolve: [String: String] = [:]
    /// A command run (without a shell, message as its last argument) when a step-up or a sign-in is needed,
    /// e.g. `notify-send proxyctl`; nil runs nothing.
    public var notifyCommand: [String]? = nil
    /// Where tokens, keys and the local CA live; nil means the platform default.
    public var stateDir: String? = nil
    /// Where refresh tokens and DPoP keys are kept.
    public var tokenStore = TokenStoreKind.file

    public init() {}
}

/// A whole configuration, validated.
public struct Configuration: Sendable, Equatable {
    public var proxy = ProxySettings()
    /// `[provider NAME]` sections, in file order.
    public var providers: [ProviderConfig] = []
    /// `[origin URL]` sections: the protected origins.
    public var origins = OriginTable()
    /// Where it came from: a file path, or nil for the built-in defaults.
    public var source: String? = nil

    public init() {}
}

/// Turns the text of proxy.conf into a `Configuration`, or every error in it.
public struct ConfigParser: Sendable {
    /// Expands `~/` in paths.
    public var homeDirectory: String?
    /// Relative paths are taken relative to this directory (the config file's).
    public var baseDirectory: String?

    public init(homeDirectory: String?, baseDirectory: String?) {
        self.homeDirectory = homeDirectory
        self.baseDirectory = baseDirectory
    }

    public func parse(_ text: String, file: String) -> Result<Configuration, ConfigErrors> {
        let (document, syntaxErrors) = INIDocument.parse(text, file: file)
        var errors = syntaxErrors
        var config = Configuration()
        config.source = file
        var seenProxy: Int? = nil
        var seenProviders: [String: Int] = [:]
        var seenOrigins: [OriginTable.Key: Int] = [:]
        var origins: [OriginConfig] = []
        for section in document.sections {
            switch section.name {
            case "origin":
                guard let argument = section.argument else {
                    errors.append(
                        ConfigError(
                            file: file, line: section.line,
                            "expected [origin URL], such as [origin https://api.example.com]"))
                    continue
                }
                var origin: OriginConfig
                switch OriginConfig.parseURL(argument) {
                case .failure(let error):
                    errors.append(ConfigError(file: file, line: section.line, section: section.label, error.message))
                    continue
                case .success(let parsed):
                    origin = parsed
                }
                origin.line = section.line
                origin.file = file
                let key = OriginTable.key(of: origin)
                if let first = seenOrigins[key] {
                    errors.append(
                        ConfigError(
                            file: file, line: section.line, section: section.label,
                            "the same origin as the section on line \(first) (after normalising case, trailing dot and default port); merge them"
                        ))
                    continue
                }
                seenOrigins[key] = section.line
                applyOrigin(section, file: file, into: &origin, errors: &errors)
                origins.append(origin)
            case "provider":
                guard let name = section.argument, ProviderConfig.isValidName(name) else {
                    errors.append(
                        ConfigError(
                            file: file, line: section.line,
                            "expected [provider NAME] with a name of letters, digits, '-', '_' or '.', such as [provider corp]"
                        ))
                    continue
                }
                if let first = seenProviders[name] {
                    errors.append(
                        ConfigError(
                            file: file, line: section.line, section: section.label,
                            "section appears twice (first on line \(first)); merge them"))
                    continue
                }
                seenProviders[name] = section.line
                var provider = ProviderConfig(name: name)
                provider.line = section.line
                provider.file = file
                applyProvider(section, file: file, into: &provider, errors: &errors)
                config.providers.append(provider)
            case "proxy":
                if let first = seenProxy {
                    errors.append(
                        ConfigError(
                            file: file, line: section.line, section: "proxy",
                            "section appears twice (first on line \(first)); merge them"))
                    continue
                }
                if section.argument != nil {
                    errors.append(
                        ConfigError(file: file, line: section.line, "[proxy] takes no name; write [proxy]"))
                }
                seenProxy = section.line
                applyProxy(section, file: file, into: &config.proxy, errors: &errors)
            default:
                errors.append(
                    ConfigError(
                        file: file, line: section.line,
                        "unknown section [\(section.label)]; expected [proxy], [provider NAME] or [origin URL]"))
            }
        }
        // Cross-section checks: every origin names a configured provider.
        for origin in origins where !origin.provider.isEmpty {
            if !config.providers.contains(where: { $0.name == origin.provider }) {
                let line = document.sections.first { $0.line == origin.line }?.entries.first { $0.key == "provider" }?
                    .line
                errors.append(
                    ConfigError(
                        file: file, line: line ?? origin.line, section: "origin \(origin.url)", key: "provider",
                        "no [provider \(origin.provider)] section; configured: \(config.providers.isEmpty ? "none" : config.providers.map(\.name).joined(separator: ", "))"
                    ))
            } else if origin.tokenType == .idToken,
                let provider = config.providers.first(where: { $0.name == origin.provider }), !provider.needsSignIn
            {
                let line = document.sections.first { $0.line == origin.line }?.entries.first { $0.key == "token_type" }?
                    .line
                errors.append(
                    ConfigError(
                        file: file, line: line ?? origin.line, section: "origin \(origin.url)", key: "token_type",
                        "[provider \(provider.name)] uses grant = \(provider.grant.rawValue), which gives no ID token; only a person's sign-in does"
                    ))
            }
        }
        // `browser_requests` of [proxy] is the default of every [origin] that does not set its own.
        for index in origins.indices where !origins[index].setsBrowserRequests {
            origins[index].browserRequests = config.proxy.browserRequests
        }
        config.origins = OriginTable(origins)
        // Cross-key checks.
        if !config.proxy.listen.isLoopback && config.proxy.proxyAuthFile == nil {
            let line = document.sections.first { $0.name == "proxy" }?.entries.first { $0.key == "listen" }?.line
            errors.append(
                ConfigError(
                    file: file, line: line, section: "proxy", key: "listen",
                    "\(config.proxy.listen) is reachable from other machines; set proxy_auth_file so that clients must authenticate, or listen on 127.0.0.1"
                ))
        }
        if let admin = config.proxy.adminListen, admin.port != 0, admin.port == config.proxy.listen.port {
            let line = document.sections.first { $0.name == "proxy" }?.entries.first { $0.key == "admin_listen" }?.line
            errors.append(
                ConfigError(
                    file: file, line: line, section: "proxy", key: "admin_listen",
                    "\(admin) is the proxy's own port; health and metrics need a port of their own"))
        }
        errors.sort { ($0.line ?? 0) < ($1.line ?? 0) }
        return errors.isEmpty ? .success(config) : .failure(ConfigErrors(errors))
    }

    /// Applies `[proxy]` keys given outside the file (`PROXYCTL_LISTEN` and the like): each value is checked
    /// as its key in the file would be, and an error names the variable instead of a line.
    public func applyOverrides(
        _ overrides: [(source: String, key: String, value: String)], to configuration: inout Configuration
    ) -> [ConfigError] {
        var errors: [ConfigError] = []
        for override in overrides {
            let section = INIDocument.Section(
                name: "proxy", argument: nil, line: 0,
                entries: [INIDocument.Entry(key: override.key, value: override.value, line: 0)])
            var found: [ConfigError] = []
            applyProxy(section, file: override.source, into: &configuration.proxy, errors: &found)
            errors += found.map {
                ConfigError(file: override.source, line: nil, section: "proxy", key: override.key, $0.message)
            }
        }
        return errors
    }

    /// A path value: `~/` expanded, relative paths resolved against the config file's directory.
    public func resolvePath(_ value: String) -> String {
        if value.hasPrefix("~/"), let homeDirectory {
            return homeDirectory + value.dropFirst(1)
        }
        if value.utf8.first != UInt8(ascii: "/"), let baseDirectory {
            return baseDirectory + "/" + value
        }
        return value
    }

    private func applyProxy(
        _ section: INIDocument.Section, file: String, into settings: inout ProxySettings, errors: inout [ConfigError]
    ) {
        for entry in section.entries {
            func fail(_ message: String) {
                errors.append(ConfigError(file: file, line: entry.line, section: "proxy", key: entry.key, message))
            }
            func got() -> String { "got \"\(INIDocument.clip(entry.value))\"" }
            func duration(_ apply: (Int) -> Void, allowZero: Bool = false) {
                guard let value = ConfigValue.duration(entry.value), allowZero || value > 0 else {
                    return fail("expected a duration such as 10s, 500ms or 5m, \(got())")
                }
                apply(value)
            }
            func size(_ minimum: Int, _ maximum: Int, _ apply: (Int) -> Void) {
                guard let value = ConfigValue.size(entry.value), value >= minimum, value <= maximum else {
                    return fail("expected a size from \(minimum) to \(maximum) bytes (e.g. 8KiB), \(got())")
                }
                apply(value)
            }
            func count(_ minimum: Int, _ maximum: Int, _ apply: (Int) -> Void) {
                guard let value = ConfigValue.digits(entry.value), value >= minimum, value <= maximum else {
                    return fail("expected a number from \(minimum) to \(maximum), \(got())")
                }
                apply(value)
            }
            switch entry.key {
            case "listen":
                switch ListenAddress.check(entry.value) {
                case .success(let address): settings.listen = address
                case .failure(let error): fail("\(error.message), \(got())")
                }
            case "upstream_proxy":
                if entry.value.isEmpty || entry.value.lowercased() == "none" {
                    settings.upstreamProxy = nil
                    continue
                }
                switch UpstreamProxy.parse(entry.value) {
                case .success(let proxy): settings.upstreamProxy = proxy
                // The value may hold a password: never echo it.
                case .failure(let error): fail(error.message)
                }
            case "no_upstream_proxy":
                switch BypassList.parse(entry.value) {
                case .success(let list): settings.noUpstreamProxy = list
                case .failure(let error): fail("\(error.message); expected a comma-separated list")
                }
            case "proxy_auth_file":
                guard !entry.value.isEmpty else { return fail("expected the path of a file of user:password lines") }
                settings.proxyAuthFile = resolvePath(entry.value)
            case "protected_users", "passthrough_users":
                guard let scope = UserScope(rawValue: entry.value.lowercased()) else {
                    return fail("expected owner or any, \(got())")
                }
                if entry.key == "protected_users" {
                    settings.protectedUsers = scope
                } else {
                    settings.passthroughUsers = scope
                }
            case "connect_timeout": duration { settings.connectTimeout = $0 }
            case "idle_timeout": duration { settings.idleTimeout = $0 }
            case "keepalive_timeout": duration { settings.keepAliveTimeout = $0 }
            case "header_timeout": duration { settings.headerTimeout = $0 }
            case "shutdown_grace": duration({ settings.shutdownGrace = $0 }, allowZero: true)
            case "max_request_line": size(256, 1 << 20) { settings.headLimits.maxStartLine = $0 }
            case "max_header_bytes": size(1024, 16 << 20) { settings.headLimits.maxHeadBytes = $0 }
            case "max_headers": count(8, 10_000) { settings.headLimits.maxFields = $0 }
            case "max_connections": count(1, 1_000_000) { settings.maxConnections = $0 }
            case "max_connections_per_client": count(1, 1_000_000) { settings.maxConnectionsPerClient = $0 }
            case "replay_memory": size(0, 1 << 30) { settings.replayMemory = $0 }
            case "replay_spool": size(0, 1 << 40) { settings.replaySpool = $0 }
            case "replay_memory_total": size(0, 1 << 40) { settings.replayMemoryTotal = $0 }
            case "replay_spool_total": size(0, 1 << 50) { settings.replaySpoolTotal = $0 }
            case "audit_max_size": size(0, 1 << 40) { settings.auditMaxSize = $0 }
            case "http2":
                guard let flag = ConfigValue.bool(entry.value) else { return fail("expected on or off, \(got())") }
                settings.http2 = flag
            case "browser_requests":
                guard let policy = BrowserRequestsPolicy(rawValue: entry.value.lowercased()) else {
                    return fail("expected refuse or allow, \(got())")
                }
                settings.browserRequests = policy
            case "upstream_client":
                // Obsolete: the proxy's own client carries every request to protected origins. `builtin`, what
                // files written from the old example say, is what happens anyway.
                guard entry.value.lowercased() == "builtin" else {
                    return fail(
                        "libcurl no longer carries requests to protected origins (the proxy's own client does, in HTTP/1.1 or HTTP/2 as the origin chooses); remove this line, \(got())"
                    )
                }
            case "resolve":
                var map: [String: String] = [:]
                for pair in entry.value.split(whereSeparator: { $0 == "," || $0 == " " }) {
                    let parts = pair.split(separator: "=", maxSplits: 1)
                    guard parts.count == 2, !parts[0].contains(":"),
                        case .success(let host) = HostPort.parse(parts[0], defaultPort: 1),
                        host.kind == .name, IPAddress.parse(parts[1]) != nil
                    else {
                        return fail(
                            "expected HOST=ADDRESS pairs separated by commas, such as api.test=127.0.0.1, \(got())")
                    }
                    map[host.host] = String(parts[1])
                }
                settings.resolve = map
            case "notify_command":
                let words = entry.value.split(separator: " ").map(String.init)
                settings.notifyCommand = words.isEmpty ? nil : words
            case "log_level":
                guard let level = LogLevel(name: entry.value) else {
                    return fail("expected one of error, warn, info, debug, \(got())")
                }
                settings.logLevel = level
            case "log_format":
                guard let format = LogFormat(rawValue: entry.value.lowercased()) else {
                    return fail("expected text or json, \(got())")
                }
                settings.logFormat = format
            case "admin_listen":
                if entry.value.isEmpty || entry.value.lowercased() == "none" {
                    settings.adminListen = nil
                    continue
                }
                // A bare port is a loopback port.
                let text = ConfigValue.digits(entry.value) != nil ? "127.0.0.1:\(entry.value)" : entry.value
                switch ListenAddress.check(text) {
                case .success(let address): settings.adminListen = address
                case .failure(let error) where error.message.hasPrefix("port "): fail("\(error.message), \(got())")
                case .failure:
                    fail("expected HOST:PORT with an IP address, or a port for 127.0.0.1, \(got())")
                }
            case "admin_hosts":
                var names: [String] = []
                for item in entry.value.split(whereSeparator: { $0 == "," || $0 == " " }) {
                    guard case .success(let parsed) = HostPort.parse(item, defaultPort: 1), parsed.kind == .name,
                        !item.contains(":")
                    else {
                        return fail(
                            "expected host names without ports, separated by commas, such as proxyctl, metrics.internal, \(got())"
                        )
                    }
                    if !names.contains(parsed.host) { names.append(parsed.host) }
                }
                settings.adminHosts = names
            case "state_dir":
                guard !entry.value.isEmpty else { return fail("expected a directory path") }
                settings.stateDir = resolvePath(entry.value)
            case "token_store":
                let value = entry.value.lowercased().replacing("_", with: "-")
                guard let kind = TokenStoreKind(rawValue: value) else {
                    return fail("expected file or secret-service, \(got())")
                }
                settings.tokenStore = kind
            default:
                fail(KeySuggestion.message(for: entry.key, among: Self.proxyKeys))
            }
        }
    }

    /// Every key of `[proxy]`, in the order of proxy.conf.example.
    public static let proxyKeys = [
        "listen", "upstream_proxy", "no_upstream_proxy", "proxy_auth_file", "protected_users", "passthrough_users",
        "connect_timeout", "idle_timeout",
        "keepalive_timeout", "header_timeout", "shutdown_grace", "max_request_line", "max_header_bytes",
        "max_headers", "max_connections", "max_connections_per_client", "replay_memory", "replay_spool",
        "replay_memory_total", "replay_spool_total", "http2", "browser_requests", "upstream_client", "resolve",
        "notify_command", "log_level", "log_format", "admin_listen", "admin_hosts", "state_dir", "token_store",
        "audit_max_size",
    ]
}
