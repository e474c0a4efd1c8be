/// Which token an origin gets (`token_type` in `[origin]`).
public enum OriginTokenKind: String, Sendable, Equatable, Hashable {
    /// An access token (the provider's own, or one narrowed to the origin's `resource` and `scopes`).
    case accessToken = "access_token"
    /// The provider's ID token, for origins that demand one (an identity-aware proxy such as Google IAP).
    case idToken = "id_token"
}

/// Names one token of a provider: the one every origin of the provider gets by default, or one obtained
/// for an origin's audience (RFC 8707 `resource`) and narrowed `scopes` (RFC 9700 §4.10), or the ID token.
/// Requests carry the key, never the token: tokens are cached per key, so a token meant for one origin never
/// reaches another.
public struct TokenKey: Sendable, Hashable, CustomStringConvertible {
    public let provider: String
    /// The resource indicator sent when the token is obtained; nil for none.
    public let resource: String?
    /// The scopes asked for when the token is obtained; nil for the provider's (the signed-in set).
    public let scopes: [String]?
    public let kind: OriginTokenKind
    /// A static secret (`secret_file`, `secret_command`, `secret`), named in `provider` by its source: no
    /// provider's token manager ever sees such a key.
    public let isStaticSecret: Bool

    /// The static secret named `name` (`SecretSource.name`).
    public init(staticSecret name: String) {
        self.provider = name
        self.resource = nil
        self.scopes = nil
        self.kind = .accessToken
        self.isStaticSecret = true
    }

    public init(
        provider: String, resource: String? = nil, scopes: [String]? = nil, kind: OriginTokenKind = .accessToken
    ) {
        self.provider = provider
        self.resource = resource
        self.scopes = scopes
        self.kind = kind
        self.isStaticSecret = false
    }

    /// The provider's own access token: what `proxyctl login` stores and `proxyctl token NAME` prints.
    public var isProviderDefault: Bool {
        resource == nil && scopes == nil && kind == .accessToken && !isStaticSecret
    }

    /// A stable name for the key within its provider's token file ("" for the default token).
    public var id: String {
        if isProviderDefault { return "" }
        if isStaticSecret { return provider }
        var parts: [String] = []
        if kind == .idToken { parts.append("id_token") }
        if let resource { parts.append("resource=\(resource)") }
        if let scopes { parts.append("scope=\(scopes.joined(separator: " "))") }
        return parts.joined(separator: ";")
    }

    public var description: String {
        isProviderDefault || isStaticSecret ? provider : "\(provider) [\(id)]"
    }
}
