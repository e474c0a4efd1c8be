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

/// `proxyctl doctor`'s look at each runtime on this machine: does this shell's environment give it the proxy
/// and the local CA the way that runtime reads them (docs/clients.md)?
enum RuntimeCheck {
    enum Outcome: Equatable {
        case ok(String)
        case fix(String, how: String)
        case note(String)
    }

    struct Finding: Equatable {
        let runtime: String
        let outcome: Outcome
    }

    static let envFix = "eval \"$(proxyctl env)\" (or run it with proxyctl exec -- COMMAND)"

    /// - Parameters:
    ///   - bundle: the CA bundle runtimes must trust (nil without protected https origins).
    static func run(
        environment: [String: String], bundle: String?, trustStore: String, clientFiles: ClientEnvironment.Files
    ) -> [Finding] {
        let path = environment["PATH"]
        func has(_ command: String) -> String? { ChildProcess.which(command, path: path) }
        func value(_ name: String) -> String? { environment[name].flatMap { $0.isEmpty ? nil : $0 } }
        var findings: [Finding] = []
        func add(_ runtime: String, _ outcome: Outcome) { findings.append(Finding(runtime: runtime, outcome: outcome)) }
        /// The variable points at the bundle (or nothing is needed).
        func trusts(_ runtime: String, _ variables: [String]) -> Bool {
            guard let bundle else { return true }
            if variables.contains(where: { value($0) == bundle }) { return true }
            add(
                runtime,
                .fix(
                    "does not trust the local CA (\(variables.map { "\($0) is \(value($0) ?? "not set")" }.joined(separator: ", ")))",
                    how: envFix))
            return false
        }
        let proxySet = value("HTTPS_PROXY") ?? value("https_proxy") != nil

        if has("curl") != nil, trusts("curl", ["CURL_CA_BUNDLE", "SSL_CERT_FILE"]) {
            add(
                "curl",
                proxySet ? .ok("HTTPS_PROXY and CURL_CA_BUNDLE are set") : .fix("HTTPS_PROXY is not set", how: envFix))
        }
        if has("wget") != nil {
            // wget (GnuTLS) reads only its wgetrc's ca_certificate.
            if bundle == nil || value("WGETRC") == clientFiles.wgetrc {
                add("wget", .ok("WGETRC names the CA bundle"))
            } else {
                add("wget", .fix("wget ignores SSL_CERT_FILE; WGETRC is \(value("WGETRC") ?? "not set")", how: envFix))
            }
        }
        if has("git") != nil, trusts("git", ["GIT_SSL_CAINFO"]) {
            add("git", .ok("GIT_SSL_CAINFO names the CA bundle"))
        }
        if has("python3") != nil || has("pip") != nil,
            trusts("python", ["REQUESTS_CA_BUNDLE"]), trusts("pip", ["PIP_CERT"]),
            trusts("python ssl", ["SSL_CERT_FILE"])
        {
            add(
                "python",
                .ok(
                    "SSL_CERT_FILE, REQUESTS_CA_BUNDLE and PIP_CERT name the CA bundle (requests, httpx, aiohttp, urllib, pip)"
                ))
        }
        if let node = has("node") {
            let version = Self.output(node, ["--version"])?.trimmingWhitespace() ?? "?"
            let numbers = version.dropFirst().split(separator: ".").compactMap { Int($0) }
            let (major, minor) = (numbers.first ?? 0, numbers.count > 1 ? numbers[1] : 0)
            let native = major >= 25 || (major == 24 && minor >= 5) || (major == 22 && minor >= 21)
            if native {
                if value("NODE_USE_ENV_PROXY") == "1" {
                    add("node \(version)", .ok("NODE_USE_ENV_PROXY=1: fetch and https use HTTPS_PROXY"))
                } else {
                    add(
                        "node \(version)",
                        .fix("fetch and https ignore HTTPS_PROXY unless NODE_USE_ENV_PROXY=1", how: envFix))
                }
            } else if value("NODE_OPTIONS")?.contains(clientFiles.nodePreload) == true {
                add("node \(version)", .ok("NODE_OPTIONS preloads proxyctl's agent: fetch and https use HTTPS_PROXY"))
            } else {
                add(
                    "node \(version)",
                    .fix(
                        "Node before 22.21 ignores HTTPS_PROXY in fetch and https (NODE_USE_ENV_PROXY does not exist yet) and NODE_OPTIONS does not preload proxyctl's agent",
                        how: envFix))
            }
            if bundle != nil && value("NODE_EXTRA_CA_CERTS") == nil {
                add(
                    "node \(version)",
                    .fix("NODE_EXTRA_CA_CERTS is not set: Node does not trust the local CA", how: envFix))
            }
        }
        if has("java") != nil {
            let options = value("JAVA_TOOL_OPTIONS") ?? ""
            if !options.contains("-Dhttps.proxyHost=") {
                add(
                    "java",
                    .fix("Java reads no proxy variable; JAVA_TOOL_OPTIONS has no -Dhttps.proxyHost", how: envFix))
            } else if bundle != nil && !options.contains("-Djavax.net.ssl.trustStore=\(trustStore)") {
                add(
                    "java",
                    .fix(
                        "Java cannot read a PEM bundle; JAVA_TOOL_OPTIONS does not name the trust store \(trustStore)",
                        how: envFix + "; or: proxyctl ca export --bundle --format pkcs12 --output FILE"))
            } else {
                add("java", .ok("JAVA_TOOL_OPTIONS sets the proxy and the PKCS#12 trust store"))
            }
        }
        if has("go") != nil, trusts("go", ["SSL_CERT_FILE"]) { add("go", .ok("HTTPS_PROXY and SSL_CERT_FILE are set")) }
        if has("cargo") != nil, trusts("cargo", ["CARGO_HTTP_CAINFO"]),
            trusts("rust (reqwest, rustls-native-certs)", ["SSL_CERT_FILE"])
        {
            add("rust", .ok("CARGO_HTTP_CAINFO and SSL_CERT_FILE name the CA bundle"))
        }
        for builder in ["docker", "podman"] where has(builder) != nil {
            add(
                builder,
                .note(
                    "builds do not inherit the proxy: pass it as build arguments with the host's network, e.g. \(builder) build --network host --build-arg HTTPS_PROXY --build-arg SSL_CERT_FILE=/tmp/proxyctl-ca.pem (docs/clients.md)"
                ))
        }
        return findings
    }

    /// The standard output of a short command, or nil.
    static func output(_ executable: String, _ arguments: [String]) -> String? {
        guard let outcome = try? ChildProcess.run(executable, arguments, output: .capture, error: .null) else {
            return nil
        }
        return String(validating: outcome.output, as: UTF8.self)
    }
}
