import ProxyCore
import ProxyOAuth

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

/// The protected resource metadata a protected origin's 401 names (RFC 9728 §5.1), fetched under
/// `MetadataFetcher`'s rules (https or loopback http, no redirect to another origin, 64 KiB) and judged by
/// `ResourceMetadataVerdict` against the provider's issuer: once per URL and issuer for five minutes (30 s when it
/// could not be read), every exchange asking meanwhile joining the fetch in flight. Only URLs on the origin's own
/// origin get here (`AuthExchange`), fetched with the origin's `ca_file`, so an origin cannot make the proxy
/// fetch from anywhere else; and the verdict only ever adds words for the user (nothing switches providers).
final class ResourceMetadataLookup {
    private struct Key: Hashable {
        let url: String
        let issuer: String
    }

    private let loop: EventLoop
    private let transport: CurlTransport
    private var known: [Key: (verdict: ResourceMetadataVerdict, until: Int64)] = [:]
    private var waiting: [Key: [(ResourceMetadataVerdict) -> Void]] = [:]
    /// How long an exchange waits for the document (milliseconds).
    static let timeout = 5_000

    init(loop: EventLoop, settings: ProxySettings) {
        self.loop = loop
        transport = CurlTransport(
            loop: loop, upstreamProxy: settings.upstreamProxy, bypass: settings.noUpstreamProxy,
            resolve: settings.resolve)
    }

    /// Calls `completion` on the loop with what the metadata at `url` says of `issuer` (unknown without one).
    func verdict(
        url: String, origin: OriginConfig, issuer: String?, _ completion: @escaping (ResourceMetadataVerdict) -> Void
    ) {
        guard let issuer else { return completion(.unknown("the origin's provider is not configured")) }
        let key = Key(url: url, issuer: issuer)
        let now = EventLoop.monotonicMilliseconds()
        if let cached = known[key], cached.until > now { return completion(cached.verdict) }
        if waiting[key] != nil {
            waiting[key]?.append(completion)
            return
        }
        waiting[key] = [completion]
        let fetcher = MetadataFetcher(transport: transport, caFile: origin.caFile, timeout: Self.timeout)
        let originURL = origin.url
        let loop = self.loop
        let bound = LoopBound(self, loop: loop)
        Task {
            let verdict: ResourceMetadataVerdict
            do {
                let fetched = try await fetcher.get(url)
                if fetched.response.status == 200, case .success(let json) = JSON.parse(fetched.response.body) {
                    verdict = ResourceMetadataVerdict.judge(json, origin: originURL, issuer: issuer)
                } else {
                    verdict = .unknown("\(TargetText.withoutQuery(url)) answered \(fetched.response.status)")
                }
            } catch {
                verdict = .unknown("\(error)")
            }
            loop.post { bound.value.settle(key, verdict) }
        }
    }

    private func settle(_ key: Key, _ verdict: ResourceMetadataVerdict) {
        let lifetime: Int64 = if case .unknown = verdict { 30_000 } else { 300_000 }
        known[key] = (verdict, EventLoop.monotonicMilliseconds() + lifetime)
        if known.count > 256 { known.removeAll() }
        for completion in waiting.removeValue(forKey: key) ?? [] { completion(verdict) }
    }
}
