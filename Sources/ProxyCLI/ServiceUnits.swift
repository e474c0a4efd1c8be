import ProxyCore
import ProxyOAuth

/// proxyctl under the user's systemd (packaging/systemd: proxyctl.socket starts proxyctl.service): where its
/// socket listens, for `proxyctl env` before anything has connected (until then no serve runs to say it).
enum ServiceUnits {
    /// The address `proxyctl.socket` listens on when the user's systemd has it active; nil without a user
    /// manager, without the unit, or when it is not listening. Asks `systemctl --user show`, which knows every
    /// drop-in (a `ListenStream=` changed with `systemctl --user edit` included).
    static func socketAddress(environment: [String: String]) -> ListenAddress? {
        guard !(environment["XDG_RUNTIME_DIR"] ?? "").isEmpty,
            let systemctl = ChildProcess.which("systemctl", path: environment["PATH"]),
            let outcome = try? ChildProcess.run(
                systemctl, ["--user", "show", "proxyctl.socket", "--property=ActiveState", "--property=Listen"],
                environment: environment, output: .capture, error: .null, timeout: 3000),
            outcome.succeeded
        else { return nil }
        return listenAddress(String(decoding: outcome.output, as: UTF8.self))
    }

    /// The first stream address of `systemctl show`'s `Listen=` lines (`Listen=127.0.0.1:8080 (Stream)`), when
    /// `ActiveState=active`.
    static func listenAddress(_ shown: String) -> ListenAddress? {
        var active = false
        var address: ListenAddress?
        for line in shown.split(separator: "\n") {
            if line == "ActiveState=active" { active = true }
            guard line.hasPrefix("Listen="), address == nil else { continue }
            let words = line.dropFirst("Listen=".count).split(separator: " ")
            guard words.count == 2, words[1] == "(Stream)" else { continue }
            address = ListenAddress.parse(String(words[0]))
        }
        return active ? address : nil
    }
}
