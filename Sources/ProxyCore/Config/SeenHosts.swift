/// The hosts a wildcard origin (`[origin https://*.corp.example]`) has served, with when each was last seen: kept in
/// the state directory across restarts of `serve` so that `proxyctl status` can list them. Bounded: at most
/// `limit` hosts per wildcard, the least recently seen going first; a host name comes from a client's CONNECT,
/// so nothing a client sends may grow the file without end.
public struct SeenHosts: Sendable, Equatable {
    /// Hosts kept per wildcard.
    public static let limit = 256
    /// A host already recorded is written again only when the file's time is older than this (seconds): a busy
    /// host does not make a write per request.
    public static let refreshAfter: Int64 = 3600

    /// Wildcard URL -> host URL -> last seen (seconds since 1970).
    public private(set) var hosts: [String: [String: Int64]] = [:]

    public init() {}

    /// Records `host` (the URL of a host `wildcard` covers) seen at `now`; true when that changes what is kept
    /// beyond a busy host's clock (a new host, or one whose time is `refreshAfter` old): worth writing.
    @discardableResult
    public mutating func record(_ host: String, under wildcard: String, at now: Int64) -> Bool {
        var kept = hosts[wildcard] ?? [:]
        let previous = kept[host]
        if let previous, now - previous < Self.refreshAfter { return false }
        kept[host] = max(now, previous ?? now)
        hosts[wildcard] = Self.bounded(kept)
        return true
    }

    /// How many hosts of a wildcard `proxyctl login` asks for (RFC 8707 resources on the authorization request):
    /// the most recently seen; an authorization request stays a URL a browser opens.
    public static let askedAtLogin = 16

    /// The `count` hosts of `wildcard` seen most recently, the latest first.
    public func recent(of wildcard: String, count: Int) -> [String] {
        (hosts[wildcard] ?? [:]).sorted { $0.value != $1.value ? $0.value > $1.value : $0.key < $1.key }.prefix(count)
            .map(\.key)
    }

    /// The hosts of `wildcard`, sorted.
    public func hosts(of wildcard: String) -> [String] {
        (hosts[wildcard] ?? [:]).keys.sorted()
    }

    /// Both records, each host at its later time, still bounded.
    public func merged(with other: SeenHosts) -> SeenHosts {
        var result = self
        for (wildcard, seen) in other.hosts {
            var kept = result.hosts[wildcard] ?? [:]
            for (host, at) in seen { kept[host] = max(at, kept[host] ?? at) }
            result.hosts[wildcard] = Self.bounded(kept)
        }
        return result
    }

    /// Only wildcards in `wildcards` (a section removed from the configuration takes its hosts with it).
    public func keeping(_ wildcards: Set<String>) -> SeenHosts {
        var result = self
        result.hosts = hosts.filter { wildcards.contains($0.key) }
        return result
    }

    private static func bounded(_ kept: [String: Int64]) -> [String: Int64] {
        guard kept.count > limit else { return kept }
        // The most recently seen first; equal times by name, so that the choice does not depend on hashing.
        let sorted = kept.sorted { $0.value != $1.value ? $0.value > $1.value : $0.key < $1.key }
        return Dictionary(uniqueKeysWithValues: sorted.prefix(limit).map { ($0.key, $0.value) })
    }

    /// `{"wildcards": {"https://*.corp.example": {"https://a.corp.example": 1796390000}}}`
    public var json: JSONValue {
        var wildcards = JSONObject()
        for wildcard in hosts.keys.sorted() {
            var seen = JSONObject()
            for host in hosts[wildcard]!.keys.sorted() { seen[host] = .int(hosts[wildcard]![host]!) }
            wildcards[wildcard] = .object(seen)
        }
        return .object(JSONObject([("wildcards", .object(wildcards))]))
    }

    /// What `json` wrote, bounded again (a file edited by hand is read like any other); entries that are not a
    /// host URL with a time are skipped.
    public init(json: JSONValue) {
        for (wildcard, value) in json["wildcards"]?.object?.members ?? [] {
            var kept: [String: Int64] = [:]
            for (host, at) in value.object?.members ?? [] {
                guard let at = at.int, case .success = AbsoluteURL.parse(host) else { continue }
                kept[host] = at
            }
            if !kept.isEmpty { hosts[wildcard] = Self.bounded(kept) }
        }
    }
}
