import CLibevent
import Dispatch
import ProxyCore
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

/// Why the server could not start.
public struct ServerError: Error, CustomStringConvertible {
    public let message: String
    /// The address to listen on is taken (EADDRINUSE): the command says by whom.
    public var addressInUse = false
    public var description: String { message }
}

/// What protected origins need at run time: the local CA, a token manager per provider, and where request
/// bodies are spooled.
public struct Interception: Sendable {
    public var ca: LocalCA?
    public var managers: [String: TokenManager]
    public var spoolDirectory: String
    /// DPoP keys of the providers with `token_binding = dpop`, for proofs on resource requests.
    public var dpopKeys: [String: DPoPKey]
    /// Where keys are looked up again when they change.
    public var stateDirectory: String?
    /// The static secrets of origins without a provider, by `SecretSource.name`.
    public var secrets: [String: StaticSecret]

    public init(
        ca: LocalCA?, managers: [String: TokenManager], spoolDirectory: String, dpopKeys: [String: DPoPKey] = [:],
        stateDirectory: String? = nil, secrets: [String: StaticSecret] = [:]
    ) {
        self.ca = ca
        self.secrets = secrets
        self.managers = managers
        self.spoolDirectory = spoolDirectory
        self.dpopKeys = dpopKeys
        self.stateDirectory = stateDirectory
    }
}

/// What a SIGHUP loaded: the `[proxy]` settings and users, and the protected origins with what they need.
public struct Reloaded: Sendable {
    public var settings: ProxySettings
    public var credentials: ProxyCredentials?
    public var origins: OriginTable
    /// The providers' token managers, the CA and the DPoP keys for `origins`; nil keeps the current ones (and
    /// the current origins).
    public var interception: Interception?
    /// What could not be applied, and why (logged as warnings).
    public var notes: [String]
    /// What was not applied, in a few words each (`state_dir`, `[origin] and [provider] changes`): the reload's
    /// last line names them instead of saying the configuration was reloaded.
    public var notApplied: [String] = []

    public init(
        settings: ProxySettings, credentials: ProxyCredentials?, origins: OriginTable, interception: Interception?,
        notes: [String] = []
    ) {
        self.settings = settings
        self.credentials = credentials
        self.origins = origins
        self.interception = interception
        self.notes = notes
    }
}

/// The forward proxy: a listener, the connections it accepted, the signals that stop or reload it.
///
/// Lives on one loop thread. Connections are owned by `connections` and find the server through an unowned
/// reference; the server outlives them all.
public final class ProxyServer: ConnectionOwner {
    let loop: EventLoop
    public let logger: Logger
    private(set) var settings: ProxySettings
    private(set) var frontDoor: FrontDoor
    private(set) var resolver: Resolver

    private var listener: OpaquePointer?
    private var connections: [ObjectIdentifier: any ServerConnection] = [:]
    /// Connections open per client address, for `max_connections_per_client`.
    private var clientCounts: [String: Int] = [:]
    /// The limits on connections, from the settings and the open-file limit.
    private(set) var admission: Admission
    private let fileLimit: Int
    /// Tokens for protected origins.
    private(set) var tokens: TokenBroker
    /// TLS contexts with leaves from the local CA; nil without protected https origins.
    private(set) var tlsContexts: TLSServerContexts?
    /// Trust for the proxy's own TLS connections to origins (made again on a reload: ca_files are read anew).
    private var tlsClients = TLSClientContexts()
    private(set) var spoolDirectory: String
    /// DPoP keys by provider.
    private var keys: DPoPKeyring
    private var stateDirectory: String?
    /// Pipes for splicing tunnel bytes.
    private let pipes = PipePool()
    /// A buffer for tunnels that copy (where splice is not available).
    private let tunnelBuffer = TunnelBuffer()
    /// What request bodies kept for replays hold in the whole process (`replay_memory_total`, `replay_spool_total`).
    private let replayBudget: ReplayBudget
    /// Peer lookups for the "owner" rules and the audit log's client processes.
    private let peers: PeerLookup
    /// The latest DPoP nonce of each protected origin, from every response (RFC 9449 §9).
    let resourceNonces = DPoPNonces()
    /// What new connections get; replaced on SIGHUP (connections in flight keep theirs).
    private var context: ConnectionContext?
    /// Step-up records and notices are file and process work: done off the loop, in order.
    private let notices = DispatchQueue(label: "proxyctl.notices")
    private var nextID: UInt64 = 0
    private(set) var draining = false
    private var listenerPaused = false
    private var signalEvents: [OpaquePointer] = []
    private var graceTimer: LoopTimer?
    private var refreshPoll: LoopTimer?
    /// Loads the configuration again on SIGHUP; nil disables reloading.
    private let reload: (() -> Result<Reloaded, any Error>)?
    public private(set) var boundAddress: ListenAddress
    /// The counters behind the admin listener's `/metrics`.
    public let metrics = ProxyMetrics()
    /// Token brokers replaced by a SIGHUP, kept while a refresh of theirs may still be out (shutdown waits).
    private var retiredBrokers: [TokenBroker] = []
    /// Recorded in this serve's record under state_dir (for `proxyctl status`, `doctor`, `exec`).
    public var configurationSource: String?
    public var adminAddress: String?
    /// Whether this proxy leaves a record under state_dir (`proxyctl exec`'s own proxy does not).
    public var writesServeRecord = true
    /// A listening socket the service manager passed (systemd socket activation): `start` accepts on it instead
    /// of binding `listen`, and a reload keeps it.
    public var inheritedListener: Int32?
    /// Whether the service manager hears of reloads and the shutdown (`RELOADING=1`, `READY=1`, `STOPPING=1`;
    /// `serve` under systemd), through `Platform.notifyServiceManager`.
    public var notifiesServiceManager = false
    /// The owner credential (`FrontDoor.ownerCredential`), where the kernel cannot name a client's user; kept
    /// across reloads. Set before `start`.
    public var ownerCredential: ProxyCredentials? {
        didSet {
            frontDoor.ownerCredential = ownerCredential
            context = nil
        }
    }

    public init(
        loop: EventLoop, logger: Logger, settings: ProxySettings, credentials: ProxyCredentials?,
        origins: OriginTable = OriginTable(), interception: Interception? = nil,
        reload: (() -> Result<Reloaded, any Error>)? = nil, fileLimit: Int? = nil,
        stateDirectory: String? = nil
    ) throws {
        // Streaming buffers are allocated and freed all the time: keep glibc from mapping and trimming them.
        Platform.tuneAllocator()
        self.fileLimit = fileLimit ?? Self.openFileLimit()
        self.admission = Admission(settings: settings, fileLimit: self.fileLimit)
        self.loop = loop
        self.peers = PeerLookup(loop: loop)
        self.logger = logger
        self.settings = settings
        self.replayBudget = ReplayBudget(Self.replayLimits(settings))
        self.boundAddress = settings.listen
        self.frontDoor = FrontDoor(
            settings: settings, credentials: credentials, boundAddress: settings.listen, origins: origins)
        self.reload = reload
        self.resolver = Resolver(overrides: settings.resolve)
        self.tokens = TokenBroker(
            loop: loop, managers: interception?.managers ?? [:], secrets: interception?.secrets ?? [:])
        self.tlsContexts = try interception?.ca.map { try TLSServerContexts(ca: $0, http2: settings.http2) }
        self.spoolDirectory = interception?.spoolDirectory ?? Platform.temporaryDirectory
        self.keys = DPoPKeyring(
            loop: loop, keys: interception?.dpopKeys ?? [:], stateDirectory: interception?.stateDirectory)
        self.stateDirectory = stateDirectory ?? interception?.stateDirectory
    }

    private static func replayLimits(_ settings: ProxySettings) -> ReplayBudget.Limits {
        ReplayBudget.Limits(memory: settings.replayMemoryTotal, spool: settings.replaySpoolTotal)
    }

    /// The context for connections accepted from now on: the current settings, front door and resolver.
    private func currentContext() -> ConnectionContext {
        if let context { return context }
        let made = ConnectionContext(
            loop: loop, logger: logger, frontDoor: frontDoor, resolver: resolver,
            tokens: tokens,
            tlsContexts: tlsContexts, tlsClients: tlsClients, spoolDirectory: spoolDirectory,
            replayBudget: replayBudget, nonces: resourceNonces,
            keys: keys, pipes: pipes, tunnelBuffer: tunnelBuffer, peers: peers, owner: self, audit: currentAudit())
        context = made
        return made
    }

    /// The audit log of the state directory, made once and again when `audit_max_size` changes.
    private var auditLog: AuditLog?

    private func currentAudit() -> AuditLog? {
        guard let stateDirectory, settings.auditMaxSize > 0 else { return nil }
        if let auditLog, auditLog.maxBytes == settings.auditMaxSize { return auditLog }
        let made = AuditLog(
            stateDirectory: stateDirectory, maxBytes: settings.auditMaxSize, logger: logger, peers: peers, loop: loop)
        auditLog?.flush()
        auditLog = made
        return made
    }

    deinit {
        if let listener { evconnlistener_free(listener) }
        for event in signalEvents { event_free(event) }
    }

    /// Binds the listener and installs the signal handlers. Returns the bound address (the port may have
    /// been 0).
    /// - Parameter handleSignals: SIGTERM/SIGINT stop it and SIGHUP reloads (serve); `exec` handles signals
    ///   itself and stops the server when its command ends.
    @discardableResult
    public func start(handleSignals: Bool = true) throws -> ListenAddress {
        let bound = try inheritedListener.map(adopt) ?? bind(settings.listen)
        boundAddress = bound
        frontDoor.boundAddress = bound
        context = nil
        if handleSignals { installSignals() }
        startServeState()
        metrics.setListening(true)
        return bound
    }

    private func bind(_ address: ListenAddress) throws -> ListenAddress {
        guard let socketAddress = SocketAddress(ip: address.host, port: address.port) else {
            throw ServerError(message: "cannot listen on \(address): not an IP address")
        }
        let flags = LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_EXEC
        let made = socketAddress.withSockaddr { pointer, length in
            evconnlistener_new_bind(loop.base, nil, nil, UInt32(flags), 1024, pointer, Int32(length))
        }
        guard let made else {
            let code = proxyctl_errno()
            throw ServerError(
                message: "cannot listen on \(address): \(String(cString: strerror(code)))",
                addressInUse: code == EADDRINUSE)
        }
        if let listener { evconnlistener_free(listener) }
        listener = made
        evconnlistener_set_cb(made, acceptCallback, Unmanaged.passUnretained(self).toOpaque())
        evconnlistener_set_error_cb(made, acceptErrorCallback)
        var storage = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        let fd = evconnlistener_get_fd(made)
        let actual = withUnsafeMutablePointer(to: &storage) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { sockaddrPointer -> SocketAddress in
                getsockname(fd, sockaddrPointer, &length)
                return SocketAddress(sockaddrPointer, length: length)
            }
        }
        return ListenAddress(host: address.host, port: actual.port, isIPv6: address.isIPv6)
    }

    /// Accepts on `fd`, a socket that already listens (from the service manager): a TCP socket of IPv4 or IPv6
    /// that listens, else an error naming what it is.
    private func adopt(_ fd: Int32) throws -> ListenAddress {
        var type: Int32 = 0
        var listening: Int32 = 0
        var size = socklen_t(MemoryLayout<Int32>.size)
        var storage = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        let address = withUnsafeMutablePointer(to: &storage) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { sockaddrPointer -> SocketAddress? in
                guard getsockname(fd, sockaddrPointer, &length) == 0 else { return nil }
                return SocketAddress(sockaddrPointer, length: length)
            }
        }
        guard let address, address.family == AF_INET || address.family == AF_INET6,
            getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &size) == 0, type == Platform.streamSocketType,
            getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &size) == 0, listening != 0
        else {
            throw ServerError(
                message:
                    "the socket the service manager passed (descriptor \(fd)) is not a listening TCP socket; give proxyctl.socket a ListenStream= of an IP address and port"
            )
        }
        // libevent accepts until EAGAIN: the socket must not block (systemd passes it blocking). Backlog 0: it
        // listens already.
        _ = evutil_make_socket_nonblocking(fd)
        let flags = LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC
        guard let made = evconnlistener_new(loop.base, nil, nil, UInt32(flags), 0, fd) else {
            throw ServerError(message: "cannot accept on the socket the service manager passed (descriptor \(fd))")
        }
        if let listener { evconnlistener_free(listener) }
        listener = made
        evconnlistener_set_cb(made, acceptCallback, Unmanaged.passUnretained(self).toOpaque())
        evconnlistener_set_error_cb(made, acceptErrorCallback)
        return ListenAddress(host: address.ipString, port: address.port, isIPv6: address.family == AF_INET6)
    }

    // MARK: - Accepting

    /// The process's open-file limit (its soft limit, which serve raises to the hard one first).
    public static func openFileLimit() -> Int { Platform.openFileLimit() }

    func accepted(fd: Int32, address: UnsafeMutablePointer<sockaddr>?, length: Int32) {
        let socketAddress = address.map { SocketAddress($0, length: socklen_t(length)) }
        let peer = socketAddress?.description ?? "-"
        let client = socketAddress?.ipString ?? "-"
        if draining {
            Platform.closeDescriptor(fd)
            return
        }
        _ = evutil_make_socket_nonblocking(fd)
        if let answer = admission.decide(open: connections.count, fromClient: clientCounts[client, default: 0]) {
            turnAway(fd, answer, client: client)
            return
        }
        nextID += 1
        metrics.update { $0.connectionsAccepted += 1 }
        let connection = ClientDriver(context: currentContext(), id: nextID, fd: fd, peer: peer, client: client)
        adopt(connection)
    }

    /// Answers a client the proxy cannot serve now and closes: one write to a fresh socket, never a wait.
    private func turnAway(_ fd: Int32, _ answer: ProxyAnswer, client: String) {
        let bytes = answer.response.serialized()
        _ = bytes.withUnsafeBytes { Platform.send(fd, $0) }
        Platform.closeDescriptor(fd)
        turnedAway += 1
        metrics.update {
            $0.connectionsTurnedAway += 1
            $0.record(
                RequestOutcome(
                    kind: .proxy, status: answer.status, proxyError: answer.response.proxyStatus?.error?.rawValue))
        }
        let now = EventLoop.monotonicMilliseconds()
        if now - lastTurnAwayLog >= 10_000 {
            lastTurnAwayLog = now
            logger.warn(
                "turned away \(turnedAway) connection(s) with 503 (last from \(client)): \(answer.response.proxyStatus?.details ?? "")"
            )
            turnedAway = 0
        }
    }

    private var turnedAway = 0
    private var lastTurnAwayLog: Int64 = -10_000

    /// accept(2) failed. Out of descriptors (EMFILE, ENFILE) or memory, the listening socket stays readable
    /// and the loop would spin: pause accepting for a moment instead.
    func acceptFailed(errno code: Int32) {
        guard code == EMFILE || code == ENFILE || code == ENOBUFS || code == ENOMEM else { return }
        logger.warn(
            "cannot accept connections: \(String(cString: strerror(code))); pausing for 1s (\(connections.count) open)")
        guard !listenerPaused, let listener else { return }
        listenerPaused = true
        evconnlistener_disable(listener)
        let timer = LoopTimer(loop: loop) { [unowned self] in
            acceptRetryTimer = nil
            guard listenerPaused, !draining else { return }
            listenerPaused = false
            evconnlistener_enable(self.listener)
        }
        timer.schedule(milliseconds: 1000)
        acceptRetryTimer = timer
    }

    private var acceptRetryTimer: LoopTimer?

    // MARK: - State for `proxyctl status`

    private var serveState: ServeState?
    private var serveStateDirty = false
    private var serveStateTimer: LoopTimer?
    /// Hosts wildcard origins served, kept in the state directory across restarts (`SeenHosts`).
    private var seenHosts = SeenHosts()
    private var seenHostsDirty = false
    /// The wildcard (its URL) covering each host this serve has served under one.
    private var wildcardOfHost: [String: String] = [:]

    /// Counts an intercepted exchange for `proxyctl status` and the metrics.
    func record(_ record: ExchangeRecord, up: Int, down: Int, milliseconds: Int64) {
        metrics.update { $0.recordExchange(record, up: up, down: down, milliseconds: milliseconds) }
        guard serveState != nil else { return }
        let origin = record.origin
        // Every configured origin has its counts from the start: an origin without them is a host a wildcard
        // section covers, met for the first time. One lookup of the origin, counted in place: reading
        // `serveState!.origins[origin]` first copied the whole state and hashed the origin again (about 1,200
        // instructions per request, callgrind, bench row 6).
        var firstTime = false
        Self.count(
            record,
            in: &serveState!.origins[
                origin,
                default: {
                    firstTime = true
                    return ServeState.OriginCounts()
                }()])
        serveStateDirty = true
        if firstTime, let wildcard = frontDoor.origins.wildcard(covering: origin) {
            wildcardOfHost[origin] = wildcard.url
        }
        if !wildcardOfHost.isEmpty, let wildcard = wildcardOfHost[origin],
            seenHosts.record(origin, under: wildcard, at: Int64(time(nil)))
        {
            seenHostsDirty = true
        }
    }

    /// Writes the hosts wildcard origins served, off the loop (a file merged and replaced, fsynced).
    private func writeSeenHosts() {
        guard seenHostsDirty, let stateDirectory else { return }
        seenHostsDirty = false
        let seen = seenHosts
        let wildcards = Set(frontDoor.origins.origins.filter(\.isWildcard).map(\.url))
        let logger = self.logger
        notices.async {
            do {
                try seen.save(stateDirectory: stateDirectory, wildcards: wildcards)
            } catch {
                logger.warn("cannot write \(SeenHosts.path(stateDirectory: stateDirectory)): \(error)")
            }
        }
    }

    private static func count(_ record: ExchangeRecord, in counts: inout ServeState.OriginCounts) {
        counts.requests += 1
        if record.keptClientAuthorization { counts.clientAuthorizationKept += 1 }
        if record.attached { counts.tokenAttached += 1 }
        if record.refreshed { counts.refreshed += 1 }
        if record.nonceRetried { counts.nonceRetried += 1 }
        if record.stepUp { counts.stepUps += 1 }
        if record.answeredByProxy { counts.answeredByProxy += 1 }
    }

    /// A request ended (not an exchange with a protected origin: those come through `record`).
    func count(_ outcome: RequestOutcome) {
        metrics.update { $0.record(outcome) }
    }

    /// A tunnel ended: a CONNECT that was passed through (counted as a request when it ends, with its
    /// bytes) or an upgraded connection (its request was counted when the 101 went through).
    func tunnelEnded(upgrade: Bool, status: Int, up: Int, down: Int) {
        metrics.update {
            $0.tunnels[upgrade ? "upgrade" : "blind", default: 0] += 1
            if upgrade {
                $0.addBytes(.passthrough, up: up, down: down)
            } else {
                $0.record(RequestOutcome(kind: .connect, status: status, up: up, down: down))
            }
        }
    }

    /// A CONNECT to a protected origin was answered 200 and its TLS session begins.
    func interceptionStarted() {
        metrics.update {
            $0.tunnels["intercepted", default: 0] += 1
            $0.record(RequestOutcome(kind: .connect, status: 200))
        }
    }

    private func startServeState() {
        guard writesServeRecord, let stateDirectory else { return }
        // Records of serves that are gone (killed, crashed) go; those of other live serves stay.
        _ = ServeState.allRunning(stateDirectory: stateDirectory, removeStale: true)
        var state = ServeState(pid: getpid(), listen: boundAddress.description, startedAt: Int64(time(nil)))
        state.proxyAuthentication = frontDoor.credentials != nil
        state.ownerCredential = frontDoor.ownerCredential != nil
        state.configuration = configurationSource
        state.admin = adminAddress
        for origin in frontDoor.origins.origins { state.origins[origin.url] = ServeState.OriginCounts() }
        serveState = state
        writeServeState()
        let timer = LoopTimer(loop: loop) { [unowned self] in
            if serveStateDirty { writeServeState() }
            writeSeenHosts()
            serveStateTimer?.schedule(milliseconds: 5000)
        }
        timer.schedule(milliseconds: 5000)
        serveStateTimer = timer
    }

    private func writeServeState() {
        guard let serveState, let stateDirectory else { return }
        serveStateDirty = false
        do {
            try serveState.save(stateDirectory: stateDirectory)
        } catch {
            logger.warn("cannot write \(ServeState.path(stateDirectory: stateDirectory)): \(error)")
        }
    }

    /// Removes this serve's record when the proxy stops.
    public func removeServeState() {
        guard let serveState, let stateDirectory else { return }
        serveState.remove(stateDirectory: stateDirectory)
        // The hosts met since the last write, after any write still queued.
        if seenHostsDirty {
            seenHostsDirty = false
            let seen = seenHosts
            let wildcards = Set(frontDoor.origins.origins.filter(\.isWildcard).map(\.url))
            notices.sync { try? seen.save(stateDirectory: stateDirectory, wildcards: wildcards) }
        }
    }

    // MARK: - Telling the user

    private var lastSignInNotice: [String: Int64] = [:]

    /// A protected origin asked for a stronger sign-in (RFC 9470): record it for `proxyctl step-up` and
    /// `proxyctl status`, log it once, and run `notify_command`. The store is files: off the loop.
    func stepUpRequired(origin: OriginConfig, challenge: Challenge) {
        var made = PendingStepUp(
            origin: origin.url, provider: origin.provider, acrValues: challenge["acr_values"],
            maxAge: challenge["max_age"].flatMap { Int($0) }, at: Int64(time(nil)))
        made.scope = challenge.insufficientScope?.joined(separator: " ")
        let pending = made
        let stateDirectory = self.stateDirectory
        let logger = self.logger
        let notifyCommand = settings.notifyCommand
        notices.async {
            // Announced once while it is pending; after `proxyctl step-up` cleared it, the same challenge is new.
            let store = stateDirectory.map { StepUpStore(stateDirectory: $0) }
            let alreadyPending = store?.load().contains {
                $0.origin == pending.origin && $0.acrValues == pending.acrValues && $0.maxAge == pending.maxAge
                    && $0.scope == pending.scope
            }
            if alreadyPending == true { return }
            let wanted = pending.requirement
            let message =
                pending.scope != nil
                ? "\(origin.url) needs \(wanted), which the token lacks; run: \(pending.command)"
                : "\(origin.url) requires a stronger sign-in\(wanted.isEmpty ? "" : " (\(wanted))"); run: \(pending.command)"
            logger.warn("step-up: \(message)")
            if let store {
                do {
                    try store.record(pending)
                } catch {
                    logger.error("cannot record the step-up challenge: \(error)")
                }
            }
            Self.notify(
                notifyCommand, logger: logger, event: "step_up", provider: origin.provider, origin: origin.url,
                command: pending.command, message: message)
        }
    }

    private var lastMismatchNotice: [String: Int64] = [:]

    /// A protected origin's 401 named metadata whose authorization servers do not include its provider's issuer
    /// (RFC 9728): the client got that 401 with `Proxy-Status`; the log says what to run (at most once a minute per
    /// origin). Nothing switches providers by itself.
    func wrongAuthorizationServer(origin: OriginConfig, servers: [String]) {
        let now = Int64(time(nil))
        if let last = lastMismatchNotice[origin.url], now - last < 60 { return }
        lastMismatchNotice[origin.url] = now
        logger.warn(
            "wrong authorization server: \(origin.url)'s protected resource metadata names \(servers.joined(separator: ", ")), not the issuer of [provider \(origin.provider)] (\(tokens.issuer(of: origin.provider) ?? "not configured")); its tokens will not be accepted there. To sign in where the origin says, run: proxyctl init --origin \(origin.url) --config NEW.conf (or change [origin \(origin.url)] in \(origin.file.isEmpty ? "proxy.conf" : origin.file))"
        )
    }

    /// Tokens for `provider` cannot be had without the user: say so (at most once a minute per provider).
    func signInNeeded(provider: String, origin: String, reason: String) {
        metrics.update { $0.providers[provider, default: MetricsRegistry.ProviderCounts()].signInNeeded += 1 }
        let now = Int64(time(nil))
        if let last = lastSignInNotice[provider], now - last < 60 { return }
        lastSignInNotice[provider] = now
        let message = "\(reason) (requests to \(origin) get 401 until then)"
        logger.warn("sign-in needed: \(message)")
        let (notifyCommand, logger) = (settings.notifyCommand, self.logger)
        notices.async {
            Self.notify(
                notifyCommand, logger: logger, event: "sign_in", provider: provider, origin: origin,
                command: "proxyctl login \(provider)", message: message)
        }
    }

    /// Runs `notify_command` with the message as its last argument and the details in the environment. No
    /// shell is involved; the proxy does not wait for it.
    private static func notify(
        _ notifyCommand: [String]?, logger: Logger, event: String, provider: String, origin: String, command: String,
        message: String
    ) {
        guard let words = notifyCommand, let first = words.first else { return }
        let (path, arguments) = first.contains("/") ? (first, Array(words.dropFirst())) : ("/usr/bin/env", words)
        var environment = ProcessInfo.processInfo.environment
        environment["PROXYCTL_EVENT"] = event
        environment["PROXYCTL_PROVIDER"] = provider
        environment["PROXYCTL_ORIGIN"] = origin
        environment["PROXYCTL_COMMAND"] = command
        environment["PROXYCTL_MESSAGE"] = message
        do {
            try ChildProcess.start(
                path, arguments + [message], environment: environment, output: .inherit, error: .inherit)
        } catch {
            logger.warn("notify_command \(first) could not be run: \(error)")
        }
    }

    /// Tracks a connection: one just accepted, or one made by another (a tunnel or a TLS session takes a
    /// client connection over; the old one closes right after, so the count of its address stays the same).
    func adopt(_ connection: any ServerConnection) {
        connections[ObjectIdentifier(connection)] = connection
        clientCounts[connection.clientAddress, default: 0] += 1
        let open = connections.count
        metrics.update { $0.connectionsOpen = open }
    }

    func connectionClosed(_ connection: any ServerConnection) {
        guard connections.removeValue(forKey: ObjectIdentifier(connection)) != nil else { return }
        let open = connections.count
        metrics.update { $0.connectionsOpen = open }
        let address = connection.clientAddress
        if let count = clientCounts[address], count > 1 {
            clientCounts[address] = count - 1
        } else {
            clientCounts.removeValue(forKey: address)
        }
        if draining && connections.isEmpty {
            logger.info("all connections finished; exiting")
            stopAfterRefreshes()
        }
    }

    /// Stops the loop once no refresh token is out at a provider: a refresh still unanswered (its callers
    /// may have stopped waiting) holds the only copy of the rotated refresh token, and exiting before its
    /// answer is stored would sign the user out. The grace timer still bounds the wait.
    private func stopAfterRefreshes() {
        retiredBrokers.removeAll { !$0.refreshInFlight }
        guard tokens.refreshInFlight || !retiredBrokers.isEmpty else {
            stopLoop()
            return
        }
        if refreshPoll == nil {
            logger.info("waiting for a token refresh in flight to be answered and stored before exiting")
            refreshPoll = LoopTimer(loop: loop) { [unowned self] in stopAfterRefreshes() }
        }
        refreshPoll?.schedule(milliseconds: 20)
    }

    /// Stops the loop; audit lines still waiting for their client's process are written without it first.
    private func stopLoop() {
        peers.answerWaiting()
        auditLog?.flush()
        loop.stop()
    }

    /// Open client connections (for tests and status).
    public var connectionCount: Int { connections.count }

    // MARK: - Signals

    private func installSignals() {
        let context = Unmanaged.passUnretained(self).toOpaque()
        for signalNumber in [SIGTERM, SIGINT, SIGHUP] {
            guard let event = proxyctl_evsignal_new(loop.base, signalNumber, signalCallback, context) else { continue }
            event_add(event, nil)
            signalEvents.append(event)
        }
    }

    func handleSignal(_ number: Int32) {
        switch number {
        case SIGHUP:
            reloadConfiguration()
        default:
            if draining {
                logger.info("second signal: exiting now with \(connections.count) connection(s) open")
                // Every connection ends here, its transfers cancelled, before the loop stops: nothing of theirs
                // is left to run while the server and its pools are torn down.
                for connection in Array(connections.values) { connection.abort("second signal") }
                stopLoop()
                return
            }
            beginShutdown()
        }
    }

    /// Stops accepting, closes idle connections, and lets the rest finish within the grace period.
    public func beginShutdown() {
        if notifiesServiceManager { Platform.notifyServiceManager("STOPPING=1") }
        draining = true
        metrics.setListening(false)
        if let listener {
            evconnlistener_free(listener)
            self.listener = nil
        }
        // Idle connections close at once; the others finish their exchange first.
        for connection in Array(connections.values) { connection.shutdown() }
        if connections.isEmpty {
            logger.info("shutting down: no connections open")
            stopAfterRefreshes()
            if tokens.refreshInFlight { startGraceTimer() }
            return
        }
        logger.info(
            "shutting down: waiting up to \(ConfigValue.describeDuration(settings.shutdownGrace)) for \(connections.count) connection(s)"
        )
        startGraceTimer()
    }

    private func startGraceTimer() {
        let timer = LoopTimer(loop: loop) { [unowned self] in
            logger.info("grace period over: closing \(connections.count) connection(s)")
            for connection in Array(connections.values) { connection.abort("shutdown") }
            stopLoop()
        }
        timer.schedule(milliseconds: settings.shutdownGrace)
        graceTimer = timer
    }

    /// Signs leaves with `ca` from now on (a CA `proxyctl ca init` made while the proxy runs, `LocalCAWatch`): new
    /// connections get TLS contexts minting from it; connections already open keep theirs.
    @discardableResult
    public func signWith(_ ca: LocalCA) -> Bool {
        do {
            tlsContexts = try TLSServerContexts(ca: ca, http2: settings.http2)
            context = nil
            return true
        } catch {
            logger.error("cannot set up TLS with the new local CA: \(error); the CA before it stays in use")
            return false
        }
    }

    private func reloadConfiguration() {
        guard notifiesServiceManager else { return reloadNow() }
        // sd_notify(3): the service manager knows a reload from its start to READY=1.
        Platform.notifyServiceManager("RELOADING=1")
        reloadNow()
        Platform.notifyServiceManager("READY=1\nSTATUS=listening on http://\(boundAddress)")
    }

    private func reloadNow() {
        guard let reload else {
            logger.warn("SIGHUP: no configuration file to reload")
            return
        }
        switch reload() {
        case .failure(let error):
            logger.error("SIGHUP: the new configuration has errors; still serving the old one:\n\(error)")
        case .success(let reloaded):
            let (newSettings, credentials) = (reloaded.settings, reloaded.credentials)
            if newSettings.listen != settings.listen && inheritedListener != nil {
                logger.warn(
                    "SIGHUP: listen changed, but the socket comes from the service manager: change ListenStream= of proxyctl.socket instead (systemctl --user edit proxyctl.socket); still listening on \(boundAddress)"
                )
            } else if newSettings.listen != settings.listen {
                do {
                    boundAddress = try bind(newSettings.listen)
                } catch {
                    logger.error("SIGHUP: \(error); still serving the old configuration")
                    return
                }
                logger.info("listening on http://\(boundAddress)")
            }
            settings = newSettings
            replayBudget.limits = Self.replayLimits(newSettings)
            admission = Admission(settings: newSettings, fileLimit: fileLimit)
            resolver = Resolver(overrides: newSettings.resolve)
            var origins = frontDoor.origins
            if let interception = reloaded.interception {
                // New origins and providers: a new broker (managers of unchanged providers are the same
                // objects, so a refresh in flight is joined, not repeated), new TLS contexts (leaves are minted
                // again from the CA on first use) and keys. Connections in flight keep what they had.
                do {
                    let contexts = try interception.ca.map { try TLSServerContexts(ca: $0, http2: newSettings.http2) }
                    if tokens.refreshInFlight { retiredBrokers.append(tokens) }
                    tokens = TokenBroker(loop: loop, managers: interception.managers, secrets: interception.secrets)
                    tlsContexts = contexts
                    keys = DPoPKeyring(
                        loop: loop, keys: interception.dpopKeys, stateDirectory: interception.stateDirectory)
                    spoolDirectory = interception.spoolDirectory
                    if stateDirectory == nil { stateDirectory = interception.stateDirectory }
                    origins = reloaded.origins
                } catch {
                    logger.error("SIGHUP: cannot set up TLS for the protected origins: \(error); they are unchanged")
                }
            }
            frontDoor = FrontDoor(
                settings: newSettings, credentials: credentials, boundAddress: boundAddress, origins: origins,
                ownerCredential: ownerCredential)
            tlsContexts?.http2 = newSettings.http2
            tlsClients = TLSClientContexts()
            // New connections get the new settings; those in flight keep the ones they were accepted with
            // (an HTTP/2 connection, which may last long, is asked to make way for a new one).
            context = nil
            for connection in Array(connections.values) { connection.reload() }
            logger.level = newSettings.logLevel
            logger.format = newSettings.logFormat
            for note in reloaded.notes { logger.warn("SIGHUP: \(note)") }
            if reloaded.interception != nil, var state = serveState {
                var counts: [String: ServeState.OriginCounts] = [:]
                for origin in origins.origins {
                    counts[origin.url] = state.origins[origin.url] ?? ServeState.OriginCounts()
                }
                // Hosts a wildcard origin still covers keep their counts (status lists them as hosts seen).
                for (url, kept) in state.origins where counts[url] == nil && origins.wildcard(covering: url) != nil {
                    counts[url] = kept
                }
                state.origins = counts
                serveState = state
                writeServeState()
                // The wildcards may have changed: each host is looked up again when next served.
                wildcardOfHost = [:]
            }
            let protected = origins.origins.map(\.url).joined(separator: ", ")
            if reloaded.notApplied.isEmpty {
                logger.info(
                    "SIGHUP: configuration reloaded\(reloaded.interception != nil ? " (protected origins: \(protected))" : "")"
                )
            } else {
                logger.warn(
                    "SIGHUP: applied the rest of the configuration; not applied: \(reloaded.notApplied.joined(separator: ", ")) (see above)"
                        + (protected.isEmpty ? "" : "; protected origins: \(protected)"))
            }
        }
    }
}

// MARK: - libevent callbacks (context: the ProxyServer, unretained)

private let acceptCallback: evconnlistener_cb = { _, fd, address, length, context in
    Unmanaged<ProxyServer>.fromOpaque(context!).takeUnretainedValue().accepted(fd: fd, address: address, length: length)
}

private let acceptErrorCallback: evconnlistener_errorcb = { _, context in
    Unmanaged<ProxyServer>.fromOpaque(context!).takeUnretainedValue().acceptFailed(errno: proxyctl_errno())
}

private let signalCallback: event_callback_fn = { number, _, context in
    Unmanaged<ProxyServer>.fromOpaque(context!).takeUnretainedValue().handleSignal(number)
}
