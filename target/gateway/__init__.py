"""The gateway group: several `nvmeof serve` processes exporting the same subsystems, with ANA group
ownership decided by locks in a store they share (store.py: the interface; dirstore.py: a local
directory with flock; radosstore.py: a RADOS object with cls_lock leases and watch/notify) and the
member logic in group.py."""
