import Foundation
import ProxyCore
import Testing

@testable import ProxyOAuth

/// RFC 9110 §5.6.7's example date: Sun, 06 Nov 1994 08:49:37 GMT.
private let httpDateNow = Date(timeIntervalSince1970: 784_111_777)

private func response(_ status: Int, _ body: String, headers: [(name: String, value: String)] = []) -> HTTPResponse {
    HTTPResponse(status: status, headers: headers, body: Array(body.utf8))
}

private func parse(
    _ status: Int, _ body: String, headers: [(name: String, value: String)] = []
)
    -> Result<TokenResponse, TokenEndpointError>
{
    TokenEndpoint.parse(response(status, body, headers: headers), now: httpDateNow)
}

@Suite struct TokenEndpointParseTests {
    @Test func successWithNumericExpiry() throws {
        let tokens = try parse(
            200,
            #"{"access_token":"at-1","token_type":"Bearer","expires_in":3600,"refresh_token":"rt-1","id_token":"h.p.s","scope":"openid email"}"#
        ).get()
        #expect(
            tokens
                == TokenResponse(
                    accessToken: "at-1", tokenType: "Bearer", expiresIn: 3600, refreshToken: "rt-1", idToken: "h.p.s",
                    scope: "openid email"))
    }

    @Test func expiresInAsAStringOrWholeFraction() throws {
        #expect(
            try parse(200, #"{"access_token":"a","token_type":"Bearer","expires_in":"300"}"#).get().expiresIn == 300)
        #expect(
            try parse(200, #"{"access_token":"a","token_type":"Bearer","expires_in":300.0}"#).get().expiresIn == 300)
        #expect(try parse(200, #"{"access_token":"a","token_type":"Bearer","expires_in":0}"#).get().expiresIn == 0)
        #expect(try parse(200, #"{"access_token":"a","token_type":"Bearer"}"#).get().expiresIn == nil)
    }

    @Test(arguments: [#""soon""#, "-1", #""-5""#, "1.5", "null", "true", #""""#, "[]"])
    func unusableExpiresIn(_ value: String) {
        let result = parse(200, #"{"access_token":"a","token_type":"Bearer","expires_in":\#(value)}"#)
        #expect(result == .failure(.malformed("the token endpoint's expires_in is not a number")))
    }

    @Test func lowercaseBearerIsKeptAndNormalised() throws {
        // glewlwyd answers token_type "bearer" (RFC 6749 §7.1: case-insensitive).
        let tokens = try parse(200, #"{"access_token":"a","token_type":"bearer","expires_in":60}"#).get()
        #expect(tokens.tokenType == "bearer")
        #expect(TokenEndpoint.normalizedType(tokens.tokenType) == "Bearer")
    }

    @Test func normalizedTypes() {
        #expect(TokenEndpoint.normalizedType("Bearer") == "Bearer")
        #expect(TokenEndpoint.normalizedType("BEARER") == "Bearer")
        #expect(TokenEndpoint.normalizedType("DPoP") == "DPoP")
        #expect(TokenEndpoint.normalizedType("dpop") == "DPoP")
        #expect(TokenEndpoint.normalizedType("mac") == nil)
        #expect(TokenEndpoint.normalizedType("N_A") == nil)
        #expect(TokenEndpoint.normalizedType("") == nil)
    }

    @Test func emptyRefreshTokenMeansNone() throws {
        let tokens = try parse(200, #"{"access_token":"a","token_type":"Bearer","refresh_token":""}"#).get()
        #expect(tokens.refreshToken == nil)
    }

    @Test func successWithoutAccessTokenOrTypeIsMalformed() {
        #expect(
            parse(200, #"{"token_type":"Bearer"}"#)
                == .failure(.malformed("the token endpoint's answer has no access_token")))
        #expect(
            parse(200, #"{"access_token":"","token_type":"Bearer"}"#)
                == .failure(.malformed("the token endpoint's answer has no access_token")))
        #expect(
            parse(200, #"{"access_token":"a"}"#)
                == .failure(.malformed("the token endpoint's answer has no token_type")))
    }

    @Test(arguments: [
        "", "not json", "{\"access_token\":\"a\",", "[1,2]", "\"a\"", #"{"a":1,"a":2}"#, "<html>ok</html>",
    ])
    func malformedJSONInASuccess(_ body: String) {
        #expect(parse(200, body) == .failure(.malformed("the token endpoint's answer is not JSON")))
    }

    @Test func oauthErrorWithBody() {
        let result = parse(
            400,
            #"{"error":"invalid_grant","error_description":"Token is not active","error_uri":"https://e.example/doc"}"#)
        #expect(
            result
                == .failure(
                    .oauth(
                        OAuthErrorResponse(
                            error: "invalid_grant", description: "Token is not active", uri: "https://e.example/doc"),
                        status: 400, dpopNonce: nil)))
    }

    @Test func oauthErrorKeepsTheDPoPNonce() {
        let result = parse(
            400, #"{"error":"use_dpop_nonce"}"#, headers: [("DPoP-Nonce", "eyJ7S_zG.eyJH0-Z.HX4w-7v")])
        #expect(
            result
                == .failure(
                    .oauth(
                        OAuthErrorResponse(error: "use_dpop_nonce", description: nil), status: 400,
                        dpopNonce: "eyJ7S_zG.eyJH0-Z.HX4w-7v")))
    }

    @Test func oauthErrorDescriptionIsMadeSafeToPrint() {
        guard
            case .failure(.oauth(let error, _, _)) = parse(
                401, "{\"error\":\"invalid_client\",\"error_description\":\"bad\\u001b[2J\\nclient\"}")
        else {
            Issue.record("not an OAuth error")
            return
        }
        #expect(error.description == "bad?[2J?client")
        #expect(error.summary == "invalid_client: bad?[2J?client")
    }

    @Test(arguments: [400, 401, 403])
    func emptyRejectionBecomesAnHTTPStatusError(_ status: Int) {
        // glewlwyd answers a reused refresh token with an empty 400.
        for body in ["", "{}", "not json"] {
            let result = parse(status, body)
            #expect(
                result
                    == .failure(
                        .oauth(
                            OAuthErrorResponse(error: "http_\(status)", description: "no error details in the answer"),
                            status: status, dpopNonce: nil)))
        }
    }

    @Test(arguments: [301, 404, 405, 418])
    func otherStatusesAreMalformed(_ status: Int) {
        #expect(parse(status, "") == .failure(.malformed("the token endpoint answered \(status)")))
    }

    @Test func errorBodyOnOtherStatusStillReadsAsOAuthError() {
        guard case .failure(.oauth(let error, let status, _)) = parse(404, #"{"error":"invalid_request"}"#) else {
            Issue.record("not an OAuth error")
            return
        }
        #expect(error.error == "invalid_request")
        #expect(status == 404)
    }

    @Test func unavailableWithRetryAfterSeconds() {
        #expect(parse(429, "", headers: [("Retry-After", "7")]) == .failure(.unavailable(status: 429, retryAfter: 7)))
        #expect(
            parse(503, "", headers: [("retry-after", " 120 ")]) == .failure(.unavailable(status: 503, retryAfter: 120)))
        #expect(parse(503, "") == .failure(.unavailable(status: 503, retryAfter: nil)))
        // A JSON error body does not turn an outage into an OAuth error.
        #expect(
            parse(500, #"{"error":"server_error"}"#, headers: [("Retry-After", "0")])
                == .failure(.unavailable(status: 500, retryAfter: 0)))
    }

    @Test func unavailableWithRetryAfterHTTPDate() {
        #expect(
            parse(503, "", headers: [("Retry-After", "Sun, 06 Nov 1994 08:50:37 GMT")])
                == .failure(.unavailable(status: 503, retryAfter: 60)))
        #expect(
            parse(429, "", headers: [("Retry-After", "Sun, 06 Nov 1994 10:49:37 GMT")])
                == .failure(.unavailable(status: 429, retryAfter: 7200)))
    }

    @Test func retryAfterEdgeCases() {
        #expect(TokenEndpoint.retryAfter(nil, now: httpDateNow) == nil)
        #expect(TokenEndpoint.retryAfter("", now: httpDateNow) == nil)
        #expect(TokenEndpoint.retryAfter("soon", now: httpDateNow) == nil)
        #expect(TokenEndpoint.retryAfter("1.5", now: httpDateNow) == nil)
        #expect(TokenEndpoint.retryAfter("-5", now: httpDateNow) == 0)
        #expect(TokenEndpoint.retryAfter("0", now: httpDateNow) == 0)
        // A date in the past means now.
        #expect(TokenEndpoint.retryAfter("Sat, 05 Nov 1994 08:49:37 GMT", now: httpDateNow) == 0)
        // Fractions of a second round up, so the wait is never too short.
        #expect(TokenEndpoint.retryAfter("Sun, 06 Nov 1994 08:49:38 GMT", now: httpDateNow + 0.25) == 1)
        // Garbage and dates in other zones give no hint.
        #expect(TokenEndpoint.retryAfter("Sun, 06 Nov 1994 08:50:37 CET", now: httpDateNow) == nil)
        #expect(TokenEndpoint.retryAfter("06 Nov 1994", now: httpDateNow) == nil)
    }

    @Test func obsoleteHTTPDateFormsAreAccepted() {
        // RFC 9110 §5.6.7: recipients accept the RFC 850 and asctime forms too (its examples, one minute later).
        #expect(TokenEndpoint.retryAfter("Sunday, 06-Nov-94 08:50:37 GMT", now: httpDateNow) == 60)
        #expect(TokenEndpoint.retryAfter("Sun Nov  6 08:50:37 1994", now: httpDateNow) == 60)
    }
}
