import Testing

@testable import ProxyCore

/// Issue 32 item 2: the admin listener could be blinded by any local user and read through DNS rebinding.
@Suite struct AdminDoorTests {
    static let loopback = AdminDoor(bound: ListenAddress(host: "127.0.0.1", port: 9464, isIPv6: false))
    static let everywhere = AdminDoor(bound: ListenAddress(host: "0.0.0.0", port: 9464, isIPv6: false))
    static let podAddress = AdminDoor(bound: ListenAddress(host: "10.1.2.3", port: 9464, isIPv6: false))

    static func head(_ text: String) -> HTTPHead {
        var parser = HTTPHeadParser(kind: .request, limits: AdminDoor.headLimits)
        guard case .complete(let head, _) = parser.parse(Array(text.utf8)) else { fatalError("does not parse") }
        return head
    }

    @Test(arguments: [
        ("127.0.0.1:9464", true), ("127.0.0.1", true), ("localhost:9464", true), ("LOCALHOST.:8080", true),
        ("[::1]:9464", true), ("127.0.0.2:9464", true), ("[::ffff:127.0.0.1]:9464", true),
        // DNS rebinding: the attacker's name, re-pointed at 127.0.0.1.
        ("evil.example:9464", false), ("rebind.127.0.0.1.nip.io:9464", false), ("localhost.evil.example", false),
        ("10.1.2.3:9464", false), ("", false), ("127.0.0.1:9464 x", false), ("a@127.0.0.1", false),
    ])
    func aLoopbackListenerAnswersItsOwnNamesOnly(host: String, answered: Bool) {
        #expect(Self.loopback.namesOwnAddress(Array(host.utf8)[...]) == answered)
    }

    @Test func aListenerOnEveryAddressAnswersAnyAddressButNoName() {
        // A pod's probe names the pod's address; a name can be rebound, an address cannot.
        #expect(Self.everywhere.namesOwnAddress(Array("10.1.2.3:9464".utf8)[...]))
        #expect(Self.everywhere.namesOwnAddress(Array("[fd00::5]:9464".utf8)[...]))
        #expect(!Self.everywhere.namesOwnAddress(Array("proxy.internal:9464".utf8)[...]))
        #expect(Self.podAddress.namesOwnAddress(Array("10.1.2.3".utf8)[...]))
        #expect(Self.podAddress.namesOwnAddress(Array("localhost".utf8)[...]))
        #expect(!Self.podAddress.namesOwnAddress(Array("10.1.2.4".utf8)[...]))
    }

    @Test func namesInAdminHostsAreAnsweredToo() {
        let door = AdminDoor(bound: ListenAddress(host: "0.0.0.0", port: 9464, isIPv6: false), names: ["proxyctl"])
        #expect(door.namesOwnAddress(Array("proxyctl:9464".utf8)[...]))
        #expect(door.namesOwnAddress(Array("PROXYCTL.".utf8)[...]))
        #expect(!door.namesOwnAddress(Array("proxyctl.evil.example".utf8)[...]))
        var parsed = ProxySettings()
        for (value, names) in [("proxyctl, Metrics.svc.", ["proxyctl", "metrics.svc"]), ("", [])] {
            let text = "[proxy]\nadmin_hosts = \(value)\n"
            parsed =
                (try? ConfigParser(homeDirectory: nil, baseDirectory: nil).parse(text, file: "p").get().proxy)
                ?? ProxySettings()
            #expect(parsed.adminHosts == names)
        }
        for bad in ["proxyctl:9464", "10.0.0.1", "a b/c"] {
            let text = "[proxy]\nadmin_hosts = \(bad)\n"
            guard
                case .failure(let errors) = ConfigParser(homeDirectory: nil, baseDirectory: nil).parse(text, file: "p")
            else {
                Issue.record("accepted \(bad)")
                continue
            }
            #expect(errors.errors.contains { $0.key == "admin_hosts" })
        }
    }

    @Test func routes() {
        let door = Self.loopback
        #expect(door.route(Self.head("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:9464\r\n\r\n")) == .health)
        #expect(door.route(Self.head("HEAD /readyz?x=1 HTTP/1.1\r\nHost: localhost\r\n\r\n")) == .readiness)
        #expect(door.route(Self.head("GET /metrics HTTP/1.0\r\n\r\n")) == .metrics, "HTTP/1.0 without Host")
        guard case .answer(421, let body) = door.route(Self.head("GET /metrics HTTP/1.1\r\nHost: evil.example\r\n\r\n"))
        else {
            Issue.record("a foreign Host was answered")
            return
        }
        #expect(body.contains("own address only (Host: 127.0.0.1:9464 or localhost:9464)"))
        #expect(!body.contains("evil"), "the Host value is not echoed")
        #expect(
            door.route(Self.head("GET /healthz HTTP/1.1\r\n\r\n"))
                == .answer(status: 400, body: "exactly one Host field, naming this address (127.0.0.1:9464)\n"))
        #expect(
            door.route(Self.head("GET /healthz HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\r\n"))
                == .answer(status: 400, body: "exactly one Host field, naming this address (127.0.0.1:9464)\n"))
        #expect(
            door.route(Self.head("POST /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"))
                == .answer(status: 405, body: "only GET and HEAD\n"))
        #expect(
            door.route(Self.head("GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"))
                == .answer(status: 404, body: "not found; try /healthz, /readyz or /metrics\n"))
    }
}

/// The admin listener's admission as events in, decisions out.
@Suite struct AdminAdmissionPlaybook {
    static func admission(total: Int = 4, perClient: Int = 2) -> AdminAdmission {
        AdminAdmission(limits: Admission(maxConnections: total, maxPerClient: perClient), headDeadline: 5_000)
    }

    @Test func aClientAtItsLimitMakesRoomWithItsOwnOldestUnfinishedHead() {
        var a = Self.admission()
        #expect(a.accepted(client: "127.0.0.1") == .admit(id: 1, evicting: []))
        #expect(a.accepted(client: "127.0.0.1") == .admit(id: 2, evicting: []))
        // The probe from the same address as the attacker: the oldest half-sent head goes.
        #expect(a.accepted(client: "127.0.0.1") == .admit(id: 3, evicting: [1]))
        a.headComplete(3)
        #expect(a.accepted(client: "127.0.0.1") == .admit(id: 4, evicting: [2]))
        // Connections being answered are not evicted: at the limit with none unfinished, a fast 503.
        a.headComplete(4)
        #expect(a.accepted(client: "127.0.0.1") == .turnAway(.tooManyFromClient(limit: 2)))
        a.closed(3)
        #expect(a.accepted(client: "127.0.0.1") == .admit(id: 5, evicting: []))
        #expect(a.openCount == 2)
    }

    @Test func aFullListenerMakesRoomAtTheBusiestClientsExpense() {
        var a = Self.admission(total: 4, perClient: 3)
        for _ in 0..<3 { _ = a.accepted(client: "192.0.2.9") }
        #expect(a.accepted(client: "192.0.2.1") == .admit(id: 4, evicting: []))
        a.headComplete(4)
        // A kubelet probe from another address: the flooder's oldest head goes, not the scraper's.
        #expect(a.accepted(client: "192.0.2.2") == .admit(id: 5, evicting: [1]))
        #expect(a.isReadingHead(5) && !a.isReadingHead(1) && !a.isReadingHead(4))
    }

    @Test func aFullListenerOfAnsweredConnectionsTurnsAwayAtOnce() {
        var a = Self.admission(total: 2, perClient: 2)
        for id: UInt64 in 1...2 {
            _ = a.accepted(client: "127.0.0.1")
            a.headComplete(id)
        }
        #expect(a.accepted(client: "127.0.0.2") == .turnAway(.overCapacity(limit: 2)))
        #expect(a.openCount == 2)
    }

    @Test func aThousandHalfSentHeadsLeaveRoomForEveryProbe() {
        var a = AdminAdmission(limits: AdminAdmission.limits(settings: ProxySettings()).0, headDeadline: 5_000)
        var evicted = 0
        for _ in 0..<1_000 {
            guard case .admit(_, let evicting) = a.accepted(client: "127.0.0.1") else {
                Issue.record("a half-sent head was turned away instead of making room")
                return
            }
            evicted += evicting.count
        }
        #expect(a.openCount == 32 && evicted == 1_000 - 32)
        for probe in 0..<20 {
            guard case .admit(let id, let evicting) = a.accepted(client: "127.0.0.1") else {
                Issue.record("a probe was turned away")
                return
            }
            // The first takes a flooder's slot; each probe leaves it free for the next.
            #expect(evicting.count == (probe == 0 ? 1 : 0))
            a.headComplete(id)
            a.closed(id)
        }
    }
}
