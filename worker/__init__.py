"""omnifabric worker: one process per GPU running the duplex unit loop on an engine."""
