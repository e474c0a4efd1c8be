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
/// Nothing it answers carries a path, a query, a token or a user.
public final class AdminServer: Sendable {
    private let thread: LoopThread
    private let listener: LoopBound<AdminListener>
    public let boundAddress: ListenAddress

    /// Binds `address`; `metrics` renders `/metrics`, `readiness` decides `/readyz`.
    public init(
        address: ListenAddress, version: String, metrics: ProxyMetrics,
        providerFacts: @escaping ProviderFactsSource, readiness: @escaping ReadinessCheck
    ) throws {
        let thread = LoopThread()
        let made = Mutex<Result<(LoopBound<AdminListener>, Int), any Error>?>(nil)
        let ready = DispatchSemaphore(value: 0)
        thread.loop.post {
            do {
                let listener = try AdminListener(
                    loop: thread.loop, address: address, version: version, metrics: metrics,
                    providerFacts: providerFacts,
                    readiness: readiness)
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
    private var listener: OpaquePointer?
    private var connections: [ObjectIdentifier: AdminConnection] = [:]

    init(
        loop: EventLoop, address: ListenAddress, version: String, metrics: ProxyMetrics,
        providerFacts: @escaping ProviderFactsSource, readiness: @escaping ReadinessCheck
    ) throws {
        self.loop = loop
        self.version = version
        self.metrics = metrics
        self.providerFacts = providerFacts
        self.readiness = readiness
        guard let socketAddress = SocketAddress(ip: address.host, port: address.port) else {
            throw ServerError(message: "cannot listen on \(address) (admin_listen): not an IP address")
        }
        let flags = LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_EXEC
        listener = socketAddress.withSockaddr { pointer, length in
            evconnlistener_new_bind(loop.base, nil, nil, UInt32(flags), 64, pointer, Int32(length))
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
        evconnlistener_set_cb(
            listener,
            { _, fd, _, _, context in
                Unmanaged<AdminListener>.fromOpaque(context!).takeUnretainedValue().accepted(fd)
            }, Unmanaged.passUnretained(self).toOpaque())
    }

    deinit {
        if let listener { evconnlistener_free(listener) }
        connections.removeAll()
    }

    func accepted(_ fd: Int32) {
        // A handful of probes and scrapers at a time; beyond that, close at once.
        guard connections.count < 64 else {
            Platform.closeDescriptor(fd)
            return
        }
        _ = evutil_make_socket_nonblocking(fd)
        let connection = AdminConnection(listener: self, fd: fd)
        connections[ObjectIdentifier(connection)] = connection
    }

    func closed(_ connection: AdminConnection) {
        connections.removeValue(forKey: ObjectIdentifier(connection))
    }

    func shutdown() {
        if let listener { evconnlistener_free(listener) }
        listener = nil
        for connection in Array(connections.values) { connection.close() }
    }

    /// The answer to one request: status, content type, body.
    func handle(_ head: HTTPHead) -> (Int, String, String) {
        guard head.method == "GET" || head.method == "HEAD" else {
            return (405, "text/plain; charset=utf-8", "only GET and HEAD\n")
        }
        // The path alone: a query is neither needed nor echoed.
        let path = head.target.split(separator: "?", maxSplits: 1, omittingEmptySubsequences: false).first ?? ""
        switch path {
        case "/healthz":
            return (200, "text/plain; charset=utf-8", "ok\n")
        case "/readyz":
            let reasons = readiness()
            if reasons.isEmpty { return (200, "text/plain; charset=utf-8", "ready\n") }
            return (503, "text/plain; charset=utf-8", "not ready:\n" + reasons.map { "- \($0)\n" }.joined())
        case "/metrics":
            var registry = metrics.snapshot
            for (provider, facts) in providerFacts() {
                var counts = registry.providers[provider, default: MetricsRegistry.ProviderCounts()]
                counts.tokenExpiry = facts.tokenExpiry
                counts.refreshesOK = facts.refreshesOK
                counts.refreshesFailed = facts.refreshesFailed
                registry.providers[provider] = counts
            }
            return (200, "text/plain; version=0.0.4; charset=utf-8", registry.render(version: version))
        default:
            return (404, "text/plain; charset=utf-8", "not found; try /healthz, /readyz or /metrics\n")
        }
    }
}

/// One admin connection: read a head, answer, close.
final class AdminConnection {
    unowned let listener: AdminListener
    private var bev: OpaquePointer?
    private var parser = HTTPHeadParser(
        kind: .request, limits: HTTPHeadLimits(maxStartLine: 2048, maxHeadBytes: 16384, maxFields: 50))
    private var answered = false

    init(listener: AdminListener, fd: Int32) {
        self.listener = listener
        bev = bufferevent_socket_new(listener.loop.base, fd, Int32(BEV_OPT_CLOSE_ON_FREE.rawValue))
        let context = Unmanaged.passUnretained(self).toOpaque()
        bufferevent_setcb(
            bev,
            { _, context in Unmanaged<AdminConnection>.fromOpaque(context!).takeUnretainedValue().readable() },
            { _, context in Unmanaged<AdminConnection>.fromOpaque(context!).takeUnretainedValue().writable() },
            { _, _, context in Unmanaged<AdminConnection>.fromOpaque(context!).takeUnretainedValue().close() },
            context)
        var timeout = timeval(milliseconds: 10_000)
        bufferevent_set_timeouts(bev, &timeout, &timeout)
        bufferevent_enable(bev, Int16(EV_READ | EV_WRITE))
    }

    func readable() {
        guard !answered else { return }
        let input = bufferevent_get_input(bev)
        var outcome = HTTPHeadParser.Outcome.needMore
        Buffers.forEachSegment(input) { segment in
            outcome = parser.parse(segment)
            if case .needMore = outcome { return true }
            return false
        }
        evbuffer_drain(input, Buffers.length(input))
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

    private func answer(_ status: Int, _ type: String, _ body: String, headRequest: Bool) {
        answered = true
        let bytes = Array(body.utf8)
        let head =
            "HTTP/1.1 \(status) \(ProxyResponse.reasonPhrase(status))\r\nContent-Type: \(type)\r\n"
            + "Content-Length: \(bytes.count)\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n"
        Buffers.append(Array(head.utf8) + (headRequest ? [] : bytes), to: bufferevent_get_output(bev))
        bufferevent_disable(bev, Int16(EV_READ))
    }

    func writable() {
        if answered && Buffers.length(bufferevent_get_output(bev)) == 0 { close() }
    }

    deinit { if let bev { bufferevent_free(bev) } }

    func close() {
        if let bev { bufferevent_free(bev) }
        bev = nil
        listener.closed(self)
    }
}
