"""Certificates by the parties' TLS identity rule: a node's certificate names its node id
(subject CN) and its host (a subjectAltName entry). Read by the node config at load (its own
certificate and the CA: files, validity dates, names) and by each party's front door (the
peer a client certificate identifies, its TLS contexts). Standard library only: the front is
a light process.
"""
from __future__ import annotations

import ipaddress
import ssl
import time


class CertificateError(ValueError):
    """A certificate file that cannot serve: unreadable, outside its dates, or naming another
    node or host. The message names the file and what to change."""


def certificate_names(cert: dict) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """(subject CN, subjectAltName entries) of a certificate as Python's ssl module decodes it
    (`SSLSocket.getpeercert()`)."""
    cn = None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                cn = value
    return cn, tuple((str(k), str(v)) for k, v in cert.get("subjectAltName", ()))


def san_matches(host: str, sans) -> bool:
    """Whether subjectAltName entries (as `certificate_names` gives them) name `host`: an IP
    entry equal to an IP literal host (brackets allowed), else a DNS entry equal to the name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return any(kind == "DNS" and value.lower() == host.lower() for kind, value in sans)
    for kind, value in sans:
        if kind == "IP Address":
            try:
                if ipaddress.ip_address(value.strip()) == ip:
                    return True
            except ValueError:
                continue
    return False


def describe_certificate(cert: dict) -> str:
    """'CN=node:2, SAN IP:127.0.0.1 DNS:localhost' (for messages)."""
    cn, sans = certificate_names(cert)
    names = " ".join(f"{'IP' if k == 'IP Address' else k}:{v}" for k, v in sans) or "none"
    return f"CN={cn!r}, SAN {names}"


def identity_mismatch(cert: dict, node: str, host: str) -> str | None:
    """Why `cert` is not node `node` at `host` by the TLS identity rule (module docstring of
    runtime.distributed.config):
    None if it is."""
    cn, sans = certificate_names(cert)
    problems = []
    if cn != node:
        problems.append(f"its CN is {cn!r}, not {node!r}")
    if not san_matches(host, sans):
        problems.append(f"its subjectAltName has no entry for the node's host {host}")
    if not problems:
        return None
    return (f"it is a certificate for {describe_certificate(cert)} where node {node!r} at "
            f"{host} was expected ({'; '.join(problems)})")


def read_certificate(path: str) -> dict | None:
    """A PEM certificate file decoded like a peer certificate (None if Python cannot)."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        return decode(path)
    except (ssl.SSLError, OSError, ValueError) as err:
        raise CertificateError(f"{path} is not a readable PEM certificate ({err})") from None


# A certificate that expires within this long is accepted with a warning at load.
EXPIRY_WARNING_S = 7 * 24 * 3600


def check_validity(cert: dict, path: str, where: str, now: float | None = None) -> str | None:
    """A certificate's validity dates against `now` (Unix seconds, default the clock): not yet
    valid or expired -> CertificateError naming the file and the date; expiring within 7 days
    -> a warning (returned); else None."""
    now = time.time() if now is None else now
    try:
        not_before = ssl.cert_time_to_seconds(cert["notBefore"])
        not_after = ssl.cert_time_to_seconds(cert["notAfter"])
    except (KeyError, ValueError):
        raise CertificateError(f"{where}={path!r} has no readable validity dates") from None
    if now < not_before:
        raise CertificateError(f"{where}={path!r} is not valid yet (from {cert['notBefore']}; "
                              "check this machine's clock or reissue it)")
    if now > not_after:
        raise CertificateError(f"{where}={path!r} expired on {cert['notAfter']}; issue a new one "
                              "(scripts/make_certs.sh)")
    if not_after - now < EXPIRY_WARNING_S:
        days = (not_after - now) / 86400
        return (f"{where}={path!r} expires on {cert['notAfter']} (in {days:.1f} days); issue a "
                "new one before then (scripts/make_certs.sh)")
    return None


def check_own_certificate(node: str, host: str, path: str, where: str) -> str | None:
    """The certificate file configured for `node` must be within its validity dates and name
    `node` (CN) and its host (SAN) -> a warning if it expires within 7 days, else None."""
    cert = read_certificate(path)
    if cert is None:
        return None
    warning = check_validity(cert, path, where)
    why = identity_mismatch(cert, node, host)
    if why:
        raise CertificateError(f"{where}={path!r} cannot identify node {node!r}: {why}. Each "
                              f"node's certificate must have CN={node!r} and a subjectAltName "
                              f"for {host} (the address in 'nodes'); issue one per node")
    return warning


def _refuse_passphrase(*_):
    raise CertificateError("it is encrypted with a passphrase; the parties need an unencrypted "
                           "key (openssl pkey -in KEY -out KEY.plain)")


def check_key_and_ca(cert: str, key: str, ca: str, where_cert: str, where_key: str) -> None:
    """The key must be the private key of the certificate, and the certificate must chain to
    the CA: a TLS handshake between the two in memory (this party's certificate and key on
    one side, a client trusting only the CA on the other), as a peer would check it.
    Raises CertificateError naming the field."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        server.load_cert_chain(cert, key, password=_refuse_passphrase)
    except CertificateError as err:
        raise CertificateError(f"{where_key}={key!r}: {err}") from None
    except ssl.SSLError as err:
        if "KEY_VALUES_MISMATCH" in str(err) or "key values mismatch" in str(err):
            raise CertificateError(f"{where_key}={key!r} is not the private key of "
                                   f"{where_cert}={cert!r} (key values mismatch); give the key "
                                   "the certificate was issued for") from None
        raise CertificateError(f"{where_key}={key!r} is not a PEM private key for "
                               f"{where_cert} ({err.reason or err})") from None
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False       # names: the identity rule, checked apart
    try:
        client.load_verify_locations(ca)
    except ssl.SSLError as err:
        raise CertificateError(f"link.tls.ca={ca!r} is not a PEM certificate "
                               f"({err.reason or err})") from None
    bios = [ssl.MemoryBIO() for _ in range(4)]
    sides = [client.wrap_bio(bios[0], bios[1]), server.wrap_bio(bios[2], bios[3],
                                                                 server_side=True)]
    done = [False, False]
    for _ in range(8):
        for i, side in enumerate(sides):
            if not done[i]:
                try:
                    side.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLCertVerificationError as err:
                    raise CertificateError(
                        f"{where_cert}={cert!r} is not signed by link.tls.ca={ca!r} "
                        f"({err.verify_message}): peers would refuse it; issue it from "
                        "that CA (scripts/make_certs.sh) or configure its CA") from None
                except ssl.SSLError as err:
                    if i == 1 and done[0]:
                        break
                    raise CertificateError(f"{where_cert}={cert!r} with {where_key} cannot "
                                           f"serve TLS ({err.reason or err})") from None
            out, into = (bios[1], bios[2]) if i == 0 else (bios[3], bios[0])
            data = out.read()
            if data:
                into.write(data)
        if done[0]:
            return
    raise CertificateError(f"{where_cert}={cert!r}: a TLS handshake with it did not complete")


def certificate_node(cert: dict | None, peers: dict[str, dict]) -> tuple[str | None, str]:
    """The peer node a client certificate identifies by the identity rule -> (node, '') or
    (None, why not)."""
    if not cert:
        return None, "it presented no certificate"
    cn, sans = certificate_names(cert)
    if cn not in peers:
        return None, f"its certificate's CN {cn!r} is not a peer node of the config"
    if not san_matches(peers[cn]["host"], sans):
        return None, (f"its certificate (CN={cn!r}) has no subjectAltName for {cn}'s host "
                      f"{peers[cn]['host']}")
    return cn, ""


def tls_context(ca: str, cert: str, key: str, server: bool = False) -> ssl.SSLContext:
    """Mutual TLS by the identity rule: the peer's certificate must chain to `ca` (its names
    are checked by the rule, not as a host name); this side presents `cert` and `key`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(ca)
    ctx.load_cert_chain(cert, key)
    return ctx
