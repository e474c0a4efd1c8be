/// The timers of a client connection. The machine arms and disarms them; the I/O layer only runs them.
public enum ConnectionTimer: Sendable, Equatable, Hashable, CaseIterable {
    /// The request head (or the TLS handshake) must be complete by then: a total deadline from its first
    /// byte (from the accept, for the first request), not a read timeout that every byte restarts.
    case head
    /// How long a client may stay idle between requests.
    case keepAlive
    /// Resolving and connecting to the next hop (all addresses together), and an upstream proxy's answer.
    case connect
    /// No byte moved either way for idle_timeout while an exchange (or an answer being flushed) is in flight.
    case idle
    /// How long an idle upstream connection is kept for the next request.
    case upstreamKeepAlive
}

/// The answer of the resolver for the next hop.
public enum ResolveOutcome: Sendable, Equatable {
    /// The addresses (IP text), tried in order.
    case addresses([String])
    case notFound
    case failed(reason: String)
}

/// Why a connect attempt failed (the I/O layer maps errno onto this).
public enum ConnectFailure: Sendable, Equatable {
    case refused
    case timedOut
    case other(reason: String)
    /// The attempt never had a socket (no descriptor left, no memory, an address the I/O layer lacks): there is
    /// no upstream connection to close.
    case noSocket(reason: String)
}

/// A line for the log, without the `conn= client=` prefix the I/O layer adds. Kept as its UTF-8 bytes: the
/// access log's lines are built as bytes (`LogLineBuilder`) and written as bytes, with no String between.
public struct LogLine: Sendable, Equatable {
    public enum Level: Sendable, Equatable { case debug, info, warn }
    public let level: Level
    public let bytes: [UInt8]

    public init(_ level: Level, _ text: String) {
        self.level = level
        self.bytes = Array(text.utf8)
    }

    /// A line built by `LogLineBuilder` (valid UTF-8).
    public init(_ level: Level, _ line: LogLineBuilder) {
        self.level = level
        self.bytes = line.bytes
    }

    public var text: String { String(decoding: bytes, as: UTF8.self) }
}

/// How a tunnel is named in its log line: "CONNECT host:port", or the upgraded request's method and URL. The
/// CONNECT form keeps its target until the line is written: joined, the name was an allocation held by every
/// idle tunnel (a thousand idle tunnels grew by a tenth).
public enum TunnelLabel: Sendable, Equatable, CustomStringConvertible, ExpressibleByStringLiteral {
    case connect(HostPort)
    case request(String)

    public init(stringLiteral value: String) { self = .request(value) }

    public var description: String {
        switch self {
        case .connect(let target): "CONNECT \(target)"
        case .request(let text): text
        }
    }

    /// The same name is the same label, however it is kept.
    public static func == (lhs: Self, rhs: Self) -> Bool { lhs.description == rhs.description }
}

/// RFC 9110 §9.2.2: a proxy must not retry a request on its own unless its method is idempotent. A request
/// with a body is not retried either: its bytes were passed on and are gone.
public enum RetryPolicy {
    static let idempotent: Set<String> = ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"]

    /// Whether a request may be sent again on a new connection after a reused one closed without a byte of
    /// response.
    public static func mayResend(method: String, framing: BodyFraming) -> Bool {
        idempotent.contains(method) && framing == .none
    }
}

/// The TLS server name (SNI, RFC 6066 §3) a client sent inside a CONNECT tunnel, checked against the
/// tunnel's authority.
public enum ServerName {
    /// nil when `serverName` names the tunnel's host, else why it does not. Case and one trailing dot do
    /// not matter; some clients (Go behind a proxy) send `host:port`, whose port must then be the tunnel's.
    /// No SNI at all is accepted: the Host of each request is checked anyway.
    public static func mismatch(_ serverName: String?, tunnel: HostPort) -> String? {
        guard let serverName else { return nil }
        var name = Substring(serverName)
        let portSuffix = ":\(tunnel.port)"
        if name.hasSuffix(portSuffix) { name = name.dropLast(portSuffix.count) }
        if name.hasSuffix(".") { name = name.dropLast() }
        // ASCII case folding only: Unicode lower-casing would map other names onto this one.
        let folded = String(decoding: name.utf8.map(ASCII.lower), as: UTF8.self)
        if folded == tunnel.host { return nil }
        return "the TLS server name \(ASCII.clip(serverName)) does not match the tunnel's \(tunnel.host)"
    }
}
