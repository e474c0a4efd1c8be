import ProxyCore
import ProxyTLS

/// Who signed in, from a validated ID token.
public struct Identity: Sendable, Equatable {
    public var subject: String
    public var name: String?
    public var email: String?
    public var authTime: Int64?
    public var acr: String?
    public var amr: [String]?
    public var expiresAt: Int64?

    public init(subject: String) { self.subject = subject }
}

/// ID token checks (OpenID Connect Core 1.0 §3.1.3.7) before anything is stored.
public struct IDTokenValidator: Sendable {
    public var issuer: String
    public var clientID: String
    public var nonce: String?
    /// Requested `max_age`, in seconds: `auth_time` must then be recent enough.
    public var maxAge: Int?
    /// Allowed clock difference with the provider, in seconds.
    public var clockSkew: Int64 = 60
    public var now: Int64

    public init(issuer: String, clientID: String, nonce: String?, maxAge: Int? = nil, now: Int64) {
        self.issuer = issuer
        self.clientID = clientID
        self.nonce = nonce
        self.maxAge = maxAge
        self.now = now
    }

    /// Validates `token`. `fetchKeys(refresh)` returns the provider's key set; it is called again with
    /// `refresh: true` once when the token names a key the cached set does not have (key rotation).
    public func validate(
        _ token: String, isolation: isolated (any Actor)? = #isolation,
        fetchKeys: (_ refresh: Bool) async throws -> JWKSet
    ) async throws -> Identity {
        let jwt: JWT
        switch JWT.parse(token) {
        case .failure(let error): throw invalid("is malformed: \(error.reason)")
        case .success(let parsed): jwt = parsed
        }
        var outcome = JWSVerifier.verify(jwt, keys: try await fetchKeys(false))
        if outcome == .unknownKey {
            outcome = JWSVerifier.verify(jwt, keys: try await fetchKeys(true))
        }
        switch outcome {
        case .valid: break
        case .unknownKey:
            throw invalid(
                "is signed with a key (kid \(AuthText.clip(jwt.keyID ?? "none", 60))) the provider does not publish")
        case .invalid(let reason): throw invalid(reason)
        }
        return try checkClaims(jwt.claims)
    }

    /// The claim checks alone (signature already verified).
    public func checkClaims(_ claims: JSONObject) throws -> Identity {
        guard claims["iss"]?.string == issuer else {
            throw invalid("was issued by \(AuthText.clip(claims["iss"]?.string ?? "nobody")), not \(issuer)")
        }
        guard let audiences = claims["aud"]?.stringList, audiences.contains(clientID) else {
            throw invalid("is not meant for this client (aud does not contain \(clientID))")
        }
        let azp = claims["azp"]?.string
        if audiences.count > 1 && azp == nil {
            throw invalid("has several audiences but no azp")
        }
        if let azp, azp != clientID {
            throw invalid("was issued to another party (azp \(AuthText.clip(azp)))")
        }
        guard let expiry = claims["exp"]?.int else { throw invalid("has no exp") }
        guard expiry + clockSkew > now else { throw invalid("has already expired (is this machine's clock right?)") }
        guard let issuedAt = claims["iat"]?.int else { throw invalid("has no iat") }
        guard issuedAt <= now + clockSkew else {
            throw invalid("was issued in the future (is this machine's clock right?)")
        }
        if let nonce {
            guard claims["nonce"]?.string == nonce else { throw invalid("does not carry this sign-in's nonce") }
        }
        guard let subject = claims["sub"]?.string, !subject.isEmpty else { throw invalid("has no sub") }
        let authTime = claims["auth_time"]?.int
        // OpenID Connect Core §3.1.2.1: with max_age, auth_time is required. glewlwyd sends 0 when it does
        // not know the time; that is accepted as "unknown" rather than failing every such sign-in.
        if maxAge != nil && authTime == nil { throw invalid("has no auth_time although max_age was requested") }
        if let maxAge, let authTime, authTime > 0, authTime + Int64(maxAge) + clockSkew < now {
            throw invalid("reports a sign-in older than max_age \(maxAge)s")
        }
        var identity = Identity(subject: subject)
        identity.name = claims["name"]?.string ?? claims["preferred_username"]?.string
        identity.email = claims["email"]?.string
        identity.authTime = authTime
        identity.acr = claims["acr"]?.string
        identity.amr = claims["amr"]?.stringList
        identity.expiresAt = expiry
        return identity
    }

    private func invalid(_ reason: String) -> AuthError {
        .rejected(reason: "the sign-in was refused: the provider's ID token \(reason); nothing was stored")
    }
}
