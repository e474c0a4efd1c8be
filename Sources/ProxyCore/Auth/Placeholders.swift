/// The placeholder values `proxyctl env` and `exec` hand to tools in place of real keys (`placeholder_env`), and
/// which origin each belongs to: the proxy swaps one for the secret only in the credential fields of a request to
/// its own origin, and refuses a request to any other protected origin that carries one anywhere (a confused or
/// hostile tool sending a key where it does not belong).
///
/// Looking for them is a parser of outside input (every field value and target of intercepted requests): pure,
/// tested by tables and fuzzed by `FuzzPlaceholders`.
public struct Placeholders: Sendable, Equatable {
    /// Every placeholder starts so: visibly not a key, and one search finds any of them.
    public static let prefix = "proxyctl-placeholder-"
    static let prefixBytes = Array(prefix.utf8)

    public struct Entry: Sendable, Equatable {
        /// The whole placeholder (`proxyctl-placeholder-` and lower-case hex).
        public let value: [UInt8]
        /// The origin it stands in for (`OriginConfig.url`).
        public let origin: String
        /// The variable it is exported as.
        public let variable: String
        /// The credential it stands in for (`OriginConfig.credentialName`: the provider, or the secret's source),
        /// and whether that is a static secret: what the audit line of a request refused for carrying it names.
        public let credential: String
        public let staticSecret: Bool

        public init(
            value: [UInt8], origin: String, variable: String, credential: String = "", staticSecret: Bool = true
        ) {
            self.value = value
            self.origin = origin
            self.variable = variable
            self.credential = credential
            self.staticSecret = staticSecret
        }
    }

    public let entries: [Entry]

    public init(_ entries: [Entry] = []) { self.entries = entries }

    public var isEmpty: Bool { entries.isEmpty }

    /// The placeholder found in `bytes` (anywhere), if any. Values of `Authorization: Basic ...` are also
    /// decoded (RFC 7617: a tool given a placeholder as its password sends it in base64).
    public func find(in bytes: some Collection<UInt8>) -> Entry? {
        guard !entries.isEmpty else { return nil }
        if let found = findPlain(bytes) { return found }
        return findInBasic(bytes)
    }

    private func findPlain(_ bytes: some Collection<UInt8>) -> Entry? {
        let array = Array(bytes)
        let prefix = Self.prefixBytes
        guard array.count >= prefix.count else { return nil }
        var start = 0
        while start + prefix.count <= array.count {
            guard let first = array[start...].firstIndex(of: prefix[0]), first + prefix.count <= array.count else {
                return nil
            }
            if array[first..<(first + prefix.count)].elementsEqual(prefix) {
                for entry in entries where first + entry.value.count <= array.count {
                    if array[first..<(first + entry.value.count)].elementsEqual(entry.value) { return entry }
                }
            }
            start = first + 1
        }
        return nil
    }

    /// `Basic <base64>` (any case, any spaces after the scheme): the decoded `user:password` searched.
    private func findInBasic(_ bytes: some Collection<UInt8>) -> Entry? {
        let array = Array(bytes)
        guard array.count > 6, ASCII.equalsLowercase(array[0..<5], "basic"),
            array[5] == ASCII.space || array[5] == ASCII.tab
        else { return nil }
        var rest = array[6...]
        while let first = rest.first, first == ASCII.space || first == ASCII.tab { rest.removeFirst() }
        while let last = rest.last, last == ASCII.space || last == ASCII.tab { rest.removeLast() }
        guard rest.count <= 8192, let decoded = Base64.decode(String(decoding: rest, as: UTF8.self)) else {
            return nil
        }
        return findPlain(decoded)
    }

    /// The placeholder of `origin`, if it has one.
    public func entry(for origin: String) -> Entry? { entries.first { $0.origin == origin } }
}

/// What a request's fields say about credentials, for one protected origin: whether the client sent a credential
/// field of its own (not the origin's placeholder), and any placeholder of another origin.
public struct CredentialScan: Sendable, Equatable {
    /// A field the origin's credential goes in, holding something other than the origin's placeholder.
    public var clientCredential = false
    /// A credential field held the origin's own placeholder (the proxy puts the secret in its place).
    public var placeholderUsed = false
    /// A placeholder of another origin, found in a field or the target: the request is refused.
    public var foreign: Placeholders.Entry?

    public init() {}
}

/// A request to one protected origin refused for carrying the placeholder of another (issue 31): the reason the
/// client is told (`Proxy-Status`), and whose placeholder it was, without the placeholder itself. The audit log
/// records it as a refused use of that origin's credential (`RefusedCredentialUse`).
public struct PlaceholderRefusal: Sendable, Equatable {
    /// What `Proxy-Status` says (`OriginConfig.credentialRefusal`).
    public let reason: String
    /// The origin the placeholder belongs to, the variable it is exported as, and that origin's credential.
    public let origin: String
    public let variable: String
    public let credential: String
    public let staticSecret: Bool

    public init(reason: String, owner: Placeholders.Entry) {
        self.reason = reason
        origin = owner.origin
        variable = owner.variable
        credential = owner.credential
        staticSecret = owner.staticSecret
    }
}

/// A request refused because of a credential it carried, as the audit log records it: where it went and what it
/// asked (the target's query is cut when the line is made), and the placeholder refusal. The I/O layer adds the
/// client (address, user, process) and writes the line.
public struct RefusedCredentialUse: Sendable, Equatable {
    /// The protected origin the request was sent to (`OriginConfig.url`).
    public let origin: String
    public let method: String
    public let target: String
    public let refusal: PlaceholderRefusal

    public init(origin: String, method: String, target: String, refusal: PlaceholderRefusal) {
        self.origin = origin
        self.method = method
        self.target = target
        self.refusal = refusal
    }
}
