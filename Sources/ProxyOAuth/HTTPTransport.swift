import ProxyCore

/// A request to a provider endpoint.
public struct HTTPRequest: Sendable {
    public var method: String
    public var url: String
    public var headers: [(name: String, value: String)]
    public var body: [UInt8]
    /// Milliseconds for the whole exchange.
    public var timeout: Int
    /// PEM bundle to trust instead of the system roots (the provider's `ca_file`).
    public var caFile: String?
    /// The most bytes of body read: a larger answer is an error, unless `keepsHeadWhenTooLarge`, when it completes
    /// with its head and the first `limit` bytes (a probe that needs only the head).
    public var limit = 1 << 20
    public var keepsHeadWhenTooLarge = false

    public init(
        method: String = "GET", url: String, headers: [(name: String, value: String)] = [], body: [UInt8] = [],
        timeout: Int = 30_000, caFile: String? = nil
    ) {
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.timeout = timeout
        self.caFile = caFile
    }

    /// A form POST (application/x-www-form-urlencoded, RFC 6749 Appendix B).
    public static func form(
        _ url: String, _ parameters: [(String, String)], caFile: String?, headers: [(name: String, value: String)] = []
    ) -> HTTPRequest {
        HTTPRequest(
            method: "POST", url: url,
            headers: [("Content-Type", "application/x-www-form-urlencoded"), ("Accept", "application/json")] + headers,
            body: Array(FormEncoding.encode(parameters).utf8), caFile: caFile)
    }
}

/// A provider's answer.
public struct HTTPResponse: Sendable {
    public var status: Int
    public var headers: [(name: String, value: String)]
    public var body: [UInt8]

    public init(status: Int, headers: [(name: String, value: String)] = [], body: [UInt8] = []) {
        self.status = status
        self.headers = headers
        self.body = body
    }

    /// The last value of a header, compared case-insensitively.
    public func header(_ name: String) -> String? {
        let lowered = name.lowercased()
        return headers.last { $0.name.lowercased() == lowered }?.value
    }

    /// Every value of a header, in order.
    public func headers(named name: String) -> [String] {
        let lowered = name.lowercased()
        return headers.filter { $0.name.lowercased() == lowered }.map(\.value)
    }

    /// The body as a JSON object, when it is one.
    public var jsonObject: JSONObject? {
        guard case .success(.object(let object)) = JSON.parse(body) else { return nil }
        return object
    }
}

/// Why a request got no answer. The messages name the host, never a token.
public enum TransportError: Error, Sendable, Equatable, CustomStringConvertible {
    /// DNS, refused, reset, TLS: the provider could not be reached.
    case unreachable(String)
    /// No answer within the timeout.
    case timeout(String)
    /// TLS verification failed: a configuration problem (ca_file), not a passing one.
    case certificate(String)
    /// The request was sent, then the connection ended or timed out before a complete answer: the server
    /// may have acted on it. A request that must not be repeated (a refresh) is not sent again.
    case noAnswer(String)

    public var description: String {
        switch self {
        case .unreachable(let reason): reason
        case .timeout(let reason): reason
        case .certificate(let reason): reason
        case .noAnswer(let reason): reason
        }
    }
}

/// Sends requests to providers. ProxyIO implements it with libcurl; tests may implement it in memory.
public protocol HTTPTransport: Sendable {
    func send(_ request: HTTPRequest) async throws -> HTTPResponse
}

/// application/x-www-form-urlencoded and URL query strings.
public enum FormEncoding {
    /// RFC 3986 unreserved characters stay; everything else is percent-encoded (space as %20).
    public static func encode(_ parameters: [(String, String)]) -> String {
        parameters.map { "\(percentEncode($0.0))=\(percentEncode($0.1))" }.joined(separator: "&")
    }

    public static func percentEncode(_ text: String) -> String {
        var out = ""
        for byte in text.utf8 {
            switch byte {
            case UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "a")...UInt8(ascii: "z"),
                UInt8(ascii: "0")...UInt8(ascii: "9"), UInt8(ascii: "-"), UInt8(ascii: "."), UInt8(ascii: "_"),
                UInt8(ascii: "~"):
                out.unicodeScalars.append(Unicode.Scalar(byte))
            default:
                out += "%" + String(byte, radix: 16, uppercase: true).leftPadding(to: 2)
            }
        }
        return out
    }

    /// Decodes a query or form body; "+" means space. Invalid escapes make the whole input invalid.
    public static func decode(_ text: String) -> [(String, String)]? {
        var result: [(String, String)] = []
        for pair in text.split(separator: "&", omittingEmptySubsequences: true) {
            let parts = pair.split(separator: "=", maxSplits: 1, omittingEmptySubsequences: false)
            guard let name = percentDecode(parts[0]), let value = percentDecode(parts.count > 1 ? parts[1] : "")
            else { return nil }
            result.append((name, value))
        }
        return result
    }

    static func percentDecode(_ text: Substring) -> String? {
        var bytes: [UInt8] = []
        var iterator = Array(text.utf8).makeIterator()
        while let byte = iterator.next() {
            switch byte {
            case UInt8(ascii: "+"): bytes.append(0x20)
            case UInt8(ascii: "%"):
                guard let high = iterator.next(), let low = iterator.next(), let h = hex(high), let l = hex(low)
                else { return nil }
                bytes.append(h << 4 | l)
            default: bytes.append(byte)
            }
        }
        return String(validating: bytes, as: UTF8.self)
    }

    private static func hex(_ byte: UInt8) -> UInt8? {
        switch byte {
        case 0x30...0x39: byte - 0x30
        case 0x41...0x46: byte - 0x41 + 10
        case 0x61...0x66: byte - 0x61 + 10
        default: nil
        }
    }
}
