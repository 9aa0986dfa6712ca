"""What every service shares: domain errors, the gRPC server scaffold, config helpers."""
