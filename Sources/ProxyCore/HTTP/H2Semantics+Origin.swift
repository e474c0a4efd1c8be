/// HTTP/2 on the way out (RFC 9113 §8): a request to a protected origin as a header block for the proxy's own
/// client, and the origin's response header block read back into the `ReceivedHead` every exchange decides
/// from, through the one head parser and `MessageSemantics.response`, as an HTTP/1.1 origin's would be.
extension H2Semantics {
    /// The request header block: `:method`, `:scheme`, `:authority` (the URL's, as `Host` would carry it),
    /// `:path` (the URL's path and query byte for byte, or `target`: `*` for `OPTIONS *`), then the client's
    /// fields in their order with lower-case names (none of the connection-specific ones; `te` only as
    /// `te: trailers`), `content-length` for a body of known length, and the credential's fields.
    public static func originRequest(
        method: String, url: AbsoluteURL, target: String?, fields: [(name: String, value: [UInt8])],
        body: OriginExchange.Body, credential: [(name: String, value: [UInt8])]
    ) -> [H2Field] {
        var block: [H2Field] = []
        block.reserveCapacity(fields.count + credential.count + 5)
        block.append(H2Field(H2Names.method, Array(method.utf8)))
        block.append(H2Field(H2Names.scheme, Array(url.scheme.utf8)))
        block.append(H2Field(H2Names.authority, Array(url.hostFieldValue.utf8)))
        block.append(H2Field(H2Names.path, Array((target ?? url.pathAndQuery).utf8)))
        for field in fields {
            let name = Array(field.name.utf8).map(ASCII.lower)
            if name == H2Names.te {
                if ASCII.equalsLowercase(field.value[...], "trailers") { block.append(H2Field(name, field.value)) }
                continue
            }
            if name == H2Names.host || name == H2Names.contentLength || connectionSpecific.contains(name) { continue }
            block.append(H2Field(name, field.value))
        }
        if case .length(let length) = body { block.append(H2Field(H2Names.contentLength, Array(String(length).utf8))) }
        for field in credential { block.append(H2Field(Array(field.name.utf8).map(ASCII.lower), field.value)) }
        return block
    }

    /// The origin's response header block (an interim 1xx one or the final) as the head an HTTP/1.1 origin would
    /// have sent: its status and fields, parsed by the one head parser with the exchange's limits and checked by
    /// `MessageSemantics.response`. nghttp2 has already refused what HTTP/2 forbids (upper-case names,
    /// connection-specific fields, CR or LF in a value); a block without a valid `:status` is refused here.
    public static func originResponseHead(
        _ fields: [H2Field], requestMethod: String, limits: HTTPHeadLimits
    ) -> Result<ReceivedHead, HTTPParseError> {
        var status: [UInt8]?
        var bytes = Array("HTTP/1.1 ".utf8)
        var lines: [UInt8] = []
        for field in fields {
            if field.name.first == UInt8(ascii: ":") {
                guard field.name == Self.statusName, status == nil else {
                    return .failure(HTTPParseError(.malformed, "a response pseudo-field other than one :status"))
                }
                status = field.value
                continue
            }
            lines += field.name + Array(": ".utf8) + field.value + [ASCII.cr, ASCII.lf]
        }
        guard let status, status.count == 3, status.allSatisfy(ASCII.isDigit) else {
            return .failure(HTTPParseError(.malformed, "a response without a valid :status"))
        }
        bytes += status + [ASCII.space, ASCII.cr, ASCII.lf] + lines + [ASCII.cr, ASCII.lf]
        var parser = HTTPHeadParser(kind: .response, limits: limits)
        let parsed = bytes.withUnsafeBytes { parser.parse($0) }
        switch parsed {
        case .needMore:
            return .failure(HTTPParseError(.malformed, "the response head did not end"))
        case .failed(let error):
            return .failure(error)
        case .complete(let head, _):
            let semantics = MessageSemantics.response(head, requestMethod: requestMethod, upgradeRequested: false)
            return .success(ReceivedHead(head: head, semantics: try? semantics.get()))
        }
    }

    public static let statusName = Array(":status".utf8)
}
