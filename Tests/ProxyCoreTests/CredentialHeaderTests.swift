import Testing

@testable import ProxyCore

/// `header = NAME: TEMPLATE`, placeholders and the client's own credential fields (issue 31).
@Suite struct CredentialHeaderTests {
    func render(_ header: CredentialHeader, _ credential: String = "K", scheme: String = "Bearer") -> String {
        String(
            decoding: header.render(credential: Array(credential.utf8), scheme: scheme) { path in
                Array("file(\(path))".utf8)
            }, as: UTF8.self)
    }

    @Test(arguments: [
        ("X-API-Key: {secret}", "X-API-Key", "K"),
        ("Authorization: Bearer {secret}", "Authorization", "Bearer K"),
        ("authorization:Token  {secret} ", "authorization", "Token  K"),
        ("CF-Access-Client-Id: {secret_file:/run/id}", "CF-Access-Client-Id", "file(/run/id)"),
        ("Authorization: {basic:ada}", "Authorization", "Basic YWRhOks="),
        ("X-Key: pre-{secret}-post", "X-Key", "pre-K-post"),
    ])
    func parsesAndRenders(text: String, name: String, value: String) throws {
        let header = try CredentialHeader.parse(text, kind: .secret).get()
        #expect(header.name == name)
        #expect(render(header) == value)
    }

    @Test func tokenOriginsWriteToken() throws {
        let header = try CredentialHeader.parse("X-Token: {token}", kind: .token).get()
        #expect(render(header, "T") == "T")
        #expect(throws: ValueError.self) { try CredentialHeader.parse("X-Token: {secret}", kind: .token).get() }
        #expect(throws: ValueError.self) { try CredentialHeader.parse("X-Token: {token}", kind: .secret).get() }
    }

    @Test(arguments: [
        "X-API-Key {secret}", ": {secret}", "X API: {secret}", "Host: {secret}", "Content-Length: {secret}",
        "Proxy-Authorization: {secret}", "DPoP: {secret}", "X-Key: {nope}", "X-Key: {secret", "X-Key: }{secret}",
        "X-Key: plain text only", "X-Key: {basic:a:b}", "X-Key: {secret_file:}", "X-Key: caf\u{e9} {secret}",
        "X-Key: {secret}\r\nX-Evil: 1",
    ])
    func refusesBadTemplates(text: String) {
        #expect(throws: ValueError.self) { try CredentialHeader.parse(text, kind: .secret).get() }
    }

    @Test func theDefaultIsTheSchemeAndTheToken() {
        #expect(render(.authorizationDefault, "T", scheme: "DPoP") == "DPoP T")
    }

    // MARK: - Placeholders

    let mine = Placeholders.Entry(
        value: Array("proxyctl-placeholder-00112233445566778899aabbccddeeff".utf8), origin: "https://a.test",
        variable: "A_KEY")
    let theirs = Placeholders.Entry(
        value: Array("proxyctl-placeholder-ffeeddccbbaa99887766554433221100".utf8), origin: "https://b.test",
        variable: "B_KEY", credential: "secret:b", staticSecret: true)

    @Test func placeholdersAreFoundAnywhereAndInBasic() {
        let table = Placeholders([mine, theirs])
        let text = "Bearer " + String(decoding: theirs.value, as: UTF8.self) + "!"
        #expect(table.find(in: Array(text.utf8)) == theirs)
        #expect(table.find(in: Array("proxyctl-placeholder-nothing".utf8)) == nil)
        let basic = "basic  " + Base64.encode(Array("me:".utf8) + mine.value)
        #expect(table.find(in: Array(basic.utf8)) == mine)
        #expect(Placeholders().find(in: mine.value) == nil)
    }

    func origin(_ text: String) throws -> OriginConfig {
        let parser = ConfigParser(homeDirectory: "/home/ada", baseDirectory: "/etc/proxyctl")
        var origin = try #require(try parser.parse(text, file: "proxy.conf").get().origins.origins.first)
        origin.placeholders = Placeholders([mine, theirs])
        return origin
    }

    func scan(_ origin: OriginConfig, _ fields: [(String, String)], target: String = "/") -> CredentialScan {
        origin.scanCredentials(target: target.utf8) { visit in
            for (name, value) in fields { visit(Array(name.utf8)[...], Array(value.utf8)[...]) }
        }
    }

    @Test func theOwnPlaceholderIsNoClientCredentialAndAnotherIsRefused() throws {
        let a = try origin(
            "[origin https://a.test]\nsecret_file = /k\nheader = X-API-Key: {secret}\nplaceholder_env = A_KEY\n")
        #expect(a.credentialFieldNames == ["x-api-key"])
        #expect(a.clientAuthorization == .replace)
        let own = scan(a, [("x-api-key", String(decoding: mine.value, as: UTF8.self))])
        #expect(own.placeholderUsed && !own.clientCredential && own.foreign == nil)
        #expect(a.credentialRefusal(own) == nil)
        let client = scan(a, [("X-API-KEY", "sk-real"), ("Authorization", "Bearer x")])
        #expect(client.clientCredential && !client.placeholderUsed)
        let stolen = scan(a, [("X-Other", "x " + String(decoding: theirs.value, as: UTF8.self))])
        #expect(stolen.foreign == theirs)
        #expect(a.credentialRefusal(stolen)?.contains("https://b.test (B_KEY)") == true)
        let query = scan(a, [], target: "/?k=" + String(decoding: theirs.value, as: UTF8.self))
        #expect(query.foreign == theirs)
    }

    @Test func refuseRefusesTheClientsOwnCredential() throws {
        let a = try origin("[origin https://a.test]\nsecret_file = /k\nclient_credential = refuse\n")
        #expect(a.credentialRefusal(scan(a, [("authorization", "Bearer mine")]))?.contains("refuse") == true)
        #expect(a.credentialRefusal(scan(a, [("accept", "*/*")])) == nil)
    }

    @Test func theRequestLosesTheClientsFieldAndGetsThePlaceholdersOrigin() throws {
        let a = try origin(
            "[origin https://a.test]\nsecret_file = /k\nheader = X-API-Key: {secret}\nheader = X-Id: {secret_file:/id}\n"
        )
        let head = try parseHead(
            "GET /x HTTP/1.1\r\nHost: a.test\r\nX-API-Key: mine\r\nx-id: 1\r\nAccept: */*\r\n\r\n")
        let request = try MessageSemantics.interceptedRequest(head, for: a).get()
        #expect(request.upstreamFields.map(\.name) == ["Accept"])
        #expect(request.clientAuthorization)
        let theirsHead = try parseHead(
            "GET /x HTTP/1.1\r\nHost: a.test\r\nX-Trace: \(String(decoding: theirs.value, as: UTF8.self))\r\n\r\n")
        guard
            case .failure(let refusal) = MessageSemantics.interceptedRequest(theirsHead, for: a),
            case .placeholderRefused(let placeholder, close: false) = refusal
        else {
            Issue.record("a placeholder of another origin was not refused")
            return
        }
        #expect(placeholder.reason.contains("https://b.test"))
        #expect(refusal.answer.status == 403)
        // What the audit log gets: whose placeholder, which credential, never the placeholder.
        let use = try #require(refusal.refusedUse(origin: a, method: "GET", target: "/x?k=1"))
        #expect(use.origin == "https://a.test" && use.refusal.origin == "https://b.test")
        #expect(use.refusal.variable == "B_KEY" && use.refusal.credential == "secret:b" && use.refusal.staticSecret)
        #expect(!String(describing: use).contains("proxyctl-placeholder-"))
        // The client's own credential under refuse is no placeholder refusal, and no audit line.
        let refusing = try origin("[origin https://a.test]\nsecret_file = /k\nclient_credential = refuse\n")
        let own = try parseHead("GET /x HTTP/1.1\r\nHost: a.test\r\nAuthorization: Bearer mine\r\n\r\n")
        guard case .failure(let other) = MessageSemantics.interceptedRequest(own, for: refusing),
            case .credentialRefused = other
        else {
            Issue.record("the client's own credential was not refused")
            return
        }
        #expect(other.refusedUse(origin: refusing, method: "GET", target: "/x") == nil)
    }

    // MARK: - Configuration errors name the line

    @Test(arguments: [
        ("[origin https://a.test]\nsecret_file = /k\nsecret_command = vault\n", 3, "one secret"),
        ("[origin https://a.test]\nprovider = corp\nsecret_file = /k\n", 3, "either provider"),
        ("[origin https://a.test]\nsecret_file = /k\nheader = X-Key: {token}\n", 3, "{secret}"),
        ("[origin https://a.test]\nsecret_file = /k\nsecret_ttl = 1m\n", 3, "needs secret_command"),
        ("[origin https://a.test]\nsecret_file = /k\nplaceholder_env = 1BAD\n", 3, "environment variable"),
        ("[origin https://a.test]\nsecret_file = /k\nclient_credential = maybe\n", 3, "replace, keep or refuse"),
        ("[origin https://a.test]\nsecret_file = /k\nheader = X-Key: {secret}\nheader = x-key: {secret}\n", 4, "twice"),
        ("[origin https://a.test]\nsecret_file = /k\nscopes = a\n", 3, "static secret"),
        ("[origin https://a.test]\nheader = X-Key: {secret}\n", 1, "or a secret"),
    ])
    func configErrorsNameTheLine(text: String, line: Int, message: String) {
        let parser = ConfigParser(homeDirectory: "/home/ada", baseDirectory: "/etc/proxyctl")
        let provider = "[provider corp]\nissuer = https://login.example.com\nclient_id = proxyctl\n"
        let offset = text.contains("provider = corp") ? 3 : 0
        guard case .failure(let errors) = parser.parse((offset > 0 ? provider : "") + text, file: "proxy.conf") else {
            Issue.record("accepted: \(text)")
            return
        }
        #expect(
            errors.errors.contains { $0.line == line + offset && $0.message.contains(message) },
            "\(errors.description)")
    }

    @Test func aCommandHasADefaultTTLAndItsNameHidesItsArguments() throws {
        let a = try origin("[origin https://a.test]\nsecret_command = /usr/bin/vault read secret/api\n")
        #expect(a.secret == .command(["/usr/bin/vault", "read", "secret/api"], ttl: 300))
        #expect(a.credentialName == "secret_command:vault")
        #expect(a.tokenKey == TokenKey(staticSecret: "secret_command:vault"))
    }

    // MARK: - The audit log

    /// The line the audit log writes for `record` (without its newline, which it must end with) and the entry
    /// `parse` reads back from it.
    private func logged(
        _ record: ExchangeRecord, time: Int64, uid: Int?, process: ClientProcess? = nil, client: String
    ) throws -> (json: String, entry: AuditEntry) {
        let lines = AuditLines()
        try #require(lines.append(record, time: time, uid: uid, process: process, client: client))
        let line = lines.withBytes { [UInt8]($0) }
        #expect(line.last == UInt8(ascii: "\n") && line.filter { $0 == UInt8(ascii: "\n") }.count == 1)
        let json = String(decoding: line.dropLast(), as: UTF8.self)
        let entry = try #require(AuditEntry.parse(json))
        // The entry writes the very line the record did: one writer for both.
        #expect(entry.jsonLine == line)
        return (json, entry)
    }

    @Test func auditLinesHoldNoQueryAndReadBack() throws {
        let record = ExchangeRecord(
            method: "POST", origin: "https://a.test", provider: "secret_file:/k", target: "/v1/x?api_key=SECRET#f",
            status: 200, attempts: 2, keptClientAuthorization: false, attached: true, refreshed: true,
            nonceRetried: false, stepUp: false, answeredByProxy: false, note: nil, close: false,
            clientCredentialReplaced: false, placeholderUsed: true, staticSecret: true)
        let (json, entry) = try logged(record, time: 1_767_323_045, uid: 1000, client: "127.0.0.1:5000")
        #expect(!json.contains("SECRET") && !json.contains("?"))
        #expect(json.contains(#""time":"2026-01-02T03:04:05Z""#))
        #expect(entry.origin == "https://a.test" && entry.method == "POST" && entry.path == "/v1/x")
        #expect(entry.credential == "secret_file:/k" && entry.kind == "secret" && entry.status == 200)
        #expect(entry.attempts == 2 && entry.refreshed && !entry.replacedClientCredential && entry.placeholder)
        #expect(entry.uid == 1000 && entry.client == "127.0.0.1:5000" && entry.time == 1_767_323_045)
        let none = ExchangeRecord(
            method: "GET", origin: "https://a.test", provider: "corp", target: "/", status: 200, attempts: 1,
            keptClientAuthorization: true, attached: false, refreshed: false, nonceRetried: false, stepUp: false,
            answeredByProxy: false, note: nil, close: false)
        let lines = AuditLines()
        #expect(!lines.append(none, time: 0, uid: nil, client: "") && lines.isEmpty)
    }

    @Test func auditLinesNameTheClientsProcessWhereKnown() throws {
        let record = ExchangeRecord(
            method: "GET", origin: "https://a.test", provider: "corp", target: "/v1", status: 200, attempts: 1,
            keptClientAuthorization: false, attached: true, refreshed: false, nonceRetried: false, stepUp: false,
            answeredByProxy: false, note: nil, close: false)
        let curl = ClientProcess(pid: 4242, executable: "/usr/bin/curl")
        let (json, entry) = try logged(record, time: 0, uid: 1000, process: curl, client: "127.0.0.1:5000")
        #expect(json.contains(#""uid":1000,"pid":4242,"executable":"/usr/bin/curl","client""#))
        #expect(entry.kind == "token" && entry.pid == 4242 && entry.executable == "/usr/bin/curl")
        #expect(entry.text.hasSuffix("GET https://a.test/v1 200 token corp (uid=1000, pid=4242 /usr/bin/curl)"))
        // Unknown: absent, not empty or zero.
        let unknown = try logged(record, time: 0, uid: nil, process: nil, client: "127.0.0.1:5000")
        #expect(!unknown.json.contains("pid") && !unknown.json.contains("executable") && !unknown.json.contains("uid"))
        let forked = try logged(
            record, time: 0, uid: 7, process: ClientProcess(pid: nil, executable: "/bin/x"), client: "")
        #expect(!forked.json.contains("pid") && forked.entry.executable == "/bin/x")
        #expect(forked.entry.text.hasSuffix("(uid=7, /bin/x)"))
    }

    @Test func aRefusedPlaceholderIsARefusedUseOfItsOwnersCredential() throws {
        let refusal = PlaceholderRefusal(reason: "the request carries the placeholder of https://b.test", owner: theirs)
        let use = RefusedCredentialUse(
            origin: "http://127.0.0.1:8000", method: "POST", target: "http://127.0.0.1:8000/up?key=x", refusal: refusal)
        let entry = AuditEntry(use, time: 0, uid: 1000, process: nil, client: "127.0.0.1:5000")
        #expect(entry.status == 403 && entry.attempts == 0 && entry.path == "/up")
        #expect(entry.credential == "secret:b" && entry.kind == "secret" && entry.origin == "http://127.0.0.1:8000")
        #expect(
            entry.json.contains(#""refused":"placeholder","placeholder_of":"https://b.test","placeholder_env":"B_KEY""#)
        )
        #expect(!entry.json.contains("proxyctl-placeholder-") && !entry.json.contains("key=x"))
        #expect(AuditEntry.parse(entry.json) == entry)
        #expect(
            entry.text.hasSuffix(
                "POST http://127.0.0.1:8000/up 403 refused: the placeholder of https://b.test (B_KEY), for secret secret:b (uid=1000)"
            ))
    }

    /// The line written byte by byte is the JSON the members make, escapes included, and parses back.
    @Test func anAuditLineIsTheJSONOfItsMembers() throws {
        var entry = AuditEntry(
            time: 951_782_400, origin: "https://a.test", method: "PATCH", path: "/q\"uo\\te/\u{1}\t\n/é",
            credential: "secret_command:/bin/\"x\"", kind: "secret", status: 502, attempts: 3, refreshed: true,
            replacedClientCredential: true, placeholder: false, uid: 0, client: "[::1]:5000",
            process: ClientProcess(pid: 1, executable: "/opt/ünï/cöde"))
        entry.refused = "placeholder"
        entry.placeholderOf = "https://b.test"
        entry.placeholderEnv = "B_KEY"
        let members: [(String, JSONValue)] = [
            ("time", .string("2000-02-29T00:00:00Z")), ("ts", .int(951_782_400)), ("origin", .string(entry.origin)),
            ("method", .string("PATCH")), ("path", .string(entry.path)), ("credential", .string(entry.credential)),
            ("kind", .string("secret")), ("status", .int(502)), ("attempts", .int(3)), ("refreshed", .bool(true)),
            ("client_credential_replaced", .bool(true)), ("placeholder", .bool(false)),
            ("refused", .string("placeholder")), ("placeholder_of", .string("https://b.test")),
            ("placeholder_env", .string("B_KEY")), ("uid", .int(0)), ("pid", .int(1)),
            ("executable", .string("/opt/ünï/cöde")), ("client", .string("[::1]:5000")),
        ]
        #expect(entry.json == JSON.serialize(.object(JSONObject(members))))
        #expect(entry.json.contains(#""path":"/q\"uo\\te/\u0001\t\n/é","#))
        #expect(entry.json.hasPrefix(#"{"time":"2000-02-29T00:00:00Z","ts":951782400,"origin":"https://a.test","#))
        #expect(
            entry.jsonLine.last == UInt8(ascii: "\n") && entry.jsonLine.filter { $0 == UInt8(ascii: "\n") }.count == 1)
        #expect(AuditEntry.parse(entry.json) == entry)
    }

    @Test(arguments: [
        (Int64(0), "1970-01-01T00:00:00Z"), (951_782_400, "2000-02-29T00:00:00Z"),
        (1_767_323_045, "2026-01-02T03:04:05Z"),
        (4_102_444_799, "2099-12-31T23:59:59Z"), (253_402_300_799, "9999-12-31T23:59:59Z"),
        (-1, "1969-12-31T23:59:59Z"),
    ])
    func auditTimestampsAreUTC(seconds: Int64, text: String) {
        #expect(AuditEntry.timestamp(seconds) == text)
    }

    @Test(arguments: [
        ("/a/b?c#d", "/a/b"), ("http://127.0.0.1:8000/x?y", "/x"), ("https://h.test", "/"), ("*", "*"), ("", ""),
    ])
    func auditPathsHaveNoQueryNorAuthority(target: String, path: String) {
        #expect(AuditEntry.pathOnly(target) == path)
    }
}

/// What the holders of a client's socket name in the audit log (`ClientProcess`): a field is absent rather than
/// wrong.
@Suite struct ClientProcessTests {
    typealias Holder = ClientProcess.Holder

    @Test func oneHolderIsNamed() {
        #expect(
            ClientProcess.from(holders: [Holder(pid: 10, executable: "/usr/bin/curl")])
                == ClientProcess(pid: 10, executable: "/usr/bin/curl"))
        #expect(
            ClientProcess.from(holders: [Holder(pid: 10, executable: nil)]) == ClientProcess(pid: 10, executable: nil))
    }

    @Test func severalHoldersNameNoPid() {
        let same = [Holder(pid: 10, executable: "/usr/bin/python3"), Holder(pid: 11, executable: "/usr/bin/python3")]
        #expect(ClientProcess.from(holders: same) == ClientProcess(pid: nil, executable: "/usr/bin/python3"))
        let different = [Holder(pid: 10, executable: "/bin/sh"), Holder(pid: 11, executable: "/usr/bin/curl")]
        #expect(ClientProcess.from(holders: different) == nil)
        #expect(
            ClientProcess.from(holders: [Holder(pid: 10, executable: nil), Holder(pid: 11, executable: nil)]) == nil)
        #expect(ClientProcess.from(holders: []) == nil)
    }

    @Test(arguments: [
        ("socket:[12345]", UInt64?(12345)), ("socket:[0]", 0), ("socket:[]", nil), ("socket:[12a]", nil),
        ("pipe:[12345]", nil), ("/dev/null", nil), ("socket:[123", nil), ("socket:[18446744073709551616]", nil),
        ("anon_inode:[eventpoll]", nil), ("socket:[18446744073709551615]", UInt64.max), ("socket:(1]", nil),
        ("Socket:[1]", nil), ("socket:[1]x", nil), ("", nil),
    ])
    func socketLinks(link: String, inode: UInt64?) {
        #expect(Array(link.utf8).withUnsafeBytes { ClientProcess.socketInode(link: $0) } == inode)
    }

    @Test(arguments: [
        ("1", 1), ("4194304", 4_194_304), ("self", nil), ("0", nil), ("01", nil), ("", nil), ("12345678901", nil),
    ])
    func procEntries(name: String, pid: Int?) {
        #expect(Array(name.utf8).withUnsafeBytes { ClientProcess.pid(directoryName: $0) } == pid)
    }
}
