import Dispatch
import ProxyCore
import ProxyIO
import ProxyOAuth
import ProxyTLS
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

/// `proxyctl exec -- COMMAND [ARGS...]`: runs a command with the variables of `proxyctl env` set. With a
/// `proxyctl serve` running for this configuration (its record in state_dir), the command replaces proxyctl
/// and uses it. Without one, proxyctl starts the proxy itself on a free loopback port, with a credential made
/// for this run in the proxy URL it hands the command, runs the command, passes signals on, and stops the
/// proxy when the command ends, exiting with its status.
enum ExecCommand {
    static let spec = CommandSpec(
        name: "exec",
        abstract:
            "Run a command through the proxy: HTTPS_PROXY and the CA variables set, a proxy started if none runs.",
        discussion: """
            Example: proxyctl exec -- curl https://api.example.com/me. When proxyctl serve runs for this \
            configuration, the command uses it (and replaces proxyctl). Otherwise proxyctl starts the proxy \
            for the command alone, on a free 127.0.0.1 port, with a user name and password made for this run \
            in HTTPS_PROXY (so that no other local user can use it), passes SIGINT, SIGTERM, SIGHUP, SIGQUIT, \
            SIGUSR1, SIGUSR2 and SIGWINCH sent to proxyctl on to the command, and stops the proxy when the \
            command ends. The exit code is the command's (128+N when a signal N ended it; 127: not found). \
            Put -- before the command so its options are not read as proxyctl's.
            """,
        arguments: [
            ArgumentSpec(name: "command", help: "The program to run, then its arguments.", optional: false),
            ArgumentSpec(name: "arguments", help: "Its arguments (any number)."),
        ],
        options: [
            AuthEnvironment.configOption,
            .option(
                "log-level", value: "level", values: LogLevel.allCases.map(\.description),
                help:
                    "What the proxy started for the command logs to standard error: error, warn (default), info, debug."
            ),
            .flag("no-serve", help: "Do not use a running proxyctl serve; start a proxy for this command."),
        ],
        run: run
    )

    /// Signals passed on to the command when they are sent to proxyctl alone.
    static let forwarded: [Int32] = [SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH]

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let words = arguments.positionals
        guard let program = words.first else {
            throw UsageError(message: "Missing expected argument '<command>'", command: ["proxyctl", "exec"])
        }
        var level = LogLevel.warn
        if let text = arguments.value("log-level") {
            guard let parsed = LogLevel(name: text) else {
                throw UsageError(
                    message: "--log-level expects error, warn, info or debug", command: ["proxyctl", "exec"])
            }
            level = parsed
        }
        // Signals wait for the thread that passes them on: blocked before any other thread exists, so that
        // every thread made later inherits the mask.
        var blocked = sigset_t()
        sigemptyset(&blocked)
        for signal in forwarded { sigaddset(&blocked, signal) }
        var previousMask = sigset_t()
        pthread_sigmask(SIG_BLOCK, &blocked, &previousMask)

        let loader = ConfigLoader(environment: context.environment)
        let location = loader.locate(flag: arguments.value("config"))
        var configuration = try loader.load(location)
        let stateDirectory =
            configuration.proxy.stateDir ?? TokenStore.defaultStateDirectory(environment: context.environment)
        guard let path = ChildProcess.which(program, path: context.environment["PATH"]) else {
            throw CommandFailure(message: "\(program): command not found", exitCode: 127)
        }

        let running =
            arguments.flag("no-serve") ? nil : stateDirectory.flatMap { reachableServe($0, for: configuration) }
        if let running {
            var environment = context.environment
            let (url, problem) = EnvCommand.withOwnerCredential(
                EnvCommand.proxyURL(configuration, running: running), configuration, running: running,
                stateDirectory: stateDirectory)
            if let problem { context.err("proxyctl: \(problem)") }
            let (variables, notes) = ClientEnvironment.variables(
                configuration, stateDirectory: stateDirectory, proxyURL: url, inherited: context.environment)
            for note in notes { context.err("proxyctl: \(note)") }
            if running.proxyAuthentication {
                context.err(
                    "proxyctl: the running proxyctl serve (pid \(running.pid)) requires a user name and password: put them in HTTPS_PROXY yourself, or use --no-serve"
                )
            }
            for (name, value) in variables { environment[name] = value }
            pthread_sigmask(SIG_SETMASK, &previousMask, nil)
            let argv = words.map { strdup($0) } + [nil]
            let envp = environment.map { strdup("\($0.key)=\($0.value)") } + [nil]
            execve(path, argv, envp)
            throw CommandFailure(
                message: "\(program): cannot run it: \(String(cString: strerror(errno)))", exitCode: 126)
        }

        // No proxy runs for this configuration: one for this command alone, on loopback, with a credential
        // made for this run.
        let secret = Crypto.randomToken(bytes: 24)
        guard case .success(let credentials) = ProxyCredentials.parse("proxyctl:\(secret)", file: "exec") else {
            throw CommandFailure(message: "cannot make the proxy credential")
        }
        configuration.proxy.listen = ListenAddress(host: "127.0.0.1", port: 0, isIPv6: false)
        configuration.proxy.logLevel = level
        configuration.proxy.ownerNeedsNoCredentials = true
        configuration.proxy.adminListen = nil
        let ca = try ServeCommand.loadLocalCA(configuration, stateDirectory: stateDirectory)
        let logger = Logger(level: level, format: configuration.proxy.logFormat)
        EventLoop.initializeLibraries()
        let loop = EventLoop()
        let interception = try ProxyRuntime.interception(
            configuration, stateDirectory: stateDirectory, loop: loop, ca: ca)
        let server: ProxyServer
        let bound: ListenAddress
        do {
            server = try ProxyServer(
                loop: loop, logger: logger, settings: configuration.proxy, credentials: credentials,
                origins: configuration.origins, interception: interception, fileLimit: nil, stateDirectory: nil)
            // Not a serve other commands should find: it is this command's alone.
            server.writesServeRecord = false
            bound = try server.start(handleSignals: false)
        } catch {
            throw CommandFailure(message: "cannot start the proxy for the command: \(error)")
        }
        let proxyURL = "http://proxyctl:\(secret)@127.0.0.1:\(bound.port)"
        let (variables, notes) = ClientEnvironment.variables(
            configuration, stateDirectory: stateDirectory, proxyURL: proxyURL, inherited: context.environment)
        for note in notes { context.err("proxyctl: \(note)") }
        var environment = context.environment
        for (name, value) in variables { environment[name] = value }

        let finished = DispatchSemaphore(value: 0)
        let serverRef = LoopBound(server, loop: loop)
        logger.holdAccessLines(on: loop)
        Platform.startThread(name: "proxyctl-exec-loop") {
            loop.run()
            logger.flush()
            finished.signal()
        }

        let signals = ForwardedSignals()
        let waitedFor = blocked
        Platform.startThread(name: "proxyctl-exec-signals") {
            while true {
                guard let (number, fromTerminal) = Platform.waitForSignal(waitedFor) else { continue }
                // The terminal sends Ctrl-C, Ctrl-\ and window changes to the whole foreground process group,
                // the command included: passing them on would deliver them twice.
                if fromTerminal { continue }
                let pid = signals.child.load(ordering: .acquiring)
                if pid > 0 {
                    kill(pid, number)
                } else if pid == 0 {
                    signals.pending.store(number, ordering: .releasing)
                }
            }
        }

        let pid: pid_t
        do {
            pid = try spawn(path: path, words: words, environment: environment, mask: previousMask)
        } catch {
            stop(serverRef, loop: loop, finished: finished, grace: 1000)
            throw error
        }
        signals.child.store(pid, ordering: .releasing)
        let early = signals.pending.exchange(0, ordering: .acquiring)
        if early != 0 { kill(pid, early) }

        var status: Int32 = 0
        while waitpid(pid, &status, 0) < 0 && errno == EINTR {}
        signals.child.store(-1, ordering: .releasing)
        stop(serverRef, loop: loop, finished: finished, grace: configuration.proxy.shutdownGrace)
        // WIFEXITED / WTERMSIG are macros: the low seven bits are the signal, the next byte the exit code.
        let signal = status & 0x7f
        return signal == 0 ? (status >> 8) & 0xff : 128 + signal
    }

    /// A running serve of this state directory that accepts connections.
    /// A running serve of `configuration` that accepts connections. Several configurations may share a state
    /// directory (and so its serve records): a serve of another one protects other origins, so it is used only
    /// when it runs the same file (or the same text) with the same protected origins.
    static func reachableServe(_ stateDirectory: String, for configuration: Configuration) -> ServeState? {
        let source = ConfigLoader.canonical(configuration.source)
        let origins = Set(configuration.origins.origins.map(\.url))
        for state in ServeState.allRunning(stateDirectory: stateDirectory)
        where ConfigLoader.canonical(state.configuration) == source && Set(state.origins.keys) == origins {
            guard let address = ListenAddress.parse(state.listen) else { continue }
            let host = address.host == "0.0.0.0" ? "127.0.0.1" : (address.host == "::" ? "::1" : address.host)
            if DoctorCommand.canConnect(host: host, port: address.port) { return state }
        }
        return nil
    }

    /// Starts the command with the signal mask proxyctl had before and default dispositions.
    static func spawn(path: String, words: [String], environment: [String: String], mask: sigset_t) throws -> pid_t {
        // An opaque pointer in Darwin's headers, a struct in glibc's (docs/porting.md).
        #if canImport(Darwin)
            var attributes: posix_spawnattr_t = nil
        #else
            var attributes = posix_spawnattr_t()
        #endif
        posix_spawnattr_init(&attributes)
        defer { posix_spawnattr_destroy(&attributes) }
        var childMask = mask
        posix_spawnattr_setsigmask(&attributes, &childMask)
        var defaults = sigset_t()
        sigemptyset(&defaults)
        for signal in forwarded + [SIGPIPE] { sigaddset(&defaults, signal) }
        posix_spawnattr_setsigdefault(&attributes, &defaults)
        posix_spawnattr_setflags(&attributes, Int16(POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF))
        let argv = words.map { strdup($0) } + [nil]
        let envp = environment.map { strdup("\($0.key)=\($0.value)") } + [nil]
        defer {
            for pointer in argv { free(pointer) }
            for pointer in envp { free(pointer) }
        }
        var pid = pid_t()
        let result = posix_spawn(&pid, path, nil, &attributes, argv, envp)
        guard result == 0 else {
            throw CommandFailure(
                message: "\(words[0]): cannot run it: \(String(cString: strerror(result)))",
                exitCode: result == ENOENT ? 127 : 126)
        }
        return pid
    }

    /// Stops the proxy (connections still open get `grace` milliseconds) and waits for its loop to end.
    static func stop(_ server: LoopBound<ProxyServer>, loop: EventLoop, finished: DispatchSemaphore, grace: Int) {
        loop.post { server.value.beginShutdown() }
        _ = finished.wait(timeout: .now() + .milliseconds(grace + 2000))
    }
}

/// The command's pid for the thread that passes signals on (0: not started yet, -1: it ended), and a signal
/// that came before it started.
final class ForwardedSignals: Sendable {
    let child = Atomic<Int32>(0)
    let pending = Atomic<Int32>(0)
}
