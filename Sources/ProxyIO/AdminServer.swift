import CLibevent
import Dispatch
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

/// The counters of a running proxy, shared between its loop (which counts) and the admin listener's thread
/// (which renders them for a scrape). One lock, held for a dictionary update or a copy.
public final class ProxyMetrics: Sendable {
    private let registry = Mutex(MetricsRegistry())
    private let listening = Atomic<Bool>(false)

    /// Whether the proxy listens and takes new connections (not stopping): part of `/readyz`.
    public var isListening: Bool { listening.load(ordering: .relaxed) }
    public func setListening(_ value: Bool) { listening.store(value, ordering: .relaxed) }

    public init() {
        registry.withLock { $0.startTime = Int64(time(nil)) }
    }

    public func update(_ body: (inout MetricsRegistry) -> Void) {
        registry.withLock { body(&$0) }
    }

    public var snapshot: MetricsRegistry { registry.withLock { $0 } }
}

/// What the admin listener asks the proxy for readiness: nothing when ready, else the reasons it is not.
public typealias ReadinessCheck = @Sendable () -> [String]

/// What is read about each provider at scrape time (off the proxy's loop): its token's expiry and its
/// refresh tally.
public struct ProviderFacts: Sendable {
    public var tokenExpiry: Int64?
    public var refreshesOK: Int
    public var refreshesFailed: Int

    public init(tokenExpiry: Int64?, refreshesOK: Int, refreshesFailed: Int) {
        self.tokenExpiry = tokenExpiry
        self.refreshesOK = refreshesOK
        self.refreshesFailed = refreshesFailed
    }
}

public typealias ProviderFactsSource = @Sendable () -> [String: ProviderFacts]

/// The optional admin listener (`admin_listen`): `/healthz`, `/readyz` and `/metrics`, on its own address
/// (never the proxy's port) and its own loop thread, so a scrape never waits behind proxy traffic and the
/// readiness check (which reads token files) never runs on the proxy's loop.
///
/// Each connection reads one request head (the one parser, `HTTPHeadParser`), gets one answer and is closed.
/// Who gets a connection and what a request gets are `AdminAdmission`'s and `AdminDoor`'s decisions (ProxyCore):
/// a total head deadline, limits per client and in all with the oldest unfinished head making room, and only
/// Host values naming the listener's own address. Nothing it answers carries a path, a query, a token or a user.
public final class AdminServer: Sendable {
    private let thread: LoopThread
    private let listener: LoopBound<AdminListener>
    public let boundAddress: ListenAddress

    /// Binds `address`; `metrics` renders `/metrics`, `readiness` decides `/readyz`; `settings` give the head
    /// deadline (`AdminAdmission.limits`).
    public init(
        address: ListenAddress, settings: ProxySettings, version: String, metrics: ProxyMetrics,
        providerFacts: @escaping ProviderFactsSource, readiness: @escaping ReadinessCheck
    ) throws {
        let thread = LoopThread()
        let made = Mutex<Result<(LoopBound<AdminListener>, Int), any Error>?>(nil)
        let ready = DispatchSemaphore(value: 0)
        thread.loop.post {
            do {
                let listener = try AdminListener(
                    loop: thread.loop, address: address, settings: settings, version: version, metrics: metrics,
                    providerFacts: providerFacts, readiness: readiness)
                made.withLock { $0 = .success((LoopBound(listener, loop: thread.loop), listener.port)) }
            } catch {
                made.withLock { $0 = .failure(error) }
            }
            ready.signal()
        }
        ready.wait()
        let result = made.withLock { $0! }
        switch result {
        case .success(let (listener, port)):
            self.thread = thread
            self.boundAddress = ListenAddress(host: address.host, port: port, isIPv6: address.isIPv6)
            self.listener = listener
        case .failure(let error):
            thread.stop()
            throw error
        }
    }

    /// Closes the listener and stops its thread.
    public func stop() {
        let listener = self.listener
        let done = DispatchSemaphore(value: 0)
        thread.loop.post {
            listener.value.shutdown()
            done.signal()
        }
        _ = done.wait(timeout: .now() + .seconds(2))
        thread.stop()
    }
}

/// The admin listener and its connections, on the admin loop thread.
final class AdminListener {
    let loop: EventLoop
    let version: String
    let metrics: ProxyMetrics
    let providerFacts: ProviderFactsSource
    let readiness: ReadinessCheck
    private(set) var port = 0
    private(set) var door: AdminDoor
    private var admission: AdminAdmission
    private var listener: OpaquePointer?
    private var connections: [UInt64: AdminConnection] = [:]

    init(
        loop: EventLoop, address: ListenAddress, settings: ProxySettings, version: String, metrics: ProxyMetrics,
        providerFacts: @escaping ProviderFactsSource, readiness: @escaping ReadinessCheck
    ) throws {
        self.loop = loop
        self.version = version
        self.metrics = metrics
        self.providerFacts = providerFacts
        self.readiness = readiness
        let (limits, headDeadline) = AdminAdmission.limits(settings: settings)
        admission = AdminAdmission(limits: limits, headDeadline: headDeadline)
        door = AdminDoor(bound: address, names: settings.adminHosts)
        guard let socketAddress = SocketAddress(ip: address.host, port: address.port) else {
            throw ServerError(message: "cannot listen on \(address) (admin_listen): not an IP address")
        }
        let flags = LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_EXEC
        // A backlog as deep as the proxy's: a burst of connections must not make a probe's SYN wait for a retry.
        listener = socketAddress.withSockaddr { pointer, length in
            evconnlistener_new_bind(loop.base, nil, nil, UInt32(flags), 1024, pointer, Int32(length))
        }
        guard let listener else {
            let code = proxyctl_errno()
            throw ServerError(
                message:
                    "cannot listen on \(address) for health and metrics (admin_listen): \(String(cString: strerror(code)))"
            )
        }
        var storage = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        let fd = evconnlistener_get_fd(listener)
        port = withUnsafeMutablePointer(to: &storage) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { raw in
                getsockname(fd, raw, &length)
                return SocketAddress(raw, length: length).port
            }
        }
        door = AdminDoor(
            bound: ListenAddress(host: address.host, port: port, isIPv6: address.isIPv6), names: settings.adminHosts)
        // TCP_DEFER_ACCEPT (tcp(7)): the kernel hands over a connection once its first bytes arrived (nginx's
        // `deferred`). A probe's whole head then comes with its accept and is answered at once, before any later
        // accept could close it to make room; a connection that sends nothing never takes a slot or a descriptor.
        var seconds = Int32(max(1, headDeadline / 1000))
        _ = setsockopt(fd, Int32(IPPROTO_TCP), TCP_DEFER_ACCEPT, &seconds, socklen_t(MemoryLayout<Int32>.size))
        evconnlistener_set_cb(
            listener,
            { _, fd, address, length, context in
                let client = address.map { SocketAddress($0, length: socklen_t(length)).ipString } ?? "-"
                Unmanaged<AdminListener>.fromOpaque(context!).takeUnretainedValue().accepted(fd, client: client)
            }, Unmanaged.passUnretained(self).toOpaque())
    }

    deinit {
        if let listener { evconnlistener_free(listener) }
        connections.removeAll()
    }

    func accepted(_ fd: Int32, client: String) {
        _ = evutil_make_socket_nonblocking(fd)
        // Before a connection is closed to make room, what it sent meanwhile is read: a head that is complete
        // now is answered instead (a probe accepted just before a burst of the flood's connections).
        while let candidate = admission.nextVictim(client: client), let connection = connections[candidate],
            connection.readWaiting()
        {}
        switch admission.accepted(client: client) {
        case .turnAway(let answer):
            // One write to a fresh socket, never a wait (as the proxy's own listener does).
            let bytes = answer.response.serialized()
            _ = bytes.withUnsafeBytes { Platform.send(fd, $0) }
            Platform.closeDescriptor(fd)
        case .admit(let id, let evicting):
            for victim in evicting { connections.removeValue(forKey: victim)?.close(admitted: false) }
            let connection = AdminConnection(listener: self, id: id, fd: fd, headDeadline: admission.headDeadline)
            connections[id] = connection
            connection.start()
        }
    }

    func headComplete(_ id: UInt64) { admission.headComplete(id) }

    func closed(_ id: UInt64) {
        admission.closed(id)
        connections.removeValue(forKey: id)
    }

    func shutdown() {
        if let listener { evconnlistener_free(listener) }
        listener = nil
        for connection in Array(connections.values) { connection.close() }
    }

    /// The answer to one request: status, content type, body.
    func handle(_ head: HTTPHead) -> (Int, String, String) {
        let text = "text/plain; charset=utf-8"
        switch door.route(head) {
        case .answer(let status, let body):
            return (status, text, body)
        case .health:
            return (200, text, "ok\n")
        case .readiness:
            let reasons = readiness()
            if reasons.isEmpty { return (200, text, "ready\n") }
            return (503, text, "not ready:\n" + reasons.map { "- \($0)\n" }.joined())
        case .metrics:
            var registry = metrics.snapshot
            for (provider, facts) in providerFacts() {
                var counts = registry.providers[provider, default: MetricsRegistry.ProviderCounts()]
                counts.tokenExpiry = facts.tokenExpiry
                counts.refreshesOK = facts.refreshesOK
                counts.refreshesFailed = facts.refreshesFailed
                registry.providers[provider] = counts
            }
            return (200, "text/plain; version=0.0.4; charset=utf-8", registry.render(version: version))
        }
    }
}

/// One admin connection: read a head within the deadline, answer, close.
final class AdminConnection {
    unowned let listener: AdminListener
    let id: UInt64
    private var bev: OpaquePointer?
    private var parser = HTTPHeadParser(kind: .request, limits: AdminDoor.headLimits)
    private var answered = false
    private let fd: Int32
    /// The total head deadline, from the accept (a head trickled in byte by byte does not extend it).
    private var deadline: LoopTimer?
    private let headDeadline: Int

    init(listener: AdminListener, id: UInt64, fd: Int32, headDeadline: Int) {
        self.listener = listener
        self.id = id
        self.fd = fd
        self.headDeadline = headDeadline
        bev = bufferevent_socket_new(listener.loop.base, fd, Int32(BEV_OPT_CLOSE_ON_FREE.rawValue))
        let context = Unmanaged.passUnretained(self).toOpaque()
        bufferevent_setcb(
            bev,
            { _, context in Unmanaged<AdminConnection>.fromOpaque(context!).takeUnretainedValue().readable() },
            { _, context in Unmanaged<AdminConnection>.fromOpaque(context!).takeUnretainedValue().writable() },
            { _, _, context in Unmanaged<AdminConnection>.fromOpaque(context!).takeUnretainedValue().close() },
            context)
        // The answer must be taken within 10 s (a scraper that does not read).
        var timeout = timeval(milliseconds: 10_000)
        bufferevent_set_timeouts(bev, nil, &timeout)
        bufferevent_enable(bev, Int16(EV_READ | EV_WRITE))
        let timer = LoopTimer(loop: listener.loop) { [unowned self] in headTimedOut() }
        timer.schedule(milliseconds: headDeadline)
        deadline = timer
    }

    /// Reads what the socket holds already: a probe's head is usually there at the accept, and answering it now
    /// means no later accept can make room at its expense.
    func start() {
        var buffer = [UInt8](repeating: 0, count: 4096)
        let count = buffer.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT)) }
        guard count > 0 else { return }
        buffer.withUnsafeBytes { handle(parser.parse(UnsafeRawBufferPointer(rebasing: $0[..<count]))) }
    }

    /// Reads what arrived since the loop last looked (the bufferevent's input, then the socket); true when the
    /// head is complete now and the connection is being answered.
    func readWaiting() -> Bool {
        readable()
        if !answered { start() }
        return answered
    }

    func readable() {
        guard !answered, let bev else { return }
        let input = bufferevent_get_input(bev)
        var outcome = HTTPHeadParser.Outcome.needMore
        Buffers.forEachSegment(input) { segment in
            outcome = parser.parse(segment)
            if case .needMore = outcome { return true }
            return false
        }
        evbuffer_drain(input, Buffers.length(input))
        handle(outcome)
    }

    private func handle(_ outcome: HTTPHeadParser.Outcome) {
        guard !answered else { return }
        switch outcome {
        case .needMore:
            return
        case .failed(let error):
            answer(error.status, "text/plain; charset=utf-8", error.reason + "\n", headRequest: false)
        case .complete(let head, _):
            let (status, type, body) = listener.handle(head)
            answer(status, type, body, headRequest: head.method == "HEAD")
        }
    }

    private func headTimedOut() {
        guard !answered else { return }
        let response = ProxyAnswer.requestHeadTimeout(milliseconds: headDeadline).response
        answered = true
        listener.headComplete(id)
        Buffers.append(response.serialized(), to: bufferevent_get_output(bev))
        bufferevent_disable(bev, Int16(EV_READ))
    }

    private func answer(_ status: Int, _ type: String, _ body: String, headRequest: Bool) {
        answered = true
        deadline?.cancel()
        listener.headComplete(id)
        let bytes = Array(body.utf8)
        let head =
            "HTTP/1.1 \(status) \(ProxyResponse.reasonPhrase(status))\r\nContent-Type: \(type)\r\n"
            + "Content-Length: \(bytes.count)\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n"
        Buffers.append(Array(head.utf8) + (headRequest ? [] : bytes), to: bufferevent_get_output(bev))
        bufferevent_disable(bev, Int16(EV_READ))
    }

    func writable() {
        if answered, let bev, Buffers.length(bufferevent_get_output(bev)) == 0 { close() }
    }

    deinit {
        deadline?.cancel()
        if let bev { bufferevent_free(bev) }
    }

    /// Frees the socket; `admitted` false: the listener already let the connection go (it made room for another).
    func close(admitted: Bool = true) {
        deadline?.cancel()
        deadline = nil
        if let bev { bufferevent_free(bev) }
        bev = nil
        if admitted { listener.closed(id) }
    }
}
