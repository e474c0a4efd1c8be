import Dispatch
import ProxyCore

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Which user's process is on the other end of an accepted connection, looked up only when a rule needs it,
/// through the kernel where it can say (`Platform.SocketOwnerLookup`); `.unknown` where it cannot, and then the
/// front door's owner credential decides (docs/porting.md). Loop thread only.
///
/// For the audit log it also names the client's process (`ClientProcess`): the accept's netlink answer carries the
/// client socket's inode, kept by connection id (`remember`); the first exchange with a protected origin on the
/// connection (`resolve`) has a worker thread find the processes holding that inode in /proc (once per connection,
/// one scan at a time for all connections waiting, bounded by `scanBudget` descriptors, and scans started at least
/// `scanInterval` apart, and `scanDutyFactor` times the last scan's CPU time: a scan reads every descriptor of the
/// user's processes, and one per new connection took a core's worth of CPU under a load of new connections, bench
/// row 8); audit lines wait for the
/// answer (`client(connection:_:)`). Connection ids are never reused, so an answer is never another connection's;
/// entries are dropped oldest first past their bounds, and a connection whose entry is gone gets no pid (absent,
/// not wrong).
final class PeerLookup {
    private let lookup = Platform.SocketOwnerLookup()
    private let owner = Int(geteuid())

    /// Accepted connections' client sockets, not yet resolved (a ring of ids, oldest first).
    private var sockets: [UInt64: Platform.ClientSocket] = [:]
    private var socketOrder: [UInt64] = []
    private var socketOrderStart = 0
    /// What the audit line of a connection's request says of its client: the user and the process, where the
    /// kernel named them.
    struct Client {
        var uid: Int?
        var process: ClientProcess?
    }
    /// Resolutions under way or done, with the last time each was used (for dropping the least recently used).
    private enum Resolution {
        case waiting(Platform.ClientSocket, [(Client) -> Void])
        case done(Client)
    }
    private var resolutions: [UInt64: (resolution: Resolution, used: UInt64)] = [:]
    private var uses: UInt64 = 0
    /// Connections waiting for a scan that has not started: the next scan's, without a walk of every resolution
    /// (a walk of up to `resolutionLimit` entries per new connection showed in bench row 8's profile).
    private var unscanned: [UInt64] = []
    /// Whether a worker is scanning /proc, when the last scan began, and the least time before the next one.
    private var scanning = false
    private var lastScan: Int64?
    private var interval = PeerLookup.scanInterval
    /// Starts the next scan once `interval` passed since the last one began (`scanInterval` to `longestInterval`
    /// milliseconds, by the last scan's CPU time).
    private var scanTimer: LoopTimer?
    private let loop: EventLoop?

    /// How many unresolved sockets and resolutions are kept; descriptors one scan reads at most.
    static let socketLimit = 4096
    static let resolutionLimit = 4096
    static let scanBudget = 200_000
    /// Milliseconds between the starts of two scans at the least: the connections that come meanwhile share the next.
    static let scanInterval = 20
    /// The next scan waits at least this many times the CPU time the last one took, so that scans take at most
    /// about 1% of a core however many descriptors the user's processes hold (about a millisecond each under
    /// bench row 8: the 20 ms floor alone let them take 7% of the proxy's CPU there).
    static let scanDutyFactor = 100
    /// But never more than this many milliseconds apart: audit lines wait for the scan, and a client process
    /// that ended before it is logged without a pid.
    static let longestInterval = 250

    init(loop: EventLoop? = nil) {
        self.loop = loop
    }

    /// Who `fd`'s peer is for the owner rules. With `audited` (the audit log is written and origins are protected)
    /// the client socket is also remembered for `connection`, which costs nothing more when a rule asked the
    /// kernel anyway (the default, `protected_users = owner`) and one netlink query otherwise.
    func identify(_ fd: Int32, connection: UInt64, settings frontDoor: FrontDoor, audited: Bool) -> PeerIdentity {
        let protectedRule = !frontDoor.origins.isEmpty && frontDoor.settings.protectedUsers == .owner
        let needed =
            protectedRule || frontDoor.settings.passthroughUsers == .owner || frontDoor.settings.ownerNeedsNoCredentials
        let remembered = audited && !frontDoor.origins.isEmpty
        guard needed || remembered else { return .owner }
        let socket = lookup.socket(ofClient: fd)
        if remembered, let socket { remember(socket, connection: connection) }
        guard needed else { return .owner }
        guard let uid = socket?.uid else { return .unknown }
        return uid == owner ? .owner : .otherUser(uid: uid)
    }

    private func remember(_ socket: Platform.ClientSocket, connection: UInt64) {
        sockets[connection] = socket
        socketOrder.append(connection)
        if socketOrder.count - socketOrderStart > Self.socketLimit {
            sockets.removeValue(forKey: socketOrder[socketOrderStart])
            socketOrderStart += 1
        }
        if socketOrderStart >= Self.socketLimit {
            socketOrder.removeFirst(socketOrderStart)
            socketOrderStart = 0
        }
    }

    /// Starts finding `connection`'s client process, once: its first exchange with a protected origin (the client
    /// is waiting for the answer, so its process is there to be found).
    func resolve(connection: UInt64) {
        // A connection's socket is let go when its resolution begins: after the first exchange, one lookup.
        guard let socket = sockets.removeValue(forKey: connection) else { return }
        guard socket.inode != 0, loop != nil else {
            store(connection, .done(Client(uid: socket.uid)))
            return
        }
        store(connection, .waiting(socket, []))
        unscanned.append(connection)
        scanIfIdle()
    }

    /// Calls `body` with what the kernel said of `connection`'s client once its process is known (at once when it
    /// is, or when it cannot be): nothing when the connection was not remembered or its entry is gone.
    func client(connection: UInt64, _ body: @escaping (Client) -> Void) {
        if let known = clientIfKnown(connection: connection) { return body(known) }
        guard let index = resolutions.index(forKey: connection),
            case .waiting(let socket, var waiters) = resolutions.values[index].resolution
        else { return body(Client()) }
        uses += 1
        waiters.append(body)
        resolutions.values[index] = (.waiting(socket, waiters), uses)
    }

    /// What `client(connection:_:)` would call its body with at once; nil while a scan is awaited. Every exchange
    /// of a connection after its first finds its answer here, with one lookup and no closure to keep.
    func clientIfKnown(connection: UInt64) -> Client? {
        resolve(connection: connection)
        guard let index = resolutions.index(forKey: connection) else { return Client() }
        guard case .done(let client) = resolutions.values[index].resolution else { return nil }
        uses += 1
        resolutions.values[index].used = uses
        return client
    }

    /// The loop is about to stop: whatever waits for a scan is answered without a process now (its audit line
    /// is written without a pid rather than lost).
    func answerWaiting() {
        for (connection, entry) in resolutions {
            guard case .waiting(let socket, let waiters) = entry.resolution else { continue }
            let client = Client(uid: socket.uid)
            resolutions[connection] = (.done(client), entry.used)
            for waiter in waiters { waiter(client) }
        }
    }

    private func store(_ connection: UInt64, _ resolution: Resolution) {
        uses += 1
        resolutions[connection] = (resolution, uses)
        guard resolutions.count > Self.resolutionLimit else { return }
        // Drop the least recently used quarter of the answers (never one still waiting).
        let done = resolutions.filter { if case .done = $0.value.resolution { true } else { false } }
        for (connection, _) in done.sorted(by: { $0.value.used < $1.value.used }).prefix(Self.resolutionLimit / 4) {
            resolutions.removeValue(forKey: connection)
        }
    }

    /// One scan at a time, for every connection waiting when it starts; those that come meanwhile wait for the
    /// next.
    private func scanIfIdle() {
        guard !scanning, let loop, !unscanned.isEmpty else { return }
        let now = EventLoop.monotonicMilliseconds()
        if let lastScan, now - lastScan < Int64(interval) {
            let timer = scanTimer ?? LoopTimer(loop: loop) { [weak self] in self?.scanIfIdle() }
            scanTimer = timer
            if !timer.isPending { timer.schedule(milliseconds: interval - Int(now - lastScan)) }
            return
        }
        var wanted: [UInt64: Platform.ClientSocket] = [:]
        for connection in unscanned {
            if case .waiting(let socket, _) = resolutions[connection]?.resolution { wanted[connection] = socket }
        }
        unscanned.removeAll(keepingCapacity: true)
        guard !wanted.isEmpty else { return }
        lastScan = now
        scanning = true
        let waiting = wanted
        let inodes = Set(wanted.values.map(\.inode))
        let uids = Set(wanted.values.map(\.uid))
        let lookup = LoopBound(self, loop: loop)
        let budget = Self.scanBudget
        DispatchQueue.global(qos: .utility).async {
            let began = Platform.threadCPUMicroseconds()
            let holders = Platform.socketHolders(inodes: inodes, uids: uids, budget: budget)
            let took = Platform.threadCPUMicroseconds() - began
            loop.post {
                let peers = lookup.value
                peers.scanning = false
                peers.interval = min(
                    Self.longestInterval, max(Self.scanInterval, Int(took * Int64(Self.scanDutyFactor) / 1000)))
                for (connection, socket) in waiting {
                    guard let entry = peers.resolutions[connection], case .waiting(_, let waiters) = entry.resolution
                    else { continue }
                    let client = Client(
                        uid: socket.uid, process: ClientProcess.from(holders: holders[socket.inode] ?? []))
                    peers.resolutions[connection] = (.done(client), entry.used)
                    for waiter in waiters { waiter(client) }
                }
                peers.scanIfIdle()
            }
        }
    }
}
