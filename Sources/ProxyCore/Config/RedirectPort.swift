/// The loopback port `proxyctl init` writes as `redirect_port` when it is not given one.
///
/// Why a fixed default and not any free port: many providers compare the redirect URI character for character
/// (glewlwyd does, despite RFC 8252 §7.3), so the port is part of the client's registration. A port that is the same on every machine lets one registration of
/// `http://127.0.0.1:17755/callback` serve a whole team, as the fixed defaults of other command-line sign-ins do
/// (HashiCorp Vault's 8250, kubelogin's 8000 and 18000, gcloud's 8085). It lies below the kernel's ephemeral
/// range (`net.ipv4.ip_local_port_range`, 32768-60999 on Linux, 49152 and up elsewhere), where no outgoing
/// connection and no bind to port 0 can take it between `init` and a login. Only when it is busy at `init` time
/// (something else listens there) is another one taken: the next few after it, then the first free port below
/// the ephemeral range, always in the same order, so that `init` run again picks the same port.
public enum RedirectPort {
    /// The default port, and the first candidate.
    public static let preferred = 17755
    /// How many ports after `preferred` are tried before any other.
    public static let nearby = 10

    /// Why the port was chosen, for the message `init` prints.
    public enum Reason: Equatable, Sendable {
        /// The default, free.
        case preferred
        /// The port of the file being replaced (`init --force`): the provider has it registered already.
        case kept
        /// The default was busy: `busy` lists the candidates skipped.
        case fallback(busy: [Int])
    }

    /// The kernel's ephemeral port range from the text of `/proc/sys/net/ipv4/ip_local_port_range`
    /// ("32768\t60999\n"); nil when the text is not two ports in order.
    public static func ephemeralRange(_ text: String) -> ClosedRange<Int>? {
        let words = text.split(whereSeparator: { $0 == " " || $0 == "\t" || $0 == "\n" })
        guard words.count == 2, let low = Int(words[0]), let high = Int(words[1]), 1 <= low, low <= high,
            high <= 65535
        else { return nil }
        return low...high
    }

    /// The port for a new configuration. `existing` is the `redirect_port` of the file being replaced (0 or nil
    /// when there is none); `ephemeral` the kernel's range (nil when unknown: 32768-60999 is assumed); `isFree`
    /// tells whether nothing listens on 127.0.0.1:PORT now. Nil when no port below the ephemeral range is free.
    public static func choose(
        existing: Int?, ephemeral: ClosedRange<Int>?, isFree: (Int) -> Bool
    ) -> (port: Int, reason: Reason)? {
        if let existing, existing > 0 { return (existing, .kept) }
        let range = ephemeral ?? 32768...60999
        // Where the ephemeral range leaves no room below it (ip_local_port_range = 1024 65535), the default is
        // still the best guess: the same on every machine.
        let limit = range.lowerBound > 1024 ? range.lowerBound : 65536
        var busy: [Int] = []
        for port in preferred...(preferred + nearby) where port < limit {
            if isFree(port) { return (port, busy.isEmpty ? .preferred : .fallback(busy: busy)) }
            busy.append(port)
        }
        // Then every other port below the ephemeral range, from just above the nearby ones, wrapping around to
        // 1024 (ports below are for root).
        let start = preferred + nearby + 1
        for port in Array(start..<max(start, limit)) + Array(1024..<min(preferred, limit)) where isFree(port) {
            return (port, .fallback(busy: busy))
        }
        return nil
    }
}
