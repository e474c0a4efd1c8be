/// How a provider's tokens are bound to the client (`token_binding`).
public enum TokenBinding: String, Sendable, Equatable {
    /// Plain Bearer tokens (RFC 6750).
    case bearer
    /// Sender-constrained tokens with DPoP proofs (RFC 9449).
    case dpop
}

/// When to push the authorization request first (RFC 9126, `use_par`).
public enum PARPolicy: String, Sendable, Equatable {
    /// When the provider requires it (`require_pushed_authorization_requests`).
    case auto
    /// Whenever the provider offers it; an error when it does not.
    case always
    /// Never; an error when the provider requires it.
    case never
}

/// How proxyctl obtains tokens from a provider (`grant`).
public enum ProviderGrant: String, Sendable, Equatable {
    /// A person signs in (`proxyctl login`: Authorization Code + PKCE or the device flow); refresh tokens renew.
    case authorizationCode = "authorization_code"
    /// The client's own credentials (RFC 6749 §4.4): machines and CI, no person and no refresh token.
    case clientCredentials = "client_credentials"
    /// An ambient workload token exchanged for an access token (RFC 8693), e.g. a CI system's OIDC ID token.
    case tokenExchange = "token_exchange"
}

/// How the client authenticates at the token endpoint (`token_endpoint_auth_method`, RFC 7591 §2).
public enum ClientAuthMethod: String, Sendable, Equatable {
    /// A public client: `client_id` only.
    case none
    /// A JWT signed with the client's own key (RFC 7523 §2.2), made by `proxyctl key init`.
    case privateKeyJWT = "private_key_jwt"
    /// HTTP Basic with the client secret (RFC 6749 §2.3.1).
    case clientSecretBasic = "client_secret_basic"
    /// The client secret in the form body (RFC 6749 §2.3.1).
    case clientSecretPost = "client_secret_post"
    /// A JWT signed with HMAC-SHA256 keyed by the client secret (RFC 7523 §2.2, OpenID Connect Core §9).
    case clientSecretJWT = "client_secret_jwt"

    /// Whether the method needs `client_secret_file`.
    public var usesSecret: Bool { self == .clientSecretBasic || self == .clientSecretPost || self == .clientSecretJWT }

    /// Whether the client authenticates with a signed JWT, the client assertion (RFC 7523 §2.2).
    public var usesAssertion: Bool { self == .privateKeyJWT || self == .clientSecretJWT }
}

/// The `aud` of a client assertion (`client_assertion_audience`).
public enum AssertionAudience: String, Sendable, Equatable {
    /// The authorization server's issuer identifier, the one audience draft-ietf-oauth-rfc7523bis allows: a
    /// token endpoint URL can be another server's too (the audience confusion that draft fixes).
    case issuer
    /// The token endpoint's URL (OpenID Connect Core §9, RFC 7523 before the bis): for providers that accept
    /// nothing else (glewlwyd 2.7).
    case tokenEndpoint = "token_endpoint"
}

/// A `[provider NAME]` section: an OpenID provider that proxyctl signs in to as a public client.
public struct ProviderConfig: Sendable, Equatable {
    public let name: String
    /// The issuer identifier; endpoints come from its discovery document.
    public var issuer: String = ""
    public var clientID: String = ""
    /// Requested scopes; `openid` is always first, nothing else is added.
    public var scopes: [String] = ["openid"]
    /// Loopback port for the redirect; 0 means any free port (RFC 8252 §7.3).
    public var redirectPort: Int = 0
    public var redirectPath: String = "/callback"
    public var acrValues: String? = nil
    public var loginHint: String? = nil
    /// Resource indicators (RFC 8707).
    public var resources: [String] = []
    /// Extra authorization request parameters (`param.NAME = value`).
    public var extraParameters: [(name: String, value: String)] = []
    public var usePAR: PARPolicy = .auto
    /// A CA bundle to trust for this provider instead of the system roots.
    public var caFile: String? = nil
    public var tokenBinding: TokenBinding = .bearer
    /// With `token_binding = dpop`: fail instead of falling back to Bearer.
    public var dpopRequired: Bool = false
    /// How long a login waits for the browser or the device code.
    public var loginTimeout: Int = 300_000
    /// How long a caller waits for the token endpoint (milliseconds). A refresh still unanswered then is
    /// left running, never sent again, and callers are told to retry.
    public var tokenTimeout: Int = 30_000
    /// How tokens are obtained: a person's sign-in, or a grant that needs nobody.
    public var grant: ProviderGrant = .authorizationCode
    /// Client authentication at the token endpoint; nil means the default (`effectiveClientAuth`).
    public var clientAuthMethod: ClientAuthMethod? = nil
    /// The client's private key for `private_key_jwt` (default `<state_dir>/keys/NAME.client.pem`).
    public var clientKeyFile: String? = nil
    /// A 0600 file holding the client secret (client_secret_basic, _post, _jwt).
    public var clientSecretFile: String? = nil
    /// The `aud` of the client assertion (private_key_jwt, client_secret_jwt).
    public var clientAssertionAudience: AssertionAudience = .issuer
    /// With `grant = token_exchange`: the file holding the subject token (read anew each time).
    public var subjectTokenFile: String? = nil
    /// With `grant = token_exchange`: a command printing the subject token (run without a shell).
    public var subjectTokenCommand: [String]? = nil
    /// RFC 8693 §3 token type identifier of the subject token.
    public var subjectTokenType: String = "urn:ietf:params:oauth:token-type:jwt"
    /// RFC 8693 `audience` of the requested token.
    public var audience: String? = nil
    /// Line of the section header, for messages.
    public var line: Int = 0
    /// The configuration file of the section, for messages that name the fix ("" when unknown).
    public var file: String = ""

    public init(name: String) { self.name = name }

    /// The client authentication in force: `token_endpoint_auth_method`, else what the other keys say. A
    /// `client_secret_file` without a `client_key_file` means `client_secret_basic` (RFC 7591 §2's default for
    /// a client with a secret); otherwise `none` for a person's sign-in and `private_key_jwt` for the machine
    /// grants.
    public var effectiveClientAuth: ClientAuthMethod {
        if let clientAuthMethod { return clientAuthMethod }
        if clientSecretFile != nil && clientKeyFile == nil { return .clientSecretBasic }
        return grant == .authorizationCode ? .none : .privateKeyJWT
    }

    /// Whether tokens come from a person signing in (`proxyctl login`) rather than from a grant that needs nobody.
    public var needsSignIn: Bool { grant == .authorizationCode }

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.name == rhs.name && lhs.issuer == rhs.issuer && lhs.clientID == rhs.clientID && lhs.scopes == rhs.scopes
            && lhs.redirectPort == rhs.redirectPort && lhs.redirectPath == rhs.redirectPath
            && lhs.acrValues == rhs.acrValues && lhs.loginHint == rhs.loginHint && lhs.resources == rhs.resources
            && lhs.extraParameters.map(\.name) == rhs.extraParameters.map(\.name)
            && lhs.extraParameters.map(\.value) == rhs.extraParameters.map(\.value) && lhs.usePAR == rhs.usePAR
            && lhs.caFile == rhs.caFile && lhs.tokenBinding == rhs.tokenBinding
            && lhs.dpopRequired == rhs.dpopRequired && lhs.loginTimeout == rhs.loginTimeout
            && lhs.tokenTimeout == rhs.tokenTimeout && lhs.grant == rhs.grant
            && lhs.clientAuthMethod == rhs.clientAuthMethod && lhs.clientKeyFile == rhs.clientKeyFile
            && lhs.clientSecretFile == rhs.clientSecretFile
            && lhs.clientAssertionAudience == rhs.clientAssertionAudience
            && lhs.subjectTokenFile == rhs.subjectTokenFile
            && lhs.subjectTokenCommand == rhs.subjectTokenCommand && lhs.subjectTokenType == rhs.subjectTokenType
            && lhs.audience == rhs.audience
    }

    /// Every key of `[provider NAME]`, in the order of proxy.conf.example.
    public static let keys = [
        "issuer", "client_id", "scopes", "redirect_port", "redirect_path", "acr_values", "login_hint", "resource",
        "param.NAME", "use_par", "ca_file", "token_binding", "dpop_required", "login_timeout",
        "token_timeout", "grant", "token_endpoint_auth_method", "client_key_file", "client_secret_file",
        "client_assertion_audience", "subject_token_file", "subject_token_command", "subject_token_type", "audience",
    ]

    /// Authorization parameters proxyctl sets itself; `param.` cannot override them.
    static let reservedParameters: Set<String> = [
        "client_id", "response_type", "redirect_uri", "scope", "state", "nonce", "code_challenge",
        "code_challenge_method", "request_uri", "dpop_jkt", "client_secret",
    ]

    /// The name `proxyctl init` gives a provider without `--name`: the registrable label of the issuer's host
    /// (`example` for login.example.com, `corp` for sso.corp.co.uk), which says whose sign-in it is and reads
    /// well in `proxyctl login example`; `default` for an IP address or a one-label host (`localhost`), whose
    /// digits say nothing. `isAddress` says which it was, so that init can suggest --name.
    public static func defaultName(issuerHost host: String) -> (name: String, isAddress: Bool) {
        var labels = host.lowercased().split(separator: ".").map(String.init)
        if IPAddress.parse(host) != nil || host.hasPrefix("[") || labels.count < 2 { return ("default", true) }
        labels.removeLast()  // the top-level domain
        // A two-letter country code with a second-level domain of its own (example.co.uk, example.com.au).
        let secondLevel: Set<String> = ["co", "com", "net", "org", "ac", "gov", "edu", "or", "ne", "go"]
        if labels.count >= 2, host.split(separator: ".").last?.count == 2, secondLevel.contains(labels.last ?? "") {
            labels.removeLast()
        }
        guard let label = labels.last, isValidName(label) else { return ("default", true) }
        return (label, false)
    }

    /// What to add to the message of a token endpoint that refused the client (`invalid_client`) while the
    /// assertion's audience is the issuer: providers that predate draft-ietf-oauth-rfc7523bis want the token
    /// endpoint there. nil when the client sends no assertion or already names the token endpoint.
    public var assertionAudienceHint: String? {
        guard effectiveClientAuth.usesAssertion, clientAssertionAudience == .issuer else { return nil }
        return
            "the client assertion's audience is the issuer (draft-ietf-oauth-rfc7523bis); if the provider wants its token endpoint there, set client_assertion_audience = token_endpoint in \(sectionReference)"
    }

    /// `[provider NAME] of FILE`, or `[provider NAME]` when the file is not known.
    public var sectionReference: String { file.isEmpty ? "[provider \(name)]" : "[provider \(name)] of \(file)" }

    /// Whether a provider name is usable on the command line and as a file name.
    static func isValidName(_ name: String) -> Bool {
        !name.isEmpty && name.count <= 64
            && name.utf8.allSatisfy {
                ASCII.isDigit($0) || ($0 | 0x20 >= 0x61 && $0 | 0x20 <= 0x7A) || $0 == 0x2D || $0 == 0x5F || $0 == 0x2E
            } && !name.hasPrefix(".")
    }

    /// Checks an issuer: https, or http for a loopback host (a provider on this machine); no query or fragment.
    public static func checkIssuer(_ text: String) -> String? {
        guard case .success(let url) = AbsoluteURL.parse(text) else {
            return "expected an https:// URL such as https://login.example.com/realms/dev"
        }
        if text.contains("?") || text.contains("#") { return "an issuer has no query or fragment (RFC 8414 §2)" }
        if url.scheme == "http" {
            let host = url.authority.host
            let loopback = host == "localhost" || (IPAddress.parse(host)?.isLoopback ?? false)
            if !loopback { return "an issuer must use https:// (http:// is accepted only for loopback hosts)" }
        }
        return nil
    }
}

extension ConfigParser {
    func applyProvider(
        _ section: INIDocument.Section, file: String, into provider: inout ProviderConfig, errors: inout [ConfigError]
    ) {
        let label = section.label
        for entry in section.entries {
            func fail(_ message: String) {
                errors.append(ConfigError(file: file, line: entry.line, section: label, key: entry.key, message))
            }
            func got() -> String { "got \"\(INIDocument.clip(entry.value))\"" }
            if entry.key.hasPrefix("param.") {
                let name = String(entry.key.dropFirst("param.".count))
                guard !name.isEmpty, name.utf8.allSatisfy({ ASCII.isTchar($0) }) else {
                    fail("expected param.NAME with a parameter name, such as param.audience")
                    continue
                }
                guard !ProviderConfig.reservedParameters.contains(name) else {
                    fail("\(name) is set by proxyctl itself and cannot be overridden")
                    continue
                }
                provider.extraParameters.append((name, entry.value))
                continue
            }
            switch entry.key {
            case "issuer":
                if let problem = ProviderConfig.checkIssuer(entry.value) { fail("\(problem), \(got())") }
                provider.issuer = entry.value
            case "client_id":
                guard !entry.value.isEmpty else {
                    fail("expected the client ID registered with the provider")
                    continue
                }
                provider.clientID = entry.value
            case "scopes":
                var scopes = ["openid"]
                for scope in entry.value.split(whereSeparator: { $0 == " " || $0 == "," })
                where !scopes.contains(String(scope)) {
                    scopes.append(String(scope))
                }
                provider.scopes = scopes
            case "redirect_port":
                guard let port = ConfigValue.digits(entry.value), (0...65535).contains(port) else {
                    fail("expected a port from 1 to 65535, or 0 for any free port, \(got())")
                    continue
                }
                provider.redirectPort = port
            case "redirect_path":
                guard entry.value.hasPrefix("/"), !entry.value.contains("?"), !entry.value.contains("#"),
                    entry.value.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F })
                else {
                    fail("expected a path starting with /, such as /callback, \(got())")
                    continue
                }
                provider.redirectPath = entry.value
            case "acr_values":
                provider.acrValues = entry.value.isEmpty ? nil : entry.value
            case "login_hint":
                provider.loginHint = entry.value.isEmpty ? nil : entry.value
            case "resource":
                provider.resources = entry.value.split(separator: " ").map(String.init)
                for resource in provider.resources where !resource.contains("://") {
                    fail("expected absolute URIs separated by spaces (RFC 8707), \(got())")
                }
            case "use_par":
                guard let policy = PARPolicy(rawValue: entry.value.lowercased()) else {
                    fail("expected auto, always or never, \(got())")
                    continue
                }
                provider.usePAR = policy
            case "ca_file":
                guard !entry.value.isEmpty else {
                    fail("expected the path of a PEM file of CA certificates")
                    continue
                }
                provider.caFile = resolvePath(entry.value)
            case "token_binding":
                guard let binding = TokenBinding(rawValue: entry.value.lowercased()) else {
                    fail("expected bearer or dpop, \(got())")
                    continue
                }
                provider.tokenBinding = binding
            case "dpop_required":
                guard let flag = ConfigValue.bool(entry.value) else {
                    fail("expected true or false, \(got())")
                    continue
                }
                provider.dpopRequired = flag
            case "login_timeout":
                guard let value = ConfigValue.duration(entry.value), value > 0 else {
                    fail("expected a duration such as 5m, \(got())")
                    continue
                }
                provider.loginTimeout = value
            case "token_timeout":
                guard let value = ConfigValue.duration(entry.value), value > 0 else {
                    fail("expected a duration such as 30s, \(got())")
                    continue
                }
                provider.tokenTimeout = value
            case "grant":
                let value = entry.value.lowercased().replacing("-", with: "_")
                guard let grant = ProviderGrant(rawValue: value == "login" ? "authorization_code" : value) else {
                    fail("expected authorization_code, client_credentials or token_exchange, \(got())")
                    continue
                }
                provider.grant = grant
            case "token_endpoint_auth_method":
                guard let method = ClientAuthMethod(rawValue: entry.value.lowercased()) else {
                    fail(
                        "expected none, private_key_jwt, client_secret_basic, client_secret_post or client_secret_jwt, \(got())"
                    )
                    continue
                }
                provider.clientAuthMethod = method
            case "client_key_file", "client_secret_file", "subject_token_file":
                guard !entry.value.isEmpty else {
                    fail("expected a file path")
                    continue
                }
                let path = resolvePath(entry.value)
                if entry.key == "client_key_file" {
                    provider.clientKeyFile = path
                } else if entry.key == "client_secret_file" {
                    provider.clientSecretFile = path
                } else {
                    provider.subjectTokenFile = path
                }
            case "client_assertion_audience":
                guard let audience = AssertionAudience(rawValue: entry.value.lowercased()) else {
                    fail("expected issuer or token_endpoint, \(got())")
                    continue
                }
                provider.clientAssertionAudience = audience
            case "subject_token_command":
                let words = entry.value.split(separator: " ").map(String.init)
                guard !words.isEmpty else {
                    fail("expected a command that prints the subject token, such as /usr/local/bin/ci-id-token")
                    continue
                }
                provider.subjectTokenCommand = words
            case "subject_token_type":
                guard entry.value.hasPrefix("urn:") else {
                    fail(
                        "expected a token type URI (RFC 8693 §3), such as urn:ietf:params:oauth:token-type:id_token, \(got())"
                    )
                    continue
                }
                provider.subjectTokenType = entry.value
            case "audience":
                provider.audience = entry.value.isEmpty ? nil : entry.value
            default:
                fail(KeySuggestion.message(for: entry.key, among: ProviderConfig.keys))
            }
        }
        for (key, present) in [("issuer", !provider.issuer.isEmpty), ("client_id", !provider.clientID.isEmpty)]
        where !present && !section.entries.contains(where: { $0.key == key }) {
            errors.append(
                ConfigError(
                    file: file, line: section.line, section: label, key: key,
                    "missing; every provider needs an issuer and a client_id"))
        }
        func crossError(_ key: String, _ message: String) {
            let line = section.entries.first { $0.key == key }?.line ?? section.line
            errors.append(ConfigError(file: file, line: line, section: label, key: key, message))
        }
        let method = provider.effectiveClientAuth
        if method.usesSecret && provider.clientSecretFile == nil {
            crossError(
                "token_endpoint_auth_method",
                "\(method.rawValue) needs client_secret_file: a file readable by you alone that holds the client secret"
            )
        }
        if provider.clientSecretFile != nil && !method.usesSecret {
            crossError(
                "client_secret_file",
                provider.clientAuthMethod == nil
                    ? "client_key_file and client_secret_file are both given: say which one the client uses with token_endpoint_auth_method = private_key_jwt or client_secret_basic (client_secret_post, client_secret_jwt)"
                    : "only used with token_endpoint_auth_method = client_secret_basic, client_secret_post or client_secret_jwt"
            )
        }
        if section.entries.contains(where: { $0.key == "client_assertion_audience" }) && !method.usesAssertion {
            crossError(
                "client_assertion_audience",
                "only used with token_endpoint_auth_method = private_key_jwt or client_secret_jwt (a client assertion); this provider uses \(method.rawValue)"
            )
        }
        if provider.grant == .clientCredentials && method == .none {
            crossError(
                "token_endpoint_auth_method",
                "grant = client_credentials needs a client that authenticates: private_key_jwt (proxyctl key init \(provider.name)) or a client secret"
            )
        }
        let sources = [provider.subjectTokenFile != nil, provider.subjectTokenCommand != nil].filter { $0 }.count
        if provider.grant == .tokenExchange && sources != 1 {
            crossError(
                "grant",
                sources == 0
                    ? "grant = token_exchange needs subject_token_file or subject_token_command: where the workload token comes from"
                    : "give one of subject_token_file and subject_token_command, not both")
        }
        if provider.grant != .tokenExchange {
            for key in ["subject_token_file", "subject_token_command", "subject_token_type", "audience"]
            where section.entries.contains(where: { $0.key == key }) {
                crossError(key, "only used with grant = token_exchange")
            }
        }
        if provider.dpopRequired && provider.tokenBinding != .dpop {
            let line = section.entries.first { $0.key == "dpop_required" }?.line ?? section.line
            errors.append(
                ConfigError(
                    file: file, line: line, section: label, key: "dpop_required",
                    "only meaningful with token_binding = dpop"))
        }
    }
}
