import ProxyCore
import ProxyTLS

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// A step-up challenge (RFC 9470) a protected origin sent, or a scope it said the token lacks (RFC 6750 §3.1
/// `insufficient_scope`), waiting for `proxyctl step-up`.
public struct PendingStepUp: Sendable, Equatable {
    public var origin: String
    public var provider: String
    public var acrValues: String?
    public var maxAge: Int?
    /// The scopes an `insufficient_scope` challenge named, space-separated.
    public var scope: String?
    /// When it was seen, seconds since 1970.
    public var at: Int64

    public init(origin: String, provider: String, acrValues: String?, maxAge: Int?, at: Int64) {
        self.origin = origin
        self.provider = provider
        self.acrValues = acrValues
        self.maxAge = maxAge
        self.at = at
    }

    /// What the user should run.
    public var command: String { "proxyctl step-up \(origin)" }

    var json: JSONValue {
        var object = JSONObject()
        object["origin"] = .string(origin)
        object["provider"] = .string(provider)
        if let acrValues { object["acr_values"] = .string(acrValues) }
        if let maxAge { object["max_age"] = .int(Int64(maxAge)) }
        if let scope { object["scope"] = .string(scope) }
        object["at"] = .int(at)
        return .object(object)
    }

    init?(json: JSONValue) {
        guard let origin = json["origin"]?.string, let provider = json["provider"]?.string, let at = json["at"]?.int
        else { return nil }
        self.init(
            origin: origin, provider: provider, acrValues: json["acr_values"]?.string,
            maxAge: json["max_age"]?.int.map { Int($0) }, at: at)
        scope = json["scope"]?.string.flatMap { ScopeText.split($0) }.map { $0.joined(separator: " ") }
    }

    /// What the origin asked for, for people: "acr_values X, max_age N" or "the scope S".
    public var requirement: String {
        var wanted: [String] = []
        if let acrValues { wanted.append("acr_values \(acrValues)") }
        if let maxAge { wanted.append("max_age \(maxAge)") }
        if let scope { wanted.append("the scope \(scope)") }
        return wanted.joined(separator: ", ")
    }
}

/// The pending step-ups, one per origin, in `<state_dir>/step-up.json` (0600, replaced atomically).
public struct StepUpStore: Sendable {
    public let file: String

    public init(stateDirectory: String) {
        file = stateDirectory + "/step-up.json"
    }

    public func load() -> [PendingStepUp] {
        guard let data = FileManager.default.contents(atPath: file), case .success(let json) = JSON.parse(Array(data)),
            let list = json["pending"]?.array
        else { return [] }
        return list.compactMap(PendingStepUp.init(json:))
    }

    public func save(_ pending: [PendingStepUp]) throws {
        let directory = PathText.parent(file)
        try SecureFile.makePrivateDirectory(directory)
        let text = JSON.serialize(.object(JSONObject([("pending", .array(pending.map(\.json)))]))) + "\n"
        try SecureFile.write(Array(text.utf8), to: file, mode: 0o600)
    }

    /// Records `challenge`, replacing an older one for the same origin.
    public func record(_ challenge: PendingStepUp) throws {
        var pending = load().filter { $0.origin != challenge.origin }
        pending.append(challenge)
        try save(pending)
    }

    /// Forgets the challenges of `origins`.
    public func clear(origins: Set<String>) throws {
        let pending = load()
        let kept = pending.filter { !origins.contains($0.origin) }
        if kept.count != pending.count { try save(kept) }
    }
}
