import CLibevent
import ProxyCore

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// What an `UpstreamSocket` tells the driver that owns it (at the top of the loop).
protocol UpstreamSocketUser: AnyObject {
    /// An event for the connection's machine: the resolve's answer, the connect's outcome, bytes, the end.
    /// `activity`: bytes or the connection came (the idle clock starts again).
    func upstream(_ event: ConnectionMachine.Event, activity: Bool)
    /// The socket's output drained below its write low-water mark.
    func upstreamDrained()
}

/// The next hop of a forwarded request or a blind tunnel (the origin, or the upstream proxy) as the machine's
/// `.resolve` and `.connect` actions ask for it: the addresses of the latest resolve, one bufferevent at a time,
/// its callbacks turned into the machine's events. It decides nothing: which address, when to give up and when
/// to close are the machine's.
///
/// Owned by its driver; libevent reaches it through an unretained context pointer, which `close()` and
/// `release()` disconnect.
final class UpstreamSocket {
    private let context: ConnectionContext
    private weak var user: (any UpstreamSocketUser)?
    /// The connection, from `.connect` to `.closeUpstream` (or a hand-off).
    private(set) var bev: OpaquePointer?
    /// `bev` is connecting: its first event is CONNECTED or the failure.
    private var connecting = false
    private var addresses: [SocketAddress] = []
    /// Counts the resolves asked for: an answer is taken only while it is for the latest.
    private var resolving = 0

    init(context: ConnectionContext, user: any UpstreamSocketUser) {
        self.context = context
        self.user = user
    }

    deinit { close() }

    var input: OpaquePointer? { bev.map { bufferevent_get_input($0) } }
    var output: OpaquePointer? { bev.map { bufferevent_get_output($0) } }

    /// Resolves `hop`. Each connect the machine starts asks anew; an answer for an earlier one (a request answered
    /// or abandoned meanwhile) is for nobody, and must not give its addresses to the next.
    func resolve(_ hop: HostPort) {
        resolving += 1
        let asked = resolving
        let bound = LoopBound(Weak(self), loop: context.loop)
        context.resolver.resolve(hop, loop: context.loop) { result in
            guard let socket = bound.value.object, socket.resolving == asked else { return }
            socket.resolved(result)
        }
    }

    private func resolved(_ result: Result<[SocketAddress], ResolveError>) {
        switch result {
        case .success(let found):
            addresses = found
            user?.upstream(.resolved(.addresses(found.map(\.ipString))), activity: false)
        case .failure(.notFound):
            user?.upstream(.resolved(.notFound), activity: false)
        case .failure(.temporary(let reason)):
            user?.upstream(.resolved(.failed(reason: reason)), activity: false)
        }
    }

    /// Connects to the latest resolve's address `index`: nil once started, or the failure's event (for the
    /// machine, after the actions that asked for it).
    func connect(to index: Int) -> ConnectionMachine.Event? {
        precondition(bev == nil, "a connect started while an upstream connection was still open")
        guard index < addresses.count else {
            return .upstreamConnectFailed(.noSocket(reason: "no address to connect to"))
        }
        guard let made = bufferevent_socket_new(context.loop.base, -1, Int32(BEV_OPT_CLOSE_ON_FREE.rawValue)) else {
            return .upstreamConnectFailed(.noSocket(reason: "cannot make a socket"))
        }
        bev = made
        connecting = true
        bufferevent_setcb(
            made, upstreamReadCallback, upstreamWriteCallback, upstreamEventCallback,
            Unmanaged.passUnretained(self).toOpaque())
        let status = addresses[index].withSockaddr { pointer, length in
            bufferevent_socket_connect(made, UnsafeMutablePointer(mutating: pointer), Int32(length))
        }
        return status == 0 ? nil : .upstreamConnectFailed(Self.connectFailure(proxyctl_errno()))
    }

    private static func connectFailure(_ code: Int32) -> ConnectFailure {
        switch code {
        case ECONNREFUSED: .refused
        case ETIMEDOUT: .timedOut
        case 0: .other(reason: "unreachable")
        default: .other(reason: String(cString: strerror(code)))
        }
    }

    // MARK: - Flow control (the driver's mechanics)

    /// Reading from the next hop on or off (the client's output is full, or drained).
    func setReading(_ on: Bool) {
        guard let bev else { return }
        if on { bufferevent_enable(bev, Int16(EV_READ)) } else { bufferevent_disable(bev, Int16(EV_READ)) }
    }

    /// The write callback (`upstreamDrained`) comes when a write leaves at most `mark` bytes in the output.
    func setWriteLowWater(_ mark: Int) {
        if let bev { bufferevent_setwatermark(bev, Int16(EV_WRITE), mark, 0) }
    }

    // MARK: - The end

    /// Closes the connection (the machine's `.closeUpstream`, or the driver's end).
    func close() {
        guard let bev else { return }
        bufferevent_free(bev)
        self.bev = nil
        connecting = false
    }

    /// The bufferevent for a tunnel, its callbacks off: no longer this socket's.
    func release() -> OpaquePointer? {
        guard let bev else { return nil }
        bufferevent_setcb(bev, nil, nil, nil, nil)
        self.bev = nil
        connecting = false
        return bev
    }

    // MARK: - libevent's callbacks

    fileprivate func readable() { user?.upstream(.upstreamData, activity: true) }

    fileprivate func writable() { user?.upstreamDrained() }

    fileprivate func event(_ events: Int16) {
        let what = Int32(events)
        guard let bev else { return }
        if what & Int32(BEV_EVENT_CONNECTED) != 0 {
            connecting = false
            _ = proxyctl_set_nodelay(bufferevent_getfd(bev))
            ClientDriver.tune(bev)
            bufferevent_enable(bev, Int16(EV_READ | EV_WRITE))
            user?.upstream(.upstreamConnected, activity: true)
            return
        }
        if connecting {
            var code = proxyctl_socket_error(bufferevent_getfd(bev))
            if code == 0 { code = proxyctl_errno() }
            if what & Int32(BEV_EVENT_TIMEOUT) != 0 { code = ETIMEDOUT }
            user?.upstream(.upstreamConnectFailed(Self.connectFailure(code)), activity: false)
            return
        }
        user?.upstream(.upstreamEnded(reset: what & Int32(BEV_EVENT_ERROR) != 0), activity: false)
    }
}

/// A weak reference a loop-bound callback can carry.
private struct Weak<Object: AnyObject> {
    weak var object: Object?
    init(_ object: Object) { self.object = object }
}

// MARK: - libevent callbacks (context: the UpstreamSocket, unretained; its driver owns it)

private func socket(_ context: UnsafeMutableRawPointer?) -> UpstreamSocket {
    Unmanaged<UpstreamSocket>.fromOpaque(context!).takeUnretainedValue()
}
private let upstreamReadCallback: bufferevent_data_cb = { _, context in socket(context).readable() }
private let upstreamWriteCallback: bufferevent_data_cb = { _, context in socket(context).writable() }
private let upstreamEventCallback: bufferevent_event_cb = { _, events, context in socket(context).event(events) }
