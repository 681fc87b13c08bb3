"""omnifabric scheduler: worker registry, one FIFO queue with ETA, and stream-bound leases."""
