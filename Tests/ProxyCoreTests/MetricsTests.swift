import Foundation
import Testing

@testable import ProxyCore

/// What the admin listener's `/metrics` is built from: the outcomes the connection machine reports (one per
/// request) and their exposition. The integration suite parses the real output with prometheus_client.
@Suite struct MetricsTests {
    @Test func aForwardedRequestIsOnePassthroughOutcomeWithItsBytes() {
        var p = Playbook.frontDoor()
        p.client(ForwardingPlaybooks.get)
        p.connectUpstream()
        p.upstream(ForwardingPlaybooks.ok)
        #expect(p.outcomes.count == 1)
        let outcome = p.outcomes[0]
        #expect(outcome.kind == .passthrough && outcome.status == 200 && outcome.proxyError == nil)
        #expect(outcome.up == 33 && outcome.down == 40 && outcome.milliseconds != nil)
    }

    @Test func anAnswerOfTheProxysOwnCarriesItsKindAndProxyStatusType() {
        var p = Playbook.frontDoor()
        p.client("GET http://o.test/a HTTP/1.1\nHost: o.test\n\n".crlf)
        _ = p.next()
        p.event(.resolved(.notFound))
        #expect(p.outcomes.count == 1)
        #expect(p.outcomes[0].kind == .passthrough && p.outcomes[0].status == 502)
        #expect(p.outcomes[0].proxyError == "dns_error" && p.outcomes[0].isUpstreamError)

        var refused = Playbook.frontDoor()
        refused.client("GET /not-a-proxy-request HTTP/1.1\nHost: o.test\n\n".crlf)
        #expect(refused.outcomes.map(\.kind) == [.proxy])
        #expect(refused.outcomes[0].status == 400 && !refused.outcomes[0].isUpstreamError)

        var connect = Playbook.frontDoor()
        connect.client("CONNECT o.test:443 HTTP/1.1\nHost: o.test:443\n\n".crlf)
        _ = connect.next()
        connect.event(.resolved(.addresses(Playbook.addresses(1))))
        _ = connect.next()
        connect.event(.upstreamConnectFailed(.refused))
        #expect(connect.outcomes.map(\.kind) == [.connect])
        #expect(connect.outcomes[0].status == 502 && connect.outcomes[0].proxyError == "connection_refused")
    }

    @Test func exchangesCountTheirTokenWork() {
        var registry = MetricsRegistry()
        let record = ExchangeRecord(
            method: "GET", origin: "https://api.test", provider: "corp", target: "/secret?token=x", status: 200,
            attempts: 2, keptClientAuthorization: false, attached: true, refreshed: true, nonceRetried: false,
            stepUp: false, answeredByProxy: false, note: nil, close: false)
        registry.recordExchange(record, up: 10, down: 20, milliseconds: 30)
        #expect(registry.requests["intercepted"]?["2xx"] == 1)
        #expect(registry.providers["corp"]?.tokensAttached == 1 && registry.providers["corp"]?.replays == 1)
        let text = registry.render(version: "1.0")
        // Nothing of the request but its kind and status class reaches a label.
        #expect(!text.contains("/secret") && !text.contains("token=x") && !text.contains("api.test"))
        #expect(text.contains("proxyctl_requests_total{kind=\"intercepted\",status_class=\"2xx\"} 1\n"))
        #expect(text.contains("proxyctl_bytes_total{kind=\"intercepted\",direction=\"down\"} 20\n"))
        #expect(text.contains("proxyctl_request_duration_seconds_bucket{kind=\"intercepted\",le=\"0.05\"} 1\n"))
        #expect(text.contains("proxyctl_request_duration_seconds_bucket{kind=\"intercepted\",le=\"0.025\"} 0\n"))
        #expect(text.contains("proxyctl_request_duration_seconds_count{kind=\"intercepted\"} 1\n"))
    }

    @Test func labelValuesAreEscaped() {
        #expect(MetricsRegistry.labels([("a", "x\"y\\z\nw")]) == "{a=\"x\\\"y\\\\z\\nw\"}")
        #expect(RequestOutcome.statusClass(0) == "none" && RequestOutcome.statusClass(503) == "5xx")
    }

    @Test func adminListenIsNeverTheProxysPort() {
        let parser = ConfigParser(homeDirectory: "/home/ada", baseDirectory: "/etc/proxyctl")
        guard
            case .failure(let errors) = parser.parse(
                "[proxy]\nlisten = 127.0.0.1:9000\nadmin_listen = 9000\n", file: "p.conf")
        else {
            Issue.record("accepted the proxy's own port for admin_listen")
            return
        }
        #expect(errors.errors.map(\.key) == ["admin_listen"] && errors.errors[0].line == 3)
    }

    @Test func environmentOverridesAreCheckedLikeTheKeyAndNameTheVariable() {
        let parser = ConfigParser(homeDirectory: "/home/ada", baseDirectory: "/srv")
        var configuration = Configuration()
        let none = parser.applyOverrides(
            [
                ("$PROXYCTL_LISTEN", "listen", "0.0.0.0:3128"),
                ("$PROXYCTL_PROXY_AUTH_FILE", "proxy_auth_file", "users"),
            ],
            to: &configuration)
        #expect(none.isEmpty)
        #expect(configuration.proxy.listen == ListenAddress(host: "0.0.0.0", port: 3128, isIPv6: false))
        #expect(configuration.proxy.proxyAuthFile == "/srv/users")
        let errors = parser.applyOverrides([("$PROXYCTL_LISTEN", "listen", "everywhere")], to: &configuration)
        #expect(errors.count == 1)
        #expect(errors[0].description.hasPrefix("$PROXYCTL_LISTEN: [proxy] listen: expected HOST:PORT"))
    }
}
