import ProxyCore
import ProxyOAuth
import ProxyTLS

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// The variables that point every common runtime at the proxy and make it trust the local CA: what
/// `proxyctl env` prints and `proxyctl exec` sets. docs/clients.md says, per runtime, what each one does.
enum ClientEnvironment {
    /// Variables that take a whole bundle, for the runtimes that read them.
    static let bundleVariables = [
        "SSL_CERT_FILE",  // OpenSSL, Go, Ruby, Python's ssl, Rust's rustls-native-certs
        "CURL_CA_BUNDLE",  // curl
        "REQUESTS_CA_BUNDLE",  // Python requests
        "PIP_CERT",  // pip
        "GIT_SSL_CAINFO",  // git
        "AWS_CA_BUNDLE",  // AWS CLI and SDKs
        "HTTPLIB2_CA_CERTS",  // httplib2 (gcloud)
        "CARGO_HTTP_CAINFO",  // cargo
        "DENO_CERT",  // Deno
    ]

    /// The files proxyctl writes for runtimes that need one, in state_dir.
    struct Files {
        let stateDirectory: String
        var wgetrc: String { stateDirectory + "/clients/wgetrc" }
        var nodePreload: String { stateDirectory + "/clients/node-proxy.cjs" }
    }

    /// The variables for a proxy at `proxyURL` (credentials included, if any). `inherited` is the
    /// environment the variables are added to (for NODE_OPTIONS and JAVA_TOOL_OPTIONS, which may already hold
    /// options of the user's). Returns notes for the user too.
    static func variables(
        _ configuration: Configuration, stateDirectory: String?, proxyURL: String, inherited: [String: String]
    ) -> (variables: [(String, String)], notes: [String]) {
        var variables: [(String, String)] = [
            ("HTTPS_PROXY", proxyURL), ("https_proxy", proxyURL), ("HTTP_PROXY", proxyURL), ("http_proxy", proxyURL),
            // Node 22.21+ and 24.5+ read the proxy variables for fetch and https only when asked to.
            ("NODE_USE_ENV_PROXY", "1"),
        ]
        var notes: [String] = []
        // `placeholder_env`: tools that refuse to start without a key get one that is visibly none; the proxy puts
        // the secret in its place for that origin alone.
        for origin in configuration.origins.origins {
            guard let variable = origin.placeholderEnv, let entry = origin.placeholders.entry(for: origin.url) else {
                continue
            }
            variables.append((variable, String(decoding: entry.value, as: UTF8.self)))
        }
        guard let stateDirectory else { return (variables, notes) }
        let files = Files(stateDirectory: stateDirectory)
        let caFiles = LocalCA.Files(stateDirectory: stateDirectory)
        var bundle: String? = nil
        if (try? LocalCA.load(caFiles)) != nil {
            // Rewrite the bundle (and the Java trust store) so that they carry the current roots: those this
            // environment trusted already (SSL_CERT_FILE naming another bundle, a corporate one say), else the
            // system's.
            var roots = LocalCA.systemRootsPath()
            if let own = inherited["SSL_CERT_FILE"], !own.isEmpty, own != caFiles.bundle,
                FileManager.default.isReadableFile(atPath: own)
            {
                roots = own
            }
            do {
                try LocalCA.refreshBundle(caFiles, systemRoots: roots)
            } catch {
                notes.append("cannot rewrite the CA bundle: \(error)")
            }
            bundle = caFiles.bundle
            for name in bundleVariables { variables.append((name, caFiles.bundle)) }
            // Node adds these to its own bundled roots: the whole bundle, so that Node also trusts what this
            // system (or the SSL_CERT_FILE given) trusts, a corporate root say, and not only the local CA.
            variables.append(("NODE_EXTRA_CA_CERTS", caFiles.bundle))
        } else if !configuration.origins.tlsHosts.isEmpty {
            notes.append("No local CA yet: run proxyctl ca init, then this command again.")
        }
        do {
            try SecureFile.makePrivateDirectory(stateDirectory)
            try SecureFile.makePrivateDirectory(stateDirectory + "/clients")
            // wget (GnuTLS) reads no CA variable: only its wgetrc's ca_certificate.
            if let bundle {
                try SecureFile.write(
                    Array(wgetrc(bundle: bundle, home: inherited["HOME"]).utf8), to: files.wgetrc, mode: 0o644)
                variables.append(("WGETRC", files.wgetrc))
            }
            // Node before 22.21 (and 24.0 to 24.4) ignores the proxy variables in fetch and https: a preload
            // script routes both through the proxy (it does nothing where Node does it itself).
            try SecureFile.write(Array(nodePreload.utf8), to: files.nodePreload, mode: 0o644)
            variables.append(("NODE_OPTIONS", nodeOptions(inherited["NODE_OPTIONS"], preload: files.nodePreload)))
        } catch {
            notes.append("cannot write the runtime files in \(stateDirectory)/clients: \(error)")
        }
        // Java reads neither the proxy variables nor a PEM bundle.
        if let proxy = proxyAddress(proxyURL) {
            variables.append(
                (
                    "JAVA_TOOL_OPTIONS",
                    javaOptions(
                        inherited["JAVA_TOOL_OPTIONS"], host: proxy.host, port: proxy.port,
                        trustStore: bundle != nil ? caFiles.trustStore : nil)
                ))
        }
        return (variables, notes)
    }

    /// A proxy URL without its password, for messages.
    static func redacted(_ url: String) -> String {
        guard let at = url.lastIndex(of: "@"), let scheme = url.firstRange(of: "://"), scheme.upperBound < at else {
            return url
        }
        return url[..<scheme.upperBound] + "***" + url[at...]
    }

    /// Host and port of `http://[user:password@]host:port`.
    static func proxyAddress(_ url: String) -> (host: String, port: Int)? {
        var text = url
        // The user name and password (proxyctl exec's credential) are no part of the address.
        if let scheme = text.firstRange(of: "://"), let at = text.lastIndex(of: "@"), scheme.upperBound < at {
            text = String(text[..<scheme.upperBound]) + String(text[text.index(after: at)...])
        }
        guard case .success(let parsed) = AbsoluteURL.parse(text) else { return nil }
        return (parsed.authority.host, parsed.authority.port)
    }

    /// ca_certificate for wget, then the user's own ~/.wgetrc (WGETRC replaces it, so it is carried along).
    static func wgetrc(bundle: String, home: String?) -> String {
        var text = "# Written by proxyctl (proxyctl env): wget's CA bundle, then the lines of ~/.wgetrc.\n"
        text += "ca_certificate = \(bundle)\n"
        if let home, let own = try? String(contentsOfFile: home + "/.wgetrc", encoding: .utf8) {
            text += "# ~/.wgetrc\n" + own + (own.hasSuffix("\n") ? "" : "\n")
        }
        return text
    }

    /// NODE_OPTIONS with the preload first and the user's options after it (a previous preload of ours is
    /// not repeated).
    static func nodeOptions(_ existing: String?, preload: String) -> String {
        let ours = preload.contains(" ") ? "--require \"\(preload)\"" : "--require=\(preload)"
        var rest = existing ?? ""
        for previous in ["--require=\(preload)", "--require \"\(preload)\""] {
            rest = rest.replacing(previous, with: "")
        }
        rest = rest.trimmingOWS()
        return rest.isEmpty ? ours : ours + " " + rest
    }

    /// The proxy and trust store properties for every JVM (HttpURLConnection and java.net.http honour them),
    /// then the user's options, whose own settings of these keys are dropped.
    static func javaOptions(_ existing: String?, host: String, port: Int, trustStore: String?) -> String {
        let javaHost = host.contains(":") ? "[\(host)]" : host
        var ours = [
            "-Dhttps.proxyHost=\(javaHost)", "-Dhttps.proxyPort=\(port)", "-Dhttp.proxyHost=\(javaHost)",
            "-Dhttp.proxyPort=\(port)",
        ]
        if let trustStore {
            ours += [
                "-Djavax.net.ssl.trustStore=\(trustStore)", "-Djavax.net.ssl.trustStoreType=PKCS12",
                "-Djavax.net.ssl.trustStorePassword=\(TrustStore.password)",
            ]
        }
        let keys = Set(ours.map { String($0.split(separator: "=", maxSplits: 1)[0]) })
        let rest = (existing ?? "").split(separator: " ").filter {
            !keys.contains(String($0.split(separator: "=", maxSplits: 1)[0]))
        }
        return (ours + rest.map(String.init)).joined(separator: " ")
    }

    /// A CommonJS preload for Node versions whose built-in fetch and https ignore HTTPS_PROXY (before 22.21,
    /// and 24.0 to 24.4): https.globalAgent and fetch's global dispatcher open their connections through a
    /// CONNECT tunnel, honouring NO_PROXY. Only Node's own modules are used.
    static let nodePreload = #"""
        // Written by proxyctl (proxyctl env / exec): routes Node's built-in fetch and https through
        // HTTPS_PROXY on Node versions that do not (NODE_USE_ENV_PROXY arrived in Node 22.21 and 24.5).
        'use strict';
        (function () {
          const [major, minor] = process.versions.node.split('.').map(Number);
          const native = major >= 25 || (major === 24 && minor >= 5) || (major === 22 && minor >= 21);
          if (native && process.env.NODE_USE_ENV_PROXY === '1') return;
          const text = process.env.HTTPS_PROXY || process.env.https_proxy;
          if (!text) return;
          let proxy;
          try { proxy = new URL(text); } catch { return; }
          if (proxy.protocol !== 'http:') return;
          const http = require('http');
          const https = require('https');
          const tls = require('tls');
          const net = require('net');
          const proxyHost = proxy.hostname.replace(/^\[|\]$/g, '');
          const proxyPort = Number(proxy.port) || 80;
          const authorization = proxy.username
            ? 'Basic ' + Buffer.from(decodeURIComponent(proxy.username) + ':' + decodeURIComponent(proxy.password)).toString('base64')
            : null;
          const noProxy = (process.env.NO_PROXY || process.env.no_proxy || '')
            .split(',').map((entry) => entry.trim().toLowerCase()).filter(Boolean);
          function bypass(host) {
            host = String(host).toLowerCase().replace(/^\[|\]$/g, '');
            return noProxy.some((entry) => entry === '*' || host === entry.replace(/^\./, '')
              || host.endsWith(entry.startsWith('.') ? entry : '.' + entry));
          }
          function tunnel(host, port, callback) {
            const bare = String(host).replace(/^\[|\]$/g, '');
            const target = (bare.includes(':') ? '[' + bare + ']' : bare) + ':' + port;
            const headers = { host: target };
            if (authorization) headers['proxy-authorization'] = authorization;
            const request = http.request({ host: proxyHost, port: proxyPort, method: 'CONNECT', path: target, headers, agent: false });
            request.once('connect', (response, socket, head) => {
              if (response.statusCode !== 200) {
                socket.destroy();
                callback(new Error('the proxy answered CONNECT ' + target + ' with ' + response.statusCode + ' ' + response.statusMessage));
                return;
              }
              if (head && head.length) socket.unshift(head);
              callback(null, socket);
            });
            request.once('error', (error) => callback(error));
            request.end();
          }
          class ProxyAgent extends https.Agent {
            createConnection(options, callback) {
              const host = options.host || options.hostname || 'localhost';
              const port = Number(options.port) || 443;
              if (bypass(host)) return super.createConnection(options, callback);
              tunnel(host, port, (error, socket) => {
                if (error) return callback(error);
                const servername = options.servername || (net.isIP(host) ? undefined : host);
                callback(null, tls.connect({ ...options, socket, servername }));
              });
              return undefined;
            }
          }
          https.globalAgent = new ProxyAgent({ keepAlive: true });
          // fetch: Node's bundled undici keeps its dispatcher under this symbol; reading globalThis.Headers loads
          // undici (fetch itself loads it only when first called), which installs its default Agent.
          const symbol = Symbol.for('undici.globalDispatcher.1');
          void globalThis.Headers;
          const current = globalThis[symbol];
          if (!current || typeof current.constructor !== 'function') return;
          const Agent = current.constructor;
          globalThis[symbol] = new Agent({
            connect(options, callback) {
              const host = options.hostname || options.host;
              const secure = options.protocol === 'https:';
              const port = Number(options.port) || (secure ? 443 : 80);
              const finish = (socket) => {
                if (!secure) { callback(null, socket); return; }
                const servername = options.servername || (net.isIP(host) ? undefined : host);
                const session = tls.connect({ socket, servername, ALPNProtocols: ['http/1.1'] });
                session.once('secureConnect', () => callback(null, session));
                session.once('error', (error) => callback(error));
              };
              if (bypass(host)) {
                const socket = net.connect({ host, port });
                socket.once('connect', () => finish(socket));
                socket.once('error', (error) => callback(error));
                return;
              }
              tunnel(host, port, (error, socket) => (error ? callback(error) : finish(socket)));
            },
          });
        })();

        """#
}
