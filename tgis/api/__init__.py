"""Pure protobuf <-> value-object conversion and request validation; no gRPC server code."""
