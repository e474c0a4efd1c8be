"""Name constraints every client enforces (issue 32 item 3). The local CA's constraints sat on its self-signed
root, and RFC 5280 lets a relying party ignore a trust anchor's constraints: Java 17 connected to a leaf for a
name outside them. Now the trusted root signs a name-constrained intermediate and its key is never stored; the
intermediate signs the leaves.

Three independent verifiers, OpenSSL (`openssl s_client`), Go (crypto/tls) and Java 17 (the JDK's PKIX in
HttpClient), each trusting the root alone:
- refuse a leaf outside the constraints signed with the intermediate's key, which the test reads from the state
  directory (where the proxy needs it anyway; the root's key is nowhere to be had), served with the intermediate;
- accept the same kind of leaf for a permitted name (the control: the refusal is the constraints' doing);
- accept the proxy's own leaves, through the proxy, with the token reaching the API.
And the shape that needed the change: a root with the same constraints signing the leaf itself, which Java
accepts while OpenSSL and Go refuse.
"""

from __future__ import annotations

import datetime
import os
import shutil
import ssl
import subprocess
import textwrap
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fixtures import config
from fixtures.deployment import Deployment, Workspace
from fixtures.pki import CertificateAuthority
from fixtures.proxy import clean_env
from fixtures.tls_server import QuietHandler, TLSHTTPServer
from idp_fake import FakeIdP
from resource_server import ResourceServer

API = "api.test"


class _Answer(QuietHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")


GO_CLIENT = textwrap.dedent("""\
    // Fetches URL trusting only the PEM roots in CAFILE, connecting to ADDR (a stub) or through PROXY.
    package main

    import (
        "context"
        "crypto/tls"
        "crypto/x509"
        "fmt"
        "io"
        "net"
        "net/http"
        "net/url"
        "os"
    )

    func main() {
        target, caFile, via := os.Args[1], os.Args[2], os.Args[3]
        pem, err := os.ReadFile(caFile)
        if err != nil {
            panic(err)
        }
        roots := x509.NewCertPool()
        roots.AppendCertsFromPEM(pem)
        transport := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}
        if proxy, err := url.Parse(via); err == nil && proxy.Scheme == "http" {
            transport.Proxy = http.ProxyURL(proxy)
        } else {
            transport.DialContext = func(ctx context.Context, network, _ string) (net.Conn, error) {
                return (&net.Dialer{}).DialContext(ctx, network, via)
            }
        }
        response, err := (&http.Client{Transport: transport}).Get(target)
        if err != nil {
            fmt.Println("REFUSED", err)
            os.Exit(1)
        }
        body, _ := io.ReadAll(response.Body)
        fmt.Println("STATUS", response.StatusCode, string(body))
    }
    """)

JAVA_CLIENT = textwrap.dedent("""\
    import java.io.FileInputStream;
    import java.net.InetSocketAddress;
    import java.net.ProxySelector;
    import java.net.URI;
    import java.net.http.HttpClient;
    import java.net.http.HttpRequest;
    import java.net.http.HttpResponse;
    import java.security.KeyStore;
    import java.security.cert.CertificateFactory;
    import java.security.cert.X509Certificate;
    import javax.net.ssl.SSLContext;
    import javax.net.ssl.TrustManagerFactory;

    /** Fetches URL trusting only the PEM root in CAFILE (a trust anchor, as proxyctl's trust store makes it),
     *  through PROXY (host:port) when given; names resolve through -Djdk.net.hosts.file. */
    public class Fetch {
        public static void main(String[] args) throws Exception {
            KeyStore store = KeyStore.getInstance("PKCS12");
            store.load(null, null);
            try (FileInputStream in = new FileInputStream(args[1])) {
                X509Certificate root = (X509Certificate) CertificateFactory.getInstance("X.509").generateCertificate(in);
                store.setCertificateEntry("root", root);
            }
            TrustManagerFactory trust = TrustManagerFactory.getInstance(TrustManagerFactory.getDefaultAlgorithm());
            trust.init(store);
            SSLContext context = SSLContext.getInstance("TLS");
            context.init(null, trust.getTrustManagers(), null);
            HttpClient.Builder builder = HttpClient.newBuilder().sslContext(context);
            if (args.length > 2) {
                String[] proxy = args[2].split(":");
                builder.proxy(ProxySelector.of(new InetSocketAddress(proxy[0], Integer.parseInt(proxy[1]))));
            }
            try {
                HttpResponse<String> response = builder.build().send(
                    HttpRequest.newBuilder(URI.create(args[0])).build(), HttpResponse.BodyHandlers.ofString());
                System.out.println("STATUS " + response.statusCode() + " " + response.body());
            } catch (Exception error) {
                Throwable cause = error;
                while (cause.getCause() != null) cause = cause.getCause();
                System.out.println("REFUSED " + error + " / " + cause);
                System.exit(1);
            }
        }
    }
    """)


def require(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        pytest.skip(f"{program} is not installed (scripts/bootstrap test)")
    return path


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ca-constraints")


@pytest.fixture(scope="module")
def go_client(module_dir) -> Path:
    go = require("go")
    source = module_dir / "fetch.go"
    source.write_text(GO_CLIENT)
    binary = module_dir / "fetch"
    cache = Path(os.environ.get("GOCACHE") or Path.home() / ".cache" / "go-build")
    built = subprocess.run([go, "build", "-o", str(binary), str(source)], capture_output=True, text=True,
                           timeout=300, env=clean_env(GOCACHE=str(cache), GOPATH=str(module_dir / "gopath"),
                                                      GO111MODULE="off"))
    assert built.returncode == 0, built.stderr
    return binary


@pytest.fixture(scope="module")
def java_client(module_dir) -> Path:
    javac = require("javac")
    require("java")
    source = module_dir / "Fetch.java"
    source.write_text(JAVA_CLIENT)
    built = subprocess.run([javac, "-d", str(module_dir), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return module_dir


@pytest.fixture(scope="module")
def deployment(module_dir):
    with FakeIdP(access_token_format="jwt") as fake:
        rs = ResourceServer(module_dir / "rs", [API])
        rs.trust(fake.issuer, fake.url("jwks"))
        sections = (config.provider("fake", fake.issuer, redirect_port=0)
                    + config.origin(f"https://{API}:{rs.port}", "fake", ca_file=rs.ca_pem))
        ws = Workspace(module_dir / "ws", sections, f"{API}=127.0.0.1")
        made = ws.ca_init()
        assert "intermediate.pem" in made.stderr, made.stderr
        ws.login_fake("fake")
        deployment = Deployment(ws, ws.start_proxy())
        deployment.rs = rs
        yield deployment
        failure = deployment.stop()
        rs.close()
        assert failure is None, failure


def intermediate(deployment) -> CertificateAuthority:
    """The intermediate as the proxy keeps it: its certificate and its key, read from the state directory."""
    ca = deployment.ws.state / "ca"
    return CertificateAuthority.load(ca / "intermediate.pem", ca / "intermediate-key.pem")


class Stub:
    """A TLS server on 127.0.0.1 presenting a leaf (and the chain after it) for `name`."""

    def __init__(self, issuer: CertificateAuthority, directory: Path, name: str, chain: bool):
        identity = issuer.issue(directory, [name], stem=name.replace(".", "-"), chain=chain)
        self.server = TLSHTTPServer(_Answer, identity.server_context()).start()
        self.name, self.port = name, self.server.port
        self.leaf = identity.cert_pem

    def url(self) -> str:
        return f"https://{self.name}:{self.port}/"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def openssl(stub: Stub, root: Path) -> str:
    done = subprocess.run(["openssl", "s_client", "-connect", f"127.0.0.1:{stub.port}", "-servername", stub.name,
                           "-CAfile", str(root), "-verify_return_error", "-verify_hostname", stub.name],
                          input="", capture_output=True, text=True, timeout=30)
    verdict = [line.strip() for line in (done.stdout + done.stderr).splitlines()
               if "Verification" in line or "verify error" in line]
    return f"exit {done.returncode}: {' | '.join(verdict)}"


def go(binary: Path, stub: Stub, root: Path) -> str:
    done = subprocess.run([str(binary), stub.url(), str(root), f"127.0.0.1:{stub.port}"], capture_output=True,
                          text=True, timeout=60, env=clean_env())
    return done.stdout.strip() or done.stderr.strip()


def java(classes: Path, stub: Stub, root: Path, tmp_path: Path) -> str:
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 {stub.name}\n")
    done = subprocess.run(["java", f"-Djdk.net.hosts.file={hosts}", "-cp", str(classes), "Fetch", stub.url(),
                           str(root)], capture_output=True, text=True, timeout=120, env=clean_env())
    return done.stdout.strip() or done.stderr.strip()


@pytest.mark.parametrize("name, violation", [("other.test", "permitted subtree"), ("sub.api.test", "excluded subtree")])
def test_a_leaf_outside_the_constraints_signed_by_the_intermediate_is_refused_by_openssl_go_and_java(
        deployment, go_client, java_client, tmp_path, name, violation):
    root = deployment.ws.state / "ca" / "ca.pem"
    stub = Stub(intermediate(deployment), tmp_path, name, chain=True)
    control = Stub(intermediate(deployment), tmp_path, API, chain=True)
    try:
        verdicts = {"openssl": openssl(stub, root), "go": go(go_client, stub, root),
                    "java": java(java_client, stub, root, tmp_path)}
        controls = {"openssl": openssl(control, root), "go": go(go_client, control, root),
                    "java": java(java_client, control, root, tmp_path)}
    finally:
        stub.close()
        control.close()
    assert verdicts["openssl"].startswith("exit 1") and f"{violation} violation" in verdicts["openssl"], verdicts
    assert verdicts["go"].startswith("REFUSED") and "not authorized to sign for this name" in verdicts["go"], verdicts
    assert verdicts["java"].startswith("REFUSED") and "name constraints" in verdicts["java"].lower(), verdicts
    # The control: a permitted name from the same key and chain is accepted by each.
    assert "Verification: OK" in controls["openssl"] and controls["openssl"].startswith("exit 0"), controls
    assert controls["go"] == "STATUS 200 ok" and controls["java"] == "STATUS 200 ok", controls


def test_the_proxys_own_leaves_verify_in_openssl_go_and_java(deployment, go_client, java_client, tmp_path):
    rs, proxy = deployment.rs, deployment.proxy
    root = deployment.ws.state / "ca" / "ca.pem"
    url = rs.url("/me", API)
    mark = rs.mark()
    go_done = subprocess.run([str(go_client), url, str(root), f"http://127.0.0.1:{proxy.port}"],
                             capture_output=True, text=True, timeout=60, env=clean_env())
    assert go_done.stdout.startswith("STATUS 200"), go_done.stdout + go_done.stderr
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 {API}\n")
    java_done = subprocess.run(["java", f"-Djdk.net.hosts.file={hosts}", "-cp", str(java_client), "Fetch", url,
                                str(root), f"127.0.0.1:{proxy.port}"], capture_output=True, text=True, timeout=120,
                               env=clean_env())
    assert java_done.stdout.startswith("STATUS 200"), java_done.stdout + java_done.stderr
    seen = rs.since(mark, API)
    assert len(seen) == 2 and all(s.error is None and s.token for s in seen), seen
    # OpenSSL through a CONNECT tunnel: the chain is the leaf, then the intermediate; the root is not sent.
    done = subprocess.run(["openssl", "s_client", "-proxy", f"127.0.0.1:{proxy.port}", "-connect",
                           f"{API}:{rs.port}", "-servername", API, "-CAfile", str(root), "-verify_return_error",
                           "-verify_hostname", API, "-showcerts"], input="", capture_output=True, text=True,
                          timeout=30)
    assert "Verification: OK" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    chain = [line for line in done.stdout.splitlines() if line.strip().startswith(("0 s:", "1 s:", "2 s:"))]
    assert len(chain) == 2 and "intermediate" in chain[1], chain


def test_the_roots_key_is_nowhere_in_the_state_directory(deployment):
    ca = deployment.ws.state / "ca"
    root = x509.load_pem_x509_certificate((ca / "ca.pem").read_bytes())
    numbers = root.public_key().public_numbers()
    for path in deployment.ws.state.rglob("*"):
        if not path.is_file():
            continue
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError):
            continue
        assert key.public_key().public_numbers() != numbers, f"{path} holds the root's key"
    assert not (ca / "ca-key.pem").exists()
    assert (ca / "intermediate-key.pem").stat().st_mode & 0o777 == 0o600
    constraints = x509.load_pem_x509_certificate((ca / "intermediate.pem").read_bytes()).extensions \
        .get_extension_for_class(x509.NameConstraints)
    assert constraints.critical and {n.value for n in constraints.value.permitted_subtrees} == {API}
    # Only the root is trusted: the bundle holds it and not the intermediate.
    bundle = x509.load_pem_x509_certificates((ca / "bundle.pem").read_bytes())
    intermediate_cert = x509.load_pem_x509_certificate((ca / "intermediate.pem").read_bytes())
    assert root in bundle and intermediate_cert not in bundle


def test_java_ignores_constraints_on_a_root_the_reason_for_the_intermediate(java_client, go_client, tmp_path):
    """What the issue measured, on a CA shaped like the old one (a root with the constraints, signing leaves
    itself): Java connects to a leaf outside them while OpenSSL and Go refuse it. This keeps the Java check above
    meaningful: it would see the difference."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "constrained root")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.NameConstraints(permitted_subtrees=[x509.DNSName(API)], excluded_subtrees=None),
                           critical=True)
            .sign(key, hashes.SHA256()))
    root = tmp_path / "root.pem"
    root.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    stub = Stub(CertificateAuthority(key, cert), tmp_path, "other.test", chain=False)
    try:
        assert java(java_client, stub, root, tmp_path) == "STATUS 200 ok"
        assert go(go_client, stub, root).startswith("REFUSED")
        assert openssl(stub, root).startswith("exit 1")
    finally:
        stub.close()


def test_ca_init_replaces_a_ca_made_before_the_intermediate(module_dir):
    """A state directory from before: a constrained root that signs leaves itself, its key in ca-key.pem. `ca show`
    and `serve --check` still work and say what is wrong; `ca init` makes a root and an intermediate, deletes the
    old key and keeps the old root trusted until it expires (a serve started with it keeps working)."""
    sections = (config.provider("p", "http://127.0.0.1:9/issuer", redirect_port=0)
                + config.origin(f"https://{API}:8443", "p"))
    ws = Workspace(module_dir / "legacy", sections, f"{API}=127.0.0.1")
    ca = ws.state / "ca"
    ca.mkdir(parents=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "proxyctl local CA (before)")])
    now = datetime.datetime.now(datetime.timezone.utc)
    old = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
           .serial_number(x509.random_serial_number())
           .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=300))
           .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
           .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
           .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
           .add_extension(x509.NameConstraints(permitted_subtrees=[x509.DNSName(API)],
                                               excluded_subtrees=[x509.DNSName("." + API)]), critical=True)
           .sign(key, hashes.SHA256()))
    (ca / "ca.pem").write_bytes(old.public_bytes(serialization.Encoding.PEM))
    (ca / "ca-key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    (ca / "ca-key.pem").chmod(0o600)
    (ca / "hosts").write_text(API + "\n")
    shown = ws.cli("ca", "show")
    assert shown.returncode == 0 and "signs with:  the root itself" in shown.stdout, shown.stdout
    assert ws.cli("serve", "--check").returncode == 0
    doctor = ws.cli("doctor")
    assert "name constraints are on its root, which Java ignores" in doctor.stdout, doctor.stdout
    made = ws.ca_init()
    assert "its name constraints are on an intermediate" in made.stderr, made.stderr
    assert not (ca / "ca-key.pem").exists() and (ca / "intermediate-key.pem").exists()
    bundle = x509.load_pem_x509_certificates((ca / "bundle.pem").read_bytes())
    assert old in bundle, "the old root stays trusted until it expires"
    assert "signs with:  " + str(ca / "intermediate.pem") in ws.cli("ca", "show").stdout
    assert "nothing to do" in ws.ca_init().stderr


def test_an_origin_below_another_is_intercepted_and_verifies(module_dir, go_client):
    """Protected origins one below another (nest.test, api.nest.test, v2.api.nest.test; FuzzConfig found it): the
    upper host's excluded subtree took the lower hosts from the intermediate, whose leaves every client refused.
    Each host's leaf verifies in Go and OpenSSL through the proxy, the token reaches each, and the lowest host's
    own subtree stays excluded."""
    hosts = ["nest.test", "api.nest.test", "v2.api.nest.test"]
    with FakeIdP(access_token_format="jwt") as fake:
        rs = ResourceServer(module_dir / "nested-rs", hosts)
        rs.trust(fake.issuer, fake.url("jwks"))
        sections = config.provider("fake", fake.issuer, redirect_port=0)
        for host in hosts:
            sections += config.origin(f"https://{host}:{rs.port}", "fake", ca_file=rs.ca_pem)
        ws = Workspace(module_dir / "nested-ws", sections, ",".join(f"{host}=127.0.0.1" for host in hosts))
        ws.ca_init()
        ws.login_fake("fake")
        nested = Deployment(ws, ws.start_proxy())
        try:
            root = ws.state / "ca" / "ca.pem"
            for host in hosts:
                mark = rs.mark()
                answer = nested.curl(rs.url("/me", host))
                assert answer.status == 200, (host, answer)
                done = subprocess.run([str(go_client), rs.url("/me", host), str(root),
                                       f"http://127.0.0.1:{nested.proxy.port}"], capture_output=True, text=True,
                                      timeout=60, env=clean_env())
                assert done.stdout.startswith("STATUS 200"), (host, done.stdout + done.stderr)
                seen = rs.since(mark, host)
                assert len(seen) == 2 and all(s.error is None and s.token for s in seen), (host, seen)
                verified = subprocess.run(["openssl", "s_client", "-proxy", f"127.0.0.1:{nested.proxy.port}",
                                           "-connect", f"{host}:{rs.port}", "-servername", host, "-CAfile", str(root),
                                           "-verify_return_error", "-verify_hostname", host], input="",
                                          capture_output=True, text=True, timeout=30)
                assert "Verification: OK" in verified.stdout, (host, verified.stdout[-2000:] + verified.stderr)
            constraints = x509.load_pem_x509_certificate((ws.state / "ca" / "intermediate.pem").read_bytes()) \
                .extensions.get_extension_for_class(x509.NameConstraints).value
            permitted = sorted(name.value for name in constraints.permitted_subtrees)
            excluded = sorted(name.value for name in constraints.excluded_subtrees
                              if isinstance(name, x509.DNSName))
            assert permitted == sorted(hosts), permitted
            assert excluded == [".v2.api.nest.test"], excluded
        finally:
            failure = nested.stop()
            rs.close()
        assert failure is None, failure
