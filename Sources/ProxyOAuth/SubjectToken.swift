import Dispatch
import ProxyCore

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

/// Where `grant = token_exchange` gets the workload's own token (RFC 8693 `subject_token`): a file read anew
/// at each exchange (CI systems and Kubernetes rotate them in place), or a command's standard output (run
/// without a shell, e.g. a script asking the CI system for an OIDC ID token). The token is never logged.
public enum SubjectToken {
    public static func read(_ provider: ProviderConfig, timeout: Int) async throws -> String {
        if let file = provider.subjectTokenFile {
            guard let data = FileManager.default.contents(atPath: file) else {
                throw AuthError.configuration(
                    reason:
                        "the subject token file \(file) of [provider \(provider.name)] cannot be read (\(String(cString: strerror(errno))))"
                )
            }
            return try clean(data, from: "the subject token file \(file)")
        }
        guard let command = provider.subjectTokenCommand else {
            throw AuthError.configuration(reason: "[provider \(provider.name)] names no subject token source")
        }
        let output = try await run(command, timeout: timeout)
        return try clean(output, from: "subject_token_command (\(command[0]))")
    }

    static func clean(_ data: Data, from source: String) throws -> String {
        let text = String(decoding: data, as: UTF8.self).trimmingWhitespace()
        guard !text.isEmpty, !text.contains(where: { $0.isWhitespace }), text.utf8.count <= 64 << 10 else {
            throw AuthError.configuration(reason: "\(source) gave no usable token (empty, several words, or too long)")
        }
        return text
    }

    /// Runs `command` with standard input closed; its standard output, or why it failed (its standard error
    /// is passed through, so that the user sees the command's own message).
    static func run(_ command: [String], timeout: Int) async throws -> Data {
        try await withCheckedThrowingContinuation { continuation in
            DispatchQueue.global().async {
                let path = ProcessInfo.processInfo.environment["PATH"]
                let executable = ChildProcess.which(command[0], path: path) ?? "/usr/bin/\(command[0])"
                let outcome: ChildProcess.Outcome
                do {
                    outcome = try ChildProcess.run(
                        executable, Array(command.dropFirst()), output: .capture, error: .inherit, timeout: timeout)
                } catch {
                    continuation.resume(
                        throwing: AuthError.configuration(
                            reason: "subject_token_command \(command[0]) cannot be run: \(error)"))
                    return
                }
                guard outcome.succeeded, !outcome.timedOut else {
                    var how = "stopped after \(timeout) ms"
                    if !outcome.timedOut, case .exit(let status) = outcome.termination { how = "exit \(status)" }
                    continuation.resume(
                        throwing: AuthError.recoverable(
                            reason: "subject_token_command \(command[0]) failed (\(how))", retryAfter: nil))
                    return
                }
                continuation.resume(returning: Data(outcome.output))
            }
        }
    }
}
