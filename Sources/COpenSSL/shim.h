#ifndef PROXYCTL_COPENSSL_SHIM_H
#define PROXYCTL_COPENSSL_SHIM_H

#include <openssl/ssl.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/ec.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/bio.h>
#include <openssl/core_names.h>
#include <openssl/ecdsa.h>
#include <openssl/bn.h>
#include <openssl/sha.h>
#include <openssl/param_build.h>
#include <openssl/rsa.h>
#include <openssl/hmac.h>

// BIO_get_mem_data is a macro over BIO_ctrl.
static inline long proxyctl_BIO_get_mem_data(BIO *bio, char **data) {
    return BIO_get_mem_data(bio, data);
}

// OPENSSL_free is a macro carrying file and line.
static inline void proxyctl_OPENSSL_free(void *ptr) { OPENSSL_free(ptr); }

// SSL_CTX_set_min_proto_version is a macro over SSL_CTX_ctrl.
static inline int proxyctl_SSL_CTX_set_min_proto_version(SSL_CTX *ctx, int version) {
    return (int)SSL_CTX_set_min_proto_version(ctx, version);
}

// SSL_CTX_set_tlsext_servername_callback and _arg are macros over SSL_CTX_callback_ctrl / SSL_CTX_ctrl.
static inline int proxyctl_SSL_CTX_set_servername_callback(SSL_CTX *ctx, int (*cb)(SSL *, int *, void *),
                                                            void *arg) {
    if (!SSL_CTX_set_tlsext_servername_callback(ctx, cb)) return 0;
    return (int)SSL_CTX_set_tlsext_servername_arg(ctx, arg);
}

// SSL_set_tlsext_host_name is a macro over SSL_ctrl.
static inline int proxyctl_SSL_set_tlsext_host_name(SSL *ssl, const char *name) {
    return (int)SSL_set_tlsext_host_name(ssl, name);
}

// SSL_OP_NO_TICKET is a macro expression (SSL_OP_BIT).
static inline uint64_t proxyctl_SSL_OP_NO_TICKET(void) { return SSL_OP_NO_TICKET; }

// XN_FLAG_RFC2253 is a macro expression.
static inline unsigned long proxyctl_XN_FLAG_RFC2253(void) { return XN_FLAG_RFC2253; }

// X509V3_set_ctx_nodb is a macro.
static inline void proxyctl_X509V3_set_ctx_nodb(X509V3_CTX *ctx) { X509V3_set_ctx_nodb(ctx); }

// SSL_CTX_set_session_cache_mode and SSL_CTX_set_mode/options are macros over SSL_CTX_ctrl.
static inline long proxyctl_SSL_CTX_set_session_cache_mode(SSL_CTX *ctx, long mode) {
    return SSL_CTX_set_session_cache_mode(ctx, mode);
}
static inline long proxyctl_SSL_CTX_set_mode(SSL_CTX *ctx, long mode) { return SSL_CTX_set_mode(ctx, mode); }

// EVP_PKEY_PUBLIC_KEY and EVP_PKEY_KEYPAIR are macro expressions.
static inline int proxyctl_EVP_PKEY_PUBLIC_KEY(void) { return EVP_PKEY_PUBLIC_KEY; }
static inline int proxyctl_EVP_PKEY_KEYPAIR(void) { return EVP_PKEY_KEYPAIR; }

// ERR_get_error_all is fine, but the reason string needs ERR_error_string_n with a buffer: one helper.
static inline unsigned long proxyctl_ERR_get_error_string(char *buffer, size_t length) {
    unsigned long code = ERR_get_error();
    if (code != 0) ERR_error_string_n(code, buffer, length);
    return code;
}

#endif
