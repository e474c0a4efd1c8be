import ProxyCore
import ProxyOAuth
import Synchronization

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

/// Finds, reads and validates proxy.conf and the files it names.
struct ConfigLoader {
    let environment: [String: String]

    /// Where the configuration comes from, and whether its absence is an error.
    enum Location: Equatable {
        /// Named by `--config` or `$PROXYCTL_CONFIG`: must exist.
        case explicit(String)
        /// The XDG default: optional.
        case standard(String)
        /// The whole configuration in `$PROXYCTL_CONFIG_TEXT` (a sidecar configured from its environment).
        case text(String)
        /// No home directory to look in.
        case none

        /// The file looked for, if any.
        var path: String? {
            switch self {
            case .explicit(let path), .standard(let path): path
            case .text: ConfigLoader.textLabel
            case .none: nil
            }
        }
    }

    /// The label of a configuration given as text, used in error messages instead of a file name.
    static let textLabel = "$PROXYCTL_CONFIG_TEXT"

    /// A configuration's source (`Configuration.source`) as one name: the file's real path (symbolic links
    /// and relative parts resolved), or the label of a configuration given as text.
    static func canonical(_ source: String?) -> String? {
        guard let source, source != textLabel, let resolved = realpath(source, nil) else { return source }
        defer { free(resolved) }
        return String(cString: resolved)
    }

    /// `[proxy]` keys that may also come from the environment (a sidecar's), overriding the file's.
    static let environmentKeys: [(variable: String, key: String)] = [
        ("PROXYCTL_LISTEN", "listen"), ("PROXYCTL_PROXY_AUTH_FILE", "proxy_auth_file"),
        ("PROXYCTL_STATE_DIR", "state_dir"), ("PROXYCTL_ADMIN_LISTEN", "admin_listen"),
        ("PROXYCTL_LOG_FORMAT", "log_format"), ("PROXYCTL_LOG_LEVEL", "log_level"),
        ("PROXYCTL_UPSTREAM_PROXY", "upstream_proxy"), ("PROXYCTL_PROTECTED_USERS", "protected_users"),
        ("PROXYCTL_ADMIN_HOSTS", "admin_hosts"),
    ]

    /// Where the configuration comes from: `--config FILE`, else `$PROXYCTL_CONFIG_TEXT`, else
    /// `$PROXYCTL_CONFIG`, else the XDG default.
    func locate(flag: String?) -> Location {
        if let flag { return .explicit(flag) }
        if let text = environment["PROXYCTL_CONFIG_TEXT"], !text.isEmpty { return .text(text) }
        if let path = environment["PROXYCTL_CONFIG"], !path.isEmpty { return .explicit(path) }
        if let base = environment["XDG_CONFIG_HOME"], base.hasPrefix("/") {
            return .standard(base + "/proxyctl/proxy.conf")
        }
        if let home = environment["HOME"], !home.isEmpty { return .standard(home + "/.config/proxyctl/proxy.conf") }
        return .none
    }

    /// Loads the configuration. No file at the standard location means the built-in defaults (a pure
    /// passthrough proxy on 127.0.0.1:8080).
    func load(_ location: Location) throws -> Configuration {
        var configuration = try loadWithoutPlaceholders(location)
        do {
            try PlaceholderKey.assign(
                &configuration,
                stateDirectory: configuration.proxy.stateDir
                    ?? TokenStore.defaultStateDirectory(environment: environment))
        } catch let error as AuthError {
            throw CommandFailure(message: error.description)
        }
        return configuration
    }

    private func loadWithoutPlaceholders(_ location: Location) throws -> Configuration {
        var configuration = try loadSource(location)
        // The sidecar's variables override single keys of whatever the configuration came from.
        var overrides: [(source: String, key: String, value: String)] = []
        for (variable, key) in Self.environmentKeys {
            if let value = environment[variable], !value.isEmpty { overrides.append(("$\(variable)", key, value)) }
        }
        guard !overrides.isEmpty else { return configuration }
        let parser = ConfigParser(
            homeDirectory: environment["HOME"], baseDirectory: FileManager.default.currentDirectoryPath)
        let errors = parser.applyOverrides(overrides, to: &configuration)
        if !errors.isEmpty { throw CommandFailure(message: ConfigErrors(errors).description) }
        return configuration
    }

    private func loadSource(_ location: Location) throws -> Configuration {
        let path: String
        let text: String
        var baseDirectory: String
        switch location {
        case .none:
            return Configuration()
        case .standard(let standard):
            guard FileManager.default.fileExists(atPath: standard) else { return Configuration() }
            path = standard
            text = try readText(path, what: "configuration file")
            baseDirectory = PathText.parent(path)
        case .explicit(let explicit):
            path = explicit
            text = try readText(path, what: "configuration file")
            baseDirectory = PathText.parent(path)
        case .text(let given):
            if let file = environment["PROXYCTL_CONFIG"], !file.isEmpty {
                throw CommandFailure(
                    message:
                        "both PROXYCTL_CONFIG (\(file)) and PROXYCTL_CONFIG_TEXT are set; keep one of them (or name the file with --config)"
                )
            }
            path = Self.textLabel
            text = given
            // Relative paths in the text are relative to the working directory.
            baseDirectory = FileManager.default.currentDirectoryPath
        }
        if baseDirectory.isEmpty { baseDirectory = "." }
        let parser = ConfigParser(homeDirectory: environment["HOME"], baseDirectory: baseDirectory)
        switch parser.parse(text, file: path) {
        case .success(let configuration):
            configureSecretStore(configuration)
            return configuration
        case .failure(let errors): throw CommandFailure(message: errors.description)
        }
    }

    /// Why `token_store = secret-service` fell back to the files in this process, if it did.
    static var secretStoreFallback: String? { fallback.withLock { $0 } }
    private static let fallback = Mutex<String?>(nil)

    /// With `token_store = secret-service`: refresh tokens and DPoP keys of this process go to the Secret
    /// Service when one answers, else (a headless machine, no secret-tool) to the 0600 files.
    func configureSecretStore(_ configuration: Configuration) {
        guard configuration.proxy.tokenStore == .secretService,
            let stateDirectory = configuration.proxy.stateDir
                ?? TokenStore.defaultStateDirectory(environment: environment)
        else {
            SecretService.configure(nil)
            return
        }
        switch SecretService.connect(stateDirectory: stateDirectory, environment: environment) {
        case .success(let service):
            SecretService.configure(service)
            Self.fallback.withLock { $0 = nil }
        case .failure(let failure):
            SecretService.configure(nil)
            Self.fallback.withLock { $0 = failure.description }
        }
    }

    /// The users of `proxy_auth_file`; the file must not be readable by others.
    func loadCredentials(_ settings: ProxySettings) throws -> ProxyCredentials? {
        guard let path = settings.proxyAuthFile else { return nil }
        var info = stat()
        if stat(path, &info) == 0, info.st_mode & 0o077 != 0 {
            throw CommandFailure(
                message:
                    "\(path): proxy_auth_file holds passwords but can be read by other users; run: chmod 600 \(path)")
        }
        let text = try readText(path, what: "proxy_auth_file")
        switch ProxyCredentials.parse(text, file: path) {
        case .success(let credentials): return credentials
        case .failure(let error): throw CommandFailure(message: error.description)
        }
    }

    /// Applies `--listen` and checks what depends on the final listener.
    func finish(_ configuration: inout Configuration, listen: String?) throws {
        if let listen {
            switch ListenAddress.check(listen) {
            case .success(let address): configuration.proxy.listen = address
            case .failure(let error) where error.message.hasPrefix("port "):
                throw UsageError(
                    message: "--listen: \(error.message), got '\(listen)'", command: ["proxyctl", "serve"])
            case .failure:
                throw UsageError(
                    message: "--listen expects HOST:PORT with an IP address, such as 127.0.0.1:8080, got '\(listen)'",
                    command: ["proxyctl", "serve"])
            }
        }
        if let admin = configuration.proxy.adminListen, admin.port != 0, admin.port == configuration.proxy.listen.port {
            throw CommandFailure(
                message:
                    "admin_listen \(admin) is the proxy's own port; give health and metrics a port of their own")
        }
        if !configuration.proxy.listen.isLoopback && configuration.proxy.proxyAuthFile == nil {
            throw CommandFailure(
                message:
                    "refusing to listen on \(configuration.proxy.listen): other machines could use this proxy. Set proxy_auth_file in [proxy] so that clients must authenticate, or listen on 127.0.0.1"
            )
        }
    }

    private func readText(_ path: String, what: String) throws -> String {
        guard let data = FileManager.default.contents(atPath: path) else {
            let reason = FileManager.default.fileExists(atPath: path) ? "cannot be read" : "does not exist"
            throw CommandFailure(message: "\(path): the \(what) \(reason)")
        }
        guard let text = String(data: data, encoding: .utf8) else {
            throw CommandFailure(message: "\(path): the \(what) is not UTF-8 text")
        }
        return text
    }
}
