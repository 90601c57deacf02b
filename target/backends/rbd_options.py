"""The settings an RBD namespace takes, declared once: the registry (target/backends/__init__.py) registers the
kind with them before librbd's module is loaded, and the configuration file's check, the REST body
(api/schemas.py NamespaceCreate) and the service's check (``validate_spec``) all use these declarations;
rbd.py checks a name's bytes against the same NAME_MAX.
"""

from __future__ import annotations

from target.fields import Field

NAME_MAX = 255      # bytes; Ceph refuses longer pool names, and no RBD image or namespace needs more
PATH_MAX = 4096     # a Ceph configuration or keyring path, as Linux's PATH_MAX

OPTIONS: dict[str, Field] = {
    "pool": Field(str, min_length=1, max_length=NAME_MAX, description="RBD pool (backend 'rbd', required)"),
    "image": Field(str, min_length=1, max_length=NAME_MAX, description="RBD image (backend 'rbd', required)"),
    "rbd_namespace": Field(str, min_length=1, max_length=NAME_MAX, description="RADOS namespace of the image"),
    "ceph_conf": Field(str, min_length=1, max_length=PATH_MAX,
                       description="Ceph configuration file; one the daemon allows (--ceph-conf)"),
    "ceph_id": Field(str, min_length=1, max_length=NAME_MAX, description="Ceph client id (default admin)"),
    # a path the daemon allows, not the key: the keyring's contents are never read into the configuration
    "ceph_keyring": Field(str, min_length=1, max_length=PATH_MAX,
                          description="Ceph keyring; one the daemon allows (--ceph-keyring)"),
}
