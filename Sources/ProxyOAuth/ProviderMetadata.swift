import ProxyCore

/// The endpoints and capabilities of a provider, from its discovery document (OpenID Connect Discovery 1.0
/// §3, RFC 8414 §2).
public struct ProviderMetadata: Sendable, Equatable {
    public var issuer: String
    public var authorizationEndpoint: String?
    public var tokenEndpoint: String
    public var deviceAuthorizationEndpoint: String?
    public var pushedAuthorizationRequestEndpoint: String?
    public var requirePushedAuthorizationRequests = false
    public var revocationEndpoint: String?
    public var userinfoEndpoint: String?
    public var jwksURI: String?
    public var endSessionEndpoint: String?
    public var codeChallengeMethods: [String]?
    public var dpopSigningAlgorithms: [String]?
    public var issParameterSupported = false
    public var idTokenSigningAlgorithms: [String]?
    public var grantTypes: [String]?
    public var scopesSupported: [String]?
    public var promptValues: [String]?
    /// RFC 7591 §3: where clients register themselves.
    public var registrationEndpoint: String?
    /// draft-ietf-oauth-client-id-metadata-document: an https URL may be the client id.
    public var clientIDMetadataDocumentSupported = false

    public init(issuer: String, tokenEndpoint: String) {
        self.issuer = issuer
        self.tokenEndpoint = tokenEndpoint
    }

    /// The discovery URLs to try, in order: OpenID Connect Discovery (issuer + path), then RFC 8414
    /// (well-known inserted between host and path).
    public static func discoveryURLs(issuer: String) -> [String] {
        var trimmed = issuer
        while trimmed.hasSuffix("/") { trimmed.removeLast() }
        var urls = [trimmed + "/.well-known/openid-configuration"]
        if case .success(let url) = AbsoluteURL.parse(issuer) {
            var path = url.pathAndQuery
            if path == "/" { path = "" }
            while path.hasSuffix("/") { path.removeLast() }
            let origin = "\(url.scheme)://\(url.hostFieldValue)"
            urls.append(origin + "/.well-known/oauth-authorization-server" + path)
        }
        return urls
    }

    /// Issuers a person may have meant when `issuer` has no discovery document, most likely first: the part
    /// before `/.well-known/` (a discovery URL given as the issuer), then the path's ancestors up to the origin
    /// (`https://login.example.com/realms/dev/extra` → `.../realms/dev`, `.../realms`, `https://login.example.com`).
    /// Each is only a guess until its own discovery document names it.
    public static func issuerCandidates(for issuer: String, limit: Int = 4) -> [String] {
        guard case .success(let url) = AbsoluteURL.parse(issuer) else { return [] }
        let origin = "\(url.scheme)://\(url.hostFieldValue)"
        var path = url.pathAndQuery
        if let query = path.firstIndex(where: { $0 == "?" || $0 == "#" }) { path = String(path[..<query]) }
        var found: [String] = []
        if let wellKnown = path.firstRange(of: "/.well-known/") {
            found.append(origin + path[..<wellKnown.lowerBound])
            path = String(path[..<wellKnown.lowerBound])
        }
        var segments = path.split(separator: "/", omittingEmptySubsequences: true)
        while !segments.isEmpty {
            segments.removeLast()
            found.append(origin + segments.map { "/" + $0 }.joined())
        }
        var unique: [String] = []
        for candidate in found where candidate != issuer && !unique.contains(candidate) { unique.append(candidate) }
        return Array(unique.prefix(limit))
    }

    /// "URL answered 404 (OpenID Connect Discovery), URL answered 404 (RFC 8414)": the URLs of `discoveryURLs`
    /// tried, in its order.
    public static func describeTried(_ tried: [(url: String, status: Int)]) -> String {
        let kinds = ["OpenID Connect Discovery", "RFC 8414"]
        return tried.enumerated().map { index, attempt in
            "\(attempt.url) answered \(attempt.status)" + (index < kinds.count ? " (\(kinds[index]))" : "")
        }.joined(separator: ", ")
    }

    /// Parses and checks a discovery document for `expectedIssuer`.
    public static func parse(_ document: JSONObject, expectedIssuer: String) -> Result<ProviderMetadata, AuthError> {
        guard let issuer = document["issuer"]?.string else {
            return .failure(.configuration(reason: "the discovery document has no issuer"))
        }
        // OpenID Connect Discovery §4.3, RFC 8414 §3.3: the issuer must be exactly the one asked for.
        guard issuer == expectedIssuer else {
            return .failure(
                .configuration(
                    reason:
                        "the provider says its issuer is \(AuthText.clip(issuer)), but proxy.conf has \(expectedIssuer); set issuer to exactly the provider's value"
                ))
        }
        guard let token = document["token_endpoint"]?.string else {
            return .failure(.configuration(reason: "the discovery document has no token_endpoint"))
        }
        var metadata = ProviderMetadata(issuer: issuer, tokenEndpoint: token)
        metadata.authorizationEndpoint = document["authorization_endpoint"]?.string
        metadata.deviceAuthorizationEndpoint = document["device_authorization_endpoint"]?.string
        metadata.pushedAuthorizationRequestEndpoint = document["pushed_authorization_request_endpoint"]?.string
        metadata.requirePushedAuthorizationRequests = document["require_pushed_authorization_requests"]?.bool ?? false
        metadata.revocationEndpoint = document["revocation_endpoint"]?.string
        metadata.userinfoEndpoint = document["userinfo_endpoint"]?.string
        metadata.jwksURI = document["jwks_uri"]?.string
        metadata.endSessionEndpoint = document["end_session_endpoint"]?.string
        metadata.codeChallengeMethods = document["code_challenge_methods_supported"]?.stringList
        metadata.dpopSigningAlgorithms = document["dpop_signing_alg_values_supported"]?.stringList
        metadata.issParameterSupported = document["authorization_response_iss_parameter_supported"]?.bool ?? false
        metadata.idTokenSigningAlgorithms = document["id_token_signing_alg_values_supported"]?.stringList
        metadata.grantTypes = document["grant_types_supported"]?.stringList
        metadata.scopesSupported = document["scopes_supported"]?.stringList
        metadata.promptValues = document["prompt_values_supported"]?.stringList
        metadata.registrationEndpoint = document["registration_endpoint"]?.string
        metadata.clientIDMetadataDocumentSupported = document["client_id_metadata_document_supported"]?.bool ?? false
        for (name, value) in [
            ("token_endpoint", Optional(token)), ("authorization_endpoint", metadata.authorizationEndpoint),
            ("device_authorization_endpoint", metadata.deviceAuthorizationEndpoint),
            ("pushed_authorization_request_endpoint", metadata.pushedAuthorizationRequestEndpoint),
            ("revocation_endpoint", metadata.revocationEndpoint), ("jwks_uri", metadata.jwksURI),
            ("registration_endpoint", metadata.registrationEndpoint),
            ("end_session_endpoint", metadata.endSessionEndpoint), ("userinfo_endpoint", metadata.userinfoEndpoint),
        ] {
            guard let value else { continue }
            // Each is one URL of the issuer's rules, and holds nothing but URL characters: the authorization and
            // end-session endpoints become the URL a browser is started with (CVE-2025-6514 was such an endpoint
            // handed to a shell).
            if let problem = ProviderConfig.checkIssuer(value.split(separator: "?").first.map(String.init) ?? value)
                ?? MetadataURL.problem(value, allowQuery: true)
            {
                return .failure(.configuration(reason: "the provider's \(name) is not usable: \(problem)"))
            }
        }
        return .success(metadata)
    }

    /// Whether the provider accepts PKCE S256. Providers that do not advertise methods are given the
    /// benefit of the doubt (many support S256 without saying so).
    public var supportsS256: Bool { codeChallengeMethods?.contains("S256") ?? true }
}

enum AuthText {
    static func clip(_ text: String, _ limit: Int = 120) -> String {
        OAuthErrorResponse.sanitize(text, limit: limit)
    }
}
