"""The wire layer: the .proto, its generated stubs and what both ends of a call agree on.

The server (``kvstore.server``) and the clients (``kvstore.client``) import this package; it
imports neither of them, nor the store or its tiers, only the shared value types
(``kvstore.api``, ``keys``, ``spec``, ``errors``).

- ``kvstore.proto``: the API; ``make proto`` regenerates ``kvstore_pb2.py``, ``kvstore_pb2.pyi``
  and ``kvstore_pb2_grpc.py`` from it (never edit those by hand).
- ``status.py``: the kvstore exception tree <-> gRPC statuses and the trailing metadata that
  names the exception class, both ways.
- ``convert.py``: value types <-> proto messages (tokens, keys, spec, namespace, lookup, block
  listings, stats, leases, reservations, health).
- ``tensors.py``: tensors on the wire: the declared header, its checks, zero-copy views and the
  chunking of streamed Put and Get.
- ``metadata.py``: call metadata beside the messages: the session a call is granted under.
- ``framing.py``: the data socket's wire: hello and ticket, raw Put/Get bytes, call channel
  frames (served by ``kvstore.server.data_socket``).
- ``descriptors.py``: the descriptor channel's request and reply lines (served by
  ``kvstore.server.descriptor_socket``).
"""
