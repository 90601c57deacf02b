"""The /api/v1 resource routers; each module exports ``router``."""
