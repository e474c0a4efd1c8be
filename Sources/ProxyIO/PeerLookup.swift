import ProxyCore

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Which user's process is on the other end of an accepted connection, looked up only when a rule needs it,
/// through the kernel where it can say (`Platform.SocketOwnerLookup`); `.unknown` where it cannot, and then the
/// front door's owner credential decides (docs/porting.md). Loop thread only.
final class PeerLookup {
    private let lookup = Platform.SocketOwnerLookup()
    private let owner = Int(geteuid())

    func identify(_ fd: Int32, settings frontDoor: FrontDoor) -> PeerIdentity {
        let protectedRule = !frontDoor.origins.isEmpty && frontDoor.settings.protectedUsers == .owner
        guard
            protectedRule || frontDoor.settings.passthroughUsers == .owner || frontDoor.settings.ownerNeedsNoCredentials
        else { return .owner }
        guard let uid = lookup.uid(ofClient: fd) else { return .unknown }
        return uid == owner ? .owner : .otherUser(uid: uid)
    }
}
