import ProxyCore

/// The tokens held for one provider, as stored on disk.
public struct TokenSet: Sendable, Equatable {
    /// The fields, behind one reference: a token set travels from the broker's cache to each request's driver
    /// (the cache, the completion's Result, the driver), and as a struct of seventeen fields each copy was
    /// about ten retains (callgrind, bench row 6). `Boxed`: copied on write.
    private struct Fields: Sendable, Equatable {
        var provider: String
        var issuer: String
        var clientID: String
        var accessToken: String
        var tokenType: String
        var issuedAt: Int64
        var expiresAt: Int64? = nil
        var refreshToken: String? = nil
        var idToken: String? = nil
        var scope: String? = nil
        var identity: Identity? = nil
        var generation: Int64
        var lastRefresh: RefreshRecord? = nil
        var dpopThumbprint: String? = nil
        var accessGeneration: Int64? = nil
        var refreshTokenInSecretService: Bool = false
        var audienceTokens: [String: AudienceToken] = [:]
        var idTokenSince: Int64? = nil
    }

    @Boxed private var fields: Fields

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.fields == rhs.fields
    }

    public var provider: String {
        get { fields.provider }
        _modify { yield &fields.provider }
    }
    public var issuer: String {
        get { fields.issuer }
        _modify { yield &fields.issuer }
    }
    public var clientID: String {
        get { fields.clientID }
        _modify { yield &fields.clientID }
    }
    public var accessToken: String {
        get { fields.accessToken }
        _modify { yield &fields.accessToken }
    }
    /// "Bearer" or "DPoP".
    public var tokenType: String {
        get { fields.tokenType }
        _modify { yield &fields.tokenType }
    }
    public var issuedAt: Int64 {
        get { fields.issuedAt }
        _modify { yield &fields.issuedAt }
    }
    public var expiresAt: Int64? {
        get { fields.expiresAt }
        _modify { yield &fields.expiresAt }
    }
    public var refreshToken: String? {
        get { fields.refreshToken }
        _modify { yield &fields.refreshToken }
    }
    public var idToken: String? {
        get { fields.idToken }
        _modify { yield &fields.idToken }
    }
    public var scope: String? {
        get { fields.scope }
        _modify { yield &fields.scope }
    }
    public var identity: Identity? {
        get { fields.identity }
        _modify { yield &fields.identity }
    }
    /// Grows by one each time the tokens change; lets a caller tell whether someone refreshed since it looked.
    public var generation: Int64 {
        get { fields.generation }
        _modify { yield &fields.generation }
    }
    public var lastRefresh: RefreshRecord? {
        get { fields.lastRefresh }
        _modify { yield &fields.lastRefresh }
    }
    /// With DPoP: the thumbprint of the key the tokens are bound to (RFC 9449 `cnf.jkt`).
    public var dpopThumbprint: String? {
        get { fields.dpopThumbprint }
        _modify { yield &fields.dpopThumbprint }
    }
    /// The generation in which `accessToken` was obtained, when a later change (a token for an origin's
    /// audience, which may rotate the refresh token) left it as it was; nil means `generation`.
    public var accessGeneration: Int64? {
        get { fields.accessGeneration }
        _modify { yield &fields.accessGeneration }
    }
    /// Whether the token file keeps the refresh token in the Secret Service (`token_store = secret-service`);
    /// set by `TokenStore.load`, not stored.
    public var refreshTokenInSecretService: Bool {
        get { fields.refreshTokenInSecretService }
        _modify { yield &fields.refreshTokenInSecretService }
    }
    /// Tokens obtained for origins' audiences and scopes (RFC 8707, RFC 9700 §4.10), by `TokenKey.id`.
    public var audienceTokens: [String: AudienceToken] {
        get { fields.audienceTokens }
        _modify { yield &fields.audienceTokens }
    }

    /// An access token obtained for one `TokenKey` (an origin's resource and scopes).
    public struct AudienceToken: Sendable, Equatable {
        public var accessToken: String
        public var tokenType: String
        public var issuedAt: Int64
        public var expiresAt: Int64?
        public var scope: String?
        /// The generation of the token file when this token was obtained.
        public var generation: Int64
        public var dpopThumbprint: String?

        public init(
            accessToken: String, tokenType: String, issuedAt: Int64, expiresAt: Int64?, scope: String?,
            generation: Int64, dpopThumbprint: String?
        ) {
            self.accessToken = accessToken
            self.tokenType = tokenType
            self.issuedAt = issuedAt
            self.expiresAt = expiresAt
            self.scope = scope
            self.generation = generation
            self.dpopThumbprint = dpopThumbprint
        }

        var json: JSONValue {
            var object = JSONObject()
            object["access_token"] = .string(accessToken)
            object["token_type"] = .string(tokenType)
            object["issued_at"] = .int(issuedAt)
            if let expiresAt { object["expires_at"] = .int(expiresAt) }
            if let scope { object["scope"] = .string(scope) }
            object["generation"] = .int(generation)
            if let dpopThumbprint { object["dpop_jkt"] = .string(dpopThumbprint) }
            return .object(object)
        }

        init?(json: JSONValue) {
            guard let object = json.object, let accessToken = object["access_token"]?.string,
                let tokenType = object["token_type"]?.string, let issuedAt = object["issued_at"]?.int,
                let generation = object["generation"]?.int
            else { return nil }
            self.init(
                accessToken: accessToken, tokenType: tokenType, issuedAt: issuedAt,
                expiresAt: object["expires_at"]?.int, scope: object["scope"]?.string, generation: generation,
                dpopThumbprint: object["dpop_jkt"]?.string)
        }
    }

    /// The outcome of the last refresh, for `proxyctl status`.
    public struct RefreshRecord: Sendable, Equatable {
        public var at: Int64
        /// "ok", or the error category.
        public var outcome: String
        public var reason: String?

        public init(at: Int64, outcome: String, reason: String? = nil) {
            self.at = at
            self.outcome = outcome
            self.reason = reason
        }
    }

    public init(
        provider: String, issuer: String, clientID: String, accessToken: String, tokenType: String, issuedAt: Int64,
        expiresAt: Int64?, refreshToken: String?, idToken: String?, scope: String?, identity: Identity?,
        generation: Int64
    ) {
        _fields = Boxed(
            wrappedValue: Fields(
                provider: provider, issuer: issuer, clientID: clientID, accessToken: accessToken, tokenType: tokenType,
                issuedAt: issuedAt, expiresAt: expiresAt, refreshToken: refreshToken, idToken: idToken, scope: scope,
                identity: identity, generation: generation))
    }

    /// When to refresh: 60 s before expiry, or at 80 % of the lifetime for short-lived tokens. The margin is
    /// rounded up to whole seconds: the provider's `exp`, this clock and the origin's count seconds apart, and a
    /// token of a few seconds (a margin of 0 when rounded down) was sent in its last second and refused.
    public var refreshAt: Int64? {
        guard let expiresAt else { return nil }
        let lifetime = max(0, expiresAt - issuedAt)
        return expiresAt - min(60, (lifetime + 4) / 5)
    }

    /// Whether the access token can be used at `now` without refreshing first.
    public func isFresh(at now: Int64) -> Bool {
        guard let refreshAt else { return true }
        return now < refreshAt
    }

    /// Whether there is an access token that can be used at `now` without obtaining a new one first (a machine
    /// grant's token file may hold none yet: only tokens for origins' audiences).
    public func isUsable(at now: Int64) -> Bool { !accessToken.isEmpty && isFresh(at: now) }

    /// Whether the access token has expired at `now`.
    public func isExpired(at now: Int64) -> Bool {
        guard let expiresAt else { return false }
        return now >= expiresAt
    }

    /// The tokens as an origin of `key` sees them: `accessToken`, `tokenType`, the expiry and `generation` are
    /// those of the key's own token (the ID token for `.idToken`); nil when there is none yet. The refresh
    /// token and the identity stay the provider's.
    public func view(for key: TokenKey) -> TokenSet? {
        if key.isProviderDefault {
            var view = self
            view.generation = accessGeneration ?? generation
            view.audienceTokens = [:]
            return view
        }
        if key.kind == .idToken {
            guard let idToken, case .success(let jwt) = JWT.parse(idToken) else { return nil }
            var view = self
            view.accessToken = idToken
            view.tokenType = "Bearer"
            view.dpopThumbprint = nil
            view.issuedAt = jwt.claims["iat"]?.int ?? issuedAt
            view.expiresAt = jwt.claims["exp"]?.int
            view.generation = idTokenGeneration
            view.audienceTokens = [:]
            return view
        }
        guard let token = audienceTokens[key.id] else { return nil }
        var view = self
        view.accessToken = token.accessToken
        view.tokenType = token.tokenType
        view.issuedAt = token.issuedAt
        view.expiresAt = token.expiresAt
        view.scope = token.scope
        view.generation = token.generation
        view.dpopThumbprint = token.dpopThumbprint
        view.audienceTokens = [:]
        return view
    }

    /// The generation in which the ID token was last replaced: a refresh that brings none leaves it.
    public var idTokenGeneration: Int64 { idTokenSince ?? accessGeneration ?? generation }
    /// Set when a later change kept the ID token as it was (see `idTokenGeneration`).
    public var idTokenSince: Int64? {
        get { fields.idTokenSince }
        _modify { yield &fields.idTokenSince }
    }

    // MARK: - JSON

    public var json: JSONValue {
        var object = JSONObject()
        object["version"] = 1
        object["provider"] = .string(provider)
        object["issuer"] = .string(issuer)
        object["client_id"] = .string(clientID)
        object["token_type"] = .string(tokenType)
        object["access_token"] = .string(accessToken)
        object["issued_at"] = .int(issuedAt)
        if let expiresAt { object["expires_at"] = .int(expiresAt) }
        if let refreshToken { object["refresh_token"] = .string(refreshToken) }
        if let idToken { object["id_token"] = .string(idToken) }
        if let scope { object["scope"] = .string(scope) }
        if let identity {
            var who = JSONObject()
            who["sub"] = .string(identity.subject)
            if let name = identity.name { who["name"] = .string(name) }
            if let email = identity.email { who["email"] = .string(email) }
            if let authTime = identity.authTime { who["auth_time"] = .int(authTime) }
            if let acr = identity.acr { who["acr"] = .string(acr) }
            if let amr = identity.amr { who["amr"] = .array(amr.map { .string($0) }) }
            object["identity"] = .object(who)
        }
        object["generation"] = .int(generation)
        if let dpopThumbprint { object["dpop_jkt"] = .string(dpopThumbprint) }
        if let accessGeneration { object["access_generation"] = .int(accessGeneration) }
        if let idTokenSince { object["id_token_generation"] = .int(idTokenSince) }
        if !audienceTokens.isEmpty {
            var tokens = JSONObject()
            for (id, token) in audienceTokens.sorted(by: { $0.key < $1.key }) { tokens[id] = token.json }
            object["audience_tokens"] = .object(tokens)
        }
        if let lastRefresh {
            var record = JSONObject()
            record["at"] = .int(lastRefresh.at)
            record["outcome"] = .string(lastRefresh.outcome)
            if let reason = lastRefresh.reason { record["reason"] = .string(reason) }
            object["last_refresh"] = .object(record)
        }
        return .object(object)
    }

    public init?(json: JSONValue) {
        guard let object = json.object, object["version"]?.int == 1, let provider = object["provider"]?.string,
            let issuer = object["issuer"]?.string, let clientID = object["client_id"]?.string,
            let accessToken = object["access_token"]?.string, let tokenType = object["token_type"]?.string,
            let issuedAt = object["issued_at"]?.int, let generation = object["generation"]?.int
        else { return nil }
        var identity: Identity? = nil
        if let who = object["identity"]?.object, let subject = who["sub"]?.string {
            var parsed = Identity(subject: subject)
            parsed.name = who["name"]?.string
            parsed.email = who["email"]?.string
            parsed.authTime = who["auth_time"]?.int
            parsed.acr = who["acr"]?.string
            parsed.amr = who["amr"]?.stringList
            identity = parsed
        }
        self.init(
            provider: provider, issuer: issuer, clientID: clientID, accessToken: accessToken, tokenType: tokenType,
            issuedAt: issuedAt, expiresAt: object["expires_at"]?.int, refreshToken: object["refresh_token"]?.string,
            idToken: object["id_token"]?.string, scope: object["scope"]?.string, identity: identity,
            generation: generation)
        dpopThumbprint = object["dpop_jkt"]?.string
        accessGeneration = object["access_generation"]?.int
        idTokenSince = object["id_token_generation"]?.int
        if let tokens = object["audience_tokens"]?.object {
            for (id, value) in tokens.members {
                if let token = AudienceToken(json: value) { audienceTokens[id] = token }
            }
        }
        if let record = object["last_refresh"]?.object, let at = record["at"]?.int,
            let outcome = record["outcome"]?.string
        {
            lastRefresh = RefreshRecord(at: at, outcome: outcome, reason: record["reason"]?.string)
        }
    }
}
