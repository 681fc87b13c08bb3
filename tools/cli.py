"""The `omnifabric` command (placeholder until the services land)."""
def main() -> int:
    return 0
