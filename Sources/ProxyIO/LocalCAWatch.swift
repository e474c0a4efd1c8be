import ProxyCore
import ProxyOAuth
import ProxyTLS

/// Watches the local CA's files for a running proxy, so that a CA `proxyctl ca init` made in another process is
/// picked up without a restart or a SIGHUP (issue 32 item 4).
///
/// Every `interval` the files are looked at with one `stat` each (as `TokenBroker` looks at a token file); when
/// one changed, and once an hour in any case (a CA the proxy keeps may come within a week of its end), `check`
/// says which CA to sign with: nil to keep the current one (it covers the protected hosts and the bundle still
/// trusts it: `LocalCA.keepsSigning`), or the CA now in the directory, which `apply` installs for new
/// connections (false when it could not). Runs on the proxy's loop; the reading and the decision are a SIGHUP's.
public final class LocalCAWatch {
    private let paths: [String]
    private let check: () -> Result<LocalCA?, any Error>
    private let apply: (LocalCA) -> Bool
    private let logger: Logger
    private let interval: Int
    private var timer: LoopTimer?
    /// What each file looked like: a replaced file (a rename over it) has another inode.
    private var seen: [TokenStore.FileVersion?]
    private var lastCheck = EventLoop.monotonicMilliseconds()
    /// Checked this often whatever the files say (milliseconds).
    static let recheck: Int64 = 3_600_000

    public init(
        loop: EventLoop, files: LocalCA.Files, interval: Int = 1_000, logger: Logger,
        check: @escaping () -> Result<LocalCA?, any Error>, apply: @escaping (LocalCA) -> Bool
    ) {
        paths = [files.certificate, files.intermediate, files.retired]
        self.check = check
        self.apply = apply
        self.logger = logger
        self.interval = interval
        seen = paths.map(Self.stamp)
        let timer = LoopTimer(loop: loop) { [unowned self] in tick() }
        self.timer = timer
        timer.schedule(milliseconds: interval)
    }

    deinit { timer?.cancel() }

    public func stop() {
        timer?.cancel()
        timer = nil
    }

    private func tick() {
        defer { timer?.schedule(milliseconds: interval) }
        let now = EventLoop.monotonicMilliseconds()
        let stamps = paths.map(Self.stamp)
        guard stamps != seen || now - lastCheck >= Self.recheck else { return }
        seen = stamps
        lastCheck = now
        switch check() {
        case .success(nil):
            break
        case .success(let ca?):
            guard apply(ca) else { return }
            logger.info(
                "the local CA changed (proxyctl ca init): new connections get leaves from the CA for \(ca.hosts.joined(separator: ", ")) (SHA-256 \(ca.certificate.fingerprint)); no restart or SIGHUP needed"
            )
        case .failure(let error):
            logger.warn(
                "the local CA in \(PathText.parent(paths[0])) changed, and this proxy keeps signing with the CA it has: \(error)"
            )
        }
    }

    /// One stat(2) of `path` (the token files' own stamp: inode, size, modification time).
    static func stamp(_ path: String) -> TokenStore.FileVersion? { TokenStore.version(atPath: path) }
}
