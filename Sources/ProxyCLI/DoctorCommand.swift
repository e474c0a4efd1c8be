import ProxyCore
import ProxyIO
import ProxyOAuth
import ProxyTLS

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

/// `proxyctl doctor`: checks the set-up end to end and says what to fix.
enum DoctorCommand {
    static let spec = CommandSpec(
        name: "doctor",
        abstract: "Check the configuration, sign-ins, the local CA, the running proxy and this shell's variables.",
        discussion: """
            Each problem comes with the command that fixes it. Exit code 0 when everything is fine. When this \
            shell sets no proxy variable (HTTPS_PROXY), it is taken as a set-up that runs commands with proxyctl \
            exec, which sets every variable itself: the runtimes are checked with the variables exec gives its \
            command, and what only eval "$(proxyctl env)" would need is a note. Once HTTPS_PROXY is set, this \
            shell's own variables are checked, and a wrong one is a problem.
            """,
        options: [AuthEnvironment.configOption],
        run: run
    )

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        var problems = 0
        func ok(_ text: String) { context.out("  ok    \(text)") }
        func bad(_ text: String, fix: String) {
            problems += 1
            context.out("  FIX   \(text)\n        -> \(fix)")
        }
        func note(_ text: String) { context.out("  note  \(text)") }

        let loader = ConfigLoader(environment: context.environment)
        let location = loader.locate(flag: arguments.value("config"))
        context.out("Configuration")
        let configuration: Configuration
        do {
            configuration = try loader.load(location)
            if configuration.source == nil {
                bad(
                    "no configuration file\(location.path.map { " at \($0)" } ?? ""): proxyctl is a passthrough proxy only",
                    fix:
                        "proxyctl init --issuer https://YOUR-PROVIDER --client-id YOUR-CLIENT-ID --origin https://YOUR-API"
                )
            } else {
                ok("\(configuration.source!) is valid")
            }
        } catch {
            bad("\(error)", fix: "correct the file; proxyctl serve --check shows every error")
            return ExitCode.failure
        }
        guard
            let stateDirectory = configuration.proxy.stateDir
                ?? TokenStore.defaultStateDirectory(environment: context.environment)
        else {
            bad("no state directory", fix: "set HOME, XDG_STATE_HOME or state_dir in [proxy]")
            return ExitCode.failure
        }
        var info = stat()
        if stat(stateDirectory, &info) == 0 {
            if info.st_mode & 0o077 != 0 {
                bad("\(stateDirectory) is open to other users", fix: "chmod 700 \(stateDirectory)")
            } else {
                ok("state directory \(stateDirectory) is private")
            }
        } else {
            note("state directory \(stateDirectory) does not exist yet (made at the first login)")
        }

        context.out("Sign-in")
        let store = TokenStore(stateDirectory: stateDirectory)
        let now = Int64(time(nil))
        if configuration.providers.isEmpty { note("no [provider] configured: passthrough only") }
        for provider in configuration.providers {
            if !provider.needsSignIn {
                // A machine grant needs nobody: what it needs is its client credential.
                do {
                    _ = try ClientAuthentication.load(provider: provider, stateDirectory: stateDirectory)
                    ok("\(provider.name): grant = \(provider.grant.rawValue), client authentication ready")
                } catch {
                    bad("\(provider.name): \(error)", fix: "proxyctl key init \(provider.name), or client_secret_file")
                }
                continue
            }
            let tokens = try? store.load(provider.name)
            guard let tokens, tokens.issuer == provider.issuer, tokens.clientID == provider.clientID else {
                bad("\(provider.name): not signed in", fix: "proxyctl login \(provider.name)")
                continue
            }
            if tokens.isExpired(at: now) && tokens.refreshToken == nil {
                bad(
                    "\(provider.name): the access token expired and there is no refresh token",
                    fix: "proxyctl login \(provider.name)")
            } else if let record = tokens.lastRefresh, record.outcome != "ok", tokens.refreshToken == nil {
                bad(
                    "\(provider.name): the last refresh failed (\(record.reason ?? record.outcome))",
                    fix: "proxyctl login \(provider.name)")
            } else {
                ok(
                    "\(provider.name): signed in\(tokens.identity.map { " as \(StatusCommand.describeIdentity($0))" } ?? "")"
                )
            }
            if provider.tokenBinding == .dpop, tokens.tokenType == "DPoP" {
                let key = try? DPoPKey.load(stateDirectory: stateDirectory, provider: provider.name)
                if key?.thumbprint != tokens.dpopThumbprint {
                    bad(
                        "\(provider.name): the tokens are bound to a DPoP key that is not in \(DPoPKey.path(stateDirectory: stateDirectory, provider: provider.name))",
                        fix: "proxyctl login \(provider.name)")
                } else {
                    ok("\(provider.name): DPoP key \(tokens.dpopThumbprint ?? "") is present")
                }
            }
        }
        for pending in StepUpStore(stateDirectory: stateDirectory).load() {
            bad("\(pending.origin) asked for a stronger sign-in", fix: pending.command)
        }

        context.out("Local CA")
        let hosts = configuration.origins.tlsHosts
        let files = LocalCA.Files(stateDirectory: stateDirectory)
        if hosts.isEmpty {
            note("no https protected origin: no CA needed")
        } else if let ca = try? LocalCA.load(files) {
            if !ca.covers(hosts) {
                bad(
                    "the CA was made for \(ca.hosts.joined(separator: ", ")), proxy.conf protects \(hosts.joined(separator: ", "))",
                    fix: "proxyctl ca init")
            } else if ca.certificate.notAfter < now + 7 * 86400 {
                bad("the CA expires \(HumanTime.describe(ca.certificate.notAfter, now: now))", fix: "proxyctl ca init")
            } else if ca.isLegacy {
                bad(
                    "the CA's name constraints are on its root, which Java ignores (for Java programs it could vouch for any name)",
                    fix: "proxyctl ca init (a new CA whose intermediate carries them; then restart proxyctl serve)")
            } else {
                let extra = Set(ca.hosts).subtracting(hosts).sorted()
                ok(
                    "the CA covers \(extra.isEmpty ? "exactly " : "")\(hosts.joined(separator: ", ")) until \(HumanTime.describe(ca.certificate.notAfter, now: now))"
                        + (extra.isEmpty
                            ? ""
                            : " (and \(extra.joined(separator: ", ")), for other configurations sharing \(stateDirectory))")
                )
            }
        } else {
            bad("there is no local CA for \(hosts.joined(separator: ", "))", fix: "proxyctl ca init")
        }

        context.out("Proxy")
        let listen = configuration.proxy.listen
        let serving = ServeState.allRunning(stateDirectory: stateDirectory)
        for serve in serving {
            ok(
                "proxyctl serve is running (pid \(serve.pid), http://\(serve.listen)\(serve.admin.map { ", health and metrics on http://\($0)" } ?? ""))"
            )
        }
        if serving.isEmpty {
            if listen.port != 0, canConnect(host: listen.host, port: listen.port) {
                ok("something answers on \(listen) (proxyctl serve, presumably)")
            } else {
                note(
                    "nothing listens on \(listen) (no proxyctl serve is running): proxyctl exec -- COMMAND starts a proxy for one command; for every shell run proxyctl serve (in another terminal, or as a service)"
                )
            }
        }

        context.out("This shell")
        let proxyValue = (context.environment["HTTPS_PROXY"] ?? context.environment["https_proxy"]).flatMap {
            $0.isEmpty ? nil : $0
        }
        // No proxy variable at all: this shell uses proxyctl exec (or nothing yet), which sets the variables for
        // its command. Its runtimes are checked with what exec gives them; the shell's own are not a problem.
        let viaExec = proxyValue == nil
        let caReady = !hosts.isEmpty && (try? LocalCA.load(files)) != nil
        if viaExec {
            note(
                "HTTPS_PROXY is not set here: proxyctl exec -- COMMAND sets it and each runtime's variables for its command; only tools run directly in this shell need eval \"$(proxyctl env)\""
            )
        } else if let proxyValue, let address = ClientEnvironment.proxyAddress(proxyValue) {
            // What counts is that something answers where HTTPS_PROXY points (a serve may have stopped).
            if canConnect(host: address.host, port: address.port) {
                ok("HTTPS_PROXY points at a proxy that answers (\(address.host):\(address.port))")
            } else {
                bad(
                    "HTTPS_PROXY is \(ClientEnvironment.redacted(proxyValue)), and nothing listens there",
                    fix: "start proxyctl serve, then eval \"$(proxyctl env)\" again (or use proxyctl exec -- COMMAND)")
            }
        } else {
            bad(
                "HTTPS_PROXY is \(proxyValue.map { "set to \(ClientEnvironment.redacted($0))" } ?? "not set")",
                fix: "eval \"$(proxyctl env)\" (or run each command with proxyctl exec -- COMMAND)")
        }
        if !hosts.isEmpty && !viaExec {
            let trust = context.environment["SSL_CERT_FILE"] ?? context.environment["CURL_CA_BUNDLE"]
            if trust == files.bundle {
                ok("the CA bundle variables point at \(files.bundle)")
            } else {
                bad(
                    "tools do not trust the local CA (SSL_CERT_FILE is \(trust ?? "not set"))",
                    fix: "eval \"$(proxyctl env)\"")
            }
        }
        var runtimeEnvironment = context.environment
        if viaExec {
            context.out("Runtimes on this machine, with the variables proxyctl exec sets for its command")
            // The variables exec gives its command (the proxy's address aside, which exec picks at each run).
            let (variables, _) = ClientEnvironment.variables(
                configuration, stateDirectory: stateDirectory, proxyURL: "http://127.0.0.1:1",
                inherited: context.environment)
            for (name, value) in variables { runtimeEnvironment[name] = value }
        } else {
            context.out("Runtimes on this machine")
        }
        // Without a CA yet, the Local CA section has said so already: the runtimes are not blamed for it.
        let found = RuntimeCheck.run(
            environment: runtimeEnvironment, bundle: hosts.isEmpty || (viaExec && !caReady) ? nil : files.bundle,
            trustStore: files.trustStore, clientFiles: ClientEnvironment.Files(stateDirectory: stateDirectory))
        if found.isEmpty { note("none of the runtimes proxyctl knows is on PATH") }
        for finding in found {
            switch finding.outcome {
            case .ok(let text): ok("\(finding.runtime): \(text)")
            case .fix(let text, let how): bad("\(finding.runtime): \(text)", fix: how)
            case .note(let text): note("\(finding.runtime): \(text)")
            }
        }
        context.out(problems == 0 ? "\nEverything looks right." : "\n\(problems) thing(s) to fix.")
        return problems == 0 ? ExitCode.success : ExitCode.failure
    }

    static func canConnect(host: String, port: Int) -> Bool {
        guard let address = SocketAddress(ip: host == "0.0.0.0" ? "127.0.0.1" : host, port: port) else { return false }
        let fd = Platform.tcpSocket(family: address.family, nonBlocking: false)
        guard fd >= 0 else { return false }
        defer { close(fd) }
        return address.withSockaddrPublic { pointer, length in connect(fd, pointer, length) == 0 }
    }
}
