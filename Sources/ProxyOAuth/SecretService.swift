import Dispatch
import Synchronization

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

/// The freedesktop Secret Service (GNOME Keyring, KeePassXC...) for `token_store = secret-service`, through
/// libsecret's own command-line client `secret-tool` (Debian package libsecret-tools), so that proxyctl links
/// no GLib and runs the same where there is no desktop. The secret always travels on a pipe, never in argv.
/// Items carry the attributes application=proxyctl, state_dir, provider and kind (`refresh_token`,
/// `dpop_key`), so that two state directories never share an item.
public struct SecretService: Sendable {
    public let tool: String
    public let stateDirectory: String

    public enum Kind: String, Sendable {
        case refreshToken = "refresh_token"
        case dpopKey = "dpop_key"
        /// A static secret of an origin (`secret = NAME`, `proxyctl secret set NAME`): `provider` is its name.
        case staticSecret = "static_secret"
    }

    public struct Failure: Error, Sendable, CustomStringConvertible {
        public let description: String
    }

    // MARK: - The process-wide choice

    private static let current = Mutex<SecretService?>(nil)

    /// The Secret Service this process keeps secrets in (set by the CLI from `token_store`); nil: files only.
    public static var configured: SecretService? { current.withLock { $0 } }

    public static func configure(_ service: SecretService?) { current.withLock { $0 = service } }

    /// The Secret Service when it can be used, else why not (then the 0600 files are used): no secret-tool,
    /// no D-Bus session (a headless machine), or no service answering on it.
    public static func connect(stateDirectory: String, environment: [String: String]) -> Result<SecretService, Failure>
    {
        guard let tool = ChildProcess.which("secret-tool", path: environment["PATH"]) else {
            return .failure(Failure(description: "secret-tool is not installed (Debian package libsecret-tools)"))
        }
        let runtime = environment["XDG_RUNTIME_DIR"].map { $0 + "/bus" }
        guard environment["DBUS_SESSION_BUS_ADDRESS"] != nil || runtime.map(FileManager.default.fileExists) == true
        else {
            return .failure(Failure(description: "there is no D-Bus session (a headless machine)"))
        }
        let service = SecretService(tool: tool, stateDirectory: stateDirectory)
        do {
            _ = try service.lookup(provider: ".probe", kind: .refreshToken)
        } catch let failure as Failure {
            return .failure(failure)
        } catch {
            return .failure(Failure(description: "\(error)"))
        }
        return .success(service)
    }

    public init(tool: String, stateDirectory: String) {
        self.tool = tool
        self.stateDirectory = stateDirectory
    }

    func attributes(_ provider: String, _ kind: Kind) -> [String] {
        ["application", "proxyctl", "state_dir", stateDirectory, "provider", provider, "kind", kind.rawValue]
    }

    /// Stores (or replaces) the provider's secret of `kind`.
    public func store(_ secret: [UInt8], provider: String, kind: Kind) throws {
        let what =
            switch kind {
            case .refreshToken: "refresh token"
            case .dpopKey: "DPoP key"
            case .staticSecret: "secret"
            }
        let label = "proxyctl \(what) for \(provider)"
        let outcome = try run(["store", "--label=\(label)"] + attributes(provider, kind), input: secret)
        guard outcome.status == 0 else {
            throw Failure(description: "the Secret Service did not store the \(kind.rawValue): \(outcome.error)")
        }
    }

    /// The provider's secret of `kind`, or nil when the Secret Service holds none.
    public func lookup(provider: String, kind: Kind) throws -> [UInt8]? {
        let outcome = try run(["lookup"] + attributes(provider, kind), input: nil)
        if outcome.status == 0 { return outcome.output }
        // secret-tool exits 1 without a message when nothing matches, and with one when the service failed.
        if outcome.status == 1 && outcome.error.isEmpty { return nil }
        throw Failure(description: "the Secret Service cannot be read: \(outcome.error)")
    }

    /// Removes the provider's secret of `kind`, if any.
    public func clear(provider: String, kind: Kind) {
        _ = try? run(["clear"] + attributes(provider, kind), input: nil)
    }

    private func run(_ arguments: [String], input: [UInt8]?) throws -> (status: Int32, output: [UInt8], error: String) {
        let outcome: ChildProcess.Outcome
        do {
            outcome = try ChildProcess.run(
                tool, arguments, input: input.map { .bytes($0) } ?? .null, output: .capture, error: .capture,
                timeout: 15_000)
        } catch {
            throw Failure(description: "\(tool) cannot be run: \(error)")
        }
        let message = String(decoding: outcome.error, as: UTF8.self).split(separator: "\n").first.map(String.init) ?? ""
        guard case .exit(let status) = outcome.termination else { return (-1, outcome.output, message) }
        return (status, outcome.output, message)
    }
}
