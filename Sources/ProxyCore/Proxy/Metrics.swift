/// How one request through the proxy ended, for the counters of the admin listener's `/metrics`. No path,
/// query, token or user is in it: a kind, a status, the `Proxy-Status` error type of an answer of the proxy's
/// own, byte counts and a duration.
public struct RequestOutcome: Sendable, Equatable {
    /// What the request was routed to.
    public enum Kind: String, Sendable, Equatable, CaseIterable {
        /// A plain http:// request forwarded to an origin that is not protected.
        case passthrough
        /// CONNECT: a blind tunnel (200) or the proxy's answer when it could not open one.
        case connect
        /// A request to a protected origin (inside an intercepted tunnel, or to a loopback http:// origin).
        case intercepted
        /// Refused by the front door before it was routed (a malformed head, missing proxy authentication,
        /// a request that is not a proxy request, another local user).
        case proxy

        /// Its place in `allCases`, where the registry keeps its counts.
        var index: Int {
            switch self {
            case .passthrough: 0
            case .connect: 1
            case .intercepted: 2
            case .proxy: 3
            }
        }
    }

    public let kind: Kind
    /// The status the client got; 0 when none was sent (the exchange was cut short).
    public let status: Int
    /// The `Proxy-Status` error type when the answer was the proxy's own.
    public let proxyError: String?
    /// Body bytes from the client (up) and to the client (down).
    public let up: Int
    public let down: Int
    /// From the request head to the end of the response, when it was measured.
    public let milliseconds: Int64?

    public init(
        kind: Kind, status: Int, proxyError: String? = nil, up: Int = 0, down: Int = 0, milliseconds: Int64? = nil
    ) {
        self.kind = kind
        self.status = status
        self.proxyError = proxyError
        self.up = up
        self.down = down
        self.milliseconds = milliseconds
    }

    /// `2xx`, `5xx`, ... or `none` when no status was sent.
    public static func statusClass(_ status: Int) -> String { statusClasses[statusClassIndex(status)] }

    /// The status classes, in the order of `statusClassIndex`.
    static let statusClasses = ["1xx", "2xx", "3xx", "4xx", "5xx", "none"]

    static func statusClassIndex(_ status: Int) -> Int {
        status >= 100 && status <= 599 ? status / 100 - 1 : 5
    }

    /// Whether the proxy answered because the next hop failed (502 Bad Gateway, 504 Gateway Timeout): what
    /// `proxyctl_upstream_errors_total` counts, by `Proxy-Status` error type.
    public var isUpstreamError: Bool { proxyError != nil && (status == 502 || status == 504) }
}

/// The counters, gauges and histograms of a running proxy, and their Prometheus text exposition (format
/// 0.0.4). A value: the I/O layer keeps one behind a lock and renders a copy for each scrape.
///
/// Labels are only ever kinds, status classes, `Proxy-Status` error types, provider names and fixed words:
/// never a path, a query, a host the client asked for, a token or a user.
public struct MetricsRegistry: Sendable, Equatable {
    /// Upper bounds (seconds) of the request duration histograms.
    public static let durationBuckets: [Double] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]

    public struct Histogram: Sendable, Equatable {
        /// Per bucket of `durationBuckets` (not cumulative), plus one for +Inf.
        public var counts = [Int](repeating: 0, count: MetricsRegistry.durationBuckets.count + 1)
        public var sum = 0.0
        public var count = 0

        public mutating func observe(seconds: Double) {
            let index =
                MetricsRegistry.durationBuckets.firstIndex { seconds <= $0 } ?? MetricsRegistry.durationBuckets.count
            counts[index] += 1
            sum += seconds
            count += 1
        }
    }

    public struct ProviderCounts: Sendable, Equatable {
        public var tokensAttached = 0
        public var replays = 0
        public var nonceRetries = 0
        public var stepUps = 0
        public var signInNeeded = 0
        public var refreshesOK = 0
        public var refreshesFailed = 0
        /// When the current access token expires (seconds since 1970), if known.
        public var tokenExpiry: Int64?
        public init() {}
    }

    public var connectionsOpen = 0
    public var connectionsAccepted = 0
    /// Turned away with 503 at once (max_connections, max_connections_per_client).
    public var connectionsTurnedAway = 0
    /// [kind: [status class: count]], of the requests counted so far.
    public var requests: [String: [String: Int]] {
        var requests: [String: [String: Int]] = [:]
        for kind in RequestOutcome.Kind.allCases {
            for (index, count) in requestCounts[kind.index].enumerated() where count > 0 {
                requests[kind.rawValue, default: [:]][RequestOutcome.statusClasses[index]] = count
            }
        }
        return requests
    }
    /// Tunnels opened: blind (CONNECT), intercepted (CONNECT to a protected origin), upgrade (101).
    public var tunnels: [String: Int] = [:]
    /// [kind: (up, down)], of the kinds that moved bytes.
    public var bytes: [String: (up: Int, down: Int)] {
        var bytes: [String: (up: Int, down: Int)] = [:]
        for kind in RequestOutcome.Kind.allCases where byteCounts[kind.index] != (0, 0) {
            bytes[kind.rawValue] = byteCounts[kind.index]
        }
        return bytes
    }
    public var upstreamErrors: [String: Int] = [:]
    /// [kind: request durations], of the kinds that have any.
    public var durations: [String: Histogram] {
        var durations: [String: Histogram] = [:]
        for kind in RequestOutcome.Kind.allCases where histograms[kind.index].count > 0 {
            durations[kind.rawValue] = histograms[kind.index]
        }
        return durations
    }
    public var providers: [String: ProviderCounts] = [:]
    public var startTime: Int64 = 0

    // What a request adds to, by kind (`RequestOutcome.Kind.index`) and status class: arrays, not dictionaries
    // keyed by strings, whose hashing cost more than the counting (callgrind, bench row 6: four string hashes
    // and a string interpolation per request).
    private var requestCounts = [[Int]](
        repeating: [Int](repeating: 0, count: RequestOutcome.statusClasses.count),
        count: RequestOutcome.Kind.allCases.count)
    private var byteCounts = [(up: Int, down: Int)](repeating: (0, 0), count: RequestOutcome.Kind.allCases.count)
    private var histograms = [Histogram](repeating: Histogram(), count: RequestOutcome.Kind.allCases.count)

    public init() {}

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.connectionsOpen == rhs.connectionsOpen && lhs.connectionsAccepted == rhs.connectionsAccepted
            && lhs.connectionsTurnedAway == rhs.connectionsTurnedAway && lhs.requests == rhs.requests
            && lhs.tunnels == rhs.tunnels
            && lhs.bytes.mapValues { [$0.up, $0.down] } == rhs.bytes.mapValues { [$0.up, $0.down] }
            && lhs.upstreamErrors == rhs.upstreamErrors && lhs.durations == rhs.durations
            && lhs.providers == rhs.providers && lhs.startTime == rhs.startTime
    }

    /// Counts one finished request.
    public mutating func record(_ outcome: RequestOutcome) {
        let kind = outcome.kind.index
        requestCounts[kind][RequestOutcome.statusClassIndex(outcome.status)] += 1
        addBytes(outcome.kind, up: outcome.up, down: outcome.down)
        if outcome.isUpstreamError, let error = outcome.proxyError { upstreamErrors[error, default: 0] += 1 }
        if let milliseconds = outcome.milliseconds, outcome.kind == .passthrough || outcome.kind == .intercepted {
            histograms[kind].observe(seconds: Double(milliseconds) / 1000)
        }
    }

    public mutating func addBytes(_ kind: RequestOutcome.Kind, up: Int, down: Int) {
        guard up > 0 || down > 0 else { return }
        Self.add(up, down, to: &byteCounts[kind.index])
    }

    private static func add(_ up: Int, _ down: Int, to total: inout (up: Int, down: Int)) {
        total.up += up
        total.down += down
    }

    /// Counts an exchange with a protected origin: the request itself and what happened to its token.
    public mutating func recordExchange(_ record: ExchangeRecord, up: Int, down: Int, milliseconds: Int64) {
        self.record(
            RequestOutcome(
                kind: .intercepted, status: record.status, proxyError: record.answeredByProxy ? record.proxyError : nil,
                up: up, down: down, milliseconds: milliseconds))
        // A static secret is counted under one label: its source (a path, a command) is no metric label.
        Self.count(
            record, in: &providers[record.staticSecret ? "static_secret" : record.provider, default: ProviderCounts()])
    }

    private static func count(_ record: ExchangeRecord, in counts: inout ProviderCounts) {
        if record.attached { counts.tokensAttached += 1 }
        if record.refreshed { counts.replays += 1 }
        if record.nonceRetried { counts.nonceRetries += 1 }
        if record.stepUp { counts.stepUps += 1 }
    }

    // MARK: - Exposition

    /// The Prometheus text format (version 0.0.4): `# HELP`, `# TYPE`, then the samples of each family.
    public func render(version: String) -> String {
        var text = ""
        func family(
            _ name: String, _ type: String, _ help: String, _ samples: [(labels: [(String, String)], value: String)]
        ) {
            text += "# HELP \(name) \(help)\n# TYPE \(name) \(type)\n"
            for sample in samples {
                text += name + Self.labels(sample.labels) + " " + sample.value + "\n"
            }
        }
        family("proxyctl_build_info", "gauge", "The running proxyctl's version.", [([("version", version)], "1")])
        family(
            "proxyctl_start_time_seconds", "gauge", "When the proxy started, in seconds since 1970.",
            [([], String(startTime))])
        family(
            "proxyctl_connections_open", "gauge", "Client connections open now (tunnels included).",
            [([], String(connectionsOpen))])
        family(
            "proxyctl_connections_accepted_total", "counter", "Client connections accepted.",
            [([], String(connectionsAccepted))])
        family(
            "proxyctl_connections_turned_away_total", "counter",
            "Client connections answered 503 at once because max_connections or max_connections_per_client was reached.",
            [([], String(connectionsTurnedAway))])
        let requests = self.requests
        var requestSamples: [(labels: [(String, String)], value: String)] = []
        for kind in requests.keys.sorted() {
            for statusClass in requests[kind]!.keys.sorted() {
                requestSamples.append(
                    ([("kind", kind), ("status_class", statusClass)], String(requests[kind]![statusClass]!)))
            }
        }
        family(
            "proxyctl_requests_total", "counter",
            "Requests by kind (passthrough, connect, intercepted, proxy) and the status class the client got.",
            requestSamples)
        family(
            "proxyctl_tunnels_total", "counter",
            "Tunnels opened: blind (CONNECT passed through), intercepted (CONNECT to a protected origin), upgrade (101).",
            tunnels.keys.sorted().map { ([("kind", $0)], String(tunnels[$0]!)) })
        let bytes = self.bytes
        var byteSamples: [(labels: [(String, String)], value: String)] = []
        for kind in bytes.keys.sorted() {
            byteSamples.append(([("kind", kind), ("direction", "up")], String(bytes[kind]!.up)))
            byteSamples.append(([("kind", kind), ("direction", "down")], String(bytes[kind]!.down)))
        }
        family(
            "proxyctl_bytes_total", "counter",
            "Body bytes (tunnel bytes for tunnels) from clients (up) and to clients (down), by kind.", byteSamples)
        family(
            "proxyctl_upstream_errors_total", "counter",
            "Answers of the proxy's own because the next hop failed (502, 504), by Proxy-Status error type.",
            upstreamErrors.keys.sorted().map { ([("error", $0)], String(upstreamErrors[$0]!)) })
        let names = providers.keys.sorted()
        func perProvider(_ name: String, _ help: String, _ value: (ProviderCounts) -> Int) {
            family(name, "counter", help, names.map { ([("provider", $0)], String(value(providers[$0]!))) })
        }
        perProvider("proxyctl_tokens_attached_total", "Requests to protected origins that carried the proxy's token.") {
            $0.tokensAttached
        }
        family(
            "proxyctl_token_refreshes_total", "counter", "Token refreshes at the provider, by outcome.",
            names.flatMap { name in
                [
                    ([("provider", name), ("outcome", "ok")], String(providers[name]!.refreshesOK)),
                    ([("provider", name), ("outcome", "failed")], String(providers[name]!.refreshesFailed)),
                ]
            })
        perProvider("proxyctl_replays_total", "Requests replayed after a 401 and a token refresh.") { $0.replays }
        perProvider("proxyctl_nonce_retries_total", "Requests retried with a new DPoP nonce.") { $0.nonceRetries }
        perProvider("proxyctl_step_ups_total", "Step-up challenges (RFC 9470) passed on to the client.") { $0.stepUps }
        perProvider(
            "proxyctl_sign_in_needed_total",
            "Requests answered 401 by the proxy because nobody is signed in (or the refresh token was refused)."
        ) { $0.signInNeeded }
        family(
            "proxyctl_token_expiry_timestamp_seconds", "gauge",
            "When the provider's current access token expires, in seconds since 1970.",
            names.compactMap { name in providers[name]!.tokenExpiry.map { ([("provider", name)], String($0)) } })
        text += "# HELP proxyctl_request_duration_seconds Time from the request head to the end of the response.\n"
        text += "# TYPE proxyctl_request_duration_seconds histogram\n"
        let durations = self.durations
        for kind in durations.keys.sorted() {
            let histogram = durations[kind]!
            var cumulative = 0
            for (index, bound) in Self.durationBuckets.enumerated() {
                cumulative += histogram.counts[index]
                text +=
                    "proxyctl_request_duration_seconds_bucket\(Self.labels([("kind", kind), ("le", Self.number(bound))])) \(cumulative)\n"
            }
            text +=
                "proxyctl_request_duration_seconds_bucket\(Self.labels([("kind", kind), ("le", "+Inf")])) \(histogram.count)\n"
            text +=
                "proxyctl_request_duration_seconds_sum\(Self.labels([("kind", kind)])) \(Self.number(histogram.sum))\n"
            text += "proxyctl_request_duration_seconds_count\(Self.labels([("kind", kind)])) \(histogram.count)\n"
        }
        return text
    }

    static func labels(_ pairs: [(String, String)]) -> String {
        guard !pairs.isEmpty else { return "" }
        return "{" + pairs.map { "\($0.0)=\"\(escape($0.1))\"" }.joined(separator: ",") + "}"
    }

    /// Label values escape backslash, double quote and line feed.
    static func escape(_ value: String) -> String {
        var escaped = ""
        for character in value {
            switch character {
            case "\\": escaped += "\\\\"
            case "\"": escaped += "\\\""
            case "\n": escaped += "\\n"
            default: escaped.append(character)
            }
        }
        return escaped
    }

    static func number(_ value: Double) -> String {
        if value == value.rounded() && abs(value) < 1e15 { return String(Int64(value)) + ".0" }
        return String(value)
    }
}
