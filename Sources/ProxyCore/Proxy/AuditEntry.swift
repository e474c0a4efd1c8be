/// One line of the audit log (`state_dir/audit.log`, JSON lines): a use of a credential (a provider's token or a
/// static secret) with an origin. What it holds is chosen here, and it is never a secret, a token, a proof, a
/// query string or a body: the path is cut at its `?`, the credential is named by its provider or its source.
public struct AuditEntry: Sendable, Equatable {
    /// Seconds since the epoch (UTC).
    public var time: Int64
    public var origin: String
    public var method: String
    /// The request's path, without its query.
    public var path: String
    /// The provider, or the static secret's source (`secret_file:PATH`, `secret_command:PROGRAM`, `secret:NAME`).
    public var credential: String
    /// `token` or `secret`.
    public var kind: String
    public var status: Int
    public var attempts: Int
    public var refreshed: Bool
    /// The client's own credential field was replaced.
    public var replacedClientCredential: Bool
    /// The client sent the origin's placeholder.
    public var placeholder: Bool
    /// The user whose process sent the request, when the kernel said so.
    public var uid: Int?
    /// The process that sent it and its executable, where the kernel names them (`ClientProcess`).
    public var pid: Int?
    public var executable: String?
    /// The client's address and port.
    public var client: String
    /// Why the proxy refused the request instead of attaching the credential (`placeholder`: it carried the
    /// placeholder of `placeholderOf`, exported as `placeholderEnv`); nil for a use.
    public var refused: String?
    public var placeholderOf: String?
    public var placeholderEnv: String?

    public init(
        time: Int64, origin: String, method: String, path: String, credential: String, kind: String, status: Int,
        attempts: Int, refreshed: Bool, replacedClientCredential: Bool, placeholder: Bool, uid: Int?, client: String,
        process: ClientProcess? = nil
    ) {
        self.time = time
        self.origin = origin
        self.method = method
        self.path = path
        self.credential = credential
        self.kind = kind
        self.status = status
        self.attempts = attempts
        self.refreshed = refreshed
        self.replacedClientCredential = replacedClientCredential
        self.placeholder = placeholder
        self.uid = uid
        self.client = client
        pid = process?.pid
        executable = process?.executable
    }

    /// The entry of an exchange in which the proxy attached its credential; nil when it attached none.
    public init?(_ record: ExchangeRecord, time: Int64, uid: Int?, process: ClientProcess? = nil, client: String) {
        guard record.attached else { return nil }
        self.init(
            time: time, origin: record.origin, method: record.method, path: Self.pathOnly(record.target),
            credential: record.provider, kind: record.staticSecret ? "secret" : "token", status: record.status,
            attempts: record.attempts, refreshed: record.refreshed,
            replacedClientCredential: record.clientCredentialReplaced, placeholder: record.placeholderUsed, uid: uid,
            client: client, process: process)
    }

    /// The entry of a request refused for carrying another origin's placeholder: a refused use (403, nothing
    /// sent) of that origin's credential, at the origin the request went to. The placeholder is not in it.
    public init(_ use: RefusedCredentialUse, time: Int64, uid: Int?, process: ClientProcess? = nil, client: String) {
        let refusal = use.refusal
        self.init(
            time: time, origin: use.origin, method: use.method, path: Self.pathOnly(use.target),
            credential: refusal.credential, kind: refusal.staticSecret ? "secret" : "token", status: 403, attempts: 0,
            refreshed: false, replacedClientCredential: false, placeholder: true, uid: uid, client: client,
            process: process)
        refused = "placeholder"
        placeholderOf = refusal.origin
        placeholderEnv = refusal.variable
    }

    /// The target's path: without its query or fragment (a query may carry a key: `?api_key=...`), and without
    /// the scheme and authority of an absolute-form target (a request to a loopback `http://` origin).
    public static func pathOnly(_ target: String) -> String {
        var path: [UInt8] = []
        for byte in target.utf8 {
            if byte == UInt8(ascii: "?") || byte == UInt8(ascii: "#") { break }
            path.append(byte)
        }
        if path.first != UInt8(ascii: "/"), let colon = path.firstIndex(of: UInt8(ascii: ":")),
            path[colon...].starts(with: Array("://".utf8))
        {
            let authority = colon + 3
            path = Array(path[(path[authority...].firstIndex(of: UInt8(ascii: "/")) ?? path.endIndex)...])
            if path.isEmpty { path = [UInt8(ascii: "/")] }
        }
        return String(decoding: path, as: UTF8.self)
    }

    /// `2026-01-02T03:04:05Z` for `seconds` since the epoch (UTC; proleptic Gregorian).
    public static func timestamp(_ seconds: Int64) -> String {
        let days = seconds >= 0 ? seconds / 86400 : (seconds - 86399) / 86400
        let rest = seconds - days * 86400
        // Howard Hinnant's civil_from_days.
        let z = days + 719_468
        let era = (z >= 0 ? z : z - 146_096) / 146_097
        let doe = z - era * 146_097
        let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100)
        let mp = (5 * doy + 2) / 153
        let day = doy - (153 * mp + 2) / 5 + 1
        let month = mp < 10 ? mp + 3 : mp - 9
        let year = yoe + era * 400 + (month <= 2 ? 1 : 0)
        func pad(_ value: Int64, _ width: Int) -> String {
            let text = String(value)
            return String(repeating: "0", count: max(0, width - text.count)) + text
        }
        return
            "\(pad(year, 4))-\(pad(month, 2))-\(pad(day, 2))T\(pad(rest / 3600, 2)):\(pad(rest / 60 % 60, 2)):\(pad(rest % 60, 2))Z"
    }

    /// The JSON line (without its newline).
    public var json: String {
        var members: [(String, JSONValue)] = [
            ("time", .string(Self.timestamp(time))), ("ts", .int(time)), ("origin", .string(origin)),
            ("method", .string(method)), ("path", .string(path)), ("credential", .string(credential)),
            ("kind", .string(kind)), ("status", .int(Int64(status))), ("attempts", .int(Int64(attempts))),
            ("refreshed", .bool(refreshed)), ("client_credential_replaced", .bool(replacedClientCredential)),
            ("placeholder", .bool(placeholder)),
        ]
        if let refused {
            members.append(("refused", .string(refused)))
            if let placeholderOf { members.append(("placeholder_of", .string(placeholderOf))) }
            if let placeholderEnv { members.append(("placeholder_env", .string(placeholderEnv))) }
        }
        if let uid { members.append(("uid", .int(Int64(uid)))) }
        if let pid { members.append(("pid", .int(Int64(pid)))) }
        if let executable { members.append(("executable", .string(executable))) }
        members.append(("client", .string(client)))
        return JSON.serialize(.object(JSONObject(members)))
    }

    /// An entry read back from its line; nil for a line that is not one (a torn line at a crash, say).
    public static func parse(_ line: some StringProtocol) -> AuditEntry? {
        guard case .success(.object(let object)) = JSON.parse(String(line)),
            case .number(let ts)? = object["ts"], let time = Int64(ts),
            case .string(let origin)? = object["origin"], case .string(let method)? = object["method"],
            case .string(let path)? = object["path"], case .string(let credential)? = object["credential"],
            case .number(let status)? = object["status"]
        else { return nil }
        var uid: Int? = nil
        if case .number(let text)? = object["uid"] { uid = Int(text) }
        func flag(_ key: String) -> Bool { if case .bool(true)? = object[key] { true } else { false } }
        var kind = "token"
        if case .string(let given)? = object["kind"] { kind = given }
        var attempts = 1
        if case .number(let text)? = object["attempts"] { attempts = Int(text) ?? 1 }
        var client = ""
        if case .string(let given)? = object["client"] { client = given }
        func text(_ key: String) -> String? { if case .string(let value)? = object[key] { value } else { nil } }
        var process: ClientProcess? = nil
        if case .number(let text)? = object["pid"] { process = ClientProcess(pid: Int(text), executable: nil) }
        if let executable = text("executable") {
            process = ClientProcess(pid: process?.pid, executable: executable)
        }
        var entry = AuditEntry(
            time: time, origin: origin, method: method, path: path, credential: credential, kind: kind,
            status: Int(status) ?? 0, attempts: attempts, refreshed: flag("refreshed"),
            replacedClientCredential: flag("client_credential_replaced"), placeholder: flag("placeholder"), uid: uid,
            client: client, process: process)
        entry.refused = text("refused")
        entry.placeholderOf = text("placeholder_of")
        entry.placeholderEnv = text("placeholder_env")
        return entry
    }

    /// One line for people.
    public var text: String {
        var notes: [String] = []
        if attempts > 1 { notes.append("attempts=\(attempts)") }
        if refreshed { notes.append("refreshed") }
        if replacedClientCredential { notes.append("client credential replaced") }
        if placeholder && refused == nil { notes.append("placeholder") }
        if let uid { notes.append("uid=\(uid)") }
        switch (pid, executable) {
        case (let pid?, let executable?): notes.append("pid=\(pid) \(executable)")
        case (let pid?, nil): notes.append("pid=\(pid)")
        case (nil, let executable?): notes.append(executable)
        case (nil, nil): break
        }
        let tail = notes.isEmpty ? "" : " (" + notes.joined(separator: ", ") + ")"
        let start = "\(Self.timestamp(time)) \(method) \(origin)\(path) \(status)"
        if refused == "placeholder", let placeholderOf {
            return
                "\(start) refused: the placeholder of \(placeholderOf) (\(placeholderEnv ?? "?")), for \(kind) \(credential)\(tail)"
        }
        if let refused { return "\(start) refused: \(refused), for \(kind) \(credential)\(tail)" }
        return "\(start) \(kind) \(credential)\(tail)"
    }
}
