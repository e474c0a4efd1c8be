import Foundation
import ProxyCore
import ProxyTLS

/// What a running `proxyctl serve` tells `proxyctl status`: `<state_dir>/serve.json`, rewritten every few
/// seconds while counts change and removed at exit.
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

    public init(pid: Int32, listen: String, startedAt: Int64, origins: [String: OriginCounts] = [:]) {
        self.pid = pid
        self.listen = listen
        self.startedAt = startedAt
        self.origins = origins
    }

    public static func path(stateDirectory: String) -> String { stateDirectory + "/serve.json" }

    public var json: JSONValue {
        var object = JSONObject()
        object["pid"] = .int(Int64(pid))
        object["listen"] = .string(listen)
        object["started_at"] = .int(startedAt)
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
        try SecureFile.write(
            Array((JSON.serialize(json) + "\n").utf8), to: Self.path(stateDirectory: stateDirectory), mode: 0o600)
    }

    /// The state of a proxy that is still running, or nil.
    public static func running(stateDirectory: String) -> ServeState? {
        guard let data = FileManager.default.contents(atPath: path(stateDirectory: stateDirectory)),
            case .success(let json) = JSON.parse(Array(data)), let state = ServeState(json: json),
            kill(state.pid, 0) == 0
        else { return nil }
        return state
    }
}
