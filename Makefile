# The two commands of the README: `make serve` and `make test`. Each sets itself up.
.PHONY: setup setup-test serve test lint proto bench

VENV := .venv/bin

setup:
	./scripts/bootstrap.sh

serve: setup
	$(VENV)/kvstore serve

test:
	./scripts/test.sh

lint:
	$(VENV)/ruff check kvstore tests bench

# The committed stubs must import on the oldest runtimes pyproject allows (protobuf>=5.26,
# grpcio>=1.65; checked by loading them there), so two guards of the newer generators go:
# protobuf's runtime_version check (that module only exists from 5.27 on) and the gRPC plugin's
# pin of grpcio to its own version, which is lowered to GRPC_STUB_FLOOR.
GRPC_STUB_FLOOR := 1.65.0

proto:
	$(VENV)/python -m grpc_tools.protoc -I kvstore/rpc --python_out=kvstore/rpc \
	    --grpc_python_out=kvstore/rpc --pyi_out=kvstore/rpc kvstore/rpc/kvstore.proto
	sed -i 's/^import kvstore_pb2/from kvstore.rpc import kvstore_pb2/' kvstore/rpc/kvstore_pb2_grpc.py
	sed -i -e '/^from google.protobuf import runtime_version/d' \
	    -e '/^_runtime_version.ValidateProtobufRuntimeVersion(/,/^)/d' kvstore/rpc/kvstore_pb2.py
	sed -i "s/^GRPC_GENERATED_VERSION = .*/GRPC_GENERATED_VERSION = '$(GRPC_STUB_FLOOR)'/" \
	    kvstore/rpc/kvstore_pb2_grpc.py
