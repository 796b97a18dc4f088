"""A certificate authority of its own for the secured local services, made with the machine's
``openssl``: a CA, and server certificates it signs for the names clients dial (``localhost``
and ``127.0.0.1``), so that clients verify the server's name as in production (librdkafka's
``ssl.endpoint.identification.algorithm=https``, libpq's ``sslmode=verify-full``).

Called by the secured local backend (:mod:`oncekit.connectors.services.secured`) and by tests,
which make a second, untrusted authority to check that clients refuse it.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from oncekit.core.errors import ServiceError

SERVER_NAMES = ("localhost", "127.0.0.1")


def _openssl(*args: str) -> None:
    program = shutil.which("openssl")
    if program is None:
        raise ServiceError("tls: no openssl on the PATH to make the test certificates; install openssl")
    done = subprocess.run([program, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ServiceError(f"tls: openssl {args[0]} failed: {done.stderr.strip()[-300:]}")


@dataclass(frozen=True)
class ServerCertificate:
    """A server's certificate and its unencrypted private key, as PEM files."""

    certificate: Path
    key: Path

    def pkcs12(self, password: str) -> Path:
        """The same key and certificate as a PKCS#12 keystore under ``password`` (what a Java
        server such as the Kafka broker loads)."""
        store = self.certificate.with_suffix(".p12")
        _openssl("pkcs12", "-export", "-in", str(self.certificate), "-inkey", str(self.key), "-out", str(store),
                 "-name", "server", "-passout", f"pass:{password}")
        return store


@dataclass(frozen=True)
class CertificateAuthority:
    """A self-signed CA in ``folder``: ``certificate`` is what clients trust (librdkafka's
    ``ssl.ca.location``, libpq's ``sslrootcert``)."""

    folder: Path

    @property
    def certificate(self) -> Path:
        return self.folder / "ca.pem"

    @classmethod
    def create(cls, folder: Path, name: str = "oncekit test CA") -> CertificateAuthority:
        folder.mkdir(parents=True, exist_ok=True)
        ca = cls(folder)
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                 "-keyout", str(folder / "ca.key"), "-out", str(ca.certificate))
        return ca

    def issue(self, name: str) -> ServerCertificate:
        """A server certificate for :data:`SERVER_NAMES`, signed by this CA, as ``<name>.pem``
        and ``<name>.key`` in the CA's folder."""
        key, request, cert = (self.folder / f"{name}.{ext}" for ext in ("key", "csr", "pem"))
        names = ",".join(f"IP:{n}" if n[0].isdigit() else f"DNS:{n}" for n in SERVER_NAMES)
        extensions = self.folder / f"{name}.ext"
        extensions.write_text(f"subjectAltName={names}\nextendedKeyUsage=serverAuth\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={SERVER_NAMES[0]}",
                 "-keyout", str(key), "-out", str(request))
        _openssl("x509", "-req", "-in", str(request), "-CA", str(self.certificate), "-CAkey", str(self.folder / "ca.key"),
                 "-CAcreateserial", "-days", "2", "-extfile", str(extensions), "-out", str(cert))
        return ServerCertificate(cert, key)
