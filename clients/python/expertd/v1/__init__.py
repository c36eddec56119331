"""Generated stubs of expertd.v1 (scripts/gen-proto-python.sh writes them)."""
