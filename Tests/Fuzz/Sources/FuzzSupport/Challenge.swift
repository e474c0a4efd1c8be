import ProxyCore

/// Each line of the input is one `WWW-Authenticate` field value. The challenges parsed from them are checked,
/// written back in many equivalent ways (case, whitespace, empty list elements, split across field lines)
/// and parsed again, compared with an independent reading of the grammar, and fed to `AuthExchange`.
public func fuzzChallenge(_ data: UnsafeBufferPointer<UInt8>) {
    let input = Array(data)
    let values = input.split(separator: 0x0A, omittingEmptySubsequences: false).map { line in
        String(decoding: line.last == 0x0D ? line.dropLast() : line, as: UTF8.self)
    }
    let challenges = ChallengeParser.parse(values)
    invariant(challenges == values.flatMap { ChallengeParser.parse($0) }, "a list parses unlike its lines")
    challenges.forEach(checkChallenge)
    checkParameters(challenges)
    for value in values {
        if let expected = ReferenceChallenges.parse(Array(value.utf8)) {
            let parsed = ChallengeParser.parse(value)
            invariant(
                parsed == expected,
                "\(value.prefix(200).debugDescription) parses to \(describe(parsed)), the grammar says \(describe(expected))"
            )
        }
    }

    var plain: InputRandom? = nil
    checkRendering(render(challenges, random: &plain), challenges: challenges, what: "written back")
    var random: InputRandom? = InputRandom(input, salt: 0x51)
    for _ in 0..<2 {
        checkRendering(render(challenges, random: &random), challenges: challenges, what: "written back differently")
    }
    exchange(challenges, random: &random!)
}

/// The parameters proxyctl acts on (RFC 9728 §5.1 `resource_metadata`, RFC 6750 §3 `scope` and `insufficient_scope`):
/// a URL named is one a metadata fetch takes (https or loopback http, URL characters only), from a Bearer or DPoP
/// challenge that has it; scopes are scope tokens from such a challenge's `scope`, and insufficient_scope only
/// with that error.
private func checkParameters(_ challenges: [Challenge]) {
    if let url = challenges.resourceMetadata {
        invariant(MetadataURL.problem(url, allowQuery: true) == nil, "resource_metadata \(url.debugDescription)")
        invariant(
            challenges.contains { ($0.scheme == "bearer" || $0.scheme == "dpop") && $0["resource_metadata"] == url },
            "resource_metadata \(url.debugDescription) from no Bearer or DPoP challenge")
        // RFC 3986 §3.1: a scheme is case-insensitive ("HTTPS://" is an https URL, and libcurl reads it so).
        let lowered = url.lowercased()
        invariant(lowered.hasPrefix("https://") || lowered.hasPrefix("http://"), "not a web URL: \(url)")
    }
    for challenge in challenges {
        if let scopes = challenge.insufficientScope {
            invariant(challenge["error"] == "insufficient_scope", "insufficient_scope without the error")
            invariant(!scopes.isEmpty && scopes.allSatisfy(ScopeText.isScopeToken), "scopes \(scopes)")
            invariant(Set(scopes).count == scopes.count, "a scope twice: \(scopes)")
            invariant(
                scopes.allSatisfy { scope in
                    challenge["scope"]?.split(separator: " ").contains(Substring(scope)) == true
                },
                "scopes not from the challenge's scope")
        }
    }
    if let scopes = challenges.scope {
        invariant(
            scopes.allSatisfy { !$0.contains(" ") && !$0.contains("\"") && ScopeText.isScopeToken($0) }, "\(scopes)")
    }
}

/// Scheme and parameter names are lower-case tokens; token68 and values hold only what the grammar allows.
private func checkChallenge(_ challenge: Challenge) {
    invariant(
        !challenge.scheme.isEmpty && challenge.scheme.utf8.allSatisfy { isTchar($0) && !($0 >= 0x41 && $0 <= 0x5A) },
        "scheme \(challenge.scheme.debugDescription)")
    if let token68 = challenge.token68 {
        invariant(isToken68(Array(token68.utf8)[...]), "token68 \(token68.debugDescription)")
        invariant(challenge.parameters.isEmpty, "token68 and parameters")
    }
    for (name, value) in challenge.parameters {
        invariant(
            !name.isEmpty && name.utf8.allSatisfy { isTchar($0) && !($0 >= 0x41 && $0 <= 0x5A) },
            "parameter name \(name.debugDescription)")
        invariant(
            value.utf8.allSatisfy { $0 == 0x09 || ($0 >= 0x20 && $0 != 0x7F) },
            "parameter value \(value.debugDescription)")
        invariant(challenge[name.uppercased()] != nil, "parameter \(name) not found by its upper-case name")
    }
}

/// Field values written from `challenges` parse back to them, also one by one, and the grammar agrees.
private func checkRendering(_ lines: [String], challenges: [Challenge], what: String) {
    let parsed = ChallengeParser.parse(lines)
    invariant(
        parsed == challenges,
        "\(what) as \(lines.map { $0.prefix(200) }), parses to \(describe(parsed)), not \(describe(challenges))")
    var fromReference: [Challenge] = []
    for line in lines {
        guard let expected = ReferenceChallenges.parse(Array(line.utf8)) else {
            return invariant(false, "\(what) as \(line.prefix(200).debugDescription), which the grammar rejects")
        }
        fromReference += expected
    }
    invariant(fromReference == challenges, "the grammar reads \(lines) as \(describe(fromReference))")
}

/// Writes challenges as field values. Without `random`: one line, single spaces, quoted values. With it:
/// random case in schemes and names, whitespace around "=" and ",", empty list elements, token or quoted
/// values, quoted-pairs, and challenges spread over several lines.
private func render(_ challenges: [Challenge], random: inout InputRandom?) -> [String] {
    func chance(_ percent: Int) -> Bool {
        guard var generator = random else { return false }
        defer { random = generator }
        return generator.next(in: 0...99) < percent
    }
    func spaces(_ percent: Int, tabs: Bool = true) -> String {
        var out = ""
        while chance(percent) { out += tabs && chance(30) ? "\t" : " " }
        return out
    }
    func mixedCase(_ text: String) -> String {
        String(decoding: text.utf8.map { $0 >= 0x61 && $0 <= 0x7A && chance(40) ? $0 - 0x20 : $0 }, as: UTF8.self)
    }
    func separator() -> String {
        var out = spaces(20) + ","
        while chance(15) { out += spaces(30) + "," }
        return out + spaces(40)
    }
    func quoted(_ value: String) -> String {
        var out = "\""
        for scalar in value.unicodeScalars {
            if scalar == "\"" || scalar == "\\" || (scalar.isASCII && scalar.value >= 0x20 && chance(5)) {
                out += "\\"
            }
            out.unicodeScalars.append(scalar)
        }
        return out + "\""
    }

    var lines: [String] = []
    var line = spaces(10) + (chance(10) ? "," + spaces(30) : "")
    for (index, challenge) in challenges.enumerated() {
        if index > 0 {
            if chance(30) {
                lines.append(line + (chance(10) ? separator() : ""))
                line = chance(10) ? separator() : ""
            } else {
                line += separator()
            }
        }
        line += mixedCase(challenge.scheme)
        if let token68 = challenge.token68 {
            line += " " + spaces(20, tabs: false) + token68
        } else if !challenge.parameters.isEmpty {
            line += " " + spaces(20, tabs: false)
            for (number, (name, value)) in challenge.parameters.enumerated() {
                if number > 0 { line += separator() }
                let bareToken = !value.isEmpty && value.utf8.allSatisfy(isTchar)
                line += mixedCase(name) + spaces(15) + "=" + spaces(15)
                line += bareToken && chance(50) ? value : quoted(value)
            }
        }
    }
    lines.append(line + (chance(10) ? separator() : ""))
    return lines
}

private func describe(_ challenges: [Challenge]) -> String {
    "["
        + challenges.map { challenge in
            var text = challenge.scheme
            if let token68 = challenge.token68 { text += " " + token68 }
            text += challenge.parameters.map { " \($0.name)=\($0.value.debugDescription)" }.joined(separator: ",")
            return text
        }.joined(separator: "; ") + "]"
}

private func isTchar(_ byte: UInt8) -> Bool {
    switch byte {
    case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"),
        UInt8(ascii: "0")...UInt8(ascii: "9"):
        return true
    default:
        return "!#$%&'*+-.^_`|~".utf8.contains(byte)
    }
}

/// token68 = 1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="
private func isToken68(_ bytes: ArraySlice<UInt8>) -> Bool {
    var index = bytes.startIndex
    while index < bytes.endIndex {
        let byte = bytes[index]
        let alphanumeric = (byte >= 0x30 && byte <= 0x39) || (byte | 0x20 >= 0x61 && byte | 0x20 <= 0x7A)
        guard alphanumeric || "-._~+/".utf8.contains(byte) else { break }
        index += 1
    }
    guard index > bytes.startIndex else { return false }
    return bytes[index...].allSatisfy { $0 == UInt8(ascii: "=") }
}

/// An independent reading of RFC 9110 §11.6.1 for well-formed field values only: the value is cut into
/// list elements at commas outside quoted strings; an element is `scheme`, `scheme 1*SP token68`,
/// `scheme 1*SP auth-param` or `auth-param` (continuing the challenge before it). Returns nil for anything
/// else, including the cases where the grammar leaves the meaning open (a parameter after a bare scheme or
/// a token68, HTAB after the scheme).
private enum ReferenceChallenges {
    static func parse(_ value: [UInt8]) -> [Challenge]? {
        var elements: [ArraySlice<UInt8>] = []
        var start = 0
        var index = 0
        var inQuotes = false
        while index < value.count {
            let byte = value[index]
            if inQuotes {
                if byte == UInt8(ascii: "\\") {
                    index += 2
                    continue
                }
                if byte == UInt8(ascii: "\"") { inQuotes = false }
            } else if byte == UInt8(ascii: "\"") {
                inQuotes = true
            } else if byte == UInt8(ascii: ",") {
                elements.append(value[start..<index])
                start = index + 1
            }
            index += 1
        }
        guard !inQuotes, index == value.count else { return nil }
        elements.append(value[start...])

        var result: [(scheme: String, token68: String?, parameters: [(name: String, value: String)])] = []
        var takesParameters = false
        for element in elements {
            let trimmed = trimOWS(element)
            if trimmed.isEmpty { continue }
            var cursor = trimmed.startIndex
            while cursor < trimmed.endIndex && isTchar(trimmed[cursor]) { cursor += 1 }
            guard cursor > trimmed.startIndex else { return nil }
            let first = String(decoding: trimmed[..<cursor], as: UTF8.self)
            if cursor == trimmed.endIndex {
                result.append((first, nil, []))
                takesParameters = false
                continue
            }
            let rest = trimmed[cursor...]
            if let equals = rest.firstIndex(where: { $0 != 0x20 && $0 != 0x09 }), rest[equals] == UInt8(ascii: "=") {
                guard takesParameters, let parameterValue = self.value(rest[(equals + 1)...]) else { return nil }
                result[result.count - 1].parameters.append((first, parameterValue))
                continue
            }
            guard rest.first == 0x20 else { return nil }
            let afterSpaces = rest.drop { $0 == 0x20 }
            guard afterSpaces.first != 0x09 else { return nil }
            if isToken68(afterSpaces) {
                result.append((first, String(decoding: afterSpaces, as: UTF8.self), []))
                takesParameters = false
                continue
            }
            var nameEnd = afterSpaces.startIndex
            while nameEnd < afterSpaces.endIndex && isTchar(afterSpaces[nameEnd]) { nameEnd += 1 }
            let afterName = afterSpaces[nameEnd...].drop { $0 == 0x20 || $0 == 0x09 }
            guard nameEnd > afterSpaces.startIndex, afterName.first == UInt8(ascii: "="),
                let parameterValue = self.value(afterName.dropFirst())
            else { return nil }
            result.append((first, nil, [(String(decoding: afterSpaces[..<nameEnd], as: UTF8.self), parameterValue)]))
            takesParameters = true
        }
        return result.map { Challenge(scheme: $0.scheme, token68: $0.token68, parameters: $0.parameters) }
    }

    /// BWS ( token / quoted-string ), filling the rest of the element.
    private static func value(_ text: ArraySlice<UInt8>) -> String? {
        let text = text.drop { $0 == 0x20 || $0 == 0x09 }
        guard let first = text.first else { return nil }
        if first != UInt8(ascii: "\"") {
            return text.allSatisfy(isTchar) ? String(decoding: text, as: UTF8.self) : nil
        }
        var out: [UInt8] = []
        var index = text.startIndex + 1
        while index < text.endIndex {
            let byte = text[index]
            switch byte {
            case UInt8(ascii: "\""):
                return index == text.endIndex - 1 ? String(decoding: out, as: UTF8.self) : nil
            case UInt8(ascii: "\\"):
                guard index + 1 < text.endIndex else { return nil }
                let escaped = text[index + 1]
                guard escaped == 0x09 || (escaped >= 0x20 && escaped != 0x7F) else { return nil }
                out.append(escaped)
                index += 2
            case 0x09, 0x20, 0x21, 0x23...0x5B, 0x5D...0x7E, 0x80...0xFF:
                out.append(byte)
                index += 1
            default:
                return nil
            }
        }
        return nil
    }

    private static func trimOWS(_ bytes: ArraySlice<UInt8>) -> ArraySlice<UInt8> {
        var trimmed = bytes
        while let first = trimmed.first, first == 0x20 || first == 0x09 { trimmed.removeFirst() }
        while let last = trimmed.last, last == 0x20 || last == 0x09 { trimmed.removeLast() }
        return trimmed
    }
}

// MARK: - AuthExchange

private let origin = "https://api.example.com"
private let failures: [TokenFailure] = [
    .signInNeeded(reason: "no tokens"), .unavailable(reason: "timed out", retryAfter: nil),
    .unavailable(reason: "503", retryAfter: 30), .unavailable(reason: "429", retryAfter: -3),
    .configuration(reason: "invalid_client"), .pending(reason: "no answer yet", retryAfter: 5),
    .storage(reason: "disk full"),
]

/// Drives an exchange with events derived from the input, always an event its last action asks for, until a
/// final action (`deliver` or `respond`): handing it anything after that is a precondition failure by
/// design, so "no action after a final one" means the loop ends there. At most 3 sends, 1 refresh, one
/// `getTokens` (the first action), and a final action within 8 steps.
private func exchange(_ parsed: [Challenge], random: inout InputRandom) {
    let replayable = random.next(in: 0...3) != 0
    let knownNonce: String? = random.nextBool() ? "known-nonce" : nil
    let checks = random.nextBool()
    var machine = AuthExchange(
        origin: origin, provider: "corp", replayable: replayable, knownNonce: knownNonce,
        checksResourceMetadata: checks)
    var metadataChecks = 0
    var action = machine.start()
    invariant(action == .getTokens, "the first action is \(action)")
    var sends = 0
    var refreshes = 0
    var generation: Int64 = -1
    var nonce = knownNonce
    var lastEvent: AuthExchange.Event? = nil
    for step in 1...9 {
        invariant(step <= 8, "no final action after 8 steps")
        let event: AuthExchange.Event
        switch action {
        case .getTokens:
            invariant(step == 1, "getTokens again at step \(step)")
            if random.next(in: 0...5) == 0 {
                event = .tokensFailed(failures[random.next(in: 0...(failures.count - 1))])
            } else {
                generation = Int64(random.next(in: 1...3))
                event = .tokens(generation: generation)
            }
        case .send(let sent, let sentNonce):
            sends += 1
            invariant(sends <= 3, "sent \(sends) times")
            invariant(replayable || sends == 1, "a request without a kept body sent \(sends) times")
            invariant(sent == generation, "sent generation \(sent), current \(generation)")
            invariant(
                sentNonce == nonce, "sent nonce \(String(describing: sentNonce)), current \(String(describing: nonce))")
            event = randomResponse(parsed, random: &random)
            if case .response(_, _, let dpopNonce) = event, let dpopNonce { nonce = dpopNonce }
        case .refresh(let replacing):
            refreshes += 1
            invariant(refreshes <= 1, "refreshed \(refreshes) times")
            invariant(replacing == generation, "refresh replacing \(replacing), current \(generation)")
            if random.next(in: 0...3) == 0 {
                event = .refreshFailed(failures[random.next(in: 0...(failures.count - 1))])
            } else {
                generation += Int64(random.next(in: 0...2))
                event = .refreshed(generation: generation)
            }
        case .checkResourceMetadata(let url):
            metadataChecks += 1
            invariant(checks && metadataChecks == 1, "checked the metadata \(metadataChecks) times (checks: \(checks))")
            invariant(MetadataURL.sameOrigin(url, origin), "fetches metadata at \(url) for \(origin)")
            guard case .response(401, let challenges, _) = lastEvent, challenges.resourceMetadata == url else {
                return invariant(false, "a check after \(String(describing: lastEvent))")
            }
            invariant(challenges.insufficientScope == nil, "a check of an insufficient_scope answer")
            let verdicts: [ResourceMetadataVerdict] = [
                .consistent, .otherServers(["https://login.other.example"]), .unknown("x"),
            ]
            event = .resourceMetadata(verdicts[random.next(in: 0...2)])
        case .deliver(let proxyStatus):
            if case .resourceMetadata(let verdict)? = lastEvent {
                if case .otherServers(let servers) = verdict {
                    invariant(
                        machine.otherServers == servers && proxyStatus?.error == .proxyConfigurationError
                            && proxyStatus?.details?.contains("proxyctl init --origin \(origin)") == true,
                        "another server delivered with \(String(describing: proxyStatus))")
                }
                invariant(proxyStatus?.receivedStatus == 401, "a checked 401 delivered without its Proxy-Status")
                return
            }
            guard case .response(let status, let challenges, _) = lastEvent else {
                return invariant(false, "deliver after \(String(describing: lastEvent))")
            }
            // RFC 6750 §3.1: a 401 or 403 naming the scope it lacks is surfaced like a step-up, never refreshed.
            let scoped = (status == 401 || status == 403) ? challenges.first { $0.insufficientScope != nil } : nil
            invariant(
                (status == 401 || scoped != nil) == (proxyStatus != nil),
                "deliver of a \(status) with \(String(describing: proxyStatus))")
            let stepUp = challenges.first { $0["error"] == "insufficient_user_authentication" }
            invariant(
                machine.stepUp == (scoped ?? (status == 401 ? stepUp : nil)),
                "stepUp \(String(describing: machine.stepUp))")
            if let proxyStatus {
                invariant(proxyStatus.receivedStatus == status, "Proxy-Status without received-status \(status)")
                invariant(
                    proxyStatus.fieldValue.utf8.allSatisfy { $0 >= 0x20 && $0 < 0x7F }, "Proxy-Status not printable")
            }
            return
        case .respond(let answer):
            let response = answer.response
            let failure: TokenFailure
            switch lastEvent {
            case .tokensFailed(let given)?, .refreshFailed(let given)?: failure = given
            default: return invariant(false, "respond after \(String(describing: lastEvent))")
            }
            switch failure {
            case .signInNeeded: invariant(response.status == 401, "sign-in needed answered \(response.status)")
            case .unavailable(_, let retryAfter):
                invariant(response.status == 503, "unavailable answered \(response.status)")
                let wait = response.extraFields.first { $0.name == "Retry-After" }?.value
                invariant(wait == String(max(1, retryAfter ?? 5)), "Retry-After \(String(describing: wait))")
            case .configuration: invariant(response.status == 500, "misconfiguration answered \(response.status)")
            case .pending(_, let retryAfter):
                invariant(response.status == 503, "pending answered \(response.status)")
                let wait = response.extraFields.first { $0.name == "Retry-After" }?.value
                invariant(wait == String(max(1, retryAfter)), "Retry-After \(String(describing: wait))")
            case .storage:
                invariant(response.status == 503, "storage answered \(response.status)")
                invariant(!response.extraFields.contains { $0.name == "Retry-After" }, "Retry-After on storage")
            }
            var parser = HTTPHeadParser(kind: .response, limits: generousLimits)
            guard case .complete = parser.parse(response.serialized()) else {
                return invariant(false, "the exchange's own \(response.status) does not parse")
            }
            return
        }
        lastEvent = event
        action = machine.handle(event)
    }
}

private func randomResponse(_ parsed: [Challenge], random: inout InputRandom) -> AuthExchange.Event {
    let statuses = [401, 401, 401, 200, 403, 500]
    let status = statuses[random.next(in: 0...(statuses.count - 1))]
    let challenges: [Challenge]
    switch random.next(in: 0...7) {
    case 0: challenges = parsed
    case 1: challenges = [Challenge(scheme: "DPoP", parameters: [("error", "use_dpop_nonce"), ("algs", "ES256")])]
    case 2:
        challenges = [
            Challenge(
                scheme: "Bearer",
                parameters: [("error", "insufficient_user_authentication"), ("acr_values", "phr"), ("max_age", "5")])
        ]
    case 3: challenges = [Challenge(scheme: "Bearer", parameters: [("error", "invalid_token")])]
    case 4: challenges = parsed + [Challenge(scheme: "dpop", parameters: [("error", "use_dpop_nonce")])]
    case 5:
        challenges =
            [
                Challenge(
                    scheme: "Bearer",
                    parameters: [("resource_metadata", "https://api.example.com/.well-known/oauth-protected-resource")])
            ] + parsed
    case 6: challenges = [Challenge(scheme: "Bearer", parameters: [("error", "insufficient_scope"), ("scope", "a b")])]
    default: challenges = []
    }
    let nonce: String? = random.nextBool() ? "nonce-\(random.next(in: 1...3))" : nil
    return .response(status: status, challenges: challenges, dpopNonce: nonce)
}
