# The two commands of the README: `make serve` and `make test`. Each sets itself up.
.PHONY: setup setup-test serve test lint proto bench

VENV := .venv/bin

setup:
	./scripts/bootstrap.sh

serve: setup
	$(VENV)/kvstore serve

test: setup
	TRITON_INTERPRET=1 $(VENV)/python -m pytest -q

lint:
	$(VENV)/ruff check kvstore tests bench

proto:
	$(VENV)/python -m grpc_tools.protoc -I kvstore/server --python_out=kvstore/server \
	    --grpc_python_out=kvstore/server --pyi_out=kvstore/server kvstore/server/kvstore.proto
	sed -i 's/^import kvstore_pb2/from kvstore.server import kvstore_pb2/' kvstore/server/kvstore_pb2_grpc.py
