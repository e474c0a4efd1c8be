#ifndef PROXYCTL_CCURL_SHIM_H
#define PROXYCTL_CCURL_SHIM_H

#include <curl/curl.h>

// curl_easy_setopt, curl_multi_setopt and curl_easy_getinfo are variadic: Swift cannot call them.
// One typed wrapper per argument type.
static inline CURLcode proxyctl_easy_setopt_long(CURL *h, CURLoption o, long v) {
    return curl_easy_setopt(h, o, v);
}
static inline CURLcode proxyctl_easy_setopt_ptr(CURL *h, CURLoption o, void *v) {
    return curl_easy_setopt(h, o, v);
}
static inline CURLcode proxyctl_easy_setopt_string(CURL *h, CURLoption o, const char *v) {
    return curl_easy_setopt(h, o, v);
}
static inline CURLcode proxyctl_easy_setopt_off(CURL *h, CURLoption o, curl_off_t v) {
    return curl_easy_setopt(h, o, v);
}
static inline CURLcode proxyctl_easy_setopt_write_cb(CURL *h, size_t (*cb)(char *, size_t, size_t, void *)) {
    return curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, cb);
}
static inline CURLcode proxyctl_easy_setopt_header_cb(CURL *h, size_t (*cb)(char *, size_t, size_t, void *)) {
    return curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, cb);
}
static inline CURLcode proxyctl_easy_setopt_read_cb(CURL *h, size_t (*cb)(char *, size_t, size_t, void *)) {
    return curl_easy_setopt(h, CURLOPT_READFUNCTION, cb);
}
static inline CURLcode proxyctl_easy_setopt_seek_cb(CURL *h, int (*cb)(void *, curl_off_t, int)) {
    return curl_easy_setopt(h, CURLOPT_SEEKFUNCTION, cb);
}
// CURL_WRITEFUNC_PAUSE and CURL_READFUNC_PAUSE are macros of size_t values Swift does not import.
static inline CURLcode proxyctl_easy_setopt_trailer_cb(CURL *h, int (*cb)(struct curl_slist **, void *)) {
    return curl_easy_setopt(h, CURLOPT_TRAILERFUNCTION, cb);
}
// CURLVERSION_NOW is a macro.
static inline curl_version_info_data *proxyctl_curl_version_info(void) { return curl_version_info(CURLVERSION_NOW); }
static inline size_t proxyctl_writefunc_pause(void) { return CURL_WRITEFUNC_PAUSE; }
static inline size_t proxyctl_readfunc_pause(void) { return CURL_READFUNC_PAUSE; }
static inline size_t proxyctl_readfunc_abort(void) { return CURL_READFUNC_ABORT; }
static inline CURLcode proxyctl_easy_getinfo_long(CURL *h, CURLINFO i, long *v) {
    return curl_easy_getinfo(h, i, v);
}
static inline CURLcode proxyctl_easy_getinfo_ptr(CURL *h, CURLINFO i, void **v) {
    return curl_easy_getinfo(h, i, v);
}
static inline CURLcode proxyctl_easy_getinfo_off(CURL *h, CURLINFO i, curl_off_t *v) {
    return curl_easy_getinfo(h, i, v);
}
static inline CURLMcode proxyctl_multi_setopt_long(CURLM *m, CURLMoption o, long v) {
    return curl_multi_setopt(m, o, v);
}
static inline CURLMcode proxyctl_multi_setopt_ptr(CURLM *m, CURLMoption o, void *v) {
    return curl_multi_setopt(m, o, v);
}
static inline CURLMcode proxyctl_multi_setopt_socket_cb(CURLM *m, int (*cb)(CURL *, curl_socket_t, int, void *, void *)) {
    return curl_multi_setopt(m, CURLMOPT_SOCKETFUNCTION, cb);
}
static inline CURLMcode proxyctl_multi_setopt_timer_cb(CURLM *m, int (*cb)(CURLM *, long, void *)) {
    return curl_multi_setopt(m, CURLMOPT_TIMERFUNCTION, cb);
}

// curl_share_setopt is variadic.
static inline CURLSHcode proxyctl_share_setopt_long(CURLSH *s, CURLSHoption o, long v) {
    return curl_share_setopt(s, o, v);
}

#endif
