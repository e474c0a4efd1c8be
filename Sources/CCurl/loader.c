// libcurl loaded at first use (include/shim.h says why). Each function proxyctl calls is looked up once; a
// missing one fails the load, so a later call never goes through a null pointer.
#include "shim.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

static struct {
    CURLcode (*global_init)(long);
    CURL *(*easy_init)(void);
    void (*easy_cleanup)(CURL *);
    void (*easy_reset)(CURL *);
    CURLcode (*easy_pause)(CURL *, int);
    const char *(*easy_strerror)(CURLcode);
    CURLcode (*easy_setopt)(CURL *, CURLoption, ...);
    CURLcode (*easy_getinfo)(CURL *, CURLINFO, ...);
    CURLM *(*multi_init)(void);
    CURLMcode (*multi_cleanup)(CURLM *);
    CURLMcode (*multi_add_handle)(CURLM *, CURL *);
    CURLMcode (*multi_remove_handle)(CURLM *, CURL *);
    CURLMcode (*multi_socket_action)(CURLM *, curl_socket_t, int, int *);
    CURLMcode (*multi_assign)(CURLM *, curl_socket_t, void *);
    CURLMsg *(*multi_info_read)(CURLM *, int *);
    CURLMcode (*multi_setopt)(CURLM *, CURLMoption, ...);
    CURLSH *(*share_init)(void);
    CURLSHcode (*share_cleanup)(CURLSH *);
    CURLSHcode (*share_setopt)(CURLSH *, CURLSHoption, ...);
    struct curl_slist *(*slist_append)(struct curl_slist *, const char *);
    void (*slist_free_all)(struct curl_slist *);
} curl;

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int loaded = -1;
static char failure[512] = "libcurl was not loaded";

// libcurl.so.4: the soname of every libcurl since 7.16 (Debian's libcurl4, OpenSSL flavour); macOS ships it as
// libcurl.4.dylib (docs/porting.md).
#if defined(__APPLE__)
#define PROXYCTL_LIBCURL "libcurl.4.dylib"
#else
#define PROXYCTL_LIBCURL "libcurl.so.4"
#endif

static void load(void) {
    void *library = dlopen(PROXYCTL_LIBCURL, RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        snprintf(failure, sizeof failure, "libcurl cannot be loaded (%s); install libcurl4 (Debian) to sign in",
                 dlerror());
        return;
    }
#define FIND(field, name)                                                                              \
    if ((*(void **)&curl.field = dlsym(library, name)) == NULL) {                                      \
        snprintf(failure, sizeof failure, PROXYCTL_LIBCURL " has no %s: libcurl 7.85 or later is needed", name);  \
        return;                                                                                        \
    }
    FIND(global_init, "curl_global_init")
    FIND(easy_init, "curl_easy_init")
    FIND(easy_cleanup, "curl_easy_cleanup")
    FIND(easy_reset, "curl_easy_reset")
    FIND(easy_pause, "curl_easy_pause")
    FIND(easy_strerror, "curl_easy_strerror")
    FIND(easy_setopt, "curl_easy_setopt")
    FIND(easy_getinfo, "curl_easy_getinfo")
    FIND(multi_init, "curl_multi_init")
    FIND(multi_cleanup, "curl_multi_cleanup")
    FIND(multi_add_handle, "curl_multi_add_handle")
    FIND(multi_remove_handle, "curl_multi_remove_handle")
    FIND(multi_socket_action, "curl_multi_socket_action")
    FIND(multi_assign, "curl_multi_assign")
    FIND(multi_info_read, "curl_multi_info_read")
    FIND(multi_setopt, "curl_multi_setopt")
    FIND(share_init, "curl_share_init")
    FIND(share_cleanup, "curl_share_cleanup")
    FIND(share_setopt, "curl_share_setopt")
    FIND(slist_append, "curl_slist_append")
    FIND(slist_free_all, "curl_slist_free_all")
#undef FIND
    // Thread-safe since libcurl 7.84 (Debian 12 has 7.88): other threads run by now.
    CURLcode status = curl.global_init(CURL_GLOBAL_DEFAULT);
    if (status != CURLE_OK) {
        snprintf(failure, sizeof failure, "curl_global_init failed: %s", curl.easy_strerror(status));
        return;
    }
    loaded = 0;
}

int proxyctl_curl_load(void) {
    pthread_once(&once, load);
    return loaded;
}

const char *proxyctl_curl_load_error(void) { return failure; }

CURL *proxyctl_curl_easy_init(void) { return curl.easy_init(); }
void proxyctl_curl_easy_cleanup(CURL *h) { curl.easy_cleanup(h); }
void proxyctl_curl_easy_reset(CURL *h) { curl.easy_reset(h); }
CURLcode proxyctl_curl_easy_pause(CURL *h, int bitmask) { return curl.easy_pause(h, bitmask); }
const char *proxyctl_curl_easy_strerror(CURLcode code) { return curl.easy_strerror(code); }
CURLM *proxyctl_curl_multi_init(void) { return curl.multi_init(); }
CURLMcode proxyctl_curl_multi_cleanup(CURLM *m) { return curl.multi_cleanup(m); }
CURLMcode proxyctl_curl_multi_add_handle(CURLM *m, CURL *h) { return curl.multi_add_handle(m, h); }
CURLMcode proxyctl_curl_multi_remove_handle(CURLM *m, CURL *h) { return curl.multi_remove_handle(m, h); }
CURLMcode proxyctl_curl_multi_socket_action(CURLM *m, curl_socket_t s, int ev_bitmask, int *running_handles) {
    return curl.multi_socket_action(m, s, ev_bitmask, running_handles);
}
CURLMcode proxyctl_curl_multi_assign(CURLM *m, curl_socket_t s, void *sockp) { return curl.multi_assign(m, s, sockp); }
CURLMsg *proxyctl_curl_multi_info_read(CURLM *m, int *msgs_in_queue) { return curl.multi_info_read(m, msgs_in_queue); }
CURLSH *proxyctl_curl_share_init(void) { return curl.share_init(); }
CURLSHcode proxyctl_curl_share_cleanup(CURLSH *s) { return curl.share_cleanup(s); }
struct curl_slist *proxyctl_curl_slist_append(struct curl_slist *list, const char *string) {
    return curl.slist_append(list, string);
}
void proxyctl_curl_slist_free_all(struct curl_slist *list) { curl.slist_free_all(list); }

CURLcode proxyctl_easy_setopt_long(CURL *h, CURLoption o, long v) { return curl.easy_setopt(h, o, v); }
CURLcode proxyctl_easy_setopt_ptr(CURL *h, CURLoption o, void *v) { return curl.easy_setopt(h, o, v); }
CURLcode proxyctl_easy_setopt_string(CURL *h, CURLoption o, const char *v) { return curl.easy_setopt(h, o, v); }
CURLcode proxyctl_easy_setopt_off(CURL *h, CURLoption o, curl_off_t v) { return curl.easy_setopt(h, o, v); }
CURLcode proxyctl_easy_setopt_write_cb(CURL *h, size_t (*cb)(char *, size_t, size_t, void *)) {
    return curl.easy_setopt(h, CURLOPT_WRITEFUNCTION, cb);
}
CURLcode proxyctl_easy_setopt_header_cb(CURL *h, size_t (*cb)(char *, size_t, size_t, void *)) {
    return curl.easy_setopt(h, CURLOPT_HEADERFUNCTION, cb);
}
CURLcode proxyctl_easy_setopt_read_cb(CURL *h, size_t (*cb)(char *, size_t, size_t, void *)) {
    return curl.easy_setopt(h, CURLOPT_READFUNCTION, cb);
}
CURLcode proxyctl_easy_setopt_seek_cb(CURL *h, int (*cb)(void *, curl_off_t, int)) {
    return curl.easy_setopt(h, CURLOPT_SEEKFUNCTION, cb);
}
CURLcode proxyctl_easy_setopt_trailer_cb(CURL *h, int (*cb)(struct curl_slist **, void *)) {
    return curl.easy_setopt(h, CURLOPT_TRAILERFUNCTION, cb);
}
CURLcode proxyctl_easy_getinfo_long(CURL *h, CURLINFO i, long *v) { return curl.easy_getinfo(h, i, v); }
CURLcode proxyctl_easy_getinfo_ptr(CURL *h, CURLINFO i, void **v) { return curl.easy_getinfo(h, i, v); }
CURLcode proxyctl_easy_getinfo_off(CURL *h, CURLINFO i, curl_off_t *v) { return curl.easy_getinfo(h, i, v); }
CURLMcode proxyctl_multi_setopt_long(CURLM *m, CURLMoption o, long v) { return curl.multi_setopt(m, o, v); }
CURLMcode proxyctl_multi_setopt_ptr(CURLM *m, CURLMoption o, void *v) { return curl.multi_setopt(m, o, v); }
CURLMcode proxyctl_multi_setopt_socket_cb(CURLM *m, int (*cb)(CURL *, curl_socket_t, int, void *, void *)) {
    return curl.multi_setopt(m, CURLMOPT_SOCKETFUNCTION, cb);
}
CURLMcode proxyctl_multi_setopt_timer_cb(CURLM *m, int (*cb)(CURLM *, long, void *)) {
    return curl.multi_setopt(m, CURLMOPT_TIMERFUNCTION, cb);
}
CURLSHcode proxyctl_share_setopt_long(CURLSH *s, CURLSHoption o, long v) { return curl.share_setopt(s, o, v); }
