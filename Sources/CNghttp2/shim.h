#ifndef PROXYCTL_CNGHTTP2_SHIM_H
#define PROXYCTL_CNGHTTP2_SHIM_H

// nghttp2, the HTTP/2 library curl and Apache httpd use: the frames, HPACK and flow-control bookkeeping of
// the HTTP/2 connections clients make inside intercepted tunnels. Its API is plain functions and structs, so
// the shim only has to include it.
#include <nghttp2/nghttp2.h>

#endif
