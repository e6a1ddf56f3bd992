"""Wire protocol v1. The `*_pb2*` modules here are generated from the `.proto`
files by the build (tools/protogen.py); never edit or commit them."""
