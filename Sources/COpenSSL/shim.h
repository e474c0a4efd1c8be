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
#include <openssl/pkcs12.h>
#include <stdio.h>
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
static inline uint64_t proxyctl_SSL_OP_IGNORE_UNEXPECTED_EOF(void) { return SSL_OP_IGNORE_UNEXPECTED_EOF; }

// XN_FLAG_RFC2253 is a macro expression.
static inline unsigned long proxyctl_XN_FLAG_RFC2253(void) { return XN_FLAG_RFC2253; }

// X509V3_set_ctx_nodb is a macro.
static inline void proxyctl_X509V3_set_ctx_nodb(X509V3_CTX *ctx) { X509V3_set_ctx_nodb(ctx); }

// SSL_CTX_set_session_cache_mode and SSL_CTX_set_mode/options are macros over SSL_CTX_ctrl.
static inline long proxyctl_SSL_CTX_set_session_cache_mode(SSL_CTX *ctx, long mode) {
    return SSL_CTX_set_session_cache_mode(ctx, mode);
}
static inline long proxyctl_SSL_CTX_set_mode(SSL_CTX *ctx, long mode) { return SSL_CTX_set_mode(ctx, mode); }
static inline long proxyctl_SSL_set_mode(SSL *ssl, long mode) { return SSL_set_mode(ssl, mode); }
// SSL_CTX_add1_chain_cert is a macro over SSL_CTX_ctrl: the local CA's intermediate sent after each leaf.
static inline int proxyctl_SSL_CTX_add1_chain_cert(SSL_CTX *ctx, X509 *x509) {
    return (int)SSL_CTX_add1_chain_cert(ctx, x509);
}

// EVP_PKEY_PUBLIC_KEY and EVP_PKEY_KEYPAIR are macro expressions.
static inline int proxyctl_EVP_PKEY_PUBLIC_KEY(void) { return EVP_PKEY_PUBLIC_KEY; }
static inline int proxyctl_EVP_PKEY_KEYPAIR(void) { return EVP_PKEY_KEYPAIR; }

// ERR_get_error_all is fine, but the reason string needs ERR_error_string_n with a buffer: one helper.
static inline unsigned long proxyctl_ERR_get_error_string(char *buffer, size_t length) {
    unsigned long code = ERR_get_error();
    if (code != 0) ERR_error_string_n(code, buffer, length);
    return code;
}

// A PKCS#12 trust store for Java: every certificate of the PEM bundle as a certificate bag carrying the
// attribute keytool gives trusted certificates (Oracle's trusted key usage, 2.16.840.1.113894.746875.1.1,
// with anyExtendedKeyUsage), so that Java's PKCS12 KeyStore lists them as trusted entries. The bags are
// not encrypted (they are public certificates); the MAC is SHA-256 under `password`. Returns the DER length
// with *out from OPENSSL_malloc (free with proxyctl_OPENSSL_free), or -1; *count is the certificates read.
static inline int proxyctl_pkcs12_truststore(const unsigned char *pem, int pem_length, const char *password,
                                             unsigned char **out, int *count) {
    int result = -1;
    *out = NULL;
    *count = 0;
    BIO *bio = BIO_new_mem_buf(pem, pem_length);
    STACK_OF(PKCS12_SAFEBAG) *bags = NULL;
    STACK_OF(PKCS7) *safes = NULL;
    PKCS12 *p12 = NULL;
    ASN1_OBJECT *any_usage = OBJ_txt2obj("2.5.29.37.0", 1);
    if (bio == NULL || any_usage == NULL) goto done;
    X509 *cert;
    while ((cert = PEM_read_bio_X509(bio, NULL, NULL, NULL)) != NULL) {
        PKCS12_SAFEBAG *bag = PKCS12_add_cert(&bags, cert);
        X509_free(cert);
        if (bag == NULL) goto done;
        char alias[32];
        snprintf(alias, sizeof alias, "proxyctl-%d", *count);
        if (!PKCS12_add_friendlyname_asc(bag, alias, -1)) goto done;
        if (!PKCS12_add1_attr_by_txt(bag, "2.16.840.1.113894.746875.1.1", V_ASN1_OBJECT,
                                     (const unsigned char *)any_usage, -1)) goto done;
        *count += 1;
    }
    ERR_clear_error();  // the end of the bundle reads as an error
    if (*count == 0) goto done;
    if (!PKCS12_add_safe(&safes, bags, -1, 0, NULL)) goto done;
    p12 = PKCS12_add_safes(safes, 0);
    if (p12 == NULL) goto done;
    if (!PKCS12_set_mac(p12, password, -1, NULL, 0, 10000, EVP_sha256())) goto done;
    result = i2d_PKCS12(p12, out);
done:
    PKCS12_free(p12);
    sk_PKCS7_pop_free(safes, PKCS7_free);
    sk_PKCS12_SAFEBAG_pop_free(bags, PKCS12_SAFEBAG_free);
    ASN1_OBJECT_free(any_usage);
    BIO_free(bio);
    return result;
}

// ECDSA with its nonce made ahead (PrivateKey's presigned pool): ECDSA_sign_setup makes k^-1 and r = (k*G).x,
// the scalar multiplication that is most of a P-256 signature; ECDSA_do_sign_ex finishes a signature from one
// such pair and a digest. OpenSSL 3.0 deprecated these (EVP has no equivalent) but keeps them; the
// deprecation warnings stay in this header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
// A legacy EC_KEY of its own (a copy: the pool is filled on another thread than the one that signs).
static inline EC_KEY *proxyctl_ec_key_copy(EVP_PKEY *pkey) {
    EC_KEY *shared = EVP_PKEY_get1_EC_KEY(pkey);
    if (shared == NULL) return NULL;
    EC_KEY *copy = EC_KEY_dup(shared);
    EC_KEY_free(shared);
    return copy;
}
static inline void proxyctl_ec_key_free(EC_KEY *key) { EC_KEY_free(key); }
static inline int proxyctl_ecdsa_presign(EC_KEY *key, BIGNUM **kinv, BIGNUM **r) {
    return ECDSA_sign_setup(key, NULL, kinv, r);
}
// The signature of a 32-byte digest as raw r||s (64 bytes, JWS form) from a pair made by proxyctl_ecdsa_presign.
static inline int proxyctl_ecdsa_sign_presigned(EC_KEY *key, const unsigned char *digest, const BIGNUM *kinv,
                                                const BIGNUM *r, unsigned char *out) {
    ECDSA_SIG *sig = ECDSA_do_sign_ex(digest, 32, kinv, r, key);
    if (sig == NULL) return 0;
    const BIGNUM *sr = NULL, *ss = NULL;
    ECDSA_SIG_get0(sig, &sr, &ss);
    int ok = BN_bn2binpad(sr, out, 32) == 32 && BN_bn2binpad(ss, out + 32, 32) == 32;
    ECDSA_SIG_free(sig);
    return ok;
}
#pragma GCC diagnostic pop

#endif
