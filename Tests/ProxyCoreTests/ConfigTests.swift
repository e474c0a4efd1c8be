import Testing

@testable import ProxyCore

private let parser = ConfigParser(homeDirectory: "/home/ada", baseDirectory: "/etc/proxyctl")

/// Parses a configuration that must be valid.
private func config(_ text: String, sourceLocation: SourceLocation = #_sourceLocation) throws -> Configuration {
    switch parser.parse(text, file: "proxy.conf") {
    case .success(let configuration):
        return configuration
    case .failure(let errors):
        Issue.record("configuration was refused: \(errors)", sourceLocation: sourceLocation)
        throw errors
    }
}

/// The errors of a configuration that must be refused (empty when it was accepted).
private func errors(_ text: String) -> [ConfigError] {
    switch parser.parse(text, file: "proxy.conf") {
    case .success: []
    case .failure(let errors): errors.errors
    }
}

private func error(line: Int?, section: String? = nil, key: String? = nil) -> ConfigError {
    ConfigError(file: "proxy.conf", line: line, section: section, key: key, "")
}

/// proxy.conf: the INI syntax, the `[proxy]` keys, and errors that name the file, the line, the section and
/// the key.
@Suite struct ConfigTests {
    @Test func emptyFileGivesDefaults() throws {
        let configuration = try config("")
        #expect(configuration.proxy == ProxySettings())
        #expect(configuration.source == "proxy.conf")
        #expect(configuration.proxy.listen == ListenAddress(host: "127.0.0.1", port: 8080, isIPv6: false))
        #expect(configuration.proxy.upstreamProxy == nil)
        #expect(configuration.proxy.proxyAuthFile == nil)
        #expect(configuration.proxy.connectTimeout == 10_000)
        #expect(configuration.proxy.idleTimeout == 300_000)
        #expect(configuration.proxy.keepAliveTimeout == 60_000)
        #expect(configuration.proxy.headerTimeout == 30_000)
        #expect(configuration.proxy.shutdownGrace == 10_000)
        #expect(configuration.proxy.headLimits == HTTPHeadLimits())
        #expect(configuration.proxy.maxConnections == nil)
        #expect(configuration.proxy.logLevel == .info)
        #expect(configuration.proxy.stateDir == nil)
    }

    @Test func everyProxyKeyParses() throws {
        let text = """
            # proxyctl configuration
            [proxy]
            listen = 127.0.0.1:3128
            upstream_proxy = http://corp%5Cada:p%40ss:word@proxy.corp.example:3128
            no_upstream_proxy = localhost, .internal.example 10.0.0.0/8
            proxy_auth_file = users.txt
            connect_timeout = 5s
            idle_timeout = 10m
            keepalive_timeout = 90
            header_timeout = 500ms
            shutdown_grace = 0
            max_request_line = 16KiB
            max_header_bytes = 1MiB
            max_headers = 200
            max_connections = 100
            max_connections_per_client = 25
            protected_users = any
            passthrough_users = Owner
            replay_memory = 2MiB
            replay_spool = 16MiB
            replay_memory_total = 32MiB
            replay_spool_total = 2GiB
            http2 = off
            browser_requests = Allow
            upstream_client = Builtin
            resolve = api.test=127.0.0.1, Git.Test.=::1
            notify_command = notify-send  proxyctl
            log_level = debug
            log_format = JSON
            admin_listen = 9464
            admin_hosts = proxyctl, Metrics.Internal.
            state_dir = ~/state
            token_store = secret-service
            audit_max_size = 1MiB
            """
        let proxy = try config(text).proxy
        #expect(proxy.auditMaxSize == 1 << 20)
        #expect(proxy.logFormat == .json)
        #expect(proxy.adminListen == ListenAddress(host: "127.0.0.1", port: 9464, isIPv6: false))
        #expect(proxy.tokenStore == .secretService)
        #expect(proxy.adminHosts == ["proxyctl", "metrics.internal"])
        #expect(proxy.replayMemory == 2 << 20)
        #expect(proxy.replaySpool == 16 << 20)
        #expect(proxy.replayMemoryTotal == 32 << 20 && proxy.replaySpoolTotal == 2 << 30)
        #expect(proxy.http2 == false)
        #expect(proxy.browserRequests == .allow)
        #expect(proxy.resolve == ["api.test": "127.0.0.1", "git.test": "::1"])
        #expect(proxy.notifyCommand == ["notify-send", "proxyctl"])
        #expect(proxy.listen == ListenAddress(host: "127.0.0.1", port: 3128, isIPv6: false))
        let upstream = try #require(proxy.upstreamProxy)
        #expect(upstream.address == HostPort(host: "proxy.corp.example", port: 3128, kind: .name))
        #expect(upstream.username == "corp\\ada")
        #expect(upstream.password == "p@ss:word")
        #expect(proxy.noUpstreamProxy.domains == ["localhost", "internal.example"])
        #expect(proxy.noUpstreamProxy.ranges == [CIDR.parse("10.0.0.0/8")!])
        #expect(proxy.proxyAuthFile == "/etc/proxyctl/users.txt")
        #expect(proxy.connectTimeout == 5000)
        #expect(proxy.idleTimeout == 600_000)
        #expect(proxy.keepAliveTimeout == 90_000)
        #expect(proxy.headerTimeout == 500)
        #expect(proxy.shutdownGrace == 0)
        #expect(proxy.headLimits == HTTPHeadLimits(maxStartLine: 16384, maxHeadBytes: 1 << 20, maxFields: 200))
        #expect(proxy.maxConnections == 100)
        #expect(proxy.maxConnectionsPerClient == 25)
        #expect(proxy.protectedUsers == .any && proxy.passthroughUsers == .owner)
        #expect(proxy.logLevel == .debug)
        #expect(proxy.stateDir == "/home/ada/state")
        #expect(ConfigParser.proxyKeys.count == 32)
        for key in ConfigParser.proxyKeys {
            #expect(text.contains("\n\(key) = "), "\(key) is not covered")
        }
    }

    @Test func pathsAreResolved() throws {
        #expect(parser.resolvePath("/abs/users") == "/abs/users")
        #expect(parser.resolvePath("rel/users") == "/etc/proxyctl/rel/users")
        #expect(parser.resolvePath("~/users") == "/home/ada/users")
        #expect(parser.resolvePath("~user/x") == "/etc/proxyctl/~user/x")
        let bare = ConfigParser(homeDirectory: nil, baseDirectory: nil)
        #expect(bare.resolvePath("~/users") == "~/users")
        #expect(bare.resolvePath("users") == "users")
    }

    @Test func upstreamProxyNoneClearsIt() throws {
        #expect(try config("[proxy]\nupstream_proxy = none\n").proxy.upstreamProxy == nil)
        #expect(try config("[proxy]\nupstream_proxy = NONE\n").proxy.upstreamProxy == nil)
        #expect(try config("[proxy]\nupstream_proxy =\n").proxy.upstreamProxy == nil)
    }

    @Test(arguments: [
        ("error", LogLevel.error), ("warn", .warn), ("warning", .warn), ("info", .info), ("debug", .debug),
        ("DEBUG", .debug), ("Info", .info),
    ])
    func logLevels(name: String, expected: LogLevel) throws {
        #expect(try config("[proxy]\nlog_level = \(name)\n").proxy.logLevel == expected)
        #expect(LogLevel(name: expected.description) == expected)
    }

    @Test func logLevelsAreOrdered() {
        #expect(LogLevel.error < .warn)
        #expect(LogLevel.warn < .info)
        #expect(LogLevel.info < .debug)
        #expect(LogLevel.allCases.count == 4)
    }

    // MARK: - Bad values: each names its line, section and key

    @Test(arguments: [
        ("listen", "8080"),
        ("listen", "example.com:8080"),
        ("listen", "127.0.0.1"),
        ("listen", "127.0.0.1:99999"),
        ("listen", "127.0.0.1:-1"),
        ("listen", "127.0.0.1:+80"),
        ("listen", "127.0.0.1:"),
        ("listen", "[::1]"),
        ("listen", "[::1]:"),
        ("listen", "::1:8080"),
        ("listen", "[127.0.0.1]:8080"),
        ("listen", "01.0.0.1:8080"),
        ("listen", ""),
        ("upstream_proxy", "proxy.corp:3128"),
        ("upstream_proxy", "https://proxy.corp:3128"),
        ("upstream_proxy", "socks5://proxy.corp:1080"),
        ("upstream_proxy", "http://proxy.corp:0"),
        ("upstream_proxy", "http://proxy.corp:3128/path"),
        ("upstream_proxy", "http://:3128"),
        ("upstream_proxy", "http://"),
        ("upstream_proxy", "http://%zz:pass@proxy:1"),
        ("upstream_proxy", "http://:pass@proxy:1"),
        ("no_upstream_proxy", "exa@mple.com"),
        ("no_upstream_proxy", "10.0.0.0/33"),
        ("no_upstream_proxy", "."),
        ("no_upstream_proxy", "a%20b"),
        ("proxy_auth_file", ""),
        ("connect_timeout", "5x"),
        ("connect_timeout", "0"),
        ("connect_timeout", "-1s"),
        ("connect_timeout", "1.5s"),
        ("connect_timeout", ""),
        ("idle_timeout", "forever"),
        ("keepalive_timeout", "0ms"),
        ("header_timeout", "s"),
        ("shutdown_grace", "5x"),
        ("shutdown_grace", "-1"),
        ("max_request_line", "100"),
        ("max_request_line", "2MiB"),
        ("max_request_line", "8KB"),
        ("max_request_line", "lots"),
        ("max_header_bytes", "512"),
        ("max_header_bytes", "17MiB"),
        ("max_headers", "7"),
        ("max_headers", "10001"),
        ("max_headers", "ten"),
        ("max_headers", "8k"),
        ("max_connections", "0"),
        ("max_connections", "1000001"),
        ("max_connections", "-5"),
        ("log_level", "verbose"),
        ("log_level", ""),
        ("state_dir", ""),
        ("http2", "maybe"),
    ])
    func badValueNamesItsLocation(key: String, value: String) {
        let found = errors("# comment\n[proxy]\n\n\(key) = \(value)\n")
        #expect(found == [error(line: 4, section: "proxy", key: key)])
        #expect(found.first?.message.isEmpty == false)
        #expect(found.first?.description.hasPrefix("proxy.conf:4: [proxy] \(key): ") == true)
    }

    @Test func messagesSayWhatIsExpected() {
        let found = errors("[proxy]\nconnect_timeout = 5x\n")
        #expect(
            found.first?.description
                == "proxy.conf:2: [proxy] connect_timeout: expected a duration such as 10s, 500ms or 5m, got \"5x\"")
        #expect(
            errors("[proxy]\nupstream_client = libcurl\n").first?.description
                == "proxy.conf:2: [proxy] upstream_client: libcurl no longer carries requests to protected origins (the proxy's own client does, in HTTP/1.1 or HTTP/2 as the origin chooses); remove this line, got \"libcurl\""
        )
    }

    @Test func unknownKey() throws {
        let found = errors("[proxy]\nlisten_addr = 127.0.0.1:80\n")
        #expect(found == [error(line: 2, section: "proxy", key: "listen_addr")])
        #expect(found[0].message.contains("listen"))
        #expect(errors("[proxy]\nlistne = 127.0.0.1:80\n").first?.message == "unknown key; did you mean listen?")
    }

    @Test func aPortOutOfRangeIsNamedAsSuch() {
        #expect(
            errors("[proxy]\nlisten = 127.0.0.1:80800\n").first?.description
                == "proxy.conf:2: [proxy] listen: port 80800 out of range (1-65535, or 0 for any free port), got \"127.0.0.1:80800\""
        )
        #expect(
            errors("[proxy]\nadmin_listen = 70000\n").first?.message
                == "port 70000 out of range (1-65535, or 0 for any free port), got \"70000\"")
        #expect(
            errors("[proxy]\nlisten = 127.0.0.1:8o80\n").first?.message
                == "expected HOST:PORT with an IP address, such as 127.0.0.1:8080 or [::1]:8080, got \"127.0.0.1:8o80\""
        )
        #expect(
            ListenAddress.check("[::1]:65536") == .failure("port 65536 out of range (1-65535, or 0 for any free port)"))
        #expect(ListenAddress.check("[::1]:65535") == .success(ListenAddress(host: "::1", port: 65535, isIPv6: true)))
    }

    @Test func keysAreCaseSensitive() {
        #expect(errors("[proxy]\nListen = 127.0.0.1:80\n") == [error(line: 2, section: "proxy", key: "Listen")])
    }

    @Test func duplicateKeyNamesTheFirstLine() throws {
        let found = errors("[proxy]\nlog_level = info\n# again\nlog_level = debug\n")
        #expect(found == [error(line: 4, section: "proxy", key: "log_level")])
        #expect(found[0].message.contains("line 2"))
    }

    @Test func duplicateProxySectionNamesTheFirstLine() throws {
        let found = errors("[proxy]\nlog_level = info\n\n[proxy]\nmax_headers = 10\n")
        #expect(found == [error(line: 4, section: "proxy")])
        #expect(found[0].message.contains("line 1"))
    }

    @Test func keyOutsideASection() {
        let found = errors("listen = 127.0.0.1:8080\n[proxy]\n")
        #expect(found == [error(line: 1, key: "listen")])
        #expect(found[0].message.contains("[proxy]"))
    }

    @Test func unknownSection() {
        let found = errors("[proxy]\n[frobnicate https://api.example.com]\nprovider = corp\n")
        #expect(found == [error(line: 2)])
        #expect(found[0].message.contains("frobnicate https://api.example.com"))
        #expect(found[0].message.contains("[origin URL]"))
        #expect(errors("[Proxy]\nlog_level = debug\n").isEmpty)  // section names are case-insensitive
    }

    @Test func proxySectionTakesNoName() {
        #expect(errors("[proxy main]\n") == [error(line: 1)])
    }

    @Test(arguments: ["[proxy", "[]", "[ ]", "just some words", "= value", "bad key = 1", "k$y = 1"])
    func syntaxErrors(line: String) {
        #expect(errors("[proxy]\n\(line)\n") == [error(line: 2)])
    }

    @Test func commentsAndBlankLinesAreIgnored() throws {
        let text = """
            # full-line comment
            ; another comment style
               # indented comment

            [proxy]
            \t; indented comment in a section
            log_level=debug
              max_headers   =   50\t
            upstream_proxy = http://proxy.example:3128/#not-a-comment
            """
        let found = errors(text)
        // "#" is not a comment inside a value: the URL is refused for its path, not truncated.
        #expect(found == [error(line: 9, section: "proxy", key: "upstream_proxy")])
        let proxy = try config(text.replacingOccurrences(of: "/#not-a-comment", with: "")).proxy
        #expect(proxy.logLevel == .debug)
        #expect(proxy.headLimits.maxFields == 50)
        #expect(proxy.upstreamProxy?.address == HostPort(host: "proxy.example", port: 3128, kind: .name))
    }

    @Test func crlfLineEndings() throws {
        let text = "# c\r\n[proxy]\r\nlog_level = debug\r\nmax_headers = 20\r\n\r\nstate_dir = /var/lib/p\r\n"
        let proxy = try config(text).proxy
        #expect(proxy.logLevel == .debug)
        #expect(proxy.headLimits.maxFields == 20)
        #expect(proxy.stateDir == "/var/lib/p")
        #expect(
            errors("[proxy]\r\nlog_level = debug\r\nmax_headers = x\r\n") == [
                error(line: 3, section: "proxy", key: "max_headers")
            ])
    }

    @Test func everyErrorIsReportedInLineOrder() {
        let text = """
            stray = 1
            [proxy]
            connect_timeout = never
            log_level = loud
            log_level = info
            [other]
            """
        #expect(
            errors(text) == [
                error(line: 1, key: "stray"), error(line: 3, section: "proxy", key: "connect_timeout"),
                error(line: 4, section: "proxy", key: "log_level"), error(line: 5, section: "proxy", key: "log_level"),
                error(line: 6),
            ])
    }

    // MARK: - Cross-key checks

    @Test(arguments: ["0.0.0.0:8080", "[::]:8080", "192.168.1.10:3128", "[2001:db8::1]:3128"])
    func nonLoopbackListenNeedsProxyAuth(listen: String) throws {
        let found = errors("[proxy]\nlog_level = info\nlisten = \(listen)\n")
        #expect(found == [error(line: 3, section: "proxy", key: "listen")])
        #expect(found[0].message.contains("proxy_auth_file"))
        let proxy = try config("[proxy]\nlisten = \(listen)\nproxy_auth_file = /etc/users\n").proxy
        #expect(proxy.proxyAuthFile == "/etc/users")
        #expect(!proxy.listen.isLoopback)
    }

    @Test(arguments: ["127.0.0.1:8080", "127.1.2.3:80", "[::1]:8080", "localhost:9000", "127.0.0.1:0"])
    func loopbackListenNeedsNoProxyAuth(listen: String) throws {
        let proxy = try config("[proxy]\nlisten = \(listen)\n").proxy
        #expect(proxy.listen.isLoopback)
        #expect(proxy.proxyAuthFile == nil)
    }

    // MARK: - Secrets

    @Test(arguments: [
        "http://ada:hunter2secret@bad host:3128",
        "ftp://ada:hunter2secret@proxy:3128",
        "https://ada:hunter2secret@proxy:3128",
        "ada:hunter2secret@proxy:3128",
        "http://ada:hunter2secret@proxy:99999",
        "http://ada:hunter2secret@proxy:3128/path",
        "http://ada:hunter2secret%zz@proxy:3128",
        "http://ada:hunter2secret@",
        "http://ada:hunter2secret@[::1:3128",
    ])
    func badUpstreamURLNeverEchoesThePassword(value: String) {
        switch parser.parse("[proxy]\nupstream_proxy = \(value)\n", file: "proxy.conf") {
        case .success:
            Issue.record("a bad upstream proxy URL was accepted")
        case .failure(let errors):
            #expect(errors.errors == [error(line: 2, section: "proxy", key: "upstream_proxy")])
            #expect(!errors.description.contains("hunter2"))
        }
    }

    @Test(arguments: [
        "upstream_proxy: http://ada:hunter2secret@proxy:3128", "upstream_proxy http://ada:hunter2secret@p",
    ])
    func lineWithoutEqualsNeverEchoesAPassword(line: String) {
        let found = errors("[proxy]\n\(line)\n")
        #expect(found == [error(line: 2)])
        #expect(found.first?.message.contains("upstream_proxy") == true)
        #expect(found.first?.description.contains("hunter2") == false)
    }

    @Test func configErrorEquality() {
        let a = ConfigError(file: "f", line: 1, section: "proxy", key: "k", "one message")
        #expect(a == ConfigError(file: "f", line: 1, section: "proxy", key: "k", "another message"))
        #expect(a != ConfigError(file: "g", line: 1, section: "proxy", key: "k", "one message"))
        #expect(a != ConfigError(file: "f", line: 2, section: "proxy", key: "k", "one message"))
        #expect(a != ConfigError(file: "f", line: 1, section: nil, key: "k", "one message"))
        #expect(a != ConfigError(file: "f", line: 1, section: "proxy", key: nil, "one message"))
        #expect(a.description == "f:1: [proxy] k: one message")
        #expect(ConfigError(file: "f", line: nil, "m").description == "f: m")
    }
}

@Suite struct AdmissionTests {
    @Test func limitsComeFromTheOpenFileLimitUnlessSet() {
        let derived = Admission(settings: ProxySettings(), fileLimit: 20_000)
        #expect(derived.maxConnections == 9_968 && derived.maxPerClient == 2_492)
        #expect(Admission(settings: ProxySettings(), fileLimit: 100).maxConnections == 18)
        #expect(Admission(settings: ProxySettings(), fileLimit: 10).maxConnections == 16)
        var settings = ProxySettings()
        settings.maxConnections = 10
        settings.maxConnectionsPerClient = 50
        let set = Admission(settings: settings, fileLimit: 20_000)
        #expect(set.maxConnections == 10 && set.maxPerClient == 10, "per client never above the total")
    }

    @Test func beyondALimitTheClientIsToldAtOnce() {
        var settings = ProxySettings()
        settings.maxConnections = 4
        settings.maxConnectionsPerClient = 2
        let admission = Admission(settings: settings, fileLimit: 1_000)
        #expect(admission.decide(open: 3, fromClient: 1) == nil)
        #expect(admission.decide(open: 4, fromClient: 0) == .overCapacity(limit: 4))
        #expect(admission.decide(open: 2, fromClient: 2) == .tooManyFromClient(limit: 2))
        let response = ProxyAnswer.overCapacity(limit: 4).response
        #expect(response.status == 503 && response.close)
        #expect(response.proxyStatus?.error == .connectionLimitReached)
        #expect(response.extraFields.map(\.name) == ["Retry-After"])
    }

    @Test func theKeyIsParsed() throws {
        let configuration = try config("[proxy]\nmax_connections_per_client = 7\n")
        #expect(configuration.proxy.maxConnectionsPerClient == 7)
    }
}

/// Issue 15's keys: per-origin audience and scopes, ID-token origins, machine grants and client authentication.
@Suite struct CredentialConfigTests {
    let parser = ConfigParser(homeDirectory: "/home/ada", baseDirectory: "/etc/proxyctl")

    func parse(_ text: String) -> Result<Configuration, ConfigErrors> { parser.parse(text, file: "proxy.conf") }

    @Test func anOriginNamesItsOwnAudienceAndScopes() throws {
        let text = """
            [provider corp]
            issuer = https://login.example.com
            client_id = proxyctl
            [origin https://a.example.com]
            provider = corp
            resource = https://a.example.com/
            scopes = a.read, a.write a.read
            [origin https://iap.example.com]
            provider = corp
            token_type = id_token
            """
        let origins = try parse(text).get().origins.origins
        #expect(
            origins[0].tokenKey
                == TokenKey(provider: "corp", resource: "https://a.example.com/", scopes: ["a.read", "a.write"]))
        #expect(origins[1].tokenKey == TokenKey(provider: "corp", kind: .idToken))
    }

    @Test(arguments: [
        ("resource = a.example.com", "resource"), ("resource = https://a.example.com/#x", "resource"),
        ("token_type = refresh_token", "token_type"), ("scopes =", "scopes"),
        ("token_type = id_token\nresource = https://a.example.com/", "token_type"),
    ])
    func badOriginValuesNameTheirKey(line: String, key: String) {
        let text =
            "[provider corp]\nissuer = https://login.example.com\nclient_id = p\n[origin https://a.example.com]\nprovider = corp\n\(line)\n"
        guard case .failure(let errors) = parse(text) else {
            Issue.record("accepted \(line)")
            return
        }
        #expect(errors.errors.contains { $0.key == key }, "\(errors)")
    }

    @Test func machineGrantsAndClientAuthentication() throws {
        let text = """
            [provider ci]
            issuer = https://login.example.com
            client_id = ci-bot
            grant = client_credentials
            client_key_file = keys/ci.pem
            [provider exchange]
            issuer = https://login.example.com
            client_id = ci
            grant = token-exchange
            subject_token_file = /run/ci/token
            subject_token_type = urn:ietf:params:oauth:token-type:id_token
            audience = api
            token_endpoint_auth_method = client_secret_basic
            client_secret_file = ~/ci.secret
            """
        let providers = try parse(text).get().providers
        #expect(providers[0].grant == .clientCredentials && providers[0].effectiveClientAuth == .privateKeyJWT)
        #expect(providers[0].clientKeyFile == "/etc/proxyctl/keys/ci.pem" && !providers[0].needsSignIn)
        #expect(providers[1].grant == .tokenExchange && providers[1].effectiveClientAuth == .clientSecretBasic)
        #expect(providers[1].clientSecretFile == "/home/ada/ci.secret" && providers[1].audience == "api")
        #expect(providers[1].subjectTokenType == "urn:ietf:params:oauth:token-type:id_token")
        // A client assertion names the issuer unless told otherwise (draft-ietf-oauth-rfc7523bis).
        #expect(providers[0].clientAssertionAudience == .issuer && providers[0].file == "proxy.conf")
        let glewlwyd = try parse(
            "[provider g]\nissuer = https://login.example.com\nclient_id = c\ngrant = client_credentials\n"
                + "client_assertion_audience = token_endpoint\n"
        ).get()
        #expect(glewlwyd.providers[0].clientAssertionAudience == .tokenEndpoint)
    }

    /// Issue 32 item 6: a secret file says what the user means; RFC 7591 §2's default method for a client with a
    /// secret is client_secret_basic. An explicit method or a key file keeps its meaning.
    @Test func aClientSecretFileAloneMeansClientSecretBasic() throws {
        let base = "[provider ci]\nissuer = https://login.example.com\nclient_id = ci-bot\n"
        for grant in ["client_credentials", "token_exchange\nsubject_token_file = /t", "authorization_code"] {
            let provider = try #require(
                try parse(base + "grant = \(grant)\nclient_secret_file = /s\n").get().providers.first)
            #expect(provider.effectiveClientAuth == .clientSecretBasic, "\(grant)")
        }
        let explicit = "token_endpoint_auth_method = client_secret_post\n"
        let post = try parse(base + "grant = client_credentials\nclient_secret_file = /s\n" + explicit).get()
        #expect(post.providers[0].effectiveClientAuth == .clientSecretPost)
        let key = try parse(base + "grant = client_credentials\nclient_key_file = /k\n").get()
        #expect(key.providers[0].effectiveClientAuth == .privateKeyJWT)
        let plain = try parse(base + "grant = client_credentials\n").get()
        #expect(plain.providers[0].effectiveClientAuth == .privateKeyJWT)
        let bothFiles = base + "grant = client_credentials\nclient_secret_file = /s\nclient_key_file = /k\n"
        guard case .failure(let both) = parse(bothFiles) else {
            Issue.record("accepted a key file and a secret file without a method")
            return
        }
        #expect(both.description.contains("token_endpoint_auth_method = private_key_jwt or client_secret_basic"))
    }

    @Test(arguments: [
        ("grant = client_credentials\ntoken_endpoint_auth_method = none", "token_endpoint_auth_method"),
        ("token_endpoint_auth_method = client_secret_post", "token_endpoint_auth_method"),
        ("client_secret_file = s\nclient_key_file = k", "client_secret_file"),
        ("token_endpoint_auth_method = private_key_jwt\nclient_secret_file = s", "client_secret_file"),
        ("grant = token_exchange", "grant"),
        ("grant = token_exchange\nsubject_token_file = a\nsubject_token_command = b", "grant"),
        ("subject_token_file = a", "subject_token_file"),
        ("grant = password", "grant"),
        ("client_assertion_audience = token_endpoint", "client_assertion_audience"),
        ("grant = client_credentials\nclient_assertion_audience = endpoint", "client_assertion_audience"),
        ("client_secret_file = s\nclient_assertion_audience = issuer", "client_assertion_audience"),
    ])
    func inconsistentProviderKeysAreNamed(lines: String, key: String) {
        let text = "[provider ci]\nissuer = https://login.example.com\nclient_id = c\n\(lines)\n"
        guard case .failure(let errors) = parse(text) else {
            Issue.record("accepted \(lines)")
            return
        }
        #expect(errors.errors.contains { $0.key == key }, "\(errors)")
    }

    @Test func anIDTokenOriginNeedsAProviderWithASignIn() {
        let text = """
            [provider ci]
            issuer = https://login.example.com
            client_id = c
            grant = client_credentials
            [origin https://a.example.com]
            provider = ci
            token_type = id_token
            """
        guard case .failure(let errors) = parse(text) else {
            Issue.record("accepted")
            return
        }
        #expect(errors.errors.contains { $0.key == "token_type" && $0.description.contains("no ID token") })
    }
}
