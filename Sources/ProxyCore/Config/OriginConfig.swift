/// What to do with a credential field the client sent itself (`client_credential`, or its older name for
/// `Authorization` alone, `client_authorization`): a field named like one the origin's credential goes in, holding
/// anything but the origin's own placeholder.
public enum ClientAuthorizationPolicy: String, Sendable, Equatable {
    /// Leave the client's credentials alone and attach nothing (the client knows best).
    case keep
    /// Remove the client's credentials and attach the origin's own (logged): the default.
    case replace
    /// Answer 403: a tool that brings a key of its own for this origin is not expected (logged).
    case refuse
}

/// An `[origin URL]` section: a protected origin, the only kind of traffic proxyctl intercepts.
public struct OriginConfig: Sendable, Equatable {
    /// The fields, behind one reference (`Boxed`, copied on write). An origin travels with every request (into
    /// the exchange, each of its actions, the driver's calls); as a struct of nine fields each copy cost a
    /// retain per string, about 40 per request (scripts/instructions, bench row 6).
    private struct Fields: Sendable, Equatable {
        let scheme: String
        let authority: HostPort
        let url: String
        var provider = ""
        /// nil: not written, `replace` (issue 31: for a provider's token as for a static secret, logged). Before
        /// `client_credential` an origin with a provider kept the client's own `Authorization` by default.
        var clientAuthorization: ClientAuthorizationPolicy? = nil
        /// The static secret, for an origin without a provider.
        var secret: SecretSource? = nil
        /// `header = NAME: TEMPLATE` lines; empty: `Authorization: Bearer` (or DPoP).
        var headers: [CredentialHeader] = []
        /// Lower-case names of the fields the credential goes in.
        var credentialFieldNames: [String] = ["authorization"] {
            didSet { credentialFieldBytes = credentialFieldNames.map { Array($0.utf8) } }
        }
        /// The same names as bytes, what every field name of an intercepted request is compared with (twice per
        /// field: the credential scan and the fields forwarded).
        private(set) var credentialFieldBytes: [[UInt8]] = [Array("authorization".utf8)]
        /// `placeholder_env`: the variable `env` and `exec` export with this origin's placeholder.
        var placeholderEnv: String? = nil
        /// Every origin's placeholder (filled in by the runtime from the state directory).
        var placeholders = Placeholders()
        var caFile: String? = nil
        var resource: String? = nil
        var scopes: [String]? = nil
        var tokenType = OriginTokenKind.accessToken
        var line = 0
        var file = ""
        /// `browser_requests` of the section; nil takes `[proxy]`'s (`ConfigParser` fills it in).
        var browserRequests: BrowserRequestsPolicy? = nil
        var allowedRequestOrigins: [WebOrigin] = []
        /// `[origin https://*.DOMAIN]`: `authority` holds DOMAIN, and the section covers every host below it.
        var wildcard = false
        /// For a host a wildcard section covers: that section's URL.
        var pattern: String? = nil

        init(scheme: String, authority: HostPort, url: String) {
            self.scheme = scheme
            self.authority = authority
            self.url = url
        }

        /// `other`'s keys for another origin.
        init(copying other: Fields, scheme: String, authority: HostPort, url: String) {
            self.init(scheme: scheme, authority: authority, url: url)
            provider = other.provider
            clientAuthorization = other.clientAuthorization
            caFile = other.caFile
            resource = other.resource
            scopes = other.scopes
            tokenType = other.tokenType
            line = other.line
            file = other.file
            browserRequests = other.browserRequests
            allowedRequestOrigins = other.allowedRequestOrigins
            wildcard = other.wildcard
            pattern = other.pattern
        }
    }

    @Boxed private var fields: Fields

    /// The normalised origin: lower-case scheme and host, no trailing dot, the port always explicit.
    public var scheme: String { fields.scheme }
    public var authority: HostPort { fields.authority }
    /// The provider whose tokens are attached.
    public var provider: String {
        get { fields.provider }
        _modify { yield &fields.provider }
    }
    public var clientAuthorization: ClientAuthorizationPolicy {
        get { fields.clientAuthorization ?? .replace }
        set { fields.clientAuthorization = newValue }
    }
    /// The static secret this origin gets instead of a provider's token (`secret_file`, `secret_command`,
    /// `secret`).
    public var secret: SecretSource? {
        get { fields.secret }
        _modify { yield &fields.secret }
    }
    /// What the origin's credential is.
    public var credentialKind: CredentialKind { fields.secret == nil ? .token : .secret }
    /// The fields the credential goes in (`header`), the default `Authorization` when none is configured.
    public var credentialHeaders: [CredentialHeader] {
        fields.headers.isEmpty ? [.authorizationDefault] : fields.headers
    }
    /// Whether `header` lines replace the default `Authorization` field.
    public var hasCustomHeaders: Bool { !fields.headers.isEmpty }
    public var headers: [CredentialHeader] {
        get { fields.headers }
        set {
            fields.headers = newValue
            var names: [String] = []
            for header in (newValue.isEmpty ? [.authorizationDefault] : newValue)
            where !names.contains(header.lowercasedName) {
                names.append(header.lowercasedName)
            }
            fields.credentialFieldNames = names
        }
    }
    /// Lower-case names of the fields the origin's credential goes in: a client's field of one of these names is
    /// removed when the proxy attaches its own (replaced, never doubled).
    public var credentialFieldNames: [String] { fields.credentialFieldNames }
    /// Whether the field named `name` (as received, any case) is one the credential goes in.
    public func isCredentialField(_ name: some Collection<UInt8>) -> Bool {
        let count = name.count
        // Lengths first: most names differ in length from every credential field's.
        for lower in fields.credentialFieldBytes where lower.count == count && ASCII.equalsLowercase(name, bytes: lower)
        {
            return true
        }
        return false
    }
    /// `placeholder_env`: the variable `proxyctl env` and `exec` export with this origin's placeholder.
    public var placeholderEnv: String? {
        get { fields.placeholderEnv }
        _modify { yield &fields.placeholderEnv }
    }
    /// The placeholders of every origin of the configuration (`Placeholders`), the same table in each.
    public var placeholders: Placeholders {
        get { fields.placeholders }
        _modify { yield &fields.placeholders }
    }
    /// How the credential is named in logs, metrics and the audit log: the provider, or the secret's source.
    public var credentialName: String { fields.secret?.name ?? fields.provider }
    /// PEM bundle to trust for the origin's TLS instead of the system roots.
    public var caFile: String? {
        get { fields.caFile }
        _modify { yield &fields.caFile }
    }
    /// The audience of this origin's own token (RFC 8707 resource indicator); nil uses the provider's token.
    public var resource: String? {
        get { fields.resource }
        _modify { yield &fields.resource }
    }
    /// Narrowed scopes for this origin's own token (RFC 9700 §4.10); nil uses the provider's.
    public var scopes: [String]? {
        get { fields.scopes }
        _modify { yield &fields.scopes }
    }
    /// Which token the origin gets: an access token, or the ID token (`token_type = id_token`).
    public var tokenType: OriginTokenKind {
        get { fields.tokenType }
        _modify { yield &fields.tokenType }
    }
    public var line: Int {
        get { fields.line }
        _modify { yield &fields.line }
    }
    /// The configuration file the section is in (for messages that name the fix).
    public var file: String {
        get { fields.file }
        _modify { yield &fields.file }
    }

    /// What a request made by a web page of another origin gets (`browser_requests`): the section's own value,
    /// else `[proxy]`'s, else `refuse`.
    public var browserRequests: BrowserRequestsPolicy {
        get { fields.browserRequests ?? .refuse }
        set { fields.browserRequests = newValue }
    }
    /// Whether the section set `browser_requests` itself.
    public var setsBrowserRequests: Bool { fields.browserRequests != nil }
    /// Web apps whose pages may use the token (`allowed_request_origins`).
    public var allowedRequestOrigins: [WebOrigin] {
        get { fields.allowedRequestOrigins }
        _modify { yield &fields.allowedRequestOrigins }
    }

    /// The refusal for a request whose `Sec-Fetch-Site`, `Origin` and `Referer` values say a web page of another
    /// origin made it, or nil when it may have the token (`BrowserRequests.check`; `browser_requests = allow`
    /// admits every request).
    public func browserRefusal(
        fetchSite: [ArraySlice<UInt8>], origin: [ArraySlice<UInt8>], referer: [ArraySlice<UInt8>]
    ) -> BrowserRefusal? {
        guard browserRequests == .refuse, !(fetchSite.isEmpty && origin.isEmpty) else { return nil }
        return BrowserRequests.check(
            fetchSite: fetchSite, origin: origin, referer: referer,
            own: WebOrigin(scheme: scheme, authority: authority), allowed: allowedRequestOrigins,
            section: (url, file))
    }

    /// `https://api.example.com` or `http://127.0.0.1:8000`: the default port is left out. Made once: every
    /// request to the origin uses it (a DPoP proof's `htu`, the nonce cache's key).
    public var url: String { fields.url }

    public init(scheme: String, authority: HostPort) {
        _fields = Boxed(
            wrappedValue: Fields(
                scheme: scheme, authority: authority, url: Self.url(scheme, authority, wildcard: false)))
    }

    private static func url(_ scheme: String, _ authority: HostPort, wildcard: Bool) -> String {
        let defaultPort = scheme == "https" ? 443 : 80
        let host = (wildcard ? "*." : "") + authority.hostForURL
        return authority.port == defaultPort ? "\(scheme)://\(host)" : "\(scheme)://\(host):\(authority.port)"
    }

    /// `[origin https://*.DOMAIN[:PORT]]`: every host below DOMAIN (at any depth, not DOMAIN itself), on that port.
    public init(wildcardScheme scheme: String, domain: HostPort) {
        var fields = Fields(scheme: scheme, authority: domain, url: Self.url(scheme, domain, wildcard: true))
        fields.wildcard = true
        _fields = Boxed(wrappedValue: fields)
    }

    /// Whether this is a wildcard section (`authority` is then the domain below which it protects every host).
    public var isWildcard: Bool { fields.wildcard }
    /// The wildcard section's URL when this origin is a host that section covers (`OriginTable.match`).
    public var pattern: String? { fields.pattern }

    /// Whether the wildcard section covers `host`: a host name ending in "." and its domain (RFC 6125 §6.4.3
    /// would cover one label; here every label below, as the CA's `.DOMAIN` name constraint does).
    public func covers(host: String, kind: HostPort.Kind) -> Bool {
        // A "*" in a host a client names is no host: it never reaches the CA as a name to sign.
        guard fields.wildcard, kind == .name, !host.contains("*") else { return false }
        let domain = fields.authority.host
        return host.utf8.count > domain.utf8.count + 1 && host.hasSuffix(domain)
            && host.utf8[host.utf8.index(host.utf8.endIndex, offsetBy: -(domain.utf8.count + 1))] == UInt8(ascii: ".")
    }

    /// The origin of `authority`, a host this wildcard section covers: the section's keys, its own URL, a
    /// `resource` with "*" written as the host's labels below the domain (`https://*.corp.example/` gives
    /// `https://api.corp.example/` for api.corp.example), and `pattern` naming the section.
    public func covering(_ authority: HostPort) -> OriginConfig {
        var fields = self.fields
        let labels = authority.host.dropLast(fields.authority.host.count + 1)
        fields.pattern = fields.url
        fields.wildcard = false
        fields.resource = fields.resource.map { $0.replacing("*", with: labels) }
        fields = Fields(
            copying: fields, scheme: fields.scheme, authority: authority,
            url: Self.url(fields.scheme, authority, wildcard: false))
        var origin = self
        origin._fields = Boxed(wrappedValue: fields)
        return origin
    }

    public static func == (lhs: Self, rhs: Self) -> Bool { lhs.fields == rhs.fields }

    /// Whether the proxy attaches its token to a request whose client did (or did not) send its own
    /// Authorization: the one place `client_authorization` is applied.
    public func attachesToken(clientHasAuthorization: Bool) -> Bool {
        clientAuthorization == .replace || !clientHasAuthorization
    }

    /// The token this origin gets: it never receives one obtained for another audience. A static secret is named
    /// by its source.
    public var tokenKey: TokenKey {
        if let secret = fields.secret { return TokenKey(staticSecret: secret.name) }
        return TokenKey(provider: provider, resource: resource, scopes: scopes, kind: tokenType)
    }

    /// Looks at a request's credential fields and every field value for placeholders: `field(visit)` calls `visit`
    /// with each field's name and value. `target` is searched for placeholders too.
    public func scanCredentials(
        target: some Collection<UInt8>,
        _ fields: ((_ name: ArraySlice<UInt8>, _ value: ArraySlice<UInt8>) -> Void) -> Void
    ) -> CredentialScan {
        var scan = CredentialScan()
        let placeholders = self.fields.placeholders
        if placeholders.isEmpty {
            // No placeholder anywhere (no origin has `placeholder_env`): only the credential fields matter.
            fields { name, _ in
                if !scan.clientCredential && isCredentialField(name) { scan.clientCredential = true }
            }
            return scan
        }
        let own = placeholders.entry(for: url)
        fields { name, value in
            let found = placeholders.find(in: value)
            if let found, found.origin != url, scan.foreign == nil { scan.foreign = found }
            guard isCredentialField(name) else { return }
            if let own, found == own {
                scan.placeholderUsed = true
            } else {
                scan.clientCredential = true
            }
        }
        if scan.foreign == nil, let found = placeholders.find(in: target), found.origin != url { scan.foreign = found }
        return scan
    }

    /// The refusal of a request whose fields `scan` describes, if it is refused: a placeholder of another origin
    /// (wherever it is), or a credential of the client's own with `client_credential = refuse`.
    public func credentialRefusal(_ scan: CredentialScan) -> String? {
        if let foreign = scan.foreign {
            return
                "the request carries the placeholder of \(foreign.origin) (\(foreign.variable)), which is not sent to \(url)"
        }
        if scan.clientCredential && clientAuthorization == .refuse {
            let names = credentialHeaders.map(\.name).joined(separator: ", ")
            return "the request brings its own \(names); client_credential = refuse in [origin \(url)] of \(file)"
        }
        return nil
    }

    public static let keys = [
        "provider", "client_authorization", "client_credential", "ca_file", "resource", "scopes", "token_type",
        "browser_requests", "allowed_request_origins", "secret_file", "secret_command", "secret_ttl", "secret",
        "header", "placeholder_env",
    ]

    /// Parses the section argument: scheme, host and optional port; nothing else. `https://*.DOMAIN[:PORT]` is a
    /// wildcard section (`OriginPattern`).
    public static func parseURL(_ text: String) -> Result<OriginConfig, ValueError> {
        guard case .success(let url) = AbsoluteURL.parse(text) else {
            return .failure(
                "expected [origin https://HOST] or [origin https://HOST:PORT], such as [origin https://api.example.com]"
            )
        }
        var path = url.pathAndQuery
        if text.hasSuffix("/") == false && path == "/" { path = "" }
        guard path.isEmpty || path == "/" else {
            return .failure("an origin is a scheme, a host and a port: remove the path \"\(INIDocument.clip(path))\"")
        }
        if url.authority.host.contains("*") {
            switch OriginPattern.domain(of: url.authority) {
            case .failure(let error): return .failure(error)
            case .success(let domain):
                guard url.scheme == "https" else {
                    return .failure("a wildcard origin is https:// (http:// origins are single loopback hosts)")
                }
                return .success(OriginConfig(wildcardScheme: url.scheme, domain: domain))
            }
        }
        if url.scheme == "https" && url.authority.kind != .name {
            return .failure("an https origin must be named by a host name: the local CA never signs for IP addresses")
        }
        if url.scheme == "http" {
            let host = url.authority.host
            let loopback = host == "localhost" || (IPAddress.parse(host)?.isLoopback ?? false)
            if !loopback {
                return .failure(
                    "http:// origins are accepted only on loopback hosts (a token is never sent in cleartext over a network); use https://"
                )
            }
        }
        return .success(OriginConfig(scheme: url.scheme, authority: url.authority))
    }
}

/// The protected origins, looked up by scheme and authority after normalisation (lower case, no trailing
/// dot, explicit port). Lookups are exact: no subdomains, no other ports, no prefixes or suffixes.
public struct OriginTable: Sendable, Equatable {
    private var byKey: [Key: OriginConfig] = [:]
    /// Wildcard sections, the longest domain first: a more specific one wins (an exact section wins over all).
    private var wildcards: [OriginConfig] = []
    public private(set) var origins: [OriginConfig] = []

    public init(_ origins: [OriginConfig] = []) {
        for origin in origins {
            if origin.isWildcard {
                wildcards.append(origin)
            } else {
                byKey[Self.key(origin.scheme, origin.authority)] = origin
            }
            self.origins.append(origin)
        }
        wildcards.sort { $0.authority.host.utf8.count > $1.authority.host.utf8.count }
    }

    /// Scheme and normalised authority (and whether it is a wildcard's domain): what makes two sections the same
    /// origin.
    struct Key: Hashable {
        let scheme: String
        let authority: HostPort
        var wildcard = false
    }

    static func key(_ scheme: String, _ authority: HostPort) -> Key {
        Key(scheme: scheme, authority: authority)
    }

    static func key(of origin: OriginConfig) -> Key {
        Key(scheme: origin.scheme, authority: origin.authority, wildcard: origin.isWildcard)
    }

    public var isEmpty: Bool { origins.isEmpty }

    /// The protected origin for `scheme` and `authority`, if any: an exact section, else the origin of that host
    /// under the most specific wildcard section that covers it (same scheme and port).
    public func match(scheme: String, authority: HostPort) -> OriginConfig? {
        if let exact = byKey[Self.key(scheme, authority)] { return exact }
        if wildcards.isEmpty { return nil }
        for wildcard in wildcards
        where wildcard.scheme == scheme && wildcard.authority.port == authority.port
            && wildcard.covers(host: authority.host, kind: authority.kind)
        {
            return wildcard.covering(authority)
        }
        return nil
    }

    /// The wildcard section that covers the origin `url` (a host it served), when it is not a section itself.
    public func wildcard(covering url: String) -> OriginConfig? {
        guard case .success(let parsed) = AbsoluteURL.parse(url),
            byKey[Self.key(parsed.scheme, parsed.authority)] == nil
        else { return nil }
        return match(scheme: parsed.scheme, authority: parsed.authority)?.pattern.flatMap { pattern in
            wildcards.first { $0.url == pattern }
        }
    }

    /// Host names the local CA must cover: those of the https origins, and `.DOMAIN` (every name below DOMAIN, as
    /// a name constraint writes it) for a wildcard section.
    public var tlsHosts: [String] {
        Array(Set(origins.filter { $0.scheme == "https" }.map { ($0.isWildcard ? "." : "") + $0.authority.host }))
            .sorted()
    }
}

extension ConfigParser {
    func applyOrigin(
        _ section: INIDocument.Section, file: String, into origin: inout OriginConfig, errors: inout [ConfigError]
    ) {
        var headerEntries: [INIDocument.Entry] = []
        var secretEntries: [INIDocument.Entry] = []
        var ttl: Int? = nil
        for entry in section.entries {
            func fail(_ message: String) {
                errors.append(
                    ConfigError(file: file, line: entry.line, section: section.label, key: entry.key, message))
            }
            switch entry.key {
            case "secret_file":
                guard !entry.value.isEmpty else {
                    fail("expected the path of a file readable by you alone (chmod 600) that holds the secret")
                    continue
                }
                secretEntries.append(entry)
                origin.secret = .file(resolvePath(entry.value))
            case "secret_command":
                let words = entry.value.split(separator: " ").map(String.init)
                guard !words.isEmpty else {
                    fail("expected a command that prints the secret on its first line, such as vault-key api")
                    continue
                }
                secretEntries.append(entry)
                origin.secret = .command(words, ttl: 0)
            case "secret":
                guard !entry.value.isEmpty, entry.value.utf8.allSatisfy(ASCII.isTchar) else {
                    fail(
                        "expected the name a secret was stored under with proxyctl secret set NAME (letters, digits, - and _)"
                    )
                    continue
                }
                secretEntries.append(entry)
                origin.secret = .stored(entry.value)
            case "secret_ttl":
                guard let value = ConfigValue.duration(entry.value), value >= 1000 else {
                    fail(
                        "expected a duration of a second or more, such as 5m or 1h, got \"\(INIDocument.clip(entry.value))\""
                    )
                    continue
                }
                ttl = value / 1000
            case "header":
                headerEntries.append(entry)
            case "placeholder_env":
                let bytes = Array(entry.value.utf8)
                guard let first = bytes.first, !ASCII.isDigit(first),
                    bytes.allSatisfy({
                        ASCII.isDigit($0) || $0 == UInt8(ascii: "_") || ($0 | 0x20 >= 0x61 && $0 | 0x20 <= 0x7A)
                    })
                else {
                    fail("expected an environment variable name, such as OPENAI_API_KEY")
                    continue
                }
                origin.placeholderEnv = entry.value
            case "client_credential":
                guard let policy = ClientAuthorizationPolicy(rawValue: entry.value.lowercased()) else {
                    fail("expected replace, keep or refuse, got \"\(INIDocument.clip(entry.value))\"")
                    continue
                }
                origin.clientAuthorization = policy
            case "provider":
                guard !entry.value.isEmpty else {
                    fail("expected the name of a [provider NAME] section")
                    continue
                }
                origin.provider = entry.value
            case "client_authorization":
                guard let policy = ClientAuthorizationPolicy(rawValue: entry.value.lowercased()) else {
                    fail("expected keep or replace, got \"\(INIDocument.clip(entry.value))\"")
                    continue
                }
                origin.clientAuthorization = policy
            case "ca_file":
                guard !entry.value.isEmpty else {
                    fail("expected the path of a PEM file of CA certificates")
                    continue
                }
                origin.caFile = resolvePath(entry.value)
            case "resource":
                // RFC 8707 §2: an absolute URI without a fragment.
                guard entry.value.contains("://"), !entry.value.contains("#"), !entry.value.contains(" ") else {
                    fail(
                        "expected one absolute URI without a fragment (RFC 8707), such as https://api.example.com/, got \"\(INIDocument.clip(entry.value))\""
                    )
                    continue
                }
                if entry.value.contains("*") {
                    // A wildcard's resource names each host's: "*" stands for the host's labels below the domain.
                    guard origin.isWildcard, entry.value.filter({ $0 == "*" }).count == 1 else {
                        fail(
                            origin.isWildcard
                                ? "expected one \"*\" standing for the host's labels, such as https://*.corp.example/"
                                : "\"*\" is for the resource of a wildcard origin ([origin https://*.DOMAIN])")
                        continue
                    }
                }
                origin.resource = entry.value
            case "scopes":
                var scopes: [String] = []
                for scope in entry.value.split(whereSeparator: { $0 == " " || $0 == "," })
                where !scopes.contains(String(scope)) {
                    scopes.append(String(scope))
                }
                guard !scopes.isEmpty else {
                    fail("expected the scopes this origin's token needs, such as scopes = api.read")
                    continue
                }
                origin.scopes = scopes
            case "token_type":
                guard let kind = OriginTokenKind(rawValue: entry.value.lowercased()) else {
                    fail("expected access_token or id_token, got \"\(INIDocument.clip(entry.value))\"")
                    continue
                }
                origin.tokenType = kind
            case "browser_requests":
                guard let policy = BrowserRequestsPolicy(rawValue: entry.value.lowercased()) else {
                    fail("expected refuse or allow, got \"\(INIDocument.clip(entry.value))\"")
                    continue
                }
                origin.browserRequests = policy
            case "allowed_request_origins":
                var allowed: [WebOrigin] = []
                for item in entry.value.split(whereSeparator: { $0 == " " || $0 == "," }) {
                    guard let parsed = WebOrigin.parse(item.utf8, allowTrailingSlash: true) else {
                        fail(
                            "expected web origins (a scheme, a host and a port, no path) separated by commas, such as http://localhost:3000, got \"\(INIDocument.clip(String(item)))\""
                        )
                        continue
                    }
                    if !allowed.contains(parsed) { allowed.append(parsed) }
                }
                origin.allowedRequestOrigins = allowed
            default:
                fail(KeySuggestion.message(for: entry.key, among: OriginConfig.keys))
            }
        }
        let hasProvider = section.entries.contains(where: { $0.key == "provider" })
        if secretEntries.count > 1 {
            let entry = secretEntries[1]
            errors.append(
                ConfigError(
                    file: file, line: entry.line, section: section.label, key: entry.key,
                    "an origin has one secret: give one of secret_file, secret_command and secret (\(secretEntries[0].key) is on line \(secretEntries[0].line))"
                ))
        }
        if hasProvider, let entry = secretEntries.first {
            errors.append(
                ConfigError(
                    file: file, line: entry.line, section: section.label, key: entry.key,
                    "an origin has either provider = NAME (OAuth tokens) or a secret, not both"))
        }
        if let ttl {
            if case .command(let words, _) = origin.secret {
                origin.secret = .command(words, ttl: ttl)
            } else {
                let line = section.entries.first { $0.key == "secret_ttl" }?.line ?? section.line
                errors.append(
                    ConfigError(
                        file: file, line: line, section: section.label, key: "secret_ttl",
                        "secret_ttl is how long the output of secret_command is kept: it needs secret_command"))
            }
        } else if case .command(let words, 0) = origin.secret {
            origin.secret = .command(words, ttl: 300)
        }
        var headers: [CredentialHeader] = []
        for entry in headerEntries {
            switch CredentialHeader.parse(entry.value, kind: origin.credentialKind, resolvePath: resolvePath) {
            case .success(let header):
                if let twice = headers.first(where: { $0.lowercasedName == header.lowercasedName }) {
                    errors.append(
                        ConfigError(
                            file: file, line: entry.line, section: section.label, key: "header",
                            "\(twice.name) is given twice; one header line per field"))
                    continue
                }
                headers.append(header)
            case .failure(let error):
                errors.append(
                    ConfigError(file: file, line: entry.line, section: section.label, key: "header", error.message))
            }
        }
        if !headers.isEmpty {
            if !headers.contains(where: \.usesCredential) {
                errors.append(
                    ConfigError(
                        file: file, line: headerEntries[0].line, section: section.label, key: "header",
                        origin.credentialKind == .secret
                            ? "no header holds the secret: write {secret} or {basic:USER} in one"
                            : "no header holds the token: write {token} or {basic:USER} in one"))
            }
            origin.headers = headers
        }
        if origin.provider.isEmpty && !hasProvider && secretEntries.isEmpty {
            errors.append(
                ConfigError(
                    file: file, line: section.line, section: section.label, key: "provider",
                    "missing; every origin needs the provider whose tokens it gets, or a secret (secret_file, secret_command or secret)"
                ))
        }
        if origin.secret != nil,
            let entry = section.entries.first(where: {
                ["resource", "scopes", "token_type"].contains($0.key)
            })
        {
            errors.append(
                ConfigError(
                    file: file, line: entry.line, section: section.label, key: entry.key,
                    "\(entry.key) is about a provider's tokens; this origin has a static secret"))
        }
        if origin.tokenType == .idToken && (origin.resource != nil || origin.scopes != nil) {
            let line = section.entries.first { $0.key == "token_type" }?.line ?? section.line
            errors.append(
                ConfigError(
                    file: file, line: line, section: section.label, key: "token_type",
                    "an ID token's audience is the client (OpenID Connect Core §2): remove resource and scopes, or use token_type = access_token"
                ))
        }
    }
}

/// `[origin https://*.DOMAIN]`: the wildcard sections' host pattern.
public enum OriginPattern {
    /// DOMAIN of a `*.DOMAIN` host: "*" is the whole leftmost label and appears once; DOMAIN is a host name (not an
    /// address) of at least two labels, so that `*.com` or `*.internal` never makes the local CA sign for a whole
    /// top-level domain.
    public static func domain(of authority: HostPort) -> Result<HostPort, ValueError> {
        let host = authority.host
        guard host.hasPrefix("*."), !host.dropFirst(2).contains("*") else {
            return .failure(
                "a wildcard origin is written https://*.DOMAIN (the whole leftmost label, once), such as [origin https://*.corp.example]"
            )
        }
        let rest = String(host.dropFirst(2))
        guard case .success(let domain) = HostPort.parse(Substring(rest), defaultPort: authority.port),
            domain.kind == .name, !domain.host.hasPrefix("."), !domain.host.contains("..")
        else {
            return .failure("a wildcard origin's domain must be a host name, such as https://*.corp.example")
        }
        guard domain.host.split(separator: ".").count >= 2 else {
            return .failure(
                "a wildcard below a top-level domain (*.\(domain.host)) would cover every site in it; name a domain of yours, such as https://*.corp.example"
            )
        }
        return .success(HostPort(host: domain.host, port: authority.port, kind: .name))
    }
}
