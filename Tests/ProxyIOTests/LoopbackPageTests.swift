import ProxyOAuth
import Testing

@testable import ProxyIO

/// The pages the sign-in listener shows: text from the provider is never markup.
@Suite struct LoopbackPageTests {
    @Test func providerTextIsEscaped() {
        let page = LoopbackReceiver.Page.render(
            .failed(provider: "corp", reason: "<script>alert('x')</script> & \"more\"", retry: "proxyctl login corp"))
        #expect(!page.contains("<script>"))
        #expect(page.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;more&quot;"))
        #expect(page.contains(LoopbackReceiver.Page.endingMarker))
    }

    @Test func otherPagesAreNotEndings() {
        #expect(
            !LoopbackReceiver.Page.render(title: "Not found", message: "x").contains(
                LoopbackReceiver.Page.endingMarker))
    }
}
