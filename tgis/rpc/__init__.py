"""The gRPC front door: the fmaas GenerationService servicer, its request parsing and proto conversion."""
