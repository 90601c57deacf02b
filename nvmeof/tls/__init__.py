"""NVMe/TCP over TLS 1.3 with pre-shared keys (TP 8011, TP 8018), sans-IO.

psk.py      TlsKey (NVMeTLSkey-1 interchange format, CRC), retained / TLS PSK derivation (HKDF-Expand-Label),
            PskIdentity (NVMe0R0x / NVMe1R0x identities), generate_key (nvme gen-tls-key)
openssl.py  TlsSession: a TLS 1.3 PSK-only session over memory BIOs, through a cffi ABI binding to libssl.so.3
"""

from nvmeof.tls.psk import CIPHER_SUITES, PskIdentity, TlsKey, generate_key

__all__ = ["CIPHER_SUITES", "PskIdentity", "TlsKey", "generate_key"]
