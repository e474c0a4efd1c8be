import Dispatch
import Foundation
import ProxyCore

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
        let text = String(decoding: data, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
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
                let process = Process()
                let executable =
                    command[0].contains("/") ? command[0] : (which(command[0]) ?? "/usr/bin/\(command[0])")
                process.executableURL = URL(fileURLWithPath: executable)
                process.arguments = Array(command.dropFirst())
                process.standardInput = FileHandle.nullDevice
                let output = Pipe()
                process.standardOutput = output
                do {
                    try process.run()
                } catch {
                    continuation.resume(
                        throwing: AuthError.configuration(
                            reason: "subject_token_command \(command[0]) cannot be run: \(error.localizedDescription)"))
                    return
                }
                let timer = DispatchWorkItem { if process.isRunning { process.terminate() } }
                DispatchQueue.global().asyncAfter(deadline: .now() + .milliseconds(timeout), execute: timer)
                let data = output.fileHandleForReading.readDataToEndOfFile()
                process.waitUntilExit()
                timer.cancel()
                guard process.terminationReason == .exit, process.terminationStatus == 0 else {
                    continuation.resume(
                        throwing: AuthError.recoverable(
                            reason:
                                "subject_token_command \(command[0]) failed (\(process.terminationReason == .exit ? "exit \(process.terminationStatus)" : "stopped after \(timeout) ms"))",
                            retryAfter: nil))
                    return
                }
                continuation.resume(returning: data)
            }
        }
    }

    static func which(_ name: String) -> String? {
        for directory in (ProcessInfo.processInfo.environment["PATH"] ?? "/usr/local/bin:/usr/bin:/bin").split(
            separator: ":")
        {
            let candidate = "\(directory)/\(name)"
            if FileManager.default.isExecutableFile(atPath: candidate) { return candidate }
        }
        return nil
    }
}
