import Dispatch
import ProxyCore
import ProxyOAuth
import Synchronization

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

enum StatusCommand {
    static let spec = CommandSpec(
        name: "status",
        abstract: "Show whether you are signed in, as whom, and the state of the tokens.",
        discussion: """
            Exit code 0 when every provider shown is usable: a refresh token is held (proxyctl renews the access \
            token), a machine grant is configured, or an access token is still valid where the provider gave no \
            refresh token. 1 when a sign-in is needed: no tokens, an expired access token without a refresh token, \
            or a refresh token the provider refused; the last even while the access token has time left, since \
            origins may refuse it already and every request will once it expires (status says until when). \
            Scripts can test `proxyctl status NAME >/dev/null || proxyctl login NAME`; --json has the details \
            (signed_in, access_token_expires_at, refresh_refused).
            """,
        arguments: [ArgumentSpec(name: "provider", help: "Show only this provider (default: all configured).")],
        options: [AuthEnvironment.configOption, .flag("json", help: "Print JSON for scripts.")],
        run: run
    )

    static func describeIdentity(_ identity: Identity) -> String {
        var text = identity.name ?? identity.subject
        if let email = identity.email { text += " <\(email)>" }
        if identity.name != nil { text += " (sub \(identity.subject))" }
        return text
    }

    /// The origins a provider serves and the token each gets: the provider's own, the ID token, or one of
    /// their own (resource, scopes) with its expiry and the `aud` it really has. A provider that ignored the
    /// resource indicator is named as such rather than trusted.
    static func originLines(
        _ origins: [OriginConfig], tokens: TokenSet?, now: Int64, text: inout [String], object: inout JSONObject,
        seen: [String: [String]] = [:]
    ) {
        guard !origins.isEmpty else {
            text.append("  origins:       none")
            return
        }
        text.append("  origins:")
        var reports: [JSONValue] = []
        for origin in origins {
            let key = origin.tokenKey
            var report = JSONObject([("origin", .string(origin.url))])
            var line = "    \(origin.url): "
            switch (key.isProviderDefault, key.kind) {
            case (true, _):
                report["token"] = "provider"
                line += "the provider's access token"
            case (false, .idToken):
                report["token"] = "id_token"
                line += "the ID token"
            case (false, .accessToken):
                report["token"] = "own"
                var wanted: [String] = []
                if let resource = key.resource {
                    wanted.append("resource \(resource)")
                    report["resource"] = .string(resource)
                }
                if let scopes = key.scopes {
                    wanted.append("scopes \(scopes.joined(separator: " "))")
                    report["scopes"] = .array(scopes.map { .string($0) })
                }
                line += "its own token (\(wanted.joined(separator: ", ")))"
            }
            if !key.isProviderDefault {
                if let view = tokens?.view(for: key), !view.accessToken.isEmpty {
                    if let expiresAt = view.expiresAt {
                        line += view.isExpired(at: now) ? ", expired " : ", valid until "
                        line += HumanTime.describe(expiresAt, now: now)
                        report["expires_at"] = .int(expiresAt)
                    }
                    let audience = Self.audience(of: view.accessToken)
                    if let audience {
                        report["aud"] = .array(audience.map { .string($0) })
                        line += "; aud \(audience.joined(separator: " "))"
                        if let resource = key.resource {
                            let honoured = audience.contains(resource)
                            report["resource_honoured"] = .bool(honoured)
                            if !honoured {
                                line +=
                                    " (the provider ignored the resource indicator: this token is not limited to \(resource))"
                            }
                        }
                    } else if key.kind == .accessToken {
                        line += "; aud unknown (an opaque token)"
                    }
                } else {
                    line += ", not obtained yet (the first request gets it)"
                    report["obtained"] = false
                }
            }
            text.append(line)
            if origin.isWildcard {
                // The hosts below the domain serves have intercepted (running ones' records, and the state
                // directory's `SeenHosts` across restarts).
                let hosts = seen[origin.url] ?? []
                text.append(
                    "      hosts seen: "
                        + (hosts.isEmpty ? "none yet" : hosts.joined(separator: ", ")))
                report["hosts_seen"] = .array(hosts.map { .string($0) })
            }
            reports.append(.object(report))
        }
        object["origin_tokens"] = .array(reports)
    }

    /// The `aud` of a JWT access token (a string or an array), without checking its signature: this only
    /// reports what the provider issued. Nil for an opaque token.
    static func audience(of token: String) -> [String]? {
        guard case .success(let jwt) = JWT.parse(token), let aud = jwt.claims["aud"] else { return nil }
        if let single = aud.string { return [single] }
        return aud.stringList
    }

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let loader = ConfigLoader(environment: context.environment)
        let location = loader.locate(flag: arguments.value("config"))
        let configuration = try loader.load(location)
        var providers = configuration.providers
        if let name = arguments.positionals.first {
            providers = [try AuthEnvironment.pick(configuration, name: name, location: location, command: "status")]
        }
        guard
            let stateDirectory = configuration.proxy.stateDir
                ?? TokenStore.defaultStateDirectory(environment: context.environment)
        else { throw CommandFailure(message: "no state directory: set HOME, XDG_STATE_HOME or state_dir in [proxy]") }
        let store = TokenStore(stateDirectory: stateDirectory)
        let now = Int64(Date().timeIntervalSince1970)
        var allUsable = !providers.isEmpty
        var reports: [JSONValue] = []
        var text: [String] = []
        // Hosts each wildcard origin covered, as the running serves recorded them.
        var seen: [String: [String]] = [:]
        for state in ServeState.allRunning(stateDirectory: stateDirectory) {
            for url in state.origins.keys {
                guard let wildcard = configuration.origins.wildcard(covering: url) else { continue }
                if !(seen[wildcard.url] ?? []).contains(url) { seen[wildcard.url, default: []].append(url) }
            }
        }
        // And those kept in the state directory, served by earlier serves (a host since given a section of its own
        // is not listed under the wildcard).
        let kept = SeenHosts.load(stateDirectory: stateDirectory)
        for wildcard in configuration.origins.origins where wildcard.isWildcard {
            for url in kept.hosts(of: wildcard.url)
            where configuration.origins.wildcard(covering: url)?.url == wildcard.url
                && !(seen[wildcard.url] ?? []).contains(url)
            {
                seen[wildcard.url, default: []].append(url)
            }
        }
        for key in seen.keys { seen[key]?.sort() }
        if providers.isEmpty {
            text.append(
                "No provider is configured. Add a [provider NAME] section to \(AuthEnvironment.describe(location)).")
        }
        for provider in providers {
            let tokens: TokenSet?
            var problem: String? = nil
            do {
                tokens = try store.load(provider.name)
            } catch {
                tokens = nil
                problem = "\(error)"
            }
            let matches = tokens.map { $0.issuer == provider.issuer && $0.clientID == provider.clientID } ?? false
            // A machine grant needs nobody: it is usable whenever its client can authenticate.
            let machine = !provider.needsSignIn
            // The provider refused the refresh token (and proxyctl dropped it): the access token may still look
            // valid, but nothing can renew it, and origins may refuse it already.
            let refused =
                tokens.map {
                    $0.refreshToken == nil && !$0.refreshTokenInSecretService
                        && $0.lastRefresh?.outcome == AuthError.reauthenticate(reason: "").category
                } ?? false
            let usable =
                machine
                || (matches && !refused && tokens.map { !$0.isExpired(at: now) || $0.refreshToken != nil } ?? false)
            allUsable = allUsable && usable
            var object = JSONObject()
            object["provider"] = .string(provider.name)
            object["issuer"] = .string(provider.issuer)
            object["grant"] = .string(provider.grant.rawValue)
            object["signed_in"] = .bool(usable)
            if !machine { object["refresh_refused"] = .bool(refused) }
            let served = configuration.origins.origins.filter { $0.provider == provider.name }
            object["origins"] = .array(served.map { .string($0.url) })
            guard let tokens, !(machine && !matches) else {
                if machine {
                    text.append(
                        "\(provider.name): grant = \(provider.grant.rawValue), no sign-in needed; no token obtained yet (proxyctl token \(provider.name) or the first request gets one)"
                    )
                    text.append("  issuer:        \(provider.issuer)")
                } else {
                    text.append("\(provider.name): not signed in (run: proxyctl login \(provider.name))")
                }
                if let problem { text.append("  problem:       \(problem)") }
                if let problem { object["problem"] = .string(problem) }
                originLines(served, tokens: nil, now: now, text: &text, object: &object, seen: seen)
                reports.append(.object(object))
                continue
            }
            let dropped =
                tokens.lastRefresh?.reason?.contains("refused the refresh token") == true
                ? "the provider refused the refresh token" : "the refresh token was dropped after the last refresh"
            let state = usable ? "signed in" : refused ? "sign-in needed (\(dropped))" : "sign-in needed"
            if let identity = tokens.identity {
                text.append("\(provider.name): \(state) as \(describeIdentity(identity))")
                var who = JSONObject()
                who["sub"] = .string(identity.subject)
                if let name = identity.name { who["name"] = .string(name) }
                if let email = identity.email { who["email"] = .string(email) }
                object["identity"] = .object(who)
            } else {
                text.append("\(provider.name): \(state)")
            }
            if !matches {
                text.append(
                    "  problem:       the tokens were issued for another issuer or client; run: proxyctl login \(provider.name)"
                )
            }
            text.append("  issuer:        \(provider.issuer)")
            if let scope = tokens.scope {
                text.append("  scopes:        \(scope)")
                object["scopes"] = .array(scope.split(separator: " ").map { .string(String($0)) })
            }
            text.append("  token type:    \(tokens.tokenType)")
            object["token_type"] = .string(tokens.tokenType)
            if let thumbprint = tokens.dpopThumbprint {
                // RFC 7638 thumbprint of the key the tokens are bound to.
                text.append("  DPoP key:      \(thumbprint)")
                object["dpop_jkt"] = .string(thumbprint)
            }
            if let expiresAt = tokens.expiresAt {
                let expired = tokens.isExpired(at: now)
                var line =
                    "  access token:  \(expired ? "expired" : "valid until") \(HumanTime.describe(expiresAt, now: now))"
                if !expired && !machine && tokens.refreshToken == nil && !tokens.refreshTokenInSecretService {
                    line +=
                        refused
                        ? "; nothing can renew it: origins may refuse it already, and every request will after that"
                        : "; there is no refresh token, so sign in again then"
                }
                text.append(line)
                object["access_token_expires_at"] = .int(expiresAt)
            } else {
                text.append("  access token:  no expiry given")
            }
            object["access_token_expired"] = .bool(tokens.isExpired(at: now))
            let kept = tokens.refreshTokenInSecretService ? " (in the Secret Service)" : ""
            if tokens.refreshTokenInSecretService && tokens.refreshToken == nil {
                text.append("  refresh token: in the Secret Service, which cannot be read now")
            } else {
                text.append("  refresh token: \(tokens.refreshToken != nil ? "held\(kept)" : "none")")
            }
            object["refresh_token"] = .bool(tokens.refreshToken != nil)
            object["refresh_token_store"] = .string(tokens.refreshTokenInSecretService ? "secret-service" : "file")
            if let record = tokens.lastRefresh {
                let outcome = record.outcome == "ok" ? "ok" : "failed (\(record.outcome): \(record.reason ?? "-"))"
                text.append("  last refresh:  \(outcome), \(HumanTime.describe(record.at, now: now))")
                var refresh = JSONObject()
                refresh["at"] = .int(record.at)
                refresh["outcome"] = .string(record.outcome)
                if let reason = record.reason { refresh["reason"] = .string(reason) }
                object["last_refresh"] = .object(refresh)
            }
            if machine { text.append("  grant:         \(provider.grant.rawValue) (no sign-in needed)") }
            originLines(served, tokens: tokens, now: now, text: &text, object: &object, seen: seen)
            if !usable { text.append("  next step:     proxyctl login \(provider.name)") }
            reports.append(.object(object))
        }
        if configuration.proxy.tokenStore == .secretService {
            let fallback = ConfigLoader.secretStoreFallback
            text.append("")
            text.append(
                fallback.map { "token_store = secret-service: not available (\($0)); the 0600 files are used" }
                    ?? "token_store = secret-service: refresh tokens and DPoP keys are kept in the Secret Service")
        }
        let serving = ServeState.running(stateDirectory: stateDirectory)
        if let serving {
            text.append("")
            text.append(
                "proxyctl serve is running (pid \(serving.pid), listening on http://\(serving.listen), started \(HumanTime.describe(serving.startedAt, now: now)))"
            )
            for (url, counts) in serving.origins.sorted(by: { $0.key < $1.key }) {
                var parts = ["\(counts.requests) request(s)", "token attached \(counts.tokenAttached)"]
                if counts.clientAuthorizationKept > 0 {
                    parts.append("client's own Authorization kept \(counts.clientAuthorizationKept)")
                }
                if counts.refreshed > 0 { parts.append("refreshed and replayed \(counts.refreshed)") }
                if counts.nonceRetried > 0 { parts.append("DPoP nonce retries \(counts.nonceRetried)") }
                if counts.stepUps > 0 { parts.append("step-ups \(counts.stepUps)") }
                if counts.answeredByProxy > 0 { parts.append("answered by the proxy \(counts.answeredByProxy)") }
                text.append("  \(url): \(parts.joined(separator: ", "))")
            }
        }
        let stepUps = StepUpStore(stateDirectory: stateDirectory).load().filter { pending in
            providers.contains { $0.name == pending.provider }
        }
        if !stepUps.isEmpty {
            text.append("")
            text.append("Pending step-ups (an origin asked for a stronger sign-in or a wider scope):")
            for pending in stepUps {
                let wanted = pending.requirement
                text.append(
                    "  \(pending.origin)\(wanted.isEmpty ? "" : " (\(wanted))"), \(HumanTime.describe(pending.at, now: now)): run \(pending.command)"
                )
            }
        }
        if arguments.flag("json") {
            var document = JSONObject([("providers", .array(reports))])
            if let serving { document["serve"] = serving.json }
            document["pending_step_ups"] = .array(
                stepUps.map { pending in
                    var object = JSONObject([
                        ("origin", .string(pending.origin)), ("provider", .string(pending.provider)),
                    ])
                    if let scope = pending.scope { object["scope"] = .string(scope) }
                    if let acr = pending.acrValues { object["acr_values"] = .string(acr) }
                    if let maxAge = pending.maxAge { object["max_age"] = .int(Int64(maxAge)) }
                    object["at"] = .int(pending.at)
                    object["command"] = .string(pending.command)
                    return .object(object)
                })
            context.out(JSON.serialize(.object(document)))
        } else {
            context.out(text.joined(separator: "\n"))
        }
        return allUsable ? ExitCode.success : ExitCode.failure
    }
}

enum TokenCommand {
    static let spec = CommandSpec(
        name: "token",
        abstract: "Print a fresh access token, for HTTP stacks that cannot use the proxy.",
        discussion: """
            Refreshes the token first when needed. The token is a secret: anything that receives it can use \
            it until it expires, and programs often log what they are given.
            A refresh is waited for until the provider answers: its answer holds the new refresh token. \
            SIGINT and SIGTERM during a refresh stop the command once the answer is stored, within \
            shutdown_grace; a second signal stops it at once.
            With grant = client_credentials or token_exchange no login is needed: the grant runs when the \
            stored token is missing or about to expire. --origin prints the token that origin gets (its own \
            resource and scopes, or the ID token).
            """,
        arguments: [AuthEnvironment.providerArgument],
        options: [
            AuthEnvironment.configOption,
            .option("origin", value: "url", help: "Print the token this [origin URL] gets instead of the provider's."),
        ],
        run: run
    )

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        var key: TokenKey? = nil
        var provided = arguments
        if let url = arguments.value("origin") {
            let loader = ConfigLoader(environment: context.environment)
            let configuration = try loader.load(loader.locate(flag: arguments.value("config")))
            guard case .success(let parsed) = OriginConfig.parseURL(url),
                let origin = configuration.origins.match(scheme: parsed.scheme, authority: parsed.authority)
            else {
                throw CommandFailure(
                    message:
                        "no [origin \(url)] in the configuration; configured: \(configuration.origins.origins.map(\.url).joined(separator: ", "))"
                )
            }
            if let named = arguments.positionals.first, named != origin.provider {
                throw CommandFailure(
                    message: "[origin \(origin.url)] gets its tokens from \(origin.provider), not \(named)")
            }
            key = origin.tokenKey
            provided.positionals = [origin.provider]
        }
        let environment = try AuthEnvironment.load(provided, context, command: "token")
        defer { environment.loopThread.stop() }
        try environment.loadDPoPKey()
        try environment.prepareClientAuthentication()
        let manager = environment.manager()
        let tokenKey = key ?? manager.defaultKey
        let signals = RefreshSignals(
            gate: manager.gate, grace: environment.configuration.proxy.shutdownGrace, context: context)
        let tokens: TokenSet
        do {
            let slow = slowRefreshNote(manager, environment.provider, context)
            defer { slow.cancel() }
            // No time limit of our own: the refresh's answer holds the new refresh token (the request itself
            // gives up after TokenManager.refreshRequestLimit).
            tokens = try runBlocking { try await manager.currentTokens(for: tokenKey, waitingAtMost: .some(nil)) }
            try keepUnsaved(manager, environment.provider, context)
        } catch let error as AuthError {
            signals.finish()
            throw error.commandFailure
        }
        signals.finish()
        let what = tokenKey.kind == .idToken ? "ID token" : "access token"
        context.err(
            "proxyctl: printing the \(tokenKey.isProviderDefault ? environment.provider.name : tokenKey.description) \(what); it is a secret, and a program handed it may log it"
        )
        if tokens.tokenType == "DPoP" {
            context.err(
                "proxyctl: this is a DPoP-bound token: it is accepted only with a proof signed by proxyctl's key")
        }
        context.out(tokens.accessToken)
        return ExitCode.success
    }
}

extension TokenCommand {
    /// Says why the command is still waiting once a refresh has been out at the provider for token_timeout.
    static func slowRefreshNote(
        _ manager: TokenManager, _ provider: ProviderConfig, _ context: CommandContext
    ) -> SlowRefreshNote {
        let note = SlowRefreshNote(gate: manager.gate, timeout: provider.tokenTimeout, context: context)
        note.check(outSince: nil)
        return note
    }

    /// When the refreshed tokens could not be written (a full disk), tries again for a while: once this
    /// process exits, the rotated refresh token they hold is gone.
    static func keepUnsaved(_ manager: TokenManager, _ provider: ProviderConfig, _ context: CommandContext) throws {
        guard try runBlocking({ await manager.hasUnsavedTokens }) else { return }
        let file = manager.store.path(for: provider.name)
        context.err("proxyctl: the refreshed tokens cannot be written to \(file); free space there; retrying for 60s")
        let deadline = Date().addingTimeInterval(60)
        while Date() < deadline {
            if try runBlocking({ await manager.saveUnsaved() }) { return }
            sleep(1)
        }
        throw AuthError.storage(
            reason:
                "the refreshed tokens could not be written to \(file), and the new refresh token is lost when proxyctl exits; free space, then run: proxyctl login \(provider.name)"
        )
    }
}

enum EndSession {
    static func url(_ endpoint: String, _ parameters: [(String, String)]) -> String {
        endpoint + (endpoint.contains("?") ? "&" : "?") + FormEncoding.encode(parameters)
    }
}

/// Watches the refresh gate every 100 ms (the request may go out late on a busy machine) and says once why
/// the command is still waiting when a refresh has been out for `timeout` milliseconds.
final class SlowRefreshNote: Sendable {
    private let gate: RefreshGate
    private let timeout: Int
    private let context: CommandContext
    private let stopped = Atomic<Bool>(false)

    init(gate: RefreshGate, timeout: Int, context: CommandContext) {
        self.gate = gate
        self.timeout = timeout
        self.context = context
    }

    func cancel() { stopped.store(true, ordering: .releasing) }

    func check(outSince: DispatchTime?) {
        guard !stopped.load(ordering: .acquiring) else { return }
        let since: DispatchTime? = gate.isIdle ? nil : outSince ?? .now()
        if let since, DispatchTime.now() >= since + .milliseconds(timeout) {
            context.err(
                "proxyctl: the provider has not answered the token refresh in \(ConfigValue.describeDuration(timeout)); waiting for its answer, which holds the new refresh token (it is not sent again)"
            )
            return
        }
        DispatchQueue.global().asyncAfter(deadline: .now() + .milliseconds(100)) { [self] in check(outSince: since) }
    }
}

enum LogoutCommand {
    static let spec = CommandSpec(
        name: "logout",
        abstract: "Revoke the refresh token where the provider allows it, and delete the local tokens.",
        discussion: """
            With --end-session the provider's own session ends too (OpenID Connect RP-Initiated Logout): the \
            browser opens the provider's end_session_endpoint from its discovery document, with the ID token as \
            id_token_hint, so that the next proxyctl login can choose another account.
            """,
        arguments: [AuthEnvironment.providerArgument],
        options: [
            AuthEnvironment.configOption,
            .flag("end-session", help: "Also end the provider's session in the browser (RP-initiated logout)."),
            .flag("no-browser", help: "With --end-session: print the URL instead of opening a browser."),
        ],
        run: run
    )

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let environment = try AuthEnvironment.load(arguments, context, command: "logout")
        defer { environment.loopThread.stop() }
        try environment.loadDPoPKey()
        let name = environment.provider.name
        guard let tokens = try? environment.store.load(name) else {
            context.err("Not signed in to \(name); nothing to do.")
            _ = try? environment.store.delete(name)
            return ExitCode.success
        }
        let client = environment.client
        let clientID = environment.provider.clientID
        let message: String =
            (try? runBlocking { () -> String in
                let metadata: ProviderMetadata
                do {
                    metadata = try await client.discover()
                } catch {
                    return
                        "Could not reach the provider to revoke the tokens (\(error)); they stay valid until they expire."
                }
                guard let endpoint = metadata.revocationEndpoint else {
                    return "The provider offers no revocation endpoint; the tokens stay valid until they expire."
                }
                let (token, hint) =
                    tokens.refreshToken.map { ($0, "refresh_token") } ?? (tokens.accessToken, "access_token")
                // RFC 7009 §2.1: a public client identifies itself with client_id.
                let response: HTTPResponse
                do {
                    response = try await client.postForm(
                        endpoint, [("token", token), ("token_type_hint", hint), ("client_id", clientID)])
                } catch {
                    return
                        "Could not revoke the \(hint.replacing("_", with: " ")) (\(error)); it stays valid until it expires."
                }
                if response.status == 200 {
                    return "Revoked the \(hint.replacing("_", with: " ")) at the provider."
                }
                let detail =
                    response.jsonObject?["error"]?.string.map {
                        OAuthErrorResponse(error: $0, description: nil).summary
                    } ?? "HTTP \(response.status)"
                return
                    "The provider did not revoke the \(hint.replacing("_", with: " ")) (\(detail)); many providers do not let public clients revoke, and it stays valid until it expires."
            }) ?? "Could not revoke the tokens."
        context.err(message)
        do {
            try environment.store.delete(name)
        } catch {
            throw CommandFailure(message: "\(error)")
        }
        context.err("Deleted the local tokens for \(name).")
        if arguments.flag("end-session") {
            try endSession(environment, idToken: tokens.idToken, arguments: arguments, context: context)
        }
        return ExitCode.success
    }

    /// RP-initiated logout (OpenID Connect RP-Initiated Logout 1.0 §2): the end_session_endpoint from
    /// discovery with `id_token_hint` and `client_id`, opened in the browser. The printed URL leaves the ID
    /// token out (it names the user); the provider then asks which session to end.
    static func endSession(
        _ environment: AuthEnvironment, idToken: String?, arguments: ParsedArguments, context: CommandContext
    ) throws {
        let client = environment.client
        let metadata: ProviderMetadata
        do {
            metadata = try runBlocking { try await client.discover() }
        } catch let error as AuthError {
            throw error.commandFailure
        }
        guard let endpoint = metadata.endSessionEndpoint else {
            throw CommandFailure(
                message:
                    "the provider's discovery document has no end_session_endpoint: it does not offer RP-initiated logout; sign out on its own pages"
            )
        }
        var parameters = [("client_id", environment.provider.clientID)]
        let shown = EndSession.url(endpoint, parameters)
        if let idToken { parameters.insert(("id_token_hint", idToken), at: 0) }
        let full = EndSession.url(endpoint, parameters)
        let launcher = BrowserLauncher(environment: context.environment, interactive: context.isInteractive)
        if let reason = launcher.unavailableReason(noBrowserFlag: arguments.flag("no-browser")) {
            context.err("No browser can be opened here: \(reason). To end the provider's session, open:")
            context.out(shown)
        } else if launcher.open(full) {
            context.err("Opened the provider's sign-out page in the browser (\(endpoint)).")
        } else {
            context.err("Could not start a browser. To end the provider's session, open:")
            context.out(shown)
        }
    }
}
