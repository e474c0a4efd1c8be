// Generated once with PyJWT 2.15.1 and cryptography 43.0.1 (an implementation this project did not write),
// by the script at the end of this file; the keys were random and are not kept. Regenerating gives
// different keys and tokens: replace every literal together.

/// JWS test vectors signed by PyJWT. Claims of every token (except jti in the leading-zero ones):
/// `{"iss":"https://idp.example.com","sub":"alice","aud":"proxyctl-test","exp":2000000000,
/// "iat":1700000000,"nonce":"n-0S6_WzA2Mj"}`.
public enum JWSFixtures {
    public static let issuer = "https://idp.example.com"
    public static let clientID = "proxyctl-test"
    public static let nonce = "n-0S6_WzA2Mj"
    public static let subject = "alice"
    public static let issuedAt: Int64 = 1_700_000_000
    public static let expiresAt: Int64 = 2_000_000_000

    /// RSA 2048, kid rsa-1: signs the RS*, PS* tokens.
    public static let rsa1 = """
        {"kty":"RSA","kid":"rsa-1","use":"sig","n":"55UxjPqE4FHybTTajmKxLjK_mj7ChUryBV2LrKRVxpUg2drr4UuNoH7g\
        7GhRm9llVJk9h27eX6eekJwXLCzgqRh-fj-V3mbqITNYZqXNeq-JQ-Ci7-Pu6eTNKe8l0coZni3yGPikXbfqnkfQLPj3351OIKtQ\
        DXYP8_TQ5Ay7daHaMA8NWa7Cs-A9QJ94OTEGsDK1FEBvUm3680ogiQ3hwN3wjzC4f99nawvvBu_mRbNeQZcSHcY96OH0K6fH9aeQ\
        bbTBipMCAtEV7Qgbqht_hm07KSJB_Sr3CtPX54eUJP8E_8CwPE_UAUyvbqhgmVPaQjg5ng3tHeI_bvbnW1vKfQ","e":"AQAB"}
        """
    /// RSA 2048, kid rsa-2: signs only `rs256ByRSA2`.
    public static let rsa2 = """
        {"kty":"RSA","kid":"rsa-2","use":"sig","n":"t7sGsuvULXXwTCsl2wgAm6TvAgDiXcQo1ViBHeg8KCNIjrNTRD8UpGVZ\
        t5e2YEbrhsCI9HLRvzLFr5ciRz7ePBGpp7MBZ4LXgw_jjTMCQLzzGLREb7JtVRyQUTrNzuraG50k6uGNtlwfluory4VDEa2wrJ-5\
        1UPEhuGJyVpmlVYOHS50TYk5zMBLQPJ6oef09BvLyJlLzEXXiPCjt9xCSt76rYEi2c6VEo6OGeSOovbI6rvaXYB9lIzzznORYCGz\
        0IQNuE1Be75wudDjDlzIn9Pu8qCd8I9tNSOFFbichqA1sUEPfO-NLwtdr1LnLcUF8pcsIbT2POkfXqqJ7poQww","e":"AQAB"}
        """
    /// P-256, kid ec-1: signs the ES256 tokens.
    public static let ec1 = """
        {"kty":"EC","kid":"ec-1","use":"sig","crv":"P-256","x":"yimTDhJ4SHUv8dyipRkywZWuMV5fsPHg7HF-8F8GcZI"\
        ,"y":"vG799Lk1HsJ3-5rbK8SznaI3_yUpqef27xcZzKjB3-k"}
        """
    /// P-384, kid ec384-1: signs the ES384 token.
    public static let ec384 = """
        {"kty":"EC","kid":"ec384-1","use":"sig","crv":"P-384","x":"0SnsaymNKSkagibeFL78Vj8hc6xrQsn4Gdp5Sjygw\
        ziK60ZMwEXvwdssZWm7Jvim","y":"822TQ44qTxydG3UBXgiAT7FgfFUia02CKC9JFjPny1eoyZk8kQG9wgW_23qgOLs-"}
        """
    /// RS256 by rsa-1.
    public static let rs256 = """
        eyJhbGciOiJSUzI1NiIsImtpZCI6InJzYS0xIiwidHlwIjoiSldUIn0.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIs\
        InN1YiI6ImFsaWNlIiwiYXVkIjoicHJveHljdGwtdGVzdCIsImV4cCI6MjAwMDAwMDAwMCwiaWF0IjoxNzAwMDAwMDAwLCJub25j\
        ZSI6Im4tMFM2X1d6QTJNaiJ9.rBEcYs7uOjJwy1i1FU8TIJVaG_Gl7Tj3rWQkn6wXfGBlMMrn0JOq8q-wP7MnjNlL2V22ryrE1pU\
        qeh0O5vvBdt74VP7bFrhkCVksohcC7pqnTxO--SAyoQBBOYbjhF-5dduRQo16V_1vUa9uPo8ppTxE804i5Y5zHbEbJ_eil3jeOPg\
        -86qVU_gSx7IPbLpgR1lntZNDVcPLlKxb12iKTvz6TI2EdZ5IK1RgVm0cNkW1cxeOzotNTVtCRx3TfNVCrOxxYQRDB4-dojERdK2\
        Ay6ty9VpuxwO6Eu6JbKotjJlEMkz25mqOPVTCJkJUMmnp3E_b8NIqCwx_EEUQD-DGKw
        """
    /// RS384 by rsa-1.
    public static let rs384 = """
        eyJhbGciOiJSUzM4NCIsImtpZCI6InJzYS0xIiwidHlwIjoiSldUIn0.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIs\
        InN1YiI6ImFsaWNlIiwiYXVkIjoicHJveHljdGwtdGVzdCIsImV4cCI6MjAwMDAwMDAwMCwiaWF0IjoxNzAwMDAwMDAwLCJub25j\
        ZSI6Im4tMFM2X1d6QTJNaiJ9.VALCn5MZODh8Td_kKy1r4ydCf8yGi9J_XLemcT7ATwlLbUQC6dpSsmjmUKLjYzFAWfBPg2rU_-i\
        mv3nnZaky2RRqzAji_UV7J8NXlPhTyw9WZ8-dqE636qhYdXrC0KkgwKRF3N3n_9Y7R1yGfYeiAlbuFjnlkXlwJfiFejU1MLMEQmO\
        NxImkfDjU1dbHIwvAi1dr-yiwAI9SY1OCzDejxjuhjbE2HA0HQsU2slL1Na1Jhy09aERFQBXPmiFh1BxpDwNE4wHTl-sWWMUj4z6\
        mYjMfso5M7jQ_A3PLeYveEIq-A-rMWoYK0rGBY6XcZv53-xoTjrfJBzOOQUzV26cQaQ
        """
    /// PS256 by rsa-1 (MGF1-SHA256, 32-byte salt).
    public static let ps256 = """
        eyJhbGciOiJQUzI1NiIsImtpZCI6InJzYS0xIiwidHlwIjoiSldUIn0.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIs\
        InN1YiI6ImFsaWNlIiwiYXVkIjoicHJveHljdGwtdGVzdCIsImV4cCI6MjAwMDAwMDAwMCwiaWF0IjoxNzAwMDAwMDAwLCJub25j\
        ZSI6Im4tMFM2X1d6QTJNaiJ9.HrugaRRO_-E6JXTrFlXr8BsLb9CS0M_mOcI2NMJfdtBwvlLCUVlRO3Vd7hwfYqbZa90yak61Pg7\
        2W9Qg6VL7Qmij6ScMwgbD6i-DDUUWdZ04uEaGKw7TMWwmj0ZKehKFwR1595CPVzZHxLbswBfeRsRwneR9GLIfcfMPFN0UvCMDb-q\
        GZm7MkPwLbdjch0xp_Z9nglIn7vkaO7V34oC8GnxoiYa30TxmbtN3_qJGXof1oEMYJEzwap6ZlGIf9x-RL8aAk7wgm9b_J2P4EEh\
        sz-nM79p0J09-2tAceP--EIdjKn8WHwcfl5pigm_TP1gYeS_r5GVapSf1vpkabybfmw
        """
    /// ES256 by ec-1.
    public static let es256 = """
        eyJhbGciOiJFUzI1NiIsImtpZCI6ImVjLTEiLCJ0eXAiOiJKV1QifQ.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIsI\
        nN1YiI6ImFsaWNlIiwiYXVkIjoicHJveHljdGwtdGVzdCIsImV4cCI6MjAwMDAwMDAwMCwiaWF0IjoxNzAwMDAwMDAwLCJub25jZ\
        SI6Im4tMFM2X1d6QTJNaiJ9.GWJ7bUT0iDn1RoUeR7Zt1QWA39-nbyZUrDvBRUdc9x8FySJRLWYG-zxMFRlO_CqnYqovwiUsL9Zj\
        T5W31ShYKg
        """
    /// ES384 by ec384-1.
    public static let es384 = """
        eyJhbGciOiJFUzM4NCIsImtpZCI6ImVjMzg0LTEiLCJ0eXAiOiJKV1QifQ.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvb\
        SIsInN1YiI6ImFsaWNlIiwiYXVkIjoicHJveHljdGwtdGVzdCIsImV4cCI6MjAwMDAwMDAwMCwiaWF0IjoxNzAwMDAwMDAwLCJub\
        25jZSI6Im4tMFM2X1d6QTJNaiJ9.Z-F8kL_VfGHzJxsC_aGYE-LK2uAjAGMm3b6AB2OZKzCDMslAQN1AQ2lJp2pAYt0Jr1ZhTRDf\
        0xEjl5iOv0AdPwbrK3JsK6OwVhaFPcr2LVPfttnZ7Q07L94X9mdxMwXT
        """
    /// ES256 by ec-1 whose r starts with a zero byte (searched for by varying jti).
    public static let es256LeadingZeroR = """
        eyJhbGciOiJFUzI1NiIsImtpZCI6ImVjLTEiLCJ0eXAiOiJKV1QifQ.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIsI\
        nN1YiI6ImFsaWNlIiwiYXVkIjoicHJveHljdGwtdGVzdCIsImV4cCI6MjAwMDAwMDAwMCwiaWF0IjoxNzAwMDAwMDAwLCJub25jZ\
        SI6Im4tMFM2X1d6QTJNaiIsImp0aSI6IjE4NiJ9.ADTKxfefTOhbE3ZVJQJ0HXx8X8rOuvRjRWg8eRoWwUmp8JLtVi-Yebrr_Qgj\
        mbCmclljLMlMIdGUhKD4-nlPPg
        """
    /// Its signature as r||s, hex.
    public static let es256LeadingZeroRRaw = """
        0034cac5f79f4ce85b1376552502741d7c7c5fcacebaf46345683c791a16c149a9f092ed562f9879baebfd082399b0a67259\
        632cc94c21d19484a0f8fa794f3e
        """
    /// Its signature as DER (cryptography's encode_dss_signature), hex: r has 31 bytes.
    public static let es256LeadingZeroRDER = """
        3044021f34cac5f79f4ce85b1376552502741d7c7c5fcacebaf46345683c791a16c149022100a9f092ed562f9879baebfd08\
        2399b0a67259632cc94c21d19484a0f8fa794f3e
        """
    /// ES256 by ec-1 whose s starts with a zero byte.
    public static let es256LeadingZeroS = """
        eyJhbGciOiJFUzI1NiIsImtpZCI6ImVjLTEiLCJ0eXAiOiJKV1QifQ.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIsI\
        nN1YiI6ImFsaWNlIiwiYXVkIjoicHJveHljdGwtdGVzdCIsImV4cCI6MjAwMDAwMDAwMCwiaWF0IjoxNzAwMDAwMDAwLCJub25jZ\
        SI6Im4tMFM2X1d6QTJNaiIsImp0aSI6IjE0In0.Flq7ZM5nqwi5CTcSHbzTMzHDr8xHyN0Zyz-BYvPcxr8AeU0vDnQ4aij46ghBa\
        L4iQWwW9ofqlDcFQ8OtVLpxKA
        """
    /// Its signature as r||s, hex.
    public static let es256LeadingZeroSRaw = """
        165abb64ce67ab08b90937121dbcd33331c3afcc47c8dd19cb3f8162f3dcc6bf00794d2f0e74386a28f8ea084168be22416c\
        16f687ea94370543c3ad54ba7128
        """
    /// Its signature as DER, hex: s has 31 bytes.
    public static let es256LeadingZeroSDER = """
        30430220165abb64ce67ab08b90937121dbcd33331c3afcc47c8dd19cb3f8162f3dcc6bf021f794d2f0e74386a28f8ea0841\
        68be22416c16f687ea94370543c3ad54ba7128
        """
    /// RS256 by rsa-1 with no kid in the header.
    public static let rs256WithoutKid = """
        eyJhbGciOiJSUzI1NiIsInR5cCI6IkpXVCJ9.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIsInN1YiI6ImFsaWNlIiw\
        iYXVkIjoicHJveHljdGwtdGVzdCIsImV4cCI6MjAwMDAwMDAwMCwiaWF0IjoxNzAwMDAwMDAwLCJub25jZSI6Im4tMFM2X1d6QTJ\
        NaiJ9.q94s8oggtNInVW2xXsKYxsyR6UM72EcwVeaNqy3ajKuOLI-0GT6Rjhp5gb5_SDugEhR0V0XuWb-9EnpeMqvnU5gc3Nh754\
        rDxcWM-DLR9XKvPDTpWjzgYBOG-Ti5XMXH5iaK7aWmQVMG0DSt3OfQDoRUAHShxkfDcdIfYOJrX3vzDeCApzEZioAO32DT1F_rR6\
        XpOeH9qlLBIeFfRIHnExFdOVscVk-YyNNt3_075wW0hC4Cl-HelYiWaPHFg984ZZU5ctKjDmE9s4zTclRrCYffk1UnNSxpB90ZgT\
        IuytR6BdHGFBaXi4xBSIa-bhtERC8pD2wuGagtVatuFR2Tow
        """
    /// RS256 by rsa-2, kid rsa-2.
    public static let rs256ByRSA2 = """
        eyJhbGciOiJSUzI1NiIsImtpZCI6InJzYS0yIiwidHlwIjoiSldUIn0.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIs\
        InN1YiI6ImFsaWNlIiwiYXVkIjoicHJveHljdGwtdGVzdCIsImV4cCI6MjAwMDAwMDAwMCwiaWF0IjoxNzAwMDAwMDAwLCJub25j\
        ZSI6Im4tMFM2X1d6QTJNaiJ9.lRyoIwTVGQ0KFnVv6yIKBEpta28zTLq68FrfYbYlbqiOsFRqhjrDUwaX0CbbTxq52ggjpgztH7H\
        sRaYq80Q99_5ee5E4FHPqd_CS1-tMbu7K6edObnLarPITdodLcdkhYtg4jtt-cP_G5DwLTvfGbZL73oDC9Zf9dsGjar9H06yekWs\
        PAizZie8T4NijxMr_DAeEmRUZOX1dNNd7uuskjI1L-ImU9fkymM0HOrRBiyJsTnWeC74zFAgk_HQU2f3oj4oqOHIiEbFo6thD5TW\
        BGbyi08DSqs6cPnjLXOzGtTM3bT7utJSN3Z0RgOfw9ok_yrZst3H1blgrFUP0HdQo7Q
        """
    /// HS256 (kid rsa-1) keyed with rsa-1's public key PEM: the algorithm-confusion forgery.
    public static let hs256KeyedWithRSAPublicKey = """
        eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCIsImtpZCI6InJzYS0xIn0.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlLmNvbSIs\
        InN1YiI6ImFsaWNlIiwiYXVkIjoicHJveHljdGwtdGVzdCIsImV4cCI6MjAwMDAwMDAwMCwiaWF0IjoxNzAwMDAwMDAwLCJub25j\
        ZSI6Im4tMFM2X1d6QTJNaiJ9.0bLRyGW47CVg3gyogLFhXhOia1Ap13CJxPVHh3ATfsM
        """
}

// The generator (.venv/bin/python gen.py > out.json; each value was pasted in 100-character lines):
//
// # JWS fixtures for Tests/ProxyOAuthTests and Tests/ProxyTLSTests, made with PyJWT and cryptography.
// import base64, hashlib, hmac, json, sys
// import jwt
// from jwt.algorithms import RSAAlgorithm, ECAlgorithm
// from cryptography.hazmat.primitives.asymmetric import rsa, ec
// from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature
// from cryptography.hazmat.primitives import serialization
//
// def b64u(b): return base64.urlsafe_b64encode(b).rstrip(b"=").decode()
// def unb64u(s): return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
//
// def jwk(pub, kid, alg=None, use="sig"):
//     d = json.loads((RSAAlgorithm if isinstance(pub, rsa.RSAPublicKey) else ECAlgorithm).to_jwk(pub))
//     out = {"kty": d["kty"], "kid": kid, "use": use}
//     if alg: out["alg"] = alg
//     for k in ("n", "e", "crv", "x", "y"):
//         if k in d: out[k] = d[k]
//     return out
//
// rsa1 = rsa.generate_private_key(public_exponent=65537, key_size=2048)
// rsa2 = rsa.generate_private_key(public_exponent=65537, key_size=2048)
// ec256 = ec.generate_private_key(ec.SECP256R1())
// ec384 = ec.generate_private_key(ec.SECP384R1())
//
// claims = {"iss": "https://idp.example.com", "sub": "alice", "aud": "proxyctl-test", "exp": 2000000000,
//           "iat": 1700000000, "nonce": "n-0S6_WzA2Mj"}
// def sign(key, alg, kid):
//     return jwt.encode(claims, key, algorithm=alg, headers={"kid": kid})
//
// out = {}
// out["jwks"] = {"keys": [jwk(rsa1.public_key(), "rsa-1"), jwk(rsa2.public_key(), "rsa-2"),
//                         jwk(ec256.public_key(), "ec-1"), jwk(ec384.public_key(), "ec384-1")]}
// out["RS256"] = sign(rsa1, "RS256", "rsa-1")
// out["RS384"] = sign(rsa1, "RS384", "rsa-1")
// out["PS256"] = sign(rsa1, "PS256", "rsa-1")
// out["ES256"] = sign(ec256, "ES256", "ec-1")
// out["ES384"] = sign(ec384, "ES384", "ec384-1")
// out["RS256_nokid"] = jwt.encode(claims, rsa1, algorithm="RS256")
// out["RS256_rsa2"] = sign(rsa2, "RS256", "rsa-2")
// # HS256 keyed with the RSA public key's PEM: the classic algorithm-confusion forgery.
// pem = rsa1.public_key().public_bytes(serialization.Encoding.PEM,
//                                      serialization.PublicFormat.SubjectPublicKeyInfo)
// h = b64u(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "rsa-1"}, separators=(",", ":")).encode())
// p = b64u(json.dumps(claims, separators=(",", ":")).encode())
// mac = hmac.new(pem, (h + "." + p).encode(), hashlib.sha256).digest()
// out["HS256_confused"] = h + "." + p + "." + b64u(mac)
//
// def find(pred):
//     for i in range(100000):
//         c = dict(claims, jti=str(i))
//         t = jwt.encode(c, ec256, algorithm="ES256", headers={"kid": "ec-1"})
//         raw = unb64u(t.split(".")[2])
//         if pred(raw):
//             r, s = int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big")
//             return t, raw.hex(), encode_dss_signature(r, s).hex()
//     sys.exit("not found")
// out["ES256_r0"] = find(lambda raw: raw[0] == 0)
// out["ES256_s0"] = find(lambda raw: raw[32] == 0)
// # check with pyjwt itself
// for alg in ("RS256", "RS384", "PS256"):
//     jwt.decode(out[alg], rsa1.public_key(), algorithms=[alg], audience="proxyctl-test",
//                options={"verify_exp": False})
// print(json.dumps(out, indent=1))
