import Dispatch
import ProxyCore
import ProxyIO
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

/// What the sign-in commands share: the configuration, the chosen provider, its store, client and loop.
struct AuthEnvironment {
    let configuration: Configuration
    let provider: ProviderConfig
    let store: TokenStore
    let loopThread: LoopThread
    let client: ProviderClient
    /// The HTTP client of `client` (and of a registration `login` makes again).
    let transport: any HTTPTransport

    static let configOption = OptionSpec.option(
        "config", short: "c", value: "file", help: "The configuration file (proxy.conf).")
    static let providerArgument = ArgumentSpec(
        name: "provider", help: "The [provider NAME] section to use; may be omitted when only one is configured.")

    /// Loads the configuration and picks the provider named on the command line (or the only one).
    static func load(_ arguments: ParsedArguments, _ context: CommandContext, command: String) throws -> AuthEnvironment
    {
        let loader = ConfigLoader(environment: context.environment)
        let location = loader.locate(flag: arguments.value("config"))
        let configuration = try loader.load(location)
        let provider = try pick(configuration, name: arguments.positionals.first, location: location, command: command)
        if let caFile = provider.caFile, !FileManager.default.isReadableFile(atPath: caFile) {
            throw CommandFailure(message: "[provider \(provider.name)] ca_file \(caFile) cannot be read")
        }
        guard
            let stateDirectory = configuration.proxy.stateDir
                ?? TokenStore.defaultStateDirectory(environment: context.environment)
        else {
            throw CommandFailure(message: "no state directory: set HOME, XDG_STATE_HOME or state_dir in [proxy]")
        }
        let loopThread = LoopThread()
        let transport = CurlTransport(
            loop: loopThread.loop, upstreamProxy: configuration.proxy.upstreamProxy,
            bypass: configuration.proxy.noUpstreamProxy,
            resolve: configuration.proxy.resolve)
        return AuthEnvironment(
            configuration: configuration, provider: provider, store: TokenStore(stateDirectory: stateDirectory),
            loopThread: loopThread, client: ProviderClient(config: provider, transport: transport), transport: transport
        )
    }

    static func pick(
        _ configuration: Configuration, name: String?, location: ConfigLoader.Location, command: String
    ) throws -> ProviderConfig {
        if let name {
            guard let provider = configuration.providers.first(where: { $0.name == name }) else {
                let known = configuration.providers.map(\.name)
                throw CommandFailure(
                    message: known.isEmpty
                        ? "no provider named \(name): \(describe(location)) has no [provider NAME] section"
                        : "no provider named \(name); configured: \(known.joined(separator: ", "))")
            }
            return provider
        }
        switch configuration.providers.count {
        case 0:
            throw CommandFailure(
                message:
                    "no provider is configured: add a [provider NAME] section with issuer and client_id to \(describe(location)) (see proxy.conf.example)"
            )
        case 1:
            return configuration.providers[0]
        default:
            throw UsageError(
                message:
                    "several providers are configured (\(configuration.providers.map(\.name).joined(separator: ", "))); name one: proxyctl \(command) \(configuration.providers[0].name)",
                command: ["proxyctl", command])
        }
    }

    static func describe(_ location: ConfigLoader.Location) -> String {
        switch location {
        case .explicit(let path), .standard(let path): path
        case .text: ConfigLoader.textLabel
        case .none: "the configuration"
        }
    }

    /// The provider's DPoP key when `token_binding = dpop` and one exists, set on the client so that token
    /// requests carry proofs.
    func loadDPoPKey() throws {
        guard provider.tokenBinding == .dpop else { return }
        do {
            if let key = try DPoPKey.load(stateDirectory: store.stateDirectory, provider: provider.name) {
                let client = self.client
                try runBlocking { await client.setDPoPKey(key) }
            }
        } catch {
            throw CommandFailure(message: "cannot read the DPoP key: \(error)")
        }
    }

    /// The client authentication of a confidential client (`token_endpoint_auth_method`), and for a machine
    /// grant with `token_binding = dpop` its DPoP key (made on first use: there is no login to make it).
    func prepareClientAuthentication() throws {
        do {
            try prepareClient(provider, client: client, stateDirectory: store.stateDirectory)
        } catch let error as AuthError {
            throw error.commandFailure
        }
    }

    /// The same environment for `provider` (changed by `login` registering its client again).
    func with(_ provider: ProviderConfig) -> AuthEnvironment {
        var configuration = configuration
        if let index = configuration.providers.firstIndex(where: { $0.name == provider.name }) {
            configuration.providers[index] = provider
        }
        return AuthEnvironment(
            configuration: configuration, provider: provider, store: store, loopThread: loopThread,
            client: ProviderClient(config: provider, transport: transport), transport: transport)
    }

    func manager() -> TokenManager {
        TokenManager(provider: provider, store: store, client: client)
    }
}

/// Sets up `client` for `provider`'s token requests: its client authentication, and for a machine grant with
/// `token_binding = dpop` the DPoP key (made when there is none).
func prepareClient(_ provider: ProviderConfig, client: ProviderClient, stateDirectory: String) throws {
    let authentication = try ClientAuthentication.load(provider: provider, stateDirectory: stateDirectory)
    try runBlocking { await client.setClientAuthentication(authentication) }
    guard !provider.needsSignIn, provider.tokenBinding == .dpop else { return }
    do {
        let key =
            try DPoPKey.load(stateDirectory: stateDirectory, provider: provider.name)
            ?? DPoPKey.create(stateDirectory: stateDirectory, provider: provider.name)
        try runBlocking { await client.setDPoPKey(key) }
    } catch {
        throw AuthError.configuration(reason: "cannot prepare the DPoP key of \(provider.name): \(error)")
    }
}

/// Runs async work from a synchronous command and waits for it.
func runBlocking<T: Sendable>(_ body: @escaping @Sendable () async throws -> T) throws -> T {
    let outcome = Mutex<Result<T, any Error>?>(nil)
    let done = DispatchSemaphore(value: 0)
    Task {
        do {
            let value = try await body()
            outcome.withLock { $0 = .success(value) }
        } catch {
            outcome.withLock { $0 = .failure(error) }
        }
        done.signal()
    }
    done.wait()
    return try outcome.withLock { $0! }.get()
}

/// Prints login progress to standard error (standard output is kept for data, such as `proxyctl token`).
/// The device flow's code goes to standard output (a container's log, a script), to standard error as well
/// when standard output is not the terminal, and to `notify_command`. While the login waits for the person,
/// a terminal shows what it waits for and a countdown, rewritten in place each second; elsewhere it is quiet.
final class StderrConsole: LoginConsole, @unchecked Sendable {
    // @unchecked Sendable: the countdown timer is touched under `lock` only; the context's handles are
    // thread-safe for writes.
    let context: CommandContext
    let notifyCommand: [String]?
    private let lock = Mutex(())
    private var timer: DispatchSourceTimer?
    private let terminal: Bool

    init(context: CommandContext, notifyCommand: [String]? = nil) {
        self.context = context
        self.notifyCommand = notifyCommand
        self.terminal = context.stderr.isTerminal
    }

    func say(_ line: String) {
        lock.withLock { _ in
            if timer != nil && terminal { context.stderr.write("\r\u{1B}[K") }
            context.err(line)
        }
    }

    func showDeviceCode(_ prompt: DeviceCodePrompt) {
        let text = prompt.lines.joined(separator: "\n") + "\n"
        context.stdout.write(text)
        if !context.stdout.isTerminal { context.stderr.write(text) }
        guard let words = notifyCommand, let first = words.first,
            let executable = ChildProcess.which(first, path: context.environment["PATH"])
        else { return }
        let message =
            "sign in to \(prompt.provider): visit \(prompt.verificationURI) and enter the code \(prompt.userCode)"
        var environment = context.environment
        environment["PROXYCTL_EVENT"] = "device_code"
        environment["PROXYCTL_PROVIDER"] = prompt.provider
        environment["PROXYCTL_VERIFICATION_URI"] = prompt.verificationURI
        environment["PROXYCTL_USER_CODE"] = prompt.userCode
        environment["PROXYCTL_EXPIRES_AT"] = String(prompt.expiresAt)
        if let complete = prompt.verificationURIComplete {
            environment["PROXYCTL_VERIFICATION_URI_COMPLETE"] = complete
        }
        environment["PROXYCTL_MESSAGE"] = message
        let started = try? ChildProcess.start(
            executable, Array(words.dropFirst()) + [message], environment: environment, output: .inherit,
            error: .inherit)
        if started == nil { context.err("notify_command \(first) could not be run") }
    }

    func waiting(for what: String, until deadline: Int64) {
        guard terminal else { return }
        let made = DispatchSource.makeTimerSource(queue: DispatchQueue.global())
        let context = self.context
        made.setEventHandler {
            let left = max(0, deadline - Int64(time(nil)))
            let seconds = left % 60 < 10 ? "0\(left % 60)" : "\(left % 60)"
            context.stderr.write("\r\u{1B}[KWaiting for \(what): \(left / 60):\(seconds) left (Ctrl-C stops)")
        }
        made.schedule(deadline: .now(), repeating: .seconds(1))
        lock.withLock { _ in
            timer?.cancel()
            timer = made
        }
        made.resume()
    }

    func waitEnded() {
        lock.withLock { _ in
            guard let timer else { return }
            timer.cancel()
            self.timer = nil
            if terminal { context.stderr.write("\r\u{1B}[K") }
        }
    }
}

extension AuthError {
    /// The error as a command failure: what happened and what to do.
    var commandFailure: CommandFailure {
        switch self {
        case .configuration(let reason): CommandFailure(message: "configuration problem: \(reason)")
        case .recoverable(let reason, let retryAfter):
            CommandFailure(message: retryAfter.map { "\(reason); try again in \($0)s" } ?? "\(reason); try again later")
        default: CommandFailure(message: description)
        }
    }
}

/// Opens URLs in a browser, or says why it cannot.
struct BrowserLauncher {
    let environment: [String: String]
    let interactive: Bool

    /// Why no browser will be opened, or nil when one can be.
    func unavailableReason(noBrowserFlag: Bool) -> String? {
        if noBrowserFlag { return "--no-browser was given" }
        if let browser = environment["BROWSER"], !browser.isEmpty { return nil }
        // Non-interactive runs never open a browser unless $BROWSER says which.
        if !interactive { return "this is not an interactive terminal and $BROWSER is not set" }
        let hasDisplay = !(environment["DISPLAY"] ?? "").isEmpty || !(environment["WAYLAND_DISPLAY"] ?? "").isEmpty
        if !hasDisplay {
            let ssh = environment["SSH_CONNECTION"] != nil || environment["SSH_TTY"] != nil
            return ssh ? "this is an SSH session without a display" : "there is no display"
        }
        if ChildProcess.which("xdg-open", path: environment["PATH"]) == nil { return "xdg-open is not installed" }
        return nil
    }

    /// Starts the browser on `url` without waiting for it; false when no command could be started.
    func open(_ url: String) -> Bool { launch(url, failed: { _ in }) == nil }

    /// Starts the browser on `url` without waiting for it, and returns why no command could be started (nil when
    /// one was). `$BROWSER` may list several commands separated by ":"; `%s` in one is replaced by the URL, else
    /// the URL is its last argument. No shell is involved. A command that starts and then exits with a status
    /// other than 0 (xdg-open that finds no browser, a `$BROWSER` entry that fails) is reported to `failed` as it
    /// ends, and the next command of `$BROWSER` is tried, as the `$BROWSER` convention asks; a browser that keeps
    /// running is never waited for.
    func launch(_ url: String, failed: @escaping @Sendable (String) -> Void) -> String? {
        // Only an https (or loopback http) URL of URL characters reaches a browser, and as one argument of an
        // execve (Process): never a file: URL, never a value a shell would split (CVE-2025-6514).
        if let problem = MetadataURL.browserProblem(url) { return "the URL is not opened in a browser: \(problem)" }
        let attempt = BrowserAttempt(candidates: candidates(url), path: environment["PATH"], failed: failed)
        let problems = attempt.start(from: 0)
        return problems.isEmpty ? nil : problems.joined(separator: "; ")
    }

    /// The commands to try, each as its words, the URL in place.
    private func candidates(_ url: String) -> [BrowserAttempt.Command] {
        var candidates: [BrowserAttempt.Command] = []
        if let browser = environment["BROWSER"], !browser.isEmpty {
            for command in browser.split(separator: ":") {
                var words = command.split(separator: " ").map(String.init)
                if words.contains(where: { $0.contains("%s") }) {
                    words = words.map { $0.replacing("%s", with: url) }
                } else {
                    words.append(url)
                }
                if let first = words.first { candidates.append(.init(words: words, name: "$BROWSER command \(first)")) }
            }
        } else {
            candidates.append(.init(words: ["xdg-open", url], name: "xdg-open"))
        }
        return candidates
    }
}

/// One browser start: the commands of `$BROWSER` (or xdg-open) tried in turn until one starts and does not
/// fail. Each process is watched for its end from a Dispatch thread; nothing waits for it.
final class BrowserAttempt: Sendable {
    struct Command {
        let words: [String]
        /// How messages name it: the program, never the URL (its arguments).
        let name: String
    }

    let candidates: [Command]
    let path: String?
    let failed: @Sendable (String) -> Void

    init(candidates: [Command], path: String?, failed: @escaping @Sendable (String) -> Void) {
        self.candidates = candidates
        self.path = path
        self.failed = failed
    }

    /// Starts the first command from `index` on that can be started; returns why each one before it could not
    /// (all of them when none started).
    func start(from index: Int) -> [String] {
        var problems: [String] = []
        for position in index..<candidates.count {
            let command = candidates[position]
            guard let first = command.words.first, let executable = ChildProcess.which(first, path: path) else {
                problems.append("\(command.name) is not found")
                continue
            }
            let ended: @Sendable (ChildProcess.Termination) -> Void = { [self] termination in
                guard termination != .exit(0) else { return }
                var message = "\(command.name) \(termination)"
                let remaining = candidates.count - position - 1
                let later = remaining > 0 ? start(from: position + 1) : []
                if later.count < remaining {
                    message += "; trying the next command of $BROWSER"
                } else if !later.isEmpty {
                    message += "; " + later.joined(separator: "; ")
                }
                failed(message)
            }
            do {
                try ChildProcess.start(executable, Array(command.words.dropFirst()), ended: ended)
                return []
            } catch {
                problems.append("\(command.name) cannot be started: \(error)")
            }
        }
        return problems
    }
}

/// Times for people: "2026-11-30 10:00:00 UTC (in 59 min)".
enum HumanTime {
    static func describe(_ epoch: Int64, now: Int64) -> String {
        "\(HTTPDate.utcText(epoch)) UTC (\(relative(epoch - now)))"
    }

    static func relative(_ seconds: Int64) -> String {
        let magnitude = abs(seconds)
        let text: String
        if magnitude < 60 {
            text = "\(magnitude)s"
        } else if magnitude < 3600 {
            text = "\(magnitude / 60) min"
        } else if magnitude < 86400 {
            text = "\(magnitude / 3600) h \(magnitude % 3600 / 60) min"
        } else {
            text = "\(magnitude / 86400) d"
        }
        if magnitude < 2 { return "now" }
        return seconds >= 0 ? "in \(text)" : "\(text) ago"
    }
}
