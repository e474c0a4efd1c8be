/// Requests made by web pages to protected origins: the cross-site request forgery rule.
///
/// A bearer token is not ambient the way a cookie is: a page on another site cannot make the browser send it.
/// A proxy that attaches the user's token to every request for a protected origin makes it ambient again: any
/// page the user visits can have the browser send a request (an image, a script, a form POST, a `fetch` in
/// `no-cors` mode) to the protected API through the proxy, which adds the token. So a request that says it
/// comes from a page of another origin gets no token and a 403; requests from tools, which send neither Fetch
/// Metadata nor `Origin`, are unchanged.
///
/// What a browser says about a request's initiator:
/// - `Sec-Fetch-Site` (Fetch Metadata, W3C): `same-origin`, `same-site`, `cross-site` or `none` (the user typed
///   the address or opened a bookmark). Only `same-origin` and `none` are the origin's own; `same-site` is a
///   sibling subdomain, another origin all the same.
/// - `Origin` (RFC 6454 §7, Fetch): sent on every request but GET and HEAD in `no-cors` mode; `null` for opaque
///   initiators (a sandboxed frame, a `file:` page, a redirect across origins), which an attacker can produce at
///   will, so it is never the origin's own.
/// - `Referer`: the page's URL or origin. It only ever admits: when there is no `Origin` (a no-cors GET), its
///   origin decides whether a cross-site request comes from an origin in `allowed_request_origins` (a page
///   cannot make the browser send another site's Referer; it can send none, and is then refused).
public enum BrowserRequestsPolicy: String, Sendable, Equatable {
    /// Requests a web page of another origin made get no token and a 403 (the default).
    case refuse
    /// Every request gets the token, whoever made it (the behaviour before the rule).
    case allow
}

/// A web origin (RFC 6454): a scheme (http or https), a host and a port, compared after normalisation.
public struct WebOrigin: Sendable, Hashable, CustomStringConvertible {
    public let scheme: String
    public let authority: HostPort

    public init(scheme: String, authority: HostPort) {
        self.scheme = scheme
        self.authority = authority
    }

    /// `https://host`, `http://host:port`: the serialisation (RFC 6454 §6.2), the default port left out.
    public var description: String {
        let defaultPort = scheme == "https" ? 443 : 80
        return authority.port == defaultPort
            ? "\(scheme)://\(authority.hostForURL)" : "\(scheme)://\(authority.hostForURL):\(authority.port)"
    }

    /// An `Origin` field value or a configured origin: `scheme://host[:port]`, http or https, nothing after the
    /// authority (a `/` alone is tolerated in configuration, not in the field). nil for anything else (`null`,
    /// another scheme, a path, a list).
    public static func parse(_ bytes: some Collection<UInt8>, allowTrailingSlash: Bool = false) -> WebOrigin? {
        var text = Array(bytes)
        if allowTrailingSlash, text.last == UInt8(ascii: "/") { text.removeLast() }
        guard text.count <= 2048, text.allSatisfy({ $0 > 0x20 && $0 < 0x7F }),
            case .success(let url) = AbsoluteURL.parse(String(decoding: text, as: UTF8.self)),
            url.pathAndQuery == "/", text.last != UInt8(ascii: "/"), !text.contains(UInt8(ascii: "?"))
        else { return nil }
        return WebOrigin(scheme: url.scheme, authority: url.authority)
    }

    /// The origin of an absolute http(s) URL (a `Referer`), or nil.
    public static func ofURL(_ bytes: some Collection<UInt8>) -> WebOrigin? {
        guard bytes.count <= 8192, bytes.allSatisfy({ $0 > 0x20 && $0 < 0x7F }),
            case .success(let url) = AbsoluteURL.parse(String(decoding: bytes, as: UTF8.self))
        else { return nil }
        return WebOrigin(scheme: url.scheme, authority: url.authority)
    }
}

/// Why a request for a protected origin was judged a web page's request from elsewhere.
public struct BrowserRefusal: Sendable, Equatable, Error {
    /// The rule that fired.
    public enum Rule: Sendable, Equatable {
        /// `Sec-Fetch-Site` was `cross-site`, `same-site` or a value no browser sends (lower-cased, clipped).
        case fetchSite(String)
        /// `Origin` names another origin than the request's.
        case foreignOrigin
        /// `Origin` is `null` or not an http(s) origin: an initiator nobody can vouch for.
        case opaqueOrigin
        /// More than one `Origin` or `Sec-Fetch-Site` field.
        case repeated
    }

    public let rule: Rule
    /// The page's origin, where the request names one (from `Origin`, else `Referer`).
    public let from: WebOrigin?
    /// The protected origin (`https://api.example.com`).
    public let origin: String
    /// The configuration file of its section ("" when unknown).
    public let file: String

    /// What `Proxy-Status` says: the rule, in a few words.
    public var details: String {
        let what: String
        switch rule {
        case .fetchSite(let value): what = "Sec-Fetch-Site: \(value)"
        case .foreignOrigin: what = "Origin is another origin"
        case .opaqueOrigin: what = "Origin is null or not an http(s) origin"
        case .repeated: what = "more than one Origin or Sec-Fetch-Site field"
        }
        return "request from a web page of another origin (\(what)); no token attached (browser_requests = refuse)"
    }

    /// The sentence for a person: what happened, and the two keys that change it.
    public var message: String {
        let section = "[origin \(origin)]" + (file.isEmpty ? "" : " of \(file)")
        let page = from.map { "a web page on \($0)" } ?? "a web page of another origin"
        let allow =
            from.map { "add allowed_request_origins = \($0) to \(section)" }
            ?? "add the web app's origin to allowed_request_origins in \(section)"
        return
            "proxyctl: \(page) asked for \(origin) through this proxy, and the proxy attaches your token only to requests from tools and from \(origin)'s own pages (\(details)); if that page is a web app you run and trust, \(allow), or set browser_requests = allow there"
    }
}

/// The rule of one protected origin: `browser_requests` and `allowed_request_origins`.
public enum BrowserRequests {
    /// The refusal for a request to `own` (policy `refuse`) whose fields say it comes from a page of another
    /// origin, or nil when it may have the token: a tool's request (neither `Sec-Fetch-Site` nor `Origin`), the
    /// origin's own page, the user's own navigation (`Sec-Fetch-Site: none`), or a page of an `allowed` origin.
    /// Values are the field values as received (a list when the field came more than once).
    public static func check(
        fetchSite: [ArraySlice<UInt8>], origin: [ArraySlice<UInt8>], referer: [ArraySlice<UInt8>],
        own: WebOrigin, allowed: [WebOrigin], section: (origin: String, file: String)
    ) -> BrowserRefusal? {
        // A tool (curl, an SDK, git): no Fetch Metadata and no Origin. A Referer alone says nothing (curl -e).
        if fetchSite.isEmpty && origin.isEmpty { return nil }
        func refuse(_ rule: BrowserRefusal.Rule, _ from: WebOrigin?) -> BrowserRefusal {
            BrowserRefusal(rule: rule, from: from, origin: section.origin, file: section.file)
        }
        if fetchSite.count > 1 || origin.count > 1 { return refuse(.repeated, nil) }
        var initiator: WebOrigin? = nil
        if let value = origin.first {
            guard let parsed = WebOrigin.parse(trimmed(value)) else { return refuse(.opaqueOrigin, nil) }
            initiator = parsed
            if parsed != own && !allowed.contains(parsed) { return refuse(.foreignOrigin, parsed) }
        } else if referer.count == 1, let first = referer.first {
            initiator = WebOrigin.ofURL(trimmed(first))
        }
        if let value = fetchSite.first {
            let site = trimmed(value)
            if ASCII.equalsLowercase(site, "same-origin") || ASCII.equalsLowercase(site, "none") { return nil }
            // cross-site, same-site, or a value no browser sends (fail closed): only a page of an allowed origin.
            if let initiator, initiator == own || allowed.contains(initiator) { return nil }
            return refuse(.fetchSite(ASCII.printable(site.prefix(32)).lowercased()), initiator)
        }
        return nil
    }

    /// A field value without the optional whitespace around it (RFC 9110 §5.5).
    static func trimmed(_ value: ArraySlice<UInt8>) -> ArraySlice<UInt8> {
        var slice = value
        while let first = slice.first, first == ASCII.space || first == ASCII.tab { slice.removeFirst() }
        while let last = slice.last, last == ASCII.space || last == ASCII.tab { slice.removeLast() }
        return slice
    }
}
