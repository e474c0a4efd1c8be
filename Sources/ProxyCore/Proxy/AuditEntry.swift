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

    /// The entry of a request refused for carrying another origin's placeholder: a refused use (403, nothing
    /// sent) of that origin's credential, at the origin the request went to. The placeholder is not in it.
    public init(_ use: RefusedCredentialUse, time: Int64, uid: Int?, process: ClientProcess? = nil, client: String) {
        let refusal = use.refusal
        self.init(
            time: time, origin: use.origin, method: use.method, path: Self.pathOnly(use.target),
            credential: refusal.credential, kind: Self.kind(staticSecret: refusal.staticSecret), status: 403,
            attempts: 0,
            refreshed: false, replacedClientCredential: false, placeholder: true, uid: uid, client: client,
            process: process)
        refused = "placeholder"
        placeholderOf = refusal.origin
        placeholderEnv = refusal.variable
    }

    /// The target's path: without its query or fragment (a query may carry a key: `?api_key=...`), and without
    /// the scheme and authority of an absolute-form target (a request to a loopback `http://` origin).
    public static func pathOnly(_ target: String) -> String {
        var target = target
        // The usual origin-form target: itself, or up to its query.
        let originForm = target.withUTF8 { utf8 -> String? in
            guard let end = originFormPathEnd(utf8) else { return nil }
            guard end < utf8.count else { return "" }
            return String(decoding: UnsafeBufferPointer(rebasing: utf8[..<end]), as: UTF8.self)
        }
        if let originForm { return originForm.isEmpty ? target : originForm }
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
        String(decoding: ByteWriter.bytes(atMost: timestampBound) { writeTimestamp(seconds, to: &$0) }, as: UTF8.self)
    }

    /// The most bytes a timestamp takes (a year of Int64's range, a sign).
    private static let timestampBound = 48

    /// `timestamp(seconds)`'s bytes.
    static func writeTimestamp(_ seconds: Int64, to out: inout ByteWriter) {
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
        out.write(decimal: year, width: 4)
        out.write(UInt8(ascii: "-"))
        out.write(decimal: month, width: 2)
        out.write(UInt8(ascii: "-"))
        out.write(decimal: day, width: 2)
        out.write(UInt8(ascii: "T"))
        out.write(decimal: rest / 3600, width: 2)
        out.write(UInt8(ascii: ":"))
        out.write(decimal: rest / 60 % 60, width: 2)
        out.write(UInt8(ascii: ":"))
        out.write(decimal: rest % 60, width: 2)
        out.write(UInt8(ascii: "Z"))
    }

    /// The JSON line (without its newline).
    public var json: String {
        var line = jsonLine
        line.removeLast()
        return String(decoding: line, as: UTF8.self)
    }

    /// The JSON line's bytes with its newline, as the audit log appends them (`AuditLines`): written member by
    /// member into memory sized for it (strings escaped by `ByteWriter.jsonString`), the members in the order
    /// `parse` and the readers of the file know. Built as a `JSONObject` and serialised, the line took more
    /// instructions than the rest of the intercepted request it records (`scripts/instructions`).
    public var jsonLine: [UInt8] {
        let bound =
            Self.stampBound
            + Self.membersBound(
                origin: origin, method: method, path: path, credential: credential, kind: kind, refused: refused,
                placeholderOf: placeholderOf, placeholderEnv: placeholderEnv, executable: executable, client: client)
        return ByteWriter.bytes(atMost: bound) { out in
            Self.writeStamp(time, to: &out)
            writeMembers(to: &out)
        }
    }

    /// This entry's members after the stamp, and the line's end.
    func writeMembers(to out: inout ByteWriter) {
        Self.writeMembers(
            to: &out, origin: origin, method: method, path: path, pathIsTarget: false, credential: credential,
            kind: kind, status: status, attempts: attempts, refreshed: refreshed,
            replacedClientCredential: replacedClientCredential, placeholder: placeholder, refused: refused,
            placeholderOf: placeholderOf, placeholderEnv: placeholderEnv, uid: uid, pid: pid, executable: executable,
            client: client)
    }

    /// `kind` of a use: a provider's token or a static secret.
    static func kind(staticSecret: Bool) -> String { staticSecret ? "secret" : "token" }

    /// The most bytes `writeStamp` writes.
    static let stampBound = 96

    /// A line's start, the same for every line of one second: `{"time":"2026-01-02T03:04:05Z","ts":1767323045`.
    static func writeStamp(_ time: Int64, to out: inout ByteWriter) {
        out.write(#"{"time":""#)
        writeTimestamp(time, to: &out)
        out.write(#"","ts":"#)
        out.write(decimal: time)
    }

    /// The most bytes `writeMembers` writes for these strings: the names, punctuation and numbers (under 512
    /// bytes) and each string at its longest escaped.
    static func membersBound(
        origin: String, method: String, path: String, credential: String, kind: String, refused: String?,
        placeholderOf: String?, placeholderEnv: String?, executable: String?, client: String
    ) -> Int {
        var bound = 512 + ByteWriter.jsonStringBound(origin) + ByteWriter.jsonStringBound(method)
        bound += ByteWriter.jsonStringBound(path) + ByteWriter.jsonStringBound(credential)
        bound += ByteWriter.jsonStringBound(kind) + ByteWriter.jsonStringBound(client)
        if let refused { bound += ByteWriter.jsonStringBound(refused) }
        if let placeholderOf { bound += ByteWriter.jsonStringBound(placeholderOf) }
        if let placeholderEnv { bound += ByteWriter.jsonStringBound(placeholderEnv) }
        if let executable { bound += ByteWriter.jsonStringBound(executable) }
        return bound
    }

    /// The one writer of a line's members after its stamp, for an entry and for an exchange's record. With
    /// `pathIsTarget`, `path` is a request target and its path is written (`pathOnly`; an origin-form target's
    /// bytes up to its query, without making a string of them).
    static func writeMembers(
        to out: inout ByteWriter, origin: String, method: String, path: String, pathIsTarget: Bool,
        credential: String, kind: String, status: Int, attempts: Int, refreshed: Bool,
        replacedClientCredential: Bool, placeholder: Bool, refused: String?, placeholderOf: String?,
        placeholderEnv: String?, uid: Int?, pid: Int?, executable: String?, client: String
    ) {
        out.write(#","origin":"#)
        out.jsonString(origin)
        out.write(#","method":"#)
        out.jsonString(method)
        out.write(#","path":"#)
        if pathIsTarget { writePath(of: path, to: &out) } else { out.jsonString(path) }
        out.write(#","credential":"#)
        out.jsonString(credential)
        out.write(#","kind":"#)
        out.jsonString(kind)
        out.write(#","status":"#)
        out.write(decimal: status)
        out.write(#","attempts":"#)
        out.write(decimal: attempts)
        out.write(#","refreshed":"#)
        out.write(refreshed ? "true" as StaticString : "false")
        out.write(#","client_credential_replaced":"#)
        out.write(replacedClientCredential ? "true" as StaticString : "false")
        out.write(#","placeholder":"#)
        out.write(placeholder ? "true" as StaticString : "false")
        if let refused {
            out.write(#","refused":"#)
            out.jsonString(refused)
            if let placeholderOf {
                out.write(#","placeholder_of":"#)
                out.jsonString(placeholderOf)
            }
            if let placeholderEnv {
                out.write(#","placeholder_env":"#)
                out.jsonString(placeholderEnv)
            }
        }
        if let uid {
            out.write(#","uid":"#)
            out.write(decimal: uid)
        }
        if let pid {
            out.write(#","pid":"#)
            out.write(decimal: pid)
        }
        if let executable {
            out.write(#","executable":"#)
            out.jsonString(executable)
        }
        out.write(#","client":"#)
        out.jsonString(client)
        out.write("}\n")
    }

    /// `pathOnly(target)` as a JSON string: the usual origin-form target's bytes up to its query or fragment,
    /// written from the target's storage.
    private static func writePath(of target: String, to out: inout ByteWriter) {
        var target = target
        let written = target.withUTF8 { utf8 -> Bool in
            guard let end = originFormPathEnd(utf8) else { return false }
            out.jsonString(UnsafeBufferPointer(rebasing: utf8[..<end]))
            return true
        }
        if !written { out.jsonString(pathOnly(target)) }
    }

    /// Where an origin-form target's path ends (its `?` or `#`, or its end); nil for a target of another form.
    private static func originFormPathEnd(_ utf8: UnsafeBufferPointer<UInt8>) -> Int? {
        guard utf8.first == UInt8(ascii: "/") else { return nil }
        return utf8.firstIndex(where: { $0 == UInt8(ascii: "?") || $0 == UInt8(ascii: "#") }) ?? utf8.count
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
