"""NVMe-over-Fabrics protocol core: wire structures, status codes and sans-IO queue protocols."""

__version__ = "0.1.0"
