"""What every service shares: domain errors, the gRPC server scaffold, tracing, TLS and address checks,
child processes, the health probe."""
