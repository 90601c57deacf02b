"""Every default the product uses, in one place (target, initiator, CLI and API read these)."""

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
DEFAULT_SUBSYSTEM_NQN = "nqn.2026-11.io.nvmeof-toolkit:ramdisk0"

TCP_IO_PORT = 4420          # IANA NVMe-oF port
TCP_DISCOVERY_PORT = 8009   # NVME_TCP_DISC_PORT
PORT_MAX = 65535            # a trsvcid is an IP port, 1..PORT_MAX (NVMe/TCP, and RDMA through the RDMA CM)
API_PORT = 8080
LISTEN_ADDRESS = "127.0.0.1"

ADMIN_QUEUE_SIZE = 32       # NVME_AQ_DEPTH: the Linux host connects the admin queue with sqsize 31
MAX_QUEUE_SIZE = 128        # MQES + 1 advertised in CAP
MAX_IO_QUEUES = 64
ADMIN_INCAPSULE_SIZE = 8192  # NVME_TCP_ADMIN_CCSZ: fabrics/admin in-capsule data
IO_INCAPSULE_SIZE = 8192     # advertised through IOCCSZ = (64 + this) / 16; a listener's inline_data_size default
MAXH2CDATA = 128 * 1024      # ICResp maxdata: multiple of 4, >= 4096
MDTS = 8                     # 2**8 * 4 KiB = 1 MiB per command
PAGE_SIZE = 4096             # CAP.MPSMIN = 0
MAX_TRANSFER = (1 << MDTS) * PAGE_SIZE   # MDTS in bytes: the most data one command moves (CAP.MPSMIN is 4 KiB)
# A listener's inline_data_size (nvmet's port param_inline_data_size): IOCCSZ counts 16-byte units, and no
# command carries more than MDTS bytes, so a larger in-capsule size could never be used
INLINE_DATA_SIZE_UNIT = 16
INLINE_DATA_SIZE_MAX = MAX_TRANSFER
# NVMe/RDMA preallocates each receive's in-capsule buffer: nvmet-rdma's NVMET_RDMA_MAX_INLINE_DATA_SIZE
# (max(SZ_16K, PAGE_SIZE)) bounds it
RDMA_INLINE_DATA_SIZE_MAX = 16384
KAS_UNITS_MS = 100           # Identify KAS granularity
DEFAULT_KATO_MS = 5000       # NVME_DEFAULT_KATO = 5 s
KATO_GRACE = 1.0             # extra seconds before a silent host's controller is torn down (CTRATT TBKAS off)
CAP_TO_500MS = 15            # CAP.TO: 7.5 s to become ready
NVME_VERSION = (1, 3, 0)     # VS: CNS 0x03 is used by the host from 1.3 on

RAMDISK_DEFAULT_SIZE = 1 << 30
DEFAULT_BLOCK_SIZE = 512
MODEL = "nvmeof-toolkit"
FIRMWARE_REVISION = "0.1.0"
IEEE_OUI = b"\x00\x00\x00"
MAX_NAMESPACES = 1024
TCP_MAX_C2H_DATA = 16 * 1024 * 1024  # host side: largest C2HData payload one PDU may carry before TermReq
FILE_IO_THREADS = 4          # threads for blocking file-backend calls (preadv/pwritev/fdatasync/fallocate)
RDMA_IO_BUFFER_POOL = 4 << 20      # registered data buffer per NVMe/RDMA I/O queue (>= MDTS), reused by every command
RDMA_ADMIN_BUFFER_POOL = 1 << 20   # the same for admin queues: Identify, log pages, Connect data
RDMA_READ_DEPTH = 16               # RDMA READs one side keeps outstanding (CM initiator depth / responder resources)
RDMA_CM_TIMEOUT_MS = 3000          # NVME_RDMA_CM_TIMEOUT_MS: address and route resolution
TCP_DIRECT_PLACEMENT_MIN = 16 * 1024  # missing data PDU payload from which it is received straight into its buffer
TCP_CLOSE_GRACE = 2.0             # seconds a closing NVMe/TCP connection may wait for its peer to read before abort
TCP_H2C_BUDGET = 32 << 20         # R2T'd write bytes one NVMe/TCP connection may ask for at once (>= MDTS)

# -- management plane and port limits (hardening) ---------------------------------------------------
STATE_DIR_ROOT = "/var/lib/nvmeof"   # state directory when the daemon runs as root
STATE_DIR_USER = ".local/share/nvmeof"  # under $HOME otherwise ($XDG_DATA_HOME/nvmeof when set)
API_TOKEN_FILE = "api-token"          # in the state directory, mode 0600: the CLI reads it by itself
API_ENDPOINT_FILE = "api-endpoint"    # next to it: the API's URL (http://ADDR:PORT) or unix:PATH, for the CLI
API_MAX_BODY = 1 << 20                # bytes of one REST request body; larger gets 413
TLS_MODES = ("none", "optional", "required")   # a TCP listener's --tls (TP 8011 secure channel)
TLS_IDENTITY_VERSION = 1   # the PSK identity our initiator offers: NVMe1R (with digest; the kernel tries it first)
TCP_ICREQ_TIMEOUT = 5.0               # seconds a new NVMe/TCP connection may take to send ICReq
TCP_CONNECT_TIMEOUT = 10.0            # seconds after ICResp until the queue's Fabrics Connect
TCP_MAX_CONNECTIONS = 1024            # NVMe/TCP connections across all listeners
TCP_MAX_CONNECTIONS_PER_LISTENER = 512
TCP_H2C_GLOBAL_BUDGET = 256 << 20     # R2T'd write bytes all connections together may have outstanding
TCP_FD_RESERVE = 64                   # fds kept free below RLIMIT_NOFILE: API, backing files, listeners, workers
TCP_RECV_BUFFER_MIN = 16 * 1024       # receive buffer of an idle NVMe/TCP connection: ICReq, a capsule with 8 KiB
TCP_RECV_BUFFER_MAX = 256 * 1024      # what it grows to while reads keep filling it
TCP_LIMIT_LOG_INTERVAL = 1.0          # seconds: at most one log line per kind of refusal/timeout, the rest counted
BACKING_DIR = "disks"                 # in the state directory: where file namespaces live unless --backing-dir
RESERVATIONS_DIR = "reservations"   # <state dir>/reservations: namespaces' reservation states kept while PTPL is on
MAX_FILE_SIZE = (1 << 63) - 1         # off_t: the largest file length ftruncate(2) can be asked for


def state_dir(*, uid: int | None = None, environ: dict[str, str] | None = None) -> str:
    """The daemon's state directory: $NVMEOF_STATE_DIR, else /var/lib/nvmeof for root, else
    $XDG_DATA_HOME/nvmeof or ~/.local/share/nvmeof. Pure: computes the path, touches nothing."""
    import os

    env = os.environ if environ is None else environ
    if env.get("NVMEOF_STATE_DIR"):
        return env["NVMEOF_STATE_DIR"]
    if (os.geteuid() if uid is None else uid) == 0:
        return STATE_DIR_ROOT
    if env.get("XDG_DATA_HOME"):
        return os.path.join(env["XDG_DATA_HOME"], "nvmeof")
    return os.path.join(env.get("HOME") or os.path.expanduser("~"), STATE_DIR_USER)

# Ceph RBD namespaces (target/backends/rbd.py)
CEPH_CONF = "/etc/ceph/ceph.conf"     # what librados reads when the operator names no --ceph-conf
CEPH_CLIENT_ID = "admin"              # the cephx user (client.admin), as the rbd CLI assumes
RBD_OP_TIMEOUT = 10.0                 # seconds an OSD or monitor call may take before it fails with ETIMEDOUT;
                                      # below the Linux host's 30 s I/O timeout, so the host sees an error it
                                      # can retry instead of aborting and resetting the controller
RBD_CONNECT_TIMEOUT = 10.0            # seconds to reach the cluster when a namespace is opened
RBD_SIZE_POLL = 2.0                   # seconds between checks that the image was not resized behind our back
RBD_IDENTITY_KEY = "nvmeof.identity"  # image metadata key holding the namespace's NGUID/UUID/EUI-64 (JSON)
RBD_WAIT_MARGIN = 5.0                 # seconds past RBD_OP_TIMEOUT a command waits for librbd's answer before it
                                      # is answered "storage unreachable" anyway (librbd's retries, lock handover)
BACKEND_CLOSE_WAIT = 4.0              # seconds a stopping daemon or worker waits for its backends to close (librbd
                                      # closing images, shutting its clients down) before it exits without them;
                                      # below a worker's 5 s to exit (target/workers.py STOP_TIMEOUT)

# In-band authentication, DH-HMAC-CHAP (target/auth.py)
AUTH_TIMEOUT = 10.0                   # seconds a queue's transaction may stall between two steps before the
                                      # controller is torn down (nvmet_auth_expired_work waits KATO, else 120 s,
                                      # and only resets the step; a host that never finishes must not keep a
                                      # queue and a controller ID)
AUTH_MAX_TRANSFER = 64 * 1024         # largest Authentication Send TL / Receive AL accepted (the largest
                                      # message, a Reply with an ffdhe8192 value and SHA-512, is under 1.2 KiB)

# Dashboard and per-host metrics (api/routers/ui.py, target/model.py)
HOST_STATS_MAX = 1024                 # hosts per subsystem whose I/O counters are kept (oldest dropped past it)
UI_POLL_INTERVAL = 1.0                # seconds between the dashboard's reads of /ui/stats
UI_HISTORY = 300                      # seconds of samples the dashboard's charts keep (it draws the last 5 minutes)

# File backend data path (target/backends/file.py, issue 12)
FILE_BUFFER_SIZE = 128 * 1024         # bytes per pooled read buffer of a file namespace; longer reads get a one-off
FILE_BUFFERS = 64                     # pooled read buffers per file backend (per process), made on first use
FILE_INLINE_WRITE_MAX = 128 * 1024    # where pwritev2(RWF_NOWAIT) is unsupported (ext4, tmpfs, NFS, FUSE buffered
                                      # writes): page-aligned writes up to this size run on the event loop while
                                      # they stay fast (target/backends/inline.py); 0 sends them all to the thread
                                      # pool, as nvmet_file_execute_rw queues buffered writes on its workqueue
FILE_INLINE_SLOW_US = 1000            # an inline write taking longer moves the file's writes to the thread pool ...
FILE_INLINE_BACKOFF_MS = 100          # ... for this long, then one is tried inline again; a slow retry doubles it
FILE_INLINE_BACKOFF_MAX_MS = 5000     # ... up to this
FILE_INLINE_CPU_TIMED_WRITES = 256    # after a slow inline write that did not sleep, this many next ones are timed
                                      # on the thread's CPU clock (a system call each): one that ran on the CPU for
                                      # longer than FILE_INLINE_SLOW_US backs off too

# NVMe/TCP batch engine (target/transports/tcp_batch.py, issue 12)
POLL_US = 0                           # `--poll-us`: µs of non-blocking receives after a batch before sleeping in
                                      # the selector (hybrid polling, SPDK pollers / kernel busy-poll); 0 = off
TCP_POLL_SLICE_US = 1000              # longest one connection's polling may hold the event loop per wake-up
TCP_WRITE_HIGH_WATER = 256 * 1024     # unsent reply bytes of a connection before it stops reading commands
TCP_WRITE_LOW_WATER = 64 * 1024       # ... and reads again once its backlog has drained below this
TCP_BATCH_TIME_BUDGET_US = 500        # one received batch runs backend calls (file page-cache I/O) this long, then
                                      # the rest waits behind the loop's other callbacks (a loop stall bound)
TCP_LISTEN_BACKLOG = 100              # listen() backlog, as asyncio's create_server; also accepts per wake-up

# Asymmetric Namespace Access and the gateway group (target/admin.py, target/gateway/)
ANAGRPMAX = 128                       # ANA groups 1..ANAGRPMAX (nvmet NVMET_MAX_ANAGRPS); = Identify NANAGRPID
ANATT = 10                            # seconds a group may stay in ANA change state (Identify ANATT; host timer)
DEFAULT_ANAGRPID = 1                  # the ANA group of a namespace that names none (nvmet NVMET_DEFAULT_ANA_GRPID)
CNTLID_MIN = 1                        # controller IDs a target hands out: 1..0xFFEF (FFF0h..FFFFh are reserved)
CNTLID_MAX = 0xFFEF
CNTLID_SPAN = 2040                    # CNTLIDs per gateway of a group: member i gets [i*SPAN+1, (i+1)*SPAN]
GATEWAY_LEASE = 5.0                   # seconds an ANA group's ownership lock lives without renewal
GATEWAY_MAX = 16                      # members of one gateway group (stable indexes 0..GATEWAY_MAX-1)
GATEWAY_FENCE_MARGIN = 1.0            # seconds: an owner steps down this long (at least lease/5) before its lease ends
GATEWAY_DIR_POLL = 0.1                # seconds between a dir group store's checks for changes and dead members
GATEWAY_STORE_TIMEOUT = 3.0           # seconds one call to the group store may take before it counts as lost
GATEWAY_LEASE_MIN = 3.0               # seconds: a shorter lease leaves no time to renew (every lease/3) before fencing
GATEWAY_BLOCKLIST_EXPIRE = 3600       # seconds a dead gateway's Ceph clients stay on the OSD blocklist (fencing)

# NVMe/TCP batch engine bounds (target/transports/tcp_batch.py)
TCP_BATCH_REPLY_SLOTS = 4096          # CIDs of one queue with a cached reply slot (~3 MB); Linux hosts
                                      # use 16 generations x the queue depth of CIDs (nvme_cid), SPDK the depth
TCP_BATCH_WRITE_POOL = 1 << 20        # bytes of R2T write buffers one batch-engine queue keeps for its next writes
                                      # (no allocation, zeroing or page faults per write)
POLL_US_MAX = TCP_POLL_SLICE_US       # largest `--poll-us`: one wake-up polls at most TCP_POLL_SLICE_US anyway

# -- QoS (target/qos.py): per-namespace and per-host rate limits, as SPDK bdev_set_qos_limit --------
QOS_BURST_SECONDS = 0.02              # a bucket holds this much of its rate: the burst a limit lets through
QOS_CATCHUP_SECONDS = 0.25            # how late waiting commands may still be let go on time (a stalled loop)
QOS_RELEASE_SECONDS = 0.01            # a throttle lets waiting commands go at most this often, together (one
                                      # write for their replies); a waiting command may go this much late
QOS_TIMER_MIN_SECONDS = 0.001         # the shortest wait a throttle's timer is armed for (libuv's resolution)
QOS_IOS_MAX = 10_000_000              # rw_ios_per_second above this is refused as a typing error
QOS_MBYTES_MAX = 1_000_000            # *_mbytes_per_second above this (~1 TiB/s) likewise; 1 MB = 2**20 B (SPDK)
QOS_HOSTS_MAX = 1024                  # per-host limits on one namespace
