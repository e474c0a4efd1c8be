import Testing

@testable import ProxyCore

/// The proxy's answer when a protected origin's certificate does not verify names the fix where a CA is the
/// fix: `ca_file` in the origin's section of its file.
@Suite struct UpstreamFailureTests {
    static let hop = HostPort(host: "api.test", port: 34223, kind: .name)

    @Test func aPrivateCANamesCAFileInTheOriginsSection() {
        let answer = UpstreamFailure.certificate.answer(
            hop: Self.hop, proxy: nil, detail: "self-signed certificate in certificate chain",
            origin: OriginTrust(url: "https://api.test:34223", caFile: nil, file: "/home/ada/proxy.conf"))
        let response = answer.response
        #expect(response.status == 502)
        #expect(
            response.message
                == "proxyctl: the certificate of api.test:34223 does not verify: self-signed certificate in certificate chain; if the origin's certificate comes from a private CA, set ca_file = FILE (that CA's PEM) in [origin https://api.test:34223] of /home/ada/proxy.conf"
        )
        #expect(response.proxyStatus?.error == .tlsCertificateError)
    }

    @Test func aCAFileWithoutTheIssuerIsNamed() {
        let answer = UpstreamFailure.certificate.answer(
            hop: Self.hop, proxy: nil, detail: "unable to get local issuer certificate",
            origin: OriginTrust(url: "https://api.test:34223", caFile: "/etc/ca.pem", file: "p.conf"))
        #expect(
            answer.response.message
                == "proxyctl: the certificate of api.test:34223 does not verify: unable to get local issuer certificate; the CA that issued it is not in ca_file = /etc/ca.pem of [origin https://api.test:34223] of p.conf: add it there"
        )
    }

    @Test(arguments: ["certificate has expired", "hostname mismatch"])
    func whatACADoesNotFixGetsNoCAHint(detail: String) {
        let answer = UpstreamFailure.certificate.answer(
            hop: Self.hop, proxy: nil, detail: detail, origin: OriginTrust(url: "https://api.test:34223", caFile: nil))
        #expect(answer.response.message == "proxyctl: the certificate of api.test:34223 does not verify: \(detail)")
    }

    @Test func withoutTheOriginTheAnswerIsAsBefore() {
        #expect(
            UpstreamFailure.certificate.answer(hop: Self.hop, proxy: nil, detail: "self-signed certificate").response
                .message == "proxyctl: the certificate of api.test:34223 does not verify: self-signed certificate")
    }
}
