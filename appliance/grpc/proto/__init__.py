"""The gRPC API's proto files and the code generated from them (appliance/grpc/codegen.py)."""
