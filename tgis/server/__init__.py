"""The gRPC and HTTP faces of the service: servicer, health, reflection, metrics endpoint."""
