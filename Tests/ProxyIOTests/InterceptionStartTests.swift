import Testing

@testable import ProxyIO

/// After a CONNECT to a protected origin the machine's 200 goes out, then TLS starts: on the socket when the
/// kernel took the whole answer, else over the bufferevent, which sends only what the socket did not take.
@Suite struct InterceptionStartTests {
    let answer = Array("HTTP/1.1 200 Connection established\r\n\r\n".utf8)

    @Test func theWholeAnswerSentMeansTLSOnTheSocket() {
        #expect(ClientHandOff.interceptionStart(answer: answer, sent: answer.count, buffered: false) == .onTheSocket)
    }

    @Test func aPartialSendLeavesOnlyTheRestToSend() {
        let start = ClientHandOff.interceptionStart(answer: answer, sent: 10, buffered: false)
        #expect(start == .overTheBufferevent(rest: answer[10...]))
        if case .overTheBufferevent(let rest) = start {
            #expect(Array(answer[..<10]) + Array(rest) == answer, "each byte of the 200 once, in order")
        }
    }

    @Test func nothingSentMeansTheWholeAnswerWaits() {
        #expect(
            ClientHandOff.interceptionStart(answer: answer, sent: -1, buffered: false)
                == .overTheBufferevent(rest: answer[...]))
        #expect(
            ClientHandOff.interceptionStart(answer: answer, sent: 0, buffered: false)
                == .overTheBufferevent(rest: answer[...]))
    }

    @Test func bytesWaitingInTheBuffereventKeepTheWholeAnswerBehindThem() {
        #expect(
            ClientHandOff.interceptionStart(answer: answer, sent: 0, buffered: true)
                == .overTheBufferevent(rest: answer[...]))
    }
}
