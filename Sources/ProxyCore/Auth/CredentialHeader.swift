/// One field the proxy attaches to requests for an origin (`header = NAME: TEMPLATE` in `[origin]`): its name
/// and a template of literal text and the credential's parts. Parsed once from proxy.conf (outside input: pure,
/// tested by tables and fuzzed by `FuzzCredentialHeader`); made into a value by the I/O layer, the one place that
/// holds the secret (`render`).
public struct CredentialHeader: Sendable, Equatable, Hashable {
    /// A piece of the template.
    public enum Part: Sendable, Equatable, Hashable {
        /// Text as written (visible ASCII, spaces and tabs).
        case literal([UInt8])
        /// The origin's credential: the static secret, or the OAuth access token (`{secret}`, `{token}`).
        case credential
        /// The first line of a file of the user's own (0600): `{secret_file:PATH}`.
        case secretFile(String)
        /// `Basic base64(USER:credential)` (RFC 7617): `{basic:USER}`.
        case basic(user: String)
        /// The token's scheme, `Bearer` or `DPoP` (RFC 9449 §7): only in the default field, which config cannot
        /// spell.
        case scheme
    }

    /// The field name as written (sent as written; compared without case).
    public let name: String
    public let parts: [Part]

    public init(name: String, parts: [Part]) {
        self.name = name
        self.parts = parts
    }

    /// `Authorization: Bearer <token>` (RFC 6750 §2.1), or `Authorization: DPoP <token>` with a proof for a token
    /// bound to a key: what an origin gets when it names no `header`.
    public static let authorizationDefault = CredentialHeader(
        name: "Authorization", parts: [.scheme, .literal([ASCII.space]), .credential])

    /// The field name in lower case, for comparing with the client's fields.
    public var lowercasedName: String { String(decoding: name.utf8.map(ASCII.lower), as: UTF8.self) }

    /// The files the template reads (`{secret_file:PATH}`).
    public var files: [String] {
        parts.compactMap { if case .secretFile(let path) = $0 { path } else { nil } }
    }

    /// Whether the template uses the origin's own credential (`{secret}`, `{token}`, `{basic:USER}`).
    public var usesCredential: Bool {
        parts.contains { part in
            switch part {
            case .credential, .basic, .scheme: true
            case .literal, .secretFile: false
            }
        }
    }

    /// Field names a template may not set: the message's framing and routing, and the proxy's own hop-by-hop
    /// fields (RFC 9110 §7.6.1); a DPoP proof is the proxy's to make.
    static let reserved: Set<String> = [
        "host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer", "upgrade",
        "proxy-authorization", "proxy-authenticate", "proxy-connection", "expect", "dpop",
    ]

    /// The placeholders a template may hold, for messages.
    static let spelling = "{secret}, {token}, {secret_file:PATH} or {basic:USER}"

    /// Parses `NAME: TEMPLATE`. `kind` says which credential the origin has: `{secret}` is for a static secret,
    /// `{token}` for a provider's token. `resolvePath` makes a relative `{secret_file:PATH}` absolute.
    public static func parse(
        _ text: String, kind: CredentialKind, resolvePath: (String) -> String = { $0 }
    ) -> Result<CredentialHeader, ValueError> {
        let bytes = Array(text.utf8)
        guard let colon = bytes.firstIndex(of: ASCII.colon) else {
            return .failure("expected NAME: TEMPLATE, such as X-API-Key: {secret}")
        }
        let name = bytes[..<colon]
        guard !name.isEmpty, name.allSatisfy(ASCII.isTchar) else {
            return .failure("expected a field name (letters, digits and -) before the colon, such as X-API-Key")
        }
        let nameText = String(decoding: name, as: UTF8.self)
        let lower = String(decoding: name.map(ASCII.lower), as: UTF8.self)
        guard !reserved.contains(lower) else {
            return .failure("\(nameText) is not a credential field; the proxy sets it itself or it frames the message")
        }
        var template = bytes[(colon + 1)...]
        while let first = template.first, first == ASCII.space || first == ASCII.tab { template.removeFirst() }
        while let last = template.last, last == ASCII.space || last == ASCII.tab { template.removeLast() }
        var parts: [Part] = []
        var literal: [UInt8] = []
        var index = template.startIndex
        while index < template.endIndex {
            let byte = template[index]
            if byte == UInt8(ascii: "{") {
                guard let close = template[index...].firstIndex(of: UInt8(ascii: "}")) else {
                    return .failure("a { without its }: write \(spelling)")
                }
                let inner = String(decoding: template[(index + 1)..<close], as: UTF8.self)
                let part: Part
                switch inner {
                case "secret":
                    guard kind == .secret else {
                        return .failure("this origin's credential is its provider's token: write {token}")
                    }
                    part = .credential
                case "token":
                    guard kind == .token else {
                        return .failure("this origin's credential is a static secret: write {secret}")
                    }
                    part = .credential
                case _ where inner.hasPrefix("secret_file:"):
                    let path = String(inner.dropFirst("secret_file:".count))
                    guard !path.isEmpty else { return .failure("expected {secret_file:PATH} with a file path") }
                    part = .secretFile(resolvePath(path))
                case _ where inner.hasPrefix("basic:"):
                    let user = String(inner.dropFirst("basic:".count))
                    guard !user.utf8.contains(ASCII.colon), user.utf8.allSatisfy(isLiteral) else {
                        return .failure("the user of {basic:USER} may not hold a colon (RFC 7617 §2)")
                    }
                    part = .basic(user: user)
                default:
                    return .failure("unknown {\(INIDocument.clip(inner))}: write \(spelling)")
                }
                if !literal.isEmpty {
                    parts.append(.literal(literal))
                    literal = []
                }
                parts.append(part)
                index = close + 1
                continue
            }
            guard isLiteral(byte), byte != UInt8(ascii: "}") else {
                return .failure(
                    "the template may hold visible ASCII, spaces and \(spelling); a } needs its {")
            }
            literal.append(byte)
            index += 1
        }
        if !literal.isEmpty { parts.append(.literal(literal)) }
        guard parts.contains(where: { if case .literal = $0 { false } else { true } }) else {
            return .failure("the template holds no credential: write \(spelling) in it, such as Bearer {secret}")
        }
        return .success(CredentialHeader(name: nameText, parts: parts))
    }

    /// Visible ASCII, space and tab (RFC 9110 §5.5 field-vchar without obs-text: a credential field is ASCII).
    static func isLiteral(_ byte: UInt8) -> Bool {
        byte == ASCII.space || byte == ASCII.tab || (byte > 0x20 && byte < 0x7F)
    }

    /// The field value: `credential` where the template names it, `file(PATH)` for `{secret_file:PATH}`. Nothing
    /// here logs or keeps the value.
    public func render(
        credential: some Collection<UInt8>, scheme: String, file: (String) throws -> [UInt8]
    ) rethrows -> [UInt8] {
        var value: [UInt8] = []
        for part in parts {
            switch part {
            case .literal(let bytes): value += bytes
            case .credential: value += credential
            case .scheme: value += scheme.utf8
            case .secretFile(let path): value += try file(path)
            case .basic(let user):
                value += "Basic ".utf8
                value += Base64.encode(Array(user.utf8) + [ASCII.colon] + Array(credential)).utf8
            }
        }
        return value
    }
}

/// What an origin's credential is: a provider's token (OAuth) or a static secret.
public enum CredentialKind: Sendable, Equatable, Hashable {
    case token
    case secret
}

/// Where an origin's static secret comes from (`secret_file`, `secret_command`, `secret`).
public enum SecretSource: Sendable, Equatable, Hashable {
    /// The first line of a file of the user's own, readable by nobody else.
    case file(String)
    /// The first line a command prints, run without a shell; kept for `ttl` seconds, run again after a 401.
    case command([String], ttl: Int)
    /// A secret `proxyctl secret set NAME` stored (the Secret Service, or a 0600 file in the state directory).
    case stored(String)

    /// How the secret is named where it is used (the access log, the audit log, the metrics): never its value.
    public var name: String {
        switch self {
        case .file(let path): "secret_file:" + path
        case .command(let words, _):
            // The program's name only: its arguments may hold anything (a vault path, an account).
            "secret_command:" + String((words.first ?? "").split(separator: "/").last ?? "")
        case .stored(let name): "secret:" + name
        }
    }
}
