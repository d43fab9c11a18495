"""Protobuf and gRPC stubs for the fmaas API, generated from proto/generation.proto by the build."""
