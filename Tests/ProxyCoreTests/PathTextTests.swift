import ProxyCore
import Testing

/// The cuts `NSString.deletingLastPathComponent` and `lastPathComponent` make (checked against Foundation 6.3 on
/// Linux; there `//` has the parent `` and a one-component relative path traps, where PathText answers `/` and ``).
@Suite struct PathTextTests {
    @Test(arguments: [
        ("/a/b", "/a"), ("/a/b/", "/a"), ("/a", "/"), ("/", "/"), ("b", ""), ("a/b", "a"), ("", ""),
        ("/a//b", "/a"), ("//", "/"), ("/var/lib/proxyctl/state/ca", "/var/lib/proxyctl/state"),
    ])
    func parent(path: String, expected: String) {
        #expect(PathText.parent(path) == expected)
    }

    @Test(arguments: [("/a/b", "b"), ("/a/b/", "b"), ("/", "/"), ("b", "b"), ("", ""), ("/a/proxy.conf", "proxy.conf")])
    func lastComponent(path: String, expected: String) {
        #expect(PathText.lastComponent(path) == expected)
    }
}
