import ProxyCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// A successful token response (RFC 6749 §5.1).
public struct TokenResponse: Sendable, Equatable {
    public var accessToken: String
    /// "Bearer" or "DPoP", whatever case the provider used (glewlwyd says "bearer").
    public var tokenType: String
    public var expiresIn: Int?
    public var refreshToken: String?
    public var idToken: String?
    public var scope: String?
}

/// Why the token endpoint did not give tokens.
public enum TokenEndpointError: Error, Sendable, Equatable {
    /// An OAuth error response (RFC 6749 §5.2), or an empty 400/401 (glewlwyd's answer to a bad refresh token).
    case oauth(OAuthErrorResponse, status: Int, dpopNonce: String?)
    /// 5xx or 429: the provider is down or overloaded.
    case unavailable(status: Int, retryAfter: Int?)
    /// Something that is not a token response.
    case malformed(String)
    /// The request went out and no answer came back: the provider may or may not have acted on it.
    case unanswered(String)
}

public enum TokenEndpoint {
    /// Reads a token endpoint answer.
    public static func parse(_ response: HTTPResponse, now: Date = Date()) -> Result<TokenResponse, TokenEndpointError>
    {
        if response.status == 429 || response.status >= 500 {
            return .failure(
                .unavailable(
                    status: response.status, retryAfter: retryAfter(response.header("Retry-After"), now: now)))
        }
        let object = response.jsonObject
        if response.status != 200 {
            if let object, let error = object["error"]?.string {
                return .failure(
                    .oauth(
                        OAuthErrorResponse(
                            error: error, description: object["error_description"]?.string,
                            uri: object["error_uri"]?.string),
                        status: response.status, dpopNonce: response.header("DPoP-Nonce")))
            }
            if (400...403).contains(response.status) {
                // No error code: report the status; callers decide what an empty rejection means.
                return .failure(
                    .oauth(
                        OAuthErrorResponse(
                            error: "http_\(response.status)", description: "no error details in the answer"),
                        status: response.status, dpopNonce: response.header("DPoP-Nonce")))
            }
            return .failure(.malformed("the token endpoint answered \(response.status)"))
        }
        guard let object else { return .failure(.malformed("the token endpoint's answer is not JSON")) }
        guard let accessToken = object["access_token"]?.string, !accessToken.isEmpty else {
            return .failure(.malformed("the token endpoint's answer has no access_token"))
        }
        guard let tokenType = object["token_type"]?.string else {
            return .failure(.malformed("the token endpoint's answer has no token_type"))
        }
        var expiresIn: Int? = nil
        if let value = object["expires_in"] {
            // Some providers send the number as a string.
            expiresIn = value.int.map(Int.init) ?? value.string.flatMap { Int($0) }
            guard let parsed = expiresIn, parsed >= 0 else {
                return .failure(.malformed("the token endpoint's expires_in is not a number"))
            }
            expiresIn = parsed
        }
        return .success(
            TokenResponse(
                accessToken: accessToken, tokenType: tokenType, expiresIn: expiresIn,
                refreshToken: object["refresh_token"]?.string.flatMap { $0.isEmpty ? nil : $0 },
                idToken: object["id_token"]?.string, scope: object["scope"]?.string))
    }

    /// `Retry-After` (RFC 9110 §10.2.3): delay-seconds or an HTTP-date, as seconds from now (at least 0).
    public static func retryAfter(_ value: String?, now: Date) -> Int? {
        guard let value = value?.trimmingOWS(), !value.isEmpty else { return nil }
        if let seconds = Int(value) { return max(0, seconds) }
        // RFC 9110 §5.6.7: a recipient must accept the IMF-fixdate and the obsolete RFC 850 and asctime forms.
        let seconds = now.timeIntervalSince1970
        guard let date = HTTPDate.parse(value, now: Int64(seconds.rounded(.down))) else { return nil }
        return max(0, Int((Double(date) - seconds).rounded(.up)))
    }

    /// The token type, normalised: "Bearer" or "DPoP" (RFC 6749 §7.1: case-insensitive); nil when unknown.
    public static func normalizedType(_ type: String) -> String? {
        switch type.lowercased() {
        case "bearer": "Bearer"
        case "dpop": "DPoP"
        default: nil
        }
    }
}
