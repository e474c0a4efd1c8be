/// Why a document from an origin or an authorization server cannot be used, in words that name the document.
public struct DiscoveryError: Error, Sendable, Equatable, CustomStringConvertible {
    public let message: String
    public init(_ message: String) { self.message = message }
    public var description: String { message }
}

/// An origin's protected resource metadata (RFC 9728 §2): which authorization servers issue tokens it accepts,
/// the scopes it knows, whether it wants DPoP-bound tokens. Everything in it comes from the origin, so it is
/// checked before anything is believed: the `resource` must be the one asked about (§3.3, `matches`), every
/// authorization server a URL proxyctl may talk to (https, or http on loopback: the rule for issuers), every
/// scope a scope token (RFC 6749 §3.3). A malformed member is an error naming it, not a value skipped, so that a
/// document proxyctl half understood is never used.
public struct ProtectedResourceMetadata: Sendable, Equatable {
    /// The resource identifier (§2 `resource`), exactly as the document spells it.
    public var resource: String
    /// Issuer identifiers of the authorization servers (§2 `authorization_servers`), in the document's order,
    /// duplicates removed.
    public var authorizationServers: [String]
    /// `scopes_supported`, when present.
    public var scopesSupported: [String]?
    /// `dpop_bound_access_tokens_required` (RFC 9728 §2, RFC 9449 §5.1): tokens must be DPoP-bound.
    public var dpopBoundAccessTokensRequired = false
    /// `dpop_signing_alg_values_supported`, when present.
    public var dpopSigningAlgorithms: [String]?
    /// `resource_name`, for people; printable and clipped.
    public var resourceName: String?

    public init(resource: String, authorizationServers: [String]) {
        self.resource = resource
        self.authorizationServers = authorizationServers
    }

    /// The most bytes read of any metadata document or registration answer (the issue's bound: a server cannot
    /// make proxyctl hold more than this).
    public static let maxDocumentBytes = 64 * 1024
    /// More authorization servers than this is not a list a person chooses from.
    static let maxAuthorizationServers = 16

    /// Parses and checks a protected resource metadata document.
    public static func parse(_ value: JSONValue) -> Result<Self, DiscoveryError> {
        guard case .object(let object) = value else {
            return .failure(DiscoveryError("the protected resource metadata is not a JSON object"))
        }
        guard let resource = object["resource"]?.string else {
            return .failure(DiscoveryError("the protected resource metadata has no resource (RFC 9728 §2)"))
        }
        if let problem = MetadataURL.problem(resource, allowQuery: true) {
            return .failure(DiscoveryError("its resource \(DiscoveryText.quote(resource)) is not usable: \(problem)"))
        }
        guard let listed = object["authorization_servers"] else {
            return .failure(
                DiscoveryError(
                    "the protected resource metadata names no authorization server (authorization_servers); give --issuer and --client-id"
                ))
        }
        guard case .array(let entries) = listed, !entries.isEmpty else {
            return .failure(DiscoveryError("authorization_servers is not a list of issuer URLs"))
        }
        guard entries.count <= maxAuthorizationServers else {
            return .failure(
                DiscoveryError(
                    "authorization_servers lists \(entries.count) servers (at most \(maxAuthorizationServers))"))
        }
        var servers: [String] = []
        for entry in entries {
            guard let issuer = entry.string else {
                return .failure(DiscoveryError("authorization_servers holds something other than an issuer URL"))
            }
            if let problem = ProviderConfig.checkIssuer(issuer) ?? MetadataURL.problem(issuer, allowQuery: false) {
                return .failure(
                    DiscoveryError(
                        "the authorization server \(DiscoveryText.quote(issuer)) is not usable: \(problem)"))
            }
            if !servers.contains(issuer) { servers.append(issuer) }
        }
        var metadata = ProtectedResourceMetadata(resource: resource, authorizationServers: servers)
        switch ScopeText.list(object["scopes_supported"], name: "scopes_supported") {
        case .failure(let error): return .failure(error)
        case .success(let scopes): metadata.scopesSupported = scopes
        }
        if let required = object["dpop_bound_access_tokens_required"] {
            guard let flag = required.bool else {
                return .failure(DiscoveryError("dpop_bound_access_tokens_required is not true or false"))
            }
            metadata.dpopBoundAccessTokensRequired = flag
        }
        if let algorithms = object["dpop_signing_alg_values_supported"] {
            guard case .array = algorithms, let list = algorithms.stringList else {
                return .failure(DiscoveryError("dpop_signing_alg_values_supported is not a list of names"))
            }
            metadata.dpopSigningAlgorithms = list
        }
        if let name = object["resource_name"]?.string { metadata.resourceName = DiscoveryText.printable(name) }
        return .success(metadata)
    }

    /// Where the metadata of `resource` is published (RFC 9728 §3.1): `/.well-known/oauth-protected-resource`
    /// inserted between the host and the path, a terminating slash of the path removed, the query kept.
    public static func wellKnownURL(for resource: AbsoluteURL) -> String {
        var path = resource.pathAndQuery
        var query = ""
        if let mark = path.firstIndex(of: "?") {
            query = String(path[mark...])
            path = String(path[..<mark])
        }
        while path.hasSuffix("/") { path.removeLast() }
        return "\(resource.scheme)://\(resource.hostFieldValue)/.well-known/oauth-protected-resource\(path)\(query)"
    }

    /// Whether `resource` (the document's) identifies the resource asked about (RFC 9728 §3.3: they must be
    /// identical). Compared as RFC 3986 §6.2.2-6.2.3 compares URLs without guessing: the scheme and host in
    /// any case, a default port written or not, and an empty path equal to "/"; any other difference (a
    /// trailing slash after a path, another path, another port) is another resource.
    public static func matches(_ resource: String, _ expected: AbsoluteURL) -> Bool {
        guard case .success(let named) = AbsoluteURL.parse(resource) else { return false }
        return named.scheme == expected.scheme && named.authority == expected.authority
            && named.pathAndQuery == expected.pathAndQuery
    }

    /// The authorization server to use: the one listed, or the one the user named (`--issuer`), which must be
    /// listed exactly. Several listed without a choice is the user's to make, never proxyctl's.
    public func chooseAuthorizationServer(named: String?) -> Result<String, DiscoveryError> {
        let listed = authorizationServers.joined(separator: ", ")
        if let named {
            guard authorizationServers.contains(named) else {
                return .failure(
                    DiscoveryError(
                        "--issuer \(named) is not one of the authorization servers the origin names (\(listed))"))
            }
            return .success(named)
        }
        if authorizationServers.count == 1 { return .success(authorizationServers[0]) }
        return .failure(
            DiscoveryError(
                "the origin names several authorization servers (\(listed)); choose one with --issuer URL"))
    }
}

/// What an origin's protected resource metadata, named in its 401, says of the provider the origin is configured
/// with. Only used to tell the user: nothing switches authorization servers by itself.
public enum ResourceMetadataVerdict: Sendable, Equatable {
    /// It lists the provider's issuer.
    case consistent
    /// It lists only these other authorization servers.
    case otherServers([String])
    /// It could not be read or does not describe this origin (why): it says nothing, and the 401 is handled as
    /// any other.
    case unknown(String)

    /// The verdict on `document`, fetched for the protected origin `origin` (its URL) whose provider's issuer is
    /// `issuer`: a document whose resource is not on that origin says nothing about it (RFC 9728 §3.3).
    public static func judge(_ document: JSONValue, origin: String, issuer: String) -> ResourceMetadataVerdict {
        switch ProtectedResourceMetadata.parse(document) {
        case .failure(let error): return .unknown(error.message)
        case .success(let metadata):
            guard MetadataURL.sameOrigin(metadata.resource, origin) else {
                return .unknown("its resource \(DiscoveryText.printable(metadata.resource)) is not on \(origin)")
            }
            return metadata.authorizationServers.contains(issuer)
                ? .consistent : .otherServers(metadata.authorizationServers)
        }
    }
}

/// The rules for every URL proxyctl fetches metadata from or registers at because an origin or an authorization
/// server named it: https, or http on a loopback host (development servers, as for issuers); no userinfo, no
/// fragment; only characters a URL may hold (RFC 3986 §2), so a value can never be more than one URL.
public enum MetadataURL {
    /// Why `text` is not such a URL, or nil.
    public static func problem(_ text: String, allowQuery: Bool) -> String? {
        if let bad = text.utf8.first(where: { !isURICharacter($0) }) {
            return bad == 0x20
                ? "a URL cannot hold a space"
                : "a URL cannot hold the byte 0x\(String(bad, radix: 16, uppercase: true))"
        }
        if text.contains("#") { return "a URL here has no fragment" }
        guard case .success(let url) = AbsoluteURL.parse(text) else { return "expected an https:// URL" }
        if !allowQuery && text.contains("?") { return "a URL here has no query" }
        if url.scheme == "http" && !isLoopbackHost(url.authority.host) {
            return "https:// is required (http:// is accepted only for loopback hosts)"
        }
        return nil
    }

    /// RFC 3986 §2: unreserved, reserved and "%". Everything else (spaces, control characters, quotes,
    /// backslashes, "<>^`{|}", bytes of 0x80 and above) makes a value that is not a URL.
    public static func isURICharacter(_ byte: UInt8) -> Bool {
        switch byte {
        case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"),
            UInt8(ascii: "0")...UInt8(ascii: "9"):
            return true
        default:
            return Array("-._~:/?#[]@!$&'()*+,;=%".utf8).contains(byte)
        }
    }

    public static func isLoopbackHost(_ host: String) -> Bool {
        host == "localhost" || (IPAddress.parse(host)?.isLoopback ?? false)
    }

    /// Whether two URLs have the same origin (scheme, host and port after normalisation).
    public static func sameOrigin(_ a: String, _ b: String) -> Bool {
        guard case .success(let left) = AbsoluteURL.parse(a), case .success(let right) = AbsoluteURL.parse(b) else {
            return false
        }
        return left.scheme == right.scheme && left.authority == right.authority
    }

    /// Where a redirect of a metadata fetch from `url` to `location` goes, when proxyctl follows it: only to the
    /// same origin (a redirect to another origin would let a server choose who proxyctl talks to), only to a
    /// URL of these rules. A path (`/x`) is on `url`'s origin.
    public static func redirect(from url: String, to location: String) -> Result<String, DiscoveryError> {
        var target = location
        if location.hasPrefix("/") && !location.hasPrefix("//"), case .success(let base) = AbsoluteURL.parse(url) {
            target = "\(base.scheme)://\(base.hostFieldValue)\(location)"
        }
        guard problem(target, allowQuery: true) == nil, sameOrigin(url, target) else {
            return .failure(
                DiscoveryError(
                    "\(TargetText.withoutQuery(url)) redirects to \(DiscoveryText.quote(TargetText.withoutQuery(location))); metadata is never fetched from another origin, so the redirect was not followed"
                ))
        }
        return .success(target)
    }

    /// The URL a browser may be started with: one of these rules' URLs (so never `file:`, `javascript:` or a
    /// value a shell would read as more than one word), its query allowed. The browser gets it as one argument of
    /// an `execve`; this check is what keeps a provider's `authorization_endpoint` from being anything else
    /// (CVE-2025-6514 was such an endpoint handed to a shell).
    public static func browserProblem(_ url: String) -> String? {
        problem(url, allowQuery: true)
    }
}

/// Scope values (RFC 6749 §3.3: scope-token = 1*NQCHAR, NQCHAR = %x21 / %x23-5B / %x5D-7E).
public enum ScopeText {
    public static func isScopeToken(_ text: String) -> Bool {
        !text.isEmpty && text.utf8.count <= 200
            && text.utf8.allSatisfy { $0 == 0x21 || (0x23...0x5B).contains($0) || (0x5D...0x7E).contains($0) }
    }

    /// A list member of scope tokens; nil when absent.
    static func list(_ value: JSONValue?, name: String) -> Result<[String]?, DiscoveryError> {
        guard let value else { return .success(nil) }
        guard case .array = value, let scopes = value.stringList else {
            return .failure(DiscoveryError("\(name) is not a list of scopes"))
        }
        var unique: [String] = []
        for scope in scopes {
            guard isScopeToken(scope) else {
                return .failure(DiscoveryError("\(name) holds \(DiscoveryText.quote(scope)), which is not a scope"))
            }
            if !unique.contains(scope) { unique.append(scope) }
        }
        return .success(unique)
    }

    /// A space-separated scope string split into scope tokens; nil when any is not one.
    public static func split(_ text: String) -> [String]? {
        let scopes = text.split(separator: " ").map(String.init)
        guard !scopes.isEmpty, scopes.allSatisfy(isScopeToken) else { return nil }
        var unique: [String] = []
        for scope in scopes where !unique.contains(scope) { unique.append(scope) }
        return unique
    }
}

/// Text from a server, made safe to print: printable ASCII, clipped.
public enum DiscoveryText {
    public static func printable(_ text: String, limit: Int = 80) -> String {
        ASCII.printable(Array(text.utf8), limit: limit)
    }

    static func quote(_ text: String) -> String { "\"\(printable(text))\"" }
}

extension Challenge {
    /// The `resource_metadata` URL of a Bearer or DPoP challenge (RFC 9728 §5.1), when it is one proxyctl may
    /// fetch (`MetadataURL`).
    public var resourceMetadata: String? {
        guard scheme == "bearer" || scheme == "dpop", let url = self["resource_metadata"],
            MetadataURL.problem(url, allowQuery: true) == nil
        else { return nil }
        return url
    }

    /// The scopes an `error="insufficient_scope"` challenge asks for (RFC 6750 §3.1, its `scope`), when it names
    /// valid ones.
    public var insufficientScope: [String]? {
        guard scheme == "bearer" || scheme == "dpop", self["error"] == "insufficient_scope",
            let scope = self["scope"]
        else { return nil }
        return ScopeText.split(scope)
    }
}

extension Array where Element == Challenge {
    /// The first `resource_metadata` any challenge names.
    public var resourceMetadata: String? { lazy.compactMap(\.resourceMetadata).first }

    /// The scopes of the first `insufficient_scope` challenge that names them.
    public var insufficientScope: [String]? { lazy.compactMap(\.insufficientScope).first }

    /// The `scope` of the first Bearer or DPoP challenge that has a valid one (RFC 6750 §3: the scope the
    /// resource needs), whatever its error.
    public var scope: [String]? {
        lazy.filter { $0.scheme == "bearer" || $0.scheme == "dpop" }.compactMap { $0["scope"].flatMap(ScopeText.split) }
            .first
    }
}
