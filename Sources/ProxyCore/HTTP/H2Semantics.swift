/// One field of an HTTP/2 header block: name and value as bytes (names in lower case, RFC 9113 §8.2.1).
public struct H2Field: Sendable, Equatable, Hashable {
    public let name: [UInt8]
    public let value: [UInt8]

    public init(_ name: [UInt8], _ value: [UInt8]) {
        self.name = name
        self.value = value
    }

    public init(_ name: String, _ value: String) {
        self.init(Array(name.utf8), Array(value.utf8))
    }

    public var nameText: String { String(decoding: name, as: UTF8.self) }
}

/// HTTP/2 messages as the rest of the proxy sees them (RFC 9113 §8): a request header block checked for a
/// protected origin and turned into the `InterceptedRequest` every exchange uses, and the origin's response (or
/// the proxy's own answer) as a header block for the client. nghttp2 already enforces the framing rules (no
/// connection-specific fields, lower-case names, pseudo-fields first, Content-Length against DATA); these are
/// the rules about meaning.
public enum H2Semantics {
    /// Fields that must not appear in HTTP/2 (RFC 9113 §8.2.2), nor travel from an HTTP/1.1 origin to an
    /// HTTP/2 client: the hop-by-hop ones (`te` is let through only as `te: trailers`) and the framing.
    static let connectionSpecific: Set<[UInt8]> = Set(
        connectionSpecificNames.map { name in name.withUTF8Buffer { Array($0) } })
    static let connectionSpecificNames: [StaticString] = MessageSemantics.alwaysHopByHop + ["transfer-encoding"]

    /// Whether `name` (any case) is connection-specific: compared in place, without a lower-cased copy and a
    /// hash per field of every response (the lengths differ, so most names take one comparison per entry).
    static func isConnectionSpecific(_ name: ArraySlice<UInt8>) -> Bool {
        connectionSpecificNames.contains { ASCII.equalsLowercase(name, $0) }
    }

    /// Checks a request for `protected` (RFC 9113 §8.3.1): its `:scheme` https, its `:authority` (and a `host`
    /// field, if any) naming the origin exactly, else it is misdirected and gets no token; a request a web page of
    /// another origin made is refused (`OriginConfig.browserRefusal`).
    public static func interceptedRequest(
        _ fields: [H2Field], endStream: Bool, for protected: OriginConfig
    ) -> Result<InterceptedRequest, InterceptRefusal> {
        let origin = protected.authority
        let split: RequestPseudoFields
        switch RequestPseudoFields.split(fields) {
        case .failure(let refusal): return .failure(refusal)
        case .success(let fields): split = fields
        }
        let (method, path, scheme, authority, protocolName, regular) = (
            split.method, split.path, split.scheme, split.authority, split.protocolName, split.regular
        )
        guard let method else {
            return .failure(.badRequest(HTTPParseError(.malformed, "request without :method")))
        }
        if method == "CONNECT" {
            // RFC 8441 extended CONNECT (:protocol websocket) is a WebSocket (`webSocketRequest`); a plain
            // CONNECT opens a tunnel, which a protected origin does not give.
            return .failure(
                .unsupported(
                    protocolName == nil
                        ? "CONNECT inside a tunnel to a protected origin is not supported"
                        : "the protocol \(protocolName ?? "-") cannot be tunnelled to a protected origin; only websocket"
                ))
        }
        guard scheme == "https" else {
            return .failure(.misdirected("the request names the scheme \(scheme ?? "-"), not https"))
        }
        guard let path, path.utf8.first == UInt8(ascii: "/") || (path == "*" && method == "OPTIONS") else {
            return .failure(.badRequest(HTTPParseError(.malformed, "request without an origin-form :path")))
        }
        let hosts = regular.filter { $0.name == H2Names.host }.map(\.valueText)
        let named = authority ?? hosts.first
        guard let named else {
            return .failure(.badRequest(HTTPParseError(.malformed, "request without :authority")))
        }
        for candidate in [named] + hosts {
            switch HostPort.parse(candidate[...], defaultPort: 443) {
            case .failure:
                return .failure(.misdirected("the :authority is not a valid authority"))
            case .success(let parsed) where parsed != origin:
                return .failure(.misdirected(":authority \(parsed) does not match the tunnel's \(origin)"))
            case .success:
                break
            }
        }
        var length: UInt64?
        for field in regular where field.name == H2Names.contentLength {
            guard field.value.count <= 19, !field.value.isEmpty, field.value.allSatisfy(ASCII.isDigit),
                let parsed = UInt64(String(decoding: field.value, as: UTF8.self)), parsed <= UInt64(Int64.max),
                length == nil || length == parsed
            else {
                return .failure(.badRequest(HTTPParseError(.badFraming, "invalid content-length")))
            }
            length = parsed
        }
        let framing: BodyFraming
        if endStream {
            framing = .none
        } else if let length {
            framing = length == 0 ? .none : .contentLength(length)
        } else {
            // DATA frames until END_STREAM: a length nobody knows in advance, streamed like a chunked body.
            framing = .chunked
        }
        let scan = protected.scanCredentials(target: path.utf8) { visit in
            for field in regular { visit(field.name[...], field.value[...]) }
        }
        let clientAuthorization = scan.clientCredential
        let attach = protected.attachesToken(clientHasAuthorization: clientAuthorization)
        var upstream: [(name: String, value: [UInt8])] = []
        var acceptsTrailers = false
        var fetchSite: [ArraySlice<UInt8>] = []
        var initiator: [ArraySlice<UInt8>] = []
        var referer: [ArraySlice<UInt8>] = []
        for field in regular {
            // Names are lower case in HTTP/2 (RFC 9113 §8.2.1; nghttp2 enforces it).
            if field.name == H2Names.secFetchSite {
                fetchSite.append(field.value[...])
            } else if field.name == H2Names.origin {
                initiator.append(field.value[...])
            } else if field.name == H2Names.referer {
                referer.append(field.value[...])
            }
            if field.name == H2Names.te {
                // RFC 9113 §8.2.2: only "trailers"; gRPC servers require it, so it travels.
                acceptsTrailers = true
                upstream.append(("te", Array("trailers".utf8)))
                continue
            }
            if field.name == H2Names.host || field.name == H2Names.contentLength
                || connectionSpecific.contains(field.name)
                || field.name == H2Names.expect
            {
                continue
            }
            if attach && protected.isCredentialField(field.name) { continue }
            upstream.append((field.nameText, field.value))
        }
        if let refusal = protected.browserRefusal(fetchSite: fetchSite, origin: initiator, referer: referer) {
            return .failure(.browserRequest(refusal, close: false))
        }
        if let refusal = InterceptRefusal.credential(scan, for: protected, close: false) {
            return .failure(refusal)
        }
        var request = InterceptedRequest(
            method: method, target: path, framing: framing, keepAlive: true, upstreamFields: upstream,
            clientAuthorization: clientAuthorization, upgrade: false, expectsContinue: false,
            acceptsTrailers: acceptsTrailers)
        request.placeholderUsed = scan.placeholderUsed
        return .success(request)
    }

    /// Whether a request header block is an RFC 8441 extended CONNECT for a WebSocket.
    public static func isWebSocketConnect(_ fields: [H2Field]) -> Bool {
        fields.contains { $0.name == H2Names.method && $0.value == H2Names.connectMethod }
            && fields.contains { $0.name == H2Names.protocolName && $0.value == H2Names.websocketProtocol }
    }

    /// An RFC 8441 WebSocket (extended CONNECT, `:protocol websocket`) as the HTTP/1.1 upgrade request the
    /// proxy sends on (RFC 6455 §4.1: GET, Upgrade and Connection, a Sec-WebSocket-Key of `key`), for an
    /// HTTP/1.1 connection machine to carry out like any upgrade: token, refresh and replay, the origin's TLS.
    /// The client's other fields travel (Sec-WebSocket-Version, -Protocol, -Extensions, Origin, Authorization).
    public static func webSocketRequest(
        _ fields: [H2Field], origin: HostPort, key: String
    ) -> Result<
        [UInt8], InterceptRefusal
    > {
        let split: RequestPseudoFields
        switch RequestPseudoFields.split(fields) {
        case .failure(let refusal): return .failure(refusal)
        case .success(let fields): split = fields
        }
        let (path, scheme, authority, regular) = (split.path, split.scheme, split.authority, split.regular)
        guard scheme == "https" else {
            return .failure(.misdirected("the request names the scheme \(scheme ?? "-"), not https"))
        }
        guard let path, path.utf8.first == UInt8(ascii: "/") else {
            return .failure(.badRequest(HTTPParseError(.malformed, "extended CONNECT without an origin-form :path")))
        }
        guard let authority else {
            return .failure(.badRequest(HTTPParseError(.malformed, "extended CONNECT without :authority")))
        }
        switch HostPort.parse(authority[...], defaultPort: 443) {
        case .failure:
            return .failure(.misdirected("the :authority is not a valid authority"))
        case .success(let parsed) where parsed != origin:
            return .failure(.misdirected(":authority \(parsed) does not match the tunnel's \(origin)"))
        case .success:
            break
        }
        var head = Array(
            "GET \(path) HTTP/1.1\r\nHost: \(authority)\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: \(key)\r\n"
                .utf8)
        let skipped: Set<[UInt8]> = connectionSpecific.union(
            ["host", "content-length", "sec-websocket-key"].map { Array($0.utf8) })
        for field in regular where !skipped.contains(field.name) {
            head += field.name + Array(": ".utf8) + field.value + [ASCII.cr, ASCII.lf]
        }
        head += [ASCII.cr, ASCII.lf]
        return .success(head)
    }

    /// The answer to an extended CONNECT from the HTTP/1.1 response to its upgrade request: a 101 becomes the
    /// 200 that opens the stream (RFC 8441 §5), without the fields that only HTTP/1.1's handshake has; any
    /// other response is passed on as it is (the proxy's Proxy-Status included), with whether a body follows.
    public static func webSocketResponse(_ head: HTTPHead) -> (fields: [H2Field], opened: Bool, framing: BodyFraming) {
        if head.status == 101 {
            var fields = [H2Field(":status", "200")]
            let handshake: Set<[UInt8]> = connectionSpecific.union([Array("sec-websocket-accept".utf8)])
            for index in head.fields.indices {
                let name = head.bytes[head.fields[index].name].map(ASCII.lower)
                if handshake.contains(name) { continue }
                fields.append(H2Field(name, Array(head.valueBytes(at: index))))
            }
            return (fields, true, .untilClose)
        }
        let semantics: ResponseSemantics
        switch MessageSemantics.response(head, requestMethod: "GET", upgradeRequested: true) {
        case .success(let checked): semantics = checked
        case .failure: return ([H2Field(":status", "502"), H2Field("content-length", "0")], false, .none)
        }
        let (fields, _) = responseHead(
            UpstreamResponse(head: head, semantics: semantics, proxyStatus: nil), requestMethod: "GET")
        return (fields, false, semantics.framing)
    }

    /// The origin's response as an HTTP/2 header block: `:status`, every end-to-end field (names in lower
    /// case; hop-by-hop and connection-specific ones removed), the proxy's `proxy-status` when set, and
    /// whether a body follows.
    public static func responseHead(
        _ response: UpstreamResponse, requestMethod: String
    ) -> (
        fields: [H2Field], hasBody: Bool
    ) {
        let head = response.head
        let status = head.status
        // A gRPC status in the head makes it a Trailers-Only response (the gRPC HTTP/2 protocol): one HEADERS
        // frame that ends the stream, which is how a gRPC client must see it.
        let trailersOnly = head.fields.indices.contains { head.field($0, isNamed: "grpc-status") }
        let hasBody = !(status < 200 || status == 204 || status == 304 || requestMethod == "HEAD" || trailersOnly)
        var fields: [H2Field] = [H2Field(":status", String(status))]
        fields.reserveCapacity(head.fields.count + 3)
        for index in head.fields.indices where !response.semantics.dropped.contains(index) {
            let name = head.nameBytes(at: index)
            if isConnectionSpecific(name) || ASCII.equalsLowercase(name, "trailer") { continue }
            // A length that is not the body's (discarded) does not travel.
            if response.semantics.framing == .none && hasBody && ASCII.equalsLowercase(name, "content-length") {
                continue
            }
            fields.append(H2Field(name.map(ASCII.lower), Array(head.valueBytes(at: index))))
        }
        if let proxyStatus = response.proxyStatus {
            fields.append(H2Field("proxy-status", proxyStatus.fieldValue))
        }
        if hasBody && response.semantics.framing == .none { fields.append(H2Field("content-length", "0")) }
        return (fields, hasBody && response.semantics.framing != .none)
    }

    /// Trailer fields of the origin's response for an HTTP/2 client (names in lower case, none of the
    /// fields a trailer must not carry).
    public static func trailers(_ fields: [(name: String, value: [UInt8])]) -> [H2Field] {
        fields.compactMap { field in
            let name = Array(field.name.utf8).map(ASCII.lower)
            if connectionSpecific.contains(name) || ChunkedScanner.forbiddenTrailers.contains(name) { return nil }
            return H2Field(name, field.value)
        }
    }

    /// The proxy's own answer as an HTTP/2 response: its fields and its one-line body (none for HEAD).
    public static func answer(_ answer: ProxyAnswer, headRequest: Bool) -> (fields: [H2Field], body: [UInt8]) {
        let response = answer.response
        let body = headRequest ? [] : Array((response.message + "\n").utf8)
        var fields: [H2Field] = [H2Field(":status", String(response.status))]
        if let proxyStatus = response.proxyStatus { fields.append(H2Field("proxy-status", proxyStatus.fieldValue)) }
        for (name, value) in response.extraFields { fields.append(H2Field(name.lowercased(), value)) }
        fields.append(H2Field("content-type", "text/plain; charset=utf-8"))
        fields.append(H2Field("content-length", String((response.message + "\n").utf8.count)))
        fields.append(H2Field("cache-control", "no-store"))
        return (fields, body)
    }
}

extension H2Field {
    /// The value as text (pseudo-field values are ASCII).
    public var valueText: String { String(decoding: value, as: UTF8.self) }
}

/// A request header block split into its pseudo-fields (RFC 9113 §8.3.1; the last of a repeated one counts:
/// nghttp2 refuses repeats before they get here) and its regular fields; an unknown pseudo-field is refused.
/// The names are compared with `Names`' constants, not arrays made per field.
struct RequestPseudoFields {
    var method: String?
    var path: String?
    var scheme: String?
    var authority: String?
    var protocolName: String?
    var regular: [H2Field] = []

    static func split(_ fields: [H2Field]) -> Result<RequestPseudoFields, InterceptRefusal> {
        var split = RequestPseudoFields()
        split.regular.reserveCapacity(fields.count)
        for field in fields {
            guard field.name.first == UInt8(ascii: ":") else {
                split.regular.append(field)
                continue
            }
            switch field.name {
            case H2Names.method: split.method = field.valueText
            case H2Names.path: split.path = field.valueText
            case H2Names.scheme: split.scheme = field.valueText
            case H2Names.authority: split.authority = field.valueText
            case H2Names.protocolName: split.protocolName = field.valueText
            default: return .failure(.badRequest(HTTPParseError(.malformed, "unknown pseudo-header field")))
            }
        }
        return .success(split)
    }
}

/// The field names (and the two values) the HTTP/2 files compare with, made once (an array literal in a comparison
/// is made anew for every field of every stream).
enum H2Names {
    static let method = Array(":method".utf8)
    static let path = Array(":path".utf8)
    static let scheme = Array(":scheme".utf8)
    static let authority = Array(":authority".utf8)
    static let protocolName = Array(":protocol".utf8)
    static let te = Array("te".utf8)
    static let trailer = Array("trailer".utf8)
    static let contentLength = Array("content-length".utf8)
    static let host = Array("host".utf8)
    static let expect = Array("expect".utf8)
    static let authorization = Array("authorization".utf8)
    static let secFetchSite = Array("sec-fetch-site".utf8)
    static let origin = Array("origin".utf8)
    static let referer = Array("referer".utf8)
    // Values.
    static let connectMethod = Array("CONNECT".utf8)
    static let websocketProtocol = Array("websocket".utf8)
}
