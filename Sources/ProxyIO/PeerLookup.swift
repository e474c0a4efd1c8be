import CLibevent
import ProxyCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// Which user's process is on the other end of an accepted connection, looked up only when a rule needs it:
/// one NETLINK_SOCK_DIAG query to the kernel per connection, as ss(8) makes, on a netlink socket kept for the
/// loop's life (opening one per connection was four more system calls on every new connection). Loop thread
/// only.
final class PeerLookup {
    private var link: Int32 = -1
    private var sequence: UInt32 = 0
    private let owner = Int(geteuid())

    deinit { if link >= 0 { close(link) } }

    func identify(_ fd: Int32, settings frontDoor: FrontDoor) -> PeerIdentity {
        let protectedRule = !frontDoor.origins.isEmpty && frontDoor.settings.protectedUsers == .owner
        guard
            protectedRule || frontDoor.settings.passthroughUsers == .owner || frontDoor.settings.ownerNeedsNoCredentials
        else { return .owner }
        let uid = proxyctl_tcp_peer_uid(fd, &link, &sequence)
        if uid < 0 { return .unknown }
        return uid == owner ? .owner : .otherUser(uid: uid)
    }
}
