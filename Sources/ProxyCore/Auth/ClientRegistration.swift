/// What proxyctl asks an authorization server to register (RFC 7591 §2): a native public client (RFC 8252), no
/// secret (`token_endpoint_auth_method` none), the authorization code and refresh token grants (and the device
/// grant where the server has a device endpoint), one loopback redirect URI on a port proxyctl keeps.
public struct ClientRegistrationRequest: Sendable, Equatable {
    public static let deviceGrant = "urn:ietf:params:oauth:grant-type:device_code"

    public var redirectURI: String
    public var grantTypes: [String]
    public var scopes: [String]
    /// RFC 9449 §5.2: tokens of this client are always DPoP-bound.
    public var dpopBound: Bool
    public var clientName = "proxyctl"

    public init(redirectURI: String, device: Bool, scopes: [String], dpopBound: Bool) {
        self.redirectURI = redirectURI
        grantTypes = ["authorization_code", "refresh_token"] + (device ? [Self.deviceGrant] : [])
        self.scopes = scopes
        self.dpopBound = dpopBound
    }

    /// The registration request's JSON body.
    public var body: String {
        var members: [(String, JSONValue)] = [
            ("client_name", .string(clientName)), ("application_type", "native"),
            ("redirect_uris", .array([.string(redirectURI)])), ("token_endpoint_auth_method", "none"),
            ("grant_types", .array(grantTypes.map(JSONValue.string))), ("response_types", ["code"]),
            ("software_id", "proxyctl"),
            // glewlwyd 2.7.5 registers a confidential client (which must authenticate at the token endpoint)
            // unless told otherwise in a member of its own; RFC 7591 §2 has servers ignore members they do not
            // know, so the others are unaffected.
            ("client_confidential", false),
        ]
        if !scopes.isEmpty { members.append(("scope", .string(scopes.joined(separator: " ")))) }
        if dpopBound { members.append(("dpop_bound_access_tokens", true)) }
        return JSON.serialize(.object(JSONObject(members)))
    }

    /// A one-line description for people: what will be registered.
    public var summary: String {
        let grants = grantTypes.map {
            $0 == Self.deviceGrant ? "device code" : $0.replacing("_", with: " ")
        }
        return
            "a native public client named \(clientName) (no secret), redirect URI \(redirectURI), grants \(grants.joined(separator: ", "))"
            + (scopes.isEmpty ? "" : ", scopes \(scopes.joined(separator: " "))")
    }
}

/// A client an authorization server registered for proxyctl (RFC 7591 §3.2.1), as checked and kept per issuer in
/// the state directory. The `registration_access_token` (RFC 7592) is a credential for changing or deleting the
/// registration: it is kept 0600 like a refresh token and never printed.
public struct ClientRegistration: Sendable, Equatable {
    public var issuer: String
    public var clientID: String
    public var redirectURIs: [String]
    public var grantTypes: [String]
    public var registrationAccessToken: String?
    public var registrationClientURI: String?
    /// When the server says it issued the client id (`client_id_issued_at`), else when proxyctl registered it.
    public var issuedAt: Int64
    /// The server issued a client secret although none was asked for; it is not kept (a public client has none).
    public var secretIgnored = false

    public init(issuer: String, clientID: String, redirectURIs: [String], grantTypes: [String], issuedAt: Int64) {
        self.issuer = issuer
        self.clientID = clientID
        self.redirectURIs = redirectURIs
        self.grantTypes = grantTypes
        self.issuedAt = issuedAt
    }

    /// Whether `text` can be a client id written into proxy.conf and sent in forms: printable ASCII without
    /// spaces, at most 255 bytes; a Client ID Metadata Document URL is one too.
    public static func isClientID(_ text: String) -> Bool {
        !text.isEmpty && text.utf8.count <= 255 && text.utf8.allSatisfy { $0 > 0x20 && $0 < 0x7F }
            && !text.hasPrefix("#") && !text.hasPrefix(";")
    }

    /// Checks the server's answer to `request` (a 201 or 200 with a JSON object).
    public static func parse(
        _ value: JSONValue, issuer: String, request: ClientRegistrationRequest, now: Int64
    ) -> Result<ClientRegistration, DiscoveryError> {
        guard case .object(let object) = value else {
            return .failure(DiscoveryError("the registration answer is not a JSON object"))
        }
        guard let clientID = object["client_id"]?.string else {
            return .failure(DiscoveryError("the registration answer has no client_id"))
        }
        guard isClientID(clientID) else {
            return .failure(
                DiscoveryError("the registration answer's client_id \(DiscoveryText.quote(clientID)) is not usable"))
        }
        var redirects = [request.redirectURI]
        if let echoed = object["redirect_uris"] {
            guard case .array = echoed, let list = echoed.stringList else {
                return .failure(DiscoveryError("the registration answer's redirect_uris is not a list of URLs"))
            }
            guard list.contains(request.redirectURI) else {
                return .failure(
                    DiscoveryError(
                        "the provider registered other redirect URIs than \(request.redirectURI); a sign-in could not come back"
                    ))
            }
            redirects = list
        }
        if let method = object["token_endpoint_auth_method"]?.string, method != "none" {
            return .failure(
                DiscoveryError(
                    "the provider registered a confidential client (token_endpoint_auth_method \(DiscoveryText.quote(method))), but proxyctl signs in as a public client: register one at the provider and give --client-id"
                ))
        }
        var grants = request.grantTypes
        if let echoed = object["grant_types"] {
            guard case .array = echoed, let list = echoed.stringList else {
                return .failure(DiscoveryError("the registration answer's grant_types is not a list"))
            }
            guard list.contains("authorization_code") else {
                return .failure(
                    DiscoveryError("the provider registered the client without the authorization_code grant"))
            }
            grants = list
        }
        var registration = ClientRegistration(
            issuer: issuer, clientID: clientID, redirectURIs: redirects, grantTypes: grants,
            issuedAt: object["client_id_issued_at"]?.int ?? now)
        if let token = object["registration_access_token"] {
            guard let text = token.string, !text.isEmpty, text.utf8.count <= 4096,
                text.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F })
            else {
                return .failure(DiscoveryError("the registration answer's registration_access_token is not a token"))
            }
            registration.registrationAccessToken = text
        }
        if let uri = object["registration_client_uri"] {
            guard let text = uri.string, MetadataURL.problem(text, allowQuery: true) == nil else {
                return .failure(DiscoveryError("the registration answer's registration_client_uri is not usable"))
            }
            registration.registrationClientURI = text
        }
        registration.secretIgnored = object["client_secret"] != nil
        return .success(registration)
    }

    /// The port of the loopback redirect URI, `http://127.0.0.1:PORT/...`.
    public var redirectPort: Int? {
        for uri in redirectURIs {
            if case .success(let url) = AbsoluteURL.parse(uri), url.scheme == "http", url.authority.host == "127.0.0.1"
            {
                return url.authority.port
            }
        }
        return nil
    }

    /// What is kept in the state directory.
    public var stored: JSONValue {
        var members: [(String, JSONValue)] = [
            ("issuer", .string(issuer)), ("client_id", .string(clientID)),
            ("redirect_uris", .array(redirectURIs.map(JSONValue.string))),
            ("grant_types", .array(grantTypes.map(JSONValue.string))), ("client_id_issued_at", .int(issuedAt)),
        ]
        if let registrationAccessToken {
            members.append(("registration_access_token", .string(registrationAccessToken)))
        }
        if let registrationClientURI { members.append(("registration_client_uri", .string(registrationClientURI))) }
        return .object(JSONObject(members))
    }

    /// A kept registration read back; nil when it is not one.
    public init?(stored value: JSONValue) {
        guard let issuer = value["issuer"]?.string, let clientID = value["client_id"]?.string,
            let redirects = value["redirect_uris"]?.stringList, let grants = value["grant_types"]?.stringList
        else { return nil }
        self.init(
            issuer: issuer, clientID: clientID, redirectURIs: redirects, grantTypes: grants,
            issuedAt: value["client_id_issued_at"]?.int ?? 0)
        registrationAccessToken = value["registration_access_token"]?.string
        registrationClientURI = value["registration_client_uri"]?.string
    }
}

/// How init gets a client for an authorization server it found from an origin, in the order the issue sets:
/// the id the user gave, a Client ID Metadata Document the user publishes (when the server accepts them), a
/// registration (RFC 7591) when the server has an endpoint for it; else what the server needs, naming the flag.
public enum ClientChoice: Sendable, Equatable {
    case given(String)
    case metadataDocument(String)
    case register(endpoint: String)

    public static func decide(
        clientID: String?, clientMetadataURL: String?, metadataDocumentsSupported: Bool, registrationEndpoint: String?,
        issuer: String
    ) -> Result<ClientChoice, DiscoveryError> {
        if let clientID { return .success(.given(clientID)) }
        if let clientMetadataURL, metadataDocumentsSupported { return .success(.metadataDocument(clientMetadataURL)) }
        if let registrationEndpoint { return .success(.register(endpoint: registrationEndpoint)) }
        if clientMetadataURL != nil {
            return .failure(
                DiscoveryError(
                    "\(issuer) accepts no Client ID Metadata Document (client_id_metadata_document_supported) and has no registration endpoint: register a public client for proxyctl there and give --client-id ID"
                ))
        }
        return .failure(
            DiscoveryError(
                "\(issuer) has no registration endpoint (registration_endpoint, RFC 7591)"
                    + (metadataDocumentsSupported
                        ? " but accepts Client ID Metadata Documents: publish one for proxyctl at an https URL and give --client-metadata-url URL, or"
                        : ":")
                    + " register a public client for proxyctl there (redirect URI http://127.0.0.1:PORT/callback) and give --client-id ID"
            ))
    }

    /// A Client ID Metadata Document URL (draft-ietf-oauth-client-id-metadata-document §3): https with a path.
    public static func metadataURLProblem(_ text: String) -> String? {
        if let problem = MetadataURL.problem(text, allowQuery: false) { return problem }
        guard case .success(let url) = AbsoluteURL.parse(text), url.scheme == "https" else {
            return "a client metadata document is served over https"
        }
        if url.pathAndQuery == "/" { return "a client metadata document URL has a path" }
        return nil
    }
}
