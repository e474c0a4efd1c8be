/// The `Proxy-Status` response field (RFC 9209): which intermediary answered and why.
public struct ProxyStatus: Sendable, Equatable {
    /// Proxy error types registered by RFC 9209 §2.3, the ones this proxy uses.
    public enum ErrorType: String, Sendable, Equatable {
        case dnsTimeout = "dns_timeout"
        case dnsError = "dns_error"
        case destinationNotFound = "destination_not_found"
        case destinationUnavailable = "destination_unavailable"
        case destinationIPUnroutable = "destination_ip_unroutable"
        case connectionRefused = "connection_refused"
        case connectionTerminated = "connection_terminated"
        case connectionTimeout = "connection_timeout"
        case connectionReadTimeout = "connection_read_timeout"
        case connectionLimitReached = "connection_limit_reached"
        case tlsProtocolError = "tls_protocol_error"
        case tlsCertificateError = "tls_certificate_error"
        case httpRequestError = "http_request_error"
        case httpRequestDenied = "http_request_denied"
        case httpResponseIncomplete = "http_response_incomplete"
        case httpResponseHeaderSectionSize = "http_response_header_section_size"
        case httpResponseTimeout = "http_response_timeout"
        case httpProtocolError = "http_protocol_error"
        case httpUpgradeFailed = "http_upgrade_failed"
        case proxyInternalResponse = "proxy_internal_response"
        case proxyInternalError = "proxy_internal_error"
        case proxyConfigurationError = "proxy_configuration_error"
        case proxyLoopDetected = "proxy_loop_detected"
    }

    /// The name this proxy uses for itself in the field.
    public static let proxyName = "proxyctl"

    public var error: ErrorType?
    /// Free text for a person; never a secret.
    public var details: String?
    /// The upstream status that was received, when relevant (RFC 9209 §2.1.3 `received-status`).
    public var receivedStatus: Int?
    /// The upstream host that was contacted (`next-hop`).
    public var nextHop: String?

    public init(
        error: ErrorType? = nil, details: String? = nil, receivedStatus: Int? = nil, nextHop: String? = nil
    ) {
        self.error = error
        self.details = details
        self.receivedStatus = receivedStatus
        self.nextHop = nextHop
    }

    /// The field value as a Structured Fields list member (RFC 8941).
    public var fieldValue: String {
        var value = Self.proxyName
        if let error { value += "; error=\(error.rawValue)" }
        if let nextHop { value += "; next-hop=\(Self.sfString(nextHop))" }
        if let receivedStatus { value += "; received-status=\(receivedStatus)" }
        if let details { value += "; details=\(Self.sfString(details))" }
        return value
    }

    /// An sf-string: printable ASCII with `"` and `\` escaped; anything else becomes "?".
    static func sfString(_ text: String) -> String {
        var out = "\""
        for scalar in text.unicodeScalars {
            switch scalar {
            case "\"", "\\":
                out += "\\"
                out.unicodeScalars.append(scalar)
            case " "..."~":
                out.unicodeScalars.append(scalar)
            default:
                out += "?"
            }
        }
        return out + "\""
    }
}

/// A response the proxy makes itself: a status, a `Proxy-Status` field and a one-line body naming the fix.
public struct ProxyResponse: Sendable, Equatable {
    public var status: Int
    public var proxyStatus: ProxyStatus?
    /// One line for a person; a newline is added.
    public var message: String
    public var extraFields: [(name: String, value: String)]
    /// Whether the connection closes after this response.
    public var close: Bool

    public init(
        status: Int, proxyStatus: ProxyStatus? = nil, message: String,
        extraFields: [(name: String, value: String)] = [], close: Bool = false
    ) {
        self.status = status
        self.proxyStatus = proxyStatus
        self.message = message
        self.extraFields = extraFields
        self.close = close
    }

    public static func == (lhs: Self, rhs: Self) -> Bool {
        lhs.status == rhs.status && lhs.proxyStatus == rhs.proxyStatus && lhs.message == rhs.message
            && lhs.close == rhs.close && lhs.extraFields.map(\.name) == rhs.extraFields.map(\.name)
            && lhs.extraFields.map(\.value) == rhs.extraFields.map(\.value)
    }

    /// The response bytes, HTTP/1.1.
    public func serialized(headRequest: Bool = false) -> [UInt8] {
        let body = message + "\n"
        var head = "HTTP/1.1 \(status) \(Self.reasonPhrase(status))\r\n"
        if let proxyStatus { head += "Proxy-Status: \(proxyStatus.fieldValue)\r\n" }
        for (name, value) in extraFields { head += "\(name): \(value)\r\n" }
        head += "Content-Type: text/plain; charset=utf-8\r\n"
        head += "Content-Length: \(body.utf8.count)\r\n"
        head += "Cache-Control: no-store\r\n"
        if close { head += "Connection: close\r\n" }
        head += "\r\n"
        return Array(head.utf8) + (headRequest ? [] : Array(body.utf8))
    }

    public static func reasonPhrase(_ status: Int) -> String {
        switch status {
        case 200: "OK"
        case 400: "Bad Request"
        case 401: "Unauthorized"
        case 403: "Forbidden"
        case 404: "Not Found"
        case 405: "Method Not Allowed"
        case 407: "Proxy Authentication Required"
        case 408: "Request Timeout"
        case 413: "Content Too Large"
        case 414: "URI Too Long"
        case 421: "Misdirected Request"
        case 431: "Request Header Fields Too Large"
        case 500: "Internal Server Error"
        case 501: "Not Implemented"
        case 502: "Bad Gateway"
        case 503: "Service Unavailable"
        case 504: "Gateway Timeout"
        case 505: "HTTP Version Not Supported"
        case 508: "Loop Detected"
        default: "Status \(status)"
        }
    }
}
