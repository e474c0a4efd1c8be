import ProxyCore

/// What went wrong with sign-in or tokens, in the four categories the proxy and the CLI act on
/// (modelled on the Versola SDK's error categories). Messages never contain a token, a code or a verifier.
public enum AuthError: Error, Sendable, Equatable, CustomStringConvertible {
    /// A passing problem (provider down, overloaded, network): try again, after `retryAfter` seconds if set.
    case recoverable(reason: String, retryAfter: Int?)
    /// A refresh is at the provider and has not been answered yet. It is left running (its answer is stored
    /// when it comes) and the refresh token is not sent again meanwhile: try again after `retryAfter` seconds.
    case pending(reason: String, retryAfter: Int)
    /// The state directory cannot be written (a full disk, a quota, permissions) or read: tokens cannot be
    /// kept, so none are spent. Fixed by the user on this machine, not at the provider.
    case storage(reason: String)
    /// The user must sign in again (no tokens, refresh token expired or revoked).
    case reauthenticate(reason: String)
    /// The resource wants a stronger sign-in (RFC 9470).
    case stepUp(acrValues: String?, maxAge: Int?, reason: String)
    /// proxy.conf or the provider's registration is wrong; retrying will not help.
    case configuration(reason: String)
    /// The user or the provider ended the sign-in (access_denied, timeout, Ctrl-C).
    case cancelled(reason: String)
    /// The provider's answer failed validation (an ID token with a bad signature, the wrong audience, an
    /// expiry in the past): nothing was stored.
    case rejected(reason: String)

    public var description: String {
        switch self {
        case .recoverable(let reason, let retryAfter):
            retryAfter.map { "\(reason) (try again in \($0)s)" } ?? reason
        case .pending(let reason, let retryAfter): "\(reason) (try again in \(retryAfter)s)"
        case .storage(let reason): reason
        case .reauthenticate(let reason): reason
        case .stepUp(_, _, let reason): reason
        case .configuration(let reason): reason
        case .cancelled(let reason): reason
        case .rejected(let reason): reason
        }
    }

    /// A short name for logs and `status --json`.
    public var category: String {
        switch self {
        case .recoverable: "recoverable"
        case .pending: "pending"
        case .storage: "storage"
        case .reauthenticate: "reauthenticate"
        case .stepUp: "step_up"
        case .configuration: "configuration"
        case .cancelled: "cancelled"
        case .rejected: "rejected"
        }
    }
}

/// An OAuth error response (RFC 6749 §5.2), with the description made safe to print.
public struct OAuthErrorResponse: Sendable, Equatable {
    public let error: String
    public let description: String?
    public let uri: String?

    /// RFC 6749 §5.2 limits these to printable ASCII; anything else is replaced, and length is capped, so a
    /// provider cannot write control sequences to the user's terminal.
    public init(error: String, description: String?, uri: String? = nil) {
        self.error = Self.sanitize(error, limit: 80)
        self.description = description.map { Self.sanitize($0, limit: 300) }
        self.uri = uri.map { Self.sanitize($0, limit: 300) }
    }

    static func sanitize(_ text: String, limit: Int) -> String {
        ASCII.clip(text, limit: limit)
    }

    /// "access_denied: The user said no"
    public var summary: String {
        description.map { "\(error): \($0)" } ?? error
    }
}
