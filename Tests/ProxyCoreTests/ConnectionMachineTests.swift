import Foundation
import Testing

@testable import ProxyCore

/// The client-connection machine as playbooks: bytes from the client and the next hop in, what each side
/// receives and the notable actions out, no sockets. The I/O layer's rules (never a second upstream
/// connection, no bytes to a closed side) are checked by `Playbook` after every event.
@Suite struct ForwardingPlaybooks {
    static let get = "GET http://o.test/a HTTP/1.1\nHost: o.test\n\n".crlf
    static let ok = "HTTP/1.1 200 OK\nContent-Length: 2\n\nhi".crlf

    @Test func forwardsAGetAndKeepsBothConnections() {
        var p = Playbook.frontDoor()
        p.client(Self.get)
        #expect(p.next() == [.resolve(hop("o.test:80"))])
        #expect(p.timers[.connect] != nil && p.timers[.head] == nil)
        p.event(.resolved(.addresses(Playbook.addresses(1))))
        #expect(p.next() == [.connect(address: 0)])
        p.event(.upstreamConnected)
        #expect(p.upstreamGot() == "GET /a HTTP/1.1\nHost: o.test\n\n".crlf)
        p.upstream(Self.ok)
        #expect(p.clientGot() == Self.ok)
        #expect(p.next() == [])
        #expect(p.lastLog.hasPrefix("GET http://o.test/a status=200 up=33 down=40 duration="))
        // Both stay open: the client for its next request, the upstream connection for reuse.
        #expect(p.timers[.keepAlive] != nil && p.timers[.upstreamKeepAlive] != nil && p.upstreamOpen)
        #expect(p.machine.isIdle)
    }

    @Test func reusesTheKeptConnectionForTheSameHop() {
        var p = Playbook.frontDoor()
        p.client(Self.get)
        p.connectUpstream()
        p.upstream(Self.ok)
        _ = (p.next(), p.clientGot(), p.upstreamGot())
        p.client("GET http://o.test/b HTTP/1.1\nHost: o.test\n\n".crlf)
        #expect(p.next() == [], "no new connection")
        #expect(p.upstreamGot() == "GET /b HTTP/1.1\nHost: o.test\n\n".crlf)
        #expect(p.timers[.upstreamKeepAlive] == nil)
    }

    @Test func anotherHostClosesTheKeptConnectionBeforeConnecting() {
        var p = Playbook.frontDoor()
        p.client(Self.get)
        p.connectUpstream()
        p.upstream(Self.ok)
        _ = p.next()
        p.client("GET http://other.test/ HTTP/1.1\nHost: other.test\n\n".crlf)
        #expect(p.next() == [.closeUpstream, .resolve(hop("other.test:80"))])
    }

    /// The hardening issue's use-after-free: a kept connection must be closed before a tunnel connects.
    @Test func connectAfterAKeptAliveGetClosesTheKeptConnectionFirst() {
        var p = Playbook.frontDoor()
        p.client(Self.get)
        p.connectUpstream()
        p.upstream(Self.ok)
        _ = (p.next(), p.clientGot())
        p.client("CONNECT b.test:443 HTTP/1.1\nHost: b.test:443\n\n".crlf)
        #expect(p.next() == [.closeUpstream, .resolve(hop("b.test:443"))])
        p.connectUpstream()
        #expect(p.clientGot() == "HTTP/1.1 200 Connection established\n\n".crlf)
        #expect(p.next() == [.connect(address: 0), .startTunnel(label: "CONNECT b.test:443", status: 200)])
        #expect(p.timers.isEmpty)
    }

    @Test func pipelinedGetAndConnectInOneWrite() {
        var p = Playbook.frontDoor()
        p.client(Self.get + "CONNECT b.test:443 HTTP/1.1\nHost: b.test:443\n\n".crlf)
        #expect(p.next() == [.resolve(hop("o.test:80"))])
        p.connectUpstream()
        p.upstream(Self.ok)
        #expect(p.clientGot() == Self.ok)
        // The CONNECT waited in the buffer; now the kept connection goes first.
        #expect(p.next() == [.connect(address: 0), .closeUpstream, .resolve(hop("b.test:443"))])
    }

    @Test func pipelinedRequestsAreAnsweredInOrder() {
        var p = Playbook.frontDoor()
        let body = "pipelined body"
        p.client(
            Self.get + "POST http://o.test/b HTTP/1.1\nHost: o.test\nContent-Length: \(body.utf8.count)\n\n".crlf
                + body + "GET http://o.test/c HTTP/1.1\nHost: o.test\n\n".crlf)
        p.connectUpstream()
        #expect(p.upstreamGot() == "GET /a HTTP/1.1\nHost: o.test\n\n".crlf, "one request at a time")
        p.upstream(Self.ok)
        #expect(
            p.upstreamGot() == "POST /b HTTP/1.1\nHost: o.test\nContent-Length: 14\n\n".crlf + body)
        p.upstream("HTTP/1.1 201 Created\nContent-Length: 0\n\n".crlf)
        #expect(p.upstreamGot() == "GET /c HTTP/1.1\nHost: o.test\n\n".crlf)
        p.upstream(Self.ok)
        #expect(
            p.clientGot() == Self.ok + "HTTP/1.1 201 Created\nContent-Length: 0\n\n".crlf + Self.ok)
        #expect(p.clientIn.isEmpty)
    }

    @Test func chunkedRequestBodyPassesUnchangedInPieces() {
        var p = Playbook.frontDoor()
        let chunked = "4;x=y\r\nWiki\r\n5\r\npedia\r\n0\r\nX-T: 1\r\n\r\n"
        p.client("POST http://o.test/u HTTP/1.1\nHost: o.test\nTransfer-Encoding: chunked\n\n".crlf)
        p.connectUpstream()
        _ = p.upstreamGot()
        for piece in [
            String(chunked.prefix(9)), String(chunked.dropFirst(9).prefix(10)), String(chunked.dropFirst(19)),
        ] {
            p.client(piece)
        }
        #expect(p.upstreamGot() == chunked)
        p.upstream(Self.ok)
        #expect(p.clientGot() == Self.ok)
        #expect(p.machine.isIdle)
    }

    @Test func badChunkBeforeAnyResponseIs400AndCloses() {
        var p = Playbook.frontDoor()
        p.client("POST http://o.test/u HTTP/1.1\nHost: o.test\nTransfer-Encoding: chunked\n\nzz\r\n".crlf)
        _ = p.next()
        p.connectUpstream()
        #expect(p.clientGot().hasPrefix("HTTP/1.1 400 Bad Request\r\nProxy-Status: proxyctl; error=http_request_error"))
        #expect(p.next() == [.connect(address: 0), .closeUpstream, .closeAfterFlush])
    }

    @Test func readUntilCloseBodyEndsWithTheOriginsClose() {
        var p = Playbook.frontDoor()
        p.client(Self.get)
        _ = p.next()
        p.connectUpstream()
        p.upstream("HTTP/1.1 200 OK\n\nstream".crlf)
        p.upstream(" more")
        #expect(p.clientGot() == "HTTP/1.1 200 OK\nConnection: close\n\nstream more".crlf)
        p.upstreamEnds()
        #expect(p.next() == [.connect(address: 0), .closeUpstream, .closeAfterFlush])
        #expect(p.lastLog.contains("status=200"))
    }

    @Test func anUpstreamResetIsPassedOnAsAReset() {
        var p = Playbook.frontDoor()
        p.client(Self.get)
        _ = p.next()
        p.connectUpstream()
        p.upstream("HTTP/1.1 200 OK\n\nstream".crlf)
        _ = p.clientGot()
        p.upstreamEnds(reset: true)
        #expect(p.next() == [.connect(address: 0), .closeUpstream, .resetClient])
        #expect(p.lastLog.contains("note=\"upstream reset the connection\""))
    }

    @Test func interimResponsesPassBeforeTheFinalOne() {
        var p = Playbook.frontDoor()
        p.client("POST http://o.test/u HTTP/1.1\nHost: o.test\nExpect: 100-continue\nContent-Length: 2\n\n".crlf)
        p.connectUpstream()
        p.upstream("HTTP/1.1 100 Continue\n\nHTTP/1.1 103 Early Hints\nLink: </s.css>\n\n".crlf)
        #expect(
            p.clientGot() == "HTTP/1.1 100 Continue\n\nHTTP/1.1 103 Early Hints\nLink: </s.css>\n\n".crlf)
        p.client("ok")
        p.upstream(Self.ok)
        #expect(p.clientGot() == Self.ok)
    }

    @Test func switchingProtocolsBecomesATunnel() {
        var p = Playbook.frontDoor()
        p.client("GET http://o.test/ws HTTP/1.1\nHost: o.test\nConnection: Upgrade\nUpgrade: websocket\n\n".crlf)
        _ = p.next()
        p.connectUpstream()
        #expect(p.upstreamGot() == "GET /ws HTTP/1.1\nHost: o.test\nUpgrade: websocket\nConnection: upgrade\n\n".crlf)
        p.upstream("HTTP/1.1 101 Switching Protocols\nConnection: Upgrade\nUpgrade: websocket\n\n".crlf + "frame")
        #expect(p.clientGot() == "HTTP/1.1 101 Switching Protocols\nConnection: Upgrade\nUpgrade: websocket\n\n".crlf)
        #expect(p.next() == [.connect(address: 0), .startTunnel(label: "GET http://o.test/ws", status: 101)])
        #expect(p.upstreamIn == Array("frame".utf8), "bytes after the 101 go into the tunnel")
    }

    @Test func unrequested101IsAProtocolError() {
        var p = Playbook.frontDoor()
        p.client(Self.get)
        p.connectUpstream()
        p.upstream("HTTP/1.1 101 Switching Protocols\nUpgrade: websocket\n\n".crlf)
        #expect(
            p.clientGot().hasPrefix("HTTP/1.1 502 Bad Gateway\r\nProxy-Status: proxyctl; error=http_protocol_error"))
    }

    @Test func conflictingContentLengthsAre502() {
        var p = Playbook.frontDoor()
        p.client(Self.get)
        _ = p.next()
        p.connectUpstream()
        p.upstream("HTTP/1.1 200 OK\nContent-Length: 2\nContent-Length: 8\n\nhi".crlf)
        #expect(p.clientGot().hasPrefix("HTTP/1.1 502 Bad Gateway"))
        #expect(p.next() == [.connect(address: 0), .closeUpstream, .closeAfterFlush])
    }

    @Test func bareLFResponseLinesReachTheClientAsCRLF() {
        var p = Playbook.frontDoor()
        p.client(Self.get)
        p.connectUpstream()
        p.upstream("HTTP/1.1 200 OK\nX-A: 1\nContent-Length: 2\n\nhi")
        #expect(p.clientGot() == "HTTP/1.1 200 OK\r\nX-A: 1\r\nContent-Length: 2\r\n\r\nhi")
    }

    @Test func bytesAfterTheResponseMakeTheConnectionUnusable() {
        var p = Playbook.frontDoor()
        p.client(Self.get)
        _ = p.next()
        p.connectUpstream()
        p.upstream(Self.ok + "junk")
        #expect(p.next() == [.connect(address: 0), .closeUpstream])
        #expect(!p.upstreamOpen && p.machine.isIdle)
    }

    @Test func anEarlyAnswerBeforeTheWholeBodyClosesTheConnection() {
        var p = Playbook.frontDoor()
        p.client("POST http://o.test/u HTTP/1.1\nHost: o.test\nContent-Length: 10\n\nabc".crlf)
        p.connectUpstream()
        p.upstream("HTTP/1.1 413 Content Too Large\nContent-Length: 0\n\n".crlf)
        // The rest of the body could not be told from a next request: the client is told the connection ends.
        #expect(p.clientGot() == "HTTP/1.1 413 Content Too Large\nContent-Length: 0\nConnection: close\n\n".crlf)
        #expect(p.next().suffix(2) == [.closeUpstream, .closeAfterFlush])
    }
}

/// A kept-alive upstream connection that the origin closed: the retry rule (RFC 9110 §9.2.2).
@Suite struct StaleConnectionPlaybooks {
    static func withKeptConnection() -> Playbook {
        var p = Playbook.frontDoor()
        p.client(ForwardingPlaybooks.get)
        p.connectUpstream()
        p.upstream(ForwardingPlaybooks.ok)
        _ = (p.next(), p.clientGot(), p.upstreamGot())
        return p
    }

    @Test func anIdempotentRequestIsSentAgainOnce() {
        var p = Self.withKeptConnection()
        p.client("GET http://o.test/b HTTP/1.1\nHost: o.test\n\n".crlf)
        p.upstreamEnds()
        #expect(p.next() == [.closeUpstream, .resolve(hop("o.test:80"))])
        #expect(p.logs.contains { $0.text.contains("closed unanswered; sent again on a new one") })
        p.connectUpstream()
        #expect(p.upstreamGot() == "GET /b HTTP/1.1\nHost: o.test\n\n".crlf + "GET /b HTTP/1.1\nHost: o.test\n\n".crlf)
        // The new connection closes unanswered too: no third try.
        p.upstreamEnds()
        #expect(
            p.clientGot().hasPrefix(
                "HTTP/1.1 502 Bad Gateway\r\nProxy-Status: proxyctl; error=http_response_incomplete"))
    }

    @Test(arguments: ["POST", "PATCH", "CONNECTX"])
    func aNonIdempotentRequestIsNotSentAgain(method: String) {
        var p = Self.withKeptConnection()
        p.client("\(method) http://o.test/b HTTP/1.1\nHost: o.test\nContent-Length: 0\n\n".crlf)
        p.upstreamEnds()
        #expect(p.next() == [.closeUpstream, .closeAfterFlush])
        let answer = p.clientGot()
        #expect(answer.hasPrefix("HTTP/1.1 502 Bad Gateway\r\nProxy-Status: proxyctl; error=http_response_incomplete"))
        #expect(p.logs.contains { $0.text.contains("a \(method) is not sent twice") })
    }

    @Test func aResponseThatStartedIsNotRetried() {
        var p = Self.withKeptConnection()
        p.client("GET http://o.test/b HTTP/1.1\nHost: o.test\n\n".crlf)
        p.upstream("HTTP/1.1 200 OK\nContent-Len".crlf)
        p.upstreamEnds()
        #expect(p.next() == [.closeUpstream, .closeAfterFlush])
        #expect(p.clientGot().hasPrefix("HTTP/1.1 502"))
    }

    @Test func theKeptConnectionIsDroppedWhenItsTimerFiresOrItSpeaks() {
        var p = Self.withKeptConnection()
        p.wait(10_000)
        #expect(p.next() == [.closeUpstream, .closeNow], "upstream keep-alive and client keep-alive both 10 s")
        var q = Self.withKeptConnection()
        q.upstream("HTTP/1.1 200 OK\n\n".crlf)
        #expect(q.next() == [.closeUpstream])
        #expect(q.machine.isIdle && q.clientClosed == nil)
    }
}

@Suite struct UpstreamProxyPlaybooks {
    static func settings(user: Bool) -> ProxySettings {
        var settings = Playbook.settings
        settings.upstreamProxy = try! UpstreamProxy.parse(user ? "http://u:p@corp.test:3128" : "http://corp.test:3128")
            .get()
        return settings
    }

    @Test func tunnelsThroughTheUpstreamProxy() {
        var p = Playbook.frontDoor(Self.settings(user: true))
        p.client("CONNECT b.test:443 HTTP/1.1\nHost: b.test:443\n\n".crlf)
        #expect(p.next() == [.resolve(hop("corp.test:3128"))])
        p.connectUpstream()
        #expect(
            p.upstreamGot()
                == "CONNECT b.test:443 HTTP/1.1\nHost: b.test:443\nProxy-Authorization: Basic dTpw\n\n".crlf)
        p.upstream("HTTP/1.1 200 Connection established\n\n".crlf + "early")
        #expect(p.clientGot() == "HTTP/1.1 200 Connection established\n\n".crlf)
        #expect(p.next() == [.connect(address: 0), .startTunnel(label: "CONNECT b.test:443", status: 200)])
        #expect(p.upstreamIn == Array("early".utf8))
    }

    @Test(arguments: [true, false])
    func a407FromTheUpstreamProxyNamesTheConfiguration(user: Bool) {
        var p = Playbook.frontDoor(Self.settings(user: user))
        p.client("CONNECT b.test:443 HTTP/1.1\nHost: b.test:443\n\n".crlf)
        p.connectUpstream()
        p.upstream("HTTP/1.1 407 Proxy Authentication Required\nProxy-Authenticate: Basic\n\n".crlf)
        let answer = p.clientGot()
        #expect(answer.hasPrefix("HTTP/1.1 502 Bad Gateway\r\nProxy-Status: proxyctl; error=proxy_configuration_error"))
        #expect(answer.contains(user ? "refused the credentials" : "add user:password to upstream_proxy"))
        #expect(!answer.contains("Proxy-Authenticate"))
    }

    @Test func aForwarded407FromTheUpstreamProxyIsOurs() {
        var p = Playbook.frontDoor(Self.settings(user: false))
        p.client(ForwardingPlaybooks.get)
        p.connectUpstream()
        #expect(p.upstreamGot().hasPrefix("GET http://o.test/a HTTP/1.1\r\n"), "absolute form through a proxy")
        p.upstream("HTTP/1.1 407 Proxy Authentication Required\nProxy-Authenticate: Basic\nContent-Length: 0\n\n".crlf)
        let answer = p.clientGot()
        #expect(answer.hasPrefix("HTTP/1.1 502") && answer.contains("received-status=407"))
    }

    @Test func silenceFromTheUpstreamProxyIs504() {
        var p = Playbook.frontDoor(Self.settings(user: false))
        p.client("CONNECT b.test:443 HTTP/1.1\nHost: b.test:443\n\n".crlf)
        p.connectUpstream()
        p.wait(5_000)
        #expect(
            p.clientGot().hasPrefix(
                "HTTP/1.1 504 Gateway Timeout\r\nProxy-Status: proxyctl; error=http_response_timeout"))
        #expect(p.next().suffix(2) == [.closeUpstream, .closeAfterFlush])
    }
}

@Suite struct ConnectingPlaybooks {
    @Test func triesEachAddressThenAnswersWithTheLastFailure() {
        var p = Playbook.frontDoor()
        p.client("CONNECT b.test:443 HTTP/1.1\nHost: b.test:443\n\n".crlf)
        p.event(.resolved(.addresses(Playbook.addresses(2))))
        p.event(.upstreamConnectFailed(.other(reason: "No route to host")))
        p.event(.upstreamConnectFailed(.refused))
        #expect(p.connects == [0, 1])
        #expect(p.clientGot().hasPrefix("HTTP/1.1 502 Bad Gateway\r\nProxy-Status: proxyctl; error=connection_refused"))
        #expect(p.lastLog.hasPrefix("CONNECT b.test:443 status=502 error=connection_refused"))
    }

    @Test func anAttemptWithoutASocketHasNothingToCloseAndTheNextAddressIsTried() {
        var p = Playbook.frontDoor()
        p.client("CONNECT b.test:443 HTTP/1.1\nHost: b.test:443\n\n".crlf)
        p.event(.resolved(.addresses(Playbook.addresses(2))))
        p.event(.upstreamConnectFailed(.noSocket(reason: "Too many open files")))
        #expect(!p.next().contains(.closeUpstream), "no socket was made: nothing to close")
        #expect(p.connects == [0, 1])
        p.event(.upstreamConnectFailed(.noSocket(reason: "Too many open files")))
        #expect(!p.next().contains(.closeUpstream))
        let answer = p.clientGot()
        #expect(answer.hasPrefix("HTTP/1.1 502 Bad Gateway\r\nProxy-Status: proxyctl; error=destination_unavailable"))
        #expect(answer.contains("cannot connect to b.test:443: Too many open files"))
    }

    @Test func noSuchHostIs502DnsError() {
        var p = Playbook.frontDoor()
        p.client("CONNECT nx.test:443 HTTP/1.1\nHost: nx.test:443\n\n".crlf)
        p.event(.resolved(.notFound))
        #expect(
            p.clientGot().contains(
                "error=dns_error; next-hop=\"nx.test:443\"; details=\"cannot resolve nx.test: no such host\""))
    }

    @Test func theConnectDeadlineCoversResolvingAndConnecting() {
        var p = Playbook.frontDoor()
        p.client("CONNECT slow.test:443 HTTP/1.1\nHost: slow.test:443\n\n".crlf)
        p.wait(5_000)
        #expect(p.clientGot().hasPrefix("HTTP/1.1 504 Gateway Timeout\r\nProxy-Status: proxyctl; error=dns_timeout"))
        var q = Playbook.frontDoor()
        q.client("CONNECT slow.test:443 HTTP/1.1\nHost: slow.test:443\n\n".crlf)
        _ = q.next()
        q.event(.resolved(.addresses(Playbook.addresses(1))))
        q.wait(5_000)
        #expect(
            q.clientGot().hasPrefix("HTTP/1.1 504 Gateway Timeout\r\nProxy-Status: proxyctl; error=connection_timeout"))
        #expect(q.next() == [.connect(address: 0), .closeUpstream, .closeAfterFlush])
        // A late answer of the resolver changes nothing.
        q.event(.resolved(.addresses(Playbook.addresses(1))))
        #expect(q.next() == [])
    }
}

@Suite struct TimeoutPlaybooks {
    @Test func theHeadDeadlineIsTotalFromTheFirstByte() {
        var p = Playbook.frontDoor()
        p.client("GET http://o.test/ HTTP/1.1\r\n")
        // A byte every few seconds does not move the deadline (slowloris).
        for _ in 0..<4 {
            p.wait(4_000)
            p.client("X")
        }
        p.wait(4_000)
        let answer = p.clientGot()
        #expect(answer.hasPrefix("HTTP/1.1 408 Request Timeout\r\nProxy-Status: proxyctl; error=http_request_error"))
        #expect(answer.contains("did not arrive within 20s"))
        #expect(p.now == 21_000)
    }

    @Test func aSilentClientIsClosedAtTheHeadDeadlineFromAccept() {
        var p = Playbook.frontDoor()
        p.wait(20_000)
        #expect(p.next() == [.closeNow])
        #expect(p.clientGot() == "")
    }

    @Test func keepAliveThenANewHeadGetsItsOwnDeadline() {
        var p = Playbook.frontDoor()
        p.client(ForwardingPlaybooks.get)
        p.connectUpstream()
        p.upstream(ForwardingPlaybooks.ok)
        #expect(p.timers[.keepAlive] == p.now + 10_000)
        p.wait(9_000)
        p.client("GET http://o.test/b HTTP/1.1\r\n")
        #expect(p.timers[.keepAlive] == nil && p.timers[.head] == p.now + 20_000)
    }

    @Test func idleTimeoutWithoutAResponseIs504() {
        var p = Playbook.frontDoor()
        p.client(ForwardingPlaybooks.get)
        p.connectUpstream()
        p.wait(30_000)
        #expect(
            p.clientGot().hasPrefix(
                "HTTP/1.1 504 Gateway Timeout\r\nProxy-Status: proxyctl; error=http_response_timeout"))
    }

    @Test func activityMovesTheIdleDeadline() {
        var p = Playbook.frontDoor()
        p.client(ForwardingPlaybooks.get)
        _ = p.next()
        p.connectUpstream()
        p.upstream("HTTP/1.1 200 OK\nContent-Length: 100\n\n".crlf)
        for _ in 0..<5 {
            p.wait(20_000)
            p.upstream("0123456789")
        }
        #expect(p.clientClosed == nil)
        p.wait(30_000)
        #expect(p.next() == [.connect(address: 0), .closeUpstream, .closeNow])
        #expect(p.lastLog.contains("note=\"idle timeout\""))
    }

    @Test func shutdownClosesIdleConnectionsAndFinishesOthers() {
        var idle = Playbook.frontDoor()
        idle.event(.shutdown)
        #expect(idle.next() == [.closeNow])
        var busy = Playbook.frontDoor()
        busy.client(ForwardingPlaybooks.get)
        _ = busy.next()
        busy.connectUpstream()
        busy.event(.shutdown)
        #expect(busy.clientClosed == nil)
        busy.upstream(ForwardingPlaybooks.ok)
        #expect(busy.clientGot() == "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
        #expect(busy.next() == [.connect(address: 0), .closeUpstream, .closeAfterFlush])
    }
}

/// Every answer the front door gives itself: status, Proxy-Status and whether the connection stays.
@Suite struct FrontDoorAnswerPlaybooks {
    @Test(arguments: [
        ("GET / HTTP/1.1\r\nHost: x\r\n\r\n", "400 Bad Request", "not a proxy request", false),
        ("GET https://o.test/ HTTP/1.1\r\nHost: o.test\r\n\r\n", "400 Bad Request", "https URL", false),
        (
            "GET http://127.0.0.1:8080/ HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n", "508 Loop Detected", "proxy_loop",
            true
        ),
        ("GET http://o.test/ HTTP/1.1\r\n\r\n", "400 Bad Request", "without a Host", true),
        ("GET http://o.test/ HTTP/2.0\r\nHost: o.test\r\n\r\n", "505", "http_request_error", true),
        ("GET http://o.test/ HTTP/1.1\nHost: o.test\n\n", "400 Bad Request", "bare LF", true),
        (
            "POST http://o.test/ HTTP/1.1\r\nHost: o.test\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
            "400 Bad Request", "both Transfer-Encoding and Content-Length", true
        ),
    ])
    func answers(request: String, status: String, detail: String, closes: Bool) {
        var p = Playbook.frontDoor()
        p.client(request)
        let answer = p.clientGot()
        #expect(answer.hasPrefix("HTTP/1.1 \(status)"), "\(answer)")
        #expect(answer.contains(detail), "\(answer)")
        #expect((p.clientClosed == .closeAfterFlush) == closes)
    }

    @Test func aKeptAliveAnswerLetsTheNextRequestThrough() {
        var p = Playbook.frontDoor()
        p.client("GET / HTTP/1.1\r\nHost: x\r\n\r\n" + ForwardingPlaybooks.get)
        #expect(p.clientGot().hasPrefix("HTTP/1.1 400"))
        #expect(p.next() == [.resolve(hop("o.test:80"))])
    }

    @Test func aHeadRequestGetsNoBody() {
        var p = Playbook.frontDoor()
        p.client("HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
        #expect(p.clientGot().hasSuffix("Cache-Control: no-store\r\n\r\n"))
    }

    @Test func aProtectedHttpsOriginWithoutALocalCAIs502() {
        let origin = Origins.https
        var p = Playbook(
            ConnectionMachine(
                role: .frontDoor,
                frontDoor: FrontDoor(
                    settings: Playbook.settings, credentials: nil,
                    boundAddress: ListenAddress(host: "127.0.0.1", port: 8080, isIPv6: false),
                    origins: OriginTable([origin])),
                hasLocalCA: false))
        p.client("CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
        #expect(p.clientGot().contains("run proxyctl ca init"))
    }

    @Test func connectToAProtectedOriginStartsInterception() {
        var p = Playbook.frontDoor(origins: [Origins.https])
        p.client("CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
        #expect(
            p.next() == [
                .startInterception(Origins.https, answer: Array("HTTP/1.1 200 Connection established\r\n\r\n".utf8))
            ])
        #expect(p.timers.isEmpty)
        var failed = Playbook.frontDoor(origins: [Origins.https])
        failed.client("CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
        failed.clientClosed = nil
        failed.event(.interceptionFailed(Origins.https, reason: "no key"))
        #expect(
            failed.clientGot().hasPrefix(
                "HTTP/1.1 502 Bad Gateway\r\nProxy-Status: proxyctl; error=proxy_internal_error"))
    }
}

enum Origins {
    static var https: OriginConfig {
        var origin = OriginConfig(scheme: "https", authority: hop("api.test:443"))
        origin.provider = "corp"
        return origin
    }

    static var http: OriginConfig {
        var origin = OriginConfig(scheme: "http", authority: hop("127.0.0.1:9000"))
        origin.provider = "corp"
        return origin
    }
}

/// Requests that would come back to the proxy itself: 508 before anything is connected.
@Suite struct LoopPlaybooks {
    @Test(arguments: ["[::ffff:127.0.0.1]:8080", "[::ffff:7f00:1]:8080", "127.0.0.1:8080", "0.0.0.0:8080"])
    func anAddressOfTheListenerIsALoop(target: String) {
        var p = Playbook.frontDoor()
        p.client("CONNECT \(target) HTTP/1.1\r\nHost: \(target)\r\n\r\n")
        #expect(
            p.clientGot().hasPrefix("HTTP/1.1 508 Loop Detected\r\nProxy-Status: proxyctl; error=proxy_loop_detected"))
        #expect(p.next() == [.closeAfterFlush])
    }

    @Test func aNameThatResolvesToTheListenerIsALoop() {
        var p = Playbook.frontDoor()
        p.client("CONNECT alias.test:8080 HTTP/1.1\r\nHost: alias.test:8080\r\n\r\n")
        p.event(.resolved(.addresses(["192.0.2.7", "::ffff:127.0.0.1"])))
        #expect(p.clientGot().hasPrefix("HTTP/1.1 508 Loop Detected"))
        #expect(p.connects.isEmpty)
        #expect(p.lastLog.contains("alias.test:8080 resolves to this proxy"))
        var other = Playbook.frontDoor()
        other.client("CONNECT alias.test:9090 HTTP/1.1\r\nHost: alias.test:9090\r\n\r\n")
        other.event(.resolved(.addresses(["127.0.0.1"])))
        #expect(other.connects == [0], "another port of the same address is no loop")
    }
}

/// Framing values and trailers that two hops could read differently.
@Suite struct FramingLimitPlaybooks {
    @Test func aContentLengthBeyondTwoToTheSixtyThreeIsRefused() {
        var p = Playbook.frontDoor()
        p.client("POST http://o.test/ HTTP/1.1\r\nHost: o.test\r\nContent-Length: 9223372036854775808\r\n\r\n")
        #expect(p.clientGot().contains("Content-Length too large"))
        var ok = Playbook.frontDoor()
        ok.client("POST http://o.test/ HTTP/1.1\r\nHost: o.test\r\nContent-Length: 9223372036854775807\r\n\r\n")
        #expect(ok.next() == [.resolve(hop("o.test:80"))])
    }

    @Test func aChunkSizeBeyondTwoToTheSixtyThreeIsRefused() {
        var p = Playbook.frontDoor()
        p.client("POST http://o.test/u HTTP/1.1\r\nHost: o.test\r\nTransfer-Encoding: chunked\r\n\r\n")
        p.connectUpstream()
        _ = (p.next(), p.upstreamGot())
        p.client("8000000000000000\r\n")
        #expect(p.clientGot().contains("chunk size too large"))
        var ok = Playbook.frontDoor()
        ok.client("POST http://o.test/u HTTP/1.1\r\nHost: o.test\r\nTransfer-Encoding: chunked\r\n\r\n")
        ok.connectUpstream()
        _ = ok.upstreamGot()
        ok.client("7fffffffffffffff\r\nabc")
        #expect(ok.upstreamGot() == "7fffffffffffffff\r\nabc")
    }

    @Test func framingAndRoutingFieldsInATrailerAreDropped() {
        var p = Playbook.frontDoor()
        p.client("POST http://o.test/u HTTP/1.1\r\nHost: o.test\r\nTransfer-Encoding: chunked\r\n\r\n")
        p.connectUpstream()
        _ = p.upstreamGot()
        p.client("3\r\nabc\r\n0\r\nX-Sum: 1\r\nContent-Length: 5\r\n")
        #expect(p.upstreamGot() == "3\r\nabc\r\n0\r\n", "the trailer section waits until it is complete")
        p.client("content-length: 9\r\nProxy-Authorization: Basic eA==\r\nX-End: 2\r\n\r\n")
        #expect(p.upstreamGot() == "X-Sum: 1\r\nX-End: 2\r\n\r\n")
        p.upstream(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nHost: evil.test\r\nX-T: 1\r\n\r\n")
        #expect(p.clientGot() == "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-T: 1\r\n\r\n")
        #expect(p.machine.isIdle)
    }
}
