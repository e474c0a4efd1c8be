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

/// What a connection may use, captured when it is accepted: the settings snapshot (through its front
/// door), the resolver, the own client's pool, tokens, TLS contexts, the logger, and the few things it reports back to
/// the server. A SIGHUP makes a new context for new connections; connections in flight keep theirs, so a
/// reload never changes the timeouts or the next hop of an exchange under way.
final class ConnectionContext {
    let loop: EventLoop
    let logger: Logger
    /// The decisions for request heads and the `[proxy]` settings they were made with.
    let frontDoor: FrontDoor
    let resolver: Resolver
    /// The tokens exchanges attach (`TokenBroker`; a test's own source).
    let tokens: any ExchangeTokens
    /// Makes an exchange's upstream transfer: `makeUpstreamTransfer` (the proxy's own client); a test's fake.
    let makeTransfer: UpstreamTransferFactory
    /// The proxy's own kept connections to protected origins (`OriginTransfer`), made on first use.
    private(set) lazy var origins = OriginPool(loop: loop)
    /// Protected resource metadata a 401 named, fetched and judged once a while (made on first use).
    private(set) lazy var resourceMetadata = ResourceMetadataLookup(loop: loop, settings: settings)
    /// TLS contexts with leaves from the local CA; nil without protected https origins or a CA.
    let tlsContexts: TLSServerContexts?
    /// TLS client contexts for the connections the proxy makes to origins itself (upgrades).
    let tlsClients: TLSClientContexts
    let spoolDirectory: String
    /// What request bodies kept for replays may hold in the whole process (one for the server's life).
    let replayBudget: ReplayBudget
    /// The latest DPoP nonce of each protected origin, from every response (RFC 9449 §9).
    let nonces: DPoPNonces
    let keys: DPoPKeyring
    /// Pipes and a copy buffer for tunnels.
    let pipes: PipePool
    let tunnelBuffer: TunnelBuffer
    /// Who is on the other end of an accepted connection (a netlink socket kept across connections).
    let peers: PeerLookup
    /// Where every use of a credential is written (`state_dir/audit.log`); nil without a state directory.
    let audit: AuditLog?
    /// What connections tell the server: they closed, one hands over to another, exchanges and notices.
    unowned let owner: any ConnectionOwner
    /// Output buffered toward a slow receiver before its sender is paused.
    let highWater = 256 * 1024
    /// An action array the own client's transfers reuse (`Array.takeScratch`): one per loop, not one
    /// allocation per event of every transfer.
    var originActions: [OriginExchange.Action] = []
    /// Timers of the own client's finished transfers, for the next ones: a transfer's timer was an object and a
    /// libevent event made and freed per request.
    private var spareTimers: [LoopTimer] = []

    /// A timer running `action`: a spare one when there is one.
    func takeTimer(_ action: @escaping () -> Void) -> LoopTimer {
        guard let spare = spareTimers.popLast() else { return LoopTimer(loop: loop, action: action) }
        spare.action = action
        return spare
    }

    /// Takes back a timer no longer used: cancelled, its action (and what that holds) dropped.
    func spareTimer(_ timer: LoopTimer) {
        timer.cancel()
        timer.action = {}
        if spareTimers.count < 64 { spareTimers.append(timer) }
    }

    init(
        loop: EventLoop, logger: Logger, frontDoor: FrontDoor, resolver: Resolver,
        tokens: any ExchangeTokens, tlsContexts: TLSServerContexts?, tlsClients: TLSClientContexts,
        spoolDirectory: String, replayBudget: ReplayBudget, nonces: DPoPNonces,
        keys: DPoPKeyring, pipes: PipePool, tunnelBuffer: TunnelBuffer, peers: PeerLookup, owner: any ConnectionOwner,
        audit: AuditLog? = nil, makeTransfer: @escaping UpstreamTransferFactory = makeUpstreamTransfer
    ) {
        self.audit = audit
        self.makeTransfer = makeTransfer
        self.loop = loop
        self.logger = logger
        self.frontDoor = frontDoor
        self.resolver = resolver
        self.tokens = tokens
        self.tlsContexts = tlsContexts
        self.tlsClients = tlsClients
        self.spoolDirectory = spoolDirectory
        self.replayBudget = replayBudget
        self.nonces = nonces
        self.keys = keys
        self.pipes = pipes
        self.tunnelBuffer = tunnelBuffer
        self.peers = peers
        self.owner = owner
    }

    var settings: ProxySettings { frontDoor.settings }

    /// A request refused for carrying another origin's placeholder, in the audit log (when there is one).
    func audit(_ use: RefusedCredentialUse, connection: UInt64, client: String) {
        audit?.refused(use, connection: connection, client: client, ownerAdmitted: settings.protectedUsers == .owner)
    }

    /// The DPoP nonce to put in the next proof to `origin` with `tokens`: none for Bearer tokens, which carry
    /// no proof (and so need no URL parsed and no lock taken per request).
    func dpopNonce(for tokens: TokenSet, origin: OriginConfig?) -> String? {
        guard tokens.tokenType == "DPoP", let origin else { return nil }
        return nonces.nonce(for: origin.url)
    }
}

/// The server as its connections see it: a narrow interface instead of the whole server.
protocol ConnectionOwner: AnyObject {
    /// Tracks a connection made by another one (a tunnel, or a TLS session, takes a client connection over).
    func adopt(_ connection: any ServerConnection)
    func connectionClosed(_ connection: any ServerConnection)
    /// Counts an exchange with a protected origin for `proxyctl status` and the metrics.
    func record(_ record: ExchangeRecord, up: Int, down: Int, milliseconds: Int64)
    /// Counts a request that ended otherwise (an answer of the proxy's own, a forwarded exchange).
    func count(_ outcome: RequestOutcome)
    /// A blind tunnel (or an upgraded connection) ended.
    func tunnelEnded(upgrade: Bool, status: Int, up: Int, down: Int)
    /// A CONNECT to a protected origin became a TLS session.
    func interceptionStarted()
    /// A protected origin asked for a stronger sign-in (RFC 9470).
    func stepUpRequired(origin: OriginConfig, challenge: Challenge)
    /// Tokens for a provider cannot be had without the user.
    func signInNeeded(provider: String, origin: String, reason: String)
    /// A protected origin's metadata names other authorization servers than its provider's issuer.
    func wrongAuthorizationServer(origin: OriginConfig, servers: [String])
}

/// A connection the server keeps track of: a client connection, an intercepted TLS session, or a tunnel.
/// Who a client connection is, for its log lines, counts and audit records; what takes the connection over (a
/// tunnel, the TLS session of an interception, HTTP/2) goes on under the same names.
struct ConnectionIdentity {
    let id: UInt64
    /// The client as the log names it (address and port).
    let peer: String
    /// The client's address (without the port).
    let client: String
    /// When the driver took the connection.
    let started: Int64
}

/// Queued events for a driver's machine: one is handled at a time, and the ones raised meanwhile (by its actions,
/// by callbacks inside them) wait behind it, so the views the machine saw stay valid; `actions` is the array the
/// machine writes its actions into, reused.
struct MachineQueue<Event, Action> {
    var handling = false
    var events: [Event] = []
    var actions: [Action] = []
}

protocol ServerConnection: AnyObject {
    /// The client's address (without the port), for `max_connections_per_client`.
    var clientAddress: String { get }
    /// Nothing in flight: waiting for the next request.
    var isIdle: Bool { get }
    /// The proxy is shutting down: finish what is in flight, then close.
    func shutdown()
    /// The configuration was reloaded: connections that keep settings for their lifetime (HTTP/2) tell the
    /// client to open a new one.
    func reload()
    func abort(_ reason: String?)
}

extension ServerConnection {
    func reload() {}
}

/// One copy buffer for the tunnels of a loop that cannot splice.
final class TunnelBuffer {
    var bytes = [UInt8](repeating: 0, count: 256 * 1024)
}

/// The DPoP keys tokens are bound to, by provider. The key loaded at start is used while the tokens'
/// thumbprint matches it; after `proxyctl login --new-key` the new key file is read on a worker thread, not
/// on the loop.
final class DPoPKeyring {
    private let loop: EventLoop
    private var keys: [String: DPoPKey]
    private let stateDirectory: String?

    init(loop: EventLoop, keys: [String: DPoPKey], stateDirectory: String?) {
        self.loop = loop
        self.keys = keys
        self.stateDirectory = stateDirectory
        // A proof per request: their signatures finish nonces made ahead (`PrivateKey.signAhead`).
        for key in keys.values { key.key.signAhead() }
    }

    /// The key for tokens with `thumbprint` (nil: any), if it is at hand.
    func cached(provider: String, thumbprint: String?) -> DPoPKey? {
        guard let key = keys[provider], thumbprint == nil || key.thumbprint == thumbprint else { return nil }
        return key
    }

    /// Reads the provider's key file off the loop; `completion` runs on the loop with the key, or nil when
    /// there is none or it does not match `thumbprint`.
    func load(provider: String, thumbprint: String?, completion: @escaping (DPoPKey?) -> Void) {
        guard let stateDirectory else { return completion(nil) }
        let callback = LoopBound(completion, loop: loop)
        let ring = LoopBound(self, loop: loop)
        let loop = self.loop
        DispatchQueue.global().async {
            let key = try? DPoPKey.load(stateDirectory: stateDirectory, provider: provider)
            key?.key.signAhead()
            loop.post {
                if let key { ring.value.keys[provider] = key }
                callback.value(key.flatMap { thumbprint == nil || $0.thumbprint == thumbprint ? $0 : nil })
            }
        }
    }
}
