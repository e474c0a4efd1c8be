import ProxyCore
import ProxyTLS

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

/// The owner credential: where the kernel cannot name the user of a client's socket (docs/porting.md: macOS, or
/// Linux with `PROXYCTL_PORTABLE=1`), a secret stands for "a process of the user running proxyctl". It is a
/// 0600 file in the state directory, which is that user's alone (0700), beside the tokens it protects:
/// `<state_dir>/proxy-credential`, made at the first need by `serve` or `env` (whichever comes first) and kept,
/// so that the shells that took HTTPS_PROXY from `proxyctl env` keep working across restarts of serve, and a
/// serve that a service manager starts on the first connection has the one `env` handed out before. Delete the
/// file to make a new one (then run `eval "$(proxyctl env)"` again).
///
/// `proxyctl exec`'s own proxy does not use it: it makes a credential for its run.
public enum OwnerCredential {
    /// The user name that goes with the secret in the proxy URL (`http://proxyctl:SECRET@127.0.0.1:8080`).
    public static let user = "proxyctl"

    public struct Failure: Error, CustomStringConvertible, Equatable {
        public let description: String
    }

    public static func path(stateDirectory: String) -> String { stateDirectory + "/proxy-credential" }

    /// The secret, made the first time (24 random bytes, base64url): two processes making it at once end up
    /// with the same one (the file appears whole, with link(2), or not at all).
    public static func secret(stateDirectory: String) throws -> String {
        let file = path(stateDirectory: stateDirectory)
        if let existing = try load(file) { return existing }
        do {
            try SecureFile.makePrivateDirectory(stateDirectory)
        } catch {
            throw Failure(description: "\(stateDirectory) cannot be made: \(error)")
        }
        let made = Crypto.randomToken(bytes: 24)
        let temporary = "\(stateDirectory)/.proxy-credential.\(getpid()).\(UInt32.random(in: 0...UInt32.max)).tmp"
        let fd = open(temporary, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0o600)
        guard fd >= 0 else { throw Failure(description: "\(temporary) cannot be made: \(lastError())") }
        let line = Array((made + "\n").utf8)
        let written = line.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
        let synced = fsync(fd) == 0
        close(fd)
        defer { unlink(temporary) }
        guard written == line.count, synced else {
            throw Failure(description: "\(temporary) cannot be written: \(lastError())")
        }
        if link(temporary, file) == 0 { return made }
        guard errno == EEXIST, let other = try load(file) else {
            throw Failure(description: "\(file) cannot be made: \(lastError())")
        }
        return other
    }

    /// The secret as `ProxyCredentials` for the front door (`FrontDoor.ownerCredential`).
    public static func credentials(secret: String) -> ProxyCredentials? {
        guard case .success(let parsed) = ProxyCredentials.parse("\(user):\(secret)", file: "proxy-credential")
        else { return nil }
        return parsed
    }

    /// `url` (`http://host:port`) with the credential in it.
    public static func proxyURL(_ url: String, secret: String) -> String {
        guard let scheme = url.firstRange(of: "://") else { return url }
        return String(url[..<scheme.upperBound]) + "\(user):\(secret)@" + String(url[scheme.upperBound...])
    }

    /// The secret in `file`, nil when there is none; an error when it is not this user's alone, or empty.
    private static func load(_ file: String) throws -> String? {
        let fd = open(file, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)
        if fd < 0 {
            if errno == ENOENT { return nil }
            throw Failure(description: "\(file) cannot be read: \(lastError())")
        }
        defer { close(fd) }
        var info = stat()
        guard fstat(fd, &info) == 0, info.st_mode & S_IFMT == S_IFREG else {
            throw Failure(description: "\(file) is not a file")
        }
        guard info.st_uid == geteuid(), info.st_mode & 0o077 == 0 else {
            throw Failure(
                description:
                    "\(file) may be read by other users (it must be this user's, mode 0600); delete it and a new one is made"
            )
        }
        var bytes = [UInt8](repeating: 0, count: 128)
        let count = bytes.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
        let text = count > 0 ? String(decoding: bytes[0..<count], as: UTF8.self).trimmingWhitespace() : ""
        guard !text.isEmpty, !text.contains(":"), !text.contains("@") else {
            throw Failure(description: "\(file) holds no credential; delete it and a new one is made")
        }
        return text
    }

    private static func lastError() -> String { String(cString: strerror(errno)) }
}
