import ProxyCore
import ProxyTLS

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// Receives the authorization response on a loopback redirect URI (RFC 8252 §7.3).
public protocol RedirectReceiver: Sendable {
    /// `http://127.0.0.1:PORT/PATH`.
    var redirectURI: String { get }
    /// Starts accepting the answer carrying `state`; call before the browser opens. Requests with another
    /// state are answered with an error page and ignored.
    func expect(state: String) async
    /// Waits for the browser's request to the redirect path that carries the expected state, and returns
    /// its query. Throws `AuthError.cancelled` after `timeout` milliseconds.
    func waitForResponse(timeout: Int) async throws -> [(String, String)]
    /// How the sign-in the browser came back from ended, once it has (the tokens stored, or why not): the page
    /// the browser is shown says so. Returns when the browser has it, or after a short while without it.
    func finish(_ end: SignInEnd) async
    func close()
}

extension RedirectReceiver {
    public func finish(_ end: SignInEnd) async {}
}

/// What the browser is told when a sign-in it came back from has ended: the same as the terminal, in a page.
public enum SignInEnd: Sendable, Equatable {
    /// The tokens are stored.
    case signedIn(provider: String, account: String?)
    /// Nothing was stored: why, and the command to try again.
    case failed(provider: String, reason: String, retry: String)
    /// The login goes on with another page of the provider (an enrolment).
    case continuing(provider: String, reason: String)

    public var title: String {
        switch self {
        case .signedIn(let provider, _): "Signed in to \(provider)"
        case .failed(let provider, _, _): "Sign-in to \(provider) failed"
        case .continuing(let provider, _): "Sign-in to \(provider) continues"
        }
    }

    /// Sentences for a person, plain text.
    public var message: String {
        switch self {
        case .signedIn(let provider, let account):
            "You are signed in to \(provider)\(account.map { " as \($0)" } ?? ""), and proxyctl has stored the tokens. Go back to the terminal; you can close this tab."
        case .failed(_, let reason, let retry):
            "proxyctl could not sign you in: \(reason.prefix(1).uppercased() + reason.dropFirst()). Nothing was stored. To try again, run in the terminal: \(retry)"
        case .continuing(_, let reason):
            "\(reason) Go back to the terminal: it says what comes next."
        }
    }

    /// "Alice Liddell <alice@example.test>", else the e-mail, the name or the subject.
    public static func account(_ identity: Identity) -> String {
        switch (identity.name, identity.email) {
        case (let name?, let email?): "\(name) <\(email)>"
        case (let name?, nil): name
        case (nil, let email?): email
        case (nil, nil): identity.subject
        }
    }
}

/// Where a login talks to the person: progress and the URL to open.
public protocol LoginConsole: Sendable {
    func say(_ line: String)
    /// The device flow's code to enter (RFC 8628). The default says it line by line.
    func showDeviceCode(_ prompt: DeviceCodePrompt)
    /// The login waits for the person to finish signing in (`what`), until `deadline` (seconds since 1970).
    func waiting(for what: String, until deadline: Int64)
    /// The wait announced by `waiting` is over.
    func waitEnded()
}

/// What a person needs to finish a device-flow sign-in: where to go and the code to type. The user code is
/// meant to be shown (it is short-lived and useless without the device code, which is never shown).
public struct DeviceCodePrompt: Sendable, Equatable {
    public let provider: String
    public let verificationURI: String
    public let verificationURIComplete: String?
    public let userCode: String
    public let expiresAt: Int64

    public init(
        provider: String, verificationURI: String, verificationURIComplete: String?, userCode: String, expiresAt: Int64
    ) {
        self.provider = provider
        self.verificationURI = verificationURI
        self.verificationURIComplete = verificationURIComplete
        self.userCode = userCode
        self.expiresAt = expiresAt
    }

    /// The lines a person reads.
    public var lines: [String] {
        var lines = [
            "To sign in to \(provider), visit", "", "    \(verificationURI)", "", "and enter the code  \(userCode)",
        ]
        if let complete = verificationURIComplete { lines.append("(or open \(complete) directly)") }
        return lines
    }
}

extension LoginConsole {
    public func showDeviceCode(_ prompt: DeviceCodePrompt) {
        for line in prompt.lines { say(line) }
    }
    public func waiting(for what: String, until deadline: Int64) {}
    public func waitEnded() {}
}

/// What the person asked for on the command line.
public struct LoginOptions: Sendable, Equatable {
    public var scopes: [String]? = nil
    public var acrValues: String? = nil
    public var maxAge: Int? = nil
    public var loginHint: String? = nil
    /// Ask the provider for enrolment (`prompt=create`).
    public var create = false
    /// OpenID Connect `prompt` (Core §3.1.2.1): `login`, `select_account` or `consent`.
    public var prompt: String? = nil
    /// The resource indicators of the provider's origins (RFC 8707 §2.1): the grant covers each of them, so
    /// that refreshes can ask for a token per origin.
    public var originResources: [String] = []
    /// Some origin of the provider gets the provider's own token (`TokenKey.isProviderDefault`): the token the
    /// sign-in obtains then keeps the provider's audience instead of an origin's resource.
    public var providerTokenUsed = true

    /// The `prompt` values `proxyctl login --prompt` accepts.
    public static let promptValues = ["login", "select_account", "consent"]

    public init() {}
}

/// Builds the authorization request and checks the response: the pure parts of the code flow.
public struct AuthorizationRequest: Sendable {
    public let provider: ProviderConfig
    public let options: LoginOptions
    public let redirectURI: String
    public let state: String
    public let nonce: String
    public let pkce: PKCE
    /// With DPoP: the key's thumbprint, sent as `dpop_jkt` to bind the code to the key (RFC 9449 §10).
    public let dpopThumbprint: String?

    public init(
        provider: ProviderConfig, options: LoginOptions, redirectURI: String, pkce: PKCE = PKCE(),
        dpopThumbprint: String? = nil
    ) {
        self.provider = provider
        self.options = options
        self.redirectURI = redirectURI
        self.state = Crypto.randomToken()
        self.nonce = Crypto.randomToken()
        self.pkce = pkce
        self.dpopThumbprint = dpopThumbprint
    }

    /// The scopes to ask for: `openid` first, then the configured or requested ones; nothing is added.
    public var scopes: [String] {
        var result = ["openid"]
        for scope in options.scopes ?? provider.scopes where !result.contains(scope) { result.append(scope) }
        return result
    }

    /// The authorization request parameters (RFC 6749 §4.1.1, RFC 7636 §4.3, OpenID Connect Core §3.1.2.1).
    public var parameters: [(String, String)] {
        var parameters: [(String, String)] = [
            ("response_type", "code"), ("client_id", provider.clientID), ("redirect_uri", redirectURI),
            ("scope", scopes.joined(separator: " ")), ("state", state), ("nonce", nonce),
            ("code_challenge", pkce.challenge), ("code_challenge_method", "S256"),
        ]
        if let acr = options.acrValues ?? provider.acrValues { parameters.append(("acr_values", acr)) }
        if let maxAge = options.maxAge { parameters.append(("max_age", String(maxAge))) }
        if let hint = options.loginHint ?? provider.loginHint { parameters.append(("login_hint", hint)) }
        let prompts = (options.create ? ["create"] : []) + (options.prompt.map { [$0] } ?? [])
        if !prompts.isEmpty { parameters.append(("prompt", prompts.joined(separator: " "))) }
        if let dpopThumbprint { parameters.append(("dpop_jkt", dpopThumbprint)) }
        for resource in resources { parameters.append(("resource", resource)) }
        for (name, value) in provider.extraParameters { parameters.append((name, value)) }
        return parameters
    }

    /// The resources the grant covers (RFC 8707 §2.1): the provider's own and every origin's, so that refreshes
    /// can ask for a token per origin.
    public var resources: [String] {
        var resources = provider.resources
        for resource in options.originResources where !resources.contains(resource) { resources.append(resource) }
        return resources
    }

    /// The `resource` of the token request that ends the sign-in (the code exchange, the device code's; RFC 8707
    /// §2.2): the provider's own resources when it has any (its token is for them); else the one resource of the
    /// provider's origins when no origin uses the provider's own token (`proxyctl init --origin` writes such a
    /// configuration), so that the token is for that origin from the start; else none, the provider's token
    /// keeping its default audience (several resources in one token request would ask for one token for all of
    /// them, the opposite of a token per origin; those come from refreshes with each origin's resource).
    public var tokenResources: [String] {
        if !provider.resources.isEmpty { return provider.resources }
        guard !options.providerTokenUsed, options.originResources.count == 1 else { return [] }
        return options.originResources
    }

    /// The origin's token the sign-in's token is also (`tokenResources`' one origin resource): stored for its key
    /// too, so that the origin's first request needs no refresh.
    public var audienceKey: TokenKey? {
        guard provider.resources.isEmpty, let resource = tokenResources.first else { return nil }
        return TokenKey(provider: provider.name, resource: resource)
    }

    /// What came back to the redirect URI.
    public enum Response: Sendable, Equatable {
        case code(String)
        case error(OAuthErrorResponse)
    }

    /// Checks the redirect's query: state (already matched by the receiver, checked again), `iss` (RFC 9207),
    /// then a code or an error.
    public func check(_ query: [(String, String)], metadata: ProviderMetadata) -> Result<Response, AuthError> {
        func value(_ name: String) -> String? { query.first { $0.0 == name }?.1 }
        guard value("state") == state else {
            return .failure(.cancelled(reason: "the browser returned an answer for another sign-in (state mismatch)"))
        }
        if let iss = value("iss") {
            guard iss == metadata.issuer else {
                return .failure(
                    .configuration(
                        reason:
                            "the answer came from issuer \(AuthText.clip(iss)), not \(metadata.issuer) (RFC 9207 mix-up protection); nothing was stored"
                    ))
            }
        } else if metadata.issParameterSupported {
            return .failure(
                .configuration(reason: "the provider promises an iss parameter (RFC 9207) but the answer has none"))
        }
        if let error = value("error") {
            return .success(
                .error(
                    OAuthErrorResponse(error: error, description: value("error_description"), uri: value("error_uri"))))
        }
        guard let code = value("code"), !code.isEmpty else {
            return .failure(.cancelled(reason: "the answer carries neither a code nor an error"))
        }
        return .success(.code(code))
    }
}

/// PKCE (RFC 7636): a random verifier and its S256 challenge.
public struct PKCE: Sendable, Equatable {
    public let verifier: String
    public let challenge: String

    /// 32 random bytes: a 43-character verifier (RFC 7636 §4.1).
    public init() {
        self.init(verifier: Crypto.randomToken(bytes: 32))
    }

    /// BASE64URL(SHA256(ASCII(verifier))) (RFC 7636 §4.2).
    public init(verifier: String) {
        self.verifier = verifier
        self.challenge = Base64.urlEncode(Crypto.sha256(verifier))
    }
}

/// Runs logins for one provider and stores the result.
public struct LoginFlow: Sendable {
    public let client: ProviderClient
    public let store: TokenStore
    public let console: any LoginConsole
    public var now: @Sendable () -> Int64 = { Int64(Date().timeIntervalSince1970) }
    /// The configuration file the provider comes from, named by the hint about a redirect that does not come.
    public var configurationFile: String? = nil
    /// The command the browser's failure page names to try again (default: proxyctl login NAME).
    public var retryCommand: String? = nil

    /// How long a browser sign-in waits for the redirect before saying what usually keeps it away (milliseconds):
    /// long enough for a person to type a password and pass a second factor, short enough that nobody gives up
    /// on a silent terminal first. A third of `login_timeout` when that is less, so that the hint always comes
    /// before the login gives up.
    public static let redirectHintDelay = 45_000

    /// When the hint comes for a login that waits `loginTimeout` milliseconds.
    public static func redirectHintDelay(loginTimeout: Int) -> Int {
        let third = loginTimeout / 3
        // Whole seconds, so that the hint says "after 6s" and not "after 6666ms".
        return min(redirectHintDelay, third >= 1000 ? third / 1000 * 1000 : third)
    }

    public init(client: ProviderClient, store: TokenStore, console: any LoginConsole) {
        self.client = client
        self.store = store
        self.console = console
    }

    var provider: ProviderConfig { client.config }

    /// Authorization Code + PKCE in the browser. `openBrowser` returns why no browser could be started, or nil
    /// when one was (the URL is printed either way); without it (`--no-browser`, no display) the URL is for the
    /// user to open, and nothing says a browser opens.
    public func browserLogin(
        options: LoginOptions, receiver: any RedirectReceiver, openBrowser: (@Sendable (String) -> String?)?
    ) async throws -> TokenSet {
        let metadata = try await client.discover()
        guard let authorizationEndpoint = metadata.authorizationEndpoint else {
            throw AuthError.configuration(
                reason: "the provider has no authorization endpoint; use: proxyctl login --device \(provider.name)")
        }
        guard metadata.supportsS256 else {
            throw AuthError.configuration(
                reason: "the provider does not support PKCE with S256, which a public client needs")
        }
        var currentOptions = options
        var enrolmentTried = options.create
        if options.create && metadata.promptValues?.contains("create") != true {
            // OpenID Connect Prompt Create 1.0 §4: a provider that supports it says so; others ignore the value.
            console.say(
                "Note: the provider does not list create in prompt_values_supported, so it may show its usual sign-in page and create no account."
            )
        }
        let retry = retryCommand ?? "proxyctl login \(provider.name)"
        while true {
            let request = AuthorizationRequest(
                provider: provider, options: currentOptions, redirectURI: receiver.redirectURI,
                dpopThumbprint: await client.dpopKey?.thumbprint)
            let url = try await authorizationURL(request, endpoint: authorizationEndpoint, metadata: metadata)
            await receiver.expect(state: request.state)
            if let openBrowser {
                console.say("Opening the browser to sign in to \(provider.name). If it does not open, visit:")
                console.say("")
                console.say("    \(url)")
                console.say("")
                if let reason = openBrowser(url) {
                    console.say(
                        "No browser could be started (\(reason)); open the URL above in a browser on this machine.")
                }
            } else {
                console.say("To sign in to \(provider.name), open this URL in a browser:")
                console.say("")
                console.say("    \(url)")
                console.say("")
            }
            console.say(
                "Waiting for the provider to send the browser back to \(receiver.redirectURI)"
                    + (provider.redirectPort == 0 ? " (redirect_port = 0: a port of this login's own)." : "."))
            console.waiting(
                for: "the sign-in in the browser (the redirect to \(receiver.redirectURI))",
                until: now() + Int64(provider.loginTimeout / 1000))
            // A provider that refuses the redirect URI or the client shows its own error page and never sends
            // the browser back: say what usually causes that while the login still waits.
            let hint = Task { [console, provider, configurationFile] in
                try await Task.sleep(for: .milliseconds(Self.redirectHintDelay(loginTimeout: provider.loginTimeout)))
                for line in Self.redirectHint(
                    provider: provider, redirectURI: receiver.redirectURI, file: configurationFile)
                {
                    console.say(line)
                }
            }
            let query: [(String, String)]
            do {
                query = try await receiver.waitForResponse(timeout: provider.loginTimeout)
                hint.cancel()
                console.waitEnded()
            } catch {
                hint.cancel()
                console.waitEnded()
                throw error
            }
            switch request.check(query, metadata: metadata) {
            case .failure(let error):
                await receiver.finish(.failed(provider: provider.name, reason: error.description, retry: retry))
                throw error
            case .success(.error(let error)):
                // OpenID Connect Prompt Create 1.0: a user who is not registered can enrol, once.
                let notRegistered =
                    error.error == "access_denied"
                    && (error.description?.contains("user_not_registered") ?? false)
                if notRegistered && !enrolmentTried {
                    enrolmentTried = true
                    currentOptions.create = true
                    console.say("The provider says you are not registered yet; starting enrolment (prompt=create).")
                    await receiver.finish(
                        .continuing(
                            provider: provider.name,
                            reason: "The provider says you are not registered yet: proxyctl opens its enrolment page."
                        ))
                    continue
                }
                let failure = Self.describe(error, provider: provider)
                await receiver.finish(.failed(provider: provider.name, reason: failure.description, retry: retry))
                throw failure
            case .success(.code(let code)):
                console.say("Received the authorization code; exchanging it for tokens.")
                var parameters: [(String, String)] = [
                    ("grant_type", "authorization_code"), ("code", code), ("redirect_uri", request.redirectURI),
                    ("client_id", provider.clientID), ("code_verifier", request.pkce.verifier),
                ]
                for resource in request.tokenResources { parameters.append(("resource", resource)) }
                // The browser's page waits for this: it says signed in only once the tokens are stored.
                do {
                    let response = try await exchange(parameters, what: "the authorization code")
                    let tokens = try await store(
                        response, nonce: request.nonce, maxAge: currentOptions.maxAge, scopes: request.scopes,
                        audience: request.audienceKey)
                    await receiver.finish(
                        .signedIn(provider: provider.name, account: tokens.identity.map(SignInEnd.account)))
                    return tokens
                } catch {
                    let reason = (error as? AuthError)?.description ?? "\(error)"
                    await receiver.finish(.failed(provider: provider.name, reason: reason, retry: retry))
                    throw error
                }
            }
        }
    }

    /// What to say when the browser has not come back for a while: the two usual causes, each with the key that
    /// fixes it. `file` is the configuration file the provider is in.
    public static func redirectHint(provider: ProviderConfig, redirectURI: String, file: String?) -> [String] {
        let section = "[provider \(provider.name)]" + (file.map { " of \($0)" } ?? "")
        let waited = ConfigValue.describeDuration(redirectHintDelay(loginTimeout: provider.loginTimeout))
        let registration =
            provider.redirectPort == 0
            ? "redirect_port is 0 in \(section), so this login listens on a port of its own (\(redirectURI)) that a provider matching redirect URIs exactly does not know: set redirect_port to a port and register http://127.0.0.1:PORT\(provider.redirectPath) for the client"
            : "the redirect URI \(redirectURI) is not registered for client \(provider.clientID) exactly as written: register it at the provider, or set redirect_port in \(section) to a port that is registered"
        return [
            "No answer from the browser after \(waited). If the provider showed an error page instead of signing you in, the usual causes are:",
            "  - \(registration);",
            "  - the client id \(provider.clientID) is not the one registered at the provider: change client_id in \(section).",
            "Still waiting (login_timeout \(ConfigValue.describeDuration(provider.loginTimeout)); Ctrl-C stops).",
        ]
    }

    /// The URL to open: the request itself, or a PAR `request_uri` (RFC 9126) when pushing is required or asked.
    func authorizationURL(
        _ request: AuthorizationRequest, endpoint: String, metadata: ProviderMetadata
    ) async throws -> String {
        let usePAR: Bool
        switch provider.usePAR {
        case .always:
            guard metadata.pushedAuthorizationRequestEndpoint != nil else {
                throw AuthError.configuration(
                    reason: "use_par = always, but the provider offers no pushed authorization request endpoint")
            }
            usePAR = true
        case .never:
            if metadata.requirePushedAuthorizationRequests {
                throw AuthError.configuration(
                    reason: "the provider requires pushed authorization requests; set use_par = auto")
            }
            usePAR = false
        case .auto:
            usePAR = metadata.requirePushedAuthorizationRequests && metadata.pushedAuthorizationRequestEndpoint != nil
        }
        let separator = endpoint.contains("?") ? "&" : "?"
        guard usePAR, let parEndpoint = metadata.pushedAuthorizationRequestEndpoint else {
            return endpoint + separator + FormEncoding.encode(request.parameters)
        }
        let response = try await client.postForm(parEndpoint, request.parameters)
        guard response.status == 201 || response.status == 200, let object = response.jsonObject,
            let requestURI = object["request_uri"]?.string
        else {
            if let object = response.jsonObject, let error = object["error"]?.string {
                throw AuthError.configuration(
                    reason:
                        "the provider refused the pushed authorization request: \(OAuthErrorResponse(error: error, description: object["error_description"]?.string).summary)"
                )
            }
            throw AuthError.recoverable(
                reason: "the pushed authorization request failed (HTTP \(response.status))", retryAfter: nil)
        }
        return endpoint + separator
            + FormEncoding.encode([("client_id", provider.clientID), ("request_uri", requestURI)])
    }

    /// The device authorization grant (RFC 8628).
    public func deviceLogin(options: LoginOptions) async throws -> TokenSet {
        let metadata = try await client.discover()
        guard let endpoint = metadata.deviceAuthorizationEndpoint else {
            throw AuthError.configuration(
                reason: "the provider does not offer the device flow (no device_authorization_endpoint)")
        }
        let request = AuthorizationRequest(provider: provider, options: options, redirectURI: "")
        var parameters: [(String, String)] = [
            ("client_id", provider.clientID), ("scope", request.scopes.joined(separator: " ")),
        ]
        if let acr = options.acrValues ?? provider.acrValues { parameters.append(("acr_values", acr)) }
        for resource in request.resources { parameters.append(("resource", resource)) }
        let response = try await client.postForm(endpoint, parameters)
        guard response.status == 200, let object = response.jsonObject, let deviceCode = object["device_code"]?.string,
            let userCode = object["user_code"]?.string, let verificationURI = object["verification_uri"]?.string
        else {
            if let object = response.jsonObject, let error = object["error"]?.string {
                throw Self.describe(
                    OAuthErrorResponse(error: error, description: object["error_description"]?.string),
                    provider: provider)
            }
            throw AuthError.recoverable(
                reason: "the device authorization request failed (HTTP \(response.status))", retryAfter: nil)
        }
        let expiresIn = object["expires_in"]?.int.map(Int.init) ?? 600
        var interval = max(1, object["interval"]?.int.map(Int.init) ?? 5)
        let deadline = now() + Int64(min(expiresIn, provider.loginTimeout / 1000 + 1))
        console.showDeviceCode(
            DeviceCodePrompt(
                provider: provider.name, verificationURI: AuthText.clip(verificationURI, 300),
                verificationURIComplete: object["verification_uri_complete"]?.string.map { AuthText.clip($0, 300) },
                userCode: AuthText.clip(userCode, 40), expiresAt: now() + Int64(expiresIn)))
        console.say("Waiting for you to finish (the code expires in \(expiresIn / 60) min)...")
        console.waiting(for: "the code to be entered at \(AuthText.clip(verificationURI, 300))", until: deadline)
        defer { console.waitEnded() }
        while true {
            try await Task.sleep(for: .seconds(interval))
            let outcome = try await client.postToken(
                [
                    ("grant_type", "urn:ietf:params:oauth:grant-type:device_code"), ("device_code", deviceCode),
                    ("client_id", provider.clientID),
                ] + request.tokenResources.map { ("resource", $0) })
            switch outcome {
            case .success(let tokens):
                return try await store(
                    tokens, nonce: nil, maxAge: options.maxAge, scopes: request.scopes, audience: request.audienceKey)
            case .failure(.oauth(let error, _, _)):
                switch error.error {
                case "authorization_pending":
                    break
                case "slow_down":
                    // RFC 8628 §3.5: add 5 seconds to the interval from now on.
                    interval += 5
                case "expired_token":
                    throw AuthError.cancelled(
                        reason: "the code expired before the sign-in was finished; run the login again")
                case "access_denied":
                    throw AuthError.cancelled(reason: "the sign-in was declined")
                default:
                    throw Self.describe(error, provider: provider)
                }
            case .failure(.unavailable(let status, let retryAfter)):
                throw AuthError.recoverable(
                    reason: "the provider is unavailable (HTTP \(status))", retryAfter: retryAfter)
            case .failure(.malformed(let reason)), .failure(.unanswered(let reason)):
                throw AuthError.recoverable(reason: reason, retryAfter: nil)
            }
            if now() >= deadline {
                throw AuthError.cancelled(reason: "nobody finished the sign-in in time; run the login again")
            }
        }
    }

    func exchange(_ parameters: [(String, String)], what: String) async throws -> TokenResponse {
        switch try await client.postToken(parameters) {
        case .success(let response):
            return response
        case .failure(.oauth(let error, let status, _)):
            // glewlwyd answers a bad code or verifier with 403 invalid_code.
            if case let hint = provider.clientRefusalHint(error.error), !hint.isEmpty {
                throw AuthError.configuration(
                    reason: "the provider refused client \(provider.clientID) (\(error.summary), HTTP \(status))\(hint)"
                )
            }
            throw AuthError.cancelled(
                reason: "the provider did not accept \(what) (\(error.summary), HTTP \(status)); run the login again")
        case .failure(.unavailable(let status, let retryAfter)):
            throw AuthError.recoverable(reason: "the provider is unavailable (HTTP \(status))", retryAfter: retryAfter)
        case .failure(.malformed(let reason)), .failure(.unanswered(let reason)):
            throw AuthError.recoverable(reason: reason, retryAfter: nil)
        }
    }

    /// Validates the ID token, then replaces the stored tokens (under the provider's lock).
    /// `audience`: the origin's key the token was asked for too (`AuthorizationRequest.audienceKey`).
    func store(
        _ response: TokenResponse, nonce: String?, maxAge: Int?, scopes: [String], audience: TokenKey? = nil
    ) async throws -> TokenSet {
        guard let type = TokenEndpoint.normalizedType(response.tokenType) else {
            throw AuthError.configuration(
                reason: "the provider issued an unsupported token type \(AuthText.clip(response.tokenType, 20))")
        }
        let dpopKey = await client.dpopKey
        if dpopKey != nil && type != "DPoP" {
            // RFC 9449 §5: a provider that ignores the proof answers with a Bearer token.
            if provider.dpopRequired {
                throw AuthError.configuration(
                    reason:
                        "the provider answered a DPoP token request with a \(type) token, and dpop_required = true in [provider \(provider.name)]"
                )
            }
            console.say(
                "Warning: the provider issued a \(type) token although DPoP was asked for; using it as \(type).")
        }
        let thumbprint = type == "DPoP" ? dpopKey?.thumbprint : nil
        var identity: Identity? = nil
        if scopes.contains("openid") {
            guard let idToken = response.idToken else {
                throw AuthError.configuration(reason: "the provider returned no ID token for an openid sign-in")
            }
            let validator = IDTokenValidator(
                issuer: provider.issuer, clientID: provider.clientID, nonce: nonce, maxAge: maxAge, now: now())
            identity = try await validator.validate(idToken) { refresh in try await client.jwks(refresh: refresh) }
        }
        let issuedAt = now()
        let store = self.store
        let providerName = provider.name
        let issuer = provider.issuer
        let clientID = provider.clientID
        let finalIdentity = identity
        return try await store.withLock(providerName) {
            // A refresh killed mid-write may have left its temporary file, with a refresh token, behind.
            store.removeStaleTemporaries(providerName)
            let previous = try? store.load(providerName)
            var tokens = TokenSet(
                provider: providerName, issuer: issuer, clientID: clientID, accessToken: response.accessToken,
                tokenType: type, issuedAt: issuedAt, expiresAt: response.expiresIn.map { issuedAt + Int64($0) },
                refreshToken: response.refreshToken, idToken: response.idToken,
                scope: response.scope ?? scopes.joined(separator: " "), identity: finalIdentity,
                generation: ((previous ?? nil)?.generation ?? 0) + 1)
            tokens.dpopThumbprint = thumbprint
            if let audience {
                tokens.audienceTokens[audience.id] = TokenSet.AudienceToken(
                    accessToken: tokens.accessToken, tokenType: type, issuedAt: issuedAt, expiresAt: tokens.expiresAt,
                    scope: tokens.scope, generation: tokens.generation, dpopThumbprint: thumbprint)
            }
            try store.save(tokens)
            return tokens
        }
    }

    /// An error from the authorization or device endpoint, in plain words.
    static func describe(_ error: OAuthErrorResponse, provider: ProviderConfig) -> AuthError {
        switch error.error {
        case "access_denied":
            return .cancelled(reason: "the sign-in was declined (\(error.summary))")
        case "invalid_scope":
            return .configuration(
                reason:
                    "the provider refused the requested scopes (\(error.summary)); check scopes in [provider \(provider.name)]"
            )
        case "unauthorized_client", "invalid_client", "invalid_request", "unsupported_response_type":
            return .configuration(
                reason:
                    "the provider refused the request from client \(provider.clientID) (\(error.summary)); check the client's registration (redirect URIs, grant types, public client)"
                    + provider.clientRefusalHint(error.error)
            )
        case "login_required", "interaction_required", "consent_required", "account_selection_required":
            return .cancelled(
                reason: "the provider needs you to interact (\(error.summary)); run the login again in a browser")
        case "temporarily_unavailable", "server_error":
            return .recoverable(
                reason: "the provider could not sign you in right now (\(error.summary))", retryAfter: nil)
        default:
            return .cancelled(reason: "the provider ended the sign-in (\(error.summary))")
        }
    }
}
