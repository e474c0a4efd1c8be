import ProxyCore
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

/// What a running `proxyctl serve` tells `proxyctl status`, `doctor`, `env` and `exec`: one file per serve,
/// `<state_dir>/serve/PID.json`, rewritten every few seconds while counts change and removed at exit by the
/// process that wrote it. Several serves may share a state directory (on different ports): each keeps its
/// own record, and a record whose process is gone is ignored (and removed by the next serve).
public struct ServeState: Sendable, Equatable {
    /// Counts for one protected origin since the proxy started.
    public struct OriginCounts: Sendable, Equatable {
        public var requests = 0
        /// The proxy's token was attached.
        public var tokenAttached = 0
        /// The client's own Authorization was kept (`client_authorization = keep`).
        public var clientAuthorizationKept = 0
        /// Requests that needed a refresh-and-replay.
        public var refreshed = 0
        /// Requests retried with a DPoP nonce.
        public var nonceRetried = 0
        /// Step-up challenges passed on.
        public var stepUps = 0
        /// Answered by the proxy itself because no token could be had.
        public var answeredByProxy = 0

        public init() {}
    }

    public var pid: Int32
    public var listen: String
    public var startedAt: Int64
    public var origins: [String: OriginCounts]
    /// Clients must send `Proxy-Authorization` (proxy_auth_file).
    public var proxyAuthentication = false
    /// What it keeps for its user needs the owner credential (`OwnerCredential`): the kernel cannot name a
    /// client's user here. `env` and `exec` put it in the proxy URL.
    public var ownerCredential = false
    /// The configuration it runs with (a file path, or where it came from).
    public var configuration: String? = nil
    /// The admin listener (health and metrics), when there is one.
    public var admin: String? = nil

    public init(pid: Int32, listen: String, startedAt: Int64, origins: [String: OriginCounts] = [:]) {
        self.pid = pid
        self.listen = listen
        self.startedAt = startedAt
        self.origins = origins
    }

    public static func directory(stateDirectory: String) -> String { stateDirectory + "/serve" }

    /// This process's record.
    public static func path(stateDirectory: String, pid: Int32 = getpid()) -> String {
        directory(stateDirectory: stateDirectory) + "/\(pid).json"
    }

    public var json: JSONValue {
        var object = JSONObject()
        object["pid"] = .int(Int64(pid))
        object["listen"] = .string(listen)
        object["started_at"] = .int(startedAt)
        object["proxy_authentication"] = .bool(proxyAuthentication)
        if ownerCredential { object["owner_credential"] = .bool(true) }
        if let configuration { object["configuration"] = .string(configuration) }
        if let admin { object["admin"] = .string(admin) }
        var origins = JSONObject()
        for (url, counts) in self.origins.sorted(by: { $0.key < $1.key }) {
            origins[url] = .object(
                JSONObject([
                    ("requests", .int(Int64(counts.requests))), ("token_attached", .int(Int64(counts.tokenAttached))),
                    ("client_authorization_kept", .int(Int64(counts.clientAuthorizationKept))),
                    ("refreshed", .int(Int64(counts.refreshed))), ("nonce_retried", .int(Int64(counts.nonceRetried))),
                    ("step_ups", .int(Int64(counts.stepUps))),
                    ("answered_by_proxy", .int(Int64(counts.answeredByProxy))),
                ]))
        }
        object["origins"] = .object(origins)
        return .object(object)
    }

    public init?(json: JSONValue) {
        guard let pid = json["pid"]?.int, let listen = json["listen"]?.string, let started = json["started_at"]?.int
        else { return nil }
        self.init(pid: Int32(pid), listen: listen, startedAt: started)
        proxyAuthentication = json["proxy_authentication"]?.bool ?? false
        ownerCredential = json["owner_credential"]?.bool ?? false
        configuration = json["configuration"]?.string
        admin = json["admin"]?.string
        for (url, value) in json["origins"]?.object?.members ?? [] {
            var counts = OriginCounts()
            counts.requests = Int(value["requests"]?.int ?? 0)
            counts.tokenAttached = Int(value["token_attached"]?.int ?? 0)
            counts.clientAuthorizationKept = Int(value["client_authorization_kept"]?.int ?? 0)
            counts.refreshed = Int(value["refreshed"]?.int ?? 0)
            counts.nonceRetried = Int(value["nonce_retried"]?.int ?? 0)
            counts.stepUps = Int(value["step_ups"]?.int ?? 0)
            counts.answeredByProxy = Int(value["answered_by_proxy"]?.int ?? 0)
            origins[url] = counts
        }
    }

    public func save(stateDirectory: String) throws {
        try SecureFile.makePrivateDirectory(stateDirectory)
        try SecureFile.makePrivateDirectory(Self.directory(stateDirectory: stateDirectory))
        try SecureFile.write(
            Array((JSON.serialize(json) + "\n").utf8), to: Self.path(stateDirectory: stateDirectory, pid: pid),
            mode: 0o600)
    }

    /// Removes this record (only the process that wrote it does).
    public func remove(stateDirectory: String) {
        unlink(Self.path(stateDirectory: stateDirectory, pid: pid))
    }

    /// Every proxy still running on this state directory, the most recently started first. Records of
    /// processes that are gone are skipped; `removeStale` deletes them.
    public static func allRunning(stateDirectory: String, removeStale: Bool = false) -> [ServeState] {
        let directory = directory(stateDirectory: stateDirectory)
        let names = (try? FileManager.default.contentsOfDirectory(atPath: directory)) ?? []
        var found: [ServeState] = []
        for name in names where name.hasSuffix(".json") && !name.hasPrefix(".") {
            let path = directory + "/" + name
            guard let data = FileManager.default.contents(atPath: path),
                case .success(let json) = JSON.parse(Array(data)), let state = ServeState(json: json)
            else { continue }
            // kill(pid, 0) fails with ESRCH when no such process exists (EPERM: it exists, another user's).
            if kill(state.pid, 0) == 0 || errno == EPERM {
                found.append(state)
            } else if removeStale {
                unlink(path)
            }
        }
        return found.sorted { ($0.startedAt, $0.pid) > ($1.startedAt, $1.pid) }
    }

    /// The state of a proxy that is still running (the most recently started one), or nil.
    public static func running(stateDirectory: String) -> ServeState? {
        allRunning(stateDirectory: stateDirectory).first
    }
}

/// The hosts wildcard origins served (`SeenHosts`), in `<state_dir>/wildcard-hosts.json`: written by `serve` when
/// a host is new (or an hour later), read by `proxyctl status`. Several serves may share the state directory:
/// each merges what it saw into the file's contents before replacing it (0600 in the 0700 state directory,
/// atomically).
extension SeenHosts {
    public static func path(stateDirectory: String) -> String { stateDirectory + "/wildcard-hosts.json" }

    /// What the file holds; empty when there is none or it cannot be read.
    public static func load(stateDirectory: String) -> SeenHosts {
        guard let data = FileManager.default.contents(atPath: path(stateDirectory: stateDirectory)),
            case .success(let json) = JSON.parse(Array(data))
        else { return SeenHosts() }
        return SeenHosts(json: json)
    }

    /// Merges these hosts into the file's and writes the result, forgetting wildcards not in `wildcards`.
    public func save(stateDirectory: String, wildcards: Set<String>) throws {
        let merged = Self.load(stateDirectory: stateDirectory).merged(with: self).keeping(wildcards)
        try SecureFile.makePrivateDirectory(stateDirectory)
        try SecureFile.write(
            Array((JSON.serialize(merged.json) + "\n").utf8), to: Self.path(stateDirectory: stateDirectory),
            mode: 0o600)
    }
}
