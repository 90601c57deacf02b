"""A sans-IO TLS 1.3 PSK session over the system OpenSSL (libssl.so.3), bound with cffi in ABI mode.

Python 3.11's ssl module has no TLS 1.3 external-PSK callbacks, so this binds the few libssl calls NVMe/TCP
needs (what SPDK's posix socket layer uses, lib/sock/sock.c / module/sock/posix): TLS 1.3 only, the two
suites of TP 8011, no certificates, one PSK per connection:

- client: SSL_CTX_set_psk_use_session_callback hands OpenSSL an SSL_SESSION built from the TLS PSK
  (SSL_SESSION_new + set1_master_key + set_cipher + set_protocol_version) under the NVMe identity;
- server: a ClientHello callback reads the first identity of the pre_shared_key extension, asks the
  caller's lookup for the PSK and limits this connection's suites to the PSK's hash (so OpenSSL cannot pick
  a suite the PSK is not bound to); SSL_CTX_set_psk_find_session_callback then returns the session.

The session talks to memory BIOs only (BIO_s_mem): ciphertext goes in with ``receive`` and comes out of
``data_to_send``, plaintext the other way, so any transport (asyncio protocol, blocking socket) can carry it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from nvmeof.tls.psk import CIPHER_SUITES, HASH_LENGTHS, HMAC_SHA256, HMAC_SHA384

_CDEF = """
typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;
typedef struct ssl_method_st SSL_METHOD;
typedef struct ssl_session_st SSL_SESSION;
typedef struct ssl_cipher_st SSL_CIPHER;
typedef struct bio_st BIO;
typedef struct bio_method_st BIO_METHOD;
typedef struct evp_md_st EVP_MD;
typedef int (*SSL_psk_find_session_cb_func)(SSL *, const unsigned char *, size_t, SSL_SESSION **);
typedef int (*SSL_psk_use_session_cb_func)(SSL *, const EVP_MD *, const unsigned char **, size_t *,
                                           SSL_SESSION **);
typedef int (*SSL_client_hello_cb_fn)(SSL *, int *, void *);

const SSL_METHOD *TLS_method(void);
SSL_CTX *SSL_CTX_new(const SSL_METHOD *);
void SSL_CTX_free(SSL_CTX *);
long SSL_CTX_ctrl(SSL_CTX *, int, long, void *);
uint64_t SSL_CTX_set_options(SSL_CTX *, uint64_t);
int SSL_CTX_set_ciphersuites(SSL_CTX *, const char *);
int SSL_CTX_set_num_tickets(SSL_CTX *, size_t);
void SSL_CTX_set_psk_find_session_callback(SSL_CTX *, SSL_psk_find_session_cb_func);
void SSL_CTX_set_psk_use_session_callback(SSL_CTX *, SSL_psk_use_session_cb_func);
void SSL_CTX_set_client_hello_cb(SSL_CTX *, SSL_client_hello_cb_fn, void *);
int SSL_client_hello_get0_ext(SSL *, unsigned int, const unsigned char **, size_t *);

SSL *SSL_new(SSL_CTX *);
void SSL_free(SSL *);
int SSL_set_ex_data(SSL *, int, void *);
void *SSL_get_ex_data(const SSL *, int);
int SSL_set_ciphersuites(SSL *, const char *);
void SSL_set_connect_state(SSL *);
void SSL_set_accept_state(SSL *);
void SSL_set_bio(SSL *, BIO *, BIO *);
int SSL_do_handshake(SSL *);
int SSL_is_init_finished(const SSL *);
int SSL_read_ex(SSL *, void *, size_t, size_t *);
int SSL_write_ex(SSL *, const void *, size_t, size_t *);
int SSL_get_error(const SSL *, int);
int SSL_shutdown(SSL *);
const SSL_CIPHER *SSL_get_current_cipher(const SSL *);
const char *SSL_CIPHER_get_name(const SSL_CIPHER *);
const SSL_CIPHER *SSL_CIPHER_find(SSL *, const unsigned char *);
const EVP_MD *SSL_CIPHER_get_handshake_digest(const SSL_CIPHER *);
const char *EVP_MD_get0_name(const EVP_MD *);
const char *SSL_get_version(const SSL *);

SSL_SESSION *SSL_SESSION_new(void);
void SSL_SESSION_free(SSL_SESSION *);
int SSL_SESSION_set1_master_key(SSL_SESSION *, const unsigned char *, size_t);
int SSL_SESSION_set_cipher(SSL_SESSION *, const SSL_CIPHER *);
int SSL_SESSION_set_protocol_version(SSL_SESSION *, int);

const BIO_METHOD *BIO_s_mem(void);
BIO *BIO_new(const BIO_METHOD *);
int BIO_read(BIO *, void *, int);
int BIO_write(BIO *, const void *, int);
size_t BIO_ctrl_pending(BIO *);

unsigned long ERR_get_error(void);
void ERR_error_string_n(unsigned long, char *, size_t);
void ERR_clear_error(void);
"""

TLS1_3_VERSION = 0x0304
SSL_CTRL_SET_MIN_PROTO_VERSION = 123   # SSL_CTX_set_min_proto_version is a macro over SSL_CTX_ctrl
SSL_CTRL_SET_MAX_PROTO_VERSION = 124
SSL_OP_ALLOW_NO_DHE_KEX = 1 << 10
SSL_OP_NO_TICKET = 1 << 14
SSL_OP_CIPHER_SERVER_PREFERENCE = 1 << 22
# a SHA-384 PSK bound to SHA-256 (server: _client_hello; client: TlsSession(sha256_binder=True)): TP 8011's
# SHA-256 suite first, then the other SHA-256 suite tlshd 1.0.0 offers for such a key (its ClientHello for a
# 48-byte PSK has no TLS_AES_128_GCM_SHA256)
_SHA256_BINDER_SUITES = "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256"
SSL_ERROR_SSL = 1
SSL_ERROR_WANT_READ = 2
SSL_ERROR_WANT_WRITE = 3
SSL_ERROR_SYSCALL = 5
SSL_ERROR_ZERO_RETURN = 6
SSL_CLIENT_HELLO_SUCCESS = 1
SSL_CLIENT_HELLO_ERROR = 0
TLSEXT_TYPE_PSK = 41
SSL_AD_INTERNAL_ERROR = 80
SSL_AD_UNKNOWN_PSK_IDENTITY = 115
# the two-byte TLS 1.3 suite ids (RFC 8446 B.4) SSL_CIPHER_find takes
_SUITE_IDS = {HMAC_SHA256: b"\x13\x01", HMAC_SHA384: b"\x13\x02"}
READ_CHUNK = 256 * 1024
MAX_RECORD = 16384 + 256 + 64   # a TLS 1.3 record's plaintext limit plus its overhead, with room


class TlsError(Exception):
    """The TLS session failed (handshake refused, bad record, alert); the message says why."""


class TlsUnavailable(TlsError):
    """libssl.so.3 or cffi is missing."""


# Lookup a server makes per connection: the raw PSK identity -> (TLS PSK, cipher hash id), or None (unknown).
PskLookup = Callable[[bytes], "tuple[bytes, int] | None"]

_lib_lock = threading.Lock()
_binding: _Binding | None = None


class _Binding:
    def __init__(self) -> None:
        try:
            import cffi
        except ImportError as exc:     # pragma: no cover - cffi is a dependency
            raise TlsUnavailable("NVMe/TCP TLS needs the cffi package") from exc
        self.ffi = ffi = cffi.FFI()
        ffi.cdef(_CDEF)
        try:
            self.lib = ffi.dlopen("libssl.so.3")
        except OSError as exc:
            raise TlsUnavailable(f"NVMe/TCP TLS needs OpenSSL 3 (libssl.so.3): {exc}") from exc
        lib = self.lib
        # one C callback each for the whole process; they find their session through SSL ex_data slot 0
        self.find_cb = ffi.callback("SSL_psk_find_session_cb_func", _find_session, error=0)
        self.use_cb = ffi.callback("SSL_psk_use_session_cb_func", _use_session, error=0)
        self.hello_cb = ffi.callback("SSL_client_hello_cb_fn", _client_hello, error=SSL_CLIENT_HELLO_ERROR)
        self.method = lib.TLS_method()

    def errors(self) -> str:
        """Drain OpenSSL's error queue into one line."""
        lib, ffi = self.lib, self.ffi
        parts = []
        buf = ffi.new("char[]", 256)
        while True:
            code = lib.ERR_get_error()
            if not code:
                break
            lib.ERR_error_string_n(code, buf, 256)
            parts.append(ffi.string(buf).decode(errors="replace"))
        return "; ".join(parts)


def binding() -> _Binding:
    global _binding
    with _lib_lock:
        if _binding is None:
            _binding = _Binding()
        return _binding


def available() -> bool:
    try:
        binding()
    except TlsUnavailable:
        return False
    return True


def _session_of(ssl) -> TlsSession | None:
    b = binding()
    handle = b.lib.SSL_get_ex_data(ssl, 0)
    if handle == b.ffi.NULL:
        return None
    return b.ffi.from_handle(handle)


def _make_session(ssl, psk: bytes, cipher: int):
    """An SSL_SESSION carrying an external PSK: what OpenSSL's PSK callbacks hand over (ssl_sess.c)."""
    b = binding()
    lib, ffi = b.lib, b.ffi
    suite = lib.SSL_CIPHER_find(ssl, _SUITE_IDS[cipher])
    if suite == ffi.NULL:
        return ffi.NULL
    sess = lib.SSL_SESSION_new()
    if sess == ffi.NULL:
        return ffi.NULL
    if (lib.SSL_SESSION_set1_master_key(sess, psk, len(psk)) != 1 or lib.SSL_SESSION_set_cipher(sess, suite) != 1
            or lib.SSL_SESSION_set_protocol_version(sess, TLS1_3_VERSION) != 1):
        lib.SSL_SESSION_free(sess)
        return ffi.NULL
    return sess


def _first_psk_identity(ext: bytes) -> bytes | None:
    """The first identity of a ClientHello pre_shared_key extension (RFC 8446 4.2.11: OfferedPsks)."""
    if len(ext) < 4:
        return None
    total = int.from_bytes(ext[0:2], "big")
    n = int.from_bytes(ext[2:4], "big")
    if total < n + 6 or len(ext) < 4 + n:
        return None
    return bytes(ext[4:4 + n])


def _first_binder_length(ext: bytes) -> int | None:
    """The length of the first binder of a pre_shared_key extension (OfferedPsks: identities<7..2^16-1>, then
    binders<33..2^16-1> of PskBinderEntry<32..255>): the hash the client bound its PSK to (32: SHA-256)."""
    if len(ext) < 2:
        return None
    at = 2 + int.from_bytes(ext[0:2], "big")   # past the identities
    if len(ext) < at + 3:
        return None
    return ext[at + 2]


def _client_hello(ssl, al, arg) -> int:
    b = binding()
    lib, ffi = b.lib, b.ffi
    try:
        session = _session_of(ssl)
        if session is None or session._lookup is None:
            al[0] = SSL_AD_INTERNAL_ERROR
            return SSL_CLIENT_HELLO_ERROR
        out = ffi.new("const unsigned char **")
        outlen = ffi.new("size_t *")
        identity = binder = None
        if lib.SSL_client_hello_get0_ext(ssl, TLSEXT_TYPE_PSK, out, outlen) == 1:
            ext = bytes(ffi.buffer(out[0], outlen[0]))
            identity, binder = _first_psk_identity(ext), _first_binder_length(ext)
        if identity is None:
            session.failure = "the ClientHello offers no PSK identity (this target takes PSK-only TLS)"
            al[0] = SSL_AD_UNKNOWN_PSK_IDENTITY
            return SSL_CLIENT_HELLO_ERROR
        session.identity = identity
        found = session._lookup(identity)
        if found is None:
            session.failure = session.lookup_failure or "unknown PSK identity"
            al[0] = SSL_AD_UNKNOWN_PSK_IDENTITY
            return SSL_CLIENT_HELLO_ERROR
        session._psk, session._cipher = found
        if session._cipher == HMAC_SHA384 and binder == HASH_LENGTHS[HMAC_SHA256]:
            # a SHA-384 PSK under a SHA-256 binder: the client's library binds every external PSK to SHA-256
            # (GnuTLS before 3.8.11, gnutls_psk_allocate_client_credentials: so tlshd on Debian trixie, the Linux
            # host's handshake agent). TP 8011 wants TLS_AES_256_GCM_SHA384 for it, which that client cannot do;
            # take the PSK as it bound it, with the SHA-256 suite, rather than refuse every such host
            session._cipher = HMAC_SHA256
            session.sha256_binder = True
            lib.SSL_set_ciphersuites(ssl, _SHA256_BINDER_SUITES.encode())
            return SSL_CLIENT_HELLO_SUCCESS
        # only the suite of the PSK's hash: OpenSSL skips a PSK whose hash is not the chosen suite's
        lib.SSL_set_ciphersuites(ssl, CIPHER_SUITES[session._cipher].encode())
        return SSL_CLIENT_HELLO_SUCCESS
    except Exception as exc:
        al[0] = SSL_AD_INTERNAL_ERROR
        s = _session_of(ssl)
        if s is not None:
            s.failure = f"PSK lookup failed: {exc}"
        return SSL_CLIENT_HELLO_ERROR


def _find_session(ssl, identity, identity_len, sess) -> int:
    b = binding()
    try:
        session = _session_of(ssl)
        sess[0] = b.ffi.NULL
        if session is None or session._psk is None:
            return 1
        if bytes(b.ffi.buffer(identity, identity_len)) != session.identity:
            return 1                     # not the identity the lookup was for: no PSK for it
        sess[0] = _make_session(ssl, session._psk, session._cipher)
        return 1 if sess[0] != b.ffi.NULL else 0
    except Exception:
        return 0


def _use_session(ssl, md, out_id, out_idlen, sess) -> int:
    b = binding()
    lib, ffi = b.lib, b.ffi
    try:
        session = _session_of(ssl)
        sess[0] = ffi.NULL
        if session is None or session._psk is None:
            return 0
        if md != ffi.NULL:
            suite = lib.SSL_CIPHER_find(ssl, _SUITE_IDS[session._cipher])
            want = lib.SSL_CIPHER_get_handshake_digest(suite)
            if ffi.string(lib.EVP_MD_get0_name(md)) != ffi.string(lib.EVP_MD_get0_name(want)):
                return 1                 # a HelloRetryRequest picked another hash: offer no PSK
        s = _make_session(ssl, session._psk, session._cipher)
        if s == ffi.NULL:
            return 0
        session._id_buf = ffi.new("unsigned char[]", session.identity)
        out_id[0] = session._id_buf
        out_idlen[0] = len(session.identity)
        sess[0] = s
        return 1
    except Exception:
        return 0


class TlsContext:
    """An SSL_CTX for one role: TLS 1.3 only, TP 8011's suites, PSK callbacks, no certificates, no tickets."""

    def __init__(self, server: bool) -> None:
        b = binding()
        lib, ffi = b.lib, b.ffi
        self.server = server
        ctx = lib.SSL_CTX_new(b.method)
        if ctx == ffi.NULL:
            raise TlsError(f"SSL_CTX_new failed: {b.errors()}")
        self._ctx = ffi.gc(ctx, lib.SSL_CTX_free)
        lib.SSL_CTX_ctrl(ctx, SSL_CTRL_SET_MIN_PROTO_VERSION, TLS1_3_VERSION, ffi.NULL)
        lib.SSL_CTX_ctrl(ctx, SSL_CTRL_SET_MAX_PROTO_VERSION, TLS1_3_VERSION, ffi.NULL)
        if lib.SSL_CTX_set_ciphersuites(ctx, ":".join(CIPHER_SUITES.values()).encode()) != 1:
            raise TlsError(f"SSL_CTX_set_ciphersuites failed: {b.errors()}")
        lib.SSL_CTX_set_num_tickets(ctx, 0)     # no resumption: every connection proves the PSK again
        if server:
            # a host offering psk_ke only (no (EC)DHE) still connects; OpenSSL takes psk_dhe_ke when offered
            # server preference: the order of a suite list set per connection (_SHA256_BINDER_SUITES) decides
            lib.SSL_CTX_set_options(ctx, SSL_OP_ALLOW_NO_DHE_KEX | SSL_OP_NO_TICKET | SSL_OP_CIPHER_SERVER_PREFERENCE)
            lib.SSL_CTX_set_client_hello_cb(ctx, b.hello_cb, ffi.NULL)
            lib.SSL_CTX_set_psk_find_session_callback(ctx, b.find_cb)
        else:
            lib.SSL_CTX_set_options(ctx, SSL_OP_NO_TICKET)
            lib.SSL_CTX_set_psk_use_session_callback(ctx, b.use_cb)


_server_ctx: TlsContext | None = None
_client_ctx: TlsContext | None = None


def server_context() -> TlsContext:
    global _server_ctx
    if _server_ctx is None:
        _server_ctx = TlsContext(server=True)
    return _server_ctx


def client_context() -> TlsContext:
    global _client_ctx
    if _client_ctx is None:
        _client_ctx = TlsContext(server=False)
    return _client_ctx


class TlsSession:
    """One TLS connection, sans-IO.

    ``receive(ciphertext) -> plaintext`` (drives the handshake; raises TlsError on failure),
    ``send(plaintext)`` (encrypts; before the handshake completes it is buffered), ``data_to_send()``
    (the ciphertext to put on the wire, handshake messages included), ``handshake_done``.
    """

    def __init__(self, *, server: bool, lookup: PskLookup | None = None, identity: bytes | None = None,
                 psk: bytes | None = None, cipher: int | None = None, sha256_binder: bool = False) -> None:
        b = binding()
        self._b = b
        lib, ffi = b.lib, b.ffi
        self.server = server
        self._lookup = lookup
        self.identity: bytes | None = identity
        self._psk = psk
        self._cipher = cipher
        self.failure: str | None = None          # why the handshake failed, from our side
        self.lookup_failure: str | None = None   # set by a lookup that refuses an identity, for the log
        # a SHA-384 PSK bound to SHA-256 (GnuTLS < 3.8.11's binding): server, the client bound it so; client, asked to
        self.sha256_binder = False
        self.handshake_done = False
        self.closed = False
        self._pending: list[bytes] = []
        if not server and (identity is None or psk is None or cipher not in _SUITE_IDS):
            raise ValueError("a TLS client session needs an identity, a PSK and its hash")
        if server and sha256_binder:
            raise ValueError("sha256_binder is a client option (a server follows the binder the client sent)")
        suites = CIPHER_SUITES[cipher] if cipher in CIPHER_SUITES else ""
        if sha256_binder and cipher == HMAC_SHA384:
            # interop, off by default: a server on GnuTLS before 3.8.11 (tlshd 1.0.0 for Linux nvmet) binds every
            # external PSK to SHA-256 and takes a SHA-384 PSK only under a SHA-256 suite; TP 8011 wants
            # TLS_AES_256_GCM_SHA384, which that server refuses (GnuTLS -55). The suites _client_hello takes for it.
            self._cipher = HMAC_SHA256
            self.sha256_binder = True
            suites = _SHA256_BINDER_SUITES
        ctx = (server_context() if server else client_context())._ctx
        ssl = lib.SSL_new(ctx)
        if ssl == ffi.NULL:
            raise TlsError(f"SSL_new failed: {b.errors()}")
        self._ssl = ffi.gc(ssl, lib.SSL_free)
        self._handle = ffi.new_handle(self)
        lib.SSL_set_ex_data(ssl, 0, self._handle)
        self._rbio = lib.BIO_new(lib.BIO_s_mem())
        self._wbio = lib.BIO_new(lib.BIO_s_mem())
        lib.SSL_set_bio(ssl, self._rbio, self._wbio)     # the SSL owns both BIOs now
        if server:
            lib.SSL_set_accept_state(ssl)
        else:
            lib.SSL_set_ciphersuites(ssl, suites.encode())
            lib.SSL_set_connect_state(ssl)
        # reused buffers, not zeroed on allocation (every byte read out was written by OpenSSL first)
        self._alloc = ffi.new_allocator(should_clear_after_alloc=False)
        self._rbuf = None   # receive's plaintext buffer, made by its first call (read_into needs none)
        self._rsize = 0
        self._nbytes = ffi.new("size_t *")

    # -- handshake -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Client: produce the ClientHello (then read it with data_to_send)."""
        self._handshake()

    def _fail(self, what: str) -> TlsError:
        detail = self._b.errors()
        reason = self.failure or detail or what
        if self.failure and detail:
            reason = f"{self.failure} ({detail})"
        self.failure = reason
        return TlsError(reason)

    def _handshake(self) -> None:
        lib = self._b.lib
        lib.ERR_clear_error()
        rc = lib.SSL_do_handshake(self._ssl)
        if rc == 1:
            self.handshake_done = True
            pending, self._pending = self._pending, []
            for data in pending:
                self.send(data)
            return
        err = lib.SSL_get_error(self._ssl, rc)
        if err in (SSL_ERROR_WANT_READ, SSL_ERROR_WANT_WRITE):
            return
        raise self._fail(f"TLS handshake failed (SSL error {err})")

    # -- data ----------------------------------------------------------------------------------------------
    def receive(self, data: bytes | bytearray | memoryview) -> bytes | memoryview:
        """Feed ciphertext; returns the plaintext it completes (b"" while the handshake runs or mid-record).

        The plaintext is a view of this session's receive buffer, valid until the next ``receive`` (the
        contract of a socket receive buffer, which nvmeof.tcp's receive_data already follows)."""
        self.feed(data)
        if not self.handshake_done:
            return b""
        # every record that completed is decrypted back to back into one buffer (plaintext <= ciphertext)
        # (OpenSSL may also hold the start of a record it read before: up to one record more than the BIO has)
        need = self._b.lib.BIO_ctrl_pending(self._rbio) + MAX_RECORD
        if need > self._rsize:
            self._rsize = max(need, self._rsize * 2, READ_CHUNK)
            self._rbuf = self._alloc("unsigned char[]", self._rsize)
        got = 0
        while True:
            got += self._read(self._rbuf + got, self._rsize - got)
            if got < self._rsize:
                break
            # not expected (see above); grow rather than lose plaintext
            self._rsize *= 2
            buf = self._alloc("unsigned char[]", self._rsize)
            self._b.ffi.memmove(buf, self._rbuf, got)
            self._rbuf = buf
        return memoryview(self._b.ffi.buffer(self._rbuf, got)) if got else b""

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take ciphertext without reading plaintext out (``read_into`` does); drives the handshake."""
        b = self._b
        lib, ffi = b.lib, b.ffi
        if data:
            src = ffi.from_buffer(data)
            off, n = 0, len(data)
            while off < n:
                w = lib.BIO_write(self._rbio, src + off, n - off)
                if w <= 0:
                    raise TlsError("BIO_write failed")
                off += w
        if not self.handshake_done:
            self._handshake()

    def read_into(self, dest: bytearray | memoryview) -> int:
        """Decrypt what the records fed so far hold into ``dest`` (a writable byte buffer, e.g. a receive
        buffer the caller parses in place); returns the bytes written. Less than ``len(dest)``: nothing is
        left; exactly ``len(dest)``: more may be (OpenSSL keeps the rest of a record for the next call)."""
        if not self.handshake_done or not len(dest):
            return 0
        return self._read(self._b.ffi.from_buffer(dest, require_writable=True), len(dest))

    def _read(self, buf, size: int) -> int:   # type: ignore[no-untyped-def]
        """SSL_read_ex record after record into ``buf`` (cffi pointer) until ``size`` bytes or none left."""
        b = self._b
        lib = b.lib
        ssl, nbytes = self._ssl, self._nbytes
        got = 0
        while got < size:
            lib.ERR_clear_error()
            if lib.SSL_read_ex(ssl, buf + got, size - got, nbytes) == 1:
                got += nbytes[0]
                continue
            err = lib.SSL_get_error(ssl, 0)
            if err == SSL_ERROR_WANT_READ or err == SSL_ERROR_WANT_WRITE:
                break
            if err == SSL_ERROR_ZERO_RETURN:
                self.closed = True
                break
            raise self._fail(f"TLS read failed (SSL error {err})")
        return got

    def send(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt plaintext (kept until the handshake is done)."""
        if not data:
            return
        if not self.handshake_done:
            self._pending.append(bytes(data))
            return
        b = self._b
        lib, ffi = b.lib, b.ffi
        lib.ERR_clear_error()
        if lib.SSL_write_ex(self._ssl, ffi.from_buffer(data), len(data), self._nbytes) != 1:
            err = lib.SSL_get_error(self._ssl, 0)
            raise self._fail(f"TLS write failed (SSL error {err})")

    def data_to_send(self) -> bytes | memoryview:
        """The ciphertext produced so far (handshake, records, alerts): b"" or a view of a buffer of its own, which
        the caller may keep (a transport's backlog does). Read out of the BIO straight into that buffer, not
        allocated cleared: one copy of every record, not two."""
        b = self._b
        lib = b.lib
        n = lib.BIO_ctrl_pending(self._wbio)
        if not n:
            return b""
        buf = self._alloc("unsigned char[]", n)
        got = lib.BIO_read(self._wbio, buf, n)
        return memoryview(b.ffi.buffer(buf, max(got, 0)))

    def close_notify(self) -> None:
        """Queue a close_notify alert (best effort)."""
        if self.handshake_done and not self.closed:
            self._b.lib.SSL_shutdown(self._ssl)
            self._b.lib.ERR_clear_error()

    @property
    def cipher_name(self) -> str | None:
        b = self._b
        c = b.lib.SSL_get_current_cipher(self._ssl)
        if c == b.ffi.NULL:
            return None
        return b.ffi.string(b.lib.SSL_CIPHER_get_name(c)).decode()

    @property
    def version(self) -> str:
        return self._b.ffi.string(self._b.lib.SSL_get_version(self._ssl)).decode()


def looks_like_tls(first: bytes | bytearray | memoryview) -> bool:
    """A TLS handshake record starts with content type 22 (0x16); an NVMe/TCP ICReq with PDU type 0."""
    return len(first) > 0 and first[0] == 0x16
