/// Who gets a connection: the limits on connections open at once, in total and per client address, and the
/// answer for a client beyond them. A client that cannot be served is told so at once (503 with
/// `Proxy-Status`), instead of waiting in the kernel's backlog while slow or idle connections hold every slot.
public struct Admission: Sendable, Equatable {
    /// Most connections open at once.
    public let maxConnections: Int
    /// Most connections open at once from one address.
    public let maxPerClient: Int

    /// - Parameter fileLimit: the process's open-file limit (after raising it to the hard limit), which
    ///   derives the defaults the settings leave open.
    public init(settings: ProxySettings, fileLimit: Int) {
        let total = settings.maxConnections ?? Self.connections(fileLimit: fileLimit)
        maxConnections = total
        maxPerClient = min(total, settings.maxConnectionsPerClient ?? max(1, total / 4))
    }

    /// Fixed limits (the admin listener's, `AdminAdmission`).
    public init(maxConnections: Int, maxPerClient: Int) {
        self.maxConnections = maxConnections
        self.maxPerClient = min(maxConnections, maxPerClient)
    }

    /// Descriptors kept free of client connections: the listener, the event loop, libcurl's sockets, log and
    /// state files, the pipes of tunnels that are moving bytes.
    public static let reservedFiles = 64

    /// The default `max_connections`: every connection may hold two descriptors (the client's and the next
    /// hop's), so half of what the open-file limit leaves.
    public static func connections(fileLimit: Int) -> Int {
        max(16, min(1_000_000, (fileLimit - reservedFiles) / 2))
    }

    /// nil when a new connection from a client with `fromClient` connections open may be served, given
    /// `open` connections in all; else the answer it gets.
    public func decide(open: Int, fromClient: Int) -> ProxyAnswer? {
        if open >= maxConnections { return .overCapacity(limit: maxConnections) }
        if fromClient >= maxPerClient { return .tooManyFromClient(limit: maxPerClient) }
        return nil
    }
}

/// Who is on the other end of a client connection, as far as the machine can tell.
public enum PeerIdentity: Sendable, Equatable {
    /// A process of the user the proxy runs as.
    case owner
    /// A process of another user of this machine.
    case otherUser(uid: Int)
    /// Not known: a peer on another machine, or a lookup that failed.
    case unknown

    /// Whether `scope` admits this peer. An unknown peer is admitted only where `proxy_auth_file` makes every
    /// client authenticate (a listener beyond loopback requires it): the credential is then the control.
    public func admitted(by scope: UserScope, authenticated: Bool) -> Bool {
        switch (scope, self) {
        case (.any, _), (.owner, .owner): true
        case (.owner, .otherUser): false
        case (.owner, .unknown): authenticated
        }
    }
}
