import ProxyCore

/// `header = NAME: TEMPLATE` and the placeholder search (issue 31): outside input (proxy.conf, and every field of
/// intercepted requests). Invariants: a parsed header has a field-name, holds a credential part, and renders to a
/// value of visible ASCII and spaces whatever the credential (when the credential is such); the placeholder search
/// finds a placeholder wherever it is put into the input, plainly or in a Basic value, and never finds one in input
/// without its prefix (unless the input was a Basic value).
public func fuzzCredentials(_ data: UnsafeBufferPointer<UInt8>) {
    let input = Array(data)
    let text = String(decoding: input, as: UTF8.self)
    for kind in [CredentialKind.secret, .token] {
        guard case .success(let header) = CredentialHeader.parse(text, kind: kind) else { continue }
        invariant(
            !header.name.isEmpty && header.name.utf8.allSatisfy { $0 > 0x20 && $0 < 0x7F && $0 != 0x3A },
            "a header name that is no field-name: \(header.name.debugDescription)")
        invariant(!header.parts.isEmpty, "a header without parts")
        let value = header.render(credential: Array("c-r-e-d".utf8), scheme: "Bearer") { _ in Array("file".utf8) }
        invariant(
            value.allSatisfy { $0 == 0x20 || $0 == 0x09 || ($0 > 0x20 && $0 < 0x7F) },
            "a rendered value with bytes a field cannot carry")
        invariant(
            !header.usesCredential || header.parts.contains(where: { if case .secretFile = $0 { true } else { false } })
                || String(decoding: value, as: UTF8.self).contains("c-r-e-d")
                || header.parts.contains(where: { if case .basic = $0 { true } else { false } }),
            "a template using the credential rendered without it")
    }

    let entry = Placeholders.Entry(
        value: Array("proxyctl-placeholder-0123456789abcdef0123456789abcdef".utf8), origin: "https://a.test",
        variable: "A_KEY")
    let table = Placeholders([entry])
    let found = table.find(in: input)
    let hasPrefix = text.contains(Placeholders.prefix)
    let lowered = String(decoding: input.prefix(6).map { $0 | 0x20 }, as: UTF8.self)
    invariant(found == nil || hasPrefix || lowered.hasPrefix("basic"), "a placeholder found where none is")
    // Put in anywhere, it is found.
    let cut = input.isEmpty ? 0 : Int(input[0]) % (input.count + 1)
    let planted = Array(input[..<cut]) + entry.value + Array(input[cut...])
    invariant(table.find(in: planted) == entry, "a planted placeholder not found")
    let basic = Array("Basic ".utf8) + Array(Base64.encode(Array("user:".utf8) + entry.value).utf8)
    invariant(table.find(in: basic) == entry, "a placeholder in a Basic value not found")
}
