/// The admin listener's decisions (`admin_listen`): who gets a connection, and what each request gets. Pure, like
/// the proxy's own front door; `AdminServer` (ProxyIO) carries them out.
///
/// Two attacks shape it (issue 32):
/// - **Blinding.** Any local user can open connections that never finish their head. The admin listener once
///   held 64 and reset every connection beyond them, so a liveness probe failed for as long as they lasted.
///   Now every head has a total deadline from the accept, and at a limit the oldest connection still sending
///   its head is closed to make room: a probe, which sends its head at once, always gets in (`AdminAdmission`).
/// - **DNS rebinding.** A web page whose host name the attacker re-points at 127.0.0.1 reaches the listener
///   as same-origin and could read `/metrics` and `/readyz`. Such a request names the attacker's host in
///   `Host`; only Host values naming the listener's own address are answered (`AdminDoor.route`).
public struct AdminDoor: Sendable {
    /// The address the admin listener listens on (the port may have been 0 in the settings).
    public let bound: ListenAddress
    /// Host names it answers besides its own address and `localhost` (`admin_hosts`), lower case.
    public let names: [String]

    public init(bound: ListenAddress, names: [String] = []) {
        self.bound = bound
        self.names = names
    }

    /// What a request gets.
    public enum Route: Sendable, Equatable {
        case health
        case readiness
        case metrics
        /// An answer of the listener's own: status and one-line body.
        case answer(status: Int, body: String)
    }

    /// The limits of the request head: a probe's is a few hundred bytes.
    public static let headLimits = HTTPHeadLimits(maxStartLine: 2048, maxHeadBytes: 16384, maxFields: 50)

    /// The route for a request head that parsed.
    public func route(_ head: HTTPHead) -> Route {
        let (host, hosts) = head.firstIndex(named: "host")
        if hosts > 1 || (hosts == 0 && head.version != .http1_0) {
            // RFC 9112 §3.2: exactly one Host in HTTP/1.1; an HTTP/1.0 probe may send none.
            return .answer(status: 400, body: "exactly one Host field, naming this address (\(bound))\n")
        }
        if let host, !namesOwnAddress(head.valueBytes(at: host)) {
            return .answer(
                status: 421,
                body:
                    "this admin listener answers requests for its own address only (Host: \(bound) or localhost:\(bound.port)), not for another host name (a web page using DNS rebinding?); a scraper that names it otherwise needs that name in admin_hosts in [proxy] (PROXYCTL_ADMIN_HOSTS)\n"
            )
        }
        guard head.method == "GET" || head.method == "HEAD" else {
            return .answer(status: 405, body: "only GET and HEAD\n")
        }
        // The path alone: a query is neither needed nor echoed.
        let path = head.target.split(separator: "?", maxSplits: 1, omittingEmptySubsequences: false).first ?? ""
        switch path {
        case "/healthz": return .health
        case "/readyz": return .readiness
        case "/metrics": return .metrics
        default: return .answer(status: 404, body: "not found; try /healthz, /readyz or /metrics\n")
        }
    }

    /// Whether a Host value names this listener: `localhost`, a name of `admin_hosts`, a loopback address, the
    /// address it listens on, or (listening on every address, as a pod's probes need) any IP address, since DNS
    /// rebinding needs a host name and an address cannot be rebound. The port is not compared: a port forward
    /// (`kubectl port-forward`, `ssh -L`) changes it.
    public func namesOwnAddress(_ value: ArraySlice<UInt8>) -> Bool {
        guard case .success(let authority) = HostPort.parse(bytes: value, defaultPort: 80) else { return false }
        if authority.kind == .name { return authority.host == "localhost" || names.contains(authority.host) }
        guard let address = IPAddress.parse(authority.host)?.unmapped else { return false }
        if address.isLoopback { return true }
        let listening = IPAddress.parse(bound.host)?.unmapped
        if listening == .v4(0) || listening == .v6(0, 0) { return true }
        return address == listening
    }
}

/// Who gets an admin connection, a small state machine over the open connections: the proxy's `Admission`
/// limits (in all, and per client address), a total head deadline, and, at a limit, the oldest connection still
/// sending its head closed to make room (of the same client when that client is at its limit, else of the
/// client with the most connections). Only when every connection at the limit is being answered is the new one
/// turned away, at once, with the 503 of `Admission`.
public struct AdminAdmission: Sendable {
    /// Connections at once in all and per client, and how long a head may take from the accept.
    public let limits: Admission
    public let headDeadline: Int

    /// The defaults: a handful of probes and scrapers need far less; the head deadline is `header_timeout`'s,
    /// at most 5 s (a probe sends its head at once).
    public static func limits(settings: ProxySettings) -> (Admission, headDeadline: Int) {
        (Admission(maxConnections: 128, maxPerClient: 32), min(settings.headerTimeout, 5_000))
    }

    private struct Entry: Sendable {
        let client: String
        /// Order of the accept (older is smaller).
        let sequence: UInt64
        var readingHead = true
    }

    private var open: [UInt64: Entry] = [:]
    private var perClient: [String: Int] = [:]
    private var sequence: UInt64 = 0

    public init(limits: Admission, headDeadline: Int) {
        self.limits = limits
        self.headDeadline = headDeadline
    }

    /// What becomes of a connection just accepted.
    public enum Decision: Sendable, Equatable {
        /// Serve it under `id`, after closing `evicting` (connections still sending their head).
        case admit(id: UInt64, evicting: [UInt64])
        /// Answer this and close.
        case turnAway(ProxyAnswer)
    }

    public var openCount: Int { open.count }

    /// A connection from `client` was accepted.
    public mutating func accepted(client: String) -> Decision {
        var evicting: [UInt64] = []
        while let refusal = limits.decide(open: open.count, fromClient: perClient[client, default: 0]) {
            guard let victim = nextVictim(client: client) else {
                // Every connection at the limit is being answered: they end soon; this one is told so now.
                for id in evicting { closed(id) }
                return .turnAway(refusal)
            }
            closed(victim)
            evicting.append(victim)
        }
        sequence += 1
        open[sequence] = Entry(client: client, sequence: sequence)
        perClient[client, default: 0] += 1
        return .admit(id: sequence, evicting: evicting)
    }

    /// The connection `accepted(client:)` would close first to make room for a new one from `client`, if any:
    /// the I/O layer reads what it has sent meanwhile before letting it go (a probe whose head came while
    /// newer connections were accepted is answered, not closed).
    public func nextVictim(client: String) -> UInt64? {
        guard let refusal = limits.decide(open: open.count, fromClient: perClient[client, default: 0]) else {
            return nil
        }
        if case .tooManyFromClient = refusal { return oldestReadingHead(of: client) }
        let busiest = perClient.max { $0.value < $1.value || ($0.value == $1.value && $0.key > $1.key) }
        return busiest.flatMap { oldestReadingHead(of: $0.key) } ?? oldestReadingHead(of: nil)
    }

    /// The connection's head is complete: it is being answered and is not evicted any more.
    public mutating func headComplete(_ id: UInt64) {
        open[id]?.readingHead = false
    }

    /// Whether the connection still sends its head (its deadline then ends it).
    public func isReadingHead(_ id: UInt64) -> Bool { open[id]?.readingHead ?? false }

    /// The connection closed (or was evicted).
    public mutating func closed(_ id: UInt64) {
        guard let entry = open.removeValue(forKey: id) else { return }
        if let count = perClient[entry.client], count > 1 {
            perClient[entry.client] = count - 1
        } else {
            perClient.removeValue(forKey: entry.client)
        }
    }

    private func oldestReadingHead(of client: String?) -> UInt64? {
        open.values.filter { $0.readingHead && (client == nil || $0.client == client) }.min {
            $0.sequence < $1.sequence
        }?.sequence
    }
}
