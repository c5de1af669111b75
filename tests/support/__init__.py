"""What the tests share: stand-ins for servers, GPUs and the hub, and helpers (support/helpers.py)."""
