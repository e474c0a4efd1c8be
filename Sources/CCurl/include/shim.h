#ifndef PROXYCTL_CCURL_SHIM_H
#define PROXYCTL_CCURL_SHIM_H

// libcurl talks to identity providers only (the proxy's way to origins is its own client), so it is loaded at
// the first request to a provider, not linked: a serve that has not needed a provider yet (and one that never
// will: passthrough, client credentials fetched by another process) does not map libcurl and the thirty
// libraries it brings (4 MB of an idle serve's RSS; docs/packaging.md). The functions below are the ones
// proxyctl uses, each calling libcurl's through a pointer found by dlsym in loader.c.
#include <curl/curl.h>

// Loads libcurl.so.4 and runs curl_global_init, once per process (thread-safe); 0 on success, else -1 with the
// reason in proxyctl_curl_load_error(). Every other function here may be called only after a success.
int proxyctl_curl_load(void);
const char *proxyctl_curl_load_error(void);

CURL *proxyctl_curl_easy_init(void);
void proxyctl_curl_easy_cleanup(CURL *h);
void proxyctl_curl_easy_reset(CURL *h);
CURLcode proxyctl_curl_easy_pause(CURL *h, int bitmask);
const char *proxyctl_curl_easy_strerror(CURLcode code);
CURLM *proxyctl_curl_multi_init(void);
CURLMcode proxyctl_curl_multi_cleanup(CURLM *m);
CURLMcode proxyctl_curl_multi_add_handle(CURLM *m, CURL *h);
CURLMcode proxyctl_curl_multi_remove_handle(CURLM *m, CURL *h);
CURLMcode proxyctl_curl_multi_socket_action(CURLM *m, curl_socket_t s, int ev_bitmask, int *running_handles);
CURLMcode proxyctl_curl_multi_assign(CURLM *m, curl_socket_t s, void *sockp);
CURLMsg *proxyctl_curl_multi_info_read(CURLM *m, int *msgs_in_queue);
CURLSH *proxyctl_curl_share_init(void);
CURLSHcode proxyctl_curl_share_cleanup(CURLSH *s);
struct curl_slist *proxyctl_curl_slist_append(struct curl_slist *list, const char *string);
void proxyctl_curl_slist_free_all(struct curl_slist *list);

// curl_easy_setopt, curl_multi_setopt, curl_share_setopt and curl_easy_getinfo are variadic: Swift cannot
// call them. One typed wrapper per argument type.
CURLcode proxyctl_easy_setopt_long(CURL *h, CURLoption o, long v);
CURLcode proxyctl_easy_setopt_ptr(CURL *h, CURLoption o, void *v);
CURLcode proxyctl_easy_setopt_string(CURL *h, CURLoption o, const char *v);
CURLcode proxyctl_easy_setopt_off(CURL *h, CURLoption o, curl_off_t v);
CURLcode proxyctl_easy_setopt_write_cb(CURL *h, size_t (*cb)(char *, size_t, size_t, void *));
CURLcode proxyctl_easy_setopt_header_cb(CURL *h, size_t (*cb)(char *, size_t, size_t, void *));
CURLcode proxyctl_easy_setopt_read_cb(CURL *h, size_t (*cb)(char *, size_t, size_t, void *));
CURLcode proxyctl_easy_setopt_seek_cb(CURL *h, int (*cb)(void *, curl_off_t, int));
CURLcode proxyctl_easy_setopt_trailer_cb(CURL *h, int (*cb)(struct curl_slist **, void *));
CURLcode proxyctl_easy_getinfo_long(CURL *h, CURLINFO i, long *v);
CURLcode proxyctl_easy_getinfo_ptr(CURL *h, CURLINFO i, void **v);
CURLcode proxyctl_easy_getinfo_off(CURL *h, CURLINFO i, curl_off_t *v);
CURLMcode proxyctl_multi_setopt_long(CURLM *m, CURLMoption o, long v);
CURLMcode proxyctl_multi_setopt_ptr(CURLM *m, CURLMoption o, void *v);
CURLMcode proxyctl_multi_setopt_socket_cb(CURLM *m, int (*cb)(CURL *, curl_socket_t, int, void *, void *));
CURLMcode proxyctl_multi_setopt_timer_cb(CURLM *m, int (*cb)(CURLM *, long, void *));
CURLSHcode proxyctl_share_setopt_long(CURLSH *s, CURLSHoption o, long v);

// CURL_WRITEFUNC_PAUSE, CURL_READFUNC_PAUSE and CURL_READFUNC_ABORT are macros of size_t values Swift does not
// import (constants: no libcurl needed). The proxy's own client answers its body callbacks with them too.
static inline size_t proxyctl_writefunc_pause(void) { return CURL_WRITEFUNC_PAUSE; }
static inline size_t proxyctl_readfunc_pause(void) { return CURL_READFUNC_PAUSE; }
static inline size_t proxyctl_readfunc_abort(void) { return CURL_READFUNC_ABORT; }

#endif
